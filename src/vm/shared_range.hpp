#pragma once
// A unified address space's shared range, page by page (vm layer, its own sources only): which
// chunk each page's addresses point at, and what the CPU may do there. The devices may always read
// and write a mapped page (a GPU cannot fault); the CPU is let in only when it touches the page (a
// fault) or a transfer pins it, since granting the CPU fills its page tables for the whole chunk.
// A page's calls run under its lock (the page table's); which page goes where is the space's.
#include <ferry/vm/page_table.hpp>

#include "vm/space_memory.hpp"

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace ferry::vm {

class shared_range {
 public:
  shared_range(space_memory& mem, space_clock& t);

  bool mapped(std::uint64_t p) const { return mapped_[p] != 0; }
  bool mapped_at(std::uint64_t p, location at) const { return mapped_[p] && at_[p] == at; }
  std::uint8_t cpu_access(std::uint64_t p) const { return cpu_[p].load(); }

  // Page p's addresses point at its chunk at `at` (for nobody yet: grant_devices, grant_cpu).
  // `writable`: a host mapping the CPU may write once it is granted.
  void map(std::uint64_t p, location at, bool writable);
  // The pages' addresses point at nothing.
  void unmap(std::vector<std::uint64_t> pages);
  // Every device of the space may read and write the pages.
  void grant_devices(std::vector<std::uint64_t> pages);
  // The CPU may read the pages mapped to their host chunks, and write those mapped writable; one
  // access change per run of pages alike.
  void grant_cpu(std::vector<std::uint64_t>& pages);
  // Page p is mapped to its host chunk and the CPU lacks some of the access its mapping allows.
  bool cpu_lacks(std::uint64_t p) const { return mapped_at(p, host) && cpu_[p].load() != (host_w_[p] ? 3 : 1); }

  // A page on the host stays where it is through a launch when it is not returned (held, no room,
  // earlier work still running, or no return at launch), and the kernel reaches it in place over the
  // bus. A CPU write then must not run beside the launched work: a GPU atomic there is not atomic
  // with the CPU's, and a CPU store could land in the middle of what a kernel reads. So a launch
  // takes the CPU's write access to such pages (read stays), and the CPU's next write faults and
  // waits for the work launched since, as a CPU fault on a device page waits.
  //
  // While launches are watched, the pages the CPU is let write are remembered until the next launch.
  void remember_writes(bool on) { remember_ = on; }
  // At a launch: the CPU keeps reading the host pages it was let write since the last launch, but
  // no longer writes them. Each page under its lock in `table`, so that no fault switches it
  // meanwhile; a page whose access cannot be changed stays writable (said in the log).
  void take_cpu_writes(page_table& table) noexcept;
  // Whether a launch took page p's write access since the CPU last wrote it (then the CPU's write
  // waits for the work launched since); forgotten as it is told.
  bool write_was_taken(std::uint64_t p) {
    if (!write_taken_[p] || !host_w_[p]) return false;
    write_taken_[p] = 0;
    return true;
  }

 private:
  // Calls f(first page, count) for each run of consecutive pages in `pages` (sorted here).
  template <typename F>
  static void runs(std::vector<std::uint64_t>& pages, F&& f);
  space_memory& mem_;
  space_clock& t_;
  std::vector<char> mapped_;    // per page: a chunk is mapped in the shared range
  std::vector<location> at_;    // per page: which
  std::vector<char> host_w_;    // per page: its host mapping may be written
  // Per page: what the CPU may do through the shared range (0, 1 read, 3 read+write).
  std::unique_ptr<std::atomic<std::uint8_t>[]> cpu_;
  std::vector<char> write_taken_;  // per page: its write access was taken by a launch
  std::atomic<bool> remember_{false};
  std::mutex writable_mu_;
  std::vector<std::uint64_t> cpu_writable_;  // writable_mu_: pages the CPU was let write since the last launch
};

}  // namespace ferry::vm
