// y[n, out] = x[n, in] @ W^T (+ bias) for a few rows (decode, verify, tree drafting), fp32, AVX-512.
//
// Memory-bound design: W is packed once into column panels of NB outputs, [out/NB][in][NB], so each panel is one
// sequential stream; a panel is read from DRAM once and applied to every activation row (the rows are tiny and
// stay in L1/L2), so 8 rows cost about what 1 row costs until the FMAs catch up. Outputs sit in vector lanes
// (x[r, k] is broadcast), so there is no horizontal reduction at all.
// Row-invariant: y[r, o] is always bias[o] + x[r,0]W[o,0] + x[r,1]W[o,1] + ... as one FMA chain in k order,
// whatever n or the row chunking are, so decode (1 row) and verify (n rows) give bit-identical results.
// Built at first use by models/rowgemm.py (g++ -O3 -mavx512f -fopenmp, no torch headers) and called via ctypes;
// it links the libgomp torch already loaded (same soname), so it shares torch's OpenMP thread pool.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <vector>

// one panel of V*16 outputs (`valid` of them real) for RB rows of x
template <int V, int RB>
static inline void tile(const float* __restrict x, int64_t in, const float* __restrict p, const float* __restrict bias,
                        int valid, float* __restrict y, int64_t ldy) {
    __m512 acc[V][RB];
    for (int v = 0; v < V; ++v) {
        int left = valid - v * 16;
        __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
        __m512 b = bias ? _mm512_maskz_loadu_ps(m, bias + v * 16) : _mm512_setzero_ps();
        for (int r = 0; r < RB; ++r) acc[v][r] = b;
    }
    for (int64_t k = 0; k < in; ++k) {
        const float* pk = p + k * (V * 16);
        // 4 KB ahead into L1: the hardware prefetcher alone leaves the FMAs waiting once n >= 4 (n = 8: -12 %)
        for (int v = 0; v < V; ++v) _mm_prefetch((const char*)(pk + 1024 + v * 16), _MM_HINT_T0);
        __m512 wv[V];
        for (int v = 0; v < V; ++v) wv[v] = _mm512_loadu_ps(pk + v * 16);
        for (int r = 0; r < RB; ++r) {
            __m512 xb = _mm512_set1_ps(x[r * in + k]);
            for (int v = 0; v < V; ++v) acc[v][r] = _mm512_fmadd_ps(wv[v], xb, acc[v][r]);
        }
    }
    for (int v = 0; v < V; ++v) {
        int left = valid - v * 16;
        if (left <= 0) break;
        __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
        for (int r = 0; r < RB; ++r) _mm512_mask_storeu_ps(y + r * ldy + v * 16, m, acc[v][r]);
    }
}

template <int V, int RB>
static inline void panel(const float* x, int64_t n, int64_t in, const float* p, const float* bias, int valid,
                         float* y, int64_t ldy) {
    int64_t r = 0;
    for (; r + RB <= n; r += RB) tile<V, RB>(x + r * in, in, p, bias, valid, y + r * ldy, ldy);
    const float* xr = x + r * in;
    float* yr = y + r * ldy;
    switch (n - r) {  // the last, narrower chunk of rows (n - r < RB <= 12)
        case 0: break;
#define TAIL(R) case R: tile<V, R>(xr, in, p, bias, valid, yr, ldy); break;
        TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5) TAIL(6) TAIL(7) TAIL(8) TAIL(9) TAIL(10) TAIL(11)
#undef TAIL
    }
}

template <int V, int RB>
static void run(const float* x, int64_t n, const float* p, int64_t out, int64_t in, const float* bias, float* y,
                int nthreads) {
    const int64_t NB = V * 16, npan = (out + NB - 1) / NB;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)
    for (int64_t b = 0; b < npan; ++b) {
        int64_t left = out - b * NB;
        int valid = left < NB ? (int)left : (int)NB;
        panel<V, RB>(x, n, in, p + b * NB * in, bias ? bias + b * NB : nullptr, valid, y + b * NB, out);
    }
}

extern "C" {

int rows_gemm_abi() { return 8; }

// pack w [out, in] (row-major) into panels of nb outputs: [ceil(out/nb)][in][nb], zero-padded
void rows_gemm_pack(const float* w, int64_t out, int64_t in, int64_t nb, float* p) {
    int64_t npan = (out + nb - 1) / nb;
    for (int64_t b = 0; b < npan; ++b)
        for (int64_t k = 0; k < in; ++k)
            for (int64_t j = 0; j < nb; ++j) {
                int64_t o = b * nb + j;
                p[(b * in + k) * nb + j] = o < out ? w[o * in + k] : 0.0f;
            }
}

// panel width nb (32 or 64) picks the kernel family; rb = rows per register tile (tuned; results identical)
int rows_gemm_f32(const float* x, int64_t n, const float* p, int64_t nb, int64_t out, int64_t in, const float* bias,
                  float* y, int nthreads, int rb) {
    if (nb == 64) {
        switch (rb) {
            case 4: run<4, 4>(x, n, p, out, in, bias, y, nthreads); return 0;
            case 6: run<4, 6>(x, n, p, out, in, bias, y, nthreads); return 0;
        }
    } else if (nb == 32) {
        switch (rb) {
            case 6: run<2, 6>(x, n, p, out, in, bias, y, nthreads); return 0;
            case 12: run<2, 12>(x, n, p, out, in, bias, y, nthreads); return 0;
        }
    } else if (nb == 16) {
        switch (rb) {
            case 12: run<1, 12>(x, n, p, out, in, bias, y, nthreads); return 0;
        }
    }
    return -1;
}

}

// ---- the rest of a decode/verify layer, row-invariant as well ---------------------------------------------------

static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
}

// exp for x <= 0 (softmax after subtracting the max): Cephes' expf polynomial on x - n ln2, scaled by 2^n
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
    p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

extern "C" {

// y[r] = x[r] / rms(x[r]) * w; with delta: h_out[r] = x[r] + delta[r] first and y normalises h_out
void rows_rmsnorm(const float* x, const float* delta, int64_t n, int64_t d, const float* w, float eps, float* h_out,
                  float* y) {
    for (int64_t r = 0; r < n; ++r) {
        const float* xr = x + r * d;
        float* hr = h_out ? h_out + r * d : nullptr;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t k = 0; k < d; k += 16) {
            __mmask16 m = tail_mask(d - k);
            __m512 v = _mm512_maskz_loadu_ps(m, xr + k);
            if (delta) {
                v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, delta + r * d + k));
                _mm512_mask_storeu_ps(hr + k, m, v);
            }
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const float* src = delta ? hr : xr;
        __m512 inv = _mm512_set1_ps(1.0f / sqrtf(hsum(ss) / (float)d + eps));
        for (int64_t k = 0; k < d; k += 16) {
            __mmask16 m = tail_mask(d - k);
            __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, src + k), inv);
            _mm512_mask_storeu_ps(y + r * d + k, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + k)));
        }
    }
}

// out[r] = silu(gu[r, :inter]) * gu[r, inter:], the gated MLP's activation from the fused gate/up projection
void rows_silu_mul(const float* gu, int64_t n, int64_t inter, float* out) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t r = 0; r < n; ++r) {
        const float* g = gu + r * 2 * inter;
        const float* u = g + inter;
        for (int64_t k = 0; k < inter; k += 16) {
            __mmask16 m = tail_mask(inter - k);
            __m512 gv = _mm512_maskz_loadu_ps(m, g + k);
            __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));     // exp(-g); +inf for g < -88: silu -> 0
            __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, e));
            _mm512_mask_storeu_ps(out + r * inter + k, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + k)));
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

// The G query heads that share one kv head, for one row: every key and value row is read once for all G (the
// cache lives in L2, whose bandwidth is what attention on a CPU runs into).
template <int G>
static void attend_group(const float* const* qs, const float* kh, const float* vh, int64_t D, const int32_t* idx,
                         int64_t m, float scale, float* sc, float* const* outs) {
    const int64_t nv = (D + 15) / 16;
    __m512 qr[G][16];
    for (int q = 0; q < G; ++q)
        for (int64_t j = 0; j < nv; ++j) qr[q][j] = _mm512_maskz_loadu_ps(tail_mask(D - j * 16), qs[q] + j * 16);
    // scores, 4 keys at a time: each key's 16 partial sums are reduced by the same tree wherever it sits in the
    // group of 4 (missing keys of the last group are zeros), so a score never depends on its neighbours
    for (int64_t i = 0; i < m; i += 4) {
        __m256 part[G][4];
        for (int u = 0; u < 4; ++u) {
            if (i + u < m) {
                const float* ks = kh + (int64_t)idx[i + u] * D;
                __m512 kv[16];
                for (int64_t j = 0; j < nv; ++j) kv[j] = _mm512_maskz_loadu_ps(tail_mask(D - j * 16), ks + j * 16);
                for (int q = 0; q < G; ++q) {
                    __m512 acc = _mm512_mul_ps(qr[q][0], kv[0]);
                    for (int64_t j = 1; j < nv; ++j) acc = _mm512_fmadd_ps(qr[q][j], kv[j], acc);
                    part[q][u] = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
                }
            } else {
                for (int q = 0; q < G; ++q) part[q][u] = _mm256_setzero_ps();
            }
        }
        __mmask8 st = (__mmask8)(m - i >= 4 ? 0xF : (1u << (m - i)) - 1u);
        for (int q = 0; q < G; ++q) {
            __m256 ab = _mm256_hadd_ps(part[q][0], part[q][1]), cd = _mm256_hadd_ps(part[q][2], part[q][3]);
            __m256 abcd = _mm256_hadd_ps(ab, cd);
            __m128 r4 = _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)),
                                   _mm_set1_ps(scale));
            _mm_mask_storeu_ps(sc + q * m + i, st, r4);
        }
    }
    for (int q = 0; q < G; ++q) {
        float* sq = sc + q * m;
        __m512 mx16 = _mm512_set1_ps(-INFINITY);
        for (int64_t i = 0; i < m; i += 16)
            mx16 = _mm512_mask_max_ps(mx16, tail_mask(m - i), mx16, _mm512_maskz_loadu_ps(tail_mask(m - i), sq + i));
        __m512 mxv = _mm512_set1_ps(_mm512_reduce_max_ps(mx16));   // a max is exact in any order
        for (int64_t i = 0; i < m; i += 16) {
            __mmask16 mm = tail_mask(m - i);
            _mm512_mask_storeu_ps(sq + i, mm, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mm, sq + i), mxv)));
        }
    }
    // weighted sum of the values over the visible keys in slot order; the denominator in 4 partial sums by visible
    // index (i % 4), fixed by the key sequence alone
    float ps[G][4];
    __m512 acc[G][16];
    for (int q = 0; q < G; ++q) {
        ps[q][0] = ps[q][1] = ps[q][2] = ps[q][3] = 0.0f;
        for (int64_t j = 0; j < nv; ++j) acc[q][j] = _mm512_setzero_ps();
    }
    for (int64_t i = 0; i < m; ++i) {
        const float* vs = vh + (int64_t)idx[i] * D;
        __m512 vv[16];
        for (int64_t j = 0; j < nv; ++j) vv[j] = _mm512_maskz_loadu_ps(tail_mask(D - j * 16), vs + j * 16);
        for (int q = 0; q < G; ++q) {
            float p = sc[q * m + i];
            ps[q][i & 3] += p;
            __m512 pv = _mm512_set1_ps(p);
            for (int64_t j = 0; j < nv; ++j) acc[q][j] = _mm512_fmadd_ps(pv, vv[j], acc[q][j]);
        }
    }
    for (int q = 0; q < G; ++q) {
        __m512 inv = _mm512_set1_ps(1.0f / ((ps[q][0] + ps[q][1]) + (ps[q][2] + ps[q][3])));
        for (int64_t j = 0; j < nv; ++j)
            _mm512_mask_storeu_ps(outs[q] + j * 16, tail_mask(D - j * 16), _mm512_mul_ps(acc[q][j], inv));
    }
}

typedef void (*group_fn)(const float* const*, const float*, const float*, int64_t, const int32_t*, int64_t, float,
                         float*, float* const*);

extern "C" {

int rows_attention(const float* q, int64_t q_row, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const float* k,
                   const float* v, int64_t kv_head, int64_t S, const uint8_t* mask, int64_t mask_row, float* out,
                   int nthreads) {
    if (D > 256 || Hq % Hkv) return -1;
    const int64_t G = Hq / Hkv;
    // groups of up to 4 heads per pass (registers); larger groups take several passes
    const int64_t gb = G % 4 == 0 ? 4 : G % 3 == 0 ? 3 : G % 2 == 0 ? 2 : 1;
    static const group_fn fns[5] = {nullptr, attend_group<1>, attend_group<2>, attend_group<3>, attend_group<4>};
    const float scale = 1.0f / sqrtf((float)D);
    const int64_t items = T * Hkv * (G / gb);
    #pragma omp parallel num_threads(nthreads) if (nthreads > 1 && items > 1)
    {
        std::vector<float> sc((size_t)(gb * (S > 0 ? S : 1)));
        std::vector<int32_t> idx(S > 0 ? S : 1);
        int64_t cur_t = -1, m = 0;
        #pragma omp for schedule(static)
        for (int64_t it = 0; it < items; ++it) {
            int64_t t = it / (Hkv * (G / gb)), rest = it % (Hkv * (G / gb));
            int64_t g = rest / (G / gb), h0 = g * G + (rest % (G / gb)) * gb;
            if (t != cur_t) {   // the visible slots of row t, in order
                const uint8_t* mr = mask ? mask + t * mask_row : nullptr;
                m = 0;
                for (int64_t s = 0; s < S; ++s)
                    if (!mr || mr[s]) idx[m++] = (int32_t)s;
                cur_t = t;
            }
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
            fns[gb](qs, k + g * kv_head, v + g * kv_head, D, idx.data(), m, scale, sc.data(), outs);
        }
    }
    return 0;
}

}
