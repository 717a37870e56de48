// Every decoder layer of a bf16 target with Q4_1 linears, for the few rows of a decode step or a
// verify, in one call: no Python between the ~10 small calls a layer makes.
//
// Why: with the Q4_1 kernel doing the linears and kernels/decode_ops.c the rest, a one-row forward
// of the embedded 135M model still spent ~2 ms of ~6.5 in Python: per layer two norms, four
// matmuls, attention, SwiGLU and two residual adds, each a module call, a few tensor allocations and
// a ctypes call (tottime of nn.Module._call_impl, data_ptr, torch.empty in a cProfile of a decode).
// Here the layers run back to back in C and call the very same kernels, in the same order on the
// same inputs, so the output is the same bits as target.DecoderLayer with native ops
// (tests/test_layer_stack.py).
//
// The kernels are not linked in: whiflash_core/layer_stack.py hands over the addresses of
// q4_1_matmul (kernels/q4_1.c) and rms_norm_bf16, silu_mul_bf16, attend_rows_bf16
// (kernels/decode_ops.c) from the libraries it already loaded (`layers_use`), so each is built once
// with its own flags and this file needs neither's source.
//
// Per layer l, x [T, H] bf16 the residual stream (updated in place), rows of several requests
// ("segments", each its own KV cache and positions) one after another:
//     xn = rms_norm(x, input_norm)            a = attention(qkv_proj(xn)) per segment
//     x  = bf16(x + o_proj(a))                xn = rms_norm(x, post_attention_norm)
//     x  = bf16(x + down_proj(silu(gate) * up)),   [gate | up] = gate_up_proj(xn)
// and the taps (Hugging Face's hidden_states[l], the stream entering layer l) copied out on the way.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int (*matmul_fn)(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *qw, const uint16_t *dw,
                         const uint16_t *mw, int64_t N, void *y, int y_bf16);
typedef void (*norm_fn)(const uint16_t *x, const uint16_t *w, float eps, int64_t M, int64_t K, uint16_t *y);
typedef void (*silu_fn)(const uint16_t *gu, int64_t M, int64_t H, uint16_t *y);
typedef int (*attend_fn)(const uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, uint16_t *kc, uint16_t *vc,
                         int64_t cap, int64_t start, int64_t t, int64_t nh, int64_t nkv, int64_t hd, uint16_t *out);
typedef int (*attend_segments_fn)(const uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, int64_t nseg,
                                  const int64_t *rows, const int64_t *start, const int64_t *cap, uint16_t *const *kc,
                                  uint16_t *const *vc, const int64_t *lead, const int64_t *shared, int64_t nh,
                                  int64_t nkv, int64_t hd, uint16_t *out);

typedef void (*rope_append_fn)(const uint16_t *k, const uint16_t *v, const uint16_t *cos, const uint16_t *sin,
                               uint16_t *kc, uint16_t *vc, int64_t cap, int64_t start, int64_t t, int64_t nkv,
                               int64_t hd);

static matmul_fn matmul;
static rope_append_fn rope_append;
static norm_fn rms_norm;
static silu_fn silu_mul;
static attend_fn attend;
static attend_segments_fn attend_segments;

void layers_use(void *mm, void *norm, void *silu, void *att, void *att_segments, void *rope_kv) {
    matmul = (matmul_fn)mm;
    rms_norm = (norm_fn)norm;
    silu_mul = (silu_fn)silu;
    attend = (attend_fn)att;
    attend_segments = (attend_segments_fn)att_segments;
    rope_append = (rope_append_fn)rope_kv;
}

// A layer's weights: pointers in this order, WEIGHTS_PER_LAYER of them per layer (layer_stack.py
// writes them); a linear is its Q4_1 blocks qw, dw, mw as kernels/q4_1.c lays them out.
enum { INPUT_NORM, QKV_QW, QKV_DW, QKV_MW, O_QW, O_DW, O_MW, POST_NORM, GATE_UP_QW, GATE_UP_DW, GATE_UP_MW,
       DOWN_QW, DOWN_DW, DOWN_MW, WEIGHTS_PER_LAYER };

// x += y for n bf16 values: each sum in float32, rounded to nearest even (PyTorch's bf16 add);
// NaN becomes 0x7FC0 as store8_bf16 in decode_ops.c. n % 8 == 0.
static void add_bf16(uint16_t *x, const uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i += 8) {
        __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(x + i))), 16));
        __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(y + i))), 16));
        __m256 v = _mm256_add_ps(a, b);
        __m256i bits = _mm256_castps_si256(v);
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
        __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
        _mm_storeu_si128((__m128i *)(x + i), _mm256_castsi256_si128(packed));
    }
}

// One layer whose attention input is given: attn_in [T, in_dim] (the normed stream for a target
// layer; EAGLE-3's [norm(embedding), norm(hidden)] for its first layer), x [T, H] the residual.
// Scratch as layers_bf16 allocates it. Returns 0, or nonzero if a kernel could not allocate.
static int one_layer(const void *const *lw, int64_t l, const uint16_t *attn_in, int64_t in_dim, int64_t H,
                     int64_t I, int64_t nh, int64_t nkv, int64_t hd, float eps, uint16_t *x, int64_t T,
                     const uint16_t *cos, const uint16_t *sin, int64_t nseg, const int64_t *rows,
                     const int64_t *start, const int64_t *cap, uint16_t *const *kc, uint16_t *const *vc,
                     const int64_t *lead, const int64_t *shared, uint16_t *xn, uint16_t *wide, uint16_t *mid,
                     uint16_t *back) {
    const int64_t width = (nh + 2 * nkv) * hd;   // q, k, v heads stacked (qkv_proj's rows)
    int status = matmul(attn_in, 1, T, in_dim, lw[QKV_QW], lw[QKV_DW], lw[QKV_MW], width, wide, 1);
    if (status == 0 && lead != NULL && nseg > 1) {   // requests sharing a cached prefix: see attend_segments_bf16
        uint16_t *kl[nseg], *vl[nseg];   // each segment's caches of layer l
        for (int64_t s = 0; s < nseg; s++) {
            kl[s] = kc[s] + l * nkv * cap[s] * hd;
            vl[s] = vc[s] + l * nkv * cap[s] * hd;
        }
        status |= attend_segments(wide, cos, sin, nseg, rows, start, cap, kl, vl, lead, shared, nh, nkv, hd, mid);
    } else
        for (int64_t s = 0, r = 0; s < nseg && status == 0; r += rows[s], s++) {
            const int64_t layer = l * nkv * cap[s] * hd;
            status |= attend(wide + r * width, cos + r * hd, sin + r * hd, kc[s] + layer, vc[s] + layer, cap[s],
                             start[s], rows[s], nh, nkv, hd, mid + r * nh * hd);
        }
    status |= matmul(mid, 1, T, nh * hd, lw[O_QW], lw[O_DW], lw[O_MW], H, back, 1);
    add_bf16(x, back, T * H);
    rms_norm(x, lw[POST_NORM], eps, T, H, xn);
    status |= matmul(xn, 1, T, H, lw[GATE_UP_QW], lw[GATE_UP_DW], lw[GATE_UP_MW], 2 * I, wide, 1);
    silu_mul(wide, T, I, mid);
    status |= matmul(mid, 1, T, I, lw[DOWN_QW], lw[DOWN_DW], lw[DOWN_MW], H, back, 1);
    add_bf16(x, back, T * H);
    return status;
}

typedef struct { uint16_t *xn, *wide, *mid, *back; } Scratch;

static int scratch(Scratch *s, int64_t T, int64_t in_dim, int64_t H, int64_t I, int64_t nh, int64_t nkv, int64_t hd) {
    const int64_t width = (nh + 2 * nkv) * hd, widest = width > 2 * I ? width : 2 * I;
    s->xn = malloc(T * (in_dim > H ? in_dim : H) * sizeof(uint16_t));   // normed stream
    s->wide = malloc(T * widest * sizeof(uint16_t));                   // qkv, then gate_up
    s->mid = malloc(T * (nh * hd > I ? nh * hd : I) * sizeof(uint16_t)); // attention out, then silu * up
    s->back = malloc(T * H * sizeof(uint16_t));                        // o_proj / down_proj outputs
    return (s->xn && s->wide && s->mid && s->back) ? 0 : -1;
}

static void release(Scratch *s) {
    free(s->xn);
    free(s->wide);
    free(s->mid);
    free(s->back);
}

// x [T, H] bf16, T the rows of all segments; cos, sin [T, hd] bf16 (each row's position);
// segment s: rows[s] rows at positions start[s].., its caches kc[s], vc[s] [L, nkv, cap[s], hd] bf16;
// lead, shared (or NULL): the cached prefixes segments share, as attend_segments_bf16 takes them;
// taps [T, ntaps, H] bf16 receives, for each j with 0 <= tap_layers[j] < L, the stream entering
// that layer (other j are left alone: the caller fills the final-norm tap).
// Returns 0, or -1 if scratch memory could not be allocated (x is then partly updated).
int layers_bf16(const void *const *w, int64_t L, int64_t H, int64_t I, int64_t nh, int64_t nkv, int64_t hd,
                float eps, uint16_t *x, int64_t T, const uint16_t *cos, const uint16_t *sin, int64_t nseg,
                const int64_t *rows, const int64_t *start, const int64_t *cap, uint16_t *const *kc,
                uint16_t *const *vc, const int64_t *lead, const int64_t *shared, const int64_t *tap_layers,
                int64_t ntaps, uint16_t *taps) {
    Scratch s;
    int status = scratch(&s, T, H, H, I, nh, nkv, hd);
    for (int64_t l = 0; l < L && status == 0; l++) {
        const void *const *lw = w + l * WEIGHTS_PER_LAYER;
        for (int64_t j = 0; j < ntaps; j++)
            if (tap_layers[j] == l)
                for (int64_t r = 0; r < T; r++) memcpy(taps + (r * ntaps + j) * H, x + r * H, H * sizeof(uint16_t));
        rms_norm(x, lw[INPUT_NORM], eps, T, H, s.xn);
        status = one_layer(lw, l, s.xn, H, H, I, nh, nkv, hd, eps, x, T, cos, sin, nseg, rows, start, cap, kc, vc,
                           lead, shared, s.xn, s.wide, s.mid, s.back);
    }
    release(&s);
    return status == 0 ? 0 : -1;
}

// One drafter layer (layer index l of its caches) over attn_in [T, in_dim], its attention input,
// and x [T, H], the residual stream (updated in place); the rest as layers_bf16 (no taps; the
// layer's INPUT_NORM pointer is not read). Returns 0, or -1 if scratch could not be allocated.
int draft_layer_bf16(const void *const *lw, int64_t l, const uint16_t *attn_in, int64_t in_dim, int64_t H,
                     int64_t I, int64_t nh, int64_t nkv, int64_t hd, float eps, uint16_t *x, int64_t T,
                     const uint16_t *cos, const uint16_t *sin, int64_t nseg, const int64_t *rows,
                     const int64_t *start, const int64_t *cap, uint16_t *const *kc, uint16_t *const *vc) {
    Scratch s;
    int status = scratch(&s, T, in_dim, H, I, nh, nkv, hd);
    if (status == 0)
        status = one_layer(lw, l, attn_in, in_dim, H, I, nh, nkv, hd, eps, x, T, cos, sin, nseg, rows, start, cap,
                           kc, vc, NULL, NULL, s.xn, s.wide, s.mid, s.back);
    release(&s);
    return status == 0 ? 0 : -1;
}

// ------------------------------------------------------------------ an EAGLE-3 chain in one call
//
// Eagle3Drafter.propose_many's greedy chain for one request, step for step with the same kernels
// on the same inputs (so the same bits; tests/test_layer_stack.py), without the ~0.3 ms of Python
// between them a step costs (module calls, tensor allocations, ctypes conversions):
//     g  = fc([fc_norm_i(tap_i)]_i)                    the newest verified pair's fused feature
//     a  = layer([input_norm(embed[pending]), hidden_norm(g)], residual g)   at position p0
//     step j = 0..k-1:
//         d_j = argmax lm_head(norm(a)) (the first largest; the first NaN), token_j = d_j + d2t[d_j]
//         a   = layer([input_norm(embed[token_j]), hidden_norm(h)], residual h) at p0 + j + 1,
//               h = norm(a) if norm_output else a       (not after the last step)
// (residual = hidden_norm(h) instead where norm_before_residual.) `ew` holds the drafter's own
// weights in this order (EAGLE_WEIGHTS): fc (qw, dw, mw), input_layernorm, hidden_norm, norm,
// lm_head (qw, dw, mw), then one fc_norm weight per tap (absent: NULL, the taps go in unnormed).
// lw is the layer (layer_stack.DraftLayer's pointers); taps [ntaps, Ht] bf16; embed [V, H] bf16;
// cos, sin [k, hd] bf16 (positions p0..p0 + k - 1); kc, vc the layer's caches [nkv, cap, hd], which
// must hold position p0 + k - 1. Writes the k target ids to tokens. Returns 0, or -1 if memory
// could not be allocated.
enum { FC_QW, FC_DW, FC_MW, EAGLE_INPUT_NORM, EAGLE_HIDDEN_NORM, EAGLE_NORM, HEAD_QW, HEAD_DW, HEAD_MW, FC_NORMS };

static inline float bf16_float(uint16_t b) {
    const uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

int eagle_chain_bf16(const void *const *lw, const void *const *ew, int64_t H, int64_t I, int64_t nh, int64_t nkv,
                     int64_t hd, float eps, int norm_output, int norm_before_residual, const uint16_t *taps,
                     int64_t ntaps, int64_t Ht, const uint16_t *embed, int64_t pending, const int64_t *d2t,
                     int64_t draft_vocab, const uint16_t *cos, const uint16_t *sin, int64_t p0, int64_t cap,
                     uint16_t *kc, uint16_t *vc, int64_t k, int64_t *tokens) {
    Scratch s;
    int status = scratch(&s, 1, 2 * H, H, I, nh, nkv, hd);
    uint16_t *fused = malloc(ntaps * Ht * sizeof(uint16_t)), *attn_in = malloc(2 * H * sizeof(uint16_t));
    uint16_t *a = malloc(H * sizeof(uint16_t)), *h = malloc(H * sizeof(uint16_t));
    uint16_t *logits = malloc(draft_vocab * sizeof(uint16_t));
    if (status != 0 || !fused || !attn_in || !a || !h || !logits) status = -1;
    if (status == 0) {   // g = fc(normed taps), into h: the first step's hidden input
        for (int64_t i = 0; i < ntaps; i++) {
            if (ew[FC_NORMS + i] != NULL)
                rms_norm(taps + i * Ht, ew[FC_NORMS + i], eps, 1, Ht, fused + i * Ht);
            else
                memcpy(fused + i * Ht, taps + i * Ht, Ht * sizeof(uint16_t));
        }
        status = matmul(fused, 1, 1, ntaps * Ht, ew[FC_QW], ew[FC_DW], ew[FC_MW], H, h, 1);
    }
    int64_t token = pending;
    for (int64_t j = 0; j <= k && status == 0; j++) {
        if (j > 0) {   // the head on the last step's output: draft token j - 1
            rms_norm(a, ew[EAGLE_NORM], eps, 1, H, s.xn);
            status = matmul(s.xn, 1, 1, H, ew[HEAD_QW], ew[HEAD_DW], ew[HEAD_MW], draft_vocab, logits, 1);
            int64_t best = 0;
            float top = bf16_float(logits[0]);
            for (int64_t d = 1; d < draft_vocab && top == top; d++) {
                const float v = bf16_float(logits[d]);
                if (v > top || v != v) top = v, best = d;
            }
            token = tokens[j - 1] = best + d2t[best];
            if (j == k) break;
            if (norm_output) memcpy(h, s.xn, H * sizeof(uint16_t));   // norm(a), as the head read it
            else memcpy(h, a, H * sizeof(uint16_t));
        }
        // the layer on (embed[token], h) at position p0 + j, residual h (or hidden_norm(h))
        rms_norm(embed + token * H, ew[EAGLE_INPUT_NORM], eps, 1, H, attn_in);
        rms_norm(h, ew[EAGLE_HIDDEN_NORM], eps, 1, H, attn_in + H);
        memcpy(a, norm_before_residual ? attn_in + H : h, H * sizeof(uint16_t));
        const int64_t rows = 1, start = p0 + j;
        status = one_layer(lw, 0, attn_in, 2 * H, H, I, nh, nkv, hd, eps, a, 1, cos + j * hd, sin + j * hd, 1, &rows,
                           &start, &cap, &kc, &vc, NULL, NULL, s.xn, s.wide, s.mid, s.back);
    }
    release(&s);
    free(fused);
    free(attn_in);
    free(a);
    free(h);
    free(logits);
    return status == 0 ? 0 : -1;
}

// Eagle3Drafter.catch_up's KV-only prefill of T verified pairs (positions start..start+T-1) in one
// call, as the module path computes it: g = fc([fc_norm_i(tap_i)]_i), x = [input_norm(embed[token]),
// hidden_norm(g)], then k_proj(x) rotated and v_proj(x) into the layer's cache (rope_append_bf16)
// and nothing else (the queries of these rows are never needed). ew as eagle_chain_bf16's; kv the
// k_proj and v_proj blocks (qw, dw, mw each); taps [T, ntaps, Ht] bf16; tokens [T] the token of
// each pair; cos, sin [T, hd]. Returns 0, or -1 if memory could not be allocated.
int eagle_catch_up_bf16(const void *const *ew, const void *const *kv, int64_t H, int64_t nkv, int64_t hd, float eps,
                        const uint16_t *taps, int64_t ntaps, int64_t Ht, const uint16_t *embed, const int64_t *tokens,
                        const uint16_t *cos, const uint16_t *sin, int64_t start, int64_t cap, uint16_t *kc,
                        uint16_t *vc, int64_t T) {
    const int64_t F = ntaps * Ht, width = nkv * hd, in = 2 * H;
    uint16_t *rows = malloc(T * (Ht > H ? Ht : H) * sizeof(uint16_t)), *normed = malloc(T * (Ht > H ? Ht : H) * sizeof(uint16_t));
    uint16_t *fused = malloc(T * F * sizeof(uint16_t)), *g = malloc(T * H * sizeof(uint16_t));
    uint16_t *x = malloc(T * in * sizeof(uint16_t)), *k = malloc(T * width * sizeof(uint16_t));
    uint16_t *v = malloc(T * width * sizeof(uint16_t));
    int status = (rows && normed && fused && g && x && k && v) ? 0 : -1;
    for (int64_t i = 0; i < ntaps && status == 0; i++) {   // tap i of every row, normed as one [T, Ht] call
        for (int64_t r = 0; r < T; r++) memcpy(rows + r * Ht, taps + (r * ntaps + i) * Ht, Ht * sizeof(uint16_t));
        if (ew[FC_NORMS + i] != NULL) rms_norm(rows, ew[FC_NORMS + i], eps, T, Ht, normed);
        for (int64_t r = 0; r < T; r++)
            memcpy(fused + r * F + i * Ht, ew[FC_NORMS + i] != NULL ? normed + r * Ht : rows + r * Ht, Ht * sizeof(uint16_t));
    }
    if (status == 0) status = matmul(fused, 1, T, F, ew[FC_QW], ew[FC_DW], ew[FC_MW], H, g, 1);
    if (status == 0) {
        for (int64_t r = 0; r < T; r++) memcpy(rows + r * H, embed + tokens[r] * H, H * sizeof(uint16_t));
        rms_norm(rows, ew[EAGLE_INPUT_NORM], eps, T, H, normed);
        for (int64_t r = 0; r < T; r++) memcpy(x + r * in, normed + r * H, H * sizeof(uint16_t));
        rms_norm(g, ew[EAGLE_HIDDEN_NORM], eps, T, H, normed);
        for (int64_t r = 0; r < T; r++) memcpy(x + r * in + H, normed + r * H, H * sizeof(uint16_t));
        status = matmul(x, 1, T, in, kv[0], kv[1], kv[2], width, k, 1);
        if (status == 0) status = matmul(x, 1, T, in, kv[3], kv[4], kv[5], width, v, 1);
    }
    if (status == 0) rope_append(k, v, cos, sin, kc, vc, cap, start, T, nkv, hd);
    free(rows);
    free(normed);
    free(fused);
    free(g);
    free(x);
    free(k);
    free(v);
    return status == 0 ? 0 : -1;
}
