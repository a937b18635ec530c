// ferry._ferry: the C++ side of the Python package. It takes raw pointers and sizes; the Python
// layer (python/ferry/) turns tensors, arrays and buffers into them and keeps those objects alive
// while ferry uses their memory. Blocking calls release the GIL.
#include <ferry/core/checksum.hpp>
#include <ferry/core/error.hpp>
#include <ferry/core/units.hpp>
#include <ferry/device/mapped_memory.hpp>
#include <ferry/runtime.hpp>
#include <ferry/store/files.hpp>
#include <ferry/vm/address_space.hpp>
#include <ferry/core/log.hpp>
#include <ferry/vm/block_pool.hpp>
#include <ferry/core/interrupt.hpp>

#include <dlpack/dlpack.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <sys/mman.h>

#include <cerrno>
#include <chrono>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

namespace py = pybind11;
using namespace ferry;

namespace {

PyObject* g_error = nullptr;  // ferry.Error

// A ferry error as the pending Python exception ferry.Error: the message as ferry wrote it, and
// its parts as attributes.
void set_error(const error& e) {
  py::object exc = py::reinterpret_borrow<py::object>(g_error)(e.what());
  exc.attr("code") = std::string(to_string(e.code()));
  exc.attr("op") = e.info().op;
  exc.attr("resource") = e.info().resource;
  exc.attr("errno") = e.sys_errno();
  exc.attr("backend_code") = e.backend_code();
  PyErr_SetObject(g_error, exc.ptr());
}

// A Python `timeout=` (seconds): how long a transfer may go without moving a byte before it fails
// (transfer_options::idle); None: FERRY_DEADLINE.
std::optional<std::chrono::nanoseconds> idle_of(std::optional<double> timeout) {
  if (!timeout) return std::nullopt;
  if (!(*timeout >= 0)) fail(errc::invalid_argument, "python", "timeout", "must be >= 0 seconds");
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(*timeout));
}

void* as_ptr(std::uintptr_t p) { return reinterpret_cast<void*>(p); }

struct py_runtime;

unsigned long g_main_thread = 0;  // the interpreter's main thread (PyThread_get_thread_ident), set at import

// A file open through a runtime (local path or ferry://).
struct py_file {
  std::shared_ptr<file> f;
  std::string path() const { return f->path(); }
  std::uint64_t size() const {
    py::gil_scoped_release nogil;  // a remote file's size is a request
    return f->size();
  }
  void sync() {
    py::gil_scoped_release nogil;
    f->sync();
  }
};

// Waits for `b` until `until` (none: until it is over), without the GIL, a tenth of a second at a
// time: in between, the interpreter's signal handlers run (Ctrl-C's KeyboardInterrupt). When one
// raises, the batch is cancelled -- remote requests under way end as well -- and waited for, so
// nothing touches the buffers any more, and the exception goes to the caller. True: the batch is over.
bool wait_interruptibly(transfer_batch& b, std::optional<std::chrono::steady_clock::time_point> until = std::nullopt) {
  using clk = std::chrono::steady_clock;
  for (;;) {
    const auto slice = clk::now() + std::chrono::milliseconds(100);
    {
      py::gil_scoped_release nogil;
      if (b.wait(until ? std::min(*until, slice) : slice) || b.poll()) return true;
    }
    if (until && clk::now() >= *until) return false;
    if (PyErr_CheckSignals() != 0) {
      {
        py::gil_scoped_release nogil;
        b.cancel();
        b.wait();
      }
      throw py::error_already_set();
    }
  }
}

struct py_batch {
  transfer_batch b;
  std::unique_ptr<stream> view;  // the user's stream, for a stream-ordered batch
  bool closed = false;
  pid_t owner = ::getpid();
  // The handle's end waits for work still running: not with the GIL held. In a process forked from
  // the one that made it, the work and the threads that run it stayed behind: nothing to wait for,
  // and the handle's end would wait forever -- it is left as it is.
  ~py_batch() { end(); }
  void end() {
    if (::getpid() != owner) {
      new transfer_batch(std::move(b));  // never ended, on purpose
      (void)view.release();
      return;
    }
    py::gil_scoped_release nogil;
    b = transfer_batch{};
    view.reset();
  }
  void open_or_fail() const {
    if (::getpid() != owner)
      fail(errc::invalid_argument, "ferry.Batch", "batch of process " + std::to_string(owner),
           "this process was forked from the one that made the batch, whose work stayed there");
    if (closed) fail(errc::invalid_argument, "ferry.Batch", "batch", "closed: its results went with it");
  }
  // A bounded look with `timeout`; without one, until the batch is over or its deadline passes.
  bool wait(std::optional<double> timeout) {
    open_or_fail();
    std::optional<std::chrono::steady_clock::time_point> until;
    if (timeout && !(*timeout >= 0)) fail(errc::invalid_argument, "ferry.Batch.wait", "timeout", "must be >= 0 seconds");
    if (timeout && *timeout < 1e9)  // longer (inf included): until the batch is over, as without one
      until = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(*timeout));
    if (!wait_interruptibly(b, until)) return false;
    py::gil_scoped_release nogil;
    return b.wait();  // over: at once
  }
  py::list results() const {
    open_or_fail();
    py::list out;
    for (auto& r : b.results()) {
      py::dict d;
      d["state"] = std::string(to_string(r.state));
      d["bytes_done"] = r.bytes_done;
      d["error"] = r.err ? py::object(py::str(r.err->what())) : py::object(py::none());
      d["code"] = r.err ? py::object(py::str(std::string(to_string(r.err->code())))) : py::object(py::none());
      out.append(d);
    }
    return out;
  }
};

// Memory ferry maps on a device (sim or CUDA) for the caller: its address and size; freed with it.
struct py_device_buffer {
  mapped_memory m;
  std::uintptr_t ptr() const { return reinterpret_cast<std::uintptr_t>(m.data()); }
  std::uint64_t nbytes() const { return m.size(); }
  std::string device() const { return m.owner() ? m.owner()->id() : ""; }
  bool cuda() const { return m.owner() && m.owner()->info().backend == device_kind::cuda; }
};

// DLPack export (https://dmlc.github.io/dlpack, the array API's __dlpack__ protocol) of memory an
// object owns, as bytes: the capsule's tensor holds a reference to the object, so the memory lives
// as long as whichever consumer (torch.from_dlpack, numpy.from_dlpack, CuPy) keeps the tensor. The
// unversioned capsule ("dltensor") is what every consumer accepts; no stream work is pending on
// ferry's buffers (their fills are synchronous or waited for), so the consumer's stream needs no wait.
struct dlpack_export {
  DLManagedTensor t{};
  std::int64_t shape[1] = {0};
  PyObject* owner = nullptr;
};

bool python_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

void dlpack_delete(DLManagedTensor* t) {
  auto* e = static_cast<dlpack_export*>(t->manager_ctx);
  // A consumer may let go from any thread, with or without the GIL. While Python shuts down a
  // thread must not take the GIL (it would be stopped there): the buffer is left to the process's end.
  if (Py_IsInitialized() && !python_finalizing()) {
    PyGILState_STATE g = PyGILState_Ensure();
    Py_XDECREF(e->owner);
    PyGILState_Release(g);
  }
  delete e;
}

DLDevice dlpack_device_of(py::handle self) {
  if (py::isinstance<py_device_buffer>(self)) {
    auto& b = self.cast<py_device_buffer&>();
    if (!b.cuda()) throw py::buffer_error(b.device() + " memory is not addressable by the CPU or CUDA: it cannot be exported");
    return {kDLCUDA, b.m.owner()->info().ordinal};
  }
  return {kDLCPU, 0};  // pinned host memory: CPU memory to every consumer (torch 1.13 takes no kDLCUDAHost)
}

py::object to_dlpack(py::handle self, std::uintptr_t ptr, std::uint64_t n, const py::object& stream, const py::object& max_version,
                     const py::object& dl_device, const py::object& copy) {
  (void)stream;
  (void)max_version;  // a consumer asking for a versioned capsule accepts the unversioned one too
  const DLDevice dev = dlpack_device_of(self);
  if (!copy.is_none() && copy.cast<bool>())
    throw py::buffer_error("ferry memory is exported without a copy (copy=True asks for one)");
  if (!dl_device.is_none()) {
    auto want = dl_device.cast<std::pair<int, int>>();
    if (want.first != dev.device_type || want.second != dev.device_id)
      throw py::buffer_error("ferry memory is on DLPack device (" + std::to_string(static_cast<int>(dev.device_type)) + ", " +
                             std::to_string(dev.device_id) + "), not (" + std::to_string(want.first) + ", " + std::to_string(want.second) + ")");
  }
  auto* e = new dlpack_export;
  e->shape[0] = static_cast<std::int64_t>(n);
  e->t.dl_tensor.data = as_ptr(ptr);
  e->t.dl_tensor.device = dev;
  e->t.dl_tensor.ndim = 1;
  e->t.dl_tensor.dtype = {kDLUInt, 8, 1};
  e->t.dl_tensor.shape = e->shape;
  e->t.dl_tensor.strides = nullptr;
  e->t.dl_tensor.byte_offset = 0;
  e->t.manager_ctx = e;
  e->t.deleter = dlpack_delete;
  e->owner = self.inc_ref().ptr();
  // A capsule never consumed (still named "dltensor") lets go of the tensor itself; a consumer
  // renames it ("used_dltensor") and calls the deleter when done.
  PyObject* cap = PyCapsule_New(&e->t, "dltensor", [](PyObject* c) {
    if (!PyCapsule_IsValid(c, "dltensor")) return;  // consumed ("used_dltensor"): the consumer deletes
    PyObject *type, *value, *trace;  // a destructor may run while an exception is set: kept as it is
    PyErr_Fetch(&type, &value, &trace);
    auto* t = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(c, "dltensor"));
    t->deleter(t);
    PyErr_Restore(type, value, trace);
  });
  if (!cap) {
    dlpack_delete(&e->t);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(cap);
}

// Host memory ferry pins (page-locked, registered with CUDA when there is a driver): copies to and
// from GPUs go straight from it. Freed with the object.
struct py_host_buffer {
  void* p = nullptr;
  std::uint64_t n = 0;
  std::optional<registration> pin;
  py_host_buffer(runtime& rt, std::uint64_t bytes) : n(bytes) {
    if (bytes == 0) fail(errc::invalid_argument, "ferry.empty", "pinned", "zero bytes");
    p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) fail_errno(errno, "ferry.empty", "pinned", "mmap of " + std::to_string(bytes) + " bytes");
    try {
      pin.emplace(rt.registrations().acquire(p, bytes));
    } catch (...) {
      ::munmap(p, bytes);
      throw;
    }
  }
  ~py_host_buffer() {
    pin.reset();
    ::munmap(p, n);
  }
  std::uintptr_t ptr() const { return reinterpret_cast<std::uintptr_t>(p); }
};

// The address and size of an object with the buffer protocol (bytes, bytearray, memoryview, numpy
// arrays), which must be C-contiguous (and writable when ferry writes into it). Valid while the
// object lives and is not resized.
py::tuple buffer_address(py::object obj, bool writable) {
  Py_buffer view;
  int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(obj.ptr(), &view, flags) != 0) throw py::error_already_set();
  auto out = py::make_tuple(reinterpret_cast<std::uintptr_t>(view.buf), static_cast<std::uint64_t>(view.len));
  PyBuffer_Release(&view);
  return out;
}

struct py_runtime {
  std::unique_ptr<runtime> rt;
  pid_t owner = ::getpid();
  explicit py_runtime(const std::optional<std::map<std::string, std::string>>& overrides) {
    settings s = settings::from_env();
    if (overrides)
      for (auto& [k, v] : *overrides) s.set(k, v, "ferry.Runtime(settings=...)");
    rt = std::make_unique<runtime>(s);
  }
  // A runtime's threads do not come along into a process forked from its own (a data loader's
  // workers): there it refuses work with an error that says what to use instead (ferry.runtime()
  // makes one per process); its end there leaves it as it is (ferry::runtime's own rule).
  runtime& live() const {
    if (::getpid() != owner)
      fail(errc::invalid_argument, "ferry.Runtime", "runtime of process " + std::to_string(owner),
           "this process (" + std::to_string(::getpid()) +
               ") was forked from the one that made it, and its threads did not come along; ferry.runtime() makes one for this process");
    return *rt;
  }
  std::shared_ptr<py_file> open(const std::string& path, const std::string& mode) {
    open_mode m = mode == "r"   ? open_mode::read
                  : mode == "r+" ? open_mode::read_write
                  : mode == "w"  ? open_mode::create
                                 : (fail(errc::invalid_argument, "ferry.open", path,
                                         "mode must be 'r' (read), 'r+' (read and write) or 'w' (create or truncate), not '" + mode + "'"),
                                    open_mode::read);
    live();
    // Opening a URL waits on the network (a HEAD, a stat): Ctrl-C ends that wait, as it ends a read's.
    // Only on the main thread, the one Python runs signal handlers on (elsewhere the check would only
    // take the GIL).
    bool signalled = false;
    std::shared_ptr<file> f;
    std::exception_ptr failed;
    const bool main_thread = PyThread_get_thread_ident() == g_main_thread;
    {
      py::gil_scoped_release nogil;
      std::optional<interrupt_scope> scope;
      if (main_thread)
        scope.emplace([&signalled] {
          py::gil_scoped_acquire g;
          return signalled = signalled || PyErr_CheckSignals() != 0;
        });
      try {
        f = file::open(path, m);
      } catch (...) {
        failed = std::current_exception();
      }
    }
    if (signalled && PyErr_Occurred()) throw py::error_already_set();  // the KeyboardInterrupt
    if (failed) std::rethrow_exception(failed);
    return std::make_shared<py_file>(py_file{std::move(f)});
  }
  // A batch of reads (or of writes) as columns, request i being (files[i], offsets[i], ptrs[i],
  // sizes[i]): lists of ints convert without a Python object per request (an object per request costs
  // microseconds to make and convert, as much as the C++ submit of it).
  std::unique_ptr<py_batch> submit(const std::vector<std::shared_ptr<py_file>>& files, const std::vector<std::uint64_t>& offsets,
                                   const std::vector<std::uintptr_t>& ptrs, const std::vector<std::uint64_t>& sizes, bool write,
                                   std::optional<std::uintptr_t> stream_handle, const std::string& device,
                                   std::optional<double> timeout) {
    const std::size_t n = files.size();
    if (offsets.size() != n || ptrs.size() != n || sizes.size() != n)
      fail(errc::invalid_argument, "ferry.submit", "requests",
           std::to_string(n) + " files, " + std::to_string(offsets.size()) + " offsets, " + std::to_string(ptrs.size()) +
               " pointers, " + std::to_string(sizes.size()) + " sizes: one of each per request");
    std::vector<file_request> fr;
    fr.reserve(n);
    for (std::size_t i = 0; i < n; ++i) {
      if (!files[i] || !files[i]->f) fail(errc::invalid_argument, "ferry.submit", "request " + std::to_string(i), "no file (closed?)");
      fr.push_back({files[i]->f, offsets[i], as_ptr(ptrs[i]), sizes[i], write});
    }
    auto out = std::make_unique<py_batch>();
    transfer_options o;
    o.idle = idle_of(timeout);
    if (stream_handle) {
      out->view = live().devices().get(device).wrap_stream(native_stream{*stream_handle});
      o.on = out->view.get();
    }
    py::gil_scoped_release nogil;
    out->b = live().files().submit(fr, o);
    return out;
  }
  // One request, waited for as a batch is (Ctrl-C ends it): a remote file may keep it for long.
  std::uint64_t transfer(py_file& f, std::uint64_t offset, std::uintptr_t ptr, std::uint64_t bytes, bool write,
                         std::optional<double> timeout) {
    transfer_options o;
    o.idle = idle_of(timeout);
    file_request r{f.f, offset, as_ptr(ptr), bytes, write};
    transfer_batch b;
    // The batch ends without the GIL however this returns (its end waits for work still running).
    struct ender {
      transfer_batch& b;
      ~ender() {
        py::gil_scoped_release nogil;
        b = transfer_batch{};
      }
    } end_it{b};
    runtime& here = live();
    {
      py::gil_scoped_release nogil;
      b = here.files().submit({&r, 1}, o);
    }
    wait_interruptibly(b);
    py::gil_scoped_release nogil;
    b.wait();
    b.check();
    return b.results()[0].bytes_done;
  }
  std::uint64_t read(py_file& f, std::uint64_t offset, std::uintptr_t ptr, std::uint64_t bytes, std::optional<double> timeout) {
    return transfer(f, offset, ptr, bytes, false, timeout);
  }
  void write(py_file& f, std::uint64_t offset, std::uintptr_t ptr, std::uint64_t bytes, bool sync, std::optional<double> timeout) {
    transfer(f, offset, ptr, bytes, true, timeout);
    if (!sync) return;
    py::gil_scoped_release nogil;
    f.f->sync();
  }
  void copy(std::uintptr_t dst, std::uintptr_t src, std::uint64_t bytes, std::optional<double> timeout) {
    transfer_options o;
    o.idle = idle_of(timeout);
    py::gil_scoped_release nogil;
    live().engine().copy(as_ptr(dst), as_ptr(src), bytes, o);
  }
  py::list settings_rows() const {
    py::list out;
    for (auto& r : rt->config().describe()) out.append(py::make_tuple(r.name, r.value, r.default_value, r.doc));
    return out;
  }
  std::vector<std::string> devices() {
    std::vector<std::string> ids;
    for (device* d : rt->devices().all()) ids.push_back(d->id());
    return ids;
  }
  std::unique_ptr<py_host_buffer> alloc_pinned(std::uint64_t bytes) {
    py::gil_scoped_release nogil;
    return std::make_unique<py_host_buffer>(live(), bytes);
  }
  std::unique_ptr<py_device_buffer> alloc(const std::string& dev, std::uint64_t bytes) {
    device& d = live().devices().get(dev);
    py::gil_scoped_release nogil;
    return std::make_unique<py_device_buffer>(py_device_buffer{allocate_mapped(d, bytes)});
  }
  // ferry's checksum of memory anywhere: on the CPU for host memory, by a kernel on the device.
  std::uint64_t checksum(std::uintptr_t ptr, std::uint64_t bytes) {
    memory_region m = live().registrations().classify(as_ptr(ptr), bytes);
    if (m.type == memory_type::unknown)
      fail(errc::bad_address, "ferry.checksum", describe_range(as_ptr(ptr), bytes), "not memory ferry knows");
    py::gil_scoped_release nogil;
    if (m.device == device_kind::none) return checksum64(as_ptr(ptr), bytes);
    auto s = live().devices().get(m.device, m.ordinal).create_stream();
    std::uint64_t out = 0;
    s->checksum(as_ptr(ptr), bytes, &out);
    s->synchronize();
    return out;
  }
  std::string classify(std::uintptr_t ptr, std::uint64_t bytes) {
    memory_region m = live().registrations().classify(as_ptr(ptr), bytes);
    if (m.type == memory_type::unknown) return "unknown";
    if (m.device == device_kind::none) return std::string(to_string(m.type));
    return m.device_id();
  }
};

// ---- torch's CUDA allocator on a unified address space (ferry.torch.use_unified_memory) ----
// One space per process on one device, as large as its memory plus the host's; tensors past the
// cap live in host memory and kernels reach them there. Made once and never destroyed: torch frees
// tensors until the very end of the process, after any static destructor of ours would have run.
struct unified_heap {
  runtime rt;  // its own, never destroyed: torch's last frees come after Python's teardown of ferry.runtime()
  device& dev;
  vm::address_space space;
  // torch's pluggable allocator asks for every tensor and gives every one back (torch's own caching
  // is bypassed): blocks are kept per stream for reuse, small ones share pages.
  vm::block_pool pool;
  std::mutex mu;
  std::vector<std::pair<std::uintptr_t, std::unique_ptr<stream>>> attached;  // streams torch allocated on
  std::string last_error;
  static std::uint64_t size_for(device& d) {
    std::uint64_t host = static_cast<std::uint64_t>(::sysconf(_SC_PHYS_PAGES)) * static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
    std::uint64_t g = d.granularity();
    return (d.memory().total + host + g - 1) / g * g;
  }
  static vm::space_options options(runtime& rt, std::uint64_t capacity) {
    auto o = vm::space_options::from(rt.config());
    if (capacity) o.device_capacity = capacity;
    return o;
  }
  unified_heap(const settings& s, const std::string& d, std::uint64_t capacity)
      : rt(s), dev(rt.devices().get(d)), space(dev, size_for(dev), options(rt, capacity)), pool(space, s.vm_keep, [this](std::uintptr_t on) {
          return fences(on);
        }) {}
  // Markers on every stream torch allocated on but `on`: a tensor freed on its stream may still be in
  // use on them (torch's record_stream does not reach a pluggable allocator). A stream capturing a
  // graph is left alone (what it enqueues does not run).
  std::vector<std::unique_ptr<event>> fences(std::uintptr_t on) {
    std::vector<std::unique_ptr<event>> out;
    std::lock_guard l(mu);
    if (attached.size() < 2) return out;
    for (auto& [h, v] : attached) {
      if (h == on) continue;
      try {
        if (!v->capturing()) out.push_back(v->record());
        else log_message(log_level::debug, "torch", "no marker on a stream torch allocated on: it is capturing a graph (or could not say)");
      } catch (const std::exception& e) {
        // A stream that takes no marker (destroyed by its owner) runs no more work: nothing to wait for.
        log_message(log_level::debug, "torch", std::string("no marker on a stream torch allocated on: ") + e.what());
      }
    }
    return out;
  }
  // A stream torch allocates on may run kernels on the memory: page moves wait for its work.
  void attach(std::uintptr_t handle) {
    std::lock_guard l(mu);
    for (auto& [h, v] : attached)
      if (h == handle) return;
    auto v = dev.wrap_stream(native_stream{handle ? handle : native_stream::legacy().handle});
    space.attach_stream(*v);
    attached.emplace_back(handle, std::move(v));
  }
};
std::atomic<unified_heap*> g_unified{nullptr};
std::mutex g_unified_mu;

}  // namespace

// The functions torch's CUDAPluggableAllocator loads from this module's file (their names are the
// ones ferry/torch.py gives it). A failure returns null (torch raises its out-of-memory error) and
// keeps ferry's message for ferry.torch to report.
extern "C" __attribute__((visibility("default"))) void* ferry_torch_malloc(ssize_t size, int, void* stream) {
  unified_heap* h = g_unified.load();
  if (!h || size <= 0) return nullptr;
  try {
    h->attach(reinterpret_cast<std::uintptr_t>(stream));
    return h->pool.alloc(static_cast<std::uint64_t>(size), reinterpret_cast<std::uintptr_t>(stream));
  } catch (const std::exception& e) {
    std::lock_guard l(h->mu);
    h->last_error = e.what();
    return nullptr;
  }
}
extern "C" __attribute__((visibility("default"))) void ferry_torch_free(void* p, ssize_t, int, void*) {
  unified_heap* h = g_unified.load();
  if (!h || !p) return;
  try {
    h->pool.free(p);
  } catch (const std::exception& e) {
    std::lock_guard l(h->mu);
    h->last_error = e.what();
  }
}

PYBIND11_MODULE(_ferry, m) {
  m.doc() = "ferry's C++ runtime (use the `ferry` package, not this module)";
  g_main_thread = py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();
  static py::exception<error> exc(m, "Error");
  g_error = exc.ptr();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const error& e) {
      set_error(e);
    }
  });
  m.def("version", [] { return std::string(ferry::version()); });
  // Durations as the settings table parses them ("30s", "1min", "250ms"),
  // so that Python and C++ read FERRY_* values and arguments alike (a bare number is milliseconds there).
  m.def("parse_duration", [](const std::string& text) {
    return std::chrono::duration<double>(parse_duration(text, "duration")).count();
  }, py::arg("text"));
  m.def("built_with_cuda", &ferry::built_with_cuda);

  m.def("buffer_address", &buffer_address, py::arg("obj"), py::arg("writable"));
  // Exported as bytes the way CUDA arrays and host arrays are (torch.as_tensor, cupy.asarray,
  // numpy.asarray take them without a copy); sim memory is not addressable by the CPU and is not exported.
  py::class_<py_device_buffer>(m, "DeviceBuffer")
      .def_property_readonly("ptr", &py_device_buffer::ptr)
      .def_property_readonly("nbytes", &py_device_buffer::nbytes)
      .def_property_readonly("device", &py_device_buffer::device)
      .def("__dlpack__", [](py::object self, py::object stream, py::object max_version, py::object dl_device, py::object copy) {
        auto& b = self.cast<py_device_buffer&>();
        return to_dlpack(self, b.ptr(), b.nbytes(), stream, max_version, dl_device, copy);
      }, py::kw_only(), py::arg("stream") = py::none(), py::arg("max_version") = py::none(), py::arg("dl_device") = py::none(),
         py::arg("copy") = py::none())
      .def("__dlpack_device__", [](py::object self) {
        DLDevice d = dlpack_device_of(self);
        return py::make_tuple(static_cast<int>(d.device_type), d.device_id);
      })
      .def_property_readonly("__cuda_array_interface__", [](py_device_buffer& b) {
        if (!b.cuda())
          throw py::attribute_error(b.device() + " memory is not CUDA memory: it has no __cuda_array_interface__");
        py::dict d;
        d["shape"] = py::make_tuple(b.nbytes());
        d["typestr"] = "|u1";
        d["data"] = py::make_tuple(b.ptr(), false);
        d["strides"] = py::none();
        d["version"] = 3;
        return d;
      });
  py::class_<py_host_buffer>(m, "PinnedBuffer")
      .def_property_readonly("ptr", &py_host_buffer::ptr)
      .def_property_readonly("nbytes", [](py_host_buffer& b) { return b.n; })
      .def_property_readonly("device", [](py_host_buffer&) { return std::string("cpu"); })
      .def("__dlpack__", [](py::object self, py::object stream, py::object max_version, py::object dl_device, py::object copy) {
        auto& b = self.cast<py_host_buffer&>();
        return to_dlpack(self, b.ptr(), b.n, stream, max_version, dl_device, copy);
      }, py::kw_only(), py::arg("stream") = py::none(), py::arg("max_version") = py::none(), py::arg("dl_device") = py::none(),
         py::arg("copy") = py::none())
      .def("__dlpack_device__", [](py::object) { return py::make_tuple(static_cast<int>(kDLCPU), 0); })
      .def_property_readonly("__array_interface__", [](py_host_buffer& b) {
        py::dict d;
        d["shape"] = py::make_tuple(b.n);
        d["typestr"] = "|u1";
        d["data"] = py::make_tuple(b.ptr(), false);
        d["strides"] = py::none();
        d["version"] = 3;
        return d;
      });

  py::class_<py_file, std::shared_ptr<py_file>>(m, "File")
      .def_property_readonly("path", &py_file::path)
      .def_property_readonly("size", &py_file::size)
      .def("sync", &py_file::sync);

  py::class_<py_batch>(m, "Batch")
      .def("wait", &py_batch::wait, py::arg("timeout") = py::none())
      .def("poll", [](py_batch& b) { return b.open_or_fail(), b.b.poll(); })
      .def("cancel", [](py_batch& b) { b.open_or_fail(), b.b.cancel(); })
      .def("check", [](py_batch& b) { b.open_or_fail(), b.b.check(); })
      .def("results", &py_batch::results)
      .def_property_readonly("bytes_done", [](py_batch& b) { return b.open_or_fail(), b.b.bytes_done(); })
      .def_property_readonly("bytes_total", [](py_batch& b) { return b.open_or_fail(), b.b.bytes_total(); })
      .def("close", [](py_batch& b) {  // waits for what runs (the handle's destructor would)
        if (b.closed) return;
        b.closed = true;
        b.end();
      });

  py::class_<py_runtime>(m, "Runtime")
      .def(py::init<const std::optional<std::map<std::string, std::string>>&>(), py::arg("settings") = py::none())
      .def("open", &py_runtime::open, py::arg("path"), py::arg("mode") = "r")
      .def("submit", &py_runtime::submit, py::arg("files"), py::arg("offsets"), py::arg("ptrs"), py::arg("sizes"),
           py::arg("write"), py::arg("stream") = py::none(), py::arg("device") = "", py::arg("timeout") = py::none())
      .def("read", &py_runtime::read, py::arg("file"), py::arg("offset"), py::arg("ptr"), py::arg("nbytes"),
           py::arg("timeout") = py::none())
      .def("write", &py_runtime::write, py::arg("file"), py::arg("offset"), py::arg("ptr"), py::arg("nbytes"),
           py::arg("sync") = false, py::arg("timeout") = py::none())
      .def("copy", &py_runtime::copy, py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("timeout") = py::none())
      .def("settings", &py_runtime::settings_rows)
      .def("devices", &py_runtime::devices)
      // A buffer keeps its runtime (its pin lives in the runtime's registration cache): exported
      // arrays may outlive every other reference to both.
      .def("alloc", &py_runtime::alloc, py::arg("device"), py::arg("nbytes"), py::keep_alive<0, 1>())
      .def("alloc_pinned", &py_runtime::alloc_pinned, py::arg("nbytes"), py::keep_alive<0, 1>())
      .def("checksum", &py_runtime::checksum, py::arg("ptr"), py::arg("nbytes"))
      .def("classify", &py_runtime::classify, py::arg("ptr"), py::arg("nbytes"))
      .def("unified_setup", [](py_runtime& r, const std::string& dev, std::uint64_t capacity) {
        std::lock_guard l(g_unified_mu);
        if (g_unified.load()) fail(errc::busy, "ferry.torch", dev, "unified memory is set up already (once per process)");
        py::gil_scoped_release nogil;
        g_unified.store(new unified_heap(r.live().config(), dev, capacity));
      }, py::arg("device"), py::arg("capacity"));
  m.def("unified_prefetch", [](std::uintptr_t ptr, std::uint64_t bytes, bool to_device) {
    unified_heap* h = g_unified.load();
    if (!h) fail(errc::invalid_argument, "ferry.torch.prefetch", describe_range(as_ptr(ptr), bytes), "use_unified_memory was not called");
    py::gil_scoped_release nogil;
    h->space.advise(as_ptr(ptr), bytes, vm::advice::prefetch, to_device ? memory_kind::device : memory_kind::host);
  }, py::arg("ptr"), py::arg("nbytes"), py::arg("to_device"));
  m.def("unified_release", []() -> std::uint64_t {
    unified_heap* h = g_unified.load();
    if (!h) return 0;
    py::gil_scoped_release nogil;
    return h->pool.release();
  });
  m.def("unified_info", []() {
        unified_heap* h = g_unified.load();
        py::dict out;
        if (!h) return out;
        auto st = h->space.stats();
        out["device"] = h->dev.id();
        out["capacity"] = h->space.device_capacity();
        out["resident_bytes"] = h->space.resident(h->dev) * h->space.page_bytes();
        out["migrations_h2d"] = st.migrations_h2d;
        out["migrations_d2h"] = st.migrations_d2h;
        out["evictions"] = st.evictions;
        auto ps = h->pool.stats();
        out["allocated_bytes"] = ps.in_use;
        out["kept_bytes"] = ps.kept;
        out["fenced_bytes"] = ps.fenced;
        std::lock_guard l(h->mu);
        out["last_error"] = h->last_error;
        return out;
  });
}
