// Prefix + tree attention of a few new tokens on x86 CPUs with AVX2 and FMA, float32: each query row
// attends to its row's filled cache slots [0, cache_len) and to the new tokens its mask lets it see.
//
// XLA's CPU program for the same attention (pallas_kernels/tree_attention/chunked.py) is a loop of small
// batched products, softmax fusions and copies per layer: on a 2-core Zen 3 EPYC one SmolLM2 layer of a
// 17-token verify after 256 cached tokens took 440-760 us that way, most of it dispatch and copies. Here
// one call per layer reads every key once for up to twelve query rows of its kv head (the query heads of
// that kv head for several new tokens): the rows' scores (8-lane FMAs over head_dim, one fixed reduction
// per key), an exact two-pass softmax with a vector exp, and the value mix in registers. A batch's cache
// is read from memory about once per step however many tokens it verifies (8 rows after 256 cached
// tokens, SmolLM2, 2-core Zen 4 EPYC: 2 new tokens a row cost 0.28 ms a layer when each token's rows read
// the cache apart, 0.21 ms in one pass, against 0.16 ms for one token).
//
// Every query row is computed by one fixed sequence of operations over its keys whatever the batch, the
// number of new tokens, the rows sharing its pass or the thread, so a position of a verified chain attends
// exactly as decoding it alone would.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Query rows (of one batch row and kv head) a task takes together at most: twelve score accumulators, a key
// vector and a query vector fill AVX2's sixteen registers.
constexpr int kMaxRowsPerTask = 12;

// exp(x) for x <= 0 in 8 lanes: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-6 polynomial (the
// Taylor coefficients, relative error below 2e-7 on that range), times 2^n built in the exponent bits.
// Below -87 (past float32's normal range) the result is 0.
inline __m256 ExpNonPositive(__m256 x) {
  const __m256 floor_x = _mm256_set1_ps(-87.0f);
  const __m256 below = _mm256_cmp_ps(x, floor_x, _CMP_LT_OQ);
  x = _mm256_max_ps(x, floor_x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts: exact n * hi
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(below, _mm256_mul_ps(p, _mm256_castsi256_ps(two_n)));
}

struct Shapes {
  int64_t batch, tokens, heads, kv_heads, slots, head_dim;
};

// The attention of R query rows that share their keys (query heads of one kv head): scores against
// `num_prefix` cached keys (rows of `k_prefix`, `head_dim` apart) and the `num_new` new keys (rows
// `new_stride` apart), row r seeing new key u where sees[r][u]; then each row's softmax and the value
// mix into out[r]. Every key is read once for all R rows. V = head_dim / 8; `scores` holds
// R x (num_prefix + num_new) floats.
//
// A row's result is the same whichever rows share its call: its score of a key is one fixed chain of
// FMAs over head_dim and one fixed tree of adds across the lanes, its probabilities add up in 8 lanes by
// their place among the keys it sees, and its value mix adds the keys in order (a key it does not see adds
// an exact zero). Places among the keys seen, not key indices: a draft tree's node sees the cache and its
// ancestors with unseen siblings between them, and decoding it after those ancestors were committed sees
// the same keys without the gaps, so only places make the two sums add alike.
template <int V, int R>
void AttendRows(const float* const* q, float scale, const float* k_prefix, const float* v_prefix,
                int64_t num_prefix, const float* k_new, const float* v_new, int64_t new_stride,
                const bool* const* sees, int64_t num_new, float* scores, float* const* out) {
  constexpr int64_t head_dim = 8 * V;
  const int64_t total = num_prefix + num_new;
  alignas(32) float qs[R][head_dim];  // the rows times the scale
  for (int r = 0; r < R; ++r)
    for (int64_t d = 0; d < V; ++d)
      _mm256_store_ps(qs[r] + 8 * d, _mm256_mul_ps(_mm256_loadu_ps(q[r] + 8 * d), _mm256_set1_ps(scale)));
  auto key = [&](int64_t j) {  // the prefix, then the new tokens
    return j < num_prefix ? k_prefix + j * head_dim : k_new + (j - num_prefix) * new_stride;
  };
  auto value = [&](int64_t j) { return j < num_prefix ? v_prefix + j * head_dim : v_new + (j - num_prefix) * new_stride; };
  float max_score[R];
  int64_t seen[R];  // keys row r sees so far: its scores are stored at their places among those
  for (int r = 0; r < R; ++r) max_score[r] = -INFINITY, seen[r] = 0;
  constexpr int kQuads = (R + 3) / 4;  // the rows' scores are reduced four at a time
  for (int64_t j = 0; j < total; ++j) {
    const float* k = key(j);
    __m256 acc[4 * kQuads];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_mul_ps(_mm256_loadu_ps(k), _mm256_load_ps(qs[r]));
    for (int r = R; r < 4 * kQuads; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t d = 1; d < V; ++d) {
      const __m256 kv = _mm256_loadu_ps(k + 8 * d);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(kv, _mm256_load_ps(qs[r] + 8 * d), acc[r]);
    }
    const int64_t u = j - num_prefix;
    for (int quad = 0; quad < kQuads; ++quad) {
      // Lane i of the low half: row 4 quad + i's (l0 + l1) + (l2 + l3); of the high half its (l4 + l5) +
      // (l6 + l7). The same tree for every row, whichever place in a quad it takes.
      const __m256* a = acc + 4 * quad;
      const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
      alignas(16) float four[4];
      _mm_store_ps(four, _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)));
      for (int i = 0; i < 4 && 4 * quad + i < R; ++i) {
        const int r = 4 * quad + i;
        if (u >= 0 && !sees[r][u]) continue;
        scores[r * total + seen[r]++] = four[i];
        max_score[r] = std::max(max_score[r], four[i]);
      }
    }
  }
  // Probabilities of the seen keys in place, summed in 8 lanes and then across them; then spread back to
  // one place per key for the value mix, unseen keys 0 (from the back: a seen key's place only moves up).
  float inverse[R];
  for (int r = 0; r < R; ++r) {
    float* row = scores + r * total;
    if (max_score[r] == -INFINITY) {  // sees no key: probabilities 0, output 0 as the reference gives
      std::fill(row, row + total, 0.0f);
      inverse[r] = 0.0f;
      continue;
    }
    const __m256 max_v = _mm256_set1_ps(max_score[r]);
    __m256 denom_v = _mm256_setzero_ps();
    const int64_t count = seen[r];
    int64_t j = 0;
    for (; j + 8 <= count; j += 8) {
      const __m256 p = ExpNonPositive(_mm256_sub_ps(_mm256_loadu_ps(row + j), max_v));
      _mm256_storeu_ps(row + j, p);
      denom_v = _mm256_add_ps(denom_v, p);
    }
    if (j < count) {
      alignas(32) float tail[8];
      std::fill(tail, tail + 8, -INFINITY);
      std::copy(row + j, row + count, tail);
      const __m256 p = ExpNonPositive(_mm256_sub_ps(_mm256_load_ps(tail), max_v));
      _mm256_store_ps(tail, p);
      std::copy(tail, tail + (count - j), row + j);
      denom_v = _mm256_add_ps(denom_v, p);
    }
    inverse[r] = 1.0f / dflax::HorizontalSum(denom_v);
    for (int64_t place = count, key = total - 1; place <= key; --key)
      row[key] = sees[r][key - num_prefix] ? row[--place] : 0.0f;
  }
  // The value mix, kSpan vectors of head_dim at a time: R x kSpan accumulators stay in registers while
  // every key's kSpan value vectors are read once for the R rows.
  constexpr int kSpan = std::min(V, R <= 3 ? 4 : R <= 6 ? 2 : 1);
  for (int64_t d0 = 0; d0 < V; d0 += kSpan) {
    __m256 acc[R][kSpan];
    for (int r = 0; r < R; ++r)
      for (int d = 0; d < kSpan; ++d) acc[r][d] = _mm256_setzero_ps();
    for (int64_t j = 0; j < total; ++j) {
      const float* v = value(j) + 8 * d0;
      __m256 vv[kSpan];
      for (int d = 0; d < kSpan; ++d) vv[d] = _mm256_loadu_ps(v + 8 * d);
      for (int r = 0; r < R; ++r) {
        const __m256 p = _mm256_broadcast_ss(scores + r * total + j);
        for (int d = 0; d < kSpan; ++d) acc[r][d] = _mm256_fmadd_ps(p, vv[d], acc[r][d]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int d = 0; d < kSpan; ++d)
        _mm256_storeu_ps(out[r] + 8 * (d0 + d), _mm256_mul_ps(acc[r][d], _mm256_set1_ps(inverse[r])));
  }
}

using AttendFn = decltype(&AttendRows<8, 1>);

// AttendRows for one head_dim (V = head_dim / 8) and every row count 1..kMaxRowsPerTask, by row count - 1.
template <int V, int... R>
constexpr std::array<AttendFn, sizeof...(R)> RowFunctions(std::integer_sequence<int, R...>) {
  return {AttendRows<V, R + 1>...};
}
template <int V>
constexpr auto kRowFunctions = RowFunctions<V>(std::make_integer_sequence<int, kMaxRowsPerTask>{});

struct Operands {
  const float *q, *k_cache, *v_cache, *k_new, *v_new;
  const int32_t* cache_len;
  const bool* mask;
  float* out;
  float scale;
  Shapes s;
  int64_t blocks;  // tasks per (batch row, kv head), each a contiguous block of its query rows
  std::array<AttendFn, kMaxRowsPerTask> rows;  // AttendRows for this head_dim, by row count - 1
};

// Task `task` of (batch row, kv head, block of that kv head's query rows: tokens x group heads);
// `scores` is the calling thread's scratch, resized to kMaxRowsPerTask x (slots + tokens).
void RunTask(int64_t task, const Operands& a) {
  const Shapes& s = a.s;
  const int64_t group = s.heads / s.kv_heads;
  const int64_t rows = s.tokens * group;  // query rows per (batch row, kv head)
  thread_local std::vector<float> scores;
  scores.resize(kMaxRowsPerTask * (s.slots + s.tokens));
  const int64_t block = task % a.blocks, kv = task / a.blocks % s.kv_heads, b = task / a.blocks / s.kv_heads;
  const int64_t filled = std::clamp<int64_t>(a.cache_len[b], 0, s.slots);
  const int64_t cache_offset = (b * s.kv_heads + kv) * s.slots * s.head_dim;
  const int64_t new_offset = (b * s.tokens * s.kv_heads + kv) * s.head_dim;
  const float* q[kMaxRowsPerTask];
  const bool* sees[kMaxRowsPerTask];
  float* out[kMaxRowsPerTask];
  const int64_t first = block * rows / a.blocks, count = (block + 1) * rows / a.blocks - first;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t t = (first + i) / group, head = kv * group + (first + i) % group;
    const int64_t q_offset = ((b * s.tokens + t) * s.heads + head) * s.head_dim;
    q[i] = a.q + q_offset;
    out[i] = a.out + q_offset;
    sees[i] = a.mask + (b * s.tokens + t) * s.tokens;
  }
  a.rows[count - 1](q, a.scale, a.k_cache + cache_offset, a.v_cache + cache_offset, filled,
                    a.k_new + new_offset, a.v_new + new_offset, s.kv_heads * s.head_dim, sees, s.tokens,
                    scores.data(), out);
}

// q [B, T, N, H], k_cache / v_cache [B, K, S, H], cache_len [B] int32, k_new / v_new [B, T, K, H],
// mask [B, T, T] bool (query t sees new token u), out [B, T, N, H]; scale multiplies the logits.
ffi::Error Handler(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                   ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> cache_len, ffi::Buffer<ffi::F32> k_new,
                   ffi::Buffer<ffi::F32> v_new, ffi::Buffer<ffi::PRED> mask, float scale,
                   ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto cd = k_cache.dimensions();
  Operands a{q.typed_data(), k_cache.typed_data(), v_cache.typed_data(), k_new.typed_data(), v_new.typed_data(),
             cache_len.typed_data(), mask.typed_data(), out->typed_data(), scale,
             Shapes{qd[0], qd[1], qd[2], cd[1], cd[2], qd[3]}, 0, {}};
  switch (a.s.head_dim) {
    case 32: a.rows = kRowFunctions<4>; break;
    case 64: a.rows = kRowFunctions<8>; break;
    case 128: a.rows = kRowFunctions<16>; break;
    case 256: a.rows = kRowFunctions<32>; break;
    default: return ffi::Error::InvalidArgument("tree_attention: head_dim must be 32, 64, 128 or 256");
  }
  // The fewest blocks of at most kMaxRowsPerTask rows, so that a kv head's keys are read by as few passes
  // as can be; but with few (batch row, kv head) pairs, up to as many blocks as three rows each would
  // make, until every thread has two tasks (one batch row verifying 4 tokens, 3 kv heads of 12 rows each,
  // over 2 threads: 6 tasks, not 3).
  const int64_t rows = a.s.tokens * (a.s.heads / a.s.kv_heads);
  const int64_t pairs = a.s.batch * a.s.kv_heads;
  const int64_t fewest = (rows + kMaxRowsPerTask - 1) / kMaxRowsPerTask;
  const int64_t balanced = std::min((rows + 2) / 3, (2 * pool.num_threads() + pairs - 1) / pairs);
  a.blocks = std::max(fewest, balanced);
  dflax::ParallelFor(pool, pairs * a.blocks, [a](int64_t task) { RunTask(task, a); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(dflax_tree_attention_f32, Handler,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [B, T, N, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_cache [B, K, S, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_cache [B, K, S, H]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cache_len [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_new [B, T, K, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_new [B, T, K, H]
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask [B, T, T]
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [B, T, N, H]
