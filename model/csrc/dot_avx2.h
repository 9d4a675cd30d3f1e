// AVX2 + FMA dot products of one weight row (or `len` weights of it) with M rows of x, row m at
// x + m * x_stride (M = 1..8), for CPUs without AVX-512 (Zen 1-3, Intel before Ice Lake and its
// E-cores). These CPUs have no bf16 arithmetic, so x is fp32. Each block of weights is loaded
// once and multiplied into all M rows of x.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "dot_portable.h"  // FOR_EACH_ROW, prefetch_ahead, bf16_to_float

namespace avx2 {

inline float reduce_add(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// 8 bf16 -> 8 fp32: the 16-bit pattern shifted into the top half of a 32-bit lane.
inline __m256 widen_bf16(const uint16_t* w) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

// Rows are taken four at a time (kRowGroup): with two accumulators each they fill 16 registers with
// the weights. More rows are another call over the same weights, by then in L1. So a row's sums are
// the same whatever rows it is computed with, and a sequence's tokens do not depend on its batch.
constexpr int kRowGroup = 4;

// out[m] = w . x[m] for bf16 w and fp32 x, 16 weights a step: each multiply-add waits for the one
// before it on the same accumulator (4 cycles), so each row has two, one per 8-weight piece.
template <int M>
void dot_bf16(const uint16_t* w, const float* x, int64_t x_stride, int64_t len, float* out) {
  if constexpr (M > kRowGroup) {
    dot_bf16<kRowGroup>(w, x, x_stride, len, out);
    dot_bf16<M - kRowGroup>(w, x + kRowGroup * x_stride, x_stride, len, out + kRowGroup);
  } else {
    __m256 acc[M][2];
    FOR_EACH_ROW(m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= len; k += 16) {
      if (k % 32 == 0) prefetch_ahead(w + k);  // a cache line every other step
      const __m256 w0 = widen_bf16(w + k), w1 = widen_bf16(w + k + 8);
      FOR_EACH_ROW(m) {
        acc[m][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * x_stride + k), acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * x_stride + k + 8), acc[m][1]);
      }
    }
    FOR_EACH_ROW(m) {
      float sum = reduce_add(_mm256_add_ps(acc[m][0], acc[m][1]));
      for (int64_t t = k; t < len; t++) sum += portable::bf16_to_float(w[t]) * x[m * x_stride + t];
      out[m] = sum;
    }
  }
}

// out[m] = w . x[m] for fp32 w and fp32 x, as dot_bf16 without the widening.
template <int M>
void dot_f32(const float* w, const float* x, int64_t x_stride, int64_t len, float* out) {
  if constexpr (M > kRowGroup) {
    dot_f32<kRowGroup>(w, x, x_stride, len, out);
    dot_f32<M - kRowGroup>(w, x + kRowGroup * x_stride, x_stride, len, out + kRowGroup);
  } else {
    __m256 acc[M][2];
    FOR_EACH_ROW(m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= len; k += 16) {
      prefetch_ahead(w + k);  // 64 bytes a step: a cache line
      const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + k + 8);
      FOR_EACH_ROW(m) {
        acc[m][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * x_stride + k), acc[m][0]);
        acc[m][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * x_stride + k + 8), acc[m][1]);
      }
    }
    FOR_EACH_ROW(m) {
      float sum = reduce_add(_mm256_add_ps(acc[m][0], acc[m][1]));
      for (int64_t t = k; t < len; t++) sum += w[t] * x[m * x_stride + t];
      out[m] = sum;
    }
  }
}

// int8 w, int16 x: 16 weights widened to int16, pairs multiplied and added into int32 (vpmaddwd);
// each group's integer sum is then scaled in fp32. Needs group % 16 == 0.
constexpr int64_t kQ8Step = 16;

template <int M>
void dot_q8(const int8_t* w, const int16_t* x, int64_t x_stride, const float* scale, int64_t len, int64_t group,
            float* out) {
  __m256 total[M];
  FOR_EACH_ROW(m) total[m] = _mm256_setzero_ps();
  for (int64_t k = 0, g = 0; k < len; k += group, g++) {  // g: the group (no division per group)
    prefetch_ahead(w + k);
    __m256i acc[M];
    FOR_EACH_ROW(m) acc[m] = _mm256_setzero_si256();
    for (int64_t i = k; i < k + group; i += kQ8Step) {
      const __m256i wi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i)));
      FOR_EACH_ROW(m)
        acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(
            wi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * x_stride + i))));
    }
    const __m256 s = _mm256_set1_ps(scale[g]);
    FOR_EACH_ROW(m) total[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]), s, total[m]);
  }
  FOR_EACH_ROW(m) out[m] = reduce_add(total[m]);
}

// int4 w (portable::dot_q4's blocks), int16 x. A block's 16 bytes widened to 16 int16 lanes hold its
// weights 0-15 in their low nibbles and 16-31 in their high ones: two vpmaddwd with x's two halves of
// the block (vpdpwssd where the CPU has AVX-VNNI) give its integer dot product in 8 int32 lanes, scaled
// once in fp32. Blocks' offsets (Q4_0: -8 scale) multiply their sums of x, a row at a time.

inline __m256i dot_int16(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

// One block (weights k..k+31, scale s) into acc.
template <int M>
inline void q4_block(const uint8_t* w, const int16_t* x, int64_t x_stride, int64_t k, float s, __m256 (&acc)[M]) {
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k / 2)));
  const __m256i lo = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F)), hi = _mm256_srli_epi16(bytes, 4);
  const __m256 sv = _mm256_set1_ps(s);
  FOR_EACH_ROW(m) {
    const __m256i* xm = reinterpret_cast<const __m256i*>(x + m * x_stride + k);
    const __m256i dot = dot_int16(_mm256_madd_epi16(lo, _mm256_loadu_si256(xm)), hi, _mm256_loadu_si256(xm + 1));
    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sv, acc[m]);
  }
}

// Odd blocks go to a second accumulator (each multiply-add waits for the one before it on the same
// accumulator), rows kRowGroup at a time as in dot_bf16.
template <int M, bool Offsets>
void dot_q4(const uint8_t* w, const int16_t* x, int64_t x_stride, const float* x_sums, int64_t sums_stride,
            const uint16_t* scale, const uint16_t* offset, int64_t len, float* out) {
  if constexpr (M > kRowGroup) {
    dot_q4<kRowGroup, Offsets>(w, x, x_stride, x_sums, sums_stride, scale, offset, len, out);
    dot_q4<M - kRowGroup, Offsets>(w, x + kRowGroup * x_stride, x_stride, x_sums + kRowGroup * sums_stride,
                                   sums_stride, scale, offset, len, out + kRowGroup);
  } else {
    __m256 acc0[M], acc1[M];
    float shift[M] = {};  // sum over blocks of offset * (the block's sum of x)
    FOR_EACH_ROW(m) acc0[m] = acc1[m] = _mm256_setzero_ps();
    const int64_t blocks = len / portable::kQ4Block;
    for (int64_t b = 0; b < blocks; b++) {
      const int64_t k = b * portable::kQ4Block;
      if (b % 4 == 0) prefetch_ahead(w + k / 2);  // one cache line: 4 blocks
      if (b % 32 == 0) {  // a cache line of fp16 values
        prefetch_block_values(scale + b);
        if (Offsets) prefetch_block_values(offset + b);
      }
      const float s = _cvtsh_ss(scale[b]), o = Offsets ? _cvtsh_ss(offset[b]) : -8.f * s;
      if (b % 2) q4_block<M>(w, x, x_stride, k, s, acc1);
      else q4_block<M>(w, x, x_stride, k, s, acc0);
      FOR_EACH_ROW(m) shift[m] += o * x_sums[m * sums_stride + b];
    }
    FOR_EACH_ROW(m) out[m] = reduce_add(_mm256_add_ps(acc0[m], acc1[m])) + shift[m];
  }
}

}  // namespace avx2
