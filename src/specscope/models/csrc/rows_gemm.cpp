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

int rows_gemm_abi() { return 4; }

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

int rows_attention(const float* q, int64_t q_row, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const float* k,
                   const float* v, int64_t kv_head, int64_t S, const uint8_t* mask, int64_t mask_row, float* out,
                   int nthreads) {
    if (D > 256 || Hq % Hkv) return -1;
    const float scale = 1.0f / sqrtf((float)D);
    const int64_t group = Hq / Hkv, nv = (D + 15) / 16;
    #pragma omp parallel num_threads(nthreads) if (nthreads > 1 && T * Hq > 1)
    {
        std::vector<float> sc(S > 0 ? S : 1);
        std::vector<int32_t> idx(S > 0 ? S : 1);
        #pragma omp for schedule(static)
        for (int64_t th = 0; th < T * Hq; ++th) {
            int64_t t = th / Hq, h = th % Hq, g = h / group;
            const float* qv = q + t * q_row + h * D;
            const float* kh = k + g * kv_head;
            const float* vh = v + g * kv_head;
            const uint8_t* mr = mask ? mask + t * mask_row : nullptr;
            __m512 qr[16];
            for (int64_t j = 0; j < nv; ++j) qr[j] = _mm512_maskz_loadu_ps(tail_mask(D - j * 16), qv + j * 16);
            int64_t m = 0;
            float mx = -INFINITY;
            for (int64_t s = 0; s < S; ++s) {
                if (mr && !mr[s]) continue;
                const float* ks = kh + s * D;
                __m512 acc = _mm512_mul_ps(qr[0], _mm512_maskz_loadu_ps(tail_mask(D), ks));
                for (int64_t j = 1; j < nv; ++j)
                    acc = _mm512_fmadd_ps(qr[j], _mm512_maskz_loadu_ps(tail_mask(D - j * 16), ks + j * 16), acc);
                float x = hsum(acc) * scale;
                sc[m] = x;
                idx[m++] = (int32_t)s;
                mx = x > mx ? x : mx;
            }
            float* o = out + t * Hq * D + h * D;
            if (m == 0) {  // no visible key: zeros (SDPA would give NaN; callers never ask for this)
                for (int64_t j = 0; j < D; ++j) o[j] = 0.0f;
                continue;
            }
            __m512 mxv = _mm512_set1_ps(mx);
            for (int64_t i = 0; i < m; i += 16) {
                __mmask16 mm = tail_mask(m - i);
                __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mm, &sc[i]), mxv));
                _mm512_mask_storeu_ps(&sc[i], mm, e);
            }
            float sum = 0.0f;
            __m512 acc[16];
            for (int64_t j = 0; j < nv; ++j) acc[j] = _mm512_setzero_ps();
            for (int64_t i = 0; i < m; ++i) {   // in slot order
                float p = sc[i];
                sum += p;
                __m512 pv = _mm512_set1_ps(p);
                const float* vs = vh + (int64_t)idx[i] * D;
                for (int64_t j = 0; j < nv; ++j)
                    acc[j] = _mm512_fmadd_ps(pv, _mm512_maskz_loadu_ps(tail_mask(D - j * 16), vs + j * 16), acc[j]);
            }
            __m512 inv = _mm512_set1_ps(1.0f / sum);
            for (int64_t j = 0; j < nv; ++j)
                _mm512_mask_storeu_ps(o + j * 16, tail_mask(D - j * 16), _mm512_mul_ps(acc[j], inv));
        }
    }
    return 0;
}

}
