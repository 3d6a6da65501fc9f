// Block-sparse attention on the CPU, fp32, forward and backward: part of the inference_kernels
// extension (kernels.cpp's module calls register_sparse_attention; one JIT build per machine).
//
// Shapes: q, k, v, out, dout, dq, dk, dv are (B, H, T, D) contiguous; lse is (B, H, T). The
// layout arrives as per-head CSR over blocks: row_ptr (H, NB + 1) int32 offsets into cols (int32
// key-block ids, sorted per row). Only kept blocks are touched, so work and reads are
// density x dense: 4 T^2 D density FLOPs per (batch, head) forward, about twice that backward.
// The reference (minispeed/inference/sparse/reference.py) is dense attention under the expanded
// mask; the tests compare both, values and gradients.
//
// Note [no scores kept between forward and backward]: the forward keeps only the per-query
// log-sum-exp lse = max + log(sum exp(s - max)); the backward recomputes each kept score s and
// p = exp(s - lse) from q and k (as flash attention does), so no (T x T) buffer ever exists.
// Backward, with Di = dout_i . out_i:  dv_j += p dout_i;  ds = p (dout_i . v_j - Di);
// dq_i += scale ds k_j;  dk_j += scale ds q_i.
//
// Threads: OpenMP over (batch, head, query block) forward and over (batch, head) backward, where
// every task owns its own slices of dk and dv (no atomics, no races); see Note [threads only for
// real work]. SIMD: dot and axpy from minispeed/simd.h (shared with kernels.cpp), chosen by the
// -DMINISPEED_SIMD_* define. See Note [raw pointers, no torch headers] in kernels.cpp: the Python
// wrapper (minispeed/inference/sparse/attention.py) checks every shape before passing a pointer.

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "minispeed/simd.h"  // dot, axpy (core/csrc/include)

namespace minispeed_sparse {

template <typename T>
inline T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

using minispeed::simd::axpy;
using minispeed::simd::dot;

// y[i] *= alpha
inline void scal(float alpha, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] *= alpha;
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

// One (batch, head, query block) of the forward: scores of the kept keys, softmax, weighted sum.
void forward_row_block(const Problem& p, int64_t bh, int64_t r, const float* q, const float* k,
                       const float* v, const int32_t* row_ptr, const int32_t* cols, float* out,
                       float* lse, std::vector<float>& scores) {
  const int64_t h = bh % p.heads, nb = p.nblocks(), D = p.dim, B = p.block;
  const int32_t* rp = row_ptr + h * (nb + 1);
  const int64_t first = rp[r], last = rp[r + 1];
  scores.resize((last - first) * B);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t i = r * B; i < (r + 1) * B; ++i) {
    const float* qi = q + (bh * p.seq + i) * D;
    float mx = neg_inf;
    int64_t n = 0;
    for (int64_t e = first; e < last; ++e) {
      const int64_t c = cols[e];
      for (int64_t j = c * B; j < (c + 1) * B; ++j, ++n) {
        const float s = (p.causal && j > i) ? neg_inf : dot(qi, k + (bh * p.seq + j) * D, D) * p.scale;
        scores[n] = s;
        mx = std::max(mx, s);
      }
    }
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      scores[t] = std::exp(scores[t] - mx);  // exp(-inf) = 0 for masked keys
      sum += scores[t];
    }
    float* o = out + (bh * p.seq + i) * D;
    std::fill(o, o + D, 0.f);
    n = 0;
    for (int64_t e = first; e < last; ++e) {
      const int64_t c = cols[e];
      for (int64_t j = c * B; j < (c + 1) * B; ++j, ++n) {
        if (scores[n] != 0.f) axpy(scores[n], v + (bh * p.seq + j) * D, o, D);
      }
    }
    scal(1.f / sum, o, D);
    lse[bh * p.seq + i] = mx + std::log(sum);
  }
}

void sparse_attention_forward(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t row_ptr,
                              uintptr_t cols, uintptr_t out, uintptr_t lse, int64_t batch,
                              int64_t heads, int64_t seq, int64_t dim, int64_t block, bool causal,
                              double scale) {
  pybind11::gil_scoped_release nogil;
  const Problem p{batch, heads, seq, dim, block, causal, static_cast<float>(scale)};
  const int64_t nb = p.nblocks(), tasks = batch * heads * nb;
  const bool big = tasks > 1 && worth_threads(p, ptr<const int32_t>(row_ptr));
#pragma omp parallel if (big)
  {
    std::vector<float> scores;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      forward_row_block(p, t / nb, t % nb, ptr<const float>(q), ptr<const float>(k),
                        ptr<const float>(v), ptr<const int32_t>(row_ptr), ptr<const int32_t>(cols),
                        ptr<float>(out), ptr<float>(lse), scores);
    }
  }
}

// One (batch, head) of the backward: see Note [no scores kept between forward and backward].
// dq, dk, dv must be zero on entry.
void backward_head(const Problem& p, int64_t bh, const float* q, const float* k, const float* v,
                   const float* out, const float* dout, const float* lse, const int32_t* row_ptr,
                   const int32_t* cols, float* dq, float* dk, float* dv) {
  const int64_t h = bh % p.heads, nb = p.nblocks(), D = p.dim, B = p.block;
  const int32_t* rp = row_ptr + h * (nb + 1);
  const int64_t base = bh * p.seq;
  for (int64_t r = 0; r < nb; ++r) {
    for (int64_t i = r * B; i < (r + 1) * B; ++i) {
      const float* qi = q + (base + i) * D;
      const float* doi = dout + (base + i) * D;
      float* dqi = dq + (base + i) * D;
      const float di = dot(doi, out + (base + i) * D, D);
      const float li = lse[base + i];
      for (int64_t e = rp[r]; e < rp[r + 1]; ++e) {
        const int64_t c = cols[e];
        const int64_t j_end = p.causal ? std::min((c + 1) * B, i + 1) : (c + 1) * B;
        for (int64_t j = c * B; j < j_end; ++j) {
          const float* kj = k + (base + j) * D;
          const float* vj = v + (base + j) * D;
          const float pij = std::exp(dot(qi, kj, D) * p.scale - li);
          axpy(pij, doi, dv + (base + j) * D, D);
          const float ds = pij * (dot(doi, vj, D) - di) * p.scale;
          axpy(ds, kj, dqi, D);
          axpy(ds, qi, dk + (base + j) * D, D);
        }
      }
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
#pragma omp parallel for schedule(static) if (big)
  for (int64_t bh = 0; bh < pairs; ++bh) {
    backward_head(p, bh, ptr<const float>(q), ptr<const float>(k), ptr<const float>(v),
                  ptr<const float>(out), ptr<const float>(dout), ptr<const float>(lse),
                  ptr<const int32_t>(row_ptr), ptr<const int32_t>(cols), ptr<float>(dq),
                  ptr<float>(dk), ptr<float>(dv));
  }
}

}  // namespace minispeed_sparse

// Called from kernels.cpp's PYBIND11_MODULE: the one module of the inference_kernels extension.
void register_sparse_attention(pybind11::module_& m) {
  m.def("sparse_attention_forward", &minispeed_sparse::sparse_attention_forward,
        "block-sparse attention forward (raw pointers; see minispeed.inference.sparse.attention)");
  m.def("sparse_attention_backward", &minispeed_sparse::sparse_attention_backward,
        "block-sparse attention backward (dq, dk, dv zeroed by the caller)");
}
