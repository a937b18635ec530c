#pragma once
// Blocks of a unified address space for a caller that makes many small, short-lived allocations, one
// stream each (torch's tensors through its pluggable allocator, which bypasses torch's own caching):
// the space's alloc maps and zeroes whole pages (2 MiB) and free discards them, which a tensor per
// operation cannot afford, and a page per small tensor would fill the device with padding.
//
//  - Small requests (at most a quarter of a page, rounded down to a power of two) take a block of
//    their power-of-two class (512 B up) carved from a page of that class and stream; larger ones
//    take whole pages, rounded up.
//  - A freed block is kept for the next allocation of its class (or page count) on the stream it was
//    allocated on: the stream's order makes that reuse safe without events, another stream's would
//    not be. Reused memory is not zeroed (as cudaMalloc's is not); fresh pages are.
//  - Kept whole-page blocks are bounded (`keep`): past it the blocks freed longest ago go back to the
//    space. release() gives back every kept whole-page block and the pages of small blocks all of
//    whose blocks are free; an allocation the space cannot make releases and tries once more.
//  - Other streams: a block freed while the caller's other streams may still use it (torch's
//    record_stream does not reach a pluggable allocator) waits, before it is kept, for markers the
//    `fences` hook records on those streams at the free (none while there is one stream).
#include <ferry/core/export.hpp>
#include <ferry/device/event.hpp>
#include <ferry/vm/address_space.hpp>

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace ferry::vm {

struct block_pool_stats {
  std::uint64_t in_use = 0;       // bytes of blocks handed out (as rounded)
  std::uint64_t kept = 0;         // bytes of freed blocks kept for reuse (small ones' pages included)
  std::uint64_t fenced = 0;       // bytes of freed blocks waiting for other streams before they are kept
  std::uint64_t pages = 0;        // pages taken from the space
  std::uint64_t reused = 0;       // allocations served by a kept block
  std::uint64_t from_space = 0;   // allocations that took pages from the space
};

class FERRY_API block_pool {
 public:
  // Markers recorded now on every stream but `stream` that may still use a block freed on `stream`.
  using fence_fn = std::function<std::vector<std::unique_ptr<event>>(std::uintptr_t stream)>;
  // `keep`: bytes of freed whole-page blocks kept at most (0: a quarter of the space's device capacity).
  explicit block_pool(address_space& space, std::uint64_t keep = 0, fence_fn fences = {});
  ~block_pool();  // gives every page back to the space (blocks still handed out included)
  block_pool(const block_pool&) = delete;
  block_pool& operator=(const block_pool&) = delete;

  // A block of at least `bytes` (> 0) for work on `stream` (any value naming it; 0 is a stream too).
  // `reused`, when given: whether the block is a kept one (its bytes may be a former block's), not
  // fresh zeroed pages. Throws what the space's alloc throws when it cannot make the pages even
  // after release().
  void* alloc(std::uint64_t bytes, std::uintptr_t stream, bool* reused = nullptr);
  // A block alloc returned; kept for the next allocation like it on its stream. Throws
  // invalid_argument for a pointer this pool did not hand out (or handed back already).
  void free(void* p);
  // Kept blocks back to the space (see above); returns the bytes given back.
  std::uint64_t release();
  block_pool_stats stats() const;

  // The largest request served from shared pages: a quarter of a page, as a power of two.
  std::uint64_t small_max() const noexcept;

 private:
  struct slab {  // a page of small blocks of one class, for one stream
    std::uint64_t klass = 0;
    std::uintptr_t stream = 0;
    std::uint64_t used = 0;  // blocks handed out
  };
  struct live_block {
    std::uintptr_t stream = 0;
    std::uint64_t size = 0;       // small: the class; large: whole pages' bytes
    std::uintptr_t slab = 0;      // small: its page; 0: a large block
  };
  using key = std::pair<std::uintptr_t, std::uint64_t>;  // stream, class (below a page) or whole pages' bytes

  void* space_alloc(std::uint64_t bytes);  // releases kept blocks and retries once when the space is full
  void* alloc_locked(std::uint64_t size, bool small, std::uintptr_t stream, std::vector<std::uintptr_t>& spare, bool& reused);
  std::uint64_t release_locked();
  // A freed block into its kept list; whole-page blocks past `keep_` leave (their pages into `out`).
  void keep_locked(void* p, std::uintptr_t stream, std::uint64_t size, std::uintptr_t in_page, std::vector<std::uintptr_t>& out);
  void reap_locked(std::vector<std::uintptr_t>& out);  // fenced blocks whose markers all passed, kept
  void give_back(const std::vector<std::uintptr_t>& pages);  // to the space, a failure logged

  address_space& space_;
  const std::uint64_t page_;
  const std::uint64_t keep_;
  const fence_fn fences_;
  mutable std::mutex mu_;
  struct fenced_block {
    void* p;
    live_block b;
    std::vector<std::unique_ptr<event>> markers;
  };
  std::deque<fenced_block> fenced_;
  std::map<key, std::vector<void*>> kept_;       // freed blocks by stream and class / size
  std::deque<std::pair<void*, key>> kept_order_; // kept whole-page blocks, freed longest ago first
  std::uint64_t kept_large_ = 0;                 // their bytes
  std::map<std::uintptr_t, live_block> live_;    // handed out, by address
  std::map<std::uintptr_t, slab> slabs_;         // pages of small blocks, by address
  block_pool_stats st_;
};

}  // namespace ferry::vm
