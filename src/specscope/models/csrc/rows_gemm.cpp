// The row-invariant CPU kernels of a decode / verify / tree-drafting forward (fp32, and bf16 linears): the linear,
// RMSNorm (with the residual add fused), SiLU-gate, and rotary embedding + KV-cache write + attention. One design,
// written once over the vector operations of simd.h and built per instruction set (AVX-512 with or without
// AVX512_BF16, AVX2+FMA, NEON) by models/rowgemm.py
// (no torch headers; called through ctypes). Threads: pool.h's pool, whose chunks are claimed rather than assigned,
// so a thread preempted by another process costs its chunk, not the step (OpenMP's barriers waited for it); a
// whole stack of layers (rows_layers) runs as one pool program that whichever of our threads is running carries
// forward, so beside busy processes the step moves while either thread has a core.
//
// Linear, memory-bound design: W is packed once into column panels of NB = V*L outputs, [out/NB][in][NB], so each
// panel is one sequential stream; a panel is read from DRAM once and applied to every activation row (the rows are
// tiny and stay in L1/L2), so 8 rows cost about what 1 row costs until the FMAs catch up. Outputs sit in vector
// lanes (x[r, k] is broadcast), so there is no horizontal reduction at all.
// Row-invariant: y[r, o] is always bias[o] + x[r,0]W[o,0] + x[r,1]W[o,1] + ... as one FMA chain in k order,
// whatever n or the row chunking are, so decode (1 row) and verify (n rows) give bit-identical results. Every
// other kernel here computes a row from that row's data alone, in an order fixed by the shapes, for the same reason.
#include "pool.h"
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

// A linear's panels [b0, b1) as a pool job (pool.h Job): their outputs, columns
// [b0*NB, min(b1*NB, out)) of every row, go to y, or to scratch laid out [n][those columns] and copied later. The
// tile writes the same bits wherever it writes them.
struct PanelOut {
    float* y;
    int64_t n, out, NB;
    int64_t cols(int64_t b0, int64_t b1) const { return (b1 * NB < out ? b1 * NB : out) - b0 * NB; }
    size_t scratch(int64_t b0, int64_t b1) const { return (size_t)(n * cols(b0, b1)); }
    // where panel b's row 0 goes, and the stride between rows
    float* at(int64_t b0, int64_t b1, int64_t b, float* to, int64_t& ld) const {
        ld = to ? cols(b0, b1) : out;
        return (to ? to : y + b0 * NB) + (b - b0) * NB;
    }
    void commit(int64_t b0, int64_t b1, const float* from) const {
        const int64_t w = cols(b0, b1);
        for (int64_t r = 0; r < n; ++r) memcpy(y + r * out + b0 * NB, from + r * w, (size_t)w * sizeof(float));
    }
    // tile(b, valid outputs, bias or null, where row 0 goes, row stride) for each panel b of [b0, b1)
    template <typename Tile>
    void each_panel(int64_t b0, int64_t b1, const float* bias, float* to, const Tile& tile) const {
        for (int64_t b = b0; b < b1; ++b) {
            int64_t left = out - b * NB, ld;
            float* yb = at(b0, b1, b, to, ld);
            tile(b, left < NB ? (int)left : (int)NB, bias ? bias + b * NB : nullptr, yb, ld);
        }
    }
};

// a linear's chunk of panels: RB rows at a time by Tiles::full, the rest by Tiles::rest; x holds k values per row
// and a panel NB*k weights (fp32 rows: k = in; bf16 k-pair rows: k = 2*ceil(in/2))
template <typename Tiles, int RB>
struct GemmJob : PanelOut {
    const typename Tiles::X* x;
    const typename Tiles::W* p;
    const float* bias;
    int64_t k;
    void compute(int64_t b0, int64_t b1, float* to) const {
        each_panel(b0, b1, bias, to, [&](int64_t b, int valid, const float* bb, float* yb, int64_t ld) {
            const typename Tiles::W* pb = p + b * NB * k;
            int64_t r = 0;
            for (; r + RB <= n; r += RB) Tiles::full(x + r * k, k, pb, bb, valid, yb + r * ld, ld);
            Tiles::rest(n - r, x + r * k, k, pb, bb, valid, yb + r * ld, ld);
        });
    }
};

// fp32 rows on fp32 or bf16 panels (tile / tail above)
template <int V, int RB, typename WT>
struct FloatTiles {
    using X = float;
    using W = WT;
    static void full(const float* x, int64_t in, const WT* p, const float* b, int valid, float* y, int64_t ld) {
        tile<V, RB>(x, in, p, b, valid, y, ld);
    }
    static void rest(int64_t rem, const float* x, int64_t in, const WT* p, const float* b, int valid, float* y,
                     int64_t ld) {
        tail<V, RB - 1, WT>(rem, x, in, p, b, valid, y, ld);
    }
};

// panel width nb and register tile rb (tuned; results identical) pick the instantiation, handed to `sink` (pool.h
// Now: run it; Later: a program's stage); -1 if not built
template <typename WT, typename Sink>
static int gemm_dispatch(const float* x, int64_t n, const WT* p, int64_t nb, int64_t out, int64_t in,
                         const float* bias, float* y, int rb, const Sink& sink) {
#define CASE(V_, RB_)                                                                        \
    if (nb == (V_) * L && rb == (RB_)) {                                                     \
        sink(GemmJob<FloatTiles<V_, RB_, WT>, RB_>{{y, n, out, (V_) * L}, x, p, bias, in}, (out + nb - 1) / nb); \
        return 0;                                                                            \
    }
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

// bf16 k-pair rows on k-pair panels (tile_dp / tail_dp above; they count k in pairs)
template <int V, int RB>
struct PairTiles {
    using X = uint16_t;
    using W = uint16_t;
    static void full(const uint16_t* x, int64_t k, const uint16_t* p, const float* b, int valid, float* y, int64_t ld) {
        tile_dp<V, RB>(x, k / 2, p, b, valid, y, ld);
    }
    static void rest(int64_t rem, const uint16_t* x, int64_t k, const uint16_t* p, const float* b, int valid, float* y,
                     int64_t ld) {
        tail_dp<V, RB - 1>(rem, x, k / 2, p, b, valid, y, ld);
    }
};

template <typename Sink>
static int dp_dispatch(const uint16_t* x, int64_t n, const uint16_t* p, int64_t nb, int64_t out, int64_t kp,
                       const float* bias, float* y, int rb, const Sink& sink) {
#define CASE(V_, RB_)                                                                         \
    if (nb == (V_) * L && rb == (RB_)) {                                                      \
        sink(GemmJob<PairTiles<V_, RB_>, RB_>{{y, n, out, (V_) * L}, x, p, bias, 2 * kp}, (out + nb - 1) / nb); \
        return 0;                                                                             \
    }
    TILES(CASE)
#undef CASE
    return -1;
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

// a bf16-input linear's rows, rounded to bf16 once: as k pairs (vdpbf16ps builds) or as fp32 values of bf16
#if defined(SPECSCOPE_DPBF16)
using bf16a_elem = uint16_t;
static size_t bf16a_size(int64_t n, int64_t in) { return (size_t)(2 * n * ((in + 1) / 2)); }
#else
using bf16a_elem = float;
static size_t bf16a_size(int64_t n, int64_t in) { return (size_t)(n * in); }
#endif

// y = bf16(x) W^T + bias (W packed by rows_gemm_pack_bf16a): x's rows rounded into `buf` (bf16a_size elements),
// the linear handed to `sink`
template <typename Sink>
static int bf16a_dispatch(const float* x, int64_t n, const uint16_t* p, int64_t nb, int64_t out, int64_t in,
                          const float* bias, float* y, int rb, bf16a_elem* buf, const Sink& sink) {
#if defined(SPECSCOPE_DPBF16)
    const int64_t kp = (in + 1) / 2;   // a row's bf16 values in k order are its k pairs (low half: even k)
    rows_to_bf16(x, n, in, 2 * kp, buf);
    return dp_dispatch(buf, n, p, nb, out, kp, bias, y, rb, sink);
#else
    for (int64_t i = 0; i < n * in; ++i) {   // the bf16 values, as fp32
        uint32_t u = (uint32_t)to_bf16(x[i]) << 16;
        memcpy(buf + i, &u, 4);
    }
    return gemm_dispatch((const float*)buf, n, p, nb, out, in, bias, y, rb, sink);
#endif
}

extern "C" {

int rows_gemm_abi() { return 12; }

// program chunks computed again because their holder was late, in this process's pool (pool.h; tests: the path ran)
uint64_t rows_pool_redone() { return pool::redone(); }

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
    return gemm_dispatch(x, n, p, nb, out, in, bias, y, rb, pool::Now{nthreads});
}

int rows_gemm_bf16(const float* x, int64_t n, const uint16_t* p, int64_t nb, int64_t out, int64_t in,
                   const float* bias, float* y, int nthreads, int rb) {
    return gemm_dispatch(x, n, p, nb, out, in, bias, y, rb, pool::Now{nthreads});
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
    // the rows rounded into a buffer kept per thread (a fresh one cost as much as a small linear); one grown past
    // 64 MB by a long prefill is given back after the call
    static thread_local std::vector<bf16a_elem> buf;
    if (buf.size() < bf16a_size(n, in)) buf.resize(bf16a_size(n, in));
    const int rc = bf16a_dispatch(x, n, p, nb, out, in, bias, y, rb, buf.data(), pool::Now{nthreads});
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
// q: row t, head h at q + t*q_row + h*D. k/v: kv head g, slot s at k + g*kv_head + s*D elements: fp32
// (kv_fmt 0) or bf16 (kv_fmt 1, the bf16 precision's cache). mask: [T, S] bytes (row stride mask_row; null =
// every slot). out: [T, Hq*D].
// Row-invariant and slot-order-exact: a row's result depends only on its own query and the keys it may see,
// accumulated in slot order (masked slots are skipped, not added as zeros), so a verify row equals the decode step
// that sees the same keys in the same order.
int rows_attention(const float* q, int64_t q_row, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const void* k,
                   const void* v, int64_t kv_fmt, int64_t kv_head, int64_t S, const uint8_t* mask, int64_t mask_row,
                   float* out, int nthreads);

// Rotary embedding + KV-cache write + attention for one layer, from the fused qkv projection [T, (Hq+2Hkv)*D]:
// k heads are rotated and written with v at `slots` (rounded to bf16 for a bf16 cache), q heads rotated, then
// rows_attention over slots 0..S-1. cos/sin: [T, D] rows for the tokens' positions (HF layout: rotate_half pairs i
// with i + D/2). Slots outside the cache are refused (-3) before anything is written.
int rows_rope_attention(const float* qkv, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const float* cos,
                        const float* sin, const int64_t* slots, void* kc, void* vc, int64_t kv_fmt, int64_t kv_head,
                        int64_t max_len, int64_t S, const uint8_t* mask, int64_t mask_row, float* out, int nthreads);

}  // extern "C"

// the checks of rows_rope_attention, before anything is written: 0, or its error code
static int rope_check(int64_t T, int64_t D, const int64_t* slots, int64_t max_len, int64_t S) {
    if (D % 2 || D > 256) return -1;
    if (S > max_len) return -2;
    for (int64_t t = 0; t < T; ++t)
        if (slots[t] < 0 || slots[t] >= max_len) return -3;
    return 0;
}

// k heads rotated and written with v at `slots` (bf16 for a bf16 cache), q heads rotated into qr [T, Hq*D]
static void rope_write(const float* qkv, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const float* cos,
                       const float* sin, const int64_t* slots, void* kc, void* vc, int64_t kv_fmt, int64_t kv_head,
                       float* qr) {
    const int64_t H = Hq + 2 * Hkv, half = D / 2;
    float kr[256];
    for (int64_t t = 0; t < T; ++t) {
        const float* row = qkv + t * H * D;
        const float* c = cos + t * D;
        const float* sn = sin + t * D;
        for (int64_t h = 0; h < Hq + Hkv; ++h) {
            const float* x = row + h * D;
            const int64_t at = (h - Hq) * kv_head + slots[t] * D;
            float* o = h < Hq ? &qr[(t * Hq + h) * D] : kv_fmt ? kr : (float*)kc + at;
            for (int64_t i = 0; i < half; ++i) {
                float a = x[i] * c[i], b = x[i + half] * sn[i];
                o[i] = a - b;
                float a2 = x[i + half] * c[i + half], b2 = x[i] * sn[i + half];
                o[i + half] = a2 + b2;
            }
            if (h >= Hq && kv_fmt) rows_to_bf16(kr, 1, D, D, (uint16_t*)kc + at);
        }
        for (int64_t g = 0; g < Hkv; ++g) {
            const float* x = row + (Hq + Hkv + g) * D;
            const int64_t at = g * kv_head + slots[t] * D;
            if (kv_fmt) rows_to_bf16(x, 1, D, D, (uint16_t*)vc + at);
            else memcpy((float*)vc + at, x, D * sizeof(float));
        }
    }
}

extern "C" {

int rows_rope_attention(const float* qkv, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const float* cos,
                        const float* sin, const int64_t* slots, void* kc, void* vc, int64_t kv_fmt, int64_t kv_head,
                        int64_t max_len, int64_t S, const uint8_t* mask, int64_t mask_row, float* out, int nthreads) {
    if (int rc = rope_check(T, D, slots, max_len, S)) return rc;
    std::vector<float> qr((size_t)(T * Hq * D));
    rope_write(qkv, T, Hq, Hkv, D, cos, sin, slots, kc, vc, kv_fmt, kv_head, qr.data());
    return rows_attention(qr.data(), Hq * D, T, Hq, Hkv, D, kc, vc, kv_fmt, kv_head, S, mask, mask_row, out,
                          nthreads);
}

}  // extern "C"

constexpr int MAXV = 256 / L;   // head_dim <= 256

// out[q][j0*L .. (j0+W)*L) = sum over visible keys t (slot order) of p[q][t] * v[t], times inv[q]: W*G independent
// FMA chains, W fixed at compile time so they stay in registers. KT: fp32 values, or bf16 widened exactly.
template <int G, int W, int NV, typename KT>
static inline void weighted_sum(const KT* vh, int64_t D, const int32_t* idx, int64_t m, const float* sc,
                                const float* inv, int j0, float* const* outs) {
    vf acc[G][W];
    for (int q = 0; q < G; ++q)
        for (int w = 0; w < W; ++w) acc[q][w] = simd::zero();
    for (int64_t t = 0; t < m; ++t) {
        const KT* vs = vh + (int64_t)idx[t] * D + j0 * L;
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

static const float ONES[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};

// scores -> unnormalised probabilities in place (exp of score - max) and each head's 1 / sum, for G heads of m
// visible keys: every step's order fixed by the key sequence alone
template <int G>
static inline void softmax_rows(float* sc, int64_t m, float* inv) {
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
        // the denominator in L partial sums by visible index (t % L, the tail's missing lanes adding +0), then the
        // fixed hsum tree: fixed by the key sequence alone
        vf den = simd::zero();
        for (t = 0; t < m; t += L) {
            int w = (int)(m - t < L ? m - t : L);
            vf e = vexp(simd::sub(simd::load_n(sq + t, w), mxv));
            if (w < L) e = simd::mul(e, simd::load_n(ONES, w));   // lanes past m: exp(0 - mx) times 0
            simd::store_n(sq + t, e, w);
            den = simd::add(den, e);
        }
        inv[q] = 1.0f / simd::hsum(den);
    }
}

// The G query heads that share one kv head, for one row: every key and value row is read once for all G (the
// cache lives in L2, whose bandwidth is what attention on a CPU runs into). NV > 0: head_dim = NV * L, known at
// compile time (the common 64 / 128, fully unrolled); NV == 0: any head_dim up to 256. KT: fp32 cache, or a bf16
// one widened exactly in registers (ISAs without vdpbf16ps, or head_dim not 64 / 128).
// Speed comes from independent chains: KB keys x G heads of dot products at once, and JC output vectors x G heads
// in the weighted sum, so the FMAs pipeline instead of waiting on one accumulator. Exactness does not depend on
// that blocking: a score is always the FMA chain over its head_dim in order, then one fixed hsum tree; an output
// lane always the FMA chain over the visible keys in slot order.
template <int G, int NV, typename KT>
static void attend_group(const float* const* qs, const KT* kh, const KT* vh, int64_t D, const int32_t* idx,
                         int64_t m, float scale, float* sc, float* const* outs) {
    // KB = 4 for simd::hsum4; G * JC accumulators + a broadcast + JC loads fit the register file (AVX2: 16, else
    // 32), so the weighted sum takes a 64-wide head (4 AVX-512 vectors) in one pass of G * 4 chains
    constexpr int KB = 4, JC = L == 8 && G > 2 ? 3 : 4;
    const int nv = NV ? NV : (int)((D + L - 1) / L);
    auto ld = [&](auto p, int j) {   // a query (fp32) or a cached key (KT) vector
        return NV ? simd::load(p + j * L) : simd::load_n(p + j * L, (int)(D - j * L));
    };
    vf qr[G][NV ? NV : MAXV];
    for (int q = 0; q < G; ++q)
        for (int j = 0; j < nv; ++j) qr[q][j] = ld(qs[q], j);
    int64_t i = 0;
    for (; i + KB <= m; i += KB) {   // scores, KB keys at a time
        const KT* ks[KB];
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
        const KT* ks = kh + (int64_t)idx[i] * D;
        vf acc[G];
        for (int q = 0; q < G; ++q) acc[q] = simd::zero();
        for (int j = 0; j < nv; ++j) {
            vf kv = ld(ks, j);
            for (int q = 0; q < G; ++q) acc[q] = simd::fma(qr[q][j], kv, acc[q]);
        }
        for (int q = 0; q < G; ++q) sc[q * m + i] = simd::hsum(acc[q]) * scale;
    }
    float inv[G];
    softmax_rows<G>(sc, m, inv);
    // weighted sum of the values over the visible keys in slot order, JC output vectors at a time
    int j0 = 0;
    for (; j0 + JC <= nv; j0 += JC) weighted_sum<G, JC, NV, KT>(vh, D, idx, m, sc, inv, j0, outs);
    if constexpr (NV == 0 || NV % JC != 0)
        for (; j0 < nv; ++j0) weighted_sum<G, 1, NV, KT>(vh, D, idx, m, sc, inv, j0, outs);
}

#if defined(SPECSCOPE_DPBF16)
// r[j] <- column j of the 16 x 16 matrix of 32-bit elements whose rows are r[0..15]
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {   // r[4i + e], 128-bit lane L: element 4L + e of rows 4i .. 4i + 3
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int e = 0; e < 4; ++e) {
        __m512i a = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x44), b = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x44);
        __m512i c = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xEE), d = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xEE);
        t[e] = _mm512_shuffle_i32x4(a, b, 0x88);
        t[4 + e] = _mm512_shuffle_i32x4(a, b, 0xDD);
        t[8 + e] = _mm512_shuffle_i32x4(c, d, 0x88);
        t[12 + e] = _mm512_shuffle_i32x4(c, d, 0xDD);
    }
    for (int j = 0; j < 16; ++j) r[j] = t[j];
}

static inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// The keys of 16 slots (block b: slots 16b .. 16b + 15, those past S standing in as 16b) transposed as k pairs
// (32-bit): kt[(c * 16 + j) * 16 + lane] = pair 16c + j of slot 16b + lane, so one vdpbf16ps adds one pair of 16
// keys' dot products. Done once per call for every row's keys (a verify's rows share the context's).
template <int ND>
static void transpose_keys(const uint16_t* kh, int64_t D, int64_t b, int64_t S, uint32_t* kt) {
    const uint16_t* rows[16];
    for (int u = 0; u < 16; ++u) rows[u] = kh + (16 * b + u < S ? 16 * b + u : 16 * b) * D;
    for (int c = 0; c < ND; ++c) {
        __m512i r[16];
        for (int u = 0; u < 16; ++u) r[u] = _mm512_loadu_si512((const void*)(rows[u] + 32 * c));
        transpose16(r);
        for (int j = 0; j < 16; ++j) _mm512_storeu_si512((void*)(kt + (c * 16 + j) * 16), r[j]);
    }
}

// A bf16 cache with vdpbf16ps (head_dim 32 * ND): the query and the probabilities are rounded to bf16 (vcvtneps2bf16:
// nearest even, denormals as zero), products are exact and sums fp32, as a bf16 engine computes attention.
// Scores with keys in lanes, from the transposed blocks (kt, the block of slot s at kt + pos[s / 16] * 256 * ND):
// four chains over the pairs (j % 4) summed (c0 + c1) + (c2 + c3), no horizontal sums, and a score depends on its
// query and key alone (a block's other slots, visible or not, never enter it).
// Weighted sum over pairs of visible keys (visible index 2i, 2i+1, the last alone with a zero partner): their value
// rows interleaved 16 bits at a time, so one vdpbf16ps adds both keys' products for 16 outputs, one chain per
// output lane in visible order. The pairing follows the visible sequence, so a verify row still equals the decode
// step that sees the same keys in the same order.
template <int G, int ND>
static void attend_group_dp(const float* const* qs, const uint32_t* kt, const int32_t* pos, const uint16_t* vh,
                            int64_t D, const int32_t* idx, int64_t m, float scale, float* sc, uint32_t* pp,
                            float* const* outs) {
    constexpr int NP = 16 * ND;   // k pairs per head
    uint32_t qp[G][NP];           // each head's query as bf16 pairs (even d low): its bf16 values in order
    for (int q = 0; q < G; ++q)
        for (int j = 0; j < 2 * ND; ++j)
            _mm256_storeu_si256((__m256i*)&qp[q][8 * j], (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(qs[q] + 16 * j)));
    for (int64_t i = 0; i < m;) {   // the visible keys block by block (slot order: a block's are consecutive)
        const int64_t b = idx[i] >> 4;
        int64_t e = i;
        uint32_t lanes = 0;   // the block's visible slots
        for (; e < m && (idx[e] >> 4) == b; ++e) lanes |= 1u << (idx[e] & 15);
        const uint32_t* kb = kt + (int64_t)pos[b] * 256 * ND;
        vf acc[G][4];
        for (int q = 0; q < G; ++q)
            for (int c = 0; c < 4; ++c) acc[q][c] = simd::zero();
        for (int c = 0; c < ND; ++c)
            for (int j = 0; j < 16; ++j) {
                __m512bh kv = as_bh(_mm512_loadu_si512((const void*)(kb + (c * 16 + j) * 16)));
                for (int q = 0; q < G; ++q)
                    acc[q][j & 3] = _mm512_dpbf16_ps(acc[q][j & 3], kv,
                                                     as_bh(_mm512_set1_epi32((int)qp[q][16 * c + j])));
            }
        for (int q = 0; q < G; ++q) {   // the visible lanes, in slot order, to visible indices i .. e - 1
            const vf r = simd::mul(simd::add(simd::add(acc[q][0], acc[q][1]), simd::add(acc[q][2], acc[q][3])),
                                   simd::set1(scale));
            simd::store_n(sc + q * m + i, lanes == 0xFFFFu ? r : _mm512_maskz_compress_ps((__mmask16)lanes, r),
                          (int)(e - i));
        }
        i = e;
    }
    float inv[G];
    softmax_rows<G>(sc, m, inv);
    // the probabilities as bf16 pairs (visible index 2i low, 2i + 1 high; an odd last one with 0): each head's
    // bf16 values in order, zero-padded to a whole vector
    const int64_t mp = (m + 1) / 2, mp16 = (mp + 15) / 16 * 16;
    for (int q = 0; q < G; ++q) {
        const float* sq = sc + q * m;
        uint16_t* ph = (uint16_t*)(pp + q * mp16);
        for (int64_t t = 0; t < 2 * mp16; t += 16) {
            const int w = (int)(m - t < 16 ? (m - t > 0 ? m - t : 0) : 16);
            _mm256_storeu_si256((__m256i*)(ph + t), (__m256i)_mm512_cvtneps_pbh(simd::load_n(sq + t, w)));
        }
    }
    vf acc[G][2 * ND];
    for (int q = 0; q < G; ++q)
        for (int c = 0; c < 2 * ND; ++c) acc[q][c] = simd::zero();
    for (int64_t i = 0; i < mp; ++i) {
        const uint16_t* a = vh + (int64_t)idx[2 * i] * D;
        const uint16_t* b = 2 * i + 1 < m ? vh + (int64_t)idx[2 * i + 1] * D : nullptr;
        __m512i lo[ND], hi[ND];   // lo[c], 128-bit lane L, element e: the pair for output 32c + 8L + e; hi: + 4
        for (int c = 0; c < ND; ++c) {
            __m512i va = _mm512_loadu_si512((const void*)(a + 32 * c));
            __m512i vb = b ? _mm512_loadu_si512((const void*)(b + 32 * c)) : _mm512_setzero_si512();
            lo[c] = _mm512_unpacklo_epi16(va, vb);
            hi[c] = _mm512_unpackhi_epi16(va, vb);
        }
        for (int q = 0; q < G; ++q) {
            __m512bh pv = as_bh(_mm512_set1_epi32((int)pp[q * mp16 + i]));
            for (int c = 0; c < ND; ++c) {
                acc[q][2 * c] = _mm512_dpbf16_ps(acc[q][2 * c], as_bh(lo[c]), pv);
                acc[q][2 * c + 1] = _mm512_dpbf16_ps(acc[q][2 * c + 1], as_bh(hi[c]), pv);
            }
        }
    }
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int q = 0; q < G; ++q) {
        const vf s = simd::set1(inv[q]);
        for (int c = 0; c < ND; ++c) {
            simd::store(outs[q] + 32 * c,
                        simd::mul(_mm512_permutex2var_ps(acc[q][2 * c], first, acc[q][2 * c + 1]), s));
            simd::store(outs[q] + 32 * c + 16,
                        simd::mul(_mm512_permutex2var_ps(acc[q][2 * c], second, acc[q][2 * c + 1]), s));
        }
    }
}
#endif

// one row's G heads of kv head g: its keys k (or their transposed blocks kt, pos), values v
typedef void (*group_fn)(const float* const*, const void*, const uint32_t*, const int32_t*, const void*, int64_t,
                         const int32_t*, int64_t, float, float*, uint32_t*, float* const*);

template <int G, int NV, typename KT>
static void group_any(const float* const* qs, const void* k, const uint32_t*, const int32_t*, const void* v,
                      int64_t D, const int32_t* idx, int64_t m, float scale, float* sc, uint32_t*,
                      float* const* outs) {
    attend_group<G, NV, KT>(qs, (const KT*)k, (const KT*)v, D, idx, m, scale, sc, outs);
}

#if defined(SPECSCOPE_DPBF16)
template <int G, int ND>
static void group_dp(const float* const* qs, const void*, const uint32_t* kt, const int32_t* pos, const void* v,
                     int64_t D, const int32_t* idx, int64_t m, float scale, float* sc, uint32_t* pp,
                     float* const* outs) {
    attend_group_dp<G, ND>(qs, kt, pos, (const uint16_t*)v, D, idx, m, scale, sc, pp, outs);
}
#endif

// 32-value chunks of a head when its attention runs on vdpbf16ps (a bf16 cache, head_dim 64 or 128, a build with
// it), else 0
static int64_t dp_chunks(int64_t D, int64_t kv_fmt) {
#if defined(SPECSCOPE_DPBF16)
    return kv_fmt && (D == 64 || D == 128) ? D / 32 : 0;
#else
    (void)D, (void)kv_fmt;
    return 0;
#endif
}

// the group kernel for (head_dim, cache format), indexed by heads per pass (1..4)
static const group_fn* group_fns(int64_t D, int64_t kv_fmt) {
#define GROUPS(NV, KT) {nullptr, group_any<1, NV, KT>, group_any<2, NV, KT>, group_any<3, NV, KT>, group_any<4, NV, KT>}
    static const group_fn any_d[5] = GROUPS(0, float), d64[5] = GROUPS(64 / L, float), d128[5] = GROUPS(128 / L, float);
    static const group_fn any_d16[5] = GROUPS(0, uint16_t), d64_16[5] = GROUPS(64 / L, uint16_t),
                          d128_16[5] = GROUPS(128 / L, uint16_t);
#undef GROUPS
#if defined(SPECSCOPE_DPBF16)
#define GROUPS(ND) {nullptr, group_dp<1, ND>, group_dp<2, ND>, group_dp<3, ND>, group_dp<4, ND>}
    static const group_fn dp2[5] = GROUPS(2), dp4[5] = GROUPS(4);
#undef GROUPS
    if (dp_chunks(D, kv_fmt)) return D == 64 ? dp2 : dp4;
#endif
    if (kv_fmt) return D == 64 ? d64_16 : D == 128 ? d128_16 : any_d16;
    return D == 64 ? d64 : D == 128 ? d128 : any_d;
}

// ---- attention in pieces a program can run: a plan (serial), then key transposes and rows (jobs) ---------------
// The plan: the visible slots of every row, in order, listed once per call (every kv head's pass reads them), and
// for the vdpbf16ps path every key block that holds a slot some row sees, numbered as met.
struct AttnPlan {
    std::vector<int32_t> idx, pos;
    std::vector<int64_t> m;
    std::vector<uint32_t> kt;   // the used key blocks, transposed (the transpose job writes them)
    int64_t need = 1, used = 0, nblk = 0, ND = 0;
};

static void attn_plan(AttnPlan& pl, int64_t T, int64_t Hkv, int64_t D, int64_t kv_fmt, int64_t S, const uint8_t* mask,
                      int64_t mask_row) {
    pl.need = S > 0 ? S : 1;
    if (pl.idx.size() < (size_t)(T * pl.need)) pl.idx.resize((size_t)(T * pl.need));
    if (pl.m.size() < (size_t)T) pl.m.resize((size_t)T);
    for (int64_t t = 0; t < T; ++t) {
        const uint8_t* mr = mask ? mask + t * mask_row : nullptr;
        int32_t* idx = pl.idx.data() + t * pl.need;
        int64_t m = 0;
        for (int64_t s = 0; s < S;) {
            // a batch's row opens one region of many: skip closed slots 64, then 8 at a time; a verify's row sees
            // most of its region: take open slots 64 at a time (bool bytes: all 1)
            if (s + 64 <= S) {
                uint64_t w[8], any = 0, all = ~0ull;
                if (mr) {
                    memcpy(w, mr + s, 64);
                    for (int j = 0; j < 8; ++j) any |= w[j], all &= w[j] == 0x0101010101010101ull ? ~0ull : 0ull;
                }
                if (mr && !any) { s += 64; continue; }
                if (all) {
                    for (int j = 0; j < 64; ++j) idx[m + j] = (int32_t)(s + j);
                    m += 64, s += 64;
                    continue;
                }
            }
            uint64_t w;
            if (mr && s + 8 <= S && (memcpy(&w, mr + s, 8), w == 0)) { s += 8; continue; }
            if (!mr || mr[s]) idx[m++] = (int32_t)s;
            ++s;
        }
        pl.m[t] = m;
    }
    pl.ND = dp_chunks(D, kv_fmt);
    pl.nblk = (S + 15) / 16;
    pl.used = 0;
    if (!pl.ND) return;
    if (pl.pos.size() < (size_t)pl.nblk) pl.pos.resize((size_t)pl.nblk);
    std::fill(pl.pos.begin(), pl.pos.begin() + pl.nblk, -1);
    for (int64_t t = 0; t < T; ++t) {
        const int32_t* idx = pl.idx.data() + t * pl.need;
        for (int64_t i = 0; i < pl.m[t];) {
            int32_t& p = pl.pos[idx[i] >> 4];
            if (p < 0) p = (int32_t)pl.used++;
            // a whole block of visible slots: on to the next
            i += (idx[i] & 15) == 0 && i + 15 < pl.m[t] && idx[i + 15] == idx[i] + 15 ? 16 : 1;
        }
    }
    if (pl.kt.size() < (size_t)(Hkv * pl.used * 256 * pl.ND)) pl.kt.resize((size_t)(Hkv * pl.used * 256 * pl.ND));
}

#if defined(SPECSCOPE_DPBF16)
// every kv head's used key blocks transposed (item: kv head g, block b), before any row reads them
struct TransposeJob {
    const uint16_t* k;
    uint32_t* kt;
    const int32_t* pos;
    int64_t nblk, used, ND, D, S, kv_head;
    size_t scratch(int64_t i0, int64_t i1) const { return (size_t)((i1 - i0) * 256 * ND); }
    uint32_t* dst(int64_t it) const { return kt + ((it / nblk) * used + pos[it % nblk]) * 256 * ND; }
    void compute(int64_t i0, int64_t i1, float* to) const {
        for (int64_t it = i0; it < i1; ++it) {
            const int64_t g = it / nblk, b = it % nblk;
            if (pos[b] < 0) continue;
            uint32_t* d = to ? (uint32_t*)to + (it - i0) * 256 * ND : dst(it);
            if (ND == 2) transpose_keys<2>(k + g * kv_head, D, b, S, d);
            else transpose_keys<4>(k + g * kv_head, D, b, S, d);
        }
    }
    void commit(int64_t i0, int64_t i1, const float* from) const {
        for (int64_t it = i0; it < i1; ++it)
            if (pos[it % nblk] >= 0)
                memcpy(dst(it), (const uint32_t*)from + (it - i0) * 256 * ND, (size_t)(256 * ND) * sizeof(uint32_t));
    }
};

// the key transposes plan pl asks of cache k (none off the vdpbf16ps path), handed to `sink`
template <typename Sink>
static void transposes(AttnPlan& pl, const void* k, int64_t Hkv, int64_t D, int64_t S, int64_t kv_head,
                       const Sink& sink) {
    if (pl.ND)
        sink(TransposeJob{(const uint16_t*)k, pl.kt.data(), pl.pos.data(), pl.nblk, pl.used, pl.ND, D, S, kv_head},
             Hkv * pl.nblk, 4);
}
#endif

// the rows (item: kv head, head pass, row), kv-head-major: a chunk of items shares one kv head's keys and values
// (read from memory once per chunk, not once per row), every row of it in turn
struct AttendJob {
    const float* q;
    const void* k;
    const void* v;
    const group_fn* fns;
    const uint32_t* kt;
    const int32_t* pos;
    const int32_t* idx;
    const int64_t* ms;
    float* out;
    int64_t q_row, T, Hq, D, G, gb, passes, kv_head, used, ND, need, es;
    float scale;
    size_t scratch(int64_t i0, int64_t i1) const { return (size_t)((i1 - i0) * gb * D); }
    float* row_out(int64_t it) const {
        const int64_t t = it % T, gp = it / T, h0 = (gp / passes) * G + (gp % passes) * gb;
        return out + t * Hq * D + h0 * D;
    }
    void compute(int64_t i0, int64_t i1, float* to) const {
        // per-thread scratch kept across calls: sized by the mask's width (all regions of a batch), so zero-filling
        // fresh vectors cost more than the attention itself at 16 regions of 4096 slots
        static thread_local std::vector<float> sc_buf;
        static thread_local std::vector<uint32_t> pp_buf;
        if (sc_buf.size() < (size_t)(gb * need)) sc_buf.resize((size_t)(gb * need));
        if (ND && pp_buf.size() < (size_t)(gb * (need / 2 + 16))) pp_buf.resize((size_t)(gb * (need / 2 + 16)));
        for (int64_t it = i0; it < i1; ++it) {
            const int64_t t = it % T, gp = it / T, g = gp / passes, h0 = g * G + (gp % passes) * gb;
            const int64_t m = ms[t];
            float* o = to ? to + (it - i0) * gb * D : row_out(it);
            const float* qs[4];
            float* outs[4];
            for (int64_t u = 0; u < gb; ++u) qs[u] = q + t * q_row + (h0 + u) * D, outs[u] = o + u * D;
            if (m == 0) {   // no visible key: zeros (SDPA would give NaN; callers never ask for this)
                memset(o, 0, (size_t)(gb * D) * sizeof(float));
                continue;
            }
            fns[gb](qs, (const char*)k + g * kv_head * es, kt + g * used * 256 * ND, pos,
                    (const char*)v + g * kv_head * es, D, idx + t * need, m, scale, sc_buf.data(), pp_buf.data(), outs);
        }
    }
    void commit(int64_t i0, int64_t i1, const float* from) const {
        for (int64_t it = i0; it < i1; ++it)
            memcpy(row_out(it), from + (it - i0) * gb * D, (size_t)(gb * D) * sizeof(float));
    }
};

static bool attention_ok(int64_t Hq, int64_t Hkv, int64_t D, int64_t kv_fmt) {
    return D <= 256 && D >= 1 && Hkv >= 1 && Hq % Hkv == 0 && kv_fmt >= 0 && kv_fmt <= 1;
}

// the rows' job over plan pl (groups of up to 4 heads per pass: registers; larger groups take several passes)
static AttendJob attend_job(const AttnPlan& pl, const float* q, int64_t q_row, int64_t T, int64_t Hq, int64_t Hkv,
                            int64_t D, const void* k, const void* v, int64_t kv_fmt, int64_t kv_head, float* out,
                            int64_t& items) {
    const int64_t G = Hq / Hkv, gb = G % 4 == 0 ? 4 : G % 3 == 0 ? 3 : G % 2 == 0 ? 2 : 1;
    items = Hkv * (G / gb) * T;
    return AttendJob{q, k, v, group_fns(D, kv_fmt), pl.kt.data(), pl.pos.data(), pl.idx.data(), pl.m.data(), out,
                     q_row, T, Hq, D, G, gb, G / gb, kv_head, pl.used, pl.ND, pl.need, kv_fmt ? 2 : 4,
                     1.0f / sqrtf((float)D)};
}

extern "C" {

int rows_attention(const float* q, int64_t q_row, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const void* k,
                   const void* v, int64_t kv_fmt, int64_t kv_head, int64_t S, const uint8_t* mask, int64_t mask_row,
                   float* out, int nthreads) {
    if (!attention_ok(Hq, Hkv, D, kv_fmt)) return -1;
    static thread_local AttnPlan pl;
    attn_plan(pl, T, Hkv, D, kv_fmt, S, mask, mask_row);
    const pool::Now now{nthreads};
#if defined(SPECSCOPE_DPBF16)
    transposes(pl, k, Hkv, D, S, kv_head, now);
#endif
    int64_t items;
    const AttendJob job = attend_job(pl, q, q_row, T, Hq, Hkv, D, k, v, kv_fmt, kv_head, out, items);
    now(job, items);
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

// rows_layers as a pool program (pool.h run_program): per layer seven stages, each a serial part (norms, rope and
// the cache write, SiLU, residual adds) run by whichever of our threads completed the stage before, and a job
enum { ST_NORM, ST_ROPE, ST_ATTEND, ST_O, ST_MLP_NORM, ST_DOWN, ST_RESIDUAL, STAGES };

struct LayersProg {
    int64_t nl;
    const RowLayer* layers;
    float* h;
    int64_t T, H, Hq, Hkv, D, inter;
    float eps;
    const float *cos, *sin;
    const int64_t* slots;
    void *kc, *vc;
    int64_t kv_fmt, layer_stride, kv_head, S;
    float* const* aux;
    int nthreads;
    float *x, *qkv, *qr, *att, *o, *gu, *act, *hn;
    bf16a_elem* conv;   // a bf16-input linear's rows, rounded
    AttnPlan* plan;   // its key blocks are rewritten per layer by the transposes
};

// a packed linear of `T` rows from `in` into `out`, handed to `sink`; -1 if its panel width / tile is not built
template <typename Sink>
static int lin_emit(const RowLinear& w, const float* in, int64_t T, float* out, bf16a_elem* conv, const Sink& sink) {
    if (w.fmt == 2)
        return bf16a_dispatch(in, T, (const uint16_t*)w.p, w.nb, w.out, w.in, w.bias, out, (int)w.rb, conv, sink);
    if (w.fmt == 1) return gemm_dispatch(in, T, (const uint16_t*)w.p, w.nb, w.out, w.in, w.bias, out, (int)w.rb, sink);
    return gemm_dispatch(in, T, (const float*)w.p, w.nb, w.out, w.in, w.bias, out, (int)w.rb, sink);
}

struct Probe {   // a sink that runs nothing: whether a linear's instantiation is built
    template <typename F>
    void operator()(const F&, int64_t, int64_t = 1) const {}
};

static bool lin_built(const RowLinear& w, int64_t T) {
    if (w.fmt == 2) {
#if defined(SPECSCOPE_DPBF16)
        return dp_dispatch(nullptr, T, (const uint16_t*)w.p, w.nb, w.out, (w.in + 1) / 2, w.bias, nullptr, (int)w.rb,
                           Probe{}) == 0;
#else
        return gemm_dispatch((const float*)nullptr, T, (const uint16_t*)w.p, w.nb, w.out, w.in, w.bias, nullptr,
                             (int)w.rb, Probe{}) == 0;
#endif
    }
    return lin_emit(w, nullptr, T, nullptr, nullptr, Probe{}) == 0;
}

static bool layers_stage(void* vp, int64_t s, pool::Job* job) {
    const LayersProg& P = *(const LayersProg*)vp;
    const int64_t T = P.T, l = s / STAGES;
    job->items = 0;
    if (l >= P.nl) {
        if (P.aux && P.aux[P.nl]) memcpy(P.aux[P.nl], P.h, (size_t)(T * P.H) * sizeof(float));
        return false;
    }
    const RowLayer& w = P.layers[l];
    const pool::Later later{job, P.nthreads};
    const int64_t at = l * P.layer_stride * (P.kv_fmt ? 2 : 4);   // bytes
    char *kc = (char*)P.kc + at, *vc = (char*)P.vc + at;
    switch (s % STAGES) {
        case ST_NORM:
            if (P.aux && P.aux[l]) memcpy(P.aux[l], P.h, (size_t)(T * P.H) * sizeof(float));
            rows_rmsnorm(P.h, nullptr, T, P.H, w.in_norm, P.eps, nullptr, P.x);
            lin_emit(w.qkv, P.x, T, P.qkv, P.conv, later);
            break;
        case ST_ROPE:
            rope_write(P.qkv, T, P.Hq, P.Hkv, P.D, P.cos, P.sin, P.slots, kc, vc, P.kv_fmt, P.kv_head, P.qr);
#if defined(SPECSCOPE_DPBF16)
            transposes(*P.plan, kc, P.Hkv, P.D, P.S, P.kv_head, later);
#endif
            break;
        case ST_ATTEND: {
            int64_t items;
            const AttendJob att = attend_job(*P.plan, P.qr, P.Hq * P.D, T, P.Hq, P.Hkv, P.D, kc, vc, P.kv_fmt,
                                             P.kv_head, P.att, items);
            later(att, items);
            break;
        }
        case ST_O: lin_emit(w.o, P.att, T, P.o, P.conv, later); break;
        case ST_MLP_NORM:
            rows_rmsnorm(P.h, P.o, T, P.H, w.post_norm, P.eps, P.hn, P.x);   // h + attn, and its norm
            lin_emit(w.gate_up, P.x, T, P.gu, P.conv, later);
            break;
        case ST_DOWN:
            rows_silu_mul(P.gu, T, P.inter, P.act);
            lin_emit(w.down, P.act, T, P.o, P.conv, later);
            break;
        default:   // ST_RESIDUAL: the MLP's residual add
            for (int64_t i = 0; i < T * P.H; ++i) P.h[i] = P.hn[i] + P.o[i];
    }
    return true;
}

extern "C" {

// h [T, H] is updated in place through layers 0..nl-1. k/v caches (fp32, or bf16 for kv_fmt 1): layer l, kv
// head g, slot s at element kc + l*layer_stride + g*kv_head + s*D. aux: nl+1 pointers, aux[i] (if not null)
// receives h entering layer i (aux[nl]: leaving the last). Returns 0, or an error code before anything is written.
int rows_layers(int64_t nl, const RowLayer* layers, float* h, int64_t T, int64_t H, int64_t Hq, int64_t Hkv,
                int64_t D, int64_t inter, float eps, const float* cos, const float* sin, const int64_t* slots,
                void* kc, void* vc, int64_t kv_fmt, int64_t layer_stride, int64_t kv_head, int64_t max_len, int64_t S,
                const uint8_t* mask, int64_t mask_row, float* const* aux, int nthreads) {
    if (int rc = rope_check(T, D, slots, max_len, S)) return rc;
    if (!attention_ok(Hq, Hkv, D, kv_fmt)) return -1;
    int64_t widest = H > Hq * D ? H : Hq * D;
    widest = widest > inter ? widest : inter;
    for (int64_t l = 0; l < nl; ++l)
        for (const RowLinear* w : {&layers[l].qkv, &layers[l].o, &layers[l].gate_up, &layers[l].down})
            if (!lin_built(*w, T)) return -1;
    // everything the program's stages read lives until run_program returns (no late thread reads it after)
    std::vector<float> x((size_t)(T * H)), qkv((size_t)(T * (Hq + 2 * Hkv) * D)), qr((size_t)(T * Hq * D)),
        att((size_t)(T * Hq * D)), o((size_t)(T * H)), gu((size_t)(T * 2 * inter)), act((size_t)(T * inter)),
        hn((size_t)(T * H));
    std::vector<bf16a_elem> conv(bf16a_size(T, widest));
    AttnPlan plan;   // the same visible slots for every layer: planned once
    attn_plan(plan, T, Hkv, D, kv_fmt, S, mask, mask_row);
    const LayersProg prog{nl, layers, h, T, H, Hq, Hkv, D, inter, eps, cos, sin, slots, kc, vc, kv_fmt,
                          layer_stride, kv_head, S, aux, nthreads, x.data(), qkv.data(), qr.data(), att.data(),
                          o.data(), gu.data(), act.data(), hn.data(), conv.data(), &plan};
    pool::run_program(nthreads, layers_stage, (void*)&prog);
    return 0;
}

}  // extern "C"
