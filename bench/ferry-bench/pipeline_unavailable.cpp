// `ferry-bench pipeline`, `gather` and `bfs` in a build without the CUDA toolkit: their kernels cannot be built.
#include "bench.hpp"

namespace ferry::cli {

int run_bench_pipeline(runtime&, const bench_pipeline_options&) {
  fail(errc::unavailable, "bench pipeline", "this build", "built without the CUDA toolkit (nvcc): the benchmark's kernel is missing");
}

int run_bench_gather(runtime&, const bench_gather_options&) {
  fail(errc::unavailable, "bench gather", "this build", "built without the CUDA toolkit (nvcc): the benchmark's kernels are missing");
}

int run_bench_bfs(runtime&, const bench_bfs_options&) {
  fail(errc::unavailable, "bench bfs", "this build", "built without the CUDA toolkit (nvcc): the benchmark's kernels are missing");
}

}  // namespace ferry::cli
