// Sixteen fp32 lanes: a GCC/Clang vector type (one zmm register) where the compiler targets AVX-512 (four NEON
// registers on ARM), two 8-lane halves in ymm registers on other x86, so one source serves every processor
// -march=native builds for.
// Weights and KV rows are read as fp32 or bf16 and widened to fp32 in registers (bf16 is fp32's high half).
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace moeplex_cpu {

typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

// e^x in every lane (relative error ~2e-7): x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^7,
// 2^n put straight into the exponent bits. Lanes below -87 give 0 (what softmax wants for far-off scores).
template <typename V, typename I>
inline V exp_lanes(V x) {
  const V lo = V{} - 87.f, hi = V{} + 88.f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const float round = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer in the mantissa
  V n = (x * 1.44269504f + round) - round;
  V r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln2 in two parts, so r keeps its low bits
  V p = 1.f / 5040 + r * 0.f;
  p = p * r + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  I bits = (__builtin_convertvector(n, I) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// bf16 values widened to fp32 lanes (bf16 is fp32's high half)
template <typename V, typename U16, typename U32>
inline V widen_lanes(const c10::BFloat16* p) {
  U16 half;
  std::memcpy(&half, p, sizeof half);
  U32 wide = __builtin_convertvector(half, U32) << 16;
  V v;
  std::memcpy(&v, &wide, sizeof v);
  return v;
}

inline float sum8(f32x8 h) {  // a tree of halves: a few shuffles, not eight dependent adds
  f32x4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

#if defined(__AVX512F__) || !(defined(__x86_64__) || defined(__i386__))
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

inline f32x16 zeros16() { return f32x16{}; }

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);  // an unaligned vector load
  return v;
}

inline f32x16 load16(const c10::BFloat16* p) { return widen_lanes<f32x16, u16x16, u32x16>(p); }

inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }

inline float sum16(f32x16 v) {
  return sum8(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}

inline f32x16 exp16(f32x16 x) { return exp_lanes<f32x16, i32x16>(x); }
#else
// x86 without AVX-512: GCC keeps a 64-byte vector type in memory there (no register holds it), which made every
// loop over it 4-15x slower than the same loop over two 8-lane halves (measured on a Zen 3 EPYC with AVX2): the
// sixteen lanes are two halves in ymm registers instead, with the operators the kernels use.
struct f32x16 {
  f32x8 lo, hi;
};

#define MOEPLEX_LANES_OP(OP)                                                                                     \
  inline f32x16 operator OP(f32x16 a, f32x16 b) { return {a.lo OP b.lo, a.hi OP b.hi}; }                           \
  inline f32x16 operator OP(f32x16 a, float b) { return {a.lo OP b, a.hi OP b}; }                                  \
  inline f32x16 operator OP(float a, f32x16 b) { return {a OP b.lo, a OP b.hi}; }                                  \
  inline f32x16& operator OP##=(f32x16& a, f32x16 b) { return a = a OP b; }
MOEPLEX_LANES_OP(+)
MOEPLEX_LANES_OP(-)
MOEPLEX_LANES_OP(*)
MOEPLEX_LANES_OP(/)
#undef MOEPLEX_LANES_OP

inline f32x16 zeros16() { return f32x16{}; }

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v.lo, p, sizeof v.lo);
  std::memcpy(&v.hi, p + 8, sizeof v.hi);
  return v;
}

inline f32x16 load16(const c10::BFloat16* p) {
  return {widen_lanes<f32x8, u16x8, u32x8>(p), widen_lanes<f32x8, u16x8, u32x8>(p + 8)};
}

inline void store16(float* p, f32x16 v) {
  std::memcpy(p, &v.lo, sizeof v.lo);
  std::memcpy(p + 8, &v.hi, sizeof v.hi);
}

inline float sum16(f32x16 v) { return sum8(v.lo + v.hi); }

inline f32x16 exp16(f32x16 x) { return {exp_lanes<f32x8, i32x8>(x.lo), exp_lanes<f32x8, i32x8>(x.hi)}; }
#endif

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }

// dot(a, b) over n values; two chains so consecutive FMAs do not wait on each other
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  f32x16 s0 = zeros16(), s1 = zeros16();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    s0 += load16(a + i) * load16(b + i);
    s1 += load16(a + i + 16) * load16(b + i + 16);
  }
  if (i + 16 <= n) {
    s0 += load16(a + i) * load16(b + i);
    i += 16;
  }
  float s = sum16(s0 + s1);
  for (; i < n; ++i) s += a[i] * widen(b[i]);
  return s;
}

// y[0:n] += a * x[0:n]
template <typename T>
inline void axpy(float* y, float a, const T* x, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(y + i, load16(y + i) + a * load16(x + i));
  for (; i < n; ++i) y[i] += a * widen(x[i]);
}

// y[0:n] *= a
inline void scale(float* y, float a, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store16(y + i, load16(y + i) * a);
  for (; i < n; ++i) y[i] *= a;
}

}  // namespace moeplex_cpu
