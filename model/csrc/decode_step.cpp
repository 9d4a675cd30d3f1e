// Every layer of one decode step in one op: one new token for each of b sequences (b <= 8), its
// hidden state x (b, dim) through each layer's
//
//   h = rms_norm(x);  q|k|v = h (Wq|Wk|Wv)^T;  q, k = apply_rope(q, k);  k, v -> the sequence's cache
//   x = x + attention(q, cached k, cached v) Wo^T
//   h = rms_norm(x);  gate|up = h (W1|W3)^T;  x = x + (silu(gate) * up) W2^T
//
// the maths of Block.decode in model/llama.py, the reference this op is tested against. Run op by
// op, a layer is about 25 small ATen ops of 5-10 us each, as long as reading the layer's weights;
// here the steps between the matrix products are plain loops over a few hundred numbers, and the
// products go to the decode kernel (matvec.h), which streams the weights.
//
// Weights are bf16, fp32, int8 with group scales, int4 with block scales and offsets (model/quantize.py), or
// llama.cpp's blocks (ggml_blocks.h), any kind beside another in one kernel call (q|k|v, wo, w1|w3, w2): an int4
// model keeps a matrix whose K is not whole blocks of 32 as int8, a GGUF's fall-backs put Q8_0 beside Q5_0.
//
// The KV caches hold keys and values in T, or in q8 blocks (model/kv_cache.py: per 32 numbers of a head
// an fp16 scale and 32 int8, GGUF's Q8_0 layout), written here a row at a time and read by attention a
// block at a time, never widened as a whole.
//
// Activations are fp32 or bf16 (T). In bf16 each value is rounded to bf16 where the reference
// stores a bf16 tensor (the norm's output, RoPE's products and their sum, the residual sums, SiLU
// and its product with up, attention's probabilities as ATen's CPU flash attention rounds them)
// and is fp32 in between, as in ATen: both give the same greedy tokens.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "dot_portable.h"  // prefetch_ahead
#include "ggml_blocks.h"  // format_of
#include "matvec.h"
#include "team.h"

#ifndef TORCH_EXTENSION_NAME  // set by torch.utils.cpp_extension to the name the build was given
#define TORCH_EXTENSION_NAME llama_kernels
#endif

namespace {

using c10::BFloat16;

// Each layer's matrices, in this order, in the op's `weights` (and `scales`, `offsets`): model/decode_step.py's
// LAYER_MATRICES. q|k|v and w1|w3 are neighbours, so each group is one slice and one kernel call.
enum Matrix : int64_t { kWq, kWk, kWv, kWo, kW1, kW3, kW2, kLayerMatrices };
constexpr int64_t kMaxRows = 8;  // sequences per step: the decode kernel's rows
constexpr int64_t kMaxGroups = 64;  // query heads per KV head

inline float f32(float v) { return v; }
inline float f32(BFloat16 v) { return static_cast<float>(v); }

// v as a tensor of T holds it: rounded to bf16, or unchanged in fp32.
template <typename T>
inline float stored(float v) { return f32(T(v)); }

// out = x / sqrt(mean(x^2) + eps) * weight, in fp32 (torch.nn.RMSNorm upcasts bf16 the same way).
template <typename T>
void rms_norm(const T* x, const T* weight, int64_t dim, float eps, T* out) {
  float sum_sq = 0.f;
  for (int64_t i = 0; i < dim; i++) sum_sq += f32(x[i]) * f32(x[i]);
  const float rstd = 1.f / std::sqrt(sum_sq / static_cast<float>(dim) + eps);
  for (int64_t i = 0; i < dim; i++) out[i] = T(f32(x[i]) * rstd * f32(weight[i]));
}

// model/rope.py's Rope.rotate on one head, in place: x * cos + rotate_half(x) * sin, where
// rotate_half(x1, x2) = (-x2, x1) for the head's two halves (Hugging Face's layout).
template <typename T>
void apply_rope(T* head, const T* cos, const T* sin, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < half; i++) {
    const float x1 = f32(head[i]), x2 = f32(head[i + half]);
    const float first = stored<T>(x1 * f32(cos[i])) + stored<T>(-x2 * f32(sin[i]));
    const float second = stored<T>(x2 * f32(cos[i + half])) + stored<T>(x1 * f32(sin[i + half]));
    head[i] = T(first);
    head[i + half] = T(second);
  }
}

// Sixteen floats as one value of the compiler's vector extension: one AVX-512 register, two AVX2
// ones, four SSE or NEON ones, whatever the build's -march has, from one piece of code.
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
inline float sum16(f32x16 v) {  // halves added as vectors: a chain of 16 scalar adds was the dot products' cost
  f32x8 lo8, hi8;
  std::memcpy(&lo8, &v, sizeof lo8);
  std::memcpy(&hi8, reinterpret_cast<const char*>(&v) + sizeof lo8, sizeof hi8);
  const f32x8 s8 = lo8 + hi8;
  f32x4 lo4, hi4;
  std::memcpy(&lo4, &s8, sizeof lo4);
  std::memcpy(&hi4, reinterpret_cast<const char*>(&s8) + sizeof lo4, sizeof hi4);
  const f32x4 s4 = lo4 + hi4;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// Lanes of a and b (0-15: a's, 16-31: b's) picked by constant indices: __builtin_shufflevector (clang, GCC
// 12 and later), or GCC's older __builtin_shuffle with the indices as a vector.
#if defined(__clang__) || __GNUC__ >= 12
#define PICK16(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int32_t i32x16 __attribute__((vector_size(64)));
#define PICK16(a, b, ...) __builtin_shuffle(a, b, i32x16{__VA_ARGS__})
#endif

// Attention's vectors are the machine's own width (kLanes floats: one AVX-512 register, or one AVX2 register):
// a 16-float vector on AVX2 is a pair of registers that GCC 12 moved through the stack and general registers
// wherever it sat in an array (the weighted sums of values, the widened keys), at several times the cost of
// the arithmetic. The plain x86-64 build takes the AVX2 width, as two SSE registers.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
typedef f32x16 f32xN;
typedef uint16_t u16xN __attribute__((vector_size(32)));
typedef uint32_t u32xN __attribute__((vector_size(64)));
typedef int8_t i8xN __attribute__((vector_size(16)));
#else
constexpr int kLanes = 8;
typedef f32x8 f32xN;
typedef uint16_t u16xN __attribute__((vector_size(16)));
typedef uint32_t u32xN __attribute__((vector_size(32)));
typedef int8_t i8xN __attribute__((vector_size(8)));
#endif

inline f32xN loadN(const float* p) {
  f32xN v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline f32xN loadN(const BFloat16* p) {  // bf16 is the top half of an fp32
#if defined(__AVX512F__)
  // GCC 12 widens a u16x16 to 32 bits in halves (5 instructions where AVX-512 has one)
  return (f32xN)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#else
  u16xN h;
  std::memcpy(&h, p, sizeof h);
  return (f32xN)(__builtin_convertvector(h, u32xN) << 16);
#endif
}
// kLanes int8 to fp32 (GCC 12 turns __builtin_convertvector of int8 into scalar conversions on AVX2)
inline f32xN widenN(const uint8_t* p) {
#if defined(__AVX512F__)
  return (f32xN)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (f32xN)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  i8xN q;
  std::memcpy(&q, p, sizeof q);
  return __builtin_convertvector(q, f32xN);
#endif
}

// a * b + c rounded once where the CPU has FMA (the kernel is built without contraction, so it is asked for
// by name); plain x86-64 builds multiply and add.
inline f32xN fmaN(f32xN a, f32xN b, f32xN c) {
#if defined(__AVX512F__)
  return (f32xN)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (f32xN)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

// A cache's row: one position of one KV head, head_dim numbers. Plain<E> keeps them as E; Q8 as blocks of
// 32 (an fp16 scale, then 32 int8). Numbers c kLanes.. (c + 1) kLanes - 1 are `raw(row, c)` in fp32, times
// `scale(row, c)` where kScaled (the scale of kVectorsPerScale vectors in a row), `at(row, i)` is number i,
// `write` stores a row; `Weights` is the type the softmax's weights are rounded to, as the reference
// rounds them: the activations' dtype over a cache in it, fp32 over q8 blocks (the reference widens those
// to fp32 and attends in fp32).
template <typename E>
struct Plain {
  using Weights = E;
  static int64_t row_bytes(int64_t head_dim) { return head_dim * static_cast<int64_t>(sizeof(E)); }
  static constexpr bool kScaled = false;
  static constexpr int kVectorsPerScale = 1 << 20;  // the whole row: its scale is 1
  static float scale(const uint8_t*, int) { return 1.f; }
  static f32xN raw(const uint8_t* row, int c) { return loadN(reinterpret_cast<const E*>(row) + kLanes * c); }
  static float at(const uint8_t* row, int64_t i) { return f32(reinterpret_cast<const E*>(row)[i]); }
  static void write(const E* x, int64_t head_dim, uint8_t* row) { std::copy(x, x + head_dim, reinterpret_cast<E*>(row)); }
};

struct Q8 {
  using Weights = float;
  static constexpr int64_t kBlock = 32, kBlockBytes = 2 + kBlock;
  static int64_t row_bytes(int64_t head_dim) { return head_dim / kBlock * kBlockBytes; }
  static float scale(const uint8_t* block) {
#if defined(__F16C__)
    uint16_t h;
    std::memcpy(&h, block, sizeof h);
    return _cvtsh_ss(h);  // exact, as c10::Half's conversion
#else
    c10::Half s;
    std::memcpy(&s, block, sizeof s);
    return static_cast<float>(s);
#endif
  }
  // Vector c (numbers kLanes c .. kLanes c + kLanes - 1) is raw(row, c) * scale(row, c): the int8 widened, and
  // its block's scale, the same for kVectorsPerScale vectors in a row.
  static constexpr bool kScaled = true;
  static constexpr int kVectorsPerScale = kBlock / kLanes;
  static float scale(const uint8_t* row, int c) { return scale(row + (c / kVectorsPerScale) * kBlockBytes); }
  static f32xN raw(const uint8_t* row, int c) {
    return widenN(row + (c / kVectorsPerScale) * kBlockBytes + 2 + c % kVectorsPerScale * kLanes);
  }
  static float at(const uint8_t* row, int64_t i) {
    const uint8_t* block = row + (i / kBlock) * kBlockBytes;
    return static_cast<float>(static_cast<int8_t>(block[2 + i % kBlock])) * scale(block);
  }
  // As model/kv_cache.py's quantize_q8: scale = fp16(max|x| / 127), q = x / scale to the nearest (ties to even).
  template <typename T>
  static void write(const T* x, int64_t head_dim, uint8_t* row) {
    for (int64_t b = 0; b < head_dim / kBlock; b++) {
      const T* xb = x + b * kBlock;
      uint8_t* block = row + b * kBlockBytes;
      float amax = 0.f;
      for (int64_t i = 0; i < kBlock; i++) amax = std::max(amax, std::fabs(f32(xb[i])));
      const c10::Half s(amax / 127.f);
      std::memcpy(block, &s, sizeof s);
      const float d = static_cast<float>(s);
      for (int64_t i = 0; i < kBlock; i++) {
        const float q = d > 0.f ? std::min(127.f, std::max(-127.f, std::nearbyint(f32(xb[i]) / d))) : 0.f;
        block[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(q));
      }
    }
  }
};

// One task of attention: the `groups` query heads q (groups, head_dim) that share one KV head,
// against n of its cached keys and values k, v (n, head_dim), from the softmax's point of view a
// piece of the positions: its scores' maximum top[g], sum[g] = sum of exp(score - top[g]) and
// acc[g] = sum of exp(score - top[g]) v (groups, head_dim); merge() puts the pieces together
// (FlashAttention's running maximum; ATen's CPU flash attention splits the keys the same way).
// Scores and softmax in fp32, each exp rounded to T before it weights a value, as ATen does.
struct Partial {
  float* top;
  float* sum;
  float* acc;
};

// exp(x) for kLanes numbers x <= 0 (a score less the largest): 2^n exp(r), with n the integer nearest x / ln 2 and
// r = x - n ln 2 in [-ln 2 / 2, ln 2 / 2], where exp(r) = 1 + r + r^2 P(r), P of degree 5 (Cephes' expf): within
// 1.3 ulp of the exact exp for every float in [-87, 0] (checked against exp in double, AVX2 build). Below -87
// exp(x) leaves fp32's normal numbers: taken as exp(-87), ~1.6e-38.
inline f32xN expN(f32xN x) {
  typedef int32_t i32xN __attribute__((vector_size(sizeof(f32xN))));
  const f32xN lowest = f32xN{} - 87.f;
  x = x < lowest ? lowest : x;
  const f32xN shifter = f32xN{} + 12582912.f;  // 1.5 * 2^23: a sum with it keeps its integer part, in the low bits
  const f32xN shifted = fmaN(x, f32xN{} + 1.44269504f, shifter);
  const f32xN n = shifted - shifter;
  f32xN r = fmaN(n, f32xN{} - 0.693359375f, x);  // ln 2 in two parts: the first exact in 9 bits
  r = fmaN(n, f32xN{} + 2.12194440e-4f, r);
  f32xN poly = f32xN{} + 1.9875691500e-4f;
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    poly = fmaN(poly, r, f32xN{} + c);
  const f32xN exp_r = fmaN(poly, r * r, r + 1.f);
  const i32xN two_n = (((i32xN)shifted - (i32xN)shifter) + 127) << 23;  // 2^n's bits (n >= -126)
  return exp_r * (f32xN)two_n;
}

// One group's scores p (n) -> exp(p - top), rounded to T as the weights of the values, with top their maximum and
// sum the sum of the exps before rounding (as ATen), kLanes at a time (the last few beside padding that counts
// for nothing): the maximum and the sum were scalar loops, a chain of n additions the compiler may not reorder.
template <typename T>
void softmax_piece(float* p, int64_t n, float* top, float* sum) {
  const int64_t whole = n / kLanes * kLanes;
  auto tail = [&](float pad) {  // p's last n - whole numbers, then pad
    f32xN v = f32xN{} + pad;
    std::memcpy(&v, p + whole, (n - whole) * sizeof(float));
    return v;
  };
  f32xN most = tail(p[0]);
  for (int64_t j = 0; j < whole; j += kLanes) {
    const f32xN v = loadN(p + j);
    most = v > most ? v : most;
  }
  float best = most[0];
  for (int i = 1; i < kLanes; i++) best = std::max(best, most[i]);
  f32xN total{};
  for (int64_t j = 0; j < whole; j += kLanes) {
    const f32xN e = expN(loadN(p + j) - best);
    std::memcpy(p + j, &e, sizeof e);
    total += e;
  }
  if (whole < n) {
    f32xN e = expN(tail(best) - best);
    std::memcpy(p + whole, &e, (n - whole) * sizeof(float));
    for (int64_t i = n - whole; i < kLanes; i++) e[i] = 0.f;  // the padding's exp(0)
    total += e;
  }
  float all = 0.f;
  for (int i = 0; i < kLanes; i++) all += total[i];
  for (int64_t j = 0; j < n; j++) p[j] = stored<T>(p[j]);
  *top = best;
  *sum = all;
}

// out[i] = the sum of v[i]'s 16 lanes, for 16 vectors at once: pairs of vectors are folded into one, half
// of each, and added, four times (15 additions of two shuffles for 16 sums, where one sum alone takes 4
// additions and the moves between registers). Each vector's lanes are added in the same order whatever its
// i, and in the order sum16 adds one vector's (halves, then quarters, eighths, pairs): the same scores.
inline f32x16 sums16(const f32x16* v) {
  f32x16 a[8], b[4], c[2];
  for (int i = 0; i < 8; i++)  // lanes 0-7: v[2i]'s sums of 2, 8-15: v[2i + 1]'s
    a[i] = PICK16(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           PICK16(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; i++)  // 4 lanes each of v[4i .. 4i + 3]
    b[i] = PICK16(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           PICK16(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; i++)  // 2 lanes each of v[8i .. 8i + 7]
    c[i] = PICK16(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           PICK16(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return PICK16(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         PICK16(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// The same for 8 vectors of 8 (the AVX2 width): out[i] = the sum of v[i]'s lanes, each vector's lanes added in one
// order whatever its i: pairs, then pairs of pairs within each 128-bit half, then the halves. Only the last step
// crosses the halves (vperm2f128 is 8 micro-operations on Zen 1, where the in-half shuffles are 2), once for
// the 8 vectors, and the sums come out in order.
#define PICK8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
inline f32x8 sums8(const f32x8* v) {
  f32x8 a[4], b[2];
  for (int i = 0; i < 4; i++)  // in each half: v[2i]'s two sums of pairs, then v[2i + 1]'s
    a[i] = PICK8(v[2 * i], v[2 * i + 1], 0, 2, 8, 10, 4, 6, 12, 14) + PICK8(v[2 * i], v[2 * i + 1], 1, 3, 9, 11, 5, 7, 13, 15);
  for (int i = 0; i < 2; i++)  // in each half: the sums of four of v[4i .. 4i + 3], in order
    b[i] = PICK8(a[2 * i], a[2 * i + 1], 0, 2, 8, 10, 4, 6, 12, 14) + PICK8(a[2 * i], a[2 * i + 1], 1, 3, 9, 11, 5, 7, 13, 15);
  return PICK8(b[0], b[1], 0, 1, 2, 3, 8, 9, 10, 11) + PICK8(b[0], b[1], 4, 5, 6, 7, 12, 13, 14, 15);  // low + high halves
}

#if defined(__AVX512F__)
inline f32xN sumsN(const f32xN* v) { return sums16(v); }
#else
inline f32xN sumsN(const f32xN* v) { return sums8(v); }
#endif

// head_dim is C pieces of 16 (Llama's 64 and 128: 4 and 8) and G query heads share the KV head (Llama
// 3.2's 3 and 4), both known to the compiler, so the queries and the weighted sums stay in registers.
// Each key and each value is read once for all the groups, in order, and asked for from memory 8 KB
// ahead as the weights are (dot_portable.h). A key's dot product with a query is 16 lanes, summed with
// 15 other keys' (sums16); the last keys fewer than 16 are summed beside zeros, the same way, so a
// score does not depend on where its key falls. Written element by element (attend_any), the compiler
// kept the sums in memory and reduced each dot product with a chain of scalar adds (docs/benchmarks.md).
// `scores` holds G * n floats.
template <int C, int G, typename T, typename KV>
void attend_vectors(const T* q, const uint8_t* k, const uint8_t* v, int64_t n, float* scores, Partial out) {
  constexpr int64_t head_dim = 16 * C;
  constexpr int D = head_dim / kLanes;  // vectors a head
  const int64_t row = KV::row_bytes(head_dim);
  const float scale = 1.f / std::sqrt(static_cast<float>(head_dim));
  f32xN qs[G][D];  // the queries, scaled
  for (int g = 0; g < G; g++)
    for (int d = 0; d < D; d++) qs[g][d] = loadN(q + g * head_dim + kLanes * d) * scale;
  // Scores a block of kLanes keys at a time: each key widened to fp32 once (in registers) and its dot product
  // with every query taken lane by lane, then the kLanes keys' lanes summed at once for each query.
  // A key's dot product with a query is kChains chains of kChain multiply-adds (a q8 block each, scaled once at
  // its end): one chain of D was a wait of D multiply-adds one after the other (5 cycles each on Zen 1) for
  // every key, and the waiting instructions filled the CPU's queue before the next key's could start.
  constexpr int kChain = std::min<int>(D, KV::kScaled ? KV::kVectorsPerScale : 4), kChains = D / kChain;
  f32xN dots[G][kLanes];
  for (int64_t first = 0; first < n; first += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, n - first);
    for (int64_t i = 0; i < count; i++) {
      const uint8_t* key = k + (first + i) * row;
      prefetch_ahead(key);
      f32xN kw[D], ks[kChains];  // the key, and each chain's scale (a q8 block's)
      for (int d = 0; d < D; d++) kw[d] = KV::raw(key, d);
      if constexpr (KV::kScaled)
        for (int c = 0; c < kChains; c++) ks[c] = f32xN{} + KV::scale(key, c * kChain);
      for (int g = 0; g < G; g++) {
        f32xN dot;
        for (int c = 0; c < kChains; c++) {
          f32xN part = qs[g][c * kChain] * kw[c * kChain];
          for (int d = 1; d < kChain; d++) part = fmaN(qs[g][c * kChain + d], kw[c * kChain + d], part);
          if constexpr (KV::kScaled) dot = c == 0 ? part * ks[0] : fmaN(part, ks[c], dot);
          else dot = c == 0 ? part : dot + part;
        }
        dots[g][i] = dot;
      }
    }
    for (int g = 0; g < G; g++) {
      for (int64_t i = count; i < kLanes; i++) dots[g][i] = f32xN{};
      const f32xN sums = sumsN(dots[g]);
      if (count == kLanes)  // a copy of fixed size: one store (a variable size was a `rep movs`)
        std::memcpy(scores + g * n + first, &sums, sizeof sums);
      else
        std::memcpy(scores + g * n + first, &sums, count * sizeof(float));
    }
  }
  for (int g = 0; g < G; g++) softmax_piece<typename KV::Weights>(scores + g * n, n, &out.top[g], &out.sum[g]);
  // The weighted sums of values P vectors of each at a time (G * P sums in registers: 12 of AVX2's 16), each
  // value's numbers read (and widened) once, the positions in order. One vector a pass made a pass over the
  // rows for every 8 numbers, and those loads (a row apart) were the step's slowest.
  constexpr int P = std::min(D, G <= 3 ? 4 : 2);
  for (int first = 0; first < D; first += P) {
    f32xN acc[G][P] = {};
    for (int64_t j = 0; j < n; j++) {
      const uint8_t* value = v + j * row;
      if (first == 0) prefetch_ahead(value);
      f32xN w[G];  // each group's weight of this value, times its block's scale: the int8 go in as they are
      for (int d = 0; d < P; d++) {
        if (d == 0 || (first + d) % KV::kVectorsPerScale == 0) {
          const float block_scale = KV::scale(value, first + d);
          for (int g = 0; g < G; g++) w[g] = f32xN{} + scores[g * n + j] * block_scale;
        }
        const f32xN vj = KV::raw(value, first + d);
        for (int g = 0; g < G; g++) acc[g][d] = fmaN(w[g], vj, acc[g][d]);
      }
    }
    for (int g = 0; g < G; g++)
      for (int d = 0; d < P; d++) std::memcpy(out.acc + g * head_dim + kLanes * (first + d), &acc[g][d], sizeof(f32xN));
  }
}

// The same for any head_dim, element by element. `scratch` holds groups * (head_dim + n) floats.
template <typename T, typename KV>
void attend_any(const T* q, const uint8_t* k, const uint8_t* v, int64_t groups, int64_t n, int64_t head_dim,
                float* scratch, Partial out) {
  const int64_t row = KV::row_bytes(head_dim);
  float* q_f = scratch;                       // (groups, head_dim)
  float* scores = scratch + groups * head_dim;  // (groups, n)
  const float scale = 1.f / std::sqrt(static_cast<float>(head_dim));
  for (int64_t i = 0; i < groups * head_dim; i++) q_f[i] = f32(q[i]);
  for (int64_t j = 0; j < n; j++) {
    const uint8_t* key = k + j * row;
    for (int64_t g = 0; g < groups; g++) {
      float dot = 0.f;
      for (int64_t d = 0; d < head_dim; d++) dot += q_f[g * head_dim + d] * KV::at(key, d);
      scores[g * n + j] = dot * scale;
    }
  }
  for (int64_t g = 0; g < groups; g++) {
    float* p = scores + g * n;
    softmax_piece<typename KV::Weights>(p, n, &out.top[g], &out.sum[g]);
    float* acc = out.acc + g * head_dim;
    std::fill(acc, acc + head_dim, 0.f);
    for (int64_t j = 0; j < n; j++) {
      const uint8_t* value = v + j * row;
      for (int64_t d = 0; d < head_dim; d++) acc[d] += p[j] * KV::at(value, d);
    }
  }
}

// attend_vectors for G = groups, 4 at most a call (G = 6: 4 then 2, each query head on its own in any case).
template <int C, typename T, typename KV>
void attend_groups(const T* q, const uint8_t* k, const uint8_t* v, int64_t groups, int64_t n, float* scores,
                   Partial out) {
  for (int64_t g = 0; g < groups; g += 4) {
    const Partial part{out.top + g, out.sum + g, out.acc + g * 16 * C};
    const T* qg = q + g * 16 * C;
    switch (std::min<int64_t>(4, groups - g)) {
      case 1: attend_vectors<C, 1, T, KV>(qg, k, v, n, scores, part); break;
      case 2: attend_vectors<C, 2, T, KV>(qg, k, v, n, scores, part); break;
      case 3: attend_vectors<C, 3, T, KV>(qg, k, v, n, scores, part); break;
      default: attend_vectors<C, 4, T, KV>(qg, k, v, n, scores, part); break;
    }
  }
}

template <typename T, typename KV>
void attend(const T* q, const uint8_t* k, const uint8_t* v, int64_t groups, int64_t n, int64_t head_dim,
            std::vector<float>& scratch, Partial out) {
  scratch.resize(groups * (head_dim + n));
  switch (head_dim) {
    case 16: return attend_groups<1, T, KV>(q, k, v, groups, n, scratch.data(), out);
    case 32: return attend_groups<2, T, KV>(q, k, v, groups, n, scratch.data(), out);
    case 64: return attend_groups<4, T, KV>(q, k, v, groups, n, scratch.data(), out);
    case 128: return attend_groups<8, T, KV>(q, k, v, groups, n, scratch.data(), out);
    default: return attend_any<T, KV>(q, k, v, groups, n, head_dim, scratch.data(), out);
  }
}

// out (head_dim) = the softmax-weighted sum of values of one query head from its `pieces` partial
// results, each rescaled from its own maximum to the largest.
template <typename T>
void merge(const float* top, const float* sum, const float* acc, int64_t pieces, int64_t stride, int64_t head_dim,
           T* out) {
  float best = top[0];
  for (int64_t i = 1; i < pieces; i++) best = std::max(best, top[i * stride]);
  float total = 0.f;
  for (int64_t i = 0; i < pieces; i++) total += sum[i * stride] * std::exp(top[i * stride] - best);
  for (int64_t d = 0; d < head_dim; d++) {
    float value = 0.f;
    for (int64_t i = 0; i < pieces; i++) value += acc[i * stride * head_dim + d] * std::exp(top[i * stride] - best);
    out[d] = T(value / total);
  }
}

// What the op was given, checked once: sizes, and raw pointers to the caches.
struct Step {
  int64_t batch, dim, n_layers, n_heads, n_kv_heads, head_dim, ffn_dim;
  float eps;
  at::TensorList norms, weights, scales;
  std::vector<std::optional<at::Tensor>> offsets;  // none, or one per weight (int4 blocks' offsets)
  std::vector<int64_t> positions, max_len;
  std::vector<void*> k_caches, v_caches;  // per sequence: (n_layers, 1, n_kv_heads, max_len, head_dim)

  // The `count` matrices from `first` of a layer, in a list of one entry per weight (or an empty list).
  template <typename T>
  static c10::ArrayRef<T> matrices(c10::ArrayRef<T> all, int64_t layer, Matrix first, int64_t count) {
    return all.empty() ? all : all.slice(layer * kLayerMatrices + first, count);
  }
  at::Tensor matvec(const at::Tensor& x, int64_t layer, Matrix first, int64_t count) const {
    return llama::matvec(x, matrices(weights, layer, first, count), matrices(scales, layer, first, count),
                         matrices(llama::Offsets(offsets), layer, first, count));
  }
};

// The share [begin, end) of n units that member `me` of `members` takes (all of them outside a team).
struct Range {
  int64_t begin, end;
};
inline Range share(int64_t n, int64_t me, int64_t members) { return {n * me / members, n * (me + 1) / members}; }

// Rotate the query heads that share KV head kv of sequence s and that key head, and write its key and value at
// the sequence's position: `qkv` row s is (n_heads + 2 n_kv_heads, head_dim).
template <typename T, typename KV>
void rotate_and_cache(const Step& st, int64_t layer, int64_t s, int64_t kv, T* qkv, const T* cos, const T* sin) {
  const int64_t d = st.head_dim, groups = st.n_heads / st.n_kv_heads, pos = st.positions[s];
  const int64_t row_bytes = KV::row_bytes(d);
  T* row = qkv + s * (st.n_heads + 2 * st.n_kv_heads) * d;
  for (int64_t g = 0; g < groups; g++) apply_rope(row + (kv * groups + g) * d, cos + s * d, sin + s * d, d);
  T* key = row + (st.n_heads + kv) * d;
  apply_rope(key, cos + s * d, sin + s * d, d);
  const int64_t head = (layer * st.n_kv_heads + kv) * st.max_len[s] * row_bytes;  // this layer's and head's rows
  KV::write(key, d, static_cast<uint8_t*>(st.k_caches[s]) + head + pos * row_bytes);
  KV::write(row + (st.n_heads + st.n_kv_heads + kv) * d, d,
            static_cast<uint8_t*>(st.v_caches[s]) + head + pos * row_bytes);
}

// Positions of one attention task: a long context is split so that both threads (or all) get a
// share of every layer's attention (by KV head alone, the default model's 3 heads went 2 and 1).
constexpr int64_t kPositionsPerTask = 256;

// Each sequence's attention over its cache, in tasks of (sequence, KV head, up to kPositionsPerTask
// positions), each task's partial results (its maximum, sum and weighted values per query head) kept until
// they are merged per query head. The same tasks in every layer of a step.
struct Attention {
  std::vector<int64_t> first{0};  // first[s]: sequence s's first task; (kv, piece) within it
  std::vector<int64_t> pieces;
  int64_t tasks, groups;
  std::vector<float> top, sum, acc;  // (tasks, groups), (tasks, groups), (tasks, groups, head_dim)

  explicit Attention(const Step& st) : groups(st.n_heads / st.n_kv_heads) {
    for (int64_t s = 0; s < st.batch; s++) {
      pieces.push_back((st.positions[s] + kPositionsPerTask) / kPositionsPerTask);  // of positions 0..pos
      first.push_back(first.back() + st.n_kv_heads * pieces.back());
    }
    tasks = first.back();
    top.resize(tasks * groups);
    sum.resize(tasks * groups);
    acc.resize(tasks * groups * st.head_dim);
  }

  // Tasks [range) of one layer.
  template <typename T, typename KV>
  void run(const Step& st, int64_t layer, const T* qkv, Range range, std::vector<float>& scratch) {
    const int64_t d = st.head_dim, row_bytes = KV::row_bytes(d);
    int64_t s = 0;
    for (int64_t task = range.begin; task < range.end; task++) {
      while (task >= first[s + 1]) s++;
      const int64_t kv = (task - first[s]) / pieces[s], piece = (task - first[s]) % pieces[s];
      const int64_t from = piece * kPositionsPerTask, n = std::min(kPositionsPerTask, st.positions[s] + 1 - from);
      const int64_t head = (layer * st.n_kv_heads + kv) * st.max_len[s] * row_bytes;
      const T* q = qkv + (s * (st.n_heads + 2 * st.n_kv_heads) + kv * groups) * d;  // the heads that share kv
      attend<T, KV>(q, static_cast<const uint8_t*>(st.k_caches[s]) + head + from * row_bytes,
                    static_cast<const uint8_t*>(st.v_caches[s]) + head + from * row_bytes, groups, n, d, scratch,
                    Partial{&top[task * groups], &sum[task * groups], &acc[task * groups * d]});
    }
  }

  // attn (b, n_heads * head_dim): query heads [range) of all b n_heads merged from their tasks' results.
  template <typename T>
  void merge_heads(const Step& st, Range range, T* attn) const {
    const int64_t d = st.head_dim;
    for (int64_t unit = range.begin; unit < range.end; unit++) {
      const int64_t s = unit / st.n_heads, kv = unit % st.n_heads / groups, g = unit % groups;
      const int64_t at = (first[s] + kv * pieces[s]) * groups + g;  // its first piece
      merge(&top[at], &sum[at], &acc[at * d], pieces[s], groups, d, attn + (s * st.n_heads + kv * groups + g) * d);
    }
  }
};

// SwiGLU's values are split between the members in pieces of this many from a row's start: the compiler computes
// exp in vectors (glibc's libmvec) and a loop's last few values one at a time, which round otherwise, so a value
// must fall in the vector part or the tail whatever share it is in: with pieces of a multiple of the vectors' width,
// only a row's last values are a tail, as when one thread computes the row.
constexpr int64_t kSwiGLUPiece = 64;

// A whole step's layers as member `me` of `members` (team.h: each member runs this with the same arguments;
// one member runs it alone outside a team). Each member keeps the residual stream and the norms' outputs
// of its own (the same numbers in each); the products' rows, RoPE and the caches' writes, the attention's
// tasks, its merge and SwiGLU are split between the members, who wait at a barrier before reading what the
// others wrote. Returns the new x (b, dim).
template <typename T, typename KV>
at::Tensor layers(const Step& st, const at::Tensor& x_in, const T* cos, const T* sin, Attention& attention,
                  const at::Tensor& attn, const at::Tensor& act, int64_t me, int64_t members) {
  llama::Team* team = llama::team();
  auto barrier = [&] {
    if (team) team->barrier();
  };
  at::Tensor x = x_in.clone();  // (b, dim): the residual stream, updated layer by layer
  at::Tensor h = at::empty_like(x);  // (b, dim): a norm's output
  T* xp = x.data_ptr<T>();
  T* hp = h.data_ptr<T>();
  T* attn_p = attn.data_ptr<T>();
  T* act_p = act.data_ptr<T>();
  const int64_t b = st.batch, dim = st.dim, ffn = st.ffn_dim;
  auto residual = [&](const at::Tensor& y) {  // x += y, y (b, dim)
    const T* yp = y.data_ptr<T>();
    for (int64_t i = 0; i < b * dim; i++) xp[i] = T(f32(xp[i]) + f32(yp[i]));
  };
  std::vector<float> scratch;  // attention's
  const Range heads = share(b * st.n_kv_heads, me, members), tasks = share(attention.tasks, me, members);
  const int64_t ffn_pieces = (ffn + kSwiGLUPiece - 1) / kSwiGLUPiece;
  const Range queries = share(b * st.n_heads, me, members), pieces = share(b * ffn_pieces, me, members);
  for (int64_t layer = 0; layer < st.n_layers; layer++) {
    const T* attention_norm = st.norms[2 * layer].data_ptr<T>();
    const T* ffn_norm = st.norms[2 * layer + 1].data_ptr<T>();

    for (int64_t s = 0; s < b; s++) rms_norm(xp + s * dim, attention_norm, dim, st.eps, hp + s * dim);
    at::Tensor qkv = st.matvec(h, layer, kWq, 3);  // (b, (n_heads + 2 n_kv_heads) head_dim)
    T* qkv_p = qkv.data_ptr<T>();
    for (int64_t unit = heads.begin; unit < heads.end; unit++)  // (sequence, KV head)
      rotate_and_cache<T, KV>(st, layer, unit / st.n_kv_heads, unit % st.n_kv_heads, qkv_p, cos, sin);
    barrier();  // every key and value in the caches
    attention.run<T, KV>(st, layer, qkv_p, tasks, scratch);
    barrier();  // every task's results
    attention.merge_heads(st, queries, attn_p);
    barrier();  // attn whole
    residual(st.matvec(attn, layer, kWo, 1));

    for (int64_t s = 0; s < b; s++) rms_norm(xp + s * dim, ffn_norm, dim, st.eps, hp + s * dim);
    at::Tensor gate_up = st.matvec(h, layer, kW1, 2);  // (b, 2 ffn_dim): gate | up
    const T* gu = gate_up.data_ptr<T>();
    for (int64_t unit = pieces.begin; unit < pieces.end; unit++) {  // (sequence, piece of kSwiGLUPiece values)
      const int64_t s = unit / ffn_pieces, from = unit % ffn_pieces * kSwiGLUPiece;
      const int64_t to = std::min(from + kSwiGLUPiece, ffn);
      for (int64_t j = from; j < to; j++) {
        const float gate = f32(gu[s * 2 * ffn + j]), up = f32(gu[s * 2 * ffn + ffn + j]);
        const float silu = stored<T>(gate / (1.f + std::exp(-gate)));
        act_p[s * ffn + j] = T(silu * up);
      }
    }
    barrier();  // act whole
    residual(st.matvec(act, layer, kW2, 1));
  }
  return x;
}

template <typename T, typename KV>
at::Tensor run(const Step& st, const at::Tensor& x, const at::Tensor& cos_t, const at::Tensor& sin_t) {
  at::Tensor attn = at::empty({st.batch, st.n_heads * st.head_dim}, x.options());
  at::Tensor act = at::empty({st.batch, st.ffn_dim}, x.options());  // silu(gate) * up
  Attention attention(st);
  const T* cos = cos_t.data_ptr<T>();
  const T* sin = sin_t.data_ptr<T>();
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  at::Tensor out;
  if (threads > 1 && llama::Team::run(threads, [&] {
        const int64_t me = llama::t_member.me;
        at::Tensor y = layers<T, KV>(st, x, cos, sin, attention, attn, act, me, threads);
        if (me == 0) out = y;
      }))
    return out;
  return layers<T, KV>(st, x, cos, sin, attention, attn, act, 0, 1);
}

void check_tensor(const char* what, const at::Tensor& t, at::ScalarType dtype, at::IntArrayRef sizes) {
  TORCH_CHECK(t.scalar_type() == dtype && t.sizes() == sizes && t.is_contiguous() && t.device().is_cpu(),
              "decode_layers: ", what, " must be a contiguous CPU tensor of ", dtype, " and shape ", sizes,
              "; got ", t.scalar_type(), " ", t.sizes(), t.is_contiguous() ? "" : " (not contiguous)", " on ",
              t.device());
}

// x (b, dim) through every layer: norms (2 per layer: attention_norm, ffn_norm), weights (7 per
// layer, Matrix's order), scales (none for bf16 weights, else one per weight: fp32 for int8, fp16
// for int4), offsets (none, or one per weight: an int4 matrix's fp16 offsets or none for Q4_0
// blocks, none for the other kinds), cos and sin (b, head_dim) rows of each sequence's position,
// k_caches and v_caches one per sequence (in x's dtype, or all in q8 blocks), written at positions[s]. Returns the new x; the caches
// are written in place.
at::Tensor decode_layers(const at::Tensor& x, at::TensorList norms, at::TensorList weights, at::TensorList scales,
                         const c10::List<std::optional<at::Tensor>>& offsets, const at::Tensor& cos,
                         const at::Tensor& sin, at::TensorList k_caches,
                         at::TensorList v_caches, at::IntArrayRef positions, int64_t n_heads, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRows &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "decode_layers: x must be float32 or bfloat16 of shape (b, dim) with 1 <= b <= ", kMaxRows, "; got ",
              x.scalar_type(), " ", x.sizes());
  Step st;
  st.batch = x.size(0);
  st.dim = x.size(1);
  st.n_layers = static_cast<int64_t>(norms.size()) / 2;
  st.n_heads = n_heads;
  st.head_dim = cos.dim() == 2 ? cos.size(1) : 0;
  st.eps = static_cast<float>(eps);
  st.norms = norms;
  st.weights = weights;
  st.scales = scales;
  st.offsets = offsets.vec();
  const auto dtype = x.scalar_type();
  TORCH_CHECK(st.n_layers >= 1 && norms.size() == 2 * st.n_layers &&
              weights.size() == kLayerMatrices * st.n_layers &&
              (scales.empty() || scales.size() == weights.size()) &&
              (offsets.empty() || offsets.size() == weights.size()),
              "decode_layers: expected 2 norms and ", kLayerMatrices, " weights a layer (and as many scales and ",
              "offsets, or none); got ", norms.size(), " norms, ", weights.size(), " weights, ", scales.size(),
              " scales, ", offsets.size(), " offsets");
  TORCH_CHECK(st.head_dim >= 2 && st.head_dim % 2 == 0 && n_heads >= 1,
              "decode_layers: cos must be (b, head_dim) with an even head_dim; got ", cos.sizes());
  st.n_kv_heads = k_caches.empty() ? 0 : k_caches[0].size(2);
  st.ffn_dim = weights[kW1].size(0);
  TORCH_CHECK(st.n_kv_heads >= 1 && n_heads % st.n_kv_heads == 0 && n_heads / st.n_kv_heads <= kMaxGroups,
              "decode_layers: ", st.n_kv_heads, " KV heads for ", n_heads, " query heads; expected a divisor, with at ",
              "most ", kMaxGroups, " query heads to a KV head");
  check_tensor("x", x, dtype, {st.batch, st.dim});
  check_tensor("cos", cos, dtype, {st.batch, st.head_dim});
  check_tensor("sin", sin, dtype, {st.batch, st.head_dim});
  for (int64_t layer = 0; layer < st.n_layers; layer++) {
    check_tensor("a norm weight", norms[2 * layer], dtype, {st.dim});
    check_tensor("a norm weight", norms[2 * layer + 1], dtype, {st.dim});
    const int64_t q_rows = n_heads * st.head_dim, kv_rows = st.n_kv_heads * st.head_dim;
    const int64_t rows[kLayerMatrices] = {q_rows, kv_rows, kv_rows, st.dim, st.ffn_dim, st.ffn_dim, st.dim};
    const int64_t cols[kLayerMatrices] = {st.dim, st.dim, st.dim, q_rows, st.dim, st.dim, st.ffn_dim};
    const at::Tensor* w = &weights[layer * kLayerMatrices];  // this layer's matrices
    for (int64_t m = 0; m < kLayerMatrices; m++) {
      // int4: two weights a byte; llama.cpp's blocks (N, K / block, bytes): the format's block of weights a row
      const ggml::Format* blocks = w[m].dim() == 3 ? ggml::format_of(w[m].size(2)) : nullptr;
      const int64_t per_byte = w[m].scalar_type() == at::kByte ? 2 : 1;
      const int64_t k = blocks ? w[m].size(1) * blocks->block : w[m].size(1) * per_byte;
      TORCH_CHECK((w[m].dim() == 2 || blocks) && w[m].size(0) == rows[m] && k == cols[m],
                  "decode_layers: layer ", layer, " matrix ", m, " is ", w[m].sizes(), " of ", w[m].scalar_type(),
                  "; expected (", rows[m], ", ", cols[m] / per_byte, ") or blocks of ", cols[m], " weights a row");
    }
  }
  TORCH_CHECK(k_caches.size() == static_cast<size_t>(st.batch) && v_caches.size() == k_caches.size() &&
              positions.size() == k_caches.size(),
              "decode_layers: ", st.batch, " rows of x but ", k_caches.size(), " key caches, ", v_caches.size(),
              " value caches and ", positions.size(), " positions");
  // every cache in x's dtype, or every one in q8 blocks (uint8): rows of head_dim / 32 blocks of 34 bytes
  const bool q8 = !k_caches.empty() && k_caches[0].scalar_type() == at::kByte;
  TORCH_CHECK(!q8 || st.head_dim % Q8::kBlock == 0, "decode_layers: q8 KV caches take a head_dim that is a multiple of ",
              Q8::kBlock, "; got ", st.head_dim);
  const auto cache_dtype = q8 ? at::kByte : dtype;
  const int64_t row = q8 ? Q8::row_bytes(st.head_dim) : st.head_dim;
  for (int64_t s = 0; s < st.batch; s++) {
    const int64_t max_len = k_caches[s].dim() == 5 ? k_caches[s].size(3) : 0;
    check_tensor("a key cache", k_caches[s], cache_dtype, {st.n_layers, 1, st.n_kv_heads, max_len, row});
    check_tensor("a value cache", v_caches[s], cache_dtype, {st.n_layers, 1, st.n_kv_heads, max_len, row});
    TORCH_CHECK(positions[s] >= 0 && positions[s] < max_len, "decode_layers: sequence ", s, " writes position ",
                positions[s], " of a cache that holds ", max_len);
    st.positions.push_back(positions[s]);
    st.max_len.push_back(max_len);
    st.k_caches.push_back(k_caches[s].data_ptr());
    st.v_caches.push_back(v_caches[s].data_ptr());
  }
  if (q8) return dtype == at::kBFloat16 ? run<BFloat16, Q8>(st, x, cos, sin) : run<float, Q8>(st, x, cos, sin);
  return dtype == at::kBFloat16 ? run<BFloat16, Plain<BFloat16>>(st, x, cos, sin) : run<float, Plain<float>>(st, x, cos, sin);
}

}  // namespace

// The op namespace is the build's name (see matvec.cpp, which defines the library).
#define FRAGMENT_LIBRARY(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define IMPL_LIBRARY(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

FRAGMENT_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("decode_layers(Tensor x, Tensor[] norms, Tensor[] weights, Tensor[] scales, Tensor?[] offsets, Tensor cos, "
        "Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, int[] positions, int n_heads, float eps) -> Tensor");
  m.def("teams() -> int", [] { return llama::Team::steps_run.load(); });  // steps that ran as a team (team.h)
}

IMPL_LIBRARY(TORCH_EXTENSION_NAME, CPU, m) { m.impl("decode_layers", decode_layers); }
