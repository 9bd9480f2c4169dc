// spectrt's SIMD layer: the few vector operations runtime/cpu_kernels.cpp is written in, implemented once per
// instruction set and chosen at compile time (runtime/kernels.py defines one of SPECTRT_ISA_AVX512,
// SPECTRT_ISA_AVX2, SPECTRT_ISA_PORTABLE and builds each into its own cached module).
//
// Why one logical width: a Vec is 16 fp32 lanes on every ISA (one zmm, two ymm, or a GCC/Clang vector of 16
// floats), each operation gives the same IEEE result per lane on every ISA, and the one cross-lane sum adds in
// one fixed tree (the order GCC's _mm512_reduce_add_ps uses). A kernel written once over Vec therefore computes
// bitwise the same numbers on every build: an AVX2 machine's logits equal an AVX-512 machine's, row invariance
// holds everywhere for the same reason, and answers generated on one CPU regenerate exactly on another.
// What differs per ISA is only how many registers a Vec takes, so register blocks are sized here (GEMM_ROWS,
// gemm_vecs, DOT_ROWS, dot_vecs, I8_ROWS, I8_VECS, ATT_CHUNKS, ATT_QUERIES, ATT_ACCUMULATORS, ATT_SCORE_BLOCK),
// never in the kernels.
//
// bf16dot (a precision of its own: bf16 GEMM inputs): dot_pair adds, per column, the odd then the even product of a k
// pair, each one FMA rounding, denormal inputs and results read as zero: VDPBF16PS (AVX512_BF16) in one instruction;
// elsewhere two FMAs under MXCSR's DAZ|FTZ (`DOT_FLUSH`: the GEMM sets it around the sums), so every ISA agrees.
//
// INT8: dot4 adds, per column, four u8 x s8 products to an int32 lane. VNNI's dpbusd does it in one instruction
// (AVX-512 VNNI or AVX-VNNI); elsewhere the bytes are widened to int16 and summed by pmaddwd (each pair sum
// <= 2 * 255 * 128 fits int32 exactly; pmaddubsw would saturate int16), so every ISA gets the same exact sums.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(SPECTRT_ISA_AVX512) || defined(SPECTRT_ISA_AVX2)
#include <immintrin.h>
#elif !defined(SPECTRT_ISA_PORTABLE)
#error "define one of SPECTRT_ISA_AVX512, SPECTRT_ISA_AVX2, SPECTRT_ISA_PORTABLE (runtime/kernels.py does)"
#endif

namespace simd {

constexpr int64_t LANES = 16;  // fp32 lanes of a Vec, int32 lanes of an IVec, on every ISA

// ---------------------------------------------------------------------------------------------------- AVX-512
#if defined(SPECTRT_ISA_AVX512)
constexpr const char* ISA = "avx512";
constexpr int GEMM_ROWS = 6;                                  // 6 rows x 4 Vec accumulators + 4 weights: 28 zmm
constexpr int gemm_vecs(int /*rows*/) { return 4; }           // a 64-column panel in one pass
constexpr int ATT_CHUNKS = 4;                                 // 4 heads x 4 Vec (64 dims) accumulators: 16 zmm
constexpr int ATT_QUERIES = 12;                               // queries an attention task takes (rows x heads)
constexpr int ATT_ACCUMULATORS = 24;                          // PV accumulators (6 queries x 4 Vec): 24 of 32 zmm
constexpr int ATT_SCORE_BLOCK = 16;                           // slots a score pass sums at once (reduce16)

struct Vec { __m512 v; };

inline __mmask16 first(int64_t n) {
  return n >= LANES ? 0xFFFF : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
}
inline Vec zero() { return {_mm512_setzero_ps()}; }
inline Vec set1(float x) { return {_mm512_set1_ps(x)}; }
inline Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Vec load_weights(const float* p) { return load(p); }
inline Vec load_weights(const uint16_t* bf16) {  // bf16 -> fp32 is exact: the bits move up by 16
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bf16));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
// 16 columns of a k-pair panel row (column c's two bf16 at 2c, 2c + 1) as the even-k and odd-k weights, in fp32
inline void split_pairs(const uint16_t* p, Vec& even, Vec& odd) {
  const __m512i v = _mm512_loadu_si512(p);
  even = {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16))};
  odd = {_mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))))};
}
#if defined(__AVX512BF16__)
// One VDPBF16PS per 16 columns and row: 6 rows x 4 accumulators + 4 raw weight pairs, as the fp32 block.
#define SPECTRT_SIMD_BF16_DOT
constexpr bool DOT_FLUSH = false;  // the instruction flushes denormals itself, whatever MXCSR says
constexpr int DOT_ROWS = 6;
constexpr int dot_vecs(int /*rows*/) { return 4; }
using DotInput = uint16_t;  // the GEMM's rounded inputs as the instruction reads them: bf16
struct Pairs { __m512i v; };
struct XPair { __m512i v; };
inline Pairs load_pairs(const uint16_t* p) { return {_mm512_loadu_si512(p)}; }
inline void pin(Pairs&) {}
inline DotInput to_dot_input(uint16_t bf16) { return bf16; }
inline XPair set_pair(const DotInput* p) {  // the pair p[0] (even k), p[1] (odd k) in every 32-bit lane
  uint32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return {_mm512_set1_epi32(static_cast<int32_t>(bits))};
}
inline Vec dot_pair(Vec acc, const XPair& x, const Pairs& w) {
  return {_mm512_dpbf16_ps(acc.v, reinterpret_cast<__m512bh>(x.v), reinterpret_cast<__m512bh>(w.v))};
}
#else
constexpr int DOT_ROWS = 4;  // 4 rows x 4 accumulators + 4 x (even, odd) weights: 24 zmm
constexpr int dot_vecs(int /*rows*/) { return 4; }
#endif
template <typename W> inline Vec in_column_order(Vec a) { return a; }  // see the AVX2 one
// Two Vecs of a panel row (32 columns) at once, the form the GEMM loads them in. bf16 widens by interleaving zero
// words (vpunpck*, port 5) instead of zero-extend (port 5) + shift (port 0: an FMA port) per Vec, as on AVX2; the
// interleave works within 128-bit lanes, so a holds columns 0-3, 8-11, 16-19, 24-27 and b the quads between, and
// in_column_order(a, b) puts a finished pair back (two permutes per output pair). Measured (scripts/isa_tcurve.py
// --against HEAD, bf16, context 128, Intel Xeon model 207, ms, zero-extend + shift -> interleave, two runs): T=8
// 12.9 -> 12.7 and 13.0 -> 11.6, T=12 14.7 -> 13.7, T=16 18.2 -> 16.3 and 18.1 -> 16.4; T=1-6 no slower (6 rounds:
// 7.5-10.0 vs 8.0-10.6); fp32 unchanged. Logits unchanged (every build sums the same FMAs per column).
#define SPECTRT_SIMD_WEIGHT_PAIRS
inline void load_weights_pair(const float* p, Vec& a, Vec& b) { a = load(p), b = load(p + LANES); }
inline void load_weights_pair(const uint16_t* bf16, Vec& a, Vec& b) {
  const __m512i h = _mm512_loadu_si512(bf16), z = _mm512_setzero_si512();
  a = {_mm512_castsi512_ps(_mm512_unpacklo_epi16(z, h))};
  b = {_mm512_castsi512_ps(_mm512_unpackhi_epi16(z, h))};
}
template <typename W> inline void in_column_order(Vec& a, Vec& b) {
  if constexpr (sizeof(W) == 2) {
    const __m512i first16 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i last16 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const __m512 x = _mm512_permutex2var_ps(a.v, first16, b.v), y = _mm512_permutex2var_ps(a.v, last16, b.v);
    a.v = x, b.v = y;
  }
}
inline Vec load_first(const float* p, int64_t n) { return {_mm512_maskz_loadu_ps(first(n), p)}; }
inline void pin(Vec&) {}  // see the AVX2 one
inline void store(float* p, Vec a) { _mm512_storeu_ps(p, a.v); }
inline void store_first(float* p, Vec a, int64_t n) { _mm512_mask_storeu_ps(p, first(n), a.v); }
inline Vec keep_first(Vec a, int64_t n) { return {_mm512_maskz_mov_ps(first(n), a.v)}; }
inline Vec zero_below(Vec a, Vec x, float t) {  // a where x >= t, else 0 (and 0 where x is NaN)
  return {_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x.v, _mm512_set1_ps(t), _CMP_GE_OQ), a.v)};
}
inline Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec operator/(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }    // a * b + c, one rounding
inline Vec fnmadd(Vec a, Vec b, Vec c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }  // c - a * b, one rounding
inline Vec max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Vec min(Vec a, Vec b) { return {_mm512_min_ps(a.v, b.v)}; }
inline Vec abs(Vec a) { return {_mm512_abs_ps(a.v)}; }
inline Vec round_even(Vec a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// p * 2^n for integral n in [-126, 128]: scalef rounds once, as the portable two exact scalings do
inline Vec ldexp(Vec p, Vec n) { return {_mm512_scalef_ps(p.v, n.v)}; }
inline float reduce_add(Vec a) {  // ((v[i] + v[i+8]) + (v[i+4] + v[i+12])), then pairs 2 apart, then the last two
  const __m256 t = _mm256_add_ps(_mm512_castps512_ps256(a.v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)));
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 w = _mm_add_ps(u, _mm_shuffle_ps(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(w) + _mm_cvtss_f32(_mm_shuffle_ps(w, w, _MM_SHUFFLE(1, 1, 1, 1)));
}
inline float reduce_max(Vec a) { return _mm512_reduce_max_ps(a.v); }  // exact in any order
// Sixteen lane sums at once: lane s is reduce_add(a[s]), bitwise (each sum goes through reduce_add's tree, the
// vectors transposed as they are added: 15 adds and 30 shuffles for sixteen sums instead of 16 x 7 operations).
#define SPECTRT_SIMD_REDUCE16
inline Vec reduce16(const Vec* a) {
  __m512 s[8], t[4], u[2];
  for (int p = 0; p < 8; ++p)  // lanes i + 8 onto i: sums 2p and 2p + 1 in the 256-bit halves
    s[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p].v, a[2 * p + 1].v, 0x44),
                         _mm512_shuffle_f32x4(a[2 * p].v, a[2 * p + 1].v, 0xEE));
  for (int q = 0; q < 4; ++q)  // i + 4 onto i: sums 4q .. 4q + 3 in the 128-bit quarters
    t[q] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * q], s[2 * q + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * q], s[2 * q + 1], 0xDD));
  for (int r = 0; r < 2; ++r)  // i + 2 onto i
    u[r] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * r], t[2 * r + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * r], t[2 * r + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),  // i + 1 onto i
                                 _mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // lane 4k + m of w holds sum 4m + k (a 4 x 4 transpose): put each sum in its own lane
  return {_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), w)};
}
// the first n lanes (integral values in [0, 255]) as bytes
inline void store_u8_first(uint8_t* p, Vec a, int64_t n) {
  _mm512_mask_cvtepi32_storeu_epi8(p, first(n), _mm512_cvtps_epi32(a.v));
}

#if defined(__AVX512VNNI__)
constexpr int I8_ROWS = 6, I8_VECS = 4;
struct IVec { __m512i v; };
struct I8Weights { __m512i v; };
inline IVec izero() { return {_mm512_setzero_si512()}; }
inline I8Weights load_i8(const int8_t* w) { return {_mm512_loadu_si512(w)}; }  // 16 columns x 4 consecutive k
inline IVec dot4(IVec acc, uint32_t a4, const I8Weights& w) {
  return {_mm512_dpbusd_epi32(acc.v, _mm512_set1_epi32(static_cast<int32_t>(a4)), w.v)};
}
inline void istore(int32_t* p, IVec a) { _mm512_storeu_si512(p, a.v); }
#else
constexpr int I8_ROWS = 6, I8_VECS = 2;
struct IVec { __m512i v[2]; };      // per column two partial sums (k 0-1, k 2-3), 8 columns per register
struct I8Weights { __m512i v[2]; };  // the 64 bytes widened to int16
inline IVec izero() { return {{_mm512_setzero_si512(), _mm512_setzero_si512()}}; }
inline I8Weights load_i8(const int8_t* w) {
  return {{_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w))),
           _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32)))}};
}
inline IVec dot4(IVec acc, uint32_t a4, const I8Weights& w) {
  const __m512i a = _mm512_set1_epi64(static_cast<int64_t>((a4 & 0xFF) | (a4 >> 8 & 0xFF) << 16 |
                                                           uint64_t(a4 >> 16 & 0xFF) << 32 | uint64_t(a4 >> 24) << 48));
  return {{_mm512_add_epi32(acc.v[0], _mm512_madd_epi16(w.v[0], a)),
           _mm512_add_epi32(acc.v[1], _mm512_madd_epi16(w.v[1], a))}};
}
inline void istore(int32_t* p, IVec a) {
  alignas(64) int32_t part[2 * LANES];
  _mm512_store_si512(part, a.v[0]);
  _mm512_store_si512(part + LANES, a.v[1]);
  for (int64_t c = 0; c < LANES; ++c) p[c] = part[2 * c] + part[2 * c + 1];
}
#endif

// ------------------------------------------------------------------------------------------------------- AVX2
#elif defined(SPECTRT_ISA_AVX2)
constexpr const char* ISA = "avx2";
// 16 ymm: FMA latency x 2 pipes wants >= 8 independent accumulators, and accumulators + weights + the broadcast
// must fit. One row takes a whole 64-column panel (8 accumulators, weights folded into the FMAs), two rows 32
// columns a pass (8 + 4 weights), 3-6 rows 16 columns a pass (up to 12 + 2). Why (measured, 576 x 3072 bf16
// projection, 2 threads): 3 rows x 32 columns spilled every k (37 GFMA/s at T=4 against 48 at T=2).
constexpr int GEMM_ROWS = 6;
constexpr int gemm_vecs(int rows) { return rows == 1 ? 4 : rows == 2 ? 2 : 1; }
constexpr int ATT_CHUNKS = 2;
constexpr int ATT_QUERIES = 6;  // 6 score accumulators: 12 of the 16 ymm
constexpr int ATT_ACCUMULATORS = 8;
// 1: 16 accumulators would take 32 ymm, and blocks of four (transposed sums of four Vecs, bitwise) measured slower:
// bf16 T=4 at context 2048 17.9 -> 19.2-19.7 ms, T=8 27.7 -> 30.5-31.1 (Zen 4, two runs; each query then re-reads
// the block's K rows, two loads a Vec, where the per-slot loop loads each once for all the task's queries)
constexpr int ATT_SCORE_BLOCK = 1;

struct Vec { __m256 lo, hi; };

inline __m256i lane_mask(int64_t n, int base) {  // all-ones in lanes base + i < n
  const __m256i idx = _mm256_setr_epi32(base, base + 1, base + 2, base + 3, base + 4, base + 5, base + 6, base + 7);
  const int32_t m = static_cast<int32_t>(n < 0 ? 0 : n > LANES ? LANES : n);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(m), idx);
}
inline Vec zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Vec load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
// A GEMM panel's 16 weights. bf16 widens by interleaving a zero word below each weight (vpunpck*: a shuffle port),
// not by zero-extend + shift (the AVX-512 single load's way): the shift runs on the two FMA ports, and at 6 rows it
// is one uop in seven there. The interleave works within 128-bit halves, so lo holds columns 0-3 and 8-11, hi 4-7
// and 12-15; in_column_order puts a finished accumulator back (once per output, not per k). Each column still gets
// the same FMAs in the same order, so the sums are bitwise those of the AVX-512 build. Measured (scripts/isa_tcurve.py,
// bf16, context 128, Intel Xeon model 207, ms, shift -> interleave): T=4 10.1 -> 9.2, T=8 15.9 -> 14.9, T=16 28.8 ->
// 27.0, T=1 7.2 either way. Not yet measured on AMD (there the interleave is 2 uops per 16 weights against 4 before).
inline Vec load_weights(const float* p) { return load(p); }
inline Vec load_weights(const uint16_t* bf16) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bf16)), z = _mm256_setzero_si256();
  return {_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, h)), _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, h))};
}
template <typename W> inline Vec in_column_order(Vec a) {
  if constexpr (sizeof(W) == 2)
    return {_mm256_permute2f128_ps(a.lo, a.hi, 0x20), _mm256_permute2f128_ps(a.lo, a.hi, 0x31)};
  else return a;
}
inline void split_pairs(const uint16_t* p, Vec& even, Vec& odd) {  // as the AVX-512 one, 8 columns a ymm
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  const __m256i mask = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  even = {_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))};
  odd = {_mm256_castsi256_ps(_mm256_and_si256(lo, mask)), _mm256_castsi256_ps(_mm256_and_si256(hi, mask))};
}
// 16 ymm. An emulated pair is two dependent FMAs per accumulator, so the FMA latency wants 8 ymm accumulators: one
// row takes a whole panel (8, weights loaded at their FMAs), two rows 32 columns a pass (8, one Vec's weights at a
// time), 3-5 rows 16 columns (up to 10 accumulators + 4 weights + the two broadcasts). Measured (isa_tcurve, Zen 4,
// context 128, ms, bf16 alongside): T=1 10.3 -> 5.9 (5.8), T=2 12.1 -> 9.3 (7.2); 5 rows a block, not 4: T=6 15.8 ->
// 12.8 (11.4), T=10 23.1 -> 19.0 (18.5), T=8 16.6 / 17.0 (14.8)
constexpr int DOT_ROWS = 5;
constexpr int dot_vecs(int rows) { return rows == 1 ? 4 : rows == 2 ? 2 : 1; }
// Keep a loaded weight in registers: otherwise GCC folds the load into every row's FMA, and a pass over a panel
// that does not fit L1 then reads L2 once per row. Measured (576 x 3072 fp32, T=8): 37 -> see kernels.py GFMA/s.
inline void pin(Vec& a) { asm volatile("" : "+x"(a.lo), "+x"(a.hi)); }
inline Vec load_first(const float* p, int64_t n) {  // masked lanes are not read
  return {_mm256_maskload_ps(p, lane_mask(n, 0)), _mm256_maskload_ps(p + 8, lane_mask(n, 8))};
}
inline void store(float* p, Vec a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline void store_first(float* p, Vec a, int64_t n) {
  _mm256_maskstore_ps(p, lane_mask(n, 0), a.lo);
  _mm256_maskstore_ps(p + 8, lane_mask(n, 8), a.hi);
}
inline Vec keep_first(Vec a, int64_t n) {
  return {_mm256_and_ps(a.lo, _mm256_castsi256_ps(lane_mask(n, 0))),
          _mm256_and_ps(a.hi, _mm256_castsi256_ps(lane_mask(n, 8)))};
}
inline Vec zero_below(Vec a, Vec x, float t) {
  const __m256 tv = _mm256_set1_ps(t);
  return {_mm256_and_ps(a.lo, _mm256_cmp_ps(x.lo, tv, _CMP_GE_OQ)),
          _mm256_and_ps(a.hi, _mm256_cmp_ps(x.hi, tv, _CMP_GE_OQ))};
}
inline Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec operator/(Vec a, Vec b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline Vec fnmadd(Vec a, Vec b, Vec c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline Vec min(Vec a, Vec b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline Vec abs(Vec a) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  return {_mm256_andnot_ps(sign, a.lo), _mm256_andnot_ps(sign, a.hi)};
}
inline Vec round_even(Vec a) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
inline __m256 pow2(__m256 n) {  // 2^n for integral n in [-126, 127]: the exponent bits
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline __m256 ldexp8(__m256 p, __m256 n) {  // two exact scalings (2^128 is not a float): one rounding, as scalef
  const __m256 n1 = _mm256_min_ps(n, _mm256_set1_ps(127.0f));
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2(n1)), pow2(_mm256_sub_ps(n, n1)));
}
inline Vec ldexp(Vec p, Vec n) { return {ldexp8(p.lo, n.lo), ldexp8(p.hi, n.hi)}; }
inline float reduce_add(Vec a) {  // the AVX-512 tree: lanes i and i + 8 first
  const __m256 t = _mm256_add_ps(a.lo, a.hi);
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 w = _mm_add_ps(u, _mm_shuffle_ps(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(w) + _mm_cvtss_f32(_mm_shuffle_ps(w, w, _MM_SHUFFLE(1, 1, 1, 1)));
}
inline float reduce_max(Vec a) {
  const __m256 t = _mm256_max_ps(a.lo, a.hi);
  const __m128 u = _mm_max_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 w = _mm_max_ps(u, _mm_shuffle_ps(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
  return std::max(_mm_cvtss_f32(w), _mm_cvtss_f32(_mm_shuffle_ps(w, w, _MM_SHUFFLE(1, 1, 1, 1))));
}
inline void store_u8_first(uint8_t* p, Vec a, int64_t n) {
  alignas(32) int32_t v[LANES];
  _mm256_store_si256(reinterpret_cast<__m256i*>(v), _mm256_cvtps_epi32(a.lo));
  _mm256_store_si256(reinterpret_cast<__m256i*>(v + 8), _mm256_cvtps_epi32(a.hi));
  for (int64_t i = 0; i < n && i < LANES; ++i) p[i] = static_cast<uint8_t>(v[i]);
}

#if defined(__AVXVNNI__)
constexpr int I8_ROWS = 4, I8_VECS = 1;
struct IVec { __m256i lo, hi; };
struct I8Weights { __m256i lo, hi; };
inline IVec izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I8Weights load_i8(const int8_t* w) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32))};
}
inline IVec dot4(IVec acc, uint32_t a4, const I8Weights& w) {
  const __m256i a = _mm256_set1_epi32(static_cast<int32_t>(a4));
  return {_mm256_dpbusd_avx_epi32(acc.lo, a, w.lo), _mm256_dpbusd_avx_epi32(acc.hi, a, w.hi)};
}
inline void istore(int32_t* p, IVec a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), a.lo);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 8), a.hi);
}
#else
constexpr int I8_ROWS = 2, I8_VECS = 1;  // 2 rows x 4 accumulators + 4 widened weights: 13 ymm
struct IVec { __m256i v[4]; };           // per column two partial sums, 4 columns per register
struct I8Weights { __m256i v[4]; };
inline IVec izero() { return {{_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                               _mm256_setzero_si256()}}; }
inline I8Weights load_i8(const int8_t* w) {
  I8Weights r;
  for (int j = 0; j < 4; ++j)
    r.v[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * j)));
  return r;
}
inline IVec dot4(IVec acc, uint32_t a4, const I8Weights& w) {
  const __m256i a = _mm256_set1_epi64x(static_cast<int64_t>((a4 & 0xFF) | (a4 >> 8 & 0xFF) << 16 |
                                                            uint64_t(a4 >> 16 & 0xFF) << 32 | uint64_t(a4 >> 24) << 48));
  for (int j = 0; j < 4; ++j) acc.v[j] = _mm256_add_epi32(acc.v[j], _mm256_madd_epi16(w.v[j], a));
  return acc;
}
inline void istore(int32_t* p, IVec a) {
  alignas(32) int32_t part[2 * LANES];
  for (int j = 0; j < 4; ++j) _mm256_store_si256(reinterpret_cast<__m256i*>(part + 8 * j), a.v[j]);
  for (int64_t c = 0; c < LANES; ++c) p[c] = part[2 * c] + part[2 * c + 1];
}
#endif

// --------------------------------------------------------------------------------------------------- portable
#else
// GCC/Clang vector extensions: the compiler maps a 16-float vector onto whatever this target has (NEON on
// aarch64, SSE/AVX on x86); lane loops below are plain C++ the compiler vectorizes.
constexpr const char* ISA = "portable";
constexpr int GEMM_ROWS = 4;
constexpr int gemm_vecs(int /*rows*/) { return 4; }
constexpr int ATT_CHUNKS = 4;
constexpr int ATT_QUERIES = 4;
constexpr int ATT_ACCUMULATORS = 16;
constexpr int ATT_SCORE_BLOCK = 1;
constexpr int I8_ROWS = 4, I8_VECS = 1;

typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
struct Vec { f32x16 v; };

inline Vec zero() { return {f32x16{}}; }
inline Vec set1(float x) {  // not f32x16{} + x: 0 + -0 is +0
  Vec r;
  for (int64_t i = 0; i < LANES; ++i) r.v[i] = x;
  return r;
}
inline Vec load(const float* p) {
  Vec r;
  std::memcpy(&r.v, p, sizeof(r.v));
  return r;
}
inline void pin(Vec&) {}
inline Vec load_weights(const float* p) { return load(p); }
inline Vec load_weights(const uint16_t* bf16) {
  i32x16 bits;
  for (int64_t i = 0; i < LANES; ++i) bits[i] = static_cast<int32_t>(uint32_t(bf16[i]) << 16);
  Vec r;
  std::memcpy(&r.v, &bits, sizeof(r.v));
  return r;
}
inline void split_pairs(const uint16_t* p, Vec& even, Vec& odd) {
  i32x16 e, o;
  for (int64_t i = 0; i < LANES; ++i) {
    e[i] = static_cast<int32_t>(uint32_t(p[2 * i]) << 16);
    o[i] = static_cast<int32_t>(uint32_t(p[2 * i + 1]) << 16);
  }
  std::memcpy(&even.v, &e, sizeof(e));
  std::memcpy(&odd.v, &o, sizeof(o));
}
constexpr int DOT_ROWS = 4;
constexpr int dot_vecs(int /*rows*/) { return 4; }
template <typename W> inline Vec in_column_order(Vec a) { return a; }
inline Vec load_first(const float* p, int64_t n) {
  Vec r = zero();
  for (int64_t i = 0; i < n && i < LANES; ++i) r.v[i] = p[i];
  return r;
}
inline void store(float* p, Vec a) { std::memcpy(p, &a.v, sizeof(a.v)); }
inline void store_first(float* p, Vec a, int64_t n) {
  for (int64_t i = 0; i < n && i < LANES; ++i) p[i] = a.v[i];
}
inline Vec keep_first(Vec a, int64_t n) {
  for (int64_t i = n < 0 ? 0 : n; i < LANES; ++i) a.v[i] = 0.0f;
  return a;
}
inline Vec zero_below(Vec a, Vec x, float t) {
  for (int64_t i = 0; i < LANES; ++i) a.v[i] = x.v[i] >= t ? a.v[i] : 0.0f;
  return a;
}
inline Vec operator+(Vec a, Vec b) { return {a.v + b.v}; }
inline Vec operator-(Vec a, Vec b) { return {a.v - b.v}; }
inline Vec operator*(Vec a, Vec b) { return {a.v * b.v}; }
inline Vec operator/(Vec a, Vec b) { return {a.v / b.v}; }
// Lane loops run over plain arrays: GCC scalarized fmaf over vector-extension elements inside the GEMM loop
// (10 GFMA/s), while the same loop over arrays becomes one vector FMA.
inline Vec fmadd(Vec a, Vec b, Vec c) {
  float x[LANES], y[LANES], z[LANES];
  std::memcpy(x, &a.v, sizeof(x));
  std::memcpy(y, &b.v, sizeof(y));
  std::memcpy(z, &c.v, sizeof(z));
  for (int64_t i = 0; i < LANES; ++i) z[i] = __builtin_fmaf(x[i], y[i], z[i]);
  std::memcpy(&c.v, z, sizeof(z));
  return c;
}
inline Vec fnmadd(Vec a, Vec b, Vec c) { return fmadd(Vec{-a.v}, b, c); }  // c - a * b: negation is exact
inline Vec max(Vec a, Vec b) {  // as maxps: the second operand unless a > b
  for (int64_t i = 0; i < LANES; ++i) a.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
  return a;
}
inline Vec min(Vec a, Vec b) {
  for (int64_t i = 0; i < LANES; ++i) a.v[i] = a.v[i] < b.v[i] ? a.v[i] : b.v[i];
  return a;
}
inline Vec abs(Vec a) {
  for (int64_t i = 0; i < LANES; ++i) a.v[i] = std::fabs(a.v[i]);
  return a;
}
inline Vec round_even(Vec a) {  // the default rounding mode: to nearest, ties to even
  for (int64_t i = 0; i < LANES; ++i) a.v[i] = std::nearbyint(a.v[i]);
  return a;
}
inline float pow2(float n) {  // 2^n for integral n in [-126, 127]
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float r;
  std::memcpy(&r, &bits, 4);
  return r;
}
inline Vec ldexp(Vec p, Vec n) {
  for (int64_t i = 0; i < LANES; ++i) {
    const float n1 = n.v[i] < 127.0f ? n.v[i] : 127.0f;
    p.v[i] = p.v[i] * pow2(n1) * pow2(n.v[i] - n1);
  }
  return p;
}
inline float reduce_add(Vec a) {
  float t[8], u[4];
  for (int i = 0; i < 8; ++i) t[i] = a.v[i] + a.v[i + 8];
  for (int i = 0; i < 4; ++i) u[i] = t[i] + t[i + 4];
  return (u[0] + u[2]) + (u[1] + u[3]);
}
inline float reduce_max(Vec a) {
  float m = a.v[0];
  for (int64_t i = 1; i < LANES; ++i) m = a.v[i] > m ? a.v[i] : m;
  return m;
}
inline void store_u8_first(uint8_t* p, Vec a, int64_t n) {
  for (int64_t i = 0; i < n && i < LANES; ++i) p[i] = static_cast<uint8_t>(static_cast<int32_t>(a.v[i]));
}

struct IVec { i32x16 v; };
struct I8Weights { int8_t w[64]; };
inline IVec izero() { return {i32x16{}}; }
inline I8Weights load_i8(const int8_t* w) {
  I8Weights r;
  std::memcpy(r.w, w, 64);
  return r;
}
inline IVec dot4(IVec acc, uint32_t a4, const I8Weights& w) {
  const int32_t a[4] = {int32_t(a4 & 0xFF), int32_t(a4 >> 8 & 0xFF), int32_t(a4 >> 16 & 0xFF), int32_t(a4 >> 24)};
  for (int64_t c = 0; c < LANES; ++c)
    acc.v[c] += a[0] * w.w[4 * c] + a[1] * w.w[4 * c + 1] + a[2] * w.w[4 * c + 2] + a[3] * w.w[4 * c + 3];
  return acc;
}
inline void istore(int32_t* p, IVec a) { std::memcpy(p, &a.v, sizeof(a.v)); }
#endif

#ifndef SPECTRT_SIMD_WEIGHT_PAIRS  // a pair of single Vec loads where the ISA has no wider form
template <typename W> inline void load_weights_pair(const W* p, Vec& a, Vec& b) {
  a = load_weights(p), b = load_weights(p + LANES);
}
template <typename W> inline void in_column_order(Vec& a, Vec& b) {
  a = in_column_order<W>(a), b = in_column_order<W>(b);
}
#endif

#ifndef SPECTRT_SIMD_BF16_DOT  // VDPBF16PS's sums from two FMAs, under DAZ|FTZ (set by the GEMM: DOT_FLUSH)
constexpr bool DOT_FLUSH = true;
// the rounded inputs kept as fp32 (bf16 -> fp32 is exact): each broadcast is then one load, as in the fp32-input
// GEMM, not a shift or mask and a move per row and pair beside its four FMAs
using DotInput = float;
struct Pairs { Vec even, odd; };
struct XPair { Vec even, odd; };
inline Pairs load_pairs(const uint16_t* p) {
  Pairs w;
  split_pairs(p, w.even, w.odd);
  return w;
}
inline void pin(Pairs& w) { pin(w.even), pin(w.odd); }
inline DotInput to_dot_input(uint16_t bf16) {
  const uint32_t bits = uint32_t(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline XPair set_pair(const DotInput* p) { return {set1(p[0]), set1(p[1])}; }
inline Vec dot_pair(Vec acc, const XPair& x, const Pairs& w) {
  return fmadd(x.even, w.even, fmadd(x.odd, w.odd, acc));  // odd first, as the instruction
}
#endif

#ifndef SPECTRT_SIMD_REDUCE16  // one sum at a time (the kernels call it only where ATT_SCORE_BLOCK is 16)
inline Vec reduce16(const Vec* a) {
  float sums[LANES];
  for (int64_t i = 0; i < LANES; ++i) sums[i] = reduce_add(a[i]);
  return load(sums);
}
#endif

}  // namespace simd
