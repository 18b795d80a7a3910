/* The bf16 decode step in C: kernels.py's twins for a few rows on a CPU with AVX512-BF16.

   kernels.py compiles this file once per machine (cc -O3 -mavx512bf16 -fopenmp, into the cache
   folder) and calls it through ctypes: linear_bf16 (kernels.NativeWeight, F.linear's twin),
   attend_bf16 (kernels.attend_native, model.attend's) and block_bf16 (kernels.block_native,
   model.Block's), in that order below.

   Why: a decode step multiplies one row (plain decoding) or a tree's few rows by every weight of
   the model, so its time is the time to read the weights. PyTorch's CPU products (oneDNN, fbgemm)
   stream them well below the memory's speed for one row, and re-read them, or run out of
   arithmetic, for a few; and each layer's ~40 small PyTorch operations cost as much again
   (results/kernels-cpu.md). Here every weight is read once per call and multiplied into up to 8
   rows with AVX512-BF16's dot product (two bf16 products and a sum into fp32 per lane, 32 an
   instruction): for 1 to 8 rows the call costs about what reading the weight costs.

   y (M, N) = bf16(x (M, K) @ w^T + bias + add), sums in fp32, rounded to bf16 once (as oneDNN's
   product with an add post-op). Weight-only int8 (--quantize int8) reads half the bytes: each
   int8 is widened to bf16 exactly in registers, and the sum scaled by its output's scale.

   Every row is computed alone, in the same order whatever M is: a row's result is the same bits
   whether it comes alone or with others, so a tree's rows get exactly what plain decoding gets
   (compiled with -ffp-contract=off, so that no compiler choice of fused multiply-adds differs
   between the code for 1 row and for 8).

   The weight is packed (NativeWeight in kernels.py) as (N/16, K/2, 16, 2): for each block of 16
   outputs, for each pair of inputs, the 16 outputs' two weights side by side, which is the
   operand order of _mm512_dpbf16_ps; a block of 16 outputs is one contiguous stream. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

typedef uint16_t bf16;
enum { ROWS = 8, BLOCKS = 2 };   /* rows and 16-output blocks a tile keeps in 16 registers */

static inline __m512 widen(__mmask16 keep, const bf16 *p) {   /* the kept of 16 bf16 -> fp32 (others 0) */
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, p)), 16));
}

/* 32 weights of the packed stream at element i (16 outputs' pair of inputs) as bf16: as they are,
   or int8 ones widened (exactly: every integer of int8 is a bf16). */
static inline __m512bh weights32(const void *w, long i, const int int8) {
  if (!int8) return (__m512bh)_mm512_loadu_si512((const bf16 *)w + i);
  __m256i q = _mm256_loadu_si256((const __m256i *)((const int8_t *)w + i));
  __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
  __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);                       /* lo's 16 numbers first, then hi's */
}

/* rows x[0..m) times the two blocks starting at output n0, written to y (row stride N). */
static inline __attribute__((always_inline)) void tile(
    const bf16 *x, const int m, int K, const void *w, const int int8, const float *scale, int n0, int N,
    const bf16 *bias, const bf16 *add, bf16 *y) {
  __m512 acc[ROWS][BLOCKS];
  for (int r = 0; r < m; r++)
    for (int b = 0; b < BLOCKS; b++) acc[r][b] = _mm512_setzero_ps();
  for (int k = 0; k < K; k += 2) {
    __m512bh wk[BLOCKS];
    for (int b = 0; b < BLOCKS; b++) {
      long i = (long)n0 * K + ((long)b * K + k) * 16;       /* block b's pair k */
      _mm_prefetch((const char *)w + (i + 1024) * (int8 ? 1 : 2), _MM_HINT_T0);  /* 1024 weights ahead */
      wk[b] = weights32(w, i, int8);
    }
    for (int r = 0; r < m; r++) {
      __m512bh xk = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(x + (long)r * K + k));  /* x[r, k:k+2] */
      for (int b = 0; b < BLOCKS; b++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xk, wk[b]);
    }
  }
  for (int r = 0; r < m; r++)
    for (int b = 0; b < BLOCKS; b++) {
      int n = n0 + 16 * b;
      if (n >= N) break;
      __mmask16 keep = N - n >= 16 ? 0xffff : (__mmask16)((1u << (N - n)) - 1);   /* the last block's outputs */
      __m512 v = acc[r][b];
      if (scale) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(keep, scale + n));
      if (bias) v = _mm512_add_ps(v, widen(keep, bias + n));
      if (add) v = _mm512_add_ps(v, widen(keep, add + (long)r * N + n));
      _mm256_mask_storeu_epi16(y + (long)r * N + n, keep, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* y (M, N) = x (M, K) @ w^T + bias + add. w packed as above with N rounded up to 32 (zeros): bf16,
   or int8 where scale (N,) is given, the weight then being scale[n] * w[n, :] (kernels.int8_weight);
   K even; bias (N,) and add (M, N) may be NULL. The outputs are shared out among the threads,
   each block of 32 read once. */
void linear_bf16(const bf16 *x, int M, int K, const void *w, const float *scale, int N, const bf16 *bias,
                 const bf16 *add, bf16 *y) {
  #pragma omp parallel for schedule(static)
  for (int n0 = 0; n0 < N; n0 += 16 * BLOCKS)
    for (int r0 = 0; r0 < M; r0 += ROWS) {
      const bf16 *xr = x + (long)r0 * K, *ar = add ? add + (long)r0 * N : 0;
      bf16 *yr = y + (long)r0 * N;
      int m = M - r0 < ROWS ? M - r0 : ROWS;
#define TILE(m) (scale ? tile(xr, m, K, w, 1, scale, n0, N, bias, ar, yr) : tile(xr, m, K, w, 0, NULL, n0, N, bias, ar, yr))
      switch (m) {   /* m and the weights' type known when compiled: the accumulators in registers */
        case 1: TILE(1); break;
        case 2: TILE(2); break;
        case 3: TILE(3); break;
        case 4: TILE(4); break;
        case 5: TILE(5); break;
        case 6: TILE(6); break;
        case 7: TILE(7); break;
        default: TILE(8); break;
      }
#undef TILE
    }
}

/* Attention for a few queries in C: the twin of model.attend for bf16 on a CPU, one batch row.

   Each query is computed alone: its visible keys are listed in order first, then scores, their
   softmax and the weighted sum of values run over that list in the same order whatever the mask
   or the other queries are. A tree's node therefore gets the bits plain decoding gets at the same
   place (same keys, same order), which SDPA, whose kernel depends on the number of queries and the
   mask, does not give. Scores and sums in fp32, the output rounded to bf16 once. */

static inline __m512 exp16(__m512 x) {   /* e^x, 16 at a time: 2^n e^r, |r| <= ln2/2, degree-6 polynomial */
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

static inline __mmask16 lanes(int c, int Dh) {   /* the lanes of chunk c (16 numbers) inside Dh */
  return 16 * (c + 1) <= Dh ? 0xffff : (__mmask16)((1u << (Dh - 16 * c)) - 1);
}

static inline __mmask32 lanes32(int c, int Dh) {   /* the bf16 lanes of chunk c (32 numbers) inside Dh */
  return 32 * (c + 1) <= Dh ? 0xffffffffu : (__mmask32)((1u << (Dh - 32 * c)) - 1);
}

/* r[i] = the sum of v[i]'s 16 numbers, for 16 vectors at once: a fixed tree of shuffles and adds
   (a quarter of the work of 16 horizontal sums). */
static inline __m512 sum16(const __m512 v[16]) {
  __m512 w[8], x[4], z[2];
  for (int i = 0; i < 8; i++)        /* per 128 bits: v2i's pair sums, v2i+1's, interleaved */
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; i++) {      /* per 128 bits: the sums of v4i .. v4i+3 over those 128 bits */
    __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; i++)        /* then over 256 bits, then all 512: lane 4i + j holds v4i+j's sum */
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* query t of head h: y[t, h] (row stride H Dh). keys, p: scratch for S ints and S + 16 floats.
   Scores: AVX512-BF16 dot products of q with 16 keys, summed across lanes by sum16. Values: a
   bf16 pair read as one 32-bit lane is two fp32 numbers, its high half masked (odd dimension)
   and shifted up (even): accumulated apart, interleaved back at the end. Every sum runs over the
   visible keys in their order, so a query's result does not depend on the others. */
static void attend_one(const bf16 *q, int H, int T, int Dh, const bf16 *k, const bf16 *v, int Hkv, int S, long head,
                       const uint8_t *mask, float scale, bf16 *y, int h, int t, int *keys, float *p) {
  int g = h / (H / Hkv), n = 0, chunks = (Dh + 31) / 32;
  const bf16 *kh = k + g * head, *vh = v + g * head;
  for (int s = 0; s < S; s++)
    if (mask ? mask[(long)t * S + s] : s <= S - T + t) keys[n++] = s;
  __m512bh qv[8];
  for (int c = 0; c < chunks; c++) qv[c] = (__m512bh)_mm512_maskz_loadu_epi16(lanes32(c, Dh), q + ((long)h * T + t) * Dh + 32 * c);
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int j0 = 0; j0 < n; j0 += 16) {                    /* scores, 16 keys at a time */
    __m512 acc[16];
    for (int i = 0; i < 16; i++) {
      acc[i] = _mm512_setzero_ps();
      if (j0 + i >= n) continue;
      const bf16 *kj = kh + (long)keys[j0 + i] * Dh;
      for (int c = 0; c < chunks; c++)
        acc[i] = _mm512_dpbf16_ps(acc[i], qv[c], (__m512bh)_mm512_maskz_loadu_epi16(lanes32(c, Dh), kj + 32 * c));
    }
    __mmask16 in = n - j0 >= 16 ? 0xffff : (__mmask16)((1u << (n - j0)) - 1);
    __m512 sc = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(p + j0, in, sc);
    top = _mm512_mask_max_ps(top, in, top, sc);
  }
  __m512 most = _mm512_set1_ps(_mm512_reduce_max_ps(top)), total = _mm512_setzero_ps();
  for (int j = 0; j < n; j += 16) {                       /* e^(score - max), 16 keys at a time */
    __mmask16 in = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
    __m512 e = _mm512_maskz_mov_ps(in, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, p + j), most)));
    _mm512_mask_storeu_ps(p + j, in, e);
    total = _mm512_add_ps(total, e);
  }
  __m512 even[2][8], odd[2][8];
  const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
  for (int c = 0; c < chunks; c++) even[0][c] = odd[0][c] = even[1][c] = odd[1][c] = _mm512_setzero_ps();
  for (int j = 0; j < n; j++) {                           /* the values, weighed */
    const bf16 *vj = vh + (long)keys[j] * Dh;
    __m512 pj = _mm512_set1_ps(p[j]);
    int a = j & 1;                                        /* two sums, alternate keys: twice the multiply-adds in flight */
    for (int c = 0; c < chunks; c++) {
      __m512i pair = _mm512_maskz_loadu_epi16(lanes32(c, Dh), vj + 32 * c);
      even[a][c] = _mm512_fmadd_ps(pj, _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16)), even[a][c]);
      odd[a][c] = _mm512_fmadd_ps(pj, _mm512_castsi512_ps(_mm512_and_si512(pair, high)), odd[a][c]);
    }
  }
  for (int c = 0; c < chunks; c++) even[0][c] = _mm512_add_ps(even[0][c], even[1][c]), odd[0][c] = _mm512_add_ps(odd[0][c], odd[1][c]);
  __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
  __m512i order = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                   39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);   /* even 0, odd 0, even 1, ... */
  for (int c = 0; c < chunks; c++) {
    __m512i e = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(even[0][c], inv)));
    __m512i o = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(odd[0][c], inv)));
    _mm512_mask_storeu_epi16(y + ((long)t * H + h) * Dh + 32 * c, lanes32(c, Dh), _mm512_permutex2var_epi16(e, order, o));
  }
}

/* y (T, H, Dh) = softmax(q k^T * scale + mask) v for q (H, T, Dh); k, v (Hkv, S, Dh) with
   `head` elements between heads (a cache's view); query head h reads key/value head h / (H/Hkv).
   mask (T, S) bytes, 1 = visible, or NULL: causal (query t sees keys up to S - T + t). Dh even,
   at most 256. Returns 0, or -1 where the scratch memory is not to be had. */
int attend_bf16(const bf16 *q, int H, int T, int Dh, const bf16 *k, const bf16 *v, int Hkv, int S, long head,
                const uint8_t *mask, float scale, bf16 *y) {
  int failed = 0;
  #pragma omp parallel
  {
    int *keys = malloc(sizeof(int) * S);
    float *p = malloc(sizeof(float) * (S + 16));
    if (!keys || !p) {
      #pragma omp atomic write
      failed = 1;
    }
    #pragma omp for schedule(static)
    for (int ht = 0; ht < H * T; ht++)
      if (keys && p) attend_one(q, H, T, Dh, k, v, Hkv, S, head, mask, scale, y, ht / T, ht % T, keys, p);
    free(keys);
    free(p);
  }
  return failed ? -1 : 0;
}

/* One decoder layer in C: the twin of model.Block (FastBlock) for a few rows of one sequence in
   bf16: RMSNorm, rotary, grouped-query attention, SwiGLU or GeGLU; Qwen2's q/k/v biases and
   Qwen3's q/k norms.
   One call a layer instead of some forty PyTorch operations, each a trip through its dispatcher:
   the time a decode step spent between its products (results/kernels-cpu.md). Each step of the
   readable layer is here, in its order, rounded to bf16 where it rounds, and every row is
   computed alone, as above. */

static inline __m512 round16(__m512 v) {   /* fp32 -> bf16 -> fp32: one rounding, as a bf16 tensor holds it */
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

static inline void store16(bf16 *p, __mmask16 keep, __m512 v) {
  _mm256_mask_storeu_epi16(p, keep, (__m256i)_mm512_cvtneps_pbh(v));
}

/* y (T, D) = model.RMSNorm: weight * bf16(x * rsqrt(mean(x^2) + eps)), each row alone. */
static void rms_norm(const bf16 *x, int T, int D, const bf16 *weight, float eps, bf16 *y) {
  for (int t = 0; t < T; t++) {
    const bf16 *xt = x + (long)t * D;
    __m512 ss = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) {
      __m512 v = widen(lanes(d / 16, D), xt + d);
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    __m512 r = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(ss) / D + eps));
    for (int d = 0; d < D; d += 16) {
      __mmask16 keep = lanes(d / 16, D);
      store16(y + (long)t * D + d, keep, _mm512_mul_ps(widen(keep, weight + d), round16(_mm512_mul_ps(widen(keep, xt + d), r))));
    }
  }
}

/* model.apply_rope on one head's row x (Dh): x cos + rotate_half(x) sin, rounded as bf16 tensors
   round each product and the sum; written to out. rotate_half(x)[d] = -x[d + Dh/2] in the first
   half, x[d - Dh/2] in the second. */
static void rope_row(const bf16 *x, const bf16 *cos, const bf16 *sin, int Dh, bf16 *out) {
  int half = Dh / 2;
  if (half % 16 == 0) {   /* whole chunks of 16 in each half */
    for (int d = 0; d < Dh; d += 16) {
      __m512 rot = d < half ? _mm512_sub_ps(_mm512_setzero_ps(), widen(0xffff, x + d + half)) : widen(0xffff, x + d - half);
      __m512 a = round16(_mm512_mul_ps(widen(0xffff, x + d), widen(0xffff, cos + d)));
      __m512 b = round16(_mm512_mul_ps(rot, widen(0xffff, sin + d)));
      store16(out + d, 0xffff, _mm512_add_ps(a, b));
    }
    return;
  }
  for (int d = 0; d < Dh; d++) {   /* the same, one number at a time */
    float xd = widen(1, x + d)[0], c = widen(1, cos + d)[0], s = widen(1, sin + d)[0];
    float rot = d < half ? -widen(1, x + d + half)[0] : widen(1, x + d - half)[0];
    float a = round16(_mm512_set1_ps(xd * c))[0], b = round16(_mm512_set1_ps(rot * s))[0];
    store16(out + d, 1, _mm512_set1_ps(a + b));
  }
}

static inline __m512 sigmoid16(__m512 x) {   /* 1 / (1 + e^-x) */
  return _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

/* The gated MLP's middle: act (T, F) = bf16(bf16(a(gate)) * up) for gu (T, 2F) = [gate | up]; a
   is SiLU, x sigmoid(x) (SwiGLU), or with gelu GELU's tanh form, x sigmoid(2 sqrt(2/pi) (x +
   0.044715 x^3)), which is 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (GeGLU: Gemma). */
static void gated(const bf16 *gu, int T, int F, int gelu, bf16 *act) {
  for (int t = 0; t < T; t++)
    for (int f = 0; f < F; f += 16) {
      __mmask16 keep = lanes(f / 16, F);
      __m512 g = widen(keep, gu + (long)t * 2 * F + f), u = widen(keep, gu + (long)t * 2 * F + F + f);
      __m512 z = g;
      if (gelu) z = _mm512_mul_ps(_mm512_set1_ps(1.5957691216f), _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), g), _mm512_mul_ps(g, g), g));
      store16(act + (long)t * F + f, keep, _mm512_mul_ps(round16(_mm512_mul_ps(g, sigmoid16(z))), u));
    }
}

/* out (T, D) = the layer applied to x (T, D). Weights packed as linear_bf16 takes them, each
   with its int8 scales or NULL: wqkv ((H + 2 Hkv) Dh outputs, bias bqkv or NULL), wo (D), wgu
   (2F: gate then up), wdown (D). cos, sin (T, Dh); the new keys and values go to slots
   start..start+T of k_cache, v_cache
   (Hkv heads, `head` elements apart, rows of Dh); mask (T, start + T) bytes or NULL (causal).
   qnorm, knorm (Dh): Qwen3's RMSNorm of each q and k head before rotary, or NULL; gelu: GeGLU's
   activation, not SwiGLU's. Returns 0, or -1 where scratch memory is not to be had. */
int block_bf16(const bf16 *x, int T, int D, const bf16 *norm1, const bf16 *norm2, float eps,
               const void *wqkv, const float *sqkv, const bf16 *bqkv, const bf16 *qnorm, const bf16 *knorm,
               int H, int Hkv, int Dh, const bf16 *cos,
               const bf16 *sin, bf16 *k_cache, bf16 *v_cache, long head, int start, const uint8_t *mask,
               const void *wo, const float *so, const void *wgu, const float *sgu, int F, const void *wdown,
               const float *sdown, int gelu, bf16 *out) {
  int Q = (H + 2 * Hkv) * Dh, S = start + T;
  bf16 *h = malloc(sizeof(bf16) * T * D), *qkv = malloc(sizeof(bf16) * T * Q), *q = malloc(sizeof(bf16) * T * H * Dh);
  bf16 *y = malloc(sizeof(bf16) * T * H * Dh), *gu = malloc(sizeof(bf16) * T * 2 * F), *act = malloc(sizeof(bf16) * T * F);
  int failed = !h || !qkv || !q || !y || !gu || !act;
  if (!failed) {
    rms_norm(x, T, D, norm1, eps, h);                                       /* input_layernorm */
    linear_bf16(h, T, D, wqkv, sqkv, Q, bqkv, NULL, qkv);                   /* q, k, v */
    for (int t = 0; t < T; t++) {                                           /* rotary; k and v into the cache */
      const bf16 *row = qkv + (long)t * Q, *ct = cos + (long)t * Dh, *st = sin + (long)t * Dh;
      bf16 normed[256];                                                       /* a q or k head after its norm */
      for (int i = 0; i < H; i++) {
        if (qnorm) rms_norm(row + i * Dh, 1, Dh, qnorm, eps, normed);
        rope_row(qnorm ? normed : row + i * Dh, ct, st, Dh, q + ((long)i * T + t) * Dh);
      }
      for (int i = 0; i < Hkv; i++) {
        if (knorm) rms_norm(row + (H + i) * Dh, 1, Dh, knorm, eps, normed);
        rope_row(knorm ? normed : row + (H + i) * Dh, ct, st, Dh, k_cache + i * head + (long)(start + t) * Dh);
        for (int d = 0; d < Dh; d++) v_cache[i * head + (long)(start + t) * Dh + d] = row[(H + Hkv + i) * Dh + d];
      }
    }
    failed = attend_bf16(q, H, T, Dh, k_cache, v_cache, Hkv, S, head, mask, 1.f / sqrtf((float)Dh), y);
  }
  if (!failed) {
    linear_bf16(y, T, H * Dh, wo, so, D, NULL, x, out);                     /* x + o_proj(attention) */
    rms_norm(out, T, D, norm2, eps, h);                                     /* post_attention_layernorm */
    linear_bf16(h, T, D, wgu, sgu, 2 * F, NULL, NULL, gu);                  /* gate and up */
    gated(gu, T, F, gelu, act);
    linear_bf16(act, T, F, wdown, sdown, D, NULL, out, out);                /* + down_proj(act): in place, each output read then written */
  }
  free(h); free(qkv); free(q); free(y); free(gu); free(act);
  return failed ? -1 : 0;
}
