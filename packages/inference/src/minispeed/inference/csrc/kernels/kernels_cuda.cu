// minispeed.inference's fused kernels in CUDA, fp32: the same contracts as kernels.cpp (see the
// reference in minispeed/inference/kernels_reference.py). Plain CUDA with extern "C" launchers
// taking raw pointers and a stream, no torch headers (see Note [raw pointers, no torch headers]
// in kernels.cpp). Declared in kernels_cuda.h; bound to Python by kernels_cuda_binding.cpp (the
// `inference_kernels_cuda` op, built only where a GPU is present). Compiled on every machine with
// nvcc by core's test (sm_80 and sm_90); the binding is compile-checked by this package's tests.
//
// Launch shapes: one block per row (norms, softmax, bias+GeLU), one block per (sequence, head)
// for decode attention, one warp per output for the int8 linear. Row reductions use warp
// shuffles then one shared-memory pass across warps.

#include <cuda_runtime.h>

#include "kernels_cuda.h"

#include <cmath>
#include <cstdint>

namespace {

constexpr int kThreads = 256;

// The two reductions the kernels need, as an operation and its identity.
struct Sum {
  __device__ static float identity() { return 0.f; }
  __device__ static float apply(float a, float b) { return a + b; }
};
struct Max {
  __device__ static float identity() { return -INFINITY; }
  __device__ static float apply(float a, float b) { return fmaxf(a, b); }
};

template <class Op>
__device__ __forceinline__ float warp_reduce(float v) {
  for (int o = 16; o > 0; o >>= 1) v = Op::apply(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Reduce over the block; every thread gets the result. `shared` holds kThreads / 32 floats.
template <class Op>
__device__ float block_reduce(float v, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_reduce<Op>(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  // every warp reduces the same partials
  v = (lane < static_cast<int>(blockDim.x / 32)) ? shared[lane] : Op::identity();
  v = warp_reduce<Op>(v);
  return __shfl_sync(0xffffffffu, v, 0);
}

__device__ __forceinline__ float warp_sum(float v) { return warp_reduce<Sum>(v); }
__device__ __forceinline__ float block_sum(float v, float* shared) {
  return block_reduce<Sum>(v, shared);
}
__device__ __forceinline__ float block_max(float v, float* shared) {
  return block_reduce<Max>(v, shared);
}

// h = x + residual; out = norm(h) * gamma (+ beta). rms == true: RMSNorm, else LayerNorm.
__global__ void norm_kernel(const float* x, const float* residual, const float* gamma,
                            const float* beta, float* out, float* res_out, int64_t cols, float eps,
                            bool rms) {
  __shared__ float shared[kThreads / 32];
  const int64_t row = blockIdx.x;
  const float* xr = x + row * cols;
  float* h = res_out + row * cols;
  float local = 0.f;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
    const float v = residual ? xr[i] + residual[row * cols + i] : xr[i];
    h[i] = v;
    local += rms ? v * v : v;
  }
  const float first = block_sum(local, shared) / static_cast<float>(cols);
  float mean = 0.f, inv;
  if (rms) {
    inv = rsqrtf(first + eps);
  } else {
    mean = first;
    local = 0.f;
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) local += (h[i] - mean) * (h[i] - mean);
    inv = rsqrtf(block_sum(local, shared) / static_cast<float>(cols) + eps);
  }
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
    out[row * cols + i] = (h[i] - mean) * inv * gamma[i] + (beta ? beta[i] : 0.f);
  }
}

__global__ void bias_gelu_kernel(const float* x, const float* bias, float* out, int64_t n,
                                 int64_t cols) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = bias ? x[i] + bias[i % cols] : x[i];
    out[i] = 0.5f * v * (1.f + erff(v * 0.70710678118654752440f));
  }
}

__global__ void masked_softmax_kernel(const float* x, const uint8_t* mask, float* out,
                                      int64_t cols, float scale) {
  __shared__ float shared[kThreads / 32];
  const int64_t row = blockIdx.x;
  const float* xr = x + row * cols;
  const uint8_t* m = mask ? mask + row * cols : nullptr;
  float* o = out + row * cols;
  float mx = -INFINITY;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x)
    if (!m || m[i]) mx = fmaxf(mx, xr[i] * scale);
  mx = block_max(mx, shared);
  if (mx == -INFINITY) {  // every entry masked: zeros, as the reference gives
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) o[i] = 0.f;
    return;
  }
  float local = 0.f;
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
    const float e = (!m || m[i]) ? expf(xr[i] * scale - mx) : 0.f;
    o[i] = e;
    local += e;
  }
  const float inv = 1.f / block_sum(local, shared);
  for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) o[i] *= inv;
}

// One thread per (token, head, i < D/2) pair of rotated elements.
__global__ void rotary_kernel(const float* x, const float* cos_t, const float* sin_t,
                              const int64_t* positions, float* out, int64_t tokens, int64_t heads,
                              int64_t dim) {
  const int64_t half = dim / 2;
  const int64_t n = tokens * heads * half;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = idx % half, th = idx / half, t = th / heads;
    const int64_t p = positions[t];
    const float c = cos_t[p * half + i], s = sin_t[p * half + i];
    const float a = x[th * dim + i], b = x[th * dim + i + half];
    out[th * dim + i] = a * c - b * s;
    out[th * dim + i + half] = b * c + a * s;
  }
}

// One block per (sequence, head); scores for the L cached positions live in dynamic shared memory
// (L floats), then each thread owns output dims d = threadIdx.x, threadIdx.x + blockDim.x, ...
// Query head h reads cached K/V head h / (heads / kv_heads) (grouped-query attention; see Note
// [paged decode attention] in kernels.cpp).
__global__ void decode_attention_kernel(const float* q, const float* k_cache, const float* v_cache,
                                        const int32_t* block_tables, const int32_t* seq_lens,
                                        float* out, int64_t heads, int64_t kv_heads, int64_t dim,
                                        int64_t block_size, int64_t max_blocks, float scale) {
  extern __shared__ float scores[];
  __shared__ float shared[kThreads / 32];
  const int64_t bh = blockIdx.x, b = bh / heads, h = bh % heads / (heads / kv_heads);
  const int64_t len = seq_lens[b], row = kv_heads * dim;
  const int32_t* table = block_tables + b * max_blocks;
  const float* qv = q + bh * dim;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int64_t t = warp; t < len; t += warps) {  // one warp per position: a D-long dot product
    const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
    const float* k = k_cache + slot * row + h * dim;
    float acc = 0.f;
    for (int64_t d = lane; d < dim; d += 32) acc += qv[d] * k[d];
    acc = warp_sum(acc);
    if (lane == 0) scores[t] = acc * scale;
  }
  __syncthreads();
  float mx = -INFINITY;
  for (int64_t t = threadIdx.x; t < len; t += blockDim.x) mx = fmaxf(mx, scores[t]);
  mx = block_max(mx, shared);
  float local = 0.f;
  for (int64_t t = threadIdx.x; t < len; t += blockDim.x) {
    scores[t] = expf(scores[t] - mx);
    local += scores[t];
  }
  const float total = block_sum(local, shared);
  __syncthreads();
  const float inv = len > 0 ? 1.f / total : 0.f;
  for (int64_t d = threadIdx.x; d < dim; d += blockDim.x) {
    float acc = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      const int64_t slot =
          static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
      acc += scores[t] * v_cache[slot * row + h * dim + d];
    }
    out[bh * dim + d] = acc * inv;
  }
}

// One warp per output (i, j): y[i, j] = s_j · Σ_k x[i, k] · q[j, k] + b_j.
__global__ void int8_linear_kernel(const float* x, const int8_t* w_q, const float* scales,
                                   const float* bias, float* out, int64_t m, int64_t n,
                                   int64_t k) {
  const int64_t warp_id = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (warp_id >= m * n) return;
  const int64_t i = warp_id / n, j = warp_id % n;
  float acc = 0.f;
  for (int64_t c = lane; c < k; c += 32) acc += x[i * k + c] * static_cast<float>(w_q[j * k + c]);
  acc = warp_sum(acc);
  if (lane == 0) out[i * n + j] = acc * scales[j] + (bias ? bias[j] : 0.f);
}

inline unsigned grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65535 ? (blocks > 0 ? blocks : 1) : 65535);
}

}  // namespace

extern "C" {

cudaError_t minispeed_inference_norm(const float* x, const float* residual, const float* gamma,
                                     const float* beta, float* out, float* res_out, int64_t rows,
                                     int64_t cols, float eps, bool rms, cudaStream_t stream) {
  if (rows > 0) {
    norm_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, residual, gamma, beta,
                                                                      out, res_out, cols, eps, rms);
  }
  return cudaGetLastError();
}

cudaError_t minispeed_inference_bias_gelu(const float* x, const float* bias, float* out,
                                          int64_t rows, int64_t cols, cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (n > 0) bias_gelu_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, bias, out, n, cols);
  return cudaGetLastError();
}

cudaError_t minispeed_inference_masked_softmax(const float* x, const uint8_t* mask, float* out,
                                               int64_t rows, int64_t cols, float scale,
                                               cudaStream_t stream) {
  if (rows > 0) {
    masked_softmax_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, mask, out, cols,
                                                                               scale);
  }
  return cudaGetLastError();
}

cudaError_t minispeed_inference_rotary(const float* x, const float* cos_t, const float* sin_t,
                                       const int64_t* positions, float* out, int64_t tokens,
                                       int64_t heads, int64_t dim, cudaStream_t stream) {
  const int64_t n = tokens * heads * (dim / 2);
  if (n > 0) {
    rotary_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, cos_t, sin_t, positions, out, tokens,
                                                        heads, dim);
  }
  return cudaGetLastError();
}

// max_len bounds seq_lens (the caller knows it): it sizes the shared-memory score buffer.
cudaError_t minispeed_inference_decode_attention(const float* q, const float* k_cache,
                                                 const float* v_cache, const int32_t* block_tables,
                                                 const int32_t* seq_lens, float* out, int64_t batch,
                                                 int64_t heads, int64_t kv_heads, int64_t dim,
                                                 int64_t block_size, int64_t max_blocks,
                                                 int64_t max_len, float scale,
                                                 cudaStream_t stream) {
  if (batch * heads > 0) {
    const size_t smem = static_cast<size_t>(max_len > 0 ? max_len : 1) * sizeof(float);
    decode_attention_kernel<<<static_cast<unsigned>(batch * heads), kThreads, smem, stream>>>(
        q, k_cache, v_cache, block_tables, seq_lens, out, heads, kv_heads, dim, block_size,
        max_blocks, scale);
  }
  return cudaGetLastError();
}

cudaError_t minispeed_inference_int8_linear(const float* x, const int8_t* w_q, const float* scales,
                                            const float* bias, float* out, int64_t m, int64_t n,
                                            int64_t k, cudaStream_t stream) {
  const int64_t threads = m * n * 32;
  if (threads > 0) {
    const int64_t blocks = (threads + kThreads - 1) / kThreads;
    int8_linear_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, w_q, scales,
                                                                              bias, out, m, n, k);
  }
  return cudaGetLastError();
}

}  // extern "C"
