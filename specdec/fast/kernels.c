/* The bf16 decode step in C: kernels.py's twins for a few rows, on x86 (AVX512-BF16, AVX-512
   without BF16, or AVX2) and on ARM (NEON).

   kernels.py compiles this file once per machine and path (cc -O3 -fopenmp plus the path's flags,
   into the cache folder) and calls it through ctypes: linear_bf16 (kernels.NativeWeight,
   F.linear's twin), attend_bf16 (kernels.attend_native, model.attend's), block_bf16
   (kernels.block_native, model.Block's) and stack_bf16 (kernels.stack_native, the layers of
   model.Transformer.run_layers), in that order below, after a few vector helpers per instruction
   set.

   Why: a decode step multiplies one row (plain decoding) or a tree's few rows by every weight of
   the model, so its time is the time to read the weights. PyTorch's CPU products (oneDNN, fbgemm)
   stream them well below the memory's speed for one row, and re-read them, or run out of
   arithmetic, for a few; on a CPU without native bf16 (AVX2) its bf16 products are emulated and
   tens of times slower than fp32's; and each layer's ~40 small PyTorch operations cost as much
   again (results/kernels-cpu.md). Here every weight is read from memory once per call and
   multiplied into a tile of rows (6 to 8, as the registers hold) from the caches: where the CPU
   multiplies bf16 pairs (AVX512-BF16), 1 to 8 rows cost about what reading the weight costs; on
   AVX2, whose widening shares the arithmetic's ports, a few rows do (results/batch-cpu.md). AVX-512
   without BF16 (most rented Xeons, Skylake to Ice Lake) widens as AVX2 does, with twice the lanes
   and registers: a tile of 8 rows, 16 outputs a multiply-add.

   y (M, N) = bf16(x (M, K) @ w^T + bias + add), sums in fp32, rounded to bf16 once (as oneDNN's
   product with an add post-op). A bf16 number is the top half of an fp32 one, so it is widened
   exactly by a 16-bit shift in registers (AVX-512, AVX2, NEON), the products then fp32 fused
   multiply-adds; AVX512-BF16 instead multiplies pairs of bf16 directly (two products and a sum
   into fp32 per lane). Weight-only int8 (--quantize int8) reads half the
   bytes: each int8 is widened exactly in registers, and the sum scaled by its output's scale.

   Every row is computed alone, in the same order whatever M is: a row's result is the same bits
   whether it comes alone or with others, so a tree's rows get exactly what plain decoding gets.
   The multiply-adds are explicit fused ones, and the file is compiled with -ffp-contract=off, so
   that no compiler choice of fused multiply-adds differs between the code for 1 row and for 8.
   (Each path rounds its own way: the bits are the same within a path, not across paths.)

   The weight is packed (NativeWeight in kernels.py) as (N/16, K/2, 16, 2): for each block of 16
   outputs, for each pair of inputs, the 16 outputs' two weights side by side (the operand order
   of AVX512-BF16's dot product); a block of 16 outputs is one contiguous stream. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;

/* --- the vector layer: the few operations the kernels below are written in, per instruction set.
   V holds VL fp32 numbers; P holds VL pairs of numbers (2 VL bf16), the operand of dot2:
   dot2(acc, a, b)[i] = acc[i] + a[2i] b[2i] + a[2i+1] b[2i+1]. Loads and stores take a count n
   of numbers (the rest read as 0, or left alone). REGS: the vector registers, which bound a tile
   of linear_bf16. A tile's step (weight_part, x_part, mac) takes a pair of inputs in PARTS parts:
   whole where the hardware multiplies bf16 pairs, else the pair's first numbers, then its second
   (dot2's order), so that a step's weights take one register a vector. */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* Both AVX-512 paths: 16 fp32 lanes, 32 registers, and masks, so that loads and stores of fewer
   than 16 numbers need no scratch (MASKED). What differs is below: whether the CPU multiplies
   bf16 pairs (AVX512-BF16: Cooper Lake, Sapphire Rapids, Zen 4) or not (AVX-512 alone: the
   Skylake to Ice Lake Xeons most clouds rent). */
#include <immintrin.h>
#define MASKED 1
enum { VL = 16, REGS = 32 };
typedef __m512 V;

static inline __mmask16 first16(int n) { return n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1); }
static inline __mmask32 first32(int n) { return n >= 32 ? ~0u : (__mmask32)((1u << n) - 1); }
static inline V vzero(void) { return _mm512_setzero_ps(); }
static inline V vset(float a) { return _mm512_set1_ps(a); }
static inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
static inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
static inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
static inline V vdiv(V a, V b) { return _mm512_div_ps(a, b); }
static inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
static inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }     /* a b + c */
static inline V vfnma(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }   /* c - a b */
static inline V vround(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT); }
static inline V vpow2(V p, V n) { return _mm512_scalef_ps(p, n); }             /* p 2^n */
static inline float hsum(V a) { return _mm512_reduce_add_ps(a); }
static inline float hmax(V a) { return _mm512_reduce_max_ps(a); }
static inline V first(V a, int n, float fill) {   /* a's first n numbers, then fill */
  return _mm512_mask_mov_ps(vset(fill), first16(n), a);
}
static inline V loadf(const float *p, int n) { return _mm512_maskz_loadu_ps(first16(n), p); }
static inline void storef(float *p, int n, V a) { _mm512_mask_storeu_ps(p, first16(n), a); }
static inline V from_bits(__m256i b) {   /* 16 bf16 -> fp32: each the top half of its fp32 */
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
static inline V widen(const bf16 *p, int n) {
  return from_bits(_mm256_maskz_loadu_epi16(first16(n), p));
}
/* r[i] = the sum of v[i]'s 16 numbers, for 16 vectors at once: a fixed tree of shuffles and adds
   (a quarter of the work of 16 horizontal sums). */
static inline V sums(const V v[16]) {
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
/* a macro: GCC drops a function whose only effect is a prefetch */
#define prefetch(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)

#if defined(__AVX512BF16__)
#define ISA "avx512-bf16"
typedef __m512bh P;            /* 32 bf16: the hardware multiplies pairs of them */

static inline void narrow(bf16 *p, int n, V a) {   /* to bf16: round to nearest even */
  _mm256_mask_storeu_epi16(p, first16(n), (__m256i)_mm512_cvtneps_pbh(a));
}
/* fp32 -> bf16 -> fp32: one rounding, as a bf16 tensor holds it */
static inline V round16(V a) { return from_bits((__m256i)_mm512_cvtneps_pbh(a)); }
static inline P pairs_all(const bf16 *p) { return (P)_mm512_loadu_si512(p); }
static inline P pairs(const bf16 *p, int n) { return (P)_mm512_maskz_loadu_epi16(first32(n), p); }
static inline P pairs_int8(const int8_t *p) {   /* every integer of int8 is a bf16: exact */
  __m256i q = _mm256_loadu_si256((const __m256i *)p);
  __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
  __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
  return _mm512_cvtne2ps_pbh(hi, lo);                        /* lo's 16 numbers first, then hi's */
}
typedef bf16 X;   /* a product's rows as its tile reads them: bf16 pairs, as dot2 takes them */
static inline P pair_bcast(const X *p) {   /* p[0], p[1] as every pair */
  int32_t b;
  memcpy(&b, p, 4);
  return (P)_mm512_set1_epi32(b);
}
static inline V dot2(V acc, P a, P b) { return _mm512_dpbf16_ps(acc, a, b); }
#define PARTS 1
typedef P W;
static inline W weight_part(const bf16 *p, int part) { (void)part; return pairs_all(p); }
static inline W weight_part_int8(const int8_t *p, int part) { (void)part; return pairs_int8(p); }
static inline P x_part(const X *p, int part) { (void)part; return pair_bcast(p); }
static inline V mac(V acc, P x, W w) { return dot2(acc, x, w); }
/* 2 VL bf16 as their even-numbered and odd-numbered halves, and back, rounded */
static inline void halves(const bf16 *p, int n, V *even, V *odd) {
  __m512i pair = _mm512_maskz_loadu_epi16(first32(n), p);
  *even = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
  *odd = _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32((int)0xffff0000u)));
}
static inline void store_halves(bf16 *p, int n, V even, V odd) {
  __m512i order = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                   39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  __m512i e = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(even));
  __m512i o = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(odd));
  _mm512_mask_storeu_epi16(p, first32(n), _mm512_permutex2var_epi16(e, order, o));
}

#else
/* No bf16 arithmetic: as AVX2's, bf16 widened to fp32 by a shift in registers and fp32 fused
   multiply-adds, on 16 lanes and 32 registers (a tile of 8 rows). P is two fp32 vectors, the
   pairs' first numbers and their second: dot2 is two multiply-adds. */
#define ISA "avx512f"
typedef struct { __m512 even, odd; } P;

static inline __m512i bf16_bits(V a) {   /* each lane's bf16, rounded to nearest even */
  __m512i b = _mm512_castps_si512(a), one = _mm512_set1_epi32(1);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), one);              /* ties go to even */
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(b, odd), _mm512_set1_epi32(0x7fff));
  r = _mm512_srli_epi32(r, 16);
  __mmask16 nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));             /* NaN stays NaN */
}
static inline void narrow(bf16 *p, int n, V a) {   /* the 16 low halves, packed */
  _mm256_mask_storeu_epi16(p, first16(n), _mm512_cvtepi32_epi16(bf16_bits(a)));
}
static inline V round16(V a) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(a), 16)); }
static inline P split(__m512i pair) {   /* 16 pairs of bf16 -> their first numbers, their second */
  return (P){_mm512_castsi512_ps(_mm512_slli_epi32(pair, 16)),
             _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32((int)0xffff0000u)))};
}
static inline P pairs_all(const bf16 *p) { return split(_mm512_loadu_si512(p)); }
static inline P pairs(const bf16 *p, int n) { return split(_mm512_maskz_loadu_epi16(first32(n), p)); }
static inline P pairs_int8(const int8_t *p) {   /* 32 int8 as 16 pairs of int16, then fp32 */
  __m512i q = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));
  __m512i even = _mm512_srai_epi32(_mm512_slli_epi32(q, 16), 16), odd = _mm512_srai_epi32(q, 16);
  return (P){_mm512_cvtepi32_ps(even), _mm512_cvtepi32_ps(odd)};
}
typedef float X;   /* a product's rows as its tile reads them: widened to fp32 once a call */
static inline V dot2(V acc, P a, P b) {   /* the first numbers of the pairs, then the second */
  return _mm512_fmadd_ps(a.odd, b.odd, _mm512_fmadd_ps(a.even, b.even, acc));
}
static inline void halves(const bf16 *p, int n, V *even, V *odd) {
  P h = pairs(p, n);
  *even = h.even, *odd = h.odd;
}
static inline void store_halves(bf16 *p, int n, V even, V odd) {
  __m512i b = _mm512_or_si512(bf16_bits(even), _mm512_slli_epi32(bf16_bits(odd), 16));
  _mm512_mask_storeu_epi16(p, first32(n), b);
}
#endif

#elif defined(__AVX2__) && defined(__FMA__)
/* No bf16 arithmetic: bf16 widened to fp32 by a shift, fp32 fused multiply-adds, 8 lanes. P is
   two fp32 vectors, the pairs' first numbers and their second: dot2 is two multiply-adds. */
#include <immintrin.h>
#define ISA "avx2"
enum { VL = 8, REGS = 16 };
typedef __m256 V;
typedef struct { __m256 even, odd; } P;

static inline V vzero(void) { return _mm256_setzero_ps(); }
static inline V vset(float a) { return _mm256_set1_ps(a); }
static inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
static inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
static inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
static inline V vdiv(V a, V b) { return _mm256_div_ps(a, b); }
static inline V vmax(V a, V b) { return _mm256_max_ps(a, b); }
static inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
static inline V vfnma(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
static inline V vround(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT); }
static inline V vpow2(V p, V n) {   /* p 2^n: n added to p's exponent (exp_ keeps it in range) */
  __m256i exponent = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), exponent));
}
static inline float hsum(V a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float hmax(V a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
static inline V first(V a, int n, float fill) {
  __m256i in = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_blendv_ps(vset(fill), a, _mm256_castsi256_ps(in));
}
static inline V loadf_all(const float *p) { return _mm256_loadu_ps(p); }
static inline void storef_all(float *p, V a) { _mm256_storeu_ps(p, a); }
static inline V widen_all(const bf16 *p) {   /* 8 bf16 -> fp32: each the top half of its fp32 */
  __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
}
static inline __m256i bf16_bits(V a) {   /* each lane's bf16, rounded to nearest even */
  __m256i b = _mm256_castps_si256(a), one = _mm256_set1_epi32(1);
  __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), one);              /* ties go to even */
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(b, odd), _mm256_set1_epi32(0x7fff));
  r = _mm256_srli_epi32(r, 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);                 /* NaN stays NaN */
}
static inline void narrow_all(bf16 *p, V a) {
  __m256i b = bf16_bits(a);   /* the 8 low halves, packed */
  __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128((__m128i *)p, packed);
}
static inline V round16(V a) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(a), 16)); }
static inline P split(__m256i pair) {   /* 8 pairs of bf16 -> their first numbers, their second */
  return (P){_mm256_castsi256_ps(_mm256_slli_epi32(pair, 16)),
             _mm256_castsi256_ps(_mm256_and_si256(pair, _mm256_set1_epi32((int)0xffff0000u)))};
}
static inline P pairs_all(const bf16 *p) { return split(_mm256_loadu_si256((const __m256i *)p)); }
static inline P pairs_int8(const int8_t *p) {   /* 16 int8 as 8 pairs of int16, then fp32 */
  __m256i q = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
  __m256i even = _mm256_srai_epi32(_mm256_slli_epi32(q, 16), 16), odd = _mm256_srai_epi32(q, 16);
  return (P){_mm256_cvtepi32_ps(even), _mm256_cvtepi32_ps(odd)};
}
typedef float X;   /* a product's rows as its tile reads them: widened to fp32 once a call */
static inline V dot2(V acc, P a, P b) {   /* the first numbers of the pairs, then the second */
  return _mm256_fmadd_ps(a.odd, b.odd, _mm256_fmadd_ps(a.even, b.even, acc));
}
static inline void store_halves_all(bf16 *p, V even, V odd) {
  __m256i b = _mm256_or_si256(bf16_bits(even), _mm256_slli_epi32(bf16_bits(odd), 16));
  _mm256_storeu_si256((__m256i *)p, b);
}
static inline V sums(const V v[8]) {   /* r[i] = the sum of v[i]'s 8 numbers: a fixed tree */
  __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
#define prefetch(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)

#elif defined(__ARM_NEON) && defined(__aarch64__)
/* As AVX2's, 4 lanes: bf16 widened by a shift, fp32 fused multiply-adds. */
#include <arm_neon.h>
#define ISA "neon"
enum { VL = 4, REGS = 32 };
typedef float32x4_t V;
typedef struct { float32x4_t even, odd; } P;

static inline V vzero(void) { return vdupq_n_f32(0); }
static inline V vset(float a) { return vdupq_n_f32(a); }
static inline V vadd(V a, V b) { return vaddq_f32(a, b); }
static inline V vsub(V a, V b) { return vsubq_f32(a, b); }
static inline V vmul(V a, V b) { return vmulq_f32(a, b); }
static inline V vdiv(V a, V b) { return vdivq_f32(a, b); }
static inline V vmax(V a, V b) { return vmaxq_f32(a, b); }
static inline V vfma(V a, V b, V c) { return vfmaq_f32(c, a, b); }
static inline V vfnma(V a, V b, V c) { return vfmsq_f32(c, a, b); }
static inline V vround(V a) { return vrndnq_f32(a); }
static inline V vpow2(V p, V n) {
  int32x4_t exponent = vshlq_n_s32(vcvtq_s32_f32(n), 23);
  return vreinterpretq_f32_s32(vaddq_s32(vreinterpretq_s32_f32(p), exponent));
}
static inline float hsum(V a) { return vaddvq_f32(a); }
static inline float hmax(V a) { return vmaxvq_f32(a); }
static inline V first(V a, int n, float fill) {
  const int32_t lane[4] = {0, 1, 2, 3};
  return vbslq_f32(vcltq_s32(vld1q_s32(lane), vdupq_n_s32(n)), a, vset(fill));
}
static inline V loadf_all(const float *p) { return vld1q_f32(p); }
static inline void storef_all(float *p, V a) { vst1q_f32(p, a); }
static inline V widen_all(const bf16 *p) {
  return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
}
static inline uint32x4_t bf16_bits(V a) {   /* each lane's bf16, rounded to nearest even */
  uint32x4_t b = vreinterpretq_u32_f32(a), odd = vandq_u32(vshrq_n_u32(b, 16), vdupq_n_u32(1));
  uint32x4_t r = vshrq_n_u32(vaddq_u32(b, vaddq_u32(odd, vdupq_n_u32(0x7fff))), 16);
  return vbslq_u32(vceqq_f32(a, a), r, vdupq_n_u32(0x7fc0));                   /* NaN stays NaN */
}
static inline void narrow_all(bf16 *p, V a) { vst1_u16(p, vmovn_u32(bf16_bits(a))); }
static inline V round16(V a) { return vreinterpretq_f32_u32(vshlq_n_u32(bf16_bits(a), 16)); }
static inline P split(uint32x4_t pair) {
  uint32x4_t even = vshlq_n_u32(pair, 16), odd = vandq_u32(pair, vdupq_n_u32(0xffff0000u));
  return (P){vreinterpretq_f32_u32(even), vreinterpretq_f32_u32(odd)};
}
static inline P pairs_all(const bf16 *p) { return split(vreinterpretq_u32_u16(vld1q_u16(p))); }
static inline P pairs_int8(const int8_t *p) {
  int32x4_t q = vreinterpretq_s32_s16(vmovl_s8(vld1_s8(p)));
  return (P){vcvtq_f32_s32(vshrq_n_s32(vshlq_n_s32(q, 16), 16)), vcvtq_f32_s32(vshrq_n_s32(q, 16))};
}
typedef float X;   /* a product's rows as its tile reads them: widened to fp32 once a call */
static inline V dot2(V acc, P a, P b) {
  return vfmaq_f32(vfmaq_f32(acc, a.even, b.even), a.odd, b.odd);
}
static inline void store_halves_all(bf16 *p, V even, V odd) {
  vst1q_u16(p, vreinterpretq_u16_u32(vorrq_u32(bf16_bits(even), vshlq_n_u32(bf16_bits(odd), 16))));
}
static inline V sums(const V v[4]) {
  return vpaddq_f32(vpaddq_f32(v[0], v[1]), vpaddq_f32(v[2], v[3]));
}
#define prefetch(p) __builtin_prefetch(p)

#else
#error "kernels.c needs AVX-512 (F, BW, VL; with BF16 or not), AVX2 with FMA, or NEON on aarch64"
#endif

#if !defined(__AVX512BF16__)
/* The tile's step where bf16 is widened (AVX-512 without BF16, AVX2, NEON): a pair's first
   numbers, then its second. */
#define PARTS 2
typedef V W;
static inline W weight_part(const bf16 *p, int part) {
  return part ? pairs_all(p).odd : pairs_all(p).even;
}
static inline W weight_part_int8(const int8_t *p, int part) {
  return part ? pairs_int8(p).odd : pairs_int8(p).even;
}
static inline V x_part(const X *p, int part) { return vset(p[part]); }
static inline V mac(V acc, V x, W w) { return vfma(x, w, acc); }

#if !defined(MASKED)
/* Loads and stores of n < VL numbers, through a vector's worth of scratch (AVX-512 masks them). */
static inline V loadf(const float *p, int n) {
  if (n >= VL) return loadf_all(p);
  float t[VL] = {0};
  memcpy(t, p, sizeof(float) * n);
  return loadf_all(t);
}
static inline void storef(float *p, int n, V a) {
  if (n >= VL) { storef_all(p, a); return; }
  float t[VL];
  storef_all(t, a);
  memcpy(p, t, sizeof(float) * n);
}
static inline V widen(const bf16 *p, int n) {
  if (n >= VL) return widen_all(p);
  bf16 t[VL] = {0};
  memcpy(t, p, sizeof(bf16) * n);
  return widen_all(t);
}
static inline void narrow(bf16 *p, int n, V a) {
  if (n >= VL) { narrow_all(p, a); return; }
  bf16 t[VL];
  narrow_all(t, a);
  memcpy(p, t, sizeof(bf16) * n);
}
static inline P pairs(const bf16 *p, int n) {
  if (n >= 2 * VL) return pairs_all(p);
  bf16 t[2 * VL] = {0};
  memcpy(t, p, sizeof(bf16) * n);
  return pairs_all(t);
}
static inline void halves(const bf16 *p, int n, V *even, V *odd) {
  P h = pairs(p, n);
  *even = h.even, *odd = h.odd;
}
static inline void store_halves(bf16 *p, int n, V even, V odd) {
  if (n >= 2 * VL) { store_halves_all(p, even, odd); return; }
  bf16 t[2 * VL];
  store_halves_all(t, even, odd);
  memcpy(p, t, sizeof(bf16) * n);
}
#endif
#endif

const char *kernels_isa(void) { return ISA; }   /* which of the paths above this build runs */

/* --- the product of a few rows --------------------------------------------------------------- */

/* a packed block's outputs; the output vectors of a group of two blocks; a tile's rows at most */
enum { BLOCK = 16, GV = 2 * BLOCK / VL, ROWS = 8 };

/* A tile keeps in registers its m x nv accumulators, the nv weight vectors of a step and a
   broadcast (a spare for the compiler): NV(m), the most vectors of a group it takes at once; a
   tile of 2 vectors takes up to TILE_ROWS rows (AVX2's 16 registers: 6, else ROWS). */
#define FITS(m, nv) ((m) * (nv) + (nv) + 2 <= REGS)
#define NV(m) \
  (FITS(m, GV) ? GV : FITS(m, GV / 2) ? GV / 2 : GV >= 4 && FITS(m, GV / 4) ? GV / 4 : 1)
#define TILE_ROWS (FITS(ROWS, 2) ? ROWS : (REGS - 4) / 2)

/* rows x[0..m) times the nv output vectors (VL outputs each) from output n0, written to y (row
   stride N). Each step takes PARTS parts of a pair of inputs: its weights, then for each row its
   broadcast and nv multiply-adds. The accumulators acc[r][v] stay in registers: m and nv are
   constants where this is inlined. */
static inline __attribute__((always_inline)) void tile(
    const X *x, const int m, const int nv, int K, const void *w, const int int8,
    const float *scale, int n0, int N, const bf16 *bias, const bf16 *add, bf16 *y) {
  V acc[ROWS][GV];
  long at[GV];                       /* where output vector v's stream starts: its block's, plus */
  for (int v = 0; v < nv; v++) {     /* its place among the block's 16 outputs, pair k = 0 */
    int n = n0 + VL * v;
    at[v] = (long)(n - n % BLOCK) * K + 2 * (n % BLOCK);
  }
  for (int r = 0; r < m; r++)
    for (int v = 0; v < nv; v++) acc[r][v] = vzero();
  for (int k = 0; k < K; k += 2)
    for (int part = 0; part < PARTS; part++) {
      W wk[GV];
      for (int v = 0; v < nv; v++) {                 /* output vector v's weights at pair k */
        long i = at[v] + (long)k * BLOCK;
        if (part == 0 && (v == 0 || (n0 + VL * v) % BLOCK == 0))   /* a block's, 4096 ahead */
          prefetch((const char *)w + (i + 4096) * (int8 ? 1 : 2));
        wk[v] = int8 ? weight_part_int8((const int8_t *)w + i, part)
                     : weight_part((const bf16 *)w + i, part);
      }
      for (int r = 0; r < m; r++) {
        W xk = x_part(x + (long)r * K + k, part);              /* x[r, k:k+2], or its part */
        for (int v = 0; v < nv; v++) acc[r][v] = mac(acc[r][v], xk, wk[v]);
      }
    }
  for (int r = 0; r < m; r++)
    for (int v = 0; v < nv; v++) {
      int n = n0 + VL * v, kept = N - n < VL ? N - n : VL;
      if (kept <= 0) break;                                   /* past the last output */
      V s = acc[r][v];
      if (scale) s = vmul(s, loadf(scale + n, kept));
      if (bias) s = vadd(s, widen(bias + n, kept));
      if (add) s = vadd(s, widen(add + (long)r * N + n, kept));
      narrow(y + (long)r * N + n, kept, s);
    }
}

/* x's n numbers as the tile broadcasts them (X): as they are where dot2 multiplies bf16 pairs
   (AVX512-BF16); else widened to fp32 here, once a call rather than once for every block of
   outputs, so that a broadcast costs a load and no shifts. NULL where memory is not to be had. */
static const X *product_rows(const bf16 *x, long n) {
#if defined(__AVX512BF16__)
  (void)n;
  return x;
#else
  float *f = malloc(sizeof(float) * n);
  for (long i = 0; f && i < n; i++) {
    uint32_t b = (uint32_t)x[i] << 16;
    memcpy(f + i, &b, sizeof b);
  }
  return f;
#endif
}

/* y (M, N) = x (M, K) @ w^T + bias + add. w packed as above with N rounded up to 32 (zeros): bf16,
   or int8 where scale (N,) is given, the weight then being scale[n] * w[n, :] (kernels.int8_weight);
   K even; bias (N,) and add (M, N) may be NULL. The threads share out the outputs, 32 at a time;
   each group of 32 is read from memory once, by up to TILE_ROWS rows at a time, then from the
   caches.
   Returns 0, or -1 where scratch memory is not to be had. */
int linear_bf16(const bf16 *x, int M, int K, const void *w, const float *scale, int N,
                const bf16 *bias, const bf16 *add, bf16 *y) {
  const X *xs = product_rows(x, (long)M * K);
  if (!xs) return -1;
  const int tiles = (M + TILE_ROWS - 1) / TILE_ROWS;   /* the rows shared out evenly (8: 4 + 4) */
  #pragma omp parallel for schedule(static)
  for (int n0 = 0; n0 < N; n0 += 2 * BLOCK)
    for (int t = 0; t < tiles; t++) {
      const int r0 = t * M / tiles, m = (t + 1) * M / tiles - r0;
      const X *xr = xs + (long)r0 * K;
      const bf16 *ar = add ? add + (long)r0 * N : 0;
      bf16 *yr = y + (long)r0 * N;
/* m rows over the group's GV output vectors, NV(m) of them at a time */
#define TILE(m) for (int v = 0; v < GV; v += NV(m)) {                                         \
        if (scale) tile(xr, m, NV(m), K, w, 1, scale, n0 + VL * v, N, bias, ar, yr);         \
        else tile(xr, m, NV(m), K, w, 0, NULL, n0 + VL * v, N, bias, ar, yr);                \
      }
      switch (m) {   /* m, nv, the weights' type known when compiled: accumulators in registers */
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
  if ((const void *)xs != (const void *)x) free((void *)xs);
  return 0;
}

/* --- attention ---------------------------------------------------------------------------------
   The attention of a few queries: the twin of model.attend for bf16 on a CPU, one batch row.

   Each query is computed alone: its visible keys are listed in order first, then scores, their
   softmax and the weighted sum of values run over that list in the same order whatever the mask
   or the other queries are. A tree's node therefore gets the bits plain decoding gets at the same
   place (same keys, same order), which SDPA, whose kernel depends on the number of queries and the
   mask, does not give. Scores and sums in fp32, the output rounded to bf16 once. */

static inline V exp_(V x) {   /* e^x: 2^n e^r, |r| <= ln2/2, degree-6 polynomial */
  x = vmax(x, vset(-87.f));
  V n = vround(vmul(x, vset(1.44269504f)));
  V r = vfnma(n, vset(0.693145752f), x);
  r = vfnma(n, vset(1.42860677e-6f), r);
  V p = vset(1.f / 720);
  p = vfma(p, r, vset(1.f / 120));
  p = vfma(p, r, vset(1.f / 24));
  p = vfma(p, r, vset(1.f / 6));
  p = vfma(p, r, vset(0.5f));
  p = vfma(p, r, vset(1.f));
  p = vfma(p, r, vset(1.f));
  return vpow2(p, n);
}

/* even, odd += weight times a value row's 2 VL numbers from vj (n of them): its even-numbered ones
   and its odd-numbered ones. */
static inline void weigh(const bf16 *vj, int n, float weight, V *even, V *odd) {
  V ev, od;
  halves(vj, n, &ev, &od);
  *even = vfma(vset(weight), ev, *even);
  *odd = vfma(vset(weight), od, *odd);
}

/* One query of head h: qt (Dh) against its n visible keys, in order (keys), into yt (Dh). p:
   scratch for n + VL floats. Scores: dot2 of q with VL keys at a time, summed across lanes by sums(). Values: each pair of
   a value row's numbers split into its first (even dimension) and second (odd), accumulated apart
   and put back in order at the end. Every sum runs over the visible keys in their order, so a
   query's result does not depend on the others. */
static void attend_one(const bf16 *qt, int H, int Dh, const bf16 *k, const bf16 *v, int Hkv, long head,
                       const int *keys, int n, float scale, bf16 *yt, int h, float *p) {
  enum { CHUNKS = 256 / (2 * VL) };                      /* 2 VL numbers of a head (Dh <= 256) */
  int g = h / (H / Hkv), chunks = (Dh + 2 * VL - 1) / (2 * VL);
  const bf16 *kh = k + g * head, *vh = v + g * head;
  P qv[CHUNKS];
  for (int c = 0; c < chunks; c++) qv[c] = pairs(qt + 2 * VL * c, Dh - 2 * VL * c);
  V top = vset(-INFINITY);
  for (int j0 = 0; j0 < n; j0 += VL) {                    /* scores, VL keys at a time */
    const bf16 *kj[VL];
    V acc[VL];
    for (int i = 0; i < VL; i++) {                        /* past the last key, any key: dropped below */
      kj[i] = kh + (long)keys[j0 + i < n ? j0 + i : j0] * Dh;
      acc[i] = vzero();
    }
    for (int c = 0; c < chunks; c++)                      /* the VL keys side by side: VL sums in flight */
      for (int i = 0; i < VL; i++) acc[i] = dot2(acc[i], qv[c], pairs(kj[i] + 2 * VL * c, Dh - 2 * VL * c));
    V sc = first(vmul(sums(acc), vset(scale)), n - j0, -INFINITY);
    storef(p + j0, n - j0, sc);
    top = vmax(top, sc);
  }
  V most = vset(hmax(top)), total = vzero();
  for (int j = 0; j < n; j += VL) {                       /* e^(score - max), VL keys at a time */
    V e = first(exp_(vsub(loadf(p + j, n - j), most)), n - j, 0);
    storef(p + j, n - j, e);
    total = vadd(total, e);
  }
  V inv = vset(1.f / hsum(total));
  for (int c = 0; c < chunks; c++) {                      /* the values, weighed: 2 VL numbers a pass */
    const bf16 *vc = vh + 2 * VL * c;
    int j = 0, kept = Dh - 2 * VL * c;
    V even[2] = {vzero(), vzero()}, odd[2] = {vzero(), vzero()};
    for (; j + 1 < n; j += 2)                             /* two sums, alternate keys: twice as many in flight */
      for (int a = 0; a < 2; a++) weigh(vc + (long)keys[j + a] * Dh, kept, p[j + a], &even[a], &odd[a]);
    if (j < n) weigh(vc + (long)keys[j] * Dh, kept, p[j], &even[0], &odd[0]);
    store_halves(yt + 2 * VL * c, kept,
                 vmul(vadd(even[0], even[1]), inv), vmul(vadd(odd[0], odd[1]), inv));
  }
}

/* M queries of H heads: y (M, H, Dh) = softmax(q k^T * scale + mask) v for q (M, H, Dh). Query m
   is row b's new token t (at[m] = b T + t; at NULL: m itself, M = B T): it reads row b's k, v
   (Hkv, S, Dh), which start `row` elements after row b - 1's, with `head` elements between heads
   (a cache's view); query head h reads key/value head h / (H/Hkv). mask (M, S) bytes, 1 =
   visible, or NULL: causal (query t sees keys up to S - T + t). Dh even, at most 256. Returns 0,
   or -1 where the scratch memory is not to be had. */
int attend_bf16(const bf16 *q, int M, const int *at, int H, int T, int Dh, const bf16 *k,
                const bf16 *v, int Hkv, int S, long row, long head, const uint8_t *mask, float scale,
                bf16 *y) {
  int failed = 0;
  #pragma omp parallel
  {
    int *keys = malloc(sizeof(int) * S);
    float *p = malloc(sizeof(float) * (S + VL));
    if (!keys || !p) {
      #pragma omp atomic write
      failed = 1;
    }
    int listed = -1, n = 0;                               /* the query whose visible keys are listed */
    #pragma omp for schedule(static)
    for (int i = 0; i < M * H; i++) {
      int m = i / H, h = i % H, bt = at ? at[m] : m, b = bt / T, t = bt % T;
      if (!keys || !p) continue;
      if (m != listed) {                                  /* query m: its visible keys, in order */
        const uint8_t *seen = mask ? mask + (long)m * S : NULL;
        n = 0;
        for (int s = 0; s < S; s++)
          if (seen ? seen[s] : s <= S - T + t) keys[n++] = s;
        listed = m;
      }
      attend_one(q + ((long)m * H + h) * Dh, H, Dh, k + b * row, v + b * row, Hkv, head, keys, n,
                 scale, y + ((long)m * H + h) * Dh, h, p);
    }
    free(keys);
    free(p);
  }
  return failed ? -1 : 0;
}

/* --- a decoder layer ---------------------------------------------------------------------------
   One decoder layer in C: the twin of model.Block (FastBlock) for a few rows of each sequence of
   a batch in bf16: RMSNorm, rotary, grouped-query attention, SwiGLU or GeGLU; Qwen2's q/k/v
   biases and Qwen3's q/k norms.
   One call a layer instead of some forty PyTorch operations, each a trip through its dispatcher:
   the time a decode step spent between its products (results/kernels-cpu.md). Each step of the
   readable layer is here, in its order, rounded to bf16 where it rounds, and every row is
   computed alone, as above. */

/* y (T, D) = model.RMSNorm: weight * bf16(x * rsqrt(mean(x^2) + eps)), each row alone. */
static void rms_norm(const bf16 *x, int T, int D, const bf16 *weight, float eps, bf16 *y) {
  for (int t = 0; t < T; t++) {
    const bf16 *xt = x + (long)t * D;
    V ss = vzero();
    for (int d = 0; d < D; d += VL) {
      V a = widen(xt + d, D - d);
      ss = vfma(a, a, ss);
    }
    V r = vset(1.f / sqrtf(hsum(ss) / D + eps));
    for (int d = 0; d < D; d += VL) {
      V normed = round16(vmul(widen(xt + d, D - d), r));
      narrow(y + (long)t * D + d, D - d, vmul(widen(weight + d, D - d), normed));
    }
  }
}

/* model.apply_rope on one head's row x (Dh): x cos + rotate_half(x) sin, rounded as bf16 tensors
   round each product and the sum; written to out. rotate_half(x)[d] = -x[d + Dh/2] in the first
   half, x[d - Dh/2] in the second: each chunk of the first half and its partner in the second. */
static void rope_row(const bf16 *x, const bf16 *cos, const bf16 *sin, int Dh, bf16 *out) {
  int half = Dh / 2;
  for (int d = 0; d < half; d += VL) {
    int n = half - d;
    V lo = widen(x + d, n), hi = widen(x + half + d, n);
    V a = round16(vmul(lo, widen(cos + d, n)));
    V b = round16(vmul(vsub(vzero(), hi), widen(sin + d, n)));
    narrow(out + d, n, vadd(a, b));
    a = round16(vmul(hi, widen(cos + half + d, n)));
    b = round16(vmul(lo, widen(sin + half + d, n)));
    narrow(out + half + d, n, vadd(a, b));
  }
}

static inline V sigmoid(V x) {   /* 1 / (1 + e^-x) */
  return vdiv(vset(1.f), vadd(vset(1.f), exp_(vsub(vzero(), x))));
}

/* The gated MLP's middle: act (T, F) = bf16(bf16(a(gate)) * up) for gu (T, 2F) = [gate | up]; a
   is SiLU, x sigmoid(x) (SwiGLU), or with gelu GELU's tanh form, x sigmoid(2 sqrt(2/pi) (x +
   0.044715 x^3)), which is 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (GeGLU: Gemma). */
static void gated(const bf16 *gu, int T, int F, int gelu, bf16 *act) {
  #pragma omp parallel for schedule(static) if (T > 1)
  for (int t = 0; t < T; t++)
    for (int f = 0; f < F; f += VL) {
      int n = F - f;
      V g = widen(gu + (long)t * 2 * F + f, n), u = widen(gu + (long)t * 2 * F + F + f, n);
      V z = g;
      if (gelu) z = vmul(vset(1.5957691216f), vfma(vmul(vset(0.044715f), g), vmul(g, g), g));
      narrow(act + (long)t * F + f, n, vmul(round16(vmul(g, sigmoid(z))), u));
    }
}

/* A decoder layer's weights, laid out once by kernels.py (NativeLayer) from a model.Block: its
   sizes, its norms' weights, and its products packed as linear_bf16 takes them, each with its int8
   scales or NULL: wqkv ((H + 2 Hkv) Dh outputs, bias bqkv or NULL), wo (D), wgu (2F: gate then
   up), wdown (D). qnorm, knorm (Dh): Qwen3's RMSNorm of each q and k head before rotary, or NULL;
   gelu: GeGLU's activation, not SwiGLU's. */
typedef struct {
  int D, H, Hkv, Dh, F, gelu;
  float eps;
  const bf16 *norm1, *norm2, *bqkv, *qnorm, *knorm;
  const void *wqkv, *wo, *wgu, *wdown;
  const float *sqkv, *so, *sgu, *sdown;
} Layer;

/* out (M, D) = the layer L applied to x (M, D): M new tokens of B batch rows, T slots a row. Token
   m is row b's new token t, at[m] = b T + t (at NULL: m itself, M = B T: B rows of T tokens); a
   row's tokens need not fill its T slots (a smaller tree beside a larger one costs only its own).
   cos, sin (M, Dh): each token's rotary. Row b's cache starts `row` elements after row b - 1's, its
   Hkv heads `head` elements apart, rows of Dh; new token t goes to slot start + t. mask (M, start +
   T) bytes or NULL (causal). Returns 0, or -1 where scratch memory is not to be had. */
int block_bf16(const Layer *L, const bf16 *x, int M, const int *at, int T, const bf16 *cos,
               const bf16 *sin, bf16 *k_cache, bf16 *v_cache, long row, long head, int start,
               const uint8_t *mask, bf16 *out) {
  const int D = L->D, H = L->H, Hkv = L->Hkv, Dh = L->Dh, F = L->F;
  const int Q = (H + 2 * Hkv) * Dh, S = start + T;
  bf16 *h = malloc(sizeof(bf16) * M * D), *qkv = malloc(sizeof(bf16) * M * Q);
  bf16 *q = malloc(sizeof(bf16) * M * H * Dh), *y = malloc(sizeof(bf16) * M * H * Dh);
  bf16 *gu = malloc(sizeof(bf16) * M * 2 * F), *act = malloc(sizeof(bf16) * M * F);
  int failed = !h || !qkv || !q || !y || !gu || !act;
  if (!failed) {
    rms_norm(x, M, D, L->norm1, L->eps, h);                                 /* input_layernorm */
    failed = linear_bf16(h, M, D, L->wqkv, L->sqkv, Q, L->bqkv, NULL, qkv);   /* q, k, v */
  }
  if (!failed) {
    /* rotary; k and v into the cache */
    #pragma omp parallel for schedule(static) if (M > 1)
    for (int m = 0; m < M; m++) {
      int bt = at ? at[m] : m, b = bt / T, t = bt % T;
      const bf16 *r = qkv + (long)m * Q, *ct = cos + (long)m * Dh, *st = sin + (long)m * Dh;
      bf16 *kb = k_cache + b * row, *vb = v_cache + b * row;
      bf16 normed[256];                                         /* a q or k head after its norm */
      for (int i = 0; i < H; i++) {
        if (L->qnorm) rms_norm(r + i * Dh, 1, Dh, L->qnorm, L->eps, normed);
        rope_row(L->qnorm ? normed : r + i * Dh, ct, st, Dh, q + ((long)m * H + i) * Dh);
      }
      for (int i = 0; i < Hkv; i++) {
        long slot = i * head + (long)(start + t) * Dh;
        if (L->knorm) rms_norm(r + (H + i) * Dh, 1, Dh, L->knorm, L->eps, normed);
        rope_row(L->knorm ? normed : r + (H + i) * Dh, ct, st, Dh, kb + slot);
        memcpy(vb + slot, r + (H + Hkv + i) * Dh, sizeof(bf16) * Dh);
      }
    }
    failed = attend_bf16(q, M, at, H, T, Dh, k_cache, v_cache, Hkv, S, row, head, mask,
                         1.f / sqrtf((float)Dh), y);
  }
  if (!failed) failed = linear_bf16(y, M, H * Dh, L->wo, L->so, D, NULL, x, out); /* x + o_proj */
  if (!failed) {
    rms_norm(out, M, D, L->norm2, L->eps, h);                               /* post_attention_layernorm */
    failed = linear_bf16(h, M, D, L->wgu, L->sgu, 2 * F, NULL, NULL, gu);   /* gate and up */
  }
  if (!failed) {
    gated(gu, M, F, L->gelu, act);
    /* + down_proj(act), in place: each output is read, then written */
    failed = linear_bf16(act, M, F, L->wdown, L->sdown, D, NULL, out, out);
  }
  free(h); free(qkv); free(q); free(y); free(gu); free(act);
  return failed ? -1 : 0;
}

/* The decoder layers L[0..n) in turn, in place: x (M, D) becomes the last one's output (a layer's
   x and out may be one buffer: x is read before out is written, element by element). Layer l's
   cache starts `layer` elements after layer l - 1's; the rest as block_bf16's. */
int stack_bf16(const Layer *L, int n, bf16 *x, int M, const int *at, int T, const bf16 *cos,
               const bf16 *sin, bf16 *k_cache, bf16 *v_cache, long layer, long row, long head,
               int start, const uint8_t *mask) {
  for (int l = 0; l < n; l++)
    if (block_bf16(L + l, x, M, at, T, cos, sin, k_cache + l * layer, v_cache + l * layer, row,
                   head, start, mask, x))
      return -1;
  return 0;
}
