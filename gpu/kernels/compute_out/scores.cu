// Stage 3, fast path (chunk sizes 64 to 512; ssd_compute_out in fused.cu serves every other
// size and version 1): the scores C B^T once per (batch, chunk, group), shared by the group's
// heads, then the output kernel streaming 64-wide tiles through a cp.async double buffer.
//
// 3a. One block of 128 threads per (batch b, chunk c, group g, pair of 64-row tiles it >= jt of
// the chunk), grid x = c * npairs + pair, pair = it (it + 1) / 2 + jt, npairs = T (T + 1) / 2
// with T = ceil(min(chunk_size, seqlen) / 64):
//   cb[b, c, g, pair][r][s] = C[it * 64 + r, :] . B[jt * 64 + s, :]
// (rows and columns past the chunk's real tokens 0): TF32 products of the raw f32 operands
// (truncated by the tensor cores, as in 3b), f32 accumulation. The 64-wide dstate slabs of the
// two tiles stream through a cp.async double buffer; the four warps split the 64 x 64 tile
// 2 x 2. vec: 16-byte copies (dstate a multiple of 4), decided by the host.
// Dynamic shared memory (floats): 2 buffers of [C slab 64 x 68, B slab 64 x 68].
#define CB_A 68
#define CB_BUF (2 * 64 * CB_A)
template <bool VEC>
__device__ __forceinline__ void chunk_cb_body(float* smem, const float* __restrict__ Bm, const float* __restrict__ Cm,
                                              float* __restrict__ cbuf, int seqlen, int ngroups, int dstate,
                                              int chunk_size, int nchunks, int tmax)
{
    const int tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int wm = warp >> 1, wn = warp & 1;
    const int npairs = tmax * (tmax + 1) / 2;
    const int c = blockIdx.x / npairs;
    const int pair = blockIdx.x % npairs;
    int it = 0;
    while ((it + 1) * (it + 2) / 2 <= pair) ++it;
    const int jt = pair - it * (it + 1) / 2;
    const int grp = blockIdx.y;
    const int b = blockIdx.z;
    const i64 t0 = (i64)c * chunk_size;
    const int valid_c = (int)min((i64)chunk_size, (i64)seqlen - t0);
    const int i0 = it * 64, j0 = jt * 64;
    if (i0 >= valid_c) return;  // never read (block-uniform)
    const int rows_i = min(64, valid_c - i0);
    const int rows_j = min(64, valid_c - j0);
    const i64 tok_stride_b = (i64)ngroups * dstate;
    const float* cg = Cm + ((i64)b * seqlen + t0 + i0) * tok_stride_b + (i64)grp * dstate;
    const float* bg = Bm + ((i64)b * seqlen + t0 + j0) * tok_stride_b + (i64)grp * dstate;
    const int nslab = (dstate + 63) / 64;
    const int NK = ((dstate + 7) / 8) * 8;

    auto issue = [&](int s) {
        float* ta = smem + (s & 1) * CB_BUF;
        const int n0 = s * 64;
        async_block64_v<VEC>(ta, CB_A, cg + n0, tok_stride_b, rows_i, dstate - n0, tid);
        async_block64_v<VEC>(ta + 64 * CB_A, CB_A, bg + n0, tok_stride_b, rows_j, dstate - n0, tid);
    };
    float acc[2][4][4];
    zero_2xn(acc);
    const unsigned smem_base = smem_addr(smem);
    issue(0);
    cp_async_commit();
    for (int s = 0; s < nslab; ++s) {
        cp_async_wait<0>();  // this thread's copies of slab s have landed
        __syncthreads();     // everyone's have, and everyone is done with slab s - 1's buffer
        if (s + 1 < nslab) issue(s + 1);
        cp_async_commit();
        const unsigned ta_s = smem_base + (unsigned)((s & 1) * CB_BUF) * 4u;
        mma_slab_2xn(acc, ta_s, ta_s + 64u * CB_A * 4u, CB_A, wm * 32, wn * 32, min(64, NK - s * 64), lane);
    }
    float* dst = cbuf + ((((i64)b * nchunks + c) * ngroups + grp) * npairs + pair) * 4096;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int r = wm * 32 + mi * 16 + g + 8 * hf;
#pragma unroll
            for (int nf = 0; nf < 4; ++nf) {
                const int col = wn * 32 + nf * 8 + 2 * q;
                *reinterpret_cast<float2*>(dst + r * 64 + col) =
                    make_float2(acc[mi][nf][2 * hf], acc[mi][nf][2 * hf + 1]);
            }
        }
}

// The parameters of ssd_chunk_cb (Rust: ChunkCbParams).
struct ChunkCbParams {
    const float* Bm;  // [batch, seqlen, ngroups, dstate]
    const float* Cm;  // [batch, seqlen, ngroups, dstate]
    float* cbuf;      // [batch, nchunks, ngroups, npairs, 64, 64]
    int seqlen, ngroups, dstate, chunk_size, nchunks, tmax;
    int vec;  // 1: 16-byte copies (dstate a multiple of 4)
};
static_assert(sizeof(ChunkCbParams) == 56, "ChunkCbParams: the Rust struct has 56 bytes");

// 3a's dynamic shared memory, as the body above carves it.
struct ChunkCbSmem {
    struct Buf {
        float c[64][CB_A];  // C slab
        float b[64][CB_A];  // B slab
    } buf[2];
};
static_assert(sizeof(ChunkCbSmem::Buf) == CB_BUF * 4, "3a's buffer");

extern "C" __global__ void __launch_bounds__(128, 3) ssd_chunk_cb(const ChunkCbParams p) {
    SSD_DYNAMIC_SMEM(smem);
    if (p.vec)
        chunk_cb_body<true>(smem, p.Bm, p.Cm, p.cbuf, p.seqlen, p.ngroups, p.dstate, p.chunk_size, p.nchunks, p.tmax);
    else
        chunk_cb_body<false>(smem, p.Bm, p.Cm, p.cbuf, p.seqlen, p.ngroups, p.dstate, p.chunk_size, p.nchunks, p.tmax);
}
SSD_LAYOUT_FIXED(ssd_chunk_cb, ChunkCbParams, sizeof(ChunkCbSmem));
