// The few vector operations the row kernels need, for one instruction set per build (models/rowgemm.py compiles
// rows_gemm.cpp once per ISA with -DSPECSCOPE_ISA_AVX512_BF16, _AVX512, _AVX2 or _NEON). Every operation is exact lane by lane
// except hsum/hmax, whose reduction tree is fixed per ISA, so results depend only on the data, never on how many
// rows a call holds. FMA is always an explicit fused multiply-add (never left to compiler contraction).
#pragma once
#include <stdint.h>
#include <string.h>

#if defined(SPECSCOPE_ISA_AVX512) || defined(SPECSCOPE_ISA_AVX512_BF16)
#include <immintrin.h>
namespace simd {
constexpr int L = 16;
#if defined(SPECSCOPE_ISA_AVX512_BF16)   // AVX-512 plus vdpbf16ps (Zen 4, Cooper Lake, Sapphire Rapids and later)
#define SPECSCOPE_DPBF16 1
constexpr const char* ISA = "avx512_bf16";
#else
constexpr const char* ISA = "avx512";
#endif
typedef __m512 vf;
static inline __mmask16 lanes(int n) { return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u); }
static inline vf zero() { return _mm512_setzero_ps(); }
static inline vf set1(float a) { return _mm512_set1_ps(a); }
static inline vf load(const float* p) { return _mm512_loadu_ps(p); }
static inline vf load(const uint16_t* p) {   // bf16 -> fp32 is exact: the bits move up 16 places
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf load_n(const float* p, int n) { return _mm512_maskz_loadu_ps(lanes(n), p); }
static inline vf load_n(const uint16_t* p, int n) {   // the first n bf16 values widened, the rest zero
    if (n >= 16) return load(p);
    uint16_t t[16] = {0};
    if (n > 0) memcpy(t, p, (size_t)n * 2);
    return load(t);
}
static inline void store_n(float* p, vf v, int n) { _mm512_mask_storeu_ps(p, lanes(n), v); }
static inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf min(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c
static inline vf fnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
static inline vf round(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf ldexp(vf p, vf n) { return _mm512_scalef_ps(p, n); }   // p * 2^n, n integral
// hsum's tree: lanes i and i+8 first, then AVX2's ((0+1)+(2+3)) + ((4+5)+(6+7)); hsum4 gives four sums by the
// same tree, so a score does not depend on whether it was reduced alone or beside three others
static inline __m256 half_sum(vf v) { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); }
static inline void hsum4(vf a, vf b, vf c, vf d, float* out) {
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(half_sum(a), half_sum(b)), _mm256_hadd_ps(half_sum(c), half_sum(d)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}
static inline float hsum(vf v) {
    __m256 h = half_sum(v);
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(h, h), _mm256_hadd_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}
static inline float hmax(vf v) { return _mm512_reduce_max_ps(v); }   // a max is exact in any order
static inline void prefetch(const void* p) { _mm_prefetch((const char*)p, _MM_HINT_T0); }
}  // namespace simd

#elif defined(SPECSCOPE_ISA_AVX2)
#include <immintrin.h>
namespace simd {
constexpr int L = 8;
constexpr const char* ISA = "avx2";
typedef __m256 vf;
static inline __m256i lanes(int n) {   // lane i enabled where i < n (sign bit set)
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline vf zero() { return _mm256_setzero_ps(); }
static inline vf set1(float a) { return _mm256_set1_ps(a); }
static inline vf load(const float* p) { return _mm256_loadu_ps(p); }
static inline vf load(const uint16_t* p) {   // bf16 -> fp32 is exact: the bits move up 16 places
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline void store(float* p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf load_n(const float* p, int n) { return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes(n)); }
static inline vf load_n(const uint16_t* p, int n) {   // the first n bf16 values widened, the rest zero
    if (n >= 8) return load(p);
    uint16_t t[8] = {0};
    if (n > 0) memcpy(t, p, (size_t)n * 2);
    return load(t);
}
static inline void store_n(float* p, vf v, int n) {
    if (n >= 8) _mm256_storeu_ps(p, v); else _mm256_maskstore_ps(p, lanes(n), v);
}
static inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf min(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf fnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline vf round(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf ldexp(vf p, vf n) {   // n in [-126, 127]: build 2^n in the exponent field
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
// ((0+1)+(2+3)) + ((4+5)+(6+7)) for one vector (hsum) or four at once (hsum4): the same tree either way
static inline void hsum4(vf a, vf b, vf c, vf d, float* out) {
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}
static inline float hsum(vf v) {
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(v, v), _mm256_hadd_ps(v, v));
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}
static inline float hmax(vf v) {
    __m128 b = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    b = _mm_max_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_max_ss(b, _mm_movehdup_ps(b)));
}
static inline void prefetch(const void* p) { _mm_prefetch((const char*)p, _MM_HINT_T0); }
}  // namespace simd

#elif defined(SPECSCOPE_ISA_NEON)
#include <arm_neon.h>
namespace simd {
constexpr int L = 4;
constexpr const char* ISA = "neon";
typedef float32x4_t vf;
static inline vf zero() { return vdupq_n_f32(0.0f); }
static inline vf set1(float a) { return vdupq_n_f32(a); }
static inline vf load(const float* p) { return vld1q_f32(p); }
static inline vf load(const uint16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }   // exact
static inline void store(float* p, vf v) { vst1q_f32(p, v); }
static inline vf load_n(const float* p, int n) {   // no masked loads: stage the tail through the stack
    if (n >= 4) return vld1q_f32(p);
    float t[4] = {0, 0, 0, 0};
    if (n > 0) memcpy(t, p, (size_t)n * sizeof(float));
    return vld1q_f32(t);
}
static inline vf load_n(const uint16_t* p, int n) {   // the first n bf16 values widened, the rest zero
    if (n >= 4) return load(p);
    uint16_t t[4] = {0, 0, 0, 0};
    if (n > 0) memcpy(t, p, (size_t)n * 2);
    return load(t);
}
static inline void store_n(float* p, vf v, int n) {
    if (n >= 4) { vst1q_f32(p, v); return; }
    float t[4];
    vst1q_f32(t, v);
    if (n > 0) memcpy(p, t, (size_t)n * sizeof(float));
}
static inline vf add(vf a, vf b) { return vaddq_f32(a, b); }
static inline vf sub(vf a, vf b) { return vsubq_f32(a, b); }
static inline vf mul(vf a, vf b) { return vmulq_f32(a, b); }
static inline vf div(vf a, vf b) { return vdivq_f32(a, b); }
static inline vf max(vf a, vf b) { return vmaxq_f32(a, b); }
static inline vf min(vf a, vf b) { return vminq_f32(a, b); }
static inline vf fma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
static inline vf fnma(vf a, vf b, vf c) { return vfmsq_f32(c, a, b); }
static inline vf round(vf a) { return vrndnq_f32(a); }
static inline vf ldexp(vf p, vf n) {
    int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtnq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vmulq_f32(p, vreinterpretq_f32_s32(e));
}
// (0+1)+(2+3) for one vector (hsum) or four at once (hsum4): the same tree either way
static inline void hsum4(vf a, vf b, vf c, vf d, float* out) {
    vst1q_f32(out, vpaddq_f32(vpaddq_f32(a, b), vpaddq_f32(c, d)));
}
static inline float hsum(vf v) {
    float32x4_t p = vpaddq_f32(v, v);
    return vgetq_lane_f32(vpaddq_f32(p, p), 0);
}
static inline float hmax(vf v) { return vmaxvq_f32(v); }
static inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }
}  // namespace simd

#else
#error "define SPECSCOPE_ISA_AVX512_BF16, SPECSCOPE_ISA_AVX512, SPECSCOPE_ISA_AVX2 or SPECSCOPE_ISA_NEON"
#endif
