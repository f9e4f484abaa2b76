// kiln-cuda: qmm, the quantized matrix product for many activation rows (prefill) on the
// tensor cores: y[m, n] = x[m, k] W[n, k]^T with MLX-affine 4- and 8-bit weights in the
// checkpoint's bytes, activations f16 or bf16, f32 accumulation and output.
//
// Each warp computes a 16 x 8 tile of y (16 activation rows, 8 weight rows) with
// `mma.sync.aligned.m16n8k16` over K in steps of 16: it builds the A fragments from the
// activations and the B fragments by dequantizing the weights it needs (w = s * q + b in
// f32, as the format defines, then rounded to the activations' dtype, what W4A16 kernels
// feed the tensor cores). Four warps per block side by side along N: a block covers 16
// activation rows and 32 weight rows. This is the straightforward form (fragments loaded
// from global memory, no shared-memory staging or pipelining); it is the correct
// baseline the tuned kernel will be measured against.
//
// Determinism: a row always lands in the same slot of its tile (row % 16), so its output
// does not depend on M or on the other rows. It differs from qmv's (weights rounded to
// 16 bits, the tensor cores' summation order): the speculative gate must say so when a
// verify runs through qmm.
#include "common.cuh"

#define KILN_QMM_WARPS 4
#define KILN_QMM_THREADS (KILN_QMM_WARPS * KILN_WARP)

template <class A>
struct Mma;

template <>
struct Mma<F16> {
  __device__ __forceinline__ static void run(const uint32_t a[4], const uint32_t b[2], float d[4]) {
#ifdef KILN_DEVICE
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    kiln_host::mma_m16n8k16(a, b, d, kiln_host::half_to_float);
#endif
  }
};

#ifndef KILN_DEVICE
inline float kiln_host_bf16_to_float(uint16_t v) { return kiln_bf2f(v); }
#endif

template <>
struct Mma<BF16> {
  __device__ __forceinline__ static void run(const uint32_t a[4], const uint32_t b[2], float d[4]) {
#ifdef KILN_DEVICE
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    kiln_host::mma_m16n8k16(a, b, d, kiln_host_bf16_to_float);
#endif
  }
};

// Code j of a row's bit stream (4 or 8 bits: never straddles a word).
template <int BITS>
__device__ __forceinline__ uint32_t qmm_code(const uint32_t* __restrict__ row, int j) {
  const int per = 32 / BITS;
  return (row[j / per] >> ((j % per) * BITS)) & ((1u << BITS) - 1u);
}

template <int BITS, class S, class A>
__device__ __forceinline__ void qmm_impl(const uint32_t* __restrict__ w, const typename S::storage* __restrict__ scales,
                                         const typename S::storage* __restrict__ biases,
                                         const uint16_t* __restrict__ x, float* __restrict__ y, int n, int k,
                                         int group, int m) {
  const int warp = (int)(threadIdx.x / KILN_WARP), lane = (int)(threadIdx.x % KILN_WARP);
  const int g = lane / 4, t = lane % 4;
  const int n0 = (int)blockIdx.x * (KILN_QMM_WARPS * 8) + warp * 8;
  const int m0 = (int)blockIdx.y * 16;
  const int wn = n0 + g;  // the weight row this lane's B fragments come from
  const int gpr = k / group;
  const uint32_t* wrow = w + (size_t)(wn < n ? wn : 0) * (size_t)(k / 32 * BITS);
  const uint16_t* x0 = x + (size_t)(m0 + g) * k;
  const uint16_t* x1 = x + (size_t)(m0 + g + 8) * k;
  const bool r0 = m0 + g < m, r1 = m0 + g + 8 < m, wv = wn < n;
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int k0 = 0; k0 < k; k0 += 16) {
    const int c0 = k0 + 2 * t, c1 = c0 + 8;
    uint32_t a[4];
    a[0] = r0 ? (uint32_t)x0[c0] | ((uint32_t)x0[c0 + 1] << 16) : 0u;
    a[1] = r1 ? (uint32_t)x1[c0] | ((uint32_t)x1[c0 + 1] << 16) : 0u;
    a[2] = r0 ? (uint32_t)x0[c1] | ((uint32_t)x0[c1 + 1] << 16) : 0u;
    a[3] = r1 ? (uint32_t)x1[c1] | ((uint32_t)x1[c1 + 1] << 16) : 0u;
    uint32_t b[2] = {0u, 0u};
    if (wv) {
      const int gi = wn * gpr + k0 / group;  // a 16-element step never straddles a group
      const float s = Conv<S>::load(scales[gi]), bias = Conv<S>::load(biases[gi]);
      const int cols[4] = {c0, c0 + 1, c1, c1 + 1};
      uint16_t h[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) h[e] = Conv<A>::store(s * (float)qmm_code<BITS>(wrow, cols[e]) + bias);
      b[0] = (uint32_t)h[0] | ((uint32_t)h[1] << 16);
      b[1] = (uint32_t)h[2] | ((uint32_t)h[3] << 16);
    }
    Mma<A>::run(a, b, d);
  }
  const int col = n0 + 2 * t;
  if (r0 && col < n) y[(size_t)(m0 + g) * n + col] = d[0];
  if (r0 && col + 1 < n) y[(size_t)(m0 + g) * n + col + 1] = d[1];
  if (r1 && col < n) y[(size_t)(m0 + g + 8) * n + col] = d[2];
  if (r1 && col + 1 < n) y[(size_t)(m0 + g + 8) * n + col + 1] = d[3];
}

#define KILN_QMM(BITS, SN, S, AN, A)                                                                      \
  extern "C" __global__ void __launch_bounds__(KILN_QMM_THREADS)                                           \
      kiln_qmm_b##BITS##_s##SN##_a##AN(const uint32_t* __restrict__ w, const void* scales, const void* biases, \
                                       const void* x, float* __restrict__ y, int n, int k, int group, int m) { \
    qmm_impl<BITS, S, A>(w, (const typename S::storage*)scales, (const typename S::storage*)biases,        \
                         (const uint16_t*)x, y, n, k, group, m);                                           \
  }                                                                                                        \
  KILN_REGISTER(kiln_qmm_b##BITS##_s##SN##_a##AN)

#define KILN_QMM_SCALES(BITS, AN, A) \
  KILN_QMM(BITS, f16, F16, AN, A)    \
  KILN_QMM(BITS, bf16, BF16, AN, A)  \
  KILN_QMM(BITS, f32, F32, AN, A)

KILN_QMM_SCALES(4, f16, F16)
KILN_QMM_SCALES(4, bf16, BF16)
KILN_QMM_SCALES(8, f16, F16)
KILN_QMM_SCALES(8, bf16, BF16)
