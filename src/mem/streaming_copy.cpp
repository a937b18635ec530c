#include "mem/streaming_copy.hpp"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace ferry {

void streaming_copy(void* dst, const void* src, std::size_t n) noexcept {
#if defined(__x86_64__)
  // Small copies gain nothing: a few lines, and the fence's cost.
  if (n < 4096) {
    std::memcpy(dst, src, n);
    return;
  }
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  // The head up to the destination's next 64-byte line, then whole lines, then the tail.
  const std::size_t head = (64 - (reinterpret_cast<std::uintptr_t>(d) & 63)) & 63;
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
  for (; n >= 64; d += 64, s += 64, n -= 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
  }
  std::memcpy(d, s, n);
  _mm_sfence();
#else
  std::memcpy(dst, src, n);
#endif
}

}  // namespace ferry
