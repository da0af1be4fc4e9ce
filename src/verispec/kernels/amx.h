/* AMX tiles for the bf16 matmul (verispec/kernels, amx.c). */
#ifndef VERISPEC_AMX_H
#define VERISPEC_AMX_H
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define VERISPEC_AMX 1
#define AMX_K 32  /* input columns one tile step covers: 16 pairs */

/* Whether this process may use the AMX tile state (asked of Linux once). */
int verispec_amx_enabled(void);

/* This thread's tiles: 0-3 the accumulators of 4 blocks of 16 output rows, MT input rows each;
 * 4 the MT input rows by 32 columns; 5-7 weight tiles, 16 column pairs by 16 output rows. */
void verispec_amx_configure(int MT);
#endif
#endif
