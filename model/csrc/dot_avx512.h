// AVX-512 dot products of one weight row (or a piece of it, `len` weights) with M rows of x, row m
// at x + m * x_stride (M = 1..8, a template parameter so the accumulators live in registers). Each
// block of weights is loaded once and multiplied into all M rows of x, which stay in L1: the
// weights stream from memory once for all M rows.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

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

#if defined(__AVX512BF16__)
// out[m] = w . x[m] for bf16 w and bf16 x: dot products of bf16 pairs accumulated in fp32
// (vdpbf16ps), 32 a step. With one or two rows, two steps in flight into separate accumulators:
// each vdpbf16ps waits for the one before it on the same accumulator, and one chain alone streamed
// about 40 GB/s a core, below what two cores get from memory.
template <int M>
void dot_bf16_bf16(const uint16_t* w, const uint16_t* x, int64_t x_stride, int64_t len, float* out) {
  constexpr int A = M <= 2 ? 2 : 1;  // accumulators per row
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

// int4 w (portable::dot_q4's blocks), fp32 x. A block's 16 bytes widened to 16 int32 lanes hold its
// first 16 weights in their low nibbles and its last 16 in their high nibbles; both halves become fp32
// weights (q * scale + offset) once for all M rows. Scales and offsets are widened to
// fp32 kQ4Chunk blocks at a time (16 per instruction), so a block broadcasts them from L1.
constexpr int64_t kQ4Chunk = 64;

// n fp16 values -> fp32, 16 at a time.
inline void widen_fp16(const uint16_t* from, float* to, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = n - i >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(to + i, lanes, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, from + i)));
  }
}

// One block (weights k..k+31) into the accumulators lo (its first 16 weights) and hi (its last 16).
// The block's 16 possible weights q * s + o (q = 0..15) are one multiply-add into a register, and each
// lane of bytes picks its weight from it with vpermps, which reads only the index's low 4 bits: the low
// nibble as it is, the high one after a shift (no mask, no int -> float conversion).
template <int M>
inline void q4_block(const uint8_t* w, const float* x, int64_t x_stride, int64_t k, float s, float o,
                     __m512 (&lo_acc)[M], __m512 (&hi_acc)[M]) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k / 2)));
  const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 table = _mm512_fmadd_ps(levels, _mm512_set1_ps(s), _mm512_set1_ps(o));
  const __m512 lo = _mm512_permutexvar_ps(bytes, table);
  const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
  FOR_EACH_ROW(m) {
    lo_acc[m] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + m * x_stride + k), lo_acc[m]);
    hi_acc[m] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + m * x_stride + k + 16), hi_acc[m]);
  }
}

// With one or two rows, odd blocks go to a second pair of accumulators: each multiply-add waits for the
// one before it on the same accumulator, and a block's instructions take less time than that wait.
template <int M, bool Offsets>
void dot_q4(const uint8_t* w, const float* x, int64_t x_stride, const uint16_t* scale, const uint16_t* offset,
            int64_t len, float* out) {
  constexpr bool kTwoPairs = M <= 2;
  __m512 lo0[M], hi0[M], lo1[M], hi1[M];
  FOR_EACH_ROW(m) lo0[m] = hi0[m] = lo1[m] = hi1[m] = _mm512_setzero_ps();
  alignas(64) float s[kQ4Chunk], o[kQ4Chunk];
  const int64_t blocks = len / portable::kQ4Block;
  for (int64_t c = 0; c < blocks; c += kQ4Chunk) {
    const int64_t n = std::min(kQ4Chunk, blocks - c);
    for (int64_t b = 0; b < n; b += 32) {  // one cache line of fp16 values each
      prefetch_block_values(scale + c + b);
      if (Offsets) prefetch_block_values(offset + c + b);
    }
    widen_fp16(scale + c, s, n);
    if (Offsets) widen_fp16(offset + c, o, n);
    else for (int64_t b = 0; b < n; b++) o[b] = -8.f * s[b];
    int64_t b = 0;
    for (; b + 2 <= n; b += 2) {
      const int64_t k = (c + b) * portable::kQ4Block;
      if (b % 4 == 0) prefetch_ahead(w + k / 2);  // one cache line: 4 blocks
      q4_block<M>(w, x, x_stride, k, s[b], o[b], lo0, hi0);
      if (kTwoPairs) q4_block<M>(w, x, x_stride, k + portable::kQ4Block, s[b + 1], o[b + 1], lo1, hi1);
      else q4_block<M>(w, x, x_stride, k + portable::kQ4Block, s[b + 1], o[b + 1], lo0, hi0);
    }
    if (b < n) q4_block<M>(w, x, x_stride, (c + b) * portable::kQ4Block, s[b], o[b], lo0, hi0);
  }
  FOR_EACH_ROW(m) {
    const __m512 total = _mm512_add_ps(lo0[m], hi0[m]);
    out[m] = _mm512_reduce_add_ps(kTwoPairs ? _mm512_add_ps(total, _mm512_add_ps(lo1[m], hi1[m])) : total);
  }
}

}  // namespace avx512
