/* The path a bfloat16 linear takes on this build and CPU, chosen in one place for linear_bf16 (linear_bf16.c)
 * and for the bfloat16 products of a quantized weight (linear_q, linear.c):
 *   - "amx" (AMX-BF16) from AMX_MIN_ROWS rows, where the OS permits the tiles;
 *   - else "avx512-bf16" (AVX512-BF16) where VDPBF16PS out-runs the FMAs on the widened weight
 *     (dot_outruns_fma), or where the cap names it;
 *   - else "widened": each weight widened to float32.
 * linear_bf16_limit caps the path (tests, PAGED_BF16_LINEAR); capped at "avx512-bf16", the dot products run
 * wherever the CPU has them.
 */

#include "bf16_kernels.h"
#include "linear_path.h"

/* From how many rows AMX: below one A tile's rows the dot products are as fast. */
#define AMX_MIN_ROWS 16

static int path_limit = PATH_AMX;

/* Caps the paths linear_bf16 may take at `limit` (0 widened, 1 avx512-bf16, 2 amx). */
void linear_bf16_limit(int limit) { path_limit = limit; }

#ifdef __AVX512BF16__
/* Cycles (time-stamp counter) of 2,000 rounds of 12 independent VDPBF16PS (dot) or FMA chains. */
static uint64_t chain_cycles(int dot) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0,
           a10 = a0, a11 = a0;
    const __m512 w = _mm512_set1_ps(1e-9f);
    const __m512bh h = (__m512bh)_mm512_set1_epi32(0x3a803a80); /* 2^-10 twice: normal values, sums stay small */
    const uint64_t start = __rdtsc();
    for (int i = 0; i < 2000; ++i) {
#define STEP(a) a = dot ? _mm512_dpbf16_ps(a, h, h) : _mm512_fmadd_ps(a, w, w);
        STEP(a0) STEP(a1) STEP(a2) STEP(a3) STEP(a4) STEP(a5) STEP(a6) STEP(a7) STEP(a8) STEP(a9) STEP(a10) STEP(a11)
#undef STEP
        __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7), "+v"(a8),
                         "+v"(a9), "+v"(a10), "+v"(a11));
    }
    return __rdtsc() - start;
}

/* Whether VDPBF16PS multiplies bfloat16 faster than FMAs multiply the widened weights: it does twice an
 * FMA's products, but some CPUs issue it at a quarter of FMA's rate (an Intel Xeon without AMX: 1.26
 * against 5.1 G instructions/s a core), where the widened path is twice as fast. Measured once, the
 * best of three short runs of each; the attention kernel asks too (bf16_kernels.h). */
int dot_outruns_fma(void) {
    static int outruns = -1;
    if (__atomic_load_n(&outruns, __ATOMIC_ACQUIRE) < 0) {
        uint64_t dot = UINT64_MAX, fma = UINT64_MAX;
        for (int round = 0; round < 3; ++round) {
            const uint64_t f = chain_cycles(0), d = chain_cycles(1);
            fma = f < fma ? f : fma;
            dot = d < dot ? d : dot;
        }
        __atomic_store_n(&outruns, dot < 2 * fma * 5 / 6, __ATOMIC_RELEASE); /* products a cycle: 2 / dot > 1.2 / fma */
    }
    return outruns;
}
#endif

int linear_bf16_path(int64_t M) {
#ifdef HAVE_AMX
    if (path_limit >= PATH_AMX && M >= AMX_MIN_ROWS && amx_permitted()) return PATH_AMX;
#endif
#ifdef __AVX512BF16__
    if (path_limit == PATH_DOT || (path_limit > PATH_DOT && dot_outruns_fma())) return PATH_DOT;
#endif
    (void)M;
    return PATH_WIDENED;
}
