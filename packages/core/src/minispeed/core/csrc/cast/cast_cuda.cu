// CUDA fp32 <-> bf16 casts, bit-identical to the CPU op: both call the same scalar conversions
// of minispeed/simd.h (Note [bf16 round-to-nearest-even]), integer arithmetic on the fp32 bits,
// so no bf16 intrinsics (and no sm_80+ requirement) are involved.
//
// Costs: memory bound; float_to_bf16 moves 6 B per element, bf16_to_float 6 B per element.
// Grid-stride loops with 256 threads per block; consecutive threads touch consecutive elements
// so loads and stores coalesce.

#include "cast_cuda.h"

#include <algorithm>

#include "minispeed/simd.h"  // f32_to_bf16_rne, bf16_to_f32: __host__ __device__ under nvcc

namespace minispeed {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;

__global__ void float_to_bf16_kernel(const float* __restrict__ src, uint16_t* __restrict__ dst,
                                     int64_t n) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    dst[i] = simd::f32_to_bf16_rne(src[i]);
  }
}

__global__ void bf16_to_float_kernel(const uint16_t* __restrict__ src, float* __restrict__ dst,
                                     int64_t n) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    dst[i] = simd::bf16_to_f32(src[i]);
  }
}

unsigned int blocks_for(int64_t n) {
  return static_cast<unsigned int>(std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks));
}

}  // namespace

cudaError_t launch_float_to_bf16(const float* src, uint16_t* dst, int64_t n, cudaStream_t stream) {
  if (n == 0) {
    return cudaSuccess;
  }
  float_to_bf16_kernel<<<blocks_for(n), kThreads, 0, stream>>>(src, dst, n);
  return cudaGetLastError();
}

cudaError_t launch_bf16_to_float(const uint16_t* src, float* dst, int64_t n, cudaStream_t stream) {
  if (n == 0) {
    return cudaSuccess;
  }
  bf16_to_float_kernel<<<blocks_for(n), kThreads, 0, stream>>>(src, dst, n);
  return cudaGetLastError();
}

}  // namespace minispeed
