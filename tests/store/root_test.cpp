#include <ferry/store/root.hpp>

#include "support/errors.hpp"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

using namespace ferry;
using ::testing::HasSubstr;

namespace {

struct tree {
  std::filesystem::path base, root;
  tree() {
    base = std::filesystem::path(::testing::TempDir()) / ("ferry-root-" + std::to_string(::getpid()));
    root = base / "export";
    std::filesystem::create_directories(root / "sub");
    std::ofstream(root / "sub" / "a.bin") << "inside";
    std::ofstream(base / "secret.txt") << "outside";
    std::filesystem::create_symlink("/etc/passwd", root / "abs-link");
    std::filesystem::create_symlink("../secret.txt", root / "rel-link");
    std::filesystem::create_symlink("sub/a.bin", root / "ok-link");
    std::filesystem::create_directory_symlink("..", root / "up");
  }
  ~tree() { std::filesystem::remove_all(base); }
};

TEST(StoreRoot, PathsInsideOpen) {
  tree t;
  store::root_dir r(t.root.string());
  int fd = r.open("sub/a.bin", O_RDONLY);
  ASSERT_GE(fd, 0);
  char buf[16] = {};
  EXPECT_EQ(::read(fd, buf, sizeof buf), 6);
  ::close(fd);
  fd = r.open("ok-link", O_RDONLY);  // a symlink that stays inside is fine
  EXPECT_GE(fd, 0);
  ::close(fd);
  fd = r.open("sub/./a.bin", O_RDONLY);
  EXPECT_GE(fd, 0);
  ::close(fd);
}

TEST(StoreRoot, EveryEscapeAttemptIsRefused) {
  tree t;
  store::root_dir r(t.root.string());
  auto text = [&](std::string_view p) { return test::error_text([&] { ::close(r.open(p, O_RDONLY)); }); };
  EXPECT_THAT(text("../secret.txt"), HasSubstr("'..' is not allowed"));
  EXPECT_THAT(text("sub/../../secret.txt"), HasSubstr("'..' is not allowed"));
  EXPECT_THAT(text("/etc/passwd"), HasSubstr("absolute paths are not allowed"));
  EXPECT_THAT(text("abs-link"), HasSubstr("leads outside the root"));
  EXPECT_THAT(text("rel-link"), HasSubstr("leads outside the root"));
  EXPECT_THAT(text("up/secret.txt"), HasSubstr("leads outside the root"));
  EXPECT_THAT(text(std::string_view("sub/a.bin\0x", 11)), HasSubstr("NUL byte"));
  EXPECT_THAT(text(""), HasSubstr("empty path"));
  EXPECT_THAT(text("/proc/self/root/etc/passwd"), HasSubstr("absolute paths"));
  EXPECT_THAT(text("missing.bin"), HasSubstr("No such file or directory"));
  EXPECT_THAT(text("abs-link"), HasSubstr("[permission_denied]"));
}

TEST(StoreRoot, MissingRootNamesIt) {
  EXPECT_THAT(test::error_text([] { store::root_dir r("/nonexistent/export"); }),
              HasSubstr("store.root /nonexistent/export: cannot open the root directory: No such file or directory"));
}

}  // namespace
