// Prefill's products with weights in llama.cpp's blocks (ggml_blocks.h): y = x W^T for the hundreds of rows of
// a prompt chunk, x rounded to int8 as the decode kernel rounds it (one scale per 256 values, as llama.cpp's
// Q8_K, or per 32) and multiplied by the blocks' integers: 64 products an instruction with AVX-512 VNNI's
// vpdpbusd (u8 weights times s8 x, four products summed into each int32 lane), 32 with AVX2's vpmaddubsw and
// vpmaddwd. Widening the blocks to bf16 for F.linear (dequantize.cpp) multiplied 32 an instruction and wrote
// every weight out and read it back first; on AVX2 CPUs, to fp32, 8.
//
// The weights are taken kLanes rows at a time (a tile). Each row's blocks are unpacked once into ggml_blocks.h's
// form (weight = a (q - z) - m per group of 16) and laid out so that one vector holds four consecutive q of each
// of the tile's rows: q[group][j][row][4 weights 4j..4j+3], beside a[group][row] and bias[group][row] = -(a z + m).
// A vector of int32 lanes then sums, lane by lane, one weight row's products with a broadcast four values of x:
//   y[m][r] = sum over x's scales s: xs[m][s] sum over its groups g (a[g][r] dot[g][r][m] + bias[g][r] sum16[m][g])
// where dot is the integer dot product of the group's 16 q with x's 16 int8 and sum16 the sum of those int8
// (exact in int32; the fp32 sums go in that order). Every row of x goes through the tile, kXRows at a time sharing
// each load of weights; the tiles are split across torch's threads. A row's result does not depend on the rows
// beside it.
//
// Built where the CPU has AVX2 (the op is absent from plain x86-64 builds, where model/linear.py widens). On
// CPUs with AMX, oneDNN's bf16 tiles multiply faster than this and model/linear.py keeps widening.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "ggml_blocks.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

using ggml::kGroup;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr int kLanes = 16;  // weight rows a tile: one int32 or fp32 lane each
constexpr int kXRows = 8;  // rows of x sharing each load of the tile's weights (3 registers a row: dot, part, acc)
using VecI = __m512i;
using VecF = __m512;
inline VecI load_i(const uint8_t* p) { return _mm512_load_si512(p); }
inline VecF load_f(const float* p) { return _mm512_load_ps(p); }
inline VecI zero_i() { return _mm512_setzero_si512(); }
inline VecF zero_f() { return _mm512_setzero_ps(); }
inline VecF broadcast(float v) { return _mm512_set1_ps(v); }
inline VecF to_float(VecI v) { return _mm512_cvtepi32_ps(v); }
inline VecF fmadd(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
// dot + four products of u8 w with the same four s8 x in every lane, summed
inline VecI dot4(VecI dot, VecI w, int32_t x4) { return _mm512_dpbusd_epi32(dot, w, _mm512_set1_epi32(x4)); }
inline void store(float* p, VecF v, int lanes) { _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << lanes) - 1), v); }
#else
constexpr int kLanes = 8;
constexpr int kXRows = 4;  // (16 registers)
using VecI = __m256i;
using VecF = __m256;
inline VecI load_i(const uint8_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }
inline VecF load_f(const float* p) { return _mm256_load_ps(p); }
inline VecI zero_i() { return _mm256_setzero_si256(); }
inline VecF zero_f() { return _mm256_setzero_ps(); }
inline VecF broadcast(float v) { return _mm256_set1_ps(v); }
inline VecF to_float(VecI v) { return _mm256_cvtepi32_ps(v); }
inline VecF fmadd(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline VecI dot4(VecI dot, VecI w, int32_t x4) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(dot, w, _mm256_set1_epi32(x4));
#else  // pairs of products in int16 (q <= 63, |x| <= 127: at most 16,002), then pairs of pairs in int32
  const __m256i pairs = _mm256_maddubs_epi16(w, _mm256_set1_epi32(x4));
  return _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}
inline void store(float* p, VecF v, int lanes) {
  alignas(32) float all[kLanes];
  _mm256_store_ps(all, v);
  std::memcpy(p, all, lanes * sizeof(float));
}
#endif

// A tile of kLanes weight rows, unpacked (see the top): groups = K / 16.
struct Tile {
  std::vector<uint8_t> q_buffer;
  std::vector<float> a_buffer, bias_buffer;
  uint8_t* q = nullptr;
  float *a = nullptr, *bias = nullptr;

  void resize(int64_t groups) {
    q = aligned(q_buffer, groups * kGroup * kLanes);
    a = aligned(a_buffer, groups * kLanes);
    bias = aligned(bias_buffer, groups * kLanes);
  }
  template <typename T>
  static T* aligned(std::vector<T>& buffer, int64_t n) {
    buffer.resize(n + 64 / sizeof(T));
    return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) / 64 * 64);
  }
};

// rows (<= kLanes) weight rows of `blocks` blocks each, from `w`, into the tile; lanes past them hold zeros.
void unpack_tile(const ggml::Format& f, const uint8_t* w, int rows, int64_t blocks, Tile& t) {
  const int64_t groups = blocks * f.block / kGroup, per_block = f.block / kGroup;
  if (rows < kLanes) {
    std::memset(t.q, 0, groups * kGroup * kLanes);
    std::memset(t.a, 0, groups * kLanes * sizeof(float));
    std::memset(t.bias, 0, groups * kLanes * sizeof(float));
  }
  ggml::Unpacked u;
  for (int r = 0; r < rows; r++) {
    const uint8_t* row = w + r * blocks * f.bytes;
    for (int64_t b = 0; b < blocks; b++) {
      f.unpack(row + b * f.bytes, u);
      for (int64_t i = 0; i < per_block; i++) {
        const int64_t g = b * per_block + i;
        t.a[g * kLanes + r] = u.a[i];
        t.bias[g * kLanes + r] = -(u.a[i] * static_cast<float>(u.z) + u.m[i]);
        for (int j = 0; j < 4; j++) std::memcpy(t.q + ((g * 4 + j) * kLanes + r) * 4, u.q + i * kGroup + 4 * j, 4);
      }
    }
  }
}

// x rounded to int8 (ggml::round_x_row), with each 16 values' sum as fp32 for the bias's products.
struct XRows {
  at::Tensor q, scales, sums;  // int8 (M, K), fp32 (M, K / group), fp32 (M, K / 16)
  int64_t group;
};

XRows round_x(const at::Tensor& x) {
  const int64_t rows = x.size(0), k_dim = x.size(1), group = k_dim % 256 == 0 ? 256 : ggml::kXBlock;
  XRows out{at::empty({rows, k_dim}, x.options().dtype(at::kChar)),
            at::empty({rows, k_dim / group}, x.options().dtype(at::kFloat)),
            at::empty({rows, k_dim / kGroup}, x.options().dtype(at::kFloat)), group};
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> widened(k_dim);
    std::vector<int16_t> sums(k_dim / kGroup);
    for (int64_t m = begin; m < end; m++) {
      const float* row = widened.data();
      if (x.scalar_type() == at::kFloat) {
        row = x.data_ptr<float>() + m * k_dim;
      } else {
        const c10::BFloat16* xb = x.data_ptr<c10::BFloat16>() + m * k_dim;
        for (int64_t k = 0; k < k_dim; k++) widened[k] = static_cast<float>(xb[k]);
      }
      ggml::round_x_row(row, k_dim, group, out.q.data_ptr<int8_t>() + m * k_dim, sums.data(),
                        out.scales.data_ptr<float>() + m * (k_dim / group));
      float* fsums = out.sums.data_ptr<float>() + m * (k_dim / kGroup);
      for (int64_t g = 0; g < k_dim / kGroup; g++) fsums[g] = static_cast<float>(sums[g]);
    }
  });
  return out;
}

// Rows m0 .. m0 + XR - 1 of x through the tile: y[m][0 .. lanes - 1] for each, y's rows `ld` apart.
template <int XR>
void tile_rows(const Tile& t, int64_t groups, const XRows& x, int64_t m0, float* y, int64_t ld, int lanes) {
  const int64_t k_dim = groups * kGroup, per_scale = x.group / kGroup;
  const int8_t* xq = x.q.data_ptr<int8_t>() + m0 * k_dim;
  const float* xs = x.scales.data_ptr<float>() + m0 * (k_dim / x.group);
  const float* sums = x.sums.data_ptr<float>() + m0 * groups;
  VecF acc[XR];
  for (int m = 0; m < XR; m++) acc[m] = zero_f();
  for (int64_t s = 0; s < groups / per_scale; s++) {
    VecF part[XR];
    for (int m = 0; m < XR; m++) part[m] = zero_f();
    for (int64_t g = s * per_scale; g < (s + 1) * per_scale; g++) {
      VecI dot[XR];
      for (int m = 0; m < XR; m++) dot[m] = zero_i();
      for (int j = 0; j < 4; j++) {
        const VecI w = load_i(t.q + (g * 4 + j) * kLanes * 4);
        for (int m = 0; m < XR; m++) {
          int32_t x4;
          std::memcpy(&x4, xq + m * k_dim + g * kGroup + 4 * j, 4);
          dot[m] = dot4(dot[m], w, x4);
        }
      }
      const VecF a = load_f(t.a + g * kLanes), bias = load_f(t.bias + g * kLanes);
      for (int m = 0; m < XR; m++) {
        part[m] = fmadd(to_float(dot[m]), a, part[m]);
        part[m] = fmadd(bias, broadcast(sums[m * groups + g]), part[m]);
      }
    }
    for (int m = 0; m < XR; m++) acc[m] = fmadd(part[m], broadcast(xs[m * (k_dim / x.group) + s]), acc[m]);
  }
  for (int m = 0; m < XR; m++) store(y + m * ld, acc[m], lanes);
}

// The rows of x left after whole groups of kXRows, one compiled loop each count.
template <int XR = kXRows - 1>
void tail_rows(int rows, const Tile& t, int64_t groups, const XRows& x, int64_t m0, float* y, int64_t ld, int lanes) {
  if constexpr (XR >= 1) {
    if (rows == XR) return tile_rows<XR>(t, groups, x, m0, y, ld, lanes);
    tail_rows<XR - 1>(rows, t, groups, x, m0, y, ld, lanes);
  }
}

// y = x W_i^T for x (M, K) fp32 or bf16 and weights in llama.cpp's blocks, uint8 (N_i, K / block, bytes) each, of
// any of ggml_blocks.h's formats: outputs side by side (M, sum N_i) in x's dtype.
at::Tensor prefill_blocks(const at::Tensor& x, at::TensorList ws) {
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
    first_tile.push_back(first_tile.back() + (t.size(0) + kLanes - 1) / kLanes);
    first_column.push_back(first_column.back() + t.size(0));
  }
  at::Tensor y = at::empty({rows, first_column.back()}, x.options().dtype(at::kFloat));
  if (rows == 0) return y.to(x.scalar_type());
  const XRows xq = round_x(x);
  const int64_t groups = k_dim / kGroup, ld = y.size(1);
  float* out = y.data_ptr<float>();
  at::parallel_for(0, first_tile.back(), 1, [&](int64_t begin, int64_t end) {
    thread_local Tile tile;
    tile.resize(groups);
    for (int64_t task = begin; task < end; task++) {
      size_t i = 0;
      while (first_tile[i + 1] <= task) i++;
      const ggml::Format& f = *formats[i];
      const int64_t r0 = (task - first_tile[i]) * kLanes, n = ws[i].size(0), blocks = ws[i].size(1);
      const int lanes = static_cast<int>(std::min<int64_t>(kLanes, n - r0));
      unpack_tile(f, ws[i].data_ptr<uint8_t>() + r0 * blocks * f.bytes, lanes, blocks, tile);
      float* y0 = out + first_column[i] + r0;
      int64_t m = 0;
      for (; m + kXRows <= rows; m += kXRows) tile_rows<kXRows>(tile, groups, xq, m, y0 + m * ld, ld, lanes);
      if (m < rows) tail_rows(static_cast<int>(rows - m), tile, groups, xq, m, y0 + m * ld, ld, lanes);
    }
  });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace

// As in matvec.cpp: a macro between, so that TORCH_EXTENSION_NAME is expanded before it is pasted.
#define FRAGMENT_LIBRARY(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define IMPL_LIBRARY(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

FRAGMENT_LIBRARY(TORCH_EXTENSION_NAME, m) { m.def("prefill_blocks(Tensor x, Tensor[] w) -> Tensor"); }

IMPL_LIBRARY(TORCH_EXTENSION_NAME, CPU, m) { m.impl("prefill_blocks", prefill_blocks); }

#endif
