// Block-sparse attention in CUDA, fp32, forward and backward: the contract of
// sparse_attention.cpp (shapes, CSR layout, log-sum-exp) with the same reference
// (minispeed/inference/sparse/reference.py). Plain CUDA, extern "C" launchers taking raw pointers
// and a stream, no torch headers. This cut compiles them (core's nvcc test, sm_80 and sm_90); the
// Python binding is not wired up yet, so CUDA tensors run the PyTorch reference.
//
// Launch shape: one warp per query row, 4 warps per thread block. A lane holds head-dim elements
// lane, lane + 32, ... (D <= 32 * kMaxPerLane = 256). The forward is an online softmax over the
// kept keys (running max m, running sum l, accumulator rescaled by exp(m_old - m_new)), so no
// score buffer exists. The backward recomputes p = exp(s - lse) (see Note [no scores kept between
// forward and backward] in sparse_attention.cpp); dq is owned by its warp, dk and dv are
// accumulated with atomicAdd (several query rows share a key).

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kMaxPerLane = 8;

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

struct Shape {
  int64_t batch, heads, seq, dim, block;
  bool causal;
  float scale;
};

// Loads row x (dim floats) into this lane's registers.
__device__ __forceinline__ void load_row(const float* x, int64_t dim, int lane, float* r) {
#pragma unroll
  for (int t = 0; t < kMaxPerLane; ++t) {
    const int64_t d = lane + 32 * t;
    r[t] = d < dim ? x[d] : 0.f;
  }
}

__device__ __forceinline__ float row_dot(const float* r, const float* y, int64_t dim, int lane) {
  float acc = 0.f;
#pragma unroll
  for (int t = 0; t < kMaxPerLane; ++t) {
    const int64_t d = lane + 32 * t;
    if (d < dim) acc += r[t] * y[d];
  }
  return warp_sum(acc);
}

// The query row this warp owns and its block row's kept key blocks: entries [first, last) of
// `cols` (the CSR row of its head). Rows past the sequence (the last block's spare warps) return
// row >= s.seq and do nothing.
struct WarpRow {
  int lane;
  int64_t row, base;  // row in the sequence; base: the first row of this (batch, head)
  int32_t first, last;
};

__device__ __forceinline__ WarpRow warp_row(const int32_t* row_ptr, const Shape& s) {
  WarpRow w;
  w.lane = threadIdx.x & 31;
  w.row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  const int64_t bh = blockIdx.y;
  w.base = bh * s.seq;
  w.first = w.last = 0;
  if (w.row < s.seq) {
    const int64_t nb = s.seq / s.block, h = bh % s.heads, r = w.row / s.block;
    const int32_t* rp = row_ptr + h * (nb + 1);
    w.first = rp[r];
    w.last = rp[r + 1];
  }
  return w;
}

__global__ void sparse_forward_kernel(const float* q, const float* k, const float* v,
                                      const int32_t* row_ptr, const int32_t* cols, float* out,
                                      float* lse, Shape s) {
  const WarpRow w = warp_row(row_ptr, s);
  if (w.row >= s.seq) return;
  const int lane = w.lane;
  const int64_t row = w.row, base = w.base;
  float qr[kMaxPerLane], acc[kMaxPerLane];
  load_row(q + (base + row) * s.dim, s.dim, lane, qr);
#pragma unroll
  for (int t = 0; t < kMaxPerLane; ++t) acc[t] = 0.f;
  float m = -INFINITY, l = 0.f;
  for (int32_t e = w.first; e < w.last; ++e) {
    const int64_t c = cols[e];
    const int64_t j_end = s.causal ? min((c + 1) * s.block, row + 1) : (c + 1) * s.block;
    for (int64_t j = c * s.block; j < j_end; ++j) {
      const float sc = row_dot(qr, k + (base + j) * s.dim, s.dim, lane) * s.scale;
      const float m_new = fmaxf(m, sc);
      const float correction = expf(m - m_new);  // 0 on the first key (m = -inf)
      const float p = expf(sc - m_new);
      l = l * correction + p;
      const float* vj = v + (base + j) * s.dim;
#pragma unroll
      for (int t = 0; t < kMaxPerLane; ++t) {
        const int64_t d = lane + 32 * t;
        acc[t] = acc[t] * correction + (d < s.dim ? p * vj[d] : 0.f);
      }
      m = m_new;
    }
  }
  float* o = out + (base + row) * s.dim;
#pragma unroll
  for (int t = 0; t < kMaxPerLane; ++t) {
    const int64_t d = lane + 32 * t;
    if (d < s.dim) o[d] = acc[t] / l;
  }
  if (lane == 0) lse[base + row] = m + logf(l);
}

__global__ void sparse_backward_kernel(const float* q, const float* k, const float* v,
                                       const float* out, const float* dout, const float* lse,
                                       const int32_t* row_ptr, const int32_t* cols, float* dq,
                                       float* dk, float* dv, Shape s) {
  const WarpRow w = warp_row(row_ptr, s);
  if (w.row >= s.seq) return;
  const int lane = w.lane;
  const int64_t row = w.row, base = w.base;
  float qr[kMaxPerLane], dor[kMaxPerLane], dqr[kMaxPerLane];
  load_row(q + (base + row) * s.dim, s.dim, lane, qr);
  load_row(dout + (base + row) * s.dim, s.dim, lane, dor);
#pragma unroll
  for (int t = 0; t < kMaxPerLane; ++t) dqr[t] = 0.f;
  const float di = row_dot(dor, out + (base + row) * s.dim, s.dim, lane);
  const float li = lse[base + row];
  for (int32_t e = w.first; e < w.last; ++e) {
    const int64_t c = cols[e];
    const int64_t j_end = s.causal ? min((c + 1) * s.block, row + 1) : (c + 1) * s.block;
    for (int64_t j = c * s.block; j < j_end; ++j) {
      const float* kj = k + (base + j) * s.dim;
      const float p = expf(row_dot(qr, kj, s.dim, lane) * s.scale - li);
      const float ds = p * (row_dot(dor, v + (base + j) * s.dim, s.dim, lane) - di) * s.scale;
#pragma unroll
      for (int t = 0; t < kMaxPerLane; ++t) {
        const int64_t d = lane + 32 * t;
        if (d < s.dim) {
          dqr[t] += ds * kj[d];
          atomicAdd(dk + (base + j) * s.dim + d, ds * qr[t]);
          atomicAdd(dv + (base + j) * s.dim + d, p * dor[t]);
        }
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kMaxPerLane; ++t) {
    const int64_t d = lane + 32 * t;
    if (d < s.dim) dq[(base + row) * s.dim + d] = dqr[t];
  }
}

dim3 grid_for(const Shape& s) {
  return dim3(static_cast<unsigned>((s.seq + kWarpsPerBlock - 1) / kWarpsPerBlock),
              static_cast<unsigned>(s.batch * s.heads));
}

}  // namespace

// Returns cudaErrorInvalidValue for a head dim above 256 (the Python side would fall back).
extern "C" cudaError_t minispeed_sparse_attention_forward_cuda(
    const float* q, const float* k, const float* v, const int32_t* row_ptr, const int32_t* cols,
    float* out, float* lse, int64_t batch, int64_t heads, int64_t seq, int64_t dim, int64_t block,
    bool causal, float scale, cudaStream_t stream) {
  if (dim > 32 * kMaxPerLane || seq % block) return cudaErrorInvalidValue;
  const Shape s{batch, heads, seq, dim, block, causal, scale};
  sparse_forward_kernel<<<grid_for(s), 32 * kWarpsPerBlock, 0, stream>>>(q, k, v, row_ptr, cols,
                                                                          out, lse, s);
  return cudaGetLastError();
}

// dk and dv must be zeroed by the caller (they are accumulated with atomicAdd).
extern "C" cudaError_t minispeed_sparse_attention_backward_cuda(
    const float* q, const float* k, const float* v, const float* out, const float* dout,
    const float* lse, const int32_t* row_ptr, const int32_t* cols, float* dq, float* dk, float* dv,
    int64_t batch, int64_t heads, int64_t seq, int64_t dim, int64_t block, bool causal, float scale,
    cudaStream_t stream) {
  if (dim > 32 * kMaxPerLane || seq % block) return cudaErrorInvalidValue;
  const Shape s{batch, heads, seq, dim, block, causal, scale};
  sparse_backward_kernel<<<grid_for(s), 32 * kWarpsPerBlock, 0, stream>>>(
      q, k, v, out, dout, lse, row_ptr, cols, dq, dk, dv, s);
  return cudaGetLastError();
}
