// Row gather and weighted row combine for MoE dispatch, on the CPU (fp32).
//
//   gather_rows:  out[i] = scale[i] * src[index[i]]          (index[i] < 0: out[i] = 0)
//   combine_rows: out[t] = sum_j weight[t, j] * src[index[t, j]]   (j < k; index < 0 skipped)
//
// Dispatch ("permute") is a gather: the expert-grouped buffer reads each of its rows from the
// token it came from. Combine ("unpermute") is the gather-sum back: each token reads its k expert
// outputs. Both write every output row from exactly one thread, so no atomics and no scatter
// conflicts; the backward passes are the same two kernels with the inverse maps (see
// minispeed/moe/permute.py).
//
// Costs (d = row width, fp32): gather_rows reads and writes 4 d B per output row (+8 B index);
// combine_rows reads 4 d k B and writes 4 d B per output row. Memory bound.
//
// Note [SIMD paths, one build]
// The row loops exist three times: scalar, AVX2+FMA and AVX-512F (the axpy rows are
// minispeed/simd.h's axpy_*, shared with the inference kernels). The vector versions are compiled
// with GCC/Clang target attributes (MINISPEED_TARGET_*), so every x86-64 build contains (and
// compile-checks) all three whatever the machine; which ones may RUN is capped by the level the
// builder compiled for (-DMINISPEED_SIMD_*, from the CPU flags or MINISPEED_SIMD), reported by
// simd_levels(). A `level` argument picks one at run time, so the tests compare every runnable
// path with the reference. The FMA paths round once per multiply-add where the scalar path rounds twice: they
// agree to a few ulp, not bit for bit.
//
// Like core's cast op this file includes no torch header (Note [raw pointers, no torch headers]
// in core/csrc/cast/cast.cpp): the Python wrapper checks dtype, device, contiguity and shapes;
// the index range is checked here, in the loop, so a bad index raises instead of reading wild.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "minispeed/simd.h"  // levels, MINISPEED_TARGET_*, axpy_* (core/csrc/include)

namespace {

namespace simd = minispeed::simd;

// ---- one row: y = a * x (copy when a == 1), y += a * x (simd::axpy_*) ---------------------------

void scale_row_scalar(float a, const float* x, float* y, int64_t d) {
  for (int64_t c = 0; c < d; ++c) y[c] = a * x[c];
}

#if defined(MINISPEED_X86)
MINISPEED_TARGET_AVX2 void scale_row_avx2(float a, const float* x, float* y, int64_t d) {
  const __m256 va = _mm256_set1_ps(a);
  int64_t c = 0;
  for (; c + 8 <= d; c += 8) _mm256_storeu_ps(y + c, _mm256_mul_ps(va, _mm256_loadu_ps(x + c)));
  for (; c < d; ++c) y[c] = a * x[c];
}

MINISPEED_TARGET_AVX512 void scale_row_avx512(float a, const float* x, float* y, int64_t d) {
  const __m512 va = _mm512_set1_ps(a);
  int64_t c = 0;
  for (; c + 16 <= d; c += 16) _mm512_storeu_ps(y + c, _mm512_mul_ps(va, _mm512_loadu_ps(x + c)));
  for (; c < d; ++c) y[c] = a * x[c];
}
#endif

using RowFn = void (*)(float a, const float* x, float* y, int64_t d);

struct RowOps {
  RowFn scale;
  RowFn axpy;
};

RowOps row_ops(int64_t level) {
  if (level < 0 || level > static_cast<int64_t>(simd::best_compiled_simd())) {
    throw std::invalid_argument("permute op: SIMD level " + std::to_string(level) +
                                " is not runnable in this build; pass one of simd_levels()");
  }
#if defined(MINISPEED_X86)
  if (level == static_cast<int64_t>(simd::Simd::kAvx512)) {
    return {scale_row_avx512, simd::axpy_avx512};
  }
  if (level == static_cast<int64_t>(simd::Simd::kAvx2)) return {scale_row_avx2, simd::axpy_avx2};
#endif
  return {scale_row_scalar, simd::axpy_scalar};
}

std::string bad_index(const char* op, int64_t at, int64_t value, int64_t rows) {
  return std::string(op) + ": index " + std::to_string(value) + " at position " +
         std::to_string(at) + " is outside [-1, " + std::to_string(rows) +
         "); -1 marks an empty slot, others must name a source row";
}

// out (n_out x d) <- rows of src (n_src x d) by index; scale may be 0 (all ones).
void gather_rows(uintptr_t src_p, int64_t n_src, uintptr_t out_p, int64_t n_out, uintptr_t index_p,
                 uintptr_t scale_p, int64_t d, int64_t level) {
  const RowOps ops = row_ops(level);
  const float* src = reinterpret_cast<const float*>(src_p);
  float* out = reinterpret_cast<float*>(out_p);
  const int64_t* index = reinterpret_cast<const int64_t*>(index_p);
  const float* scale = reinterpret_cast<const float*>(scale_p);
  std::atomic<int64_t> first_bad{-1};
#pragma omp parallel for schedule(static) if (n_out * d > (1 << 15))
  for (int64_t i = 0; i < n_out; ++i) {
    const int64_t r = index[i];
    float* o = out + i * d;
    if (r < 0 || r >= n_src) {
      if (r < -1 || r >= n_src) {
        int64_t expected = -1;
        first_bad.compare_exchange_strong(expected, i);
      }
      std::memset(o, 0, sizeof(float) * static_cast<size_t>(d));
      continue;
    }
    ops.scale(scale ? scale[i] : 1.0f, src + r * d, o, d);
  }
  const int64_t bad = first_bad.load();
  if (bad >= 0) throw std::out_of_range(bad_index("gather_rows", bad, index[bad], n_src));
}

// out (n_out x d) <- per row t, sum over j < k of weight[t*k+j] * src[index[t*k+j]].
void combine_rows(uintptr_t src_p, int64_t n_src, uintptr_t out_p, int64_t n_out,
                  uintptr_t index_p, uintptr_t weight_p, int64_t k, int64_t d, int64_t level) {
  const RowOps ops = row_ops(level);
  const float* src = reinterpret_cast<const float*>(src_p);
  float* out = reinterpret_cast<float*>(out_p);
  const int64_t* index = reinterpret_cast<const int64_t*>(index_p);
  const float* weight = reinterpret_cast<const float*>(weight_p);
  std::atomic<int64_t> first_bad{-1};
#pragma omp parallel for schedule(static) if (n_out * k * d > (1 << 15))
  for (int64_t t = 0; t < n_out; ++t) {
    float* o = out + t * d;
    std::memset(o, 0, sizeof(float) * static_cast<size_t>(d));
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = index[t * k + j];
      if (r < 0 || r >= n_src) {
        if (r < -1 || r >= n_src) {
          int64_t expected = -1;
          first_bad.compare_exchange_strong(expected, t * k + j);
        }
        continue;
      }
      ops.axpy(weight ? weight[t * k + j] : 1.0f, src + r * d, o, d);
    }
  }
  const int64_t bad = first_bad.load();
  if (bad >= 0) throw std::out_of_range(bad_index("combine_rows", bad, index[bad], n_src));
}

}  // namespace

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "minispeed MoE row gather / weighted combine (fp32, raw pointers): call it through "
            "minispeed.moe.permute, which validates";
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("gather_rows", &gather_rows, "out[i] = scale[i] * src[index[i]] (index -1: zero row)",
        py::arg("src"), py::arg("n_src"), py::arg("out"), py::arg("n_out"), py::arg("index"),
        py::arg("scale"), py::arg("d"), py::arg("level"), no_gil);
  m.def("combine_rows", &combine_rows,
        "out[t] = sum_j weight[t, j] * src[index[t, j]] (index -1 skipped)", py::arg("src"),
        py::arg("n_src"), py::arg("out"), py::arg("n_out"), py::arg("index"), py::arg("weight"),
        py::arg("k"), py::arg("d"), py::arg("level"), no_gil);
  m.def("simd_levels", &simd::compiled_simd_levels,
        "SIMD levels this build may run: 0 scalar, 1 AVX2, 2 AVX-512");
}
