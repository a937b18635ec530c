#pragma once
// libcurl, loaded at run time (store layer, its own sources only). ferry does not link against it: the
// first http://, https:// or s3:// use dlopens it, so that a process that never names a URL does not load
// it and the libraries it brings (TLS, Kerberos, LDAP, SSH, ...) -- a cost every ferry process paid at its
// start, `ferry run`'s program and the CLI before it included. Only curl.h's types and declarations are used.
#include <curl/curl.h>

#include <string>

namespace ferry::store::curl {

// Every libcurl entry point ferry uses, without the "curl_" of its name: a member named as the symbol
// would be taken by curl.h's type-checking macros (curl_easy_setopt(...) and friends).
#define FERRY_CURL_FUNCTIONS(X)                                                                            \
  X(global_init) X(version_info) X(easy_init) X(easy_cleanup) X(easy_reset) X(easy_perform)                 \
  X(easy_setopt) X(easy_getinfo) X(easy_strerror) X(slist_append) X(slist_free_all) X(multi_init)          \
  X(multi_cleanup) X(multi_setopt) X(multi_add_handle) X(multi_remove_handle) X(multi_perform)             \
  X(multi_poll) X(multi_wakeup) X(multi_info_read)

struct api {
#define FERRY_CURL_DECLARE(name) decltype(&::curl_##name) name = nullptr;
  FERRY_CURL_FUNCTIONS(FERRY_CURL_DECLARE)
#undef FERRY_CURL_DECLARE
};

// Loads the library (the first successful caller's name holds for the process; FERRY_CURL_LIBRARY) and
// runs curl_global_init; errc::unavailable naming it, with the loader's reason, when it cannot.
const api& load(const std::string& library);
// The loaded library: only after a load() that succeeded.
const api& lib() noexcept;

}  // namespace ferry::store::curl
