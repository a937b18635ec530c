#include <ferry/core/error.hpp>
#include <ferry/core/units.hpp>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

using namespace ferry;
using namespace std::chrono_literals;

TEST(Units, ParseSize) {
  EXPECT_EQ(parse_size("4096"), 4096u);
  EXPECT_EQ(parse_size("64K"), 64 * KiB);
  EXPECT_EQ(parse_size("64KiB"), 64 * KiB);
  EXPECT_EQ(parse_size("2mib"), 2 * MiB);
  EXPECT_EQ(parse_size(" 1 GiB "), GiB);
  EXPECT_EQ(parse_size("3T"), 3 * 1024 * GiB);
}

TEST(Units, ParseSizeErrorsNameTheText) {
  try {
    parse_size("12XB", "--size");
    FAIL();
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::invalid_argument);
    EXPECT_THAT(e.what(), ::testing::HasSubstr("--size='12XB'"));
    EXPECT_THAT(e.what(), ::testing::HasSubstr("unknown unit 'xb'"));
  }
  EXPECT_THROW(parse_size(""), error);
  EXPECT_THROW(parse_size("-1"), error);
  EXPECT_THROW(parse_size("99999999999T"), error);  // overflow
}

TEST(Units, ParseDuration) {
  EXPECT_EQ(parse_duration("250ms"), 250ms);
  EXPECT_EQ(parse_duration("30s"), 30s);
  EXPECT_EQ(parse_duration("2m"), 2min);
  EXPECT_EQ(parse_duration("100us"), 100us);
  EXPECT_EQ(parse_duration("5000"), 5000ms);
  EXPECT_THROW(parse_duration("soon"), error);
  EXPECT_THROW(parse_duration("5 fortnights"), error);
}

TEST(Units, Format) {
  EXPECT_EQ(format_size(512), "512 B");
  EXPECT_EQ(format_size(2 * MiB), "2 MiB");
  EXPECT_EQ(format_size(1536 * KiB), "1.50 MiB");
  EXPECT_EQ(format_rate(12.345e9), "12.35 GB/s");
  EXPECT_EQ(format_duration(30s), "30s");
  EXPECT_EQ(format_duration(250ms), "250ms");
}
