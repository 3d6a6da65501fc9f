// Gradient-compression kernels on raw pointers: 1-bit sign packing, int8/int4 block quantization,
// top-k selection. No torch headers here, so the kernel files compile in seconds; bindings.cpp is
// the only translation unit that includes <torch/extension.h>.
//
// Wire formats (the Python reference in minispeed/comm/compression/reference.py is the spec):
//
//   sign bits   element i -> byte i / 8, bit i % 8 (LSB first); bit = 1 iff x[i] < 0 (so -0.0 and
//               NaN count as positive); bits past n in the last byte are 0.
//               scales[c] = mean |x| over chunk c = [c * chunk, min((c + 1) * chunk, n)).
//   int8 block  q[i] = clamp(round_half_even(x[i] / s_b), -127, 127) stored as a two's-complement
//               byte; s_b = absmax(block b) / 127 (s_b = 0 for an all-zero block, then q = 0).
//   int4 block  as int8 with qmax = 7; element 2j in the low nibble of byte j, 2j+1 in the high
//               nibble, each a two's-complement nibble; a trailing odd element leaves the high
//               nibble 0.
//   top-k       the k largest |x[i]|; among equal magnitudes the lower index wins; indices are
//               returned ascending (int32) with their signed values.
//
// Note [SIMD paths]: each kernel has a scalar path and, when the build defines
// MINISPEED_SIMD_AVX2 or MINISPEED_SIMD_AVX512 (set by minispeed.core.op_builder from the CPU's
// flags; tested as MINISPEED_HAS_AVX2 / MINISPEED_HAS_AVX512 from minispeed/simd.h), AVX2 and
// AVX-512 paths. Every compiled path can be chosen at run time (`simd` argument),
// so one build on an AVX-512 machine lets the tests compare all three against the reference.
// The paths must produce bit-identical packed bytes; only the float sums behind the sign scales
// may differ in the last bits (they are accumulated in double to keep that difference ~1e-16).

#pragma once

#include <cstdint>

#include "minispeed/simd.h"  // Simd, best_compiled_simd, MINISPEED_HAS_* (core/csrc/include)

namespace minispeed_compression {

using minispeed::simd::best_compiled_simd;
using minispeed::simd::Simd;

// ---- 1-bit sign compression ----------------------------------------------------------------
// x: n floats; bits: ceil(n / 8) bytes; scales: ceil(n / chunk) floats.
void sign_pack(const float* x, int64_t n, int64_t chunk, uint8_t* bits, float* scales, Simd simd);
// out[i] = bit(i) ? -scales[i / chunk] : scales[i / chunk].
void sign_unpack(const uint8_t* bits, const float* scales, int64_t n, int64_t chunk, float* out,
                 Simd simd);

// ---- block quantization -----------------------------------------------------------------------
// x: n floats; q: n bytes (bits = 8) or ceil(n / 2) bytes (bits = 4); scales: ceil(n / block).
// For bits = 4, block must be even so that no byte straddles two blocks.
void quantize_blocks(const float* x, int64_t n, int64_t block, int bits, uint8_t* q, float* scales,
                     Simd simd);
void dequantize_blocks(const uint8_t* q, const float* scales, int64_t n, int64_t block, int bits,
                       float* out, Simd simd);

// ---- top-k sparsification ---------------------------------------------------------------------
// Writes k values and ascending indices. Returns 0, or -1 when x holds a NaN (no order exists).
int topk_select(const float* x, int64_t n, int64_t k, float* values, int32_t* indices, Simd simd);
// out[indices[j]] += values[j] for j < k, in order of j. Returns -1 - j for the first index j
// outside [0, n) and then writes nothing; else 0.
int64_t sparse_accumulate(float* out, int64_t n, const float* values, const int32_t* indices,
                          int64_t k);

#if defined(MINISPEED_WITH_CUDA)
// CUDA launchers (compression_cuda.cu): same formats, device pointers, queued on `stream`.
// The sign scales are reduced in double on the device too.
void sign_pack_cuda(const float* x, int64_t n, int64_t chunk, uint8_t* bits, float* scales,
                    void* stream);
void sign_unpack_cuda(const uint8_t* bits, const float* scales, int64_t n, int64_t chunk,
                      float* out, void* stream);
void quantize_blocks_cuda(const float* x, int64_t n, int64_t block, int bits, uint8_t* q,
                          float* scales, void* stream);
void dequantize_blocks_cuda(const uint8_t* q, const float* scales, int64_t n, int64_t block,
                            int bits, float* out, void* stream);
void sparse_accumulate_cuda(float* out, int64_t n, const float* values, const int32_t* indices,
                            int64_t k, void* stream);
#endif

}  // namespace minispeed_compression
