// CPU optimizer steps (Adam/AdamW, Adagrad, Lion) on raw fp32 pointers, many tensors per call.
//
// No torch or pybind11 headers here: this file and cpu_optim.cpp compile in seconds, and
// binding/offload_binding.cpp is the only translation unit that talks to Python. The Python
// wrapper (minispeed.offload.cpu_optim) checks dtypes, devices, contiguity and sizes before it
// passes a pointer here.
//
// Note [SIMD paths of the optimizer kernels]
// Each step is written once, as a template over a small vector type (ScalarVec: 1 lane,
// Avx2Vec: 8 lanes, Avx512Vec: 16 lanes). The build defines MINISPEED_SIMD_AVX2 or
// MINISPEED_SIMD_AVX512 (chosen by minispeed.core.op_builder from the CPU's flags) to compile the
// wider paths; every compiled path can be chosen at run time (`simd` argument), so one build lets
// the tests compare all of them. Tails (n not a multiple of the width) run the scalar path.
//
// Note [bit-equal to torch.optim, but for sqrt]
// The arithmetic follows torch.optim's single-tensor loops operation by operation: the same order
// of roundings, constants rounded to fp32 the way torch rounds a Python scalar, and a fused
// multiply-add exactly where torch's CPU kernels use one (add with alpha, lerp, addcmul) and
// nowhere else (the build passes -ffp-contract=off so the compiler fuses nothing by itself).
// One difference remains: torch's CPU sqrt goes through MKL's vector math, which is accurate to
// about 1 ulp but not correctly rounded, while ours is the IEEE sqrt. So a step differs from
// torch's by at most an ulp or so on some elements, and 100 steps stay within ~1e-7 of the
// parameters' scale (the tests hold us to 1e-6).

#pragma once

#include <cstdint>
#include <vector>

#include "minispeed/simd.h"  // Simd, best_compiled_simd, the 16-bit conversions (core/csrc/include)

namespace minispeed_offload {

using minispeed::simd::best_compiled_simd;
using minispeed::simd::Simd;

// What the fused write-back stores next to the fp32 master: nothing, bf16 (RNE) or fp16 (RNE).
enum class HalfKind : int { kNone = 0, kBf16 = 1, kFp16 = 2 };

// One tensor of a multi-tensor step: n elements at each pointer (state pointers unused by an
// optimizer that has fewer states are 0). `half` is 0 when there is no write-back.
struct Segment {
  float* param;
  const float* grad;
  float* state0;  // Adam: exp_avg; Adagrad: sum; Lion: exp_avg
  float* state1;  // Adam: exp_avg_sq
  uint16_t* half;
  int64_t n;
};

struct AdamScalars {
  float lr_wd_l2;     // weight_decay for L2 (Adam), 0 otherwise: g += wd * p
  float decay;        // 1 - lr * weight_decay for AdamW (decoupled), 1 otherwise: p *= decay
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^t)
};

struct AdagradScalars {
  float weight_decay;  // g += wd * p
  float eps;
  float neg_clr;  // -lr / (1 + (t - 1) * lr_decay)
};

struct LionScalars {
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float decay;   // 1 - lr * weight_decay
  float neg_lr;  // -lr
};

// Each runs every segment in one OpenMP loop over chunks of `grain` elements.
void adam_step(const std::vector<Segment>& segments, const AdamScalars& s, HalfKind half,
               Simd simd, int64_t grain);
void adagrad_step(const std::vector<Segment>& segments, const AdagradScalars& s, HalfKind half,
                  Simd simd, int64_t grain);
void lion_step(const std::vector<Segment>& segments, const LionScalars& s, HalfKind half, Simd simd,
               int64_t grain);

}  // namespace minispeed_offload
