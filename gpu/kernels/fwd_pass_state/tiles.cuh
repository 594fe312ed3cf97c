// Stage 2's tile sizes, shared by the fused state pass and 2a.

#define ST_TP 64        // headdim rows per block
#define ST_TN 64        // dstate columns per block
#define ST_TK 64        // tokens per shared-memory stage
#define ST_STRIDE 72    // row stride (floats) of both tiles: conflict-free fragment loads
#define ST_THREADS 128
