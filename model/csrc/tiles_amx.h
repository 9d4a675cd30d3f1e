// AMX tiles (Intel Sapphire Rapids and later): bf16 weights times a few rows of bf16 x, for batches.
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
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#define HAVE_AMX 1

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
// flight), 2 and 3 hold A, 4 and 5 hold B. Loaded by each thread before its tiles are used
// (the configuration is per thread, and oneDNN sets its own).
struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row
  uint8_t rows[16] = {};

  explicit Config(int64_t m) {
    for (int t = 0; t < 6; t++) {
      rows[t] = kTileRows;
      colsb[t] = t == 2 || t == 3 ? kTileK * 2 : m * 4;  // A: 32 bf16; C: M fp32; B: M pairs of bf16
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

}  // namespace amx
#endif
