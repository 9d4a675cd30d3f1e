// Weight matrices kept in llama.cpp's own blocks, as a GGUF file holds them: the K-quants (Q2_K, Q3_K,
// Q4_K, Q5_K, Q6_K: 256 weights a block) and Q5_0 / Q5_1 (32), what llama-quantize's Q4_K_M, Q5_K_M,
// Q6_K, Q3_K_M and Q2_K presets write. A matrix is uint8 (N, K / block, bytes): its rows' blocks as the
// file has them, so nothing is widened or quantized again; the block's size in bytes names its type
// (kFormats). model/blocks.py is the Python side.
//
// Every type is read through one form: a block unpacks to unsigned integers q, and per group of 16
// weights a scale a, a zero z (one per type) and a minimum m, so that weight = a (q - z) - m:
//   Q4_K, Q5_K: a = d sc, m = dmin min per 32 (6-bit sc and min), q 4 or 5 bits, z = 0
//   Q6_K:       a = d sc per 16 (int8 sc), q 6 bits, z = 32
//   Q3_K:       a = d (sc - 32) per 16 (6-bit sc), q 3 bits (the high bit set means +4), z = 4
//   Q2_K:       a = d sc, m = dmin min per 16 (4 bits each), q 2 bits
//   Q5_0:       a = d, q 5 bits, z = 16;  Q5_1: a = d, m = -min, q 5 bits
// dequantize() computes each weight in fp32 in the order the gguf library does (it is tested bit for bit
// against it; the build has -ffp-contract=off). dot_blocks() multiplies blocks by rows of x rounded to int8
// (one fp32 scale per 256 values, as llama.cpp's Q8_K, where K is whole blocks of 256; else per 32), an integer
// dot product per group of 16:
//   sum_j w_j x_j = sum_groups xs (a sum_j q_j xq_j - (a z + m) sum_j xq_j)
// so each weight is read once, as the file has it, for all rows of x. Every format has a loop of its own on AVX2
// (and AVX-512) CPUs that unpacks in registers and keeps the sums of a block in int32, the scales multiplied in as
// integers, as llama.cpp's do (Q2_K and Q3_K: 3-4x the generic loop's speed); the generic loop (dot_any), which
// unpacks a block into Unpacked, is what plain x86-64 builds and x rounded per 32 run.
#pragma once

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "dot_portable.h"  // fp16_to_float, FOR_EACH_ROW, prefetch_ahead

namespace ggml {

constexpr int64_t kMaxBlock = 256;
constexpr int64_t kGroup = 16;  // weights that share a scale a and a minimum m (Q4_K/Q5_K: two groups the same)
constexpr int64_t kXBlock = 32;  // values of x that share one int8 scale where K is not whole blocks of 256

// One block's weights: q (block), per group a and m, and the type's zero z.
struct Unpacked {
  alignas(64) uint8_t q[kMaxBlock];
  float a[kMaxBlock / kGroup];
  float m[kMaxBlock / kGroup];
  int z;
};

// An fp16 field of a block, exact either way: F16C's one instruction where the build has it (every AVX2 CPU
// does), else a dozen of bit manipulation (two such fields a Q4_K block).
inline float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return portable::fp16_to_float(bits);
#endif
}

// Q4_K and Q5_K's 8 pairs of 6-bit (scale, min) in 12 bytes: j < 4 in the low 6 bits of bytes j and
// j + 4; j >= 4 in the nibbles of byte j + 4 with the top 2 bits of bytes j - 4 and j.
inline void scale_min_k4(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q4_K (144 bytes): d, dmin (fp16), 12 bytes of scales and mins, 128 bytes of nibbles: bytes 32c..32c+31
// hold sub-block 2c in their low nibbles and 2c + 1 in their high ones.
inline void unpack_q4_k(const uint8_t* b, Unpacked& u) {
  const float d = half(b), dmin = half(b + 2);
  const uint8_t* qs = b + 16;
  for (int j = 0; j < 8; j++) {
    int sc, mn;
    scale_min_k4(b + 4, j, sc, mn);
    u.a[2 * j] = u.a[2 * j + 1] = d * static_cast<float>(sc);
    u.m[2 * j] = u.m[2 * j + 1] = dmin * static_cast<float>(mn);
  }
  for (int c = 0; c < 4; c++)
    for (int l = 0; l < 32; l++) {
      u.q[64 * c + l] = qs[32 * c + l] & 0x0F;
      u.q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
    }
  u.z = 0;
}

// Q5_K (176 bytes): Q4_K's header, 32 bytes of fifth bits (weight 32j + l: bit j of byte l), then Q4_K's nibbles.
inline void unpack_q5_k(const uint8_t* b, Unpacked& u) {
  const float d = half(b), dmin = half(b + 2);
  const uint8_t *qh = b + 16, *qs = b + 48;
  for (int j = 0; j < 8; j++) {
    int sc, mn;
    scale_min_k4(b + 4, j, sc, mn);
    u.a[2 * j] = u.a[2 * j + 1] = d * static_cast<float>(sc);
    u.m[2 * j] = u.m[2 * j + 1] = dmin * static_cast<float>(mn);
  }
  for (int j = 0; j < 8; j++)
    for (int l = 0; l < 32; l++)
      u.q[32 * j + l] = ((qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0x0F) | (((qh[l] >> j) & 1) << 4);
  u.z = 0;
}

// Q6_K (210 bytes): 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, d (fp16). Weight
// 128h + p: the nibble p / 64 of byte 64h + p % 64, the pair p / 32 of byte 128 + 32h + p % 32.
inline void unpack_q6_k(const uint8_t* b, Unpacked& u) {
  const uint8_t *ql = b, *qh = b + 128;
  const float d = half(b + 208);
  for (int g = 0; g < 16; g++) {
    u.a[g] = d * static_cast<float>(static_cast<int8_t>(b[192 + g]));
    u.m[g] = 0.f;
  }
  for (int h = 0; h < 2; h++)
    for (int i = 0; i < 4; i++)  // weights 128h + 32i + l: nibble i / 2 of byte 64h + 32 (i % 2) + l, pair i of byte 32h + l
      for (int l = 0; l < 32; l++)
        u.q[128 * h + 32 * i + l] = ((ql[64 * h + 32 * (i % 2) + l] >> (4 * (i / 2))) & 0x0F) |
                                    (((qh[32 * h + l] >> (2 * i)) & 3) << 4);
  u.z = 32;
}

// Q3_K (110 bytes): 32 bytes of high bits (weight 32j + l: bit j of byte l), 64 of 2-bit pairs (weight
// 32j + l: pair j % 4 of byte 32 (j / 4) + l), 12 bytes of 6-bit scales, d (fp16).
inline void unpack_q3_k(const uint8_t* b, Unpacked& u) {
  const uint8_t *hmask = b, *qs = b + 32, *s = b + 96;
  const float d = half(b + 108);
  for (int g = 0; g < 16; g++) {
    const int low = g < 8 ? s[g] & 0x0F : s[g - 8] >> 4, high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
    u.a[g] = d * static_cast<float>((low | high << 4) - 32);
    u.m[g] = 0.f;
  }
  for (int j = 0; j < 8; j++)
    for (int l = 0; l < 32; l++)
      u.q[32 * j + l] = ((qs[32 * (j / 4) + l] >> (2 * (j % 4))) & 3) | (((hmask[l] >> j) & 1) << 2);
  u.z = 4;
}

// Q2_K (84 bytes): 16 bytes of (scale, min) nibbles, 64 of 2-bit pairs (as Q3_K's), d, dmin (fp16).
inline void unpack_q2_k(const uint8_t* b, Unpacked& u) {
  const uint8_t *s = b, *qs = b + 16;
  const float d = half(b + 80), dmin = half(b + 82);
  for (int g = 0; g < 16; g++) {
    u.a[g] = d * static_cast<float>(s[g] & 0x0F);
    u.m[g] = dmin * static_cast<float>(s[g] >> 4);
  }
  for (int j = 0; j < 8; j++)
    for (int l = 0; l < 32; l++) u.q[32 * j + l] = (qs[32 * (j / 4) + l] >> (2 * (j % 4))) & 3;
  u.z = 0;
}

// The 32 weights of Q5_0 and Q5_1: byte l's low nibble is weight l, its high one weight 16 + l; bit j of
// the little-endian 32-bit qh is weight j's fifth bit.
inline void unpack_5bit(const uint8_t* qh_bytes, const uint8_t* qs, Unpacked& u) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  for (int l = 0; l < 16; l++) {
    u.q[l] = (qs[l] & 0x0F) | (((qh >> l) & 1) << 4);
    u.q[16 + l] = (qs[l] >> 4) | (((qh >> (16 + l)) & 1) << 4);
  }
}

// Q5_0 (22 bytes): d (fp16), qh, 16 bytes; weight = d (q - 16).
inline void unpack_q5_0(const uint8_t* b, Unpacked& u) {
  u.a[0] = u.a[1] = half(b);
  u.m[0] = u.m[1] = 0.f;
  unpack_5bit(b + 2, b + 6, u);
  u.z = 16;
}

// Q5_1 (24 bytes): d, min (fp16), qh, 16 bytes; weight = d q + min.
inline void unpack_q5_1(const uint8_t* b, Unpacked& u) {
  u.a[0] = u.a[1] = half(b);
  u.m[0] = u.m[1] = -half(b + 2);
  unpack_5bit(b + 4, b + 8, u);
  u.z = 0;
}

struct Format {
  const char* name;
  int64_t block;  // weights a block
  int64_t bytes;  // bytes a block
  void (*unpack)(const uint8_t*, Unpacked&);
  int64_t scale_group;  // weights that share a and m: two groups of 16 (32) or one
  bool minimums;  // whether m can be other than 0
};

// Told apart by their bytes a block (no two of these share a size).
constexpr Format kFormats[] = {
    {"Q4_K", 256, 144, unpack_q4_k, 32, true}, {"Q5_K", 256, 176, unpack_q5_k, 32, true},
    {"Q6_K", 256, 210, unpack_q6_k, 16, false}, {"Q3_K", 256, 110, unpack_q3_k, 16, false},
    {"Q2_K", 256, 84, unpack_q2_k, 16, true}, {"Q5_0", 32, 22, unpack_q5_0, 32, false},
    {"Q5_1", 32, 24, unpack_q5_1, 32, true},
};

// The format of blocks of `bytes` bytes; null where none has that size.
inline const Format* format_of(int64_t bytes) {
  for (const Format& f : kFormats)
    if (f.bytes == bytes) return &f;
  return nullptr;
}

// `blocks` blocks of one row into fp32: weight = a (q - z) - m, as the gguf library computes it.
inline void dequantize(const Format& f, const uint8_t* row, int64_t blocks, float* out) {
  Unpacked u;
  for (int64_t b = 0; b < blocks; b++, row += f.bytes, out += f.block) {
    f.unpack(row, u);
#if defined(__AVX2__)  // the same operations, eight weights at a time (fp32 multiply, then subtract: no FMA)
    const __m256i z = _mm256_set1_epi32(u.z);
    for (int64_t g = 0; g < f.block / kGroup; g++) {
      const __m128i q = _mm_load_si128(reinterpret_cast<const __m128i*>(u.q + g * kGroup));
      const __m256 a = _mm256_set1_ps(u.a[g]), m = _mm256_set1_ps(u.m[g]);
      for (int h = 0; h < 2; h++) {
        const __m256i qi = _mm256_sub_epi32(_mm256_cvtepu8_epi32(h ? _mm_srli_si128(q, 8) : q), z);
        _mm256_storeu_ps(out + g * kGroup + 8 * h, _mm256_sub_ps(_mm256_mul_ps(a, _mm256_cvtepi32_ps(qi)), m));
      }
    }
#else
    for (int64_t j = 0; j < f.block; j++)
      out[j] = u.a[j / kGroup] * static_cast<float>(static_cast<int>(u.q[j]) - u.z) - u.m[j / kGroup];
#endif
  }
}

// Rows of x rounded to int8 for dot_blocks: values (M, K); one scale max |x| / 127 per group of x (256 values where K
// is whole blocks of 256, as llama.cpp's Q8_K, else 32) (M, K / group); and each 16 values' sum of their int8s (M,
// K / 16), which the minimums and zeros multiply.
struct XBlocks {
  const int8_t* q;
  const float* scale;
  const int16_t* sums;
  int64_t k;  // row stride of q
  int64_t group;  // values of x per scale
  int shift;  // log2(group)
};

// One row of x (k values) rounded for dot_blocks and prefill's products: per group of `group` values a scale
// max |x| / 127 (scales[k / group]) and the values to nearest int8 (q), each 16 values' sum of int8s (sums[k / 16]).
inline void round_x_row(const float* x, int64_t k, int64_t group, int8_t* q, int16_t* sums, float* scales) {
  for (int64_t b = 0; b < k / group; b++) {
    const float* xb = x + b * group;
    float x_max = 0.f;
    for (int64_t j = 0; j < group; j++) x_max = std::max(x_max, std::abs(xb[j]));
    const float inv = x_max > 0.f ? 127.f / x_max : 0.f;
    int8_t* qb = q + b * group;
    for (int64_t j = 0; j < group; j++) qb[j] = static_cast<int8_t>(std::nearbyint(xb[j] * inv));
    for (int64_t g = 0; g < group / kGroup; g++) {
      int32_t sum = 0;
      for (int64_t j = 0; j < kGroup; j++) sum += qb[g * kGroup + j];
      sums[b * group / kGroup + g] = static_cast<int16_t>(sum);
    }
    scales[b] = x_max / 127.f;
  }
}

#if defined(__AVX2__)
inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// Any format: each block unpacked (Unpacked), each group of 16's integer dot product scaled in fp32.
template <int M>
void dot_any(const Format& f, const uint8_t* row, int64_t blocks, const XBlocks& x, int64_t k0, float* out) {
  const int64_t groups = f.block / kGroup;
  Unpacked u;
  alignas(32) float bias[kMaxBlock / kGroup];  // per group, -(a z + m): what each unit of the group's sum of x adds
#if defined(__AVX2__)
  __m256 acc[M];
  FOR_EACH_ROW(m) acc[m] = _mm256_setzero_ps();
  __m256 a_pairs[kMaxBlock / kXBlock];
#else
  float acc[M] = {};
#endif
  for (int64_t b = 0; b < blocks; b++) {
    const uint8_t* block = row + b * f.bytes;
    prefetch_ahead(block);
    f.unpack(block, u);
    for (int64_t g = 0; g < groups; g++) bias[g] = -(u.a[g] * static_cast<float>(u.z) + u.m[g]);
    const int64_t k = k0 + b * f.block;
#if defined(__AVX2__)
    for (int64_t c = 0; c < f.block / kXBlock; c++)
      a_pairs[c] = _mm256_set_m128(_mm_set1_ps(u.a[2 * c + 1]), _mm_set1_ps(u.a[2 * c]));
    FOR_EACH_ROW(m) {
      const int8_t* xq = x.q + m * x.k + k;
      const int16_t* sums = x.sums + (m * x.k + k) / kGroup;
      const int64_t first = m * x.k + k;
      for (int64_t c = 0; c < f.block / kXBlock; c++) {
        const __m256i qv = _mm256_load_si256(reinterpret_cast<const __m256i*>(u.q + c * kXBlock));
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c * kXBlock));
        // 8 int32 sums of 4 products: lanes 0-3 the first group of 16, lanes 4-7 the second (q <= 63, so no pair
        // of products reaches int16's limit); and the two groups' bias times their sums of x
        const __m256i dots = _mm256_madd_epi16(_mm256_maddubs_epi16(qv, xv), _mm256_set1_epi16(1));
        const __m256 xs = _mm256_set1_ps(x.scale[(first + c * kXBlock) >> x.shift]);
        const __m256 bias_sums = _mm256_set_m128(_mm_set_ss(bias[2 * c + 1] * static_cast<float>(sums[2 * c + 1])),
                                                 _mm_set_ss(bias[2 * c] * static_cast<float>(sums[2 * c])));
        acc[m] = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), a_pairs[c], bias_sums), xs, acc[m]);
      }
    }
#else
    FOR_EACH_ROW(m) {
      const int8_t* xq = x.q + m * x.k + k;
      const int16_t* sums = x.sums + (m * x.k + k) / kGroup;
      for (int64_t g = 0; g < groups; g++) {
        int32_t dot = 0;
        for (int64_t j = 0; j < kGroup; j++) dot += static_cast<int32_t>(u.q[g * kGroup + j]) * xq[g * kGroup + j];
        const float xs = x.scale[(m * x.k + k + g * kGroup) >> x.shift];
        acc[m] += xs * (u.a[g] * static_cast<float>(dot) + bias[g] * static_cast<float>(sums[g]));
      }
    }
#endif
  }
#if defined(__AVX2__)
  FOR_EACH_ROW(m) out[m] = horizontal_sum(acc[m]);
#else
  FOR_EACH_ROW(m) out[m] = acc[m];
#endif
}

#if defined(__AVX2__)
// Q4_K's 12 bytes of 6-bit scales and minimums (at s; 16 bytes readable there) as 16 bytes: scales 0-7, then
// minimums 0-7. j < 4: the low 6 bits of bytes j (scale) and j + 4 (minimum); j >= 4: the low (scale) and high
// (minimum) nibbles of byte j + 4, with the top 2 bits of bytes j - 4 (scale) and j (minimum) above them.
inline __m128i scales_mins_k4(const uint8_t* s) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  const __m128i low = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i top = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i nibbles = _mm_blend_epi32(low, _mm_srli_epi16(low, 4), 0b1000);  // minimums 4-7: the high nibbles
  const __m128i bits =
      _mm_and_si128(nibbles, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15));
  return _mm_or_si128(bits, _mm_srli_epi16(_mm_and_si128(top, _mm_set1_epi8(static_cast<char>(0xC0))), 2));
}

// scale[j] for chunk j of a block's 32-weight chunks: the scales of its two groups of 16, bytes 2j and 2j + 1 of sc8,
// each in the int16 lanes of its half (8 times each), widened as signed or unsigned bytes.
template <bool Signed>
inline void group_scales(__m128i sc8, __m256i (&scale)[8]) {
  for (int j = 0; j < 8; j++) {
    const __m128i picked = _mm_shuffle_epi8(sc8, _mm_set_epi64x(0x0101010101010101LL * (2 * j + 1),
                                                                 0x0101010101010101LL * (2 * j)));
    scale[j] = Signed ? _mm256_cvtepi8_epi16(picked) : _mm256_cvtepu8_epi16(picked);
  }
}

// A block's 256 weights q (unsigned, 8 registers of 32) times 256 int8 values of x: each chunk's pairs of products
// (int16: q <= 63, so no pair reaches its limit) times their group's scale (scale[j]'s int16 lanes), summed in int32.
// Four sums, chunks j and j + 4 in sum j: where the CPU has VNNI (AVX-512 VNNI, AVX-VNNI), vpdpwssd multiplies by the
// scale and adds in one instruction, and four chains of it hide its latency (int32 sums: the order changes nothing).
inline __m256i scaled_dots(const __m256i (&q)[8], const __m256i (&scale)[8], const int8_t* xq) {
  __m256i sum[4];
  for (int j = 0; j < 8; j++) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * j));
    const __m256i pairs = _mm256_maddubs_epi16(q[j], xv);
    if (j < 4) {
      sum[j] = _mm256_madd_epi16(pairs, scale[j]);
      continue;
    }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    sum[j - 4] = _mm256_dpwssd_epi32(sum[j - 4], pairs, scale[j]);
#elif defined(__AVXVNNI__)
    sum[j - 4] = _mm256_dpwssd_avx_epi32(sum[j - 4], pairs, scale[j]);
#else
    sum[j - 4] = _mm256_add_epi32(sum[j - 4], _mm256_madd_epi16(pairs, scale[j]));
#endif
  }
  return _mm256_add_epi32(_mm256_add_epi32(sum[0], sum[1]), _mm256_add_epi32(sum[2], sum[3]));
}

// One row's share of a block whose weights are d a (q - 2^Shift) (Q6_K: 32, Q3_K: 4), a each group's integer scale
// (`scales`: sixteen int16; scale[j] as group_scales gives them): the scaled dot products less 2^Shift times the
// scales times x's sums of 16, in int32, then d xs times that added to acc.
template <int Shift>
inline __m256 add_centred(const __m256i (&q)[8], const __m256i (&scale)[8], __m256i scales, float d, const XBlocks& x,
                          int64_t at, __m256 acc) {
  const __m256i sums16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.sums + at / kGroup));
  const __m256i sum = _mm256_sub_epi32(scaled_dots(q, scale, x.q + at),
                                       _mm256_slli_epi32(_mm256_madd_epi16(scales, sums16), Shift));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(d * x.scale[at >> 8]), acc);
}

// The two fp16 fields at p (d, dmin) in lanes 0 and 1.
inline __m128 fp16_pair(const uint8_t* p) {
#if defined(__F16C__)
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits)));
#else
  return _mm_setr_ps(half(p), half(p + 2), 0.f, 0.f);
#endif
}

// A row's last step of a block whose weights are d a q - dmin m (Q4_K, Q5_K, Q2_K): acc + d xs sum - dmin xs mins,
// `sum` the scaled dot products and `mins` the minimums times x's sums (int32), d and dmin as fp16_pair gives them.
inline __m256 add_d_dmin(__m256 acc, __m256i sum, __m256i mins, __m128 d_dmin, float xs) {
  const __m128 scaled = _mm_mul_ps(d_dmin, _mm_set1_ps(xs));  // d xs, dmin xs
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_broadcastss_ps(scaled), acc);
  return _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_broadcastss_ps(_mm_movehdup_ps(scaled)), acc);
}

// Q4_K (and, Five, Q5_K) with x in groups of 256 (one scale a block): each sub-block's integer dot products times
// its 6-bit scale summed in int32 (madd by the scale), the minimums times the sub-blocks' sums of x likewise (madd
// of x's sums by each minimum twice), then two fp32 multiply-adds a block and row: d xs sum - dmin xs mins.
template <int M, bool Five>
void dot_q4_k(const uint8_t* row, int64_t blocks, const XBlocks& x, int64_t k0, float* out) {
  constexpr int64_t kBytes = Five ? 176 : 144, kQs = Five ? 48 : 16;
  const __m256i nibble = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  const __m128i twice = _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);  // minimums, twice
  __m256 acc[M];
  FOR_EACH_ROW(m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; b++) {
    const uint8_t* block = row + b * kBytes;
    for (int64_t line = 0; line < kBytes; line += 64) prefetch_ahead(block + line);  // each cache line of the block
    const __m128 d_dmin = fp16_pair(block);
    const __m128i scales_mins = scales_mins_k4(block + 4);
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(scales_mins, twice));
    __m256i q[8], scale[8];  // sub-block j's 32 weights, and its scale in every int16 lane
    const __m256i hi = Five ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16)) : _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kQs + 32 * c));
      q[2 * c] = _mm256_and_si256(v, nibble);
      q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
    }
    if constexpr (Five)  // the fifth bit of sub-block j: bit j of each of the 32 bytes
      for (int j = 0; j < 8; j++)
        q[j] = _mm256_or_si256(q[j], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, j), one), 4));
    const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(scales_mins));
    for (int j = 0; j < 8; j++)  // int16 lane j of `scales` into every lane
      scale[j] = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<int16_t>((2 * j + 1) << 8 | 2 * j)));
    const int64_t k = k0 + b * 256;
    FOR_EACH_ROW(m) {
      __m256i sum = scaled_dots(q, scale, x.q + m * x.k + k);
      const __m256i sums16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.sums + (m * x.k + k) / kGroup));
      acc[m] = add_d_dmin(acc[m], sum, _mm256_madd_epi16(sums16, mins), d_dmin, x.scale[(m * x.k + k) >> 8]);
    }
  }
  FOR_EACH_ROW(m) out[m] = horizontal_sum(acc[m]);
}

// Q6_K with x in groups of 256: q (6 bits) from the nibbles and the 2-bit pairs in registers; each group of 16's
// integer dot product times its int8 scale summed in int32, less 32 times the scales times x's sums (q - 32), then
// one fp32 multiply-add a block and row: d xs sum.
template <int M>
void dot_q6_k(const uint8_t* row, int64_t blocks, const XBlocks& x, int64_t k0, float* out) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), pair = _mm256_set1_epi8(3);
  __m256 acc[M];
  FOR_EACH_ROW(m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; b++) {
    const uint8_t* block = row + b * 210;
    for (int64_t line = 0; line < 210; line += 64) prefetch_ahead(block + line);  // each cache line of the block
    const float d = half(block + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
    const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
    __m256i q[8], scale[8];  // weights 32i..32i+31, and the scales of their two groups of 16 (int16 lanes)
    for (int h = 0; h < 2; h++) {
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h + 32));
      const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * h));
      auto high = [&](int shift) { return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, shift), pair), 4); };
      q[4 * h] = _mm256_or_si256(_mm256_and_si256(l0, nibble), high(0));
      q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, nibble), high(2));
      q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), nibble), high(4));
      q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), nibble), high(6));
    }
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
    group_scales<true>(sc8, scale);
    const int64_t k = k0 + b * 256;
    FOR_EACH_ROW(m) acc[m] = add_centred<5>(q, scale, scales, d, x, m * x.k + k, acc[m]);  // q - 32
  }
  FOR_EACH_ROW(m) out[m] = horizontal_sum(acc[m]);
}

// Q3_K with x in groups of 256: q (3 bits: a 2-bit pair and a high bit, 0..7) in registers, its sixteen 6-bit scales
// (less 32: -32..31) widened to int16 in registers; each group of 16's integer dot product times its scale summed
// in int32, less 4 times the scales times x's sums (q - 4), then one fp32 multiply-add a block and row: d xs sum.
template <int M>
void dot_q3_k(const uint8_t* row, int64_t blocks, const XBlocks& x, int64_t k0, float* out) {
  const __m256i pair = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
  const __m128i nibble = _mm_set1_epi8(0x0F);
  __m256 acc[M];
  FOR_EACH_ROW(m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; b++) {
    const uint8_t* block = row + b * 110;
    for (int64_t line = 0; line < 110; line += 64) prefetch_ahead(block + line);  // each cache line of the block
    const float d = half(block + 108);
    // scale g: its low nibble (byte g's low nibble for g < 8, byte g - 8's high one after), its top two bits (bits
    // 2 (g / 4) of byte 8 + g % 4): as 32-bit words, word w of the top bits is bytes 8-11 shifted by 2w
    const __m128i lows = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 96));
    const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(lows, nibble), _mm_and_si128(_mm_srli_epi16(lows, 4), nibble));
    uint32_t top;
    std::memcpy(&top, block + 104, 4);
    const __m128i tops = _mm_and_si128(_mm_setr_epi32(top, top >> 2, top >> 4, top >> 6), _mm_set1_epi8(3));
    const __m128i sc8 = _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(tops, 4)), _mm_set1_epi8(32));  // int8 -32..31
    const __m256i scales = _mm256_cvtepi8_epi16(sc8);
    const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block));
    __m256i q[8], scale[8];  // weights 32j..32j+31, and the scales of their two groups of 16 (int16 lanes)
    for (int h = 0; h < 2; h++) {
      const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 + 32 * h));
      for (int i = 0; i < 4; i++) {
        const int j = 4 * h + i;
        const __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, j), one), 2);
        q[j] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qs, 2 * i), pair), high);
      }
    }
    group_scales<true>(sc8, scale);
    const int64_t k = k0 + b * 256;
    FOR_EACH_ROW(m) acc[m] = add_centred<2>(q, scale, scales, d, x, m * x.k + k, acc[m]);  // q - 4
  }
  FOR_EACH_ROW(m) out[m] = horizontal_sum(acc[m]);
}

// Q2_K with x in groups of 256: q (2 bits) in registers; each group of 16's integer dot product times its 4-bit
// scale summed in int32, the 4-bit minimums times x's sums likewise, then two fp32 multiply-adds a block and row:
// d xs sum - dmin xs mins.
template <int M>
void dot_q2_k(const uint8_t* row, int64_t blocks, const XBlocks& x, int64_t k0, float* out) {
  const __m256i pair = _mm256_set1_epi8(3);
  const __m128i nibble = _mm_set1_epi8(0x0F);
  __m256 acc[M];
  FOR_EACH_ROW(m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; b++) {
    const uint8_t* block = row + b * 84;
    for (int64_t line = 0; line < 84; line += 64) prefetch_ahead(block + line);  // each cache line of the block
    const __m128 d_dmin = fp16_pair(block + 80);
    const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block));  // (scale, min) nibbles of group g
    const __m128i sc8 = _mm_and_si128(s, nibble);
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s, 4), nibble));
    __m256i q[8], scale[8];  // weights 32j..32j+31, and the scales of their two groups of 16 (int16 lanes)
    for (int h = 0; h < 2; h++) {
      const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16 + 32 * h));
      for (int i = 0; i < 4; i++) q[4 * h + i] = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * i), pair);
    }
    group_scales<false>(sc8, scale);
    const int64_t k = k0 + b * 256;
    FOR_EACH_ROW(m) {
      __m256i sum = scaled_dots(q, scale, x.q + m * x.k + k);
      const __m256i sums16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.sums + (m * x.k + k) / kGroup));
      acc[m] = add_d_dmin(acc[m], sum, _mm256_madd_epi16(sums16, mins), d_dmin, x.scale[(m * x.k + k) >> 8]);
    }
  }
  FOR_EACH_ROW(m) out[m] = horizontal_sum(acc[m]);
}

// Q5_0 (and, One, Q5_1) with x in groups of 32 (one scale a block): the fifth bits spread to bytes, one block's
// integer dot product, then d xs sum. Q5_0's q - 16 is made signed in the register (a clear fifth bit sets the high
// nibble: the low nibble less 16), so its product needs no term of x's sums; Q5_1's q stays unsigned (16 where the
// bit is set) and its minimum times xs sum(x) is added.
template <int M, bool One>
void dot_q5(const uint8_t* row, int64_t blocks, const XBlocks& x, int64_t k0, float* out) {
  constexpr int64_t kBytes = One ? 24 : 22, kHigh = One ? 4 : 2;
  const __m128i nibble = _mm_set1_epi8(0x0F);
#if !(defined(__AVX512BW__) && defined(__AVX512VL__))
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);  // byte i: qh's byte i / 8
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);  // byte i: bit i % 8
#endif
  const __m256i sixteen = _mm256_set1_epi8(16), high = _mm256_set1_epi8(static_cast<char>(0xF0));
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[M];
  float tail[M] = {};
  FOR_EACH_ROW(m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; b++) {
    const uint8_t* block = row + b * kBytes;
    prefetch_ahead(block);
    const float d = half(block);
    uint32_t qh;
    std::memcpy(&qh, block + kHigh, 4);
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kHigh + 4));
    __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), nibble), _mm_and_si128(qs, nibble));
    // Q5_1: q = nibble + 16 bit, unsigned; Q5_0: q - 16 = nibble - 16 (1 - bit) in int8, its magnitude for maddubs
    // and its sign moved onto x. Bit i of qh is weight i's (byte i of q).
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    const __mmask32 set = static_cast<__mmask32>(qh);  // a mask register: no spreading to bytes
    q = One ? _mm256_mask_blend_epi8(set, q, _mm256_or_si256(q, sixteen))
            : _mm256_mask_blend_epi8(set, _mm256_or_si256(q, high), q);
#else
    const __m256i bits = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)), spread), bit);
    const __m256i set = _mm256_cmpeq_epi8(bits, bit);
    q = One ? _mm256_or_si256(q, _mm256_and_si256(set, sixteen)) : _mm256_or_si256(q, _mm256_andnot_si256(set, high));
#endif
    const __m256i magnitude = One ? q : _mm256_abs_epi8(q);
    const int64_t k = k0 + b * 32;
    FOR_EACH_ROW(m) {
      __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + m * x.k + k));
      if constexpr (!One) xv = _mm256_sign_epi8(xv, q);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
      const __m256i dots = _mm256_dpbusd_epi32(_mm256_setzero_si256(), magnitude, xv);  // (no pair saturates int16)
#elif defined(__AVXVNNI__)
      const __m256i dots = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), magnitude, xv);
#else
      const __m256i dots = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, xv), ones);
#endif
      const float xs = x.scale[(m * x.k + k) >> x.shift];
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_set1_ps(d * xs), acc[m]);
      if constexpr (One) {
        const int16_t* sums = x.sums + (m * x.k + k) / kGroup;
        tail[m] += half(block + 2) * xs * static_cast<float>(sums[0] + sums[1]);
      }
    }
  }
  FOR_EACH_ROW(m) out[m] = horizontal_sum(acc[m]) + tail[m];
}
#endif


// out[m] = the dot products of `blocks` blocks of one row (its weights from k0 on) with row m of x.
template <int M>
void dot_blocks(const Format& f, const uint8_t* row, int64_t blocks, const XBlocks& x, int64_t k0, float* out) {
#if defined(__AVX2__)
  if (x.group == 256 && f.bytes == 144) return dot_q4_k<M, false>(row, blocks, x, k0, out);
  if (x.group == 256 && f.bytes == 176) return dot_q4_k<M, true>(row, blocks, x, k0, out);
  if (x.group == 256 && f.bytes == 210) return dot_q6_k<M>(row, blocks, x, k0, out);
  if (x.group == 256 && f.bytes == 110) return dot_q3_k<M>(row, blocks, x, k0, out);
  if (x.group == 256 && f.bytes == 84) return dot_q2_k<M>(row, blocks, x, k0, out);
  if (f.bytes == 22) return dot_q5<M, false>(row, blocks, x, k0, out);
  if (f.bytes == 24) return dot_q5<M, true>(row, blocks, x, k0, out);
#endif
  dot_any<M>(f, row, blocks, x, k0, out);
}

}  // namespace ggml
