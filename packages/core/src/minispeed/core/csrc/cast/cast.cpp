// fp32 <-> bf16 casts with round-to-nearest-even, and a fused flatten/unflatten, on the CPU.
//
// One file per SIMD level would triple the code for one formula, so the vector loops are chosen
// at compile time by the define the builder passes (-DMINISPEED_SIMD_AVX512 / _AVX2 / _SCALAR);
// every path ends in the same scalar loop for the tail, so all three give identical bits.
//
// Costs: float_to_bf16 reads 4 B and writes 2 B per element; bf16_to_float reads 2 B, writes 4 B.
// Work is split into chunks of kGrain elements run on OpenMP threads with the GIL released.
//
// Note [raw pointers, no torch headers]
// The binding takes data pointers and element counts, not at::Tensor: without torch's headers
// this file compiles in seconds instead of a minute. The Python wrapper (minispeed.core.ops.cast)
// checks device, dtype, contiguity, sizes and aliasing before it passes a pointer here. OpenMP
// resolves to the libgomp torch already loaded (same soname), so torch.set_num_threads applies.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "minispeed/simd.h"  // conversions and level macros shared by every op (core/csrc/include)
#include "minispeed/threads.h"  // max_threads

namespace {

using minispeed::simd::bf16_to_f32;
using minispeed::simd::f32_to_bf16_rne;

// 32768 elements = 128 KiB of fp32 per task: big enough to amortize a task, small enough that
// two threads share a 1M-element cast evenly.
constexpr int64_t kGrain = 1 << 15;

void f32_to_bf16_range(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
#if defined(MINISPEED_HAS_AVX512)
  for (; i + 16 <= n; i += 16) {  // 16 lanes: 64 B read, 32 B written per iteration
    const __m256i half = minispeed::simd::f32x16_to_bf16(_mm512_loadu_ps(src + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), half);
  }
#elif defined(MINISPEED_HAS_AVX2)
  for (; i + 16 <= n; i += 16) {  // two 8-lane halves packed into one 16 x u16 store
    const __m256i lo = minispeed::simd::f32x8_to_bf16_lanes(_mm256_loadu_ps(src + i));
    const __m256i hi = minispeed::simd::f32x8_to_bf16_lanes(_mm256_loadu_ps(src + i + 8));
    // packus interleaves 128-bit lanes (lo0 hi0 lo1 hi1); the permute restores lo0 lo1 hi0 hi1.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), packed);
  }
#endif
  for (; i < n; ++i) {
    dst[i] = f32_to_bf16_rne(src[i]);
  }
}

void bf16_to_f32_range(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(MINISPEED_HAS_AVX512)
  for (; i + 16 <= n; i += 16) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, minispeed::simd::bf16x16_to_f32(half));
  }
#elif defined(MINISPEED_HAS_AVX2)
  for (; i + 8 <= n; i += 8) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, minispeed::simd::bf16x8_to_f32(half));
  }
#endif
  for (; i < n; ++i) {
    dst[i] = bf16_to_f32(src[i]);
  }
}

// Runs body(begin, end) over [0, n) in chunks of kGrain on OpenMP threads (serially when one
// chunk suffices, so small casts pay no thread wake-up).
template <typename Body>
void parallel_chunks(int64_t n, int64_t grain, const Body& body) {
  const int64_t chunks = (n + grain - 1) / grain;
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    body(c * grain, std::min(n, (c + 1) * grain));
  }
}

void float_to_bf16(uintptr_t src, uintptr_t dst, int64_t n) {
  const float* s = reinterpret_cast<const float*>(src);
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
  parallel_chunks(n, kGrain, [&](int64_t b, int64_t e) { f32_to_bf16_range(s + b, d + b, e - b); });
}

void bf16_to_float(uintptr_t src, uintptr_t dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  float* d = reinterpret_cast<float*>(dst);
  parallel_chunks(n, kGrain, [&](int64_t b, int64_t e) { bf16_to_f32_range(s + b, d + b, e - b); });
}

// How one segment is copied; the values are part of the Python contract (ops/cast.py).
enum CopyKind : int { kBytes = 0, kFloatToBf16 = 1, kBf16ToFloat = 2 };

// Element size on each side, per kind (kBytes counts bytes).
int64_t src_bytes(int kind) { return kind == kFloatToBf16 ? 4 : kind == kBf16ToFloat ? 2 : 1; }
int64_t dst_bytes(int kind) { return kind == kFloatToBf16 ? 2 : kind == kBf16ToFloat ? 4 : 1; }

// Copies segment k: counts[k] elements (bytes for kBytes) from srcs[k] to dsts[k], converting as
// kinds[k] says. All segments are cut into tasks of about kGrain elements and run as one parallel
// loop, so a thousand small parameters cost one loop, not a thousand tiny copies.
void copy_segments(const std::vector<uintptr_t>& srcs, const std::vector<uintptr_t>& dsts,
                   const std::vector<int64_t>& counts, const std::vector<int>& kinds) {
  const size_t k_total = srcs.size();
  if (dsts.size() != k_total || counts.size() != k_total || kinds.size() != k_total) {
    throw std::invalid_argument("copy_segments: srcs, dsts, counts and kinds differ in length");
  }
  struct Task {
    size_t segment;
    int64_t begin;
    int64_t end;
  };
  std::vector<Task> tasks;
  for (size_t k = 0; k < k_total; ++k) {
    if (kinds[k] < kBytes || kinds[k] > kBf16ToFloat) {
      throw std::invalid_argument("copy_segments: unknown kind " + std::to_string(kinds[k]));
    }
    const int64_t grain = kinds[k] == kBytes ? kGrain * 4 : kGrain;
    for (int64_t b = 0; b < counts[k]; b += grain) {
      tasks.push_back({k, b, std::min(counts[k], b + grain)});
    }
  }
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
#pragma omp parallel for schedule(dynamic, 1) if (n_tasks > 1)
  for (int64_t t = 0; t < n_tasks; ++t) {
    const Task& task = tasks[t];
    const int kind = kinds[task.segment];
    const char* s = reinterpret_cast<const char*>(srcs[task.segment]) + task.begin * src_bytes(kind);
    char* d = reinterpret_cast<char*>(dsts[task.segment]) + task.begin * dst_bytes(kind);
    const int64_t n = task.end - task.begin;
    if (kind == kBytes) {
      std::memcpy(d, s, static_cast<size_t>(n));
    } else if (kind == kFloatToBf16) {
      f32_to_bf16_range(reinterpret_cast<const float*>(s), reinterpret_cast<uint16_t*>(d), n);
    } else {
      bf16_to_f32_range(reinterpret_cast<const uint16_t*>(s), reinterpret_cast<float*>(d), n);
    }
  }
}

const char* simd_level() { return minispeed::simd::compiled_simd_name(); }

}  // namespace

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "minispeed fp32<->bf16 casts (round-to-nearest-even) and fused flatten/unflatten. "
            "Raw-pointer API: call it through minispeed.core.ops.cast, which validates.";
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("float_to_bf16", &float_to_bf16, "fp32 -> bf16 (RNE): n elements from src to dst",
        py::arg("src"), py::arg("dst"), py::arg("n"), no_gil);
  m.def("bf16_to_float", &bf16_to_float, "bf16 -> fp32 (exact): n elements from src to dst",
        py::arg("src"), py::arg("dst"), py::arg("n"), no_gil);
  m.def("copy_segments", &copy_segments, "copy/convert many segments in one parallel loop",
        py::arg("srcs"), py::arg("dsts"), py::arg("counts"), py::arg("kinds"), no_gil);
  m.def("simd_level", &simd_level, "the SIMD level this binary was compiled for");
  m.def("max_threads", &minispeed::max_threads, "OpenMP threads a parallel loop may use now");
}
