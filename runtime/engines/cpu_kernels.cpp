// spectrt's CPU forward: one call per forward for a LLaMA-family decoder over new tokens, tree masks and
// static KV caches (see runtime/kernels.py for why it exists and how it is built and checked).
//
// Written once over the SIMD layer in simd.h (AVX-512, AVX2+FMA, or portable vector extensions, picked at compile
// time); every operation there gives the same result on every ISA, so every build computes bitwise the same
// numbers. Two properties drive every loop here:
//  1. Row invariance. Each output row is computed by the same sequence of floating-point operations whatever the
//     number of rows in the call, the row's place among them, or the other rows' values: GEMM outputs are one FMA
//     chain over k in order, norms and dot products reduce in a fixed order per row, attention reduces over the
//     row's own visible slots in slot order. So a verified tree node is bitwise equal to decoding it alone, in
//     any precision, and rows of different requests can share one call.
//  2. Stream each weight once. Weights are packed in panels of NR output columns ([K][NR] contiguous); a panel is
//     read from memory once and kept in L2 while every register block of rows runs over it, so T rows cost
//     about one row's memory traffic until the FMA units saturate.
// Compile with -ffp-contract=off: contractions are explicit (simd::fmadd / std::fma) so that vectorized and
// scalar code compute the same roundings.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>  // MXCSR (FlushDenormals)
#endif

#include "simd.h"
#include "thread_pool.h"

namespace {

using simd::Vec;
using simd::LANES;

constexpr int64_t NR = 64;  // output columns per weight panel (kernels.py PANEL): 4 Vec per row

// Threads a parallel loop runs on: torch's setting (torch.set_num_threads, kernels.py `default_threads`), the
// one knob for every thread of the process; the loops themselves run on spectrt's pool (thread_pool.h).
inline int pool_threads() { return at::get_num_threads(); }

// f(begin, end) over chunks of [0, n) on the pool: items are claimed as threads come, so a late thread's share is
// taken by the others (thread_pool.h); each item must be computed the same way whichever thread takes it.
template <typename F>
inline void parallel_for(int64_t n, F&& f) {
  pool::Pool::get().parallel_for(n, pool_threads(), std::forward<F>(f));
}

inline const float* raw(const float* p) { return p; }
inline const uint16_t* raw(const at::BFloat16* p) { return reinterpret_cast<const uint16_t*>(p); }

// Software prefetch distance into the weight stream. Why: without it the hardware prefetchers left the FMA loop
// waiting on memory. Measured (AVX-512, whole forward, SmolLM2-135M, 2 threads under the team lock, with and
// without it interleaved in one process, median of 10 best of 2): bf16 T=1 20.7 -> 14.9 ms at context 128 (21.3
// -> 17.4 at 1024), T=8 28.1 -> 21.4; fp32 T=1 23.4 -> 22.7, T=8 46.6 -> 36.5. Logits are bitwise unchanged.
constexpr int64_t PREFETCH_BYTES = 4096;

// The in-panel stream's prefetch locality, set per CPU vendor by kernels.py (`stream_flags`). Non-temporal (0) on
// AMD: the stream passes through without displacing what the caches hold for the rest of the step (Zen 4, same
// weights, interleaved: bf16 T=1 6.3 -> 5.7 ms, fp32 10.4 -> 9.7; the AR target forward in the decode loop 6.50 ->
// 6.06). Into L2 (2, prefetcht1) elsewhere: on an Intel Xeon (model 207, AVX-512, 2 cores of a KVM guest) the
// non-temporal hint halved the stream (scripts/isa_tcurve.py, context 128, ms, non-temporal -> L2: AVX-512 bf16
// T=1 17.9 -> 8.9, fp32 38.8 -> 17.3, bf16 T=8 13.9 -> 13.1; AVX2 bf16 T=1 14.0 -> 8.9, fp32 41.4 -> 17.4); L1
// (3) was 3-7% slower than L2 there and L3 (1) equal.
#ifdef SPECTRT_STREAM_NTA
constexpr int STREAM_LOCALITY = 0;
#else
constexpr int STREAM_LOCALITY = 2;
#endif

// What a pass over a panel prefetches while it computes. A panel that one pass covers (one block of rows, all 64
// columns) streams itself: `ahead` prefetches each k's whole panel row PREFETCH_BYTES ahead. Where a panel takes
// several passes (more rows than one register block, or AVX2's narrower blocks), the passes after the first used to
// run from L2 with the memory bus idle; now each pass prefetches (into L2) the slice of the *next* panel that is its
// share of the panel's FMA work, lines spread evenly over its k steps, so one panel's compute overlaps the next
// one's traffic. Measured (scripts/isa_tcurve.py, Zen 4, context 128, the same weights on 2 MB pages, ms, before ->
// after): AVX2 bf16 T=2 9.2 -> 7.3, T=4 13.1 -> 9.8, T=8 18.8 -> 15.5, T=16 30.6 -> 28.2; AVX2 fp32 T=4 25.6 -> 15.0,
// T=8 30.1 -> 19.7; AVX-512 unchanged within noise (T <= 6 is one pass there), fp32 T=16 30.4 -> 27.4. Variants
// that also streamed every panel's first pass, or capped a pass at one line a k step, were no better (fp32 T=2 on
// AVX2 17-18 ms instead of 19; everything else 2-10% worse).
struct Prefetch {
  bool ahead;         // in-panel prefetch of whole panel rows (a one-pass panel, or the first a thread takes)
  const char* next;   // the next panel, or null
  int64_t lo, lines;  // this pass's slice of it: `lines` cache lines from byte `lo`
};

// out[m][c0 : c0 + 16 C] = sum_k x[m][k] * panel[k][c0 : c0 + 16 C], k ascending, one FMA chain per output.
// noinline: inlined into its callers, GCC 12 kept some blocks' accumulators in memory (the 3-row block stored
// them every k: half a bf16 T=3 forward's time on AVX2, Zen 3); compiled alone, every block keeps them in registers.
// A k-chunked variant (8df4d5a: 16 KB of a panel kept in L1 across the column passes, accumulators stored and
// reloaded between chunks, each pass prefetching its columns of the next chunk) helped on Zen 3 but lost on Zen 4
// in both builds (one process, interleaved, context 128, ms, against the code before it: AVX-512 bf16 T=8 17.0 vs
// 14.7, fp32 23.1 vs 19.2; AVX2 bf16 T=2 13.4 vs 10.9, fp32 29.0 vs 19.0), so each panel streams once, as here
// (bench/results/isa/README.md; scripts/isa_tcurve.py compares kernel revisions on a CPU).
template <typename W, int M, int C, bool NEXT>
__attribute__((noinline)) void panel_block(const float* x, int64_t ldx, const W* panel, int64_t K, float* out,
                                           int64_t ldo, int64_t cols, int64_t c0, Prefetch pf) {
  // The in-panel prefetch takes whole panel rows: later passes (narrower register blocks) find them in cache.
  // Why: prefetching only a pass's own columns left the passes that start a new cache line waiting on memory
  // (AVX2, bf16 T=8 forward 36.7 -> see kernels.py).
  constexpr int64_t row_bytes = NR * sizeof(W), ahead = PREFETCH_BYTES / row_bytes * NR;
  const int64_t prefetch_bytes = pf.ahead ? row_bytes : 0;
  const char* next_line = pf.next + pf.lo;
  int64_t credit = 0;  // next-panel lines owed: `lines` per K steps, issued as they fall due (no division per k)
  Vec acc[M][C];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < C; ++j) acc[m][j] = simd::zero();
  for (int64_t k = 0; k < K; ++k) {
    const W* w = panel + k * NR + c0;
    // __builtin_prefetch, not an inline wrapper of it (simd.h had one): with a call there GCC 12 kept the AVX2
    // accumulators in memory, storing each every k (12 stores a k in the 6-row block; fp32 GEMMs ran at ~15
    // GFMA/s a Zen 3 core at any row count). A prefetch never faults: reading past the panel's end is harmless.
    // STREAM_LOCALITY: non-temporal on AMD, into L2 elsewhere (above). The next-panel prefetch below is always
    // temporal: its lines must survive in L2 until that panel runs (non-temporal: AVX2 bf16 T=4 10.4 -> 14.5, Zen 4).
    for (int64_t b = 0; b < prefetch_bytes; b += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(w + ahead) + b, 0, STREAM_LOCALITY);
    if constexpr (NEXT)
      for (credit += pf.lines; credit >= K; credit -= K, next_line += 64) __builtin_prefetch(next_line, 0, 2);
    if constexpr (M == 1) {  // each weight used once: loaded at its FMA (loading all first spilled one register)
      static_assert(C % 2 == 0, "one row takes whole pairs of Vecs");
      const Vec xb = simd::set1(x[k]);
#pragma GCC unroll 8
      for (int j = 0; j < C; j += 2) {
        Vec a, b;
        simd::load_weights_pair(raw(w + j * LANES), a, b);
        acc[0][j] = simd::fmadd(xb, a, acc[0][j]);
        acc[0][j + 1] = simd::fmadd(xb, b, acc[0][j + 1]);
      }
    } else {
      Vec wv[C];
      for (int j = 0; j + 1 < C; j += 2) simd::load_weights_pair(raw(w + j * LANES), wv[j], wv[j + 1]);
      if constexpr (C % 2 == 1) wv[C - 1] = simd::load_weights(raw(w + (C - 1) * LANES));
      for (int j = 0; j < C; ++j) simd::pin(wv[j]);
#pragma GCC unroll 8  // keeps the accumulators in registers in the portable build (GCC left them in memory)
      for (int m = 0; m < M; ++m) {
        const Vec xb = simd::set1(x[m * ldx + k]);
#pragma GCC unroll 8
        for (int j = 0; j < C; ++j) acc[m][j] = simd::fmadd(xb, wv[j], acc[m][j]);
      }
    }
  }
  for (int m = 0; m < M; ++m) {  // back in column order, pairs and a last single as they were loaded
    for (int j = 0; j + 1 < C; j += 2) simd::in_column_order<W>(acc[m][j], acc[m][j + 1]);
    if constexpr (C % 2 == 1) acc[m][C - 1] = simd::in_column_order<W>(acc[m][C - 1]);
    for (int j = 0; j < C; ++j) {
      const int64_t c = c0 + j * LANES;
      if (c >= cols) break;
      simd::store_first(out + m * ldo + c, acc[m][j], cols - c);
    }
  }
}

// bf16dot, a precision of its own (kernels.py `pack(..., pairs=True)`): each GEMM input row is rounded to bf16, the
// weights are packed in k pairs ([P, K2, NR, 2]: column c's weights for k = 2 q, 2 q + 1 side by side), and each
// column sums, pair by pair in ascending k, the odd product and then the even one, one FMA rounding each, denormal
// inputs and results read as zero: VDPBF16PS's arithmetic (simd::dot_pair). Why: with fp32 activations every weight
// costs one fp32 FMA per row, so past ~4-6 rows a verify or a batch is bound by the FMA units (bf16 T=8 2.1x T=1,
// context 128, Zen 4); a pair dot multiplies twice the weights per instruction (one core: 114 against 58 GMAC/s).
// Rows stay invariant (each row's sums are the same instructions whatever the others), and every ISA agrees:
// without AVX512_BF16 the same FMAs run under MXCSR's DAZ|FTZ (Zen 4's VDPBF16PS against that emulation: 3.2M sums
// over normal and denormal ranges, bitwise; the SDM's pseudocode is the same: each accumulation an FMA, odd element
// first, RNE, DAZ in, FTZ out). Only a NaN's payload may differ between the two (the instruction prefers the low
// element's NaN).

// fp32 -> bf16, round to nearest even; a denormal becomes a signed zero and a NaN stays a (quiet) NaN, as
// VCVTNEPS2BF16 rounds. Written in integers, branch-free, so every build rounds alike (and GCC vectorizes the loop).
inline uint16_t round_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t magnitude = u & 0x7FFFFFFFu;
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16, quiet_nan = (u >> 16) | 0x40u;
  const uint32_t signed_zero = (u >> 16) & 0x8000u;
  return static_cast<uint16_t>(magnitude > 0x7F800000u ? quiet_nan : magnitude < 0x00800000u ? signed_zero : rounded);
}

// x [rows, K] fp32 -> xp [rows, ldp] rounded to bf16, in the form the pair sums read (simd::DotInput: the bf16 bits,
// or their fp32 value where emulated); ldp = 2 K2 >= K, the odd k past K zero
void round_rows_bf16(const float* x, int64_t rows, int64_t K, int64_t ldp, simd::DotInput* xp) {
  for (int64_t m = 0; m < rows; ++m) {
    const float* in = x + m * K;
    simd::DotInput* o = xp + m * ldp;
    for (int64_t k = 0; k < K; ++k) o[k] = simd::to_dot_input(round_bf16(in[k]));
    for (int64_t k = K; k < ldp; ++k) o[k] = 0;
  }
}

// Sets MXCSR's DAZ|FTZ for the emulated pair sums while alive (x86; other CPUs run the portable build, whose sums
// then differ from VDPBF16PS's only where a product or sum falls below 2^-126).
struct FlushDenormals {
#if defined(__x86_64__) || defined(__i386__)
  unsigned saved = 0;
  FlushDenormals() {
    if constexpr (simd::DOT_FLUSH) saved = _mm_getcsr(), _mm_setcsr(saved | 0x8040u);
  }
  ~FlushDenormals() {
    if constexpr (simd::DOT_FLUSH) _mm_setcsr(saved);
  }
#endif
};

// out[m][c0 : c0 + 16 C] = the pair sums of rows xp[m] (ldp per row) with a k-pair panel, k pairs ascending.
template <int M, int C, bool NEXT>
__attribute__((noinline)) void dot_block(const simd::DotInput* xp, int64_t ldp, const uint16_t* panel, int64_t K2,
                                         float* out, int64_t ldo, int64_t cols, int64_t c0, Prefetch pf) {
  // the stream prefetched 8 KB ahead: 4 and 8 KB measured alike in the whole forward (isa_tcurve --against), 8 KB
  // level with bf16 at T=1-4 on the same memory; 2 and 16 KB and an L2 hint no better (Zen 4)
  constexpr int64_t row_bytes = NR * 2 * sizeof(uint16_t), rows_ahead = 2 * PREFETCH_BYTES / row_bytes;
  const int64_t prefetch_bytes = pf.ahead ? row_bytes : 0;
  const char* next_line = pf.next + pf.lo;
  int64_t credit = 0;  // next-panel lines owed, as in panel_block
  Vec acc[M][C];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < C; ++j) acc[m][j] = simd::zero();
  for (int64_t q = 0; q < K2; ++q) {
    const uint16_t* w = panel + (q * NR + c0) * 2;
    for (int64_t b = 0; b < prefetch_bytes; b += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(panel + (q + rows_ahead) * NR * 2) + b, 0, STREAM_LOCALITY);
    if constexpr (NEXT)
      for (credit += pf.lines; credit >= K2; credit -= K2, next_line += 64) __builtin_prefetch(next_line, 0, 2);
    if constexpr (M == 1) {  // each weight pair used once: loaded at its sums (all first would not fit on AVX2)
      const simd::XPair xb = simd::set_pair(xp + 2 * q);
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) acc[0][j] = simd::dot_pair(acc[0][j], xb, simd::load_pairs(w + j * LANES * 2));
    } else if constexpr (simd::DOT_FLUSH && C > 1) {  // emulated: one Vec's weights at a time, so that the rows'
      // accumulators stay in registers (all weights held first, AVX2's 2-row block kept 3 of its 8 in memory)
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) {
        const simd::Pairs wj = simd::load_pairs(w + j * LANES * 2);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) acc[m][j] = simd::dot_pair(acc[m][j], simd::set_pair(xp + m * ldp + 2 * q), wj);
      }
    } else {
      simd::Pairs wv[C];
      for (int j = 0; j < C; ++j) wv[j] = simd::load_pairs(w + j * LANES * 2), simd::pin(wv[j]);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const simd::XPair xb = simd::set_pair(xp + m * ldp + 2 * q);
#pragma GCC unroll 8
        for (int j = 0; j < C; ++j) acc[m][j] = simd::dot_pair(acc[m][j], xb, wv[j]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < C; ++j) {
      const int64_t c = c0 + j * LANES;
      if (c >= cols) break;
      simd::store_first(out + m * ldo + c, acc[m][j], cols - c);
    }
}

// The two GEMM kernels the panel loop below drives: their input rows, register blocks and one pass over a panel.
template <typename W>
struct FmaKernel {  // fp32 input rows, fp32 or bf16 weights [K][NR]: one FMA per weight and row
  using In = float;
  using Weight = W;
  static constexpr int ROWS = simd::GEMM_ROWS;
  static constexpr int vecs(int m) { return simd::gemm_vecs(m); }
  static constexpr int64_t STEP_BYTES = NR * sizeof(W);  // one k step of a panel
  template <int M, int C, bool NEXT>
  static void block(const In* x, int64_t ldx, const W* panel, int64_t steps, float* out, int64_t ldo, int64_t cols,
                    int64_t c0, Prefetch pf) {
    panel_block<W, M, C, NEXT>(x, ldx, panel, steps, out, ldo, cols, c0, pf);
  }
};
struct DotKernel {  // bf16dot: bf16 input rows, weights in k pairs [K2][NR][2]: a pair dot per weight pair and row
  using In = simd::DotInput;
  using Weight = uint16_t;
  static constexpr int ROWS = simd::DOT_ROWS;
  static constexpr int vecs(int m) { return simd::dot_vecs(m); }
  static constexpr int64_t STEP_BYTES = NR * 2 * sizeof(uint16_t);  // one k pair of a panel
  template <int M, int C, bool NEXT>
  static void block(const In* x, int64_t ldx, const uint16_t* panel, int64_t steps, float* out, int64_t ldo,
                    int64_t cols, int64_t c0, Prefetch pf) {
    dot_block<M, C, NEXT>(x, ldx, panel, steps, out, ldo, cols, c0, pf);
  }
};

// Register-block work of one pass of `m` rows (Kern::vecs(m) Vec columns), and of all m-row passes over a panel
template <typename Kern> constexpr int64_t pass_work(int m) { return m * Kern::vecs(m); }
template <typename Kern> constexpr int64_t panel_work(int m, int64_t cols) {
  const int64_t width = Kern::vecs(m) * LANES;
  return (cols + width - 1) / width * pass_work<Kern>(m);
}

// M rows over a whole panel, in passes of Kern::vecs(M) Vec columns (one pass where the registers hold 64 columns).
// `done` of `work` counts the panel's work so far: each pass prefetches the slice of the next panel that is its
// share of the work, so the traffic spreads over the panel's compute time (`Prefetch`).
template <typename Kern, int M>
inline void panel_rows(const typename Kern::In* x, int64_t ldx, const typename Kern::Weight* panel, int64_t steps,
                       float* out, int64_t ldo, int64_t cols, const typename Kern::Weight* next, bool first_panel,
                       int64_t& done, int64_t work) {
  constexpr int C = Kern::vecs(M);
  constexpr int64_t pass = pass_work<Kern>(M);
  const int64_t lines = steps * Kern::STEP_BYTES / 64;
  for (int64_t c0 = 0; c0 < cols; c0 += C * LANES, done += pass) {
    const bool one_pass = work == pass, ahead = one_pass || (first_panel && done == 0);
    if (one_pass || !next) {  // nothing to overlap with, or nothing after this panel: prefetch within it
      Kern::template block<M, C, false>(x, ldx, panel, steps, out, ldo, cols, c0, {ahead, nullptr, 0, 0});
      continue;
    }
    const int64_t l0 = lines * done / work, l1 = lines * (done + pass) / work;
    Kern::template block<M, C, true>(x, ldx, panel, steps, out, ldo, cols, c0,
                                     {ahead, reinterpret_cast<const char*>(next), 64 * l0, l1 - l0});
  }
}

// f(std::integral_constant<int, n>{}) for a runtime n in [1, MAX]: a register block takes its row count as a template
// argument, so a call's last rows (fewer than a full block) pick theirs here, in one switch for every kernel
template <int MAX, typename F>
inline void with_rows(int64_t n, F&& f) {
  static_assert(MAX <= 6, "add the cases");
  switch (n) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: if constexpr (MAX >= 2) f(std::integral_constant<int, 2>{}); break;
    case 3: if constexpr (MAX >= 3) f(std::integral_constant<int, 3>{}); break;
    case 4: if constexpr (MAX >= 4) f(std::integral_constant<int, 4>{}); break;
    case 5: if constexpr (MAX >= 5) f(std::integral_constant<int, 5>{}); break;
    case 6: if constexpr (MAX >= 6) f(std::integral_constant<int, 6>{}); break;
    default: break;
  }
}

// All `rows` over one panel: blocks of Kern::ROWS rows, then the rest as one smaller block.
template <typename Kern>
void rows_block(const typename Kern::In* x, int64_t ldx, const typename Kern::Weight* panel, int64_t steps,
                float* out, int64_t ldo, int64_t rows, int64_t cols, const typename Kern::Weight* next,
                bool first_panel) {
  constexpr int MR = Kern::ROWS;
  const int rest = static_cast<int>(rows % MR);
  const int64_t work = rows / MR * panel_work<Kern>(MR, cols) + (rest ? panel_work<Kern>(rest, cols) : 0);
  int64_t m = 0, done = 0;
  for (; m + MR <= rows; m += MR)
    panel_rows<Kern, MR>(x + m * ldx, ldx, panel, steps, out + m * ldo, ldo, cols, next, first_panel, done, work);
  with_rows<MR - 1>(rest, [&](auto r) {  // the last rows: a smaller block
    panel_rows<Kern, decltype(r)::value>(x + m * ldx, ldx, panel, steps, out + m * ldo, ldo, cols, next, first_panel,
                                         done, work);
  });
}

// AMX bf16 GEMM (CPUs with AMX: Sapphire Rapids and later). Why: past one register block of rows the FMA path is
// bound by the FMA ports (bf16 T=16 cost ~2x T=1 here); one TDPBF16PS does 16 rows x 16 columns x 32 k
// multiply-adds, so up to 16 rows cost about what one row costs.
// Exactness: each fp32 activation is split x = hi + mid + lo into three bf16 (hi = bf16(x), mid = bf16(x - hi),
// lo = bf16(x - hi - mid): each residual is exact in fp32 and the last has at most 8 significant bits), and a bf16
// weight times a bf16 is exact in fp32, so every product w*x enters the sums exactly: the same bf16-weight,
// fp32-activation arithmetic as the FMA path, summed in another fixed order (each part's products over k in
// 32-k blocks, then (hi + mid) + lo). A tile row is one output row and every row goes through the same tile ops
// whatever the other rows, so rows stay bitwise invariant of T.
// Layouts: weights [P, 4, Kp/32, 16, 16, 2] (Kp = K rounded up to 32, zero-padded): per panel, each group of 16
// columns is one contiguous stream of 1 KB tiles (16 k-pairs x 16 columns x 2 consecutive k); activations
// [row blocks of 16][Kp/32][3][16][32], so each activation tile is 1 KB contiguous too.
// Measured (standalone copies of these loops, 2 threads, every layer's weights): tiles whose rows lay 256 bytes
// apart, and one accumulator taking the three parts in turn, left T=1 ~40% slower than the FMA path; three
// accumulators per output tile (three independent TDPBF16PS chains) and streamed tiles put it near par at T=1.
// Whole forward (bf16, interleaved with the FMA path, best of 4 rounds): context 128 T=16 34.3 -> 26.9 ms, T=32
// 63.3 -> 46.2, but T=1 16.2 -> 17.0 (1-2 rows pay the three-way split and 15/16 idle tile rows): so it is opt-in
// (kernels.py `amx_enabled`, SPECTRT_AMX=1).
#if defined(SPECTRT_ISA_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SPECTRT_HAS_AMX 1
#endif
constexpr int64_t KB = 32;       // k per tile step: 32 bf16, one 64-byte tile row
constexpr int64_t TILE = 512;    // bf16 per 1 KB tile
constexpr int64_t AMX_AHEAD = 4; // weight tiles prefetched ahead in a column group's stream

bool amx_init() {  // Linux grants AMX's tile data state to a process on request; false if not compiled in or refused
#ifdef SPECTRT_HAS_AMX
  constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
  return false;
#endif
}

#ifdef SPECTRT_HAS_AMX  // the AMX path is AVX-512 code by nature: written in intrinsics, not over simd.h
inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? 0xFFFF : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
}
inline __m512 bf16_to_fp32(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline __m256i fp32_to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }  // round to nearest even

// x [rows, K] -> xs: the hi, mid and lo bf16 parts of each activation in the tile layout above (padded k: 0; the
// last row block's rows past `rows` are never loaded: its tiles are configured with fewer rows).
void split_bf16x3(const float* x, int64_t rows, int64_t K, int64_t Kp, uint16_t* xs) {
  const int64_t blocks = Kp / KB;
  for (int64_t m = 0; m < rows; ++m) {
    uint16_t* row = xs + (m / 16) * blocks * 3 * TILE + (m % 16) * KB;
    for (int64_t k = 0; k < Kp; k += 16) {
      const __mmask16 mask = tail_mask(K - k);
      const __m512 v = _mm512_maskz_loadu_ps(mask, x + m * K + k);
      const __m256i hi = fp32_to_bf16(v);
      const __m512 r = _mm512_sub_ps(v, bf16_to_fp32(hi));
      const __m256i mid = fp32_to_bf16(r);
      const __m256i lo = fp32_to_bf16(_mm512_sub_ps(r, bf16_to_fp32(mid)));
      uint16_t* t = row + (k / KB) * 3 * TILE + k % KB;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(t), hi);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(t + TILE), mid);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(t + 2 * TILE), lo);
    }
  }
}

struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles below `row_tiles` hold `rows` rows (sums, activations), the others 16 (weight tiles); every row 64 bytes.
void configure_tiles(int rows, int row_tiles) {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = t < row_tiles ? rows : 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// Three parts (bf16 engines): tiles 0-2 the hi, mid, lo sums of rows x 16 fp32 outputs; 3-5 the activations' parts
// (rows x 32 bf16); 6-7 weight tiles (16 k-pairs x 16 columns x 2), alternating so a load need not wait for the
// last product.
constexpr int SPLIT_ROW_TILES = 6;

// sums[rows][48] = the hi, mid and lo partial sums of one 16-column group (`w`: its stream of Kp/32 tiles).
void amx_group(const uint16_t* xs, int64_t blocks, const uint16_t* w, float* sums) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint16_t* wt = w + b * TILE;
    for (int64_t line = 0; line < 16; ++line)  // prefetches never fault: past the last tile is harmless
      _mm_prefetch(reinterpret_cast<const char*>(wt + AMX_AHEAD * TILE) + 64 * line, _MM_HINT_T0);
    const uint16_t* a = xs + b * 3 * TILE;
    _tile_loadd(3, a, 64);
    _tile_loadd(4, a + TILE, 64);
    _tile_loadd(5, a + 2 * TILE, 64);
    if (b & 1) {
      _tile_loadd(7, wt, 64);
      _tile_dpbf16ps(0, 3, 7);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 7);
    } else {
      _tile_loadd(6, wt, 64);
      _tile_dpbf16ps(0, 3, 6);
      _tile_dpbf16ps(1, 4, 6);
      _tile_dpbf16ps(2, 5, 6);
    }
  }
  _tile_stored(0, sums, 48 * 4);
  _tile_stored(1, sums + 16, 48 * 4);
  _tile_stored(2, sums + 32, 48 * 4);
}

// bf16dot on AMX: the GEMM inputs are already bf16 (`round_bf16`, as on every build), so one part and one
// TDPBF16PS per weight tile, a third of the tile work of the split above. Its sums are the tile unit's own: probed
// on an Intel Xeon model 207 (standalone TDPBF16PS calls, 5M sums), one k pair is rounded to fp32 and then added to the
// accumulator (a second rounding), which is neither VDPBF16PS's two FMAs nor an exact sum, and over 16 pairs it
// matches no sequential model: so an AMX bf16dot engine is row invariant (tree == AR) but its logits are its own,
// as the bf16 AMX path's are. Tiles: 0-1 the sums of two 16-column groups (two independent TDPBF16PS chains),
// 2 the activation tile, 3-6 weight tiles (a group's pair per block parity, so a load never waits for the product
// that last read its tile).
constexpr int PAIR_ROW_TILES = 3;

// x [rows, K] -> xs: each activation rounded to bf16 (`round_bf16`) in the one-part tile layout
// [row blocks of 16][Kp/32][16][32] (padded k: 0).
void round_tiles_bf16(const float* x, int64_t rows, int64_t K, int64_t Kp, uint16_t* xs) {
  const int64_t blocks = Kp / KB;
  for (int64_t m = 0; m < rows; ++m) {
    uint16_t* row = xs + (m / 16) * blocks * TILE + (m % 16) * KB;
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t q = 0, k = b * KB; q < KB; ++q, ++k) row[b * TILE + q] = k < K ? round_bf16(x[m * K + k]) : 0;
  }
}

// sums[rows][32] = the pair sums of two 16-column groups (`w`: the first group's stream of Kp/32 tiles, the second's
// follows it).
void amx_pair_groups(const uint16_t* xs, int64_t blocks, const uint16_t* w, float* sums) {
  const uint16_t* w1 = w + blocks * TILE;
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint16_t *wt0 = w + b * TILE, *wt1 = w1 + b * TILE;
    for (int64_t line = 0; line < 16; ++line) {  // prefetches never fault: past the last tile is harmless
      _mm_prefetch(reinterpret_cast<const char*>(wt0 + AMX_AHEAD * TILE) + 64 * line, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wt1 + AMX_AHEAD * TILE) + 64 * line, _MM_HINT_T0);
    }
    _tile_loadd(2, xs + b * TILE, 64);
    if (b & 1) {
      _tile_loadd(5, wt0, 64);
      _tile_loadd(6, wt1, 64);
      _tile_dpbf16ps(0, 2, 5);
      _tile_dpbf16ps(1, 2, 6);
    } else {
      _tile_loadd(3, wt0, 64);
      _tile_loadd(4, wt1, 64);
      _tile_dpbf16ps(0, 2, 3);
      _tile_dpbf16ps(1, 2, 4);
    }
  }
  _tile_stored(0, sums, 32 * 4);
  _tile_stored(1, sums + 16, 32 * 4);
}

// (+ bias) -> out[16 columns], then residual += out: as the FMA path does
inline void amx_store(__m512 v, int64_t cols, const float* bias, float* out, float* residual) {
  const __mmask16 mask = tail_mask(cols);
  if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias));
  _mm512_mask_storeu_ps(out, mask, v);
  if (residual) _mm512_mask_storeu_ps(residual, mask, _mm512_add_ps(_mm512_maskz_loadu_ps(mask, residual), v));
}
#endif

// `pairs`: bf16dot's weights (one bf16 part per input, `amx_pair_groups`), else bf16's (three parts, `amx_group`).
void gemm_amx(const float* x, int64_t rows, int64_t K, const torch::Tensor& packed, bool pairs, int64_t n_out,
              float* out, const float* bias, float* residual, uint16_t* xs) {
#ifdef SPECTRT_HAS_AMX
  const int64_t panels = packed.size(0), blocks = packed.size(2), Kp = blocks * KB;
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  if (pairs) {
    round_tiles_bf16(x, rows, K, Kp, xs);
    // work items: (panel, 32-column half), so 2 threads split a 9-panel projection evenly
    parallel_for(panels * 2, [&](int64_t h0, int64_t h1) {
      alignas(64) float sums[16 * 32];
      int configured = 0;  // tile shapes are per thread: set for this call's row blocks, released at the end
      for (int64_t h = h0; h < h1; ++h) {
        const int64_t c0 = h * 32;
        if (c0 >= n_out) continue;  // a padded half of the last panel
        for (int64_t m0 = 0; m0 < rows; m0 += 16) {
          const int mr = static_cast<int>(std::min<int64_t>(16, rows - m0));
          if (mr != configured) configure_tiles(configured = mr, PAIR_ROW_TILES);
          amx_pair_groups(xs + (m0 / 16) * blocks * TILE, blocks, wp + 2 * h * blocks * TILE, sums);
          for (int64_t m = 0; m < mr; ++m)
            for (int64_t j = 0; j < 2; ++j) {
              const int64_t c = c0 + 16 * j, o = (m0 + m) * n_out + c;
              if (c < n_out)
                amx_store(_mm512_load_ps(sums + m * 32 + 16 * j), n_out - c, bias ? bias + c : nullptr, out + o,
                          residual ? residual + o : nullptr);
            }
        }
      }
      if (configured) _tile_release();
    });
    return;
  }
  split_bf16x3(x, rows, K, Kp, xs);
  // work items: (panel, 16-column group), so 2 threads split even a 9-panel projection evenly
  parallel_for(panels * 4, [&](int64_t g0, int64_t g1) {
    alignas(64) float sums[16 * 48];
    int configured = 0;  // tile shapes are per thread: set for this call's row blocks, released at the end
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t c0 = g * 16, cols = std::min<int64_t>(16, n_out - c0);
      if (cols <= 0) continue;  // a padded group of the last panel
      for (int64_t m0 = 0; m0 < rows; m0 += 16) {
        const int mr = static_cast<int>(std::min<int64_t>(16, rows - m0));
        if (mr != configured) configure_tiles(configured = mr, SPLIT_ROW_TILES);
        amx_group(xs + (m0 / 16) * blocks * 3 * TILE, blocks, wp + g * blocks * TILE, sums);
        for (int64_t m = 0; m < mr; ++m) {  // (hi + mid) + lo
          const float* s = sums + m * 48;
          const int64_t o = (m0 + m) * n_out + c0;
          amx_store(_mm512_add_ps(_mm512_add_ps(_mm512_load_ps(s), _mm512_load_ps(s + 16)), _mm512_load_ps(s + 32)),
                    cols, bias ? bias + c0 : nullptr, out + o, residual ? residual + o : nullptr);
        }
      }
    }
    if (configured) _tile_release();
  });
#else
  TORCH_CHECK(false, "AMX-packed weights but the native kernels were built without AMX: repack without AMX");
#endif
}

// Whether panel p + 1 is the next this thread computes (so p's passes prefetch it): within its chunk [., p1), or
// the chunk's stream goes on (the pool's `Stream`: the thread's own range continues after the chunk).
inline bool next_panel(int64_t p, int64_t p1, int64_t panels, pool::Stream s) {
  return p + 1 < p1 || (s.more && p + 1 < panels);
}

// Greedy decoding's argmax of each logits row (numpy's: the first maximum, or the first NaN where there is one). The
// LM head's GEMM takes each panel's maximum while its outputs are in L1; the row's argmax is then the first index of
// the first panel holding the largest maximum (64 values read). Why: read afterwards, from Python or here, the rows
// (196 KB each for a 49k vocabulary) came from memory: after the forward's weight stream every one is cold (numpy's
// argmax ~15 us per request a step at batch 8, 70 us for a batch-1 tree of 4 rows, Zen 4).
struct PanelMax {
  float value;
  bool finite;  // every value finite: else the row is scanned exactly (`exact_argmax`)
};

inline PanelMax panel_max(const float* x, int64_t n) {  // a NaN or infinity makes (v - v) NaN
  Vec m = simd::set1(-INFINITY), zero = simd::zero();
  int64_t j = 0;
  for (; j + LANES <= n; j += LANES) {
    const Vec v = simd::load(x + j);
    m = simd::max(m, v);
    zero = zero + (v - v);
  }
  float best = j ? simd::reduce_max(m) : -INFINITY;
  bool finite = !j || simd::reduce_add(zero) == 0.0f;
  for (; j < n; ++j) {
    finite = finite && std::isfinite(x[j]);
    best = std::max(best, x[j]);
  }
  return {best, finite};
}

inline int64_t exact_argmax(const float* x, int64_t n) {  // numpy's rule, scalar: a NaN is the maximum
  int64_t at = 0;
  for (int64_t t = 0; t < n; ++t) {
    if (std::isnan(x[t])) return t;
    if (x[t] > x[at]) at = t;
  }
  return at;
}

// The argmax of `row` [n] from its panels' maxima (`part[p * stride]`, panel p = columns [p * NR, p * NR + NR)).
inline int64_t row_argmax(const float* row, int64_t n, const PanelMax* part, int64_t stride) {
  const int64_t panels = (n + NR - 1) / NR;
  int64_t top = 0;
  for (int64_t p = 0; p < panels; ++p) {
    if (!part[p * stride].finite) return exact_argmax(row, n);
    if (part[p * stride].value > part[top * stride].value) top = p;  // strict: the first panel holding it
  }
  const float* x = row + top * NR;
  for (int64_t t = 0; t < std::min(NR, n - top * NR); ++t)
    if (x[t] == part[top * stride].value) return top * NR + t;
  return exact_argmax(row, n);  // unreachable: the panel holds its maximum
}

// The argmax of a row already written (the AMX path, tests): its panels' maxima into `part`, then `row_argmax`.
inline int64_t written_row_argmax(const float* row, int64_t n, std::vector<PanelMax>& part) {
  part.resize((n + NR - 1) / NR);
  for (int64_t c0 = 0; c0 < n; c0 += NR) part[c0 / NR] = panel_max(row + c0, std::min(NR, n - c0));
  return row_argmax(row, n, part.data(), 1);
}

// out[rows, N] = x[rows, K] @ W^T (+ bias), W packed [P, K, NR] (or for AMX, 6-D bf16, above; for bf16dot, k pairs
// [P, K2, NR, 2], `dot_block`). With
// `residual`, then residual += out (out is scratch): the sum is x + f(x) in that order, as in the reference forward.
// With `argmax`, each output row's argmax too (the LM head: `PanelMax`).
template <typename W>
void gemm(const float* x, int64_t rows, int64_t K, const torch::Tensor& packed, int64_t n_out, float* out,
          const float* bias, float* residual, uint16_t* xs, int64_t* argmax = nullptr) {
  if (packed.dim() == 6 || packed.dim() == 5) {  // AMX tiles: 6-D bf16's, 5-D bf16dot's (kernels.py `pack`)
    gemm_amx(x, rows, K, packed, packed.dim() == 5, n_out, out, bias, residual, xs);
    std::vector<PanelMax> part;
    for (int64_t m = 0; argmax && m < rows; ++m) argmax[m] = written_row_argmax(out + m * n_out, n_out, part);
    return;
  }
  const int64_t panels = packed.size(0);
  std::vector<PanelMax> partial(argmax ? panels * rows : 0);
  // a panel's outputs while in L1: its maxima (the LM head), then + bias, then residual += out
  auto finish = [&](int64_t p, int64_t c0, int64_t cols) {
    if (argmax)
      for (int64_t m = 0; m < rows; ++m) partial[p * rows + m] = panel_max(out + m * n_out + c0, cols);
    if (bias)
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t c = c0; c < c0 + cols; ++c) out[m * n_out + c] = out[m * n_out + c] + bias[c];
    if (residual)
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t c = c0; c < c0 + cols; ++c) residual[m * n_out + c] = residual[m * n_out + c] + out[m * n_out + c];
  };
  if (packed.dim() == 4) {  // bf16dot: the inputs rounded to bf16 once, then the pair sums
    TORCH_CHECK(xs != nullptr, "a k-pair (bf16dot) weight needs the bf16 activation scratch");
    const int64_t K2 = packed.size(1), ldp = 2 * K2;
    // the scratch holds rows x 3 Kp bf16 (AMX's three parts), room for rows x ldp fp32 (DotInput where emulated)
    simd::DotInput* xd = reinterpret_cast<simd::DotInput*>(xs);
    round_rows_bf16(x, rows, K, ldp, xd);
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
    parallel_for(panels, [&](int64_t p0, int64_t p1, pool::Stream s) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t c0 = p * NR, cols = std::min(NR, n_out - c0);
        {
          FlushDenormals flush;  // around the sums only: the epilogue's adds keep IEEE denormals on every build
          const uint16_t* next = next_panel(p, p1, panels, s) ? wp + (p + 1) * K2 * NR * 2 : nullptr;
          rows_block<DotKernel>(xd, ldp, wp + p * K2 * NR * 2, K2, out + c0, n_out, rows, cols, next,
                                p == p0 && s.first);
        }
        finish(p, c0, cols);
      }
    });
  } else {
    const W* wp = packed.data_ptr<W>();
    parallel_for(panels, [&](int64_t p0, int64_t p1, pool::Stream s) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t c0 = p * NR, cols = std::min(NR, n_out - c0);
        const W* next = next_panel(p, p1, panels, s) ? wp + (p + 1) * K * NR : nullptr;
        rows_block<FmaKernel<W>>(x, K, wp + p * K * NR, K, out + c0, n_out, rows, cols, next, p == p0 && s.first);
        finish(p, c0, cols);
      }
    });
  }
  for (int64_t m = 0; argmax && m < rows; ++m) argmax[m] = row_argmax(out + m * n_out, n_out, partial.data() + m, rows);
}

// W8A8 projection (SmoothQuant, runtime/int8.py): x * pre_quant_scale -> round-half-even(x * s) clamped to
// [-128, 127] -> int32 dot products with the int8 weights -> float(acc) * out_scale[n] (* 1/s_m per token). The
// activation scale s is either one calibrated constant (static per-tensor) or each row's own 127 / max|x_m| (dynamic
// per-token: a row's scale depends on that row alone). With `group` < K, input channels come in groups of `group`
// with one activation scale per (row, group) and one weight scale per (group, column): per group an exact int32 sum,
// then accf += float(acc - colsum_g) * out_scale_g (* 1/s_mg), groups in order. Either way a row is computed by the
// same operations whatever the other rows: invariant by construction. VNNI's dpbusd multiplies unsigned by signed
// bytes: activations are stored + 128 and `colsum` (128 * sum_k w[n, k] per group) is subtracted again. Weights
// packed [P, K/4, NR, 4]; colsum and out_scale [groups, P * NR].
struct QuantProj {
  const int8_t* w;
  const float* pre;  // may be null
  float in_scale;    // static per-tensor scale; unused when per_token
  bool per_token;
  const float* out_scale;
  const int32_t* colsum;
  int64_t panels, k4, group;  // group: input channels per scale group (a multiple of 4; K4 * 4 = one group)
};

// acc[m][c0 : c0 + 16 C] = exact int32 sums over k4 steps of four u8 activations times four s8 weights
template <int M, int C>
inline void int8_block(const uint8_t* xq, int64_t ldx, const int8_t* panel, int64_t k4, int64_t c0, int32_t* acc_out) {
  simd::IVec acc[M][C];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < C; ++j) acc[m][j] = simd::izero();
  for (int64_t k = 0; k < k4; ++k) {
    const int8_t* w = panel + (k * NR + c0) * 4;
    simd::I8Weights wv[C];
    for (int j = 0; j < C; ++j) wv[j] = simd::load_i8(w + j * LANES * 4);
    for (int m = 0; m < M; ++m) {
      uint32_t four;
      std::memcpy(&four, xq + m * ldx + 4 * k, 4);
      for (int j = 0; j < C; ++j) acc[m][j] = simd::dot4(acc[m][j], four, wv[j]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < C; ++j) simd::istore(acc_out + m * NR + c0 + j * LANES, acc[m][j]);
}

template <int M>
inline void int8_rows(const uint8_t* xq, int64_t ldx, const int8_t* panel, int64_t k4, int32_t* acc_out) {
  constexpr int C = simd::I8_VECS;
  for (int64_t c0 = 0; c0 < NR; c0 += C * LANES) int8_block<M, C>(xq, ldx, panel, k4, c0, acc_out);
}

// xq[0:ldx] = the quantized row (+ 128), K values of x (* pre) at `scale`; padded k hold 128 (zero weights there).
// Vector and scalar lanes round alike: x * pre, * scale, round half to even (as torch.round), clamp.
inline void quantize_row(const float* x, const float* pre, int64_t K, int64_t ldx, float scale, uint8_t* xq) {
  const Vec s = simd::set1(scale), lo = simd::set1(-128.0f), hi = simd::set1(127.0f), offset = simd::set1(128.0f);
  for (int64_t k = 0; k < K; k += LANES) {
    Vec v = simd::load_first(x + k, K - k);
    if (pre) v = v * simd::load_first(pre + k, K - k);
    v = simd::min(hi, simd::max(lo, simd::round_even(v * s)));
    simd::store_u8_first(xq + k, v + offset, K - k);  // integral values: the float sum is the int32 one
  }
  for (int64_t k = K; k < ldx; ++k) xq[k] = 128;
}

// max_k |x[k] * pre[k]|: a max is exact in any order.
inline float row_amax(const float* x, const float* pre, int64_t K) {
  Vec acc = simd::zero();
  for (int64_t k = 0; k < K; k += LANES) {
    Vec v = simd::load_first(x + k, K - k);
    if (pre) v = v * simd::load_first(pre + k, K - k);
    acc = simd::max(acc, simd::abs(v));
  }
  return simd::reduce_max(acc);
}

void gemm_int8(const float* x, int64_t rows, int64_t K, const QuantProj& q, int64_t n_out, float* out,
               const float* bias, float* residual, uint8_t* xq) {
  constexpr int64_t MR = simd::I8_ROWS;
  const int64_t ldx = q.k4 * 4, groups = (K + q.group - 1) / q.group, g4 = q.group / 4, np = q.panels * NR;
  std::vector<float> row_dequant(q.per_token ? rows * groups : 0);  // 1 / s_mg; 0 for an all-zero group
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t k0 = g * q.group, len = std::min(q.group, K - k0);
      const float* pre = q.pre ? q.pre + k0 : nullptr;
      float scale = q.in_scale;
      if (q.per_token) {  // as runtime/int8.scale_of: 127 / amax, 0 where amax <= 2^-24
        const float amax = row_amax(x + m * K + k0, pre, len);
        scale = amax <= 1.0f / (1 << 24) ? 0.0f : 127.0f / amax;
        row_dequant[m * groups + g] = scale == 0.0f ? 0.0f : 1.0f / scale;
      }
      quantize_row(x + m * K + k0, pre, len, g == groups - 1 ? ldx - k0 : len, scale, xq + m * ldx + k0);
    }
  parallel_for(q.panels, [&](int64_t p0, int64_t p1) {
    int32_t acc[MR * NR];
    float accf[MR * NR];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t c0 = p * NR, cols = std::min(NR, n_out - c0);
      const int8_t* panel = q.w + p * q.k4 * NR * 4;
      for (int64_t m0 = 0; m0 < rows; m0 += MR) {
        const int64_t mr = std::min(MR, rows - m0);
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t k40 = g * g4, k4n = std::min(g4, q.k4 - k40);
          const uint8_t* xr = xq + m0 * ldx + 4 * k40;
          const int8_t* pg = panel + k40 * NR * 4;
          with_rows<MR>(mr, [&](auto r) { int8_rows<decltype(r)::value>(xr, ldx, pg, k4n, acc); });
          const int32_t* cs = q.colsum + g * np + c0;
          const float* os = q.out_scale + g * np + c0;
          for (int64_t m = 0; m < mr; ++m) {  // float(acc - colsum) * out_scale (* 1/s_mg), summed over groups
            const float dq = q.per_token ? row_dequant[(m0 + m) * groups + g] : 1.0f;
            for (int64_t j = 0; j < NR; ++j) {
              float v = static_cast<float>(acc[m * NR + j] - cs[j]) * os[j];
              if (q.per_token) v = v * dq;
              accf[m * NR + j] = g == 0 ? v : accf[m * NR + j] + v;
            }
          }
        }
        for (int64_t m = 0; m < mr; ++m)
          for (int64_t c = 0; c < cols; ++c) {
            float v = accf[m * NR + c];
            if (bias) v = v + bias[c0 + c];
            const int64_t o = (m0 + m) * n_out + c0 + c;
            out[o] = v;
            if (residual) residual[o] = residual[o] + v;
          }
      }
    }
  });
}

// exp(x) per lane: range reduction by ln 2 and a degree-6 polynomial (~1 ulp); every lane alike; 0 below x = -32
// (2^-46). Why: in attention, slots scored far below the row's max came out of exp near
// FLT_MIN, and their products with V rows were subnormal, which Intel cores finish in microcode assists. The EAGLE-3
// head's attention is that peaked on real text: its forward at a 2,000-token context (README + DESIGN as the prompt,
// bf16, one process, interleaved with the code before) T=1 2.53 -> 0.48 ms, T=8 13.59 -> 1.29 (context 512: 0.97
// -> 0.41, 4.29 -> 0.94); the target's on real text unchanged (T=8 at 2000 28.8 vs 28.9 ms), on `spectrt profile`'s
// random-token caches 37.8 -> 30.8 (Intel Xeon model 207). Exactness: a softmax sum holds the row's max term e^0 = 1,
// so terms below 2^-46 (even 2^20 of them) cannot move it by one ulp, nor a PV sum unless the max slot's V is ~2^-23
// smaller than the others'; silu's 1 / (1 + e^-g) is 1 either way. The same on every ISA: row invariance holds.
inline Vec vexp(Vec x) {
  const Vec c = simd::max(simd::min(x, simd::set1(88.3762626647949f)), simd::set1(-87.3365478515625f));
  const Vec n = simd::round_even(c * simd::set1(1.44269504088896341f));
  Vec r = simd::fnmadd(n, simd::set1(0.693359375f), c);
  r = simd::fnmadd(n, simd::set1(-2.12194440e-4f), r);
  Vec p = simd::set1(1.0f / 720);
  for (float k : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = simd::fmadd(p, r, simd::set1(k));
  return simd::zero_below(simd::ldexp(p, n), x, -32.0f);
}

// out = x * rsqrt(mean(x^2) + eps) * weight, one row; the sum runs in 16 lanes over the row, then a fixed tree.
void rms_norm_row(const float* x, const float* weight, int64_t dim, float eps, float* out) {
  Vec acc = simd::zero();
  for (int64_t i = 0; i < dim; i += LANES) {
    const Vec v = simd::load_first(x + i, dim - i);
    acc = simd::fmadd(v, v, acc);
  }
  const float scale = 1.0f / std::sqrt(simd::reduce_add(acc) / static_cast<float>(dim) + eps);
  for (int64_t i = 0; i < dim; ++i) out[i] = weight[i] * (x[i] * scale);
}

// out[i] = silu(gate[i]) * up[i] = gate * (1 / (1 + exp(-gate))) * up over one row of n
void silu_mul_row(const float* gate, const float* up, int64_t n, float* out) {
  const Vec one = simd::set1(1.0f);
  for (int64_t i = 0; i < n; i += LANES) {
    const Vec g = simd::load_first(gate + i, n - i), u = simd::load_first(up + i, n - i);
    const Vec sig = one / (one + vexp(simd::zero() - g));
    simd::store_first(out + i, g * sig * u, n - i);
  }
}

// HF rotate-half RoPE on one head vector in place, cos/sin rows of the position table [half].
inline void rope_head(float* v, const float* cs, const float* sn, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * cs[i] - b * sn[i];
    v[i + half] = b * cs[i] + a * sn[i];
  }
}

struct Segment {
  int64_t row0, rows, length, window;  // rows of this request, its committed length, its window size
  const bool* mask;                    // [rows, window]
  float* k;                            // [L, Hkv, cap, D]
  float* v;
  int64_t capacity;
};

struct Config {
  int64_t hidden, inter, layers, heads, kv_heads, head_dim, vocab;
  float eps;
};

// The slots each row attends to: its segment's committed prefix [0, length) (implicit), then the window slots its
// tree-mask row allows, in slot order. Built once per forward (the masks are the same in every layer).
struct RowSlots {
  std::vector<int64_t> seg, start;  // per row: its segment; its window slots' offset in `window`
  std::vector<int64_t> window;      // all rows' visible window slots, concatenated (start[R] = end)
};

RowSlots visible_slots(const std::vector<Segment>& segs) {
  RowSlots v;
  for (int64_t s = 0; s < (int64_t)segs.size(); ++s)
    for (int64_t r = 0; r < segs[s].rows; ++r) {
      v.seg.push_back(s);
      v.start.push_back(v.window.size());
      for (int64_t j = 0; j < segs[s].window; ++j)
        if (segs[s].mask[r * segs[s].window + j]) v.window.push_back(segs[s].length + j);
    }
  v.start.push_back(v.window.size());
  return v;
}

// One query of a task: a (row, head) pair's q vector, score row, output, and its window slots (its tree-mask row).
struct Query {
  const float* q;
  float* sc;
  float* out;
  const int64_t* win;
  int64_t n_win;
};

// One task's attention: NQ queries over one segment's cache and one kv head (rows x heads of a GQA group) that share
// each K and V row load of the committed prefix; each query's window slots follow, its own. head_dim D in 16-lane
// chunks, CD of them fixed at compile time (0: any D, the chunk count at run time and the last chunk masked). Why
// templates: with runtime head and chunk counts GCC kept the score and PV accumulators on the stack, and every FMA
// of those chains went through a store and a load (bf16 T=1 at context 2000: AVX2 18.8 -> 10.9 ms). Per query the
// operations are those of the query alone, whichever queries share its task: the score one FMA chain over d then the
// lane sum, the softmax over its slot list, each output element one FMA chain over its slots in order (prefix, then
// window), so rows stay bitwise invariant.
template <int NQ, int CD, bool RUN>
void attend(const Query* qs, const float* kc, const float* vc, int64_t D, int64_t length, float scale) {
  // chunks a PV pass: NQ x NC accumulators within the ISA's budget (each pass reads the V rows and broadcasts each
  // query's probabilities again: as few passes as the registers allow)
  constexpr int64_t MAXC = simd::ATT_CHUNKS, BUDGET = simd::ATT_ACCUMULATORS;
  constexpr int64_t FIT = BUDGET / NQ >= 4 ? 4 : BUDGET / NQ >= 2 ? 2 : 1;
  constexpr int64_t NC0 = MAXC < FIT ? MAXC : FIT, NC = CD > 0 && CD < NC0 ? CD : NC0;
  static_assert(CD % NC == 0, "whole chunk groups");
  if constexpr (CD > 0) D = CD * LANES;  // a constant row stride in the slot loops
  const int64_t chunks = CD > 0 ? CD : (D + LANES - 1) / LANES;
  auto ld = [D](const float* p, int64_t d) {  // chunk d of a head vector (fixed shapes: never a partial chunk)
    if constexpr (CD > 0) return simd::load(p + d * LANES);
    else return simd::load_first(p + d * LANES, D - d * LANES);
  };
  float mx[NQ];
  for (int i = 0; i < NQ; ++i) mx[i] = -INFINITY;
  int64_t j = 0;
  // Scores over the prefix, in a run of rows (RUN), sixteen slots at a time per query where the ISA adds their lane
  // sums transposed (simd::reduce16, bitwise reduce_add's): the per-slot lane sum was most of a tree's attention time
  // once the K/V rows came from cache (perf, bf16 T=4 at context 1024, Zen 4). Not for one row: its prefix streams
  // from memory, and the shared per-slot loop below keeps one K row load for its heads (blocked, a T=1 forward at
  // context 2048 took 8.7-9.6 ms against 8.1-8.4).
  if constexpr (RUN && simd::ATT_SCORE_BLOCK == LANES)
    for (; j + LANES <= length; j += LANES)
      for (int i = 0; i < NQ; ++i) {
        Vec acc[LANES];
        for (int s = 0; s < LANES; ++s) acc[s] = simd::zero();
        for (int64_t d = 0; d < chunks; ++d) {
          const Vec qd = ld(qs[i].q, d);
          for (int s = 0; s < LANES; ++s) acc[s] = simd::fmadd(qd, ld(kc + (j + s) * D, d), acc[s]);
        }
        const Vec sums = simd::reduce16(acc) * simd::set1(scale);
        simd::store_first(qs[i].sc + j, sums, LANES);
        mx[i] = std::max(mx[i], simd::reduce_max(sums));
      }
  for (; j < length; ++j) {  // the rest of the prefix: q . k over d in 16-lane chunks, then the lane sum
    const float* kr = kc + j * D;
    Vec acc[NQ];
    for (int i = 0; i < NQ; ++i) acc[i] = simd::zero();
    for (int64_t d = 0; d < chunks; ++d) {
      const Vec kv = ld(kr, d);
      for (int i = 0; i < NQ; ++i) acc[i] = simd::fmadd(ld(qs[i].q, d), kv, acc[i]);
    }
    for (int i = 0; i < NQ; ++i) {
      qs[i].sc[j] = simd::reduce_add(acc[i]) * scale;
      mx[i] = std::max(mx[i], qs[i].sc[j]);
    }
  }
  for (int i = 0; i < NQ; ++i)  // and over each query's window slots
    for (int64_t w = 0; w < qs[i].n_win; ++w) {
      const float* kr = kc + qs[i].win[w] * D;
      Vec acc = simd::zero();
      for (int64_t d = 0; d < chunks; ++d) acc = simd::fmadd(ld(qs[i].q, d), ld(kr, d), acc);
      qs[i].sc[length + w] = simd::reduce_add(acc) * scale;
      mx[i] = std::max(mx[i], qs[i].sc[length + w]);
    }
  float inv[NQ];
  for (int i = 0; i < NQ; ++i) {  // softmax numerators in place, and 1 / their sum
    const int64_t L = length + qs[i].n_win;
    float* sc = qs[i].sc;
    Vec sum = simd::zero();
    const Vec vmx = simd::set1(mx[i]);
    for (int64_t j = 0; j < L; j += LANES) {
      const Vec e = simd::keep_first(vexp(simd::load_first(sc + j, L - j) - vmx), L - j);
      simd::store_first(sc + j, e, L - j);
      sum = sum + e;
    }
    inv[i] = 1.0f / simd::reduce_add(sum);
  }
  for (int64_t d0 = 0; d0 < chunks; d0 += NC) {  // out = sum_j p_j v_j, slots in order
    const int64_t nc = CD > 0 ? NC : std::min<int64_t>(NC, chunks - d0);  // fixed shapes: always NC
    Vec acc[NQ][NC];
    for (int i = 0; i < NQ; ++i)
      for (int cc = 0; cc < NC; ++cc) acc[i][cc] = simd::zero();
    for (int64_t j = 0; j < length; ++j) {
      const float* vr = vc + j * D;
      for (int cc = 0; cc < NC && cc < nc; ++cc) {
        const Vec vv = ld(vr, d0 + cc);
        for (int i = 0; i < NQ; ++i) acc[i][cc] = simd::fmadd(simd::set1(qs[i].sc[j]), vv, acc[i][cc]);
      }
    }
    for (int i = 0; i < NQ; ++i)
      for (int64_t w = 0; w < qs[i].n_win; ++w) {
        const float* vr = vc + qs[i].win[w] * D;
        for (int cc = 0; cc < NC && cc < nc; ++cc)
          acc[i][cc] = simd::fmadd(simd::set1(qs[i].sc[length + w]), ld(vr, d0 + cc), acc[i][cc]);
      }
    for (int i = 0; i < NQ; ++i)
      for (int cc = 0; cc < NC && cc < nc; ++cc) {
        const int64_t d = (d0 + cc) * LANES;
        simd::store_first(qs[i].out + d, acc[i][cc] * simd::set1(inv[i]), D - d);
      }
  }
}

using Attend = decltype(&attend<1, 0, false>);
template <int CD, bool RUN, size_t... I>
constexpr std::array<Attend, sizeof...(I)> attend_table(std::index_sequence<I...>) {
  return {attend<static_cast<int>(I) + 1, CD, RUN>...};
}

constexpr int64_t ATT_HEADS = 4;  // most heads of a GQA group one attention task takes

// How a forward's attention divides into tasks: the same in every layer, so made once a forward (with `visible_slots`).
struct AttentionTasks {
  int64_t per_task, task_groups;                  // heads a task takes; tasks per (row run, kv head)
  std::vector<std::pair<int64_t, int64_t>> runs;  // runs of one segment's rows: (first row, rows)
};

AttentionTasks attention_tasks(const Config& c, const std::vector<Segment>& segs) {
  const int64_t group = c.heads / c.kv_heads, threads = pool_threads();
  int64_t rows = 0, longest = 0;
  for (const Segment& g : segs) rows += g.rows, longest = std::max(longest, g.length);
  // One head per task only where there are too few rows to keep every thread busy *and* the contexts are short:
  // at long contexts a group's heads sharing each K/V row load beats the balance of more, smaller tasks. Measured
  // (Zen 4, bf16 T=1, one process, interleaved, three runs): context 2000 11.09-12.27 -> 10.21-11.37 ms, 1024
  // -0.05 to -0.29 ms, but 128 +0.09 to +0.14 ms, hence the 512 threshold.
  const bool share = rows * c.kv_heads >= 4 * threads || longest >= 512;
  AttentionTasks t;
  t.per_task = share ? std::min(group, ATT_HEADS) : 1;
  t.task_groups = (group + t.per_task - 1) / t.per_task;
  // Runs of a segment's rows, as long as the queries allow while there are still two tasks a thread, split evenly.
  // Why: the rows of a tree see the same prefix, and each loaded every K/V row of it, where a run loads it once.
  // Measured with the transposed score sums (`attend`; scripts/isa_tcurve.py --against the one-row tasks, Zen 4,
  // bf16, ms): context 1024 AVX-512 T=4 10.1 -> 9.4, T=8 17.1 -> 15.9 (fp32 14.2 -> 13.5, 21.0 -> 20.2); AVX2 T=4
  // 13.4 -> 12.5, T=8 21.4 -> 20.2; context 128 T=16 26.3 -> 22.6, T=1-8 within noise; a causal 64-row prefill
  // chunk at context 512 118.6 -> 113.9, at context 0 within 1-2% (its slots are window slots: per query).
  const int64_t most_rows =
      std::max<int64_t>(1, std::min(simd::ATT_QUERIES / t.per_task, rows * c.kv_heads * t.task_groups / (2 * threads)));
  for (const Segment& g : segs) {
    const int64_t n = (g.rows + most_rows - 1) / most_rows;
    for (int64_t k = 0; k < n; ++k) t.runs.emplace_back(g.row0 + g.rows * k / n, g.rows * (k + 1) / n - g.rows * k / n);
  }
  return t;
}

// Attention of every (row, head) over exactly its visible slots, in slot order (`attend`). A task is a kv head, the
// heads of its GQA group it takes and a run of one segment's rows (`attention_tasks`): every query of the task shares
// each K and V row load of the prefix, and the loop runs over slots with every (query, 16-lane chunk) its own
// accumulator, so FMA chains run side by side. Why: the former per-(row, head) loop re-read K/V per head and ran one
// dependent FMA chain per pass over the slots.
// Measured (whole forward, as for PREFETCH_BYTES), context 1024: bf16 T=8 58.4 -> 51.4 ms, T=32 123.5 -> 103.7;
// fp32 T=16 104.7 -> 94.0, T=32 178.6 -> 138.9; context 128 within noise. Logits are bitwise unchanged.
// At one row and long contexts attention streams the KV cache (46 KB a token, fp32: 94 MB a forward at context
// 2048, past any cache), so it runs at memory speed, not FMA speed. Tried and dropped (scripts/isa_tcurve.py
// --against HEAD --context 1024/2048, bf16, Zen 4, interleaved, T=1-8 within noise, logits bitwise unchanged):
// sixteen slots' lane sums at once for one row (a transposed reduction instead of one reduce_add per slot; for a run
// of rows it pays, `attend`), software prefetch of K/V rows 8 slots ahead, and threads splitting (row, head) pairs
// evenly (4 and 5 heads at T=1, not 6 and 3).
void attention(const Config& c, int64_t layer, const std::vector<Segment>& segs, const RowSlots& vis,
               const AttentionTasks& tasks, const float* qkv, int64_t ld_qkv, float* out, float* scores,
               int64_t scores_ld) {
  constexpr int64_t MAXQ = simd::ATT_QUERIES;  // queries (rows x heads) a task takes
  // per query count: the common head_dim (64) compiled with its chunk count, and any other
  static constexpr auto FIXED = attend_table<4, false>(std::make_index_sequence<MAXQ>());
  static constexpr auto ANY = attend_table<0, false>(std::make_index_sequence<MAXQ>());
  static constexpr auto FIXED_RUN = attend_table<4, true>(std::make_index_sequence<MAXQ>());
  static constexpr auto ANY_RUN = attend_table<0, true>(std::make_index_sequence<MAXQ>());
  const int64_t H = c.heads, D = c.head_dim, group = c.heads / c.kv_heads;
  const int64_t per_task = tasks.per_task, task_groups = tasks.task_groups;
  const auto& runs = tasks.runs;
  const int64_t n_runs = runs.size();
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // Tasks in (kv head, head group, run) order: a thread's run of tasks reads one kv head's K/V for run after run
  // (from L1/L2 after the first), where row-major order had each thread read every kv head's K/V from memory.
  // Measured (scripts/isa_tcurve.py --against HEAD, context 1024, Zen 4, ms, before -> after, one row a task):
  // AVX-512 bf16 T=2 8.4 -> 7.6, T=4 11.7 -> 10.4, T=8 19.8 -> 18.7; fp32 T=2 13.5 -> 11.6; AVX2 bf16 T=2 13.4 ->
  // 10.4, T=4 15.5 -> 13.0; T=1 and context 128 within noise.
  parallel_for(n_runs * c.kv_heads * task_groups, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t kvh = t / (task_groups * n_runs);
      const auto [row0, rows] = runs[t % n_runs];
      const int64_t h0 = kvh * group + t / n_runs % task_groups * per_task;
      const int64_t nh = std::min(per_task, (kvh + 1) * group - h0);
      const Segment& g = segs[vis.seg[row0]];
      Query qs[MAXQ];
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t row = row0 + r;
        for (int64_t i = 0; i < nh; ++i)
          qs[r * nh + i] = {qkv + row * ld_qkv + (h0 + i) * D, scores + (row * H + h0 + i) * scores_ld,
                            out + row * (H * D) + (h0 + i) * D, vis.window.data() + vis.start[row],
                            vis.start[row + 1] - vis.start[row]};
      }
      const float* kc = g.k + ((layer * c.kv_heads + kvh) * g.capacity) * D;
      const float* vc = g.v + ((layer * c.kv_heads + kvh) * g.capacity) * D;
      (rows > 1 ? (D == 4 * LANES ? FIXED_RUN : ANY_RUN) : (D == 4 * LANES ? FIXED : ANY))[rows * nh - 1](
          qs, kc, vc, D, g.length, scale);
    }
  });
}

// One projection: a packed fp weight ([packed]) or a W8A8 one ([packed int8, pre_quant_scale or empty, in_scale [1]
// or empty (per-token), out_scale [groups, P * NR], colsum [groups, P * NR], group [1] int64]).
template <typename W>
void project(const float* x, int64_t rows, int64_t K, const std::vector<torch::Tensor>& p, int64_t n_out, float* out,
             const float* bias, float* residual, uint8_t* xq, uint16_t* xs) {
  if (p.size() == 1) {
    gemm<W>(x, rows, K, p[0], n_out, out, bias, residual, xs);
    return;
  }
  const bool per_token = p[2].numel() == 0;  // no static input scale: each row's own
  QuantProj q{p[0].data_ptr<int8_t>(), p[1].numel() ? p[1].data_ptr<float>() : nullptr,
              per_token ? 0.0f : p[2].data_ptr<float>()[0], per_token, p[3].data_ptr<float>(),
              p[4].data_ptr<int32_t>(), p[0].size(0), p[0].size(1), p[5].data_ptr<int64_t>()[0]};
  gemm_int8(x, rows, K, q, n_out, out, bias, residual, xq);
}

// The final norm of the rows whose logits the caller reads, packed to the front of `h` for the LM head: `head_rows`
// (ascending row indices), or with none given every row, or none when `logits` has no rows. Returns their count.
// Why: nobody reads a prefill chunk's logits (the prompt's last token is verified by the first decode step) nor a
// draft catch-up's but its last row's, and the LM head was ~16% of a 64-row prefill forward (bf16, Intel Xeon: 10.8
// of 66 ms). Rows stay invariant: each is normed and multiplied exactly as before, wherever it sits.
int64_t head_inputs(const float* x, int64_t Hd, const float* norm, float eps, const torch::Tensor& head_rows,
                    const torch::Tensor& logits, float* h) {
  const int64_t n = logits.size(0);
  const int64_t* rows = head_rows.numel() ? head_rows.data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; i < n; ++i) rms_norm_row(x + (rows ? rows[i] : i) * Hd, norm, Hd, eps, h + i * Hd);
  return n;
}

template <typename W>
void forward_impl(const Config& c, const torch::Tensor& tokens, const torch::Tensor& positions,
                  std::vector<Segment>& segs, const torch::Tensor& embed, const std::vector<torch::Tensor>& norms,
                  const std::vector<std::vector<torch::Tensor>>& projs, const std::vector<torch::Tensor>& bqkv,
                  const std::vector<torch::Tensor>& qk_norms, const std::vector<torch::Tensor>& bo,
                  const torch::Tensor& final_norm, const torch::Tensor& head, const torch::Tensor& rope_cos,
                  const torch::Tensor& rope_sin, const std::vector<torch::Tensor>& scratch, torch::Tensor& logits,
                  const torch::Tensor& head_rows, const std::vector<int64_t>& feature_layers, float* features,
                  int64_t* argmax) {
  const int64_t R = tokens.size(0), Hd = c.hidden, D = c.head_dim, half = D / 2;
  const int64_t q_dim = c.heads * D, kv_dim = c.kv_heads * D, qkv_dim = q_dim + 2 * kv_dim;
  float* x = scratch[0].data_ptr<float>();       // residual stream [R, hidden]
  float* h = scratch[1].data_ptr<float>();       // normed input [R, hidden]
  float* qkv = scratch[2].data_ptr<float>();     // [R, qkv_dim]
  float* att = scratch[3].data_ptr<float>();     // [R, q_dim]
  float* g13 = scratch[4].data_ptr<float>();     // [R, 2 * inter]
  float* act = scratch[5].data_ptr<float>();     // [R, inter]
  float* scores = scratch[6].data_ptr<float>();  // [R * heads, capacity]
  uint8_t* xq = scratch[7].data_ptr<uint8_t>();  // [R, max K] quantized activations (W8A8 projections)
  uint16_t* xs = reinterpret_cast<uint16_t*>(scratch[8].data_ptr<at::BFloat16>());  // [R, 3 Kp] (AMX)
  const int64_t scores_ld = scratch[6].size(1);
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cs = rope_cos.data_ptr<float>();
  const float* sn = rope_sin.data_ptr<float>();
  const float* emb = embed.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) std::memcpy(x + r * Hd, emb + tok[r] * Hd, Hd * sizeof(float));
  // EAGLE-3 features: the residual stream entering layer j (j = layers: after the last layer, before the final norm)
  // for each requested j, copied into features[r, k * hidden : (k + 1) * hidden]; a copy, so rows stay invariant.
  const int64_t n_feat = static_cast<int64_t>(feature_layers.size());
  auto capture = [&](int64_t layer) {
    for (int64_t k = 0; k < n_feat; ++k)
      if (feature_layers[k] == layer)
        for (int64_t r = 0; r < R; ++r)
          std::memcpy(features + (r * n_feat + k) * Hd, x + r * Hd, Hd * sizeof(float));
  };
  const RowSlots vis = visible_slots(segs);
  const AttentionTasks tasks = attention_tasks(c, segs);

  for (int64_t l = 0; l < c.layers; ++l) {
    capture(l);
    const float* attn_norm = norms[2 * l].data_ptr<float>();
    const float* mlp_norm = norms[2 * l + 1].data_ptr<float>();
    for (int64_t r = 0; r < R; ++r) rms_norm_row(x + r * Hd, attn_norm, Hd, c.eps, h + r * Hd);
    const float* bias = bqkv.empty() ? nullptr : bqkv[l].data_ptr<float>();
    project<W>(h, R, Hd, projs[4 * l], qkv_dim, qkv, bias, nullptr, xq, xs);
    for (int64_t r = 0; r < R; ++r) {
      float* row = qkv + r * qkv_dim;
      if (!qk_norms.empty()) {  // Qwen3: RMSNorm over each q and k head before RoPE
        const float* qn = qk_norms[2 * l].data_ptr<float>();
        const float* kn = qk_norms[2 * l + 1].data_ptr<float>();
        for (int64_t hh = 0; hh < c.heads; ++hh) rms_norm_row(row + hh * D, qn, D, c.eps, row + hh * D);
        for (int64_t hh = 0; hh < c.kv_heads; ++hh)
          rms_norm_row(row + q_dim + hh * D, kn, D, c.eps, row + q_dim + hh * D);
      }
      const float* cr = cs + pos[r] * half;
      const float* sr = sn + pos[r] * half;
      for (int64_t hh = 0; hh < c.heads + c.kv_heads; ++hh) rope_head(row + hh * D, cr, sr, half);
    }
    for (const Segment& g : segs)  // new K/V rows into the last `rows` window slots of each segment's cache
      for (int64_t r = 0; r < g.rows; ++r) {
        const int64_t slot = g.length + g.window - g.rows + r;
        const float* row = qkv + (g.row0 + r) * qkv_dim;
        for (int64_t hh = 0; hh < c.kv_heads; ++hh) {
          const int64_t off = ((l * c.kv_heads + hh) * g.capacity + slot) * D;
          std::memcpy(g.k + off, row + q_dim + hh * D, D * sizeof(float));
          std::memcpy(g.v + off, row + q_dim + kv_dim + hh * D, D * sizeof(float));
        }
      }
    attention(c, l, segs, vis, tasks, qkv, qkv_dim, att, scores, scores_ld);
    project<W>(att, R, q_dim, projs[4 * l + 1], Hd, h, bo.empty() ? nullptr : bo[l].data_ptr<float>(), x, xq, xs);
    for (int64_t r = 0; r < R; ++r) rms_norm_row(x + r * Hd, mlp_norm, Hd, c.eps, h + r * Hd);
    project<W>(h, R, Hd, projs[4 * l + 2], 2 * c.inter, g13, nullptr, nullptr, xq, xs);
    for (int64_t r = 0; r < R; ++r)
      silu_mul_row(g13 + r * 2 * c.inter, g13 + r * 2 * c.inter + c.inter, c.inter, act + r * c.inter);
    project<W>(act, R, c.inter, projs[4 * l + 3], Hd, h, nullptr, x, xq, xs);
  }
  capture(c.layers);
  const int64_t n = head_inputs(x, Hd, final_norm.data_ptr<float>(), c.eps, head_rows, logits, h);
  if (n) gemm<W>(h, n, Hd, head, logits.size(1), logits.data_ptr<float>(), nullptr, nullptr, xs, argmax);
}


// EAGLE-3 head (runtime/eagle3.py): one LLaMA layer whose attention input is [input_layernorm(embed(token)),
// hidden_norm(g)] (2H wide), g the row's hidden input (fc(target features) or the parent row's output), residual g;
// returns the draft-vocabulary logits and the layer's output (the hidden the row's children read). Same kernels and
// row invariance as forward_impl; the one-layer KV cache is the head's own.
template <typename W>
void eagle3_impl(const Config& c, const torch::Tensor& tokens, const torch::Tensor& positions,
                 std::vector<Segment>& segs, const torch::Tensor& embed, const torch::Tensor& hidden_in,
                 const std::vector<torch::Tensor>& norms, const std::vector<std::vector<torch::Tensor>>& projs,
                 const torch::Tensor& head, const torch::Tensor& fc, const torch::Tensor& rope_cos,
                 const torch::Tensor& rope_sin, const std::vector<torch::Tensor>& scratch, torch::Tensor& logits,
                 const torch::Tensor& head_rows, torch::Tensor& hidden_out) {
  const int64_t R = tokens.size(0), Hd = c.hidden, D = c.head_dim, half = D / 2;
  const int64_t q_dim = c.heads * D, kv_dim = c.kv_heads * D, qkv_dim = q_dim + 2 * kv_dim;
  float* a = scratch[0].data_ptr<float>();       // attention input [R, 2 * hidden]
  float* h = scratch[1].data_ptr<float>();       // normed [R, hidden]
  float* qkv = scratch[2].data_ptr<float>();     // [R, qkv_dim]
  float* att = scratch[3].data_ptr<float>();     // [R, q_dim]
  float* g13 = scratch[4].data_ptr<float>();     // [R, 2 * inter]
  float* act = scratch[5].data_ptr<float>();     // [R, inter]
  float* scores = scratch[6].data_ptr<float>();  // [R * heads, capacity]
  uint8_t* xq = scratch[7].data_ptr<uint8_t>();  // unused by fp weights
  float* x = hidden_out.data_ptr<float>();       // residual stream [R, hidden], the rows' output hidden
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* emb = embed.data_ptr<float>();
  const float* g = hidden_in.data_ptr<float>();
  if (hidden_in.size(1) != Hd) {  // target features of committed tokens: fc first, in this call (see eagle3_forward)
    float* projected = scratch[8].data_ptr<float>();
    gemm<W>(g, R, hidden_in.size(1), fc, Hd, projected, nullptr, nullptr, nullptr);
    g = projected;
  }
  const float *in_norm = norms[0].data_ptr<float>(), *hid_norm = norms[1].data_ptr<float>();
  const float *post_norm = norms[2].data_ptr<float>(), *final_norm = norms[3].data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    rms_norm_row(emb + tok[r] * Hd, in_norm, Hd, c.eps, a + r * 2 * Hd);
    rms_norm_row(g + r * Hd, hid_norm, Hd, c.eps, a + r * 2 * Hd + Hd);
  }
  project<W>(a, R, 2 * Hd, projs[0], qkv_dim, qkv, nullptr, nullptr, xq, nullptr);
  const float* cs = rope_cos.data_ptr<float>();
  const float* sn = rope_sin.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t hh = 0; hh < c.heads + c.kv_heads; ++hh)
      rope_head(qkv + r * qkv_dim + hh * D, cs + pos[r] * half, sn + pos[r] * half, half);
  for (const Segment& s : segs)
    for (int64_t r = 0; r < s.rows; ++r) {
      const int64_t slot = s.length + s.window - s.rows + r;
      const float* row = qkv + (s.row0 + r) * qkv_dim;
      for (int64_t hh = 0; hh < c.kv_heads; ++hh) {
        std::memcpy(s.k + (hh * s.capacity + slot) * D, row + q_dim + hh * D, D * sizeof(float));
        std::memcpy(s.v + (hh * s.capacity + slot) * D, row + q_dim + kv_dim + hh * D, D * sizeof(float));
      }
    }
  attention(c, 0, segs, visible_slots(segs), attention_tasks(c, segs), qkv, qkv_dim, att, scores, scratch[6].size(1));
  std::memcpy(x, g, R * Hd * sizeof(float));
  project<W>(att, R, q_dim, projs[1], Hd, h, nullptr, x, xq, nullptr);
  for (int64_t r = 0; r < R; ++r) rms_norm_row(x + r * Hd, post_norm, Hd, c.eps, h + r * Hd);
  project<W>(h, R, Hd, projs[2], 2 * c.inter, g13, nullptr, nullptr, xq, nullptr);
  for (int64_t r = 0; r < R; ++r)
    silu_mul_row(g13 + r * 2 * c.inter, g13 + r * 2 * c.inter + c.inter, c.inter, act + r * c.inter);
  project<W>(act, R, c.inter, projs[3], Hd, h, nullptr, x, xq, nullptr);
  const int64_t n = head_inputs(x, Hd, final_norm, c.eps, head_rows, logits, h);
  if (n) gemm<W>(h, n, Hd, head, logits.size(1), logits.data_ptr<float>(), nullptr, nullptr, nullptr);
}

}  // namespace

// head_rows: ascending int64 row indices below `rows`, one logits row each; or none given, with logits for every row
// or for none (a forward whose rows only write K/V: prefill chunks).
void check_head_rows(const torch::Tensor& head_rows, int64_t rows, const torch::Tensor& logits) {
  const int64_t n = head_rows.numel();
  TORCH_CHECK(n ? logits.size(0) == n : (logits.size(0) == rows || logits.size(0) == 0),
              "logits must have one row per head row (with none given: every row, or none)");
  if (!n) return;
  TORCH_CHECK(head_rows.scalar_type() == at::kLong && head_rows.is_contiguous(), "head_rows must be contiguous int64");
  const int64_t* r = head_rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK_VALUE(r[i] >= 0 && r[i] < rows && (i == 0 || r[i] > r[i - 1]),
                      "head_rows must be ascending row indices below ", rows, ": got ", r[i], " at ", i);
}

// segments: per request (row count, committed length, window, tree mask [rows, window] bool, k cache, v cache).
// feature_layers (may be empty): residual-stream points copied into `features` [rows, len * hidden] (EAGLE-3).
// What a model's forwards read that stays the same from call to call (weights, norms, RoPE tables, scratch), handed
// from Python once (runtime/engines/kernels.py `NativeModel.bound`, again after `reserve` grows the scratch). Why:
// pybind converted every one of these tensors at every call (SmolLM2: 120 projections, 60 norms): 23 us a target
// forward warm, 84 us on the caches a forward had just flushed, the batch-1 step's costliest host item
// (scripts/isa_tcurve.py cannot time revisions before this one against it: their forward takes the old arguments).
struct Bound {
  std::vector<int64_t> dims;
  double eps = 0.0;
  torch::Tensor embed, final_norm, head, fc, rope_cos, rope_sin;
  std::vector<torch::Tensor> norms, bqkv, qk_norms, bo, scratch;
  std::vector<std::vector<torch::Tensor>> projs;
};

void forward(const Bound& w, torch::Tensor tokens, torch::Tensor positions, std::vector<int64_t> seg_rows,
             std::vector<int64_t> seg_lengths, std::vector<torch::Tensor> masks, std::vector<torch::Tensor> k_caches,
             std::vector<torch::Tensor> v_caches, torch::Tensor logits, torch::Tensor head_rows,
             std::vector<int64_t> feature_layers, torch::Tensor features, torch::Tensor argmax) {
  const std::vector<int64_t>& dims = w.dims;
  TORCH_CHECK(dims.size() == 7, "the bound model's dims must be 7 numbers");
  Config c{dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6], static_cast<float>(w.eps)};
  std::vector<Segment> segs;
  int64_t row0 = 0;
  for (size_t s = 0; s < seg_rows.size(); ++s) {
    segs.push_back({row0, seg_rows[s], seg_lengths[s], masks[s].size(1), masks[s].data_ptr<bool>(),
                    k_caches[s].data_ptr<float>(), v_caches[s].data_ptr<float>(), k_caches[s].size(2)});
    row0 += seg_rows[s];
  }
  TORCH_CHECK(row0 == tokens.size(0), "segment rows do not add up to the tokens");
  // here, not in Python: two torch reductions on caches the forward had flushed were ~3% of a step's host work
  const int64_t* tok = tokens.data_ptr<int64_t>();
  for (int64_t r = 0; r < row0; ++r)
    TORCH_CHECK_VALUE(tok[r] >= 0 && tok[r] < dims[6], "token ids must lie in [0, ", dims[6], "): got ", tok[r]);
  TORCH_CHECK(feature_layers.empty() || features.numel() == row0 * dims[0] * (int64_t)feature_layers.size(),
              "features must be [rows, len(feature_layers) * hidden]");
  float* feat = feature_layers.empty() ? nullptr : features.data_ptr<float>();
  check_head_rows(head_rows, row0, logits);
  // argmax (optional): int64, at least one entry per logits row; filled with each row's argmax (`PanelMax`)
  TORCH_CHECK(argmax.numel() == 0 || (argmax.scalar_type() == at::kLong && argmax.is_contiguous() &&
                                      argmax.numel() >= logits.size(0)),
              "argmax must be empty or a contiguous int64 tensor with an entry per logits row");
  int64_t* best = argmax.numel() ? argmax.data_ptr<int64_t>() : nullptr;
  if (w.head.scalar_type() == at::kBFloat16)
    forward_impl<at::BFloat16>(c, tokens, positions, segs, w.embed, w.norms, w.projs, w.bqkv, w.qk_norms, w.bo,
                               w.final_norm, w.head, w.rope_cos, w.rope_sin, w.scratch, logits, head_rows,
                               feature_layers, feat, best);
  else
    forward_impl<float>(c, tokens, positions, segs, w.embed, w.norms, w.projs, w.bqkv, w.qk_norms, w.bo,
                        w.final_norm, w.head, w.rope_cos, w.rope_sin, w.scratch, logits, head_rows, feature_layers,
                        feat, best);
}

// EAGLE-3 head forward: dims = (hidden, inter, heads, kv_heads, head_dim); norms = (input, hidden, post-attention,
// final); projs = (q/k/v [K = 2 * hidden], o, gate/up, down); caches [1, kv_heads, capacity, head_dim] per segment.
// hidden_in: each row's input hidden [rows, hidden], or the target features of committed tokens [rows, fc's K], which
// `fc` projects here. Why here and not in a call of its own: that call opened its own OpenMP team after the Python
// between forwards had let it sleep, and waking it cost more than its 2 MB GEMM (py-spy, batch 1 bf16: ~0.2 ms a step).
void eagle3_forward(const Bound& w, torch::Tensor tokens, torch::Tensor positions, std::vector<int64_t> seg_rows,
                    std::vector<int64_t> seg_lengths, std::vector<torch::Tensor> masks,
                    std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
                    torch::Tensor hidden_in, torch::Tensor logits, torch::Tensor head_rows, torch::Tensor hidden_out) {
  const std::vector<int64_t>& dims = w.dims;
  TORCH_CHECK(dims.size() == 5, "the bound head's dims must be 5 numbers");
  Config c{dims[0], dims[1], 1, dims[2], dims[3], dims[4], logits.size(1), static_cast<float>(w.eps)};
  std::vector<Segment> segs;
  int64_t row0 = 0;
  for (size_t s = 0; s < seg_rows.size(); ++s) {
    segs.push_back({row0, seg_rows[s], seg_lengths[s], masks[s].size(1), masks[s].data_ptr<bool>(),
                    k_caches[s].data_ptr<float>(), v_caches[s].data_ptr<float>(), k_caches[s].size(2)});
    row0 += seg_rows[s];
  }
  TORCH_CHECK(row0 == tokens.size(0) && hidden_in.size(0) == row0 && hidden_out.size(0) == row0,
              "segment rows, hidden inputs and outputs must agree");
  const std::vector<torch::Tensor>& scratch = w.scratch;
  TORCH_CHECK(hidden_in.size(1) == dims[0] || (scratch.size() > 8 && scratch[8].size(0) >= row0),
              "target features as hidden inputs need the projection scratch");
  check_head_rows(head_rows, row0, logits);
  if (w.head.scalar_type() == at::kBFloat16)
    eagle3_impl<at::BFloat16>(c, tokens, positions, segs, w.embed, hidden_in, w.norms, w.projs, w.head, w.fc,
                              w.rope_cos, w.rope_sin, scratch, logits, head_rows, hidden_out);
  else
    eagle3_impl<float>(c, tokens, positions, segs, w.embed, hidden_in, w.norms, w.projs, w.head, w.fc, w.rope_cos,
                       w.rope_sin, scratch, logits, head_rows, hidden_out);
}

// One projection, exposed for tests and the profiler: out[rows, n_out] = x @ W^T (fp or W8A8 packed).
torch::Tensor linear(torch::Tensor x, std::vector<torch::Tensor> proj, int64_t n_out) {
  const int64_t rows = x.size(0), K = x.size(1);
  auto out = torch::empty({rows, n_out}, x.options());
  auto xq = torch::empty({rows, K + 4}, x.options().dtype(torch::kUInt8));
  auto xs = torch::empty({(rows + 15) / 16 * 16, 3 * ((K + KB - 1) / KB * KB)}, x.options().dtype(torch::kBFloat16));
  uint16_t* xsp = reinterpret_cast<uint16_t*>(xs.data_ptr<at::BFloat16>());
  if (proj[0].scalar_type() == at::kBFloat16)
    project<at::BFloat16>(x.data_ptr<float>(), rows, K, proj, n_out, out.data_ptr<float>(), nullptr, nullptr,
                          xq.data_ptr<uint8_t>(), xsp);
  else
    project<float>(x.data_ptr<float>(), rows, K, proj, n_out, out.data_ptr<float>(), nullptr, nullptr,
                   xq.data_ptr<uint8_t>(), xsp);
  return out;
}

// Each row's argmax of fp32 logits [rows, V] by the LM head's rule (`panel_max` of every NR columns, then
// `row_argmax`), exposed for tests: the GEMM computes the same from each panel it writes.
torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() && logits.size(1),
              "argmax_rows takes contiguous fp32 [rows, V] logits, V >= 1");
  const int64_t rows = logits.size(0), V = logits.size(1);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kLong));
  std::vector<PanelMax> part;
  const float* x = logits.data_ptr<float>();
  for (int64_t m = 0; m < rows; ++m) out.data_ptr<int64_t>()[m] = written_row_argmax(x + m * V, V, part);
  return out;
}

// ---- host helpers of the decode loop: microseconds each, called between forwards with the GIL held ----
// Why native: right after a forward has streamed the weights (270 MB in bf16), the loop's host work runs on cold
// caches, and every op it dispatches pays for that: in the loop a numpy top-3 over one 8,192-wide draft row took
// ~0.18 ms (0.03 warm); this one 0.04-0.06 (timers in the loop, batch 1 bf16, Zen 4). Not for the target's plain
// argmax: read after the forward, numpy's (0.06 ms in the loop) read memory as fast as a native one did (0.09 ms); the
// LM head's GEMM takes it while the rows are still in cache (`PanelMax`).

// The k largest entries of one row [V] (ties to the lower index, largest first) into ids[k], and their softmax
// probabilities into probs[k] (`best`: k floats of scratch). Rows are finite or -inf, with at least k finite entries
// (a NaN may hide a block's larger entries from the skip below: outside that contract).
// Once k entries are held, a block of 64 whose maximum does not beat the k-th is skipped whole. Why: the scalar scan
// of every entry made a call over three 8,192-wide rows (the EAGLE-3 head's draft vocabulary) 18.8 us warm, this 7.9.
static void row_top_tokens(const float* row, int64_t V, int64_t k, int64_t* top, double* probs, float* best) {
  int64_t n = 0;  // entries held, sorted by (value desc, index asc): a later equal value never displaces one
  auto offer = [&](int64_t j) {
    const float v = row[j];
    if (n == k && !(v > best[k - 1])) return;
    int64_t i = n < k ? n++ : k - 1;
    while (i > 0 && v > best[i - 1]) {
      best[i] = best[i - 1];
      top[i] = top[i - 1];
      --i;
    }
    best[i] = v;
    top[i] = j;
  };
  constexpr int64_t BLOCK = 4 * LANES;
  int64_t j = 0;
  for (; j + BLOCK <= V; j += BLOCK) {
    if (n == k) {
      const Vec m = simd::max(simd::max(simd::load(row + j), simd::load(row + j + LANES)),
                              simd::max(simd::load(row + j + 2 * LANES), simd::load(row + j + 3 * LANES)));
      if (!(simd::reduce_max(m) > best[k - 1])) continue;
    }
    for (int64_t t = j; t < j + BLOCK; ++t) offer(t);
  }
  for (; j < V; ++j) offer(j);
  const Vec peak = simd::set1(best[0]);
  Vec sum = simd::zero();
  for (int64_t j = 0; j < V; j += LANES)
    sum = sum + simd::keep_first(vexp(simd::load_first(row + j, V - j) - peak), V - j);
  const float lse = best[0] + std::log(simd::reduce_add(sum));
  for (int64_t i = 0; i < k; ++i) probs[i] = std::exp(best[i] - lse);
}

// The k largest entries of each row (ties to the lower index, largest first) and their softmax probabilities: what
// `sampling.top_tokens_reference` computes in numpy (rows are finite or -inf, with at least k finite entries).
std::pair<std::vector<std::vector<int64_t>>, std::vector<std::vector<double>>> top_tokens(torch::Tensor logits,
                                                                                         int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "top_tokens takes contiguous fp32 [rows, V] logits");
  const int64_t M = logits.size(0), V = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= V, "top_tokens needs 1 <= k <= V");
  const float* x = logits.data_ptr<float>();
  std::vector<std::vector<int64_t>> ids(M, std::vector<int64_t>(k));
  std::vector<std::vector<double>> probs(M, std::vector<double>(k));
  std::vector<float> best(k);
  for (int64_t r = 0; r < M; ++r) row_top_tokens(x + r * V, V, k, ids[r].data(), probs[r].data(), best.data());
  return {ids, probs};
}

// A cache's kept window rows moved up behind its committed prefix (`KVCache.compact`): window slot keep[i] (relative
// to `length`, ascending) becomes row length + i in every [layer, kv head] block of K and V [layers, kv_heads,
// capacity, head_dim] (fp32, contiguous). Rows already in place are skipped; each destination row precedes every
// source row still to be read, so the copy runs in place. Why native: numpy's indexed copy of two rows (gather into a temporary,
// then scatter) cost 74 us right after a target forward (26 warm), a cost of most accepted tree steps at batch 1.
void compact_cache(torch::Tensor k, torch::Tensor v, int64_t length, std::vector<int64_t> keep) {
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.scalar_type() == at::kFloat &&
              v.scalar_type() == at::kFloat && k.is_contiguous() && v.is_contiguous() && k.is_cpu() && v.is_cpu(),
              "compact_cache takes contiguous CPU fp32 K and V of one shape [layers, kv_heads, capacity, head_dim]");
  const int64_t blocks = k.size(0) * k.size(1), capacity = k.size(2), D = k.size(3);
  const int64_t n = static_cast<int64_t>(keep.size());
  TORCH_CHECK_VALUE(0 <= length && length <= capacity, "compact_cache: length ", length, " outside the capacity");
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK_VALUE(keep[i] >= i && (i == 0 || keep[i] > keep[i - 1]) && keep[i] < capacity - length,
                      "compact_cache needs ascending window slots within the capacity: got ", keep[i], " at ", i);
  int64_t first = 0;
  while (first < n && keep[first] == first) ++first;
  if (first == n) return;
  for (float* base : {k.data_ptr<float>(), v.data_ptr<float>()})
    for (int64_t b = 0; b < blocks; ++b) {
      float* block = base + b * capacity * D;
      for (int64_t i = first; i < n; ++i)
        std::memcpy(block + (length + i) * D, block + (length + keep[i]) * D, D * sizeof(float));
    }
}

// A request's suffix index: runtime/decoding/suffix.py `SuffixIndex` (its docstrings say what each method does), the
// same matches and proposals (tests/test_suffix.py compares them). Why native: at batch 8 the Python index's n-gram
// tuples, dict lookups and continuation trie cost ~12 us a request a step (~0.1 ms of a step's host work).
class SuffixIndex {
 public:
  SuffixIndex(const std::vector<int64_t>& tokens, int64_t max_ngram, int64_t min_match, int64_t max_occurrences,
              int64_t max_match)
      : max_ngram_(max_ngram), min_match_(min_match), max_occurrences_(max_occurrences), max_match_(max_match) {
    TORCH_CHECK_VALUE(1 <= min_match && min_match <= max_ngram, "min_match=", min_match,
                      " must be in [1, max_ngram=", max_ngram, "]");
    TORCH_CHECK_VALUE(max_occurrences >= 1 && max_match >= 1, "max_occurrences and max_match must be >= 1");
    extend(tokens);
  }
  void extend(const std::vector<int64_t>& tokens) { seq_.insert(seq_.end(), tokens.begin(), tokens.end()); }
  void catch_up() {
    const int64_t len = static_cast<int64_t>(seq_.size());
    for (int64_t end = indexed_; end < len; ++end)
      for (int64_t n = min_match_; n <= std::min(max_ngram_, end + 1); ++n) ends_[key(end, n)].push_back(end);
    indexed_ = len;
  }
  std::pair<int64_t, std::vector<int64_t>> longest_match() {
    catch_up();
    const int64_t last = static_cast<int64_t>(seq_.size()) - 1;
    for (int64_t n = std::min(max_ngram_, last); n >= min_match_; --n) {
      auto found = ends_.find(key(last, n));
      if (found == ends_.end()) continue;
      std::vector<int64_t> ends;
      for (int64_t e : found->second)
        if (e < last) ends.push_back(e);
      if (ends.empty()) continue;
      if (static_cast<int64_t>(ends.size()) > max_occurrences_) ends.erase(ends.begin(), ends.end() - max_occurrences_);
      int64_t match = 0;
      for (int64_t e : ends) {
        int64_t m = n;
        while (m < max_match_ && e - m >= 0 && seq_[e - m] == seq_[last - m]) ++m;
        match = std::max(match, m);
      }
      return {match, ends};
    }
    return {0, {}};
  }
  std::vector<std::tuple<std::vector<int64_t>, int64_t, std::vector<double>>> propose(int64_t max_tokens) {
    const auto [match, ends] = longest_match();
    if (!match || max_tokens <= 0) return {};
    using Path = std::vector<int64_t>;
    std::vector<Path> conts;
    for (int64_t e : ends) {
      const int64_t stop = e + 1 + std::min(max_tokens, static_cast<int64_t>(seq_.size()) - e - 1);
      if (e + 1 < stop) conts.emplace_back(seq_.begin() + e + 1, seq_.begin() + stop);
    }
    const double total = static_cast<double>(conts.size());
    auto starts = [](const Path& c, const Path& p, size_t n) {  // c begins with p's first n tokens
      return c.size() >= n && std::equal(p.begin(), p.begin() + n, c.begin());
    };
    auto count = [&](const Path& p, size_t n) {  // continuations through p's first n tokens
      int64_t k = 0;
      for (const Path& c : conts) k += starts(c, p, n);
      return k;
    };
    std::vector<Path> leaves;  // distinct continuations no longer one extends
    for (const Path& c : conts) {
      bool leaf = std::find(leaves.begin(), leaves.end(), c) == leaves.end();
      for (const Path& o : conts) leaf = leaf && !(o.size() > c.size() && starts(o, c, c.size()));
      if (leaf) leaves.push_back(c);
    }
    std::sort(leaves.begin(), leaves.end(), [&](const Path& a, const Path& b) {
      const int64_t fa = count(a, 1), fb = count(b, 1), ca = count(a, a.size()), cb = count(b, b.size());
      return fa != fb ? fa > fb : ca != cb ? ca > cb : a < b;
    });
    std::vector<std::tuple<Path, int64_t, std::vector<double>>> out;
    for (const Path& c : leaves) {
      std::vector<double> share;
      for (size_t d = 1; d <= c.size(); ++d) share.push_back(static_cast<double>(count(c, d)) / total);
      out.emplace_back(c, match, share);
    }
    return out;
  }
  const std::vector<int64_t>& tokens() const { return seq_; }
  int64_t indexed() const { return indexed_; }

 private:
  std::string key(int64_t end, int64_t n) const {  // the n-gram ending at `end`, as bytes
    return std::string(reinterpret_cast<const char*>(seq_.data() + end - n + 1), n * sizeof(int64_t));
  }
  int64_t max_ngram_, min_match_, max_occurrences_, max_match_, indexed_ = 0;
  std::vector<int64_t> seq_;
  std::unordered_map<std::string, std::vector<int64_t>> ends_;
};

// ---- the speculation budget's arithmetic: runtime/decoding/policy.py's `allocate`, `choose_drafted`,
// `drafted_rate` over its `CostCurve` and `DraftingCost`, operation for operation (the same doubles in the same order,
// so bitwise the same choices: tests/test_policy.py compares them). Why native: each step weighs its candidates with
// these ~5 times, ~30 Python calls each on the caches a forward had flushed (~0.1 ms a step at batch 8, bf16dot). ----

// ms vs rows, piecewise linear through (xs, ys), xs ascending; flat below, the last slope above (`CostCurve`).
struct Curve {
  std::vector<double> xs, ys;
  double operator()(double t) const {
    const size_t n = xs.size();
    if (std::isnan(t)) return t;  // as Python's: no boundary test holds, and no segment may be read
    if (t <= xs[0]) return ys[0];
    if (t >= xs[n - 1]) {
      if (n == 1) return ys[0];
      const double a = xs[n - 2], b = xs[n - 1];
      return ys[n - 1] + (ys[n - 1] - ys[n - 2]) / (b - a) * (t - b);
    }
    const size_t i = std::lower_bound(xs.begin(), xs.end(), t) - xs.begin();
    const double a = xs[i - 1], b = xs[i];
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (t - a) / (b - a);
  }
};

// ms of a drafting step's passes by (first-pass rows, requests) (`DraftingCost`): curves[s - 1] is a draft forward
// over s segments (the last for more).
struct DraftCost {
  std::vector<std::shared_ptr<Curve>> curves;
  int64_t levels = 0;
  int64_t width = 1;
  double host_ms = 0.0, host_more_ms = 0.0;
  double pass(double rows, int64_t segments) const {
    const int64_t s = static_cast<int64_t>(std::max(std::min(static_cast<double>(segments), rows), 1.0));
    return (*curves[std::min<int64_t>(s, curves.size()) - 1])(rows);
  }
  double operator()(double rows, int64_t k) const {
    const double host = k <= 0 ? 0.0 : host_ms + host_more_ms * static_cast<double>(k - 1);
    return pass(rows, k) + static_cast<double>(levels) * pass(static_cast<double>(width * k), k) + host;
  }
};

std::pair<std::vector<int64_t>, double> allocate(const std::vector<std::vector<double>>& scores,
                                                 const std::vector<int64_t>& budgets, double sunk_ms,
                                                 const Curve& verify, int64_t base_rows, int64_t plain, int64_t cap) {
  TORCH_CHECK_VALUE(scores.size() == budgets.size(), "allocate needs one budget per request");
  const int64_t n = static_cast<int64_t>(scores.size()) + plain;
  std::vector<std::pair<double, int64_t>> merged;
  for (size_t j = 0; j < scores.size(); ++j)
    for (int64_t i = 0; i < std::min<int64_t>(std::max<int64_t>(budgets[j] - 1, 0), scores[j].size()); ++i)
      merged.emplace_back(scores[j][i], static_cast<int64_t>(j));
  std::stable_sort(merged.begin(), merged.end(), [](const auto& x, const auto& y) {
    return -x.first != -y.first ? -x.first < -y.first : x.second < y.second;
  });
  if (cap >= 0 && static_cast<int64_t>(merged.size()) > cap) merged.resize(cap);
  int64_t best_k = 0;
  double gain = static_cast<double>(n);
  double best_rate = gain / (sunk_ms + verify(static_cast<double>(base_rows + n)));
  for (size_t k = 1; k <= merged.size(); ++k) {
    gain += merged[k - 1].first;
    const double rate = gain / (sunk_ms + verify(static_cast<double>(base_rows + n + static_cast<int64_t>(k))));
    if (rate > best_rate) best_k = static_cast<int64_t>(k), best_rate = rate;
  }
  std::vector<int64_t> sizes(scores.size(), 1);
  for (int64_t k = 0; k < best_k; ++k) ++sizes[merged[k].second];
  return {sizes, best_rate};
}

double drafted_rate(const std::vector<int64_t>& chosen, const std::vector<double>& gains,
                    const std::vector<double>& gain_rows, const std::vector<double>& catch_up, double gain, double rows,
                    const Curve& verify, const DraftCost& draft) {
  const int64_t n = static_cast<int64_t>(gains.size());
  TORCH_CHECK_VALUE(gain_rows.size() == gains.size() && catch_up.size() == gains.size(),
                    "drafted_rate needs a gain, its rows and a catch-up per request");
  for (int64_t j : chosen) TORCH_CHECK_VALUE(0 <= j && j < n, "drafted_rate: chosen request ", j, " of ", n);
  if (chosen.empty()) return gain / verify(rows);
  double gained = 0.0, draft_rows = 0.0, verified = 0.0;
  for (int64_t j : chosen) gained += gains[j];
  for (int64_t j : chosen) draft_rows += catch_up[j];
  for (int64_t j : chosen) verified += gain_rows[j];
  return (gain + gained) / (draft(draft_rows, static_cast<int64_t>(chosen.size())) + verify(rows + verified));
}

std::vector<int64_t> choose_drafted(const std::vector<double>& gains, const std::vector<double>& gain_rows,
                                    const std::vector<double>& catch_up, double gain, double rows, const Curve& verify,
                                    const DraftCost& draft) {
  TORCH_CHECK_VALUE(gains.size() == gain_rows.size() && gains.size() == catch_up.size(),
                    "choose_drafted needs a gain, its rows and a catch-up per request");
  std::vector<int64_t> order(gains.size());
  for (size_t j = 0; j < order.size(); ++j) order[j] = static_cast<int64_t>(j);
  auto per_row = [&](int64_t j) { return -gains[j] / std::max(gain_rows[j], 1e-9); };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {  // never out of bounds, whatever values
    const double pa = per_row(a), pb = per_row(b);
    return pa != pb ? pa < pb : catch_up[a] != catch_up[b] ? catch_up[a] < catch_up[b] : a < b;
  });
  size_t best = 0;
  double best_rate = gain / verify(rows), total = gain, draft_rows = 0.0, verified = rows;
  for (size_t k = 1; k <= order.size(); ++k) {
    const int64_t j = order[k - 1];
    total += gains[j];
    draft_rows += catch_up[j];
    verified += gain_rows[j];
    const double rate = total / (draft(draft_rows, static_cast<int64_t>(k)) + verify(verified));
    if (rate > best_rate) best = k, best_rate = rate;
  }
  std::vector<int64_t> picked(order.begin(), order.begin() + best);
  std::sort(picked.begin(), picked.end());
  return picked;
}

// Both calls release the GIL once their arguments are converted: they touch no Python object (only tensors' data
// and ATen's allocator), so a server's other threads (a Triton stub sending responses) run while a forward computes.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // module-local: every ISA build defines its own Bound, and one process may load several (tests, isa_tcurve)
  py::class_<Bound>(m, "Bound", py::module_local(), "a model's per-call-invariant forward arguments, converted once")
      .def(py::init<>())
      .def_readwrite("dims", &Bound::dims)
      .def_readwrite("eps", &Bound::eps)
      .def_readwrite("embed", &Bound::embed)
      .def_readwrite("final_norm", &Bound::final_norm)
      .def_readwrite("head", &Bound::head)
      .def_readwrite("fc", &Bound::fc)
      .def_readwrite("rope_cos", &Bound::rope_cos)
      .def_readwrite("rope_sin", &Bound::rope_sin)
      .def_readwrite("norms", &Bound::norms)
      .def_readwrite("bqkv", &Bound::bqkv)
      .def_readwrite("qk_norms", &Bound::qk_norms)
      .def_readwrite("bo", &Bound::bo)
      .def_readwrite("scratch", &Bound::scratch)
      .def_readwrite("projs", &Bound::projs);
  m.def("forward", &forward, "spectrt CPU forward over segments (row invariant)",
        py::call_guard<py::gil_scoped_release>());
  m.def("linear", &linear, "packed row-invariant GEMM", py::call_guard<py::gil_scoped_release>());
  m.def("eagle3_forward", &eagle3_forward, "EAGLE-3 head forward over segments (row invariant)",
        py::call_guard<py::gil_scoped_release>());
  m.def("argmax_rows", &argmax_rows, "each row's argmax by the LM head's rule (tests)");
  m.def("top_tokens", &top_tokens, "each row's k best ids and softmax probabilities (sampling.top_tokens)");
  py::class_<Curve, std::shared_ptr<Curve>>(m, "Curve", py::module_local(), "a cost curve (policy.py CostCurve)")
      .def(py::init([](std::vector<double> xs, std::vector<double> ys) {
        TORCH_CHECK_VALUE(!xs.empty() && xs.size() == ys.size() && std::is_sorted(xs.begin(), xs.end()),
                          "a curve needs ascending points, one value each");
        return std::make_shared<Curve>(Curve{std::move(xs), std::move(ys)});
      }))
      .def("__call__", &Curve::operator());
  py::class_<DraftCost>(m, "DraftCost", py::module_local(), "a drafting step's cost (policy.py DraftingCost)")
      .def(py::init([](std::vector<std::shared_ptr<Curve>> curves, int64_t levels, int64_t width, double host_ms,
                       double host_more_ms) {
        TORCH_CHECK_VALUE(!curves.empty() && std::find(curves.begin(), curves.end(), nullptr) == curves.end(),
                          "a drafting cost needs curves (no None)");
        return DraftCost{std::move(curves), levels, width, host_ms, host_more_ms};
      }))
      .def("__call__", &DraftCost::operator());
  m.def("allocate", &allocate, "policy.allocate");
  m.def("choose_drafted", &choose_drafted, "policy.choose_drafted");
  m.def("drafted_rate", &drafted_rate, "policy.drafted_rate");
  py::class_<SuffixIndex>(m, "SuffixIndex", py::module_local(), "a request's suffix index (suffix.py SuffixIndex)")
      .def(py::init<const std::vector<int64_t>&, int64_t, int64_t, int64_t, int64_t>(), py::arg("tokens"),
           py::arg("max_ngram"), py::arg("min_match"), py::arg("max_occurrences"), py::arg("max_match"))
      .def("extend", &SuffixIndex::extend)
      .def("catch_up", &SuffixIndex::catch_up)
      .def("longest_match", &SuffixIndex::longest_match)
      .def("propose", &SuffixIndex::propose)
      .def_property_readonly("tokens", &SuffixIndex::tokens)
      .def_property_readonly("indexed", &SuffixIndex::indexed);
  m.def("compact_cache", &compact_cache, "move a cache's kept window rows behind its prefix (KVCache.compact)");
  m.def("pool_stats", [] {
    const pool::Pool& p = pool::Pool::get();
    return std::map<std::string, int64_t>{
        {"workers", p.workers()}, {"loops", p.stats.loops.load()}, {"inline_loops", p.stats.inline_loops.load()},
        {"caller_items", p.stats.caller_items.load()}, {"worker_items", p.stats.worker_items.load()},
        {"worker_sleeps", p.stats.worker_sleeps.load()}, {"caller_sleeps", p.stats.caller_sleeps.load()}};
  }, "the thread pool's counters (thread_pool.h Stats) and its started workers");
  m.def("pool_set", [](int64_t spin_us, int64_t worker_delay_us) {
    TORCH_CHECK_VALUE(spin_us >= 0 && worker_delay_us >= 0, "pool_set takes non-negative microseconds");
    pool::Pool::get().spin_us = spin_us;
    pool::Pool::get().worker_delay_us = worker_delay_us;
  }, "how long a waiting pool thread spins before it sleeps; tests: a delay before each worker claims a loop",
        py::arg("spin_us"), py::arg("worker_delay_us") = 0);
  m.def("amx_init", &amx_init, "request AMX tile state for this process; false where AMX cannot run");
  m.attr("isa") = simd::ISA;  // the instruction set this build's simd.h layer was compiled for
  m.attr("bf16_dot") = simd::DOT_FLUSH ? "emulated" : "vdpbf16ps";  // how this build computes bf16dot's pair sums
}
