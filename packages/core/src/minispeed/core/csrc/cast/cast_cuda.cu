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

// One grid-stride loop for both directions: dst[i] = Convert{}(src[i]).
template <typename Src, typename Dst, typename Convert>
__global__ void convert_kernel(const Src* __restrict__ src, Dst* __restrict__ dst, int64_t n) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    dst[i] = Convert{}(src[i]);
  }
}

struct ToBf16 {
  __device__ uint16_t operator()(float x) const { return simd::f32_to_bf16_rne(x); }
};

struct ToFloat {
  __device__ float operator()(uint16_t x) const { return simd::bf16_to_f32(x); }
};

unsigned int blocks_for(int64_t n) {
  return static_cast<unsigned int>(std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks));
}

template <typename Src, typename Dst, typename Convert>
cudaError_t launch_convert(const Src* src, Dst* dst, int64_t n, cudaStream_t stream) {
  if (n == 0) {
    return cudaSuccess;
  }
  convert_kernel<Src, Dst, Convert><<<blocks_for(n), kThreads, 0, stream>>>(src, dst, n);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_float_to_bf16(const float* src, uint16_t* dst, int64_t n, cudaStream_t stream) {
  return launch_convert<float, uint16_t, ToBf16>(src, dst, n, stream);
}

cudaError_t launch_bf16_to_float(const uint16_t* src, float* dst, int64_t n, cudaStream_t stream) {
  return launch_convert<uint16_t, float, ToFloat>(src, dst, n, stream);
}

}  // namespace minispeed
