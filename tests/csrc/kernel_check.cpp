// Correctness of the row kernels for one instruction set, without Python: built by tests/test_kernels_isa.py for
// the host's ISAs and, with a cross compiler, for aarch64 NEON run under qemu-user. Checks every kernel against a
// float64 reference and, what greedy speculation relies on, that 1 row and n rows give the same bits.
// Exit 0 and "ok <isa> <checks>" on success; the first failure is printed and exits 1.
#include "rows_gemm.cpp"

#include <stdio.h>
#include <stdlib.h>

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

static void check_attention() {
    const int64_t cfgs[][3] = {{4, 2, 16}, {9, 3, 64}, {2, 2, 80}, {8, 1, 128}, {3, 3, 5}};
    for (auto& c : cfgs) {
        int64_t Hq = c[0], Hkv = c[1], D = c[2], S = 37, T = 6, maxlen = 48;
        auto k = randv(Hkv * maxlen * D), v = randv(Hkv * maxlen * D), q = randv(T * Hq * D);
        std::vector<uint8_t> mask(T * S);
        for (int64_t t = 0; t < T; ++t)
            for (int64_t s = 0; s < S; ++s) mask[t * S + s] = s < S - T || ((s + t) % 3 != 0 && s <= S - T + t);
        std::vector<float> out(T * Hq * D), o1(Hq * D);
        CHECK(rows_attention(q.data(), Hq * D, T, Hq, Hkv, D, k.data(), v.data(), 0, maxlen * D, S, mask.data(), S,
                             out.data(), 2) == 0, "attention");
        for (int64_t t = 0; t < T; ++t) {
            for (int64_t h = 0; h < Hq; ++h) {
                int64_t g = h / (Hq / Hkv);
                std::vector<double> sc(S);
                double mx = -1e300, den = 0;
                for (int64_t s = 0; s < S; ++s) {
                    if (!mask[t * S + s]) continue;
                    double d = 0;
                    for (int64_t j = 0; j < D; ++j) d += (double)q[(t * Hq + h) * D + j] * k[(g * maxlen + s) * D + j];
                    sc[s] = d / sqrt((double)D);
                    mx = sc[s] > mx ? sc[s] : mx;
                }
                for (int64_t s = 0; s < S; ++s) if (mask[t * S + s]) den += exp(sc[s] - mx);
                for (int64_t j = 0; j < D; ++j) {
                    double ref = 0;
                    for (int64_t s = 0; s < S; ++s)
                        if (mask[t * S + s]) ref += exp(sc[s] - mx) / den * v[(g * maxlen + s) * D + j];
                    CHECK(fabs(out[(t * Hq + h) * D + j] - ref) <= 1e-5, "attention %ld/%ld/%ld value", (long)Hq, (long)Hkv, (long)D);
                }
            }
            rows_attention(q.data() + t * Hq * D, Hq * D, 1, Hq, Hkv, D, k.data(), v.data(), 0, maxlen * D, S,
                           mask.data() + t * S, S, o1.data(), 1);
            CHECK(memcmp(o1.data(), out.data() + t * Hq * D, Hq * D * 4) == 0, "attention row %ld alone differs", (long)t);
            // the invisible slots simply absent: the same bits (slot order, not masking, decides the sums)
            std::vector<float> kk(k.size()), vv(v.size());
            int64_t m = 0;
            for (int64_t s = 0; s < S; ++s)
                if (mask[t * S + s]) {
                    for (int64_t gg = 0; gg < Hkv; ++gg) {
                        memcpy(&kk[(gg * maxlen + m) * D], &k[(gg * maxlen + s) * D], D * 4);
                        memcpy(&vv[(gg * maxlen + m) * D], &v[(gg * maxlen + s) * D], D * 4);
                    }
                    ++m;
                }
            rows_attention(q.data() + t * Hq * D, Hq * D, 1, Hq, Hkv, D, kk.data(), vv.data(), 0, maxlen * D, m, nullptr,
                           0, o1.data(), 1);
            CHECK(memcmp(o1.data(), out.data() + t * Hq * D, Hq * D * 4) == 0, "attention row %ld compacted differs", (long)t);
        }
    }
}

static void check_rope_attention() {
    // a chain verify of T tokens equals T one-token decode steps, cache writes included
    const int64_t Hq = 4, Hkv = 2, D = 16, T = 5, P = 9, maxlen = 24, H = Hq + 2 * Hkv;
    auto qkv = randv((P + T) * H * D), cs = randv((P + T) * D), sn = randv((P + T) * D);
    std::vector<float> kc1(Hkv * maxlen * D), vc1(Hkv * maxlen * D), kc2, vc2, out1(T * Hq * D), out2(Hq * D);
    std::vector<int64_t> slots(P + T);
    for (int64_t i = 0; i < P + T; ++i) slots[i] = i;
    std::vector<float> pre(P * Hq * D);
    CHECK(rows_rope_attention(qkv.data(), P, Hq, Hkv, D, cs.data(), sn.data(), slots.data(), kc1.data(), vc1.data(), 0,
                              maxlen * D, maxlen, P, nullptr, 0, pre.data(), 2) == 0, "prefill");
    kc2 = kc1, vc2 = vc1;
    std::vector<uint8_t> mask(T * (P + T));
    for (int64_t t = 0; t < T; ++t)
        for (int64_t s = 0; s < P + T; ++s) mask[t * (P + T) + s] = s <= P + t;
    rows_rope_attention(qkv.data() + P * H * D, T, Hq, Hkv, D, cs.data() + P * D, sn.data() + P * D, slots.data() + P,
                        kc1.data(), vc1.data(), 0, maxlen * D, maxlen, P + T, mask.data(), P + T, out1.data(), 2);
    for (int64_t t = 0; t < T; ++t) {
        rows_rope_attention(qkv.data() + (P + t) * H * D, 1, Hq, Hkv, D, cs.data() + (P + t) * D, sn.data() + (P + t) * D,
                            slots.data() + P + t, kc2.data(), vc2.data(), 0, maxlen * D, maxlen, P + t + 1, nullptr, 0,
                            out2.data(), 1);
        CHECK(memcmp(out2.data(), out1.data() + t * Hq * D, Hq * D * 4) == 0, "verify row %ld != decode step", (long)t);
    }
    CHECK(memcmp(kc1.data(), kc2.data(), kc1.size() * 4) == 0 && memcmp(vc1.data(), vc2.data(), vc1.size() * 4) == 0,
          "cache writes differ");
    int64_t bad[2] = {3, maxlen};
    CHECK(rows_rope_attention(qkv.data(), 2, Hq, Hkv, D, cs.data(), sn.data(), bad, kc1.data(), vc1.data(), 0, maxlen * D,
                              maxlen, 4, nullptr, 0, out1.data(), 1) == -3, "slot past the cache accepted");
}

// A bf16 KV cache (the bf16 precision's): against float64 over the cached bf16 values, within what rounding the
// query and the probabilities to bf16 costs (the vdpbf16ps build) or fp32 sums (the widening builds); and the bits
// checks of the fp32 cache: a row alone, a verify row vs the decode step, invisible slots vs absent ones
static void check_attention_bf16kv() {
    const int64_t cfgs[][3] = {{9, 3, 64}, {8, 2, 128}, {4, 2, 16}, {3, 3, 80}, {2, 1, 64}};
    for (auto& c : cfgs) {
        for (int64_t S : {5, 37, 70}) {
            int64_t Hq = c[0], Hkv = c[1], D = c[2], T = 6, maxlen = 80;
            auto kf = randv(Hkv * maxlen * D), vf_ = randv(Hkv * maxlen * D), q = randv(T * Hq * D, 2.0f);
            std::vector<uint16_t> k(kf.size()), v(vf_.size());
            for (size_t i = 0; i < k.size(); ++i) k[i] = to_bf16(kf[i]), v[i] = to_bf16(vf_[i]);
            std::vector<uint8_t> mask(T * S);
            for (int64_t t = 0; t < T; ++t)
                for (int64_t s = 0; s < S; ++s)
                    mask[t * S + s] = S <= T ? s <= t : (s < S - T || ((s + t) % 3 != 0 && s <= S - T + t));
            std::vector<float> out(T * Hq * D), o1(Hq * D);
            CHECK(rows_attention(q.data(), Hq * D, T, Hq, Hkv, D, k.data(), v.data(), 1, maxlen * D, S, mask.data(), S,
                                 out.data(), 2) == 0, "bf16 kv attention");
            for (int64_t t = 0; t < T; ++t) {
                for (int64_t h = 0; h < Hq; ++h) {
                    int64_t g = h / (Hq / Hkv);
                    std::vector<double> sc(S);
                    double mx = -1e300, den = 0;
                    for (int64_t s = 0; s < S; ++s) {
                        if (!mask[t * S + s]) continue;
                        double d = 0;
                        for (int64_t j = 0; j < D; ++j)
                            d += (double)q[(t * Hq + h) * D + j] * bf16_value(kf[(g * maxlen + s) * D + j]);
                        sc[s] = d / sqrt((double)D);
                        mx = sc[s] > mx ? sc[s] : mx;
                    }
                    for (int64_t s = 0; s < S; ++s) if (mask[t * S + s]) den += exp(sc[s] - mx);
                    for (int64_t j = 0; j < D; ++j) {
                        double ref = 0;
                        for (int64_t s = 0; s < S; ++s)
                            if (mask[t * S + s]) ref += exp(sc[s] - mx) / den * bf16_value(vf_[(g * maxlen + s) * D + j]);
                        // bf16 query and probabilities: relative 2^-8 on each, so ~1 % of the largest |v| at worst
                        CHECK(fabs(out[(t * Hq + h) * D + j] - ref) <= 2e-2, "bf16 kv attention %ld/%ld/%ld S %ld value %g vs %g",
                              (long)Hq, (long)Hkv, (long)D, (long)S, out[(t * Hq + h) * D + j], ref);
                    }
                }
                rows_attention(q.data() + t * Hq * D, Hq * D, 1, Hq, Hkv, D, k.data(), v.data(), 1, maxlen * D, S,
                               mask.data() + t * S, S, o1.data(), 1);
                CHECK(memcmp(o1.data(), out.data() + t * Hq * D, Hq * D * 4) == 0, "bf16 kv row %ld alone differs", (long)t);
                std::vector<uint16_t> kk(k.size()), vv(v.size());
                int64_t m = 0;
                for (int64_t s = 0; s < S; ++s)
                    if (mask[t * S + s]) {
                        for (int64_t gg = 0; gg < Hkv; ++gg) {
                            memcpy(&kk[(gg * maxlen + m) * D], &k[(gg * maxlen + s) * D], D * 2);
                            memcpy(&vv[(gg * maxlen + m) * D], &v[(gg * maxlen + s) * D], D * 2);
                        }
                        ++m;
                    }
                rows_attention(q.data() + t * Hq * D, Hq * D, 1, Hq, Hkv, D, kk.data(), vv.data(), 1, maxlen * D, m,
                               nullptr, 0, o1.data(), 1);
                CHECK(memcmp(o1.data(), out.data() + t * Hq * D, Hq * D * 4) == 0, "bf16 kv row %ld compacted differs", (long)t);
            }
        }
    }
    // a chain verify of T tokens equals T one-token decode steps with a bf16 cache, cache writes included
    const int64_t Hq = 6, Hkv = 2, D = 64, T = 5, P = 21, maxlen = 32, H = Hq + 2 * Hkv;
    auto qkv = randv((P + T) * H * D), cs = randv((P + T) * D), sn = randv((P + T) * D);
    std::vector<uint16_t> kc1(Hkv * maxlen * D), vc1(Hkv * maxlen * D), kc2, vc2;
    std::vector<float> out1(T * Hq * D), out2(Hq * D), pre(P * Hq * D);
    std::vector<int64_t> slots(P + T);
    for (int64_t i = 0; i < P + T; ++i) slots[i] = i;
    CHECK(rows_rope_attention(qkv.data(), P, Hq, Hkv, D, cs.data(), sn.data(), slots.data(), kc1.data(), vc1.data(), 1,
                              maxlen * D, maxlen, P, nullptr, 0, pre.data(), 2) == 0, "bf16 kv prefill");
    CHECK(vc1[(1 * maxlen + 3) * D + 5] == to_bf16(qkv[3 * H * D + (Hq + Hkv + 1) * D + 5]), "bf16 kv: value not rounded");
    kc2 = kc1, vc2 = vc1;
    std::vector<uint8_t> mask(T * (P + T));
    for (int64_t t = 0; t < T; ++t)
        for (int64_t s = 0; s < P + T; ++s) mask[t * (P + T) + s] = s <= P + t;
    rows_rope_attention(qkv.data() + P * H * D, T, Hq, Hkv, D, cs.data() + P * D, sn.data() + P * D, slots.data() + P,
                        kc1.data(), vc1.data(), 1, maxlen * D, maxlen, P + T, mask.data(), P + T, out1.data(), 2);
    for (int64_t t = 0; t < T; ++t) {
        rows_rope_attention(qkv.data() + (P + t) * H * D, 1, Hq, Hkv, D, cs.data() + (P + t) * D, sn.data() + (P + t) * D,
                            slots.data() + P + t, kc2.data(), vc2.data(), 1, maxlen * D, maxlen, P + t + 1, nullptr, 0,
                            out2.data(), 1);
        CHECK(memcmp(out2.data(), out1.data() + t * Hq * D, Hq * D * 4) == 0, "bf16 kv verify row %ld != decode step", (long)t);
    }
    CHECK(kc1 == kc2 && vc1 == vc2, "bf16 kv cache writes differ");
}

int main() {
    check_gemm();
    check_gemm_bf16();
    check_gemm_bf16a();
    check_norm_silu();
    check_attention();
    check_rope_attention();
    check_attention_bf16kv();
    printf("ok %s %d\n", rows_gemm_isa(), checks);
    return 0;
}
