#pragma once
// The sim backend: a CPU-only model of an accelerator, so that every layer above `device` can be
// tested on machines without a GPU. It models what matters to those layers, not speed:
//  - device memory is an arena (one memfd) with a hard capacity: exceeding it is out_of_memory;
//  - a mapped device chunk is PROT_NONE for the CPU (touching it raises SIGSEGV, as on CUDA);
//    host chunks become CPU-accessible when the host is granted access;
//  - copy engines are tasks on the library's executor (as many at once as the device has engines)
//    that reach device memory through a private view of the
//    arena, and host memory through process_vm_readv/writev, so a bad host pointer is an EFAULT
//    error reported like a device error instead of a crash;
//  - copies are validated when enqueued: an unmapped or inaccessible address is bad_address.
#include <ferry/device/device.hpp>
#include <ferry/device/settings.hpp>
#include <ferry/mem/memory.hpp>

#include <memory>

namespace ferry::detail {
class executor;
}

namespace ferry::sim {

// Creates sim device `ordinal` from the settings' FERRY_SIM_* values.
std::unique_ptr<device> create_device(int ordinal, const device_settings& s, detail::executor& workers);

// The peer-memory client that recognises addresses in any live sim device's ranges.
std::unique_ptr<peer_memory_client> make_client();

}  // namespace ferry::sim
