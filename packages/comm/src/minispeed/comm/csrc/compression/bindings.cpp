// Python bindings of the compression kernels: check tensors, allocate outputs, pick the device.
// The only translation unit that includes torch (see compression.h for the formats).
// Python-side wrappers (minispeed/comm/compression/ops.py) validate arguments with friendlier
// messages first; the checks here guard the raw pointers against misuse from elsewhere.

#include <torch/extension.h>

#include <vector>

#include "compression.h"

namespace mc = minispeed_compression;

namespace {

mc::Simd to_simd(int64_t level) {
  TORCH_CHECK(level >= 0 && level <= static_cast<int64_t>(mc::best_compiled_simd()),
              "SIMD level ", level, " is not compiled into this build (best is ",
              static_cast<int>(mc::best_compiled_simd()),
              "); pass a level from simd_levels()");
  return static_cast<mc::Simd>(level);
}

void check_flat(const torch::Tensor& t, torch::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", c10::toString(dtype), ", got ",
              t.scalar_type(), "; convert it before calling");
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), name,
              " must be a contiguous 1-D tensor; pass tensor.reshape(-1).contiguous()");
}

#if defined(MINISPEED_WITH_CUDA)
// The caller passes the current CUDA stream as an integer handle (torch.cuda.Stream.cuda_stream),
// so this file needs no CUDA header: CPU-only torch builds can compile it too.
void* as_stream(int64_t handle) { return reinterpret_cast<void*>(handle); }
#endif

void require_cpu_or_cuda(const torch::Tensor& t) {
#if defined(MINISPEED_WITH_CUDA)
  TORCH_CHECK(t.is_cpu() || t.is_cuda(), "compression ops run on CPU or CUDA tensors, got ",
              t.device());
#else
  TORCH_CHECK(t.is_cpu(), "this build of the compression op has no CUDA kernels (tensor on ",
              t.device(), "); use the reference implementation or build with CUDA");
#endif
}

bool has_cuda() {
#if defined(MINISPEED_WITH_CUDA)
  return true;
#else
  return false;
#endif
}

std::vector<torch::Tensor> sign_pack(const torch::Tensor& x, int64_t chunk, int64_t simd,
                                     [[maybe_unused]] int64_t stream) {
  check_flat(x, torch::kFloat32, "x");
  require_cpu_or_cuda(x);
  TORCH_CHECK(chunk > 0, "chunk must be positive, got ", chunk);
  const int64_t n = x.numel();
  auto bits = torch::empty({(n + 7) / 8}, x.options().dtype(torch::kUInt8));
  auto scales = torch::empty({(n + chunk - 1) / chunk}, x.options());
  if (n == 0) return {bits, scales};
#if defined(MINISPEED_WITH_CUDA)
  if (x.is_cuda()) {
    mc::sign_pack_cuda(x.data_ptr<float>(), n, chunk, bits.data_ptr<uint8_t>(),
                       scales.data_ptr<float>(), as_stream(stream));
    return {bits, scales};
  }
#endif
  mc::sign_pack(x.data_ptr<float>(), n, chunk, bits.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                to_simd(simd));
  return {bits, scales};
}

torch::Tensor sign_unpack(const torch::Tensor& bits, const torch::Tensor& scales, int64_t chunk,
                          int64_t n, int64_t simd, [[maybe_unused]] int64_t stream) {
  check_flat(bits, torch::kUInt8, "bits");
  check_flat(scales, torch::kFloat32, "scales");
  require_cpu_or_cuda(bits);
  TORCH_CHECK(bits.device() == scales.device(), "bits and scales must be on one device");
  TORCH_CHECK(chunk > 0 && n >= 0, "need chunk > 0 and numel >= 0");
  TORCH_CHECK(bits.numel() == (n + 7) / 8, "bits holds ", bits.numel(), " bytes but numel ", n,
              " needs ", (n + 7) / 8);
  TORCH_CHECK(scales.numel() == (n + chunk - 1) / chunk, "scales holds ", scales.numel(),
              " values but numel ", n, " with chunk ", chunk, " needs ", (n + chunk - 1) / chunk);
  auto out = torch::empty({n}, scales.options());
  if (n == 0) return out;
#if defined(MINISPEED_WITH_CUDA)
  if (bits.is_cuda()) {
    mc::sign_unpack_cuda(bits.data_ptr<uint8_t>(), scales.data_ptr<float>(), n, chunk,
                         out.data_ptr<float>(), as_stream(stream));
    return out;
  }
#endif
  mc::sign_unpack(bits.data_ptr<uint8_t>(), scales.data_ptr<float>(), n, chunk,
                  out.data_ptr<float>(), to_simd(simd));
  return out;
}

void check_quant_args(int64_t block, int64_t bits) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  TORCH_CHECK(block > 0, "block must be positive, got ", block);
  TORCH_CHECK(bits == 8 || block % 2 == 0, "int4 needs an even block so bytes do not straddle "
              "blocks; got block ", block);
}

std::vector<torch::Tensor> quantize_blocks(const torch::Tensor& x, int64_t block, int64_t bits,
                                           int64_t simd, [[maybe_unused]] int64_t stream) {
  check_flat(x, torch::kFloat32, "x");
  require_cpu_or_cuda(x);
  check_quant_args(block, bits);
  const int64_t n = x.numel();
  auto q = torch::empty({bits == 8 ? n : (n + 1) / 2}, x.options().dtype(torch::kUInt8));
  auto scales = torch::empty({(n + block - 1) / block}, x.options());
  if (n == 0) return {q, scales};
#if defined(MINISPEED_WITH_CUDA)
  if (x.is_cuda()) {
    mc::quantize_blocks_cuda(x.data_ptr<float>(), n, block, static_cast<int>(bits),
                             q.data_ptr<uint8_t>(), scales.data_ptr<float>(), as_stream(stream));
    return {q, scales};
  }
#endif
  mc::quantize_blocks(x.data_ptr<float>(), n, block, static_cast<int>(bits), q.data_ptr<uint8_t>(),
                      scales.data_ptr<float>(), to_simd(simd));
  return {q, scales};
}

torch::Tensor dequantize_blocks(const torch::Tensor& q, const torch::Tensor& scales, int64_t block,
                                int64_t bits, int64_t n, int64_t simd, [[maybe_unused]] int64_t stream) {
  check_flat(q, torch::kUInt8, "q");
  check_flat(scales, torch::kFloat32, "scales");
  require_cpu_or_cuda(q);
  check_quant_args(block, bits);
  TORCH_CHECK(q.device() == scales.device(), "q and scales must be on one device");
  const int64_t q_bytes = bits == 8 ? n : (n + 1) / 2;
  TORCH_CHECK(q.numel() == q_bytes, "q holds ", q.numel(), " bytes but numel ", n, " at ", bits,
              " bits needs ", q_bytes);
  TORCH_CHECK(scales.numel() == (n + block - 1) / block, "scales holds ", scales.numel(),
              " values but numel ", n, " with block ", block, " needs ", (n + block - 1) / block);
  auto out = torch::empty({n}, scales.options());
  if (n == 0) return out;
#if defined(MINISPEED_WITH_CUDA)
  if (q.is_cuda()) {
    mc::dequantize_blocks_cuda(q.data_ptr<uint8_t>(), scales.data_ptr<float>(), n, block,
                               static_cast<int>(bits), out.data_ptr<float>(), as_stream(stream));
    return out;
  }
#endif
  mc::dequantize_blocks(q.data_ptr<uint8_t>(), scales.data_ptr<float>(), n, block,
                        static_cast<int>(bits), out.data_ptr<float>(), to_simd(simd));
  return out;
}

std::vector<torch::Tensor> topk_select(const torch::Tensor& x, int64_t k, int64_t simd) {
  check_flat(x, torch::kFloat32, "x");
  TORCH_CHECK(x.is_cpu(), "topk_select has no CUDA kernel; the wrapper uses the reference there");
  TORCH_CHECK(k >= 0 && k <= x.numel(), "k must be in [0, numel=", x.numel(), "], got ", k);
  TORCH_CHECK(x.numel() <= INT32_MAX, "top-k indices are int32: numel must be < 2^31");
  auto values = torch::empty({k}, x.options());
  auto indices = torch::empty({k}, x.options().dtype(torch::kInt32));
  const int rc = mc::topk_select(x.data_ptr<float>(), x.numel(), k, values.data_ptr<float>(),
                                 indices.data_ptr<int32_t>(), to_simd(simd));
  TORCH_CHECK(rc == 0, "top-k input holds NaN, so no order exists; find where the gradient "
              "overflows (e.g. enable loss scaling) before compressing");
  return {values, indices};
}

void sparse_accumulate_(torch::Tensor& out, const torch::Tensor& values,
                        const torch::Tensor& indices, [[maybe_unused]] int64_t stream) {
  check_flat(out, torch::kFloat32, "out");
  check_flat(values, torch::kFloat32, "values");
  check_flat(indices, torch::kInt32, "indices");
  require_cpu_or_cuda(out);
  TORCH_CHECK(values.numel() == indices.numel(), "values (", values.numel(), ") and indices (",
              indices.numel(), ") must have the same length");
  TORCH_CHECK(out.device() == values.device() && out.device() == indices.device(),
              "out, values and indices must be on one device");
  if (values.numel() == 0) return;
#if defined(MINISPEED_WITH_CUDA)
  if (out.is_cuda()) {
    // Indices are not bounds-checked on the device; the wrapper checks them on the host side.
    mc::sparse_accumulate_cuda(out.data_ptr<float>(), out.numel(), values.data_ptr<float>(),
                               indices.data_ptr<int32_t>(), values.numel(), as_stream(stream));
    return;
  }
#endif
  const int64_t rc = mc::sparse_accumulate(out.data_ptr<float>(), out.numel(),
                                           values.data_ptr<float>(), indices.data_ptr<int32_t>(),
                                           values.numel());
  TORCH_CHECK(rc == 0, "index ", indices[-1 - rc].item<int32_t>(), " at position ", -1 - rc,
              " is outside [0, ", out.numel(), "): the indices do not belong to this tensor");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "minispeed.comm gradient compression kernels (sign bits, block quantization, top-k)";
  m.def("simd_levels", &minispeed::simd::compiled_simd_levels,
        "SIMD levels compiled in: 0 scalar, 1 AVX2, 2 AVX-512");
  m.def("has_cuda", &has_cuda, "Whether CUDA kernels are compiled in");
  // `stream`: the CUDA stream handle for CUDA tensors (ignored on the CPU).
  m.def("sign_pack", &sign_pack, "x, chunk, simd -> [bits u8, scales f32]", py::arg("x"),
        py::arg("chunk"), py::arg("simd"), py::arg("stream") = 0);
  m.def("sign_unpack", &sign_unpack, "bits, scales, chunk, numel, simd -> f32", py::arg("bits"),
        py::arg("scales"), py::arg("chunk"), py::arg("numel"), py::arg("simd"),
        py::arg("stream") = 0);
  m.def("quantize_blocks", &quantize_blocks, "x, block, bits, simd -> [q u8, scales f32]",
        py::arg("x"), py::arg("block"), py::arg("bits"), py::arg("simd"), py::arg("stream") = 0);
  m.def("dequantize_blocks", &dequantize_blocks, "q, scales, block, bits, numel, simd -> f32",
        py::arg("q"), py::arg("scales"), py::arg("block"), py::arg("bits"), py::arg("numel"),
        py::arg("simd"), py::arg("stream") = 0);
  m.def("topk_select", &topk_select, "x, k, simd -> [values f32, indices i32 ascending]");
  m.def("sparse_accumulate_", &sparse_accumulate_, "out[indices] += values, in place",
        py::arg("out"), py::arg("values"), py::arg("indices"), py::arg("stream") = 0);
}
