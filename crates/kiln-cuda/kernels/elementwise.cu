// kiln-cuda: the row-wise and element-wise steps of the forward pass: RMSNorm, SiLU and
// multiply, residual add, rotary embeddings, the embedding lookup of quantized rows, and
// the MoE router.
// The residual stream and the projections' outputs are f32; RMSNorm and SiLU-and-multiply
// write the next projection's activations (f16, bf16, or f32).
//
// Determinism: each output depends only on its own row (RMSNorm: a fixed-order block
// reduction whose shape depends on the row width alone) or its own element, never on
// the number of rows or on the launch's other rows.
#include "common.cuh"

#define KILN_NORM_THREADS 256
#define KILN_EW_THREADS 256

// out[row, j] = x[row, j] * (1 / sqrt(mean(x[row]^2) + eps)) * weight[j], one block per
// row. Thread t squares j = t, t + 256, ... (fmaf chain); the warps' butterfly sums are
// added in warp order by every thread, so all threads hold the same total.
template <class O>
__device__ __forceinline__ void rms_norm_impl(const float* __restrict__ x, const float* __restrict__ weight,
                                              typename O::storage* __restrict__ out, int d, float eps) {
  __shared__ float partial[KILN_NORM_THREADS / KILN_WARP];
  const int t = (int)threadIdx.x;
  const float* xr = x + (size_t)blockIdx.x * d;
  float ss = 0.0f;
  for (int j = t; j < d; j += KILN_NORM_THREADS) ss = fmaf(xr[j], xr[j], ss);
  ss = kiln_warp_sum(ss);
  if (t % KILN_WARP == 0) partial[t / KILN_WARP] = ss;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < KILN_NORM_THREADS / KILN_WARP; ++w) total += partial[w];
  const float inv = kiln_div(1.0f, kiln_sqrt(kiln_div(total, (float)d) + eps));
  typename O::storage* o = out + (size_t)blockIdx.x * d;
  for (int j = t; j < d; j += KILN_NORM_THREADS) o[j] = Conv<O>::store(xr[j] * inv * weight[j]);
}

#define KILN_RMS_NORM(ON, O)                                                                          \
  extern "C" __global__ void __launch_bounds__(KILN_NORM_THREADS)                                     \
      kiln_rms_norm_o##ON(const float* __restrict__ x, const float* __restrict__ weight, void* out, int d, \
                          float eps) {                                                                \
    rms_norm_impl<O>(x, weight, (typename O::storage*)out, d, eps);                                   \
  }                                                                                                   \
  KILN_REGISTER(kiln_rms_norm_o##ON)

KILN_RMS_NORM(f16, F16)
KILN_RMS_NORM(bf16, BF16)
KILN_RMS_NORM(f32, F32)

// out[i] = gate[i] / (1 + e^-gate[i]) * up[i], as kiln-model's silu_mul orders it.
template <class O>
__device__ __forceinline__ void silu_mul_impl(const float* __restrict__ gate, const float* __restrict__ up,
                                              typename O::storage* __restrict__ out, int len) {
  const int i = (int)(blockIdx.x * KILN_EW_THREADS + threadIdx.x);
  if (i >= len) return;
  const float g = gate[i];
  out[i] = Conv<O>::store(kiln_div(g, 1.0f + kiln_exp(-g)) * up[i]);
}

#define KILN_SILU_MUL(ON, O)                                                                            \
  extern "C" __global__ void __launch_bounds__(KILN_EW_THREADS)                                         \
      kiln_silu_mul_o##ON(const float* __restrict__ gate, const float* __restrict__ up, void* out, int len) { \
    silu_mul_impl<O>(gate, up, (typename O::storage*)out, len);                                         \
  }                                                                                                     \
  KILN_REGISTER(kiln_silu_mul_o##ON)

KILN_SILU_MUL(f16, F16)
KILN_SILU_MUL(bf16, BF16)
KILN_SILU_MUL(f32, F32)

// x[i] += y[i]: the residual add.
extern "C" __global__ void __launch_bounds__(KILN_EW_THREADS)
    kiln_add_f32(float* __restrict__ x, const float* __restrict__ y, int len) {
  const int i = (int)(blockIdx.x * KILN_EW_THREADS + threadIdx.x);
  if (i < len) x[i] = x[i] + y[i];
}
KILN_REGISTER(kiln_add_f32)

// y[r, j] += bias[j] for the rows of a [len / n, n] f32 projection output: a linear's
// bias (Qwen2's q, k and v), added in f32 after the product, as kiln-model adds it.
extern "C" __global__ void __launch_bounds__(KILN_EW_THREADS)
    kiln_add_bias_f32(float* __restrict__ y, const float* __restrict__ bias, int n, int len) {
  const int i = (int)(blockIdx.x * KILN_EW_THREADS + threadIdx.x);
  if (i < len) y[i] = y[i] + bias[i % n];
}
KILN_REGISTER(kiln_add_bias_f32)

// Rotary embeddings in the half-split layout (element i of a head pairs with i + half),
// in place on x[row, heads * 2 * half], row `row` at position positions[row]. The
// frequencies (inv_freq[half], f32) carry the model's scaling, computed on the host by
// kiln-model's Rope; the angle is the f32 product of the position and the frequency and
// its cosine and sine are evaluated in double then rounded, as kiln-model does. One block
// per row; thread t takes the pairs t, t + 128, ... of the row.
extern "C" __global__ void __launch_bounds__(128)
    kiln_rope_f32(float* __restrict__ x, const int* __restrict__ positions, const float* __restrict__ inv_freq,
                  int heads, int half) {
  const int pairs = heads * half;
  float* xr = x + (size_t)blockIdx.x * (size_t)(2 * pairs);
  const float p = (float)positions[blockIdx.x];
  for (int e = (int)threadIdx.x; e < pairs; e += 128) {
    const int h = e / half, i = e % half;
    const double a = (double)(p * inv_freq[i]);
    const float c = (float)cos(a), s = (float)sin(a);
    float* head = xr + (size_t)h * (size_t)(2 * half);
    const float x1 = head[i], x2 = head[i + half];
    head[i] = x1 * c - x2 * s;
    head[i + half] = x2 * c + x1 * s;
  }
}
KILN_REGISTER(kiln_rope_f32)

// The embedding of tokens[row]: row tokens[row] of a quantized [vocab, d] table, any of
// the format's widths, dequantized as the format defines (s * q + b, rounded after the
// product and after the sum), into out[row, d] f32. A token outside the vocabulary
// yields NaN (the host checks tokens first; this keeps a bad one from reading outside
// the table). Grid (rows, ceil(d / 256)).
template <class S>
__device__ __forceinline__ void embed_impl(const uint32_t* __restrict__ packed,
                                           const typename S::storage* __restrict__ scales,
                                           const typename S::storage* __restrict__ biases,
                                           const int* __restrict__ tokens, float* __restrict__ out, int vocab,
                                           int d, int bits, int group) {
  const int j = (int)(blockIdx.y * KILN_EW_THREADS + threadIdx.x);
  if (j >= d) return;
  const int tok = tokens[blockIdx.x];
  float* o = out + (size_t)blockIdx.x * d;
  if (tok < 0 || tok >= vocab) {
    o[j] = kiln_bits_f(0x7fc00000u);
    return;
  }
  const uint32_t* row = packed + (size_t)tok * (size_t)(d / 32 * bits);
  const int bit = j * bits, word = bit / 32, shift = bit % 32;
  uint32_t v = row[word] >> shift;
  if (shift + bits > 32) v |= row[word + 1] << (32 - shift);
  const uint32_t q = v & ((1u << bits) - 1u);
  const int gi = tok * (d / group) + j / group;
  const float s = Conv<S>::load(scales[gi]), b = Conv<S>::load(biases[gi]);
  o[j] = s * (float)q + b;
}

#define KILN_EMBED(SN, S)                                                                                \
  extern "C" __global__ void __launch_bounds__(KILN_EW_THREADS)                                          \
      kiln_embed_s##SN(const uint32_t* __restrict__ packed, const void* scales, const void* biases,       \
                       const int* __restrict__ tokens, float* __restrict__ out, int vocab, int d, int bits, \
                       int group) {                                                                      \
    embed_impl<S>(packed, (const typename S::storage*)scales, (const typename S::storage*)biases, tokens, \
                  out, vocab, d, bits, group);                                                           \
  }                                                                                                      \
  KILN_REGISTER(kiln_embed_s##SN)

KILN_EMBED(f16, F16)
KILN_EMBED(bf16, BF16)
KILN_EMBED(f32, F32)

// The MoE router of one row per thread, as kiln-model's moe::route computes it: softmax
// over the row's `e_count` logits (max, e^(l - max) summed in expert order, each divided
// by the sum), the `top_k` largest probabilities with ties to the lower index, written
// ascending by expert with their probabilities, renormalised to sum to one (in expert
// order) when `norm` is set. Sequential per row, so the float order is kiln-model's; the
// selection takes, k times, the largest (p, -index) below the previous pick, which needs
// no per-expert state. Grid ceil(rows / 32) of 32 threads.
extern "C" __global__ void __launch_bounds__(32)
    kiln_moe_route(const float* __restrict__ logits, int* __restrict__ experts, float* __restrict__ weights, int rows,
                   int e_count, int top_k, int norm) {
  const int r = (int)(blockIdx.x * 32 + threadIdx.x);
  if (r >= rows) return;
  const float* l = logits + (size_t)r * e_count;
  int* ex = experts + (size_t)r * top_k;
  float* wt = weights + (size_t)r * top_k;
  float mx = kiln_bits_f(0xff800000u);
  for (int e = 0; e < e_count; ++e) mx = fmaxf(mx, l[e]);
  float sum = 0.0f;
  for (int e = 0; e < e_count; ++e) sum += kiln_exp(l[e] - mx);
  float prev_p = kiln_bits_f(0x7f800000u);
  int prev_e = -1;
  for (int j = 0; j < top_k; ++j) {
    float best_p = kiln_bits_f(0xff800000u);
    int best_e = -1;
    for (int e = 0; e < e_count; ++e) {
      const float p = kiln_div(kiln_exp(l[e] - mx), sum);
      const bool below = p < prev_p || (p == prev_p && e > prev_e);
      if (below && (best_e < 0 || p > best_p)) {
        best_p = p;
        best_e = e;
      }
    }
    prev_p = best_p;
    prev_e = best_e;
    // Insert in ascending expert order.
    int at = j;
    while (at > 0 && ex[at - 1] > best_e) {
      ex[at] = ex[at - 1];
      wt[at] = wt[at - 1];
      --at;
    }
    ex[at] = best_e;
    wt[at] = best_p;
  }
  if (norm) {
    float s = 0.0f;
    for (int j = 0; j < top_k; ++j) s += wt[j];
    for (int j = 0; j < top_k; ++j) wt[j] = kiln_div(wt[j], s);
  }
}
KILN_REGISTER(kiln_moe_route)

// The per-expert gather: row i of `out` (`[m, width]`, 16-bit activations of either
// dtype) is row rows_idx[i] of `x`, so an expert's projections run on its m rows as one
// matrix. Grid (m, ceil(width / 256)).
extern "C" __global__ void __launch_bounds__(KILN_EW_THREADS)
    kiln_gather_rows_u16(const uint16_t* __restrict__ x, const int* __restrict__ rows_idx,
                         uint16_t* __restrict__ out, int width) {
  const int j = (int)(blockIdx.y * KILN_EW_THREADS + threadIdx.x);
  if (j >= width) return;
  out[(size_t)blockIdx.x * width + j] = x[(size_t)rows_idx[blockIdx.x] * width + j];
}
KILN_REGISTER(kiln_gather_rows_u16)

// An expert's output added back: out[rows_idx[i]] += weights[i] * ye[i] (a product then
// a sum, as kiln-model adds it). An expert's rows are distinct, so no two threads write
// one value; launched once per expert in ascending expert order, the sums run in
// kiln-model's order. Grid (m, ceil(hidden / 256)).
extern "C" __global__ void __launch_bounds__(KILN_EW_THREADS)
    kiln_moe_accumulate(float* __restrict__ out, const float* __restrict__ ye, const int* __restrict__ rows_idx,
                        const float* __restrict__ weights, int hidden) {
  const int j = (int)(blockIdx.y * KILN_EW_THREADS + threadIdx.x);
  if (j >= hidden) return;
  float* o = out + (size_t)rows_idx[blockIdx.x] * hidden + j;
  *o = *o + weights[blockIdx.x] * ye[(size_t)blockIdx.x * hidden + j];
}
KILN_REGISTER(kiln_moe_accumulate)
