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

// The sums of the 8 lanes of each of M <= 4 vectors, out[m] = v[m]'s: lanes i and i + 4 added, then i and
// i + 2, i and i + 1 (reduce_add's order), for the rows at once (avx512::reduce_rows). A row's additions are
// the same whatever rows it is reduced with (missing rows are zeros beside it).
template <int M>
inline void reduce_rows(const __m256 (&v)[M], float* out) {
  static_assert(M <= kRowGroup);
  const __m256 zero = _mm256_setzero_ps();
  __m256 half[2];  // half[p]: rows 2p, 2p + 1 in 4 lanes each
  _Pragma("GCC unroll 2") for (int p = 0; p < 2; p++) {
    const __m256 a = 2 * p < M ? v[2 * p] : zero, b = 2 * p + 1 < M ? v[2 * p + 1] : zero;
    half[p] = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
  // 128-bit half h: lanes 0, 1 of row h, then of row 2 + h
  const __m256 pairs = _mm256_add_ps(_mm256_shuffle_ps(half[0], half[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(half[0], half[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(pairs, pairs, _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm256_shuffle_ps(pairs, pairs, _MM_SHUFFLE(3, 1, 3, 1)));
  // half h holds row h in lane 4h and row 2 + h in lane 4h + 1
  const __m128 rows = _mm256_castps256_ps128(_mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0)));
  alignas(16) float all[4];  // each sum stored alone, as avx512::dot_q4_x8 does (the caller reads them one by one)
  _mm_store_ps(all, rows);
  FOR_EACH_ROW(m) out[m] = all[m];
}

// int4 w with x rounded to int8 per block of 32, as avx512::dot_q4_x8 (see there) with 8 lanes: groups of 8
// blocks, whose 128 bytes are turned into 8 vectors of 4 weights of each block a lane (vpunpck*, within
// 128-bit halves: the even blocks in the low half, the odd ones in the high half; x is laid out to match);
// per row of x 8 vpmaddubsw summed in int16 (at most 8 * 2 * 15 * 127 = 30480: no saturation) and one
// vpmaddwd by ones (vpdpbusd where the CPU has AVX-VNNI) give the group's 8 integer dot products, then one
// conversion and two multiply-adds (weight scale times x scale, offset times the block's sum of x). The blocks
// after the last whole group go two a step, block t in lanes 4t..4t+3. x's layout is avx512::dot_q4_x8's with
// 8 lanes: per group 8 slots of 32 bytes, 8 scales (in the lanes' order) and 8 sums (in the blocks' order);
// per step 64 bytes and 8 scales; then the sums after the groups, 8 a row. Rows kRowGroup at a time: the 8
// weight vectors and 4 rows' accumulators fill the 16 registers; more rows unpack the weights again, from L1
// (Rows: the rows side by side in x, First: the first of them this call takes).
constexpr int64_t kQ4Lanes = 8;  // blocks a group
constexpr int64_t kQ4Group = kQ4Lanes * portable::kQ4Block;  // values of x a group
constexpr int64_t kQ4StepBlocks = 2;  // blocks a step past the groups

// The block in lane l of a group (x's layout follows it).
constexpr int64_t q4_lane_block(int64_t lane) { return lane < 4 ? 2 * lane : 2 * (lane - 4) + 1; }

// The integer dot products of N nibble vectors w[s] with x's slots x + 32 s, summed per int32 lane.
template <int N>
inline __m256i q4_dot(const __m256i (&w)[N], const int8_t* x) {
  auto slot = [&](int s) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * s)); };
#if defined(__AVXVNNI__)
  __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();  // two chains: each waits on the last
  for (int s = 0; s < N; s += 2) {
    even = _mm256_dpbusd_avx_epi32(even, w[s], slot(s));
    odd = _mm256_dpbusd_avx_epi32(odd, w[s + 1], slot(s + 1));
  }
  return _mm256_add_epi32(even, odd);
#else
  __m256i pairs = _mm256_maddubs_epi16(w[0], slot(0));
  for (int s = 1; s < N; s++) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[s], slot(s)));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

template <int M>
constexpr int kQ4WeightRows = 1;  // weight rows a call takes for M rows of x (avx512::dot_q4_x8 takes two)

// out[r * Rows + First + m] = w_r . x[First + m] for `len` int4 weights and M rows of x: avx512::dot_q4_x8's
// arguments.
template <int M, int R, bool Offsets, int Rows = M, int First = 0>
void dot_q4_x8(const uint8_t* w, int64_t w_stride, const int8_t* x, const float* x_scales, const float* x_sums,
               const uint16_t* scale, const uint16_t* offset, int64_t s_stride, int64_t len, float* out) {
  if constexpr (R > 1) {
    for (int r = 0; r < R; r++)
      dot_q4_x8<M, 1, Offsets, Rows, First>(w + r * w_stride, w_stride, x, x_scales, x_sums, scale + r * s_stride,
                                            Offsets ? offset + r * s_stride : nullptr, s_stride, len, out + r * Rows);
  } else if constexpr (M > kRowGroup) {
    dot_q4_x8<kRowGroup, 1, Offsets, Rows, First>(w, w_stride, x, x_scales, x_sums, scale, offset, s_stride, len, out);
    dot_q4_x8<M - kRowGroup, 1, Offsets, Rows, First + kRowGroup>(w, w_stride, x, x_scales, x_sums, scale, offset,
                                                                  s_stride, len, out);
  } else {
    __m256 acc[M];
    FOR_EACH_ROW(m) acc[m] = _mm256_setzero_ps();
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i lane_blocks = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);  // q4_lane_block
    const int64_t blocks = len / portable::kQ4Block, groups = blocks / kQ4Lanes;
    for (int64_t g = 0; g < groups; g++) {
      const uint8_t* wg = w + g * kQ4Group / 2;  // 128 bytes: 2 cache lines
      const int64_t b = g * kQ4Lanes;
      prefetch_ahead(wg);
      prefetch_ahead(wg + 64);
      if (g % 4 == 0) {  // one cache line of fp16 values each
        prefetch_block_values(scale + b);
        if (Offsets) prefetch_block_values(offset + b);
      }
      __m256i lines[4];  // blocks 2c (low half) and 2c + 1 (high half)
      for (int c = 0; c < 4; c++) lines[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 32 * c));
      // dwords (block, d) -> (d, block) in each half: a 4 x 4 transpose
      const __m256i d01a = _mm256_unpacklo_epi32(lines[0], lines[1]), d23a = _mm256_unpackhi_epi32(lines[0], lines[1]);
      const __m256i d01b = _mm256_unpacklo_epi32(lines[2], lines[3]), d23b = _mm256_unpackhi_epi32(lines[2], lines[3]);
      const __m256i dwords[4] = {_mm256_unpacklo_epi64(d01a, d01b), _mm256_unpackhi_epi64(d01a, d01b),
                                 _mm256_unpacklo_epi64(d23a, d23b), _mm256_unpackhi_epi64(d23a, d23b)};
      __m256i q[8];  // q[s] lane l: weights 4s..4s+3 of block q4_lane_block(l)
      for (int d = 0; d < 4; d++) {
        q[d] = _mm256_and_si256(dwords[d], nibble);
        q[d + 4] = _mm256_and_si256(_mm256_srli_epi16(dwords[d], 4), nibble);
      }
      // the blocks' scales in their order, and in the lanes' order
      const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + b)));
      const __m256 o = Offsets ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(offset + b)))
                               : _mm256_mul_ps(_mm256_set1_ps(-8.f), s);
      const __m256 s_lanes = _mm256_permutevar8x32_ps(s, lane_blocks);
      const int8_t* xg = x + (g * Rows + First) * kQ4Group;
      const float *sg = x_scales + (g * Rows + First) * kQ4Lanes, *tg = x_sums + (g * Rows + First) * kQ4Lanes;
      FOR_EACH_ROW(m) {
        const __m256i dot = q4_dot<8>(q, xg + m * kQ4Group);
        const __m256 both = _mm256_mul_ps(s_lanes, _mm256_loadu_ps(sg + m * kQ4Lanes));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), both, acc[m]);
        // the offsets' share in the blocks' own order: each lane's terms are added in the end all the same
        acc[m] = _mm256_fmadd_ps(o, _mm256_loadu_ps(tg + m * kQ4Lanes), acc[m]);
      }
    }
    const int64_t first = groups * kQ4Lanes;  // the blocks after the groups, two a step
    if (first < blocks) {
      const int8_t* xt = x + groups * Rows * kQ4Group + First * 2 * 32;
      const float* st = x_scales + (groups * Rows + First) * kQ4Lanes;
      for (int64_t b = first; b < blocks; b += kQ4StepBlocks) {
        const bool two = blocks - b >= 2;
        const uint8_t* wb = w + b * portable::kQ4Block / 2;
        const __m256i bytes = two ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb))
                                  : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb)));
        const __m256 s = _mm256_set_m128(_mm_set1_ps(two ? _cvtsh_ss(scale[b + 1]) : 0.f),
                                         _mm_set1_ps(_cvtsh_ss(scale[b])));
        const __m256i q[2] = {_mm256_and_si256(bytes, nibble),
                              _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble)};
        FOR_EACH_ROW(m) {
          const __m256i dot = q4_dot<2>(q, xt + m * 2 * 32);
          const __m256 both = _mm256_mul_ps(s, _mm256_loadu_ps(st + m * kQ4Lanes));
          acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), both, acc[m]);
        }
        xt += Rows * 2 * 32;
        st += Rows * kQ4Lanes;
      }
      const int64_t n = blocks - first;  // fewer than 8
      alignas(16) uint16_t tail_scale[8] = {}, tail_offset[8] = {};
      for (int64_t t = 0; t < n; t++) {
        tail_scale[t] = scale[first + t];
        if (Offsets) tail_offset[t] = offset[first + t];
      }
      const __m256 s = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(tail_scale)));
      const __m256 o = Offsets ? _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(tail_offset)))
                               : _mm256_mul_ps(_mm256_set1_ps(-8.f), s);
      const float* tail_sums = x_sums + (groups * Rows + First) * kQ4Lanes;
      FOR_EACH_ROW(m) acc[m] = _mm256_fmadd_ps(o, _mm256_loadu_ps(tail_sums + m * kQ4Lanes), acc[m]);
    }
    reduce_rows<M>(acc, out + First);
  }
}

}  // namespace avx2
