// A memory-bound fp32 linear for decode: y (M, N) = x (M, K) @ Wᵀ + b for a few rows M <= 8,
// part of the inference_kernels extension (kernels.cpp's module calls register_linear).
//
// Note [reading the weights once at full bandwidth]
// A decode step multiplies one row per sequence (M = batch, often 1) by every weight of the model,
// so it moves 4 N K bytes of weight per linear against 2 M N K FLOPs: at M <= 8 the time is the
// time to stream the weight from memory once. A GEMM library's small-M path packs the weight into
// panels first or re-reads it per row (torch 2.13's F.linear ran at 0.3-0.5 of the copy bandwidth
// at M = 8 here; benchmarks/inference_decode.py measures it), so this kernel reads each weight
// element exactly once, in the layout it already has, and keeps all M rows' partial sums in
// registers while it does:
//
// - `nk` (nn.Linear's (N, K), contiguous): NR output rows at a time, a dot product over K per
//   (row, m) in vector lanes, reduced once at the end. Reads NR contiguous weight rows side by side.
// - `kn` (K, N) contiguous, i.e. W is a transposed view (Hugging Face's Conv1D weight, shared by
//   injection): a tile of NT columns by KB rows of the weight at a time; each weight vector is
//   multiplied by all M broadcast inputs (one fused multiply-add each) into M × NT/width partial
//   sums that stay in registers over the KB rows and live in y between row chunks. Reads KB
//   row segments side by side.
//
// Numerics: each output is summed in a fixed order that depends on the layout and SIMD level only
// (not on the thread count or M): kn adds over k in order, one fused multiply-add per k; nk keeps
// width partial sums over k, then reduces them. Both agree with F.linear to fp32 rounding.
// Threads split the output columns (N) into one contiguous range each; see Note [threads only
// when the weight is large] below. See Note [raw pointers, no torch headers] in kernels.cpp: the
// wrapper (minispeed.inference.kernels.linear) checks shapes, strides and M <= kMaxRows.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "vec.h"  // Vec

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace minispeed_linear {

constexpr int kMaxRows = 8;  // M handled in one pass over the weight

using minispeed_inference::Vec;  // one register of fp32 lanes at the build's level (vec.h)
constexpr int kW = Vec::kWidth;

// Note [prefetch the next block]: both kernels walk the weight in blocks (nk: NR rows side by
// side; kn: KB rows, tile by tile), and the hardware prefetcher, which follows each stream only
// after it has seen it advance, left the rows' fused multiply-adds waiting on memory: 0.5-0.7 of
// the copy bandwidth at M = 8 for nn.Linear's layout, 0.6 for a (3072, 768) Conv1D weight. So each
// step also asks for the same place in the block the kernel reads next (nk: the next NR rows; kn:
// the next KB rows), one prefetch per 64-byte line into L2, about one block ahead of use: 0.8-1.0
// of the copy bandwidth at M = 8, and M = 1 at or above it (measured with prototypes of both
// kernels on a 450 MB working set; docs/packages/inference.md has the decode figures). A
// prefetch past the end of the weight is a hint, never a fault.
constexpr int64_t kLine = 16;  // floats per 64-byte cache line
inline void prefetch(const float* p) { __builtin_prefetch(p, 0, 2); }

// ---- nk: W is (N, K) row-major --------------------------------------------------------------

// Note [several weights, one pass over x]: LLaMA's q, k and v read the same input, and so do
// its gate and up; `linear_many` runs one call (one GIL release, one thread team) over several
// nn.Linear weights into their own outputs, and `swiglu` reads the gate's and the up's row n
// side by side (P = 2 weights below) and writes silu(gate · x) · (up · x) straight away, so the
// (M, N) gate and up activations are never written or read back. Each weight row's sum is the
// one `linear` makes (same order), so the pre-activations are bitwise those of two calls.

// P weights' sums for one output (row n of each, input m) -> the stored value: P = 1 is the plain
// linear (bias added), P = 2 the SwiGLU product silu(g) · u (each with its bias).
template <int P>
inline float finish(const float* s, const float* const* bias, int64_t n);
template <>
inline float finish<1>(const float* s, const float* const* bias, int64_t n) {
  return s[0] + (bias[0] ? bias[0][n] : 0.f);
}
template <>
inline float finish<2>(const float* s, const float* const* bias, int64_t n) {
  const float g = s[0] + (bias[0] ? bias[0][n] : 0.f);
  const float u = s[1] + (bias[1] ? bias[1][n] : 0.f);
  return g / (1.f + std::exp(-g)) * u;
}

// Rows [n0, n1) of y for M inputs, NR rows of each of the P weights at a time (n1 - n0 a multiple
// of NR).
template <int M, int NR, int P>
void nk_rows(const float* x, const float* const* w, const float* const* bias, float* y, int64_t K,
             int64_t N, int64_t n0, int64_t n1) {
  const int64_t kv = K / kW * kW;  // the vector part of K; the rest is the scalar tail
  for (int64_t n = n0; n < n1; n += NR) {
    Vec acc[P][NR][M];
    for (int p = 0; p < P; ++p)
      for (int r = 0; r < NR; ++r)
        for (int m = 0; m < M; ++m) acc[p][r][m] = Vec::zero();
    for (int64_t k = 0; k < kv; k += kW) {
      if (k % kLine == 0)  // See Note [prefetch the next block].
        for (int p = 0; p < P; ++p)
          for (int r = 0; r < NR; ++r) prefetch(w[p] + (n + NR + r) * K + k);
      Vec xv[M];
      for (int m = 0; m < M; ++m) xv[m] = Vec::load(x + m * K + k);
      for (int p = 0; p < P; ++p)
        for (int r = 0; r < NR; ++r) {
          const Vec wv = Vec::load(w[p] + (n + r) * K + k);
          for (int m = 0; m < M; ++m) acc[p][r][m].fma(wv, xv[m]);
        }
    }
    for (int r = 0; r < NR; ++r) {
      for (int m = 0; m < M; ++m) {
        float s[P];
        for (int p = 0; p < P; ++p) {
          const float* wr = w[p] + (n + r) * K;
          s[p] = acc[p][r][m].sum();
          for (int64_t k = kv; k < K; ++k) s[p] += x[m * K + k] * wr[k];
        }
        y[m * N + n + r] = finish<P>(s, bias, n + r);
      }
    }
  }
}

template <int M, int P>
void nk_range_of(const float* x, const float* const* w, const float* const* bias, float* y,
                 int64_t K, int64_t N, int64_t n0, int64_t n1) {
  // Registers: P · NR · M accumulators + M inputs + one weight vector must fit in 32 (16 for AVX2).
  constexpr int NR1 = M <= 2 ? 4 : (M <= 4 ? 3 : 2);
  constexpr int NR = P == 1 ? NR1 : (NR1 / P > 0 ? NR1 / P : 1);
  const int64_t full = n0 + (n1 - n0) / NR * NR;
  nk_rows<M, NR, P>(x, w, bias, y, K, N, n0, full);
  nk_rows<M, 1, P>(x, w, bias, y, K, N, full, n1);
}

template <int M>
void nk_range(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N,
              int64_t n0, int64_t n1) {
  nk_range_of<M, 1>(x, &w, &bias, y, K, N, n0, n1);
}

template <int M>
void glu_range(const float* x, const float* const* w, const float* const* bias, float* y,
               int64_t K, int64_t N, int64_t n0, int64_t n1) {
  nk_range_of<M, 2>(x, w, bias, y, K, N, n0, n1);
}

// ---- kn: W is (K, N) row-major (the weight argument is its transposed view) ------------------

// Columns [n0, n1) of y, NV vectors (NT = NV · width columns) by KB weight rows at a time
// (n1 - n0 a multiple of NT). y holds the partial sums between row chunks.
template <int M, int NV, int KB>
void kn_tiles(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n0,
              int64_t n1) {
  constexpr int NT = NV * kW;
  for (int64_t k0 = 0; k0 < K; k0 += KB) {
    const int64_t k1 = std::min<int64_t>(K, k0 + KB);
    for (int64_t n = n0; n < n1; n += NT) {
      Vec acc[M][NV];
      for (int m = 0; m < M; ++m)
        for (int j = 0; j < NV; ++j)
          acc[m][j] = k0 == 0 ? Vec::zero() : Vec::load(y + m * N + n + j * kW);
      for (int64_t k = k0; k < k1; ++k) {
        for (int j = 0; j < NT; j += kLine) prefetch(w + (k + KB) * N + n + j);  // the next block
        Vec wv[NV];
        for (int j = 0; j < NV; ++j) wv[j] = Vec::load(w + k * N + n + j * kW);
        for (int m = 0; m < M; ++m) {
          const Vec xb = Vec::splat(x[m * K + k]);
          for (int j = 0; j < NV; ++j) acc[m][j].fma(xb, wv[j]);
        }
      }
      for (int m = 0; m < M; ++m)
        for (int j = 0; j < NV; ++j) acc[m][j].store(y + m * N + n + j * kW);
    }
  }
}

template <int M>
void kn_range(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N,
              int64_t n0, int64_t n1) {
  // M = 1: 4 vectors wide; more rows: 2 vectors (2 M accumulators); 16 weight rows deep.
  constexpr int NV = M == 1 ? 4 : 2, KB = 16, NT = NV * kW;
  const int64_t full = n0 + (n1 - n0) / NT * NT;
  kn_tiles<M, NV, KB>(x, w, y, K, N, n0, full);
  for (int64_t n = full; n < n1; ++n) {  // the last < NT columns: one at a time, in k order
    for (int m = 0; m < M; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * w[k * N + n];
      y[m * N + n] = s;
    }
  }
  if (bias) {
    for (int m = 0; m < M; ++m)
      for (int64_t n = n0; n < n1; ++n) y[m * N + n] += bias[n];
  }
}

// ---- dispatch -------------------------------------------------------------------------------

using RangeFn = void (*)(const float*, const float*, const float*, float*, int64_t, int64_t,
                         int64_t, int64_t);

#define MINISPEED_ROWS_TABLE(fn) \
  {fn<1>, fn<2>, fn<3>, fn<4>, fn<5>, fn<6>, fn<7>, fn<8>}

const RangeFn kNk[kMaxRows] = MINISPEED_ROWS_TABLE(nk_range);
const RangeFn kKn[kMaxRows] = MINISPEED_ROWS_TABLE(kn_range);

// Note [threads only when the weight is large]: a team wake-up costs microseconds (far more on a
// loaded machine), so threads start only for weights of 2^16 elements or more (a 256 KiB read);
// each thread takes one contiguous range of output columns, a multiple of 64 so that no two
// threads write into one cache line of y.
inline bool big_weight(int64_t n, int64_t k) { return n >= 128 && n * k >= (int64_t{1} << 16); }

// This thread's range [n0, n1) of n output columns (all of them outside a parallel region).
inline void my_columns(int64_t n, int64_t* n0, int64_t* n1) {
  *n0 = 0;
  *n1 = n;
#if defined(_OPENMP)
  const int64_t parts = omp_get_num_threads(), me = omp_get_thread_num();
  const int64_t per = ((n + parts - 1) / parts + 63) / 64 * 64;
  *n0 = std::min(n, me * per);
  *n1 = std::min(n, *n0 + per);
#endif
}

template <typename T>
const T* cptr(uintptr_t p) {
  return reinterpret_cast<const T*>(p);
}

void linear(uintptr_t x, uintptr_t w, uintptr_t bias, uintptr_t y, int64_t m, int64_t n,
            int64_t k, bool kn) {
  pybind11::gil_scoped_release nogil;
  const RangeFn fn = (kn ? kKn : kNk)[m - 1];
#pragma omp parallel if (big_weight(n, k))
  {
    int64_t n0, n1;
    my_columns(n, &n0, &n1);
    if (n0 < n1)
      fn(cptr<float>(x), cptr<float>(w), cptr<float>(bias), reinterpret_cast<float*>(y), k, n, n0,
         n1);
  }
}

// Several (N_i, K) weights over one x, each into its own y_i (M, N_i); bias pointers may be 0.
// See Note [several weights, one pass over x].
void linear_many(uintptr_t x, const std::vector<uintptr_t>& w, const std::vector<uintptr_t>& bias,
                 const std::vector<uintptr_t>& y, const std::vector<int64_t>& n, int64_t m,
                 int64_t k) {
  pybind11::gil_scoped_release nogil;
  const RangeFn fn = kNk[m - 1];
  int64_t total = 0;
  for (int64_t ni : n) total += ni;
#pragma omp parallel if (big_weight(total, k))
  for (size_t i = 0; i < w.size(); ++i) {
    int64_t n0, n1;
    my_columns(n[i], &n0, &n1);
    if (n0 < n1)
      fn(cptr<float>(x), cptr<float>(w[i]), cptr<float>(bias[i]), reinterpret_cast<float*>(y[i]),
         k, n[i], n0, n1);
  }
}

using GluFn = void (*)(const float*, const float* const*, const float* const*, float*, int64_t,
                       int64_t, int64_t, int64_t);
const GluFn kGlu[kMaxRows] = MINISPEED_ROWS_TABLE(glu_range);

// y (M, N) = silu(x @ gateᵀ + bg) · (x @ upᵀ + bu), gate and up (N, K) contiguous.
void swiglu(uintptr_t x, uintptr_t gate, uintptr_t up, uintptr_t bg, uintptr_t bu, uintptr_t y,
            int64_t m, int64_t n, int64_t k) {
  pybind11::gil_scoped_release nogil;
  const float* w[2] = {cptr<float>(gate), cptr<float>(up)};
  const float* b[2] = {cptr<float>(bg), cptr<float>(bu)};
#pragma omp parallel if (big_weight(2 * n, k))
  {
    int64_t n0, n1;
    my_columns(n, &n0, &n1);
    if (n0 < n1) kGlu[m - 1](cptr<float>(x), w, b, reinterpret_cast<float*>(y), k, n, n0, n1);
  }
}

}  // namespace minispeed_linear

// Called from kernels.cpp's PYBIND11_MODULE: the one module of the inference_kernels extension.
void register_linear(pybind11::module_& m) {
  m.attr("linear_max_rows") = minispeed_linear::kMaxRows;
  m.def("linear", &minispeed_linear::linear,
        "y (M, N) = x (M, K) @ Wᵀ + b for M <= linear_max_rows; W (N, K) or, kn=True, its "
        "(K, N) storage (raw pointers; see minispeed.inference.kernels.linear)");
  m.def("linear_many", &minispeed_linear::linear_many,
        "y_i (M, N_i) = x (M, K) @ W_iᵀ + b_i for several (N_i, K) weights in one call (raw "
        "pointers; see minispeed.inference.kernels.linear_many)");
  m.def("swiglu", &minispeed_linear::swiglu,
        "y (M, N) = silu(x @ gateᵀ + bg) * (x @ upᵀ + bu) (raw pointers; see "
        "minispeed.inference.kernels.swiglu)");
}
