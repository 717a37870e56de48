// The rest of a decoder layer for the few rows of a decode step or a short verify, in bf16:
// RMSNorm, rotary + KV-cache append + causal attention, and SwiGLU's silu(gate) * up.
//
// Why: with the Q4_1 kernel doing the linears, a one-row forward of a small model spends about as
// long in these small ops as in its weights. In PyTorch each is several kernels (RMSNorm alone is
// pow, mean, add, rsqrt, mul, casts) and the CPU flash-attention kernel costs ~45 us per layer for
// one query row; here each is one call that touches its data once.
//
// Numerics: everything is computed in float32 from the bf16 inputs and rounded to bf16 where
// PyTorch's bf16 graph stores a bf16 tensor that the rest reads (the normalised x before its
// weight multiply, q/k after rotary, the outputs). Intermediate roundings PyTorch also does inside
// one op (x * cos, then + roll(x) * sin) are not repeated: the results are the bf16 model's
// function to within bf16 rounding, row by row (a row's result never depends on the other rows),
// which is all the engine needs (every emitted token is the argmax of the forward that verified
// it; tests/test_decode_ops.py pins the agreement with PyTorch's ops).
//
// Built and loaded as kernels/q4_1.c is (whiflash_core/native.py), threaded on PyTorch's libgomp.
#define _GNU_SOURCE   // syscall()
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

// ------------------------------------------------------------------ bf16 <-> float32

static inline __m256 load8_bf16(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline void store8_bf16(uint16_t *p, __m256 v) {
    // round to nearest, ties to even (PyTorch's .to(bfloat16)), 8 lanes; NaN lanes become 0x7FC0
    __m256i bits = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    // pack the 8 low halves: within-lane packus then fix the lane order
    __m256i packed = _mm256_packus_epi32(r, r);
    packed = _mm256_permute4x64_epi64(packed, 0xD8);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// e^x for 8 lanes (Cephes' expf: 2^n * p(r), r = x - n ln2; relative error ~1e-7 over the range
// that does not under/overflow; x <= -87.3 gives 0)
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.3f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

#if defined(__AVX512F__)
static inline __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512 exp16(__m512 x) {   // exp8 in 16 lanes
    const __m512 lo = _mm512_set1_ps(-87.3f), hi = _mm512_set1_ps(88.3f);
    const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
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
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps((__mmask16)~under, p, _mm512_castsi512_ps(e));
}

// store8_bf16's rounding in 16 lanes (the same bits lane for lane)
static inline void store16_bf16(uint16_t *p, __m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}
#endif

// ------------------------------------------------------------------ RMSNorm

// y[r] = bf16(w * bf16(x[r] * rsqrt(mean(x[r]^2) + eps))), x, w, y bf16 [M, K] / [K]; K % 8 == 0.
// (Hugging Face Llama: normalise in float32, cast to the model dtype, then scale by the weight.)
void rms_norm_bf16(const uint16_t *x, const uint16_t *w, float eps, int64_t M, int64_t K, uint16_t *y) {
#pragma omp parallel for if (M >= 8)
    for (int64_t r = 0; r < M; r++) {
        const uint16_t *xr = x + r * K;
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 16 <= K; i += 16) {
            __m256 a = load8_bf16(xr + i), b = load8_bf16(xr + i + 8);
            s0 = _mm256_fmadd_ps(a, a, s0);
            s1 = _mm256_fmadd_ps(b, b, s1);
        }
        for (; i < K; i += 8) {
            __m256 a = load8_bf16(xr + i);
            s0 = _mm256_fmadd_ps(a, a, s0);
        }
        const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum(_mm256_add_ps(s0, s1)) / (float)K + eps));
        for (i = 0; i < K; i += 8) {
            uint16_t normed[8];
            store8_bf16(normed, _mm256_mul_ps(load8_bf16(xr + i), inv));
            store8_bf16(y + r * K + i, _mm256_mul_ps(load8_bf16(normed), load8_bf16(w + i)));
        }
    }
}

// ------------------------------------------------------------------ SwiGLU

// y[r, i] = bf16(silu(g) * u), g = gu[r, i], u = gu[r, H + i] (gate_proj and up_proj stacked by
// rows, as GatedMLP's gate_up_proj); gu [M, 2H], y [M, H] bf16; H % 8 == 0.
// With AVX-512 (and H % 16 == 0) 16 lanes at a time: the same operations lane for lane (exp16 is
// exp8's), so the same bits, in about half the instructions (a verify's SwiGLU is ~3 % of it).
void silu_mul_bf16(const uint16_t *gu, int64_t M, int64_t H, uint16_t *y) {
#if defined(__AVX512F__)
    if (H % 16 == 0) {
#pragma omp parallel for collapse(2) if (M * H >= 16384)
        for (int64_t r = 0; r < M; r++)
            for (int64_t i = 0; i < H; i += 16) {
                __m512 g = load16_bf16(gu + r * 2 * H + i), u = load16_bf16(gu + r * 2 * H + H + i);
                uint16_t s[16];
                store16_bf16(s, _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
                store16_bf16(y + r * H + i, _mm512_mul_ps(load16_bf16(s), u));
            }
        return;
    }
#endif
#pragma omp parallel for collapse(2) if (M * H >= 16384)
    for (int64_t r = 0; r < M; r++)
        for (int64_t i = 0; i < H; i += 8) {
            __m256 g = load8_bf16(gu + r * 2 * H + i), u = load8_bf16(gu + r * 2 * H + H + i);
            // silu(g) = g / (1 + e^-g), stored in bf16 as F.silu's output is, then times up
            uint16_t s[8];
            store8_bf16(s, _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)))));
            store8_bf16(y + r * H + i, _mm256_mul_ps(load8_bf16(s), u));
        }
}

// ------------------------------------------------------------------ rotary + cache + attention

// x'[d] = x[d] cos[d] + x[(d + hd/2) % hd] sin[d], sin with its first half negated (layers.Rotary):
// Hugging Face's x cos + rotate_half(x) sin, with layers.apply_rope's roundings (each product and
// the sum stored in bf16), so q and k are the bits PyTorch's bf16 graph makes. hd % 16 == 0.
static inline void rope(const uint16_t *x, const uint16_t *cos, const uint16_t *sin, int64_t hd, uint16_t *out) {
    const int64_t half = hd / 2;
    for (int64_t d = 0; d < hd; d += 8) {
        const int64_t e = d < half ? d + half : d - half;
        uint16_t a[8], b[8];
        store8_bf16(a, _mm256_mul_ps(load8_bf16(x + d), load8_bf16(cos + d)));
        store8_bf16(b, _mm256_mul_ps(load8_bf16(x + e), load8_bf16(sin + d)));
        store8_bf16(out + d, _mm256_add_ps(load8_bf16(a), load8_bf16(b)));
    }
}

#define CHUNK 64  // keys per task: converted to float32 once, read by every query of their kv head

// 8 dot products a[0..7] . (one query) -> lanes 0..7 (a transpose by horizontal adds)
static inline __m256 reduce8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
    __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// One task of attend_rows_bf16: kv head g, keys [j0, j0 + nk) converted to float32 in kf / vf; a
// partial softmax for each of the head group's queries. vecs = hd / 8 is a constant at each call
// (always inlined), so the accumulators stay in registers.
static inline __attribute__((always_inline)) void attend_chunk(const int64_t vecs, const uint16_t *q, const float *kf,
        const float *vf, float *parts, int64_t g, int64_t c, int64_t j0, int64_t nk, int64_t chunks, int64_t start,
        int64_t nq, int64_t group, int64_t nh, float scale) {
    const int64_t hd = vecs * 8, part = hd + 2, j1 = j0 + nk;
    float sc[CHUNK];
    for (int64_t qi = 0; qi < nq; qi++) {
        const int64_t i = qi / group, h = g * group + qi % group;
        float *pt = parts + ((g * chunks + c) * nq + qi) * part;
        const int64_t n = (start + i + 1 < j1 ? start + i + 1 : j1) - j0;  // keys row i sees here
        if (n <= 0) {  // a chunk entirely in this row's future
            pt[hd] = -INFINITY;
            pt[hd + 1] = 0.0f;
            continue;
        }
        __m256 qv[32];
        for (int64_t d = 0; d < vecs; d++)
            qv[d] = _mm256_mul_ps(load8_bf16(q + (i * nh + h) * hd + 8 * d), _mm256_set1_ps(scale));
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {  // 8 keys' scores at a time: 8 independent FMA chains
            const float *kj = kf + j * hd;
            __m256 a[8];
            for (int u = 0; u < 8; u++) a[u] = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kj + u * hd));
            for (int64_t d = 1; d < vecs; d++)
                for (int u = 0; u < 8; u++) a[u] = _mm256_fmadd_ps(qv[d], _mm256_loadu_ps(kj + u * hd + 8 * d), a[u]);
            _mm256_storeu_ps(sc + j, reduce8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]));
        }
        for (; j < n; j++) {
            const float *kj = kf + j * hd;
            __m256 s0 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kj));
            for (int64_t d = 1; d < vecs; d++) s0 = _mm256_fmadd_ps(qv[d], _mm256_loadu_ps(kj + 8 * d), s0);
            sc[j] = hsum(s0);
        }
        float m = sc[0];
        for (j = 1; j < n; j++) m = sc[j] > m ? sc[j] : m;
        const __m256 mv = _mm256_set1_ps(m);
        float l = 0.0f;
        for (j = 0; j + 8 <= n; j += 8) {
            __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), mv));
            _mm256_storeu_ps(sc + j, p);
            l += hsum(p);
        }
        for (; j < n; j++) {
            sc[j] = expf(sc[j] - m);
            l += sc[j];
        }
        __m256 acc[32];  // acc = sum_j p_j v_j: one chain per 8 dims
        for (int64_t d = 0; d < vecs; d++) acc[d] = _mm256_setzero_ps();
        for (j = 0; j < n; j++) {
            const __m256 p = _mm256_set1_ps(sc[j]);
            for (int64_t d = 0; d < vecs; d++) acc[d] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vf + j * hd + 8 * d), acc[d]);
        }
        for (int64_t d = 0; d < vecs; d++) _mm256_storeu_ps(pt + 8 * d, acc[d]);
        pt[hd] = m;
        pt[hd + 1] = l;
    }
}

#if defined(__AVX512F__)
// ------------------------------------------------------------------ attention, 16 queries a vector
//
// Where the CPU has AVX-512: the queries of one kv head (every row, every head of its group) sit
// in the 16 lanes of a vector, so with keys and values converted to float32 once per chunk
//     scores:  s[j][lane] = sum_d q[d][lane] k[j][d]        (k[j][d] broadcast: FMA, memory operand)
//     softmax: lane by lane over j (each lane is one query: no horizontal sums anywhere)
//     values:  acc[d][lane] += p[j][lane] v[j][d]          (v[j][d] broadcast)
// 2 hd 16-lane FMAs per key and 16 queries, where attend_chunk spends 2 hd 8-lane FMAs and a
// horizontal sum per key and query. (vdpbf16ps on the bf16 cache would halve the score FMAs, but
// measured at half the MACs per second of float32 FMAs on Sapphire Rapids.) Every lane runs the
// same operations in the same order whatever the other lanes hold, so a row's result does not
// depend on the other rows of its call. With fewer than LANES_FROM queries most lanes would idle:
// a 1-row decode (3 queries a kv head in SmolLM2) measured 2x slower here than attend_chunk's
// path, 4 and 8 rows 1.2-1.4x faster over 1-2k cached positions (fewer queries take the few-query
// path below); so a row computed in a 1-row call and in a verify can differ in the last bits (as
// any two bf16 forward shapes may). Split
// and merge as attend_rows_bf16's (below), with the partials kept lane-wise: acc [d][16], m [16],
// l [16].
#define LANES 16
#define LANES_FROM 8   // queries per kv head (rows x heads per kv head) from which this path is used

// The softmax of one task's scores in lanes, sc [key][lane] in place: scaled, causally masked (key
// j0 + j is in lane's row r's past iff j0 + j - start <= r), exponentiated from the lane's max.
// Returns the lanes' max m and sum l. A lane with no key in this chunk keeps m = -inf (its weight
// at the merge is 0), its exps taken from 0.
static inline void lanes_softmax(float *sc, int64_t nk, __m512i row, int64_t j0, int64_t start, float scale,
                                 __m512 *m_out, __m512 *l_out) {
    const __m512 sv = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    __m512 m = ninf;
    for (int64_t j = 0; j < nk; j++) {
        __m512 s = _mm512_mul_ps(_mm512_load_ps(sc + j * LANES), sv);
        if (j0 + j > start)
            s = _mm512_mask_blend_ps(_mm512_cmp_epi32_mask(row, _mm512_set1_epi32((int)(j0 + j - start)), _MM_CMPINT_NLT),
                                     ninf, s);
        _mm512_store_ps(sc + j * LANES, s);
        m = _mm512_max_ps(m, s);
    }
    const __m512 m0 = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m, ninf, _CMP_EQ_OQ), m, _mm512_setzero_ps());
    __m512 l = _mm512_setzero_ps();
    for (int64_t j = 0; j < nk; j++) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_load_ps(sc + j * LANES), m0));
        _mm512_store_ps(sc + j * LANES, e);
        l = _mm512_add_ps(l, e);
    }
    *m_out = m;
    *l_out = l;
}

// One task: kv head g, keys [j0, j0 + nk) of the cache, every block of 16 queries. qt: the
// queries in float32, [nkv][blocks][hd][16]; rows: each lane's row (padding lanes: a row that
// sees every key); parts: [nkv][chunks][blocks][(hd + 2) * 16].
static void attend_lanes_task(const float *qt, const int32_t *rows, const uint16_t *kc, const uint16_t *vc,
        float *parts, int64_t g, int64_t c, int64_t j0, int64_t nk, int64_t chunks, int64_t blocks,
        int64_t start, int64_t cap, int64_t hd, float scale) {
    const int64_t part = (hd + 2) * LANES;
    float kf[CHUNK * hd], vf[CHUNK * hd];   // hd <= 256: at most 128 KB of stack
    const uint16_t *kg = kc + (g * cap + j0) * hd, *vg = vc + (g * cap + j0) * hd;   // nk rows of hd: contiguous
    for (int64_t e = 0; e < nk * hd; e += 16) {
        _mm512_storeu_ps(kf + e, load16_bf16(kg + e));
        _mm512_storeu_ps(vf + e, load16_bf16(vg + e));
    }
    float sc[CHUNK * LANES] __attribute__((aligned(64)));
    for (int64_t b = 0; b < blocks; b++) {
        const float *q = qt + (g * blocks + b) * hd * LANES;
        const __m512i row = _mm512_loadu_si512(rows + b * LANES);
        int64_t j = 0;
        for (; j + 16 <= nk; j += 16) {   // 16 keys: 16 independent FMA chains
            __m512 a[16];
#pragma GCC unroll 16
            for (int u = 0; u < 16; u++) a[u] = _mm512_setzero_ps();
            const float *kj = kf + j * hd;
            for (int64_t d = 0; d < hd; d++) {
                const __m512 qd = _mm512_load_ps(q + d * LANES);
#pragma GCC unroll 16
                for (int u = 0; u < 16; u++) a[u] = _mm512_fmadd_ps(qd, _mm512_set1_ps(kj[u * hd + d]), a[u]);
            }
#pragma GCC unroll 16
            for (int u = 0; u < 16; u++) _mm512_store_ps(sc + (j + u) * LANES, a[u]);
        }
        for (; j < nk; j++) {
            __m512 a0 = _mm512_setzero_ps();
            for (int64_t d = 0; d < hd; d++) a0 = _mm512_fmadd_ps(_mm512_load_ps(q + d * LANES), _mm512_set1_ps(kf[j * hd + d]), a0);
            _mm512_store_ps(sc + j * LANES, a0);
        }
        __m512 m, l;
        lanes_softmax(sc, nk, row, j0, start, scale, &m, &l);
        float *pt = parts + ((g * chunks + c) * blocks + b) * part;
        for (int64_t d0 = 0; d0 < hd; d0 += 16) {   // acc[d][lane] = sum_j p[j][lane] v[j][d]
            __m512 a[16];
#pragma GCC unroll 16
            for (int u = 0; u < 16; u++) a[u] = _mm512_setzero_ps();
            for (j = 0; j < nk; j++) {
                const __m512 pj = _mm512_load_ps(sc + j * LANES);
                const float *vj = vf + j * hd + d0;
#pragma GCC unroll 16
                for (int u = 0; u < 16; u++) a[u] = _mm512_fmadd_ps(pj, _mm512_set1_ps(vj[u]), a[u]);
            }
#pragma GCC unroll 16
            for (int u = 0; u < 16; u++) _mm512_storeu_ps(pt + (d0 + u) * LANES, a[u]);
        }
        _mm512_storeu_ps(pt + hd * LANES, m);
        _mm512_storeu_ps(pt + (hd + 1) * LANES, l);
    }
}


// ------------------------------------------------------------------ attention in lanes, AMX
//
// Where the CPU has AMX-BF16, attend_lanes_task's two products run as tile multiplies on the bf16
// cache itself (no float32 copies of the chunk), 16 keys by 16 queries by 32 dims an instruction:
//     scores:  S^T [16 keys][16 queries] = K [16 keys][hd] . Q^T      (tile A: the cache's K rows
//              as they lie; tile B: the queries' dims in pairs, laid out once per call)
//     values:  O^T [16 dims][16 queries] += V^T [16 dims][32 keys] . P^T   (tile A: the chunk's V
//              transposed once per task; tile B: the probabilities in bf16, key pairs by query)
// S^T has attend_lanes_task's layout sc [key][lane] and O^T its parts' [d][lane], so the causal
// mask, the softmax and the merge are that function's, unchanged. What differs is the rounding:
// products of bf16 values summed in float32 in the tile unit's order (not the FMA chain's), and p
// rounded to bf16 before the value product (as flash-attention kernels do). Each output element
// is still its own sum, so a row's result does not depend on the other rows of its call. hd = 64.
#if defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define AMX_ATTENTION 1
// GCC's tile intrinsics are asm statements that do not tell the compiler what memory they read
// (tileloadd none, ldtilecfg only its first 8 bytes): a compiler barrier before each keeps the
// stores they read from being dropped or moved past them at -O3.
#define TILE_BARRIER() __asm__ volatile("" ::: "memory")
#define tile_load(t, base, stride) do { TILE_BARRIER(); _tile_loadd(t, base, stride); } while (0)
static int amx_attention = 0;

// Linux gives a process the AMX tile state only when it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without it the first tile instruction is an illegal instruction.
int attention_amx_enable(int on) {
    static int permitted = -1;
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    amx_attention = on && permitted;
    return amx_attention;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Every tile 16 rows of 64 bytes: 0-3 O^T (dims 0-15 .. 48-63), 4 S^T, 5 an A operand, 6-7 B operands.
static void amx_configure_attention(void) {
    struct tile_config cfg = {0};
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64;
    TILE_BARRIER();
    _tile_loadconfig(&cfg);
}

// r[i] (16 rows of 16 dwords) -> r[j] = column j: unpack pairs, then quads, then 4x4 of 128-bit lanes.
static inline void transpose16(__m512i *r) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {   // u[i + c], lane L: rows i..i+3 at column 4L + c
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i b0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), b1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
        const __m512i b2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44), b3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_i32x4(b0, b2, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(b0, b2, 0xDD);
        r[8 + c] = _mm512_shuffle_i32x4(b1, b3, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(b1, b3, 0xDD);
    }
}

// attend_lanes_task with tiles (hd = 64). qb: the queries as tile B, [nkv][blocks][2 halves of
// hd][16 dim pairs][16 lanes] dwords.
static void attend_lanes_task_amx(const uint32_t *qb, const int32_t *rows, const uint16_t *kc, const uint16_t *vc,
        float *parts, int64_t g, int64_t c, int64_t j0, int64_t nk, int64_t chunks, int64_t blocks,
        int64_t start, int64_t cap, float scale) {
    enum { HD = 64 };
    const int64_t part = (HD + 2) * LANES, halves = (nk + 31) / 32, kblocks = (nk + 15) / 16;
    const uint16_t *kg = kc + (g * cap + j0) * HD, *vg = vc + (g * cap + j0) * HD;
    amx_configure_attention();
    // V^T of the chunk as tile A operands: vt[half][dim tile][16 dims][16 key pairs] dwords, keys
    // past nk zero (their p is 0, but a cache's unused rows may hold anything, NaN included)
    uint32_t vt[2][4][16 * 16] __attribute__((aligned(64)));
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t h = 0; h < halves; h++) {
        __m512i y[4][16];   // y[dim tile][pair]: dims' (V[2i][d], V[2i + 1][d]) dwords
        for (int i = 0; i < 16; i++) {
            const int64_t j = 32 * h + 2 * i;
            __m512i a[2], b[2];
            for (int w = 0; w < 2; w++) {
                a[w] = j < nk ? _mm512_loadu_si512(vg + j * HD + 32 * w) : _mm512_setzero_si512();
                b[w] = j + 1 < nk ? _mm512_loadu_si512(vg + (j + 1) * HD + 32 * w) : _mm512_setzero_si512();
                y[2 * w][i] = _mm512_permutex2var_epi16(a[w], lo, b[w]);
                y[2 * w + 1][i] = _mm512_permutex2var_epi16(a[w], hi, b[w]);
            }
        }
        for (int dt = 0; dt < 4; dt++) {
            transpose16(y[dt]);
            for (int d = 0; d < 16; d++) _mm512_store_si512(vt[h][dt] + 16 * d, y[dt][d]);
        }
    }
    uint16_t kpad[16 * HD] __attribute__((aligned(64)));   // a last block of fewer than 16 keys, zero-filled
    float sc[CHUNK * LANES] __attribute__((aligned(64)));
    uint32_t pb[16 * 16] __attribute__((aligned(64)));
    for (int64_t b = 0; b < blocks; b++) {
        const uint32_t *q = qb + (g * blocks + b) * 2 * 256;
        const __m512i row = _mm512_loadu_si512(rows + b * LANES);
        for (int64_t kb = 0; kb < kblocks; kb++) {
            const uint16_t *k = kg + 16 * kb * HD;
            if (16 * kb + 16 > nk) {
                memset(kpad, 0, sizeof kpad);
                memcpy(kpad, k, (nk - 16 * kb) * HD * sizeof(uint16_t));
                k = kpad;
            }
            _tile_zero(4);
            tile_load(5, k, HD * 2);
            tile_load(6, q, 64);
            _tile_dpbf16ps(4, 5, 6);
            tile_load(5, k + 32, HD * 2);
            tile_load(7, q + 256, 64);
            _tile_dpbf16ps(4, 5, 7);
            _tile_stored(4, sc + 16 * kb * LANES, 64);
        }
        __m512 m, l;
        lanes_softmax(sc, nk, row, j0, start, scale, &m, &l);
        for (int64_t j = nk; j < 32 * halves; j++) _mm512_store_ps(sc + j * LANES, _mm512_setzero_ps());
        // O^T += V^T . P^T, half by half of the chunk's keys
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                               23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        for (int64_t h = 0; h < halves; h++) {
            for (int i = 0; i < 16; i++) {   // P^T pairs: lane n's (p[2i][n], p[2i + 1][n])
                const float *p = sc + (32 * h + 2 * i) * LANES;
                const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(p + LANES), _mm512_load_ps(p));
                _mm512_store_si512(pb + 16 * i, _mm512_permutexvar_epi16(pairs, both));
            }
            tile_load(6, pb, 64);
            tile_load(5, vt[h][0], 64);
            _tile_dpbf16ps(0, 5, 6);
            tile_load(5, vt[h][1], 64);
            _tile_dpbf16ps(1, 5, 6);
            tile_load(5, vt[h][2], 64);
            _tile_dpbf16ps(2, 5, 6);
            tile_load(5, vt[h][3], 64);
            _tile_dpbf16ps(3, 5, 6);
        }
        float *pt = parts + ((g * chunks + c) * blocks + b) * part;
        _tile_stored(0, pt, 64);
        _tile_stored(1, pt + 16 * LANES, 64);
        _tile_stored(2, pt + 32 * LANES, 64);
        _tile_stored(3, pt + 48 * LANES, 64);
        _mm512_storeu_ps(pt + HD * LANES, m);
        _mm512_storeu_ps(pt + (HD + 1) * LANES, l);
    }
    _tile_release();
}
#endif

// ------------------------------------------------------------------ attention, few queries, AVX-512
//
// Below LANES_FROM queries a kv head (a 1-row decode: 3 in SmolLM2; 2 rows: 6) the lanes above
// would mostly idle, and attend_chunk's 8-lane vectors spend ~120 instructions a key (the chunk
// converted through memory, then per query 8-lane FMAs, a horizontal sum per 8 keys, and the
// values converted again per query): at 1k cached keys the attention was ~1.8 ms of a ~9.6 ms
// one-row forward (one thread). Here, per task (kv head g, keys [j0, j0 + nk)):
//     scores:  per query and block of 16 keys, 16 dot products (with AVX512_BF16: vdpbf16ps
//              straight on the bf16 cache, hd / 32 each; else the chunk's keys converted to
//              float32 once into kf, hd / 16 FMAs each), then one transposing reduction
//              (reduce16) leaves the 16 scores in one vector;
//     softmax: 16 keys a vector, causal positions masked to -inf (their exp is exactly 0);
//     values:  each value row converted once in registers and multiplied into every query's
//              accumulator (e^(s - m) broadcast).
// Each query's sums run in the same order whatever the other queries are, so a row's result
// does not depend on the other rows of its call (tests/test_decode_ops.py). Measured against
// attend_chunk (bench/attention_probe.py, one thread, SmolLM2's shape): 1 row 1.3-1.5x faster over
// 128-2048 cached keys, 2 rows 1.2-1.3x.

// lane j of the result = the sum of a[j]'s 16 lanes (j = 0..15), in a fixed order of additions:
// pairs of 32-bit lanes, then of 64-bit lanes, then of 128-bit lanes, twice.
static inline __m512 reduce16(const __m512 *a) {
    __m512 s[8], u[4], w[2];
    for (int i = 0; i < 8; i++)   // 128-bit lane L: [x0+x2, y0+y2, x1+x3, y1+y3] of x = a[2i], y = a[2i+1]
        s[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {   // 128-bit lane L: lane L's partial sums of keys 4i..4i+3
        const __m512d x = _mm512_castps_pd(s[2 * i]), y = _mm512_castps_pd(s[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)     // [u0: L0+L1, u0: L2+L3, u1: L0+L1, u1: L2+L3]
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    // 128-bit lane i: keys 4i..4i+3, whole sums
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

#define FEW_QUERIES 8   // at most LANES_FROM - 1 queries take this path
#if defined(__AVX512BF16__)
#define DOT_BF16 1      // scores by vdpbf16ps straight from the bf16 cache (hd % 32 == 0)
#else
#define DOT_BF16 0
#endif

// One task of the few-query path: vecs = hd / 16 a constant at each call (always inlined). q bf16
// [t, nh, hd]; parts as attend_chunk writes them.
static inline __attribute__((always_inline)) void attend_few_task(const int64_t vecs, const uint16_t *q,
        const uint16_t *kc, const uint16_t *vc, float *parts, int64_t g, int64_t c, int64_t j0, int64_t nk,
        int64_t chunks, int64_t start, int64_t cap, int64_t nq, int64_t group, int64_t nh, float scale) {
    const int64_t hd = vecs * 16, part = hd + 2, blocks = (nk + 15) / 16;
    float p[FEW_QUERIES][CHUNK] __attribute__((aligned(64)));
    const uint16_t *kg = kc + (g * cap + j0) * hd, *vg = vc + (g * cap + j0) * hd;   // nk rows of hd
#if !DOT_BF16
    float kf[CHUNK * hd] __attribute__((aligned(64)));   // the chunk's keys in float32 (zero past nk)
    for (int64_t e = 0; e < nk * hd; e += 16) _mm512_store_ps(kf + e, load16_bf16(kg + e));
    for (int64_t e = nk * hd; e < blocks * 16 * hd; e += 16) _mm512_store_ps(kf + e, _mm512_setzero_ps());
#endif
    int64_t n[FEW_QUERIES], n_max = 0, first = -1;
    float m[FEW_QUERIES], l[FEW_QUERIES];
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t qi = 0; qi < nq; qi++) {
        const int64_t i = qi / group, h = g * group + qi % group;
        n[qi] = (start + i + 1 < j0 + nk ? start + i + 1 : j0 + nk) - j0;   // keys row i sees here
        if (n[qi] <= 0) {
            n[qi] = 0;
            memset(p[qi], 0, sizeof p[qi]);   // its weight at the merge is 0 (l = 0): no value counts
            m[qi] = -INFINITY;
            l[qi] = 0.0f;
            continue;
        }
        n_max = n[qi] > n_max ? n[qi] : n_max;
        if (first < 0) first = qi;
        __m512 mv = ninf;
#if DOT_BF16
        __m512bh qp[8];   // the query's bf16 pairs, 32 a vector
        for (int64_t d = 0; d < vecs / 2; d++) qp[d] = (__m512bh)_mm512_loadu_si512(q + (i * nh + h) * hd + 32 * d);
        const __m512 sv = _mm512_set1_ps(scale);
#else
        __m512 qv[16];
        for (int64_t d = 0; d < vecs; d++)
            qv[d] = _mm512_mul_ps(load16_bf16(q + (i * nh + h) * hd + 16 * d), _mm512_set1_ps(scale));
#endif
        for (int64_t b = 0; b < blocks; b++) {   // 16 keys' scores: 16 independent FMA chains
            __m512 a[16];
            // The first query's pass asks for this block's values (read after the scores) and the
            // next chunk's keys (the next task's, one thread taking the chunks in order): over a
            // long context the K/V come from L3 or memory, and the hardware prefetcher stops at
            // each 4 KB page (32 keys). Measured (one process, prefetch off/on interleaved, Xeon
            // with AMX, one thread, a training job on the other core): one row over 900 cached
            // keys 8.56 -> 8.02 ms a forward, 8 requests' rows 32.8 -> 30.2 ms; shared_step 8
            // streams 272 -> 282 tokens per CPU-second. (The same in the lanes path lost 1-2 %.)
            if (qi == first) {
                const char *vb = (const char *)(vg + b * 16 * hd), *kn = (const char *)(kg + (CHUNK + b * 16) * hd);
                for (int64_t e = 0; e < 32 * hd; e += 64) {
                    _mm_prefetch(vb + e, _MM_HINT_T0);
                    _mm_prefetch(kn + e, _MM_HINT_T0);
                }
            }
#if DOT_BF16
            const uint16_t *kb = kg + b * 16 * hd;
#pragma GCC unroll 16
            for (int u = 0; u < 16; u++) {
                a[u] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qp[0], (__m512bh)_mm512_loadu_si512(kb + u * hd));
                for (int64_t d = 1; d < vecs / 2; d++)
                    a[u] = _mm512_dpbf16_ps(a[u], qp[d], (__m512bh)_mm512_loadu_si512(kb + u * hd + 32 * d));
            }
            const __m512 r = _mm512_mul_ps(reduce16(a), sv);
#else
            const float *kb = kf + b * 16 * hd;
#pragma GCC unroll 16
            for (int u = 0; u < 16; u++) {
                a[u] = _mm512_mul_ps(qv[0], _mm512_load_ps(kb + u * hd));
                for (int64_t d = 1; d < vecs; d++) a[u] = _mm512_fmadd_ps(qv[d], _mm512_load_ps(kb + u * hd + 16 * d), a[u]);
            }
            const __m512 r = reduce16(a);
#endif
            const __mmask16 seen = _mm512_cmp_epi32_mask(lane, _mm512_set1_epi32((int)(n[qi] - 16 * b)), _MM_CMPINT_LT);
            const __m512 s = _mm512_mask_blend_ps(seen, ninf, r);
            _mm512_store_ps(p[qi] + 16 * b, s);
            mv = _mm512_max_ps(mv, s);
        }
        m[qi] = _mm512_reduce_max_ps(mv);
        const __m512 mq = _mm512_set1_ps(m[qi]);
        __m512 lv = _mm512_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {   // masked keys: exp(-inf) = 0
            const __m512 e = exp16(_mm512_sub_ps(_mm512_load_ps(p[qi] + 16 * b), mq));
            _mm512_store_ps(p[qi] + 16 * b, e);
            lv = _mm512_add_ps(lv, e);
        }
        l[qi] = _mm512_reduce_add_ps(lv);
    }
    // acc[qi] = sum_j p[qi][j] v[j], queries in groups whose accumulators fit in registers
    const int64_t per = vecs <= 4 ? 6 : vecs <= 8 ? 3 : 1;
    for (int64_t q0 = 0; q0 < nq; q0 += per) {
        const int64_t q1 = q0 + per < nq ? q0 + per : nq;
        __m512 acc[6][16];
        for (int64_t qi = q0; qi < q1; qi++)
            for (int64_t d = 0; d < vecs; d++) acc[qi - q0][d] = _mm512_setzero_ps();
        for (int64_t j = 0; j < n_max; j++) {
            __m512 vj[16];
            for (int64_t d = 0; d < vecs; d++) vj[d] = load16_bf16(vg + j * hd + 16 * d);
            for (int64_t qi = q0; qi < q1; qi++) {
                const __m512 pj = _mm512_set1_ps(p[qi][j]);   // 0 past a query's own keys
                for (int64_t d = 0; d < vecs; d++) acc[qi - q0][d] = _mm512_fmadd_ps(pj, vj[d], acc[qi - q0][d]);
            }
        }
        for (int64_t qi = q0; qi < q1; qi++) {
            float *pt = parts + ((g * chunks + c) * nq + qi) * part;
            for (int64_t d = 0; d < vecs; d++) _mm512_storeu_ps(pt + 16 * d, acc[qi - q0][d]);
            pt[hd] = m[qi];
            pt[hd + 1] = l[qi];
        }
    }
}

// attend_rows_bf16's attention (after rotary and the cache append) in lanes; q bf16 [t, nh, hd].
// attend_lanes' tasks by attend_lanes_task: the queries laid out in float32 lanes first.
static int lanes_tasks_fma(const uint16_t *q, const int32_t *rows, const uint16_t *kc, const uint16_t *vc,
        float *parts, int64_t nkv, int64_t chunks, int64_t blocks, int64_t group, int64_t nh, int64_t nq,
        int64_t start, int64_t end, int64_t cap, int64_t hd, float scale) {
    float *qt = aligned_alloc(64, nkv * blocks * hd * LANES * sizeof(float));   // a multiple of 64 bytes
    if (qt == NULL) return -1;
    for (int64_t g = 0; g < nkv; g++)   // qt[g][block][d][lane]: query (row i, head h) in float32
        for (int64_t qi = 0; qi < blocks * LANES; qi++) {
            float *dst = qt + ((g * blocks + qi / LANES) * hd) * LANES + qi % LANES;
            const uint16_t *src = q + ((qi / group) * nh + g * group + qi % group) * hd;
            for (int64_t d = 0; d < hd; d++) {
                const uint32_t bits = qi < nq ? (uint32_t)src[d] << 16 : 0;
                float f;
                memcpy(&f, &bits, sizeof f);
                dst[d * LANES] = f;
            }
        }
#pragma omp parallel for schedule(dynamic, 1) if (nkv * chunks > 1)
    for (int64_t task = 0; task < nkv * chunks; task++) {
        const int64_t g = task / chunks, c = task % chunks, j0 = c * CHUNK;
        const int64_t nk = (j0 + CHUNK < end ? j0 + CHUNK : end) - j0;
        attend_lanes_task(qt, rows, kc, vc, parts, g, c, j0, nk, chunks, blocks, start, cap, hd, scale);
    }
    free(qt);
    return 0;
}

#if defined(AMX_ATTENTION)
// attend_lanes' tasks by attend_lanes_task_amx (hd = 64): the queries laid out as its tile B first.
static int lanes_tasks_amx(const uint16_t *q, const int32_t *rows, const uint16_t *kc, const uint16_t *vc,
        float *parts, int64_t nkv, int64_t chunks, int64_t blocks, int64_t group, int64_t nh, int64_t nq,
        int64_t start, int64_t end, int64_t cap, float scale) {
    uint32_t *qb = aligned_alloc(64, nkv * blocks * 2 * 256 * sizeof(uint32_t));   // [g][block][half][pair][lane]
    if (qb == NULL) return -1;
    for (int64_t g = 0; g < nkv; g++)
        for (int64_t qi = 0; qi < blocks * LANES; qi++) {
            const uint32_t *src = (const uint32_t *)(q + ((qi / group) * nh + g * group + qi % group) * 64);
            uint32_t *dst = qb + (g * blocks + qi / LANES) * 512 + qi % LANES;
            for (int64_t kk = 0; kk < 32; kk++) dst[(kk / 16) * 256 + (kk % 16) * 16] = qi < nq ? src[kk] : 0;
        }
#pragma omp parallel for schedule(dynamic, 1) if (nkv * chunks > 1)
    for (int64_t task = 0; task < nkv * chunks; task++) {
        const int64_t g = task / chunks, c = task % chunks, j0 = c * CHUNK;
        const int64_t nk = (j0 + CHUNK < end ? j0 + CHUNK : end) - j0;
        attend_lanes_task_amx(qb, rows, kc, vc, parts, g, c, j0, nk, chunks, blocks, start, cap, scale);
    }
    free(qb);
    return 0;
}
#endif

static int attend_lanes(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, int64_t cap, int64_t start,
                        int64_t t, int64_t nh, int64_t nkv, int64_t hd, uint16_t *out) {
    const int64_t group = nh / nkv, nq = t * group, blocks = (nq + LANES - 1) / LANES;
    const int64_t end = start + t, chunks = (end + CHUNK - 1) / CHUNK, part = (hd + 2) * LANES;
    int32_t *rows = malloc(blocks * LANES * sizeof(int32_t));
    float *parts = malloc(nkv * chunks * blocks * part * sizeof(float));
    float *w = malloc(chunks * LANES * sizeof(float));
    if (rows == NULL || parts == NULL || w == NULL) {
        free(rows);
        free(parts);
        free(w);
        return -1;
    }
    for (int64_t qi = 0; qi < blocks * LANES; qi++) rows[qi] = qi < nq ? (int32_t)(qi / group) : INT32_MAX;
    const float scale = 1.0f / sqrtf((float)hd);
    int status;
#if defined(AMX_ATTENTION)
    if (amx_attention && hd == 64)
        status = lanes_tasks_amx(q, rows, kc, vc, parts, nkv, chunks, blocks, group, nh, nq, start, end, cap, scale);
    else
#endif
        status = lanes_tasks_fma(q, rows, kc, vc, parts, nkv, chunks, blocks, group, nh, nq, start, end, cap, hd, scale);
    if (status != 0) {
        free(rows);
        free(parts);
        free(w);
        return -1;
    }
    for (int64_t g = 0; g < nkv; g++)   // merge each query's partials (as attend_rows_bf16 does)
        for (int64_t b = 0; b < blocks; b++) {
            const float *p0 = parts + (g * chunks * blocks + b) * part;   // chunk c: p0 + c * blocks * part
            __m512 mx = _mm512_set1_ps(-INFINITY), l = _mm512_setzero_ps();
            for (int64_t c = 0; c < chunks; c++) mx = _mm512_max_ps(mx, _mm512_loadu_ps(p0 + c * blocks * part + hd * LANES));
            for (int64_t c = 0; c < chunks; c++) {
                const float *pt = p0 + c * blocks * part;
                const __m512 wc = exp16(_mm512_sub_ps(_mm512_loadu_ps(pt + hd * LANES), mx));
                _mm512_storeu_ps(w + c * LANES, wc);
                l = _mm512_fmadd_ps(wc, _mm512_loadu_ps(pt + (hd + 1) * LANES), l);
            }
            const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l);
            float o[256 * LANES];   // [d][lane]
            for (int64_t d = 0; d < hd; d++) {
                __m512 acc = _mm512_setzero_ps();
                for (int64_t c = 0; c < chunks; c++)
                    acc = _mm512_fmadd_ps(_mm512_loadu_ps(w + c * LANES), _mm512_loadu_ps(p0 + c * blocks * part + d * LANES), acc);
                _mm512_storeu_ps(o + d * LANES, _mm512_mul_ps(acc, inv));
            }
            for (int64_t lane = 0; lane < LANES && b * LANES + lane < nq; lane++) {
                const int64_t qi = b * LANES + lane, i = qi / group, h = g * group + qi % group;
                float row[256];
                for (int64_t d = 0; d < hd; d++) row[d] = o[d * LANES + lane];
                for (int64_t d = 0; d < hd; d += 8) store8_bf16(out + (i * nh + h) * hd + d, _mm256_loadu_ps(row + d));
            }
        }
    free(rows);
    free(parts);
    free(w);
    return 0;
}
#endif

// The rotary and cache append of attend_rows_bf16 (below): q [t, nh, hd] receives the rotated
// queries; the rotated keys and the values go into the layer's cache at positions start..start+t-1.
static void rotate_and_append(const uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, uint16_t *kc,
                              uint16_t *vc, int64_t cap, int64_t start, int64_t t, int64_t nh, int64_t nkv,
                              int64_t hd, uint16_t *q) {
    const int64_t width = (nh + 2 * nkv) * hd;
    for (int64_t i = 0; i < t; i++) {
        const uint16_t *row = qkv + i * width, *c = cos + i * hd, *s = sin + i * hd;
        for (int64_t h = 0; h < nh; h++) rope(row + h * hd, c, s, hd, q + (i * nh + h) * hd);
        for (int64_t h = 0; h < nkv; h++) {
            rope(row + (nh + h) * hd, c, s, hd, kc + (h * cap + start + i) * hd);
            const uint16_t *v = row + (nh + nkv + h) * hd;
            uint16_t *dst = vc + (h * cap + start + i) * hd;
            for (int64_t d = 0; d < hd; d++) dst[d] = v[d];
        }
    }
}

// attend_rows_bf16's rotary and cache append without the attention, for keys and values that are
// all a row leaves behind (a drafter's KV-only catch-up): k, v bf16 [t, nkv hd] (their own
// projections), cos, sin [t, hd]; the rotated keys and the values go into the layer's cache at
// positions start..start+t-1, rotated as `rope` rotates (PyTorch's bits, as attend_rows_bf16's).
void rope_append_bf16(const uint16_t *k, const uint16_t *v, const uint16_t *cos, const uint16_t *sin, uint16_t *kc,
                      uint16_t *vc, int64_t cap, int64_t start, int64_t t, int64_t nkv, int64_t hd) {
    for (int64_t i = 0; i < t; i++)
        for (int64_t h = 0; h < nkv; h++) {
            rope(k + (i * nkv + h) * hd, cos + i * hd, sin + i * hd, hd, kc + (h * cap + start + i) * hd);
            memcpy(vc + (h * cap + start + i) * hd, v + (i * nkv + h) * hd, hd * sizeof(uint16_t));
        }
}

// Does a call with nq queries per kv head take the lanes path (attend_lanes)?
static inline int takes_lanes(int64_t nq) {
#if defined(__AVX512F__)
    return nq >= LANES_FROM;
#else
    (void)nq;
    return 0;
#endif
}

// One task of attend_rows_bf16's other paths: kv head g, keys [j0, j0 + nk) of the cache kc, vc
// (capacity cap), the partial softmax of each of the nq queries of q into parts.
static void attend_task(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, int64_t cap, float *parts,
                        int64_t g, int64_t c, int64_t j0, int64_t nk, int64_t chunks, int64_t start, int64_t nq,
                        int64_t group, int64_t nh, int64_t hd, float scale) {
#if defined(__AVX512F__)
    if (hd % (DOT_BF16 ? 32 : 16) == 0 && nq <= FEW_QUERIES) {
        if (hd == 64) attend_few_task(4, q, kc, vc, parts, g, c, j0, nk, chunks, start, cap, nq, group, nh, scale);
        else if (hd == 128) attend_few_task(8, q, kc, vc, parts, g, c, j0, nk, chunks, start, cap, nq, group, nh, scale);
        else attend_few_task(hd / 16, q, kc, vc, parts, g, c, j0, nk, chunks, start, cap, nq, group, nh, scale);
        return;
    }
#endif
    float kf[CHUNK * hd], vf[CHUNK * hd];  // hd <= 256: at most 128 KB of stack
    for (int64_t j = 0; j < nk; j++)
        for (int64_t d = 0; d < hd; d += 8) {
            _mm256_storeu_ps(kf + j * hd + d, load8_bf16(kc + (g * cap + j0 + j) * hd + d));
            _mm256_storeu_ps(vf + j * hd + d, load8_bf16(vc + (g * cap + j0 + j) * hd + d));
        }
    if (hd == 64) attend_chunk(8, q, kf, vf, parts, g, c, j0, nk, chunks, start, nq, group, nh, scale);
    else if (hd == 128) attend_chunk(16, q, kf, vf, parts, g, c, j0, nk, chunks, start, nq, group, nh, scale);
    else attend_chunk(hd / 8, q, kf, vf, parts, g, c, j0, nk, chunks, start, nq, group, nh, scale);
}

// Merge each query's partials (attend_task's) into out bf16 [t, nh hd].
static void merge_parts(const float *parts, int64_t nkv, int64_t chunks, int64_t nq, int64_t group, int64_t nh,
                        int64_t hd, uint16_t *out) {
    const int64_t vecs = hd / 8, part = hd + 2;
    for (int64_t g = 0; g < nkv; g++)
        for (int64_t qi = 0; qi < nq; qi++) {
            const int64_t i = qi / group, h = g * group + qi % group;
            float mx = -INFINITY;
            for (int64_t c = 0; c < chunks; c++) {
                const float mc = parts[((g * chunks + c) * nq + qi) * part + hd];
                mx = mc > mx ? mc : mx;
            }
            __m256 acc[32];
            for (int64_t d = 0; d < vecs; d++) acc[d] = _mm256_setzero_ps();
            float l = 0.0f;
            for (int64_t c = 0; c < chunks; c++) {
                const float *pt = parts + ((g * chunks + c) * nq + qi) * part;
                if (pt[hd + 1] == 0.0f) continue;
                const float w = expf(pt[hd] - mx);
                l += w * pt[hd + 1];
                for (int64_t d = 0; d < vecs; d++) acc[d] = _mm256_fmadd_ps(_mm256_set1_ps(w), _mm256_loadu_ps(pt + 8 * d), acc[d]);
            }
            const __m256 inv = _mm256_set1_ps(1.0f / l);
            for (int64_t d = 0; d < vecs; d++) store8_bf16(out + (i * nh + h) * hd + 8 * d, _mm256_mul_ps(acc[d], inv));
        }
}

// For t new rows at positions start..start+t-1 (their q/k/v projections stacked, qkv bf16
// [t, (nh + 2 nkv) hd]: q heads, k heads, v heads): rotate q and k (cos, sin bf16 [t, hd], the
// rows' own positions), write k and v into the layer's cache (k, v bf16 [nkv, cap, hd]) at
// start.., and attend causally: row i's query heads over keys 0..start+i of their kv head
// (head h reads kv head h / (nh / nkv)), scale 1/sqrt(hd), softmax in float32. out bf16 [t, nh hd].
//
// Split as flash-decoding splits it: a task is one kv head and a chunk of CHUNK keys; for each of
// its queries (every row, every head of the group) it leaves a partial softmax (max m, sum l of
// e^(s - m), and acc = sum e^(s - m) v); the partials of a query merge at the end:
//     out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c,   M = max_c m_c.
// Returns 0, or -1 if the scratch could not be allocated.
int attend_rows_bf16(const uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, uint16_t *kc, uint16_t *vc,
                     int64_t cap, int64_t start, int64_t t, int64_t nh, int64_t nkv, int64_t hd, uint16_t *out) {
    const int64_t group = nh / nkv, end = start + t;
    const int64_t chunks = (end + CHUNK - 1) / CHUNK, nq = t * group;  // queries per kv head
    const int64_t part = hd + 2;                                      // acc[hd], m, l
    uint16_t *q = malloc(t * nh * hd * sizeof(uint16_t));
    if (q == NULL) return -1;
    rotate_and_append(qkv, cos, sin, kc, vc, cap, start, t, nh, nkv, hd, q);
#if defined(__AVX512F__)
    if (takes_lanes(nq)) {
        const int status = attend_lanes(q, kc, vc, cap, start, t, nh, nkv, hd, out);
        free(q);
        return status;
    }
#endif
    float *parts = malloc(nkv * chunks * nq * part * sizeof(float));
    if (parts == NULL) {
        free(q);
        return -1;
    }
    const float scale = 1.0f / sqrtf((float)hd);
#pragma omp parallel for schedule(dynamic, 1) if (nkv * chunks > 1)
    for (int64_t task = 0; task < nkv * chunks; task++) {
        const int64_t g = task / chunks, c = task % chunks, j0 = c * CHUNK;
        const int64_t nk = (j0 + CHUNK < end ? j0 + CHUNK : end) - j0;
        attend_task(q, kc, vc, cap, parts, g, c, j0, nk, chunks, start, nq, group, nh, hd, scale);
    }
    merge_parts(parts, nkv, chunks, nq, group, nh, hd, out);
    free(q);
    free(parts);
    return 0;
}

// attend_rows_bf16 for the rows of several requests in one layer ("segments" s = 0..nseg-1: rows[s]
// rows at positions start[s].., the layer's caches kc[s], vc[s] [nkv, cap[s], hd]; qkv and out hold
// the segments' rows one after another), where requests share a cached prefix: segment s's first
// shared[s] keys (a multiple of CHUNK, at most start[s]) are bit for bit those of segment lead[s]'s
// cache (both copied them from one prefix-cache entry; lead[s] = s and shared[s] = 0 where none).
//
// Why: over a long cached context one query row's attention waits on memory more than it computes
// (SmolLM2, 1k keys: ~39 us a layer with the layer's K/V in L2, ~100 us inside a forward of
// several requests, whose 30 layers' caches do not fit there). Agent requests mostly share their
// system prompt and tools; here each shared chunk is read from the lead's cache for every segment
// that shares it, one segment after another, so it comes from memory once. A segment's queries go
// through attend_task with the same arguments as in its own attend_rows_bf16 call (a chunk's keys
// are the same bits in either cache) and merge the same way: the output is the same bits as a call
// per segment. Segments that attend in lanes (nq >= LANES_FROM) make their own call.
// Returns 0, or -1 if scratch could not be allocated.
int attend_segments_bf16(const uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, int64_t nseg,
                         const int64_t *rows, const int64_t *start, const int64_t *cap, uint16_t *const *kc,
                         uint16_t *const *vc, const int64_t *lead, const int64_t *shared, int64_t nh, int64_t nkv,
                         int64_t hd, uint16_t *out) {
    const int64_t width = (nh + 2 * nkv) * hd, group = nh / nkv, part = hd + 2;
    int64_t first[nseg], chunks[nseg], own_from[nseg], parts_at[nseg + 1], q_at[nseg + 1];
    int64_t ntasks = 0, nshared = 0;   // own tasks (segment, g, chunk); shared tasks (lead, g, chunk)
    int status = 0;
    parts_at[0] = q_at[0] = 0;
    for (int64_t s = 0, r = 0; s < nseg; r += rows[s], s++) {
        const int64_t nq = rows[s] * group, lanes = takes_lanes(nq);
        first[s] = r;
        chunks[s] = (start[s] + rows[s] + CHUNK - 1) / CHUNK;
        own_from[s] = lanes ? 0 : shared[s] / CHUNK;   // chunks below this: read in the shared tasks
        parts_at[s + 1] = parts_at[s] + (lanes ? 0 : nkv * chunks[s] * nq * part);
        q_at[s + 1] = q_at[s] + rows[s] * nh * hd;
        if (!lanes) ntasks += nkv * (chunks[s] - own_from[s]);
    }
    for (int64_t s = 0; s < nseg; s++)   // a lead's shared chunks: as far as its followers share
        if (lead[s] == s) {
            int64_t n = 0;
            for (int64_t f = 0; f < nseg; f++)
                if (lead[f] == s && own_from[f] > n) n = own_from[f];
            nshared += nkv * n;
        }
    uint16_t *q = malloc(q_at[nseg] * sizeof(uint16_t));
    float *parts = malloc((parts_at[nseg] > 0 ? parts_at[nseg] : 1) * sizeof(float));
    int64_t *task = malloc(3 * (ntasks + nshared + 1) * sizeof(int64_t));
    if (q == NULL || parts == NULL || task == NULL) {
        free(q);
        free(parts);
        free(task);
        return -1;
    }
    for (int64_t s = 0; s < nseg; s++)
        rotate_and_append(qkv + first[s] * width, cos + first[s] * hd, sin + first[s] * hd, kc[s], vc[s], cap[s],
                          start[s], rows[s], nh, nkv, hd, q + q_at[s]);
    int64_t n = 0;
    for (int64_t s = 0; s < nseg; s++) {   // shared tasks first: (lead, g, c) for each chunk its group shares
        if (lead[s] != s) continue;
        int64_t reach = 0;
        for (int64_t f = 0; f < nseg; f++)
            if (lead[f] == s && own_from[f] > reach) reach = own_from[f];
        for (int64_t g = 0; g < nkv; g++)
            for (int64_t c = 0; c < reach; c++, n++) task[3 * n] = s, task[3 * n + 1] = g, task[3 * n + 2] = c;
    }
    for (int64_t s = 0; s < nseg; s++) {   // then each segment's own chunks
        if (takes_lanes(rows[s] * group)) continue;
        for (int64_t g = 0; g < nkv; g++)
            for (int64_t c = own_from[s]; c < chunks[s]; c++, n++)
                task[3 * n] = nseg + s, task[3 * n + 1] = g, task[3 * n + 2] = c;
    }
    const float scale = 1.0f / sqrtf((float)hd);
#pragma omp parallel for schedule(dynamic, 1) if (n > 1)
    for (int64_t i = 0; i < n; i++) {
        const int64_t who = task[3 * i], g = task[3 * i + 1], c = task[3 * i + 2], j0 = c * CHUNK;
        if (who < nseg) {   // chunk c of lead `who`'s cache, for every segment that shares it
            for (int64_t s = 0; s < nseg; s++)
                if (lead[s] == who && c < own_from[s])
                    attend_task(q + q_at[s], kc[who], vc[who], cap[who], parts + parts_at[s], g, c, j0, CHUNK,
                                chunks[s], start[s], rows[s] * group, group, nh, hd, scale);
        } else {
            const int64_t s = who - nseg, end = start[s] + rows[s];
            const int64_t nk = (j0 + CHUNK < end ? j0 + CHUNK : end) - j0;
            attend_task(q + q_at[s], kc[s], vc[s], cap[s], parts + parts_at[s], g, c, j0, nk, chunks[s], start[s],
                        rows[s] * group, group, nh, hd, scale);
        }
    }
    for (int64_t s = 0; s < nseg; s++) {
        uint16_t *o = out + first[s] * nh * hd;
#if defined(__AVX512F__)
        if (takes_lanes(rows[s] * group)) {
            status |= attend_lanes(q + q_at[s], kc[s], vc[s], cap[s], start[s], rows[s], nh, nkv, hd, o);
            continue;
        }
#endif
        merge_parts(parts + parts_at[s], nkv, chunks[s], rows[s] * group, group, nh, hd, o);
    }
    free(q);
    free(parts);
    free(task);
    return status == 0 ? 0 : -1;
}

// ------------------------------------------------------------------ prompt lookup's search

// Prompt lookup's match in one pass over the verified context ids[0..n-1] and the pending token
// ids[n] (NgramDrafter.match): the longest suffix n-gram of ids[0..n] (min_ngram..max_ngram
// tokens) that occurred earlier, at its most recent occurrence, and how far back the copy agrees.
// Scanning back from the end, an occurrence ending at e < n matches L tokens (ids[e - i] ==
// ids[n - i] for i < L); the first e whose L reaches a size is that size's most recent occurrence,
// so one pass finds every size's and stops at the first of max_ngram tokens. A few ns a position
// where a dict of every n-gram, fed each round's tokens in Python, took ~40 us of every round.
// out[0] = size (0: no match), out[1] = start (the token after the occurrence), out[2] = the copy
// run (NgramDrafter.copy_run: tokens up to the pending one equal to those before start, at most
// longest_run; 0 without a match).
void ngram_match_i64(const int64_t *ids, int64_t n, int64_t min_ngram, int64_t max_ngram,
                     int64_t longest_run, int64_t *out) {
    out[0] = out[1] = out[2] = 0;
    if (max_ngram > n) max_ngram = n;   // the suffix itself needs max_ngram - 1 tokens before ids[n]
    if (min_ngram < 1) min_ngram = 1;
    if (max_ngram < min_ngram) return;
    const int64_t pending = ids[n];
    int64_t found = 0, end = -1;         // the longest size found so far and its occurrence's end
    for (int64_t e = n - 1; e >= min_ngram - 1 && found < max_ngram; e--) {
        if (ids[e] != pending) continue;
        int64_t len = 1;
        while (len < max_ngram && e - len >= 0 && ids[e - len] == ids[n - len]) len++;
        if (len >= min_ngram && len > found) found = len, end = e;   // later e: older occurrences
    }
    if (!found) return;
    const int64_t start = end + 1;
    int64_t run = 1;   // the pending token itself
    while (run < longest_run && start - 1 - run >= 0 && ids[start - 1 - run] == ids[n - run]) run++;
    out[0] = found, out[1] = start, out[2] = run;
}

// ------------------------------------------------------------------ the router's softmax statistics

// Entropy (nats) and top-1 probability of softmax(l) over n float32 logits. With m = max l,
// e_i = e^(l_i - m), Z = sum e_i:
//     H = log Z - sum e_i (l_i - m) / Z,   top1 = 1 / Z.
// -inf logits (masked tokens) count as probability 0. out[0] = H, out[1] = top1.
//
// The row is cut into SOFTMAX_SPANS fixed spans, each reduced on its own (its max m_s, then
// Z_s = sum e^(l_i - m_s) and S_s = sum e^(l_i - m_s) (l_i - m_s)) by whichever thread of the
// pool takes it, and merged in span order with w_s = e^(m_s - m):
//     Z = sum_s w_s Z_s,   sum e_i (l_i - m) = sum_s w_s (S_s + (m_s - m) Z_s),
// so the result is the same bits on any thread count. A span with only -inf logits adds nothing.
// (49,152 logits: ~25 us on one thread with 8 lanes; as PyTorch ops over the same row, woken
// thread pool and all, it measured ~200 us of a ~6 ms round.)
#define SOFTMAX_SPANS 8

// Cephes' exp2f polynomial for 2^f, f in [-0.5, 0.5], highest power first (Horner): the one
// definition both vector widths of exp_nonpositive below evaluate, in the same order
static const float EXP2_POLY[] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                                  5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f};
#define EXP2_TERMS (int)(sizeof EXP2_POLY / sizeof EXP2_POLY[0])

#if defined(__AVX512F__)
// e^t for t in [-87.3, 0] (softmax_span clamps there), 16 lanes: 2^(t log2 e) = 2^i 2^f with i
// the nearest integer and f in [-0.5, 0.5], 2^f by EXP2_POLY (relative error ~2e-7 over f's
// range; t log2 e rounds off ~6e-8 |t log2 e| of f, so terms far below the top lose a few more
// bits of a value that is then < 2^-60 of it), 2^i by scalef: 10 instructions a vector where
// exp16's range reduction and exponent assembly take 17 (softmax_stats_f32 of a 49,152-logit row,
// one thread, Sapphire Rapids: 16.7 -> 11.6 us with the row in cache, 33.9 -> 27.7 us cold).
// Not exp16 with other constants: exp16 must take any x (attention scores), this only t <= 0.
static inline __m512 exp16_nonpositive(__m512 t) {
    const __m512 x = _mm512_mul_ps(t, _mm512_set1_ps(1.44269504088896341f));
    const __m512 i = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, i);
    __m512 p = _mm512_set1_ps(EXP2_POLY[0]);
    for (int j = 1; j < EXP2_TERMS; j++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_POLY[j]));
    return _mm512_scalef_ps(p, i);
}
#else
// exp16_nonpositive in 8 lanes: 2^i by adding i to p's exponent bits (AVX2 has no scalef; p lies in
// [0.7, 1.5] and i >= -126 over t's range, so the sum is a normal float). 12 instructions a vector
// where exp8 takes 20: softmax_stats_f32 of a 49,152-logit row, one thread, AMD EPYC Zen 3, 29 ->
// 19 us with the row in cache, 52 -> 36 us cold.
static inline __m256 exp8_nonpositive(__m256 t) {
    const __m256 x = _mm256_mul_ps(t, _mm256_set1_ps(1.44269504088896341f));
    const __m256 i = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, i);
    __m256 p = _mm256_set1_ps(EXP2_POLY[0]);
    for (int j = 1; j < EXP2_TERMS; j++) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_POLY[j]));
    const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(i), 23);
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}
#endif

static void softmax_span(const float *l, int64_t n, float *stats) {
    float m = -INFINITY, z = 0.0f, s = 0.0f;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= n; i += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(l + i));
    m = _mm512_reduce_max_ps(mx);
#else
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= n; i += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(l + i));
    {
        float lanes[8];
        _mm256_storeu_ps(lanes, mx);
        for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
    }
#endif
    for (int64_t j = i; j < n; j++) m = l[j] > m ? l[j] : m;
    if (m == -INFINITY) {   // every logit masked: nothing to add (and l - m would be NaN)
        stats[0] = m, stats[1] = 0.0f, stats[2] = 0.0f;
        return;
    }
    i = 0;
    // t >= -87.3: the exp gives 0 below it, and 0 * t stays 0 where l = -inf
#if defined(__AVX512F__)
    const __m512 mv = _mm512_set1_ps(m), lo = _mm512_set1_ps(-87.3f);
    __m512 z16 = _mm512_setzero_ps(), s16 = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512 t = _mm512_max_ps(_mm512_sub_ps(_mm512_loadu_ps(l + i), mv), lo);
        const __m512 e = exp16_nonpositive(t);
        z16 = _mm512_add_ps(z16, e);
        s16 = _mm512_fmadd_ps(e, t, s16);
    }
    z = _mm512_reduce_add_ps(z16), s = _mm512_reduce_add_ps(s16);
#else
    const __m256 mv = _mm256_set1_ps(m), lo = _mm256_set1_ps(-87.3f);
    __m256 z8 = _mm256_setzero_ps(), s8 = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 t = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(l + i), mv), lo);
        const __m256 e = exp8_nonpositive(t);
        z8 = _mm256_add_ps(z8, e);
        s8 = _mm256_fmadd_ps(e, t, s8);
    }
    z = hsum(z8), s = hsum(s8);
#endif
    for (; i < n; i++) {
        const float t = l[i] - m < -87.3f ? -87.3f : l[i] - m;   // 0 * t, not 0 * -inf
        const float e = t <= -87.3f ? 0.0f : expf(t);
        z += e;
        s += e * t;
    }
    stats[0] = m, stats[1] = z, stats[2] = s;
}

void softmax_stats_f32(const float *l, int64_t n, float *out) {
    float stats[SOFTMAX_SPANS][3];
    const int64_t span = (n + SOFTMAX_SPANS - 1) / SOFTMAX_SPANS;
#pragma omp parallel for schedule(static) if (n >= 16384)
    for (int k = 0; k < SOFTMAX_SPANS; k++) {
        const int64_t a = k * span < n ? k * span : n, b = a + span < n ? a + span : n;
        softmax_span(l + a, b - a, stats[k]);
    }
    float m = -INFINITY, z = 0.0f, s = 0.0f;
    for (int k = 0; k < SOFTMAX_SPANS; k++) m = stats[k][0] > m ? stats[k][0] : m;
    for (int k = 0; k < SOFTMAX_SPANS; k++) {
        if (stats[k][1] == 0.0f) continue;
        const float d = stats[k][0] - m, w = expf(d);
        z += w * stats[k][1];
        s += w * (stats[k][2] + d * stats[k][1]);
    }
    out[0] = logf(z) - s / z;
    out[1] = 1.0f / z;
}

// ------------------------------------------------------------------ the LM head's top candidates

// out[r, 0..k-1] = the indices of the k largest of row r of x [rows, n] float32, largest first;
// equal values rank by the lower index (NaN never ranks). TargetModel.logits recomputes these
// candidates' logits in float32: torch.topk took ~115 us for one 49,152-logit row on one thread
// (an AMD EPYC, Zen 4), about as long as the rest of the LM head's refinement; here the row is one
// pass of compares against the k-th value so far (16 lanes a step on AVX-512, else 8), and only
// the few values that beat it are inserted into the sorted k. k <= 64.
void topk_rows_f32(const float *x, int64_t rows, int64_t n, int64_t k, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * n;
        float val[64];
        int64_t idx[64], have = 0;
        // insert (v, i), i past every index held: it goes after the values >= v (ties: lower index first)
#define TOPK_INSERT(v, i)                                                                        \
        do {                                                                                     \
            const float v_ = (v);                                                                \
            if (have == k && !(v_ > val[k - 1])) break;                                          \
            int64_t p_ = have < k ? have++ : k - 1;                                              \
            while (p_ > 0 && v_ > val[p_ - 1]) { val[p_] = val[p_ - 1]; idx[p_] = idx[p_ - 1]; p_--; } \
            val[p_] = v_;                                                                        \
            idx[p_] = (i);                                                                       \
        } while (0)
        int64_t j = 0;
        for (; j < n && have < k; j++)
            if (row[j] == row[j]) TOPK_INSERT(row[j], j);
#if defined(__AVX512F__)
        for (; j + 16 <= n; j += 16) {
            __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + j), _mm512_set1_ps(val[k - 1]), _CMP_GT_OQ);
            while (hit) {
                const int b = __builtin_ctz(hit);
                TOPK_INSERT(row[j + b], j + b);
                hit &= hit - 1;
            }
        }
#else
        for (; j + 8 <= n; j += 8) {
            int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + j), _mm256_set1_ps(val[k - 1]), _CMP_GT_OQ));
            while (hit) {
                const int b = __builtin_ctz(hit);
                TOPK_INSERT(row[j + b], j + b);
                hit &= hit - 1;
            }
        }
#endif
        for (; j < n; j++)
            if (row[j] > val[k - 1]) TOPK_INSERT(row[j], j);
#undef TOPK_INSERT
        for (int64_t i = 0; i < k; i++) out[r * k + i] = i < have ? idx[i] : 0;
    }
}

// TargetModel.logits' refinement in place: for each row r of logits [rows, V] float32 (the light
// LM head's), the k largest (topk_rows_f32's) become the float32 dot products of their dense
// weight rows w [V, H] bf16 with the row's final hidden state h [rows, H] bf16 (both exact in
// float32; each sum in 16 (8) lanes, then the lanes added in a fixed order: the same bits whatever
// the other rows). As PyTorch ops (topk, gather, einsum, scatter) this was ~0.3 ms a round; here a
// few us a row. k <= 64, H % 16 == 0.
void refine_top_f32(float *logits, int64_t rows, int64_t V, const uint16_t *h, const uint16_t *w, int64_t H,
                    int64_t k) {
    int64_t top[64];
    for (int64_t r = 0; r < rows; r++) {
        float *row = logits + r * V;
        topk_rows_f32(row, 1, V, k, top);
        const uint16_t *hr = h + r * H;
        for (int64_t i = 0; i < k; i++) {
            const uint16_t *wr = w + top[i] * H;
#if defined(__AVX512F__)
            __m512 acc = _mm512_setzero_ps();
            for (int64_t d = 0; d < H; d += 16) acc = _mm512_fmadd_ps(load16_bf16(wr + d), load16_bf16(hr + d), acc);
            row[top[i]] = _mm512_reduce_add_ps(acc);
#else
            __m256 acc = _mm256_setzero_ps();
            for (int64_t d = 0; d < H; d += 8) acc = _mm256_fmadd_ps(load8_bf16(wr + d), load8_bf16(hr + d), acc);
            row[top[i]] = hsum(acc);
#endif
        }
    }
}

// A grammar's allowed tokens as xgrammar packs them (`allowed`, int32 [rows, words]: bit b of word w
// allows token 32 w + b); tokens past 32 * words (a padded LM head) are never allowed. NULL: all are.
static inline uint32_t allowed_word(const int32_t *allowed, int64_t words, int64_t j) {
    return j / 32 < words ? (uint32_t)allowed[j / 32] : 0u;
}
static inline int is_allowed(const int32_t *allowed, int64_t words, int64_t j) {
    return allowed == NULL || ((allowed_word(allowed, words, j) >> (j % 32)) & 1u);
}
// x[j .. j + L) with the forbidden lanes at -inf (j a multiple of L, so within one word)
#if defined(__AVX512F__)
static inline __m512 load16_allowed(const float *row, int64_t j, const int32_t *allowed, int64_t words) {
    const __m512 v = _mm512_loadu_ps(row + j);
    if (allowed == NULL) return v;
    const __mmask16 k = (__mmask16)(allowed_word(allowed, words, j) >> (j % 32));
    return _mm512_mask_blend_ps(k, _mm512_set1_ps(-INFINITY), v);
}
#else
static inline __m256 load8_allowed(const float *row, int64_t j, const int32_t *allowed, int64_t words) {
    const __m256 v = _mm256_loadu_ps(row + j);
    if (allowed == NULL) return v;
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i byte = _mm256_set1_epi32((int)((allowed_word(allowed, words, j) >> (j % 32)) & 0xFFu));
    const __m256 lanes = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(byte, bit), bit));
    return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), v, lanes);
}
#endif

// out[r] = torch.argmax of row r of x [rows, n] float32: the first index of the largest value, or of
// the first NaN where the row has one (PyTorch's rule). The greedy verify's choices (sampling.py
// verify_greedy): torch.argmax took ~80 us a 49,152-logit row on one thread; here two vector
// passes (the max and whether any NaN, then the first index that holds it). With `allowed` (row r
// at allowed + r * words, see above) it is the argmax of the row with the forbidden tokens at
// -inf, as torch.argmax(x.masked_fill(~mask, -inf)) reads it, without writing that copy: unpacking
// a grammar's mask and masking a copy of the logits took ~0.4 ms a row on an AMD EPYC (Zen 3).
void argmax_rows_f32(const float *x, int64_t rows, int64_t n, const int32_t *allowed, int64_t words,
                     int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * n;
        const int32_t *ok = allowed != NULL ? allowed + r * words : NULL;
        float m = -INFINITY;
        int nan = 0;
        int64_t j = 0;
#if defined(__AVX512F__)
        __m512 mv = _mm512_set1_ps(-INFINITY);
        __mmask16 un = 0;
        for (; j + 16 <= n; j += 16) {
            const __m512 v = load16_allowed(row, j, ok, words);
            un |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            mv = _mm512_max_ps(mv, v);
        }
        m = _mm512_reduce_max_ps(mv);
        nan = un != 0;
#else
        __m256 mv = _mm256_set1_ps(-INFINITY), un = _mm256_setzero_ps();
        for (; j + 8 <= n; j += 8) {
            const __m256 v = load8_allowed(row, j, ok, words);
            un = _mm256_or_ps(un, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            mv = _mm256_max_ps(mv, v);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, mv);
        for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
        nan = _mm256_movemask_ps(un) != 0;
#endif
        for (; j < n; j++) {
            const float v = is_allowed(ok, words, j) ? row[j] : -INFINITY;
            nan |= v != v;
            m = v > m ? v : m;
        }
        // the first index holding m (or a NaN): 16 (8) lanes a compare, then the first set bit
        int64_t at = 0;
#if defined(__AVX512F__)
        const __m512 mm = _mm512_set1_ps(m);
        for (; at + 16 <= n; at += 16) {
            const __m512 v = load16_allowed(row, at, ok, words);
            const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, mm, _CMP_EQ_OQ);
            if (hit) {
                at += __builtin_ctz(hit);
                break;
            }
        }
#else
        const __m256 mm = _mm256_set1_ps(m);
        for (; at + 8 <= n; at += 8) {
            const __m256 v = load8_allowed(row, at, ok, words);
            const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, mm, _CMP_EQ_OQ));
            if (hit) {
                at += __builtin_ctz(hit);
                break;
            }
        }
#endif
        while (at < n) {
            const float v = is_allowed(ok, words, at) ? row[at] : -INFINITY;
            if (nan ? v != v : v == m) break;
            at++;
        }
        out[r] = at < n ? at : 0;
    }
}

// ------------------------------------------------------------------ the learned router's MLP

// Four independent sums: one would chain every FMA on the last one's latency (~4 cycles each),
// which was most of a hot router MLP call.
static float dot_f32(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float t = hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    for (; i < n; i++) t += a[i] * b[i];
    return t;
}

// out[O] = sigmoid(w2 @ gelu(w1 @ x + b1) + b2), float32 (router_mlp.py's
// RouterMLP.rates: 588 -> 72 -> K; the exact, erf GELU). w1 [Hd, F], w2 [O, Hd] row-major;
// Hd <= 1024.
void mlp2_f32(const float *x, int64_t F, const float *w1, const float *b1, int64_t Hd, const float *w2,
              const float *b2, int64_t O, float *out) {
    float h[1024];
    // the hidden rows over the pool's threads (each row one thread's dot: the same bits on any
    // thread count): in a round the weights come from memory, and two cores read them faster
#pragma omp parallel for schedule(static) if (Hd * F >= 32768)
    for (int64_t j = 0; j < Hd; j++) {
        const float v = dot_f32(w1 + j * F, x, F) + b1[j];
        h[j] = 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    }
    for (int64_t o = 0; o < O; o++) out[o] = 1.0f / (1.0f + expf(-(dot_f32(w2 + o * Hd, h, Hd) + b2[o])));
}

// mlp2_f32 for x = [hidden, scalars] without building x outside: hidden [d] read where it lies,
// bf16 (hidden_bf16 != 0; exact in float32) or float32, then the ns scalars: a serving round's
// call (router_mlp.RouterMLP.rates_at), the same bits as mlp2_f32 on the concatenated row.
void mlp2_at_f32(const void *hidden, int64_t d, int hidden_bf16, const float *scalars, int64_t ns,
                 const float *w1, const float *b1, int64_t Hd, const float *w2, const float *b2, int64_t O,
                 float *out) {
    float x[d + ns];
    if (hidden_bf16) {
        const uint16_t *hb = hidden;
        int64_t i = 0;
        for (; i + 8 <= d; i += 8) _mm256_storeu_ps(x + i, load8_bf16(hb + i));
        for (; i < d; i++) {
            const uint32_t bits = (uint32_t)hb[i] << 16;
            memcpy(x + i, &bits, sizeof bits);
        }
    } else {
        memcpy(x, hidden, d * sizeof(float));
    }
    memcpy(x + d, scalars, ns * sizeof(float));
    mlp2_f32(x, d + ns, w1, b1, Hd, w2, b2, O, out);
}

#if !defined(AMX_ATTENTION)
int attention_amx_enable(int on) { (void)on; return 0; }
#endif

// ------------------------------------------------------------------ the router's round

// A request's routing round (router.py, the `cost` and `learned` policies, a request alone) in one
// call: the target's entropy and top-1 probability, the learned MLP's scalars and forward, every
// (drafter, k) candidate's expected tokens g and round time t, and argmax g / t ** alpha. In Python
// the same round is ~100 interpreter calls on the caches a target forward has just evicted, ~3 % of
// a round; router.py stays the definition (router_native.py's tests pin this to it, bit for bit:
// the acceptance arithmetic is in double as Python's floats are, and -std=c11 keeps the compiler
// from fusing its multiply-adds).
//
// Acceptance state (acceptance.py's AcceptanceModel, PositionRates): per drafter, decayed
// per-position rates over all situations and per situation, shrunk towards a prior.
#define RT_K 32   // positions kept per rates (the longest routed draft is 15)
#define RT_S 8    // situations per drafter (top-1 bins: 4; prompt-lookup match sizes: <= 4; copy runs: 5)
#define RT_D 8    // drafters

typedef struct {
    double rate[RT_K], weight[RT_K];
    int64_t n;
} rt_rates;

typedef struct {
    rt_rates overall[RT_D];
    rt_rates by[RT_D][RT_S];
    double prior_rate[RT_D];          // PRIOR_RATE per drafter
    double measured[RT_S][RT_K];      // a measured prior per situation (the copy prior), else none
    int64_t measured_n[RT_S];
} rt_acceptance;

typedef struct {
    int64_t n_routed;                 // the routed drafters first (Router.drafters order), then those only the MLP's scalars name
    int64_t lookup;                   // prompt lookup's index among the routed, -1: not routed
    int64_t min_ngram, max_ngram, longest_run;   // its search (NgramConfig)
    int64_t copy_run_bins[4];         // acceptance.COPY_RUN_BINS: a copy's situation by its run
    int64_t by_match[RT_D];           // 1: the drafter's situation is the match size (prompt lookup), else top-1 bins
    int64_t route_len[RT_D];          // most draft tokens per routed drafter
    int64_t head_offset[RT_D], head_len[RT_D];   // the MLP's outputs per drafter (head_len 0: no head)
    int64_t n_feat, feat_drafter[RT_D], feat_k[RT_D];   // the MLP's per-drafter scalars, in its config's order
    const float *w1, *b1, *w2, *b2;   // the folded MLP (NULL: the cost policy)
    int64_t d, hidden_width, outputs;
    double top1_bins[3];
    double prior_weight, decay, min_seconds;
    double catch_up_share;            // CostModel.catch_up_share: a catch-up is priced at this share of its time
    int64_t seen_from;                // the prompt's length: no drafter's backlog reaches before it (Router.__init__)
} rt_config;

// A round's inputs beside the request's state: per routed drafter d, line[4 d ..] = its catch-up
// line's a and b (seconds for a backlog of x positions: a + b x, both 0 without one) and its draft
// line's a and b (drafting k tokens = catch-up + (a + b k): CostModel.drafting_coefficients), then
// line[4 D + d] = this request's calibration factor of its MLP predictions (< 0: none yet), D the
// routed drafters; seen[d]: the positions drafter d has seen (DrafterState.n_seen); verify[r]: the
// target's verify of r rows, r <= min(longest draft, limit) + 1.
// The pick goes to out: drafter (-1: the plain step), k, situation, g, t, the drafting part of t,
// the MLP's own g - 1 (NaN: none); then prompt lookup's search (ngram_match_i64's out: match size,
// start, copy run; 0 without it).
enum { RT_OUT_DRAFTER, RT_OUT_K, RT_OUT_SITUATION, RT_OUT_TOKENS, RT_OUT_SECONDS, RT_OUT_DRAFTING, RT_OUT_RAW,
       RT_OUT_MATCH, RT_OUT_START, RT_OUT_RUN, RT_OUT_N };

static void rt_shrunk(const rt_rates *r, const double *fallback, int64_t k, double weight, double *out) {
    for (int64_t i = 0; i < k; i++) {
        if (i < r->n) {
            const double w = r->weight[i];
            out[i] = (w * r->rate[i] + weight * fallback[i]) / (w + weight);
        } else {
            out[i] = fallback[i];
        }
    }
}

// AcceptanceModel._rates: p_1..p_k of drafter d in situation s
static void rt_rates_of(const rt_acceptance *m, const rt_config *c, int64_t d, int64_t s, int64_t k, double *out) {
    double prior[RT_K], overall[RT_K];
    if (m->measured_n[s] > 0) {   // past its last position the measured prior keeps its last rate
        for (int64_t i = 0; i < k; i++) prior[i] = m->measured[s][i < m->measured_n[s] ? i : m->measured_n[s] - 1];
        rt_shrunk(&m->by[d][s], prior, k, c->prior_weight, out);
        return;
    }
    for (int64_t i = 0; i < k; i++) prior[i] = m->prior_rate[d];
    rt_shrunk(&m->overall[d], prior, k, c->prior_weight, overall);
    rt_shrunk(&m->by[d][s], overall, k, c->prior_weight, out);
}

// expected_tokens_by_k: g[0..k], g(j) = 1 + sum_{i<=j} prod_{l<=i} p_l
static void rt_gains(const double *p, int64_t k, double *g) {
    double survive = 1.0;
    g[0] = 1.0;
    for (int64_t i = 0; i < k; i++) {
        survive *= p[i];
        g[i + 1] = g[i] + survive;
    }
}

static void rt_update_rates(rt_rates *r, int64_t k, int64_t accepted, double decay) {
    const int64_t upto = accepted + 1 < k ? accepted + 1 : k;
    for (int64_t i = 0; i < upto && i < RT_K; i++) {
        if (i == r->n) {
            r->rate[i] = 0.0, r->weight[i] = 0.0;
            r->n++;
        }
        const double hit = i < accepted ? 1.0 : 0.0, w = decay * r->weight[i] + 1.0;
        r->rate[i] += (hit - r->rate[i]) / w;
        r->weight[i] = w;
    }
}

// AcceptanceModel.update
static void rt_update(rt_acceptance *m, const rt_config *c, int64_t d, int64_t s, int64_t k, int64_t accepted) {
    if (k <= 0 || d < 0 || d >= RT_D || s < 0 || s >= RT_S) return;
    rt_update_rates(&m->overall[d], k, accepted, c->decay);
    rt_update_rates(&m->by[d][s], k, accepted, c->decay);
}

// The rounds' outcomes since the last call, in order: n records (model: 0 the acceptance, 1 the
// copy's; drafter, situation, k, accepted), as Router.observe made them.
void router_apply(rt_acceptance *acc, rt_acceptance *copying, const rt_config *c, const int64_t *updates, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t *u = updates + 5 * i;
        rt_update(u[0] ? copying : acc, c, u[1], u[2], u[3], u[4]);
    }
}

// AcceptanceModel.rates, for tests
void router_rates(const rt_acceptance *m, const rt_config *c, int64_t d, int64_t s, int64_t k, double *out) {
    rt_rates_of(m, c, d, s, k, out);
}

static int64_t rt_situation(const rt_config *c, int64_t d, double top1, int64_t match) {
    if (c->by_match[d]) return match;
    int64_t s = 0;
    for (int i = 0; i < 3; i++) s += c->top1_bins[i] <= top1;   // bisect_right
    return s;
}

// One round (Router.options(...).best(alpha) for a request alone), after applying the n_updates
// outcomes since the last (router_apply): ids[0..n] the verified context and the pending token
// (prompt lookup searches it, Router._lookup_inputs); logits [V] float32; hidden [d] (bf16 or
// float32; NULL: no learned predictions); the rest as above.
void router_round(const rt_config *c, rt_acceptance *acc, rt_acceptance *copying, const int64_t *updates,
                  int64_t n_updates, const int64_t *ids, int64_t n, const float *logits, int64_t vocab,
                  const void *hidden, int hidden_bf16, int64_t limit, double alpha, double plain,
                  const double *verify, const double *line, const int64_t *seen, double *out) {
    router_apply(acc, copying, c, updates, n_updates);
    int64_t found[3] = {0, 0, 0};   // size, start, copy run
    if (c->lookup >= 0) ngram_match_i64(ids, n, c->min_ngram, c->max_ngram, c->longest_run, found);
    const int64_t match = found[0], lookup_room = match ? n + 1 - found[1] : 0;
    int64_t copy_situation = -1;   // acceptance.copy_situation, where the copy has run
    if (found[2] > 0) {
        copy_situation = 0;
        for (int i = 0; i < 4; i++) copy_situation += c->copy_run_bins[i] <= found[2];
    }
    out[RT_OUT_MATCH] = found[0], out[RT_OUT_START] = found[1], out[RT_OUT_RUN] = found[2];
    float stats[2];
    softmax_stats_f32(logits, vocab, stats);
    const double top1 = stats[1];
    float p[RT_D * RT_K];
    const int learned = c->w1 != NULL && hidden != NULL;
    if (learned) {   // router_mlp.scalar_features, then the MLP (RouterMLP.rates_at)
        float scalars[4 + 3 * RT_D];
        int64_t ns = 0;
        scalars[ns++] = stats[0], scalars[ns++] = stats[1];
        scalars[ns++] = match == 2 ? 1.0f : 0.0f, scalars[ns++] = match >= 3 ? 1.0f : 0.0f;
        for (int64_t f = 0; f < c->n_feat; f++) {   // AcceptanceModel.summary
            const int64_t d = c->feat_drafter[f], k = c->feat_k[f], s = rt_situation(c, d, top1, match);
            double rates[RT_K], g[RT_K + 1];
            rt_rates_of(acc, c, d, s, k, rates);
            rt_gains(rates, k, g);
            const double seen = acc->by[d][s].n > 0 ? acc->by[d][s].weight[0] : 0.0;
            scalars[ns++] = (float)rates[0];
            scalars[ns++] = (float)((g[k] - 1.0) / (double)k);
            scalars[ns++] = (float)(seen / (seen + c->prior_weight));
        }
        mlp2_at_f32(hidden, c->d, hidden_bf16, scalars, ns, c->w1, c->b1, c->hidden_width, c->w2, c->b2, c->outputs, p);
    }
    // the plain step first; then every routed drafter's k = 1..k_max (Options.best: strict >, so
    // the earlier candidate wins a tie)
    const double t1 = fmax(plain + verify[1], c->min_seconds);
    double top_score = 1.0 / pow(t1, alpha);
    out[RT_OUT_DRAFTER] = -1, out[RT_OUT_K] = 0, out[RT_OUT_SITUATION] = 0, out[RT_OUT_TOKENS] = 1.0;
    out[RT_OUT_SECONDS] = t1, out[RT_OUT_DRAFTING] = plain, out[RT_OUT_RAW] = NAN;
    for (int64_t d = 0; d < c->n_routed; d++) {
        int64_t k_max = c->route_len[d] < limit ? c->route_len[d] : limit;
        if (d == c->lookup && lookup_room < k_max) k_max = lookup_room;
        if (k_max <= 0) continue;
        const int64_t s = rt_situation(c, d, top1, match);
        // its backlog and catch-up as CostModel.drafting_line prices them: share * (a + b x), 0 for none
        const int64_t from = seen[d] > c->seen_from ? seen[d] : c->seen_from, backlog = n - from > 0 ? n - from : 0;
        const double catch_up = backlog > 0 ? c->catch_up_share * (line[4 * d] + line[4 * d + 1] * (double)backlog) : 0.0;
        const double a = line[4 * d + 2], b = line[4 * d + 3], factor = line[4 * c->n_routed + d];
        double rates[RT_K], gains[RT_K + 1], raw[RT_K + 1];
        int has_raw = 0;
        if (d == c->lookup && copy_situation >= 0) {   // a copy's rates by its copy run
            rt_rates_of(copying, c, d, copy_situation, k_max, rates);
            rt_gains(rates, k_max, gains);
        } else if (learned && c->head_len[d] > 0) {   // the MLP's, past its positions its last
            const float *h = p + c->head_offset[d];
            for (int64_t i = 0; i < k_max; i++) rates[i] = h[i < c->head_len[d] ? i : c->head_len[d] - 1];
            rt_gains(rates, k_max, raw);
            has_raw = 1;
            if (factor >= 0.0) {   // this request's calibration (router.Calibration)
                for (int64_t i = 0; i < k_max; i++) rates[i] = fmin(rates[i] * factor, 1.0);
                rt_gains(rates, k_max, gains);
            } else {
                memcpy(gains, raw, (k_max + 1) * sizeof(double));
            }
        } else {
            rt_rates_of(acc, c, d, s, k_max, rates);
            rt_gains(rates, k_max, gains);
        }
        for (int64_t k = 1; k <= k_max; k++) {
            const double drafting = plain + (catch_up + (a + b * (double)k));
            const double t = fmax(drafting + verify[k + 1], c->min_seconds);
            const double score = gains[k] / pow(t, alpha);
            if (score > top_score) {
                top_score = score;
                out[RT_OUT_DRAFTER] = d, out[RT_OUT_K] = k, out[RT_OUT_SITUATION] = s, out[RT_OUT_TOKENS] = gains[k];
                out[RT_OUT_SECONDS] = t, out[RT_OUT_DRAFTING] = drafting, out[RT_OUT_RAW] = has_raw ? raw[k] - 1.0 : NAN;
            }
        }
    }
}
