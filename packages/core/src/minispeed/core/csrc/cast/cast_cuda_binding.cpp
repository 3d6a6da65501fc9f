// Thin pybind11 binding of the CUDA casts in cast_cuda.cu: pointers, a count and the stream
// handle in, one launch out. Like cast.cpp it includes no torch header (see Note [raw pointers, no
// torch headers] in cast.cpp): the Python wrapper checks device, dtype, contiguity and sizes and
// passes torch.cuda.current_stream().cuda_stream. Built only where a GPU is present.

#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "cast_cuda.h"

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + " launch failed: " + cudaGetErrorString(err));
  }
}

void float_to_bf16(uintptr_t src, uintptr_t dst, int64_t n, uintptr_t stream) {
  check(minispeed::launch_float_to_bf16(reinterpret_cast<const float*>(src),
                                        reinterpret_cast<uint16_t*>(dst), n,
                                        reinterpret_cast<cudaStream_t>(stream)),
        "float_to_bf16");
}

void bf16_to_float(uintptr_t src, uintptr_t dst, int64_t n, uintptr_t stream) {
  check(minispeed::launch_bf16_to_float(reinterpret_cast<const uint16_t*>(src),
                                        reinterpret_cast<float*>(dst), n,
                                        reinterpret_cast<cudaStream_t>(stream)),
        "bf16_to_float");
}

}  // namespace

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "minispeed fp32<->bf16 casts (round-to-nearest-even) on CUDA; raw-pointer API behind "
            "minispeed.core.ops.cast";
  m.def("float_to_bf16", &float_to_bf16, py::arg("src"), py::arg("dst"), py::arg("n"),
        py::arg("stream"));
  m.def("bf16_to_float", &bf16_to_float, py::arg("src"), py::arg("dst"), py::arg("n"),
        py::arg("stream"));
}
