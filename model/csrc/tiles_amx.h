// AMX tiles (Intel Sapphire Rapids and later): bf16 or int8 weights times a few rows of x, for batches.
//
// With one row of x, every kernel of matvec.cpp is bound by memory: a weight is read and used once.
// With 8 rows each weight takes part in 8 products, and on Sapphire Rapids the AVX-512 loop
// (vdpbf16ps, 32 products an instruction) became bound by arithmetic: w2 of the 1B shape took 2.3 ms
// at 8 rows against 1.35 ms at one. One tile instruction, tdpbf16ps, takes 16 rows of weights
// times 32 of K times up to 16 rows of x: 4096 products at 8 rows, so a batch of 8 streams the
// weights at memory speed again.
//
// The operands, for C (16, M) += A (16, 32) B (32, M) in fp32:
//   A: 16 rows of W (N, K), 32 bf16 weights each, loaded straight from W with W's row stride;
//   B: x transposed in pairs, the layout tdpbf16ps asks of its second operand: row p holds for each
//      row m of x the pair x[m, k0 + 2p], x[m, k0 + 2p + 1] (pair_rows writes it once per call);
//   C: 16 outputs (weight rows) for each of the M rows of x.
//
// int8 weights likewise with tdpbssd (int8 times int8 into int32), where one tile step of K is one
// group of the weights' scales (32 or 64 weights): x is rounded to int8 per group, and each step's
// int32 sums are scaled by that group's weight and x scales and added up in fp32 (rows_times_x_int8).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <vector>

#define HAVE_AMX 1
#if defined(__AMX_INT8__)
#define HAVE_AMX_INT8 1
#endif

namespace amx {

constexpr int64_t kTileRows = 16;  // weight rows (outputs) per tile
constexpr int64_t kTileK = 32;  // bf16 weights per row of a tile: 64 bytes
constexpr int64_t kMaxRows = 16;  // rows of x a tile holds

// Linux hands a process the tile registers' state only when asked, once (arch_prctl); false where
// the kernel refuses (too old, or disabled), and the caller keeps to AVX-512.
inline bool enabled() {
  static const bool ok = [] {
    constexpr int kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return ok;
}

// Tile shapes for M rows of x: tiles 0 and 1 accumulate C (even and odd steps of K, two chains in
// flight), 2 and 3 hold A (a_bytes of each of 16 weight rows), 4 and 5 hold B (b_rows rows of M
// 4-byte pieces of x). Loaded by each thread before its tiles are used (the configuration is per
// thread, and oneDNN sets its own). The defaults are bf16's: 32 weights, 16 pairs of K.
struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row
  uint8_t rows[16] = {};

  explicit Config(int64_t m, int64_t a_bytes = kTileK * 2, int64_t b_rows = kTileK / 2) {
    for (int t = 0; t < 6; t++) {
      rows[t] = t >= 4 ? b_rows : kTileRows;
      colsb[t] = t == 2 || t == 3 ? a_bytes : m * 4;  // C: M fp32 or int32; B: M pairs or quads
    }
  }
};

// x (M, K) bf16 -> (K / 2, M) pairs of bf16: B's layout for every step of K. Each pair is 32 bits.
inline void pair_rows(const uint16_t* x, int64_t m_rows, int64_t k_dim, uint32_t* pairs) {
  const auto* x32 = reinterpret_cast<const uint32_t*>(x);  // (M, K / 2) pairs
  for (int64_t p = 0; p < k_dim / 2; p++)
    for (int64_t m = 0; m < m_rows; m++) pairs[p * m_rows + m] = x32[m * (k_dim / 2) + p];
}

// out (16, M) fp32 = rows w[0..16) of W (row stride k_dim) times the M rows of x given as pairs;
// K a multiple of 32. The tiles must be configured (Config(M)). No prefetch instructions: each of
// the 16 rows is a stream the hardware prefetcher follows, and asking for each row's next lines (as
// the AVX-512 loops do) or for the next block of rows made w2 of the 1B shape 1.17x slower at 8 rows.
inline void rows_times_x(const uint16_t* w, int64_t k_dim, const uint32_t* pairs, int64_t m_rows, float* out) {
  const int64_t w_stride = k_dim * 2, pairs_stride = m_rows * 4;  // bytes between tile rows
  _tile_zero(0);
  _tile_zero(1);
  int64_t k = 0;
  for (; k + 2 * kTileK <= k_dim; k += 2 * kTileK) {
    _tile_loadd(2, w + k, w_stride);
    _tile_loadd(4, pairs + k / 2 * m_rows, pairs_stride);
    _tile_dpbf16ps(0, 2, 4);
    _tile_loadd(3, w + k + kTileK, w_stride);
    _tile_loadd(5, pairs + (k + kTileK) / 2 * m_rows, pairs_stride);
    _tile_dpbf16ps(1, 3, 5);
  }
  if (k < k_dim) {  // an odd number of steps: the last
    _tile_loadd(2, w + k, w_stride);
    _tile_loadd(4, pairs + k / 2 * m_rows, pairs_stride);
    _tile_dpbf16ps(0, 2, 4);
  }
  float odd[kTileRows * kMaxRows];
  _tile_stored(0, out, pairs_stride);
  _tile_stored(1, odd, pairs_stride);
  for (int64_t i = 0; i < kTileRows * m_rows; i++) out[i] += odd[i];
}

#ifdef HAVE_AMX_INT8
// out (16, M) fp32 = rows w[0..16) of an int8 W (row stride k_dim) times M rows of x rounded to int8
// per group of `group` (32 or 64) weights: x_quads (K / 4, M) 32-bit quads of x's int8 values
// (tdpbssd's second operand), x_scales (K / group, M), and w_scales the rows' scales (row r's group g
// at w_scales[r * scales_stride + g]). The tiles must be configured: Config(M, group, group / 4). Each
// output is the sum over groups, in order, of its int32 dot product times both scales. `next`: the
// 16 rows likely to come after these (or null), asked into L2 a line per row and group meanwhile.
//
// Why ask for the next rows: an int8 row of K = 2048 is 2 KB, and the hardware prefetcher, which
// follows each of the 16 rows by itself, was still learning a row when the block was done (int8 tiles
// streamed 16-18 GB/s on q|k|v of the 1B shape, bf16 tiles with their 4 KB rows 25); asked for, 21-22.
//
// A group's C tile, stored, is 16 * M int32 in (row, m) order: M vectors of 16. Lane l of vector v is
// row (16 v + l) / M and x row (16 v + l) % M, so its scale is a permutation of the 16 rows' scales
// times one of the M x scales: two vpermps and a multiply per vector, the rows' scales transposed
// once per call to one vector per group. While one pair of groups is scaled, the tiles of the next
// pair are already on their way (two buffers).
template <int M>
inline void rows_times_x_int8(const int8_t* w, const int8_t* next, int64_t k_dim, int64_t group,
                              const float* w_scales, int64_t scales_stride, const int32_t* x_quads,
                              const float* x_scales, float* out) {
  constexpr int64_t kQuadsStride = M * 4;  // bytes between rows of B and of C
  const int64_t groups = k_dim / group, quads_per_group = group / 4 * M;
  thread_local std::vector<float> scales;  // (groups, 16): the rows' scales, group by group
  scales.resize(groups * kTileRows);
  for (int64_t r = 0; r < kTileRows; r++)
    for (int64_t g = 0; g < groups; g++) scales[g * kTileRows + r] = w_scales[r * scales_stride + g];
  __m512i row_of[M], x_of[M];  // per vector of C: each lane's weight row and x row
  for (int v = 0; v < M; v++) {
    alignas(64) int32_t rows[16], xs[16];
    for (int l = 0; l < 16; l++) rows[l] = (16 * v + l) / M, xs[l] = (16 * v + l) % M;
    row_of[v] = _mm512_load_si512(rows);
    x_of[v] = _mm512_load_si512(xs);
  }
  __m512 acc[M];
  for (int v = 0; v < M; v++) acc[v] = _mm512_setzero_ps();
  alignas(64) int32_t sums[2][2][kTileRows * M];  // [buffer][group of the pair]
  auto tiles = [&](int64_t g, int32_t (&into)[2][kTileRows * M]) {  // groups g and g + 1 (if any)
    for (int64_t r = 0; next != nullptr && r < kTileRows; r++) {
      _mm_prefetch(reinterpret_cast<const char*>(next + r * k_dim + g * group), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next + r * k_dim + (g + 1) * group), _MM_HINT_T1);
    }
    _tile_zero(0);
    _tile_loadd(2, w + g * group, k_dim);
    _tile_loadd(4, x_quads + g * quads_per_group, kQuadsStride);
    _tile_dpbssd(0, 2, 4);
    if (g + 1 < groups) {
      _tile_zero(1);
      _tile_loadd(3, w + (g + 1) * group, k_dim);
      _tile_loadd(5, x_quads + (g + 1) * quads_per_group, kQuadsStride);
      _tile_dpbssd(1, 3, 5);
    }
    _tile_stored(0, into[0], kQuadsStride);
    if (g + 1 < groups) _tile_stored(1, into[1], kQuadsStride);
  };
  auto add = [&](const int32_t* sum, int64_t g) {  // acc += sum * the group's scales
    const __m512 row_scales = _mm512_loadu_ps(scales.data() + g * kTileRows);
    const __m512 x_scales_g = _mm512_maskz_loadu_ps((1u << M) - 1, x_scales + g * M);
    for (int v = 0; v < M; v++) {
      const __m512 scale = _mm512_mul_ps(_mm512_permutexvar_ps(row_of[v], row_scales),
                                         _mm512_permutexvar_ps(x_of[v], x_scales_g));
      acc[v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sum + 16 * v)), scale, acc[v]);
    }
  };
  tiles(0, sums[0]);
  for (int64_t g = 0; g < groups; g += 2) {
    const int buffer = (g / 2) % 2;
    if (g + 2 < groups) tiles(g + 2, sums[1 - buffer]);
    add(sums[buffer][0], g);
    if (g + 1 < groups) add(sums[buffer][1], g + 1);
  }
  for (int v = 0; v < M; v++) _mm512_storeu_ps(out + 16 * v, acc[v]);
}
#endif

}  // namespace amx
#endif
