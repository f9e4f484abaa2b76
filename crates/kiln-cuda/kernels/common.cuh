// kiln-cuda: what every kernel file shares. The same source is compiled for the device by
// NVRTC (where __CUDACC_RTC__ and __CUDA_ARCH__ are defined) and for the host by the host
// C++ compiler through host_shim.h, which runs a block's threads as fibers. Every place
// the two differ is a small function here with a device body and a host twin.
//
// Arithmetic: kernels spell every multiply-add as fmaf and are compiled without
// contraction (NVRTC --fmad=false, g++ -ffp-contract=off), so the float operations, and
// therefore the bits of every output, are the same on the host and on the device except
// where a special function (expf, cos, sin) is evaluated; those are named in docs/cuda.md.
#pragma once

#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
#define KILN_DEVICE 1
typedef unsigned int uint32_t;
typedef int int32_t;
typedef unsigned short uint16_t;
typedef unsigned long long uint64_t;
// The host execution registers each kernel by name; the device build needs no table.
#define KILN_REGISTER(name)
#else
#include "host_shim.h"
#endif

#define KILN_WARP 32
#define KILN_FULL_MASK 0xffffffffu

// Scales and biases, activations and outputs are passed as raw storage and converted
// here, so no header of the toolkit is needed and the checkpoint's bytes are read as
// they are. Dtype tags for templates:
struct F16 {
  typedef uint16_t storage;
};
struct BF16 {
  typedef uint16_t storage;
};
struct F32 {
  typedef float storage;
};

// IEEE half to float, exact. Device: one cvt instruction.
__device__ __forceinline__ float kiln_h2f(uint16_t h) {
#ifdef KILN_DEVICE
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  return kiln_host::half_to_float(h);
#endif
}

// Float to IEEE half, round to nearest even. Device: one cvt instruction.
__device__ __forceinline__ uint16_t kiln_f2h(float f) {
#ifdef KILN_DEVICE
  uint16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  return kiln_host::float_to_half(f);
#endif
}

__device__ __forceinline__ float kiln_bits_f(uint32_t u) {
#ifdef KILN_DEVICE
  return __uint_as_float(u);
#else
  return kiln_host::bits_to_float(u);
#endif
}

__device__ __forceinline__ uint32_t kiln_f_bits(float f) {
#ifdef KILN_DEVICE
  return __float_as_uint(f);
#else
  return kiln_host::float_to_bits(f);
#endif
}

// bfloat16 to float: the high half of the f32 pattern, exact.
__device__ __forceinline__ float kiln_bf2f(uint16_t b) { return kiln_bits_f(((uint32_t)b) << 16); }

// Float to bfloat16, round to nearest even; a NaN stays a (quiet) NaN.
__device__ __forceinline__ uint16_t kiln_f2bf(float f) {
  uint32_t u = kiln_f_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

template <class T>
struct Conv;
template <>
struct Conv<F16> {
  __device__ __forceinline__ static float load(uint16_t v) { return kiln_h2f(v); }
  __device__ __forceinline__ static uint16_t store(float v) { return kiln_f2h(v); }
};
template <>
struct Conv<BF16> {
  __device__ __forceinline__ static float load(uint16_t v) { return kiln_bf2f(v); }
  __device__ __forceinline__ static uint16_t store(float v) { return kiln_f2bf(v); }
};
template <>
struct Conv<F32> {
  __device__ __forceinline__ static float load(float v) { return v; }
  __device__ __forceinline__ static float store(float v) { return v; }
};

// A code of at most 23 bits to float, exactly, without a conversion instruction: the
// code placed in the mantissa of 2^23, minus 2^23 + centre. Exact because both terms and
// the difference are integers below 2^24.
__device__ __forceinline__ float kiln_code_minus(uint32_t code, float centre) {
  return kiln_bits_f(0x4b000000u | code) - (8388608.0f + centre);
}

// The butterfly sum over a warp: every lane ends with the same value, summed in the same
// order whatever the lane, so the result depends only on the 32 inputs.
__device__ __forceinline__ float kiln_warp_sum(float v) {
  v += __shfl_xor_sync(KILN_FULL_MASK, v, 16);
  v += __shfl_xor_sync(KILN_FULL_MASK, v, 8);
  v += __shfl_xor_sync(KILN_FULL_MASK, v, 4);
  v += __shfl_xor_sync(KILN_FULL_MASK, v, 2);
  v += __shfl_xor_sync(KILN_FULL_MASK, v, 1);
  return v;
}

__device__ __forceinline__ float kiln_warp_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(KILN_FULL_MASK, v, 16));
  v = fmaxf(v, __shfl_xor_sync(KILN_FULL_MASK, v, 8));
  v = fmaxf(v, __shfl_xor_sync(KILN_FULL_MASK, v, 4));
  v = fmaxf(v, __shfl_xor_sync(KILN_FULL_MASK, v, 2));
  v = fmaxf(v, __shfl_xor_sync(KILN_FULL_MASK, v, 1));
  return v;
}

// 16-byte load of four words: one LDG.128 on the device.
struct KilnWords4 {
  uint32_t w[4];
};
__device__ __forceinline__ KilnWords4 kiln_load4(const uint32_t* __restrict__ p) {
  KilnWords4 r;
#ifdef KILN_DEVICE
  uint4 v = *reinterpret_cast<const uint4*>(p);
  r.w[0] = v.x;
  r.w[1] = v.y;
  r.w[2] = v.z;
  r.w[3] = v.w;
#else
  for (int i = 0; i < 4; ++i) r.w[i] = p[i];
#endif
  return r;
}

// Correctly rounded f32 operations the host and the device agree on.
__device__ __forceinline__ float kiln_div(float a, float b) {
#ifdef KILN_DEVICE
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

__device__ __forceinline__ float kiln_sqrt(float a) {
#ifdef KILN_DEVICE
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// expf: on the device the library's expf (within 2 ulp), on the host the C library's.
// The one special function of the attention and SiLU kernels; the tests charge it
// kiln_core's EXP_REL_ERROR.
__device__ __forceinline__ float kiln_exp(float a) {
#ifdef KILN_DEVICE
  return expf(a);
#else
  return std::exp(a);
#endif
}
