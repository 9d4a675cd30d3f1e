// y = x W^T for a few rows of x (decode: one new token per sequence), reading 16-bit, 8-bit or 4-bit
// weights (or 32-bit ones) at memory bandwidth.
//
// Decoding multiplies every weight matrix by M <= 8 rows, so its speed is the speed at which
// weights stream from memory. PyTorch's CPU linear for a few rows runs well below bandwidth
// (oneDNN's bf16 kernels are tuned for many rows; fp32 weights are twice the bytes). These ops read
// each weight once for all M rows of x, split the weight rows across torch's threads, and take x
// and give y in x's dtype (fp32 or bf16). Each op takes several matrices of the same K and gives
// their outputs side by side (q|k|v, gate|up in one call and one parallel region).
//
// The instruction set is chosen when this file is compiled: AVX-512 (with vdpbf16ps where the CPU
// has AVX-512 BF16), else AVX2 + FMA, else plain loops the compiler vectorizes (dot_*.h). Where the
// CPU has AMX, bf16 and int8 products of several rows of x take its tiles (tiles_amx.h).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "dot_portable.h"
#include "ggml_blocks.h"
#include "matvec.h"
#include "team.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
#include "dot_avx512.h"
namespace isa = avx512;
#if defined(__AVX2__) && defined(__FMA__)
#include "dot_avx2.h"
namespace int16_q4 = avx2;  // int4 with x in int16, where int8_x is off (tests' close comparisons): AVX2's loops
#else
namespace int16_q4 = portable;
#endif
#define HAVE_Q4_INT8_X 1  // int4 weights take x rounded to int8 per block (avx512::dot_q4_x8)
#define HAVE_Q8_QUADS 1  // int8 weights take four groups a register (avx512::dot_q8_quads)
#if defined(__AVX512BF16__)
#define HAVE_BF16_DOT 1
constexpr const char* kPath = "AVX-512 BF16";
#else
constexpr const char* kPath = "AVX-512";
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "dot_avx2.h"
namespace isa = avx2;
namespace int16_q4 = avx2;
#define HAVE_Q4_INT8_X 1  // int4 weights take x rounded to int8 per block (avx2::dot_q4_x8)
constexpr const char* kPath = "AVX2";
#else
namespace isa = portable;
namespace int16_q4 = portable;
constexpr const char* kPath = "portable";
#endif

#include "tiles_amx.h"  // defines HAVE_AMX where the build's -march has AMX tiles with bf16

#ifndef TORCH_EXTENSION_NAME  // set by torch.utils.cpp_extension to the name the build was given
#define TORCH_EXTENSION_NAME llama_kernels
#endif

namespace {

using c10::BFloat16;
using llama::Share;

constexpr int64_t kMaxRows = 8;  // rows of x per call: model/linear.py's MAX_KERNEL_ROWS
constexpr float kOnes[kMaxRows] = {1, 1, 1, 1, 1, 1, 1, 1};  // the row scales of x that is not rescaled

// Calls f(std::integral_constant<int, M>{}) for the runtime rows = M in 1..kMaxRows, so each M gets
// its own compiled loop with its accumulators in registers.
template <typename F>
void with_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    default: TORCH_CHECK(false, "x has ", rows, " rows; the decode kernel takes 1 to ", kMaxRows);
  }
}

// Threads for a product of `bytes` of weights: at least ~64 KB each, so a share is worth waking one for.
int64_t threads_for(int64_t bytes) {
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), bytes / (64 * 1024)));
}

// f(first * task, ...) for the tasks of `shares[me]` until it is empty, then the back half of what is left of
// another's (which becomes mine) until every share is empty. shares: `count` of them.
template <typename F>
void take_tasks(Share* shares, int64_t count, int64_t me, int64_t n, int64_t task, const F& f) {
  std::atomic<uint64_t>& mine = shares[me].tasks;
  for (;;) {
    uint64_t v = mine.load(std::memory_order_relaxed);
    int64_t first = v >> 32, last = v & 0xffffffffu;
    if (first < last) {  // the next task of my share
      if (mine.compare_exchange_weak(v, uint64_t(first + 1) << 32 | last))
        f(first * task, std::min(n, (first + 1) * task));
      continue;
    }
    bool stole = false;  // mine is done: the back half of another's, which becomes mine
    for (int64_t k = 1; k < count && !stole; k++) {
      std::atomic<uint64_t>& other = shares[(me + k) % count].tasks;
      uint64_t w = other.load(std::memory_order_relaxed);
      for (;;) {
        const int64_t lo = w >> 32, hi = w & 0xffffffffu;
        if (lo >= hi) break;
        const int64_t mid = lo + (hi - lo) / 2;  // one task left: take it
        if (other.compare_exchange_weak(w, uint64_t(lo) << 32 | mid)) {
          mine.store(uint64_t(mid) << 32 | hi);
          stole = true;
          break;
        }
      }
    }
    if (!stole) return;
  }
}

// f(begin, end) over rows [0, n), `task` rows at a time, on `threads` threads. Each thread starts on
// a contiguous share, as at::parallel_for would give it, but takes it a task at a time, and a thread
// whose share is done takes the back half of what is left of another's. Why not parallel_for's
// fixed shares: with as many threads as cores, any other process that wakes up (the web server, a
// client, the desktop) takes a core from one of them for a while, and the others then waited for
// that thread's whole share; now they go on with it (a served stream, docs/benchmarks.md).
// In a team (team.h) every member calls this with the same arguments: one member a task at most starts on a
// share, the others only take from theirs, and all wait at the end until f has run for every row.
template <typename F>
void parallel_rows(int64_t n, int64_t task, int64_t threads, const F& f) {
  const int64_t tasks = (n + task - 1) / task;
  TORCH_CHECK(tasks < (int64_t(1) << 31), "parallel_rows: ", tasks, " tasks");
  if (llama::Team* team = llama::team()) {
    // Every share is empty here: the last call's members took every task before its barrier. The members
    // that start on a share are counted from what every member sees alike (`threads` comes from
    // at::get_num_threads(), which a member thread of the region may read otherwise than the caller: then
    // a share was never handed out, and its rows never computed).
    (void)threads;
    const int64_t me = llama::t_member.me, starters = std::min(tasks, team->size());
    if (me < starters)
      team->shares()[me].tasks.store(uint64_t(tasks * me / starters) << 32 | uint64_t(tasks * (me + 1) / starters));
    take_tasks(team->shares(), team->size(), me, n, task, f);
    team->barrier();
    return;
  }
  threads = std::min(threads, tasks);
  if (threads <= 1 || at::in_parallel_region()) {
    f(0, n);
    return;
  }
  std::unique_ptr<Share[]> shares(new Share[threads]);
  for (int64_t t = 0; t < threads; t++)
    shares[t].tasks = uint64_t(tasks * t / threads) << 32 | uint64_t(tasks * (t + 1) / threads);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t me = begin; me < end; me++) take_tasks(shares.get(), threads, me, n, task, f);
  });
}

// A tensor every member of a team computes with (a product's output): made once, by member 0; outside a
// team, made.
template <typename Make>
at::Tensor shared(Make&& make) {
  if (llama::Team* team = llama::team()) return team->one(make);
  return make();
}

// x is (K,) or (M, K); returns M. Each w is (N, K / per_byte): per_byte weights in a byte (int4: 2).
int64_t check(const char* op, const at::Tensor& x, at::TensorList ws, at::ScalarType dtype, int64_t per_byte = 1) {
  TORCH_CHECK((x.dim() == 1 || x.dim() == 2) && x.is_contiguous() && x.device().is_cpu() &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              op, ": x must be a contiguous float32 or bfloat16 CPU tensor of shape (K,) or (M, K); got ",
              x.scalar_type(), " ", x.sizes(), x.is_contiguous() ? "" : " (not contiguous)", " on ", x.device());
  const int64_t rows = x.dim() == 1 ? 1 : x.size(0);
  TORCH_CHECK(rows >= 1 && rows <= kMaxRows, op, ": x has ", rows, " rows; expected 1 to ", kMaxRows);
  TORCH_CHECK(!ws.empty(), op, ": no weight matrices");
  for (size_t i = 0; i < ws.size(); i++) {
    const at::Tensor& w = ws[i];
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == dtype && w.is_contiguous() && w.device().is_cpu(),
                op, ": w[", i, "] must be a contiguous (N, K) CPU tensor of ", dtype, "; got ", w.scalar_type(),
                " ", w.sizes(), w.is_contiguous() ? "" : " (not contiguous)", " on ", w.device());
    TORCH_CHECK(w.size(1) * per_byte == x.size(-1), op, ": w[", i, "] is ", w.sizes(),
                per_byte == 1 ? "" : " (two weights a byte)", " but x has K=", x.size(-1));
  }
  return rows;
}

// Rows of x are read in pieces of K that fit in L1 (kXBytes for all M rows together): for several
// rows, x of a whole row of K = 2048 or more would be read from L2 for every weight row. The
// weight rows of a thread's share are taken kBlockRows at a time, piece by piece.
constexpr int64_t kXBytes = 32 * 1024;
constexpr int64_t kBlockRows = 8;
// Rows a thread takes at a time (parallel_rows), in bytes of weights: one compare-and-swap per task.
constexpr int64_t kTaskBytes = 32 * 1024;

// Weights per piece of K: K itself where kMaxRows rows of x fit in kXBytes, else the largest multiple
// of `align` (the step of the loops, or the int8 group) whose x fits. The same pieces for any number of
// rows: a row's sum is its pieces' sums added in order, so it must not depend on the rows beside it.
int64_t piece(int64_t k_dim, int64_t x_bytes, int64_t align) {
  const int64_t fits = kXBytes / (kMaxRows * x_bytes) / align * align;
  return fits >= k_dim || fits == 0 ? k_dim : fits;
}

// The dtype of y: x's, or fp32 where asked for (the output head: logits keep the sums' every digit).
at::ScalarType out_type(const at::Tensor& x, bool fp32_out) { return fp32_out ? at::kFloat : x.scalar_type(); }

// y[m, n] = row_scale[m] * sum over pieces of out[m], where dot(i, r, k0, len, out) gives the dot
// products of weights k0..k0+len of row r of matrix i (output n) with every row m of x; in
// parallel over n, y in dtype `out` (fp32 or bf16), (N,) for x (K,) and (M, N) for x (M, K).
// A dot(i, r, count, k0, len, out) takes `count` <= R neighbouring rows of matrix i at once (out: (count, M));
// a row's sums must not depend on whether it came alone.
template <int M, int R = 1, typename Dot>
at::Tensor rows_to(const at::Tensor& x, at::ScalarType out, at::TensorList ws, int64_t bytes_per_weight,
                   int64_t x_bytes, int64_t align, const float* row_scale, Dot dot) {
  std::vector<int64_t> first{0};  // first[i]: the output index of matrix i's row 0
  for (const at::Tensor& w : ws) first.push_back(first.back() + w.size(0));
  const int64_t n_total = first.back(), k_dim = x.size(-1);
  const int64_t len = piece(k_dim, x_bytes, align);
  // The same sums in either loop order; where these M rows of x fit in L1 whole, rows are taken one
  // after the other (one row of x read by pieces of the weights spread over 8 rows left the prefetcher
  // behind: 1B's w2, one row, 100 -> 70 GB/s).
  const bool whole_rows = M * k_dim * x_bytes <= kXBytes;
  at::Tensor y = shared([&] {
    return x.dim() == 1 ? at::empty({n_total}, x.options().dtype(out)) : at::empty({M, n_total}, x.options().dtype(out));
  });
  const bool bf16 = out == at::kBFloat16;
  float* yf = bf16 ? nullptr : y.data_ptr<float>();
  BFloat16* yb = bf16 ? y.data_ptr<BFloat16>() : nullptr;
  // Tasks of whole blocks of rows, at least kTaskBytes of weights each.
  const int64_t row_bytes = k_dim * bytes_per_weight;
  const int64_t task = (std::max<int64_t>(1, kTaskBytes / row_bytes) + kBlockRows - 1) / kBlockRows * kBlockRows;
  parallel_rows(n_total, task, threads_for(n_total * row_bytes), [&](int64_t begin, int64_t end) {
    float out[R][M], sums[kBlockRows][M];
    size_t block_matrix = 0;
    for (int64_t n0 = begin; n0 < end; n0 += kBlockRows) {
      const int64_t n1 = std::min(end, n0 + kBlockRows);
      while (n0 >= first[block_matrix + 1]) block_matrix++;
      // sums[n..n + count) += the piece's dot products of rows n..n + count. A kernel that takes a count of rows
      // puts the first piece's straight in sums, read only after the block of rows: read back at once, out[]
      // waited for the kernel's stores (stores read in wider loads are not forwarded), a quarter of int4's time.
      auto add_piece = [&](size_t i, int64_t n, int64_t count, int64_t k0) {
        if constexpr (std::is_invocable_v<Dot&, size_t, int64_t, int64_t, int64_t, int64_t, float*>) {
          dot(i, n - first[i], count, k0, std::min(len, k_dim - k0), k0 == 0 ? sums[n - n0] : out[0]);
          if (k0 > 0)
            for (int64_t c = 0; c < count; c++)
              for (int m = 0; m < M; m++) sums[n - n0 + c][m] += out[c][m];
        } else {
          dot(i, n - first[i], k0, std::min(len, k_dim - k0), out[0]);
          for (int m = 0; m < M; m++) sums[n - n0][m] = (k0 == 0 ? 0.f : sums[n - n0][m]) + out[0][m];
        }
      };
      // Up to R neighbouring rows of one matrix from n on.
      auto rows_from = [&](size_t i, int64_t n) -> int64_t {
        if constexpr (R == 1) return 1;
        else return std::min<int64_t>({R, n1 - n, first[i + 1] - n});
      };
      size_t i = block_matrix;
      if (whole_rows) {  // a row at a time, in order: its weights stream on into the next row's
        for (int64_t n = n0, count; n < n1; n += count) {
          while (n >= first[i + 1]) i++;
          count = rows_from(i, n);
          for (int64_t k0 = 0; k0 < k_dim; k0 += len) add_piece(i, n, count, k0);
        }
      } else {  // a piece of every row at a time, the piece of x staying in L1
        for (int64_t k0 = 0; k0 < k_dim; k0 += len) {
          i = block_matrix;
          for (int64_t n = n0, count; n < n1; n += count) {
            while (n >= first[i + 1]) i++;
            count = rows_from(i, n);
            add_piece(i, n, count, k0);
          }
        }
      }
      for (int64_t n = n0; n < n1; n++) {
        for (int m = 0; m < M; m++) {
          const float v = sums[n - n0][m] * row_scale[m];
          if (bf16) yb[m * n_total + n] = BFloat16(v); else yf[m * n_total + n] = v;
        }
      }
    }
  });
  return y;
}

#ifdef HAVE_AMX
// Where bf16 x takes the tiles. Measured on Sapphire Rapids, weights from memory (docs/benchmarks.md):
// with K of 1536 to 8192 the tiles streamed as fast as the AVX-512 loop at 2 rows and 1.1-1.9x faster
// at 3-8, where that loop runs out of arithmetic; with rows of K = 576 (the default model) they were
// 0.84-0.96x at 2-6 rows and 1.01-1.04x at 8, so rows shorter than 1024 (a line between the two)
// keep to the AVX-512 loop. A matrix that takes them takes them for one row too: the tiles and the loop
// add in other orders, and a sequence's tokens must not depend on how many decode beside it.
constexpr int64_t kAmxMinRows = 1, kAmxMinK = 1024;
std::atomic<bool> use_amx{true};

// Shapes the tiles take whole and fast: K a multiple of 32 and at least kAmxMinK, every matrix's N
// a multiple of 16 (every Llama matrix but those of K = 576).
bool amx_fits(at::TensorList ws, int64_t k_dim) {
  if (k_dim % amx::kTileK != 0 || k_dim < kAmxMinK) return false;
  for (const at::Tensor& w : ws)
    if (w.size(0) % amx::kTileRows != 0) return false;
  return true;
}

// y = x W_i^T for bf16 x of 1-8 rows with AMX tiles (tiles_amx.h), 16 weight rows at a time, the
// blocks split across threads as in rows_to.
at::Tensor matvec_amx(const at::Tensor& x, at::TensorList ws, int64_t rows, at::ScalarType out_dtype) {
  const int64_t k_dim = x.size(-1);
  std::vector<int64_t> first{0};  // first[i]: the output index of matrix i's row 0
  std::vector<const uint16_t*> w;
  for (const at::Tensor& t : ws) {
    first.push_back(first.back() + t.size(0));
    w.push_back(reinterpret_cast<const uint16_t*>(t.data_ptr()));
  }
  const int64_t n_total = first.back();
  thread_local std::vector<uint32_t> buffer;  // the calling thread's, reused from call to call
  buffer.resize(k_dim / 2 * rows);
  amx::pair_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), rows, k_dim, buffer.data());
  const uint32_t* pairs = buffer.data();  // (the workers see their own thread_local, not this one)
  const at::TensorOptions options = x.options().dtype(out_dtype);
  at::Tensor y = shared([&] { return x.dim() == 1 ? at::empty({n_total}, options) : at::empty({rows, n_total}, options); });
  const bool bf16 = out_dtype == at::kBFloat16;
  BFloat16* yb = bf16 ? y.data_ptr<BFloat16>() : nullptr;
  float* yf = bf16 ? nullptr : y.data_ptr<float>();
  const int64_t row_bytes = k_dim * 2;
  const int64_t task = (std::max<int64_t>(1, kTaskBytes / row_bytes) + amx::kTileRows - 1) / amx::kTileRows *
                       amx::kTileRows;
  parallel_rows(n_total, task, threads_for(n_total * row_bytes), [&](int64_t begin, int64_t end) {
    const amx::Config config(rows);
    _tile_loadconfig(&config);
    float out[amx::kTileRows * amx::kMaxRows];  // (16, rows)
    size_t i = 0;
    for (int64_t n0 = begin; n0 < end; n0 += amx::kTileRows) {
      while (n0 >= first[i + 1]) i++;
      amx::rows_times_x(w[i] + (n0 - first[i]) * k_dim, k_dim, pairs, rows, out);
      for (int64_t r = 0; r < amx::kTileRows; r++)
        for (int64_t m = 0; m < rows; m++) {
          if (bf16) yb[m * n_total + n0 + r] = BFloat16(out[r * rows + m]);
          else yf[m * n_total + n0 + r] = out[r * rows + m];
        }
    }
    _tile_release();
  });
  return y;
}
#endif

// Switches the AMX tiles on or off for bf16 and int8 products (tests and benchmarks compare the two
// paths); returns the setting before. Builds without them: always false.
bool set_amx(bool on) {
#ifdef HAVE_AMX
  return use_amx.exchange(on);
#else
  (void)on;
  return false;
#endif
}

at::Tensor matvec_bf16(const at::Tensor& x, at::TensorList ws, bool fp32_out) {
  const int64_t rows = check("matvec_bf16", x, ws, at::kBFloat16);
  const at::ScalarType out = out_type(x, fp32_out);
  const int64_t k_dim = x.size(-1);
  std::vector<const uint16_t*> w;
  for (const at::Tensor& t : ws) w.push_back(reinterpret_cast<const uint16_t*>(t.data_ptr()));
  at::Tensor y;
#ifdef HAVE_BF16_DOT
  if (x.scalar_type() == at::kBFloat16) {
#ifdef HAVE_AMX
    if (rows >= kAmxMinRows && use_amx && amx_fits(ws, k_dim) && amx::enabled()) return matvec_amx(x, ws, rows, out);
#endif
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
    with_rows(rows, [&](auto m_rows) {
      constexpr int M = decltype(m_rows)::value;
      y = rows_to<M>(x, out, ws, 2, 2, 32, kOnes, [&](size_t i, int64_t r, int64_t k0, int64_t len, float* out) {
        isa::dot_bf16_bf16<M>(w[i] + r * k_dim + k0, xp + k0, k_dim, len, out);
      });
    });
    return y;
  }
#endif
  const at::Tensor xf = x.to(at::kFloat);  // no copy when x is fp32
  const float* xp = xf.data_ptr<float>();
  with_rows(rows, [&](auto m_rows) {
    constexpr int M = decltype(m_rows)::value;
    y = rows_to<M>(x, out, ws, 2, 4, 32, kOnes, [&](size_t i, int64_t r, int64_t k0, int64_t len, float* out) {
      isa::dot_bf16<M>(w[i] + r * k_dim + k0, xp + k0, k_dim, len, out);
    });
  });
  return y;
}

// fp32 weights (LLAMA_DTYPE=fp32): twice the bytes of bf16, streamed the same way.
at::Tensor matvec_f32(const at::Tensor& x, at::TensorList ws, bool fp32_out) {
  const int64_t rows = check("matvec_f32", x, ws, at::kFloat);
  const int64_t k_dim = x.size(-1);
  std::vector<const float*> w;
  for (const at::Tensor& t : ws) w.push_back(t.data_ptr<float>());
  const at::Tensor xf = x.to(at::kFloat);  // no copy when x is fp32
  const float* xp = xf.data_ptr<float>();
  at::Tensor y;
  with_rows(rows, [&](auto m_rows) {
    constexpr int M = decltype(m_rows)::value;
    y = rows_to<M>(x, out_type(x, fp32_out), ws, 4, 4, 32, kOnes,
                   [&](size_t i, int64_t r, int64_t k0, int64_t len, float* out) {
                     isa::dot_f32<M>(w[i] + r * k_dim + k0, xp + k0, k_dim, len, out);
                   });
  });
  return y;
}

// x rounded to int16 for integer weights, a row at a time with its own scale, scale[m] = max |x[m]| /
// 32767, so that products with the weights are exact integer multiply-adds and the scale is applied
// once per output (an error of at most half a step per element). Optionally (int4) each block of 32's
// sum of x. The buffers are the calling thread's, reused from call to call.
struct Int16Rows {
  const int16_t* values;  // (rows, stride)
  int64_t stride;
  const float* block_sums;  // (rows, K / 32), or null
  float scale[kMaxRows];
};

// 16 values of x (n of them; 16 in every call but a last piece of a K that is not a multiple of 16)
// rounded to int16 steps of 1 / inv at q: their sum. Written so that the compiler vectorizes it.
inline int32_t round_16(const float* x, float inv, int64_t n, int16_t* q) {
  int32_t sum = 0;
  if (n == 16) {
    for (int j = 0; j < 16; j++) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(x[j] * inv));
      q[j] = static_cast<int16_t>(v);
      sum += v;
    }
    return sum;
  }
  for (int64_t j = 0; j < n; j++) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(x[j] * inv));
    q[j] = static_cast<int16_t>(v);
    sum += v;
  }
  return sum;
}

#ifdef HAVE_Q4_INT8_X
// Integer weights take x rounded to int8 blocks (the default): int4 per block of 32 (dot_q4_x8), int8
// batches in AMX tiles per scale group; or, switched off, x rounded to int16 per row as the portable
// build does (int4 through the int16 loops, int8 batches through the AVX-512 loop: slower, for
// the tests that compare the fused decode step with the reference, where one x value rounded the other
// way moves an output by 1/127 of the block's largest |x| in int8 and by 1/32767 of the row's in int16).
std::atomic<bool> int8_x{true};
#endif

// Switches int8 x on or off; returns the setting before. Builds without it: always false.
bool set_int8_x(bool on) {
#ifdef HAVE_Q4_INT8_X
  return int8_x.exchange(on);
#else
  (void)on;
  return false;
#endif
}

// The float values of row m of x: x's own for fp32, else widened into `buffer` (reused from call to call).
const float* float_row(const at::Tensor& x, int64_t m, std::vector<float>& buffer) {
  const int64_t k_dim = x.size(-1);
  if (x.scalar_type() == at::kFloat) return x.data_ptr<float>() + m * k_dim;
  buffer.resize(k_dim);
  const BFloat16* xb = x.data_ptr<BFloat16>() + m * k_dim;
  for (int64_t k = 0; k < k_dim; k++) buffer[k] = static_cast<float>(xb[k]);
  return buffer.data();
}

// n zeros of T at a 64-byte boundary in `buffer` (resized as needed): the kernels' 64-byte loads of x each
// touch one cache line (a load across two took the int4 loop from 45 to 65 cycles a group of 8 rows).
template <typename T>
T* aligned_zeros(std::vector<T>& buffer, int64_t n) {
  buffer.resize(n + 64 / sizeof(T));
  T* first = reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) / 64 * 64);
  std::fill_n(first, n, T{0});
  return first;
}

Int16Rows round_to_int16(const at::Tensor& x, int64_t rows, bool block_sums = false) {
  constexpr int64_t kBlock = portable::kQ4Block, kStep = 16;
  thread_local std::vector<int16_t> value_buffer;
  thread_local std::vector<float> sums, widened;
  const int64_t k_dim = x.size(-1), blocks = k_dim / kBlock;
  Int16Rows out{};
  out.stride = k_dim;
  int16_t* values = aligned_zeros(value_buffer, rows * k_dim);
  if (block_sums) sums.assign(rows * blocks, 0.f);
  for (int64_t m = 0; m < rows; m++) {
    const float* row = float_row(x, m, widened);
    float x_max = 0.f;
    for (int64_t k = 0; k < k_dim; k++) x_max = std::max(x_max, std::abs(row[k]));
    const float scale = x_max > 0.f ? x_max / 32767.f : 1.f;
    out.scale[m] = scale;
    const float inv = 1.f / scale;
    for (int64_t k0 = 0; k0 < k_dim; k0 += kStep) {
      const int32_t sum = round_16(row + k0, inv, std::min(kStep, k_dim - k0), values + m * k_dim + k0);
      if (block_sums) sums[m * blocks + k0 / kBlock] += static_cast<float>(sum);
    }
  }
  out.values = values;
  out.block_sums = block_sums ? sums.data() : nullptr;
  return out;
}

#ifdef HAVE_Q8_QUADS
// x rounded to int16 as round_to_int16 does, laid out for isa::dot_q8_quads: runs of four groups of `group`
// values, a unit per row and run, the rows of a unit side by side; in a unit, 128-bit chunks (group c, vector
// v) -> (v, c): chunk c of vector v = values 8v..8v+7 of group c. Then the values after the last whole run, a
// row after the other. A piece of K from k0 (whole runs) starts at values + k0 * rows.
Int16Rows round_to_int16_quads(const at::Tensor& x, int64_t rows, int64_t group) {
  constexpr int64_t kChunk = 8;
  thread_local std::vector<int16_t> value_buffer;
  const Int16Rows natural = round_to_int16(x, rows);
  const int64_t k_dim = x.size(-1), quad = isa::kQ8Quad * group, quads = k_dim / quad, rest = k_dim - quads * quad;
  int16_t* values = aligned_zeros(value_buffer, rows * k_dim);
  for (int64_t m = 0; m < rows; m++) {
    const int16_t* row = natural.values + m * k_dim;
    for (int64_t q = 0; q < quads; q++) {
      int16_t* unit = values + (q * rows + m) * quad;
      for (int64_t c = 0; c < isa::kQ8Quad; c++)
        for (int64_t v = 0; v < group / kChunk; v++)
          std::memcpy(unit + (v * isa::kQ8Quad + c) * kChunk, row + q * quad + c * group + v * kChunk,
                      kChunk * sizeof(int16_t));
    }
    std::copy(row + quads * quad, row + k_dim, values + quads * quad * rows + m * rest);
  }
  Int16Rows out = natural;
  out.values = values;
  return out;
}
#endif

#ifdef HAVE_Q4_INT8_X
// x rounded to int8 per block of 32 for int4 weights where the build's kernel takes it (HAVE_Q4_INT8_X): each
// block with its own scale, max |x| / 127 (at most half a step of it per element), and its sum of x as rounded
// (the scale times the sum of its int8s), laid out as that kernel reads them (isa::dot_q4_x8): units of a
// group of kQ4Lanes blocks (or a step of kQ4StepBlocks after the groups) of one row, the rows of a unit side
// by side. A piece of K from k0 (whole groups) starts at values + k0 * rows and at scales, sums + k0 / 32 * rows.
// The buffers are the calling thread's.
struct Int8Blocks {
  const int8_t* values;
  const float* scales;
  const float* sums;
};

Int8Blocks round_to_int8_blocks(const at::Tensor& x, int64_t rows) {
  constexpr int64_t kBlock = portable::kQ4Block, kLanes = isa::kQ4Lanes, kStep = isa::kQ4StepBlocks;
  thread_local std::vector<int8_t> value_buffer;
  thread_local std::vector<float> scale_buffer, sum_buffer, widened;
  const int64_t k_dim = x.size(-1), blocks = k_dim / kBlock, groups = blocks / kLanes, grouped = groups * kLanes;
  const int64_t steps = (blocks - grouped + kStep - 1) / kStep;
  // Pointers taken once: a thread_local's address is a call to __tls_get_addr in a shared library.
  int8_t* values = aligned_zeros(value_buffer, (grouped + steps * kStep) * kBlock * rows);
  float* scales = aligned_zeros(scale_buffer, (groups + steps) * kLanes * rows);
  float* sums = aligned_zeros(sum_buffer, (groups + (steps > 0)) * kLanes * rows);
  std::vector<float>& widened_row = widened;
  for (int64_t m = 0; m < rows; m++) {
    const float* row = float_row(x, m, widened_row);
    for (int64_t b = 0; b < blocks; b++) {
      const float* xb = row + b * kBlock;
      float x_max = 0.f;
      for (int j = 0; j < kBlock; j++) x_max = std::max(x_max, std::abs(xb[j]));
      const float scale = x_max / 127.f, inv = x_max > 0.f ? 127.f / x_max : 0.f;
      int8_t q[kBlock];
      int32_t sum = 0;
      for (int j = 0; j < kBlock; j++) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(xb[j] * inv));
        q[j] = static_cast<int8_t>(v);
        sum += v;
      }
      if (b < grouped) {  // group g, lane l: slot s (kLanes dwords) holds values 4s..4s+3 of the lane's block
        const int64_t g = b / kLanes, unit = g * rows + m;
        int64_t lane = 0;  // the lane that holds block b
        while (g * kLanes + isa::q4_lane_block(lane) != b) lane++;
        int8_t* first = values + unit * kLanes * kBlock + lane * 4;
        for (int64_t slot = 0; slot < kBlock / 4; slot++) std::memcpy(first + slot * kLanes * 4, q + slot * 4, 4);
        scales[unit * kLanes + lane] = scale;
        sums[unit * kLanes + b - g * kLanes] = scale * static_cast<float>(sum);
      } else {  // step t: the first 16 values of its blocks, then the second 16; each block's scale 4 times
        const int64_t unit = (b - grouped) / kStep * rows + m, t = (b - grouped) % kStep;
        int8_t* first = values + grouped * kBlock * rows + unit * kStep * kBlock + t * kBlock / 2;
        std::memcpy(first, q, kBlock / 2);
        std::memcpy(first + kStep * kBlock / 2, q + kBlock / 2, kBlock / 2);
        std::fill_n(scales + (groups * rows + unit) * kLanes + 4 * t, 4, scale);
        sums[(groups * rows + m) * kLanes + b - grouped] = scale * static_cast<float>(sum);
      }
    }
  }
  return {values, scales, sums};
}
#endif

#ifdef HAVE_AMX_INT8
// int8 weights in AMX tiles (tiles_amx.h, rows_times_x_int8): one tile step is one group of the weights'
// scales, so every matrix must have the same group, of 32 or 64 weights (int8 quantizes in groups of
// 64, a Q8_0 GGUF brings 32), and N in whole tiles of 16 rows. x is rounded to int8 per group instead
// of to int16 per row: a product moves by at most half a step of 1/127 of the group's largest |x| per
// element, as int4's does per block of 32. Measured on Sapphire Rapids against the loop, weights from
// memory (docs/benchmarks.md): as fast at 2 rows (so the tiles start at 3), 1.0-1.2x at 3 and 1.3-1.9x
// at 8, rows of K = 576 (the default model) as well as the 1B shape's.
constexpr int64_t kAmxInt8MinRows = 3, kAmxInt8MinK = 512;
// Off (LLAMA_DETERMINISTIC=1): int8 batches stay in the loop, x rounded to int16 per row as for one or two
// rows, so a sequence's tokens do not depend on how many decode beside it (the tiles' int8 x rounds
// otherwise than the loop's int16 x); batched int8 decode on AMX CPUs is then up to 1.45x slower.
std::atomic<bool> use_amx_int8{true};

bool amx_int8_fits(at::TensorList ws, int64_t k_dim, const std::vector<int64_t>& groups) {
  const int64_t group = groups.front();
  if ((group != 32 && group != 64) || k_dim < kAmxInt8MinK) return false;
  for (size_t i = 0; i < ws.size(); i++)
    if (groups[i] != group || ws[i].size(0) % amx::kTileRows != 0) return false;
  return true;
}

// x rounded to int8 per group of `group` values, as tdpbssd takes it: quads (K / 4, M) of 4 int8 values
// of a row (k = 4p .. 4p + 3 of row m at quad p * M + m), and each group's scale max |x| / 127 at
// scales[g * M + m]; q = round(x * 127 / max |x|). The buffers are the calling thread's.
struct Int8Quads {
  const int32_t* quads;
  const float* scales;
};

Int8Quads round_to_int8_quads(const at::Tensor& x, int64_t rows, int64_t group) {
  thread_local std::vector<int32_t> quads;
  thread_local std::vector<float> scales, widened;
  const int64_t k_dim = x.size(-1), groups = k_dim / group;
  quads.resize(k_dim / 4 * rows);
  scales.resize(groups * rows);
  auto* values = reinterpret_cast<int8_t*>(quads.data());  // (K / 4, M, 4)
  for (int64_t m = 0; m < rows; m++) {
    const float* row = float_row(x, m, widened);
    for (int64_t g = 0; g < groups; g++) {
      const float* xg = row + g * group;
      float x_max = 0.f;
      for (int64_t j = 0; j < group; j++) x_max = std::max(x_max, std::abs(xg[j]));
      const float inv = x_max > 0.f ? 127.f / x_max : 0.f;
      scales[g * rows + m] = x_max / 127.f;
      for (int64_t j = 0; j < group; j++) {
        const int64_t k = g * group + j;
        values[(k / 4 * rows + m) * 4 + k % 4] = static_cast<int8_t>(std::nearbyint(xg[j] * inv));
      }
    }
  }
  return {quads.data(), scales.data()};
}

// y = x W_i^T for int8 W_i and 3-8 rows of x with AMX tiles, 16 weight rows at a time, the blocks split
// across threads as in rows_to.
at::Tensor matvec_int8_amx(const at::Tensor& x, at::TensorList ws, const std::vector<const int8_t*>& w,
                           const std::vector<const float*>& s, int64_t group, int64_t rows, at::ScalarType out_dtype) {
  const int64_t k_dim = x.size(-1), groups = k_dim / group;
  std::vector<int64_t> first{0};  // first[i]: the output index of matrix i's row 0
  for (const at::Tensor& t : ws) first.push_back(first.back() + t.size(0));
  const int64_t n_total = first.back();
  const Int8Quads xq = round_to_int8_quads(x, rows, group);
  at::Tensor y = shared([&] { return at::empty({rows, n_total}, x.options().dtype(out_dtype)); });
  const bool bf16 = out_dtype == at::kBFloat16;
  float* yf = bf16 ? nullptr : y.data_ptr<float>();
  BFloat16* yb = bf16 ? y.data_ptr<BFloat16>() : nullptr;
  const int64_t task = (std::max<int64_t>(1, kTaskBytes / k_dim) + amx::kTileRows - 1) / amx::kTileRows *
                       amx::kTileRows;
  with_rows(rows, [&](auto m_rows) {
    constexpr int M = decltype(m_rows)::value;
    parallel_rows(n_total, task, threads_for(n_total * k_dim), [&](int64_t begin, int64_t end) {
      const amx::Config config(M, group, group / 4);
      _tile_loadconfig(&config);
      float out[amx::kTileRows * M];  // (16, M)
      size_t i = 0;
      for (int64_t n0 = begin; n0 < end; n0 += amx::kTileRows) {
        while (n0 >= first[i + 1]) i++;
        const int64_t r0 = n0 - first[i];
        // The next rows of the matrix, most often this thread's next task (its share is contiguous).
        const bool more = n0 + amx::kTileRows < first[i + 1];
        amx::rows_times_x_int8<M>(w[i] + r0 * k_dim, more ? w[i] + (r0 + amx::kTileRows) * k_dim : nullptr, k_dim,
                                  group, s[i] + r0 * groups, groups, xq.quads, xq.scales, out);
        for (int64_t r = 0; r < amx::kTileRows; r++) {
          for (int m = 0; m < M; m++) {
            if (bf16) yb[m * n_total + n0 + r] = BFloat16(out[r * M + m]);
            else yf[m * n_total + n0 + r] = out[r * M + m];
          }
        }
      }
      _tile_release();
    });
  });
  return y;
}
#endif

// Switches int8 batches in AMX tiles on or off; returns the setting before. Builds without them: always false.
bool set_amx_int8(bool on) {
#ifdef HAVE_AMX_INT8
  return use_amx_int8.exchange(on);
#else
  (void)on;
  return false;
#endif
}

at::Tensor matvec_int8(const at::Tensor& x, at::TensorList ws, at::TensorList scales, bool fp32_out) {
  const int64_t rows = check("matvec_int8", x, ws, at::kChar);
  const at::ScalarType out = out_type(x, fp32_out);
  const int64_t k_dim = x.size(-1);
  TORCH_CHECK(scales.size() == ws.size(), "matvec_int8: ", ws.size(), " weight matrices but ", scales.size(),
              " scale tensors; expected one per matrix");
  std::vector<const int8_t*> w;
  std::vector<const float*> s;
  std::vector<int64_t> groups, n_groups;  // per matrix: weights per group, groups per row
  int64_t align = isa::kQ8Step;  // pieces of K hold whole groups of every matrix, whole steps of the loops
  for (size_t i = 0; i < ws.size(); i++) {
    const at::Tensor& scale = scales[i];
    TORCH_CHECK(scale.dim() == 2 && scale.size(0) == ws[i].size(0) && scale.scalar_type() == at::kFloat &&
                scale.is_contiguous() && scale.device().is_cpu(),
                "matvec_int8: scale[", i, "] must be a contiguous float32 CPU tensor (N, K / group) with N=",
                ws[i].size(0), "; got ", scale.scalar_type(), " ", scale.sizes());
    TORCH_CHECK(scale.size(1) >= 1 && k_dim % scale.size(1) == 0 && k_dim / scale.size(1) <= 256,
                "matvec_int8: scale[", i, "] is ", scale.sizes(), ": expected K / group columns, groups of at most ",
                "256 weights, for K=", k_dim);
    w.push_back(ws[i].data_ptr<int8_t>());
    s.push_back(scale.data_ptr<float>());
    groups.push_back(k_dim / scale.size(1));
    n_groups.push_back(scale.size(1));
    align = std::lcm(align, groups.back());
  }
#ifdef HAVE_AMX_INT8
  if (rows >= kAmxInt8MinRows && use_amx && use_amx_int8 && int8_x && amx_int8_fits(ws, k_dim, groups) &&
      amx::enabled())
    return matvec_int8_amx(x, ws, w, s, groups.front(), rows, out);
#endif
  at::Tensor y;
#ifdef HAVE_Q8_QUADS
  // One group for every matrix, whole steps of the loop: four groups a register (dot_q8_quads), in pieces of K of
  // whole runs of four groups
  const int64_t group = groups.front();
  if (group % isa::kQ8Step == 0 && std::all_of(groups.begin(), groups.end(), [&](int64_t g) { return g == group; })) {
    const Int16Rows xq = round_to_int16_quads(x, rows, group);
    with_rows(rows, [&](auto m_rows) {
      constexpr int M = decltype(m_rows)::value;
      y = rows_to<M>(x, out, ws, 1, 2, isa::kQ8Quad * group, xq.scale,
                     [&](size_t i, int64_t r, int64_t k0, int64_t len, float* out) {
        const int8_t* row = w[i] + r * k_dim + k0;
        const int16_t* xp = xq.values + k0 * M;
        const float* row_scale = s[i] + r * n_groups[i] + k0 / group;
        // the groups of Q8_0 (32) and of quantize_int8 (64) known when compiled
        if (group == 32) isa::dot_q8_quads<M, 32>(row, xp, row_scale, len, group, out);
        else if (group == 64) isa::dot_q8_quads<M, 64>(row, xp, row_scale, len, group, out);
        else isa::dot_q8_quads<M, 0>(row, xp, row_scale, len, group, out);
      });
    });
    return y;
  }
#endif
  const Int16Rows xq = round_to_int16(x, rows);
  with_rows(rows, [&](auto m_rows) {
    constexpr int M = decltype(m_rows)::value;
    y = rows_to<M>(x, out, ws, 1, 2, align, xq.scale, [&](size_t i, int64_t r, int64_t k0, int64_t len, float* out) {
      const int8_t* row = w[i] + r * k_dim + k0;
      const float* row_scale = s[i] + r * n_groups[i] + (k0 == 0 ? 0 : k0 / groups[i]);
      if (groups[i] % isa::kQ8Step == 0) isa::dot_q8<M>(row, xq.values + k0, xq.stride, row_scale, len, groups[i], out);
      else portable::dot_q8<M>(row, xq.values + k0, xq.stride, row_scale, len, groups[i], out);
    });
  });
  return y;
}

// The fp16 (N, K / 32) block scales or offsets of an int4 matrix of N rows.
const uint16_t* block_values(const char* what, size_t i, const at::Tensor& t, int64_t n, int64_t blocks) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == n && t.size(1) == blocks && t.scalar_type() == at::kHalf &&
              t.is_contiguous() && t.device().is_cpu(),
              "matvec_int4: ", what, "[", i, "] must be a contiguous float16 CPU tensor (N, K / 32) = (", n, ", ",
              blocks, "); got ", t.scalar_type(), " ", t.sizes());
  return reinterpret_cast<const uint16_t*>(t.data_ptr());
}

// int4 weights (model/quantize.py's layout): w uint8 (N, K / 2), scale and offset fp16 (N, K / 32) per
// matrix, offset None for Q4_0's symmetric blocks. x is rounded to int8 per block of 32 where the build
// has AVX-512 or AVX2 (round_to_int8_blocks, isa::dot_q4_x8), else (or with int8_x off) to int16 as for int8
// weights (see portable::dot_q4), and each block's integer dot product is scaled in fp32: the result is
// that of the dequantized matrix times x so rounded.
at::Tensor matvec_int4(const at::Tensor& x, at::TensorList ws, at::TensorList scales, llama::Offsets offsets,
                       bool fp32_out) {
  constexpr int64_t kBlock = portable::kQ4Block;
  const int64_t rows = check("matvec_int4", x, ws, at::kByte, 2);
  const at::ScalarType out = out_type(x, fp32_out);
  const int64_t k_dim = x.size(-1), blocks = k_dim / kBlock;
  TORCH_CHECK(k_dim % kBlock == 0, "matvec_int4: K=", k_dim, " is not a multiple of the block of ", kBlock,
              " weights");
  TORCH_CHECK(scales.size() == ws.size() && offsets.size() == ws.size(), "matvec_int4: ", ws.size(),
              " weight matrices, ", scales.size(), " scale tensors and ", offsets.size(),
              " offsets; expected one of each per matrix");
  std::vector<const uint8_t*> w;
  std::vector<const uint16_t*> s, o;  // o[i] null: Q4_0 blocks
  for (size_t i = 0; i < ws.size(); i++) {
    w.push_back(ws[i].data_ptr<uint8_t>());
    s.push_back(block_values("scale", i, scales[i], ws[i].size(0), blocks));
    o.push_back(offsets[i].has_value() ? block_values("offset", i, *offsets[i], ws[i].size(0), blocks) : nullptr);
  }
  at::Tensor y;
#ifdef HAVE_Q4_INT8_X
  if (int8_x) {
    const Int8Blocks xq = round_to_int8_blocks(x, rows);
    with_rows(rows, [&](auto m_rows) {
      constexpr int M = decltype(m_rows)::value;
      // x_bytes 2: a value's int8 and its share of the block scales and sums, rounded up; pieces of K in whole groups
      constexpr int R = isa::kQ4WeightRows<M>;
      y = rows_to<M, R>(x, out, ws, 1, 2, isa::kQ4Group, kOnes,
                        [&](size_t i, int64_t r, int64_t count, int64_t k0, int64_t len, float* out) {
        const uint8_t* row = w[i] + r * (k_dim / 2) + k0 / 2;
        const int64_t first = r * blocks + k0 / kBlock;  // the piece's first block
        const int8_t* xp = xq.values + k0 * M;
        const float *xs = xq.scales + k0 / kBlock * M, *sums = xq.sums + k0 / kBlock * M;
        const uint16_t *scale = s[i] + first, *offset = o[i] ? o[i] + first : nullptr;
        const int64_t w_stride = k_dim / 2;
        auto take = [&](auto weight_rows) {  // count rows of matrix i, with or without offsets
          constexpr int C = decltype(weight_rows)::value;
          if (o[i]) isa::dot_q4_x8<M, C, true>(row, w_stride, xp, xs, sums, scale, offset, blocks, len, out);
          else isa::dot_q4_x8<M, C, false>(row, w_stride, xp, xs, sums, scale, offset, blocks, len, out);
        };
        if (R > 1 && count == R) take(std::integral_constant<int, R>{});
        else take(std::integral_constant<int, 1>{});
      });
    });
    return y;
  }
#endif
  const Int16Rows xq = round_to_int16(x, rows, /*block_sums=*/true);
  with_rows(rows, [&](auto m_rows) {
    constexpr int M = decltype(m_rows)::value;
    y = rows_to<M>(x, out, ws, 1, 2, 2 * kBlock, xq.scale, [&](size_t i, int64_t r, int64_t k0, int64_t len, float* out) {
      const uint8_t* row = w[i] + r * (k_dim / 2) + k0 / 2;
      const int64_t first = r * blocks + k0 / kBlock;  // the piece's first block
      const int16_t* xp = xq.values + k0;
      const float* sums = xq.block_sums + k0 / kBlock;
      if (o[i]) int16_q4::dot_q4<M, true>(row, xp, xq.stride, sums, blocks, s[i] + first, o[i] + first, len, out);
      else int16_q4::dot_q4<M, false>(row, xp, xq.stride, sums, blocks, s[i] + first, nullptr, len, out);
    });
  });
  return y;
}

// x rounded to int8 for weights in llama.cpp's blocks (ggml_blocks.h): values (M, K), one scale max |x| / 127 per
// group of `group` values (M, K / group), each 16 values' sum of int8s (M, K / 16). The buffers are the calling thread's.
ggml::XBlocks round_to_int8_groups(const at::Tensor& x, int64_t rows, int64_t group) {  // group: 256 or 32
  constexpr int64_t kGroup = ggml::kGroup;
  thread_local std::vector<int8_t> value_buffer;
  thread_local std::vector<int16_t> sum_buffer;
  thread_local std::vector<float> scales, widened;
  const int64_t k_dim = x.size(-1);
  int8_t* values = aligned_zeros(value_buffer, rows * k_dim);
  int16_t* sums = aligned_zeros(sum_buffer, rows * k_dim / kGroup);
  scales.resize(rows * k_dim / group);
  for (int64_t m = 0; m < rows; m++)
    ggml::round_x_row(float_row(x, m, widened), k_dim, group, values + m * k_dim, sums + m * k_dim / kGroup,
                      scales.data() + m * k_dim / group);
  return {values, scales.data(), sums, k_dim, group, group == 256 ? 8 : 5};
}

// Weights in llama.cpp's blocks (ggml_blocks.h), uint8 (N_i, K / block, bytes) each, of any of its formats,
// one matrix beside another of another format (a Q4_K_M file's q|k|v: Q4_K, Q4_K, Q6_K).
at::Tensor matvec_blocks(const at::Tensor& x, at::TensorList ws, bool fp32_out) {
  TORCH_CHECK((x.dim() == 1 || x.dim() == 2) && x.is_contiguous() && x.device().is_cpu() &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "matvec_blocks: x must be a contiguous float32 or bfloat16 CPU tensor of shape (K,) or (M, K); got ",
              x.scalar_type(), " ", x.sizes());
  const int64_t rows = x.dim() == 1 ? 1 : x.size(0), k_dim = x.size(-1);
  TORCH_CHECK(rows >= 1 && rows <= kMaxRows, "matvec_blocks: x has ", rows, " rows; expected 1 to ", kMaxRows);
  TORCH_CHECK(!ws.empty(), "matvec_blocks: no weight matrices");
  std::vector<const ggml::Format*> formats;
  std::vector<const uint8_t*> w;
  int64_t align = ggml::kXBlock;  // pieces of K hold whole blocks of every matrix
  for (size_t i = 0; i < ws.size(); i++) {
    const at::Tensor& t = ws[i];
    const ggml::Format* f = t.dim() == 3 ? ggml::format_of(t.size(2)) : nullptr;
    TORCH_CHECK(t.scalar_type() == at::kByte && t.is_contiguous() && t.device().is_cpu() && f != nullptr,
                "matvec_blocks: w[", i, "] must be a contiguous uint8 CPU tensor (N, K / block, bytes) of a ",
                "block format (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1); got ", t.scalar_type(), " ", t.sizes());
    TORCH_CHECK(t.size(1) * f->block == k_dim, "matvec_blocks: w[", i, "] holds ", t.size(1), " ", f->name,
                " blocks a row (", t.size(1) * f->block, " weights) but x has K=", k_dim);
    formats.push_back(f);
    w.push_back(t.data_ptr<uint8_t>());
    align = std::lcm(align, f->block);
  }
  // x in groups of 256 where every row is whole blocks of 256 (the K-quants' fast loops take one x scale a block)
  const ggml::XBlocks xq = round_to_int8_groups(x, rows, k_dim % 256 == 0 ? 256 : ggml::kXBlock);
  at::Tensor y;
  with_rows(rows, [&](auto m_rows) {
    constexpr int M = decltype(m_rows)::value;
    y = rows_to<M>(x, out_type(x, fp32_out), ws, 1, 2, align, kOnes,
                   [&](size_t i, int64_t r, int64_t k0, int64_t len, float* out) {
      const ggml::Format& f = *formats[i];
      const uint8_t* row = w[i] + (r * (k_dim / f.block) + k0 / f.block) * f.bytes;
      ggml::dot_blocks<M>(f, row, len / f.block, xq, k0, out);
    });
  });
  return y;
}

// The registered op: a Tensor?[] argument arrives as a c10::List.
at::Tensor matvec_int4_op(const at::Tensor& x, at::TensorList ws, at::TensorList scales,
                          const c10::List<std::optional<at::Tensor>>& offsets, bool fp32_out) {
  return matvec_int4(x, ws, scales, offsets.vec(), fp32_out);
}

// The build's instruction set, and " + AMX" where bf16 batches take the tiles.
std::string path() {
#ifdef HAVE_AMX
  if (amx::enabled()) return std::string(kPath) + " + AMX";
#endif
  return kPath;
}

}  // namespace

at::Tensor llama::matvec(const at::Tensor& x, at::TensorList ws, at::TensorList scales, Offsets offsets,
                         bool fp32_out) {
  TORCH_CHECK(!ws.empty(), "matvec: no weight matrices");
  const at::ScalarType kind = ws[0].scalar_type();
  // Matrices of different kinds (a GGUF's q|k|v: Q5_0 blocks beside a Q8_0 v, as llama.cpp's fall-backs leave
  // them): a call for each run of one kind, outputs side by side.
  auto kind_of = [](const at::Tensor& w) { return std::make_pair(w.scalar_type(), w.dim()); };
  size_t run = 1;
  while (run < ws.size() && kind_of(ws[run]) == kind_of(ws[0])) run++;
  if (run < ws.size()) {
    auto part = [&](size_t first, size_t count) {
      return llama::matvec(x, ws.slice(first, count), scales.empty() ? scales : scales.slice(first, count),
                           offsets.empty() ? offsets : offsets.slice(first, count), fp32_out);
    };
    const at::Tensor head = part(0, run), tail = part(run, ws.size() - run);
    return shared([&] { return at::cat({head, tail}, -1); });
  }
  if (kind == at::kByte && ws[0].dim() == 3) return matvec_blocks(x, ws, fp32_out);
  if (kind == at::kByte) return matvec_int4(x, ws, scales, offsets, fp32_out);
  for (const std::optional<at::Tensor>& offset : offsets)
    TORCH_CHECK(!offset.has_value(), "matvec: an offset for ", kind, " weights; only int4 (uint8) blocks take one");
  if (kind == at::kChar) return matvec_int8(x, ws, scales, fp32_out);
  TORCH_CHECK(scales.empty(), "matvec: ", scales.size(), " scale tensors for ", kind, " weights; expected none");
  return kind == at::kFloat ? matvec_f32(x, ws, fp32_out) : matvec_bf16(x, ws, fp32_out);
}

// The op namespace is the build's name, so builds for different instruction sets load side by side.
#define DEFINE_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define IMPL_LIBRARY(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

DEFINE_LIBRARY(TORCH_EXTENSION_NAME, m) {
  // fp32_out: y in fp32 whatever x's dtype (the output head's logits); else in x's dtype.
  m.def("matvec_bf16(Tensor x, Tensor[] w, bool fp32_out=False) -> Tensor");
  m.def("matvec_f32(Tensor x, Tensor[] w, bool fp32_out=False) -> Tensor");
  m.def("matvec_int8(Tensor x, Tensor[] w, Tensor[] scale, bool fp32_out=False) -> Tensor");
  m.def("matvec_int4(Tensor x, Tensor[] w, Tensor[] scale, Tensor?[] offset, bool fp32_out=False) -> Tensor");
  m.def("matvec_blocks(Tensor x, Tensor[] w, bool fp32_out=False) -> Tensor");
  m.def("path() -> str", &path);  // which of the code paths above this build compiled
  m.def("set_int8_x(bool on) -> bool", &set_int8_x);
  m.def("set_amx(bool on) -> bool", &set_amx);
  m.def("set_amx_int8(bool on) -> bool", &set_amx_int8);
}

IMPL_LIBRARY(TORCH_EXTENSION_NAME, CPU, m) {
  m.impl("matvec_bf16", matvec_bf16);
  m.impl("matvec_f32", matvec_f32);
  m.impl("matvec_int8", matvec_int8);
  m.impl("matvec_int4", matvec_int4_op);
  m.impl("matvec_blocks", matvec_blocks);
}
