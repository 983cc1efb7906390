// Decode attention straight from the paged KV cache: each request's one query (its query heads grouped by the KV
// head they share) against its cached rows, read in place through its slot indices (no gathered copy), with an
// online softmax over blocks of tokens so memory stays bounded whatever the length. Parallel with
// at::parallel_for (torch's threads) over requests, or over (request, KV head) when requests are few. KV in fp32
// or bf16, accumulated in fp32. MLA's absorbed decode is the case of one KV head whose values are the keys' leading
// columns.
//
// Per block of BLOCK tokens (its rows then sit in L1/L2) and per tile of up to TILE query heads: the scores, one
// 16-lane partial sum per head kept in registers while a key row streams past; the block's softmax step
// (vectorized exp); then the values, each 16 columns of the heads' accumulators in registers while the block's
// value rows stream past. Every KV row is read from memory once, whatever the number of query heads, and the next
// block's rows are prefetched meanwhile (a paged cache's rows are scattered; without it the cold KV streamed at a
// third of the core's rate). bf16 queries and KV on a processor with AVX-512 BF16 go through its dot product.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "amx.h"
#include "vec16.h"

namespace moeplex_cpu {
namespace {

constexpr int64_t BLOCK = 32;  // tokens per online-softmax step: two 16-lane vectors of scores per head
constexpr int64_t AHEAD = BLOCK;  // how far ahead rows are prefetched
#if defined(__AVX512F__)
constexpr int TILE = 8;  // query heads whose accumulators stay in registers (32 vector registers)
#else
constexpr int TILE = 4;  // 16 registers of half the width: each f32x16 takes two
#endif

// A tile's queries: fp32, already scaled; and, where the queries are bf16 values and so are the keys on a processor
// with AVX-512 BF16, the same queries unscaled in bf16 for its dot product (exact products, fp32 sums), else null.
struct Query {
  const float* scaled;
  const c10::BFloat16* exact;
  float scale;
  Query at(int64_t offset) const { return {scaled + offset, exact ? exact + offset : nullptr, scale}; }
};

struct Shapes {
  int64_t group, head_dim, value_dim;  // query heads per KV head, key width, value width
  int64_t key_slot, value_slot, key_head, value_head;  // element strides of the caches
};

// Asks for a row's cache lines ahead of its use: rows of a paged cache are scattered, and a block's compute
// between two rows is too short for the hardware prefetcher alone to keep a core's memory bandwidth busy.
template <typename KV>
inline void prefetch_row(const KV* row, int64_t width) {
  for (int64_t i = 0; i < width; i += 64 / static_cast<int64_t>(sizeof(KV))) __builtin_prefetch(row + i, 0, 2);
}

#if defined(__AVX512BF16__)
// The scores of one key row with bf16 queries and keys: 32 products a step, summed in fp32 lanes.
template <int T>
inline void row_scores_bf16(const c10::BFloat16* q, const c10::BFloat16* k, int64_t D, float scale, float* scores,
                            int64_t t) {
  __m512 part[T];
  for (int g = 0; g < T; ++g) part[g] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 32 <= D; c += 32) {
    const __m512bh kc = (__m512bh)_mm512_loadu_si512(k + c);
    for (int g = 0; g < T; ++g) part[g] = _mm512_dpbf16_ps(part[g], (__m512bh)_mm512_loadu_si512(q + g * D + c), kc);
  }
  for (int g = 0; g < T; ++g) {
    float sum = _mm512_reduce_add_ps(part[g]);
    for (int64_t i = c; i < D; ++i) sum += static_cast<float>(q[g * D + i]) * static_cast<float>(k[i]);
    scores[g * BLOCK + t] = sum * scale;
  }
}
#endif

// Scores of `T` heads against the block's key rows -> scores[g * BLOCK + t], while the next block's rows (`ahead`,
// `ahead_n` of them, key then value) are asked for.
template <int T, typename KV>
void block_scores(const Query& query, const KV* const* keys, int64_t n, int64_t D, float* scores,
                  const KV* const* ahead, int64_t ahead_n, int64_t Dv) {
  const float* q = query.scaled;
  for (int64_t t = 0; t < n; ++t) {
    if (t < ahead_n) {
      prefetch_row(ahead[2 * t], D);
      prefetch_row(ahead[2 * t + 1], Dv);
    }
    const KV* k = keys[t];
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<KV, c10::BFloat16>) {
      if (query.exact) {
        row_scores_bf16<T>(query.exact, k, D, query.scale, scores, t);
        continue;
      }
    }
#endif
    f32x16 part[T];
    for (int g = 0; g < T; ++g) part[g] = zeros16();
    int64_t c = 0;
    for (; c + 16 <= D; c += 16) {
      const f32x16 kc = load16(k + c);
      for (int g = 0; g < T; ++g) part[g] += load16(q + g * D + c) * kc;
    }
    for (int g = 0; g < T; ++g) {
      float s = sum16(part[g]);
      for (int64_t i = c; i < D; ++i) s += q[g * D + i] * widen(k[i]);
      scores[g * BLOCK + t] = s;
    }
  }
}

// acc[g, :] += sum_t p[g * BLOCK + t] * values[t] for `T` heads: CHUNKS x 16 columns at a time, the heads'
// accumulators for them in registers while those columns of the block's rows stream past.
template <int T, typename KV>
void block_values(const float* p, const KV* const* values, int64_t n, int64_t Dv, float* acc) {
  constexpr int CHUNKS = T <= 2 ? 4 : T <= 4 ? 2 : 1;  // T * CHUNKS accumulators: at most 8 vectors
  int64_t c = 0;
  for (; c + 16 * CHUNKS <= Dv; c += 16 * CHUNKS) {
    f32x16 a[T][CHUNKS];
    for (int g = 0; g < T; ++g)
      for (int j = 0; j < CHUNKS; ++j) a[g][j] = load16(acc + g * Dv + c + 16 * j);
    for (int64_t t = 0; t < n; ++t) {
      f32x16 vc[CHUNKS];
      for (int j = 0; j < CHUNKS; ++j) vc[j] = load16(values[t] + c + 16 * j);
      for (int g = 0; g < T; ++g) {
        const float w = p[g * BLOCK + t];
        for (int j = 0; j < CHUNKS; ++j) a[g][j] += w * vc[j];
      }
    }
    for (int g = 0; g < T; ++g)
      for (int j = 0; j < CHUNKS; ++j) store16(acc + g * Dv + c + 16 * j, a[g][j]);
  }
  for (; c < Dv; ++c)
    for (int64_t t = 0; t < n; ++t)
      for (int g = 0; g < T; ++g) acc[g * Dv + c] += p[g * BLOCK + t] * widen(values[t][c]);
}

#if defined(__AVX512BF16__)
// block_values for bf16 values with bf16 queries: tokens in pairs through the bf16 dot product, the probabilities
// rounded to bf16 (as a bf16 SDPA's second product has them), sums in fp32.
template <int T>
void block_values_bf16(const float* p, const c10::BFloat16* const* values, int64_t n, int64_t Dv, float* acc) {
  constexpr int CHUNKS = T <= 4 ? 4 : 2;  // T * CHUNKS accumulators: at most 16 registers
  uint32_t pairs[T][BLOCK / 2];  // (p[t], p[t + 1]) of each head as two bf16 in one 32-bit lane
  const int64_t half = (n + 1) / 2;
  for (int g = 0; g < T; ++g)
    for (int64_t j = 0; j < half; ++j) {
      const uint32_t lo = c10::BFloat16(p[g * BLOCK + 2 * j]).x;
      const uint32_t hi = 2 * j + 1 < n ? c10::BFloat16(p[g * BLOCK + 2 * j + 1]).x : 0;
      pairs[g][j] = lo | hi << 16;
    }
  // lane 2m: row t's column m, lane 2m + 1: row t + 1's (an odd last row pairs with itself, its weight 0)
  alignas(64) int16_t order[32];
  for (int i = 0; i < 32; ++i) order[i] = static_cast<int16_t>(i % 2 ? 32 + i / 2 : i / 2);
  const __m512i interleave = _mm512_load_si512(order);
  int64_t c = 0;
  for (; c + 16 * CHUNKS <= Dv; c += 16 * CHUNKS) {
    __m512 a[T][CHUNKS];
    for (int g = 0; g < T; ++g)
      for (int k = 0; k < CHUNKS; ++k) a[g][k] = _mm512_loadu_ps(acc + g * Dv + c + 16 * k);
    for (int64_t j = 0; j < half; ++j) {
      const c10::BFloat16* v0 = values[2 * j];
      const c10::BFloat16* v1 = 2 * j + 1 < n ? values[2 * j + 1] : v0;
      __m512bh row_pairs[CHUNKS];
      for (int k = 0; k < CHUNKS; ++k) {
        const __m512i r0 = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + c + 16 * k)));
        const __m512i r1 = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + c + 16 * k)));
        row_pairs[k] = (__m512bh)_mm512_permutex2var_epi16(r0, interleave, r1);
      }
      for (int g = 0; g < T; ++g) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[g][j]));
        for (int k = 0; k < CHUNKS; ++k) a[g][k] = _mm512_dpbf16_ps(a[g][k], w, row_pairs[k]);
      }
    }
    for (int g = 0; g < T; ++g)
      for (int k = 0; k < CHUNKS; ++k) _mm512_storeu_ps(acc + g * Dv + c + 16 * k, a[g][k]);
  }
  for (; c < Dv; ++c)
    for (int64_t t = 0; t < n; ++t)
      for (int g = 0; g < T; ++g) acc[g * Dv + c] += p[g * BLOCK + t] * static_cast<float>(values[t][c]);
}
#endif

// The block's softmax step for one head: scores -> probabilities against the new running max (BLOCK of them, 0
// past n); returns the factor the head's accumulator is to be rescaled by (1 where the max did not move).
inline float softmax_probs(float* s, int64_t n, float& running_max, float& running_sum) {
  float block_max = running_max;
  for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, s[t]);
  const float correction = std::exp(running_max - block_max);  // 0 on the first block (exp(-inf))
  for (int64_t t = n; t < BLOCK; ++t) s[t] = -std::numeric_limits<float>::infinity();  // padding: p = 0
  float total = 0.f;
  for (int64_t t = 0; t < BLOCK; t += 16) {
    f32x16 p = exp16(load16(s + t) - block_max);
    total += sum16(p);
    store16(s + t, p);
  }
  running_sum = running_sum * correction + total;
  running_max = block_max;
  return correction;
}

inline void softmax_step(float* s, int64_t n, float& running_max, float& running_sum, float* acc, int64_t Dv) {
  const float correction = softmax_probs(s, n, running_max, running_sum);
  if (correction != 1.f) scale(acc, correction, Dv);
}

template <int T, typename KV>
void tile_step(const Query& q, const KV* const* keys, const KV* const* values, int64_t n, const Shapes& s,
               float* scores, float* acc, float* running_max, float* running_sum, const KV* const* ahead,
               int64_t ahead_n) {
  block_scores<T>(q, keys, n, s.head_dim, scores, ahead, ahead_n, s.value_dim);
  for (int g = 0; g < T; ++g)
    softmax_step(scores + g * BLOCK, n, running_max[g], running_sum[g], acc + g * s.value_dim, s.value_dim);
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<KV, c10::BFloat16>) {
    if (q.exact) return block_values_bf16<T>(scores, values, n, s.value_dim, acc);
  }
#endif
  block_values<T>(scores, values, n, s.value_dim, acc);
}

template <typename KV>
void tile_step_any(int heads, const Query& q, const KV* const* keys, const KV* const* values, int64_t n,
                   const Shapes& s, float* scores, float* acc, float* running_max, float* running_sum,
                   const KV* const* ahead, int64_t ahead_n) {
  switch (heads) {  // the tile's head count as a constant, so its partial sums stay in registers
#define MOEPLEX_TILE(T) \
  case T: return tile_step<T>(q, keys, values, n, s, scores, acc, running_max, running_sum, ahead, ahead_n);
    MOEPLEX_TILE(1) MOEPLEX_TILE(2) MOEPLEX_TILE(3) MOEPLEX_TILE(4)
#if defined(__AVX512F__)
    MOEPLEX_TILE(5) MOEPLEX_TILE(6) MOEPLEX_TILE(7) MOEPLEX_TILE(8)
#endif
#undef MOEPLEX_TILE
  }
}

// One request's KV heads [h0, h1): q [heads, head_dim] (already scaled) -> out [heads, value_dim]. Blocks of
// tokens outside, KV heads inside, so a block's rows are read whole (all their heads) while they are in cache.
// `readable`: slots from `slots` on that this thread reads, this request's and the next ones' (prefetched ahead
// across the boundary, so a request's first block is not read cold).
template <typename KV>
void attend(const Query& q, const KV* keys, const KV* values, const int64_t* slots, int64_t length, int64_t readable,
            int64_t h0, int64_t h1, const Shapes& s, float* out, std::vector<float>& work) {
  const int64_t G = s.group, D = s.head_dim, Dv = s.value_dim, H = (h1 - h0) * G;
  work.assign(H * BLOCK + H * Dv + 2 * H, 0.f);
  float* scores = work.data();
  float* acc = scores + H * BLOCK;
  float* running_max = acc + H * Dv;
  float* running_sum = running_max + H;
  std::fill(running_max, running_max + H, -std::numeric_limits<float>::infinity());
  const KV* key_rows[BLOCK];
  const KV* value_rows[BLOCK];
  const KV* ahead[2 * BLOCK];  // the next block's (key, value) rows of the same head: prefetched meanwhile
  for (int64_t t0 = 0; t0 < length; t0 += BLOCK) {
    const int64_t n = std::min(BLOCK, length - t0), ahead_n = std::min(BLOCK, std::max<int64_t>(readable - t0 - AHEAD, 0));
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t t = 0; t < n; ++t) {
        key_rows[t] = keys + slots[t0 + t] * s.key_slot + h * s.key_head;
        value_rows[t] = values + slots[t0 + t] * s.value_slot + h * s.value_head;
      }
      for (int64_t t = 0; t < ahead_n; ++t) {
        ahead[2 * t] = keys + slots[t0 + AHEAD + t] * s.key_slot + h * s.key_head;
        ahead[2 * t + 1] = values + slots[t0 + AHEAD + t] * s.value_slot + h * s.value_head;
      }
      for (int64_t g = (h - h0) * G; g < (h - h0 + 1) * G; g += TILE) {
        const bool first = g == (h - h0) * G;  // the head's first tile asks for the rows ahead; later ones need not
        tile_step_any(static_cast<int>(std::min<int64_t>(TILE, (h - h0 + 1) * G - g)), q.at(g * D), key_rows,
                      value_rows, n, s, scores + g * BLOCK, acc + g * Dv, running_max + g, running_sum + g, ahead,
                      first ? ahead_n : 0);
      }
    }
  }
  for (int64_t g = 0; g < H; ++g) {
    const float inv = running_sum[g] > 0.f ? 1.f / running_sum[g] : 0.f;  // an empty sequence gives zeros
    for (int64_t i = 0; i < Dv; ++i) out[g * Dv + i] = acc[g * Dv + i] * inv;
  }
}


#if defined(MOEPLEX_AMX)
// The same decode on the tile unit (bf16 queries and KV, widths of whole 32-column chunks, at most 16 query heads per
// KV head). Per half block of 16 tokens: the scores as one 16 x 16 tile (tokens x heads) summed over the key's
// 32-column chunks, the key rows loaded straight from the cache (a page's rows are evenly spaced) and the queries as
// the second operand, packed once per request; then the values: the tile product pairs neighbouring columns, so the
// value rows load in place as the second operand (row k = token k's 32 columns) and two products, one with the
// probabilities on the even lanes and one on the odd, give the even and the odd output columns. No row is repacked;
// the accumulators live in memory as tiles (16 heads x 16 columns per parity and 32-column group).
constexpr int64_t ROWS = 16;  // a tile's rows: a half block's tokens, or query heads

// Where the tile unit reads `n` (<= 16) rows of `width` bf16: in place when the rows are evenly spaced, else copied
// into `stage` with the rows past n zeroed (zero values meet zero probabilities there, and their scores are masked).
inline const c10::BFloat16* tile_source(const c10::BFloat16* const* rows, int64_t n, int64_t width,
                                        c10::BFloat16* stage, int64_t& stride) {
  if (n == ROWS) {
    const int64_t step = rows[1] - rows[0];
    bool even = step > 0;
    for (int64_t t = 2; even && t < ROWS; ++t) even = rows[t] - rows[t - 1] == step;
    if (even) {
      stride = step * static_cast<int64_t>(sizeof(c10::BFloat16));
      return rows[0];
    }
  }
  for (int64_t t = 0; t < ROWS; ++t) {
    if (t < n) std::memcpy(stage + t * width, rows[t], width * sizeof(c10::BFloat16));
    else std::memset(stage + t * width, 0, width * sizeof(c10::BFloat16));
  }
  stride = width * static_cast<int64_t>(sizeof(c10::BFloat16));
  return stage;
}

struct TileWork {
  std::vector<uint16_t> query;  // [KV head][D / 32 chunks][16 dim pairs][16 heads][2]: the scores' second operand
  std::vector<c10::BFloat16> stage;  // [2 halves][16][D] keys, then [2][16][Dv] values: rows copied where uneven
  std::vector<float> acc;  // [KV head][Dv / 32 groups][2 parities][16 heads][16 columns]
  std::vector<float> scores, running_max, running_sum;  // [KV head][16 heads][BLOCK], [KV head][16 heads] x 2
  alignas(64) uint16_t probs[2][2][ROWS][32] = {};  // [half][parity][head][token lanes]: the values' first operand
                                                    // (heads past the group stay 0)
  alignas(64) float tile[ROWS * ROWS];
};

void attend_tiles(const c10::BFloat16* q, float score_scale, const c10::BFloat16* keys, const c10::BFloat16* values,
                  const int64_t* slots, int64_t length, int64_t readable, int64_t h0, int64_t h1, const Shapes& s,
                  float* out, TileWork& w) {
  const int64_t G = s.group, D = s.head_dim, Dv = s.value_dim, heads = h1 - h0, chunks = D / 32, groups = Dv / 32;
  // MLA: the values are the keys' leading columns, already asked for with the keys
  const bool latent = values == keys && s.value_slot == s.key_slot && s.value_head == s.key_head && Dv <= D;
  w.query.assign(heads * chunks * 512, 0);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d)
        w.query[((h * chunks + d / 32) * 16 + (d % 32) / 2) * 32 + g * 2 + d % 2] = q[(h * G + g) * D + d].x;
  w.stage.resize(2 * ROWS * (D + Dv));
  w.acc.assign(heads * groups * 2 * ROWS * ROWS, 0.f);
  w.scores.assign(heads * ROWS * BLOCK, 0.f);
  w.running_max.assign(heads * ROWS, -std::numeric_limits<float>::infinity());
  w.running_sum.assign(heads * ROWS, 0.f);
  const c10::BFloat16* key_rows[BLOCK];
  const c10::BFloat16* value_rows[BLOCK];
  for (int64_t t0 = 0; t0 < length; t0 += BLOCK) {
    const int64_t n = std::min(BLOCK, length - t0), ahead_n = std::min(BLOCK, std::max<int64_t>(readable - t0 - AHEAD, 0));
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t kh = h0 + h;
      for (int64_t t = 0; t < n; ++t) {
        key_rows[t] = keys + slots[t0 + t] * s.key_slot + kh * s.key_head;
        value_rows[t] = values + slots[t0 + t] * s.value_slot + kh * s.value_head;
      }
      for (int64_t t = 0; t < ahead_n; ++t) {
        prefetch_row(keys + slots[t0 + AHEAD + t] * s.key_slot + kh * s.key_head, D);
        if (!latent) prefetch_row(values + slots[t0 + AHEAD + t] * s.value_slot + kh * s.value_head, Dv);
      }
      float* sc = w.scores.data() + h * ROWS * BLOCK;
      const c10::BFloat16* value_source[2];
      int64_t value_stride[2];
      for (int64_t half = 0; half < 2; ++half) {
        const int64_t m = std::min(ROWS, std::max<int64_t>(n - ROWS * half, 0));
        if (!m) continue;
        int64_t stride;
        const c10::BFloat16* k = tile_source(key_rows + ROWS * half, m, D, w.stage.data() + half * ROWS * D, stride);
        _tile_zero(0);
        for (int64_t c = 0; c < chunks; ++c) {
          MOEPLEX_TILE_LOAD(1, k + 32 * c, stride);
          MOEPLEX_TILE_LOAD(2, w.query.data() + (h * chunks + c) * 512, 64);
          _tile_dpbf16ps(0, 1, 2);
        }
        MOEPLEX_TILE_STORE(0, w.tile, 64);
        for (int64_t g = 0; g < G; ++g)
          for (int64_t t = 0; t < m; ++t) sc[g * BLOCK + ROWS * half + t] = w.tile[t * ROWS + g] * score_scale;
        value_source[half] = tile_source(value_rows + ROWS * half, m, Dv,
                                         w.stage.data() + 2 * ROWS * D + half * ROWS * Dv, value_stride[half]);
      }
      float* acc = w.acc.data() + h * groups * 2 * ROWS * ROWS;
      for (int64_t g = 0; g < G; ++g) {
        const float correction = softmax_probs(sc + g * BLOCK, n, w.running_max[h * ROWS + g], w.running_sum[h * ROWS + g]);
        if (correction != 1.f)
          for (int64_t j = 0; j < 2 * groups; ++j) scale(acc + j * ROWS * ROWS + g * ROWS, correction, ROWS);
        for (int64_t half = 0; half < 2; ++half) {  // rounded to bf16 (as a bf16 SDPA's second product has them), then
          // spread to the even lanes (the low half of each 32-bit pair) and to the odd ones
          const __m512i even = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sc + g * BLOCK + ROWS * half)));
          _mm512_store_si512(w.probs[half][0][g], even);
          _mm512_store_si512(w.probs[half][1][g], _mm512_slli_epi32(even, 16));
        }
      }
      for (int64_t j = 0; j < groups; ++j) {
        float* even = acc + j * 2 * ROWS * ROWS;
        float* odd = even + ROWS * ROWS;
        MOEPLEX_TILE_LOAD(6, even, 64);
        MOEPLEX_TILE_LOAD(7, odd, 64);
        for (int64_t half = 0; half * ROWS < n; ++half) {
          MOEPLEX_TILE_LOAD(5, value_source[half] + 32 * j, value_stride[half]);
          MOEPLEX_TILE_LOAD(3, w.probs[half][0], 64);
          MOEPLEX_TILE_LOAD(4, w.probs[half][1], 64);
          _tile_dpbf16ps(6, 3, 5);
          _tile_dpbf16ps(7, 4, 5);
        }
        MOEPLEX_TILE_STORE(6, even, 64);
        MOEPLEX_TILE_STORE(7, odd, 64);
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t g = 0; g < G; ++g) {
      const float sum = w.running_sum[h * ROWS + g], inv = sum > 0.f ? 1.f / sum : 0.f;  // empty: zeros
      float* o = out + (h * G + g) * Dv;
      for (int64_t j = 0; j < groups; ++j) {
        const float* even = w.acc.data() + ((h * groups + j) * 2 * ROWS + g) * ROWS;
        for (int64_t c = 0; c < ROWS; ++c) {
          o[32 * j + 2 * c] = even[c] * inv;
          o[32 * j + 2 * c + 1] = even[ROWS * ROWS + c] * inv;
        }
      }
    }
}
#endif

// Whether the tile unit can run this decode (see attend_tiles).
bool tiles_take(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache) {
  return amx_granted() && q.scalar_type() == at::kBFloat16 && key_cache.scalar_type() == at::kBFloat16 &&
         q.size(2) % 32 == 0 && value_cache.size(2) % 32 == 0 && q.size(1) / key_cache.size(1) <= 16;
}

template <typename KV>
void run(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache, const int64_t* slots,
         const int64_t* indptr, double scale, bool tiles, at::Tensor& out) {
  const int64_t requests = q.size(0), heads = q.size(1), kv_heads = key_cache.size(1);
  const Shapes s{heads / kv_heads, q.size(2), value_cache.size(2), key_cache.stride(0), value_cache.stride(0),
                 key_cache.stride(1), value_cache.stride(1)};
  const bool bf16_query = q.scalar_type() == at::kBFloat16;
  const float* qf = bf16_query ? nullptr : q.data_ptr<float>();
  const c10::BFloat16* qb = bf16_query ? q.data_ptr<c10::BFloat16>() : nullptr;
#if defined(__AVX512BF16__)
  const bool dot_bf16 = bf16_query && std::is_same_v<KV, c10::BFloat16>;
#else
  const bool dot_bf16 = false;
#endif
  const KV* kp = key_cache.data_ptr<KV>();
  const KV* vp = value_cache.data_ptr<KV>();
  float* op = out.data_ptr<float>();
  // a request's KV heads together (its rows read whole) where there are requests enough for every thread; else
  // one work item per (request, KV head)
  const int64_t split = requests >= 4 * at::get_num_threads() ? 1 : kv_heads;
#if defined(MOEPLEX_AMX)
  if constexpr (std::is_same_v<KV, c10::BFloat16>) {
    if (tiles) {
      at::parallel_for(0, requests * split, 1, [&](int64_t begin, int64_t end) {
        Tiles held;
        TileWork work;
        const int64_t last = indptr[(end - 1) / split + 1];
        for (int64_t item = begin; item < end; ++item) {
          const int64_t b = item / split, h0 = (item % split) * kv_heads / split, h1 = h0 + kv_heads / split;
          attend_tiles(qb + (b * heads + h0 * s.group) * s.head_dim, static_cast<float>(scale), kp, vp,
                       slots + indptr[b], indptr[b + 1] - indptr[b], last - indptr[b], h0, h1, s,
                       op + (b * heads + h0 * s.group) * s.value_dim, work);
        }
      });
      return;
    }
  }
#endif
  at::parallel_for(0, requests * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query, work;
    const int64_t last = indptr[(end - 1) / split + 1];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / split, h0 = (item % split) * kv_heads / split, h1 = h0 + kv_heads / split;
      const int64_t first = (b * heads + h0 * s.group) * s.head_dim, count = (h1 - h0) * s.group * s.head_dim;
      query.resize(count);
      for (int64_t i = 0; i < count; ++i)
        query[i] = (bf16_query ? static_cast<float>(qb[first + i]) : qf[first + i]) * static_cast<float>(scale);
      const Query qt{query.data(), dot_bf16 ? qb + first : nullptr, static_cast<float>(scale)};
      attend(qt, kp, vp, slots + indptr[b], indptr[b + 1] - indptr[b], last - indptr[b], h0, h1, s,
             op + (b * heads + h0 * s.group) * s.value_dim, work);
    }
  });
}

// q [B, Hq, D] fp32 or bf16; key_cache [slots, Hkv, D], value_cache [slots, Hkv, Dv] (fp32 or bf16, rows contiguous,
// any slot/head strides); kv_indices int64 [sum of lengths]; kv_indptr int64 [B + 1] -> [B, Hq, Dv] fp32.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                        const at::Tensor& kv_indices, const at::Tensor& kv_indptr, double scale, bool tiles) {
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 3 && value_cache.dim() == 3, "q, key_cache, value_cache: 3-D");
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) && q.is_contiguous(),
              "q: contiguous fp32 or bf16");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "keys and values of one dtype");
  TORCH_CHECK(key_cache.stride(2) == 1 && value_cache.stride(2) == 1, "cache rows contiguous");
  TORCH_CHECK(q.size(1) % key_cache.size(1) == 0 && key_cache.size(1) == value_cache.size(1), "query heads per KV head");
  TORCH_CHECK(q.size(2) == key_cache.size(2), "query and key widths");
  TORCH_CHECK(kv_indices.scalar_type() == at::kLong && kv_indptr.scalar_type() == at::kLong &&
                  kv_indices.is_contiguous() && kv_indptr.is_contiguous() && kv_indptr.numel() == q.size(0) + 1,
              "kv_indices and kv_indptr: contiguous int64, B + 1 offsets");
  auto out = at::empty({q.size(0), q.size(1), value_cache.size(2)}, q.options().dtype(at::kFloat));
  const int64_t* slots = kv_indices.data_ptr<int64_t>();
  const int64_t* indptr = kv_indptr.data_ptr<int64_t>();
  TORCH_CHECK(!tiles || tiles_take(q, key_cache, value_cache),
              "tiles: AMX granted, bf16 queries and KV, widths of whole 32-column chunks, <= 16 query heads per KV head");
  if (key_cache.scalar_type() == at::kFloat) {
    run<float>(q, key_cache, value_cache, slots, indptr, scale, false, out);
  } else {
    TORCH_CHECK(key_cache.scalar_type() == at::kBFloat16, "KV cache: fp32 or bf16");
    run<c10::BFloat16>(q, key_cache, value_cache, slots, indptr, scale, tiles, out);
  }
  return out;
}

}  // namespace
}  // namespace moeplex_cpu

TORCH_LIBRARY_FRAGMENT(moeplex_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor key_cache, Tensor value_cache, Tensor kv_indices, Tensor kv_indptr, float scale, bool tiles=False) -> Tensor",
        &moeplex_cpu::paged_decode);
  m.def("paged_decode_tiles_take(Tensor q, Tensor key_cache, Tensor value_cache) -> bool", &moeplex_cpu::tiles_take);
}
