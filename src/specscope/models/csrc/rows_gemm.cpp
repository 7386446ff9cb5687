// The row-invariant CPU kernels of a decode / verify / tree-drafting forward (fp32, and bf16 linears): the linear,
// RMSNorm (with the residual add fused), SiLU-gate, and rotary embedding + KV-cache write + attention. One design,
// written once over the vector operations of simd.h and built per instruction set (AVX-512 with or without
// AVX512_BF16, AVX2+FMA, NEON) by models/rowgemm.py
// (no torch headers; called through ctypes; it links the libgomp torch already loaded, so it shares torch's
// OpenMP thread pool).
//
// Linear, memory-bound design: W is packed once into column panels of NB = V*L outputs, [out/NB][in][NB], so each
// panel is one sequential stream; a panel is read from DRAM once and applied to every activation row (the rows are
// tiny and stay in L1/L2), so 8 rows cost about what 1 row costs until the FMAs catch up. Outputs sit in vector
// lanes (x[r, k] is broadcast), so there is no horizontal reduction at all.
// Row-invariant: y[r, o] is always bias[o] + x[r,0]W[o,0] + x[r,1]W[o,1] + ... as one FMA chain in k order,
// whatever n or the row chunking are, so decode (1 row) and verify (n rows) give bit-identical results. Every
// other kernel here computes a row from that row's data alone, in an order fixed by the shapes, for the same reason.
#include "simd.h"

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <vector>

using simd::L;
using simd::vf;

// the register tiles (V vectors of outputs x RB rows) each ISA is built with: its register file decides
// (AVX2: 16 registers, so V*RB + V + 1 <= 16; NEON and AVX-512: 32)
#if defined(SPECSCOPE_ISA_AVX512) || defined(SPECSCOPE_ISA_AVX512_BF16)
#define TILES(X) X(2, 6) X(2, 12) X(4, 4) X(4, 6)
#elif defined(SPECSCOPE_ISA_AVX2)
#define TILES(X) X(1, 12) X(2, 4) X(2, 6) X(4, 2) X(4, 3)
#else
#define TILES(X) X(4, 4) X(4, 6) X(8, 2) X(8, 3)
#endif

// one panel of V*L outputs (`valid` of them real) for RB rows of x; weights WT: float, or uint16_t holding bf16
// (half the bytes to stream, widened exactly to fp32 in registers: the same bits as fp32 weights of those values)
template <int V, int RB, typename WT>
static inline void tile(const float* __restrict x, int64_t in, const WT* __restrict p, const float* __restrict bias,
                        int valid, float* __restrict y, int64_t ldy) {
    vf acc[V][RB];
    for (int v = 0; v < V; ++v) {
        vf b = bias ? simd::load_n(bias + v * L, valid - v * L) : simd::zero();
        for (int r = 0; r < RB; ++r) acc[v][r] = b;
    }
    for (int64_t k = 0; k < in; ++k) {
        const WT* pk = p + k * (V * L);
        // 4 KB ahead into L1, a line at a time: the hardware prefetcher alone leaves the FMAs waiting once n >= 4
        for (int c = 0; c < V * L; c += 64 / (int)sizeof(WT)) simd::prefetch(pk + 4096 / sizeof(WT) + c);
        vf wv[V];
        for (int v = 0; v < V; ++v) wv[v] = simd::load(pk + v * L);
        for (int r = 0; r < RB; ++r) {
            vf xb = simd::set1(x[r * in + k]);
            for (int v = 0; v < V; ++v) acc[v][r] = simd::fma(wv[v], xb, acc[v][r]);
        }
    }
    for (int v = 0; v < V; ++v) {
        int left = valid - v * L;
        if (left <= 0) break;
        for (int r = 0; r < RB; ++r) simd::store_n(y + r * ldy + v * L, acc[v][r], left);
    }
}

// the last, narrower chunk of rows: tile<V, rem> for 0 < rem < RB
template <int V, int R, typename WT>
static inline void tail(int64_t rem, const float* x, int64_t in, const WT* p, const float* bias, int valid,
                        float* y, int64_t ldy) {
    if constexpr (R > 0) {
        if (rem == R) tile<V, R>(x, in, p, bias, valid, y, ldy);
        else tail<V, R - 1>(rem, x, in, p, bias, valid, y, ldy);
    }
}

template <int V, int RB, typename WT>
static void run(const float* x, int64_t n, const WT* p, int64_t out, int64_t in, const float* bias, float* y,
                int nthreads) {
    const int64_t NB = V * L, npan = (out + NB - 1) / NB;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t b = 0; b < npan; ++b) {
        int64_t left = out - b * NB;
        int valid = left < NB ? (int)left : (int)NB;
        const WT* pb = p + b * NB * in;
        const float* bb = bias ? bias + b * NB : nullptr;
        int64_t r = 0;
        for (; r + RB <= n; r += RB) tile<V, RB>(x + r * in, in, pb, bb, valid, y + r * out + b * NB, out);
        tail<V, RB - 1, WT>(n - r, x + r * in, in, pb, bb, valid, y + r * out + b * NB, out);
    }
}

// panel width nb and register tile rb (tuned; results identical) pick the instantiation; -1 if not built
template <typename WT>
static int gemm_dispatch(const float* x, int64_t n, const WT* p, int64_t nb, int64_t out, int64_t in,
                         const float* bias, float* y, int nthreads, int rb) {
#define CASE(V_, RB_) if (nb == (V_) * L && rb == (RB_)) { run<V_, RB_, WT>(x, n, p, out, in, bias, y, nthreads); return 0; }
    TILES(CASE)
#undef CASE
    return -1;
}

// ---- bf16 serving precision: weights bf16, each row's input rounded to bf16, fp32 accumulation -------------------
// Products of two bf16 values are exact in fp32, so the only roundings are the accumulations, and those happen
// per output lane in an order fixed by the shapes, whatever the row count: a verify of n rows gives the bits of n
// decode steps. (vdpbf16ps adds each pair's odd-k product before the even one and flushes denormals, so its bits
// differ from the widened builds': bf16 results are exact per build, not across ISAs.)
// With vdpbf16ps (SPECSCOPE_DPBF16) one instruction takes two k at once for 16 outputs (weights packed in k pairs,
// [out/NB][ceil(in/2)][NB][2]); elsewhere the bf16 panels above are widened and FMA'd (the same layout as bf16 weights
// with fp32 inputs), here with inputs that are bf16 values.

// fp32 -> bf16, round to nearest even, as torch rounds (NaN -> the quiet NaN 0x7FC0); branch-free, so the loops
// over a row below vectorise
static inline uint16_t to_bf16(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0x7FC0 : (uint16_t)r;
}

// n rows of `in` inputs -> rows of `ld` bf16 values (ld >= in; the rest zero)
static void rows_to_bf16(const float* __restrict x, int64_t n, int64_t in, int64_t ld, uint16_t* __restrict out) {
    for (int64_t r = 0; r < n; ++r) {
        const float* xr = x + r * in;
        uint16_t* o = out + r * ld;
        for (int64_t k = 0; k < in; ++k) o[k] = to_bf16(xr[k]);
        for (int64_t k = in; k < ld; ++k) o[k] = 0;
    }
}

#if defined(SPECSCOPE_DPBF16)
// one panel of V*L outputs for RB rows: x holds each row's input as 2*kp bf16 values, i.e. kp pairs (even k low)
template <int V, int RB>
static inline void tile_dp(const uint16_t* __restrict x, int64_t kp, const uint16_t* __restrict p,
                           const float* __restrict bias, int valid, float* __restrict y, int64_t ldy) {
    vf acc[V][RB];
    for (int v = 0; v < V; ++v) {
        vf b = bias ? simd::load_n(bias + v * L, valid - v * L) : simd::zero();
        for (int r = 0; r < RB; ++r) acc[v][r] = b;
    }
    for (int64_t j = 0; j < kp; ++j) {
        const uint16_t* pj = p + j * (2 * V * L);
        for (int c = 0; c < 2 * V * L; c += 32) simd::prefetch(pj + 2048 + c);   // 4 KB ahead, as tile()
        __m512bh wv[V];
        for (int v = 0; v < V; ++v) wv[v] = (__m512bh)_mm512_loadu_si512((const void*)(pj + v * 2 * L));
        for (int r = 0; r < RB; ++r) {
            int32_t pair;
            memcpy(&pair, x + 2 * (r * kp + j), 4);   // a plain 32-bit load, without aliasing the uint16_t buffer
            __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            for (int v = 0; v < V; ++v) acc[v][r] = _mm512_dpbf16_ps(acc[v][r], wv[v], xb);
        }
    }
    for (int v = 0; v < V; ++v) {
        int left = valid - v * L;
        if (left <= 0) break;
        for (int r = 0; r < RB; ++r) simd::store_n(y + r * ldy + v * L, acc[v][r], left);
    }
}

template <int V, int R>
static inline void tail_dp(int64_t rem, const uint16_t* x, int64_t kp, const uint16_t* p, const float* bias,
                           int valid, float* y, int64_t ldy) {
    if constexpr (R > 0) {
        if (rem == R) tile_dp<V, R>(x, kp, p, bias, valid, y, ldy);
        else tail_dp<V, R - 1>(rem, x, kp, p, bias, valid, y, ldy);
    }
}

template <int V, int RB>
static void run_dp(const uint16_t* x, int64_t n, const uint16_t* p, int64_t out, int64_t kp, const float* bias,
                   float* y, int nthreads) {
    const int64_t NB = V * L, npan = (out + NB - 1) / NB;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t b = 0; b < npan; ++b) {
        int64_t left = out - b * NB;
        int valid = left < NB ? (int)left : (int)NB;
        const uint16_t* pb = p + b * NB * 2 * kp;
        const float* bb = bias ? bias + b * NB : nullptr;
        int64_t r = 0;
        for (; r + RB <= n; r += RB) tile_dp<V, RB>(x + 2 * r * kp, kp, pb, bb, valid, y + r * out + b * NB, out);
        tail_dp<V, RB - 1>(n - r, x + 2 * r * kp, kp, pb, bb, valid, y + r * out + b * NB, out);
    }
}
#endif

// pack w [out, in] (row-major) into panels of nb outputs: [ceil(out/nb)][in][nb], zero-padded; as fp32, or as
// bf16 (the top 16 bits of each fp32 weight: callers pack only weights that are exactly bf16, so nothing is rounded)
template <typename WT, typename Conv>
static void pack_panels(const float* w, int64_t out, int64_t in, int64_t nb, WT* p, Conv conv) {
    int64_t npan = (out + nb - 1) / nb;
    for (int64_t b = 0; b < npan; ++b)
        for (int64_t k = 0; k < in; ++k)
            for (int64_t j = 0; j < nb; ++j) {
                int64_t o = b * nb + j;
                p[(b * in + k) * nb + j] = o < out ? conv(w[o * in + k]) : WT(0);
            }
}

extern "C" {

int rows_gemm_abi() { return 10; }

const char* rows_gemm_isa() { return simd::ISA; }

// the (panel width, register tile) pairs this build implements, for the tuner; returns how many
int rows_gemm_variants(int64_t* nb, int64_t* rb, int max) {
    int n = 0;
#define LIST(V_, RB_) if (n < max) { nb[n] = (V_) * L; rb[n] = (RB_); } ++n;
    TILES(LIST)
#undef LIST
    return n;
}

void rows_gemm_pack(const float* w, int64_t out, int64_t in, int64_t nb, float* p) {
    pack_panels(w, out, in, nb, p, [](float v) { return v; });
}

void rows_gemm_pack_bf16(const float* w, int64_t out, int64_t in, int64_t nb, uint16_t* p) {
    pack_panels(w, out, in, nb, p, [](float v) {
        uint32_t bits;
        memcpy(&bits, &v, 4);
        return (uint16_t)(bits >> 16);
    });
}

int rows_gemm_f32(const float* x, int64_t n, const float* p, int64_t nb, int64_t out, int64_t in, const float* bias,
                  float* y, int nthreads, int rb) {
    return gemm_dispatch(x, n, p, nb, out, in, bias, y, nthreads, rb);
}

int rows_gemm_bf16(const float* x, int64_t n, const uint16_t* p, int64_t nb, int64_t out, int64_t in,
                   const float* bias, float* y, int nthreads, int rb) {
    return gemm_dispatch(x, n, p, nb, out, in, bias, y, nthreads, rb);
}

// 1 where bf16-input linears use vdpbf16ps and its k-pair panels, 0 where they widen the bf16 panels
int rows_gemm_bf16a_pairs() {
#if defined(SPECSCOPE_DPBF16)
    return 1;
#else
    return 0;
#endif
}

// pack w [out, in] for rows_gemm_bf16a, rounding each weight to bf16 (nearest even): k-pair panels
// [ceil(out/nb)][ceil(in/2)][nb][2] where rows_gemm_bf16a_pairs(), else the bf16 panels of rows_gemm_pack_bf16
void rows_gemm_pack_bf16a(const float* w, int64_t out, int64_t in, int64_t nb, uint16_t* p) {
#if defined(SPECSCOPE_DPBF16)
    const int64_t npan = (out + nb - 1) / nb, kp = (in + 1) / 2;
    for (int64_t b = 0; b < npan; ++b)
        for (int64_t j = 0; j < kp; ++j)
            for (int64_t jj = 0; jj < nb; ++jj)
                for (int64_t e = 0; e < 2; ++e) {
                    int64_t o = b * nb + jj, k = 2 * j + e;
                    p[((b * kp + j) * nb + jj) * 2 + e] = o < out && k < in ? to_bf16(w[o * in + k]) : 0;
                }
#else
    pack_panels(w, out, in, nb, p, to_bf16);
#endif
}

// y = bf16(x) W^T + bias with W packed by rows_gemm_pack_bf16a: every input rounded to bf16 (nearest even) first,
// products exact, fp32 accumulation in k order per output, so each row's bits are independent of n
int rows_gemm_bf16a(const float* x, int64_t n, const uint16_t* p, int64_t nb, int64_t out, int64_t in,
                    const float* bias, float* y, int nthreads, int rb) {
    // the caller's rows rounded once per call, into a buffer kept per thread (a fresh one cost as much as a
    // small linear); one grown past 64 MB by a long prefill is given back after the call
    int rc = -1;
#if defined(SPECSCOPE_DPBF16)
    static thread_local std::vector<uint16_t> buf;
    const int64_t kp = (in + 1) / 2;   // a row's bf16 values in k order are its k pairs (low half: even k)
    if (buf.size() < (size_t)(2 * n * kp)) buf.resize((size_t)(2 * n * kp));
    rows_to_bf16(x, n, in, 2 * kp, buf.data());
#define CASE(V_, RB_) if (nb == (V_) * L && rb == (RB_)) { run_dp<V_, RB_>(buf.data(), n, p, out, kp, bias, y, nthreads); rc = 0; }
    TILES(CASE)
#undef CASE
#else
    static thread_local std::vector<float> buf;
    if (buf.size() < (size_t)(n * in)) buf.resize((size_t)(n * in));
    float* xr = buf.data();
    for (int64_t i = 0; i < n * in; ++i) {   // the bf16 values, as fp32
        uint32_t u = (uint32_t)to_bf16(x[i]) << 16;
        memcpy(xr + i, &u, 4);
    }
    rc = gemm_dispatch((const float*)xr, n, p, nb, out, in, bias, y, nthreads, rb);
#endif
    if (buf.size() * sizeof(buf[0]) > ((size_t)64 << 20)) decltype(buf)().swap(buf);
    return rc;
}

}  // extern "C"

// ---- the rest of a decode/verify layer, row-invariant as well ---------------------------------------------------

// exp for softmax (x <= 0 after subtracting the max) and SiLU: Cephes' expf polynomial on x - n ln2, scaled by 2^n.
// x is clamped to [-87, 88] so 2^n stays a normal float on every ISA (exp(88) ~ 1.7e38 stands in for overflow:
// SiLU of g < -88 is then ~1e-36 instead of 0)
static inline vf vexp(vf x) {
    x = simd::max(simd::min(x, simd::set1(88.0f)), simd::set1(-87.0f));
    vf n = simd::round(simd::mul(x, simd::set1(1.44269504088896341f)));
    vf r = simd::fnma(n, simd::set1(0.693359375f), x);
    r = simd::fnma(n, simd::set1(-2.12194440e-4f), r);
    vf p = simd::set1(1.9875691500e-4f);
    p = simd::fma(p, r, simd::set1(1.3981999507e-3f));
    p = simd::fma(p, r, simd::set1(8.3334519073e-3f));
    p = simd::fma(p, r, simd::set1(4.1665795894e-2f));
    p = simd::fma(p, r, simd::set1(1.6666665459e-1f));
    p = simd::fma(p, r, simd::set1(5.0000001201e-1f));
    p = simd::fma(p, simd::mul(r, r), r);
    p = simd::add(p, simd::set1(1.0f));
    return simd::ldexp(p, n);
}

extern "C" {

// y[r] = x[r] / rms(x[r]) * w; with delta: h_out[r] = x[r] + delta[r] first and y normalises h_out
void rows_rmsnorm(const float* x, const float* delta, int64_t n, int64_t d, const float* w, float eps, float* h_out,
                  float* y) {
    for (int64_t r = 0; r < n; ++r) {
        const float* xr = x + r * d;
        float* hr = h_out ? h_out + r * d : nullptr;
        vf ss = simd::zero();
        for (int64_t k = 0; k < d; k += L) {
            int m = (int)(d - k < L ? d - k : L);
            vf v = simd::load_n(xr + k, m);
            if (delta) {
                v = simd::add(v, simd::load_n(delta + r * d + k, m));
                simd::store_n(hr + k, v, m);
            }
            ss = simd::fma(v, v, ss);
        }
        const float* src = delta ? hr : xr;
        vf inv = simd::set1(1.0f / sqrtf(simd::hsum(ss) / (float)d + eps));
        for (int64_t k = 0; k < d; k += L) {
            int m = (int)(d - k < L ? d - k : L);
            vf v = simd::mul(simd::load_n(src + k, m), inv);
            simd::store_n(y + r * d + k, simd::mul(v, simd::load_n(w + k, m)), m);
        }
    }
}

// out[r] = silu(gu[r, :inter]) * gu[r, inter:], the gated MLP's activation from the fused gate/up projection
void rows_silu_mul(const float* gu, int64_t n, int64_t inter, float* out) {
    const vf one = simd::set1(1.0f);
    for (int64_t r = 0; r < n; ++r) {
        const float* g = gu + r * 2 * inter;
        const float* u = g + inter;
        for (int64_t k = 0; k < inter; k += L) {
            int m = (int)(inter - k < L ? inter - k : L);
            vf gv = simd::load_n(g + k, m);
            vf s = simd::div(gv, simd::add(one, vexp(simd::sub(simd::zero(), gv))));
            simd::store_n(out + r * inter + k, simd::mul(s, simd::load_n(u + k, m)), m);
        }
    }
}

// Attention of T query rows over S cached slots (one sequence), grouped-query, scale 1/sqrt(D).
// q: row t, head h at q + t*q_row + h*D. k/v: kv head g, slot s at k + g*kv_head + s*D. mask: [T, S] bytes
// (row stride mask_row; null = every slot). out: [T, Hq*D].
// Row-invariant and slot-order-exact: a row's result depends only on its own query and the keys it may see,
// accumulated in slot order (masked slots are skipped, not added as zeros), so a verify row equals the decode step
// that sees the same keys in the same order.
int rows_attention(const float* q, int64_t q_row, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const float* k,
                   const float* v, int64_t kv_head, int64_t S, const uint8_t* mask, int64_t mask_row, float* out,
                   int nthreads);

// Rotary embedding + KV-cache write + attention for one layer, from the fused qkv projection [T, (Hq+2Hkv)*D]:
// k heads are rotated and written with v at `slots`, q heads rotated, then rows_attention over slots 0..S-1.
// cos/sin: [T, D] rows for the tokens' positions (HF layout: rotate_half pairs i with i + D/2). Slots outside
// the cache are refused (-3) before anything is written.
int rows_rope_attention(const float* qkv, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const float* cos,
                        const float* sin, const int64_t* slots, float* kc, float* vc, int64_t kv_head, int64_t max_len,
                        int64_t S, const uint8_t* mask, int64_t mask_row, float* out, int nthreads) {
    if (D % 2) return -1;
    if (S > max_len) return -2;
    for (int64_t t = 0; t < T; ++t)
        if (slots[t] < 0 || slots[t] >= max_len) return -3;   // checked before anything is written
    const int64_t H = Hq + 2 * Hkv, half = D / 2;
    std::vector<float> qr((size_t)(T * Hq * D));
    for (int64_t t = 0; t < T; ++t) {
        const float* row = qkv + t * H * D;
        const float* c = cos + t * D;
        const float* sn = sin + t * D;
        for (int64_t h = 0; h < Hq + Hkv; ++h) {
            const float* x = row + h * D;
            float* o = h < Hq ? &qr[(t * Hq + h) * D] : kc + (h - Hq) * kv_head + slots[t] * D;
            for (int64_t i = 0; i < half; ++i) {
                float a = x[i] * c[i], b = x[i + half] * sn[i];
                o[i] = a - b;
                float a2 = x[i + half] * c[i + half], b2 = x[i] * sn[i + half];
                o[i + half] = a2 + b2;
            }
        }
        for (int64_t g = 0; g < Hkv; ++g)
            memcpy(vc + g * kv_head + slots[t] * D, row + (Hq + Hkv + g) * D, D * sizeof(float));
    }
    return rows_attention(qr.data(), Hq * D, T, Hq, Hkv, D, kc, vc, kv_head, S, mask, mask_row, out, nthreads);
}

}  // extern "C"

constexpr int MAXV = 256 / L;   // head_dim <= 256

// out[q][j0*L .. (j0+W)*L) = sum over visible keys t (slot order) of p[q][t] * v[t], times inv[q]: W*G independent
// FMA chains, W fixed at compile time so they stay in registers
template <int G, int W, int NV>
static inline void weighted_sum(const float* vh, int64_t D, const int32_t* idx, int64_t m, const float* sc,
                                const float* inv, int j0, float* const* outs) {
    vf acc[G][W];
    for (int q = 0; q < G; ++q)
        for (int w = 0; w < W; ++w) acc[q][w] = simd::zero();
    for (int64_t t = 0; t < m; ++t) {
        const float* vs = vh + (int64_t)idx[t] * D + j0 * L;
        vf vv[W];
        for (int w = 0; w < W; ++w) vv[w] = NV ? simd::load(vs + w * L) : simd::load_n(vs + w * L, (int)(D - (j0 + w) * L));
        for (int q = 0; q < G; ++q) {
            vf pv = simd::set1(sc[q * m + t]);
            for (int w = 0; w < W; ++w) acc[q][w] = simd::fma(pv, vv[w], acc[q][w]);
        }
    }
    for (int q = 0; q < G; ++q)
        for (int w = 0; w < W; ++w)
            simd::store_n(outs[q] + (j0 + w) * L, simd::mul(acc[q][w], simd::set1(inv[q])), (int)(D - (j0 + w) * L));
}

// The G query heads that share one kv head, for one row: every key and value row is read once for all G (the
// cache lives in L2, whose bandwidth is what attention on a CPU runs into). NV > 0: head_dim = NV * L, known at
// compile time (the common 64 / 128, fully unrolled); NV == 0: any head_dim up to 256.
// Speed comes from independent chains: KB keys x G heads of dot products at once, and JC output vectors x G heads
// in the weighted sum, so the FMAs pipeline instead of waiting on one accumulator. Exactness does not depend on
// that blocking: a score is always the FMA chain over its head_dim in order, then one fixed hsum tree; an output
// lane always the FMA chain over the visible keys in slot order.
template <int G, int NV>
static void attend_group(const float* const* qs, const float* kh, const float* vh, int64_t D, const int32_t* idx,
                         int64_t m, float scale, float* sc, float* const* outs) {
    // KB = 4 for simd::hsum4; G * JC accumulators + a broadcast + JC loads fit the register file (AVX2: 16, else
    // 32), so the weighted sum takes a 64-wide head (4 AVX-512 vectors) in one pass of G * 4 chains
    constexpr int KB = 4, JC = L == 8 && G > 2 ? 3 : 4;
    const int nv = NV ? NV : (int)((D + L - 1) / L);
    auto ld = [&](const float* p, int j) { return NV ? simd::load(p + j * L) : simd::load_n(p + j * L, (int)(D - j * L)); };
    vf qr[G][NV ? NV : MAXV];
    for (int q = 0; q < G; ++q)
        for (int j = 0; j < nv; ++j) qr[q][j] = ld(qs[q], j);
    int64_t i = 0;
    for (; i + KB <= m; i += KB) {   // scores, KB keys at a time
        const float* ks[KB];
        for (int u = 0; u < KB; ++u) ks[u] = kh + (int64_t)idx[i + u] * D;
        vf acc[KB][G];
        for (int u = 0; u < KB; ++u)
            for (int q = 0; q < G; ++q) acc[u][q] = simd::zero();
        for (int j = 0; j < nv; ++j)
            for (int u = 0; u < KB; ++u) {
                vf kv = ld(ks[u], j);
                for (int q = 0; q < G; ++q) acc[u][q] = simd::fma(qr[q][j], kv, acc[u][q]);
            }
        for (int q = 0; q < G; ++q) {
            float r[4];
            simd::hsum4(acc[0][q], acc[1][q], acc[2][q], acc[3][q], r);
            for (int u = 0; u < KB; ++u) sc[q * m + i + u] = r[u] * scale;
        }
    }
    for (; i < m; ++i) {             // the last keys, one at a time: the same chain and tree per key
        const float* ks = kh + (int64_t)idx[i] * D;
        vf acc[G];
        for (int q = 0; q < G; ++q) acc[q] = simd::zero();
        for (int j = 0; j < nv; ++j) {
            vf kv = ld(ks, j);
            for (int q = 0; q < G; ++q) acc[q] = simd::fma(qr[q][j], kv, acc[q]);
        }
        for (int q = 0; q < G; ++q) sc[q * m + i] = simd::hsum(acc[q]) * scale;
    }
    float inv[G];
    for (int q = 0; q < G; ++q) {
        float* sq = sc + q * m;
        float mx = -INFINITY;   // a max is exact in any order
        int64_t t = 0;
        if (m >= L) {
            vf mv = simd::load(sq);
            for (t = L; t + L <= m; t += L) mv = simd::max(mv, simd::load(sq + t));
            mx = simd::hmax(mv);
        }
        for (; t < m; ++t) mx = sq[t] > mx ? sq[t] : mx;
        const vf mxv = simd::set1(mx);
        for (t = 0; t < m; t += L) {
            int w = (int)(m - t < L ? m - t : L);
            simd::store_n(sq + t, vexp(simd::sub(simd::load_n(sq + t, w), mxv)), w);
        }
        // the denominator in 4 partial sums by visible index (t % 4), fixed by the key sequence alone
        float p0 = 0.0f, p1 = 0.0f, p2 = 0.0f, p3 = 0.0f;
        for (t = 0; t + 4 <= m; t += 4) p0 += sq[t], p1 += sq[t + 1], p2 += sq[t + 2], p3 += sq[t + 3];
        if (t < m) p0 += sq[t];
        if (t + 1 < m) p1 += sq[t + 1];
        if (t + 2 < m) p2 += sq[t + 2];
        inv[q] = 1.0f / ((p0 + p1) + (p2 + p3));
    }
    // weighted sum of the values over the visible keys in slot order, JC output vectors at a time
    int j0 = 0;
    for (; j0 + JC <= nv; j0 += JC) weighted_sum<G, JC, NV>(vh, D, idx, m, sc, inv, j0, outs);
    if constexpr (NV == 0 || NV % JC != 0)
        for (; j0 < nv; ++j0) weighted_sum<G, 1, NV>(vh, D, idx, m, sc, inv, j0, outs);
}

typedef void (*group_fn)(const float* const*, const float*, const float*, int64_t, const int32_t*, int64_t, float,
                         float*, float* const*);

extern "C" {

int rows_attention(const float* q, int64_t q_row, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const float* k,
                   const float* v, int64_t kv_head, int64_t S, const uint8_t* mask, int64_t mask_row, float* out,
                   int nthreads) {
    if (D > 256 || D < 1 || Hq % Hkv) return -1;
    const int64_t G = Hq / Hkv;
    // groups of up to 4 heads per pass (registers); larger groups take several passes
    const int64_t gb = G % 4 == 0 ? 4 : G % 3 == 0 ? 3 : G % 2 == 0 ? 2 : 1;
#define GROUPS(NV) {nullptr, attend_group<1, NV>, attend_group<2, NV>, attend_group<3, NV>, attend_group<4, NV>}
    static const group_fn any_d[5] = GROUPS(0), d64[5] = GROUPS(64 / L), d128[5] = GROUPS(128 / L);
#undef GROUPS
    const group_fn* fns = D == 64 ? d64 : D == 128 ? d128 : any_d;
    const float scale = 1.0f / sqrtf((float)D);
    const int64_t passes = G / gb, items = Hkv * passes * T;
    // the visible slots of every row, in order, listed once per call (every kv head's pass reads them)
    static thread_local std::vector<int32_t> idx_all;
    static thread_local std::vector<int64_t> m_all;
    const size_t need = (size_t)(S > 0 ? S : 1);
    if (idx_all.size() < (size_t)T * need) idx_all.resize((size_t)T * need);
    if (m_all.size() < (size_t)T) m_all.resize((size_t)T);
    int32_t* idx_rows = idx_all.data();
    int64_t* ms = m_all.data();
    for (int64_t t = 0; t < T; ++t) {
        const uint8_t* mr = mask ? mask + t * mask_row : nullptr;
        int32_t* idx = idx_rows + t * need;
        int64_t m = 0;
        for (int64_t s = 0; s < S;) {
            // a batch's row opens one region of many: skip closed slots 64, then 8 at a time
            if (mr && s + 64 <= S) {
                uint64_t w[8], any = 0;
                memcpy(w, mr + s, 64);
                for (int j = 0; j < 8; ++j) any |= w[j];
                if (!any) { s += 64; continue; }
            }
            uint64_t w;
            if (mr && s + 8 <= S && (memcpy(&w, mr + s, 8), w == 0)) { s += 8; continue; }
            if (!mr || mr[s]) idx[m++] = (int32_t)s;
            ++s;
        }
        ms[t] = m;
    }
    // kv-head-major: a thread's items share one kv head's keys and values (read from memory once per thread, not
    // once per row), every row of it in turn
    #pragma omp parallel num_threads(nthreads) if (nthreads > 1 && items > 1)
    {
        // per-thread scratch kept across calls: sized by the mask's width (all regions of a batch), so zero-filling
        // fresh vectors cost more than the attention itself at 16 regions of 4096 slots
        static thread_local std::vector<float> sc_buf;
        if (sc_buf.size() < (size_t)gb * need) sc_buf.resize((size_t)gb * need);
        float* sc = sc_buf.data();
        #pragma omp for schedule(static)
        for (int64_t it = 0; it < items; ++it) {
            const int64_t t = it % T, gp = it / T, g = gp / passes, h0 = g * G + (gp % passes) * gb;
            const int64_t m = ms[t];
            const float* qs[4];
            float* outs[4];
            for (int64_t u = 0; u < gb; ++u) {
                qs[u] = q + t * q_row + (h0 + u) * D;
                outs[u] = out + t * Hq * D + (h0 + u) * D;
            }
            if (m == 0) {   // no visible key: zeros (SDPA would give NaN; callers never ask for this)
                for (int64_t u = 0; u < gb; ++u) memset(outs[u], 0, D * sizeof(float));
                continue;
            }
            fns[gb](qs, k + g * kv_head, v + g * kv_head, D, idx_rows + t * need, m, scale, sc, outs);
        }
    }
    return 0;
}

}  // extern "C"

// ---- a whole stack of decoder layers in one call ---------------------------------------------------------------
// What Python would otherwise do per layer (8 kernel calls, their tensors and ctypes crossings: ~0.2 ms a layer,
// a third of a 135M model's decode step on a 2-core CPU), done here with the same kernels in the same order, so the
// bits are those of the per-layer path.

struct RowLinear {         // a packed linear (see rows_gemm_pack) and the register tile for this call's row count
    const void* p;         // float panels, or uint16_t (bf16) panels when fmt != 0
    const float* bias;     // may be null
    int64_t nb, rb, out, in, fmt;   // fmt 0: fp32 (rows_gemm_f32), 1: bf16 weights (rows_gemm_bf16), 2: bf16 inputs too
                                    // (rows_gemm_bf16a)
};

struct RowLayer {          // one Llama-family decoder layer (no q/k norm)
    const float* in_norm;
    const float* post_norm;
    RowLinear qkv, o, gate_up, down;
};

extern "C" {

// h [T, H] is updated in place through layers 0..nl-1. k/v caches: layer l, kv head g, slot s at
// kc + l*layer_stride + g*kv_head + s*D. aux: nl+1 pointers, aux[i] (if not null) receives h entering layer i
// (aux[nl]: leaving the last). Returns 0, or the first kernel's error code.
int rows_layers(int64_t nl, const RowLayer* layers, float* h, int64_t T, int64_t H, int64_t Hq, int64_t Hkv,
                int64_t D, int64_t inter, float eps, const float* cos, const float* sin, const int64_t* slots,
                float* kc, float* vc, int64_t layer_stride, int64_t kv_head, int64_t max_len, int64_t S,
                const uint8_t* mask, int64_t mask_row, float* const* aux, int nthreads) {
    std::vector<float> x((size_t)(T * H)), qkv((size_t)(T * (Hq + 2 * Hkv) * D)), att((size_t)(T * Hq * D)),
        o((size_t)(T * H)), gu((size_t)(T * 2 * inter)), act((size_t)(T * inter)), hn((size_t)(T * H));
    auto lin = [&](const RowLinear& w, const float* in, float* out) {
        if (w.fmt == 2)
            return rows_gemm_bf16a(in, T, (const uint16_t*)w.p, w.nb, w.out, w.in, w.bias, out, nthreads, (int)w.rb);
        return w.fmt ? rows_gemm_bf16(in, T, (const uint16_t*)w.p, w.nb, w.out, w.in, w.bias, out, nthreads, (int)w.rb)
                     : rows_gemm_f32(in, T, (const float*)w.p, w.nb, w.out, w.in, w.bias, out, nthreads, (int)w.rb);
    };
    for (int64_t l = 0; l < nl; ++l) {
        const RowLayer& w = layers[l];
        if (aux && aux[l]) memcpy(aux[l], h, (size_t)(T * H) * sizeof(float));
        rows_rmsnorm(h, nullptr, T, H, w.in_norm, eps, nullptr, x.data());
        int rc = lin(w.qkv, x.data(), qkv.data());
        if (!rc) rc = rows_rope_attention(qkv.data(), T, Hq, Hkv, D, cos, sin, slots, kc + l * layer_stride,
                                          vc + l * layer_stride, kv_head, max_len, S, mask, mask_row, att.data(),
                                          nthreads);
        if (!rc) rc = lin(w.o, att.data(), o.data());
        if (rc) return rc;
        rows_rmsnorm(h, o.data(), T, H, w.post_norm, eps, hn.data(), x.data());   // h + attn, and its norm
        if ((rc = lin(w.gate_up, x.data(), gu.data()))) return rc;
        rows_silu_mul(gu.data(), T, inter, act.data());
        if ((rc = lin(w.down, act.data(), o.data()))) return rc;
        for (int64_t i = 0; i < T * H; ++i) h[i] = hn[i] + o[i];                    // the MLP's residual add
    }
    if (aux && aux[nl]) memcpy(aux[nl], h, (size_t)(T * H) * sizeof(float));
    return 0;
}

}  // extern "C"
