// The Q4_1 x Q8 kernel alone, in cache: microseconds a call by rows of x, and a hash of the outputs
// (two builds agree bit for bit when their hashes do). Random blocks, the same on every run.
//
//   cc -O3 -march=haswell -fopenmp -DKERNEL='"whiflash_core/kernels/q4_1.c"' -I. \
//       bench/q4_1_kernel_bench.c -o /tmp/q4_1_bench -lm        (-march=native: this CPU's class)
//   OMP_NUM_THREADS=1 /tmp/q4_1_bench N K [REPS] [COPIES]
//
// COPIES > 1 holds that many copies of the weights and multiplies by the next one each call, so
// they come from memory as in a whole forward (75 MB of weights: a decode step reads them from
// DRAM or a shared last-level cache) instead of from this core's L2.
// bench/q4_1_kernel_ab.sh builds it from this tree and from another checkout's kernel and runs the
// two in turns (best of each).
#ifndef KERNEL
#define KERNEL "whiflash_core/kernels/q4_1.c"
#endif
#include KERNEL
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s N K [REPS]\n", argv[0]);
        return 2;
    }
    const int64_t N = atoll(argv[1]), K = atoll(argv[2]), reps = argc > 3 ? atoll(argv[3]) : 50;
    const int64_t copies = argc > 4 ? atoll(argv[4]) : 1;
    const int64_t np = padded_blocks(K);
    const size_t weight_bytes = q4_1_layout(N) ? (size_t)(N * (K / QK) * 16) : (size_t)(N * np * 16);
    uint8_t *qw = malloc(weight_bytes * copies);
    uint16_t *dw = malloc(N * np * 2 * copies), *mw = malloc(N * np * 2 * copies);
    float *x = malloc(16 * K * 4), *y = malloc(16 * N * 4);
    srand(1);
    for (size_t i = 0; i < weight_bytes; i++) qw[i] = (uint8_t)rand();
    for (int64_t i = 0; i < N * np; i++) dw[i] = 0x2000, mw[i] = 0xA000;   // fp16 scales 2^-7, mins -2^-7
    for (int64_t i = 0; i < 16 * K; i++) x[i] = (rand() % 200 - 100) / 50.0f;
    for (int64_t c = 1; c < copies; c++) {
        __builtin_memcpy(qw + c * weight_bytes, qw, weight_bytes);
        __builtin_memcpy(dw + c * N * np, dw, N * np * 2);
        __builtin_memcpy(mw + c * N * np, mw, N * np * 2);
    }
    int64_t next = 0;
    const int rows[] = {1, 2, 4, 8, 16};
    for (int m = 0; m < 5; m++) {
        const int M = rows[m];
        double best = 1e9;
        for (int64_t rep = 0; rep < reps; rep++) {
            const double t0 = now();
            for (int k = 0; k < 20; k++, next = (next + 1) % copies)
                q4_1_matmul(x, 0, M, K, qw + next * weight_bytes, dw + next * N * np, mw + next * N * np, N, y, 0);
            const double t = (now() - t0) / 20;
            best = t < best ? t : best;
        }
        unsigned long hash = 0;
        for (int64_t i = 0; i < M * N; i++) {
            unsigned bits;
            __builtin_memcpy(&bits, y + i, 4);
            hash = hash * 1000003u ^ bits;
        }
        printf("N=%lld K=%lld rows=%d: %.1f us (%.2f us a row) hash %lx\n", (long long)N, (long long)K, M, best * 1e6,
               best * 1e6 / M, hash);
    }
    return 0;
}
