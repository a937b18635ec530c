// `ferry-bench pipeline` in a build without the CUDA toolkit: its kernel cannot be built.
#include "bench.hpp"

namespace ferry::cli {

int run_bench_pipeline(runtime&, const bench_pipeline_options&) {
  fail(errc::unavailable, "bench pipeline", "this build", "built without the CUDA toolkit (nvcc): the benchmark's kernel is missing");
}

}  // namespace ferry::cli
