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

// The sums of the 16 lanes of each of N <= 8 vectors, in lanes 0..N-1 of the result: lanes i and i + 8
// added, then i and i + 4, i and i + 2, i and i + 1 (_mm512_reduce_add_ps's order), for all N at once: each
// stage packs two vectors' halves into one register, so 8 take 25 instructions instead of 8 reductions of 8.
// A vector's additions are the same whatever vectors it is reduced with (missing ones are zeros beside it).
template <int N>
inline __m512 reduce_rows(const __m512 (&v)[N]) {
  static_assert(N <= 8);
  const __m512 zero = _mm512_setzero_ps();
  __m512 half[4], quarter[2];  // half[p]: vectors 2p, 2p + 1 in 8 lanes each; quarter[q]: 4q..4q+3 in 4 each
  _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++) {
    const __m512 a = 2 * p < N ? v[2 * p] : zero, b = 2 * p + 1 < N ? v[2 * p + 1] : zero;
    half[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  _Pragma("GCC unroll 2") for (int q = 0; q < 2; q++)
    quarter[q] = _mm512_add_ps(_mm512_shuffle_f32x4(half[2 * q], half[2 * q + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(half[2 * q], half[2 * q + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  // 128-bit chunk c: lanes 0, 1 of quarter[0]'s vector c, then of quarter[1]'s (vector 4 + c)
  const __m512 pairs = _mm512_add_ps(_mm512_shuffle_ps(quarter[0], quarter[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_ps(quarter[0], quarter[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(pairs, pairs, _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(pairs, pairs, _MM_SHUFFLE(3, 1, 3, 1)));
  // chunk c holds vector c in lane 4c and vector 4 + c in lane 4c + 1
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), sums);
}

// int8 w with int16 x as dot_q8, four groups at a time (kQ8Quad), one to each 128-bit chunk of a register: the
// four groups' weights, widened once for all M rows, are moved chunk by chunk (a 4 x 4 transpose of 128-bit
// chunks) so that chunk c of vector v holds weights 8v..8v+7 of group c. Then a row's four groups sum in one
// register, and their scales apply in one conversion and one multiply-add instead of four: those were most of
// a row's work with groups of 32 (the default model's Q8_0 head), 4 instructions for each vpmaddwd. vpdpwssd
// where the CPU has AVX-512 VNNI. The groups after the last whole quad go one at a time, as in dot_q8.
//
// x as matvec.cpp's round_to_int16_quads lays it out, in units of a quad of one row, the rows of a unit side by
// side (a row at a fixed offset: one pointer for all M rows): per quad, its 4 groups' values in vectors of 32,
// chunk c of vector v = values 8v..8v+7 of group c; then the values after the quads, a row after the other. Group:
// a multiple of 32, known when compiled (G) or not (G = 0: `group`).
constexpr int64_t kQ8Quad = 4;
constexpr int64_t kL1Bytes = 44 * 1024;  // of the 48 KB L1 data caches of Zen 4, Zen 5 and Sapphire Rapids

inline __m512i dot_i16(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

template <int M, int G>
void dot_q8_quads(const int8_t* w, const int16_t* x, const float* scale, int64_t len, int64_t group, float* out) {
  if constexpr (G > 0) group = G;
  __m512 total[M];
  FOR_EACH_ROW(m) total[m] = _mm512_setzero_ps();
  const __m512i chunk_scales = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const int64_t quad = kQ8Quad * group, quads = len / quad;
  // Between two reads of a line of x pass x itself, the piece of a weight row and the weights prefetched ahead:
  // where that fills L1, weights asked for into L1 pushed x out (2 rows of K = 8192: 48 KB, 1.26x slower than
  // into L2); where it does not (8 rows of K = 2048: 42 KB), into L2 was up to 1.3x slower.
  const bool x_fills_l1 = M * len * int64_t{sizeof(int16_t)} + len + kPrefetchBytes > kL1Bytes;
  for (int64_t q = 0; q < quads; q++) {
    const int8_t* wq = w + q * quad;
    const int16_t* xq = x + q * M * quad;
    for (int64_t k = 0; k < quad; k += 64) {
      if (x_fills_l1) prefetch_ahead_l2(wq + k);
      else prefetch_ahead(wq + k);
    }
    // A row's products go to C accumulators (each vpdpwssd waits for the one before it on its own): 8 chains
    // in all where the rows allow, as in dot_q4_x8. Integer sums: exact in any order.
    constexpr int C = M >= 8 ? 1 : M >= 4 ? 2 : 4;
    __m512i acc[M][C];
    FOR_EACH_ROW(m) for (int c = 0; c < C; c++) acc[m][c] = _mm512_setzero_si512();
    for (int64_t j = 0; j < group; j += 32) {  // weights j..j+31 of each of the four groups
      __m512i g[kQ8Quad];
      for (int c = 0; c < kQ8Quad; c++)
        g[c] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + c * group + j)));
      const __m512i lo01 = _mm512_shuffle_i64x2(g[0], g[1], _MM_SHUFFLE(1, 0, 1, 0));
      const __m512i hi01 = _mm512_shuffle_i64x2(g[0], g[1], _MM_SHUFFLE(3, 2, 3, 2));
      const __m512i lo23 = _mm512_shuffle_i64x2(g[2], g[3], _MM_SHUFFLE(1, 0, 1, 0));
      const __m512i hi23 = _mm512_shuffle_i64x2(g[2], g[3], _MM_SHUFFLE(3, 2, 3, 2));
      const __m512i v[4] = {_mm512_shuffle_i64x2(lo01, lo23, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i64x2(lo01, lo23, _MM_SHUFFLE(3, 1, 3, 1)),
                            _mm512_shuffle_i64x2(hi01, hi23, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i64x2(hi01, hi23, _MM_SHUFFLE(3, 1, 3, 1))};
      FOR_EACH_ROW(m) {
        const int16_t* xm = xq + m * quad + 4 * j;  // vectors 4 (j / 32) + t of the row's quad
        for (int t = 0; t < 4; t++) acc[m][t % C] = dot_i16(acc[m][t % C], v[t], _mm512_loadu_si512(xm + 32 * t));
      }
    }
    const __m512 s = _mm512_permutexvar_ps(chunk_scales, _mm512_castps128_ps512(_mm_loadu_ps(scale + q * kQ8Quad)));
    FOR_EACH_ROW(m) {
      for (int c = 1; c < C; c++) acc[m][0] = _mm512_add_epi32(acc[m][0], acc[m][c]);  // integers: any order
      total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][0]), s, total[m]);
    }
  }
  const int64_t rest = len - quads * quad;  // whole groups, a row's after the other's
  x += quads * M * quad;
  for (int64_t k = quads * quad, g = quads * kQ8Quad; k < len; k += group, g++) {
    prefetch_ahead(w + k);
    __m512i acc[M];
    FOR_EACH_ROW(m) acc[m] = _mm512_setzero_si512();
    for (int64_t i = 0; i < group; i += kQ8Step) {
      const __m512i wi = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k + i)));
      FOR_EACH_ROW(m) acc[m] = dot_i16(acc[m], wi, _mm512_loadu_si512(x + m * rest + i));
    }
    x += group;
    const __m512 s = _mm512_set1_ps(scale[g]);
    FOR_EACH_ROW(m) total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m]), s, total[m]);
  }
  if constexpr (M == 1) {
    out[0] = _mm512_reduce_add_ps(total[0]);  // reduce_rows' order, in fewer instructions for one
  } else {
    alignas(64) float sums[16];  // each sum stored alone: the caller reads them one by one (dot_q4_x8)
    _mm512_store_ps(sums, reduce_rows<M>(total));
    FOR_EACH_ROW(m) out[m] = sums[m];
  }
}

// int4 w with x rounded to int8 per block of 32 (its own scale each, as llama.cpp's Q8 activations). A block's
// 16 bytes hold its weights 0-15 in the low nibbles and 16-31 in the high ones (portable::dot_q4).
//
// Groups of 16 blocks, one to each of the 16 int32 lanes: the group's 256 bytes are loaded once and turned
// (dwords (block, d) -> (d, block)) into 8 vectors whose lane j holds 4 weights of block j, weights 4s..4s+3
// in vector s. An unsigned nibble times a signed x byte, four to a lane (vpdpbusd): 8 of them per row of x
// give the group's 16 integer dot products in one register, exact; then per row one conversion and two
// multiply-adds: by the weight scale times the x scale, and the offset times the block's sum of x. So the
// unpacking is shared by all M rows, and a row's float work is 4 instructions per 16 blocks. Blocks past the
// last whole group (the default model's K = 576 is 18 blocks: 2 of them) go four at a time, block t of a step
// in lanes 4t..4t+3 (its weights 0-15, then 16-31).
//
// Each vpdpbusd reads its x from L1, and 64-byte loads (2 a cycle) were what bounded the loop, so two weight
// rows (R = 2) are taken at a time where the caller has them: each load of x then feeds two vpdpbusd. Rows of
// x then go 4 at a time (kQ4PassRows), more rows unpacking the weights again, so that the accumulators of
// both weight rows stay in registers. A row's arithmetic is the same in any of these ways.
// Without AVX-512 VNNI: vpmaddubsw into int16 pairs (at most 2 * 15 * 127 a pair, 8 of them summed at most
// 30480: no saturation), + vpmaddwd by ones.
//
// x as matvec.cpp's round_to_int8_blocks lays it out for this kernel, in units of a group (or a step) of one
// row, the rows of a unit side by side (so a row's data is at a fixed offset from the unit's: one pointer
// for all M rows): per group, 8 slots of 64 bytes (slot s, lane j: x[32j + 4s..4s+3] of the group), its 16
// x scales and its 16 blocks' sums of x as rounded (scale times the sum of the int8s); per step, the first
// 16 values of its blocks, then the second 16 (128 bytes), and each block's scale four times; after the
// steps, the blocks' sums (16 a row, zeros past the last block).
constexpr int64_t kQ4Lanes = 16;  // blocks a group
constexpr int64_t kQ4Group = kQ4Lanes * portable::kQ4Block;  // values of x a group
constexpr int64_t kQ4StepBlocks = 4;  // blocks a step past the groups
constexpr int kQ4PassRows = 4;  // rows of x at a time with two weight rows
// Weight rows a call takes for M rows of x: two, where their rows of x fit in one pass. With 8 rows, two passes
// over two weight rows were slower than one over one (a row of 576 weights: 125 cycles against 108).
template <int M>
constexpr int kQ4WeightRows = M <= kQ4PassRows ? 2 : 1;

// The block in lane l of a group (x's layout follows it): block l.
constexpr int64_t q4_lane_block(int64_t lane) { return lane; }

inline __m512i dot_u8_s8(__m512i acc, __m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else  // int16 pairs, widened where the sum is taken (q4_sum)
  return _mm512_add_epi16(acc, _mm512_maddubs_epi16(u, s));
#endif
}

inline __m512i add_parts(__m512i a, __m512i b) {  // two of dot_u8_s8's accumulators
#if defined(__AVX512VNNI__)
  return _mm512_add_epi32(a, b);
#else
  return _mm512_add_epi16(a, b);
#endif
}

inline __m512i q4_sum(__m512i acc) {
#if defined(__AVX512VNNI__)
  return acc;
#else
  return _mm512_madd_epi16(acc, _mm512_set1_epi16(1));
#endif
}

// out[r * Rows + First + m] = w_r . x[First + m] for R = 1 or 2 weight rows (w_r at w + r * w_stride, their
// scales and offsets at scale, offset + r * s_stride), `len` int4 weights each (a multiple of 32: whole
// groups, and in the last piece of a row the blocks after them), and M rows of x of the Rows laid out as above
// from x, x_scales and x_sums on.
template <int M, int R, bool Offsets, int Rows = M, int First = 0>
void dot_q4_x8(const uint8_t* w, int64_t w_stride, const int8_t* x, const float* x_scales, const float* x_sums,
               const uint16_t* scale, const uint16_t* offset, int64_t s_stride, int64_t len, float* out) {
  static_assert(R == 1 || R == 2);
  if constexpr (R == 2 && M > kQ4PassRows) {
    dot_q4_x8<kQ4PassRows, R, Offsets, Rows, First>(w, w_stride, x, x_scales, x_sums, scale, offset, s_stride, len,
                                                    out);
    dot_q4_x8<M - kQ4PassRows, R, Offsets, Rows, First + kQ4PassRows>(w, w_stride, x, x_scales, x_sums, scale, offset,
                                                                      s_stride, len, out);
  } else {
    __m512 acc[R * M];  // acc[r * M + m]
    _Pragma("GCC unroll 16") for (int a = 0; a < R * M; a++) acc[a] = _mm512_setzero_ps();
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    // Lanes of two loads (4 blocks of 4 dwords each) to one vector: blocks 0-7, dwords 0, 1 (even) or 2, 3 (odd).
    const __m512i even_dwords = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
    const __m512i odd_dwords = _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31);
    // Accumulators of the integer products a (weight row, row of x): 8 chains in all (each vpdpbusd waits
    // for the one before it on its accumulator, 4-5 cycles). Integer sums: exact in any order.
    constexpr int C = R * M >= 8 ? 1 : 8 / (R * M);
    const int64_t blocks = len / portable::kQ4Block, groups = blocks / kQ4Lanes;
    for (int64_t g = 0; g < groups; g++) {
      const int64_t b = g * kQ4Lanes;
      __m512i dwords[R][4];  // dwords[r][d] lane j: dword d of block j (weights 4d..4d+3 and 16+4d..)
      __m512 s[R], o[R];
      _Pragma("GCC unroll 2") for (int r = 0; r < R; r++) {
        const uint8_t* wg = w + r * w_stride + g * kQ4Group / 2;  // 256 bytes: 4 cache lines
        for (int c = 0; c < 4; c++) prefetch_ahead(wg + 64 * c);
        const uint16_t* sr = scale + r * s_stride + b;
        const uint16_t* orow = Offsets ? offset + r * s_stride + b : nullptr;
        if (g % 2 == 0) {  // one cache line of fp16 values each
          prefetch_block_values(sr);
          if (Offsets) prefetch_block_values(orow);
        }
        __m512i lines[4];
        for (int c = 0; c < 4; c++) lines[c] = _mm512_loadu_si512(wg + 64 * c);  // blocks 4c..4c+3
        // (block, d) -> (d, block): two permutes to 8 blocks' dwords 0-1 or 2-3, then their 256-bit halves
        const __m512i lo01 = _mm512_permutex2var_epi32(lines[0], even_dwords, lines[1]);
        const __m512i lo23 = _mm512_permutex2var_epi32(lines[0], odd_dwords, lines[1]);
        const __m512i hi01 = _mm512_permutex2var_epi32(lines[2], even_dwords, lines[3]);
        const __m512i hi23 = _mm512_permutex2var_epi32(lines[2], odd_dwords, lines[3]);
        dwords[r][0] = _mm512_shuffle_i64x2(lo01, hi01, _MM_SHUFFLE(1, 0, 1, 0));
        dwords[r][1] = _mm512_shuffle_i64x2(lo01, hi01, _MM_SHUFFLE(3, 2, 3, 2));
        dwords[r][2] = _mm512_shuffle_i64x2(lo23, hi23, _MM_SHUFFLE(1, 0, 1, 0));
        dwords[r][3] = _mm512_shuffle_i64x2(lo23, hi23, _MM_SHUFFLE(3, 2, 3, 2));
        s[r] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sr)));
        o[r] = Offsets ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(orow)))
                       : _mm512_mul_ps(_mm512_set1_ps(-8.f), s[r]);
      }
      const int8_t* xg = x + (g * Rows + First) * kQ4Group;
      __m512i part[R * M][C];
      _Pragma("GCC unroll 16") for (int a = 0; a < R * M; a++)
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) part[a][c] = _mm512_setzero_si512();
      _Pragma("GCC unroll 8") for (int slot = 0; slot < 8; slot++) {
        __m512i q[R];  // lane j: weights 4 slot..4 slot + 3 of block j
        _Pragma("GCC unroll 2") for (int r = 0; r < R; r++)
          q[r] = _mm512_and_si512(slot < 4 ? dwords[r][slot] : _mm512_srli_epi16(dwords[r][slot - 4], 4), nibble);
        FOR_EACH_ROW(m) {
          const __m512i xs = _mm512_loadu_si512(xg + m * kQ4Group + 64 * slot);
          _Pragma("GCC unroll 2") for (int r = 0; r < R; r++)
            part[r * M + m][slot % C] = dot_u8_s8(part[r * M + m][slot % C], q[r], xs);
        }
      }
      const float *sg = x_scales + (g * Rows + First) * kQ4Lanes, *tg = x_sums + (g * Rows + First) * kQ4Lanes;
      FOR_EACH_ROW(m) {
        const __m512 xs = _mm512_loadu_ps(sg + m * kQ4Lanes), sums = _mm512_loadu_ps(tg + m * kQ4Lanes);
        _Pragma("GCC unroll 2") for (int r = 0; r < R; r++) {
          __m512i* p = part[r * M + m];
          _Pragma("GCC unroll 8") for (int c = 1; c < C; c++) p[0] = add_parts(p[0], p[c]);
          __m512& a = acc[r * M + m];
          a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q4_sum(p[0])), _mm512_mul_ps(s[r], xs), a);
          a = _mm512_fmadd_ps(o[r], sums, a);
        }
      }
    }
    const int64_t first = groups * kQ4Lanes;  // the blocks after the groups, four a step
    if (first < blocks) {
      const __m512i quads = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
      const int8_t* xt = x + groups * Rows * kQ4Group + First * 2 * 64;
      const float* st = x_scales + (groups * Rows + First) * kQ4Lanes;
      for (int64_t b = first; b < blocks; b += kQ4StepBlocks) {
        const int64_t n = std::min<int64_t>(kQ4StepBlocks, blocks - b);
        const __mmask64 whole = n == kQ4StepBlocks ? ~__mmask64{0} : (__mmask64{1} << (16 * n)) - 1;
        __m512i q[R][2];
        __m512 s[R];
        _Pragma("GCC unroll 2") for (int r = 0; r < R; r++) {
          const __m512i bytes = _mm512_maskz_loadu_epi8(whole, w + r * w_stride + b * portable::kQ4Block / 2);
          q[r][0] = _mm512_and_si512(bytes, nibble);
          q[r][1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
          s[r] = _mm512_permutexvar_ps(quads, _mm512_castps128_ps512(_mm_cvtph_ps(
              _mm_maskz_loadu_epi16(static_cast<__mmask8>((1u << n) - 1), scale + r * s_stride + b))));
        }
        FOR_EACH_ROW(m) {
          const __m512i x0 = _mm512_loadu_si512(xt + m * 2 * 64), x1 = _mm512_loadu_si512(xt + m * 2 * 64 + 64);
          const __m512 xs = _mm512_loadu_ps(st + m * kQ4Lanes);
          _Pragma("GCC unroll 2") for (int r = 0; r < R; r++) {
            const __m512i dot = q4_sum(dot_u8_s8(dot_u8_s8(_mm512_setzero_si512(), q[r][0], x0), q[r][1], x1));
            __m512& a = acc[r * M + m];
            a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s[r], xs), a);
          }
        }
        xt += Rows * 2 * 64;
        st += Rows * kQ4Lanes;
      }
      const __mmask16 lanes = static_cast<__mmask16>((1u << (blocks - first)) - 1);  // fewer than 16
      __m512 o[R];
      _Pragma("GCC unroll 2") for (int r = 0; r < R; r++) {
        const __m512 s = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, scale + r * s_stride + first));
        o[r] = Offsets ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, offset + r * s_stride + first))
                       : _mm512_mul_ps(_mm512_set1_ps(-8.f), s);
      }
      const float* tail_sums = x_sums + (groups * Rows + First) * kQ4Lanes;
      FOR_EACH_ROW(m) {
        const __m512 sums = _mm512_loadu_ps(tail_sums + m * kQ4Lanes);
        _Pragma("GCC unroll 2") for (int r = 0; r < R; r++)
          acc[r * M + m] = _mm512_fmadd_ps(o[r], sums, acc[r * M + m]);
      }
    }
    // Each sum stored alone: the caller reads them one by one, and a wide (or masked) store is not forwarded
    // to narrower loads (they waited for it to reach the cache: 4% of a one-row call)
    static_assert(R * M <= 8);  // two weight rows take 4 rows of x at a time
    alignas(64) float sums[16];
    _mm512_store_ps(sums, reduce_rows<R * M>(acc));
    _Pragma("GCC unroll 2") for (int r = 0; r < R; r++) FOR_EACH_ROW(m) out[r * Rows + First + m] = sums[r * M + m];
  }
}

}  // namespace avx512
