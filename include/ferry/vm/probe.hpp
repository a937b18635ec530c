#pragma once
// Probe for the unified-memory layer's CPU fault path: can this process use userfaultfd, and with
// which features?
#include <ferry/core/capability.hpp>
#include <ferry/core/export.hpp>

namespace ferry {

FERRY_API capability probe_userfaultfd();

}  // namespace ferry
