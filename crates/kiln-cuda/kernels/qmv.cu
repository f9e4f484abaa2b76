// kiln-cuda: qmv (one activation row) and qmv_wide (up to KILN_QMV_WIDE_MAX rows) over
// MLX-affine 4- and 8-bit weights in the checkpoint's bytes: packed little-endian u32
// words, per group of `group` elements one scale and one bias (f16, bf16 or f32),
// w = scale * q + bias. Activations are f16 or bf16; products accumulate in f32; the
// output is f32, y[i * n + r] for activation row i and weight row r.
//
// Work split: one warp per weight row, KILN_QMV_ROWS rows per block. A row is read in
// chunks of 32 elements (4 words for 4-bit weights, 8 for 8-bit: 16-byte loads, adjacent
// lanes adjacent chunks, so a warp's loads are coalesced); lane l takes chunks l, l + 32,
// l + 64, ... A chunk never straddles a group (groups are 32, 64 or 128 elements).
//
// Per chunk, with the codes centred on c = 2^(bits - 1) (exact small integers):
//   dq = sum_j (q_j - c) x_j   (fmaf chain, j ascending)
//   xs = sum_j x_j             (ascending)
//   acc = fmaf(s, dq, acc); acc = fmaf(fmaf(s, c, b), xs, acc)
// which is sum_j (s q_j + b) x_j with the activations' rounding meeting q - c, not q.
// The lanes' accumulators are then summed by the warp butterfly.
//
// Determinism: every output's operations depend on (k, group, bits, dtypes) alone: the
// chunks a lane takes, the order within a lane and the butterfly are fixed, and each
// activation row has its own accumulator. So qmv and qmv_wide (and qmv_wide at any m)
// give the same bits for the same row; the tests check it.
#include "common.cuh"

#define KILN_QMV_ROWS 4
#define KILN_QMV_THREADS (KILN_QMV_ROWS * KILN_WARP)
#define KILN_QMV_WIDE_MAX 8

// The 32 codes of one chunk, `BITS` words.
template <int BITS>
struct Chunk {
  uint32_t w[BITS];
  __device__ __forceinline__ void load(const uint32_t* __restrict__ p) {
#pragma unroll
    for (int i = 0; i < BITS; i += 4) {
      KilnWords4 v = kiln_load4(p + i);
      w[i] = v.w[0];
      w[i + 1] = v.w[1];
      w[i + 2] = v.w[2];
      w[i + 3] = v.w[3];
    }
  }
  // Code j minus the centre, as float (exact).
  __device__ __forceinline__ float code(int j, float centre) const {
    const int per = 32 / BITS;
    const uint32_t q = (w[j / per] >> ((j % per) * BITS)) & ((1u << BITS) - 1u);
    return kiln_code_minus(q, centre);
  }
};

// 32 activations of one chunk, widened to f32.
template <class A>
__device__ __forceinline__ void load_x(const uint16_t* __restrict__ p, float* xs) {
  const uint32_t* w = reinterpret_cast<const uint32_t*>(p);
#pragma unroll
  for (int i = 0; i < 16; i += 4) {
    KilnWords4 v = kiln_load4(w + i);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      xs[2 * (i + e)] = Conv<A>::load((uint16_t)(v.w[e] & 0xffffu));
      xs[2 * (i + e) + 1] = Conv<A>::load((uint16_t)(v.w[e] >> 16));
    }
  }
}

template <int BITS, class S, class A, int MAXM>
__device__ __forceinline__ void qmv_impl(const uint32_t* __restrict__ w,
                                         const typename S::storage* __restrict__ scales,
                                         const typename S::storage* __restrict__ biases,
                                         const uint16_t* __restrict__ x, float* __restrict__ y, int n,
                                         int k, int group_log2, int m) {
  const int warp = (int)(threadIdx.x / KILN_WARP);
  const int lane = (int)(threadIdx.x % KILN_WARP);
  const int r = (int)blockIdx.x * KILN_QMV_ROWS + warp;
  if (r >= n) return;  // the whole warp leaves: no barrier follows
  const float centre = (float)(1 << (BITS - 1));
  const int chunks = k / 32;
  const int gpr = k >> (5 + group_log2);
  const uint32_t* row = w + (size_t)r * (size_t)(k / 32 * BITS);
  float acc[MAXM];
#pragma unroll
  for (int i = 0; i < MAXM; ++i) acc[i] = 0.0f;
  for (int c = lane; c < chunks; c += KILN_WARP) {
    Chunk<BITS> q;
    q.load(row + (size_t)c * BITS);
    const int gi = r * gpr + (c >> group_log2);
    const float s = Conv<S>::load(scales[gi]);
    const float b = Conv<S>::load(biases[gi]);
    const float bc = fmaf(s, centre, b);
#pragma unroll
    for (int i = 0; i < MAXM; ++i) {
      if (i < m) {
        float xv[32];
        load_x<A>(x + (size_t)i * k + (size_t)c * 32, xv);
        float dq = 0.0f, xs = 0.0f;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          dq = fmaf(q.code(j, centre), xv[j], dq);
          xs += xv[j];
        }
        acc[i] = fmaf(s, dq, acc[i]);
        acc[i] = fmaf(bc, xs, acc[i]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < MAXM; ++i) {
    if (i < m) {
      const float v = kiln_warp_sum(acc[i]);
      if (lane == 0) y[(size_t)i * n + r] = v;
    }
  }
}

#define KILN_QMV_PARAMS                                                                          \
  const uint32_t *__restrict__ w, const void *__restrict__ scales, const void *__restrict__ biases, \
      const void *__restrict__ x, float *__restrict__ y, int n, int k, int group_log2, int m
#define KILN_QMV_ARGS(S)                                                                          \
  w, (const typename S::storage*)scales, (const typename S::storage*)biases, (const uint16_t*)x, y, \
      n, k, group_log2, m

#define KILN_QMV(BITS, SN, S, AN, A)                                                             \
  extern "C" __global__ void __launch_bounds__(KILN_QMV_THREADS)                                  \
      kiln_qmv_b##BITS##_s##SN##_a##AN(KILN_QMV_PARAMS) {                                        \
    qmv_impl<BITS, S, A, 1>(KILN_QMV_ARGS(S));                                                    \
  }                                                                                               \
  KILN_REGISTER(kiln_qmv_b##BITS##_s##SN##_a##AN)                                                 \
  extern "C" __global__ void __launch_bounds__(KILN_QMV_THREADS)                                  \
      kiln_qmv_wide_b##BITS##_s##SN##_a##AN(KILN_QMV_PARAMS) {                                   \
    qmv_impl<BITS, S, A, KILN_QMV_WIDE_MAX>(KILN_QMV_ARGS(S));                                    \
  }                                                                                               \
  KILN_REGISTER(kiln_qmv_wide_b##BITS##_s##SN##_a##AN)

#define KILN_QMV_SCALES(BITS, AN, A) \
  KILN_QMV(BITS, f16, F16, AN, A)    \
  KILN_QMV(BITS, bf16, BF16, AN, A)  \
  KILN_QMV(BITS, f32, F32, AN, A)

KILN_QMV_SCALES(4, f16, F16)
KILN_QMV_SCALES(4, bf16, BF16)
KILN_QMV_SCALES(8, f16, F16)
KILN_QMV_SCALES(8, bf16, BF16)
