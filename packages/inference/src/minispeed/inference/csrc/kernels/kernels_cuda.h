// Launchers of minispeed.inference's CUDA kernels (kernels_cuda.cu): plain C entry points taking
// raw device pointers, sizes and a stream, so the .cu compiles with nvcc alone and the pybind11
// binding (kernels_cuda_binding.cpp) stays host-only, with no torch headers. Each returns
// cudaGetLastError() after its launch.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

extern "C" {

// h = x + residual (residual may be null); out = LayerNorm(h) (rms: RMSNorm) * gamma (+ beta).
cudaError_t minispeed_inference_norm(const float* x, const float* residual, const float* gamma,
                                     const float* beta, float* out, float* res_out, int64_t rows,
                                     int64_t cols, float eps, bool rms, cudaStream_t stream);

// out = gelu(x + bias) (erf GeLU); bias (cols,) may be null.
cudaError_t minispeed_inference_bias_gelu(const float* x, const float* bias, float* out,
                                          int64_t rows, int64_t cols, cudaStream_t stream);

// Softmax of scale * x over each row of cols; mask (uint8, 1 = keep) may be null.
cudaError_t minispeed_inference_masked_softmax(const float* x, const uint8_t* mask, float* out,
                                               int64_t rows, int64_t cols, float scale,
                                               cudaStream_t stream);

// Rotate-half RoPE of x (tokens, heads, dim) at int64 positions, tables (max_positions, dim / 2).
cudaError_t minispeed_inference_rotary(const float* x, const float* cos_t, const float* sin_t,
                                       const int64_t* positions, float* out, int64_t tokens,
                                       int64_t heads, int64_t dim, cudaStream_t stream);

// One query per (sequence, head) over the paged cache of kv_heads K/V heads (heads a multiple);
// max_len >= every seq_len (sizes the shared-memory score buffer: max_len floats per block).
cudaError_t minispeed_inference_decode_attention(const float* q, const float* k_cache,
                                                 const float* v_cache, const int32_t* block_tables,
                                                 const int32_t* seq_lens, float* out, int64_t batch,
                                                 int64_t heads, int64_t kv_heads, int64_t dim,
                                                 int64_t block_size, int64_t max_blocks,
                                                 int64_t max_len, float scale,
                                                 cudaStream_t stream);

// out (m, n) = x (m, k) @ (w_q (n, k) int8 * scales (n,))^T + bias (bias may be null).
cudaError_t minispeed_inference_int8_linear(const float* x, const int8_t* w_q, const float* scales,
                                            const float* bias, float* out, int64_t m, int64_t n,
                                            int64_t k, cudaStream_t stream);

}  // extern "C"
