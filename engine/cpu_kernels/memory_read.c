/* The machine's memory-read speed: `paged bench --workload batch1` sets a decode step's bytes against it. */

#include <stdint.h>

#include "vec.h"

/* Reads data[0 .. n) once (n a multiple of 64), 64 bytes a load, the threads splitting it; returns the XOR of
 * every 64-bit word, so that no load can be dropped. */
uint64_t memory_read(const uint8_t *data, int64_t n) {
    typedef uint64_t v8 __attribute__((vector_size(64)));
    uint64_t folded = 0;
#pragma omp parallel for schedule(static) reduction(^ : folded)
    for (int64_t chunk = 0; chunk < n / 4096; ++chunk) {
        v8 acc = {0};
        for (int64_t i = chunk * 4096; i < (chunk + 1) * 4096; i += 64) {
            v8 v;
            memcpy(&v, data + i, sizeof v);
            acc ^= v;
        }
        for (int l = 0; l < 8; ++l) folded ^= acc[l];
    }
    for (int64_t i = n / 4096 * 4096; i < n; i += 8) {
        uint64_t w;
        memcpy(&w, data + i, sizeof w);
        folded ^= w;
    }
    return folded;
}
