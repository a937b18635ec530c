#include <ferry/core/error.hpp>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cerrno>

using namespace ferry;
using ::testing::HasSubstr;

TEST(Error, WhatNamesOperationResourceDetailAndCode) {
  try {
    fail(errc::bad_address, "device.map", "sim:0 va=0x1000+4096", "not inside a reserved range");
    FAIL() << "fail() returned";
  } catch (const error& e) {
    EXPECT_STREQ(e.what(), "device.map sim:0 va=0x1000+4096: not inside a reserved range [bad_address]");
    EXPECT_EQ(e.code(), errc::bad_address);
    EXPECT_EQ(e.op(), "device.map");
    EXPECT_EQ(e.resource(), "sim:0 va=0x1000+4096");
    EXPECT_THAT(std::string(e.where().file_name()), HasSubstr("error_test.cpp"));
  }
}

TEST(Error, ErrnoKeepsTheSystemMessageAndNumber) {
  try {
    fail_errno(ENOENT, "file.open", "/data/missing.bin", "cannot open for reading");
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::not_found);
    EXPECT_EQ(e.sys_errno(), ENOENT);
    EXPECT_STREQ(e.what(),
                 "file.open /data/missing.bin: cannot open for reading: No such file or directory (errno 2 ENOENT) "
                 "[not_found]");
  }
}

TEST(Error, ErrnoMapping) {
  EXPECT_EQ(errc_from_errno(EACCES), errc::permission_denied);
  EXPECT_EQ(errc_from_errno(ENOMEM), errc::out_of_memory);
  EXPECT_EQ(errc_from_errno(ENOSPC), errc::no_space) << "a full file system is not a lack of memory";
  EXPECT_EQ(errc_from_errno(EDQUOT), errc::no_space);
  EXPECT_EQ(errno_from_errc(errc::no_space), ENOSPC) << "on the wire as the errno it came from";
  EXPECT_EQ(to_string(errc::no_space), "no_space");
  EXPECT_EQ(errc_from_errno(EFAULT), errc::bad_address);
  EXPECT_EQ(errc_from_errno(ETIMEDOUT), errc::timeout);
  EXPECT_EQ(errc_from_errno(EIO), errc::io_error);
  EXPECT_EQ(errno_name(EINVAL), "EINVAL");
}

TEST(Error, ExpectsThrowsOnlyWhenFalse) {
  EXPECT_NO_THROW(expects(true, "op", "res", "never"));
  try {
    expects(false, "xfer.submit", "request 3", "length is zero");
    FAIL();
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::invalid_argument);
    EXPECT_STREQ(e.what(), "xfer.submit request 3: length is zero [invalid_argument]");
  }
}

TEST(Error, WithContextPrefixesDetail) {
  error e(errc::io_error, "file.read", "/x", "short read");
  EXPECT_STREQ(e.with_context("loading shard 3").what(), "file.read /x: loading shard 3: short read [io_error]");
}

TEST(Error, EmptyDetailFallsBackToCodeName) {
  error e(errc::timeout, "stream.synchronize", "", "");
  EXPECT_STREQ(e.what(), "stream.synchronize: timeout [timeout]");
}

TEST(Error, DescribeRange) {
  EXPECT_EQ(describe_range(std::uintptr_t{0x7f0000001000}, 4096), "0x7f0000001000+4096");
}

TEST(Error, PrintableEscapesControlBytes) {
  EXPECT_EQ(printable(std::string_view("a\0b\n\x7f", 5)), "a\\x00b\\x0a\\x7f");
  EXPECT_EQ(printable(std::string(300, 'x')).size(), 203u);
}
