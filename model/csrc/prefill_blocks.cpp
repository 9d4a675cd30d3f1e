// Prefill's products with weights in llama.cpp's blocks (ggml_blocks.h): y = x W^T for the hundreds of rows of
// a prompt chunk, x rounded to int8 as the decode kernel rounds it (one scale per 256 values, as llama.cpp's
// Q8_K, or per 32) and multiplied by the blocks' integers: 64 products an instruction with AVX-512 VNNI's
// vpdpbusd (four u8 times s8 products summed into each int32 lane), 32 with AVX2's vpmaddubsw and vpmaddwd.
// Widening the blocks to bf16 for F.linear (dequantize.cpp) multiplied 32 an instruction and wrote every weight
// out and read it back first; on AVX2 CPUs, to fp32, 8.
//
// A vector's lanes are kLanes rows of x (a panel), each lane four of its int8 made unsigned (+128), and each
// weight row's four integers w = q - z (ggml_blocks.h's form: weight = a (q - z) - min per group of 16) are
// broadcast to every lane. For row i of x and weight row r:
//   y[i][r] = sum over x's scales s: xs[i][s] sum over its groups g (a[r][g] dot[i][r][g] - min[r][g] sum16[i][g])
//   dot = sum (x + 128) w - 128 sum w   (the second sum is the weight row's, set as the sum's start)
// exact in int32; then the fp32 sums in that order, two groups at a time where they share a and m (Q4_K, Q5_K,
// Q5_0, Q5_1). The weight rows are taken kTileRows at a time, each row's blocks unpacked once (Format::unpack);
// every panel of x goes through a tile, kRows weight rows at a time sharing each load of x; the tiles are split
// across torch's threads. A row's result does not depend on the rows of x beside it.
//
// Built where the CPU has AVX2 (the op is absent from plain x86-64 builds, where model/linear.py widens). On
// CPUs with AMX, oneDNN's bf16 tiles multiply faster than this and model/linear.py keeps widening.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ggml_blocks.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

using ggml::kGroup;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr int kLanes = 16;  // rows of x a panel: one int32 or fp32 lane each
constexpr int kRows = 8;  // weight rows sharing each load of x (3 registers a row: dot, part, acc)
using VecI = __m512i;
using VecF = __m512;
inline VecI load_i(const uint8_t* p) { return _mm512_load_si512(p); }
inline VecF load_f(const float* p) { return _mm512_load_ps(p); }
inline VecI broadcast_i(int32_t v) { return _mm512_set1_epi32(v); }
inline VecF broadcast_f(float v) { return _mm512_set1_ps(v); }
inline VecF zero_f() { return _mm512_setzero_ps(); }
inline VecF add_f(VecF a, VecF b) { return _mm512_add_ps(a, b); }
inline VecF to_float(VecI v) { return _mm512_cvtepi32_ps(v); }
inline VecF fmadd(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
// dot + in each lane the four products of its u8 x with the same four s8 w, summed
inline VecI dot4(VecI dot, VecI x, const int8_t* w) {
  int32_t w4;
  std::memcpy(&w4, w, 4);
  return _mm512_dpbusd_epi32(dot, x, _mm512_set1_epi32(w4));
}
inline void store_f(float* p, VecF v) { _mm512_store_ps(p, v); }
#else
constexpr int kLanes = 8;
constexpr int kRows = 4;  // (16 registers)
using VecI = __m256i;
using VecF = __m256;
inline VecI load_i(const uint8_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }
inline VecF load_f(const float* p) { return _mm256_load_ps(p); }
inline VecI broadcast_i(int32_t v) { return _mm256_set1_epi32(v); }
inline VecF broadcast_f(float v) { return _mm256_set1_ps(v); }
inline VecF zero_f() { return _mm256_setzero_ps(); }
inline VecF add_f(VecF a, VecF b) { return _mm256_add_ps(a, b); }
inline VecF to_float(VecI v) { return _mm256_cvtepi32_ps(v); }
inline VecF fmadd(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline VecI dot4(VecI dot, VecI x, const int8_t* w) {
  int32_t w4;
  std::memcpy(&w4, w, 4);
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(dot, x, _mm256_set1_epi32(w4));
#else  // pairs of products in int16 (x + 128 <= 255, -32 <= w <= 63: within 2 * 255 * 63 = 32,130), then in int32
  const __m256i pairs = _mm256_maddubs_epi16(x, _mm256_set1_epi32(w4));
  return _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}
inline void store_f(float* p, VecF v) { _mm256_store_ps(p, v); }
#endif

constexpr int kTileRows = 4 * kRows;  // weight rows unpacked at a time (a task)

template <typename T>
T* aligned(std::vector<T>& buffer, int64_t n) {
  buffer.resize(n + 64 / sizeof(T));
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) / 64 * 64);
}

// kTileRows weight rows unpacked, groups = K / 16: w = q - z (rows, K) int8; per row and group (rows, groups):
// a, -m, and the start of its dot products, -128 sum w (for two groups that share a and m, both sums in the first).
struct Tile {
  std::vector<int8_t> w_buffer;
  std::vector<float> a_buffer, neg_m_buffer;
  std::vector<int32_t> start_buffer;
  int8_t* w = nullptr;
  float *a = nullptr, *neg_m = nullptr;
  int32_t* start = nullptr;

  void resize(int64_t groups) {
    w = aligned(w_buffer, groups * kGroup * kTileRows);
    a = aligned(a_buffer, groups * kTileRows);
    neg_m = aligned(neg_m_buffer, groups * kTileRows);
    start = aligned(start_buffer, groups * kTileRows);
  }
};

// `rows` (<= kTileRows) weight rows of `blocks` blocks each, from `w`, into the tile; rows past them are zeros.
void unpack_tile(const ggml::Format& f, const uint8_t* w, int rows, int64_t blocks, Tile& t) {
  const int64_t k_dim = blocks * f.block, groups = k_dim / kGroup, per_block = f.block / kGroup;
  if (rows < kTileRows) {
    std::memset(t.w + rows * k_dim, 0, (kTileRows - rows) * k_dim);
    std::fill(t.a + rows * groups, t.a + kTileRows * groups, 0.f);
    std::fill(t.neg_m + rows * groups, t.neg_m + kTileRows * groups, 0.f);
    std::fill(t.start + rows * groups, t.start + kTileRows * groups, 0);
  }
  const bool pairs = f.scale_group == 2 * kGroup;
  ggml::Unpacked u;
  for (int r = 0; r < rows; r++) {
    const uint8_t* row = w + r * blocks * f.bytes;
    int8_t* out = t.w + r * k_dim;
    float *a = t.a + r * groups, *neg_m = t.neg_m + r * groups;
    int32_t* start = t.start + r * groups;
    for (int64_t b = 0; b < blocks; b++) {
      f.unpack(row + b * f.bytes, u);
      const __m128i z = _mm_set1_epi8(static_cast<char>(u.z));
      for (int64_t i = 0; i < per_block; i++) {
        const __m128i q = _mm_load_si128(reinterpret_cast<const __m128i*>(u.q + i * kGroup));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + (b * per_block + i) * kGroup), _mm_sub_epi8(q, z));
        const __m128i halves = _mm_sad_epu8(q, _mm_setzero_si128());  // the sums of q's two halves
        const int32_t sum = _mm_cvtsi128_si32(halves) + _mm_extract_epi16(halves, 4) - kGroup * u.z;
        const int64_t g = b * per_block + i;
        a[g] = u.a[i];
        neg_m[g] = -u.m[i];
        start[g] = -128 * sum;
        if (pairs && i % 2 == 1) start[g - 1] += start[g];
      }
    }
  }
}

// x rounded to int8 (ggml::round_x_row), in panels of kLanes rows: per panel, x + 128 as u8 (groups, 4, kLanes, 4)
// (lane m of vector (g, j): x[m][16 g + 4 j ..+ 3]), the scales (K / group, kLanes) and each 16 values' sum of int8
// (groups, kLanes) as fp32. Lanes past the last row are x = 0.
struct Panels {
  at::Tensor u, scales, sums;
  int64_t group;
};

Panels round_x(const at::Tensor& x) {
  const int64_t rows = x.size(0), k_dim = x.size(1), group = k_dim % 256 == 0 ? 256 : ggml::kXBlock;
  const int64_t panels = (rows + kLanes - 1) / kLanes, groups = k_dim / kGroup;
  Panels out{at::full({panels, k_dim * kLanes}, 128, x.options().dtype(at::kByte)),
             at::zeros({panels, k_dim / group * kLanes}, x.options().dtype(at::kFloat)),
             at::zeros({panels, groups * kLanes}, x.options().dtype(at::kFloat)), group};
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> widened(k_dim), scales(k_dim / group);
    std::vector<int8_t> q(k_dim);
    std::vector<int16_t> sums(groups);
    for (int64_t m = begin; m < end; m++) {
      const float* row = widened.data();
      if (x.scalar_type() == at::kFloat) {
        row = x.data_ptr<float>() + m * k_dim;
      } else {
        const c10::BFloat16* xb = x.data_ptr<c10::BFloat16>() + m * k_dim;
        for (int64_t k = 0; k < k_dim; k++) widened[k] = static_cast<float>(xb[k]);
      }
      ggml::round_x_row(row, k_dim, group, q.data(), sums.data(), scales.data());
      const int64_t panel = m / kLanes, lane = m % kLanes;
      uint8_t* u = out.u.data_ptr<uint8_t>() + panel * k_dim * kLanes;
      for (int64_t k4 = 0; k4 < k_dim / 4; k4++)
        for (int i = 0; i < 4; i++) u[(k4 * kLanes + lane) * 4 + i] = static_cast<uint8_t>(q[4 * k4 + i] + 128);
      float* xs = out.scales.data_ptr<float>() + panel * (k_dim / group) * kLanes;
      for (int64_t s = 0; s < k_dim / group; s++) xs[s * kLanes + lane] = scales[s];
      float* xsum = out.sums.data_ptr<float>() + panel * groups * kLanes;
      for (int64_t g = 0; g < groups; g++) xsum[g * kLanes + lane] = static_cast<float>(sums[g]);
    }
  });
  return out;
}

// One panel of x through kRows rows of a tile (from row r0): y[m][r] for the panel's `lanes` rows and `rows` weight
// rows, y's rows `ld` apart. Pairs: two groups share a and m; Mins: m is not always 0.
template <bool Pairs, bool Mins>
void panel_rows(const Tile& t, int r0, int64_t groups, const Panels& x, int64_t panel, float* y, int64_t ld,
                int lanes, int rows) {
  constexpr int step = Pairs ? 2 : 1;
  const int64_t k_dim = groups * kGroup, per_scale = x.group / kGroup;
  const uint8_t* xu = x.u.data_ptr<uint8_t>() + panel * k_dim * kLanes;
  const float* xs = x.scales.data_ptr<float>() + panel * (k_dim / x.group) * kLanes;
  const float* xsum = x.sums.data_ptr<float>() + panel * groups * kLanes;
  const int8_t* w = t.w + r0 * k_dim;
  const float *a = t.a + r0 * groups, *neg_m = t.neg_m + r0 * groups;
  const int32_t* start = t.start + r0 * groups;
  VecF acc[kRows];
  for (int r = 0; r < kRows; r++) acc[r] = zero_f();
  for (int64_t s = 0; s < groups / per_scale; s++) {
    VecF part[kRows];
    for (int r = 0; r < kRows; r++) part[r] = zero_f();
    for (int64_t g = s * per_scale; g < (s + 1) * per_scale; g += step) {
      VecI dot[kRows];
      for (int r = 0; r < kRows; r++) dot[r] = broadcast_i(start[r * groups + g]);
      for (int h = 0; h < step; h++)
        for (int j = 0; j < 4; j++) {
          const VecI xv = load_i(xu + ((g + h) * 4 + j) * kLanes * 4);
          for (int r = 0; r < kRows; r++) dot[r] = dot4(dot[r], xv, w + r * k_dim + (g + h) * kGroup + 4 * j);
        }
      for (int r = 0; r < kRows; r++) part[r] = fmadd(to_float(dot[r]), broadcast_f(a[r * groups + g]), part[r]);
      if constexpr (Mins) {
        VecF sums = load_f(xsum + g * kLanes);
        if constexpr (Pairs) sums = add_f(sums, load_f(xsum + (g + 1) * kLanes));
        for (int r = 0; r < kRows; r++) part[r] = fmadd(sums, broadcast_f(neg_m[r * groups + g]), part[r]);
      }
    }
    const VecF scale = load_f(xs + s * kLanes);
    for (int r = 0; r < kRows; r++) acc[r] = fmadd(part[r], scale, acc[r]);
  }
  alignas(64) float out[kRows][kLanes];
  for (int r = 0; r < kRows; r++) store_f(out[r], acc[r]);
  for (int m = 0; m < lanes; m++)
    for (int r = 0; r < rows; r++) y[m * ld + r] = out[r][m];
}

using PanelRows = void (*)(const Tile&, int, int64_t, const Panels&, int64_t, float*, int64_t, int, int);

PanelRows panel_rows_for(const ggml::Format& f) {
  const bool pairs = f.scale_group == 2 * kGroup;
  if (pairs) return f.minimums ? panel_rows<true, true> : panel_rows<true, false>;
  return f.minimums ? panel_rows<false, true> : panel_rows<false, false>;
}

// y = x W_i^T for x (M, K) fp32 or bf16 and weights in llama.cpp's blocks, uint8 (N_i, K / block, bytes) each, of
// any of ggml_blocks.h's formats: outputs side by side (M, sum N_i) in x's dtype, or in fp32 with fp32_out.
at::Tensor prefill_blocks(const at::Tensor& x, at::TensorList ws, bool fp32_out) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu() &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "prefill_blocks: x must be a contiguous float32 or bfloat16 CPU tensor (M, K); got ", x.scalar_type(),
              " ", x.sizes());
  TORCH_CHECK(!ws.empty(), "prefill_blocks: no weight matrices");
  const int64_t rows = x.size(0), k_dim = x.size(1);
  std::vector<const ggml::Format*> formats;
  std::vector<int64_t> first_tile{0}, first_column{0};
  for (size_t i = 0; i < ws.size(); i++) {
    const at::Tensor& t = ws[i];
    const ggml::Format* f = t.dim() == 3 ? ggml::format_of(t.size(2)) : nullptr;
    TORCH_CHECK(t.scalar_type() == at::kByte && t.is_contiguous() && t.device().is_cpu() && f != nullptr,
                "prefill_blocks: w[", i, "] must be a contiguous uint8 CPU tensor (N, K / block, bytes) of a ",
                "block format (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1); got ", t.scalar_type(), " ", t.sizes());
    TORCH_CHECK(t.size(1) * f->block == k_dim, "prefill_blocks: w[", i, "] holds ", t.size(1), " ", f->name,
                " blocks a row (", t.size(1) * f->block, " weights) but x has K=", k_dim);
    formats.push_back(f);
    first_tile.push_back(first_tile.back() + (t.size(0) + kTileRows - 1) / kTileRows);
    first_column.push_back(first_column.back() + t.size(0));
  }
  at::Tensor y = at::empty({rows, first_column.back()}, x.options().dtype(at::kFloat));
  const at::ScalarType out_type = fp32_out ? at::kFloat : x.scalar_type();
  if (rows == 0) return y.to(out_type);
  const Panels panels = round_x(x);
  const int64_t groups = k_dim / kGroup, ld = y.size(1), panel_count = panels.u.size(0);
  float* out = y.data_ptr<float>();
  at::parallel_for(0, first_tile.back(), 1, [&](int64_t begin, int64_t end) {
    thread_local Tile tile;
    tile.resize(groups);
    for (int64_t task = begin; task < end; task++) {
      size_t i = 0;
      while (first_tile[i + 1] <= task) i++;
      const ggml::Format& f = *formats[i];
      const int64_t r0 = (task - first_tile[i]) * kTileRows, n = ws[i].size(0), blocks = ws[i].size(1);
      const int tile_rows = static_cast<int>(std::min<int64_t>(kTileRows, n - r0));
      unpack_tile(f, ws[i].data_ptr<uint8_t>() + r0 * blocks * f.bytes, tile_rows, blocks, tile);
      const PanelRows run = panel_rows_for(f);
      for (int64_t p = 0; p < panel_count; p++) {
        const int lanes = static_cast<int>(std::min<int64_t>(kLanes, rows - p * kLanes));
        for (int r = 0; r < tile_rows; r += kRows)
          run(tile, r, groups, panels, p, out + p * kLanes * ld + first_column[i] + r0 + r, ld, lanes,
              std::min(kRows, tile_rows - r));
      }
    }
  });
  return y.to(out_type);
}

}  // namespace

// As in matvec.cpp: a macro between, so that TORCH_EXTENSION_NAME is expanded before it is pasted.
#define FRAGMENT_LIBRARY(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define IMPL_LIBRARY(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

FRAGMENT_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("prefill_blocks(Tensor x, Tensor[] w, bool fp32_out=False) -> Tensor");
}

IMPL_LIBRARY(TORCH_EXTENSION_NAME, CPU, m) { m.impl("prefill_blocks", prefill_blocks); }

#endif
