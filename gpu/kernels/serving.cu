// Packed sequences (serving, batch 1; docs/gpu.md): what the global chunk grid of stages 1-3 does
// not give by itself. Stage 2 takes each sequence's initial state into the chunk states
// (chunk_init in fwd_pass_state/passing.cu and fused.cu); these two kernels add the rest.
//
// With cs = dA_cumsum[0, h, c, :] of token t's chunk c, dt' = dt_out[0, h, c, :], g = h / (nheads /
// ngroups), and a sequence k holding tokens [s_k, e_k) of the row:
//
// ssd_seq_init_out: the initial state's share of `out` in the sequence's first chunk (later
// chunks get it through chunk_states). One block of 128 threads (4 warps) per (range r, head h,
// tile of 64 headdim rows p), walking the range 64 tokens at a time; range r = tokens [t0, t1)
// of one chunk, sequence k starting at t0 = s_k:
//   out[t, h, p] += gate(z[t, h, p]) * exp(cs[t] - cs[t0 - 1]) * sum_n C[t, g, n] * init_k[h, p, n]
// cs[t0 - 1] = 0 when t0 is the chunk's first token; gate(z) = z * sigmoid(z) when z is given,
// else 1; init_k = seq_init[k]. The sum over n is a TF32 product ([token, n] x [n, p], operands
// rounded to TF32, f32 accumulation), 64 columns of n staged in shared memory at a time.
//
// ssd_states_at: the state after token e of sequence k, for a list of targets (each sequence's
// last token: varlen_states; listed positions: position_states). One block of 128 threads per
// (target j, head h, 64 x 64 tile of [headdim, dstate]), stage 2's tile step
// (fwd_pass_state/fused.cu: state_tile_accumulate); with c = e's chunk, c0 its first token,
//   S = exp(cs[e]) * chunk_states[c, h]                    if s_k < c0 (k entered c carried)
//     = exp(cs[e] - cs[s_k - 1]) * init[i_k, h]            else, if k has an initial state
//     = 0                                                  else,
//   S += sum_{t = max(s_k, c0)}^{e} x[t, h, p] * (exp(cs[e] - cs[t]) * dt'[t] * B[t, g, n])
// as one TF32 product per 64 tokens onto the f32 accumulators. A target with e < 0 (an empty
// sequence) is its initial state, or 0.
// The parameters of ssd_seq_init_out (Rust: SeqInitOutParams).
struct SeqInitOutParams {
    const float* C;         // [1, seqlen, ngroups, dstate]
    const float* z;         // [1, seqlen, nheads, headdim] or null
    const float* dA_cumsum; // [1, nheads, nchunks, chunk_size]
    const float* seq_init;  // [nseq, nheads, headdim, dstate]
    const int* ranges;      // [nranges, 4]: (t0, t1, k, 0)
    float* out;             // [1, seqlen, nheads, headdim]
    int seqlen, nheads, headdim, ngroups, dstate, chunk_size, nchunks;
    int nranges;
};
static_assert(sizeof(SeqInitOutParams) == 80, "SeqInitOutParams: the Rust struct has 80 bytes");

// Shared memory of ssd_seq_init_out: 64 tokens' C columns [token][n] and the initial state's
// rows [p][n], 64 columns of n at a time (stage 2's tile shape and stride).
struct SeqInitOutSmem {
    float c[ST_TK * ST_STRIDE];
    float init[ST_TP * ST_STRIDE];
};
static_assert(ST_TK == 64 && ST_TP == 64 && ST_TN == 64, "64 x 64 tiles");
static_assert(sizeof(SeqInitOutSmem) <= 48 * 1024, "static shared memory");

extern "C" __global__ void __launch_bounds__(ST_THREADS) ssd_seq_init_out(const SeqInitOutParams p) {
    __shared__ __align__(16) SeqInitOutSmem sm;
    const int r = blockIdx.x, h = blockIdx.y, p0 = blockIdx.z * ST_TP;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int t0 = p.ranges[4 * r], t1 = p.ranges[4 * r + 1], k = p.ranges[4 * r + 2];
    const int N = p.dstate;
    const int rows_p = min(ST_TP, p.headdim - p0);
    const float* init = p.seq_init + (((i64)k * p.nheads + h) * p.headdim + p0) * N;
    const int c = t0 / p.chunk_size, c0 = c * p.chunk_size;
    const float* cs = p.dA_cumsum + ((i64)h * p.nchunks + c) * p.chunk_size;
    const float cs_pre = t0 > c0 ? cs[t0 - 1 - c0] : 0.0f;
    const int grp = h / (p.nheads / p.ngroups);
    const i64 tok_stride_c = (i64)p.ngroups * N;
    const StateFrag f{warp * 16 + g, q};  // rows: tokens, columns: p
    for (int tb = t0; tb < t1; tb += ST_TK) {
        const int nt = min(ST_TK, t1 - tb);
        float acc[8][4] = {};
        for (int n0 = 0; n0 < N; n0 += ST_TN) {
            const int cols = min(ST_TN, N - n0);
            __syncthreads();  // the previous step's tiles have been read
            load_block64_tf32<ST_TK, ST_THREADS, false>(sm.c, ST_STRIDE, p.C + (i64)tb * tok_stride_c + (i64)grp * N + n0,
                                                        tok_stride_c, nt, cols, nullptr, tid);
            load_block64_tf32<ST_TP, ST_THREADS, false>(sm.init, ST_STRIDE, init + n0, N, rows_p, cols, nullptr, tid);
            __syncthreads();
#pragma unroll
            for (int kk = 0; kk < ST_TN / 8; ++kk) {
                unsigned a[4];
                load_a_rowmajor(a, sm.c + warp * 16 * ST_STRIDE + kk * 8, ST_STRIDE, g, q);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    unsigned bf[2];
                    // B[n][p] = init[p][n]: sm.init holds [p][n].
                    load_b_nrows(bf, sm.init + j * 8 * ST_STRIDE + kk * 8, ST_STRIDE, g, q);
                    mma_tf32(acc[j], a, bf);
                }
            }
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int tr = f.row(e);
            if (tr >= nt) continue;
            const int t = tb + tr;
            const float decay = expf(cs[t - c0] - cs_pre);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int pr = f.col(j, e);
                if (pr >= rows_p) continue;
                const i64 o = ((i64)t * p.nheads + h) * p.headdim + p0 + pr;
                float v = decay * acc[j][e];
                if (p.z != nullptr) {
                    const float zz = p.z[o];
                    v = v * zz / (1.0f + expf(-zz));
                }
                p.out[o] += v;
            }
        }
    }
}
SSD_LAYOUT_FIXED(ssd_seq_init_out, SeqInitOutParams, 0);

// The parameters of ssd_states_at (Rust: StatesAtParams).
struct StatesAtParams {
    const float* x;             // [1, seqlen, nheads, headdim]
    const float* Bm;            // [1, seqlen, ngroups, dstate]
    const float* dt_out;        // [1, nheads, nchunks, chunk_size]
    const float* dA_cumsum;     // [1, nheads, nchunks, chunk_size]
    const float* chunk_states;  // [1, nchunks, nheads, headdim, dstate]
    const float* init;          // [ninit, nheads, headdim, dstate] or null
    const int* targets;         // [ntargets, 4]: (e or -1, s_k, i_k or -1, 0)
    float* states;              // [ntargets, nheads, headdim, dstate]
    int seqlen, nheads, headdim, ngroups, dstate, chunk_size, nchunks;
    int ntargets;
};
static_assert(sizeof(StatesAtParams) == 96, "StatesAtParams: the Rust struct has 96 bytes");

extern "C" __global__ void __launch_bounds__(ST_THREADS) ssd_states_at(const StatesAtParams p) {
    __shared__ __align__(16) float xs[ST_TK * ST_STRIDE];  // [token][p]
    __shared__ __align__(16) float bs[ST_TK * ST_STRIDE];  // [token][n], times the weight
    __shared__ float ws[ST_TK];
    const int j = blockIdx.x, h = blockIdx.y;
    const int ntn = (p.dstate + ST_TN - 1) / ST_TN;
    const int p0 = (blockIdx.z / ntn) * ST_TP, n0 = (blockIdx.z % ntn) * ST_TN;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int e = p.targets[4 * j], s = p.targets[4 * j + 1], ik = p.targets[4 * j + 2];
    const int N = p.dstate;
    const int rows_p = min(ST_TP, p.headdim - p0), cols_n = min(ST_TN, N - n0);
    const i64 hstate = (i64)p.headdim * N;  // one head's state
    const StateFrag f{warp * 16 + (lane >> 2), lane & 3};
    float acc[8][4];
    if (e < 0) {  // an empty sequence: its initial state, or 0
        frag_load_scaled(acc, f, ik >= 0 ? p.init + ((i64)ik * p.nheads + h) * hstate : nullptr, 1.0f, p0, n0,
                         rows_p, cols_n, N);
    } else {
        const int c = e / p.chunk_size, c0 = c * p.chunk_size;
        const float* cs = p.dA_cumsum + ((i64)h * p.nchunks + c) * p.chunk_size;
        const float* dto = p.dt_out + ((i64)h * p.nchunks + c) * p.chunk_size;
        const float cs_e = cs[e - c0];
        const float* base = nullptr;
        float decay = 0.0f;
        if (s < c0) {
            base = p.chunk_states + ((i64)c * p.nheads + h) * hstate;
            decay = expf(cs_e);
        } else if (ik >= 0) {
            base = p.init + ((i64)ik * p.nheads + h) * hstate;
            decay = expf(cs_e - (s > c0 ? cs[s - 1 - c0] : 0.0f));
        }
        frag_load_scaled(acc, f, base, decay, p0, n0, rows_p, cols_n, N);
        const int ta = max(s, c0);
        const int grp = h / (p.nheads / p.ngroups);
        const i64 sx = (i64)p.nheads * p.headdim, sb = (i64)p.ngroups * N;
        state_tile_accumulate(acc, xs, bs, ws, p.x + (i64)ta * sx + (i64)h * p.headdim + p0, sx,
                              p.Bm + (i64)ta * sb + (i64)grp * N + n0, sb, e + 1 - ta, rows_p, cols_n,
                              [&](int l) { return expf(cs_e - cs[ta + l - c0]) * dto[ta + l - c0]; });
    }
    frag_store(acc, f, p.states + ((i64)j * p.nheads + h) * hstate, p0, n0, rows_p, cols_n, N);
}
SSD_LAYOUT_FIXED(ssd_states_at, StatesAtParams, 0);
