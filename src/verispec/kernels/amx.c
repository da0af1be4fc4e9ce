/* AMX tiles for the bf16 matmul (verispec/kernels, bf16_gemm.c): whether the process may use them,
 * and the tile layout. (int8 weights tried it too, widened to bf16 pairs on the fly: 16-64 rows
 * ran 2-2.5x faster, but one row 1.5x slower than the FMA path, and a kernel cannot choose its
 * path by the row count without giving a row other bits in a verify step than in a decode step.) */
#include "amx.h"

#ifdef VERISPEC_AMX
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static int amx_ready = -1;  /* -1: not asked yet; 0: refused (the kernels take their AVX512 paths) */

/* Linux lends a process the AMX tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM). */
int verispec_amx_enabled(void) {
    if (amx_ready < 0) amx_ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return amx_ready;
}

void verispec_amx_configure(int MT) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = t <= 4 ? (uint8_t)MT : 16;
    }
    /* GCC 12 does not count ldtilecfg as reading the 64 bytes, and dropped part of the memset
     * as a dead store (unused tiles' sizes left as garbage: ldtilecfg faults): a barrier keeps it */
    __asm__ __volatile__("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}
#endif
