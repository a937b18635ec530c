#include <ferry/core/error.hpp>
#include <ferry/settings.hpp>

#include "support/env.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <utility>
#include <vector>

using namespace ferry;
using ::testing::HasSubstr;

namespace {
settings::lookup_fn env_of(std::map<std::string, std::string> m) {
  return [m = std::move(m)](std::string_view n) -> std::optional<std::string> {
    auto it = m.find(std::string(n));
    if (it == m.end()) return std::nullopt;
    return it->second;
  };
}
std::string error_text(const std::map<std::string, std::string>& m) {
  try {
    settings::load(env_of(m));
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::invalid_argument);
    return e.what();
  }
  return "(no error)";
}
}  // namespace

TEST(Settings, Defaults) {
  settings s = settings::load(env_of({}));
  EXPECT_EQ(s.log, log_level::warn);
  EXPECT_EQ(s.deadline, std::chrono::seconds(30));
  EXPECT_EQ(s.backend, backend_choice::automatic);
  EXPECT_EQ(s.sim_capacity, 1ull << 30);
  EXPECT_EQ(s.sim_granularity, 2ull << 20);
}

TEST(Settings, ParsesEveryKind) {
  settings s = settings::load(env_of({{"FERRY_LOG", "debug"},
                                      {"FERRY_DEADLINE", "250ms"},
                                      {"FERRY_BACKEND", "sim"},
                                      {"FERRY_SIM_DEVICES", "3"},
                                      {"FERRY_SIM_CAPACITY", "64MiB"},
                                      {"FERRY_SIM_GRANULARITY", "64KiB"},
                                      {"FERRY_SIM_COPY_GBPS", "1.5"}}));
  EXPECT_EQ(s.log, log_level::debug);
  EXPECT_EQ(s.deadline, std::chrono::milliseconds(250));
  EXPECT_EQ(s.backend, backend_choice::sim);
  EXPECT_EQ(s.sim_devices, 3);
  EXPECT_EQ(s.sim_capacity, 64ull << 20);
  EXPECT_EQ(s.sim_granularity, 64ull << 10);
  EXPECT_DOUBLE_EQ(s.sim_copy_gbps, 1.5);
}

TEST(Settings, BadValuesNameVariableValueAndReason) {
  EXPECT_THAT(error_text({{"FERRY_LOG", "loud"}}),
              HasSubstr("FERRY_LOG='loud' (from environment): expected one of trace|debug|info|warn|error|off"));
  EXPECT_THAT(error_text({{"FERRY_SIM_CAPACITY", "12XB"}}), HasSubstr("FERRY_SIM_CAPACITY='12XB'"));
  EXPECT_THAT(error_text({{"FERRY_SIM_CAPACITY", "12XB"}}), HasSubstr("unknown unit 'xb'"));
  EXPECT_THAT(error_text({{"FERRY_SIM_GRANULARITY", "3MiB"}}), HasSubstr("must be a power of two"));
  EXPECT_THAT(error_text({{"FERRY_SIM_DEVICES", "two"}}), HasSubstr("not an integer"));
  EXPECT_THAT(error_text({{"FERRY_SIM_DEVICES", "65"}}), HasSubstr("out of range [0, 64]"));
  EXPECT_THAT(error_text({{"FERRY_DEADLINE", "0s"}}), HasSubstr("must be positive"));
  EXPECT_THAT(error_text({{"FERRY_SERVE_WORKERS", "0"}}), HasSubstr("out of range [1, 64]"));
  EXPECT_EQ(settings::load(env_of({{"FERRY_SERVE_WORKERS", "4"}})).serve_workers, 4);
  EXPECT_THAT(error_text({{"FERRY_CUDA_DRIVER", ""}}), HasSubstr("must not be empty"));
  EXPECT_THAT(error_text({{"FERRY_SIM_COPY_GBPS", "fast"}}), HasSubstr("not a number"));
}

TEST(Settings, DescribeRoundTrips) {
  settings s = settings::load(env_of({{"FERRY_SIM_CAPACITY", "96MiB"}, {"FERRY_DEADLINE", "1500ms"}}));
  settings t = settings::defaults();
  for (auto& r : s.describe()) t.set(r.name, r.value, "round trip");
  for (std::size_t i = 0; i < s.describe().size(); ++i) EXPECT_EQ(s.describe()[i].value, t.describe()[i].value);
  EXPECT_EQ(t.sim_capacity, 96ull << 20);
  // Every row is documented; an empty default only where the doc says what empty means.
  for (auto& r : s.describe()) {
    EXPECT_FALSE(r.doc.empty()) << r.name;
    if (r.default_value.empty()) {
      EXPECT_THAT(r.doc, HasSubstr("Empty:")) << r.name;
    }
  }
}

TEST(Settings, ConfigFileThenEnvironment) {
  std::string path = ::testing::TempDir() + "/ferry-settings-test.conf";
  {
    std::ofstream f(path);
    f << "# comment\nFERRY_SIM_DEVICES = 5\nFERRY_LOG=info\n";
  }
  settings s = settings::load(env_of({{"FERRY_CONFIG", path}, {"FERRY_LOG", "error"}}));
  EXPECT_EQ(s.sim_devices, 5);
  EXPECT_EQ(s.log, log_level::error);  // environment wins over the file
  {
    std::ofstream f(path);
    f << "FERRY_SIM_DEVICE = 5\n";  // typo
  }
  EXPECT_THAT(error_text({{"FERRY_CONFIG", path}}), HasSubstr(path + ":1: unknown setting 'FERRY_SIM_DEVICE'"));
  {
    std::ofstream f(path);
    f << "\n\nFERRY_SIM_DEVICES = -1\n";
  }
  EXPECT_THAT(error_text({{"FERRY_CONFIG", path}}), HasSubstr("(from " + path + ":3)"));
  std::remove(path.c_str());
  try {
    settings::load(env_of({{"FERRY_CONFIG", "/nonexistent/ferry.conf"}}));
    FAIL();
  } catch (const error& e) {
    EXPECT_EQ(e.code(), errc::not_found);
    EXPECT_THAT(e.what(), HasSubstr("/nonexistent/ferry.conf"));
  }
}

TEST(Settings, FromProcessEnvironment) {
  test::scoped_env a("FERRY_SIM_DEVICES", "7");
  test::scoped_env b("FERRY_CONFIG", std::nullopt);
  EXPECT_EQ(settings::from_env().sim_devices, 7);
}

TEST(Settings, UnknownNameInSetIsAnError) {
  settings s;
  EXPECT_THROW(s.set("FERRY_NOPE", "1"), error);
}

// Each layer owns its rows; the snapshot lists the layers' tables in layer order, core first, each name once.
TEST(Settings, LayersTablesInLayerOrder) {
  std::vector<std::string_view> want;
  auto add = [&](auto rows) {
    for (auto& r : rows) want.push_back(r.name);
  };
  add(core_settings::table());
  add(mem_settings::table());
  add(device_settings::table());
  add(xfer_settings::table());
  add(vm_settings::table());
  add(io_settings::table());
  add(store_settings::table());
  add(gpu_settings::table());
  EXPECT_EQ(settings::names(), want);
  EXPECT_EQ(std::set<std::string_view>(want.begin(), want.end()).size(), want.size());
}

// A layer's struct taken from a snapshot sees the one core and mem part every layer shares, and keeps
// it when copied; moving a snapshot keeps every value.
TEST(Settings, LayerStructsShareCoreAndMem) {
  settings s = settings::load(env_of({{"FERRY_DEADLINE", "45s"}, {"FERRY_STAGING_BYTES", "1MiB"}, {"FERRY_CUDA_DRIVER", "x.so"}}));
  const io_settings& io = s;
  const xfer_settings& xfer = s;
  const gpu_settings& gpu = s;
  EXPECT_EQ(io.deadline, std::chrono::seconds(45));
  EXPECT_EQ(gpu.deadline, std::chrono::seconds(45));
  EXPECT_EQ(io.staging_bytes, 1u << 20);
  EXPECT_EQ(xfer.staging_bytes, 1u << 20);
  const io_settings copy = s;
  EXPECT_EQ(copy.deadline, std::chrono::seconds(45));
  settings t;
  t = std::move(s);
  EXPECT_EQ(t.cuda_driver, "x.so");
  EXPECT_EQ(t.deadline, std::chrono::seconds(45));
}
