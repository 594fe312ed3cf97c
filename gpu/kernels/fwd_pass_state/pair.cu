// Stage 2, 2a, the pair kernel (the host's choice where it applies, see docs/gpu.md): one block of 256
// threads (8 warps, two blocks per SM) per (batch b, chunk c, 128 dstate columns n, pair of
// units), a unit being a head h and 64 of its headdim rows p, as in the output kernel's pairs
// (head-major order, both units of a pair in one group): both units read one copy of each B
// tile from L2 instead of one each (the grid's x is (c * ceil(dstate / 128) + n / 128) * pairs +
// pair, tile_and_unit). Warp w computes unit w / 4, rows 32 ((w / 2) % 2) and
// columns 64 (w % 2): a 32 x 64 tile, its A fragments through 16-byte loads of x scaled by w
// of its unit's head as in 2a above. The 32-token stages (x of both units, B, cs and dt' of
// both heads, seq) flow through a 3-stage cp.async ring, one barrier per stage.
// Dynamic shared memory (floats): 3 stages of [x 32 x 136 (unit u at column 64 u), B 32 x 136,
// cs[2][32], dt'[2][32], seq[32]], then w: 32 per warp, then 8 base addresses (8 bytes each).
// Every copy is 16 bytes wide: headdim and dstate multiples of 4 (the host's condition).
#define SP_S 136
#define SP_STAGE (2 * 32 * SP_S + 160)
// The block's tile is (batch b, chunk c, dstate columns n0 .. n0 + 127, pair `pair`); its
// product lands in acc (warp w's 32 x 64 tile, rows in the order of store_state_tile).
__device__ __forceinline__ void chunk_state_local_pair_body(
    const float* __restrict__ x, const float* __restrict__ Bm, const float* __restrict__ dt_out,
    const float* __restrict__ dA_cumsum, const int* __restrict__ seq_idx, int seqlen, int nheads, int headdim,
    int ngroups, int dstate, int chunk_size, int nchunks, int b, int c, int n0, int pair, float (&acc)[2][8][4])
{
    SSD_DYNAMIC_SMEM(smem);
    constexpr int NT = 256, TK = 32;
    const int tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int u = warp >> 2, wm = (warp >> 1) & 1, wn = warp & 1;
    float* ws = smem + 3 * SP_STAGE + warp * TK;  // this warp's w of the current stage
    const float** ptab = (const float**)(smem + 3 * SP_STAGE + 8 * TK);
    const int ptiles = (headdim + 63) / 64;
    const int h_0 = (2 * pair) / ptiles, p_0 = ((2 * pair) % ptiles) * 64;
    const int h_1 = (2 * pair + 1) / ptiles, p_1 = ((2 * pair + 1) % ptiles) * 64;
    const int rows_0 = min(64, headdim - p_0), rows_1 = min(64, headdim - p_1);
    const int grp = h_0 / (nheads / ngroups);
    const int cols_n = min(128, dstate - n0);
    const i64 tok_stride_x = (i64)nheads * headdim;
    const i64 tok_stride_b = (i64)ngroups * dstate;
    const i64 t0 = (i64)c * chunk_size;
    const int last = (int)min((i64)chunk_size, (i64)seqlen - t0) - 1;
    const i64 cb_0 = (((i64)b * nheads + h_0) * nchunks + c) * chunk_size;
    const i64 cb_1 = (((i64)b * nheads + h_1) * nchunks + c) * chunk_size;
    // This warp's unit's head.
    const float csl_last = dA_cumsum[(u ? cb_1 : cb_0) + last] * LOG2E_F;
    const int* seq_row = seq_idx != nullptr ? seq_idx + (i64)b * seqlen + t0 : nullptr;
    const int seq_last = seq_row != nullptr ? seq_row[last] : 0;
    if (tid == 0) {
        ptab[0] = x + ((i64)b * seqlen + t0) * tok_stride_x + (i64)h_0 * headdim + p_0;
        ptab[1] = x + ((i64)b * seqlen + t0) * tok_stride_x + (i64)h_1 * headdim + p_1;
        ptab[2] = Bm + ((i64)b * seqlen + t0) * tok_stride_b + (i64)grp * dstate + n0;
        ptab[3] = dA_cumsum + cb_0;
        ptab[4] = dA_cumsum + cb_1;
        ptab[5] = dt_out + cb_0;
        ptab[6] = dt_out + cb_1;
        ptab[7] = (const float*)seq_row;
    }
    const int nst = last / TK + 1;

    auto issue = [&](int k) {
        float* xs = smem + (k % 3) * SP_STAGE;
        float* bs = xs + TK * SP_S;
        float* vk = bs + TK * SP_S;  // cs[2][32], dt'[2][32], seq[32]
        const int k0 = k * TK;
        const int rows_t = min(TK, last + 1 - k0);
        const unsigned xoff = (unsigned)k0 * (unsigned)tok_stride_x, boff = (unsigned)k0 * (unsigned)tok_stride_b;
        // x is read once: L2 priority evict_first (chained.cu says why); B keeps the normal
        // priority, the group's other pairs read the same tile.
        async_rows<TK, 64, NT, true>(xs, SP_S, ptab[0] + xoff, (unsigned)tok_stride_x, rows_t, rows_0, tid);
        async_rows<TK, 64, NT, true>(xs + 64, SP_S, ptab[1] + xoff, (unsigned)tok_stride_x, rows_t, rows_1, tid);
        async_rows<TK, 128, NT>(bs, SP_S, ptab[2] + boff, (unsigned)tok_stride_b, rows_t, cols_n, tid);
        if (tid < 64) {
            const int l = tid & 31;
            const bool ok = l < rows_t;
            cp_async4(vk + tid, ptab[3 + (tid >> 5)] + k0 + l, ok, dA_cumsum);
            cp_async4(vk + 64 + tid, ptab[5 + (tid >> 5)] + k0 + l, ok, dt_out);
            if (seq_idx != nullptr && tid < 32) cp_async4(vk + 128 + tid, (const int*)ptab[7] + k0 + l, ok, seq_idx);
        }
    };

    zero_2xn(acc);

    __syncthreads();  // the base addresses
    issue(0);
    cp_async_commit();
    if (nst > 1) issue(1);
    cp_async_commit();
    for (int k = 0; k < nst; ++k) {
        cp_async_wait<1>();  // this thread's copies of stage k have landed (k + 1 may still fly)
        __syncthreads();     // everyone's have, and everyone is done with stage k - 1
        if (k + 2 < nst) issue(k + 2);
        cp_async_commit();
        const float* xs = smem + (k % 3) * SP_STAGE;
        const float* bs = xs + TK * SP_S;
        const float* vk = bs + TK * SP_S;
        const int rows_t = min(TK, last + 1 - k * TK);
        {
            const bool same = seq_idx == nullptr || ((const int*)vk)[128 + lane] == seq_last;
            ws[lane] = (lane < rows_t && same) ? ex2_approx(csl_last - vk[u * 32 + lane] * LOG2E_F) * vk[64 + u * 32 + lane]
                                               : 0.0f;
        }
        __syncwarp();
        const float* xa = xs + u * 64 + wm * 32 + 4 * g;  // A[p][l] = x[l][p] w[l], 4 rows per load
        const float* bb = bs + wn * 64 + g;               // B[l][n]
#pragma unroll
        for (int kk = 0; kk < TK; kk += 8) {
            state_kstep<8>(acc, xa, SP_S, bb, SP_S, ws, kk, q);
        }
    }
}

// The pair kernel's dynamic shared memory, as the body above carves it.
struct ChunkStateLocalPairSmem {
    struct Stage {
        float x[32][SP_S];  // unit u at column 64 u
        float b[32][SP_S];
        float cs[2][32], dt[2][32];
        int seq[32];
    } stage[3];
    float w[8][32];        // each warp's w of the current stage
    const float* base[8];  // the block's base addresses
};
static_assert(sizeof(ChunkStateLocalPairSmem::Stage) == SP_STAGE * 4, "the pair kernel's stage");
static_assert(sizeof(ChunkStateLocalPairSmem) == (3 * SP_STAGE + 8 * 32) * 4 + 64, "the pair kernel's layout");

extern "C" __global__ void __launch_bounds__(256, 2) ssd_chunk_state_local_pair(const ChunkStateLocalParams p) {
    const int ntiles_n = (p.dstate + 127) / 128;
    const int ptiles = (p.headdim + 63) / 64;
    int ct, pair;  // ct: chunk and 128 dstate columns
    tile_and_unit(p.nheads * ptiles / 2, ct, pair);
    const int c = ct / ntiles_n, n0 = (ct % ntiles_n) * 128, b = blockIdx.z;
    float acc[2][8][4];
    chunk_state_local_pair_body(p.x, p.Bm, p.dt_out, p.dA_cumsum, p.seq_idx, p.seqlen, p.nheads, p.headdim,
                                p.ngroups, p.dstate, p.chunk_size, p.nchunks, b, c, n0, pair, acc);
    // Warp w's tile: unit w / 4, rows 32 ((w / 2) % 2), columns 64 (w % 2).
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int unit = 2 * pair + (warp >> 2);
    const int h = unit / ptiles, p0 = (unit % ptiles) * 64;
    float* cst = p.chunk_states + (((i64)b * p.nchunks + c) * p.nheads + h) * p.headdim * p.dstate;
    store_state_tile(cst, acc, p.dstate, p0, n0, (warp >> 1) & 1, (warp & 1) * 64, lane >> 2, lane & 3,
                     min(64, p.headdim - p0), min(128, p.dstate - n0));
}
SSD_LAYOUT_FIXED(ssd_chunk_state_local_pair, ChunkStateLocalParams, sizeof(ChunkStateLocalPairSmem));
