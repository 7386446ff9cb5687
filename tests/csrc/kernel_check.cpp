// Correctness of the row kernels for one instruction set, without Python: built by tests/test_kernels_isa.py for
// the host's ISAs and, with a cross compiler, for aarch64 NEON run under qemu-user. Checks every kernel against a
// float64 reference and, what greedy speculation relies on, that 1 row and n rows give the same bits.
// Exit 0 and "ok <isa> <checks>" on success; the first failure is printed and exits 1.
#include "rows_gemm.cpp"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>

static uint64_t seed = 88172645463325252ull;
static float rnd() {   // xorshift64, uniform in [-1, 1)
    seed ^= seed << 13; seed ^= seed >> 7; seed ^= seed << 17;
    return (float)((seed >> 40) * (1.0 / (1 << 23)) - 1.0);
}
static std::vector<float> randv(size_t n, float scale = 1.0f) {
    std::vector<float> v(n);
    for (auto& x : v) x = rnd() * scale;
    return v;
}
static int checks = 0;
#define CHECK(cond, ...) do { ++checks; if (!(cond)) { printf("FAIL %s:%d: ", simd::ISA, __LINE__); \
    printf(__VA_ARGS__); printf("\n"); exit(1); } } while (0)

static void check_gemm() {
    int64_t nbs[32], rbs[32];
    int nv = rows_gemm_variants(nbs, rbs, 32);
    CHECK(nv > 0 && nv <= 32, "variants %d", nv);
    const int64_t shapes[][2] = {{1, 1}, {17, 3}, {33, 16}, {100, 17}, {64, 64}, {200, 333}};
    for (auto& sh : shapes) {
        int64_t out = sh[0], in = sh[1], N = 26;
        auto w = randv(out * in), b = randv(out), x = randv(N * in);
        std::vector<float> first;
        for (int vi = 0; vi < nv; ++vi) {
            int64_t nb = nbs[vi];
            std::vector<float> p(((out + nb - 1) / nb) * nb * in);
            rows_gemm_pack(w.data(), out, in, nb, p.data());
            std::vector<float> y(N * out);
            CHECK(rows_gemm_f32(x.data(), N, p.data(), nb, out, in, b.data(), y.data(), 2, (int)rbs[vi]) == 0, "run");
            for (int64_t r = 0; r < N; ++r)
                for (int64_t o = 0; o < out; ++o) {
                    double ref = b[o], mag = fabs(b[o]);
                    for (int64_t k = 0; k < in; ++k) ref += (double)x[r * in + k] * w[o * in + k], mag += fabs(x[r * in + k] * w[o * in + k]);
                    CHECK(fabs(y[r * out + o] - ref) <= 1e-6 * mag * sqrt((double)in) + 1e-30, "gemm %ldx%ld value", (long)out, (long)in);
                }
            if (first.empty()) first = y;
            CHECK(memcmp(first.data(), y.data(), y.size() * 4) == 0, "gemm: panel %ld / tile %ld changed the bits", (long)nb, (long)rbs[vi]);
            for (int64_t n = 1; n <= N; ++n) {   // every row count gives the rows' bits
                std::vector<float> yn(n * out);
                rows_gemm_f32(x.data(), n, p.data(), nb, out, in, b.data(), yn.data(), 1, (int)rbs[vi]);
                CHECK(memcmp(yn.data(), y.data(), yn.size() * 4) == 0, "gemm %ldx%ld: %ld rows differ from %ld", (long)out, (long)in, (long)n, (long)N);
            }
        }
    }
}

// bf16 panels: for weights that are exactly bf16, the same bits as the fp32 panels, for every tile and row count
static void check_gemm_bf16() {
    int64_t nbs[32], rbs[32];
    int nv = rows_gemm_variants(nbs, rbs, 32);
    const int64_t shapes[][2] = {{1, 1}, {17, 3}, {100, 17}, {200, 333}};
    for (auto& sh : shapes) {
        int64_t out = sh[0], in = sh[1], N = 20;
        auto w = randv(out * in), b = randv(out), x = randv(N * in);
        for (auto& v : w) { uint32_t u; memcpy(&u, &v, 4); u &= 0xFFFF0000u; memcpy(&v, &u, 4); }
        for (int vi = 0; vi < nv; ++vi) {
            int64_t nb = nbs[vi], padded = ((out + nb - 1) / nb) * nb * in;
            std::vector<float> p(padded);
            std::vector<uint16_t> p16(padded);
            rows_gemm_pack(w.data(), out, in, nb, p.data());
            rows_gemm_pack_bf16(w.data(), out, in, nb, p16.data());
            for (int64_t n = 1; n <= N; n += 3) {
                std::vector<float> y(n * out), y16(n * out);
                rows_gemm_f32(x.data(), n, p.data(), nb, out, in, b.data(), y.data(), 2, (int)rbs[vi]);
                CHECK(rows_gemm_bf16(x.data(), n, p16.data(), nb, out, in, b.data(), y16.data(), 2, (int)rbs[vi]) == 0, "bf16 run");
                CHECK(memcmp(y.data(), y16.data(), y.size() * 4) == 0, "bf16 panels %ldx%ld, %ld rows: not the fp32 bits", (long)out, (long)in, (long)n);
            }
        }
    }
}

// bf16 serving precision: weights and inputs rounded to bf16 (nearest even), fp32 accumulation. Against float64 over
// the rounded values (products are exact, so only the fp32 sums err); every tile and row count gives the same bits
static double bf16_value(float v) {
    uint16_t b = to_bf16(v);
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void check_gemm_bf16a() {
    int64_t nbs[32], rbs[32];
    int nv = rows_gemm_variants(nbs, rbs, 32);
    // the AVX512_BF16 build multiplies with vdpbf16ps (k-pair panels), every other build widens bf16 panels
    CHECK(rows_gemm_bf16a_pairs() == (strcmp(simd::ISA, "avx512_bf16") == 0), "bf16a path of %s", simd::ISA);
    CHECK(to_bf16(1.0f) == 0x3F80 && to_bf16(1.00390625f) == 0x3F80 && to_bf16(1.01171875f) == 0x3F82 &&
          to_bf16(-0.0f) == 0x8000 && to_bf16(NAN) == 0x7FC0, "to_bf16 rounding");   // ties to even
    const int64_t shapes[][2] = {{1, 1}, {17, 3}, {33, 16}, {100, 17}, {64, 64}, {200, 333}};
    for (auto& sh : shapes) {
        int64_t out = sh[0], in = sh[1], N = 26;
        auto w = randv(out * in), b = randv(out), x = randv(N * in, 3.0f);
        std::vector<float> first;
        for (int vi = 0; vi < nv; ++vi) {
            int64_t nb = nbs[vi], kk = rows_gemm_bf16a_pairs() ? 2 * ((in + 1) / 2) : in;
            std::vector<uint16_t> p(((out + nb - 1) / nb) * nb * kk);
            rows_gemm_pack_bf16a(w.data(), out, in, nb, p.data());
            std::vector<float> y(N * out);
            CHECK(rows_gemm_bf16a(x.data(), N, p.data(), nb, out, in, b.data(), y.data(), 2, (int)rbs[vi]) == 0, "bf16a run");
            for (int64_t r = 0; r < N; ++r)
                for (int64_t o = 0; o < out; ++o) {
                    double ref = b[o], mag = fabs(b[o]);
                    for (int64_t k = 0; k < in; ++k) {
                        double t = bf16_value(x[r * in + k]) * bf16_value(w[o * in + k]);
                        ref += t, mag += fabs(t);
                    }
                    CHECK(fabs(y[r * out + o] - ref) <= 1e-6 * mag * sqrt((double)in) + 1e-30, "bf16a %ldx%ld value", (long)out, (long)in);
                }
            if (first.empty()) first = y;
            CHECK(memcmp(first.data(), y.data(), y.size() * 4) == 0, "bf16a: panel %ld / tile %ld changed the bits", (long)nb, (long)rbs[vi]);
            for (int64_t n = 1; n <= N; ++n) {
                std::vector<float> yn(n * out);
                rows_gemm_bf16a(x.data(), n, p.data(), nb, out, in, b.data(), yn.data(), 1, (int)rbs[vi]);
                CHECK(memcmp(yn.data(), y.data(), yn.size() * 4) == 0, "bf16a %ldx%ld: %ld rows differ from %ld", (long)out, (long)in, (long)n, (long)N);
            }
        }
    }
}

static void check_norm_silu() {
    for (int64_t d : {1, 15, 16, 64, 576, 1000}) {
        const int64_t n = 7;
        auto x = randv(n * d), dl = randv(n * d), w = randv(d);
        std::vector<float> y(n * d), h(n * d), y1(d), h1(d);
        rows_rmsnorm(x.data(), dl.data(), n, d, w.data(), 1e-5f, h.data(), y.data());
        for (int64_t r = 0; r < n; ++r) {
            double ss = 0;
            for (int64_t k = 0; k < d; ++k) {
                float hv = x[r * d + k] + dl[r * d + k];
                CHECK(h[r * d + k] == hv, "residual add");
                ss += (double)hv * hv;
            }
            double inv = 1.0 / sqrt(ss / d + 1e-5);
            for (int64_t k = 0; k < d; ++k)
                CHECK(fabs(y[r * d + k] - h[r * d + k] * inv * w[k]) <= 1e-5 * fabs(h[r * d + k] * inv * w[k]) + 1e-6, "rmsnorm d=%ld", (long)d);
            rows_rmsnorm(x.data() + r * d, dl.data() + r * d, 1, d, w.data(), 1e-5f, h1.data(), y1.data());
            CHECK(memcmp(y1.data(), y.data() + r * d, d * 4) == 0, "rmsnorm row %ld alone differs", (long)r);
        }
    }
    for (int64_t inter : {1, 17, 96, 1536}) {
        const int64_t n = 5;
        auto gu = randv(n * 2 * inter, 30.0f);   // covers exp's clamps (g < -88) and large g
        std::vector<float> out(n * inter), o1(inter);
        rows_silu_mul(gu.data(), n, inter, out.data());
        for (int64_t r = 0; r < n; ++r) {
            for (int64_t k = 0; k < inter; ++k) {
                double g = gu[r * 2 * inter + k], u = gu[r * 2 * inter + inter + k];
                double ref = g / (1.0 + exp(-g)) * u;
                CHECK(fabs(out[r * inter + k] - ref) <= 2e-6 * fabs(ref) + 1e-6, "silu_mul g=%g", g);
            }
            rows_silu_mul(gu.data() + r * 2 * inter, 1, inter, o1.data());
            CHECK(memcmp(o1.data(), out.data() + r * inter, inter * 4) == 0, "silu_mul row alone differs");
        }
    }
}

// One attention case over a cache of KT (float: fp32, kv_fmt 0; uint16_t: bf16, the bf16 precision's, kv_fmt 1):
// against float64 over the cached values within tol (a bf16 cache's vdpbf16ps path also rounds the query and the
// probabilities: relative 2^-8 on each), then the bits: a row alone, and a row whose invisible slots are absent
// (slot order, not masking, decides the sums)
template <typename KT>
static void check_attention_case(int64_t Hq, int64_t Hkv, int64_t D, int64_t S, int64_t maxlen, float qscale,
                                 double tol) {
    constexpr int64_t fmt = sizeof(KT) == 2;
    const char* name = fmt ? "bf16 kv attention" : "attention";
    const int64_t T = 6;
    auto kf = randv(Hkv * maxlen * D), vf_ = randv(Hkv * maxlen * D), q = randv(T * Hq * D, qscale);
    std::vector<KT> k(kf.size()), v(vf_.size());
    for (size_t i = 0; i < k.size(); ++i) {
        if constexpr (fmt) k[i] = to_bf16(kf[i]), v[i] = to_bf16(vf_[i]);
        else k[i] = kf[i], v[i] = vf_[i];
    }
    auto cached = [&](float x) { return fmt ? bf16_value(x) : (double)x; };
    std::vector<uint8_t> mask(T * S);
    for (int64_t t = 0; t < T; ++t)
        for (int64_t s = 0; s < S; ++s)
            mask[t * S + s] = S <= T ? s <= t : (s < S - T || ((s + t) % 3 != 0 && s <= S - T + t));
    std::vector<float> out(T * Hq * D), o1(Hq * D);
    CHECK(rows_attention(q.data(), Hq * D, T, Hq, Hkv, D, k.data(), v.data(), fmt, maxlen * D, S, mask.data(), S,
                         out.data(), 2) == 0, "%s", name);
    for (int64_t t = 0; t < T; ++t) {
        for (int64_t h = 0; h < Hq; ++h) {
            int64_t g = h / (Hq / Hkv);
            std::vector<double> sc(S);
            double mx = -1e300, den = 0;
            for (int64_t s = 0; s < S; ++s) {
                if (!mask[t * S + s]) continue;
                double d = 0;
                for (int64_t j = 0; j < D; ++j) d += (double)q[(t * Hq + h) * D + j] * cached(kf[(g * maxlen + s) * D + j]);
                sc[s] = d / sqrt((double)D);
                mx = sc[s] > mx ? sc[s] : mx;
            }
            for (int64_t s = 0; s < S; ++s) if (mask[t * S + s]) den += exp(sc[s] - mx);
            for (int64_t j = 0; j < D; ++j) {
                double ref = 0;
                for (int64_t s = 0; s < S; ++s)
                    if (mask[t * S + s]) ref += exp(sc[s] - mx) / den * cached(vf_[(g * maxlen + s) * D + j]);
                CHECK(fabs(out[(t * Hq + h) * D + j] - ref) <= tol, "%s %ld/%ld/%ld S %ld value %g vs %g", name,
                      (long)Hq, (long)Hkv, (long)D, (long)S, out[(t * Hq + h) * D + j], ref);
            }
        }
        rows_attention(q.data() + t * Hq * D, Hq * D, 1, Hq, Hkv, D, k.data(), v.data(), fmt, maxlen * D, S,
                       mask.data() + t * S, S, o1.data(), 1);
        CHECK(memcmp(o1.data(), out.data() + t * Hq * D, Hq * D * 4) == 0, "%s row %ld alone differs", name, (long)t);
        std::vector<KT> kk(k.size()), vv(v.size());
        int64_t m = 0;
        for (int64_t s = 0; s < S; ++s)
            if (mask[t * S + s]) {
                for (int64_t gg = 0; gg < Hkv; ++gg) {
                    memcpy(&kk[(gg * maxlen + m) * D], &k[(gg * maxlen + s) * D], D * sizeof(KT));
                    memcpy(&vv[(gg * maxlen + m) * D], &v[(gg * maxlen + s) * D], D * sizeof(KT));
                }
                ++m;
            }
        rows_attention(q.data() + t * Hq * D, Hq * D, 1, Hq, Hkv, D, kk.data(), vv.data(), fmt, maxlen * D, m, nullptr,
                       0, o1.data(), 1);
        CHECK(memcmp(o1.data(), out.data() + t * Hq * D, Hq * D * 4) == 0, "%s row %ld compacted differs", name, (long)t);
    }
}

static void check_attention() {
    const int64_t cfgs[][3] = {{4, 2, 16}, {9, 3, 64}, {2, 2, 80}, {8, 1, 128}, {3, 3, 5}};
    for (auto& c : cfgs) check_attention_case<float>(c[0], c[1], c[2], 37, 48, 1.0f, 1e-5);
}

// a chain verify of T tokens equals T one-token decode steps, cache writes included, over a cache of KT (float:
// fp32; uint16_t: bf16, each key and value rounded as it is written); a slot past the cache is refused
template <typename KT>
static void check_rope_chain(int64_t Hq, int64_t Hkv, int64_t D, int64_t P, int64_t maxlen) {
    constexpr int64_t fmt = sizeof(KT) == 2;
    const int64_t T = 5, H = Hq + 2 * Hkv;
    auto qkv = randv((P + T) * H * D), cs = randv((P + T) * D), sn = randv((P + T) * D);
    std::vector<KT> kc1(Hkv * maxlen * D), vc1(Hkv * maxlen * D), kc2, vc2;
    std::vector<float> out1(T * Hq * D), out2(Hq * D), pre(P * Hq * D);
    std::vector<int64_t> slots(P + T);
    for (int64_t i = 0; i < P + T; ++i) slots[i] = i;
    CHECK(rows_rope_attention(qkv.data(), P, Hq, Hkv, D, cs.data(), sn.data(), slots.data(), kc1.data(), vc1.data(),
                              fmt, maxlen * D, maxlen, P, nullptr, 0, pre.data(), 2) == 0, "prefill (kv_fmt %ld)", (long)fmt);
    const float v35 = qkv[3 * H * D + (Hq + Hkv + 1) * D + 5];   // slot 3's value, kv head 1, lane 5
    if constexpr (fmt) CHECK(vc1[(1 * maxlen + 3) * D + 5] == to_bf16(v35), "bf16 kv: value not rounded");
    else CHECK(vc1[(1 * maxlen + 3) * D + 5] == v35, "value not written");
    kc2 = kc1, vc2 = vc1;
    std::vector<uint8_t> mask(T * (P + T));
    for (int64_t t = 0; t < T; ++t)
        for (int64_t s = 0; s < P + T; ++s) mask[t * (P + T) + s] = s <= P + t;
    rows_rope_attention(qkv.data() + P * H * D, T, Hq, Hkv, D, cs.data() + P * D, sn.data() + P * D, slots.data() + P,
                        kc1.data(), vc1.data(), fmt, maxlen * D, maxlen, P + T, mask.data(), P + T, out1.data(), 2);
    for (int64_t t = 0; t < T; ++t) {
        rows_rope_attention(qkv.data() + (P + t) * H * D, 1, Hq, Hkv, D, cs.data() + (P + t) * D, sn.data() + (P + t) * D,
                            slots.data() + P + t, kc2.data(), vc2.data(), fmt, maxlen * D, maxlen, P + t + 1, nullptr, 0,
                            out2.data(), 1);
        CHECK(memcmp(out2.data(), out1.data() + t * Hq * D, Hq * D * 4) == 0, "verify row %ld != decode step (kv_fmt %ld)",
              (long)t, (long)fmt);
    }
    CHECK(memcmp(kc1.data(), kc2.data(), kc1.size() * sizeof(KT)) == 0 &&
          memcmp(vc1.data(), vc2.data(), vc1.size() * sizeof(KT)) == 0, "cache writes differ (kv_fmt %ld)", (long)fmt);
    int64_t bad[2] = {3, maxlen};
    CHECK(rows_rope_attention(qkv.data(), 2, Hq, Hkv, D, cs.data(), sn.data(), bad, kc1.data(), vc1.data(), fmt,
                              maxlen * D, maxlen, 4, nullptr, 0, out1.data(), 1) == -3, "slot past the cache accepted");
}

static void check_rope_attention() { check_rope_chain<float>(4, 2, 16, 9, 24); }

// A bf16 KV cache (the bf16 precision's): the attention cases, and a chain verify against decode steps
static void check_attention_bf16kv() {
    const int64_t cfgs[][3] = {{9, 3, 64}, {8, 2, 128}, {4, 2, 16}, {3, 3, 80}, {2, 1, 64}};
    for (auto& c : cfgs)
        for (int64_t S : {5, 37, 70}) check_attention_case<uint16_t>(c[0], c[1], c[2], S, 80, 2.0f, 2e-2);
    check_rope_chain<uint16_t>(6, 2, 64, 21, 32);
}

// The thread pool (pool.h): more threads than this host has cores, so some are always late or preempted. Every item
// of every dispatch runs exactly once (a late worker claiming a chunk of the next job with the last job's bounds
// would show as an item run twice or never), and linears and attention give the one-thread bits whatever the
// thread count.
static void check_pool() {
    std::vector<std::atomic<int>> hits(257);
    for (int it = 0; it < 7 * 1000; ++it) {
        const int nt = 2 + (it / 1000) % 7;   // a pool kept over 1000 dispatches, then resized
        const int64_t items = 1 + (int64_t)((rnd() + 1.0f) * 128), chunk = 1 + it % 3;
        for (int64_t i = 0; i < items; ++i) hits[i].store(0, std::memory_order_relaxed);
        pool::run(nt, items, chunk, [&](int64_t b, int64_t e) {
            for (int64_t i = b; i < e; ++i) hits[i].fetch_add(1, std::memory_order_relaxed);
        });
        for (int64_t i = 0; i < items; ++i)
            CHECK(hits[i].load() == 1, "pool: dispatch %d (%d threads) ran item %ld %d times", it, nt, (long)i, hits[i].load());
    }
    // a job of few chunks, then one of many, over and over: a late worker that read the small job's exhausted
    // ticket must never take the large job's count for the small job's and claim a chunk that does not exist
    std::vector<std::atomic<int>> many(512);
    for (int it = 0; it < 50 * 1000; ++it) {
        const int64_t items = it % 2 ? 512 : 2;
        for (int64_t i = 0; i < items; ++i) many[i].store(0, std::memory_order_relaxed);
        pool::run(2, items, 1, [&](int64_t b, int64_t e) {
            for (int64_t i = b; i < e; ++i) many[i].fetch_add(1, std::memory_order_relaxed);
        });
        for (int64_t i = 0; i < items; ++i)
            CHECK(many[i].load() == 1, "pool: alternating dispatch %d ran item %ld %d times", it, (long)i, many[i].load());
    }
    int64_t nbs[32], rbs[32];
    rows_gemm_variants(nbs, rbs, 32);
    const int64_t out = 517, in = 96, N = 3;
    auto w = randv(out * in), b = randv(out), x = randv(N * in);
    std::vector<float> p(((out + nbs[0] - 1) / nbs[0]) * nbs[0] * in), y1(N * out), yt(N * out);
    rows_gemm_pack(w.data(), out, in, nbs[0], p.data());
    rows_gemm_f32(x.data(), N, p.data(), nbs[0], out, in, b.data(), y1.data(), 1, (int)rbs[0]);
    for (int rep = 0; rep < 300; ++rep) {
        const int nt = 2 + rep % 7;
        rows_gemm_f32(x.data(), N, p.data(), nbs[0], out, in, b.data(), yt.data(), nt, (int)rbs[0]);
        CHECK(memcmp(y1.data(), yt.data(), yt.size() * 4) == 0, "pool: gemm on %d threads differs from 1 thread", nt);
    }
    const int64_t T = 7, Hq = 8, Hkv = 2, D = 64, S = 300;
    auto q = randv(T * Hq * D), k = randv(Hkv * S * D), v = randv(Hkv * S * D);
    std::vector<float> a1(T * Hq * D), at(T * Hq * D);
    rows_attention(q.data(), Hq * D, T, Hq, Hkv, D, k.data(), v.data(), 0, S * D, S, nullptr, 0, a1.data(), 1);
    std::vector<uint16_t> k16(k.size()), v16(v.size());   // a bf16 cache: its key-transposing dispatch too
    for (size_t i = 0; i < k.size(); ++i) k16[i] = to_bf16(k[i]), v16[i] = to_bf16(v[i]);
    for (int64_t fmt : {0, 1}) {
        const void* kc = fmt ? (const void*)k16.data() : (const void*)k.data();
        const void* vc = fmt ? (const void*)v16.data() : (const void*)v.data();
        rows_attention(q.data(), Hq * D, T, Hq, Hkv, D, kc, vc, fmt, S * D, S, nullptr, 0, a1.data(), 1);
        for (int rep = 0; rep < 100; ++rep) {
            const int nt = 2 + rep % 7;
            rows_attention(q.data(), Hq * D, T, Hq, Hkv, D, kc, vc, fmt, S * D, S, nullptr, 0, at.data(), nt);
            CHECK(memcmp(a1.data(), at.data(), at.size() * 4) == 0, "pool: attention (kv_fmt %ld) on %d threads differs",
                  (long)fmt, nt);
        }
    }
}

// Programs (pool.h run_program). A job whose chunks sleep 3 ms now and then (a thread "preempted" while holding
// one): the stage after it must find every output written once with its value; a late thread must never write
// after its job is over (each stage overwrites the last stage's outputs with a sentinel, and they still hold it
// when run_program has returned and 10 ms more passed); other threads compute a late chunk again and carry the
// program's serial parts forward while the caller sleeps.
struct SleepyJob {
    float* out;
    int64_t stage;
    pthread_t caller;
    size_t scratch(int64_t b, int64_t e) const { return (size_t)(e - b); }
    void compute(int64_t b, int64_t e, float* to) const {
        // the caller "preempted" in some chunks, a worker in others (a worker recomputing the caller's chunk runs
        // on, so it completes the stage while the caller sleeps and must carry the serial part itself)
        const bool me = pthread_equal(pthread_self(), caller);
        if (me ? (b + stage) % 5 == 0 : (b + stage) % 7 == 3) usleep(3000);
        for (int64_t i = b; i < e; ++i) (to ? to[i - b] : out[i]) = (float)(i * 7 + stage);
    }
    void commit(int64_t b, int64_t e, const float* from) const { memcpy(out + b, from, (size_t)(e - b) * 4); }
};

struct SleepyProg {
    std::vector<std::vector<float>>* outs;
    int64_t items, stages;
    int nthreads;
    pthread_t caller;
    std::atomic<int>* bad;
    std::atomic<int>* elsewhere;   // serial parts run by a thread other than the caller
};

static bool sleepy_stage(void* vp, int64_t s, pool::Job* job) {
    SleepyProg& P = *(SleepyProg*)vp;
    job->items = 0;
    if (!pthread_equal(pthread_self(), P.caller)) P.elsewhere->fetch_add(1);
    if (s > 0) {   // the last stage's outputs: each written once, with its value; then the sentinel
        std::vector<float>& prev = (*P.outs)[s - 1];
        for (int64_t i = 0; i < P.items; ++i)
            if (prev[i] != (float)(i * 7 + s - 1)) P.bad->fetch_add(1);
        std::fill(prev.begin(), prev.end(), -2.0f);
    }
    if (s == P.stages) return false;
    pool::Later{job, P.nthreads}(SleepyJob{(*P.outs)[s].data(), s, P.caller}, P.items);
    return true;
}

static void check_programs() {
    const uint64_t before = pool::redone();
    for (int nt : {2, 3, 5}) {
        const int64_t items = 64, stages = 60;
        std::vector<std::vector<float>> outs(stages, std::vector<float>(items, -1.0f));
        std::atomic<int> bad{0}, elsewhere{0};
        SleepyProg prog{&outs, items, stages, nt, pthread_self(), &bad, &elsewhere};
        pool::run_program(nt, sleepy_stage, &prog);
        CHECK(bad.load() == 0, "programs (%d threads): %d outputs were wrong when the next stage read them", nt, bad.load());
        usleep(10000);
        for (int64_t s = 0; s < stages; ++s)
            for (int64_t i = 0; i < items; ++i)
                CHECK(outs[s][i] == -2.0f, "programs (%d threads): a late thread wrote stage %ld item %ld after its job",
                      nt, (long)s, (long)i);
        CHECK(elsewhere.load() > 0, "programs (%d threads): no serial part ran on a thread other than the caller", nt);
    }
    CHECK(pool::redone() > before, "programs: no late chunk was ever computed again");
    // one thread: the same program inline, stage after stage
    std::vector<std::vector<float>> outs(4, std::vector<float>(8, -1.0f));
    std::atomic<int> bad{0}, elsewhere{0};
    SleepyProg prog{&outs, 8, 4, 1, pthread_self(), &bad, &elsewhere};
    pool::run_program(1, sleepy_stage, &prog);
    CHECK(bad.load() == 0 && elsewhere.load() == 0, "programs: the inline run differs");
}

int main() {
    check_gemm();
    check_gemm_bf16();
    check_gemm_bf16a();
    check_norm_silu();
    check_attention();
    check_rope_attention();
    check_attention_bf16kv();
    check_pool();
    check_programs();
    printf("ok %s %d\n", rows_gemm_isa(), checks);
    return 0;
}
