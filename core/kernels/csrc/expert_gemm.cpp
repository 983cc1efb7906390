// A rank's routed experts for a few tokens each, at memory speed: every expert's weights are read once per call,
// for all the rows it received, from a layout packed for streaming (blocks of 16 output columns, the reduction
// dimension outermost, so a block is one contiguous run of memory). The rows of a tile (up to ROWS) keep their
// 16-column accumulators in registers while the block streams past; gate and up are interleaved in one block so
// SiLU(gate) * up is applied before anything leaves the registers. Weights in fp32 or bf16 (widened in
// registers); activations and accumulation in fp32. Parallel with at::parallel_for: over (expert, column block)
// for gate/up, over output column blocks for the down projection (each thread owns its columns of the output,
// so experts that share a token never write the same place from two threads).
// Each loop over a weight block prefetches the stream PF_STEPS reduction steps (4 KB of fp32 gate/up) ahead: a
// core's own hardware prefetch keeps too few lines in flight once a tile's rows give it work per line (on a Xeon
// with AMX, fp32 experts at 48 tokens read their layer at 9.4 GB/s without, 12 with, against 13 for a bare sum).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "amx.h"
#include "vec16.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace moeplex_cpu {
namespace {

#if defined(__AVX512F__)
constexpr int ROWS = 8;  // 2 x 8 accumulators + 2 weight vectors in 32 registers
#else
constexpr int ROWS = 4;  // 16 registers of half the width
#endif

constexpr int64_t PF_STEPS = 32;  // reduction steps prefetched ahead (16 and 32 measured; 32 the faster at 16 tokens)

// act[r, 16 columns] = SiLU(x[r] . gate block) * (x[r] . up block) * weight[r], for M rows; `w` [H, 32]: for each
// input column, the block's 16 gate then 16 up weights.
template <int M, typename W>
void gate_up_tile(const float* const* x, const W* w, int64_t H, float* const* act, const float* weight) {
  f32x16 gate[M], up[M];
  for (int r = 0; r < M; ++r) gate[r] = up[r] = zeros16();
  for (int64_t k = 0; k < H; ++k) {
    const f32x16 wg = load16(w + 32 * k), wu = load16(w + 32 * k + 16);
    __builtin_prefetch(w + 32 * (k + PF_STEPS), 0, 3);
    __builtin_prefetch(w + 32 * (k + PF_STEPS) + 16, 0, 3);
    for (int r = 0; r < M; ++r) {
      const float xv = x[r][k];
      gate[r] += xv * wg;
      up[r] += xv * wu;
    }
  }
  for (int r = 0; r < M; ++r) {
    const f32x16 silu = gate[r] / (1.f + exp16(zeros16() - gate[r]));
    store16(act[r], silu * up[r] * weight[r]);
  }
}

// out[r, 16 columns] += act[r] . block, for M rows; `w` [I, 16].
template <int M, typename W>
void down_tile(const float* const* act, const W* w, int64_t I, float* const* out) {
  f32x16 acc[M];
  for (int r = 0; r < M; ++r) acc[r] = zeros16();
  for (int64_t k = 0; k < I; ++k) {
    const f32x16 wk = load16(w + 16 * k);
    __builtin_prefetch(w + 16 * (k + 2 * PF_STEPS), 0, 3);
    for (int r = 0; r < M; ++r) acc[r] += act[r][k] * wk;
  }
  for (int r = 0; r < M; ++r) store16(out[r], load16(out[r]) + acc[r]);
}

#if defined(__AVX512BF16__)
// bf16 weights and bf16 activations on a processor with AVX-512 BF16: the weights packed in pairs along the
// reduction (`pack` below), each step one dot product of two bf16 pairs per lane into fp32 (exact products): twice
// the multiply-adds of widening to fp32. The gate/up output is rounded to bf16 for the down projection, as a bf16
// model's own activations are.
inline __m512bh pair_of(const c10::BFloat16* x) {  // x[0], x[1] in every 32-bit lane
  int32_t bits;
  std::memcpy(&bits, x, sizeof bits);
  return (__m512bh)_mm512_set1_epi32(bits);
}

// `w` [H/2, 64]: per pair of input columns, the block's 16 gate then 16 up columns, each as its two weights.
template <int M>
void gate_up_tile(const c10::BFloat16* const* x, const c10::BFloat16* w, int64_t H, c10::BFloat16* const* act,
                  const float* weight) {
  __m512 gate[M], up[M];
  for (int r = 0; r < M; ++r) gate[r] = up[r] = _mm512_setzero_ps();
  for (int64_t j = 0; j < H / 2; ++j) {
    const __m512bh wg = (__m512bh)_mm512_loadu_si512(w + 64 * j), wu = (__m512bh)_mm512_loadu_si512(w + 64 * j + 32);
    __builtin_prefetch(w + 64 * (j + PF_STEPS), 0, 3);
    __builtin_prefetch(w + 64 * (j + PF_STEPS) + 32, 0, 3);
    for (int r = 0; r < M; ++r) {
      const __m512bh xv = pair_of(x[r] + 2 * j);
      gate[r] = _mm512_dpbf16_ps(gate[r], xv, wg);
      up[r] = _mm512_dpbf16_ps(up[r], xv, wu);
    }
  }
  for (int r = 0; r < M; ++r) {
    f32x16 g, u;
    std::memcpy(&g, &gate[r], sizeof g);
    std::memcpy(&u, &up[r], sizeof u);
    const f32x16 y = g / (1.f + exp16(zeros16() - g)) * u * weight[r];
    __m512 yv;
    std::memcpy(&yv, &y, sizeof yv);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(act[r]), (__m256i)_mm512_cvtneps_pbh(yv));
  }
}

// `w` [I/2, 32]: per pair of intermediate columns, the block's 16 output columns, each as its two weights.
template <int M>
void down_tile(const c10::BFloat16* const* act, const c10::BFloat16* w, int64_t I, float* const* out) {
  __m512 acc[M];
  for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t j = 0; j < I / 2; ++j) {
    const __m512bh wk = (__m512bh)_mm512_loadu_si512(w + 32 * j);
    __builtin_prefetch(w + 32 * (j + 2 * PF_STEPS), 0, 3);
    for (int r = 0; r < M; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], pair_of(act[r] + 2 * j), wk);
  }
  for (int r = 0; r < M; ++r) _mm512_storeu_ps(out[r], _mm512_add_ps(_mm512_loadu_ps(out[r]), acc[r]));
}
#endif

#define MOEPLEX_ROWS(CALL)                            \
  switch (m) {                                        \
    case 1: CALL(1); break;                           \
    case 2: CALL(2); break;                           \
    case 3: CALL(3); break;                           \
    case 4: CALL(4); break;                           \
    MOEPLEX_WIDE_ROWS(CALL)                           \
  }
#if defined(__AVX512F__)
#define MOEPLEX_WIDE_ROWS(CALL) \
  case 5: CALL(5); break;       \
  case 6: CALL(6); break;       \
  case 7: CALL(7); break;       \
  case 8: CALL(8); break;
#else
#define MOEPLEX_WIDE_ROWS(CALL)
#endif

struct Pairs {  // this rank's (token, expert) pairs sorted by expert
  std::vector<int64_t> start;  // [E + 1]: expert e's pairs are start[e] .. start[e + 1]
  std::vector<int64_t> token;
  std::vector<float> weight;
};

Pairs sort_pairs(const at::Tensor& topk_ids, const at::Tensor& topk_weights, int64_t experts) {
  const int64_t n = topk_ids.numel();
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  const float* weights = topk_weights.data_ptr<float>();
  const int64_t top_k = topk_ids.size(1);
  Pairs p;
  p.start.assign(experts + 1, 0);
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] >= 0 && ids[i] < experts) ++p.start[ids[i] + 1];  // -1: another rank's pair
  for (int64_t e = 0; e < experts; ++e) p.start[e + 1] += p.start[e];
  p.token.resize(p.start[experts]);
  p.weight.resize(p.start[experts]);
  std::vector<int64_t> next(p.start.begin(), p.start.end() - 1);
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= experts) continue;
    const int64_t at = next[ids[i]]++;
    p.token[at] = i / top_k;
    p.weight[at] = weights[i];
  }
  return p;
}

// X: the activations' type (fp32, or bf16 with pair-packed bf16 weights); each weight block is H x 32 (gate/up)
// or I x 16 (down) elements in either packing.
template <typename W, typename X>
void run(const at::Tensor& x, const Pairs& p, const W* w13, const W* w2, int64_t experts, int64_t H, int64_t I,
         X* act, float* out) {
  const int64_t gate_blocks = I / 16, out_blocks = H / 16;
  const X* xp = x.data_ptr<X>();
  std::vector<int64_t> items;  // (expert, gate/up column block) pairs with rows to compute
  for (int64_t e = 0; e < experts; ++e)
    if (p.start[e + 1] > p.start[e])
      for (int64_t b = 0; b < gate_blocks; ++b) items.push_back(e * gate_blocks + b);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    const X* rows[ROWS];
    X* dest[ROWS];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = items[i] / gate_blocks, b = items[i] % gate_blocks;
      const W* block = w13 + (e * gate_blocks + b) * H * 32;
      for (int64_t r0 = p.start[e]; r0 < p.start[e + 1]; r0 += ROWS) {
        const int m = static_cast<int>(std::min<int64_t>(ROWS, p.start[e + 1] - r0));
        for (int r = 0; r < m; ++r) {
          rows[r] = xp + p.token[r0 + r] * H;
          dest[r] = act + (r0 + r) * I + 16 * b;
        }
#define MOEPLEX_GATE_UP(M) gate_up_tile<M>(rows, block, H, dest, p.weight.data() + r0)
        MOEPLEX_ROWS(MOEPLEX_GATE_UP)
#undef MOEPLEX_GATE_UP
      }
    }
  });
  at::parallel_for(0, out_blocks, 1, [&](int64_t begin, int64_t end) {
    const X* rows[ROWS];
    float* dest[ROWS];
    for (int64_t e = 0; e < experts; ++e) {  // expert by expert: its blocks of this thread's columns in order
      for (int64_t b = begin; b < end; ++b) {
        const W* block = w2 + (e * out_blocks + b) * I * 16;
        for (int64_t r0 = p.start[e]; r0 < p.start[e + 1]; r0 += ROWS) {
          const int m = static_cast<int>(std::min<int64_t>(ROWS, p.start[e + 1] - r0));
          for (int r = 0; r < m; ++r) {
            rows[r] = act + (r0 + r) * I;
            dest[r] = out + p.token[r0 + r] * H + 16 * b;
          }
#define MOEPLEX_DOWN(M) down_tile<M>(rows, block, I, dest)
          MOEPLEX_ROWS(MOEPLEX_DOWN)
#undef MOEPLEX_DOWN
        }
      }
    }
  });
}


#if defined(MOEPLEX_AMX)
// The bf16 pair-packed experts on the AMX tile unit. A 16-column block's pair-packed weights are already the tile
// product's second operand (row = one pair of reduction columns, its 16 outputs x 2): gate and up load in place
// (every other 64 bytes of a gate/up block), the down block is contiguous. The first operand is up to 16 rows of an
// expert: its tokens' activations copied into a zero-padded stage once per expert, the act rows (contiguous per
// expert) in place. Same arithmetic as the vector form: exact bf16 products summed in fp32, the gate/up output
// rounded to bf16 for the down projection.
constexpr int64_t TROWS = 16;
constexpr int64_t TILE_PF_CHUNKS = 2;  // the weight chunks (2 KB of gate/up, 1 KB of down) prefetched ahead

inline void prefetch_lines(const c10::BFloat16* p, int64_t elements) {
  for (int64_t i = 0; i < elements; i += 32) __builtin_prefetch(p + i, 0, 3);
}

void run_tiles(const at::Tensor& x, const Pairs& p, const c10::BFloat16* w13, const c10::BFloat16* w2,
               int64_t experts, int64_t H, int64_t I, c10::BFloat16* act, float* out) {
  const int64_t gate_blocks = I / 16, out_blocks = H / 16;
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  std::vector<int64_t> items;  // (expert, gate/up column block) pairs with rows to compute
  for (int64_t e = 0; e < experts; ++e)
    if (p.start[e + 1] > p.start[e])
      for (int64_t b = 0; b < gate_blocks; ++b) items.push_back(e * gate_blocks + b);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    Tiles held;
    std::vector<c10::BFloat16> stage(TROWS * H);
    alignas(64) float gate[TROWS * 16], up[TROWS * 16];
    int64_t staged = -1;  // (expert, first row) in the stage
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = items[i] / gate_blocks, b = items[i] % gate_blocks;
      const c10::BFloat16* block = w13 + (e * gate_blocks + b) * H * 32;
      for (int64_t r0 = p.start[e]; r0 < p.start[e + 1]; r0 += TROWS) {
        const int64_t m = std::min<int64_t>(TROWS, p.start[e + 1] - r0);
        if (staged != r0) {  // rows of one expert are contiguous in the pair order: r0 names them
          for (int64_t r = 0; r < TROWS; ++r) {
            if (r < m) std::memcpy(stage.data() + r * H, xp + p.token[r0 + r] * H, H * sizeof(c10::BFloat16));
            else std::memset(stage.data() + r * H, 0, H * sizeof(c10::BFloat16));
          }
          staged = r0;
        }
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t c = 0; c < H / 32; ++c) {
          prefetch_lines(block + 16 * 64 * (c + TILE_PF_CHUNKS), 16 * 64);
          MOEPLEX_TILE_LOAD(2, stage.data() + 32 * c, H * static_cast<int64_t>(sizeof(c10::BFloat16)));
          MOEPLEX_TILE_LOAD(3, block + 16 * 64 * c, 128);
          MOEPLEX_TILE_LOAD(4, block + 16 * 64 * c + 32, 128);
          _tile_dpbf16ps(0, 2, 3);
          _tile_dpbf16ps(1, 2, 4);
        }
        MOEPLEX_TILE_STORE(0, gate, 64);
        MOEPLEX_TILE_STORE(1, up, 64);
        for (int64_t r = 0; r < m; ++r) {
          const f32x16 g = load16(gate + 16 * r), u = load16(up + 16 * r);
          const f32x16 y = g / (1.f + exp16(zeros16() - g)) * u * p.weight[r0 + r];
          __m512 yv;
          std::memcpy(&yv, &y, sizeof yv);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(act + (r0 + r) * I + 16 * b), (__m256i)_mm512_cvtneps_pbh(yv));
        }
      }
    }
  });
  at::parallel_for(0, out_blocks, 1, [&](int64_t begin, int64_t end) {
    Tiles held;
    alignas(64) float part[TROWS * 16];
    for (int64_t e = 0; e < experts; ++e) {  // expert by expert: its blocks of this thread's columns in order
      for (int64_t b = begin; b < end; ++b) {
        const c10::BFloat16* block = w2 + (e * out_blocks + b) * I * 16;
        for (int64_t r0 = p.start[e]; r0 < p.start[e + 1]; r0 += TROWS) {
          const int64_t m = std::min<int64_t>(TROWS, p.start[e + 1] - r0);
          _tile_zero(0);
          for (int64_t c = 0; c < I / 32; ++c) {  // rows past m: the next expert's, or the act buffer's padding
            prefetch_lines(block + 16 * 32 * (c + 2 * TILE_PF_CHUNKS), 16 * 32);
            MOEPLEX_TILE_LOAD(2, act + r0 * I + 32 * c, I * static_cast<int64_t>(sizeof(c10::BFloat16)));
            MOEPLEX_TILE_LOAD(3, block + 16 * 32 * c, 64);
            _tile_dpbf16ps(0, 2, 3);
          }
          MOEPLEX_TILE_STORE(0, part, 64);
          for (int64_t r = 0; r < m; ++r) {
            float* o = out + p.token[r0 + r] * H + 16 * b;
            store16(o, load16(o) + load16(part + 16 * r));
          }
        }
      }
    }
  });
}
#endif

// Whether the tile unit runs these pair-packed bf16 weights (AMX granted; H and I whole 32-column chunks).
bool experts_tiles_take(const at::Tensor& w13, const at::Tensor& w2) {
  return amx_granted() && w13.dim() == 4 && w13.size(3) == 64 && w13.scalar_type() == at::kBFloat16 &&
         (w13.size(1) * 16) % 32 == 0 && (w13.size(2) * 2) % 32 == 0;
}

// Whether bf16 weights are packed in pairs (`moe_experts` then takes bf16 activations): the processor has AVX-512 BF16.
bool bf16_pairs() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// x [T, H] fp32 (bf16 with pair-packed weights); topk_ids [T, k] int64 (-1: another rank's pair); topk_weights
// [T, k] fp32; weights packed by 16 output columns: w13 [E, I/16, H, 32] (per input column, the block's gate then
// up weights) and w2 [E, H/16, I, 16], fp32 or bf16; or, bf16 where `bf16_pairs`, in pairs along the reduction:
// w13 [E, I/16, H/2, 64], w2 [E, H/16, I/2, 32] -> [T, H] fp32: over each token's pairs, weight * expert(token).
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                       const at::Tensor& w13, const at::Tensor& w2, bool tiles) {
  TORCH_CHECK(topk_ids.scalar_type() == at::kLong && topk_ids.is_contiguous() && topk_ids.dim() == 2 &&
                  topk_ids.size(0) == x.size(0), "topk_ids: contiguous int64 [T, k]");
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_weights.is_contiguous() &&
                  topk_weights.sizes() == topk_ids.sizes(), "topk_weights: contiguous fp32 [T, k]");
  TORCH_CHECK(w13.dim() == 4 && w2.dim() == 4 && w13.is_contiguous() && w2.is_contiguous() &&
                  w13.scalar_type() == w2.scalar_type(), "packed w13 and w2: contiguous, one dtype");
  const bool pairs = w13.size(3) == 64;
  TORCH_CHECK(pairs ? (bf16_pairs() && w13.scalar_type() == at::kBFloat16 && w2.size(3) == 32)
                    : (w13.size(3) == 32 && w2.size(3) == 16), "packed w13 [E, I/16, H, 32], w2 [E, H/16, I, 16]");
  const int64_t experts = w13.size(0), I = w13.size(1) * 16, H = w13.size(2) * (pairs ? 2 : 1);
  TORCH_CHECK(x.size(1) == H && w2.size(0) == experts && w2.size(1) * 16 == H && w2.size(2) * (pairs ? 2 : 1) == I,
              "shapes agree");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == (pairs ? at::kBFloat16 : at::kFloat),
              "x: contiguous [T, H], bf16 with pair-packed weights, else fp32");
  TORCH_CHECK(!tiles || experts_tiles_take(w13, w2), "tiles: AMX granted, pair-packed bf16, whole 32-column chunks");
  const Pairs p = sort_pairs(topk_ids, topk_weights, experts);
  auto out = at::zeros({x.size(0), H}, x.options().dtype(at::kFloat));
  auto act = at::empty({p.start[experts] + (tiles ? 16 : 0), I}, x.options());  // tiles read 16 rows at a time
#if defined(MOEPLEX_AMX)
  if (tiles) {
    run_tiles(x, p, w13.data_ptr<c10::BFloat16>(), w2.data_ptr<c10::BFloat16>(), experts, H, I,
              act.data_ptr<c10::BFloat16>(), out.data_ptr<float>());
    return out;
  }
#endif
  if (w13.scalar_type() == at::kFloat) {
    run<float, float>(x, p, w13.data_ptr<float>(), w2.data_ptr<float>(), experts, H, I, act.data_ptr<float>(),
                      out.data_ptr<float>());
  } else if (!pairs) {
    TORCH_CHECK(w13.scalar_type() == at::kBFloat16, "weights: fp32 or bf16");
    run<c10::BFloat16, float>(x, p, w13.data_ptr<c10::BFloat16>(), w2.data_ptr<c10::BFloat16>(), experts, H, I,
                              act.data_ptr<float>(), out.data_ptr<float>());
  } else {
#if defined(__AVX512BF16__)
    run<c10::BFloat16, c10::BFloat16>(x, p, w13.data_ptr<c10::BFloat16>(), w2.data_ptr<c10::BFloat16>(), experts, H,
                                      I, act.data_ptr<c10::BFloat16>(), out.data_ptr<float>());
#endif
  }
  return out;
}

}  // namespace
}  // namespace moeplex_cpu

TORCH_LIBRARY_FRAGMENT(moeplex_cpu, m) {
  m.def("moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w2, bool tiles=False) -> Tensor",
        &moeplex_cpu::moe_experts);
  m.def("experts_tiles_take(Tensor w13, Tensor w2) -> bool", &moeplex_cpu::experts_tiles_take);
  m.def("experts_bf16_pairs() -> bool", &moeplex_cpu::bf16_pairs);
}
