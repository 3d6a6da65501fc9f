// CUDA row gather and weighted combine for MoE dispatch (fp32); the contract of permute.cpp.
//
// One block per output row, its threads striding over the row's d columns: consecutive threads
// touch consecutive floats, so each row's read and write coalesce. Every output row is written by
// one block only (a gather, never a scatter), so no atomics; the sum over j < k runs in j order,
// the same order as the CPU op and the reference.
//
// Costs: gather_rows moves 8 d B per output row, combine_rows 4 d (k + 1) B. Memory bound.

#include "permute_cuda.h"

#include <algorithm>

namespace minispeed_moe {
namespace {

constexpr int kThreads = 128;
constexpr int64_t kMaxBlocks = 65535;

__global__ void gather_rows_kernel(const float* __restrict__ src, int64_t n_src,
                                   float* __restrict__ out, int64_t n_out,
                                   const int64_t* __restrict__ index,
                                   const float* __restrict__ scale, int64_t d, int* bad_flag) {
  for (int64_t i = blockIdx.x; i < n_out; i += gridDim.x) {
    const int64_t r = index[i];
    float* o = out + i * d;
    const bool valid = r >= 0 && r < n_src;
    if (!valid && r != -1 && threadIdx.x == 0) *bad_flag = 1;
    const float a = scale ? scale[i] : 1.0f;
    for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
      o[c] = valid ? a * src[r * d + c] : 0.0f;
    }
  }
}

__global__ void combine_rows_kernel(const float* __restrict__ src, int64_t n_src,
                                    float* __restrict__ out, int64_t n_out,
                                    const int64_t* __restrict__ index,
                                    const float* __restrict__ weight, int64_t k, int64_t d,
                                    int* bad_flag) {
  for (int64_t t = blockIdx.x; t < n_out; t += gridDim.x) {
    for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
      float acc = 0.0f;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = index[t * k + j];
        if (r < 0 || r >= n_src) {
          if (r != -1 && c == 0) *bad_flag = 1;
          continue;
        }
        acc = fmaf(weight ? weight[t * k + j] : 1.0f, src[r * d + c], acc);
      }
      out[t * d + c] = acc;
    }
  }
}

unsigned int blocks_for(int64_t rows) {
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min<int64_t>(rows, kMaxBlocks)));
}

}  // namespace

cudaError_t launch_gather_rows(const float* src, int64_t n_src, float* out, int64_t n_out,
                               const int64_t* index, const float* scale, int64_t d,
                               int* bad_flag, cudaStream_t stream) {
  if (n_out == 0 || d == 0) return cudaSuccess;
  gather_rows_kernel<<<blocks_for(n_out), kThreads, 0, stream>>>(src, n_src, out, n_out, index,
                                                                  scale, d, bad_flag);
  return cudaGetLastError();
}

cudaError_t launch_combine_rows(const float* src, int64_t n_src, float* out, int64_t n_out,
                                const int64_t* index, const float* weight, int64_t k, int64_t d,
                                int* bad_flag, cudaStream_t stream) {
  if (n_out == 0 || d == 0) return cudaSuccess;
  combine_rows_kernel<<<blocks_for(n_out), kThreads, 0, stream>>>(src, n_src, out, n_out, index,
                                                                   weight, k, d, bad_flag);
  return cudaGetLastError();
}

}  // namespace minispeed_moe
