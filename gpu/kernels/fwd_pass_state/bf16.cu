// Stage 2, 2a with bf16 inputs (the host's choice for bf16 I/O where the pair kernels apply,
// see docs/gpu.md): ssd_chunk_state_local_pair_bf16, the pair kernel (pair.cu) over bf16 tiles
// of x and B, writing each chunk's own state L_c in f32 as the f32 kernels do (2b then runs
// unchanged). Grid and block as pair.cu: one block of 256 threads per (batch, chunk, 128
// dstate columns, pair of units of one group); warp w computes unit w / 4, rows 32 ((w / 2)
// % 2) and columns 64 (w % 2) of the [headdim, dstate] state, its rows in the standard
// fragment order (row 16 mi + g + 8 hf of its 32).
//   L_c[p, n] = sum_l bf16(x[l, p] w[l]) B[l, n],  w[l] = exp(cs[last] - cs[l]) dt'[l]
// (0 where seq(l) differs from seq(last)): bf16 products (mma.m16n8k16), f32 accumulation.
// The A fragments (x^T, [p][l]) come through ldmatrix.trans from the x tile ([l][p]), are
// scaled by w in f32 and rounded back to bf16, to nearest even: one operand rounding per term,
// as mamba_ssm's chunk-state kernel rounds its scaled B (b.to(x.dtype)); the B fragments
// ([l][n]) through ldmatrix.trans as stored. The 64-token stages flow through a 3-stage
// cp.async ring, one barrier per stage (twice the bytes in flight of 32-token stages through
// three, half the barriers and copy set-ups; the products in the same k order, so the same
// bits). Every copy is 16 bytes wide: headdim and dstate multiples of 8 (the host's condition).
#define SPH_S 136  // bf16 row stride of the x and B tiles (272-byte rows: ldmatrix without conflicts)
#define SPH_T 64   // tokens per stage
struct ChunkStateLocalPairBf16Smem {
    struct Stage {
        bf16_t x[SPH_T][SPH_S];  // unit u at column 64 u
        bf16_t b[SPH_T][SPH_S];
        float cs[2][SPH_T], dt[2][SPH_T];
        int seq[SPH_T];
    } stage[3];
    float w[8][SPH_T];    // each warp's w of the current stage
    const void* base[8];  // the block's base addresses
};
static_assert(sizeof(ChunkStateLocalPairBf16Smem::Stage) % 16 == 0, "16-byte aligned stages");
static_assert(2 * (sizeof(ChunkStateLocalPairBf16Smem) + 1024) <= 228 * 1024, "two blocks per Hopper SM");

// The parameters of ssd_chunk_state_local_pair_bf16 (Rust: ChunkStateLocalParams, as the f32
// 2a kernels').
struct ChunkStateLocalBf16Params {
    const bf16_t* x;         // [batch, seqlen, nheads, headdim]
    const bf16_t* Bm;        // [batch, seqlen, ngroups, dstate]
    const float* dt_out;     // [batch, nheads, nchunks, chunk_size]
    const float* dA_cumsum;  // [batch, nheads, nchunks, chunk_size]
    const int* seq_idx;      // [batch, seqlen] or null
    float* chunk_states;     // [batch, nchunks, nheads, headdim, dstate] (L_c here)
    int seqlen, nheads, headdim, ngroups, dstate, chunk_size, nchunks;
};
static_assert(sizeof(ChunkStateLocalBf16Params) == sizeof(ChunkStateLocalParams), "one Rust struct for the 2a kernels");

// The block's tile is (batch b, chunk c, dstate columns n0 .. n0 + 127, pair `pair`); its
// product lands in acc (warp w's 32 x 64 tile, rows in the standard fragment order).
__device__ __forceinline__ void chunk_state_local_pair_bf16_body(const ChunkStateLocalBf16Params& p, int b, int c,
                                                                 int n0, int pair, float (&acc)[2][8][4]) {
    SSD_DYNAMIC_SMEM(smem_raw);
    ChunkStateLocalPairBf16Smem& sm = *reinterpret_cast<ChunkStateLocalPairBf16Smem*>(smem_raw);
    constexpr int NT = 256, TK = SPH_T;
    static_assert(TK == 64, "a warp's w: two tokens per lane");
    const int tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int u = warp >> 2, wm = (warp >> 1) & 1, wn = warp & 1;
    float* ws = sm.w[warp];
    const void** ptab = sm.base;
    const int ptiles = (p.headdim + 63) / 64;
    const int h_0 = (2 * pair) / ptiles, p_0 = ((2 * pair) % ptiles) * 64;
    const int h_1 = (2 * pair + 1) / ptiles, p_1 = ((2 * pair + 1) % ptiles) * 64;
    const int rows_0 = min(64, p.headdim - p_0), rows_1 = min(64, p.headdim - p_1);
    const int grp = h_0 / (p.nheads / p.ngroups);
    const int cols_n = min(128, p.dstate - n0);
    const unsigned tok_stride_x = (unsigned)(p.nheads * p.headdim);
    const unsigned tok_stride_b = (unsigned)(p.ngroups * p.dstate);
    const i64 t0 = (i64)c * p.chunk_size;
    const int last = (int)min((i64)p.chunk_size, (i64)p.seqlen - t0) - 1;
    const i64 cb_0 = (((i64)b * p.nheads + h_0) * p.nchunks + c) * p.chunk_size;
    const i64 cb_1 = (((i64)b * p.nheads + h_1) * p.nchunks + c) * p.chunk_size;
    // This warp's unit's head.
    const float csl_last = p.dA_cumsum[(u ? cb_1 : cb_0) + last] * LOG2E_F;
    const int* seq_row = p.seq_idx != nullptr ? p.seq_idx + (i64)b * p.seqlen + t0 : nullptr;
    const int seq_last = seq_row != nullptr ? seq_row[last] : 0;
    if (tid == 0) {
        const bf16_t* xb = p.x + ((i64)b * p.seqlen + t0) * tok_stride_x;
        ptab[0] = xb + (i64)h_0 * p.headdim + p_0;
        ptab[1] = xb + (i64)h_1 * p.headdim + p_1;
        ptab[2] = p.Bm + ((i64)b * p.seqlen + t0) * tok_stride_b + (i64)grp * p.dstate + n0;
        ptab[3] = p.dA_cumsum + cb_0;
        ptab[4] = p.dA_cumsum + cb_1;
        ptab[5] = p.dt_out + cb_0;
        ptab[6] = p.dt_out + cb_1;
        ptab[7] = seq_row;
    }
    const int nst = last / TK + 1;

    auto issue = [&](int k) {
        ChunkStateLocalPairBf16Smem::Stage& st = sm.stage[k % 3];
        const int k0 = k * TK;
        const int rows_t = min(TK, last + 1 - k0);
        const unsigned xoff = (unsigned)k0 * tok_stride_x, boff = (unsigned)k0 * tok_stride_b;
        // x is read once: L2 priority evict_first (chained.cu says why); B keeps the normal
        // priority, the group's other pairs read the same tile.
        async_rows_bf16<TK, 64, NT, true>(&st.x[0][0], SPH_S, (const bf16_t*)ptab[0] + xoff, tok_stride_x, rows_t, rows_0, tid);
        async_rows_bf16<TK, 64, NT, true>(&st.x[0][64], SPH_S, (const bf16_t*)ptab[1] + xoff, tok_stride_x, rows_t, rows_1, tid);
        async_rows_bf16<TK, 128, NT>(&st.b[0][0], SPH_S, (const bf16_t*)ptab[2] + boff, tok_stride_b, rows_t, cols_n, tid);
        if (tid < 2 * TK) {
            const int l = tid & (TK - 1), v = tid / TK;
            const bool ok = l < rows_t;
            cp_async4(&st.cs[v][l], (const float*)ptab[3 + v] + k0 + l, ok, p.dA_cumsum);
            cp_async4(&st.dt[v][l], (const float*)ptab[5 + v] + k0 + l, ok, p.dt_out);
            if (seq_row != nullptr && tid < TK) cp_async4(&st.seq[l], (const int*)ptab[7] + k0 + l, ok, p.seq_idx);
        }
    };

    zero_2xn(acc);
    // ldmatrix.trans rows of this lane for the A fragments: token kk + 8 ((lane >> 4) & 1) +
    // (lane & 7), column (p) u 64 + wm 32 + 16 mi + 8 ((lane >> 3) & 1).
    const int a_off = (((lane >> 4) & 1) * 8 + (lane & 7)) * SPH_S + u * 64 + wm * 32 + ((lane >> 3) & 1) * 8;

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
        const ChunkStateLocalPairBf16Smem::Stage& st = sm.stage[k % 3];
        const int rows_t = min(TK, last + 1 - k * TK);
#pragma unroll
        for (int e = 0; e < TK; e += 32) {
            const int l = e + lane;
            const bool same = seq_row == nullptr || st.seq[l] == seq_last;
            ws[l] = (l < rows_t && same) ? ex2_approx(csl_last - st.cs[u][l] * LOG2E_F) * st.dt[u][l] : 0.0f;
        }
        __syncwarp();
        const unsigned x_s = smem_addr(&st.x[0][0]), b_s = smem_addr(&st.b[0][0]);
#pragma unroll
        for (int kk = 0; kk < TK; kk += 16) {
            const float w0 = ws[kk + 2 * q], w1 = ws[kk + 2 * q + 1];
            const float w8 = ws[kk + 2 * q + 8], w9 = ws[kk + 2 * q + 9];
            unsigned a[2][4], bf[8][2];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                ldmatrix_x4_trans(a[mi], x_s + (unsigned)(kk * SPH_S + a_off + mi * 16) * 2u);
                scale_a_tokens_bf16(a[mi], w0, w1, w8, w9);
            }
            load_b_kmajor_bf16(bf, b_s, SPH_S, kk, wn * 64, lane);
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int nf = 0; nf < 8; ++nf) mma_bf16(acc[mi][nf], a[mi], bf[nf]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(256, 2) ssd_chunk_state_local_pair_bf16(const ChunkStateLocalBf16Params p) {
    const int ntiles_n = (p.dstate + 127) / 128;
    const int ptiles = (p.headdim + 63) / 64;
    int ct, pair;  // ct: chunk and 128 dstate columns
    tile_and_unit(p.nheads * ptiles / 2, ct, pair);
    const int c = ct / ntiles_n, n0 = (ct % ntiles_n) * 128, b = blockIdx.z;
    float acc[2][8][4];
    chunk_state_local_pair_bf16_body(p, b, c, n0, pair, acc);
    // Store: rows wm 32 + 16 mi + g + 8 hf, columns wn 64 + 8 nf + 2 q (+1); dstate is even.
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int wm = (warp >> 1) & 1, wn = warp & 1;
    const int unit = 2 * pair + (warp >> 2);
    const int h = unit / ptiles, p0 = (unit % ptiles) * 64;
    const int rows_p = min(64, p.headdim - p0), cols_n = min(128, p.dstate - n0);
    float* cst = p.chunk_states + (((i64)b * p.nchunks + c) * p.nheads + h) * p.headdim * p.dstate;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int pr = wm * 32 + 16 * mi + g + 8 * hf;
            if (pr >= rows_p) continue;
            float* row = cst + (i64)(p0 + pr) * p.dstate + n0;
#pragma unroll
            for (int nf = 0; nf < 8; ++nf) {
                const int nc = wn * 64 + nf * 8 + 2 * q;
                if (nc < cols_n) *reinterpret_cast<float2*>(row + nc) = make_float2(acc[mi][nf][2 * hf], acc[mi][nf][2 * hf + 1]);
            }
        }
}
SSD_LAYOUT_FIXED(ssd_chunk_state_local_pair_bf16, ChunkStateLocalBf16Params, sizeof(ChunkStateLocalPairBf16Smem));
