// A plain C++ program (no torch, no pybind11) over core's minispeed/simd.h, built by
// test_simd_header_conversions.py once per SIMD level with the op builder's flags.
//
// It converts a fixed set of fp32 bit patterns (IEEE specials, rounding ties, fp16 edges, then
// pseudo-random ones) with the header's scalar conversions, checks every vector form compiled
// at this level against them lane by lane, and writes the inputs and the scalar results to
// argv[1] (n u32, n u16 bf16, n u16 fp16) for the test to compare with torch. Prints the level
// and the number of vector lanes checked; exits 1 at the first disagreement.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "minispeed/simd.h"

namespace s = minispeed::simd;

namespace {

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

int fail(const char* what, size_t i, uint32_t input, uint32_t got, uint32_t want) {
  std::fprintf(stderr, "%s: element %zu (fp32 bits 0x%08x): got 0x%x, scalar form gives 0x%x\n",
               what, i, input, got, want);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT_FILE\n", argv[0]);
    return 2;
  }
  std::vector<uint32_t> in = {
      0x00000000u, 0x80000000u, 0x7F800000u, 0xFF800000u,  // +-0, +-inf
      0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFFFFFFFFu,  // quiet and signalling NaNs
      0x3F808000u, 0x3F818000u, 0x3F808001u, 0x3F807FFFu,  // bf16 ties (to even, to odd) and near
      0x00000001u, 0x807FFFFFu, 0x7F7FFFFFu, 0xFF7FFFFFu,  // fp32 denormals, largest finite
      0x477FE000u, 0x477FEFFFu, 0x477FF000u, 0x477FFFFFu,  // fp16 max (65504) and the inf edge
      0x38800000u, 0x387FFFFFu, 0x33000000u, 0x33000001u,  // fp16 normal/subnormal edges
      0x33800000u, 0x32FFFFFFu, 0x38801000u, 0x38803000u,  // fp16 ties
  };
  uint64_t state = 0x9E3779B97F4A7C15ull;
  while (in.size() < (1u << 16)) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    in.push_back(static_cast<uint32_t>(state >> 32));
  }
  const size_t n = in.size();  // a multiple of 16
  std::vector<float> f(n);
  std::memcpy(f.data(), in.data(), n * sizeof(float));
  std::vector<uint16_t> bf(n), hf(n);
  for (size_t i = 0; i < n; ++i) {
    bf[i] = s::f32_to_bf16_rne(f[i]);
    hf[i] = s::f32_to_fp16_rne(f[i]);
    const uint32_t back = bits_of(s::bf16_to_f32(bf[i]));
    if (back != static_cast<uint32_t>(bf[i]) << 16) return fail("bf16_to_f32", i, in[i], back, bf[i]);
  }
  size_t lanes = 0;
#if defined(MINISPEED_HAS_AVX2)
  for (size_t i = 0; i < n; i += 8) {
    alignas(32) uint16_t half[8];
    alignas(32) float wide[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(half), s::f32x8_to_bf16(_mm256_loadu_ps(&f[i])));
    alignas(32) uint32_t lane32[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lane32),
                       s::f32x8_to_bf16_lanes(_mm256_loadu_ps(&f[i])));
    _mm256_store_ps(wide, s::bf16x8_to_f32(_mm_loadu_si128(reinterpret_cast<__m128i*>(&bf[i]))));
    for (int j = 0; j < 8; ++j) {
      if (half[j] != bf[i + j]) return fail("f32x8_to_bf16", i + j, in[i + j], half[j], bf[i + j]);
      if (lane32[j] != bf[i + j]) {
        return fail("f32x8_to_bf16_lanes", i + j, in[i + j], lane32[j], bf[i + j]);
      }
      const uint32_t back = bits_of(wide[j]);
      if (back != static_cast<uint32_t>(bf[i + j]) << 16) {
        return fail("bf16x8_to_f32", i + j, in[i + j], back, bf[i + j]);
      }
    }
    // The hardware fp16 conversion the vector paths use must round like f32_to_fp16_rne
    // (NaN payloads aside: both give a NaN, the scalar form the canonical one).
    alignas(16) uint16_t h[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(h),
                    _mm256_cvtps_ph(_mm256_loadu_ps(&f[i]), _MM_FROUND_TO_NEAREST_INT));
    for (int j = 0; j < 8; ++j) {
      if (!std::isnan(f[i + j]) && h[j] != hf[i + j]) {
        return fail("_mm256_cvtps_ph vs f32_to_fp16_rne", i + j, in[i + j], h[j], hf[i + j]);
      }
    }
    // hsum256's documented order: ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)).
    const float* v = &f[i];
    const float want = ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
    const float got = s::hsum256(_mm256_loadu_ps(v));
    if (bits_of(got) != bits_of(want) && !(std::isnan(got) && std::isnan(want))) {
      return fail("hsum256", i, in[i], bits_of(got), bits_of(want));
    }
    lanes += 8;
  }
#endif
#if defined(MINISPEED_HAS_AVX512)
  for (size_t i = 0; i < n; i += 16) {
    alignas(64) uint16_t half[16];
    alignas(64) float wide[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(half), s::f32x16_to_bf16(_mm512_loadu_ps(&f[i])));
    _mm512_store_ps(wide,
                    s::bf16x16_to_f32(_mm256_loadu_si256(reinterpret_cast<__m256i*>(&bf[i]))));
    for (int j = 0; j < 16; ++j) {
      if (half[j] != bf[i + j]) return fail("f32x16_to_bf16", i + j, in[i + j], half[j], bf[i + j]);
      const uint32_t back = bits_of(wide[j]);
      if (back != static_cast<uint32_t>(bf[i + j]) << 16) {
        return fail("bf16x16_to_f32", i + j, in[i + j], back, bf[i + j]);
      }
    }
    lanes += 16;
  }
#endif
  FILE* out = std::fopen(argv[1], "wb");
  if (out == nullptr) return 2;
  std::fwrite(in.data(), sizeof(uint32_t), n, out);
  std::fwrite(bf.data(), sizeof(uint16_t), n, out);
  std::fwrite(hf.data(), sizeof(uint16_t), n, out);
  std::fclose(out);
  std::printf("%s %zu\n", s::compiled_simd_name(), lanes);
  return 0;
}
