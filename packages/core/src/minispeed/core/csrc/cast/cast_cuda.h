// Launchers of the CUDA fp32 <-> bf16 casts: plain CUDA C++ (no torch headers), so the .cu file
// compiles in seconds with nvcc alone and the torch binding stays in a host-only .cpp.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace minispeed {

// fp32 -> bf16 with round-to-nearest-even; every NaN becomes 0x7FC0. Reads 4 B, writes 2 B
// per element. dst holds the raw bf16 bits.
cudaError_t launch_float_to_bf16(const float* src, uint16_t* dst, int64_t n, cudaStream_t stream);

// bf16 -> fp32, exact. Reads 2 B, writes 4 B per element.
cudaError_t launch_bf16_to_float(const uint16_t* src, float* dst, int64_t n, cudaStream_t stream);

}  // namespace minispeed
