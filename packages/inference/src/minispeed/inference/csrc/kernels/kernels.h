// The inference op's entry points that more than one of its C++ files calls (one extension: see
// kernels.cpp). Raw pointers and sizes, as the bindings take them (Note [raw pointers, no torch
// headers] in kernels.cpp); each releases the GIL itself while it runs.

#pragma once

#include <cstdint>

namespace minispeed_kernels {  // kernels.cpp

void layer_norm(uintptr_t x, uintptr_t residual, uintptr_t gamma, uintptr_t beta, uintptr_t out,
                uintptr_t res_out, int64_t rows, int64_t cols, double eps);
void bias_gelu(uintptr_t x, uintptr_t bias, uintptr_t out, int64_t rows, int64_t cols);
void bias_gelu_tanh(uintptr_t x, uintptr_t bias, uintptr_t out, int64_t rows, int64_t cols);
void decode_attention(uintptr_t q, uintptr_t k_cache, uintptr_t v_cache, uintptr_t block_tables,
                      uintptr_t seq_lens, uintptr_t out, int64_t batch, int64_t heads,
                      int64_t kv_heads, int64_t dim, int64_t block_size, int64_t max_blocks,
                      double scale);
void int8_linear(uintptr_t x, uintptr_t w_q, uintptr_t scales, uintptr_t bias, uintptr_t out,
                 int64_t m, int64_t n, int64_t k);

}  // namespace minispeed_kernels

namespace minispeed_linear {  // linear.cpp

void linear(uintptr_t x, uintptr_t w, uintptr_t bias, uintptr_t y, int64_t m, int64_t n,
            int64_t k, bool kn);

}  // namespace minispeed_linear
