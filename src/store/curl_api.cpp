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
  std::string why;
  if (!missing.empty()) why = "libcurl lacks " + missing + " (too old?)";
  else if (const CURLcode rc = a.global_init(CURL_GLOBAL_DEFAULT); rc != CURLE_OK) why = a.easy_strerror(rc);
  if (!why.empty()) {
    ::dlclose(h);
    fail(errc::unavailable, "http.init", library, why);
  }
  return a;  // the handle stays open: the process uses the library until it ends
}

std::mutex g_mu;
bool g_loaded = false;  // g_mu
api g_api;              // written once, under g_mu, before g_loaded

}  // namespace

const api& load(const std::string& library) {
  // A mutex, not call_once: a failed load throws, and each later caller tries again and is told
  // (libstdc++'s call_once may block for good after its function threw).
  std::lock_guard l(g_mu);
  if (!g_loaded) {
    g_api = open(library);
    g_loaded = true;
  }
  return g_api;
}

const api& lib() noexcept { return g_api; }

}  // namespace ferry::store::curl
