// Block-sparse attention on the CPU, fp32, forward and backward: part of the inference_kernels
// extension (kernels.cpp's module calls register_sparse_attention; one JIT build per machine).
//
// Shapes: q, k, v, out, dout, dq, dk, dv are (B, H, T, D) contiguous; lse is (B, H, T). The
// layout arrives as per-head CSR over blocks: row_ptr (H, NB + 1) int32 offsets into cols (int32
// key-block ids, sorted per row). Only kept blocks are touched, so work and reads are
// density x dense: 4 T^2 D density FLOPs per (batch, head) forward, 2.5 times that backward.
// The reference (minispeed/inference/sparse/reference.py) is dense attention under the expanded
// mask; the tests compare both, values and gradients.
//
// Note [tiles as small matrix products]: a kept tile pairs b queries with b keys, and every step
// of attention over it is a (b x b x D) matrix product: S = Q Kᵀ, O += P V forward, and backward
// dV += Pᵀ dO, dP = dO Vᵀ, dQ += dS K, dK += dSᵀ Q. One register-blocked kernel (`gemm`) does
// them all: it keeps an MR x (NV vectors) block of the product in registers and, per step p of
// the shared dimension, multiplies NV vectors of one row of B by MR broadcast elements of A (one
// fused multiply-add each), so a score costs 2 D / width multiply-adds per product, as in a BLAS
// micro-kernel, instead of a dot product reduced across lanes per score. A is read through two
// strides, so Pᵀ and dSᵀ need no copy; B must be contiguous along the output's columns, so the
// products over keys (S and dP) read Kᵀ and Vᵀ, transposed once per call per head, key block by
// key block (T D floats each, against the density · T² D work).
//
// Note [no scores kept between forward and backward]: the forward keeps only the per-query
// log-sum-exp lse = max + log(sum exp(s - max)), computed online tile by tile (the running max m
// and sum l rescale the partial output when a later tile raises the max, as flash attention does);
// the backward recomputes each kept tile's scores and p = exp(s - lse) from q and k, so no (T x T)
// buffer ever exists. Backward, with Di = dout_i . out_i: ds = p (dp - Di) scale.
//
// Threads: OpenMP over (batch, head, query block) forward and over (batch, head) backward, where
// every task owns its own slices of dk and dv (no atomics, no races); see Note [threads only for
// real work]. SIMD: vec.h's Vec and exp (see Note [vector exp]), one level per build. See Note [raw
// pointers, no torch headers] in kernels.cpp: the Python wrapper
// (minispeed/inference/sparse/attention.py) checks every shape before passing a pointer.

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec.h"  // Vec (see Note [vector exp])

namespace minispeed_sparse {

using minispeed_inference::Vec;
constexpr int kW = Vec::kWidth;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename T>
inline T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

// A matrix read through two strides: element (r, p) is at data[r * row + p * step].
struct Strided {
  const float* data;
  int64_t row, step;
  float at(int64_t r, int64_t p) const { return data[r * row + p * step]; }
};

// Which part of a causal diagonal tile's product is needed: query i sees keys j <= i there, so
// kLowerCols: only C[r][n] with n <= r (S = Q Kᵀ, dP = dO Vᵀ); kLowerInner: A(r, p) = 0 for p > r
// (P V, dS K); kUpperInner: A(r, p) = 0 for p < r (Pᵀ dO, dSᵀ Q). Skipping the rest halves a
// diagonal tile's work. Rows, columns and the inner index all count from the tile's corner.
enum class Part { kFull, kLowerCols, kLowerInner, kUpperInner };

// C[r, 0 .. NV·width) (+)= sum_{p0 <= p < p1} A(r, p) B[p, 0 .. NV·width) for MR rows; see Note
// [tiles as small matrix products]. B rows are ldb apart, C rows ldc apart.
template <int MR, int NV>
void tile(int64_t p0, int64_t p1, Strided a, const float* b, int64_t ldb, float* c, int64_t ldc,
          bool add) {
  Vec acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = add ? Vec::load(c + r * ldc + j * kW) : Vec::zero();
  for (int64_t p = p0; p < p1; ++p) {
    Vec bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = Vec::load(b + p * ldb + j * kW);
    for (int r = 0; r < MR; ++r) {
      const Vec ar = Vec::splat(a.at(r, p));
      for (int j = 0; j < NV; ++j) acc[r][j].fma(ar, bv[j]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j].store(c + r * ldc + j * kW);
}

// tile<rows, NV> for the 1 .. kMaxRows rows a strip's last group may have.
constexpr int kMaxRows = Vec::kWidth == 8 ? 3 : 6;  // registers: see gemm
template <int NV>
void tile_rows(int64_t rows, int64_t p0, int64_t p1, Strided a, const float* b, int64_t ldb,
               float* c, int64_t ldc, bool add) {
  switch (rows) {
    case 1: return tile<1, NV>(p0, p1, a, b, ldb, c, ldc, add);
    case 2: return tile<2, NV>(p0, p1, a, b, ldb, c, ldc, add);
    case 3: return tile<3, NV>(p0, p1, a, b, ldb, c, ldc, add);
#if !defined(MINISPEED_HAS_AVX2) || defined(MINISPEED_HAS_AVX512)
    case 4: return tile<4, NV>(p0, p1, a, b, ldb, c, ldc, add);
    case 5: return tile<5, NV>(p0, p1, a, b, ldb, c, ldc, add);
    case 6: return tile<6, NV>(p0, p1, a, b, ldb, c, ldc, add);
#endif
  }
}

// The inner range [p0, p1) rows [m, m + rows) need, and whether columns from n on are needed.
inline bool needed(Part part, int64_t m, int64_t rows, int64_t n, int64_t P, int64_t* p0,
                   int64_t* p1) {
  *p0 = part == Part::kUpperInner ? m : 0;
  *p1 = part == Part::kLowerInner ? std::min(P, m + rows) : P;
  return !(part == Part::kLowerCols && n > m + rows - 1);
}

// C (M x N) = A (M x P) B (P x N), or C += with add; only `part` of it (see Part). Registers:
// kMaxRows · NV accumulators, NV vectors of B and one broadcast (29 of AVX-512's 32 at 6 x 4;
// AVX2 has 16, hence 3 x 4 there). Entries a Part skips are left as they were.
void gemm(int64_t M, int64_t N, int64_t P, Strided a, const float* b, int64_t ldb, float* c,
          int64_t ldc, bool add, Part part = Part::kFull) {
  int64_t n = 0, p0, p1;
  for (; n + 4 * kW <= N; n += 4 * kW)
    for (int64_t m = 0; m < M; m += kMaxRows) {
      const int64_t rows = std::min<int64_t>(kMaxRows, M - m);
      if (!needed(part, m, rows, n, P, &p0, &p1)) continue;
      // kLowerCols: only the vectors holding columns up to the group's last row
      const int64_t nv = part == Part::kLowerCols ? std::min<int64_t>(4, (m + rows - n + kW - 1) / kW) : 4;
      const Strided ag{a.data + m * a.row, a.row, a.step};
      float* cg = c + m * ldc + n;
      switch (nv) {
        case 1: tile_rows<1>(rows, p0, p1, ag, b + n, ldb, cg, ldc, add); break;
        case 2: tile_rows<2>(rows, p0, p1, ag, b + n, ldb, cg, ldc, add); break;
        case 3: tile_rows<3>(rows, p0, p1, ag, b + n, ldb, cg, ldc, add); break;
        default: tile_rows<4>(rows, p0, p1, ag, b + n, ldb, cg, ldc, add);
      }
    }
  for (; n + kW <= N; n += kW)
    for (int64_t m = 0; m < M; m += kMaxRows) {
      const int64_t rows = std::min<int64_t>(kMaxRows, M - m);
      if (needed(part, m, rows, n, P, &p0, &p1))
        tile_rows<1>(rows, p0, p1, {a.data + m * a.row, a.row, a.step}, b + n, ldb,
                     c + m * ldc + n, ldc, add);
    }
  for (; n < N; ++n) {  // the last < width columns, one at a time
    for (int64_t m = 0; m < M; ++m) {
      if (!needed(part, m, 1, n, P, &p0, &p1)) continue;
      float s = add ? c[m * ldc + n] : 0.f;
      for (int64_t p = p0; p < p1; ++p) s += a.at(m, p) * b[p * ldb + n];
      c[m * ldc + n] = s;
    }
  }
}

// y[i] *= alpha, x[i] - shift, sums and maxima over rows of a tile, vectorized with scalar tails.
inline void scale_row(float* y, float alpha, int64_t n) {
  int64_t i = 0;
  const Vec a = Vec::splat(alpha);
  for (; i + kW <= n; i += kW) (Vec::load(y + i) * a).store(y + i);
  for (; i < n; ++i) y[i] *= alpha;
}

inline float row_max(const float* x, int64_t n) {
  float mx = kNegInf;
  int64_t i = 0;
  if (n >= kW) {
    Vec m = Vec::load(x);
    for (i = kW; i + kW <= n; i += kW) m = Vec::max(m, Vec::load(x + i));
    mx = m.hmax();
  }
  for (; i < n; ++i) mx = std::max(mx, x[i]);
  return mx;
}

// x[i] = exp((x[i] - shift) · scale) in place (x[i] <= shift; -inf gives 0); returns the sum.
inline float exp_shifted(float* x, float shift, float scale, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
  if (n >= kW) {
    const Vec s = Vec::splat(shift), sc = Vec::splat(scale);
    Vec acc = Vec::zero();
    for (; i + kW <= n; i += kW) {
      const Vec e = ((Vec::load(x + i) - s) * sc).exp();
      e.store(x + i);
      acc = acc + e;
    }
    total = acc.sum();
  }
  for (; i < n; ++i) {
    x[i] = std::exp((x[i] - shift) * scale);
    total += x[i];
  }
  return total;
}

struct Problem {
  int64_t batch, heads, seq, dim, block;
  bool causal;
  float scale;
  int64_t nblocks() const { return seq / block; }
};

// Note [threads only for real work]: a thread team costs tens of microseconds to wake, and far
// more when the machine is oversubscribed (idle threads spin). Threads start only when the kept
// tiles hold at least 2^20 multiply-adds (batch * nnz * block^2 * dim); the total nnz is the
// last row_ptr entry.
inline bool worth_threads(const Problem& p, const int32_t* row_ptr) {
  const int64_t nnz = row_ptr[p.heads * (p.nblocks() + 1) - 1];
  return p.batch * nnz * p.block * p.block * p.dim >= (int64_t{1} << 20);
}

// Note [workspaces kept between calls]: Kᵀ, Vᵀ (4 B H T D bytes each) and each thread's tile
// buffers live in buffers owned by the thread and kept between calls (grown to the largest call,
// never shrunk), so a call maps and faults in no fresh pages for them: with glibc's mmap threshold
// at 64 KiB (benchmarks/inference_sparse_attention.py sets it, to measure peaks) that cost as much
// as the tiles themselves for a sliding-window layout at 2k tokens. The bytes stay resident
// after the call, in the calling thread (Kᵀ, Vᵀ) and in each OpenMP thread (2 b² + T floats).
template <int Slot>
float* workspace(int64_t floats) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < floats) buffer.resize(floats);
  return buffer.data();
}

// Raw scores of query block r against key block c: s = Q_r K_cᵀ (unscaled: the softmax applies
// the scale inside its exp), the future set to -inf on a causal diagonal tile (and not computed,
// see Part). kt is this head's Kᵀ by key block (NB, D, b); s is (b, b), row-major.
bool diagonal(const Problem& p, int64_t r, int64_t c) { return p.causal && r == c; }

void tile_scores(const Problem& p, const float* q, const float* kt, int64_t r, int64_t c,
                 float* s) {
  const int64_t b = p.block, D = p.dim;
  const bool diag = diagonal(p, r, c);
  gemm(b, b, D, {q + r * b * D, D, 1}, kt + c * D * b, b, s, b, false,
       diag ? Part::kLowerCols : Part::kFull);
  if (diag)
    for (int64_t i = 0; i < b; ++i) std::fill(s + i * b + i + 1, s + (i + 1) * b, kNegInf);
}

// Kᵀ of one head by key block: out (NB, D, b) from k (T, D), block c's Kᵀ a contiguous (D, b)
// matrix, so a tile's product reads it with rows b floats apart (rows T apart would put every
// row of a power-of-two T in the same L1 sets). A width x width block at a time (vec.h).
void transpose_blocks(const Problem& p, const float* k, float* out) {
  const int64_t b = p.block, D = p.dim, bv = b / kW * kW, dv = D / kW * kW;
  for (int64_t c = 0; c < p.nblocks(); ++c) {
    const float* kc = k + c * b * D;
    float* oc = out + c * D * b;
    for (int64_t t = 0; t < bv; t += kW)
      for (int64_t d = 0; d < dv; d += kW)
        minispeed_inference::transpose_block(kc + t * D + d, D, oc + d * b + t, b);
    for (int64_t t = 0; t < b; ++t)  // the edges: the last < width columns, then rows
      for (int64_t d = (t < bv ? dv : 0); d < D; ++d) oc[d * b + t] = kc[t * D + d];
  }
}

// One (batch, head, query block) of the forward: online softmax over the kept tiles, in order.
void forward_row_block(const Problem& p, int64_t bh, int64_t r, const float* q, const float* kt,
                       const float* v, const int32_t* row_ptr, const int32_t* cols, float* out,
                       float* lse) {
  const int64_t h = bh % p.heads, nb = p.nblocks(), D = p.dim, b = p.block, T = p.seq;
  const int32_t* rp = row_ptr + h * (nb + 1);
  float* s = workspace<2>(b * b + 3 * b);  // (b, b) scores, then probabilities
  float* m = s + b * b;    // running max per query (of the raw scores: the scale is > 0)
  float* l = m + b;        // running sum per query
  float* alpha = l + b;    // how much each row's partial output shrinks at this tile
  std::fill(m, m + b, kNegInf);
  std::fill(l, l + b, 0.f);
  float* o = out + (bh * T + r * b) * D;  // (b, D): this task's rows of out
  const float* qh = q + bh * T * D;
  for (int64_t e = rp[r]; e < rp[r + 1]; ++e) {
    const int64_t c = cols[e];
    const bool first = e == rp[r];  // o holds nothing yet: it is written, not rescaled
    tile_scores(p, qh, kt, r, c, s);
    for (int64_t i = 0; i < b; ++i) {
      const float mx = std::max(m[i], row_max(s + i * b, b));
      alpha[i] = m[i] - mx;  // exponentiated below, all rows at once
      m[i] = mx;
    }
    exp_shifted(alpha, 0.f, p.scale, b);  // exp((m_old - m_new) scale): 0 where m_old = -inf
    for (int64_t i = 0; i < b; ++i) {
      float* si = s + i * b;
      if (m[i] == kNegInf) {  // nothing visible yet for this query: no weight, nothing to rescale
        std::fill(si, si + b, 0.f);
        continue;
      }
      l[i] = l[i] * alpha[i] + exp_shifted(si, m[i], p.scale, b);
      if (!first && alpha[i] != 1.f) scale_row(o + i * D, alpha[i], D);
    }
    const Part part = diagonal(p, r, c) ? Part::kLowerInner : Part::kFull;
    gemm(b, D, b, {s, b, 1}, v + (bh * T + c * b) * D, D, o, D, !first, part);  // O (+)= P V_c
  }
  for (int64_t i = 0; i < b; ++i) {
    scale_row(o + i * D, 1.f / l[i], D);
    lse[bh * T + r * b + i] = m[i] * p.scale + std::log(l[i]);
  }
}

void sparse_attention_forward(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t row_ptr,
                              uintptr_t cols, uintptr_t out, uintptr_t lse, int64_t batch,
                              int64_t heads, int64_t seq, int64_t dim, int64_t block, bool causal,
                              double scale) {
  pybind11::gil_scoped_release nogil;
  const Problem p{batch, heads, seq, dim, block, causal, static_cast<float>(scale)};
  const int64_t nb = p.nblocks(), pairs = batch * heads, tasks = pairs * nb;
  const bool big = tasks > 1 && worth_threads(p, ptr<const int32_t>(row_ptr));
  // Kᵀ per head (see Note [tiles as small matrix products]); every element is written below.
  float* kt = workspace<0>(pairs * seq * dim);  // See Note [workspaces kept between calls].
#pragma omp parallel if (big)
  {
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < pairs; ++bh)
      transpose_blocks(p, ptr<const float>(k) + bh * seq * dim, kt + bh * seq * dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t bh = t / nb;
      forward_row_block(p, bh, t % nb, ptr<const float>(q), kt + bh * seq * dim,
                        ptr<const float>(v), ptr<const int32_t>(row_ptr), ptr<const int32_t>(cols),
                        ptr<float>(out), ptr<float>(lse));
    }
  }
}

// One (batch, head) of the backward: see Note [no scores kept between forward and backward].
// dq, dk, dv are written whole (no need to zero them: each block's first product stores, later
// ones add; key blocks no query keeps get zeros). kt, vt: this head's Kᵀ, Vᵀ by key block (NB, D, b).
void backward_head(const Problem& p, int64_t bh, const float* q, const float* k, const float* kt,
                   const float* v, const float* vt, const float* out, const float* dout,
                   const float* lse, const int32_t* row_ptr, const int32_t* cols, float* dq,
                   float* dk, float* dv) {
  const int64_t h = bh % p.heads, nb = p.nblocks(), D = p.dim, b = p.block, T = p.seq;
  const int32_t* rp = row_ptr + h * (nb + 1);
  const int64_t base = bh * T * D;
  q += base, k += base, v += base, out += base, dout += base;
  dq += base, dk += base, dv += base, lse += bh * T;
  float* pr = workspace<2>(2 * b * b + T + nb);  // (b, b): probabilities of one tile
  float* ds = pr + b * b;                          // (b, b): dP, then dS
  float* di = ds + b * b;                          // (T,): dout_i . out_i
  float* written = di + T;  // (NB,): 1 once key block c's dk and dv hold a first product
  std::fill(written, written + nb, 0.f);
  for (int64_t i = 0; i < T; ++i) di[i] = minispeed::simd::dot(dout + i * D, out + i * D, D);
  for (int64_t r = 0; r < nb; ++r) {
    const float* q_r = q + r * b * D;
    const float* do_r = dout + r * b * D;
    for (int64_t e = rp[r]; e < rp[r + 1]; ++e) {
      const int64_t c = cols[e];
      const bool diag = diagonal(p, r, c);
      tile_scores(p, q, kt, r, c, pr);
      for (int64_t i = 0; i < b; ++i) {  // P = exp(scale · s - lse)
        const Vec sc = Vec::splat(p.scale), li = Vec::splat(lse[r * b + i]);
        float* pi = pr + i * b;
        int64_t j = 0;
        for (; j + kW <= b; j += kW) (Vec::load(pi + j) * sc - li).exp().store(pi + j);
        for (; j < b; ++j) pi[j] = std::exp(pi[j] * p.scale - lse[r * b + i]);
      }
      const Part lower = diag ? Part::kLowerInner : Part::kFull;
      const Part upper = diag ? Part::kUpperInner : Part::kFull;
      const bool add_kv = written[c] != 0.f, add_q = e != rp[r];
      written[c] = 1.f;
      gemm(b, D, b, {pr, 1, b}, do_r, D, dv + c * b * D, D, add_kv, upper);  // dV_c += Pᵀ dO_r
      gemm(b, b, D, {do_r, D, 1}, vt + c * D * b, b, ds, b, false,
           diag ? Part::kLowerCols : Part::kFull);  // dP = dO_r V_cᵀ
      for (int64_t i = 0; i < b; ++i) {  // dS = P (dP - Di) scale; 0 where P is masked
        const Vec d = Vec::splat(di[r * b + i]), sc = Vec::splat(p.scale);
        float* dsi = ds + i * b;
        const float* pi = pr + i * b;
        const int64_t end = diag ? i + 1 : b;  // dP past the diagonal was not computed
        int64_t j = 0;
        for (; j + kW <= end; j += kW)
          (Vec::load(pi + j) * (Vec::load(dsi + j) - d) * sc).store(dsi + j);
        for (; j < end; ++j) dsi[j] = pi[j] * (dsi[j] - di[r * b + i]) * p.scale;
        std::fill(dsi + end, dsi + b, 0.f);
      }
      gemm(b, D, b, {ds, b, 1}, k + c * b * D, D, dq + r * b * D, D, add_q, lower);  // dQ_r += dS K_c
      gemm(b, D, b, {ds, 1, b}, q_r, D, dk + c * b * D, D, add_kv, upper);  // dK_c += dSᵀ Q_r
    }
  }
  for (int64_t c = 0; c < nb; ++c) {  // keys no query of this head sees: zero gradient
    if (written[c] == 0.f) {
      std::fill(dk + c * b * D, dk + (c + 1) * b * D, 0.f);
      std::fill(dv + c * b * D, dv + (c + 1) * b * D, 0.f);
    }
  }
}

void sparse_attention_backward(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out,
                               uintptr_t dout, uintptr_t lse, uintptr_t row_ptr, uintptr_t cols,
                               uintptr_t dq, uintptr_t dk, uintptr_t dv, int64_t batch,
                               int64_t heads, int64_t seq, int64_t dim, int64_t block, bool causal,
                               double scale) {
  pybind11::gil_scoped_release nogil;
  const Problem p{batch, heads, seq, dim, block, causal, static_cast<float>(scale)};
  const int64_t pairs = batch * heads, hd = seq * dim;
  const bool big = pairs > 1 && worth_threads(p, ptr<const int32_t>(row_ptr));
  // Kᵀ and Vᵀ per head (see Note [tiles as small matrix products]), written before they are read.
  float* kt = workspace<0>(pairs * hd);  // See Note [workspaces kept between calls].
  float* vt = workspace<1>(pairs * hd);
#pragma omp parallel for schedule(dynamic, 1) if (big)
  for (int64_t bh = 0; bh < pairs; ++bh) {
    transpose_blocks(p, ptr<const float>(k) + bh * hd, kt + bh * hd);
    transpose_blocks(p, ptr<const float>(v) + bh * hd, vt + bh * hd);
    backward_head(p, bh, ptr<const float>(q), ptr<const float>(k), kt + bh * hd,
                  ptr<const float>(v), vt + bh * hd, ptr<const float>(out),
                  ptr<const float>(dout), ptr<const float>(lse), ptr<const int32_t>(row_ptr),
                  ptr<const int32_t>(cols), ptr<float>(dq), ptr<float>(dk), ptr<float>(dv));
  }
}

}  // namespace minispeed_sparse

// Called from kernels.cpp's PYBIND11_MODULE: the one module of the inference_kernels extension.
void register_sparse_attention(pybind11::module_& m) {
  m.def("sparse_attention_forward", &minispeed_sparse::sparse_attention_forward,
        "block-sparse attention forward (raw pointers; see minispeed.inference.sparse.attention)");
  m.def("sparse_attention_backward", &minispeed_sparse::sparse_attention_backward,
        "block-sparse attention backward (writes dq, dk, dv whole)");
}
