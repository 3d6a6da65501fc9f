// Thin pybind11 binding of the CUDA row gather / combine in permute_cuda.cu: pointers, sizes and
// the stream handle in, one launch out. No torch header (see permute.cpp); the Python wrapper
// (minispeed.moe.permute) validates, passes torch's current stream and a device int it reads
// back to raise on an out-of-range index. Built only where a GPU is present.

#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "permute_cuda.h"

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + " launch failed: " + cudaGetErrorString(err));
  }
}

void gather_rows(uintptr_t src, int64_t n_src, uintptr_t out, int64_t n_out, uintptr_t index,
                 uintptr_t scale, int64_t d, uintptr_t bad_flag, uintptr_t stream) {
  check(minispeed_moe::launch_gather_rows(
            reinterpret_cast<const float*>(src), n_src, reinterpret_cast<float*>(out), n_out,
            reinterpret_cast<const int64_t*>(index), reinterpret_cast<const float*>(scale), d,
            reinterpret_cast<int*>(bad_flag), reinterpret_cast<cudaStream_t>(stream)),
        "gather_rows");
}

void combine_rows(uintptr_t src, int64_t n_src, uintptr_t out, int64_t n_out, uintptr_t index,
                  uintptr_t weight, int64_t k, int64_t d, uintptr_t bad_flag, uintptr_t stream) {
  check(minispeed_moe::launch_combine_rows(
            reinterpret_cast<const float*>(src), n_src, reinterpret_cast<float*>(out), n_out,
            reinterpret_cast<const int64_t*>(index), reinterpret_cast<const float*>(weight), k, d,
            reinterpret_cast<int*>(bad_flag), reinterpret_cast<cudaStream_t>(stream)),
        "combine_rows");
}

}  // namespace

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "minispeed MoE row gather / weighted combine on CUDA (fp32, raw pointers) behind "
            "minispeed.moe.permute";
  m.def("gather_rows", &gather_rows, py::arg("src"), py::arg("n_src"), py::arg("out"),
        py::arg("n_out"), py::arg("index"), py::arg("scale"), py::arg("d"), py::arg("bad_flag"),
        py::arg("stream"));
  m.def("combine_rows", &combine_rows, py::arg("src"), py::arg("n_src"), py::arg("out"),
        py::arg("n_out"), py::arg("index"), py::arg("weight"), py::arg("k"), py::arg("d"),
        py::arg("bad_flag"), py::arg("stream"));
}
