// The Python face of the offload op: CPU optimizer steps and the async I/O engine.
//
// Raw-pointer API (no torch headers, so the whole op builds in seconds): call it through
// minispeed.offload.cpu_optim and minispeed.offload.aio, which validate every tensor first.
// Every entry point that can run long releases the GIL.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "aio/aio.h"
#include "cpu_optim/cpu_optim.h"
#include "minispeed/threads.h"  // max_threads (core/csrc/include)

namespace py = pybind11;
namespace mo = minispeed_offload;

namespace {

mo::Simd to_simd(int level) {
  if (level < 0 || level > static_cast<int>(mo::best_compiled_simd())) {
    throw std::invalid_argument("SIMD level " + std::to_string(level) +
                                " is not compiled into this build (best is " +
                                std::to_string(static_cast<int>(mo::best_compiled_simd())) +
                                "); pass a level from simd_levels()");
  }
  return static_cast<mo::Simd>(level);
}

mo::HalfKind to_half(int kind) {
  if (kind < 0 || kind > 2) throw std::invalid_argument("half kind must be 0, 1 (bf16) or 2 (fp16)");
  return static_cast<mo::HalfKind>(kind);
}

// ptrs[k] = (param, grad, state0, state1, half); counts[k] = numel.
std::vector<mo::Segment> segments(const std::vector<std::vector<uintptr_t>>& ptrs,
                                  const std::vector<int64_t>& counts) {
  if (ptrs.size() != counts.size()) throw std::invalid_argument("ptrs and counts differ in length");
  std::vector<mo::Segment> out;
  out.reserve(ptrs.size());
  for (size_t k = 0; k < ptrs.size(); ++k) {
    if (ptrs[k].size() != 5) throw std::invalid_argument("each segment needs 5 pointers");
    out.push_back({reinterpret_cast<float*>(ptrs[k][0]), reinterpret_cast<const float*>(ptrs[k][1]),
                   reinterpret_cast<float*>(ptrs[k][2]), reinterpret_cast<float*>(ptrs[k][3]),
                   reinterpret_cast<uint16_t*>(ptrs[k][4]), counts[k]});
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "minispeed.offload op: SIMD CPU optimizers and thread-pool async file I/O "
            "(raw pointers: call it through minispeed.offload, which validates)";
  const auto no_gil = py::call_guard<py::gil_scoped_release>();

  m.def(
      "adam_step",
      [](const std::vector<std::vector<uintptr_t>>& ptrs, const std::vector<int64_t>& counts,
         float wd_l2, float decay, float one_minus_beta1, float beta2, float one_minus_beta2,
         float bc2_sqrt, float eps, float neg_step_size, int half, int simd, int64_t grain) {
        const auto segs = segments(ptrs, counts);
        const mo::AdamScalars s{wd_l2, decay, one_minus_beta1, beta2, one_minus_beta2,
                                bc2_sqrt, eps, neg_step_size};
        py::gil_scoped_release release;
        mo::adam_step(segs, s, to_half(half), to_simd(simd), grain);
      },
      "Adam/AdamW step over many tensors (see cpu_optim.h for the scalars)");
  m.def(
      "adagrad_step",
      [](const std::vector<std::vector<uintptr_t>>& ptrs, const std::vector<int64_t>& counts,
         float weight_decay, float eps, float neg_clr, int half, int simd, int64_t grain) {
        const auto segs = segments(ptrs, counts);
        const mo::AdagradScalars s{weight_decay, eps, neg_clr};
        py::gil_scoped_release release;
        mo::adagrad_step(segs, s, to_half(half), to_simd(simd), grain);
      },
      "Adagrad step over many tensors");
  m.def(
      "lion_step",
      [](const std::vector<std::vector<uintptr_t>>& ptrs, const std::vector<int64_t>& counts,
         float beta1, float one_minus_beta1, float beta2, float one_minus_beta2, float decay,
         float neg_lr, int half, int simd, int64_t grain) {
        const auto segs = segments(ptrs, counts);
        const mo::LionScalars s{beta1, one_minus_beta1, beta2, one_minus_beta2, decay, neg_lr};
        py::gil_scoped_release release;
        mo::lion_step(segs, s, to_half(half), to_simd(simd), grain);
      },
      "Lion step over many tensors");
  m.def("simd_levels", &minispeed::simd::compiled_simd_levels,
        "SIMD levels compiled in: 0 scalar, 1 AVX2, 2 AVX-512");
  m.def("max_threads", &minispeed::max_threads, "OpenMP threads a parallel loop may use now");

  py::class_<mo::AioEngine>(m, "AioEngine")
      .def(py::init<int, int64_t, bool>(), py::arg("threads"), py::arg("block_bytes"),
           py::arg("single_submit"))
      .def("submit", &mo::AioEngine::submit, py::arg("path"), py::arg("buffer"),
           py::arg("nbytes"), py::arg("offset"), py::arg("write"), py::arg("direct"),
           py::arg("fsync_after"))
      .def(
          "wait",
          [](mo::AioEngine& engine, int64_t id) {
            mo::IoResult r;
            {
              py::gil_scoped_release release;
              r = engine.wait(id);
            }
            return std::make_tuple(r.bytes, r.err, r.message);
          },
          py::arg("id"), "block until request id completes: (bytes, err, message)")
      .def("pending", &mo::AioEngine::pending, no_gil)
      .def_property_readonly("threads", &mo::AioEngine::threads);
  m.def("io_busy_seconds", &mo::io_busy_seconds, no_gil,
        "seconds with at least one request of any engine in flight (Note [the I/O busy clock])");
  m.attr("SHORT_READ") = mo::kShortRead;
}
