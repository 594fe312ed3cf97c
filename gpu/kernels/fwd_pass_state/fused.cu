// Stage 2: the state entering every chunk, and the final state; the fused sequential kernel
// (version 1's stage 2, and version 2's where 2a's grid would overflow, see docs/gpu.md).
//
// One block of 128 threads (4 warps) per (batch b, head h, tile of 64 headdim rows p x 64 dstate
// columns n); it walks the chunks in order and keeps the running state S[p, n] of its tile in
// the tensor-core accumulators. For chunk c, with `last` its last real token (seqlen may end
// inside it), cs = dA_cumsum[b, h, c, :], dt' = dt_out[b, h, c, :]:
//   chunk_states[b, c, h, p, n] = S                     (the state entering chunk c)
//   S <- scale * S + sum_{l <= last, seq(l) == seq(last)} x[l, p] * w[l] * B[l, n]
//   w[l]  = exp(cs[last] - cs[l]) * dt'[l]
//   scale = exp(cs[last]) if seq(last) == seq(token before the chunk) else 0
// where seq(token before chunk 0) = 0 (initial_states seed only a leading run with seq_idx 0)
// and seq(.) = 0 everywhere without seq_idx. The sum is one TF32 matrix product per chunk:
// (x^T)[p, l] times (w B)[l, n], operands rounded to TF32, accumulated in f32 onto scale * S.
// After the last chunk, final_states[b, h, p, n] = S.
// Packed sequences with one initial state each (batch 1): where chunk_init[c] = (k, s), k >= 0,
// the sequence of the chunk's last token starts at its token s from seq_init[k], and
//   S <- exp(cs[last] - cs[s - 1]) * seq_init[k, h] + sum_{l >= s} ...   (cs[-1] = 0)
// instead of scale * S (which is 0 there: the sequence changed, or S is 0 before chunk 0).

// The accumulator tile of a block of ST_THREADS threads over a 64 x 64 tile of a state: warp w
// holds rows 16 w + g (+ 8), columns 8 j + 2 q (+ 1), j < 8 (the m16n8k8 C fragment).
struct StateFrag {
    int pr0, q;  // the thread's first row (16 warp + g) and quad index
    __device__ __forceinline__ int row(int e) const { return pr0 + ((e & 2) ? 8 : 0); }
    __device__ __forceinline__ int col(int j, int e) const { return j * 8 + 2 * q + (e & 1); }
};

// acc = scale * src[p0 + row, n0 + col] (row < rows_p, col < cols_n; 0 elsewhere and where src is
// null); src is a [headdim, dstate] state.
__device__ __forceinline__ void frag_load_scaled(float (&acc)[8][4], StateFrag f, const float* src, float scale,
                                                 int p0, int n0, int rows_p, int cols_n, int dstate) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int pr = f.row(e), nc = f.col(j, e);
            acc[j][e] = src != nullptr && pr < rows_p && nc < cols_n ? scale * src[(i64)(p0 + pr) * dstate + n0 + nc] : 0.0f;
        }
    }
}

// dst[p0 + row, n0 + col] = acc, within rows_p x cols_n; dst is a [headdim, dstate] state.
__device__ __forceinline__ void frag_store(const float (&acc)[8][4], StateFrag f, float* dst, int p0, int n0,
                                           int rows_p, int cols_n, int dstate) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int pr = f.row(e), nc = f.col(j, e);
            if (pr < rows_p && nc < cols_n) dst[(i64)(p0 + pr) * dstate + n0 + nc] = acc[j][e];
        }
    }
}

// acc[p, n] += sum_{l < ntok} x[l, p] * (weight(l) * B[l, n]) for one 64 x 64 state tile: xsrc and
// bsrc point at token 0's row of the tile's columns (row strides sx, sb), one TF32 product per
// ST_TK tokens staged in xs, bs ([token][p], [token][n], stride ST_STRIDE) and ws. Every thread of
// the block calls it (it synchronises).
template <typename Weight>
__device__ __forceinline__ void state_tile_accumulate(float (&acc)[8][4], float* xs, float* bs, float* ws,
                                                      const float* __restrict__ xsrc, i64 sx,
                                                      const float* __restrict__ bsrc, i64 sb, int ntok,
                                                      int rows_p, int cols_n, Weight weight) {
    const int tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    for (int k0 = 0; k0 < ntok; k0 += ST_TK) {
        const int rows_t = min(ST_TK, ntok - k0);
        __syncthreads();  // the previous stage's fragments have been read
        if (tid < ST_TK) ws[tid] = tid < rows_t ? weight(k0 + tid) : 0.0f;
        load_block64_tf32<ST_TK, ST_THREADS, false>(xs, ST_STRIDE, xsrc + k0 * sx, sx, rows_t, rows_p, nullptr, tid);
        __syncthreads();  // ws is ready
        load_block64_tf32<ST_TK, ST_THREADS, true>(bs, ST_STRIDE, bsrc + k0 * sb, sb, rows_t, cols_n, ws, tid);
        __syncthreads();  // both tiles are ready
#pragma unroll
        for (int kk = 0; kk < ST_TK / 8; ++kk) {
            unsigned a[4];
            // A[p][l] = x[l][p]: xs holds [l][p], so the fragment is read transposed.
            load_a_colmajor(a, xs + kk * 8 * ST_STRIDE + warp * 16, ST_STRIDE, g, q);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                unsigned bf[2];
                load_b_krows(bf, bs + kk * 8 * ST_STRIDE + j * 8, ST_STRIDE, g, q);
                mma_tf32(acc[j], a, bf);
            }
        }
    }
}

__device__ __forceinline__ void fwd_pass_state_body(
    const float* __restrict__ x,               // [batch, seqlen, nheads, headdim]
    const float* __restrict__ Bm,              // [batch, seqlen, ngroups, dstate]
    const float* __restrict__ dt_out,          // [batch, nheads, nchunks, chunk_size]
    const float* __restrict__ dA_cumsum,       // [batch, nheads, nchunks, chunk_size]
    const float* __restrict__ initial_states,  // [batch, nheads, headdim, dstate] or null
    const int* __restrict__ seq_idx,           // [batch, seqlen] or null
    float* __restrict__ chunk_states,          // [batch, nchunks, nheads, headdim, dstate]
    float* __restrict__ final_states,          // [batch, nheads, headdim, dstate]
    int seqlen, int nheads, int headdim, int ngroups, int dstate, int chunk_size, int nchunks,
    const float* __restrict__ seq_init, const int* __restrict__ chunk_init)
{
    __shared__ __align__(16) float xs[ST_TK * ST_STRIDE];   // [token][p]
    __shared__ __align__(16) float bs[ST_TK * ST_STRIDE];   // [token][n], times w
    __shared__ float ws[ST_TK];

    const int tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int ntiles_n = (dstate + ST_TN - 1) / ST_TN;
    const int p0 = (blockIdx.x / ntiles_n) * ST_TP;
    const int n0 = (blockIdx.x % ntiles_n) * ST_TN;
    const int h = blockIdx.y;
    const int b = blockIdx.z;
    const int grp = h / (nheads / ngroups);
    const int rows_p = min(ST_TP, headdim - p0);
    const int cols_n = min(ST_TN, dstate - n0);

    const StateFrag f{warp * 16 + g, q};
    float acc[8][4];
    frag_load_scaled(acc, f,
                     initial_states != nullptr ? initial_states + ((i64)b * nheads + h) * headdim * dstate : nullptr,
                     1.0f, p0, n0, rows_p, cols_n, dstate);
    // Writes this thread's accumulator elements into a [headdim, dstate] state.
    auto store_state = [&](float* dst) { frag_store(acc, f, dst, p0, n0, rows_p, cols_n, dstate); };

    const i64 tok_stride_x = (i64)nheads * headdim;
    const i64 tok_stride_b = (i64)ngroups * dstate;
    for (int c = 0; c < nchunks; ++c) {
        const i64 t0 = (i64)c * chunk_size;
        const int last = (int)min((i64)chunk_size, (i64)seqlen - t0) - 1;
        // The state entering chunk c.
        store_state(chunk_states + (((i64)b * nchunks + c) * nheads + h) * headdim * dstate);
        const i64 cb = (((i64)b * nheads + h) * nchunks + c) * chunk_size;
        const float cs_last = dA_cumsum[cb + last];
        int seq_last = 0, seq_prev = 0;
        if (seq_idx != nullptr) {
            seq_last = seq_idx[(i64)b * seqlen + t0 + last];
            seq_prev = c == 0 ? 0 : seq_idx[(i64)b * seqlen + t0 - 1];
        }
        const float scale = seq_last == seq_prev ? expf(cs_last) : 0.0f;
        if (chunk_init != nullptr && chunk_init[2 * c] >= 0) {
            const int s = chunk_init[2 * c + 1];
            const float decay = expf(cs_last - (s > 0 ? dA_cumsum[cb + s - 1] : 0.0f));
            frag_load_scaled(acc, f, seq_init + ((i64)chunk_init[2 * c] * nheads + h) * headdim * dstate, decay, p0,
                             n0, rows_p, cols_n, dstate);
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[j][e] *= scale;
            }
        }

        state_tile_accumulate(
            acc, xs, bs, ws, x + ((i64)b * seqlen + t0) * tok_stride_x + (i64)h * headdim + p0, tok_stride_x,
            Bm + ((i64)b * seqlen + t0) * tok_stride_b + (i64)grp * dstate + n0, tok_stride_b, last + 1, rows_p, cols_n,
            [&](int l) {
                const bool same = seq_idx == nullptr || seq_idx[(i64)b * seqlen + t0 + l] == seq_last;
                return same ? expf(cs_last - dA_cumsum[cb + l]) * dt_out[cb + l] : 0.0f;
            });
    }

    store_state(final_states + ((i64)b * nheads + h) * headdim * dstate);
}

// The parameters of ssd_fwd_pass_state (Rust: FwdPassStateParams).
struct FwdPassStateParams {
    const float* x;               // [batch, seqlen, nheads, headdim]
    const float* Bm;              // [batch, seqlen, ngroups, dstate]
    const float* dt_out;          // [batch, nheads, nchunks, chunk_size]
    const float* dA_cumsum;       // [batch, nheads, nchunks, chunk_size]
    const float* initial_states;  // [batch, nheads, headdim, dstate] or null
    const int* seq_idx;           // [batch, seqlen] or null
    float* chunk_states;          // [batch, nchunks, nheads, headdim, dstate]
    float* final_states;          // [batch, nheads, headdim, dstate]
    int seqlen, nheads, headdim, ngroups, dstate, chunk_size, nchunks;
    const float* seq_init;        // [nseq, nheads, headdim, dstate] or null (packed, batch 1)
    const int* chunk_init;        // [nchunks, 2]: (k or -1, first token of k in the chunk) or null
};
static_assert(sizeof(FwdPassStateParams) == 112, "FwdPassStateParams: the Rust struct has 112 bytes");

extern "C" __global__ void __launch_bounds__(ST_THREADS) ssd_fwd_pass_state(const FwdPassStateParams p) {
    fwd_pass_state_body(p.x, p.Bm, p.dt_out, p.dA_cumsum, p.initial_states, p.seq_idx, p.chunk_states,
                        p.final_states, p.seqlen, p.nheads, p.headdim, p.ngroups, p.dstate, p.chunk_size,
                        p.nchunks, p.seq_init, p.chunk_init);
}
// Static shared memory only.
SSD_LAYOUT_FIXED(ssd_fwd_pass_state, FwdPassStateParams, 0);
