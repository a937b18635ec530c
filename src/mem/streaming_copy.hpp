#pragma once
// A copy into memory the CPU will not read again -- a staging buffer a device reads by DMA: the
// destination's cache lines are written whole, around the caches (non-temporal stores), instead of
// being read first and left in the cache, where they would push out the bytes the copy reads and the
// ones the next copy reads (the source is usually still in the cache: just received, just read).
// Ordered before a later store of this thread (the signal that the buffer is ready) by a fence at
// the end. Elsewhere than x86-64 it is memcpy.
#include <cstddef>

namespace ferry {

void streaming_copy(void* dst, const void* src, std::size_t n) noexcept;

}  // namespace ferry
