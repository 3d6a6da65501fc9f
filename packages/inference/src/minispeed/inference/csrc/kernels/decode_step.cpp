// A decode step's GPT blocks in one call: the same kernels as decode_plan.py's GPTDecodePlan ran
// one Python call at a time, in the same order on the same buffers (part of the inference_kernels
// extension; kernels.cpp's module calls register_decode_step).
//
// Note [the GPT blocks in one call]
// With the decode plan (Note [decode step as raw op calls] in decode_plan.py) a batch-1 int8 step
// of GPT-2 124M still spent ~2.2 ms of its ~16 ms outside the op's kernels: per layer ~11 calls
// from Python, two `index_copy_` into the cache with their views, the residual `add_`. Timed with
// the linears made no-ops that Python is ~0.5 ms a step; between the linears, which stream ~7 MB
// of weight through the caches each layer, it ran several times slower. Here the layer loop, the
// cache writes (a copy of each sequence's K and V row into its slot, what `index_copy_` did) and
// the residual add (h + y, one rounding, what `add_` did) run in C++, and every kernel is the
// entry point Python called, so the step's outputs are the plan's bit for bit (the kernels
// release the GIL themselves; the loop holds it between them).
//
// Tables, all int64, built once per plan (decode_plan.py writes them):
// - layers (L, kFields): per layer the norm and GeLU vectors and the four linears (qkv, o, fc,
//   proj), each as (kind, weight, scales, bias, N, K) with kind 0 int8 (N, K), 1 fp32 (N, K),
//   2 fp32 stored (K, N) (a Conv1D weight; kernels.stored_transposed);
// - eps (L, 2) doubles: the two layer norms' epsilon;
// - buffers (kBuffers): x0, x1 (the residual stream, ping-pong), a, p, y, n2, h, qkv, f, g, q;
// and per step caches (L, 2): each layer's K and V pool.

#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>

#include "kernels.h"  // the kernels this loop calls

namespace minispeed_decode_step {

constexpr int kLinearFields = 6;  // kind, weight, scales, bias, N, K
constexpr int kFields = 6 + 4 * kLinearFields;  // ln1 w, b, ln2 w, b, fc bias, tanh GeLU; linears
enum Buffer { kX0, kX1, kA, kP, kY, kN2, kH, kQkv, kF, kG, kQ, kBuffers };

// y (rows, N) = x (rows, K) @ Wᵀ + b by the descriptor at d (see the tables above).
void run_linear(const int64_t* d, uintptr_t x, uintptr_t y, int64_t rows) {
  const uintptr_t w = d[1], s = d[2], b = d[3];
  if (d[0] == 0)
    minispeed_kernels::int8_linear(x, w, s, b, y, rows, d[4], d[5]);
  else
    minispeed_linear::linear(x, w, b, y, rows, d[4], d[5], d[0] == 2);
}

// Returns the buffer holding the output (x0 or x1), (B, C).
uintptr_t gpt_layers(uintptr_t layers_p, uintptr_t eps_p, uintptr_t buffers_p, uintptr_t caches_p,
                     int64_t n_layers, uintptr_t slots_p, uintptr_t tables, uintptr_t lens,
                     int64_t batch, int64_t C, int64_t F, int64_t heads, int64_t dim,
                     int64_t block_size, int64_t max_blocks, double scale) {
  const auto* layers = reinterpret_cast<const int64_t*>(layers_p);
  const auto* eps = reinterpret_cast<const double*>(eps_p);
  const auto* buf = reinterpret_cast<const uintptr_t*>(buffers_p);
  const auto* caches = reinterpret_cast<const uintptr_t*>(caches_p);
  const auto* slots = reinterpret_cast<const int64_t*>(slots_p);
  const size_t row_bytes = static_cast<size_t>(C) * sizeof(float);  // one K or V row (H = KV)
  for (int64_t l = 0; l < n_layers; ++l) {
    const int64_t* f = layers + l * kFields;
    const int64_t* lin = f + 6;  // qkv, o, fc, proj descriptors
    const uintptr_t cur = buf[l % 2 ? kX1 : kX0], nxt = buf[l % 2 ? kX0 : kX1];
    minispeed_kernels::layer_norm(cur, 0, f[0], f[1], buf[kA], buf[kP], batch, C, eps[2 * l]);
    run_linear(lin, buf[kA], buf[kQkv], batch);
    const auto* qkv = reinterpret_cast<const float*>(buf[kQkv]);
    auto* kc = reinterpret_cast<float*>(caches[2 * l]);
    auto* vc = reinterpret_cast<float*>(caches[2 * l + 1]);
    for (int64_t b = 0; b < batch; ++b) {  // the cache writes, then q contiguous at B > 1
      const float* row = qkv + b * 3 * C;
      std::memcpy(kc + slots[b] * C, row + C, row_bytes);
      std::memcpy(vc + slots[b] * C, row + 2 * C, row_bytes);
      if (batch > 1) std::memcpy(reinterpret_cast<float*>(buf[kQ]) + b * C, row, row_bytes);
    }
    minispeed_kernels::decode_attention(batch > 1 ? buf[kQ] : buf[kQkv], caches[2 * l],
                                        caches[2 * l + 1], tables, lens, buf[kY], batch, heads,
                                        heads, dim, block_size, max_blocks, scale);
    run_linear(lin + kLinearFields, buf[kY], buf[kP], batch);
    minispeed_kernels::layer_norm(buf[kP], cur, f[2], f[3], buf[kN2], buf[kH], batch, C,
                                  eps[2 * l + 1]);
    run_linear(lin + 2 * kLinearFields, buf[kN2], buf[kF], batch);
    (f[5] ? minispeed_kernels::bias_gelu_tanh : minispeed_kernels::bias_gelu)(
        buf[kF], f[4], buf[kG], batch, F);
    run_linear(lin + 3 * kLinearFields, buf[kG], nxt, batch);
    auto* x = reinterpret_cast<float*>(nxt);
    const auto* h = reinterpret_cast<const float*>(buf[kH]);
    for (int64_t i = 0; i < batch * C; ++i) x[i] = x[i] + h[i];  // the residual add
  }
  return buf[n_layers % 2 ? kX1 : kX0];
}

}  // namespace minispeed_decode_step

// Called from kernels.cpp's PYBIND11_MODULE.
void register_decode_step(pybind11::module_& m) {
  m.attr("gpt_layer_fields") = minispeed_decode_step::kFields;
  m.attr("gpt_step_buffers") = static_cast<int>(minispeed_decode_step::kBuffers);
  m.def("gpt_layers", &minispeed_decode_step::gpt_layers,
        "a decode step through L GPT blocks from the plan's tables (raw pointers; see "
        "minispeed.inference.decode_plan.GPTDecodePlan)");
}
