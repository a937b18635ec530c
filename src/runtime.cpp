#include <ferry/runtime.hpp>

#include <ferry/store/files.hpp>

#include "core/logging.hpp"
#include "device/sim/sim_device.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <mutex>

namespace ferry {

namespace {
// This process's id, as of the last fork: every call into a runtime checks that it runs in the
// process that made it, and getpid() is a system call each time (glibc keeps no copy), which a
// small copy's caller would pay on every call. A fork's child handler sets it anew.
std::atomic<long> this_pid{0};
long current_pid() {
  static std::once_flag once;
  std::call_once(once, [] {
    this_pid.store(::getpid(), std::memory_order_relaxed);
    ::pthread_atfork(nullptr, nullptr, [] { this_pid.store(::getpid(), std::memory_order_relaxed); });
  });
  return this_pid.load(std::memory_order_relaxed);
}

// FERRY_LOG=debug says what a process's first call paid to make each part (docs/design/python.md, cold start).
template <class F>
void timed(const char* what, F&& make) {
  const auto t0 = std::chrono::steady_clock::now();
  make();
  log::debug("runtime", "{} made in {} us", what,
             std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count());
}
}  // namespace

runtime::runtime() : runtime(settings::from_env()) {}

runtime::runtime(settings s) : pid_(current_pid()), config_((set_log_level(s.log), std::move(s))), devices_(config_) {
  // Connections are made on the first open; the client then classifies memory through this
  // runtime's cache and stages GPU/sim data through its engine.
  ferry_files_ = store::register_ferry_files([this] { return store::client_options_from(config(), &registrations(), &engine()); });
  http_files_ = store::register_http_files([this] { return store::http_options_from(config(), &registrations(), &engine()); });
}

// The engine first (its workers hold streams), then the cache (pools hold registrations), then devices.
runtime::~runtime() {
  if (pid_ != current_pid()) {  // a forked child's copy: its threads are not here to be ended
    new scheme_registration(std::move(ferry_files_));
    new store::http_registration(std::move(http_files_));
    (void)files_.release();
    (void)engine_.release();
    (void)cache_.release();
    for (auto& c : clients_) (void)c.release();
    devices_.abandon();
    return;
  }
  ferry_files_ = {};  // its clients use the engine and the cache
  http_files_ = {};
  files_.reset();
  engine_.reset();
  cache_.reset();
}

void runtime::check_process(const char* part) const {
  if (pid_ != current_pid())
    fail(errc::invalid_argument, "runtime", fmt::format("{} of the runtime of process {}", part, pid_),
         fmt::format("this process ({}) was forked from the one that made the runtime, and its threads did not come along; "
                     "make a runtime in this process",
                     ::getpid()));
}

registration_cache& runtime::registrations() {
  check_process("registrations");
  std::call_once(mem_once_, [&] { timed("registration cache", [&] {
    if (devices_.cuda_status().available)
      if (auto c = make_cuda_client(config().cuda_driver)) clients_.push_back(std::move(c));
    clients_.push_back(sim::make_client());
    clients_.push_back(make_host_client(config().cuda_driver));
    std::vector<peer_memory_client*> raw;
    for (auto& c : clients_) raw.push_back(c.get());
    cache_ = std::make_unique<registration_cache>(raw, config().pin_limit);
  }); });
  return *cache_;
}

transfer_engine& runtime::engine() {
  check_process("engine");
  std::call_once(engine_once_, [&] {
    registrations();
    timed("transfer engine", [&] { engine_ = std::make_unique<transfer_engine>(devices_, registrations(), config()); });
  });
  return *engine_;
}

file_engine& runtime::files() {
  check_process("files");
  std::call_once(files_once_, [&] {
    engine();
    timed("file engine", [&] { files_ = std::make_unique<file_engine>(engine(), devices_, registrations(), config()); });
  });
  return *files_;
}

const char* version() noexcept { return FERRY_VERSION; }

bool built_with_cuda() noexcept {
#ifdef FERRY_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace ferry
