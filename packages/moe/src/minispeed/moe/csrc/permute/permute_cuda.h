// Launchers of the CUDA row gather / weighted combine (same contract as permute.cpp): plain CUDA
// C++ with no torch header, so the .cu compiles with nvcc alone and the binding stays host-only.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace minispeed_moe {

// out[i] = scale[i] * src[index[i]] for i < n_out (scale may be null: ones); index -1 -> zero row.
// An index outside [-1, n_src) also writes a zero row and sets *bad_flag (device int) to 1.
cudaError_t launch_gather_rows(const float* src, int64_t n_src, float* out, int64_t n_out,
                               const int64_t* index, const float* scale, int64_t d,
                               int* bad_flag, cudaStream_t stream);

// out[t] = sum_{j<k} weight[t*k+j] * src[index[t*k+j]] (weight may be null: ones; index -1
// skipped; out of range skipped and flagged as above).
cudaError_t launch_combine_rows(const float* src, int64_t n_src, float* out, int64_t n_out,
                                const int64_t* index, const float* weight, int64_t k, int64_t d,
                                int* bad_flag, cudaStream_t stream);

}  // namespace minispeed_moe
