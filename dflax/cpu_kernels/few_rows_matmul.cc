// out[r, o] = sum_k x[r, k] * w[o, k] for a few rows x [M, K] and a weight w [O, K] stored as in PyTorch
// checkpoints ([out, in]), float32 results, for x86 CPUs with AVX2 and FMA (and bf16 rows times bf16
// weights with AVX-512 BF16, below).
//
// XLA's CPU products for 2-16 rows read a weight at 3-6 GB/s on AVX2 CPUs (YNNPACK, Eigen, oneDNN and
// OpenBLAS alike), a third of the memory bandwidth, while one row (Eigen's matrix-vector product) runs near
// it. Here every weight row is read from memory once for all rows of x: a tile of up to four rows of x
// times three weight rows keeps its twelve float32 accumulators in registers, and further row tiles reread
// the three weight rows from L1. The output rows are split in chunks over XLA's intra-op thread pool.
//
// Every result is one fixed sequence of 8-lane FMAs (32-lane bf16 pair products) over k followed by one
// fixed horizontal sum, whatever M, the row tile or the thread: a row's result does not depend on the other
// rows (batch invariance), so a target verifying a block computes each position's logits exactly as
// decoding it alone would (up to the attention).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Twelve accumulators, three weight vectors and one row of x fill AVX2's sixteen vector registers: a third
// fewer loads of x per FMA than tiles of 4 x 2 (all of SmolLM2's fp32 weights times 16 / 32 rows on the
// EPYC, 2026-11-28: 65 / 103 -> 55 / 83 ms).
constexpr int64_t kWeightRowsPerTile = 3;
constexpr int64_t kMaxRowsPerTile = 4;
constexpr int64_t kOutputsPerChunk = 48;  // a multiple of every tile's weight rows (3, 4 for one row or bf16)
// Weight rows are prefetched this many groups of weight rows ahead, by all row tiles in equal shares (the
// first row tile alone prefetching a group left the memory idle while the others computed: 16 rows of the
// same weights 53-56 -> 42-45 ms), into L2 rather than L1, where they compete with the rows of x for lines
// (every product of a SmolLM2-135M forward, fp32 weights from memory, 2-core EPYC of the Zen 4 family,
// interleaved runs: 4 / 8 / 16 rows 32.2 / 36.8 / 45.8 -> 25.3 / 26.4 / 40.8 ms; 1 and 24 rows unchanged;
// 1 or 3 groups ahead, or into L3, no better). The bf16 pair tiles keep prefetching into L1: a bf16 forward
// measured no faster with L2.
constexpr int64_t kPrefetchGroups = 2;
constexpr int64_t kLineBytes = 64;

// Eight consecutive weights as float32: float32 loads as is, bfloat16 is the high half of a float32.
inline __m256 LoadWeights(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 LoadWeights(const uint16_t* w) {
  __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

// R rows of x (float32, [R, K]) times U weight rows starting at output o. Each k step also prefetches the
// line at `ahead` + step * `ahead_stride` bytes (and the next one when the stride exceeds a line): the row
// tiles of one group of weight rows share the prefetching of a later group evenly, so loads from memory
// stay in flight while the tiles compute (a prefetch past the weight's end does not fault).
template <int R, int U, typename W>
inline void Tile(const float* x, const W* w, float* out, int64_t K, int64_t O, int64_t o, const char* ahead,
                 int64_t ahead_stride) {
  __m256 acc[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) acc[r][u] = _mm256_setzero_ps();
  const bool two_lines = ahead_stride > kLineBytes;
  for (int64_t k = 0; k < K; k += 8, ahead += ahead_stride) {
    _mm_prefetch(ahead, _MM_HINT_T1);
    if (two_lines) _mm_prefetch(ahead + kLineBytes, _MM_HINT_T1);
    __m256 wv[U];
    for (int u = 0; u < U; ++u) wv[u] = LoadWeights(w + (o + u) * K + k);
    for (int r = 0; r < R; ++r) {
      __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int u = 0; u < U; ++u) acc[r][u] = _mm256_fmadd_ps(xv, wv[u], acc[r][u]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) out[r * O + o + u] = dflax::HorizontalSum(acc[r][u]);
}

// With AVX-512 BF16 (Zen 4 and later, Xeons since Cooper Lake) bf16 rows times bf16 weights take vdpbf16ps:
// 32 products a vector, accumulated in float32 pairwise, from 512-bit loads of both operands, and no
// widening of the weights. These functions are compiled for that extension only (the rest of the file stays
// AVX2); Python calls them only on a CPU that reports it.
#define DFLAX_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

constexpr int64_t kDotWeightRowsPerTile = 4;  // 16 accumulators, 4 weight vectors, 1 row vector of 32
constexpr int64_t kDotLanes = 32;             // bf16 values a 512-bit vector holds

DFLAX_AVX512_BF16 inline __m512bh LoadPairs(const uint16_t* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

// `Tile` for bf16 rows: R rows of x ([R, K] bf16) times U bf16 weight rows starting at output o.
template <int R, int U>
DFLAX_AVX512_BF16 inline void Tile(const uint16_t* x, const uint16_t* w, float* out, int64_t K, int64_t O,
                                   int64_t o, const char* ahead, int64_t ahead_stride) {
  __m512 acc[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
  // A k step reads a whole line of each weight row: one tile's share can be several lines a step.
  const int64_t lines = (ahead_stride + kLineBytes - 1) / kLineBytes;
  for (int64_t k = 0; k < K; k += kDotLanes, ahead += ahead_stride) {
    for (int64_t line = 0; line < lines; ++line) _mm_prefetch(ahead + line * kLineBytes, _MM_HINT_T0);
    __m512bh wv[U];
    for (int u = 0; u < U; ++u) wv[u] = LoadPairs(w + (o + u) * K + k);
    for (int r = 0; r < R; ++r) {
      __m512bh xv = LoadPairs(x + r * K + k);
      for (int u = 0; u < U; ++u) acc[r][u] = _mm512_dpbf16_ps(acc[r][u], xv, wv[u]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) out[r * O + o + u] = _mm512_reduce_add_ps(acc[r][u]);
}

// Values of x a k step covers: 8 float32 rows (AVX2), 32 bf16 rows (AVX-512).
template <typename X>
constexpr int64_t kLanes = sizeof(X) == 2 ? kDotLanes : 8;

// Every row of x times U weight rows starting at output o, in row tiles (`Tile` for float32 rows, its bf16
// overload for bf16 ones); the tiles prefetch the weight rows kPrefetchGroups groups ahead in equal
// shares. Always inlined, so in the bf16 range function, compiled for AVX-512 BF16, the bf16 tiles inline.
template <int U, typename X, typename W>
__attribute__((always_inline)) inline void AllRows(const X* x, const W* w, float* out, int64_t M, int64_t K,
                                                   int64_t O, int64_t o) {
  const int64_t tiles = (M + kMaxRowsPerTile - 1) / kMaxRowsPerTile;
  const int64_t steps = K / kLanes<X>;
  const int64_t share = U * K * static_cast<int64_t>(sizeof(W)) / tiles;  // bytes each tile prefetches
  const int64_t stride = (share + steps - 1) / steps;                      // bytes per k step
  const char* ahead = reinterpret_cast<const char*>(w + (o + kPrefetchGroups * U) * K);
  int64_t r = 0;
  for (; r + kMaxRowsPerTile <= M; r += kMaxRowsPerTile, ahead += share)
    Tile<kMaxRowsPerTile, U>(x + r * K, w, out + r * O, K, O, o, ahead, stride);
  switch (M - r) {
    case 3: Tile<3, U>(x + r * K, w, out + r * O, K, O, o, ahead, stride); break;
    case 2: Tile<2, U>(x + r * K, w, out + r * O, K, O, o, ahead, stride); break;
    case 1: Tile<1, U>(x + r * K, w, out + r * O, K, O, o, ahead, stride); break;
    default: break;
  }
}

// One row of x streams four weight rows at a time (more loads in flight); more rows stream three, so that
// a tile's accumulators fit the sixteen vector registers.
template <typename W>
void OutputRange(const float* x, const W* w, float* out, int64_t M, int64_t K, int64_t O, int64_t begin,
                 int64_t end) {
  int64_t o = begin;
  if (M == 1)
    for (; o + 4 <= end; o += 4) AllRows<4>(x, w, out, M, K, O, o);
  for (; o + kWeightRowsPerTile <= end; o += kWeightRowsPerTile)
    AllRows<kWeightRowsPerTile>(x, w, out, M, K, O, o);
  for (; o < end; ++o) AllRows<1>(x, w, out, M, K, O, o);
}

DFLAX_AVX512_BF16 void DotOutputRange(const uint16_t* x, const uint16_t* w, float* out, int64_t M, int64_t K,
                                      int64_t O, int64_t begin, int64_t end) {
  int64_t o = begin;
  for (; o + kDotWeightRowsPerTile <= end; o += kDotWeightRowsPerTile)
    AllRows<kDotWeightRowsPerTile>(x, w, out, M, K, O, o);
  for (; o < end; ++o) AllRows<1>(x, w, out, M, K, O, o);
}

// Which range function a call runs: `OutputRange` for float32 rows, `DotOutputRange` for bf16 ones.
template <typename W>
inline void Range(const float* x, const W* w, float* out, int64_t M, int64_t K, int64_t O, int64_t b,
                  int64_t e) {
  OutputRange(x, w, out, M, K, O, b, e);
}
inline void Range(const uint16_t* x, const uint16_t* w, float* out, int64_t M, int64_t K, int64_t O,
                  int64_t b, int64_t e) {
  DotOutputRange(x, w, out, M, K, O, b, e);
}

// Chunks of kOutputsPerChunk outputs over the intra-op thread pool.
template <typename X, typename W>
ffi::Error FewRowsMatmul(ffi::ThreadPool pool, const X* x, const W* w, float* out, int64_t M, int64_t K,
                         int64_t O) {
  if (K % kLanes<X> != 0)
    return ffi::Error::InvalidArgument(
        "few_rows_matmul: the contraction must be a multiple of 8 (of 32 for bf16 rows)");
  const int64_t chunks = (O + kOutputsPerChunk - 1) / kOutputsPerChunk;
  dflax::ParallelFor(pool, chunks, [x, w, out, M, K, O](int64_t chunk) {
    const int64_t begin = chunk * kOutputsPerChunk;
    Range(x, w, out, M, K, O, begin, std::min(O, begin + kOutputsPerChunk));
  });
  return ffi::Error::Success();
}

// The FFI handler for rows of dtype X and weights of dtype W (float32 x float32, float32 x bf16, or bf16 x
// bf16 on AVX-512 BF16): x [M, K], w [O, K], and the result [M, O] float32. bf16 buffers hold uint16 bits.
template <ffi::DataType X, ffi::DataType W>
ffi::Error Handler(ffi::ThreadPool pool, ffi::Buffer<X> x, ffi::Buffer<W> w,
                   ffi::ResultBuffer<ffi::F32> out) {
  using XBits = std::conditional_t<X == ffi::BF16, uint16_t, float>;
  using WBits = std::conditional_t<W == ffi::BF16, uint16_t, float>;
  return FewRowsMatmul(pool, reinterpret_cast<const XBits*>(x.untyped_data()),
                       reinterpret_cast<const WBits*>(w.untyped_data()), out->typed_data(), x.dimensions()[0],
                       x.dimensions()[1], w.dimensions()[0]);
}

template <ffi::DataType X, ffi::DataType W>
auto Binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<X>>()  // x [M, K]
      .template Arg<ffi::Buffer<W>>()  // w [O, K] (`template`: the builder type depends on X and W)
      .template Ret<ffi::Buffer<ffi::F32>>();  // out [M, O]
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(dflax_few_rows_matmul_f32, (Handler<ffi::F32, ffi::F32>),
                              (Binding<ffi::F32, ffi::F32>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(dflax_few_rows_matmul_bf16, (Handler<ffi::F32, ffi::BF16>),
                              (Binding<ffi::F32, ffi::BF16>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(dflax_few_rows_matmul_bf16_dot, (Handler<ffi::BF16, ffi::BF16>),
                              (Binding<ffi::BF16, ffi::BF16>()));
