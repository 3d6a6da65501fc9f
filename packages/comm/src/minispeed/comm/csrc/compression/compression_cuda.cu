// CUDA pack/unpack kernels for gradient compression: the formats of compression.h, on the device.
//
// Launch shapes (T = 256 threads per block):
//   sign bits        one thread per element; each warp ballots its 32 signs into 4 bytes.
//   sign scales      one block per chunk; a block-wide sum of |x| in double.
//   sign unpack      one thread per element.
//   quantize         one block per quantization block: block-wide absmax, then one thread per
//                    element (int8) or per element pair (int4, one output byte each).
//   dequantize       one thread per element.
//   sparse add       one thread per (value, index); indices are unique per call, so the atomics
//                    never collide and the result does not depend on scheduling.
// Divisions use __fdiv_rn and rounding uses rintf (half to even) so results match the CPU paths
// bit for bit even when the build passes --use_fast_math.

#include <cuda_runtime.h>

#include <cstdint>

#ifndef MINISPEED_WITH_CUDA
#define MINISPEED_WITH_CUDA  // only the CUDA build compiles this file; declare its launchers
#endif
#include "compression.h"

namespace minispeed_compression {
namespace {

constexpr int kThreads = 256;

inline unsigned blocks_for(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

// Sum of `v` over the block; every thread must call it. Result valid in thread 0.
template <typename T, typename Op>
__device__ T block_reduce(T v, Op op) {
  __shared__ T smem[kThreads];
  smem[threadIdx.x] = v;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) smem[threadIdx.x] = op(smem[threadIdx.x], smem[threadIdx.x + stride]);
    __syncthreads();
  }
  return smem[0];
}

struct AddD {
  __device__ double operator()(double a, double b) const { return a + b; }
};
// A max that keeps NaN (fmaxf drops it): See Note [non-finite blocks] in quantize_cpu.cpp.
struct MaxF {
  __device__ float operator()(float a, float b) const {
    return (isnan(a) || isnan(b)) ? __int_as_float(0x7fc00000) : fmaxf(a, b);
  }
};

__global__ void sign_bits_kernel(const float* __restrict__ x, int64_t n, uint8_t* __restrict__ bits) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  // Every lane votes (also those past n, as "positive") so the full-warp ballot is legal.
  const unsigned votes = __ballot_sync(0xffffffffu, i < n && x[i] < 0.0f);
  const int lane = threadIdx.x & 31;
  const int64_t byte = (i - lane) / 8 + lane;  // lanes 0..3 write the warp's 4 bytes
  if (lane < 4 && byte < (n + 7) / 8) bits[byte] = static_cast<uint8_t>(votes >> (8 * lane));
}

__global__ void sign_scales_kernel(const float* __restrict__ x, int64_t n, int64_t chunk,
                                   float* __restrict__ scales) {
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * chunk;
  const int64_t end = begin + chunk < n ? begin + chunk : n;
  double sum = 0.0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) sum += fabs(static_cast<double>(x[i]));
  sum = block_reduce(sum, AddD{});
  if (threadIdx.x == 0) scales[blockIdx.x] = static_cast<float>(sum / static_cast<double>(end - begin));
}

__global__ void sign_unpack_kernel(const uint8_t* __restrict__ bits, const float* __restrict__ scales,
                                   int64_t n, int64_t chunk, float* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float s = scales[i / chunk];
  out[i] = ((bits[i >> 3] >> (i & 7)) & 1u) ? -s : s;
}

__device__ int quantize_one(float x, float s, int qmax) {
  if (s == 0.0f) return 0;
  const float r0 = rintf(__fdiv_rn(x, s));
  if (isnan(r0)) return 0;  // a NaN block, a NaN element, or +-inf / inf: code 0
  const float r = fminf(fmaxf(r0, static_cast<float>(-qmax)), static_cast<float>(qmax));
  return static_cast<int>(r);
}

__global__ void quantize_kernel(const float* __restrict__ x, int64_t n, int64_t block, int bits,
                                uint8_t* __restrict__ q, float* __restrict__ scales) {
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * block;
  const int64_t end = begin + block < n ? begin + block : n;
  const int qmax = bits == 8 ? 127 : 7;
  float m = 0.0f;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) m = MaxF{}(m, fabsf(x[i]));
  const float s = __fdiv_rn(block_reduce(m, MaxF{}), static_cast<float>(qmax));
  if (threadIdx.x == 0) scales[blockIdx.x] = s;
  if (bits == 8) {
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
      q[i] = static_cast<uint8_t>(static_cast<int8_t>(quantize_one(x[i], s, qmax)));
    }
    return;
  }
  // int4: begin is even (block is even), so pair p covers elements begin + 2p and begin + 2p + 1.
  for (int64_t i = begin + 2 * threadIdx.x; i < end; i += 2 * kThreads) {
    const int lo = quantize_one(x[i], s, qmax);
    const int hi = i + 1 < end ? quantize_one(x[i + 1], s, qmax) : 0;
    q[i / 2] = static_cast<uint8_t>((lo & 0xF) | ((hi & 0xF) << 4));
  }
}

__global__ void dequantize_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scales,
                                  int64_t n, int64_t block, int bits, float* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  int v;
  if (bits == 8) {
    v = static_cast<int8_t>(q[i]);
  } else {
    const unsigned nib = (i & 1) ? (q[i / 2] >> 4) : (q[i / 2] & 0xFu);
    v = static_cast<int>(nib ^ 8u) - 8;  // sign-extend the two's-complement nibble
  }
  out[i] = static_cast<float>(v) * scales[i / block];
}

__global__ void sparse_accumulate_kernel(float* __restrict__ out, int64_t n,
                                         const float* __restrict__ values,
                                         const int32_t* __restrict__ indices, int64_t k) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= k) return;
  const int64_t i = indices[j];
  if (i >= 0 && i < n) atomicAdd(out + i, values[j]);
}

}  // namespace

void sign_pack_cuda(const float* x, int64_t n, int64_t chunk, uint8_t* bits, float* scales,
                    void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  sign_bits_kernel<<<blocks_for(n), kThreads, 0, s>>>(x, n, bits);
  sign_scales_kernel<<<static_cast<unsigned>((n + chunk - 1) / chunk), kThreads, 0, s>>>(x, n, chunk,
                                                                                       scales);
}

void sign_unpack_cuda(const uint8_t* bits, const float* scales, int64_t n, int64_t chunk,
                      float* out, void* stream) {
  sign_unpack_kernel<<<blocks_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      bits, scales, n, chunk, out);
}

void quantize_blocks_cuda(const float* x, int64_t n, int64_t block, int bits, uint8_t* q,
                          float* scales, void* stream) {
  quantize_kernel<<<static_cast<unsigned>((n + block - 1) / block), kThreads, 0,
                    static_cast<cudaStream_t>(stream)>>>(x, n, block, bits, q, scales);
}

void dequantize_blocks_cuda(const uint8_t* q, const float* scales, int64_t n, int64_t block,
                            int bits, float* out, void* stream) {
  dequantize_kernel<<<blocks_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      q, scales, n, block, bits, out);
}

void sparse_accumulate_cuda(float* out, int64_t n, const float* values, const int32_t* indices,
                            int64_t k, void* stream) {
  sparse_accumulate_kernel<<<blocks_for(k), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      out, n, values, indices, k);
}

}  // namespace minispeed_compression
