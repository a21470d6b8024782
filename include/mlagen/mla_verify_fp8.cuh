// mlagen/mla_verify_fp8.cuh — e4m3 (fp8) KV rows: dequantize to bf16 for mma.sync, quantize for the store.
// Every e4m3 value (normal, subnormal, +-0, +-448, NaN) is exact in fp16 and in bf16, so the dequantized
// row is the cache's value and the math after it is the bf16 kernel's; SGLang's per-layer k_scale / v_scale
// are applied outside the kernel (scores: softmax_scale x k_scale; output x v_scale), as its Triton
// backend folds them (docs/fp8-kv-cache.md). Conversions: cvt.rn.f16x2.e4m3x2 (sm_89+) via cuda_fp8.h.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace mlagen {

// Two e4m3 bytes (element 0 in the low byte) -> bf16x2 (element 0 in the low half), exactly.
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t two_bytes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_bytes & 0xffffu), __NV_E4M3);
  __half2 hh;
  hh = h;
  const __nv_bfloat162 b = __float22bfloat162_rn(__half22float2(hh));
  return *reinterpret_cast<const uint32_t*>(&b);
}

// 16 e4m3 bytes -> 16 bf16 values (32 bytes: lo = values 0-7, hi = values 8-15).
__device__ __forceinline__ void e4m3x16_to_bf16x16(const uint4 v, uint4& lo, uint4& hi) {
  lo = make_uint4(e4m3x2_to_bf16x2(v.x), e4m3x2_to_bf16x2(v.x >> 16), e4m3x2_to_bf16x2(v.y), e4m3x2_to_bf16x2(v.y >> 16));
  hi = make_uint4(e4m3x2_to_bf16x2(v.z), e4m3x2_to_bf16x2(v.z >> 16), e4m3x2_to_bf16x2(v.w), e4m3x2_to_bf16x2(v.w >> 16));
}

// bf16x2 -> two e4m3 bytes (low byte = element 0): round to nearest even, finite values past +-448
// saturate to +-448, NaN stays NaN — torch's float8_e4m3fn cast, which SGLang's KV write uses.
__device__ __forceinline__ uint32_t bf16x2_to_e4m3x2(uint32_t two) {
  __nv_bfloat162_raw r;
  r.x = static_cast<unsigned short>(two & 0xffffu);
  r.y = static_cast<unsigned short>(two >> 16);
  return static_cast<uint32_t>(__nv_cvt_bfloat16raw2_to_fp8x2(r, __NV_SATFINITE, __NV_E4M3));
}

// 8 bf16 values (16 bytes) -> 8 e4m3 bytes.
__device__ __forceinline__ uint2 bf16x8_to_e4m3x8(const uint4 v) {
  return make_uint2(bf16x2_to_e4m3x2(v.x) | (bf16x2_to_e4m3x2(v.y) << 16),
                    bf16x2_to_e4m3x2(v.z) | (bf16x2_to_e4m3x2(v.w) << 16));
}

}  // namespace mlagen
