#pragma once
// The file engine test servers move their data through, one for the whole test process (as the
// runtime's in `ferry serve`). Built from its parts rather than a ferry::runtime, so that it does
// not register ferry:// for the tests' own clients. CPU only: servers read and write host memory.
#include <ferry/io/file_engine.hpp>
#include <ferry/mem/registration.hpp>
#include <ferry/settings.hpp>
#include <ferry/store/server.hpp>

#include <chrono>
#include <memory>
#include <thread>

namespace ferry::test {

inline file_engine& server_io() {
  struct parts {
    settings s = settings::defaults();
    device_registry devices{s};
    std::unique_ptr<peer_memory_client> host = make_host_client(s.cuda_driver);
    registration_cache cache{{host.get()}, s.pin_limit};
    transfer_engine xfer{devices, cache, s};
    file_engine files{xfer, devices, cache, s};
  };
  static parts p;
  return p.files;
}

// A server started again on the port `o` names, as soon as the port is free again (it may take a
// moment); null when it never was within five seconds.
inline std::unique_ptr<store::server> restart_server(const store::server_options& o) {
  for (int i = 0; i < 50; ++i) {
    try {
      return std::make_unique<store::server>(server_io(), o);
    } catch (const error&) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  return nullptr;
}

}  // namespace ferry::test
