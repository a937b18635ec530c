// io's settings table: a row per field of io_settings (ferry/io/settings.hpp).
#include <ferry/io/settings.hpp>

#include "core/settings_table.hpp"

#include <algorithm>
#include <thread>

namespace ferry {

namespace {

constexpr std::pair<std::string_view, file_backend_kind> file_backends[] = {
    {"auto", file_backend_kind::automatic}, {"io_uring", file_backend_kind::io_uring}, {"cufile", file_backend_kind::cufile}};
constexpr std::pair<std::string_view, direct_io> direct_ios[] = {
    {"auto", direct_io::automatic}, {"always", direct_io::always}, {"never", direct_io::never}};

// clang-format off
constexpr setting_row<io_settings> rows[] = {
  {"FERRY_CUFILE_LIBRARY", "cuFile (GPUDirect Storage) library loaded at run time (optional).",
   [](io_settings& s, std::string_view v) { s.cufile_library = nonempty(v); },
   [](const io_settings& s) { return s.cufile_library; }},
  {"FERRY_FILE_BACKEND", "File backend: auto (cuFile where the nvidia-fs driver is loaded and handle registration and a probe read work, else io_uring; a file system that refused registration once is not tried again) | io_uring | cufile.",
   [](io_settings& s, std::string_view v) { s.file_backend = parse_enum(v, file_backends); },
   [](const io_settings& s) { return std::string(to_string(s.file_backend)); }},
  {"FERRY_IO_DIRECT", "O_DIRECT for file reads: auto (unless the range is in the page cache; a small read asks the page cache first) | always | never.",
   [](io_settings& s, std::string_view v) { s.io_direct = parse_enum(v, direct_ios); },
   [](const io_settings& s) { return std::string(to_string(s.io_direct)); }},
  {"FERRY_IO_THREADS", "Most file engine rings, each an io_uring whose loop runs as a task on the library's executor while it has work (and a second after), 0..64; 0 = three quarters of the hardware threads, 2..16. They are made as the work asks for them: two at first, then one more for every FERRY_IO_DEPTH requests waiting or running and for every 32 MiB asked of them since the process began. A request goes to the ring with the least work, so requests that come together (a server's clients, the pieces of a ferry:// read) run in parallel.",
   [](io_settings& s, std::string_view v) { s.io_threads = static_cast<int>(parse_int(v, 0, 64)); },
   [](const io_settings& s) { return std::to_string(s.io_threads); }},
  {"FERRY_IO_DEPTH", "File reads/writes in flight per file engine ring (its queue depth), shared by the requests it runs at once: each issues into a free slot in turn; staged ones take a buffer of the staging pool per I/O, those free at the time, 1..256.",
   [](io_settings& s, std::string_view v) { s.io_depth = static_cast<int>(parse_int(v, 1, 256)); },
   [](const io_settings& s) { return std::to_string(s.io_depth); }},
  {"FERRY_IO_CHUNK", "Size of each file read/write, a multiple of 4 KiB (at most FERRY_STAGING_BYTES, the buffer it lands in).",
   [](io_settings& s, std::string_view v) {
     s.io_chunk = parse_size_in(v, 64 * KiB, 1 * GiB);
     if (s.io_chunk % (4 * KiB)) throw bad_setting{"must be a multiple of 4KiB"};
   },
   [](const io_settings& s) { return format_size(s.io_chunk); }},
  {"FERRY_IO_MAPPED", "Reads into GPU memory of ranges the page cache holds: when set, the GPU's copy engine reads the file's pages where they are (mapped, pinned read-only for the copy, two pieces of this size at a time per file engine thread) instead of through the staging pool. A process's first loads then make no staging buffers (faster by about the making of the pool); large warm loads are slower than staged ones (docs/design/python.md). 0 (the default) = staged. A multiple of 4 KiB.",
   [](io_settings& s, std::string_view v) {
     s.io_mapped = v == "0" ? 0 : parse_size_in(v, 64 * KiB, 1 * GiB);
     if (s.io_mapped % (4 * KiB)) throw bad_setting{"must be 0 or a multiple of 4KiB"};
   },
   [](const io_settings& s) { return s.io_mapped ? format_size(s.io_mapped) : std::string("0"); }},
  {"FERRY_STREAM_SLOTS", "Staging buffers (FERRY_STAGING_BYTES each) one stream-ordered file read or write uses at once: the file side fills one while the stream copies another, 1..64.",
   [](io_settings& s, std::string_view v) { s.stream_slots = static_cast<int>(parse_int(v, 1, 64)); },
   [](const io_settings& s) { return std::to_string(s.stream_slots); }},
  {"FERRY_IO_INLINE", "Buffered file reads/writes of at most this size are copied by the file engine thread as it submits them (when the pages are cached); larger ones go to the kernel's io_uring workers so their copies run in parallel. Also the smallest piece a page-cache read into host memory is cut into for several file engine threads (FERRY_IO_CHUNK when this is below 64KiB). 0 = never inline.",
   [](io_settings& s, std::string_view v) { s.io_inline = parse_size_in(v, 0, 1 * GiB); },
   [](const io_settings& s) { return format_size(s.io_inline); }},
  {"FERRY_IO_INJECT", "Test only: inject faults into file I/O completions: partial, eintr, or partial,eintr. Empty: off.",
   [](io_settings& s, std::string_view v) {
     if (!v.empty() && v != "partial" && v != "eintr" && v != "partial,eintr" && v != "eintr,partial")
       throw bad_setting{"expected partial, eintr, partial,eintr or empty"};
     s.io_inject = std::string(v);
   },
   [](const io_settings& s) { return s.io_inject; }},
};
// clang-format on

}  // namespace

std::span<const setting_row<io_settings>> io_settings::table() { return rows; }

std::string_view to_string(file_backend_kind v) noexcept { return enum_name(v, file_backends); }
std::string_view to_string(direct_io v) noexcept { return enum_name(v, direct_ios); }

int default_io_threads() noexcept {
  // A buffered read that hits the page cache is a copy by the CPU, made on an io thread or by its
  // ring's io-wq worker, which runs a burst of such copies one after another (it adds a worker only
  // when one sleeps): copies run in parallel across threads only. Three quarters of the cores: the
  // threads that feed the engine (a server's progress threads, a GPU proxy's, the caller's own)
  // keep the rest. Between 2 and 16.
  unsigned n = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp(n * 3 / 4, 2u, 16u));
}

}  // namespace ferry
