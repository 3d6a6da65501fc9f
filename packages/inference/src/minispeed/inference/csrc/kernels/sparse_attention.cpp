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
// of attention over it is a (b x b x D) matrix product. One register-blocked kernel (`gemm`) does
// them all: it keeps an MR x (NV vectors) block of the product in registers and, per step p of
// the shared dimension, multiplies NV vectors of one row of B by MR broadcast elements of A (one
// fused multiply-add each), so a score costs 2 D / width multiply-adds per product, as in a BLAS
// micro-kernel, instead of a dot product reduced across lanes per score. A is read through two
// strides, so any transpose of it is free; B must be contiguous along the output's columns. So
// the tile is held transposed, keys by queries: Sᵀ = K_c Q_rᵀ, and backward dPᵀ = V_c dO_rᵀ, read
// Q_rᵀ and dO_rᵀ (D x b), transposed once per query block into a thread's buffer and reused by
// every tile of the row; O += P V, dV += Pᵀ dO, dQ += dS K and dK += dSᵀ Q then read Sᵀ-shaped
// tiles as A. The softmax runs down the tile's columns, a vector of queries at a time (a running
// max and sum per lane, no reduction across lanes). No transpose of K or V, no buffer of T.
//
// Note [no scores kept between forward and backward]: the forward keeps only the per-query
// log-sum-exp lse = max + log(sum exp(s - max)), computed online tile by tile (the running max m
// and sum l rescale the partial output when a later tile raises the max, as flash attention does);
// the backward recomputes each kept tile's scores and p = exp(s - lse) from q and k, so no (T x T)
// buffer ever exists. Backward, with Di = dout_i . out_i: ds = p (dp - Di) scale.
//
// Note [internal linkage, so the kernels inline]: every function here sits in an anonymous
// namespace. With external linkage, a shared library's function may be interposed at load time,
// so -fPIC code called each small kernel (tile_vectors, diagonal, ...) through the PLT and passed
// its strided operands on the stack, uninlined: 12-16% of the op's time sat in gemm's own
// frame (perf). Only register_sparse_attention, below, is seen from outside.
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
namespace {  // internal linkage: see Note [internal linkage, so the kernels inline]

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

// Which part of a causal diagonal tile's product is needed: key j is visible to query i there
// only for j <= i. With the tile held keys by queries (see Note [tiles as small matrix products]):
// kUpperCols: only C[r][n] with n >= r (Sᵀ, dPᵀ: row = key, column = query); kLowerInner:
// A(r, p) = 0 for p > r (P V and dS K: row = query, inner = key); kUpperInner: A(r, p) = 0 for
// p < r (Pᵀ dO and dSᵀ Q: row = key, inner = query). Skipping the rest halves a diagonal tile's
// work. Rows, columns and the inner index all count from the tile's corner.
enum class Part { kFull, kUpperCols, kLowerInner, kUpperInner };

// Per-row factors a product applies to C as it goes (nullptr: none): `before[r]` multiplies row
// r's old value when the product adds to it, `after[r]` the result as it is stored. The forward's
// online softmax uses them for its rescale by alpha and its final 1 / l, which would otherwise
// each read and write O_r once more (see forward_row_block); each is the one multiplication the
// separate pass did, so the results are the same bits.
struct RowScale {
  const float* before = nullptr;
  const float* after = nullptr;
  RowScale from(int64_t m) const {  // the same factors for the rows from m on
    return {before ? before + m : nullptr, after ? after + m : nullptr};
  }
};

// C[r, 0 .. NV·width) (+)= sum_{p0 <= p < p1} A(r, p) B[p, 0 .. NV·width) for MR rows, with
// `scale` (see RowScale); see Note [tiles as small matrix products]. B rows are ldb apart, C rows
// ldc apart. The loops over the register block are unrolled by hand (the pragmas): left to the
// compiler, the accumulators' loads and stores went through the stack (64 x 64 x 64 from L1:
// 5.1-5.4 against 4.8-5.0 G vector multiply-adds per second, AVX-512, best of 400).
template <int MR, int NV>
void tile(int64_t p0, int64_t p1, Strided a, const float* b, int64_t ldb, float* c, int64_t ldc,
          bool add, RowScale scale) {
  Vec acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const Vec in = Vec::splat(add && scale.before ? scale.before[r] : 1.f);
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      acc[r][j] = add ? Vec::load(c + r * ldc + j * kW) : Vec::zero();
      if (add && scale.before) acc[r][j] = acc[r][j] * in;
    }
  }
  for (int64_t p = p0; p < p1; ++p) {
    Vec bv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) bv[j] = Vec::load(b + p * ldb + j * kW);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const Vec ar = Vec::splat(a.at(r, p));
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[r][j].fma(ar, bv[j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const Vec out = Vec::splat(scale.after ? scale.after[r] : 1.f);
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j)
      (scale.after ? acc[r][j] * out : acc[r][j]).store(c + r * ldc + j * kW);
  }
}

// tile<rows, NV> for the 1 .. kMaxRows rows a group may have.
constexpr int kMaxRows = Vec::kWidth == 8 ? 3 : 6;  // registers: see gemm
template <int NV>
void tile_rows(int64_t rows, int64_t p0, int64_t p1, Strided a, const float* b, int64_t ldb,
               float* c, int64_t ldc, bool add, RowScale scale) {
  switch (rows) {
    case 1: return tile<1, NV>(p0, p1, a, b, ldb, c, ldc, add, scale);
    case 2: return tile<2, NV>(p0, p1, a, b, ldb, c, ldc, add, scale);
    case 3: return tile<3, NV>(p0, p1, a, b, ldb, c, ldc, add, scale);
#if !defined(MINISPEED_HAS_AVX2) || defined(MINISPEED_HAS_AVX512)
    case 4: return tile<4, NV>(p0, p1, a, b, ldb, c, ldc, add, scale);
    case 5: return tile<5, NV>(p0, p1, a, b, ldb, c, ldc, add, scale);
    case 6: return tile<6, NV>(p0, p1, a, b, ldb, c, ldc, add, scale);
#endif
  }
}

// tile_rows<nv> for nv = 1 .. 4 vectors chosen at run time.
void tile_vectors(int64_t nv, int64_t rows, int64_t p0, int64_t p1, Strided a, const float* b,
                  int64_t ldb, float* c, int64_t ldc, bool add, RowScale scale) {
  switch (nv) {
    case 1: return tile_rows<1>(rows, p0, p1, a, b, ldb, c, ldc, add, scale);
    case 2: return tile_rows<2>(rows, p0, p1, a, b, ldb, c, ldc, add, scale);
    case 3: return tile_rows<3>(rows, p0, p1, a, b, ldb, c, ldc, add, scale);
    case 4: return tile_rows<4>(rows, p0, p1, a, b, ldb, c, ldc, add, scale);
  }
}

// Note [prefetch the next tile]: a layout with few tiles per query block (a sliding window keeps
// two) reads every Q_r, K_c, V_c and O_r once per call, 16 KiB each at b = D = 64, and the
// hardware prefetcher, which follows a stream only after it has seen it advance (and starts
// again at every 4 KiB page), left the products waiting on memory: one kept tile per query block
// cost 1.7-2x a tile of a dense layout per score (the same layout fits in L2 at T = 1k and kept
// most of the gap, so it is latency, not bandwidth). So while it multiplies one tile, the op asks
// for the blocks of the next one (the next query block's rows when this is the row's last tile),
// a few 64-byte lines into L2 after each group of rows a product finishes: the queued lines split
// evenly over the tile's groups of rows, so the requests are spread over the tile's work instead
// of filling the line-fill buffers at once (a burst of them stalled the products: 11 % of a
// sliding window's forward samples sat on prefetches). A block the current tile already holds
// (a sliding window's next row starts on the key block its diagonal tile just read) is not asked
// for again. A prefetch is a hint, never a fault; where the next task runs on another thread it
// is wasted, not wrong.
class Ahead {
 public:
  // Queue `floats` floats at x (nullptr: nothing) for reading, or for writing with `write`.
  void add(const float* x, int64_t floats, bool write = false) {
    if (x != nullptr && floats > 0 && n_ < kMax) {
      ranges_[n_++] = {reinterpret_cast<const char*>(x), floats * 4, write};
      lines_ += (floats * 4 + kLineBytes - 1) / kLineBytes;
    }
  }
  // Spread the queued lines over `steps` calls of step().
  void spread(int64_t steps) { per_step_ = (lines_ + steps - 1) / std::max<int64_t>(steps, 1); }
  // Ask for the next share of the queued lines.
  void step() { request(per_step_); }
  void finish() { request(std::numeric_limits<int64_t>::max()); }

 private:
  // The position lives in locals while the loop runs: kept in the members, every request waited
  // on the previous one's store of it (a chain through memory: tile_scores' own share of a warm
  // sliding-window row, T = 512, fell from 8 % to 6.4 %, perf).
  void request(int64_t lines) {
    int i = i_;
    int64_t off = off_;
    for (; lines > 0 && i < n_; --lines) {
      const Range& r = ranges_[i];
      if (r.write)
        __builtin_prefetch(r.p + off, 1, 2);
      else
        __builtin_prefetch(r.p + off, 0, 2);
      off += kLineBytes;
      if (off >= r.bytes) ++i, off = 0;
    }
    i_ = i, off_ = off;
  }
  static constexpr int kMax = 8;  // ranges: the backward's next row queues eight
  static constexpr int64_t kLineBytes = 64;
  struct Range {
    const char* p;
    int64_t bytes;
    bool write;
  };
  Range ranges_[kMax];
  int n_ = 0, i_ = 0;
  int64_t off_ = 0, lines_ = 0, per_step_ = 0;
};


// C (M x N) = A (M x P) B (P x N), or C += with add, with `scale` (see RowScale); only `part` of
// it (see Part). Registers:
// kMaxRows · NV accumulators, NV vectors of B and one broadcast (29 of AVX-512's 32 at 6 x 4;
// AVX2 has 16, hence 3 x 4 there). Entries a Part skips are left as they were.
void gemm(int64_t M, int64_t N, int64_t P, Strided a, const float* b, int64_t ldb, float* c,
          int64_t ldc, bool add, Part part = Part::kFull, Ahead* ahead = nullptr,
          RowScale scale = {}) {
  const int64_t nvec = N / kW;
  for (int64_t m = 0; m < M; m += kMaxRows) {
    const int64_t rows = std::min<int64_t>(kMaxRows, M - m);
    const int64_t p0 = part == Part::kUpperInner ? m : 0;
    const int64_t p1 = part == Part::kLowerInner ? std::min(P, m + rows) : P;
    // kUpperCols: the group's columns start at its first row, so whole vectors before it go
    int64_t v = part == Part::kUpperCols ? std::min(nvec, m / kW) : 0;
    const Strided ag{a.data + m * a.row, a.row, a.step};
    for (; v < nvec; v += 4) {
      const int64_t nv = std::min<int64_t>(4, nvec - v);
      tile_vectors(nv, rows, p0, p1, ag, b + v * kW, ldb, c + m * ldc + v * kW, ldc, add,
                   scale.from(m));
    }
    for (int64_t r = m; r < m + rows; ++r) {  // the last < width columns, one at a time
      for (int64_t n = nvec * kW; n < N; ++n) {
        if (part == Part::kUpperCols && n < r) continue;
        const int64_t q0 = part == Part::kUpperInner ? r : 0;
        const int64_t q1 = part == Part::kLowerInner ? std::min(P, r + 1) : P;
        float s = add ? c[r * ldc + n] * (scale.before ? scale.before[r] : 1.f) : 0.f;
        for (int64_t p = q0; p < q1; ++p) s += a.at(r, p) * b[p * ldb + n];
        c[r * ldc + n] = scale.after ? s * scale.after[r] : s;
      }
    }
    if (ahead != nullptr) ahead->step();  // See Note [prefetch the next tile].
  }
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

// A thread's tile buffers, kept between calls (grown to the largest call, never shrunk: 4 b² +
// 2 b D + 4 b floats), so a call maps no fresh pages for them. The buffer starts on a cache line
// (malloc gives 16 bytes): a product's B rows (Q_rᵀ, dO_rᵀ) and C rows (Sᵀ, dPᵀ) live in it, and a
// 64-byte load or store across two lines costs both (64 x 64 x 64 from L1: 4.2 against 4.4 G
// vector multiply-adds per second, AVX-512).
float* thread_buffer(int64_t floats) {
  constexpr int64_t kLine = 64 / sizeof(float);
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < floats + kLine) buffer.resize(floats + kLine);
  const auto at = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + (-at / sizeof(float)) % kLine;  // the first float on a 64-byte line
}

bool diagonal(const Problem& p, int64_t r, int64_t c) { return p.causal && r == c; }

// x (b rows of D, row-major) into xt (D rows of b): a width x width block at a time (vec.h).
void transpose_rows(const float* x, float* xt, int64_t b, int64_t D) {
  const int64_t bv = b / kW * kW, dv = D / kW * kW;
  for (int64_t t = 0; t < bv; t += kW)
    for (int64_t d = 0; d < dv; d += kW)
      minispeed_inference::transpose_block(x + t * D + d, D, xt + d * b + t, b);
  for (int64_t t = 0; t < b; ++t)  // the edges: the last < width columns, then rows
    for (int64_t d = (t < bv ? dv : 0); d < D; ++d) xt[d * b + t] = x[t * D + d];
}

// Raw scores of key block c against query block r, keys by queries: st = K_c Q_rᵀ (unscaled: the
// softmax applies the scale inside its exp), a key after its query set to -inf on a causal
// diagonal tile (and not computed, see Part). k is this head's (T, D); qt_r is Q_rᵀ (D, b).
void tile_scores(const Problem& p, const float* k, const float* qt_r, int64_t r, int64_t c,
                 float* st, Ahead* ahead) {
  const int64_t b = p.block, D = p.dim;
  const bool diag = diagonal(p, r, c);
  gemm(b, b, D, {k + c * b * D, D, 1}, qt_r, b, st, b, false,
       diag ? Part::kUpperCols : Part::kFull, ahead);
  if (diag)
    for (int64_t j = 1; j < b; ++j) std::fill(st + j * b, st + j * b + j, kNegInf);
}

// NV vectors of queries [i, i + NV·width) of the online softmax over one Sᵀ tile (b keys down,
// queries across; V is Vec, or Lane for the scalar tail): raise the running max m, rescale the
// running sum l by alpha = exp((m_old - m_new) scale) (the caller rescales the output rows), and
// turn the scores into probabilities. The NV vectors go down the tile together, key by key, so
// every step has NV independent chains of max, exp and sum (one vector at a time waited on its
// own chain's latency: 1.7 -> 1.35 us per 64 x 64 tile, AVX-512, timed alone). m starts at the
// lowest finite float, so an all-masked column gives exp(-inf) = 0, never NaN. On a causal
// diagonal tile (Diag) vector u sees keys j < keys[u] only, those at or before its last query;
// the later keys' probabilities are 0, stored without an exp (P V reads some of them, see
// Part::kLowerInner).
template <typename V, int NV, bool Diag>
void softmax_vectors(float* st, int64_t b, int64_t i, float* m, float* l, float* alpha,
                     float scale) {
  constexpr int64_t w = V::kWidth;
  int64_t keys[NV];
  for (int u = 0; u < NV; ++u) keys[u] = Diag ? std::min(b, i + (u + 1) * w) : b;
  V mx[NV], sum[NV];
  for (int u = 0; u < NV; ++u) mx[u] = V::load(m + i + u * w), sum[u] = V::zero();
  for (int64_t j = 0; j < keys[NV - 1]; ++j)
    for (int u = 0; u < NV; ++u)
      if (!Diag || j < keys[u]) mx[u] = V::max(mx[u], V::load(st + j * b + i + u * w));
  const V sc = V::splat(scale);
  for (int u = 0; u < NV; ++u)
    ((V::load(m + i + u * w) - mx[u]) * sc).exp().store(alpha + i + u * w);
  for (int64_t j = 0; j < b; ++j) {
    float* row = st + j * b + i;
    for (int u = 0; u < NV; ++u) {
      if (Diag && j >= keys[u]) {
        V::zero().store(row + u * w);
        continue;
      }
      const V e = ((V::load(row + u * w) - mx[u]) * sc).exp();
      e.store(row + u * w);
      sum[u] = sum[u] + e;
    }
  }
  for (int u = 0; u < NV; ++u) {
    (V::load(l + i + u * w) * V::load(alpha + i + u * w) + sum[u]).store(l + i + u * w);
    mx[u].store(m + i + u * w);
  }
}

// The scalar lane type for the tails of softmax_vectors (the same operations on one float).
struct Lane {
  static constexpr int kWidth = 1;
  float v;
  static Lane zero() { return {0.f}; }
  static Lane load(const float* p) { return {*p}; }
  static Lane splat(float a) { return {a}; }
  void store(float* p) const { *p = v; }
  Lane operator*(Lane o) const { return {v * o.v}; }
  Lane operator-(Lane o) const { return {v - o.v}; }
  Lane operator+(Lane o) const { return {v + o.v}; }
  static Lane max(Lane a, Lane b) { return {a.v > b.v ? a.v : b.v}; }
  Lane exp() const { return {std::exp(v)}; }
};

// The online softmax over a whole Sᵀ tile (see softmax_vectors): four vectors of queries at a
// time, then the remaining vectors, then the scalar tail.
template <bool Diag>
void softmax_tile(float* st, int64_t b, float* m, float* l, float* alpha, float scale) {
  int64_t i = 0;
  for (; i + 4 * kW <= b; i += 4 * kW)
    softmax_vectors<Vec, 4, Diag>(st, b, i, m, l, alpha, scale);
  switch ((b - i) / kW) {
    case 3: softmax_vectors<Vec, 3, Diag>(st, b, i, m, l, alpha, scale); break;
    case 2: softmax_vectors<Vec, 2, Diag>(st, b, i, m, l, alpha, scale); break;
    case 1: softmax_vectors<Vec, 1, Diag>(st, b, i, m, l, alpha, scale); break;
  }
  for (i += (b - i) / kW * kW; i < b; ++i)
    softmax_vectors<Lane, 1, Diag>(st, b, i, m, l, alpha, scale);
}

// Task t = (bh, r)'s blocks of x (B, H, T, D): query block r's rows, or key block c's rows.
inline int64_t row_offset(const Problem& p, int64_t bh, int64_t block) {
  return (bh * p.seq + block * p.block) * p.dim;
}

// Queue the next tile's K and V, or, after row r's last tile, the next task's (bh, r + 1, or the
// next head's row 0) Q and O rows and the K and V of its first tile (unless that is the key
// block this tile holds). See Note [prefetch the next tile].
void ahead_forward(const Problem& p, int64_t t, int64_t e, const float* q, const float* k,
                   const float* v, const int32_t* row_ptr, const int32_t* cols, float* out,
                   Ahead& ahead) {
  const int64_t nb = p.nblocks(), n = p.block * p.dim;
  int64_t bh = t / nb, r = t % nb;
  const int64_t held = bh * nb + cols[e];  // this tile's key block, as (bh, c)
  if (e + 1 == row_ptr[(bh % p.heads) * (nb + 1) + r + 1]) {  // the row's last tile
    if (++t == p.batch * p.heads * nb) return;
    bh = t / nb, r = t % nb;
    ahead.add(q + row_offset(p, bh, r), n);
    e = row_ptr[(bh % p.heads) * (nb + 1) + r];
    if (bh * nb + cols[e] != held) {
      ahead.add(k + row_offset(p, bh, cols[e]), n);
      ahead.add(v + row_offset(p, bh, cols[e]), n);
    }
    ahead.add(out + row_offset(p, bh, r), n, true);  // written last, after the first P V
  } else {
    ++e;
    ahead.add(k + row_offset(p, bh, cols[e]), n);
    ahead.add(v + row_offset(p, bh, cols[e]), n);
  }
  ahead.spread(2 * ((p.block + kMaxRows - 1) / kMaxRows));  // Sᵀ and P V: a step per row group
}

// One (batch, head, query block) t = bh · NB + r of the forward: online softmax over the kept
// tiles, in order.
void forward_row_block(const Problem& p, int64_t t, const float* q, const float* k,
                       const float* v, const int32_t* row_ptr, const int32_t* cols, float* out,
                       float* lse) {
  const int64_t nb = p.nblocks(), bh = t / nb, r = t % nb, h = bh % p.heads;
  const int64_t D = p.dim, b = p.block, T = p.seq;
  const float *q0 = q, *k0 = k, *v0 = v;
  float* out0 = out;
  const int32_t* rp = row_ptr + h * (nb + 1);
  float* st = thread_buffer(b * b + D * b + 4 * b);  // (b, b): Sᵀ, then Pᵀ
  float* qt = st + b * b;                             // (D, b): Q_rᵀ
  float* m = qt + D * b;                              // running max per query (raw scores)
  float* l = m + b;                                   // running sum per query
  float* alpha = l + b;                               // this tile's rescale per query
  float* inv_l = alpha + b;                           // 1 / l, once the last tile has run
  std::fill(m, m + b, std::numeric_limits<float>::lowest());
  std::fill(l, l + b, 0.f);
  q += bh * T * D, k += bh * T * D, v += bh * T * D;
  transpose_rows(q + r * b * D, qt, b, D);
  float* o = out + (bh * T + r * b) * D;  // (b, D): this task's rows of out
  for (int64_t e = rp[r]; e < rp[r + 1]; ++e) {
    const int64_t c = cols[e];
    const bool first = e == rp[r];  // o holds nothing yet: it is written, not rescaled
    Ahead ahead;
    ahead_forward(p, t, e, q0, k0, v0, row_ptr, cols, out0, ahead);
    tile_scores(p, k, qt, r, c, st, &ahead);
    const bool diag = diagonal(p, r, c);  // keys after a query's last: see softmax_vectors
    if (diag)
      softmax_tile<true>(st, b, m, l, alpha, p.scale);
    else
      softmax_tile<false>(st, b, m, l, alpha, p.scale);
    const bool last = e + 1 == rp[r + 1];  // o is stored normalized: times 1 / l
    if (last)
      for (int64_t i = 0; i < b; ++i) inv_l[i] = 1.f / l[i];
    const Part part = diag ? Part::kLowerInner : Part::kFull;
    const RowScale scale{first ? nullptr : alpha, last ? inv_l : nullptr};
    gemm(b, D, b, {st, 1, b}, v + c * b * D, D, o, D, !first, part, &ahead,
         scale);  // O = alpha O + P V_c, then / l after the last
    ahead.finish();
  }
  for (int64_t i = 0; i < b; ++i) lse[bh * T + r * b + i] = m[i] * p.scale + std::log(l[i]);
}

void sparse_attention_forward(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t row_ptr,
                              uintptr_t cols, uintptr_t out, uintptr_t lse, int64_t batch,
                              int64_t heads, int64_t seq, int64_t dim, int64_t block, bool causal,
                              double scale) {
  pybind11::gil_scoped_release nogil;
  const Problem p{batch, heads, seq, dim, block, causal, static_cast<float>(scale)};
  const int64_t nb = p.nblocks(), tasks = batch * heads * nb;
  const bool big = tasks > 1 && worth_threads(p, ptr<const int32_t>(row_ptr));
#pragma omp parallel for schedule(dynamic, 1) if (big)
  for (int64_t t = 0; t < tasks; ++t) {
    forward_row_block(p, t, ptr<const float>(q), ptr<const float>(k),
                      ptr<const float>(v), ptr<const int32_t>(row_ptr), ptr<const int32_t>(cols),
                      ptr<float>(out), ptr<float>(lse));
  }
}

// One (batch, head) of the backward: see Note [no scores kept between forward and backward].
// dq, dk, dv are written whole (no need to zero them: each block's first product stores, later
// ones add; key blocks no query keeps get zeros).
void backward_head(const Problem& p, int64_t bh, const float* q, const float* k, const float* v,
                   const float* out, const float* dout, const float* lse, const int32_t* row_ptr,
                   const int32_t* cols, float* dq, float* dk, float* dv) {
  const int64_t h = bh % p.heads, nb = p.nblocks(), D = p.dim, b = p.block, T = p.seq;
  const int32_t* rp = row_ptr + h * (nb + 1);
  const int64_t base = bh * T * D, bv = b / kW * kW;
  q += base, k += base, v += base, out += base, dout += base;
  dq += base, dk += base, dv += base, lse += bh * T;
  float* pt = thread_buffer(2 * b * b + 2 * D * b + b + nb);  // (b, b): Pᵀ of one tile
  float* ds = pt + b * b;                                      // (b, b): dPᵀ, then dSᵀ
  float* qt = ds + b * b;                                      // (D, b): Q_rᵀ
  float* dot = qt + D * b;                                     // (D, b): dO_rᵀ
  float* di = dot + D * b;                                     // (b,): dout_i . out_i
  float* written = di + b;  // (NB,): 1 once key block c's dk and dv hold a first product
  std::fill(written, written + nb, 0.f);
  const Vec sc = Vec::splat(p.scale);
  for (int64_t r = 0; r < nb; ++r) {
    const float* q_r = q + r * b * D;
    const float* do_r = dout + r * b * D;
    transpose_rows(q_r, qt, b, D);
    transpose_rows(do_r, dot, b, D);
    for (int64_t i = 0; i < b; ++i)
      di[i] = minispeed::simd::dot(do_r + i * D, out + (r * b + i) * D, D);
    for (int64_t e = rp[r]; e < rp[r + 1]; ++e) {
      const int64_t c = cols[e];
      const bool diag = diagonal(p, r, c);
      Ahead ahead;  // the next tile's blocks: see Note [prefetch the next tile]
      int64_t rn = r, en = e + 1;
      if (en == rp[r + 1] && ++rn < nb) {  // the row's last tile: the next row's too
        en = rp[rn];
        for (const float* x : {q, dout, out}) ahead.add(x + rn * b * D, b * D);
        ahead.add(dq + rn * b * D, b * D, true);
      }
      if (rn < nb && cols[en] != c) {  // not the key block this tile holds
        const int64_t cn = cols[en] * b * D;
        ahead.add(k + cn, b * D), ahead.add(v + cn, b * D);
        ahead.add(dk + cn, b * D, true), ahead.add(dv + cn, b * D, true);
      }
      ahead.spread(5 * ((b + kMaxRows - 1) / kMaxRows));  // five products: a step per row group
      tile_scores(p, k, qt, r, c, pt, &ahead);
      for (int64_t j = 0; j < b; ++j) {  // Pᵀ = exp(scale · sᵀ - lse), lse along the columns
        float* pj = pt + j * b;
        // on a diagonal tile, queries before key j's vector see nothing of it: 0 without an exp
        int64_t i = diag ? std::min(j / kW * kW, bv) : 0;
        std::fill(pj, pj + i, 0.f);
        for (; i < bv; i += kW)
          (Vec::load(pj + i) * sc - Vec::load(lse + r * b + i)).exp().store(pj + i);
        for (; i < b; ++i) pj[i] = std::exp(pj[i] * p.scale - lse[r * b + i]);
      }
      const Part lower = diag ? Part::kLowerInner : Part::kFull;
      const Part upper = diag ? Part::kUpperInner : Part::kFull;
      const bool add_kv = written[c] != 0.f, add_q = e != rp[r];
      written[c] = 1.f;
      gemm(b, D, b, {pt, b, 1}, do_r, D, dv + c * b * D, D, add_kv, upper,
           &ahead);  // dV_c += Pᵀ dO_r
      gemm(b, b, D, {v + c * b * D, D, 1}, dot, b, ds, b, false,
           diag ? Part::kUpperCols : Part::kFull, &ahead);  // dPᵀ = V_c dO_rᵀ
      for (int64_t j = 0; j < b; ++j) {  // dSᵀ = Pᵀ (dPᵀ - D) scale; 0 where a key is masked
        float* dj = ds + j * b;
        const float* pj = pt + j * b;
        const int64_t start = diag ? j : 0;  // dPᵀ before the diagonal was not computed
        std::fill(dj, dj + start, 0.f);
        int64_t i = start;
        for (; i < b && i % kW; ++i) dj[i] = pj[i] * (dj[i] - di[i]) * p.scale;
        for (; i + kW <= b; i += kW)
          (Vec::load(pj + i) * (Vec::load(dj + i) - Vec::load(di + i)) * sc).store(dj + i);
        for (; i < b; ++i) dj[i] = pj[i] * (dj[i] - di[i]) * p.scale;
      }
      gemm(b, D, b, {ds, 1, b}, k + c * b * D, D, dq + r * b * D, D, add_q, lower,
           &ahead);  // dQ_r += dS K_c
      gemm(b, D, b, {ds, b, 1}, q_r, D, dk + c * b * D, D, add_kv, upper,
           &ahead);  // dK_c += dSᵀ Q_r
      ahead.finish();
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
  const int64_t pairs = batch * heads;
  const bool big = pairs > 1 && worth_threads(p, ptr<const int32_t>(row_ptr));
#pragma omp parallel for schedule(dynamic, 1) if (big)
  for (int64_t bh = 0; bh < pairs; ++bh) {
    backward_head(p, bh, ptr<const float>(q), ptr<const float>(k), ptr<const float>(v),
                  ptr<const float>(out), ptr<const float>(dout), ptr<const float>(lse),
                  ptr<const int32_t>(row_ptr), ptr<const int32_t>(cols), ptr<float>(dq),
                  ptr<float>(dk), ptr<float>(dv));
  }
}

}  // namespace
}  // namespace minispeed_sparse

// Called from kernels.cpp's PYBIND11_MODULE: the one module of the inference_kernels extension.
void register_sparse_attention(pybind11::module_& m) {
  m.def("sparse_attention_forward", &minispeed_sparse::sparse_attention_forward,
        "block-sparse attention forward (raw pointers; see minispeed.inference.sparse.attention)");
  m.def("sparse_attention_backward", &minispeed_sparse::sparse_attention_backward,
        "block-sparse attention backward (writes dq, dk, dv whole)");
}
