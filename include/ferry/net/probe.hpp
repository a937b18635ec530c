#pragma once
// Probe of the UCX library the net layer uses: version, transports (component/md/tl/device) and the
// memory types UCP can handle directly (host only in Debian's build; cuda where UCX has CUDA support).
#include <ferry/core/capability.hpp>
#include <ferry/core/export.hpp>

namespace ferry {

FERRY_API capability probe_ucx();

}  // namespace ferry
