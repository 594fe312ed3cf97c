// Stage 3's tile sizes, shared by its kernels.

#define CO_TM 64
#define CO_TP 64
#define CO_TJ 64
#define CO_XSTRIDE 72
#define CO_SSTRIDE 68
#define CO_THREADS 128
