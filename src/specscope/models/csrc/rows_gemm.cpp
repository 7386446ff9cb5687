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
#include <stdint.h>
#include <string.h>

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

int rows_gemm_abi() { return 2; }

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
