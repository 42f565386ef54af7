// Prefix + tree attention of a few new tokens on x86 CPUs with AVX2 and FMA, float32: each query row
// attends to its row's filled cache slots [0, cache_len) and to the new tokens its mask lets it see.
//
// XLA's CPU program for the same attention (pallas_kernels/tree_attention/chunked.py) is a loop of small
// batched products, softmax fusions and copies per layer: on a 2-core EPYC it cost SmolLM2 about 5 ms of a
// 1-token step and 20 ms of a 17-token verify, most of it dispatch and copies. Here one call per layer
// walks the keys once per query row: a query row's scores (8-lane FMAs over head_dim, one fixed reduction
// per key), an exact two-pass softmax with a vector exp, and the value mix in registers.
//
// Every query row is computed by one fixed sequence of operations over its keys whatever the batch, the
// number of new tokens or the thread, so a verified position attends exactly as decoding it alone would.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRowsPerTask = 4;   // query rows (of one batch row and kv head) a task takes

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

inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

struct Shapes {
  int64_t batch, tokens, heads, kv_heads, slots, head_dim;
};

// One query row's attention: scores against `num_prefix` cached keys (rows of `k_prefix`, `head_dim` apart)
// and the new keys `new_keys[0..num_new)` (rows `new_stride` apart) it sees where `sees[u]`, then the
// softmax and the value mix into out. `scores` holds num_prefix + num_new floats.
// V = head_dim / 8 vectors of a query row, kept in registers.
template <int V>
void AttendRow(const float* q, float scale, const float* k_prefix, const float* v_prefix, int64_t num_prefix,
               const float* k_new, const float* v_new, int64_t new_stride, const bool* sees, int64_t num_new,
               float* scores, float* out) {
  constexpr int64_t vectors = V, head_dim = 8 * V;
  __m256 qv[V];
  for (int64_t d = 0; d < vectors; ++d) qv[d] = _mm256_mul_ps(_mm256_loadu_ps(q + 8 * d), _mm256_set1_ps(scale));
  // Scores of four keys at once (four independent FMA chains over head_dim), each reduced across its
  // lanes by the same fixed tree of adds, whichever of the four places it takes.
  auto four_scores = [&](const float* k0, const float* k1, const float* k2, const float* k3) {
    __m256 a0 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k0)), a1 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k1));
    __m256 a2 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k2)), a3 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k3));
    for (int64_t d = 1; d < vectors; ++d) {
      a0 = _mm256_fmadd_ps(qv[d], _mm256_loadu_ps(k0 + 8 * d), a0);
      a1 = _mm256_fmadd_ps(qv[d], _mm256_loadu_ps(k1 + 8 * d), a1);
      a2 = _mm256_fmadd_ps(qv[d], _mm256_loadu_ps(k2 + 8 * d), a2);
      a3 = _mm256_fmadd_ps(qv[d], _mm256_loadu_ps(k3 + 8 * d), a3);
    }
    // [a0 l0+l1, a0 l2+l3, a1 .., a1 .., | a0 l4+l5, ...] then pairs again: lane k of each half holds key
    // k's sum over that half; the halves add last.
    const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));  // [4]
  };
  const int64_t total = num_prefix + num_new;
  // Keys in order: the prefix, then the new tokens (a key a query does not see still gets a score,
  // replaced by -inf below).
  auto key = [&](int64_t j) { return j < num_prefix ? k_prefix + j * head_dim : k_new + (j - num_prefix) * new_stride; };
  alignas(32) static const float zeros[8 * V] = {};
  __m128 max4 = _mm_set1_ps(-INFINITY);
  for (int64_t j = 0; j < total; j += 4) {
    const float* k0 = key(j);
    const float* k1 = j + 1 < total ? key(j + 1) : zeros;
    const float* k2 = j + 2 < total ? key(j + 2) : zeros;
    const float* k3 = j + 3 < total ? key(j + 3) : zeros;
    alignas(16) float four[4];
    _mm_store_ps(four, four_scores(k0, k1, k2, k3));
    for (int64_t i = 0; i < 4 && j + i < total; ++i) {
      const int64_t u = j + i - num_prefix;
      scores[j + i] = u >= 0 && !sees[u] ? -INFINITY : four[i];
    }
  }
  float max_score = -INFINITY;
  for (int64_t j = 0; j < total; ++j) max_score = std::max(max_score, scores[j]);
  (void)max4;
  if (max_score == -INFINITY) {  // sees no key: zero, as the reference gives
    std::memset(out, 0, head_dim * sizeof(float));
    return;
  }
  // Probabilities in place (unseen keys: exp(-inf - max) = 0), summed in 8 lanes and then across them.
  const __m256 max_v = _mm256_set1_ps(max_score);
  __m256 denom_v = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= total; j += 8) {
    __m256 p = ExpNonPositive(_mm256_sub_ps(_mm256_loadu_ps(scores + j), max_v));
    _mm256_storeu_ps(scores + j, p);
    denom_v = _mm256_add_ps(denom_v, p);
  }
  if (j < total) {
    alignas(32) float tail[8];
    std::fill(tail, tail + 8, -INFINITY);
    std::copy(scores + j, scores + total, tail);
    __m256 p = ExpNonPositive(_mm256_sub_ps(_mm256_load_ps(tail), max_v));
    _mm256_store_ps(tail, p);
    std::copy(tail, tail + (total - j), scores + j);
    denom_v = _mm256_add_ps(denom_v, p);
  }
  const float inverse = 1.0f / HorizontalSum(denom_v);
  __m256 acc[V];
  for (int64_t d = 0; d < vectors; ++d) acc[d] = _mm256_setzero_ps();
  for (int64_t i = 0; i < num_prefix; ++i) {
    const __m256 p = _mm256_set1_ps(scores[i]);
    const float* value = v_prefix + i * head_dim;
    for (int64_t d = 0; d < vectors; ++d) acc[d] = _mm256_fmadd_ps(p, _mm256_loadu_ps(value + 8 * d), acc[d]);
  }
  for (int64_t u = 0; u < num_new; ++u) {
    if (!sees[u]) continue;
    const __m256 p = _mm256_set1_ps(scores[num_prefix + u]);
    const float* value = v_new + u * new_stride;
    for (int64_t d = 0; d < vectors; ++d) acc[d] = _mm256_fmadd_ps(p, _mm256_loadu_ps(value + 8 * d), acc[d]);
  }
  const __m256 inverse_v = _mm256_set1_ps(inverse);
  for (int64_t d = 0; d < vectors; ++d) _mm256_storeu_ps(out + 8 * d, _mm256_mul_ps(acc[d], inverse_v));
}

struct Work {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t tasks = 0;
};

struct Operands {
  const float *q, *k_cache, *v_cache, *k_new, *v_new;
  const int32_t* cache_len;
  const bool* mask;
  float* out;
  float scale;
  Shapes s;
  decltype(&AttendRow<8>) row;  // AttendRow for this head_dim
};

// Tasks: (batch row, kv head, block of kRowsPerTask query rows of that kv head's tokens x group heads).
void RunTasks(Work& work, const Operands& a) {
  const Shapes& s = a.s;
  const int64_t group = s.heads / s.kv_heads;
  const int64_t rows = s.tokens * group;  // query rows per (batch row, kv head)
  const int64_t blocks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  std::vector<float> scores(s.slots + s.tokens);
  for (int64_t task; (task = work.next.fetch_add(1)) < work.tasks;) {
    const int64_t block = task % blocks, kv = task / blocks % s.kv_heads, b = task / blocks / s.kv_heads;
    const int64_t filled = std::clamp<int64_t>(a.cache_len[b], 0, s.slots);
    const int64_t cache_offset = (b * s.kv_heads + kv) * s.slots * s.head_dim;
    const int64_t new_offset = (b * s.tokens * s.kv_heads + kv) * s.head_dim;
    for (int64_t row = block * kRowsPerTask; row < std::min(rows, (block + 1) * kRowsPerTask); ++row) {
      const int64_t t = row / group, head = kv * group + row % group;
      const int64_t q_offset = ((b * s.tokens + t) * s.heads + head) * s.head_dim;
      a.row(a.q + q_offset, a.scale, a.k_cache + cache_offset, a.v_cache + cache_offset, filled,
            a.k_new + new_offset, a.v_new + new_offset, s.kv_heads * s.head_dim,
            a.mask + (b * s.tokens + t) * s.tokens, s.tokens, scores.data(), a.out + q_offset);
    }
    work.done.fetch_add(1, std::memory_order_release);
  }
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
             Shapes{qd[0], qd[1], qd[2], cd[1], cd[2], qd[3]}, nullptr};
  switch (a.s.head_dim) {
    case 32: a.row = AttendRow<4>; break;
    case 64: a.row = AttendRow<8>; break;
    case 128: a.row = AttendRow<16>; break;
    case 256: a.row = AttendRow<32>; break;
    default: return ffi::Error::InvalidArgument("tree_attention: head_dim must be 32, 64, 128 or 256");
  }
  auto work = std::make_shared<Work>();
  const int64_t rows = a.s.tokens * (a.s.heads / a.s.kv_heads);
  work->tasks = a.s.batch * a.s.kv_heads * ((rows + kRowsPerTask - 1) / kRowsPerTask);
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->tasks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work, a] { RunTasks(*work, a); });
  RunTasks(*work, a);
  while (work->done.load(std::memory_order_acquire) < work->tasks) _mm_pause();
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
