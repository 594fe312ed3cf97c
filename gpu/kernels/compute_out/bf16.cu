// Stage 3 with bf16 inputs and output (the host's choice for bf16 I/O where the pair kernels
// apply, see docs/gpu.md): x, C, B, z and out in bf16; dt', dA_cumsum, D and the scores in
// f32. Every product takes bf16 operands on the tensor cores (mma.m16n8k16), f32
// accumulation, the operands rounded where mamba_ssm's kernels round them with bf16 inputs:
// the decayed scores M (cb.to(x.dtype)) and the carried state S (prev_states.to(C.dtype)) to
// bf16, to nearest even; x, B and C are bf16 already. S comes rounded: stage 2 writes each
// chunk's state in f32 (chunk_states) and in bf16 (states_lo, the same rounding), and 3b
// reads the bf16 copy.
//
// 3a, ssd_chunk_cb_bf16: as ssd_chunk_cb (scores.cu), the same grid and f32 output, C and B
// slabs of 64 bf16 through the cp.async double buffer, fragments through ldmatrix.
// Dynamic shared memory: 2 buffers of [C slab 64 x 72, B slab 64 x 72] bf16 (144-byte rows:
// ldmatrix without bank conflicts).
#define CBH_A 72
struct ChunkCbBf16Smem {
    struct Buf {
        bf16_t c[64][CBH_A];
        bf16_t b[64][CBH_A];
    } buf[2];
};

// The parameters of ssd_chunk_cb_bf16 (Rust: ChunkCbParams, as ssd_chunk_cb's).
struct ChunkCbBf16Params {
    const bf16_t* Bm;  // [batch, seqlen, ngroups, dstate]
    const bf16_t* Cm;  // [batch, seqlen, ngroups, dstate]
    float* cbuf;       // [batch, nchunks, ngroups, npairs, 64, 64]
    int seqlen, ngroups, dstate, chunk_size, nchunks, tmax;
    int vec;  // 1 (dstate a multiple of 8, the host's condition); not read
};
static_assert(sizeof(ChunkCbBf16Params) == sizeof(ChunkCbParams), "one Rust struct for both 3a kernels");

extern "C" __global__ void __launch_bounds__(128, 3) ssd_chunk_cb_bf16(const ChunkCbBf16Params p) {
    SSD_DYNAMIC_SMEM(smem_raw);
    ChunkCbBf16Smem& sm = *reinterpret_cast<ChunkCbBf16Smem*>(smem_raw);
    const int tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int wm = warp >> 1, wn = warp & 1;
    const int npairs = p.tmax * (p.tmax + 1) / 2;
    const int c = blockIdx.x / npairs;
    const int pair = blockIdx.x % npairs;
    int it = 0;
    while ((it + 1) * (it + 2) / 2 <= pair) ++it;
    const int jt = pair - it * (it + 1) / 2;
    const int grp = blockIdx.y;
    const int b = blockIdx.z;
    const i64 t0 = (i64)c * p.chunk_size;
    const int valid_c = (int)min((i64)p.chunk_size, (i64)p.seqlen - t0);
    const int i0 = it * 64, j0 = jt * 64;
    if (i0 >= valid_c) return;  // never read (block-uniform)
    const int rows_i = min(64, valid_c - i0);
    const int rows_j = min(64, valid_c - j0);
    const unsigned tok_stride_b = (unsigned)(p.ngroups * p.dstate);
    const bf16_t* cg = p.Cm + ((i64)b * p.seqlen + t0 + i0) * tok_stride_b + (i64)grp * p.dstate;
    const bf16_t* bg = p.Bm + ((i64)b * p.seqlen + t0 + j0) * tok_stride_b + (i64)grp * p.dstate;
    const int nslab = (p.dstate + 63) / 64;
    const int NK = ((p.dstate + 15) / 16) * 16;

    auto issue = [&](int s) {
        const int n0 = s * 64;
        async_rows_bf16<64, 64, 128>(&sm.buf[s & 1].c[0][0], CBH_A, cg + n0, tok_stride_b, rows_i, p.dstate - n0, tid);
        async_rows_bf16<64, 64, 128>(&sm.buf[s & 1].b[0][0], CBH_A, bg + n0, tok_stride_b, rows_j, p.dstate - n0, tid);
    };
    float acc[2][4][4];
    zero_2xn(acc);
    issue(0);
    cp_async_commit();
    for (int s = 0; s < nslab; ++s) {
        cp_async_wait<0>();  // this thread's copies of slab s have landed
        __syncthreads();     // everyone's have, and everyone is done with slab s - 1's buffer
        if (s + 1 < nslab) issue(s + 1);
        cp_async_commit();
        mma_slab_2xn_bf16(acc, smem_addr(&sm.buf[s & 1].c[0][0]), smem_addr(&sm.buf[s & 1].b[0][0]), CBH_A, wm * 32,
                          wn * 32, min(64, NK - s * 64), lane);
    }
    float* dst = p.cbuf + ((((i64)b * p.nchunks + c) * p.ngroups + grp) * npairs + pair) * 4096;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int r = wm * 32 + mi * 16 + g + 8 * hf;
#pragma unroll
            for (int nf = 0; nf < 4; ++nf) {
                const int col = wn * 32 + nf * 8 + 2 * q;
                *reinterpret_cast<float2*>(dst + r * 64 + col) = make_float2(acc[mi][nf][2 * hf], acc[mi][nf][2 * hf + 1]);
            }
        }
}
SSD_LAYOUT_FIXED(ssd_chunk_cb_bf16, ChunkCbBf16Params, sizeof(ChunkCbBf16Smem));

// The score decay's three modes in 3b's half steps: left of the block without seq_idx (the split
// decay, no mask), the causal mask alone, the mask and seq_idx.
enum { DECAY_SPLIT, DECAY_MASK, DECAY_SEQ };

// 3b, ssd_compute_out_pair_bf16: the pair kernel (pair.cu) over bf16 tiles. One block of 256
// threads (8 warps, two blocks per SM) per (batch, chunk, 128 rows, pair of units of one
// group); warp w owns unit w % 2 and two 16-row groups of the block, w / 2 and 7 - w / 2 (rows
// 16 (w / 2) and 16 (7 - w / 2) on), a 32 x 64 output tile. Balanced so: along the block's own
// columns the causal mask gives the lower rows more steps, and every warp holds one group of
// each end. A warp skips the 16-column halves of a step that lie wholly right of a group's
// last row. Its steps flow through a 2-stage cp.async ring, one barrier per step:
//   steps over dstate, 64 wide (only when the carried state is not 0): C[i, n0:n0+64] (bf16,
//     128 rows) and bf16(S_u)[p, n0:n0+64] (states_lo) of both units; acc += C bf16(S_u)^T,
//     both operands' fragments through ldmatrix (the same k order as 32-wide steps: the same
//     bits);
//   then acc *= exp(cs_i) (0 where seq(i) differs from the seq before the chunk);
//   steps over 64 of the chunk's columns up to the block's last row, each computed as two
//     32-column halves: the f32 scores of the block's rows, x_u[j, p] (bf16) of both units,
//     cs_j, dt'_j of both heads, seq_j. Each warp builds its A fragments from f32 pairs of
//     scores, decays them as pair.cu does (the split row and column factors left of the block
//     without seq_idx) and rounds them to bf16; x's fragments come through ldmatrix.trans. The D
//     term is added at the half holding each group's rows.
// One 64-column step with two stages in flight replaces two 32-column steps with three: the same
// bytes ahead of the products, half the barriers, waits and copy set-ups per column (version 42
// in docs/perf-history.md).
// cs_i and seq_i of the block's rows come with step 0's copies (one round trip fewer before the
// first step).
// Epilogue: z gate (z bf16), out written as bf16 pairs, rounded to nearest even.
// Dynamic shared memory: ComputeOutPairBf16Smem below. The f32 scores have a row stride of 8
// mod 32 floats (72), so the 8-byte fragment loads of a half warp hit 32 distinct banks; the C
// and x tiles rows of 16-byte pieces whose eight rows of an ldmatrix hit distinct banks (144
// and 272 bytes); the S slabs unpadded 128-byte rows, XOR-swizzled (async_rows_bf16_swz64),
// as version 40's three 32-column stages needed to fit two blocks per SM (a slab stage now lies
// within a score stage either way).
#define COH_J 64   // chunk columns per score step
#define COH_A 72   // scores row stride (floats)
#define COH_N 64   // dstate columns per slab step
#define COH_C 72   // C slab row stride (bf16)
#define COH_X 136  // x row stride (bf16): unit u at column 64 u
struct ComputeOutPairBf16Smem {
    struct Stage {
        union {
            float scores[128][COH_A];
            bf16_t c[128][COH_C];
        } a;
        union {
            bf16_t s[2][64][COH_N];  // the bf16 S slabs of both units, unpadded, swizzled
            struct {
                bf16_t x[COH_J][COH_X];
                float cs_j[2][COH_J], dt_j[2][COH_J];
                int seq_j[COH_J];
            } x;
        } b;
    } stage[2];
    float cs_i[2][128];
    int seq_i[128];
    const void* base[12];  // the block's 11 base addresses
};
static_assert(sizeof(ComputeOutPairBf16Smem::Stage) % 16 == 0, "16-byte aligned stages");
static_assert(COH_N == 64, "the S slabs' swizzle spans rows of 64 bf16 (async_rows_bf16_swz64)");
static_assert(COH_J == 64 && COH_A % 32 == 8, "64-column score steps, one 64-column score tile each; bank-free rows");
static_assert(2 * (sizeof(ComputeOutPairBf16Smem) + 1024) <= 228 * 1024, "two blocks per Hopper SM");

// The parameters of ssd_compute_out_pair_bf16 (Rust: ComputeOutCbParams, as the f32 kernels').
struct ComputeOutPairBf16Params {
    const bf16_t* x;            // [batch, seqlen, nheads, headdim]
    const bf16_t* Cm;           // [batch, seqlen, ngroups, dstate]
    const float* Dv;            // [nheads] or [nheads, headdim] or null
    const bf16_t* z;            // [batch, seqlen, nheads, headdim] or null
    const float* dt_out;        // [batch, nheads, nchunks, chunk_size]
    const float* dA_cumsum;     // [batch, nheads, nchunks, chunk_size]
    const bf16_t* states_lo;    // [batch, nchunks, nheads, headdim, dstate]: bf16(chunk_states)
    const int* seq_idx;         // [batch, seqlen] or null
    const float* cbuf;          // [batch, nchunks, ngroups, npairs, 64, 64]
    bf16_t* out;                // [batch, seqlen, nheads, headdim]
    int seqlen, nheads, headdim, ngroups, dstate, chunk_size, nchunks;
    int d_per_channel, has_initial_states, tmax;
    int vec;  // 1 (headdim and dstate multiples of 8, the host's condition); not read
};
static_assert(sizeof(ComputeOutPairBf16Params) == sizeof(ComputeOutCbParams), "one Rust struct for the 3b kernels");

extern "C" __global__ void __launch_bounds__(256, 2) ssd_compute_out_pair_bf16(const ComputeOutPairBf16Params p) {
    SSD_DYNAMIC_SMEM(smem_raw);
    ComputeOutPairBf16Smem& sm = *reinterpret_cast<ComputeOutPairBf16Smem*>(smem_raw);
    constexpr int TM = 128, NT = 256;
    const void** ptab = sm.base;

    const int tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int wm = warp >> 1, wn = warp & 1;  // rows 32 wm, unit wn
    const int itiles = (p.chunk_size + TM - 1) / TM;
    const int c = blockIdx.x / itiles;
    const int i0 = (blockIdx.x % itiles) * TM;
    const int t64 = i0 / 64;
    const int ptiles = (p.headdim + 63) / 64;
    const int b = blockIdx.z;
    const int h_0 = (2 * blockIdx.y) / ptiles, p_0 = ((2 * blockIdx.y) % ptiles) * 64;
    const int h_1 = (2 * blockIdx.y + 1) / ptiles, p_1 = ((2 * blockIdx.y + 1) % ptiles) * 64;
    const int cols_0 = min(64, p.headdim - p_0), cols_1 = min(64, p.headdim - p_1);
    const int grp = h_0 / (p.nheads / p.ngroups);

    const i64 t0 = (i64)c * p.chunk_size;
    const int valid_c = (int)min((i64)p.chunk_size, (i64)p.seqlen - t0);
    if (i0 >= valid_c) return;  // the whole tile lies past seqlen (block-uniform)
    const int rows_i = min(TM, valid_c - i0);
    const i64 cb_0 = (((i64)b * p.nheads + h_0) * p.nchunks + c) * p.chunk_size;
    const i64 cb_1 = (((i64)b * p.nheads + h_1) * p.nchunks + c) * p.chunk_size;
    const unsigned tok_stride_x = (unsigned)(p.nheads * p.headdim);
    const unsigned tok_stride_b = (unsigned)(p.ngroups * p.dstate);
    const int npairs = p.tmax * (p.tmax + 1) / 2;
    const int* seq_row = p.seq_idx != nullptr ? p.seq_idx + (i64)b * p.seqlen : nullptr;
    const bool has_seq = seq_row != nullptr;

    if (tid == 0) {
        const bf16_t* xb = p.x + ((i64)b * p.seqlen + t0) * tok_stride_x;
        ptab[0] = xb + (i64)h_0 * p.headdim + p_0;
        ptab[1] = xb + (i64)h_1 * p.headdim + p_1;
        ptab[2] = p.states_lo + ((((i64)b * p.nchunks + c) * p.nheads + h_0) * p.headdim + p_0) * p.dstate;
        ptab[3] = p.states_lo + ((((i64)b * p.nchunks + c) * p.nheads + h_1) * p.headdim + p_1) * p.dstate;
        ptab[4] = p.Cm + ((i64)b * p.seqlen + t0 + i0) * tok_stride_b + (i64)grp * p.dstate;
        ptab[5] = p.cbuf + (((i64)b * p.nchunks + c) * p.ngroups + grp) * npairs * 4096;
        ptab[6] = p.dA_cumsum + cb_0;
        ptab[7] = p.dA_cumsum + cb_1;
        ptab[8] = p.dt_out + cb_0;
        ptab[9] = p.dt_out + cb_1;
        ptab[10] = has_seq ? seq_row + t0 : nullptr;
    }
    {
        // cs_i of both units and seq_i join step 0's copies (zeros past the chunk's end).
        // Written out in both pair kernels: as one shared helper it moved ptxas's register
        // allocation (bf16: 16 -> 32 or 40 bytes of spills, version 39 in docs/perf-history.md).
        static_assert(NT == 2 * TM, "one cs_i entry per thread");
        const int u = tid / TM, rr = tid & (TM - 1);
        cp_async4(&sm.cs_i[u][rr], p.dA_cumsum + (u ? cb_1 : cb_0) + i0 + rr, rr < rows_i, p.dA_cumsum);
        if (tid < TM) {
            if (has_seq)
                cp_async4(&sm.seq_i[tid], seq_row + t0 + i0 + tid, tid < rows_i, seq_row);
            else
                sm.seq_i[tid] = 0;
        }
    }

    const int nslab = (c > 0 || p.has_initial_states) ? (p.dstate + COH_N - 1) / COH_N : 0;
    const int nsteps = nslab + (min(i0 + TM, valid_c) + COH_J - 1) / COH_J;
    const bool split = !has_seq && i0 > 0;
    // This warp's unit.
    const int h = wn ? h_1 : h_0, p0 = wn ? p_1 : p_0, cols_p = wn ? cols_1 : cols_0;
    const float R = split ? p.dA_cumsum[(wn ? cb_1 : cb_0) + i0 - 1] * LOG2E_F : 0.0f;

    auto issue = [&](int s) {
        ComputeOutPairBf16Smem::Stage& st = sm.stage[s & 1];
        if (s < nslab) {
            const int n0 = s * COH_N;
            async_rows_bf16<TM, COH_N, NT>(&st.a.c[0][0], COH_C, (const bf16_t*)ptab[4] + n0, tok_stride_b, rows_i,
                                           p.dstate - n0, tid);
            async_rows_bf16_swz64<64, NT>(&st.b.s[0][0][0], (const bf16_t*)ptab[2] + n0, p.dstate, cols_0,
                                          p.dstate - n0, tid);
            async_rows_bf16_swz64<64, NT>(&st.b.s[1][0][0], (const bf16_t*)ptab[3] + n0, p.dstate, cols_1,
                                          p.dstate - n0, tid);
        } else {
            const int j0 = (s - nslab) * COH_J;
            const int jt = j0 >> 6;
            const int rows_j = min(COH_J, valid_c - j0);
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int rt = t64 + hh;
                if (jt <= rt && hh * 64 < rows_i)
                    async_rows<64, COH_J, NT>(&st.a.scores[hh * 64][0], COH_A,
                                              (const float*)ptab[5] + (rt * (rt + 1) / 2 + jt) * 4096, 64, 64, COH_J,
                                              tid);
            }
            const unsigned xoff = (unsigned)j0 * tok_stride_x;
            async_rows_bf16<COH_J, 64, NT>(&st.b.x.x[0][0], COH_X, (const bf16_t*)ptab[0] + xoff, tok_stride_x,
                                           rows_j, cols_0, tid);
            async_rows_bf16<COH_J, 64, NT>(&st.b.x.x[0][64], COH_X, (const bf16_t*)ptab[1] + xoff, tok_stride_x,
                                           rows_j, cols_1, tid);
            if (tid < 2 * COH_J) {
                const int k = tid & (COH_J - 1), u = tid / COH_J;
                const bool ok = k < rows_j;
                cp_async4(&st.b.x.cs_j[u][k], (const float*)ptab[6 + u] + j0 + k, ok, p.dA_cumsum);
                cp_async4(&st.b.x.dt_j[u][k], (const float*)ptab[8 + u] + j0 + k, ok, p.dt_out);
                if (has_seq && tid < COH_J) cp_async4(&st.b.x.seq_j[k], (const int*)ptab[10] + j0 + k, ok, seq_row);
            }
        }
    };

    float acc[2][8][4];
    zero_2xn(acc);

    // The warp's two row groups in the block (rb0 < rb1), and whether any of its rows is in.
    const int rb0 = 16 * wm, rb1 = 16 * (7 - wm);
    const bool rows_mma = rb0 < rows_i;
    // The rows of this thread's fragments, (mi ? rb1 : rb0) + g + 8 hf: log2(e) cs_i (-inf past
    // the chunk's end) and seq.
    float csl[2][2];
    int sq[2][2];

    __syncthreads();  // the base addresses
    issue(0);
    cp_async_commit();
    // The loop runs over the slab steps and the 32-column halves of the score steps; a slab step
    // or the first half of a score step waits for its copies and issues the next step's.
    const int nhalf = nslab + (min(i0 + TM, valid_c) + 31) / 32;
    for (int s = 0; s < nhalf; ++s) {
        const int cs = s < nslab ? s : nslab + ((s - nslab) >> 1);  // the copy step
        if (s < nslab || ((s - nslab) & 1) == 0) {
            cp_async_wait<0>();  // this thread's copies of step cs have landed
            __syncthreads();     // everyone's have, and everyone is done with step cs - 1's stage
            if (cs + 1 < nsteps) issue(cs + 1);
            cp_async_commit();
        }
        if (s == 0) {
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int r = (mi ? rb1 : rb0) + g + 8 * hf;
                    csl[mi][hf] = r < rows_i ? sm.cs_i[wn][r] * LOG2E_F : NEG_INF_F;
                    sq[mi][hf] = sm.seq_i[r];
                }
        }
        if (!rows_mma) continue;  // this warp's rows lie past the chunk's end
        const ComputeOutPairBf16Smem::Stage& st = sm.stage[cs & 1];
        if (s < nslab) {
            // acc += C bf16(S_u)^T over 64 dstate columns (zeros past dstate in both).
            mma_slab_2xn_bf16_swz(acc, smem_addr(&st.a.c[0][0]), smem_addr(&st.b.s[0][0][0]), COH_C, rb0, wn * 64,
                                  lane, rb1 - rb0);
            continue;
        }
        const int j0 = (s - nslab) * 32;
        const int jh = j0 & 32;  // the half's first row of x and column of the scores in the stage
        if (j0 == 0 && nslab > 0) {
            if (split) {
                // exp(cs_i) = 2^R 2^(csl_i - R): 2^R now, the row factor when the block's own
                // columns begin.
                const float f = ex2_approx(R);
#pragma unroll
                for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                    for (int nf = 0; nf < 8; ++nf)
#pragma unroll
                        for (int e = 0; e < 4; ++e) acc[mi][nf][e] *= f;
            } else {
                const int seq_prev = (!has_seq || c == 0) ? 0 : seq_row[t0 - 1];
#pragma unroll
                for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) {
                        const int r = (mi ? rb1 : rb0) + g + 8 * hf;
                        const float f = sq[mi][hf] == seq_prev ? expf(sm.cs_i[wn][r]) : 0.0f;
#pragma unroll
                        for (int nf = 0; nf < 8; ++nf) {
                            acc[mi][nf][2 * hf] *= f;
                            acc[mi][nf][2 * hf + 1] *= f;
                        }
                    }
            }
        }
        if (split && j0 == i0) {
            // Everything so far takes its row factor 2^(csl_i - R) <= 1 (0 past the chunk's end).
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const float f = ex2_approx(csl[mi][hf] - R);
#pragma unroll
                    for (int nf = 0; nf < 8; ++nf) {
                        acc[mi][nf][2 * hf] *= f;
                        acc[mi][nf][2 * hf + 1] *= f;
                    }
                }
        }
        if (j0 > i0 + rb1 + 15) continue;  // every column of the half lies right of this warp's rows
        const float* cs_j = st.b.x.cs_j[wn] + jh;
        const float* dt_j = st.b.x.dt_j[wn] + jh;
        const int* seq_j = st.b.x.seq_j + jh;
        // The half holding a group's own rows adds y += D x to it, from the stage (bf16 x, exact
        // in f32): x's rows jh + (rb & 31) + g + 8 hf there.
        const bool d0 = j0 == i0 + (rb0 & ~31), d1 = j0 == i0 + (rb1 & ~31);
        if ((d0 || d1) && p.Dv != nullptr) {
            // With D per head and a full unit: one D load and no column tests.
            const float dh = p.d_per_channel ? 0.0f : p.Dv[h];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                if (!(mi ? d1 : d0)) continue;
                const int xr = jh + ((mi ? rb1 : rb0) & 31) + g;
                if (!p.d_per_channel && cols_p == 64) {
#pragma unroll
                    for (int nf = 0; nf < 8; ++nf)
#pragma unroll
                        for (int hf = 0; hf < 2; ++hf) {
                            const unsigned xv =
                                *reinterpret_cast<const unsigned*>(&st.b.x.x[xr + 8 * hf][wn * 64 + nf * 8 + 2 * q]);
                            acc[mi][nf][2 * hf] += dh * bf16_lo(xv);
                            acc[mi][nf][2 * hf + 1] += dh * bf16_hi(xv);
                        }
                } else {
#pragma unroll
                    for (int nf = 0; nf < 8; ++nf) {
                        const int col = nf * 8 + 2 * q;
                        if (col >= cols_p) continue;  // cols_p is a multiple of 8: col + 1 is in too
                        const float dc0 = p.d_per_channel ? p.Dv[(i64)h * p.headdim + p0 + col] : dh;
                        const float dc1 = p.d_per_channel ? p.Dv[(i64)h * p.headdim + p0 + col + 1] : dh;
#pragma unroll
                        for (int hf = 0; hf < 2; ++hf) {
                            const unsigned xv =
                                *reinterpret_cast<const unsigned*>(&st.b.x.x[xr + 8 * hf][wn * 64 + col]);
                            acc[mi][nf][2 * hf] += dc0 * bf16_lo(xv);
                            acc[mi][nf][2 * hf + 1] += dc1 * bf16_hi(xv);
                        }
                    }
                }
            }
        }
        const bool colf = split && j0 < i0;  // left of the block: the split decay, no mask
        // Column k of the step is masked for fragment row (mi, hf) where k > lim + rb + 8 hf.
        const int lim = i0 - j0 + g;
        const unsigned x_s = smem_addr(&st.b.x.x[jh][0]);
        // The half's decay mode is chosen once here, outside the unrolled fragment loops (chosen
        // inside them, each of the 16 fragment registers carried its own branch).
        // (M is a constant at each of the three calls below: inlined, each call keeps one mode.)
        const auto half_step = [&](const int M) {
#pragma unroll
            for (int kk = 0; kk < 32; kk += 16) {
                // Group mi takes part where a column of this half lies at or left of its last row
                // (the lower group wherever the upper one does).
                const bool act0 = j0 + kk <= i0 + rb0 + 15;
                if (j0 + kk > i0 + rb1 + 15) continue;
                // This thread's four columns: kk + 2q + {0, 1, 8, 9}.
                int kc[4];
                float cj[4], dj[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    kc[e] = kk + 2 * q + (e & 1) + 8 * (e >> 1);
                    cj[e] = cs_j[kc[e]] * LOG2E_F;
                    dj[e] = dt_j[kc[e]];
                }
                unsigned a[2][4], bf[8][2];
#pragma unroll
                for (int mi = 0; mi < 2; ++mi) {
                    if (mi == 0 && !act0) continue;
                    const int rb = mi ? rb1 : rb0;
#pragma unroll
                    for (int reg = 0; reg < 4; ++reg) {
                        // a[mi][reg]: row rb + g + 8 (reg & 1), columns kc[2 (reg >> 1)] and the next.
                        const int hf = reg & 1, e0 = 2 * (reg >> 1);
                        const float2 v = *reinterpret_cast<const float2*>(&st.a.scores[rb + g + 8 * hf][jh + kc[e0]]);
                        float f0, f1;
                        if (M == DECAY_SPLIT) {
                            f0 = ex2_approx(R - cj[e0]) * dj[e0];
                            f1 = ex2_approx(R - cj[e0 + 1]) * dj[e0 + 1];
                        } else if (M == DECAY_MASK) {
                            // As below with every seq equal: the mask alone (the same bits).
                            const int lm = lim + rb + 8 * hf;
                            const float arg0 = kc[e0] <= lm ? csl[mi][hf] - cj[e0] : NEG_INF_F;
                            const float arg1 = kc[e0 + 1] <= lm ? csl[mi][hf] - cj[e0 + 1] : NEG_INF_F;
                            f0 = ex2_approx(arg0) * dj[e0];
                            f1 = ex2_approx(arg1) * dj[e0 + 1];
                        } else {
                            const int lm = lim + rb + 8 * hf;
                            const int s0 = seq_j[kc[e0]], s1 = seq_j[kc[e0 + 1]];
                            const float arg0 = (kc[e0] <= lm && s0 == sq[mi][hf]) ? csl[mi][hf] - cj[e0] : NEG_INF_F;
                            const float arg1 = (kc[e0 + 1] <= lm && s1 == sq[mi][hf]) ? csl[mi][hf] - cj[e0 + 1] : NEG_INF_F;
                            f0 = ex2_approx(arg0) * dj[e0];
                            f1 = ex2_approx(arg1) * dj[e0 + 1];
                        }
                        a[mi][reg] = pack_bf16x2(v.x * f0, v.y * f1);
                    }
                }
                load_b_kmajor_bf16(bf, x_s, COH_X, kk, wn * 64, lane);
#pragma unroll
                for (int mi = 0; mi < 2; ++mi) {
                    if (mi == 0 && !act0) continue;
#pragma unroll
                    for (int nf = 0; nf < 8; ++nf) mma_bf16(acc[mi][nf], a[mi], bf[nf]);
                }
            }
        };
        if (colf)
            half_step(DECAY_SPLIT);
        else if (!has_seq)
            half_step(DECAY_MASK);
        else
            half_step(DECAY_SEQ);
    }

    // Epilogue: z gate, store bf16 pairs (the D term is in already).
    if (!rows_mma) return;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int r = (mi ? rb1 : rb0) + g + 8 * hf;
            if (r >= rows_i) continue;
            const i64 row_off = ((i64)b * p.seqlen + t0 + i0 + r) * tok_stride_x + (i64)h * p.headdim + p0;
#pragma unroll
            for (int nf = 0; nf < 8; ++nf) {
                const int col = nf * 8 + 2 * q;
                if (col >= cols_p) continue;
                float y0 = acc[mi][nf][2 * hf], y1 = acc[mi][nf][2 * hf + 1];
                if (p.z != nullptr) {
                    const unsigned zv = *reinterpret_cast<const unsigned*>(p.z + row_off + col);
                    const float z0 = bf16_lo(zv), z1 = bf16_hi(zv);
                    y0 = y0 * z0 / (1.0f + expf(-z0));
                    y1 = y1 * z1 / (1.0f + expf(-z1));
                }
                *reinterpret_cast<unsigned*>(p.out + row_off + col) = pack_bf16x2(y0, y1);
            }
        }
}
SSD_LAYOUT_FIXED(ssd_compute_out_pair_bf16, ComputeOutPairBf16Params, sizeof(ComputeOutPairBf16Smem));
