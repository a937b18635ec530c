// vm's settings table: a row per field of vm_settings (ferry/vm/settings.hpp).
#include <ferry/vm/settings.hpp>

#include "core/settings_table.hpp"

namespace ferry {

namespace {

constexpr std::pair<std::string_view, page_replacement> replacements[] = {{"lru", page_replacement::lru}, {"fifo", page_replacement::fifo}};

// clang-format off
constexpr setting_row<vm_settings> rows[] = {
  {"FERRY_VM_CAPACITY", "Device memory one unified address space may use for its pages; beyond it pages are evicted to host memory. 0 = what the device has free when the space is made, minus FERRY_VM_RESERVE.",
   [](vm_settings& s, std::string_view v) { s.vm_capacity = parse_size_in(v, 0, 1ull << 50); },
   [](const vm_settings& s) { return format_size(s.vm_capacity); }},
  {"FERRY_VM_RESERVE", "Device memory a unified address space leaves free when FERRY_VM_CAPACITY is 0 (for kernels, streams and other allocations); at most a quarter of the free memory.",
   [](vm_settings& s, std::string_view v) { s.vm_reserve = parse_size_in(v, 0, 1ull << 50); },
   [](const vm_settings& s) { return format_size(s.vm_reserve); }},
  {"FERRY_VM_KEEP", "Bytes of freed whole-page blocks a block pool keeps for reuse (torch's tensors on unified memory: the memory of freed tensors, kept for the next ones on the same stream); past it the blocks freed longest ago go back to the address space. 0 = a quarter of the space's device capacity.",
   [](vm_settings& s, std::string_view v) { s.vm_keep = parse_size_in(v, 0, 1ull << 50); },
   [](const vm_settings& s) { return format_size(s.vm_keep); }},
  {"FERRY_VM_PAGE", "Page size of a unified address space: the unit that migrates, rounded up to the device granularity (2 MiB with CUDA). One CUDA VMM call costs about the same for 2 MiB as for 32 MiB, so larger pages remap faster; 0 = the device granularity.",
   [](vm_settings& s, std::string_view v) { s.vm_page = parse_size_in(v, 0, 1ull << 30); },
   [](const vm_settings& s) { return format_size(s.vm_page); }},
  {"FERRY_VM_POLICY", "Which device page a unified address space evicts first: lru (least recently used) | fifo (first arrived).",
   [](vm_settings& s, std::string_view v) { s.vm_policy = parse_enum(v, replacements); },
   [](const vm_settings& s) { return std::string(to_string(s.vm_policy)); }},
  {"FERRY_VM_BATCH", "Most pages (of FERRY_VM_PAGE) one batched migration moves: their remaps are grouped and their copies queued together, and the next batch is remapped while one copies. A range moves in at least 8 batches when it has the pages (copies overlap remaps); a batch takes at most a quarter of the device capacity.",
   [](vm_settings& s, std::string_view v) { s.vm_batch = static_cast<int>(parse_int(v, 1, 1024)); },
   [](const vm_settings& s) { return std::to_string(s.vm_batch); }},
  {"FERRY_VM_FAULT_AHEAD", "Pages a CPU fault on device-resident memory moves to host: the faulting page, then -- after the faulting thread runs on -- the device-resident pages after it, inside its allocation (1 = the faulting page only), in batches; the CPU may use them without another fault. While faults come in sequence (each inside the last window) the window doubles, up to 8 times this.",
   [](vm_settings& s, std::string_view v) { s.vm_fault_ahead = static_cast<int>(parse_int(v, 1, 1024)); },
   [](const vm_settings& s) { return std::to_string(s.vm_fault_ahead); }},
  {"FERRY_VM_THRASH_LAPSE", "A unified-memory page evicted from the device and prefetched back within this time is thrashing (the device cannot hold the working set, e.g. a stream over more than FERRY_VM_CAPACITY): PREFETCH then leaves it on the host for FERRY_VM_THRASH_HOLD and the device reads it in place over PCIe, instead of evicting another page that is wanted back as soon. Pages whose PREFERRED_LOCATION is the device are always moved. 0 = off: every PREFETCH migrates.",
   [](vm_settings& s, std::string_view v) { s.vm_thrash_lapse = parse_duration_in(v, std::chrono::nanoseconds::zero(), std::chrono::hours(1)); },
   [](const vm_settings& s) { return format_duration(s.vm_thrash_lapse); }},
  {"FERRY_VM_THRASH_HOLD", "How long a thrashing unified-memory page (FERRY_VM_THRASH_LAPSE) stays on the host before PREFETCH migrates it again.",
   [](vm_settings& s, std::string_view v) { s.vm_thrash_hold = parse_duration_in(v, std::chrono::nanoseconds::zero(), std::chrono::hours(1)); },
   [](const vm_settings& s) { return format_duration(s.vm_thrash_hold); }},
  {"FERRY_VM_RETURN_AT_LAUNCH", "Pages of a unified address space that CPU faults took from a device go back to it (their PREFERRED_LOCATION, else the device they came from) before the next kernel launch on that device, so that kernels read them from device memory (needs launch callbacks: CUPTI with CUDA). Only with room on the device (never by eviction), once the work of earlier launches, copies and memsets on any stream has finished (waited for up to FERRY_VM_RETURN_QUIET, else the pages wait for a later launch); pages the CPU keeps taking back stay on the host (FERRY_VM_RETURN_HOLD). 0 = off.",
   [](vm_settings& s, std::string_view v) { s.vm_return_at_launch = parse_bool(v); },
   [](const vm_settings& s) { return std::string(s.vm_return_at_launch ? "1" : "0"); }},
  {"FERRY_VM_RETURN_QUIET", "Pages the CPU took from a device (FERRY_VM_RETURN_AT_LAUNCH) also go back in the background once this long has passed since the CPU took them, the space's attached streams are idle and no launched work still runs on any stream (needs launch callbacks, like the return at launch); also how long a launch waits for earlier work before it returns pages. 0 = only at launches.",
   [](vm_settings& s, std::string_view v) { s.vm_return_quiet = parse_duration_in(v, std::chrono::nanoseconds::zero(), std::chrono::hours(1)); },
   [](const vm_settings& s) { return format_duration(s.vm_return_quiet); }},
  {"FERRY_VM_PREFETCH_WAIT", "How long a prefetch (cudaMemPrefetchAsync under ferry run, advise PREFETCH) waits for the work queued on the space's attached streams before it returns and leaves the move to the space's service thread, which makes it once those streams are idle (a kernel may wait for the CPU to act after the call). While such a prefetch waits, later ones join it at once, in order.",
   [](vm_settings& s, std::string_view v) { s.vm_prefetch_wait = parse_duration_in(v, std::chrono::nanoseconds::zero(), std::chrono::hours(1)); },
   [](const vm_settings& s) { return format_duration(s.vm_prefetch_wait); }},
  {"FERRY_VM_RETURN_HOLD", "A page the CPU takes again within this time of its return to the device is one the CPU keeps using: it stays on the host this long, twice as long each further time (at most 64 times). Also how long the background return leaves the pages moved ahead of the last CPU fault (the CPU is on its way to them).",
   [](vm_settings& s, std::string_view v) { s.vm_return_hold = parse_duration_in(v, std::chrono::nanoseconds::zero(), std::chrono::hours(1)); },
   [](const vm_settings& s) { return format_duration(s.vm_return_hold); }},
  {"FERRY_VM_REPORT", "1: each unified address space prints to stderr, when it ends (for a program on ferry's managed memory, at its exit), where its time went: CPU faults and the time serving them, migrations each way with their bytes, evictions, prefetches and returns, and the time in new chunks, remaps, waits for the program's streams and for copies, the largest named with what usually helps. 0 = off.",
   [](vm_settings& s, std::string_view v) { s.vm_report = parse_bool(v); },
   [](const vm_settings& s) { return std::string(s.vm_report ? "1" : "0"); }},
};
// clang-format on

}  // namespace

std::span<const setting_row<vm_settings>> vm_settings::table() { return rows; }

std::string_view to_string(page_replacement v) noexcept { return enum_name(v, replacements); }

}  // namespace ferry
