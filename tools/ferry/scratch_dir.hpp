#pragma once
// A private directory for generated data (mkdtemp), removed with everything in it when the object goes.
#include <ferry/core/error.hpp>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

namespace ferry::cli {

class scratch_dir {
 public:
  // Under `base`, or $TMPDIR (else /tmp) when `base` is empty; `op` names the command in errors.
  scratch_dir(const std::string& base, const std::string& prefix, const char* op) {
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl = (base.empty() ? std::string(tmp && *tmp ? tmp : "/tmp") : base) + "/" + prefix + "-XXXXXX";
    if (!::mkdtemp(tmpl.data())) fail_errno(errno, op, tmpl, "cannot create a scratch directory");
    path_ = tmpl;
  }
  ~scratch_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  scratch_dir(const scratch_dir&) = delete;
  scratch_dir& operator=(const scratch_dir&) = delete;
  const std::filesystem::path& path() const noexcept { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace ferry::cli
