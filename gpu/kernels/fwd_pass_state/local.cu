// Stage 2, split in two for parallelism (version 2; fused.cu holds the fused sequential
// kernel): 2a here and in pair.cu, 2b in passing.cu.
//
// 2a. Each chunk's own state, all chunks in parallel: one block per (batch b, chunk c, head h,
// tile of 64 headdim rows x TN dstate columns), writing into chunk_states[b, c, h]
//   L_c[p, n] = sum_{l <= last, seq(l) == seq(last)} (x[l, p] * w[l]) * B[l, n],
//   w[l] = 2^((cs[last] - cs[l]) log2 e) * dt'[l],
// started from zero. TN = 64 (4 warps, ssd_chunk_state_local) or 128 (8 warps,
// ssd_chunk_state_local_wide, for dstate > 64: each x tile is read once per 128 columns instead
// of once per 64). The grid's x is (c * tiles + tile) * nheads + h (tile_and_unit: the heads of
// one chunk run side by side and share its B rows in L2). The 64-token stages stream
// through a cp.async double buffer: while stage k is multiplied, stage k + 1's x, B, cs, dt'
// and seq_idx are in flight. Per stage, each warp first writes w of the stage's 64 tokens to
// its own 64 floats of shared memory (no block barrier), then runs the product, warp (wm, wn)
// computing rows 32 wm and columns 32 wn of the tile, scaling x by w in registers. Operands go
// to the tensor cores as raw f32 (truncated to TF32 there), f32 accumulation.
//
// The A fragments through 16-byte loads: the m16n8k8 product does not care which rows of the
// tile its slots stand for, as long as the accumulators are stored back accordingly. Slot
// g + 8 half of row fragment mi stands for row 4 g + 2 mi + half of the warp's 32, so that a
// thread's A values at token l are the 4 consecutive x[l][4 g .. 4 g + 3]: one 16-byte load
// (conflict-free at stride 72) instead of four 4-byte ones, scaled by w[l] on the way to the
// fragment registers. (B's pairs span two tokens, so B keeps its 4-byte loads.)
// Dynamic shared memory (floats): 2 buffers of [x 64 x 72, B 64 x (TN + 8), cs 64, dt' 64,
// seq 64], then w: 64 per warp.
#define SL_BUF(TN) (ST_TK * ST_STRIDE + ST_TK * ((TN) + 8) + 3 * ST_TK)
// One k-step (8 tokens) of 2a's product for a warp's 32 x (8 NF) part: A[p][l] = x[l][p] w[l]
// through 16-byte loads of x (xa at the thread's first row, row stride xs; slot g + 8 half of
// row fragment mi stands for row 4 g + 2 mi + half), B[l][n] through 32-bit loads (bb at the
// thread's column g, row stride bs).
template <int NF>
__device__ __forceinline__ void state_kstep(float (&acc)[2][NF][4], const float* xa, int xs, const float* bb, int bs,
                                            const float* ws, int kk, int q) {
    const float w0 = ws[kk + q], w1 = ws[kk + q + 4];
    const float4 x0 = *reinterpret_cast<const float4*>(xa + (kk + q) * xs);
    const float4 x1 = *reinterpret_cast<const float4*>(xa + (kk + q + 4) * xs);
    const unsigned a[2][4] = {{__float_as_uint(x0.x * w0), __float_as_uint(x0.y * w0), __float_as_uint(x1.x * w1),
                               __float_as_uint(x1.y * w1)},
                              {__float_as_uint(x0.z * w0), __float_as_uint(x0.w * w0), __float_as_uint(x1.z * w1),
                               __float_as_uint(x1.w * w1)}};
    unsigned bf[NF][2];
#pragma unroll
    for (int nf = 0; nf < NF; ++nf) {
        bf[nf][0] = __float_as_uint(bb[(kk + q) * bs + nf * 8]);
        bf[nf][1] = __float_as_uint(bb[(kk + q + 4) * bs + nf * 8]);
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int nf = 0; nf < NF; ++nf) mma_tf32(acc[mi][nf], a[mi], bf[nf]);
}

// Writes a warp's 32 x (8 NF) tile of 2a's accumulators, acc[mi][nf][2 hf + e] at row
// wm 32 + 4 g + 2 mi + hf and column col0 + 8 nf + 2 q + e of the block's tile, into the
// [headdim, dstate] state cst at (p0 + row, n0 + column), for rows < rows_p and columns <
// cols_n: two floats at a time where both lie in and dstate is even (8-byte aligned), else one.
template <int NF>
__device__ __forceinline__ void store_state_tile(float* cst, const float (&acc)[2][NF][4], int dstate, int p0, int n0,
                                                 int wm, int col0, int g, int q, int rows_p, int cols_n) {
    const bool vec_out = (dstate & 1) == 0;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int pr = wm * 32 + 4 * g + 2 * mi + hf;
            if (pr >= rows_p) continue;
            float* row = cst + (i64)(p0 + pr) * dstate + n0;
#pragma unroll
            for (int nf = 0; nf < NF; ++nf) {
                const int nc = col0 + nf * 8 + 2 * q;
                if (vec_out && nc + 1 < cols_n) {
                    *reinterpret_cast<float2*>(row + nc) = make_float2(acc[mi][nf][2 * hf], acc[mi][nf][2 * hf + 1]);
                } else {
                    if (nc < cols_n) row[nc] = acc[mi][nf][2 * hf];
                    if (nc + 1 < cols_n) row[nc + 1] = acc[mi][nf][2 * hf + 1];
                }
            }
        }
}

template <int TN>
__device__ __forceinline__ void chunk_state_local_body(
    float* smem, const float* __restrict__ x, const float* __restrict__ Bm, const float* __restrict__ dt_out,
    const float* __restrict__ dA_cumsum, const int* __restrict__ seq_idx, float* __restrict__ chunk_states,
    int seqlen, int nheads, int headdim, int ngroups, int dstate, int chunk_size, int nchunks)
{
    constexpr int NT = 2 * TN;           // threads: 2 x (TN / 32) warps
    constexpr int BS = TN + 8;           // B's row stride: 8 mod 32, conflict-free fragments
    constexpr int BUF = SL_BUF(TN);
    const int tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int wm = warp & 1, wn = warp >> 1;  // this warp's 32 x 32 part: rows p, columns n
    const int ntiles_n = (dstate + TN - 1) / TN;
    const int tiles = ((headdim + ST_TP - 1) / ST_TP) * ntiles_n;
    int ct, h;  // ct: chunk and tile
    tile_and_unit(nheads, ct, h);
    const int c = ct / tiles;
    const int tile = ct % tiles;
    const int p0 = (tile / ntiles_n) * ST_TP;
    const int n0 = (tile % ntiles_n) * TN;
    const int b = blockIdx.z;
    const int grp = h / (nheads / ngroups);
    const int rows_p = min(ST_TP, headdim - p0);
    const int cols_n = min(TN, dstate - n0);
    float* ws = smem + 2 * BUF + warp * ST_TK;  // this warp's w of the current stage

    float acc[2][4][4];
    zero_2xn(acc);
    const i64 tok_stride_x = (i64)nheads * headdim;
    const i64 tok_stride_b = (i64)ngroups * dstate;
    const i64 t0 = (i64)c * chunk_size;
    const int last = (int)min((i64)chunk_size, (i64)seqlen - t0) - 1;
    const i64 cb = (((i64)b * nheads + h) * nchunks + c) * chunk_size;
    const float csl_last = dA_cumsum[cb + last] * LOG2E_F;
    const int seq_last = seq_idx != nullptr ? seq_idx[(i64)b * seqlen + t0 + last] : 0;
    const float* xsrc = x + ((i64)b * seqlen + t0) * tok_stride_x + (i64)h * headdim + p0;
    const float* bsrc = Bm + ((i64)b * seqlen + t0) * tok_stride_b + (i64)grp * dstate + n0;
    const int* seq_row = seq_idx != nullptr ? seq_idx + (i64)b * seqlen + t0 : nullptr;
    const int nst = last / ST_TK + 1;

    auto issue = [&](int k) {
        float* xs = smem + (k & 1) * BUF;
        float* bs = xs + ST_TK * ST_STRIDE;
        float* csk = bs + ST_TK * BS;
        const int k0 = k * ST_TK;
        const int rows_t = min(ST_TK, last + 1 - k0);
        async_block64<NT>(xs, ST_STRIDE, xsrc + k0 * tok_stride_x, tok_stride_x, rows_t, rows_p, tid);
#pragma unroll
        for (int nb = 0; nb < TN / 64; ++nb)
            async_block64<NT>(bs + nb * 64, BS, bsrc + k0 * tok_stride_b + nb * 64, tok_stride_b, rows_t,
                              cols_n - nb * 64, tid);
        if (tid < ST_TK) {
            const bool ok = tid < rows_t;
            cp_async4(csk + tid, dA_cumsum + cb + k0 + tid, ok, dA_cumsum);
            cp_async4(csk + ST_TK + tid, dt_out + cb + k0 + tid, ok, dt_out);
            if (seq_row != nullptr) cp_async4(csk + 2 * ST_TK + tid, seq_row + k0 + tid, ok, seq_row);
        }
    };

    issue(0);
    cp_async_commit();
    for (int k = 0; k < nst; ++k) {
        cp_async_wait<0>();  // this thread's copies of stage k have landed
        __syncthreads();     // everyone's have, and everyone is done with stage k - 1's buffer
        if (k + 1 < nst) issue(k + 1);
        cp_async_commit();
        const float* xs = smem + (k & 1) * BUF;
        const float* bs = xs + ST_TK * ST_STRIDE;
        const float* csk = bs + ST_TK * BS;
        const float* dtk = csk + ST_TK;
        const int* seqk = (const int*)(dtk + ST_TK);
        const int rows_t = min(ST_TK, last + 1 - k * ST_TK);
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int r = lane + 32 * u;
            const bool same = seq_row == nullptr || seqk[r] == seq_last;
            ws[r] = (r < rows_t && same) ? ex2_approx(csl_last - csk[r] * LOG2E_F) * dtk[r] : 0.0f;
        }
        __syncwarp();
        const float* xa = xs + wm * 32 + 4 * g;  // A[p][l] = x[l][p] w[l], 4 rows per load
        const float* bb = bs + wn * 32 + g;      // B[l][n]
#pragma unroll
        for (int kk = 0; kk < ST_TK; kk += 8) {
            state_kstep<4>(acc, xa, ST_STRIDE, bb, BS, ws, kk, q);
        }
        __syncwarp();  // not needed: the next stage's block barrier orders these reads before w is rewritten
    }

    float* cst = chunk_states + (((i64)b * nchunks + c) * nheads + h) * headdim * dstate;
    store_state_tile(cst, acc, dstate, p0, n0, wm, wn * 32, g, q, rows_p, cols_n);
}

// The parameters of the three 2a kernels (Rust: ChunkStateLocalParams).
struct ChunkStateLocalParams {
    const float* x;          // [batch, seqlen, nheads, headdim]
    const float* Bm;         // [batch, seqlen, ngroups, dstate]
    const float* dt_out;     // [batch, nheads, nchunks, chunk_size]
    const float* dA_cumsum;  // [batch, nheads, nchunks, chunk_size]
    const int* seq_idx;      // [batch, seqlen] or null
    float* chunk_states;     // [batch, nchunks, nheads, headdim, dstate] (L_c here)
    int seqlen, nheads, headdim, ngroups, dstate, chunk_size, nchunks;
};
static_assert(sizeof(ChunkStateLocalParams) == 80, "ChunkStateLocalParams: the Rust struct has 80 bytes");

// 2a's dynamic shared memory for TN dstate columns per block (TN / 16 warps), as the body above
// carves it.
template <int TN>
struct ChunkStateLocalSmem {
    struct Buf {
        float x[ST_TK][ST_STRIDE];  // [token][p]
        float b[ST_TK][TN + 8];     // [token][n]
        float cs[ST_TK], dt[ST_TK];
        int seq[ST_TK];
    } buf[2];
    float w[TN / 16][ST_TK];  // each warp's w of the current stage
};
static_assert(sizeof(ChunkStateLocalSmem<64>::Buf) == SL_BUF(64) * 4, "2a's buffer");
static_assert(sizeof(ChunkStateLocalSmem<128>::Buf) == SL_BUF(128) * 4, "2a's buffer");
static_assert(sizeof(ChunkStateLocalSmem<128>) == (2 * SL_BUF(128) + 8 * ST_TK) * 4, "2a's layout");

#define CHUNK_STATE_LOCAL_FIELDS                                                                                 \
    p.x, p.Bm, p.dt_out, p.dA_cumsum, p.seq_idx, p.chunk_states, p.seqlen, p.nheads, p.headdim, p.ngroups, p.dstate, \
        p.chunk_size, p.nchunks
extern "C" __global__ void __launch_bounds__(128, 3) ssd_chunk_state_local(const ChunkStateLocalParams p) {
    SSD_DYNAMIC_SMEM(smem);
    chunk_state_local_body<64>(smem, CHUNK_STATE_LOCAL_FIELDS);
}
SSD_LAYOUT_FIXED(ssd_chunk_state_local, ChunkStateLocalParams, sizeof(ChunkStateLocalSmem<64>));
extern "C" __global__ void __launch_bounds__(256, 2) ssd_chunk_state_local_wide(const ChunkStateLocalParams p) {
    SSD_DYNAMIC_SMEM(smem);
    chunk_state_local_body<128>(smem, CHUNK_STATE_LOCAL_FIELDS);
}
SSD_LAYOUT_FIXED(ssd_chunk_state_local_wide, ChunkStateLocalParams, sizeof(ChunkStateLocalSmem<128>));
