// CPU optimizer steps: Adam/AdamW, Adagrad, Lion; fp32 masters, optional bf16/fp16 write-back.
// See cpu_optim.h and Note [SIMD paths of the optimizer kernels].
//
// Costs per element (bytes moved through memory, the floor of a step on a bandwidth-bound CPU):
//   Adam    reads p, g, m, v (16 B), writes p, m, v (12 B): 28 B (+2 B with a 16-bit write-back)
//   Adagrad reads p, g, sum (12 B), writes p, sum (8 B):   20 B (+2 B)
//   Lion    reads p, g, m (12 B), writes p, m (8 B):        20 B (+2 B)

#include "cpu_optim.h"

#include <algorithm>
#include <cmath>

namespace minispeed_offload {

namespace {

// ---- vector types: one lane, 8 lanes, 16 lanes -------------------------------------------------

struct ScalarVec {
  static constexpr int kWidth = 1;
  float v;
  static ScalarVec load(const float* p) { return {*p}; }
  static ScalarVec set1(float x) { return {x}; }
  void store(float* p) const { *p = v; }
  friend ScalarVec operator+(ScalarVec a, ScalarVec b) { return {a.v + b.v}; }
  friend ScalarVec operator-(ScalarVec a, ScalarVec b) { return {a.v - b.v}; }
  friend ScalarVec operator*(ScalarVec a, ScalarVec b) { return {a.v * b.v}; }
  friend ScalarVec operator/(ScalarVec a, ScalarVec b) { return {a.v / b.v}; }
  static ScalarVec sqrt(ScalarVec a) { return {std::sqrt(a.v)}; }
  // One rounding where the CPU has FMA (as torch's kernels do there), two where it has not.
  static ScalarVec fmadd(ScalarVec a, ScalarVec b, ScalarVec c) {
#if defined(__FMA__)
    return {std::fma(a.v, b.v, c.v)};
#else
    return {a.v * b.v + c.v};
#endif
  }
  static ScalarVec sign(ScalarVec a) {
    return {a.v > 0.0f ? 1.0f : (a.v < 0.0f ? -1.0f : (a.v == 0.0f ? 0.0f : a.v))};
  }
  void store_half(uint16_t* dst, HalfKind kind) const {
    *dst = kind == HalfKind::kBf16 ? minispeed::simd::f32_to_bf16_rne(v)
                                   : minispeed::simd::f32_to_fp16_rne(v);
  }
};

#if defined(MINISPEED_HAS_AVX2)
struct Avx2Vec {
  static constexpr int kWidth = 8;
  __m256 v;
  static Avx2Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Avx2Vec set1(float x) { return {_mm256_set1_ps(x)}; }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  friend Avx2Vec operator+(Avx2Vec a, Avx2Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
  friend Avx2Vec operator-(Avx2Vec a, Avx2Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
  friend Avx2Vec operator*(Avx2Vec a, Avx2Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
  friend Avx2Vec operator/(Avx2Vec a, Avx2Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
  static Avx2Vec sqrt(Avx2Vec a) { return {_mm256_sqrt_ps(a.v)}; }
  static Avx2Vec fmadd(Avx2Vec a, Avx2Vec b, Avx2Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static Avx2Vec sign(Avx2Vec a) {
    // +1 where a > 0, -1 where a < 0, a itself (0 or NaN) elsewhere: torch.sign's convention.
    const __m256 zero = _mm256_setzero_ps();
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 pos = _mm256_cmp_ps(a.v, zero, _CMP_GT_OQ);
    const __m256 neg = _mm256_cmp_ps(a.v, zero, _CMP_LT_OQ);
    __m256 r = _mm256_blendv_ps(a.v, one, pos);
    return {_mm256_blendv_ps(r, _mm256_set1_ps(-1.0f), neg)};
  }
  void store_half(uint16_t* dst, HalfKind kind) const {
    __m128i packed;
    if (kind == HalfKind::kFp16) {
      packed = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {
      packed = minispeed::simd::f32x8_to_bf16(v);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), packed);
  }
};
#endif

#if defined(MINISPEED_HAS_AVX512)
struct Avx512Vec {
  static constexpr int kWidth = 16;
  __m512 v;
  static Avx512Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Avx512Vec set1(float x) { return {_mm512_set1_ps(x)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  friend Avx512Vec operator+(Avx512Vec a, Avx512Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend Avx512Vec operator-(Avx512Vec a, Avx512Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend Avx512Vec operator*(Avx512Vec a, Avx512Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend Avx512Vec operator/(Avx512Vec a, Avx512Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
  static Avx512Vec sqrt(Avx512Vec a) { return {_mm512_sqrt_ps(a.v)}; }
  static Avx512Vec fmadd(Avx512Vec a, Avx512Vec b, Avx512Vec c) {
    return {_mm512_fmadd_ps(a.v, b.v, c.v)};
  }
  static Avx512Vec sign(Avx512Vec a) {
    const __m512 zero = _mm512_setzero_ps();
    const __mmask16 pos = _mm512_cmp_ps_mask(a.v, zero, _CMP_GT_OQ);
    const __mmask16 neg = _mm512_cmp_ps_mask(a.v, zero, _CMP_LT_OQ);
    __m512 r = _mm512_mask_blend_ps(pos, a.v, _mm512_set1_ps(1.0f));
    return {_mm512_mask_blend_ps(neg, r, _mm512_set1_ps(-1.0f))};
  }
  void store_half(uint16_t* dst, HalfKind kind) const {
    __m256i packed;
    if (kind == HalfKind::kFp16) {
      packed = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {
      packed = minispeed::simd::f32x16_to_bf16(v);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), packed);
  }
};
#endif

// ---- the three steps, each written once over a vector type --------------------------------------

// torch's lerp: start + w * (end - start) for w < 0.5, else end - (end - start) * (1 - w).
template <typename V>
inline V lerp(V start, V end, float weight) {
  if (weight < 0.5f) return V::fmadd(V::set1(weight), end - start, start);
  return end - (end - start) * V::set1(1.0f - weight);
}

template <typename V>
int64_t adam_range(const Segment& seg, int64_t i, int64_t end, const AdamScalars& s,
                   HalfKind half) {
  const V wd = V::set1(s.lr_wd_l2), decay = V::set1(s.decay), beta2 = V::set1(s.beta2);
  const V c2 = V::set1(s.one_minus_beta2), bc2 = V::set1(s.bias_correction2_sqrt);
  const V eps = V::set1(s.eps), neg_step = V::set1(s.neg_step_size);
  for (; i + V::kWidth <= end; i += V::kWidth) {
    V g = V::load(seg.grad + i);
    V p = V::load(seg.param + i);
    if (s.lr_wd_l2 != 0.0f) g = V::fmadd(p, wd, g);  // Adam: grad.add(param, alpha=wd)
    if (s.decay != 1.0f) p = p * decay;               // AdamW: param.mul_(1 - lr * wd)
    const V m = lerp(V::load(seg.state0 + i), g, s.one_minus_beta1);
    const V v = V::fmadd(c2 * g, g, V::load(seg.state1 + i) * beta2);  // v.mul_(b2).addcmul_(g, g, 1 - b2)
    const V denom = V::sqrt(v) / bc2 + eps;       // (v.sqrt() / sqrt(bc2)).add_(eps)
    p = p + neg_step * m / denom;                 // param.addcdiv_(m, denom, -step_size)
    m.store(seg.state0 + i);
    v.store(seg.state1 + i);
    p.store(seg.param + i);
    if (half != HalfKind::kNone) p.store_half(seg.half + i, half);
  }
  return i;
}

template <typename V>
int64_t adagrad_range(const Segment& seg, int64_t i, int64_t end, const AdagradScalars& s,
                      HalfKind half) {
  const V wd = V::set1(s.weight_decay), eps = V::set1(s.eps), neg_clr = V::set1(s.neg_clr);
  const V one = V::set1(1.0f);
  for (; i + V::kWidth <= end; i += V::kWidth) {
    V g = V::load(seg.grad + i);
    V p = V::load(seg.param + i);
    if (s.weight_decay != 0.0f) g = V::fmadd(p, wd, g);
    const V sum = V::fmadd(one * g, g, V::load(seg.state0 + i));  // sum.addcmul_(g, g, value=1)
    const V std_dev = V::sqrt(sum) + eps;
    p = p + neg_clr * g / std_dev;                         // param.addcdiv_(g, std, -clr)
    sum.store(seg.state0 + i);
    p.store(seg.param + i);
    if (half != HalfKind::kNone) p.store_half(seg.half + i, half);
  }
  return i;
}

template <typename V>
int64_t lion_range(const Segment& seg, int64_t i, int64_t end, const LionScalars& s,
                   HalfKind half) {
  const V b1 = V::set1(s.beta1), c1 = V::set1(s.one_minus_beta1);
  const V b2 = V::set1(s.beta2), c2 = V::set1(s.one_minus_beta2);
  const V decay = V::set1(s.decay), neg_lr = V::set1(s.neg_lr);
  for (; i + V::kWidth <= end; i += V::kWidth) {
    const V g = V::load(seg.grad + i);
    V p = V::load(seg.param + i);
    V m = V::load(seg.state0 + i);
    const V update = V::sign(m * b1 + g * c1);  // sign(b1 m + (1 - b1) g)
    if (s.decay != 1.0f) p = p * decay;
    p = V::fmadd(update, neg_lr, p);            // param.add_(update, alpha=-lr)
    m = V::fmadd(g, c2, m * b2);                // exp_avg.mul_(b2).add_(g, alpha=1 - b2)
    m.store(seg.state0 + i);
    p.store(seg.param + i);
    if (half != HalfKind::kNone) p.store_half(seg.half + i, half);
  }
  return i;
}

// Runs range<V> over [begin, end) at the chosen width, then the scalar path on the tail.
template <template <typename> class Range, typename Scalars>
void dispatch(const Segment& seg, int64_t begin, int64_t end, const Scalars& s, HalfKind half,
              Simd simd) {
  int64_t i = begin;
#if defined(MINISPEED_HAS_AVX512)
  if (simd == Simd::kAvx512) i = Range<Avx512Vec>::run(seg, i, end, s, half);
#endif
#if defined(MINISPEED_HAS_AVX2)
  if (simd == Simd::kAvx2) i = Range<Avx2Vec>::run(seg, i, end, s, half);
#endif
  (void)simd;
  Range<ScalarVec>::run(seg, i, end, s, half);
}

template <typename V>
struct AdamRange {
  static int64_t run(const Segment& g, int64_t i, int64_t e, const AdamScalars& s, HalfKind h) {
    return adam_range<V>(g, i, e, s, h);
  }
};
template <typename V>
struct AdagradRange {
  static int64_t run(const Segment& g, int64_t i, int64_t e, const AdagradScalars& s, HalfKind h) {
    return adagrad_range<V>(g, i, e, s, h);
  }
};
template <typename V>
struct LionRange {
  static int64_t run(const Segment& g, int64_t i, int64_t e, const LionScalars& s, HalfKind h) {
    return lion_range<V>(g, i, e, s, h);
  }
};

// Cuts every segment into chunks of `grain` elements and runs them as ONE OpenMP loop, so a
// model of a thousand small tensors costs one parallel region, not a thousand.
template <template <typename> class Range, typename Scalars>
void run_segments(const std::vector<Segment>& segments, const Scalars& s, HalfKind half, Simd simd,
                  int64_t grain) {
  struct Task {
    int64_t segment, begin, end;
  };
  std::vector<Task> tasks;
  grain = std::max<int64_t>(grain, 64);
  for (size_t k = 0; k < segments.size(); ++k) {
    for (int64_t b = 0; b < segments[k].n; b += grain) {
      tasks.push_back({static_cast<int64_t>(k), b, std::min(segments[k].n, b + grain)});
    }
  }
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  // Dynamic: on a shared machine a descheduled thread's chunks go to the others instead of
  // stalling the step (a static split waits for the slowest thread).
#pragma omp parallel for schedule(dynamic, 1) if (n_tasks > 1)
  for (int64_t t = 0; t < n_tasks; ++t) {
    const Task& task = tasks[t];
    dispatch<Range>(segments[task.segment], task.begin, task.end, s, half, simd);
  }
}

}  // namespace

void adam_step(const std::vector<Segment>& segments, const AdamScalars& s, HalfKind half,
               Simd simd, int64_t grain) {
  run_segments<AdamRange>(segments, s, half, simd, grain);
}

void adagrad_step(const std::vector<Segment>& segments, const AdagradScalars& s, HalfKind half,
                  Simd simd, int64_t grain) {
  run_segments<AdagradRange>(segments, s, half, simd, grain);
}

void lion_step(const std::vector<Segment>& segments, const LionScalars& s, HalfKind half, Simd simd,
               int64_t grain) {
  run_segments<LionRange>(segments, s, half, simd, grain);
}

}  // namespace minispeed_offload
