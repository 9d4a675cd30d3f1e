// Quantized weight matrices widened to fp32 or bf16 for prefill, which multiplies hundreds of rows of x
// by each matrix and so goes to F.linear (oneDNN) rather than to the decode kernel. model/linear.py
// widens a block of rows at a time (blockwise_linear); model/quantize.py's dequantize_int8/_int4 are
// the reference these loops are tested against. In ATen ops the same work took several passes over
// an fp32 copy (unpack the nibbles, multiply, add, convert); here it is one pass, rows split across
// threads, that writes each weight once in the dtype F.linear takes.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "dot_portable.h"  // fp16_to_float
#include "ggml_blocks.h"

namespace {

using portable::fp16_to_float;

// fp32 rounded to bf16, to nearest even (a NaN to 0x7FC0), as c10::BFloat16(float) rounds: eight at a time where
// the build has AVX2 (the one-at-a-time conversion, with its NaN test, did not vectorize: it took as long as the rest
// of a block's widening).
void round_to_bf16(const float* __restrict src, c10::BFloat16* __restrict dst, int64_t n) {
  int64_t j = 0;
#if defined(__AVX2__)
  const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1), nan = _mm256_set1_epi32(0x7FC0);
  for (; j + 8 <= n; j += 8) {
    const __m256 x = _mm256_loadu_ps(src + j);
    const __m256i bits = _mm256_castps_si256(x);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(bits, 16), one))), 16);
    r = _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j),
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
  }
#endif
  for (; j < n; j++) dst[j] = c10::BFloat16(src[j]);
}

// out (N, K) in fp32 or bf16; fill(r, row) writes row r's K weights in fp32: into the output's row (fp32), or into
// a buffer of the thread's own that is then rounded to bf16.
template <typename Fill>
at::Tensor widen(int64_t n, int64_t k, at::ScalarType dtype, Fill fill) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize: to float32 or bfloat16, not ", dtype);
  at::Tensor out = at::empty({n, k}, at::TensorOptions().dtype(dtype));
  const bool bf16 = dtype == at::kBFloat16;
  float* f32 = bf16 ? nullptr : out.data_ptr<float>();
  c10::BFloat16* b16 = bf16 ? out.data_ptr<c10::BFloat16>() : nullptr;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(bf16 ? k : 0);
    for (int64_t r = begin; r < end; r++) {
      if (bf16) {
        fill(r, buffer.data());
        round_to_bf16(buffer.data(), b16 + r * k, k);
      } else {
        fill(r, f32 + r * k);
      }
    }
  });
  return out;
}

// int4 blocks of 32 (model/quantize.py): byte j of a block holds weight j in its low nibble and
// weight 16 + j in its high one; weight = q * scale + offset, offset -8 * scale where there is none.
at::Tensor dequantize_int4(const at::Tensor& packed, const at::Tensor& scale, const std::optional<at::Tensor>& offset,
                           at::ScalarType dtype) {
  constexpr int64_t kBlock = 32;
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "dequantize_int4: packed weights must be contiguous uint8 (N, K / 2)");
  const int64_t n = packed.size(0), k = packed.size(1) * 2, blocks = k / kBlock;
  TORCH_CHECK(k % kBlock == 0, "dequantize_int4: K = ", k, " is not whole blocks of ", kBlock);
  auto check = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.scalar_type() == at::kHalf && t.is_contiguous() && t.dim() == 2 && t.size(0) == n &&
                    t.size(1) == blocks,
                "dequantize_int4: ", what, " must be contiguous float16 (", n, ", ", blocks, ")");
    return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>());
  };
  const uint16_t* s = check(scale, "scale");
  const uint16_t* o = offset.has_value() ? check(*offset, "offset") : nullptr;
  const uint8_t* w = packed.data_ptr<uint8_t>();
  return widen(n, k, dtype, [&](int64_t r, float* __restrict dst) {
    for (int64_t b = 0; b < blocks; b++) {
      const float sc = fp16_to_float(s[r * blocks + b]);
      const float off = o ? fp16_to_float(o[r * blocks + b]) : -8.f * sc;
      const uint8_t* __restrict bytes = w + (r * blocks + b) * (kBlock / 2);
      float* __restrict out = dst + b * kBlock;
#if defined(__AVX2__)
      // The same q * sc + off (a product, then a sum: two roundings) eight weights at a time: the loops below did
      // not vectorize, and took 5 times as long a weight as int8's.
      const __m128i packed16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));  // 32 nibbles
      const __m128i low = _mm_and_si128(packed16, _mm_set1_epi8(0x0F));                   // weights 0..15
      const __m128i high = _mm_and_si128(_mm_srli_epi16(packed16, 4), _mm_set1_epi8(0x0F));  // weights 16..31
      const __m256 vsc = _mm256_set1_ps(sc), voff = _mm256_set1_ps(off);
      const __m128i eights[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
      for (int i = 0; i < 4; i++) {
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eights[i]));
        _mm256_storeu_ps(out + 8 * i, _mm256_add_ps(_mm256_mul_ps(q, vsc), voff));
      }
#else
      for (int j = 0; j < kBlock / 2; j++) out[j] = static_cast<float>(bytes[j] & 0x0F) * sc + off;
      for (int j = 0; j < kBlock / 2; j++) out[j + kBlock / 2] = static_cast<float>(bytes[j] >> 4) * sc + off;
#endif
    }
  });
}

// int8 weights with one fp32 scale per group of a row: weight = q * scale.
at::Tensor dequantize_int8(const at::Tensor& q, const at::Tensor& scale, at::ScalarType dtype) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(),
              "dequantize_int8: weights must be contiguous int8 (N, K)");
  const int64_t n = q.size(0), k = q.size(1);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2 && scale.size(0) == n &&
                  scale.size(1) > 0 && k % scale.size(1) == 0,
              "dequantize_int8: scale must be contiguous float32 (", n, ", groups of K = ", k, ")");
  const int64_t groups = scale.size(1), group = k / groups;
  const int8_t* w = q.data_ptr<int8_t>();
  const float* s = scale.data_ptr<float>();
  return widen(n, k, dtype, [&](int64_t r, float* __restrict dst) {
    for (int64_t g = 0; g < groups; g++) {
      const float sc = s[r * groups + g];
      const int8_t* __restrict in = w + r * k + g * group;
      float* __restrict out = dst + g * group;
      for (int64_t j = 0; j < group; j++) out[j] = static_cast<float>(in[j]) * sc;
    }
  });
}

// Blocks of llama.cpp's formats (ggml_blocks.h), uint8 (N, K / block, bytes), each weight as the gguf library
// computes it.
at::Tensor dequantize_blocks(const at::Tensor& w, at::ScalarType dtype) {
  const ggml::Format* f = w.dim() == 3 ? ggml::format_of(w.size(2)) : nullptr;
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && f != nullptr,
              "dequantize_blocks: weights must be contiguous uint8 (N, K / block, bytes) of a block format; got ",
              w.scalar_type(), " ", w.sizes());
  const int64_t n = w.size(0), blocks = w.size(1);
  const uint8_t* data = w.data_ptr<uint8_t>();
  return widen(n, blocks * f->block, dtype, [&](int64_t r, float* __restrict dst) {
    ggml::dequantize(*f, data + r * blocks * f->bytes, blocks, dst);
  });
}

}  // namespace

// As in matvec.cpp: a macro between, so that TORCH_EXTENSION_NAME is expanded before it is pasted.
#define FRAGMENT_LIBRARY(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define IMPL_LIBRARY(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

FRAGMENT_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("dequantize_int4(Tensor w, Tensor scale, Tensor? offset, ScalarType dtype) -> Tensor");
  m.def("dequantize_int8(Tensor w, Tensor scale, ScalarType dtype) -> Tensor");
  m.def("dequantize_blocks(Tensor w, ScalarType dtype) -> Tensor");
}

IMPL_LIBRARY(TORCH_EXTENSION_NAME, CPU, m) {
  m.impl("dequantize_int4", dequantize_int4);
  m.impl("dequantize_int8", dequantize_int8);
  m.impl("dequantize_blocks", dequantize_blocks);
}
