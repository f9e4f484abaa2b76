// kiln-cuda: decode attention over an f16 KV cache, split along the sequence and merged
// (flash decoding), for `rows` query rows at consecutive positions (a decode step is one
// row; a speculative verify several). Row r sits at position start + r and sees keys
// 0..=start + r.
//
// Layout: q[rows, kv_heads * group * head_dim] f32 (the group of key/value head h
// contiguous); the cache per layer keys[kv_heads, capacity, head_dim] and values alike,
// f16. A partial state of one (row, kv head, span) is kiln-core's: group maxima, group
// sums, group * head_dim unnormalised outputs.
//
// kiln_attn_split_d{64,128,256}: grid (max_spans, kv_heads, rows), 128 threads. Block
// (sp, h, r) takes the keys of span sp (KILN_ATTN_SPAN positions, fixed, like
// kiln-core's SPAN_KEYS) for all `group` query heads of key/value head h, so each cached
// key and value is read once per step (GQA). Warp w takes keys lo + w, lo + w + 4, ...,
// lanes split head_dim (lane l holds dims l, l + 32, ...); per key, each head's score is
// the warp butterfly of the lanes' partial dots, then an online-softmax update. The
// four warps' states are merged in warp order through shared memory.
//
// kiln_attn_merge_o{f32,f16,bf16}: grid (kv_heads, rows), 128 threads; merges a row's
// span states in span order and writes acc / l.
//
// kiln_kv_store_f16: writes a step's new keys and values (f32, after RoPE) into the
// cache at positions start.., rounded to f16 to nearest even, as kiln-model's f16 cache
// stores them. Grid (rows, kv_heads), 128 threads.
//
// Determinism: a row's spans, the keys each warp takes and every merge order depend on
// its position alone, so a row's output never depends on the other rows, and a verify of
// several rows gives each row the bits of a one-row decode at its position.
#include "common.cuh"

#define KILN_ATTN_SPAN 256
#define KILN_ATTN_WARPS 4
#define KILN_ATTN_THREADS (KILN_ATTN_WARPS * KILN_WARP)
#define KILN_ATTN_MAX_GROUP 8
#define KILN_NEG_INF (kiln_bits_f(0xff800000u))

// Joins state (fm, fl, facc) into (m, l, acc), kiln-core's attn::merge for one value.
__device__ __forceinline__ void merge_one(float& m, float& l, float& acc, float fm, float fl, float facc) {
  if (fm == KILN_NEG_INF) return;
  if (m == KILN_NEG_INF) {
    m = fm;
    l = fl;
    acc = facc;
    return;
  }
  const float mx = fmaxf(m, fm);
  const float a = kiln_exp(m - mx), b = kiln_exp(fm - mx);
  l = l * a + fl * b;
  acc = acc * a + facc * b;
  m = mx;
}

template <int HDC>
__device__ __forceinline__ void split_impl(const float* __restrict__ q, const uint16_t* __restrict__ kc,
                                           const uint16_t* __restrict__ vc, float* __restrict__ partial,
                                           int kv_heads, int group, int hd, int capacity, int start,
                                           int max_spans, float scale) {
  constexpr int D = HDC * KILN_WARP;
  constexpr int G = KILN_ATTN_MAX_GROUP;
  __shared__ float sm[KILN_ATTN_WARPS][G], sl[KILN_ATTN_WARPS][G], sacc[KILN_ATTN_WARPS][G][D];
  const int sp = (int)blockIdx.x, h = (int)blockIdx.y, r = (int)blockIdx.z;
  const int len = start + r + 1;
  if (sp * KILN_ATTN_SPAN >= len) return;  // the whole block leaves before any barrier
  const int lo = sp * KILN_ATTN_SPAN;
  const int hi = len < lo + KILN_ATTN_SPAN ? len : lo + KILN_ATTN_SPAN;
  const int warp = (int)(threadIdx.x / KILN_WARP), lane = (int)(threadIdx.x % KILN_WARP);
  const int qdim = kv_heads * group * hd;
  const float* qh = q + (size_t)r * qdim + (size_t)h * group * hd;

  float qv[G][HDC], acc[G][HDC], m[G], l[G];
#pragma unroll
  for (int j = 0; j < G; ++j) {
    m[j] = KILN_NEG_INF;
    l[j] = 0.0f;
#pragma unroll
    for (int c = 0; c < HDC; ++c) {
      const int d = lane + c * KILN_WARP;
      qv[j][c] = (j < group && d < hd) ? qh[j * hd + d] : 0.0f;
      acc[j][c] = 0.0f;
    }
  }
  const uint16_t* kh = kc + (size_t)h * capacity * hd;
  const uint16_t* vh = vc + (size_t)h * capacity * hd;
  for (int t = lo + warp; t < hi; t += KILN_ATTN_WARPS) {
    float kv[HDC], vv[HDC];
#pragma unroll
    for (int c = 0; c < HDC; ++c) {
      const int d = lane + c * KILN_WARP;
      kv[c] = d < hd ? kiln_h2f(kh[(size_t)t * hd + d]) : 0.0f;
      vv[c] = d < hd ? kiln_h2f(vh[(size_t)t * hd + d]) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < G; ++j) {
      if (j < group) {
        float part = 0.0f;
#pragma unroll
        for (int c = 0; c < HDC; ++c) part = fmaf(qv[j][c], kv[c], part);
        const float s = kiln_warp_sum(part) * scale;
        const float mx = fmaxf(m[j], s);
        const float corr = kiln_exp(m[j] - mx);
        const float p = kiln_exp(s - mx);
        l[j] = fmaf(l[j], corr, p);
#pragma unroll
        for (int c = 0; c < HDC; ++c) acc[j][c] = fmaf(p, vv[c], acc[j][c] * corr);
        m[j] = mx;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < G; ++j) {
    if (j < group) {
      if (lane == 0) {
        sm[warp][j] = m[j];
        sl[warp][j] = l[j];
      }
#pragma unroll
      for (int c = 0; c < HDC; ++c) sacc[warp][j][lane + c * KILN_WARP] = acc[j][c];
    }
  }
  __syncthreads();
  // The four warps' states, merged in warp order; thread e takes values e, e + 128, ...
  float* st = partial + (((size_t)r * kv_heads + h) * max_spans + sp) * (size_t)(group * (hd + 2));
  for (int e = (int)threadIdx.x; e < group * hd; e += KILN_ATTN_THREADS) {
    const int j = e / hd, d = e % hd;
    float mm = sm[0][j], ll = sl[0][j], aa = sacc[0][j][d];
    for (int w = 1; w < KILN_ATTN_WARPS; ++w) merge_one(mm, ll, aa, sm[w][j], sl[w][j], sacc[w][j][d]);
    st[2 * group + e] = aa;
    if (d == 0) {
      st[j] = mm;
      st[group + j] = ll;
    }
  }
}

#define KILN_ATTN_SPLIT(D, MINB)                                                                              \
  extern "C" __global__ void __launch_bounds__(KILN_ATTN_THREADS, MINB)                                   \
      kiln_attn_split_d##D(const float* __restrict__ q, const uint16_t* __restrict__ kc,                  \
                           const uint16_t* __restrict__ vc, float* __restrict__ partial, int kv_heads,     \
                           int group, int hd, int capacity, int start, int max_spans, float scale) {      \
    split_impl<D / KILN_WARP>(q, kc, vc, partial, kv_heads, group, hd, capacity, start, max_spans, scale); \
  }                                                                                                       \
  KILN_REGISTER(kiln_attn_split_d##D)

// The second number is the blocks per multiprocessor ptxas must leave room for: with
// none named, it capped the 64-wide kernel at 64 registers on sm_80 and spilled; the
// 256-wide one needs more than 128 registers, so it names one.
KILN_ATTN_SPLIT(64, 4)
KILN_ATTN_SPLIT(128, 4)
KILN_ATTN_SPLIT(256, 1)

template <class O>
__device__ __forceinline__ void merge_impl(const float* __restrict__ partial, typename O::storage* __restrict__ out,
                                           int kv_heads, int group, int hd, int start, int max_spans) {
  const int h = (int)blockIdx.x, r = (int)blockIdx.y;
  const int len = start + r + 1;
  const int spans = (len + KILN_ATTN_SPAN - 1) / KILN_ATTN_SPAN;
  const size_t sl = (size_t)(group * (hd + 2));
  const float* base = partial + ((size_t)r * kv_heads + h) * max_spans * sl;
  typename O::storage* o = out + (size_t)r * kv_heads * group * hd + (size_t)h * group * hd;
  for (int e = (int)threadIdx.x; e < group * hd; e += KILN_ATTN_THREADS) {
    const int j = e / hd;
    float m = base[j], l = base[group + j], acc = base[2 * group + e];
    for (int s = 1; s < spans; ++s) {
      const float* st = base + (size_t)s * sl;
      merge_one(m, l, acc, st[j], st[group + j], st[2 * group + e]);
    }
    const float inv = l > 0.0f ? kiln_div(1.0f, l) : 0.0f;
    o[e] = Conv<O>::store(acc * inv);
  }
}

#define KILN_ATTN_MERGE(ON, O)                                                                              \
  extern "C" __global__ void __launch_bounds__(KILN_ATTN_THREADS)                                           \
      kiln_attn_merge_o##ON(const float* __restrict__ partial, void* out, int kv_heads, int group, int hd,  \
                            int start, int max_spans) {                                                     \
    merge_impl<O>(partial, (typename O::storage*)out, kv_heads, group, hd, start, max_spans);               \
  }                                                                                                         \
  KILN_REGISTER(kiln_attn_merge_o##ON)

KILN_ATTN_MERGE(f32, F32)
KILN_ATTN_MERGE(f16, F16)
KILN_ATTN_MERGE(bf16, BF16)

extern "C" __global__ void __launch_bounds__(KILN_ATTN_THREADS)
    kiln_kv_store_f16(const float* __restrict__ k, const float* __restrict__ v, uint16_t* __restrict__ kc,
                      uint16_t* __restrict__ vc, int kv_heads, int hd, int capacity, int start) {
  const int r = (int)blockIdx.x, h = (int)blockIdx.y;
  const float* kr = k + ((size_t)r * kv_heads + h) * hd;
  const float* vr = v + ((size_t)r * kv_heads + h) * hd;
  const size_t at = ((size_t)h * capacity + (size_t)(start + r)) * hd;
  for (int d = (int)threadIdx.x; d < hd; d += KILN_ATTN_THREADS) {
    kc[at + d] = kiln_f2h(kr[d]);
    vc[at + d] = kiln_f2h(vr[d]);
  }
}
KILN_REGISTER(kiln_kv_store_f16)
