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
// per 32 values (one fp32 scale each), an integer dot product per group of 16 scaled in fp32:
//   sum_j w_j x_j = sum_groups xs (a sum_j q_j xq_j - (a z + m) sum_j xq_j)
// so each weight is read once, as the file has it, for all rows of x.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

#include "dot_portable.h"  // fp16_to_float, FOR_EACH_ROW, prefetch_ahead

namespace ggml {

constexpr int64_t kMaxBlock = 256;
constexpr int64_t kGroup = 16;  // weights that share a scale a and a minimum m (Q4_K/Q5_K: two groups the same)
constexpr int64_t kXBlock = 32;  // values of x that share one int8 scale

// One block's weights: q (block), per group a and m, and the type's zero z.
struct Unpacked {
  alignas(64) uint8_t q[kMaxBlock];
  float a[kMaxBlock / kGroup];
  float m[kMaxBlock / kGroup];
  int z;
};

inline float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return portable::fp16_to_float(bits);
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
    for (int p = 0; p < 128; p++)
      u.q[128 * h + p] = ((ql[64 * h + p % 64] >> (4 * (p / 64))) & 0x0F) | (((qh[32 * h + p % 32] >> (2 * (p / 32))) & 3) << 4);
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
};

// Told apart by their bytes a block (no two of these share a size).
constexpr Format kFormats[] = {
    {"Q4_K", 256, 144, unpack_q4_k}, {"Q5_K", 256, 176, unpack_q5_k}, {"Q6_K", 256, 210, unpack_q6_k},
    {"Q3_K", 256, 110, unpack_q3_k}, {"Q2_K", 256, 84, unpack_q2_k},  {"Q5_0", 32, 22, unpack_q5_0},
    {"Q5_1", 32, 24, unpack_q5_1},
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
    for (int64_t j = 0; j < f.block; j++)
      out[j] = u.a[j / kGroup] * static_cast<float>(static_cast<int>(u.q[j]) - u.z) - u.m[j / kGroup];
  }
}

// Rows of x rounded to int8 per kXBlock values for dot_blocks: values (M, K), each 32's scale xs = max |x| / 127
// (M, K / 32), and per group of 16 xs times the sum of its int8 values (M, K / 16).
struct XBlocks {
  const int8_t* q;
  const float* scale;
  const float* group_sums;
  int64_t k;  // row stride of q
};

// out[m] = the dot products of `blocks` blocks of one row (its weights from k0 on) with row m of x.
template <int M>
void dot_blocks(const Format& f, const uint8_t* row, int64_t blocks, const XBlocks& x, int64_t k0, float* out) {
  const int64_t groups = f.block / kGroup;
  Unpacked u;
  float bias[kMaxBlock / kGroup];  // per group, -(a z + m): what each unit of the group's sum of x adds
  float tail[M] = {};  // bias terms of blocks of 32 (two groups)
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
      const float* xs = x.scale + (m * x.k + k) / kXBlock;
      const float* sums = x.group_sums + (m * x.k + k) / kGroup;
      for (int64_t c = 0; c < f.block / kXBlock; c++) {
        const __m256i qv = _mm256_load_si256(reinterpret_cast<const __m256i*>(u.q + c * kXBlock));
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c * kXBlock));
        // 8 int32 sums of 4 products: lanes 0-3 the first group of 16, lanes 4-7 the second (q <= 63, so
        // no pair of products reaches int16's limit)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        const __m256i dots = _mm256_dpbusd_epi32(_mm256_setzero_si256(), qv, xv);
#else
        const __m256i dots = _mm256_madd_epi16(_mm256_maddubs_epi16(qv, xv), _mm256_set1_epi16(1));
#endif
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(a_pairs[c], _mm256_set1_ps(xs[c])), acc[m]);
      }
      if (groups == 16) {
        acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(bias), _mm256_loadu_ps(sums), acc[m]);
        acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(bias + 8), _mm256_loadu_ps(sums + 8), acc[m]);
      } else {
        for (int64_t g = 0; g < groups; g++) tail[m] += bias[g] * sums[g];
      }
    }
#else
    FOR_EACH_ROW(m) {
      const int8_t* xq = x.q + m * x.k + k;
      const float* xs = x.scale + (m * x.k + k) / kXBlock;
      const float* sums = x.group_sums + (m * x.k + k) / kGroup;
      for (int64_t g = 0; g < groups; g++) {
        int32_t dot = 0;
        for (int64_t j = 0; j < kGroup; j++) dot += static_cast<int32_t>(u.q[g * kGroup + j]) * xq[g * kGroup + j];
        acc[m] += xs[g / 2] * u.a[g] * static_cast<float>(dot) + bias[g] * sums[g];
      }
    }
#endif
  }
#if defined(__AVX2__)
  FOR_EACH_ROW(m) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    out[m] = _mm_cvtss_f32(v) + tail[m];
  }
#else
  FOR_EACH_ROW(m) out[m] = acc[m] + tail[m];
#endif
}

}  // namespace ggml
