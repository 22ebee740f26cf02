// Element types of the arithmetic kernels (reduce-scatter sums, the gather's norm stage): conversion of
// bf16 / fp16 / fp32 words to fp32 and back, one rounding (round to nearest even) on the way back.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "codes.h"

namespace nsa_cp {

template <int D>
struct Elem;
template <>
struct Elem<kBF16> {
  static constexpr int kBytes = 2;
  __device__ static float to_f(uint32_t b) { return __uint_as_float(b << 16); }  // exact
  __device__ static uint32_t from_f(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
};
template <>
struct Elem<kFP16> {
  static constexpr int kBytes = 2;
  __device__ static float to_f(uint32_t b) { return __half2float(__ushort_as_half(static_cast<unsigned short>(b))); }
  __device__ static uint32_t from_f(float f) { return __half_as_ushort(__float2half_rn(f)); }
};
template <>
struct Elem<kFP32> {
  static constexpr int kBytes = 4;
  __device__ static float to_f(uint32_t b) { return __uint_as_float(b); }
  __device__ static uint32_t from_f(float f) { return __float_as_uint(f); }
};

// A 16-byte word holds 8 bf16/fp16 or 4 fp32; a scalar word holds one element.
template <int D, int N>
__device__ __forceinline__ void unpack(const uint4& v, float (&f)[N]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (Elem<D>::kBytes == 4) {
      f[i] = Elem<D>::to_f(w[i]);
    } else {
      f[2 * i] = Elem<D>::to_f(w[i] & 0xFFFFu);
      f[2 * i + 1] = Elem<D>::to_f(w[i] >> 16);
    }
  }
}
template <int D, typename S>
__device__ __forceinline__ void unpack(const S& v, float (&f)[1]) {
  f[0] = Elem<D>::to_f(static_cast<uint32_t>(v));
}

template <int D, int N>
__device__ __forceinline__ void pack(const float (&f)[N], uint4& v) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (Elem<D>::kBytes == 4) {
      w[i] = Elem<D>::from_f(f[i]);
    } else {
      w[i] = Elem<D>::from_f(f[2 * i]) | (Elem<D>::from_f(f[2 * i + 1]) << 16);
    }
  }
  v = make_uint4(w[0], w[1], w[2], w[3]);
}
template <int D, typename S>
__device__ __forceinline__ void pack(const float (&f)[1], S& v) {
  v = static_cast<S>(Elem<D>::from_f(f[0]));
}

// The norm stages' residual step on one 16-byte word of a row: v <- v + residual in fp32 (ROUND_FIRST:
// v rounded to the dtype first, as the reduce-scatter returns it), and the residual word <- v rounded,
// in place.
template <int D, bool ROUND_FIRST, int N>
__device__ __forceinline__ void add_residual_in_place(float (&v)[N], char* word) {
  uint4* rp = reinterpret_cast<uint4*>(word);
  float r[N];
  unpack<D>(*rp, r);
#pragma unroll
  for (int e = 0; e < N; ++e) v[e] = (ROUND_FIRST ? Elem<D>::to_f(Elem<D>::from_f(v[e])) : v[e]) + r[e];
  uint4 o;
  pack<D>(v, o);
  *rp = o;
}

// Element `col` of a bf16 / fp16 / fp32 vector as fp32 (the dtype a runtime code: the norm's weight).
__device__ __forceinline__ float load_as_float(const void* base, int dtype, int64_t col) {
  if (dtype == kFP32) return __ldg(static_cast<const float*>(base) + col);
  const unsigned short b = __ldg(static_cast<const unsigned short*>(base) + col);
  return dtype == kBF16 ? __uint_as_float(static_cast<uint32_t>(b) << 16) : __half2float(__ushort_as_half(b));
}

}  // namespace nsa_cp
