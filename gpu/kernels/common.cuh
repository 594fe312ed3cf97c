// Shared helpers of the SSD kernels: fragment loads, tile copies and the contract between a
// kernel and the host.
//
// Every kernel file is compiled in one NVRTC program, after ptx.cuh (the inline PTX) and this
// file. No CUDA header is needed.

typedef long long i64;

#define LOG2E_F 1.4426950408889634f
#define NEG_INF_F __int_as_float(0xff800000)

// The contract of each kernel with the host, in one place: every kernel K takes one parameter
// struct by value (its fields are the kernel's arguments, in the order of the Rust struct of
// the same name in gpu/src), and defines the global `K_layout`, which the host reads from the
// loaded module: the size of that struct (checked against the Rust one) and the dynamic shared
// memory a block of K takes, for dstate up to 64, 128, 192 and 256 (the same four times where
// it does not depend on dstate), as the sizeof of the C struct that lays it out. So the
// shared-memory sizes are written once, here in the kernel source.
struct KernelLayout {
    unsigned params;
    unsigned smem[4];
};
#define SSD_LAYOUT(kernel, Params, smem64, smem128, smem192, smem256) \
    __constant__ KernelLayout kernel##_layout = {sizeof(Params), {smem64, smem128, smem192, smem256}}
#define SSD_LAYOUT_FIXED(kernel, Params, smem) SSD_LAYOUT(kernel, Params, smem, smem, smem, smem)

// Loads an A fragment (16 x 8) from shared memory laid out row-major with `stride` floats:
// A[row][col] = base[row * stride + col], rows [0, 16), cols [0, 8).
__device__ __forceinline__ void load_a_rowmajor(unsigned (&a)[4], const float* base, int stride, int g, int q) {
    a[0] = __float_as_uint(base[g * stride + q]);
    a[1] = __float_as_uint(base[(g + 8) * stride + q]);
    a[2] = __float_as_uint(base[g * stride + q + 4]);
    a[3] = __float_as_uint(base[(g + 8) * stride + q + 4]);
}

// Loads an A fragment (16 x 8) stored transposed: A[row][col] = base[col * stride + row].
__device__ __forceinline__ void load_a_colmajor(unsigned (&a)[4], const float* base, int stride, int g, int q) {
    a[0] = __float_as_uint(base[q * stride + g]);
    a[1] = __float_as_uint(base[q * stride + g + 8]);
    a[2] = __float_as_uint(base[(q + 4) * stride + g]);
    a[3] = __float_as_uint(base[(q + 4) * stride + g + 8]);
}

// Loads a B fragment (8 x 8) stored row-major (k rows): B[k][n] = base[k * stride + n].
__device__ __forceinline__ void load_b_krows(unsigned (&b)[2], const float* base, int stride, int g, int q) {
    b[0] = __float_as_uint(base[q * stride + g]);
    b[1] = __float_as_uint(base[(q + 4) * stride + g]);
}

// Loads a B fragment (8 x 8) stored with n rows: B[k][n] = base[n * stride + k].
__device__ __forceinline__ void load_b_nrows(unsigned (&b)[2], const float* base, int stride, int g, int q) {
    b[0] = __float_as_uint(base[g * stride + q]);
    b[1] = __float_as_uint(base[g * stride + q + 4]);
}

// acc[j] += A B for one warp: A is 16 rows x nk (row-major at `a`, row stride `stride`), B is
// nk x 64 stored n-major (B[k][n] = b[n * stride + k]), nk a multiple of 8; acc[j] holds the
// columns 8j .. 8j + 7 in the C fragment layout. k ascending, the same order at every call.
__device__ __forceinline__ void mma_16x64_nmajor(float (&acc)[8][4], const float* a, const float* b, int stride,
                                                 int nk, int g, int q) {
    for (int kk = 0; kk < nk; kk += 8) {
        unsigned af[4];
        load_a_rowmajor(af, a + kk, stride, g, q);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            unsigned bf[2];
            load_b_nrows(bf, b + j * 8 * stride + kk, stride, g, q);
            mma_tf32(acc[j], af, bf);
        }
    }
}

// A warp's 32 x (8 NF) part of a tile: 2 row fragments of 16 by NF column fragments of 8 (NF = 4:
// a 32 x 32 quarter of a 64 x 64 tile, the 2 x 2 warp split; NF = 8: the pair kernels' 32 x 64).
template <int NF>
__device__ __forceinline__ void zero_2xn(float (&acc)[2][NF][4]) {
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int nf = 0; nf < NF; ++nf)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mi][nf][e] = 0.0f;
}
template <int NF>
__device__ __forceinline__ void mma_2xn(float (&acc)[2][NF][4], const unsigned (&a)[2][4], const unsigned (&b)[NF][2]) {
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int nf = 0; nf < NF; ++nf) mma_tf32(acc[mi][nf], a[mi], b[nf]);
}

// Copies a ROWS x 64 block of a row-major global matrix into shared memory, rounded to TF32,
// optionally scaling row r by row_scale[r] first (SCALE):
//   dst[r * dst_stride + c] = tf32(src[r * src_stride + c] (* row_scale[r]))
// for r < rows_valid and c < cols_valid, 0 elsewhere in [0, ROWS) x [0, 64). Every load of the
// block is issued before the first store (the loops are unrolled), 16 bytes wide when the
// source allows it (aligned base, row stride and cols_valid multiples of 4; dst_stride must
// then be a multiple of 4 too), coalesced along the rows either way.
template <int ROWS, int NT, bool SCALE>
__device__ __forceinline__ void load_block64_tf32(float* dst, int dst_stride, const float* __restrict__ src,
                                                  i64 src_stride, int rows_valid, int cols_valid,
                                                  const float* row_scale, int tid) {
    const bool vec = (((unsigned long long)src | (unsigned long long)(src_stride * 4)) & 15) == 0 &&
                     (cols_valid & 3) == 0 && (dst_stride & 3) == 0;
    if (vec) {
        constexpr int PER = ROWS * 16 / NT;
        float4 v[PER];
#pragma unroll
        for (int k = 0; k < PER; ++k) {
            int e = tid + k * NT;
            int r = e >> 4, c = (e & 15) << 2;
            v[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (r < rows_valid && c < cols_valid) v[k] = __ldg(reinterpret_cast<const float4*>(src + r * src_stride + c));
        }
#pragma unroll
        for (int k = 0; k < PER; ++k) {
            int e = tid + k * NT;
            int r = e >> 4, c = (e & 15) << 2;
            float f = SCALE ? row_scale[r] : 1.0f;
            float4 t = SCALE ? make_float4(v[k].x * f, v[k].y * f, v[k].z * f, v[k].w * f) : v[k];
            *reinterpret_cast<float4*>(dst + r * dst_stride + c) =
                make_float4(tf32_round(t.x), tf32_round(t.y), tf32_round(t.z), tf32_round(t.w));
        }
    } else {
        constexpr int PER = ROWS * 64 / NT;
        float v[PER];
#pragma unroll
        for (int k = 0; k < PER; ++k) {
            int e = tid + k * NT;
            int r = e >> 6, c = e & 63;
            v[k] = (r < rows_valid && c < cols_valid) ? __ldg(src + r * src_stride + c) : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < PER; ++k) {
            int e = tid + k * NT;
            int r = e >> 6, c = e & 63;
            float t = SCALE ? v[k] * row_scale[r] : v[k];
            dst[r * dst_stride + c] = tf32_round(t);
        }
    }
}

// Copies a ROWS x ncols tile (ncols a multiple of 64) as consecutive 64-column blocks.
template <int ROWS, int NT>
__device__ __forceinline__ void load_tile_tf32(float* dst, int dst_stride, const float* __restrict__ src,
                                               i64 src_stride, int rows_valid, int cols_valid, int ncols,
                                               int tid) {
    for (int c0 = 0; c0 < ncols; c0 += 64)
        load_block64_tf32<ROWS, NT, false>(dst + c0, dst_stride, src + c0, src_stride, rows_valid,
                                           cols_valid - c0, nullptr, tid);
}

// 2a's blocks lie on a 1-D grid over (tile, unit), the unit fastest: blockIdx.x = tile * units
// + unit, a tile being a chunk and a part of its state, a unit a head (or a pair of units of one
// group). Consecutive blocks then read the same rows of B, which stay in L2 between them; with
// the tile fastest a unit walked every chunk of a batch before the next unit began, and where a
// batch's B outgrows the L2 (many chunks, few heads) it came back from DRAM once per unit.
__device__ __forceinline__ void tile_and_unit(int units, int& tile, int& unit) {
    tile = (int)(blockIdx.x / (unsigned)units);
    unit = (int)(blockIdx.x % (unsigned)units);
}


// Whether a 64-column block of a row-major global matrix can be copied 16 bytes at a time.
__device__ __forceinline__ bool vec16_ok(const float* src, i64 src_stride, int cols_valid) {
    return (((unsigned long long)src | (unsigned long long)(src_stride * 4)) & 15) == 0 && (cols_valid & 3) == 0;
}

// Starts copying a 64 x 64 block of a row-major global matrix into shared memory (raw f32):
//   dst[r * dst_stride + c] = src[r * src_stride + c] for r < rows_valid, c < cols_valid, 0
// elsewhere. dst_stride must be a multiple of 4. NT threads (tid < NT; 128 by default, the
// same thread -> element map as round_block64_tf32, which rounds the block in place once the
// copies have landed). VEC: 16-byte copies, only where vec16_ok holds (the caller decides,
// once per kernel).
// A block with every row and column valid takes a short path: no predicates and no fallback
// address, one base address per thread in each space, then constant steps of NT / 16 rows (the
// general path's address arithmetic dominates the integer work of the output and state
// kernels).
template <bool VEC, int NT = 128>
__device__ __forceinline__ void async_block64_v(float* dst, int dst_stride, const float* __restrict__ src,
                                                i64 src_stride, int rows_valid, int cols_valid, int tid) {
    if (VEC && rows_valid >= 64 && cols_valid >= 64) {
        const int r0 = tid >> 4, c0 = (tid & 15) << 2;
        const float* s = src + r0 * src_stride + c0;
        const unsigned d = smem_addr(dst + r0 * dst_stride + c0);
        const i64 s_step = (NT / 16) * src_stride;
        const unsigned d_step = (unsigned)((NT / 16) * dst_stride) * 4u;
#pragma unroll
        for (int k = 0; k < 1024 / NT; ++k) cp_async16_all(d + k * d_step, s + k * s_step);
    } else if (VEC) {
#pragma unroll
        for (int k = 0; k < 1024 / NT; ++k) {
            int e = tid + k * NT;
            int r = e >> 4, c = (e & 15) << 2;
            cp_async16(dst + r * dst_stride + c, src + r * src_stride + c, r < rows_valid && c < cols_valid, src);
        }
    } else {
#pragma unroll 8
        for (int k = 0; k < 4096 / NT; ++k) {
            int e = tid + k * NT;
            int r = e >> 6, c = e & 63;
            cp_async4(dst + r * dst_stride + c, src + r * src_stride + c, r < rows_valid && c < cols_valid, src);
        }
    }
}
template <int NT = 128>
__device__ __forceinline__ void async_block64(float* dst, int dst_stride, const float* __restrict__ src,
                                              i64 src_stride, int rows_valid, int cols_valid, int tid) {
    if (vec16_ok(src, src_stride, cols_valid))
        async_block64_v<true, NT>(dst, dst_stride, src, src_stride, rows_valid, cols_valid, tid);
    else
        async_block64_v<false, NT>(dst, dst_stride, src, src_stride, rows_valid, cols_valid, tid);
}

// Starts copying a ROWS x COLS block (COLS a multiple of 4) of a row-major global matrix into
// shared memory at dst_stride (a multiple of 4): zeros where r >= rows_valid or c >= cols_valid
// (cols_valid a multiple of 4). 16-byte copies by NT threads; a fully valid block takes the
// short path (one base address per thread, constant steps). Offsets from src are 32-bit
// unsigned (the callers' ROWS x src_stride stay below 2^32 floats): 64-bit address arithmetic
// costs several integer instructions per 16-byte copy.
// FIRST: the copies read with L2 priority evict_first (data this block reads once and no
// other block needs soon; it then leaves L2 before the lines that others will read).
template <int ROWS, int COLS, int NT, bool FIRST = false>
__device__ __forceinline__ void async_rows(float* dst, int dst_stride, const float* __restrict__ src,
                                           unsigned src_stride, int rows_valid, int cols_valid, int tid) {
    constexpr int CH = COLS / 4;     // 16-byte pieces per row
    constexpr int STEP = NT / CH;    // rows per pass
    static_assert(NT % CH == 0 && ROWS % STEP == 0, "the threads must tile the block");
    const int r0 = tid / CH, c0 = (tid % CH) * 4;
    const unsigned step = (unsigned)STEP * src_stride;
    if (rows_valid >= ROWS && cols_valid >= COLS) {
        const float* s = src + ((unsigned)r0 * src_stride + (unsigned)c0);
        const unsigned d = smem_addr(dst + r0 * dst_stride + c0);
        if (FIRST) {
            const unsigned long long pol = l2_evict_first();
#pragma unroll
            for (int k = 0; k < ROWS / STEP; ++k)
                cp_async16_all_hint(d + (unsigned)(k * STEP * dst_stride) * 4u, s + (unsigned)k * step, pol);
        } else {
#pragma unroll
            for (int k = 0; k < ROWS / STEP; ++k)
                cp_async16_all(d + (unsigned)(k * STEP * dst_stride) * 4u, s + (unsigned)k * step);
        }
    } else {
        const unsigned long long pol = FIRST ? l2_evict_first() : 0;
#pragma unroll
        for (int k = 0; k < ROWS / STEP; ++k) {
            const int r = r0 + k * STEP;
            const bool ok = r < rows_valid && c0 < cols_valid;
            const float* a = ok ? src + ((unsigned)r * src_stride + (unsigned)c0) : src;
            if (FIRST)
                cp_async16_hint(dst + r * dst_stride + c0, a, ok, src, pol);
            else
                cp_async16(dst + r * dst_stride + c0, a, ok, src);
        }
    }
}



// Rounds to TF32, in place, the elements of a 64 x 64 shared block that this thread copied
// with async_block64 (same arguments), after cp_async_wait: no barrier is needed before it.
__device__ __forceinline__ void round_block64_tf32(float* dst, int dst_stride, const float* src, i64 src_stride,
                                                   int cols_valid, int tid) {
    if (vec16_ok(src, src_stride, cols_valid)) {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            int e = tid + k * 128;
            float4* p = reinterpret_cast<float4*>(dst + (e >> 4) * dst_stride + ((e & 15) << 2));
            float4 v = *p;
            *p = make_float4(tf32_round(v.x), tf32_round(v.y), tf32_round(v.z), tf32_round(v.w));
        }
    } else {
#pragma unroll 8
        for (int k = 0; k < 32; ++k) {
            int e = tid + k * 128;
            float* p = dst + (e >> 6) * dst_stride + (e & 63);
            *p = tf32_round(*p);
        }
    }
}

// acc += A B^T for one warp's 32 x (8 NF) part (rows a_row .. a_row + 31 of A, columns b_row ..
// b_row + 8 NF - 1, i.e. rows of B) over k in [0, kend) (kend a multiple of 8) of two shared
// tiles at `stride` floats (a multiple of 4, rows 16-byte aligned): A stored row-major ([row][k],
// shared address a_s in bytes), B stored n-major ([n][k], b_s). Fragments through ldmatrix; raw
// f32 operands (the tensor cores truncate them to TF32).
template <int NF>
__device__ __forceinline__ void mma_slab_2xn(float (&acc)[2][NF][4], unsigned a_s, unsigned b_s, int stride,
                                             int a_row, int b_row, int kend, int lane) {
    const int a_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * stride + (lane >> 4) * 4;
    const int b_off = ((lane & 7) + (lane >> 4) * 8) * stride + ((lane >> 3) & 1) * 4;
    for (int kk = 0; kk < kend; kk += 8) {
        unsigned a[2][4], bf[NF][2];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
            ldmatrix_x4(a[mi], a_s + (unsigned)((a_row + mi * 16) * stride + kk + a_off) * 4u);
#pragma unroll
        for (int np = 0; np < NF / 2; ++np) {
            unsigned r4[4];
            ldmatrix_x4(r4, b_s + (unsigned)((b_row + np * 16) * stride + kk + b_off) * 4u);
            bf[2 * np][0] = r4[0];
            bf[2 * np][1] = r4[1];
            bf[2 * np + 1][0] = r4[2];
            bf[2 * np + 1][1] = r4[3];
        }
        mma_2xn(acc, a, bf);
    }
}

// bf16 storage: the bit patterns of bfloat16 values, as 16-bit words (no CUDA header). A pair
// of neighbouring elements is one 32-bit word, the lower index in its low half.
typedef unsigned short bf16_t;
__device__ __forceinline__ float bf16_lo(unsigned v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(unsigned v) { return __uint_as_float(v & 0xffff0000u); }
// Scales an m16n8k16 A fragment of x^T (ldmatrix.trans of an x tile [token][p], lane (g, q))
// by the weights of its tokens, each term rounded to bf16 once: a[0] and a[1] hold tokens 2q and
// 2q + 1 of the k16 slice (w0, w1), a[2] and a[3] the tokens 8 later (w8, w9).
__device__ __forceinline__ void scale_a_tokens_bf16(unsigned (&a)[4], float w0, float w1, float w8, float w9) {
    a[0] = pack_bf16x2(bf16_lo(a[0]) * w0, bf16_hi(a[0]) * w1);
    a[1] = pack_bf16x2(bf16_lo(a[1]) * w0, bf16_hi(a[1]) * w1);
    a[2] = pack_bf16x2(bf16_lo(a[2]) * w8, bf16_hi(a[2]) * w9);
    a[3] = pack_bf16x2(bf16_lo(a[3]) * w8, bf16_hi(a[3]) * w9);
}

// async_rows for a ROWS x COLS block of bf16 (COLS a multiple of 8): the same 16-byte copies, 8
// elements each. src_stride and dst_stride (elements) must be even, cols_valid a multiple of 8
// (the host's condition for the bf16 kernels: headdim and dstate multiples of 8).
template <int ROWS, int COLS, int NT, bool FIRST = false>
__device__ __forceinline__ void async_rows_bf16(bf16_t* dst, int dst_stride, const bf16_t* __restrict__ src,
                                                unsigned src_stride, int rows_valid, int cols_valid, int tid) {
    static_assert(COLS % 8 == 0, "16-byte pieces");
    async_rows<ROWS, COLS / 2, NT, FIRST>(reinterpret_cast<float*>(dst), dst_stride / 2,
                                          reinterpret_cast<const float*>(src), src_stride / 2, rows_valid,
                                          cols_valid / 2, tid);
}

// One 16-deep k step of the bf16 slab products below: A's two 16-row groups by ldmatrix at
// the shared addresses a0 and a0 + a_step (bytes), B's NF / 2 pairs of 8-column fragments at
// b0 + np b_step; acc[mi][nf] += A_mi B_nf^T.
template <int NF>
__device__ __forceinline__ void mma_k16_2xn_bf16(float (&acc)[2][NF][4], unsigned a0, unsigned a_step, unsigned b0,
                                                 unsigned b_step) {
    static_assert(NF % 2 == 0, "pairs of 8-column fragments");
    unsigned a[2][4], bf[NF][2];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) ldmatrix_x4(a[mi], a0 + (unsigned)mi * a_step);
#pragma unroll
    for (int np = 0; np < NF / 2; ++np) {
        unsigned r4[4];
        ldmatrix_x4(r4, b0 + (unsigned)np * b_step);
        bf[2 * np][0] = r4[0];
        bf[2 * np][1] = r4[1];
        bf[2 * np + 1][0] = r4[2];
        bf[2 * np + 1][1] = r4[3];
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int nf = 0; nf < NF; ++nf) mma_bf16(acc[mi][nf], a[mi], bf[nf]);
}

// acc += A B^T for one warp's 32 x (8 NF) part as mma_slab_2xn, over bf16 tiles (strides in
// elements, multiples of 8, rows 16-byte aligned; kend a multiple of 16): A stored row-major
// ([row][k], shared address a_s in bytes), B stored n-major ([n][k], b_s); bf16 products. The
// warp's two 16-row groups of A start at a_row and a_row + a_gap (16: 32 consecutive rows).
template <int NF>
__device__ __forceinline__ void mma_slab_2xn_bf16(float (&acc)[2][NF][4], unsigned a_s, unsigned b_s, int stride,
                                                  int a_row, int b_row, int kend, int lane, int a_gap = 16) {
    const int a_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * stride + (lane >> 4) * 8;
    const int b_off = ((lane & 7) + (lane >> 4) * 8) * stride + ((lane >> 3) & 1) * 8;
    for (int kk = 0; kk < kend; kk += 16)
        mma_k16_2xn_bf16(acc, a_s + (unsigned)(a_row * stride + kk + a_off) * 2u, (unsigned)(a_gap * stride) * 2u,
                         b_s + (unsigned)(b_row * stride + kk + b_off) * 2u, (unsigned)(16 * stride) * 2u);
}

// async_rows_bf16 for a ROWS x 64 block of bf16 into unpadded 128-byte rows, XOR-swizzled:
// the 16-byte piece k of row r lands at piece k ^ (r & 7), so that the eight rows of an
// ldmatrix hit distinct banks without padding (read by mma_slab_2xn_bf16_swz; in a 1024-byte
// aligned tile, also the 128-byte swizzle of TMA and wgmma). Zeros where r >= rows_valid or a
// piece's columns reach cols_valid (a multiple of 8).
template <int ROWS, int NT>
__device__ __forceinline__ void async_rows_bf16_swz64(bf16_t* dst, const bf16_t* __restrict__ src,
                                                      unsigned src_stride, int rows_valid, int cols_valid, int tid) {
    constexpr int STEP = NT / 8;  // rows per pass: a multiple of 8, so r & 7 is the same in every pass
    static_assert(NT % 8 == 0 && STEP % 8 == 0 && ROWS % STEP == 0, "the threads must tile the block");
    const int r0 = tid / 8, k0 = tid % 8;
    const unsigned d = smem_addr(dst) + (unsigned)(r0 * 128 + ((k0 ^ (r0 & 7)) << 4));
    const float* s = reinterpret_cast<const float*>(src) + ((unsigned)r0 * src_stride + (unsigned)k0 * 8u) / 2u;
    const unsigned step = (unsigned)STEP * src_stride / 2u;  // floats
    if (rows_valid >= ROWS && cols_valid >= 64) {
#pragma unroll
        for (int k = 0; k < ROWS / STEP; ++k) cp_async16_all(d + (unsigned)(k * STEP * 128), s + (unsigned)k * step);
    } else {
        float* dp = reinterpret_cast<float*>(reinterpret_cast<char*>(dst) + (r0 * 128 + ((k0 ^ (r0 & 7)) << 4)));
        const float* fb = reinterpret_cast<const float*>(src);
#pragma unroll
        for (int k = 0; k < ROWS / STEP; ++k) {
            const bool ok = r0 + k * STEP < rows_valid && k0 * 8 < cols_valid;
            cp_async16(dp + k * STEP * 32, ok ? s + (unsigned)k * step : fb, ok, fb);
        }
    }
}

// mma_slab_2xn_bf16 over a 64-wide k slab whose B tile is unpadded and swizzled as
// async_rows_bf16_swz64 leaves it (rows of 64 bf16); A at a_stride elements as there.
template <int NF>
__device__ __forceinline__ void mma_slab_2xn_bf16_swz(float (&acc)[2][NF][4], unsigned a_s, unsigned b_s,
                                                      int a_stride, int a_row, int b_row, int lane, int a_gap = 16) {
    const int a_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * a_stride + (lane >> 4) * 8;
    // Row b_row + 16 np + (lane & 7) + 8 (lane >> 4) of B: its swizzle is lane & 7 (b_row is a
    // multiple of 8). Piece kk / 8 + ((lane >> 3) & 1) lands at that piece ^ (lane & 7).
    const unsigned b_base = b_s + (unsigned)((b_row + (lane & 7) + (lane >> 4) * 8) * 128);
    const int b_sw = ((lane >> 3) & 1) ^ (lane & 7);
#pragma unroll
    for (int kk = 0; kk < 64; kk += 16)
        mma_k16_2xn_bf16(acc, a_s + (unsigned)(a_row * a_stride + kk + a_off) * 2u, (unsigned)(a_gap * a_stride) * 2u,
                         b_base + (unsigned)(((kk >> 3) ^ b_sw) << 4), 16u * 128u);
}

// B fragments of 8 NF columns (n = n0 .. n0 + 8 NF - 1) for rows k = kk .. kk + 15 of a bf16
// tile stored k-major ([k][n], stride in elements, a multiple of 8), through ldmatrix.trans.
template <int NF>
__device__ __forceinline__ void load_b_kmajor_bf16(unsigned (&bf)[NF][2], unsigned t_s, int stride, int kk, int n0,
                                                   int lane) {
    const int off = (kk + ((lane >> 3) & 1) * 8 + (lane & 7)) * stride + n0 + (lane >> 4) * 8;
#pragma unroll
    for (int np = 0; np < NF / 2; ++np) {
        unsigned r4[4];
        ldmatrix_x4_trans(r4, t_s + (unsigned)(off + np * 16) * 2u);
        bf[2 * np][0] = r4[0];
        bf[2 * np][1] = r4[1];
        bf[2 * np + 1][0] = r4[2];
        bf[2 * np + 1][1] = r4[3];
    }
}
