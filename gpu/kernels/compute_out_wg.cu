// 3b on Hopper (sm_90a), the warpgroup kernel: the pair kernel's blocks and steps (compute_out.cu)
// with the products on `wgmma` (TF32, f32 accumulation) instead of `mma.sync`, computing each
// unit's output transposed. One block of 256 threads (two warpgroups, two blocks per SM) per
// (batch b, chunk c, 128 rows i of the chunk, pair of units u = 0, 1 of one group); warpgroup u
// computes Y_u^T[p, i] (64 headdim columns p x the block's 128 rows i) in 64 accumulators per
// thread: warp w (0..3) of the warpgroup holds rows p = 16 w + g (+8) and columns
// i = 8 nf + 2 q (+1) (register 4 nf + e: p + 8 (e / 2), i + e % 2), with g = lane / 4,
// q = lane % 4. The transposed product needs no transposed copy of anything:
//   steps over dstate: Y_u^T += S_u C^T, A = S_u[p, n0:n0+32] and B = C[i, n0:n0+32] both
//     K-major (n contiguous) in shared memory, read through matrix descriptors;
//   then Y_u^T[:, i] *= exp(cs_i) (0 where seq(i) differs from the seq before the chunk);
//   steps over the chunk's columns j0 .. j0 + 31 up to the block's last row: the block first
//     turns the raw scores into each head's causal matrix in shared memory (once per head, not
//     per warp; the same formula as the pair kernel, with the split decay left of the block),
//       M_u[i, j] = score * 2^((cs_i - cs_j) log2 e) * dt'_j  where j <= i and seq(j) = seq(i),
//     then Y_u^T += x_u^T M_u^T with A = x_u^T from registers (loaded from the x stage, [j][p])
//     and B = M_u[i, j0:j0+32] K-major (j contiguous). On the block's own columns (j0 >= i0)
//     the rows i < j0 - i0 of M are 0 and the product skips them (n = 128, 96, 64 or 32 from
//     row j0 - i0). At those steps the D skip adds D x from the x stage.
// K-major tiles use the no-swizzle canonical layout: core matrices of 8 rows x 4 floats (128
// contiguous bytes), the 8 along k 128 bytes apart (leading byte offset), the 8-row groups
// 1,024 bytes apart (stride byte offset); gpu/tests/wgmma.rs checks this layout, the register
// layouts above and the descriptor encoding on the device.
// Pipeline: a cp.async double buffer, each stage [A: C slab or raw scores, 128 x 32 K-major |
// B: both S slabs 2 x 64 x 32 K-major, or x 32 x 136 (unit u at column 64 u) | cs_j[2][32],
// dt_j[2][32], seq_j[32]]; then the decayed scores of both heads (2 x 128 x 32 K-major), cs_i[2][128],
// seq_i[128] and 11 base addresses. A step: wait for its copies, fence them into the async proxy,
// barrier, start the next step's copies, (score steps: decay pass, fence, barrier,) the
// warpgroup products, wait for them. Raw f32 operands (the tensor cores truncate them to TF32).
// Every copy is 16 bytes wide: headdim and dstate multiples of 4 (the pair kernel's conditions,
// which the host also asks here). On any other target the kernel is empty and never launched.
#define WG_A 4096                       // floats of a 128 x 32 K-major tile
#define WG_STAGE 8704                   // A 4096 + B 4352 (x at stride CP_X) + 160, padded to 1 KB
#define WG_DECAYED (2 * WG_STAGE)       // offset of the decayed scores
#define WG_CS (WG_DECAYED + 2 * WG_A)   // offset of cs_i

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Float offset of element (r, k) in a K-major tile of rows x 32.
__device__ __forceinline__ int km_off(int r, int k) { return (r >> 3) * 256 + (k >> 2) * 32 + (r & 7) * 4 + (k & 3); }

// Starts copying a ROWS x 32 block of a row-major global matrix into a K-major tile: zeros where
// r >= rows_valid or k >= cols_valid (a multiple of 4). 16-byte copies by the block's 256
// threads, 32 rows per pass: warp v takes rows 8 (v / 2) .. + 7 and 16-byte columns
// 4 (v % 2) .. + 3, lane l row l % 8 and column l / 8. Each 8-lane phase then writes 8 rows of
// one core-matrix column (distinct banks), and each warp reads whole 32-byte sectors; with the
// columns fastest across lanes the copies had hit one bank 8 times over, which also doubled
// the L2 sectors they requested.
template <int ROWS>
__device__ __forceinline__ void async_kmajor(float* dst, const float* __restrict__ src, unsigned src_stride,
                                             int rows_valid, int cols_valid, int tid) {
    static_assert(ROWS % 32 == 0, "32 rows per pass");
    const int lane = tid & 31, v = tid >> 5;
    const int r0 = 8 * (v >> 1) + (lane & 7), kc = 4 * (v & 1) + (lane >> 3);
    float* d = dst + (r0 >> 3) * 256 + kc * 32 + (r0 & 7) * 4;
    if (rows_valid >= ROWS && cols_valid >= 32) {
        const float* s = src + ((unsigned)r0 * src_stride + (unsigned)(kc * 4));
        const unsigned da = smem_addr(d);
#pragma unroll
        for (int k = 0; k < ROWS / 32; ++k)
            cp_async16_all(da + (unsigned)(k * 1024) * 4u, s + (unsigned)(k * 32) * src_stride);
    } else {
#pragma unroll
        for (int k = 0; k < ROWS / 32; ++k) {
            const int r = r0 + k * 32;
            const bool ok = r < rows_valid && kc * 4 < cols_valid;
            cp_async16(d + k * 1024, ok ? src + ((unsigned)r * src_stride + (unsigned)(kc * 4)) : src, ok, src);
        }
    }
}

// Matrix descriptor of a K-major tile at shared address `saddr` (16-byte aligned): start address,
// leading byte offset 128, stride byte offset 1,024, no swizzle.
__device__ __forceinline__ unsigned long long wg_desc(unsigned saddr) {
    return (unsigned long long)((saddr >> 4) & 0x3FFF) | (8ull << 16) | (64ull << 32);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Orders this thread's earlier shared-memory writes (cp.async's included) before later reads
// by the async proxy (wgmma), once a barrier has followed.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Pins the accumulators at this point of the program (no read or write of them moves across),
// as around the asynchronous products.
__device__ __forceinline__ void wg_pin(float (&d)[64]) {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// acc[0 .. 63] += A B^T, m64n128k8: A (64 x 8) and B (128 x 8) from shared memory.
__device__ __forceinline__ void wg_ss_n128(float* d, unsigned long long da, unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
                 "}, %64, %65, 1, 1, 1;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(da), "l"(db));
}
// acc[0 .. 63] += A B^T, m64n128k8: A (64 x 8) from registers, B (128 x 8) from shared memory.
__device__ __forceinline__ void wg_rs_n128(float* d, const unsigned (&a)[4], unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
                 "}, {%64, %65, %66, %67}, %68, 1, 1, 1;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
// acc[0 .. 47] += A B^T, m64n96k8: A (64 x 8) from registers, B (96 x 8) from shared memory.
__device__ __forceinline__ void wg_rs_n96(float* d, const unsigned (&a)[4], unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n96k8.f32.tf32.tf32 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
                 "}, {%48, %49, %50, %51}, %52, 1, 1, 1;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
// acc[0 .. 31] += A B^T, m64n64k8: A (64 x 8) from registers, B (64 x 8) from shared memory.
__device__ __forceinline__ void wg_rs_n64(float* d, const unsigned (&a)[4], unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
                 "}, {%32, %33, %34, %35}, %36, 1, 1, 1;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
// acc[0 .. 15] += A B^T, m64n32k8: A (64 x 8) from registers, B (32 x 8) from shared memory.
__device__ __forceinline__ void wg_rs_n32(float* d, const unsigned (&a)[4], unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
                 "}, {%16, %17, %18, %19}, %20, 1, 1, 1;\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
// acc columns 8 NF0 .. 8 NF0 + 31 (x stage rows 0..31) += D x; FULL: all 64 columns p real.
template <int NF0, bool FULL>
__device__ __forceinline__ void wg_dskip(float (&acc)[64], const float* xr, int q, int w, int g, float dv0, float dv1,
                                         int cols_p) {
#pragma unroll
    for (int f = 0; f < 4; ++f)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = 8 * f + 2 * q + (e & 1), p = 16 * w + g + 8 * (e >> 1);
            if (FULL || p < cols_p) acc[4 * (NF0 + f) + e] += (e >> 1 ? dv1 : dv0) * xr[r * CP_X + p];
        }
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

extern "C" __global__ void __launch_bounds__(256, 2) ssd_compute_out_wg(CO_CB_PARAMS)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(16) float smem[];
    constexpr int TM = 128, NT = 256;
    float* dec = smem + WG_DECAYED;           // [2][128 x 32 K-major]: head u's causal matrix
    float* cs_i = smem + WG_CS;               // [2][TM]: unit u's head at u * TM
    int* seq_i = (int*)(cs_i + 2 * TM);
    const float** ptab = (const float**)(seq_i + TM);
    (void)vec;

    const int tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int u = warp >> 2, w = warp & 3;  // this warpgroup's unit, the warp in it
    const int itiles = (chunk_size + TM - 1) / TM;
    const int c = blockIdx.x / itiles;
    const int i0 = (blockIdx.x % itiles) * TM;
    const int t64 = i0 / 64;
    const int ptiles = (headdim + 63) / 64;
    const int b = blockIdx.z;
    const int h_0 = (2 * blockIdx.y) / ptiles, p_0 = ((2 * blockIdx.y) % ptiles) * 64;
    const int h_1 = (2 * blockIdx.y + 1) / ptiles, p_1 = ((2 * blockIdx.y + 1) % ptiles) * 64;
    const int cols_0 = min(64, headdim - p_0), cols_1 = min(64, headdim - p_1);
    const int grp = h_0 / (nheads / ngroups);

    const i64 t0 = (i64)c * chunk_size;
    const int valid_c = (int)min((i64)chunk_size, (i64)seqlen - t0);
    if (i0 >= valid_c) return;  // the whole tile lies past seqlen (block-uniform)
    const int rows_i = min(TM, valid_c - i0);
    const i64 cb_0 = (((i64)b * nheads + h_0) * nchunks + c) * chunk_size;
    const i64 cb_1 = (((i64)b * nheads + h_1) * nchunks + c) * chunk_size;
    const i64 tok_stride_x = (i64)nheads * headdim;
    const i64 tok_stride_b = (i64)ngroups * dstate;
    const int npairs = tmax * (tmax + 1) / 2;
    const int* seq_row = seq_idx != nullptr ? seq_idx + (i64)b * seqlen : nullptr;
    const bool has_seq = seq_row != nullptr;

    if (tid == 0) {
        ptab[0] = x + ((i64)b * seqlen + t0) * tok_stride_x + (i64)h_0 * headdim + p_0;
        ptab[1] = x + ((i64)b * seqlen + t0) * tok_stride_x + (i64)h_1 * headdim + p_1;
        ptab[2] = chunk_states + ((((i64)b * nchunks + c) * nheads + h_0) * headdim + p_0) * dstate;
        ptab[3] = chunk_states + ((((i64)b * nchunks + c) * nheads + h_1) * headdim + p_1) * dstate;
        ptab[4] = Cm + (i64)b * seqlen * tok_stride_b + (i64)grp * dstate + (t0 + i0) * tok_stride_b;
        ptab[5] = cbuf + (((i64)b * nchunks + c) * ngroups + grp) * npairs * 4096;
        ptab[6] = dA_cumsum + cb_0;
        ptab[7] = dA_cumsum + cb_1;
        ptab[8] = dt_out + cb_0;
        ptab[9] = dt_out + cb_1;
        ptab[10] = has_seq ? (const float*)(seq_row + t0) : nullptr;
    }
    for (int r = tid; r < 2 * TM; r += NT) {
        const int rr = r & (TM - 1);
        cs_i[r] = rr < rows_i ? dA_cumsum[(r < TM ? cb_0 : cb_1) + i0 + rr] : 0.0f;
    }
    if (tid < TM) seq_i[tid] = (has_seq && tid < rows_i) ? seq_row[t0 + i0 + tid] : 0;

    const int NK = ((dstate + 7) / 8) * 8;
    const int nslab = (c > 0 || has_initial_states) ? (dstate + 31) / 32 : 0;
    const int nsteps = nslab + (min(i0 + TM, valid_c) + 31) / 32;
    const bool split = !has_seq && i0 > 0;
    // This warpgroup's unit.
    const int h = u ? h_1 : h_0, p0 = u ? p_1 : p_0, cols_p = u ? cols_1 : cols_0;
    // log2(e) cs at the token before the block, both heads (the split decay's reference).
    const float R_0 = split ? dA_cumsum[cb_0 + i0 - 1] * LOG2E_F : 0.0f;
    const float R_1 = split ? dA_cumsum[cb_1 + i0 - 1] * LOG2E_F : 0.0f;
    const float R_u = u ? R_1 : R_0;
    // D of this thread's accumulator rows p = 16 w + g and p + 8.
    float dv0 = 0.0f, dv1 = 0.0f;
    if (Dv != nullptr) {
        const int pa = min(16 * w + g, cols_p - 1), pb = min(16 * w + g + 8, cols_p - 1);
        dv0 = d_per_channel ? Dv[(i64)h * headdim + p0 + pa] : Dv[h];
        dv1 = d_per_channel ? Dv[(i64)h * headdim + p0 + pb] : Dv[h];
    }

    auto issue = [&](int s) {
        float* ta = smem + (s & 1) * WG_STAGE;
        float* tb = ta + WG_A;
        if (s < nslab) {
            const int n0 = s * 32;
            async_kmajor<TM>(ta, ptab[4] + n0, (unsigned)tok_stride_b, rows_i, dstate - n0, tid);
            async_kmajor<64>(tb, ptab[2] + n0, dstate, cols_0, dstate - n0, tid);
            async_kmajor<64>(tb + WG_A / 2, ptab[3] + n0, dstate, cols_1, dstate - n0, tid);
        } else {
            const int j0 = (s - nslab) * 32;
            const int jt = j0 >> 6;
            const int rows_j = min(32, valid_c - j0);
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int rt = t64 + hh;
                if (jt <= rt && hh * 64 < rows_i)
                    async_kmajor<64>(ta + hh * (WG_A / 2), ptab[5] + (rt * (rt + 1) / 2 + jt) * 4096 + (j0 & 63), 64,
                                         64, 32, tid);
            }
            const unsigned xoff = (unsigned)j0 * (unsigned)tok_stride_x;
            async_rows<32, 64, NT>(tb, CP_X, ptab[0] + xoff, (unsigned)tok_stride_x, rows_j, cols_0, tid);
            async_rows<32, 64, NT>(tb + 64, CP_X, ptab[1] + xoff, (unsigned)tok_stride_x, rows_j, cols_1, tid);
            float* vj = tb + 32 * CP_X;  // cs_j[2][32], dt_j[2][32], seq_j[32]
            if (tid < 64) {
                const int k = tid & 31;
                const bool ok = k < rows_j;
                cp_async4(vj + tid, ptab[6 + (tid >> 5)] + j0 + k, ok, dA_cumsum);
                cp_async4(vj + 64 + tid, ptab[8 + (tid >> 5)] + j0 + k, ok, dt_out);
                if (has_seq && tid < 32) cp_async4(vj + 128 + tid, (const int*)ptab[10] + j0 + k, ok, seq_row);
            }
        }
    };

    float acc[64];
#pragma unroll
    for (int r = 0; r < 64; ++r) acc[r] = 0.0f;

    // The decay pass's share of this thread: rows dr_m = 8 (tid / 64) + 32 m + tid % 8 of the
    // block (m = 0..3) and columns 4 jc .. 4 jc + 3 of each step.
    const int jc = (tid >> 3) & 7;
    float dcsl[2][4];  // log2(e) cs of those rows, both heads (-inf past the chunk's end)
    int dsq[4];
    const unsigned dec_s = smem_addr(dec + u * WG_A);

    __syncthreads();  // the base addresses, cs_i, seq_i
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        const int r = 8 * (tid >> 6) + 32 * m + (tid & 7);
        dcsl[0][m] = r < rows_i ? cs_i[r] * LOG2E_F : NEG_INF_F;
        dcsl[1][m] = r < rows_i ? cs_i[TM + r] * LOG2E_F : NEG_INF_F;
        dsq[m] = seq_i[r];
    }
    issue(0);
    cp_async_commit();
    for (int s = 0; s < nsteps; ++s) {
        cp_async_wait<0>();  // this thread's copies of step s have landed
        fence_async_smem();
        __syncthreads();     // everyone's have; everyone's products of step s - 1 are done
        if (s + 1 < nsteps) issue(s + 1);
        cp_async_commit();
        const float* ta = smem + (s & 1) * WG_STAGE;
        const float* tb = ta + WG_A;
        if (s < nslab) {
            const int kend = min(32, NK - s * 32);
            const unsigned a_s = smem_addr(tb + u * (WG_A / 2)), b_s = smem_addr(ta);
            wg_pin(acc);
            wg_fence();
            for (int kk = 0; kk < kend; kk += 8)  // k-step kk: 32 kk bytes into both tiles
                wg_ss_n128(acc, wg_desc(a_s + (unsigned)kk * 32u), wg_desc(b_s + (unsigned)kk * 32u));
            wg_commit();
            wg_wait_all();
            wg_pin(acc);
            continue;
        }
        const int j0 = (s - nslab) * 32;
        // This thread's accumulator columns: i = 8 nf + 2 q + e % 2.
        if (j0 == 0 && nslab > 0) {
            if (split) {
                const float f = ex2_approx(R_u);
#pragma unroll
                for (int r = 0; r < 64; ++r) acc[r] *= f;
            } else {
                const int seq_prev = (!has_seq || c == 0) ? 0 : seq_row[t0 - 1];
#pragma unroll
                for (int nf = 0; nf < 16; ++nf)
#pragma unroll
                    for (int e1 = 0; e1 < 2; ++e1) {
                        const int i = 8 * nf + 2 * q + e1;
                        const float f = seq_i[i] == seq_prev ? ex2_approx(cs_i[u * TM + i] * LOG2E_F) : 0.0f;
                        acc[4 * nf + e1] *= f;
                        acc[4 * nf + 2 + e1] *= f;
                    }
            }
        }
        if (split && j0 == i0) {
            // Everything so far takes its row factor 2^(csl_i - R) <= 1 (0 past the chunk's end).
#pragma unroll
            for (int nf = 0; nf < 16; ++nf)
#pragma unroll
                for (int e1 = 0; e1 < 2; ++e1) {
                    const int i = 8 * nf + 2 * q + e1;
                    const float f = i < rows_i ? ex2_approx(cs_i[u * TM + i] * LOG2E_F - R_u) : 0.0f;
                    acc[4 * nf + e1] *= f;
                    acc[4 * nf + 2 + e1] *= f;
                }
        }
        const int off = max(j0 - i0, 0);  // rows of the block below which M is 0 in this step
        const float* vj = tb + 32 * CP_X;
        // Decay pass: raw scores (ta) -> each head's causal matrix (dec).
        {
            const bool colf = split && j0 < i0;  // left of the block: the split decay, no mask
            float cj[2][4], dj[2][4];
            int sj[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int k = 4 * jc + e;
                cj[0][e] = vj[k] * LOG2E_F;
                cj[1][e] = vj[32 + k] * LOG2E_F;
                dj[0][e] = vj[64 + k];
                dj[1][e] = vj[96 + k];
                sj[e] = has_seq ? ((const int*)vj)[128 + k] : 0;
            }
            if (colf) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    dj[0][e] *= ex2_approx(R_0 - cj[0][e]);
                    dj[1][e] *= ex2_approx(R_1 - cj[1][e]);
                }
            }
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                const int r = 8 * (tid >> 6) + 32 * m + (tid & 7);
                if (r < off) continue;  // uniform over each 8-row group (off is a multiple of 32)
                const int o = km_off(r, 4 * jc);
                float4 v0 = make_float4(0.0f, 0.0f, 0.0f, 0.0f), v1 = v0;
                if (r < rows_i) {
                    const float4 raw = *reinterpret_cast<const float4*>(ta + o);
                    const float rv[4] = {raw.x, raw.y, raw.z, raw.w};
                    float m0[4], m1[4];
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        if (colf) {
                            m0[e] = rv[e] * dj[0][e];
                            m1[e] = rv[e] * dj[1][e];
                        } else {
                            const bool ok = j0 + 4 * jc + e <= i0 + r && sj[e] == dsq[m];
                            m0[e] = rv[e] * ex2_approx(ok ? dcsl[0][m] - cj[0][e] : NEG_INF_F) * dj[0][e];
                            m1[e] = rv[e] * ex2_approx(ok ? dcsl[1][m] - cj[1][e] : NEG_INF_F) * dj[1][e];
                        }
                    }
                    v0 = make_float4(m0[0], m0[1], m0[2], m0[3]);
                    v1 = make_float4(m1[0], m1[1], m1[2], m1[3]);
                }
                *reinterpret_cast<float4*>(dec + o) = v0;
                *reinterpret_cast<float4*>(dec + WG_A + o) = v1;
            }
        }
        fence_async_smem();
        __syncthreads();  // both heads' causal matrices are in place
        // A = x_u^T: rows p = 16 w + g (+8), columns j = 8 kk + q (+4), from x[j][p].
        unsigned a[4][4];
        {
            const float* xs = tb + u * 64 + 16 * w + g;
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                a[kk][0] = __float_as_uint(xs[(8 * kk + q) * CP_X]);
                a[kk][1] = __float_as_uint(xs[(8 * kk + q) * CP_X + 8]);
                a[kk][2] = __float_as_uint(xs[(8 * kk + q + 4) * CP_X]);
                a[kk][3] = __float_as_uint(xs[(8 * kk + q + 4) * CP_X + 8]);
#pragma unroll
                for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[kk][e])::"memory");
            }
        }
        wg_pin(acc);
        wg_fence();
        // Row off of the K-major tile; k-step kk starts 2 core matrices (256 bytes) further.
        const unsigned bs = dec_s + (unsigned)off * 128u;
        switch (off >> 5) {
        case 0:
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) wg_rs_n128(acc, a[kk], wg_desc(bs + (unsigned)kk * 256u));
            break;
        case 1:
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) wg_rs_n96(acc + 16, a[kk], wg_desc(bs + (unsigned)kk * 256u));
            break;
        case 2:
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) wg_rs_n64(acc + 32, a[kk], wg_desc(bs + (unsigned)kk * 256u));
            break;
        default:
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) wg_rs_n32(acc + 48, a[kk], wg_desc(bs + (unsigned)kk * 256u));
            break;
        }
        wg_commit();
        wg_wait_all();
        wg_pin(acc);
        if (j0 >= i0 && Dv != nullptr) {
            // The block's own rows j0 .. j0 + 31 (columns off .. off + 31): y += D x from the
            // stage (unscaled x).
            const float* xr = tb + u * 64;
            if (cols_p == 64) {
                switch (off >> 5) {
                case 0: wg_dskip<0, true>(acc, xr, q, w, g, dv0, dv1, cols_p); break;
                case 1: wg_dskip<4, true>(acc, xr, q, w, g, dv0, dv1, cols_p); break;
                case 2: wg_dskip<8, true>(acc, xr, q, w, g, dv0, dv1, cols_p); break;
                default: wg_dskip<12, true>(acc, xr, q, w, g, dv0, dv1, cols_p); break;
                }
            } else {
                switch (off >> 5) {
                case 0: wg_dskip<0, false>(acc, xr, q, w, g, dv0, dv1, cols_p); break;
                case 1: wg_dskip<4, false>(acc, xr, q, w, g, dv0, dv1, cols_p); break;
                case 2: wg_dskip<8, false>(acc, xr, q, w, g, dv0, dv1, cols_p); break;
                default: wg_dskip<12, false>(acc, xr, q, w, g, dv0, dv1, cols_p); break;
                }
            }
        }
    }

    // Epilogue: z gate, store. Offsets from the thread's first element are 32-bit (the host's
    // condition for the pair kernels: 128 rows of x fit in 2^32 floats).
    const i64 base = ((i64)b * seqlen + t0 + i0 + 2 * q) * tok_stride_x + (i64)h * headdim + p0 + 16 * w + g;
    float* ob = out + base;
    const float* zb = z != nullptr ? z + base : nullptr;
    const unsigned ts = (unsigned)tok_stride_x;
    const bool full = rows_i == TM && cols_p == 64;
#pragma unroll
    for (int nf = 0; nf < 16; ++nf)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = 8 * nf + 2 * q + (e & 1), p = 16 * w + g + 8 * (e >> 1);
            if (!full && (i >= rows_i || p >= cols_p)) continue;
            const unsigned o = (unsigned)(8 * nf + (e & 1)) * ts + (unsigned)(8 * (e >> 1));
            float y = acc[4 * nf + e];
            if (zb != nullptr) {
                const float zz = zb[o];
                y = y * zz / (1.0f + expf(-zz));
            }
            ob[o] = y;
        }
#endif
}
