// y[M, N] = x[M, K] @ W[N, K]^T with W in the GGUF's Q4_1 blocks, multiplied as llama.cpp does.
//
// Q4_1: blocks of 32 weights along K, w = d * q + m, q in 0..15, d and m fp16.
// Each row of x is quantized per block of 32 to int8 (Q8_1): x ~ dx * qx, |qx| <= 127, with
// sx = dx * sum(qx). Then one block of the dot product is
//     sum_i (d q_i + m) (dx qx_i) = d * dx * sum_i q_i qx_i  +  m * sx
// where sum_i q_i qx_i is an exact integer dot product of unsigned 4-bit by signed 8-bit values
// (VNNI's dpbusd; maddubs on plain AVX2).
//
// Blocks in lanes. A dpbusd adds 4 byte products into each of its int32 lanes. The data are laid out
// so that lane j always holds block j of a group of 8 consecutive blocks (4 or 2 in the last,
// short groups): 8 dpbusd in a row leave the group's 8 whole integer dot products in the 8 lanes, and one
// convert, one multiply by the 8 blocks' d * dx and two FMAs (the m * sx terms too) finish 8 blocks
// at once, where a block-at-a-time loop spends those 4 instructions on every block.
//   nb = K / 32 blocks, np = nb rounded up to even (a padding block is zero); groups of 8 blocks,
//   then one of 4 if np % 8 >= 4, then one of 2 if np % 4 == 2 (K = 576: 8 + 8 + 2)
//   vector v (0..7) of a group: lane j = elements 4v..4v+3 of the group's block j
//       (32 bytes; 16 or 8 in the short groups)
//   qw [N, np * 16] bytes: per group, vectors 2i and 2i + 1 share bytes as low and high nibbles
//       (q4_1_kernel.pack writes them)
//   dw, mw [N, np] fp16, the GGUF's own d and m
//   per row of x (laid out here, per call): qx [np * 32] int8 in the same vector order, dx and sx
//       [np] float32
//
// Outputs in lanes (for N % 16 == 0, on every class: q4_1_layout). Where a verify of a few rows
// is bound by instructions, not by reading the weights, blocks in lanes spend most of theirs
// outside the dot products: a horizontal sum and a store per output, and (K = 576: 16 blocks + 2)
// a short group costing as much as the full ones. Here a 512-bit vector holds 16 consecutive
// output rows instead, 4 weights of each, so one dpbusd against x's 4 int8 values of the same
// columns (broadcast) advances 16 dot products, and each block ends with one convert and two
// FMAs for 16 outputs: no horizontal sums, no short groups (the AVX2 class takes the vector as two
// 256-bit halves of 8 outputs, in the same order of operations: the same bits). Layout, per group o
// of 16 output rows (16o..16o+15) and block b (K / 32 blocks, no padding):
//   qw: 4 vectors of 64 bytes; in vector j, lane l's 4 bytes c = 0..3 hold weights
//       w[16o + l][32b + 4j + c] (low nibbles) and w[16o + l][32b + 16 + 4j + c] (high nibbles);
//       as a tensor [N, nb * 16] bytes: the group's 16 rows are its nb * 256 bytes
//   dw, mw: 16 fp16 (the group's rows), as a tensor [N, nb]
//   qx: x's int8 values in their natural order, dx and sx [nb]
// Every row of x runs the same instructions in the same order whatever the other rows (up to 8, 4
// on AVX2, share a pass over a group's weights, which stay in cache for the next), so a row's result
// never depends on the others.
//
// Built on the machine that runs it (whiflash_core/q4_1_kernel.py: cc -O3 -march=native, or the
// AVX2 class when ATEN_CPU_CAPABILITY=avx2 forces it), loaded with ctypes, threaded with the
// OpenMP runtime PyTorch already loaded (same libgomp soname, so one thread pool).
#define _GNU_SOURCE   // syscall()
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define QK 32
#define MAX_ROWS 4  // rows of x multiplied per pass over a weight row (more rows: several passes)
#define MAX_NR 4    // output rows a tile() covers at once (4 at one row of x: see rows())
#define BLOCK_ROWS 32  // weight rows a pass covers before the next pass (a multiple of 4; see q4_1_matmul)
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 32  // weight rows fetched ahead (see tile)
#endif

static inline int64_t padded_blocks(int64_t K) { return (K / QK + 1) / 2 * 2; }

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#define LANES16 1
#define LANE_ROWS 8   // rows of x per pass over a group's weights (outputs in lanes)
#else
#define LANES16 0
#define LANE_ROWS 4   // AVX2 (16 vector registers): 5 or 6 rows a pass measured no faster
#endif

// 1 where weights of N output rows are packed with outputs in lanes (q4_1_kernel.pack asks): on
// every class the kernel builds for (the AVX2 class takes a group's 16 outputs as two halves).
int q4_1_layout(int64_t N) { return N % 16 == 0; }

// The short groups' first blocks: [full8, four) in groups of 8, [four, two) one of 4, [two, np) one of 2.
static inline int64_t full8(int64_t np) { return np / 8 * 8; }
static inline int64_t four_end(int64_t np) { return full8(np) + (np % 8 >= 4 ? 4 : 0); }

// ------------------------------------------------------------------ activations -> Q8 blocks

static inline __m256 load8(const void *x, int bf16, int64_t i) {
    if (bf16) {  // bf16 is the top half of a float32
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)x + i);
}

// Where word v (elements 4v..4v+3) of block b goes in qx: its group's vector v, lane b's place.
static inline int64_t word_offset(int64_t b, int64_t v, int64_t np) {
    const int64_t f = full8(np), e = four_end(np);
    if (b < f) return (b / 8) * 256 + 32 * v + 4 * (b % 8);
    if (b < e) return f * QK + 16 * v + 4 * (b - f);
    return e * QK + 8 * v + 4 * (b - e);
}

// One row of K values (K a multiple of 32) -> its qx, dx and sx (layouts above; `natural`: the
// outputs-in-lanes layout, no padding block).
static void quantize_row(const void *x, int bf16, int64_t K, int natural, int8_t *qx, float *dx, float *sx) {
    const int64_t nb = K / QK, np = natural ? nb : padded_blocks(K);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < np; b++) {
        int32_t words[8] = {0};  // the block's 32 int8 values, 4 to a word
        float d = 0.0f, s = 0.0f;
        if (b < nb) {
            __m256 v[4];
            __m256 amax = _mm256_setzero_ps();
            for (int j = 0; j < 4; j++) {
                v[j] = load8(x, bf16, b * QK + 8 * j);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            d = _mm_cvtss_f32(m4) / 127.0f;
            const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
            __m256i q[4];
            __m256i sum = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {  // round to nearest (even), as llama.cpp's AVX2 path
                q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                sum = _mm256_add_epi32(sum, q[j]);
            }
            // int32 x 32 -> int8 x 32 in order (packs interleave 128-bit lanes: permute back)
            __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)words, bytes);
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            s4 = _mm_hadd_epi32(s4, s4);
            s4 = _mm_hadd_epi32(s4, s4);
            s = d * (float)_mm_cvtsi128_si32(s4);
        }
        for (int v = 0; v < 8; v++) *(int32_t *)(qx + (natural ? b * QK + 4 * v : word_offset(b, v, np))) = words[v];
        dx[b] = d;
        sx[b] = s;
    }
}

// All M rows of x -> one allocation holding qx [P, np * 32] (rows M..P-1 zero: P >= M pads to
// whole AMX tiles), then dx and sx [M, np] (np = K / 32 with `natural`, else padded_blocks); the
// caller frees it. NULL if it could not be allocated.
static int8_t *quantize_rows(const void *x, int x_bf16, int64_t M, int64_t P, int64_t K, int natural, float **dx,
                             float **sx) {
    const int64_t np = natural ? K / QK : padded_blocks(K), row_bytes = K * (x_bf16 ? 2 : 4);
    int8_t *qx = malloc(P * np * QK + M * np * 2 * sizeof(float));
    if (qx == NULL) return NULL;
    __builtin_memset(qx + M * np * QK, 0, (P - M) * np * QK);
    *dx = (float *)(qx + P * np * QK);
    *sx = *dx + M * np;
    for (int64_t r = 0; r < M; r++)
        quantize_row((const char *)x + r * row_bytes, x_bf16, K, natural, qx + r * np * QK, *dx + r * np, *sx + r * np);
    return qx;
}

// ------------------------------------------------------------------ the integer dot products
// step adds w_i * x_i (w 0..15, x int8) 4 bytes at a time into each int32 lane; finish adds two
// such accumulators into 8 (or 4) int32 lane sums. Without VNNI the products collect in int16
// (maddubs), which holds the 8 of a group: 8 * 2 * 15 * 127 < 2^15.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
static inline __m256i step8(__m256i a, __m256i w, __m256i x) { return _mm256_dpbusd_epi32(a, w, x); }
static inline __m128i step4(__m128i a, __m128i w, __m128i x) { return _mm_dpbusd_epi32(a, w, x); }
#define VNNI 1
#elif defined(__AVXVNNI__)
static inline __m256i step8(__m256i a, __m256i w, __m256i x) { return _mm256_dpbusd_avx_epi32(a, w, x); }
static inline __m128i step4(__m128i a, __m128i w, __m128i x) { return _mm_dpbusd_avx_epi32(a, w, x); }
#define VNNI 1
#else
// The empty asm makes each sum opaque to the compiler. Integer adds are associative, and GCC
// regrouped a tile's chains into trees that first computed all of a group's products (32 at 4 rows
// of x) and spilled them to the stack (the AVX2 class has 16 vector registers); in order, each
// product is added as it is made. The integer sums are the same either way, so the results are
// too, bit for bit. Kernel alone, -march=haswell, 1 thread, in turns (bench/q4_1_kernel_ab.sh,
// four sittings): 4 rows 1.05-1.24x, 8 rows 1.05-1.22x; one row 0.91-1.10x, as it also read with
// the asm left out of one-row tiles (their code unchanged: the spread is code placement).
static inline __m256i step8(__m256i a, __m256i w, __m256i x) {
    __m256i sum = _mm256_add_epi16(a, _mm256_maddubs_epi16(w, x));
    __asm__("" : "+x"(sum));
    return sum;
}
static inline __m128i step4(__m128i a, __m128i w, __m128i x) {
    __m128i sum = _mm_add_epi16(a, _mm_maddubs_epi16(w, x));
    __asm__("" : "+x"(sum));
    return sum;
}
#define VNNI 0
#endif
static inline __m256i finish8(__m256i a, __m256i b) {
    return VNNI ? _mm256_add_epi32(a, b) : _mm256_madd_epi16(_mm256_add_epi16(a, b), _mm256_set1_epi16(1));
}
static inline __m128i finish4(__m128i a, __m128i b) {
    return VNNI ? _mm_add_epi32(a, b) : _mm_madd_epi16(_mm_add_epi16(a, b), _mm_set1_epi16(1));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// y[i] = v, as float32 or rounded to bf16 (to nearest, ties to even: what PyTorch's .to(bfloat16) does)
static inline void store(void *y, int bf16, int64_t i, float v) {
    if (bf16) {
        uint32_t bits;
        __builtin_memcpy(&bits, &v, 4);
        ((uint16_t *)y)[i] = (v != v) ? 0x7FC0 : (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
    } else {
        ((float *)y)[i] = v;
    }
}

// 128-bit loads of the short groups: 16 bytes for a group of 4, the low 8 (rest zero) for one of 2.
static inline __m128i load_short(const void *p, int width) {
    return width == 4 ? _mm_loadu_si128((const __m128i *)p) : _mm_loadl_epi64((const __m128i *)p);
}
static inline __m128 load_short_ps(const float *p, int width) {
    return width == 4 ? _mm_loadu_ps(p) : _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)p));
}
static inline __m128 load_short_ph(const uint16_t *p, int width) {
    return _mm_cvtph_ps(width == 4 ? _mm_loadl_epi64((const __m128i *)p) : _mm_cvtsi32_si128(*(const int32_t *)p));
}

// A short group (width 4 or 2 blocks from block `start`) of tile(): the same in 128-bit vectors,
// added into the low lanes of the accumulators.
static inline __attribute__((always_inline)) void short_group(const int R, const int NR, const int width,
        int64_t start, int64_t n, int64_t np, const uint8_t *qw, const uint16_t *dw, const uint16_t *mw,
        const int8_t *qx, const float *dx, const float *sx, __m256 acc[MAX_NR][MAX_ROWS]) {
    for (int u = 0; u < NR; u++) {
        const uint8_t *wq = qw + (n + u) * np * 16 + start * 16;
        __m128i i0[MAX_ROWS], i1[MAX_ROWS];
        for (int r = 0; r < R; r++) i0[r] = i1[r] = _mm_setzero_si128();
        for (int i = 0; i < 4; i++) {
            const __m128i t = load_short(wq + 4 * width * i, width), low = _mm_set1_epi8(0x0F);
            const __m128i lo = _mm_and_si128(t, low), hi = _mm_and_si128(_mm_srli_epi16(t, 4), low);
            for (int r = 0; r < R; r++) {
                const int8_t *xr = qx + r * np * QK + start * QK + 8 * width * i;
                i0[r] = step4(i0[r], lo, load_short(xr, width));
                i1[r] = step4(i1[r], hi, load_short(xr + 4 * width, width));
            }
        }
        const __m128 wd = load_short_ph(dw + (n + u) * np + start, width);
        const __m128 wm = load_short_ph(mw + (n + u) * np + start, width);
        for (int r = 0; r < R; r++) {
            const __m128 scale = _mm_mul_ps(wd, load_short_ps(dx + r * np + start, width));
            __m128 a = _mm_mul_ps(_mm_cvtepi32_ps(finish4(i0[r], i1[r])), scale);
            a = _mm_fmadd_ps(wm, load_short_ps(sx + r * np + start, width), a);
            acc[u][r] = _mm256_add_ps(acc[u][r], _mm256_set_m128(_mm_setzero_ps(), a));
        }
    }
}

// y[r0 + r, n + u] for R rows of x (r < R) and NR output rows (u < NR); R and NR are constants at each
// call, so the R * NR * 2 integer accumulators (two chains: a dpbusd's latency) stay in registers.
static inline __attribute__((always_inline)) void tile(const int R, const int NR, int64_t n, int64_t K, int64_t N,
        const uint8_t *qw, const uint16_t *dw, const uint16_t *mw, const int8_t *qx, const float *dx,
        const float *sx, void *y, int y_bf16, int64_t r0) {
    const int64_t np = padded_blocks(K), full = full8(np);
    // Decode streams each weight once from memory: ask for the rows PREFETCH_ROWS ahead now, so
    // their loads overlap this tile's arithmetic (the hardware prefetcher alone left the kernel
    // at about half the machine's read bandwidth inside a whole forward).
    if (n + NR + PREFETCH_ROWS <= N) {
        const char *ahead = (const char *)(qw + (n + PREFETCH_ROWS) * np * 16);
        for (int64_t off = 0; off < NR * np * 16; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
        const char *sd = (const char *)(dw + (n + PREFETCH_ROWS) * np), *sm = (const char *)(mw + (n + PREFETCH_ROWS) * np);
        for (int64_t off = 0; off < NR * np * 2; off += 64) {
            _mm_prefetch(sd + off, _MM_HINT_T0);
            _mm_prefetch(sm + off, _MM_HINT_T0);
        }
    }
    // Arrays sized by the constants, not by R and NR: variable-length arrays were allocated on the
    // stack every group and their values stored and reloaded.
    __m256 acc[MAX_NR][MAX_ROWS];
    for (int u = 0; u < NR; u++)
        for (int r = 0; r < R; r++) acc[u][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < full; g += 8) {  // groups of 8 blocks
        for (int u = 0; u < NR; u++) {
            const uint8_t *wq = qw + (n + u) * np * 16 + g * 16;
            __m256i i0[MAX_ROWS], i1[MAX_ROWS];
            for (int r = 0; r < R; r++) i0[r] = i1[r] = _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                const __m256i t = _mm256_loadu_si256((const __m256i *)(wq + 32 * i)), low = _mm256_set1_epi8(0x0F);
                const __m256i lo = _mm256_and_si256(t, low), hi = _mm256_and_si256(_mm256_srli_epi16(t, 4), low);
                for (int r = 0; r < R; r++) {
                    const int8_t *xr = qx + r * np * QK + g * QK + 64 * i;
                    i0[r] = step8(i0[r], lo, _mm256_loadu_si256((const __m256i *)xr));
                    i1[r] = step8(i1[r], hi, _mm256_loadu_si256((const __m256i *)(xr + 32)));
                }
            }
            const __m256 wd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dw + (n + u) * np + g)));
            const __m256 wm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mw + (n + u) * np + g)));
            for (int r = 0; r < R; r++) {
                const __m256 scale = _mm256_mul_ps(wd, _mm256_loadu_ps(dx + r * np + g));
                acc[u][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(finish8(i0[r], i1[r])), scale, acc[u][r]);
                acc[u][r] = _mm256_fmadd_ps(wm, _mm256_loadu_ps(sx + r * np + g), acc[u][r]);
            }
        }
    }
    if (four_end(np) > full) short_group(R, NR, 4, full, n, np, qw, dw, mw, qx, dx, sx, acc);
    if (np > four_end(np)) short_group(R, NR, 2, four_end(np), n, np, qw, dw, mw, qx, dx, sx, acc);
    for (int u = 0; u < NR; u++)
        for (int r = 0; r < R; r++) store(y, y_bf16, (r0 + r) * N + n + u, hsum(acc[u][r]));
}

// Output rows [n0, n1) for R (1..MAX_ROWS) rows of quantized x: a few output rows at a time while
// x has few rows, so there are always several independent chains in flight.
static void rows(int R, int64_t n0, int64_t n1, int64_t K, int64_t N, const uint8_t *qw, const uint16_t *dw,
                 const uint16_t *mw, const int8_t *qx, const float *dx, const float *sx, void *y, int y_bf16,
                 int64_t r0) {
    int64_t n = n0;
    switch (R) {
        case 1: for (; n + 4 <= n1; n += 4) tile(1, 4, n, K, N, qw, dw, mw, qx, dx, sx, y, y_bf16, r0); break;
        case 2: for (; n + 2 <= n1; n += 2) tile(2, 2, n, K, N, qw, dw, mw, qx, dx, sx, y, y_bf16, r0); break;
        case 3: for (; n < n1; n++) tile(3, 1, n, K, N, qw, dw, mw, qx, dx, sx, y, y_bf16, r0); break;
        default: for (; n < n1; n++) tile(4, 1, n, K, N, qw, dw, mw, qx, dx, sx, y, y_bf16, r0); break;
    }
    for (; n < n1; n++) {  // the last few output rows of R = 1 or 2
        if (R == 1) tile(1, 1, n, K, N, qw, dw, mw, qx, dx, sx, y, y_bf16, r0);
        else tile(2, 1, n, K, N, qw, dw, mw, qx, dx, sx, y, y_bf16, r0);
    }
}

// ------------------------------------------------------------------ outputs in lanes
#if !LANES16
// The same layout on the AVX2 class. K = 576 (the embedded model's hidden size: 18 blocks) leaves
// blocks in lanes with two full groups and a short one that costs nearly as much, and a horizontal
// sum per output: perf put 37 % of a 4-row call (-march=haswell) there. Here a group's 64-byte
// vectors are taken as two 256-bit halves, outputs 16o..16o+7 and 16o+8..16o+15, each block ending
// in one convert and two FMAs for 8 outputs. Both halves of a block in turn, so the weights are read
// at an even pace behind the prefetches: with the weights coming from memory, as in a forward,
// 1-4 rows ran 1.03-1.24x faster than one half over all blocks and then the other, which keeps
// fewer accumulators live (in cache, 4-16 rows, that order was 1.05-1.12x faster; -march=haswell,
// 1 thread, bench/q4_1_kernel_ab.sh with COPIES=256 and 1). The steps and their order are
// lanes_tile's (AVX-512): the same integer sums, then acc += (d * dx) * dot + m * sx, so every
// class gives the same bits (tests/test_q4_1_kernel.py builds haswell, alderlake, icelake-server).
// Without VNNI the products collect in int16 (maddubs) in one chain per row: a block's 8 steps put
// 16 products in each int16 lane, 16 * 15 * 127 < 2^15.
static inline __attribute__((always_inline)) void lanes_tile(const int R, int64_t o, int64_t nb, int64_t K,
        int64_t N, const uint8_t *qw, const uint16_t *dw, const uint16_t *mw, const int8_t *qx, const float *dx,
        const float *sx, void *y, int y_bf16, int64_t r0) {
    const uint8_t *wo = qw + o * nb * 256;
    const uint16_t *dwo = dw + o * nb * 16, *mwo = mw + o * nb * 16;
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256 acc[2][LANE_ROWS];
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < R; r++) acc[h][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = wo + b * 256;
        for (int off = 0; off < 256; off += 64) _mm_prefetch((const char *)(wb + PREFETCH_ROWS * nb * 16 + off), _MM_HINT_T0);
        for (int h = 0; h < 2; h++) {
            __m256i i0[LANE_ROWS], i1[LANE_ROWS];
            for (int r = 0; r < R; r++) i0[r] = i1[r] = _mm256_setzero_si256();
            for (int j = 0; j < 4; j++) {
                const __m256i t = _mm256_loadu_si256((const __m256i *)(wb + 64 * j + 32 * h));
                const __m256i lo = _mm256_and_si256(t, low), hi = _mm256_and_si256(_mm256_srli_epi16(t, 4), low);
                for (int r = 0; r < R; r++) {
                    const int32_t *xw = (const int32_t *)(qx + (r0 + r) * K + b * QK);
                    const __m256i x0 = _mm256_set1_epi32(xw[j]), x1 = _mm256_set1_epi32(xw[j + 4]);
                    if (VNNI) {
                        i0[r] = step8(i0[r], lo, x0);
                        i1[r] = step8(i1[r], hi, x1);
                    } else {
                        i0[r] = step8(step8(i0[r], lo, x0), hi, x1);
                    }
                }
            }
            const __m256 wd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dwo + b * 16 + 8 * h)));
            const __m256 wm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mwo + b * 16 + 8 * h)));
            for (int r = 0; r < R; r++) {
                const __m256 scale = _mm256_mul_ps(wd, _mm256_set1_ps(dx[(r0 + r) * nb + b]));
                acc[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(finish8(i0[r], i1[r])), scale, acc[h][r]);
                acc[h][r] = _mm256_fmadd_ps(wm, _mm256_set1_ps(sx[(r0 + r) * nb + b]), acc[h][r]);
            }
        }
    }
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < R; r++) {
            const int64_t i = (r0 + r) * N + 16 * o + 8 * h;
            if (y_bf16) {
                float v[8];
                _mm256_storeu_ps(v, acc[h][r]);
                for (int u = 0; u < 8; u++) store(y, 1, i + u, v[u]);
            } else {
                _mm256_storeu_ps((float *)y + i, acc[h][r]);
            }
        }
}
#else
// y[r0 + r, 16o .. 16o + 15] = 16 floats, stored as float32 or bf16 (store()'s rounding, 16 lanes)
static inline void store16(void *y, int bf16, int64_t i, __m512 v) {
    if (!bf16) {
        _mm512_storeu_ps((float *)y + i, v);
        return;
    }
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256((__m256i *)((uint16_t *)y + i), _mm512_cvtepi32_epi16(r));
}

// Output group o (rows 16o..16o+15 of W) for R (1..LANE_ROWS, a constant at each call) rows of x
// from row r0: per block, 8 dpbusd per row (two chains: low and high nibbles), then
// acc += (d * dx) * dot + m * sx for the 16 outputs at once.
static inline __attribute__((always_inline)) void lanes_tile(const int R, int64_t o, int64_t nb, int64_t K,
        int64_t N, const uint8_t *qw, const uint16_t *dw, const uint16_t *mw, const int8_t *qx, const float *dx,
        const float *sx, void *y, int y_bf16, int64_t r0) {
    const uint8_t *wo = qw + o * nb * 256;
    const uint16_t *dwo = dw + o * nb * 16, *mwo = mw + o * nb * 16;
    const __m512i low = _mm512_set1_epi8(0x0F);
    // acc, i0 and i1 are sized by the constant, not by R: as variable-length arrays (i0 and i1
    // allocated anew every block) GCC kept them on the stack, storing and reloading the sums
    __m512 acc[LANE_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = wo + b * 256;
        // the weights stream from memory once: ask for those PREFETCH_ROWS output rows ahead
        for (int off = 0; off < 256; off += 64) _mm_prefetch((const char *)(wb + PREFETCH_ROWS * nb * 16 + off), _MM_HINT_T0);
        __m512i i0[LANE_ROWS], i1[LANE_ROWS];
        for (int r = 0; r < R; r++) i0[r] = i1[r] = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            const __m512i t = _mm512_loadu_si512(wb + 64 * j);
            const __m512i lo = _mm512_and_si512(t, low), hi = _mm512_and_si512(_mm512_srli_epi16(t, 4), low);
            for (int r = 0; r < R; r++) {
                const int32_t *xw = (const int32_t *)(qx + (r0 + r) * K + b * QK);
                i0[r] = _mm512_dpbusd_epi32(i0[r], lo, _mm512_set1_epi32(xw[j]));
                i1[r] = _mm512_dpbusd_epi32(i1[r], hi, _mm512_set1_epi32(xw[j + 4]));
            }
        }
        const __m512 wd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dwo + b * 16)));
        const __m512 wm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mwo + b * 16)));
        for (int r = 0; r < R; r++) {
            const __m512 scale = _mm512_mul_ps(wd, _mm512_set1_ps(dx[(r0 + r) * nb + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(i0[r], i1[r])), scale, acc[r]);
            acc[r] = _mm512_fmadd_ps(wm, _mm512_set1_ps(sx[(r0 + r) * nb + b]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) store16(y, y_bf16, (r0 + r) * N + 16 * o, acc[r]);
}
#endif

static int lanes_matmul(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *qw, const uint16_t *dw,
                        const uint16_t *mw, int64_t N, void *y, int y_bf16) {
    const int64_t nb = K / QK, groups = N / 16;
    float *dx, *sx;
    int8_t *work = quantize_rows(x, x_bf16, M, M, K, 1, &dx, &sx), *qx = work;
    if (work == NULL) return -1;
#pragma omp parallel
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t chunk = (groups + threads - 1) / threads;
        const int64_t o0 = t * chunk < groups ? t * chunk : groups, o1 = o0 + chunk < groups ? o0 + chunk : groups;
        for (int64_t o = o0; o < o1; o++)
            for (int64_t r0 = 0; r0 < M; r0 += LANE_ROWS) {   // the group's weights stay in cache
                switch (M - r0 < LANE_ROWS ? M - r0 : LANE_ROWS) {
                    case 1: lanes_tile(1, o, nb, K, N, qw, dw, mw, qx, dx, sx, y, y_bf16, r0); break;
                    case 2: lanes_tile(2, o, nb, K, N, qw, dw, mw, qx, dx, sx, y, y_bf16, r0); break;
                    case 3: lanes_tile(3, o, nb, K, N, qw, dw, mw, qx, dx, sx, y, y_bf16, r0); break;
#if LANE_ROWS == 8
                    case 4: lanes_tile(4, o, nb, K, N, qw, dw, mw, qx, dx, sx, y, y_bf16, r0); break;
                    case 5: lanes_tile(5, o, nb, K, N, qw, dw, mw, qx, dx, sx, y, y_bf16, r0); break;
                    case 6: lanes_tile(6, o, nb, K, N, qw, dw, mw, qx, dx, sx, y, y_bf16, r0); break;
                    case 7: lanes_tile(7, o, nb, K, N, qw, dw, mw, qx, dx, sx, y, y_bf16, r0); break;
#endif
                    default: lanes_tile(LANE_ROWS, o, nb, K, N, qw, dw, mw, qx, dx, sx, y, y_bf16, r0); break;
                }
            }
    }
    free(work);
    return 0;
}
#if LANES16

// ------------------------------------------------------------------ outputs in lanes, AMX
//
// Where the CPU has AMX (Sapphire Rapids and later Xeons), a verify of many rows or a prefill
// is bound by lanes_tile's instructions: 8 dpbusd and ~6 more per row, block and 16 outputs. One
// TDPBSUD instead takes the integer dot products of 16 rows of x with 16 output rows over a block
// (x signed in tile A [16 rows][32 bytes], the weights unsigned in tile B [8][64], C [16][16]
// int32), and what is left per row and block is the scaling lanes_tile does, in the same order:
//     acc += (d * dx) * dot + m * sx          (16 outputs in lanes)
// The integer dot products are exact either way, so the results are lanes_matmul's bit for bit
// (tests/test_q4_1_kernel.py), and a row's result still never depends on the other rows.
// The packed weights are already tile B's layout, two nibbles to a byte: vector j of a block
// holds B's row j (k = 4j..4j+3) in its low nibbles and row j + 4 (k = 16 + 4j..) in its high
// ones; each group's blocks are unpacked once into an L1 buffer for all of x's row tiles.
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define AMX 1
// GCC's tile intrinsics are asm statements that do not tell the compiler what memory they read
// (tileloadd none, ldtilecfg only its first 8 bytes): a compiler barrier before each keeps the
// stores they read from being dropped or moved past them at -O3.
#define TILE_BARRIER() __asm__ volatile("" ::: "memory")
#define tile_load(t, base, stride) do { TILE_BARRIER(); _tile_loadd(t, base, stride); } while (0)
#define AMX_ROWS 16   // rows of x per tile
static int64_t amx_from_rows = 0;   // calls of at least this many rows take the AMX path (0: none)
static int64_t amx_calls = 0;       // calls that took it (for tests: the results are the same either way)

// Linux gives a process the AMX tile state only when it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without it the first tile instruction is an illegal instruction. Asked once.
static int tiles_permitted(void) {
    static int permitted = -1;
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return permitted;
}

int q4_1_amx_enable(int64_t from_rows) {
    amx_from_rows = tiles_permitted() ? from_rows : 0;
    return tiles_permitted();
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Tiles: C [16][16] int32 in 0, 3, 4, 5 (four blocks' dot products in flight), A [16 rows of
// x][32 int8] in 1 and 6, B [8][16 x 4 uint8] in 2 and 7. The configuration is per thread (and
// PyTorch's oneDNN loads its own): every call loads ours.
static void amx_configure(void) {
    struct tile_config cfg = {0};
    cfg.palette = 1;
    const int c[4] = {0, 3, 4, 5};
    for (int i = 0; i < 4; i++) cfg.rows[c[i]] = 16, cfg.colsb[c[i]] = 64;
    cfg.rows[1] = cfg.rows[6] = 16, cfg.colsb[1] = cfg.colsb[6] = 32;
    cfg.rows[2] = cfg.rows[7] = 8, cfg.colsb[2] = cfg.colsb[7] = 64;
    TILE_BARRIER();
    _tile_loadconfig(&cfg);
}

// The integer dot products of n (1..4) blocks from block b, 16 rows of x (a: their qx, row stride
// K) by one group's 16 outputs (wb: its unpacked blocks), into c [n][16 rows][16 outputs]. The
// blocks go to different tiles so their TDPBSUDs overlap instead of waiting on each other's stores.
static inline __attribute__((always_inline)) void amx_dots(int64_t b, int n, const int8_t *a, int64_t K,
                                                           const uint8_t *wb, int32_t *c) {
    _tile_zero(0);
    tile_load(1, a + b * QK, K);
    tile_load(2, wb + b * 512, 64);
    _tile_dpbsud(0, 1, 2);
    if (n > 1) {
        _tile_zero(3);
        tile_load(6, a + (b + 1) * QK, K);
        tile_load(7, wb + (b + 1) * 512, 64);
        _tile_dpbsud(3, 6, 7);
    }
    if (n > 2) {
        _tile_zero(4);
        tile_load(1, a + (b + 2) * QK, K);
        tile_load(2, wb + (b + 2) * 512, 64);
        _tile_dpbsud(4, 1, 2);
    }
    if (n > 3) {
        _tile_zero(5);
        tile_load(6, a + (b + 3) * QK, K);
        tile_load(7, wb + (b + 3) * 512, 64);
        _tile_dpbsud(5, 6, 7);
    }
    _tile_stored(0, c, 64);
    if (n > 1) _tile_stored(3, c + 256, 64);
    if (n > 2) _tile_stored(4, c + 512, 64);
    if (n > 3) _tile_stored(5, c + 768, 64);
}

// Output group o (16 outputs) for R (1..16, a constant at each call) rows of x from row r0: one
// TDPBSUD per block into C, then lanes_tile's scaling of each row's 16 sums.
static inline __attribute__((always_inline)) void amx_tile(const int R, int64_t o, int64_t nb, int64_t K,
        int64_t N, const uint8_t *wb, const uint16_t *dw, const uint16_t *mw, const int8_t *qx, const float *dx,
        const float *sx, void *y, int y_bf16, int64_t r0) {
    const uint16_t *dwo = dw + o * nb * 16, *mwo = mw + o * nb * 16;
    int32_t c[4 * 16 * 16] __attribute__((aligned(64)));
    __m512 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 4) {
        const int n = nb - b0 < 4 ? (int)(nb - b0) : 4;
        amx_dots(b0, n, qx + r0 * K, K, wb, c);
        for (int i = 0; i < n; i++) {   // blocks in order: lanes_tile's order of additions
            const int64_t b = b0 + i;
            const __m512 wd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dwo + b * 16)));
            const __m512 wm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mwo + b * 16)));
            for (int r = 0; r < R; r++) {
                const __m512 scale = _mm512_mul_ps(wd, _mm512_set1_ps(dx[(r0 + r) * nb + b]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 256 * i + 16 * r)), scale, acc[r]);
                acc[r] = _mm512_fmadd_ps(wm, _mm512_set1_ps(sx[(r0 + r) * nb + b]), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) store16(y, y_bf16, (r0 + r) * N + 16 * o, acc[r]);
}

static int amx_matmul(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *qw, const uint16_t *dw,
                      const uint16_t *mw, int64_t N, void *y, int y_bf16) {
    const int64_t nb = K / QK, groups = N / 16, padded = (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
    amx_calls++;
    float *dx, *sx;   // x quantized as lanes_matmul's, in rows padded with zeros to whole tiles
    int8_t *qx = quantize_rows(x, x_bf16, M, padded, K, 1, &dx, &sx);
    if (qx == NULL) return -1;
#pragma omp parallel
    {
        amx_configure();
        uint8_t wb[nb * 512] __attribute__((aligned(64)));   // one group's blocks unpacked (K = 1536: 24 KB)
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t chunk = (groups + threads - 1) / threads;
        const int64_t o0 = t * chunk < groups ? t * chunk : groups, o1 = o0 + chunk < groups ? o0 + chunk : groups;
        const __m512i low = _mm512_set1_epi8(0x0F);
        for (int64_t o = o0; o < o1; o++) {
            const uint8_t *wo = qw + o * nb * 256;
            for (int64_t b = 0; b < nb; b++) {
                _mm_prefetch((const char *)(wo + PREFETCH_ROWS * nb * 16 + b * 256), _MM_HINT_T0);
                for (int j = 0; j < 4; j++) {
                    const __m512i v = _mm512_loadu_si512(wo + b * 256 + 64 * j);
                    _mm512_store_si512(wb + b * 512 + 64 * j, _mm512_and_si512(v, low));
                    _mm512_store_si512(wb + b * 512 + 256 + 64 * j, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
                }
            }
            for (int64_t r0 = 0; r0 < M; r0 += AMX_ROWS) {
                switch (M - r0 < AMX_ROWS ? M - r0 : AMX_ROWS) {
#define AMX_CASE(n) case n: amx_tile(n, o, nb, K, N, wb, dw, mw, qx, dx, sx, y, y_bf16, r0); break;
                    AMX_CASE(1) AMX_CASE(2) AMX_CASE(3) AMX_CASE(4) AMX_CASE(5) AMX_CASE(6) AMX_CASE(7)
                    AMX_CASE(8) AMX_CASE(9) AMX_CASE(10) AMX_CASE(11) AMX_CASE(12) AMX_CASE(13) AMX_CASE(14)
                    AMX_CASE(15) default: amx_tile(16, o, nb, K, N, wb, dw, mw, qx, dx, sx, y, y_bf16, r0); break;
#undef AMX_CASE
                }
            }
        }
        _tile_release();
    }
    free(qx);
    return 0;
}

// ------------------------------------------------------------------ bf16 tiles on dequantized weights
//
// The integer tiles above still scale every block of every row apart (the scales d * dx differ
// per block), which costs about what the dot products save. Here each group's weights are
// dequantized once per call, w = d * q + m in float32 rounded to bf16, into tile B's bf16 layout
// ([16 rows: k pairs][16 outputs x 2]); x's bf16 rows are tile A as they are; TDPBF16PS sums
// whole rows of K into float32 tiles C with no per-block work. The dequantization (~0.3
// instructions a weight) is shared by all of the call's rows, so this pays only from a few dozen
// rows (measured per machine: tiles.py; 48 on the README's Xeon). Numerics differ from the integer paths: x is not rounded
// to int8 (it stays bf16, exact), the weights are rounded to bf16 (relative error <= 2^-9, far
// below Q4_1's own step), and the products are summed in the tile unit's order; a row's result
// still never depends on the other rows.
#if defined(__AMX_BF16__)
#define BF16_TILES 1
static int64_t bf16_from_rows = 0;   // calls of at least this many rows take this path (0: none)
static int64_t bf16_calls = 0;

// Tiles: C [16][16] float32 in 0..3 (two row tiles by two groups of outputs), A [16 rows of
// x][32 bf16] in 4 and 5, B [16 k pairs][16 outputs x 2 bf16] in 6 and 7.
static void bf16_configure(void) {
    struct tile_config cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    TILE_BARRIER();
    _tile_loadconfig(&cfg);
}

// Group o's block b as tile B in bf16: wb [16 rows][32 bf16], row i holding k = 2i, 2i + 1 of the
// 16 outputs. In the packed block's vector j, lane l (output l) has k = 4j + c in byte c's low
// nibble and k = 16 + 4j + c in its high one: a shift brings one k's nibble of all 16 outputs to
// the bottom of their int32 lanes, and vpermps looks its value up as a float (an index's low 4 bits
// are the nibble), so d and m apply as they are (16 outputs in lanes); two such k become one tile
// row (bf16 pairs: cvtne2ps puts them side by side, vpermw interleaves them per output).
static inline __attribute__((always_inline)) void dequantize_block(const uint8_t *wq, const uint16_t *d16,
                                                                    const uint16_t *m16, uint16_t *wb) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d16));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)m16));
    // q -> float by table lookup: vpermps reads only an index's low 4 bits (the nibble)
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int j = 0; j < 4; j++) {
        const __m512i v = _mm512_loadu_si512(wq + 64 * j);
        for (int h = 0; h < 2; h++)
            for (int c = 0; c < 4; c += 2) {
                const __m512 qa = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8 * c + 4 * h), values);
                const __m512 qb = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 8 * c + 8 + 4 * h), values);
                const __m512 wa = _mm512_fmadd_ps(qa, d, m), wb2 = _mm512_fmadd_ps(qb, d, m);
                const __m512i side = (__m512i)_mm512_cvtne2ps_pbh(wb2, wa);   // [k for 16 outputs | k + 1]
                _mm512_store_si512(wb + 32 * (8 * h + 2 * j + c / 2), _mm512_permutexvar_epi16(pairs, side));
            }
    }
}

static int bf16_matmul(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *qw, const uint16_t *dw,
                       const uint16_t *mw, int64_t N, void *y, int y_bf16) {
    const int64_t nb = K / QK, groups = N / 16, padded = (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
    bf16_calls++;
    // x as bf16 rows padded with zero rows to whole tiles (float32 x rounded as store16 rounds)
    uint16_t *xb = aligned_alloc(64, (size_t)(padded * K * 2 + 63) / 64 * 64);
    if (xb == NULL) return -1;
    for (int64_t r = 0; r < padded; r++)
        for (int64_t k = 0; k < K; k += 16) {
            if (r >= M) { _mm256_storeu_si256((__m256i *)(xb + r * K + k), _mm256_setzero_si256()); continue; }
            if (x_bf16) _mm256_storeu_si256((__m256i *)(xb + r * K + k),
                                            _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + r * K + k)));
            else store16(xb, 1, r * K + k, _mm512_loadu_ps((const float *)x + r * K + k));
        }
    // per thread, two groups' blocks as tiles B (K = 1536: 96 KB; on the heap, as large models' K
    // would not fit a thread's stack)
    const int64_t team = omp_get_max_threads(), per_thread = 2 * nb * 512;
    uint16_t *buffers = aligned_alloc(64, (size_t)(team * per_thread * 2 + 63) / 64 * 64);
    if (buffers == NULL) {
        free(xb);
        return -1;
    }
#pragma omp parallel num_threads(team)
    {
        bf16_configure();
        float c[16 * 16] __attribute__((aligned(64)));
        // pairs of groups to a thread: each x tile loaded feeds two products, each weight tile two
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        uint16_t *wb = buffers + t * per_thread;
        const int64_t chunk = ((groups + threads - 1) / threads + 1) / 2 * 2;
        const int64_t o0 = t * chunk < groups ? t * chunk : groups, o1 = o0 + chunk < groups ? o0 + chunk : groups;
        for (int64_t o = o0; o < o1; o += 2) {
            const int two = o + 1 < o1;
            for (int g = 0; g <= two; g++) {
                const uint8_t *wo = qw + (o + g) * nb * 256;
                for (int64_t b = 0; b < nb; b++)
                    dequantize_block(wo + b * 256, dw + ((o + g) * nb + b) * 16, mw + ((o + g) * nb + b) * 16,
                                     wb + (g * nb + b) * 512);
            }
            const uint16_t *w1 = wb + nb * 512;
            // C: 0 = (rows r0.., group o), 1 = (r0.., o + 1), 2 = (r0 + 16.., o), 3 = (r0 + 16.., o + 1)
            for (int64_t r0 = 0; r0 < padded; r0 += 2 * AMX_ROWS) {
                const int rows2 = r0 + AMX_ROWS < padded;
                const uint16_t *a = xb + r0 * K;
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int64_t b = 0; b < nb; b++) {
                    tile_load(6, wb + b * 512, 64);
                    tile_load(4, a + b * QK, K * 2);
                    _tile_dpbf16ps(0, 4, 6);
                    if (two) { tile_load(7, w1 + b * 512, 64); _tile_dpbf16ps(1, 4, 7); }
                    if (rows2) {
                        tile_load(5, a + AMX_ROWS * K + b * QK, K * 2);
                        _tile_dpbf16ps(2, 5, 6);
                        if (two) _tile_dpbf16ps(3, 5, 7);
                    }
                }
                for (int q = 0; q < 4; q++) {
                    const int g = q & 1, rt = q >> 1;
                    if ((g && !two) || (rt && !rows2)) continue;
                    switch (q) {
                        case 0: _tile_stored(0, c, 64); break;
                        case 1: _tile_stored(1, c, 64); break;
                        case 2: _tile_stored(2, c, 64); break;
                        default: _tile_stored(3, c, 64); break;
                    }
                    TILE_BARRIER();
                    for (int r = 0; r < AMX_ROWS && r0 + AMX_ROWS * rt + r < M; r++)
                        store16(y, y_bf16, (r0 + AMX_ROWS * rt + r) * N + 16 * (o + g), _mm512_load_ps(c + 16 * r));
                }
            }
        }
        _tile_release();
    }
    free(buffers);
    free(xb);
    return 0;
}
int q4_1_bf16_enable(int64_t from_rows) {
    bf16_from_rows = tiles_permitted() ? from_rows : 0;
    return tiles_permitted();
}
#endif
#endif
#endif
#if !defined(AMX)
static int64_t amx_calls = 0;
int q4_1_amx_enable(int64_t from_rows) { (void)from_rows; return 0; }
#endif
int64_t q4_1_amx_calls(void) { return amx_calls; }
#if !defined(BF16_TILES)
static int64_t bf16_calls = 0;
int q4_1_bf16_enable(int64_t from_rows) { (void)from_rows; return 0; }
#endif
int64_t q4_1_bf16_calls(void) { return bf16_calls; }

// ------------------------------------------------------------------ entry points

// Blocks per weight row after padding (the row strides of qw: 16 bytes a block; dw, mw: 1 each).
int64_t q4_1_padded_blocks(int64_t K) { return padded_blocks(K); }

// x [M, K] float32, or bf16 when x_bf16; y [M, N] float32, or bf16 when y_bf16 (rounded as
// PyTorch's .to(bfloat16) rounds); qw / dw / mw as above.
// Returns 0, or -1 if the quantized rows' memory (M * np * 40 bytes) could not be allocated.
int q4_1_matmul(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *qw, const uint16_t *dw,
                const uint16_t *mw, int64_t N, void *y, int y_bf16) {
#if LANES16
#if defined(AMX)
#if defined(BF16_TILES)
    if (q4_1_layout(N) && bf16_from_rows > 0 && M >= bf16_from_rows) return bf16_matmul(x, x_bf16, M, K, qw, dw, mw, N, y, y_bf16);
#endif
    if (q4_1_layout(N) && amx_from_rows > 0 && M >= amx_from_rows) return amx_matmul(x, x_bf16, M, K, qw, dw, mw, N, y, y_bf16);
#endif
#endif
    if (q4_1_layout(N)) return lanes_matmul(x, x_bf16, M, K, qw, dw, mw, N, y, y_bf16);
    const int64_t np = padded_blocks(K);
    float *dx, *sx;
    int8_t *work = quantize_rows(x, x_bf16, M, M, K, 0, &dx, &sx), *qx = work;
    if (work == NULL) return -1;
#pragma omp parallel
    {
        // contiguous output rows per thread, in multiples of 4 (a tile of R = 1)
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t chunk = ((N + threads - 1) / threads + 3) / 4 * 4;
        const int64_t n0 = t * chunk < N ? t * chunk : N, n1 = n0 + chunk < N ? n0 + chunk : N;
        // More than MAX_ROWS rows of x take several passes; each pass then runs over a block of
        // BLOCK_ROWS weight rows before the next block, so a weight row comes from memory once for
        // all the passes (the later ones find it in cache) instead of once per pass.
        const int64_t block = M <= MAX_ROWS ? n1 - n0 : BLOCK_ROWS;
        for (int64_t b0 = n0; b0 < n1; b0 += block) {
            const int64_t b1 = b0 + block < n1 ? b0 + block : n1;
            for (int64_t r = 0; r < M; r += MAX_ROWS) {
                const int R = M - r < MAX_ROWS ? (int)(M - r) : MAX_ROWS;
                rows(R, b0, b1, K, N, qw, dw, mw, qx + r * np * QK, dx + r * np, sx + r * np, y, y_bf16, r);
            }
        }
    }
    free(work);
    return 0;
}
