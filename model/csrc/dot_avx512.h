// AVX-512 dot products of one weight row (or a piece of it, `len` weights) with M rows of x, row m
// at x + m * x_stride (M = 1..8, a template parameter so the accumulators live in registers). Each
// block of weights is loaded once and multiplied into all M rows of x, which stay in L1: the
// weights stream from memory once for all M rows.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "dot_portable.h"  // FOR_EACH_ROW, prefetch_ahead

namespace avx512 {

// bf16 -> fp32: the 16-bit pattern shifted into the top half of a 32-bit lane.
inline __m512 widen_bf16(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// 32 bf16 weights (only the lanes in `mask`) times fp32 x, into two accumulators per row of x.
template <int M>
inline void fma_block(const uint16_t* w, const float* x, int64_t x_stride, __mmask32 mask, __m512 (&lo_acc)[M],
                      __m512 (&hi_acc)[M]) {
  const __m512i raw = _mm512_maskz_loadu_epi16(mask, w);
  const __m512 lo = widen_bf16(_mm512_castsi512_si256(raw));
  const __m512 hi = widen_bf16(_mm512_extracti64x4_epi64(raw, 1));
  const __mmask16 mask_lo = static_cast<__mmask16>(mask), mask_hi = static_cast<__mmask16>(mask >> 16);
  FOR_EACH_ROW(m) {
    lo_acc[m] = _mm512_fmadd_ps(lo, _mm512_maskz_loadu_ps(mask_lo, x + m * x_stride), lo_acc[m]);
    hi_acc[m] = _mm512_fmadd_ps(hi, _mm512_maskz_loadu_ps(mask_hi, x + m * x_stride + 16), hi_acc[m]);
  }
}

// out[m] = w . x[m] for bf16 w and fp32 x, 32 weights a step (the last one masked).
template <int M>
void dot_bf16(const uint16_t* w, const float* x, int64_t x_stride, int64_t len, float* out) {
  __m512 lo_acc[M], hi_acc[M];
  FOR_EACH_ROW(m) lo_acc[m] = hi_acc[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= len; k += 32) {
    prefetch_ahead(w + k);
    fma_block<M>(w + k, x + k, x_stride, ~__mmask32{0}, lo_acc, hi_acc);
  }
  if (k < len) fma_block<M>(w + k, x + k, x_stride, static_cast<__mmask32>((1ull << (len - k)) - 1), lo_acc, hi_acc);
  FOR_EACH_ROW(m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(lo_acc[m], hi_acc[m]));
}

// out[m] = w . x[m] for fp32 w and fp32 x, 32 weights a step (the last one masked), as dot_bf16.
template <int M>
void dot_f32(const float* w, const float* x, int64_t x_stride, int64_t len, float* out) {
  __m512 lo_acc[M], hi_acc[M];
  FOR_EACH_ROW(m) lo_acc[m] = hi_acc[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < len; k += 32) {
    prefetch_ahead(w + k);
    const int64_t n = std::min<int64_t>(32, len - k);
    const __mmask16 mask_lo = n >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
    const __mmask16 mask_hi = n >= 32 ? __mmask16(0xFFFF) : n <= 16 ? __mmask16(0)
                                                                     : static_cast<__mmask16>((1u << (n - 16)) - 1);
    const __m512 lo = _mm512_maskz_loadu_ps(mask_lo, w + k), hi = _mm512_maskz_loadu_ps(mask_hi, w + k + 16);
    FOR_EACH_ROW(m) {
      lo_acc[m] = _mm512_fmadd_ps(lo, _mm512_maskz_loadu_ps(mask_lo, x + m * x_stride + k), lo_acc[m]);
      hi_acc[m] = _mm512_fmadd_ps(hi, _mm512_maskz_loadu_ps(mask_hi, x + m * x_stride + k + 16), hi_acc[m]);
    }
  }
  FOR_EACH_ROW(m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(lo_acc[m], hi_acc[m]));
}

#if defined(__AVX512BF16__)
// out[m] = w . x[m] for bf16 w and bf16 x: dot products of bf16 pairs accumulated in fp32
// (vdpbf16ps), 32 a step, two steps in flight into separate accumulators per row: each vdpbf16ps
// waits for the one before it on the same accumulator, and one chain alone streamed about 40 GB/s a
// core, below what two cores get from memory. Two for every M (16 registers at 8 rows): a row's sums
// are then the same whatever rows it is computed with, so a sequence's tokens do not depend on the
// batch it decodes in.
template <int M>
void dot_bf16_bf16(const uint16_t* w, const uint16_t* x, int64_t x_stride, int64_t len, float* out) {
  constexpr int A = 2;  // accumulators per row
  __m512 acc[M][A];
  FOR_EACH_ROW(m) for (int a = 0; a < A; a++) acc[m][a] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 * A <= len; k += 32 * A) {
    __m512bh wv[A];
    for (int a = 0; a < A; a++) {
      prefetch_ahead(w + k + 32 * a);
      wv[a] = (__m512bh)_mm512_loadu_si512(w + k + 32 * a);
    }
    FOR_EACH_ROW(m) for (int a = 0; a < A; a++)
      acc[m][a] = _mm512_dpbf16_ps(acc[m][a], wv[a], (__m512bh)_mm512_loadu_si512(x + m * x_stride + k + 32 * a));
  }
  for (; k < len; k += 32) {  // what is left: a whole step or the masked tail
    const __mmask32 lanes = len - k >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1ull << (len - k)) - 1);
    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(lanes, w + k);
    FOR_EACH_ROW(m)
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], wv, (__m512bh)_mm512_maskz_loadu_epi16(lanes, x + m * x_stride + k));
  }
  FOR_EACH_ROW(m) out[m] = _mm512_reduce_add_ps(A == 2 ? _mm512_add_ps(acc[m][0], acc[m][A - 1]) : acc[m][0]);
}
#endif

// int8 w, int16 x: 32 weights widened to int16, pairs multiplied and added into int32 (vpmaddwd);
// each group's integer sum is then scaled in fp32. Needs group % 32 == 0.
constexpr int64_t kQ8Step = 32;

template <int M>
void dot_q8(const int8_t* w, const int16_t* x, int64_t x_stride, const float* scale, int64_t len, int64_t group,
            float* out) {
  __m512 total[M];
  FOR_EACH_ROW(m) total[m] = _mm512_setzero_ps();
  for (int64_t k = 0, g = 0; k < len; k += group, g++) {  // g: the group (no division per group)
    prefetch_ahead(w + k);
    __m512i acc[M];
    FOR_EACH_ROW(m) acc[m] = _mm512_setzero_si512();
    for (int64_t i = k; i < k + group; i += kQ8Step) {
      const __m512i wi = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i)));
      FOR_EACH_ROW(m)
        acc[m] = _mm512_add_epi32(acc[m], _mm512_madd_epi16(wi, _mm512_loadu_si512(x + m * x_stride + i)));
    }
    const __m512 s = _mm512_set1_ps(scale[g]);
    FOR_EACH_ROW(m) total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m]), s, total[m]);
  }
  FOR_EACH_ROW(m) out[m] = _mm512_reduce_add_ps(total[m]);
}

// int4 w with x rounded to int8 per block of 32 (its own scale each, as llama.cpp's Q8 activations), four
// blocks a step: their 64 bytes hold weights 0-15 of each block in the low nibbles and 16-31 in the
// high ones. matvec.cpp lays x out to match (HAVE_Q4_INT8_X): per 128 values, the first 16 of each of the four
// blocks, then the second 16 of each, each row padded with zero blocks to whole 128s; and beside it
// each block's x scale four times (x_scales: 16 floats per 128 values, zero for padding). An unsigned
// nibble times a signed x byte, four to an int32 lane (vpdpbusd), gives a block's integer dot product
// in four lanes (block j in lanes 4j..4j+3); scaled by the block's weight scale and x scale in fp32.
// Without AVX-512 VNNI: vpmaddubsw into int16 pairs (at most 2 * 15 * 127, no saturation) + vpmaddwd.
constexpr int64_t kQ4Group = 128;  // values of x per step: four blocks

inline __m512i dot_u8_s8(__m512i acc, __m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}

template <int M, bool Offsets>
void dot_q4_x8(const uint8_t* w, const int8_t* x, int64_t x_stride, const float* x_scales,
               int64_t scales_stride, const float* x_sums, int64_t sums_stride, const uint16_t* scale,
               const uint16_t* offset, int64_t len, float* out) {
  // Odd steps go to a second accumulator, for every M: a row's sums do not depend on the rows beside it.
  __m512 acc0[M], acc1[M], shift[M];
  FOR_EACH_ROW(m) acc0[m] = acc1[m] = shift[m] = _mm512_setzero_ps();
  const int64_t blocks = len / portable::kQ4Block;
  for (int64_t b = 0; b < blocks; b += 16) {  // the offsets' share: offset[b] * (block b's sum of x)
    if (b % 32 == 0) {  // one cache line of fp16 values each
      prefetch_block_values(scale + b);
      if (Offsets) prefetch_block_values(offset + b);
    }
    const int64_t n = std::min<int64_t>(16, blocks - b);
    const __mmask16 lanes = n == 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
    const __m512 ov = Offsets ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, offset + b))
                              : _mm512_mul_ps(_mm512_set1_ps(-8.f),
                                              _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, scale + b)));
    FOR_EACH_ROW(m)
      shift[m] = _mm512_fmadd_ps(ov, _mm512_maskz_loadu_ps(lanes, x_sums + m * sums_stride + b), shift[m]);
  }
  const __m512i quads = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0, g = 0; b < blocks; b += 4, g++) {
    const int64_t k = b * portable::kQ4Block, n = std::min<int64_t>(4, blocks - b);
    prefetch_ahead(w + k / 2);  // one cache line: this step's
    __m512i bytes;
    __m128i four;  // the step's fp16 scales
    if (n == 4) {
      bytes = _mm512_loadu_si512(w + k / 2);
      four = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(scale + b));
    } else {  // the last blocks of a row: the rest of the step zero
      bytes = _mm512_maskz_loadu_epi8((1ull << (16 * n)) - 1, w + k / 2);
      four = _mm_maskz_loadu_epi16(static_cast<__mmask8>((1u << n) - 1), scale + b);
    }
    const __m512 scales = _mm512_permutexvar_ps(quads, _mm512_castps128_ps512(_mm_cvtph_ps(four)));
    const __m512i lo = _mm512_and_si512(bytes, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
    FOR_EACH_ROW(m) {
      const int8_t* xm = x + m * x_stride + k;
      const __m512i dot = dot_u8_s8(dot_u8_s8(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xm)), hi,
                                    _mm512_loadu_si512(xm + 64));
      const __m512 both = _mm512_mul_ps(scales, _mm512_loadu_ps(x_scales + m * scales_stride + 16 * g));
      if (g % 2) acc1[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), both, acc1[m]);
      else acc0[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), both, acc0[m]);
    }
  }
  FOR_EACH_ROW(m) {
    const __m512 total = _mm512_add_ps(acc0[m], shift[m]);
    out[m] = _mm512_reduce_add_ps(_mm512_add_ps(total, acc1[m]));
  }
}

}  // namespace avx512
