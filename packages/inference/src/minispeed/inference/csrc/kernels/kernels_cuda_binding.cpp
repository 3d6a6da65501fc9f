// Thin pybind11 binding of the CUDA kernels in kernels_cuda.cu, built only where a GPU is present
// (`inference_kernels_cuda`). Each function takes the arguments of its CPU twin in kernels.cpp
// (device pointers as integers, sizes, scalars) plus the CUDA stream handle, launches once and
// raises if the launch failed. No torch header (see Note [raw pointers, no torch headers] in
// kernels.cpp): minispeed/inference/kernels.py checks devices, dtypes, contiguity and shapes and
// passes torch.cuda.current_stream().cuda_stream.

#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels_cuda.h"

namespace {

template <typename T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("inference_kernels_cuda.") + what +
                             " launch failed: " + cudaGetErrorString(err));
  }
}

void layer_norm(uintptr_t x, uintptr_t residual, uintptr_t gamma, uintptr_t beta, uintptr_t out,
                uintptr_t res_out, int64_t rows, int64_t cols, double eps, uintptr_t stream) {
  check(minispeed_inference_norm(ptr<const float>(x), ptr<const float>(residual),
                                 ptr<const float>(gamma), ptr<const float>(beta), ptr<float>(out),
                                 ptr<float>(res_out), rows, cols, static_cast<float>(eps), false,
                                 as_stream(stream)),
        "layer_norm");
}

void rms_norm(uintptr_t x, uintptr_t residual, uintptr_t gamma, uintptr_t out, uintptr_t res_out,
              int64_t rows, int64_t cols, double eps, uintptr_t stream) {
  check(minispeed_inference_norm(ptr<const float>(x), ptr<const float>(residual),
                                 ptr<const float>(gamma), nullptr, ptr<float>(out),
                                 ptr<float>(res_out), rows, cols, static_cast<float>(eps), true,
                                 as_stream(stream)),
        "rms_norm");
}

void bias_gelu(uintptr_t x, uintptr_t bias, uintptr_t out, int64_t rows, int64_t cols,
               uintptr_t stream) {
  check(minispeed_inference_bias_gelu(ptr<const float>(x), ptr<const float>(bias),
                                      ptr<float>(out), rows, cols, as_stream(stream)),
        "bias_gelu");
}

void masked_softmax(uintptr_t x, uintptr_t mask, uintptr_t out, int64_t rows, int64_t cols,
                    double scale, uintptr_t stream) {
  check(minispeed_inference_masked_softmax(ptr<const float>(x), ptr<const uint8_t>(mask),
                                           ptr<float>(out), rows, cols,
                                           static_cast<float>(scale), as_stream(stream)),
        "masked_softmax");
}

void rotary(uintptr_t x, uintptr_t cos_t, uintptr_t sin_t, uintptr_t positions, uintptr_t out,
            int64_t tokens, int64_t heads, int64_t dim, uintptr_t stream) {
  check(minispeed_inference_rotary(ptr<const float>(x), ptr<const float>(cos_t),
                                   ptr<const float>(sin_t), ptr<const int64_t>(positions),
                                   ptr<float>(out), tokens, heads, dim, as_stream(stream)),
        "rotary");
}

// max_len is bounded by max_blocks * block_size (what the tables can address), so the CPU
// signature suffices: the shared-memory buffer is sized for the longest addressable sequence.
void decode_attention(uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, uintptr_t block_tables,
                      uintptr_t seq_lens, uintptr_t out, int64_t batch, int64_t heads,
                      int64_t kv_heads, int64_t dim, int64_t block_size, int64_t max_blocks,
                      double scale, uintptr_t stream) {
  check(minispeed_inference_decode_attention(
            ptr<const float>(q), ptr<const float>(k_cache), ptr<const float>(v_cache),
            ptr<const int32_t>(block_tables), ptr<const int32_t>(seq_lens), ptr<float>(out), batch,
            heads, kv_heads, dim, block_size, max_blocks, block_size * max_blocks,
            static_cast<float>(scale), as_stream(stream)),
        "decode_attention");
}

void int8_linear(uintptr_t x, uintptr_t w_q, uintptr_t scales, uintptr_t bias, uintptr_t out,
                 int64_t m, int64_t n, int64_t k, uintptr_t stream) {
  check(minispeed_inference_int8_linear(ptr<const float>(x), ptr<const int8_t>(w_q),
                                        ptr<const float>(scales), ptr<const float>(bias),
                                        ptr<float>(out), m, n, k, as_stream(stream)),
        "int8_linear");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "minispeed.inference's fused kernels on CUDA (fp32); raw-pointer API behind "
            "minispeed.inference.kernels";
  m.def("layer_norm", &layer_norm);
  m.def("rms_norm", &rms_norm);
  m.def("bias_gelu", &bias_gelu);
  m.def("masked_softmax", &masked_softmax);
  m.def("rotary", &rotary);
  m.def("decode_attention", &decode_attention);
  m.def("int8_linear", &int8_linear);
}
