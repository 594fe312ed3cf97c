// Stage 2, each state kept in registers while its block walks the chunks in order (where the
// host's configuration asks for it, see docs/gpu.md, "The walking stage 2"): ssd_state_walk_1,
// _2 and _5 (f32 x and B, TF32 products) and ssd_state_walk_bf16_1, _2 and _5 (bf16), blocks of
// HB = 1, 2 or 5 units. A unit is a head h and 64
// of its headdim rows p (as in pair.cu); the HB units of a block are consecutive and in one
// group, so they share the B tile; dstate <= 128 (a unit's whole [64, dstate] state lives in
// its warpgroup's accumulators: warp w of the unit holds rows 32 ((w / 2) % 2) and columns
// 64 (w % 2); in bf16 in the standard fragment order, row 16 mi + g + 8 hf of its 32, in f32
// in 2a's order, row 4 g + 2 mi + hf, local.cu).
// Block (b, ub) holds units ub HB .. ub HB + HB - 1 of batch b, warpgroup j unit ub HB + j.
// With S_0 the initial state (or 0), for each chunk c in order, last its last real token:
//   chunk_states[b, c, h] = S_c (when given), states_lo[b, c, h] = bf16(S_c) (to nearest even),
//   S_{c+1} = sum_l bf16(x[l, p] w[l]) B[l, n]  accumulated onto  scale_c S_c,
//   w[l] = exp(cs[last] - cs[l]) dt'[l] (0 where seq(l) differs from seq(last)),
//   scale_c = exp(cs[last]) if seq(last) equals the seq_idx of the token before the chunk (0
//   before chunk 0), else 0;
// final_states[b, h] = S_nchunks. The products are those of the pair kernels: in bf16 (bf16.cu)
// the A fragments (x^T) through ldmatrix.trans from the x tile ([l][p]), scaled by w in f32 and
// rounded to bf16 once per term, the B fragments through ldmatrix.trans, mma.m16n8k16; in f32
// (pair.cu) 2a's k step (state_kstep: x through 16-byte loads, scaled by w, raw f32 operands
// that the tensor cores truncate to TF32), mma.m16n8k8; f32 accumulation in both. In f32 there
// is no bf16 copy and chunk_states is always written (the f32 output kernel reads it). The difference from 2a + 2b (and the chained kernel): the chunk's products
// accumulate onto scale_c S_c instead of onto zero and then fma(scale_c, S_c, L_c), so the bits
// differ from theirs (the f32 sum has one more term; the error model's count of f32 additions
// is unchanged in order).
// Nothing crosses memory between chunks: no chunk waits on another block, and a block streams
// its x and B tiles through one ring of cp.async stages across chunk boundaries (64 tokens a
// stage in bf16, 32 in f32, three in flight), so the next chunk's copies fly while this one's
// products run. The
// parallelism is the units alone (batch x nheads x headdim / 64): the host takes this kernel
// where they fill the device.
// Row strides (elements): a unit's x tile 72 (bf16: 144-byte rows, ldmatrix without
// conflicts; f32: 8 mod 32 words, state_kstep's 16-byte loads without conflicts), the B tile
// 136 (272 or 544 bytes). Tokens per stage: 64 in bf16, 32 in f32 (the same bytes).
//
// bf16 on Hopper (sm_90a; WALK_WG=0 among the NVRTC options keeps the form above there, for
// A/B runs) runs the products on warpgroup products instead (WG): per 16 tokens the warp's A
// fragment (its 16 rows p of the unit, 16 w .. 16 w + 15 for warp w of the warpgroup) comes as
// above (ldmatrix.trans, scaled by w, rounded to bf16 once per term), and the warpgroup issues
// two wgmma m64n64k16 (dstate halves), A from registers, B N-major from shared memory, onto
// its accumulators: warp w holds rows 16 w + g + 8 hf and columns 64 half + 8 nf + 2 q (the
// wgmma accumulator layout). The B stage is then two 64 x 64 tiles [dstate half][token][64],
// unpadded 128-byte rows with the 128-byte swizzle (async_rows_bf16_swz64; each tile
// 1024-byte aligned, the block's base aligned up to 1024 at run time, the layout adds the
// slack). A stage's products are committed after it and waited for before the barrier that
// lets its slot be refilled, and before the accumulators are read. Same operands, same
// roundings; f32 sums in another order.
// WALK_PIPE=1 keeps a stage's products in flight through the next stage's scaling: after
// issuing stage s's products a warpgroup waits only for stage s - 1's, then a block barrier,
// then the copies of stage s + 2 into the slot stage s - 1 read (its A fragments then live
// across two stages). Versions 63 and 64, A from shared memory too, were timed and removed
// (docs/perf-history.md).
// The ring has two slots in ssd_state_walk_bf16_1 (one stage in flight while one is used;
// three with PIPE) and three in the other kernels (two in flight): a one-unit bf16 block takes
// about 56 KB instead of 83, so that three of them fit an SM. WALK_MINB1 is the blocks of
// ssd_state_walk_bf16_1 an SM must hold (its __launch_bounds__): 3 by default (168 registers
// at most), for fewer waves (version 65, docs/perf-history.md); 4 caps it at 128; 2 (the default
// with PIPE) leaves it 194 as in version 62. WALK_NST=2 or 3 among the NVRTC options sets every
// kernel's ring.
#define WALK_XS 72
#define WALK_BS 136
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && (!defined(WALK_WG) || WALK_WG != 0)
#define WALK_WG_ON 1
#else
#define WALK_WG_ON 0
#endif
#ifndef WALK_PIPE
#define WALK_PIPE 0  // 1: the warpgroup products in flight across stages
#endif
#ifndef WALK_MINB1
#define WALK_MINB1 (WALK_PIPE ? 2 : 3)  // blocks of ssd_state_walk_bf16_1 one SM must hold
#endif
#ifdef WALK_NST
static_assert(WALK_NST == 2 || WALK_NST == 3, "two or three ring slots");
#endif
static_assert(WALK_MINB1 >= 2 && WALK_MINB1 <= 4, "two to four one-unit blocks per SM");
template <typename X>
struct WalkTokens {
    static constexpr int TK = sizeof(X) == 2 ? 64 : 32;
    static constexpr bool WG = sizeof(X) == 2 && WALK_WG_ON;  // the warpgroup products
    static constexpr bool PIPE = WG && WALK_PIPE;             // products in flight across stages
};
// Ring slots: 3 (two stages in flight while one is used) or 2 (one).
template <typename X, int HB>
struct WalkRing {
#ifdef WALK_NST
    static constexpr int NST = WALK_NST;
#else
    static constexpr int NST = (sizeof(X) == 2 && HB == 1 && !WalkTokens<X>::PIPE) ? 2 : 3;
#endif
};
template <typename X, int HB>
struct StateWalkSmem {
    static constexpr int TK = WalkTokens<X>::TK;
    static constexpr bool WG = WalkTokens<X>::WG;
    static constexpr bool PIPE = WalkTokens<X>::PIPE;
    static constexpr int NST = WalkRing<X, HB>::NST;
    struct Stage {
        // B: [1][token][WALK_BS], or with WG [dstate half][token][64] swizzled
        alignas(WG ? 1024 : 16) X b[WG ? 2 : 1][TK][WG ? 64 : WALK_BS];
        X x[HB][TK][WALK_XS];  // unit j's 64 columns
        float cs[HB][TK], dt[HB][TK];
        int seq[TK];
    } stage[NST];
    float w[4 * HB][TK];          // each warp's w of the current stage
    const void* base[HB][4];      // each unit's x, B, dA_cumsum and dt' rows (read by the copies
                                  // instead of held in registers across the chunk loop)
};
// The dynamic shared memory a block takes: the layout, and with WG the alignment slack.
template <typename X, int HB>
struct WalkSmemBytes {
    static constexpr unsigned value = sizeof(StateWalkSmem<X, HB>) + (WalkTokens<X>::WG ? 1024 : 0);
};
#define WALK_CHECK(X, HB, PER_SM, WHAT)                                                               \
    static_assert(sizeof(StateWalkSmem<X, HB>::Stage) % 16 == 0, "16-byte aligned stages");          \
    static_assert((PER_SM) * (WalkSmemBytes<X, HB>::value + 1024) <= 228 * 1024, WHAT)
WALK_CHECK(bf16_t, 1, WALK_MINB1, "WALK_MINB1 blocks of one unit per Hopper SM");
WALK_CHECK(bf16_t, 2, 2, "two blocks of two units per Hopper SM");
WALK_CHECK(bf16_t, 5, 1, "one block of five units per Hopper SM");
WALK_CHECK(float, 1, 2, "two blocks of one unit per Hopper SM");
WALK_CHECK(float, 2, 2, "two blocks of two units per Hopper SM");
WALK_CHECK(float, 5, 1, "one block of five units per Hopper SM");

// The parameters: the chained kernels' struct (chained.cu, StateChainedParamsT<X>); `chain`
// is not read, nor `states_lo` in f32.

// The segmented walk (ssd_state_walk_seg_1 and ssd_state_walk_seg_bf16_1, SEG): for rows whose
// units are too few to fill the device (batch x nheads x headdim / 64 x dstate / 128 of them,
// each a block of one unit as above, its 128 dstate columns n0 = 128 nt .. of the state), each
// unit's chunks are cut into nseg segments of seg_chunks (the last may be shorter), every
// segment walked by its own block (grid (units x ntiles, segments, batch)), in three launches:
//   phase 0: segment k < nseg - 1 walked from zero, nothing written per chunk, its end state
//            E_k = sum over its chunks c of (prod over its later chunks c' of scale_c') L_c
//            written to chunk_states at the chunk after it, (k + 1) seg_chunks;
//   ssd_state_walk_seg_combine: per state element, S = S_0, then for k = 0 .. nseg - 2:
//            S = (prod over segment k's chunks of scale_c) S + E_k, written over E_k (chunk
//            (k + 1) seg_chunks now holds its true S_c);
//   phase 1: segment k walked from S at its first chunk (S_0 for k = 0), as the walk above: every
//            chunk's S_c (chunk_states where `keep`, the bf16 copy in bf16), final_states by
//            the last segment.
// chunk_states is the scratch of phase 0 and of the combination even where the outputs do not
// keep it (the pass 2b does the same). No seq_idx (the host keeps such rows off it), so scale_c =
// exp(cs[last]) for every chunk. The bits differ from the one-block walk's by the order of the
// f32 sums at the segment boundaries (one more addition there) and by the segment's decay, taken
// as one exponential of its chunks' summed log decays before it meets the state.
struct StateWalkSegFields {
    int seg_chunks;  // chunks per segment
    int nseg;        // segments per unit (the last holds the remaining chunks)
    int phase;       // 0 or 1 (the walking kernels); the combination reads neither
    int keep;        // phase 1 writes chunk_states for every chunk (else only the bf16 copy)
};
template <typename X>
struct StateWalkSegParamsT {
    StateChainedParamsT<X> c;  // chunk_states is never null here (the scratch)
    StateWalkSegFields sg;
};
typedef StateWalkSegParamsT<float> StateWalkSegParams;
typedef StateWalkSegParamsT<bf16_t> StateWalkSegBf16Params;
static_assert(sizeof(StateWalkSegParams) == 128 && sizeof(StateWalkSegBf16Params) == 128,
              "StateWalkSegParams: the Rust struct has 128 bytes");

// Row p (within the unit's 64) of accumulator element acc[i][nf][2 hf + e] of warp w of the
// warpgroup, lane (g, q): with WG rows 16 w + g + 8 hf; else warp w holds rows 32 ((w / 2) % 2)
// and columns 64 (w % 2), bf16 in the standard fragment order, f32 in 2a's (state_kstep).
template <typename X>
__device__ __forceinline__ int walk_row(int w, int g, int i, int hf) {
    if (WalkTokens<X>::WG) return 16 * w + g + 8 * hf;
    return 32 * ((w >> 1) & 1) + (sizeof(X) == 2 ? 16 * i + g + 8 * hf : 4 * g + 2 * i + hf);
}
// Its column n (and n + 1): with WG 64 i + 8 nf + 2 q, else 64 (w % 2) + 8 nf + 2 q.
template <typename X>
__device__ __forceinline__ int walk_col(int w, int q, int i, int nf) {
    return 64 * (WalkTokens<X>::WG ? i : w & 1) + 8 * nf + 2 * q;
}

// With WG: waits for the warpgroup's committed products (then its accumulators may be read and
// the stage they read refilled); nothing without.
template <bool WG>
__device__ __forceinline__ void walk_products_done(float (&acc)[2][8][4]) {
#if WALK_WG_ON
    if (WG) {
        wgmma_wait<0>();
        wgmma_hold(acc[0]);
        wgmma_hold(acc[1]);
    }
#endif
}

// With WG: waits for the warpgroup's committed products but the last group (their
// accumulators are not read here).
template <bool WG>
__device__ __forceinline__ void walk_products_but_last() {
#if WALK_WG_ON
    if (WG) wgmma_wait<1>();
#endif
}

// With WG, after this thread's copies of a stage have landed: the products read shared memory
// through the async proxy, the copies wrote it through the generic one.
template <bool WG>
__device__ __forceinline__ void walk_stage_landed() {
#if WALK_WG_ON
    if (WG) fence_proxy_async_smem();
#endif
}

// With WG, one stage's products (64 tokens), issued and committed: a_s the shared address of
// this lane's ldmatrix.trans row in the unit's x tile, b_s the stage's B tiles, ws the warp's w.
__device__ __forceinline__ void walk_products_wg(float (&acc)[2][8][4], unsigned a_s, unsigned b_s, const float* ws,
                                                 int q) {
#if WALK_WG_ON
    unsigned a[4][4];
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
        const int kk = 16 * ks;
        const float w0 = ws[kk + 2 * q], w1 = ws[kk + 2 * q + 1];
        const float w8 = ws[kk + 2 * q + 8], w9 = ws[kk + 2 * q + 9];
        ldmatrix_x4_trans(a[ks], a_s + (unsigned)(kk * WALK_XS) * 2u);
        scale_a_tokens_bf16(a[ks], w0, w1, w8, w9);
    }
    wgmma_hold(acc[0]);
    wgmma_hold(acc[1]);
    wgmma_fence();
    const unsigned long long db = wgmma_desc_nmajor_sw128(b_s);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
#pragma unroll
        for (int half = 0; half < 2; ++half)
            wgmma_bf16_rs_nmajor(acc[half], a[ks], db + ((8192u * half + 2048u * ks) >> 4));
    wgmma_commit();
#endif
}

// SEG: the segmented walk's phase sg.phase (HB = 1); without, sg is not read.
template <typename X, int HB, bool SEG = false>
__device__ __forceinline__ void state_walk_body(const StateChainedParamsT<X>& p,
                                                const StateWalkSegFields sg = StateWalkSegFields{}) {
    static_assert(!SEG || HB == 1, "the segmented walk: one unit a block");
    SSD_DYNAMIC_SMEM(smem_raw);
    typedef StateWalkSmem<X, HB> Smem;
    constexpr bool BF16 = sizeof(X) == 2;
    constexpr bool WG = Smem::WG;
    char* smem_base = reinterpret_cast<char*>(smem_raw);
    if (WG) {  // the swizzled tiles need 1024-byte alignment
        const unsigned raw = smem_addr(smem_raw);
        smem_base += ((raw + 1023u) & ~1023u) - raw;
    }
    Smem& sm = *reinterpret_cast<Smem*>(smem_base);
    constexpr int TK = Smem::TK;
    const int tid = threadIdx.x, tl = tid & 127;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int j = warp >> 2, w4 = warp & 3, wm = (warp >> 1) & 1, wn = warp & 1;
    const int ptiles = (p.headdim + 63) / 64;
    const int Q = p.chunk_size, nc = p.nchunks;
    // The block's unit and its part of the row: without SEG, units ub HB .. of batch b, every
    // chunk, all of dstate (at most 128); with SEG, block (x, y, z) = (ub ntiles + nt, segment
    // k, batch b), ub = h ptiles + p tile (a segment's units side by side: they share B), dstate
    // columns n0 = 128 nt .., chunks c0 .. c1 - 1 of segment k. The unit is ub HB + j in both
    // (j = 0 here): written as ub alone, ptxas 12.9 serialises the bf16 kernel's wgmma (its
    // "Potential Performance Loss" note).
    int b, unit, grp, n0 = 0, c0 = 0, c1 = nc, seg = 0;
    if constexpr (SEG) {
        const int wide = p.dstate > 128;  // two 128-column units a row
        b = blockIdx.z;
        seg = blockIdx.y;
        n0 = wide ? 128 * (blockIdx.x & 1) : 0;
        const int ub = blockIdx.x >> wide;
        unit = ub * HB + j;
        grp = (ub * HB / ptiles) / (p.nheads / p.ngroups);
        c0 = seg * sg.seg_chunks;
        c1 = min(nc, c0 + sg.seg_chunks);
    } else {
        const int nub = p.nheads * ptiles / HB;  // blocks per batch row
        b = blockIdx.x / nub;
        const int ub = blockIdx.x % nub;
        unit = ub * HB + j;
        grp = (ub * HB / ptiles) / (p.nheads / p.ngroups);
    }
    const int h = unit / ptiles, p0 = (unit % ptiles) * 64;
    const int rows_p = min(64, p.headdim - p0), cols_n = min(128, p.dstate - n0);
    const i64 bh = (i64)b * p.nheads + h;
    const i64 n_state = (i64)p.headdim * p.dstate;
    const unsigned tok_x = (unsigned)(p.nheads * p.headdim), tok_b = (unsigned)(p.ngroups * p.dstate);
    const float* cs_u = p.dA_cumsum + bh * nc * Q;
    if (tl == 0) {
        sm.base[j][0] = p.x + (i64)b * p.seqlen * tok_x + (i64)h * p.headdim + p0;
        sm.base[j][1] = p.Bm + (i64)b * p.seqlen * tok_b + (i64)grp * p.dstate + n0;
        sm.base[j][2] = cs_u;
        sm.base[j][3] = p.dt_out + bh * nc * Q;
    }
    const int* seq_row = p.seq_idx != nullptr ? p.seq_idx + (i64)b * p.seqlen : nullptr;
    const int nsq = (Q + TK - 1) / TK;  // stages of a whole chunk
    const int len_last = p.seqlen - (nc - 1) * Q;
    // Stages of chunks c0 .. c1 - 1 (the row's last chunk may be short).
    const int total = (c1 - 1 - c0) * nsq + (c1 == nc ? (len_last + TK - 1) / TK : nsq);

    auto issue = [&](int s) {
        typename Smem::Stage& st = sm.stage[s % Smem::NST];
        const int tl = tid_fresh() & 127;  // the copy offsets recomputed here, not held across the loop
        const X* x_u = static_cast<const X*>(sm.base[j][0]);
        const X* b_g = static_cast<const X*>(sm.base[j][1]);
        const float* cs_b = static_cast<const float*>(sm.base[j][2]);
        const float* dt_u = static_cast<const float*>(sm.base[j][3]);
        const int c = c0 + s / nsq, k0 = (s % nsq) * TK;
        const int t = c * Q + k0;  // the stage's first token in the row
        const int rows_t = min(TK, min(Q, p.seqlen - c * Q) - k0);
        // x is read once: L2 priority evict_first (chained.cu says why); B keeps the normal
        // priority, the group's other blocks read the same tile.
        if constexpr (BF16) {
            async_rows_bf16<TK, 64, 128, true>(&st.x[j][0][0], WALK_XS, x_u + (i64)t * tok_x, tok_x, rows_t, rows_p, tl);
            if (WG) {
                // The two dstate halves: both by the one unit, or one each by units 0 and 1.
#pragma unroll
                for (int half = 0; half < 2; ++half)
                    if (HB == 1 || half == j)
                        async_rows_bf16_swz64<TK, 128>(&st.b[half][0][0], b_g + (i64)t * tok_b + 64 * half, tok_b,
                                                      rows_t, cols_n - 64 * half, tl);
            } else if (HB == 1) {
                async_rows_bf16<TK, 128, 128>(&st.b[0][0][0], WALK_BS, b_g + (i64)t * tok_b, tok_b, rows_t, cols_n, tl);
            } else if (j < 2) {
                async_rows_bf16<TK / 2, 128, 128>(&st.b[0][j * (TK / 2)][0], WALK_BS,
                                                  b_g + (i64)(t + j * (TK / 2)) * tok_b, tok_b, rows_t - j * (TK / 2),
                                                  cols_n, tl);
            }
        } else {
            async_rows<TK, 64, 128, true>(&st.x[j][0][0], WALK_XS, x_u + (i64)t * tok_x, tok_x, rows_t, rows_p, tl);
            if (HB == 1) {
                async_rows<TK, 128, 128>(&st.b[0][0][0], WALK_BS, b_g + (i64)t * tok_b, tok_b, rows_t, cols_n, tl);
            } else if (j < 2) {
                async_rows<TK / 2, 128, 128>(&st.b[0][j * (TK / 2)][0], WALK_BS, b_g + (i64)(t + j * (TK / 2)) * tok_b,
                                             tok_b, rows_t - j * (TK / 2), cols_n, tl);
            }
        }
        const int l = tl & (TK - 1);
        const bool ok = l < rows_t;
        const i64 at = (i64)c * Q + k0 + l;
        if (tl < TK)
            cp_async4(&st.cs[j][l], cs_b + at, ok, p.dA_cumsum);
        else if (tl < 2 * TK)
            cp_async4(&st.dt[j][l], dt_u + at, ok, p.dt_out);
        if (seq_row != nullptr && j == 0 && tl < TK) cp_async4(&st.seq[l], seq_row + t + l, ok, p.seq_idx);
    };

    // The state of this thread's part of its unit: S_0 (SEG: zero in phase 0; in phase 1 S_0
    // for the first segment, else the combination's S_c0 in chunk_states).
    float acc[2][8][4];
    const float* init = p.initial_states != nullptr ? p.initial_states + bh * n_state : nullptr;
    if (SEG && sg.phase == 0) init = nullptr;
    if (SEG && sg.phase == 1 && seg > 0) init = p.chunk_states + (((i64)b * nc + c0) * p.nheads + h) * n_state;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int pr = walk_row<X>(w4, g, mi, hf);
#pragma unroll
            for (int nf = 0; nf < 8; ++nf) {
                const int ncol = walk_col<X>(w4, q, mi, nf);
                float2 v = make_float2(0.0f, 0.0f);
                if (init != nullptr && pr < rows_p && ncol < cols_n)
                    v = *reinterpret_cast<const float2*>(init + (i64)(p0 + pr) * p.dstate + n0 + ncol);
                acc[mi][nf][2 * hf] = v.x;
                acc[mi][nf][2 * hf + 1] = v.y;
            }
        }
    // Chunk c's last token and the seq_idx values its scale compares, loaded one chunk ahead.
    auto chunk_last = [&](int c) { return min(Q, p.seqlen - c * Q) - 1; };
    float cs_next = cs_u[(i64)c0 * Q + chunk_last(c0)];
    int seq_next = seq_row != nullptr ? seq_row[c0 * Q + chunk_last(c0)] : 0, seq_prev_next = 0;

    // bf16: ldmatrix.trans rows of this lane for the A fragments: token kk + 8 ((lane >> 4) & 1)
    // + (lane & 7), column (p) wm 32 + 16 mi + 8 ((lane >> 3) & 1) of the unit's tile (with WG
    // 16 w4 + 8 ((lane >> 3) & 1)).
    const int a_off =
        (((lane >> 4) & 1) * 8 + (lane & 7)) * WALK_XS + (WG ? 16 * w4 : wm * 32) + ((lane >> 3) & 1) * 8;
    float* ws = sm.w[warp];
    float csl_last = 0.0f;
    int seq_last = 0;

    __syncthreads();  // the base addresses
    constexpr int AHEAD = Smem::NST - 1;  // stages in flight while one is used
    static_assert(AHEAD == 2 || !Smem::PIPE, "products in flight across stages need three slots");
    if (AHEAD == 2) {
        issue(0);
        cp_async_commit();
        if (total > 1) issue(1);
    } else if (total > 0) {  // always; ptxas allocates registers better at 168 with the test
        issue(0);
    }
    cp_async_commit();
    int s = 0;  // the stage, counted across chunks
    for (int c = c0; c < c1; ++c) {
        {
            // Chunk c begins: S_c goes out, then the state decays over the chunk.
            walk_products_done<WG>(acc);
            const float cs_last = cs_next;
            seq_last = seq_next;
            const int seq_prev = seq_prev_next;
            if (c + 1 < c1) {
                const int last_n = chunk_last(c + 1);
                cs_next = cs_u[(i64)(c + 1) * Q + last_n];
                if (seq_row != nullptr) {
                    seq_next = seq_row[(c + 1) * Q + last_n];
                    seq_prev_next = seq_row[(c + 1) * Q - 1];
                }
            }
            // The thread's offsets recomputed from a fresh thread index: hoisted out of the chunk
            // loop, the 32 addresses and their bounds checks would be held in registers across
            // it and spill (ptxas: 416 bytes a thread at 128 registers).
            const int tf = tid_fresh(), gf = (tf & 31) >> 2, qf = tf & 3, wf = (tf >> 5) & 3;
            const i64 at_c = (((i64)b * nc + c) * p.nheads + h) * n_state;
            bf16_t* lo = BF16 ? p.states_lo + at_c : nullptr;
            float* st32 = p.chunk_states != nullptr ? p.chunk_states + at_c : nullptr;
            // SEG phase 0 writes nothing per chunk; phase 1 the f32 states where `keep`.
            const bool out_c = !(SEG && sg.phase == 0);
            if (SEG && !(out_c && sg.keep)) st32 = nullptr;
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int pr = walk_row<X>(wf, gf, mi, hf);
                    if (pr >= rows_p) continue;
                    const i64 row = (i64)(p0 + pr) * p.dstate + n0;
#pragma unroll
                    for (int nf = 0; nf < 8; ++nf) {
                        const int ncol = walk_col<X>(wf, qf, mi, nf);
                        if (ncol >= cols_n) continue;
                        const float v0 = acc[mi][nf][2 * hf], v1 = acc[mi][nf][2 * hf + 1];
                        if (BF16 && out_c) *reinterpret_cast<unsigned*>(lo + row + ncol) = pack_bf16x2(v0, v1);
                        if (st32 != nullptr) *reinterpret_cast<float2*>(st32 + row + ncol) = make_float2(v0, v1);
                    }
                }
            const float scale = seq_last == seq_prev ? expf(cs_last) : 0.0f;
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int nf = 0; nf < 8; ++nf)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[mi][nf][e] *= scale;
            csl_last = cs_last * LOG2E_F;
        }
        const int nst_c = c + 1 < nc ? nsq : (len_last + TK - 1) / TK;  // (c1 <= nc)
        for (int k = 0; k < nst_c; ++k, ++s) {
            cp_async_wait<AHEAD - 1>();  // this thread's copies of stage s have landed (three slots: s + 1's may fly)
            if constexpr (!Smem::PIPE) walk_products_done<WG>(acc);  // stage s - 1's products have read their slot
            walk_stage_landed<WG>();      // the copies made visible to the products' reads
            __syncthreads();     // everyone's have, and everyone is done with stage s - 1 (PIPE: below)
            if constexpr (!Smem::PIPE) {
                if (s + AHEAD < total) issue(s + AHEAD);
                cp_async_commit();
            }
            const typename Smem::Stage& st = sm.stage[s % Smem::NST];
            const int rows_t = min(TK, min(Q, p.seqlen - c * Q) - k * TK);
    #pragma unroll
            for (int e = 0; e < TK; e += 32) {
                const int l = e + lane;
                const bool same = seq_row == nullptr || st.seq[l] == seq_last;
                ws[l] = (l < rows_t && same) ? ex2_approx(csl_last - st.cs[j][l] * LOG2E_F) * st.dt[j][l] : 0.0f;
            }
            __syncwarp();
            if constexpr (WG) {
                walk_products_wg(acc, smem_addr(&st.x[j][0][0]) + (unsigned)a_off * 2u, smem_addr(&st.b[0][0][0]), ws, q);
                if constexpr (Smem::PIPE) {
                    // Stage s's products fly while the block makes sure of stage s - 1's (they
                    // read the slot the next copies fill), then the copies of stage s + 2.
                    walk_products_but_last<WG>();
                    __syncthreads();
                    if (s + AHEAD < total) issue(s + AHEAD);
                    cp_async_commit();
                }
            } else if constexpr (BF16) {
                const unsigned x_s = smem_addr(&st.x[j][0][0]), b_s = smem_addr(&st.b[0][0][0]);
    #pragma unroll
                for (int kk = 0; kk < TK; kk += 16) {
                    const float w0 = ws[kk + 2 * q], w1 = ws[kk + 2 * q + 1];
                    const float w8 = ws[kk + 2 * q + 8], w9 = ws[kk + 2 * q + 9];
                    unsigned a[2][4];
    #pragma unroll
                    for (int mi = 0; mi < 2; ++mi) {
                        ldmatrix_x4_trans(a[mi], x_s + (unsigned)(kk * WALK_XS + a_off + mi * 16) * 2u);
                        scale_a_tokens_bf16(a[mi], w0, w1, w8, w9);
                    }
                    // B's fragments in two halves of 32 columns (fewer live registers).
    #pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        unsigned bf[4][2];
                        load_b_kmajor_bf16(bf, b_s, WALK_BS, kk, wn * 64 + half * 32, lane);
    #pragma unroll
                        for (int mi = 0; mi < 2; ++mi)
    #pragma unroll
                            for (int nf = 0; nf < 4; ++nf) mma_bf16(acc[mi][half * 4 + nf], a[mi], bf[nf]);
                    }
                }
            } else {
                // 2a's k step: A[p][l] = x[l][p] w[l], 4 rows per 16-byte load; B[l][n] 4 bytes.
                const float* xa = reinterpret_cast<const float*>(&st.x[j][0][0]) + wm * 32 + 4 * g;
                const float* bb = reinterpret_cast<const float*>(&st.b[0][0][0]) + wn * 64 + g;
    #pragma unroll
                for (int kk = 0; kk < TK; kk += 8) state_kstep<8>(acc, xa, WALK_XS, bb, WALK_BS, ws, kk, q);
            }
        }
    }
    // S_nchunks (SEG: phase 0 its segment's end state E into the next chunk's chunk_states;
    // phase 1 the last segment's alone).
    walk_products_done<WG>(acc);
    float* fin = p.final_states + bh * n_state;
    if (SEG && sg.phase == 0) fin = p.chunk_states + (((i64)b * nc + c1) * p.nheads + h) * n_state;
    const bool fin_out = !(SEG && sg.phase == 1 && c1 < nc);
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int pr = walk_row<X>(w4, g, mi, hf);
            if (pr >= rows_p) continue;
#pragma unroll
            for (int nf = 0; nf < 8; ++nf) {
                const int ncol = walk_col<X>(w4, q, mi, nf);
                if (ncol < cols_n && fin_out)
                    *reinterpret_cast<float2*>(fin + (i64)(p0 + pr) * p.dstate + n0 + ncol) =
                        make_float2(acc[mi][nf][2 * hf], acc[mi][nf][2 * hf + 1]);
            }
        }
}

extern "C" __global__ void __launch_bounds__(128, 2) ssd_state_walk_1(const StateChainedParams p) { state_walk_body<float, 1>(p); }
SSD_LAYOUT_FIXED(ssd_state_walk_1, StateChainedParams, (WalkSmemBytes<float, 1>::value));
extern "C" __global__ void __launch_bounds__(256, 2) ssd_state_walk_2(const StateChainedParams p) { state_walk_body<float, 2>(p); }
SSD_LAYOUT_FIXED(ssd_state_walk_2, StateChainedParams, (WalkSmemBytes<float, 2>::value));
extern "C" __global__ void __launch_bounds__(640, 1) ssd_state_walk_5(const StateChainedParams p) { state_walk_body<float, 5>(p); }
SSD_LAYOUT_FIXED(ssd_state_walk_5, StateChainedParams, (WalkSmemBytes<float, 5>::value));
extern "C" __global__ void __launch_bounds__(128, WALK_MINB1) ssd_state_walk_bf16_1(const StateChainedBf16Params p) { state_walk_body<bf16_t, 1>(p); }
SSD_LAYOUT_FIXED(ssd_state_walk_bf16_1, StateChainedBf16Params, (WalkSmemBytes<bf16_t, 1>::value));
extern "C" __global__ void __launch_bounds__(256, 2) ssd_state_walk_bf16_2(const StateChainedBf16Params p) { state_walk_body<bf16_t, 2>(p); }
SSD_LAYOUT_FIXED(ssd_state_walk_bf16_2, StateChainedBf16Params, (WalkSmemBytes<bf16_t, 2>::value));
extern "C" __global__ void __launch_bounds__(640, 1) ssd_state_walk_bf16_5(const StateChainedBf16Params p) { state_walk_body<bf16_t, 5>(p); }
SSD_LAYOUT_FIXED(ssd_state_walk_bf16_5, StateChainedBf16Params, (WalkSmemBytes<bf16_t, 5>::value));

// The segmented walk (above): its two phases, and the combination between them.
extern "C" __global__ void __launch_bounds__(128, 2) ssd_state_walk_seg_1(const StateWalkSegParams p) {
    state_walk_body<float, 1, true>(p.c, p.sg);
}
SSD_LAYOUT_FIXED(ssd_state_walk_seg_1, StateWalkSegParams, (WalkSmemBytes<float, 1>::value));
extern "C" __global__ void __launch_bounds__(128, WALK_MINB1) ssd_state_walk_seg_bf16_1(const StateWalkSegBf16Params p) {
    state_walk_body<bf16_t, 1, true>(p.c, p.sg);
}
SSD_LAYOUT_FIXED(ssd_state_walk_seg_bf16_1, StateWalkSegBf16Params, (WalkSmemBytes<bf16_t, 1>::value));

// One thread per pair of neighbouring state elements (dstate is even) of (b, h): S = S_0 (or
// 0), then segment by segment S = (prod_c scale_c) S + E_k, each written over E_k at the chunk
// after segment k. The product of the walk's scales exp(cs[last]) is taken as exp of their sum
// (f32, in chunk order): one exponential a segment instead of one a chunk (86 at (4, 65536, 8)).
// Blocks of 256 threads.
extern "C" __global__ void __launch_bounds__(256) ssd_state_walk_seg_combine(const StateWalkSegParams p) {
    const StateChainedParams& c = p.c;
    const i64 n_state = (i64)c.headdim * c.dstate;
    const i64 i = 2 * ((i64)blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= (i64)c.batch * c.nheads * n_state) return;
    const i64 bh = i / n_state, e = i - bh * n_state;
    const int b = (int)(bh / c.nheads), h = (int)(bh - (i64)b * c.nheads);
    const int Q = c.chunk_size, nc = c.nchunks;
    const float* cs_u = c.dA_cumsum + bh * nc * Q;
    float2 st = make_float2(0.0f, 0.0f);
    if (c.initial_states != nullptr) st = *reinterpret_cast<const float2*>(c.initial_states + bh * n_state + e);
    for (int k = 0; k + 1 < p.sg.nseg; ++k) {
        const int cb = k * p.sg.seg_chunks, ce = cb + p.sg.seg_chunks;  // ce < nc: not the last segment
        float lsum = 0.0f;  // the segment's log decay: its chunks' cs[last], summed in order
        for (int ch = cb; ch < ce; ++ch) lsum += cs_u[(i64)ch * Q + min(Q, c.seqlen - ch * Q) - 1];
        const float d = expf(lsum);
        float2* slot = reinterpret_cast<float2*>(c.chunk_states + (((i64)b * nc + ce) * c.nheads + h) * n_state + e);
        const float2 ek = *slot;
        st = make_float2(fmaf(d, st.x, ek.x), fmaf(d, st.y, ek.y));
        *slot = st;
    }
}
SSD_LAYOUT_FIXED(ssd_state_walk_seg_combine, StateWalkSegParams, 0);
