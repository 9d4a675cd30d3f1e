// Plain C++ dot products of one weight row with M rows of x: the fallback for CPUs without the
// intrinsics paths (ARM included), and for int8 groups the intrinsics cannot step through.
// The compiler vectorizes these loops for whatever -march it is given.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

// Loops over the M rows of x are unrolled completely, so that each row's accumulators stay in
// registers (without it, GCC keeps arrays of 16 or more vector accumulators in memory).
#define FOR_EACH_ROW(m) _Pragma("GCC unroll 8") for (int m = 0; m < M; m++)

// Each loop asks for the weights kPrefetchBytes ahead of where it reads: weights are read once, in
// order, and the hardware prefetcher alone fell behind (one core streamed 23-27 GB/s of weights
// where x.sum() reads 41; with this, 37-44; with 8 rows of x, 5-6 GB/s -> 17). 8 KB measured as
// good as 16 KB on rows of 576 and 2048, and better on rows of 8192 with fp32 x (28 vs 23 GB/s),
// where more would push x out of L1.
constexpr int64_t kPrefetchBytes = 8192;

// Into L1 (prefetcht0), as measured above on AMD; into L2 (prefetcht1) where model/kernels.py builds
// with LLAMA_PREFETCH_L2, on Intel CPUs. On Sapphire Rapids a prefetch into L1 most likely holds one
// of the core's few L1 miss buffers until its line arrives; into L2, one sequence decoded the 1B
// shape 1.36x faster in bf16, 1.15x in int8 and 1.05x in int4 (docs/benchmarks.md).
#if defined(LLAMA_PREFETCH_L2)
constexpr int kPrefetchLocality = 2;
#else
constexpr int kPrefetchLocality = 3;
#endif

inline void prefetch_ahead(const void* p) {
#if defined(__GNUC__)
  __builtin_prefetch(static_cast<const char*>(p) + kPrefetchBytes, 0, kPrefetchLocality);
#endif
}

// The same into L2, for a loop whose rows of x take most of L1 (avx512::dot_q8_quads).
inline void prefetch_ahead_l2(const void* p) {
#if defined(__GNUC__)
  __builtin_prefetch(static_cast<const char*>(p) + kPrefetchBytes, 0, 2);
#endif
}

// int4 scales and offsets (fp16, one per 32 weights: an eighth of the weights' bytes) are streams of
// their own, asked for as far ahead as the weights: without it each row of the int4 kernel began with a
// wait for its scales and offsets from memory (22 -> 31-34 GB/s of int4 weights on 1B matrices).
inline void prefetch_block_values(const uint16_t* p) {
#if defined(__GNUC__)
  __builtin_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes / 8, 0, kPrefetchLocality);
#endif
}

namespace portable {

inline float fp16_to_float(uint16_t fp16) { return c10::detail::fp16_ieee_to_fp32_value(fp16); }

inline float bf16_to_float(uint16_t bf16) {  // bf16 is the top half of an fp32
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// out[m] = w . x[m] for `len` bf16 weights w and fp32 x, row m at x + m * x_stride.
// 32 running sums per row of x, which the compiler turns into several independent vector
// accumulators: one accumulator would wait on the latency of each multiply-add.
template <int M>
void dot_bf16(const uint16_t* w, const float* x, int64_t x_stride, int64_t len, float* out) {
  constexpr int kBlock = 32;
  float part[M][kBlock] = {};
  int64_t k = 0;
  for (; k + kBlock <= len; k += kBlock) {
    prefetch_ahead(w + k);
    float wf[kBlock];  // the block of weights, widened once for all M rows
    for (int j = 0; j < kBlock; j++) wf[j] = bf16_to_float(w[k + j]);
    for (int m = 0; m < M; m++)
      for (int j = 0; j < kBlock; j++) part[m][j] += wf[j] * x[m * x_stride + k + j];
  }
  for (int m = 0; m < M; m++) {
    float sum = 0.f;
    for (int j = 0; j < kBlock; j++) sum += part[m][j];
    for (int64_t t = k; t < len; t++) sum += bf16_to_float(w[t]) * x[m * x_stride + t];
    out[m] = sum;
  }
}

// out[m] = w . x[m] for fp32 w and x, as dot_bf16.
template <int M>
void dot_f32(const float* w, const float* x, int64_t x_stride, int64_t len, float* out) {
  constexpr int kBlock = 32;
  float part[M][kBlock] = {};
  int64_t k = 0;
  for (; k + kBlock <= len; k += kBlock) {
    prefetch_ahead(w + k);
    for (int m = 0; m < M; m++)
      for (int j = 0; j < kBlock; j++) part[m][j] += w[k + j] * x[m * x_stride + k + j];
  }
  for (int m = 0; m < M; m++) {
    float sum = 0.f;
    for (int j = 0; j < kBlock; j++) sum += part[m][j];
    for (int64_t t = k; t < len; t++) sum += w[t] * x[m * x_stride + t];
    out[m] = sum;
  }
}

constexpr int64_t kQ8Step = 1;  // any group size

// out[m] = sum over groups g of scale[g] * (w . x[m] within g), for `len` int8 weights w and
// int16 x, row m at x + m * x_stride.
// Within a group the products are integer multiply-adds (|w| <= 127, |x| <= 32767: a group of up
// to 256 sums safely in int32).
template <int M>
void dot_q8(const int8_t* w, const int16_t* x, int64_t x_stride, const float* scale, int64_t len, int64_t group,
            float* out) {
  float sum[M] = {};
  for (int64_t k = 0, g = 0; k < len; k += group, g++) {  // g: the group (no division per group)
    prefetch_ahead(w + k);
    for (int m = 0; m < M; m++) {  // the group's weights stay in L1 after the first row of x
      int32_t acc = 0;
      for (int64_t i = k; i < k + group; i++) acc += static_cast<int32_t>(w[i]) * x[m * x_stride + i];
      sum[m] += static_cast<float>(acc) * scale[g];
    }
  }
  for (int m = 0; m < M; m++) out[m] = sum[m];
}

// int4 blocks (model/quantize.py): 32 weights in 16 bytes, byte j holding weight j (low nibble) and
// 16 + j (high nibble), with an fp16 scale and offset: weight = q * scale + offset, or Q4_0's
// (q - 8) * scale where Offsets is false (offset is then unused).
constexpr int64_t kQ4Block = 32;

// out[m] = w . x[m] for `len` int4 weights (len a multiple of kQ4Block; w, scale and offset at the
// piece's first block) and x rounded to int16 (as for int8 weights). Per block b of a row of x:
//   sum_j (q_j s_b + o_b) x_j = s_b (q . x over the block) + o_b x_sums[b],
// the first an integer dot product, x_sums[b] the block's sum of x (row m at x_sums + m * sums_stride).
template <int M, bool Offsets>
void dot_q4(const uint8_t* w, const int16_t* x, int64_t x_stride, const float* x_sums, int64_t sums_stride,
            const uint16_t* scale, const uint16_t* offset, int64_t len, float* out) {
  float sum[M] = {};
  for (int64_t k = 0, b = 0; k < len; k += kQ4Block, b++) {
    const uint8_t* bytes = w + k / 2;
    prefetch_ahead(bytes);
    if (b % 32 == 0) {  // a cache line of fp16 values
      prefetch_block_values(scale + b);
      if (Offsets) prefetch_block_values(offset + b);
    }
    const float s = fp16_to_float(scale[b]), o = Offsets ? fp16_to_float(offset[b]) : -8.f * s;
    int16_t q[kQ4Block];  // the block's weights, unpacked once for all M rows
    for (int j = 0; j < kQ4Block / 2; j++) {
      q[j] = bytes[j] & 0x0F;
      q[j + kQ4Block / 2] = bytes[j] >> 4;
    }
    for (int m = 0; m < M; m++) {
      const int16_t* xm = x + m * x_stride + k;
      int32_t dot = 0;  // int16 products summed in int32: the pattern compilers vectorize (pmaddwd)
      for (int j = 0; j < kQ4Block; j++) dot += static_cast<int32_t>(q[j]) * xm[j];
      sum[m] += static_cast<float>(dot) * s + o * x_sums[m * sums_stride + b];
    }
  }
  for (int m = 0; m < M; m++) out[m] = sum[m];
}

}  // namespace portable
