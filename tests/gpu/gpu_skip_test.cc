// Placeholder for builds without the CUDA backend (DI_CUDA=OFF or no nvcc): the GPU suite
// cannot be built there, and says so instead of vanishing.
#include "gtest/gtest.h"

TEST(GpuTest, BuiltWithoutCuda) {
  GTEST_SKIP() << "built without the CUDA backend (DI_CUDA=OFF or no nvcc): GPU tests skipped";
}
