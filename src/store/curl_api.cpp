#include "store/curl_api.hpp"

#include <ferry/core/error.hpp>

#include <dlfcn.h>

#include <mutex>
#include <string>

namespace ferry::store::curl {

namespace {

api open(const std::string& library) {
  void* h = ::dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* why = ::dlerror();
    fail(errc::unavailable, "http.init", library, std::string("cannot load libcurl (http://, https:// and s3:// need it): ") + (why ? why : "dlopen failed"));
  }
  api a;
  std::string missing;
#define FERRY_CURL_RESOLVE(name)                                                        \
  a.name = reinterpret_cast<decltype(a.name)>(::dlsym(h, "curl_" #name));             \
  if (!a.name) missing += (missing.empty() ? "curl_" : ", curl_") + std::string(#name);
  FERRY_CURL_FUNCTIONS(FERRY_CURL_RESOLVE)
#undef FERRY_CURL_RESOLVE
  // The handle stays open: the process keeps using the library until it ends.
  if (!missing.empty()) fail(errc::unavailable, "http.init", library, "libcurl lacks " + missing + " (too old?)");
  const CURLcode rc = a.global_init(CURL_GLOBAL_DEFAULT);
  if (rc != CURLE_OK) fail(errc::unavailable, "http.init", library, a.easy_strerror(rc));
  return a;
}

api g_api;

}  // namespace

const api& load(const std::string& library) {
  // A failed load is said again to each caller (call_once tries again after a throw).
  static std::once_flag once;
  std::call_once(once, [&] { g_api = open(library); });
  return g_api;
}

const api& lib() noexcept { return g_api; }

}  // namespace ferry::store::curl
