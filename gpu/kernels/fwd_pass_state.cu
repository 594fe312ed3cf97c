// Stage 2: the state entering every chunk, and the final state.
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

#define ST_TP 64        // headdim rows per block
#define ST_TN 64        // dstate columns per block
#define ST_TK 64        // tokens per shared-memory stage
#define ST_STRIDE 72    // row stride (floats) of both tiles: conflict-free fragment loads
#define ST_THREADS 128

extern "C" __global__ void __launch_bounds__(ST_THREADS) ssd_fwd_pass_state(
    const float* __restrict__ x,               // [batch, seqlen, nheads, headdim]
    const float* __restrict__ Bm,              // [batch, seqlen, ngroups, dstate]
    const float* __restrict__ dt_out,          // [batch, nheads, nchunks, chunk_size]
    const float* __restrict__ dA_cumsum,       // [batch, nheads, nchunks, chunk_size]
    const float* __restrict__ initial_states,  // [batch, nheads, headdim, dstate] or null
    const int* __restrict__ seq_idx,           // [batch, seqlen] or null
    float* __restrict__ chunk_states,          // [batch, nchunks, nheads, headdim, dstate]
    float* __restrict__ final_states,          // [batch, nheads, headdim, dstate]
    int seqlen, int nheads, int headdim, int ngroups, int dstate, int chunk_size, int nchunks)
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

    // This thread's accumulator elements: rows p = p0 + warp*16 + g (+8), cols n = n0 + j*8 + 2q (+1).
    const int pr0 = warp * 16 + g;
    float acc[8][4];
    {
        const float* init = initial_states != nullptr
            ? initial_states + ((i64)b * nheads + h) * headdim * dstate : nullptr;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int pr = pr0 + ((e & 2) ? 8 : 0);
                int nc = j * 8 + 2 * q + (e & 1);
                float v = 0.0f;
                if (init != nullptr && pr < rows_p && nc < cols_n)
                    v = init[(i64)(p0 + pr) * dstate + n0 + nc];
                acc[j][e] = v;
            }
        }
    }

    // Writes this thread's accumulator elements into a [headdim, dstate] state.
    auto store_state = [&](float* dst) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int pr = pr0 + ((e & 2) ? 8 : 0);
                int nc = j * 8 + 2 * q + (e & 1);
                if (pr < rows_p && nc < cols_n) dst[(i64)(p0 + pr) * dstate + n0 + nc] = acc[j][e];
            }
        }
    };

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
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[j][e] *= scale;
        }

        for (int k0 = 0; k0 <= last; k0 += ST_TK) {
            const int rows_t = min(ST_TK, last + 1 - k0);
            __syncthreads();  // the previous stage's fragments have been read
            if (tid < ST_TK) {
                float w = 0.0f;
                if (tid < rows_t) {
                    int l = k0 + tid;
                    bool same = seq_idx == nullptr || seq_idx[(i64)b * seqlen + t0 + l] == seq_last;
                    if (same) w = expf(cs_last - dA_cumsum[cb + l]) * dt_out[cb + l];
                }
                ws[tid] = w;
            }
            load_block64_tf32<ST_TK, ST_THREADS, false>(
                xs, ST_STRIDE, x + ((i64)b * seqlen + t0 + k0) * tok_stride_x + (i64)h * headdim + p0,
                tok_stride_x, rows_t, rows_p, nullptr, tid);
            __syncthreads();  // ws is ready
            load_block64_tf32<ST_TK, ST_THREADS, true>(
                bs, ST_STRIDE, Bm + ((i64)b * seqlen + t0 + k0) * tok_stride_b + (i64)grp * dstate + n0,
                tok_stride_b, rows_t, cols_n, ws, tid);
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

    store_state(final_states + ((i64)b * nheads + h) * headdim * dstate);
}

// Stage 2, split in two for parallelism (the default path; ssd_fwd_pass_state above is the
// fused sequential variant, kept selectable).
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

#define CHUNK_STATE_LOCAL_ARGS                                                                              \
    const float *__restrict__ x,          /* [batch, seqlen, nheads, headdim] */                           \
        const float *__restrict__ Bm,     /* [batch, seqlen, ngroups, dstate] */                           \
        const float *__restrict__ dt_out, /* [batch, nheads, nchunks, chunk_size] */                       \
        const float *__restrict__ dA_cumsum, /* [batch, nheads, nchunks, chunk_size] */                    \
        const int *__restrict__ seq_idx,     /* [batch, seqlen] or null */                                 \
        float *__restrict__ chunk_states,    /* [batch, nchunks, nheads, headdim, dstate] (L_c here) */    \
        int seqlen, int nheads, int headdim, int ngroups, int dstate, int chunk_size, int nchunks
extern "C" __global__ void __launch_bounds__(128, 3) ssd_chunk_state_local(CHUNK_STATE_LOCAL_ARGS) {
    extern __shared__ __align__(16) float smem[];
    chunk_state_local_body<64>(smem, x, Bm, dt_out, dA_cumsum, seq_idx, chunk_states, seqlen, nheads, headdim,
                               ngroups, dstate, chunk_size, nchunks);
}
extern "C" __global__ void __launch_bounds__(256, 2) ssd_chunk_state_local_wide(CHUNK_STATE_LOCAL_ARGS) {
    extern __shared__ __align__(16) float smem[];
    chunk_state_local_body<128>(smem, x, Bm, dt_out, dA_cumsum, seq_idx, chunk_states, seqlen, nheads, headdim,
                                ngroups, dstate, chunk_size, nchunks);
}

// 2a, the pair kernel (the host's choice where it applies, see docs/gpu.md): one block of 256
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
extern "C" __global__ void __launch_bounds__(256, 2) ssd_chunk_state_local_pair(CHUNK_STATE_LOCAL_ARGS) {
    extern __shared__ __align__(16) float smem[];
    constexpr int NT = 256, TK = 32;
    const int tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int u = warp >> 2, wm = (warp >> 1) & 1, wn = warp & 1;
    float* ws = smem + 3 * SP_STAGE + warp * TK;  // this warp's w of the current stage
    const float** ptab = (const float**)(smem + 3 * SP_STAGE + 8 * TK);
    const int ntiles_n = (dstate + 127) / 128;
    const int ptiles = (headdim + 63) / 64;
    int ct, pair;  // ct: chunk and 128 dstate columns
    tile_and_unit(nheads * ptiles / 2, ct, pair);
    const int c = ct / ntiles_n;
    const int n0 = (ct % ntiles_n) * 128;
    const int b = blockIdx.z;
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
    // This warp's unit.
    const int h = u ? h_1 : h_0, p0 = u ? p_1 : p_0, rows_p = u ? rows_1 : rows_0;
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
        async_rows<TK, 64, NT>(xs, SP_S, ptab[0] + xoff, (unsigned)tok_stride_x, rows_t, rows_0, tid);
        async_rows<TK, 64, NT>(xs + 64, SP_S, ptab[1] + xoff, (unsigned)tok_stride_x, rows_t, rows_1, tid);
        async_rows<TK, 128, NT>(bs, SP_S, ptab[2] + boff, (unsigned)tok_stride_b, rows_t, cols_n, tid);
        if (tid < 64) {
            const int l = tid & 31;
            const bool ok = l < rows_t;
            cp_async4(vk + tid, ptab[3 + (tid >> 5)] + k0 + l, ok, dA_cumsum);
            cp_async4(vk + 64 + tid, ptab[5 + (tid >> 5)] + k0 + l, ok, dt_out);
            if (seq_idx != nullptr && tid < 32) cp_async4(vk + 128 + tid, (const int*)ptab[7] + k0 + l, ok, seq_idx);
        }
    };

    float acc[2][8][4];
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

    float* cst = chunk_states + (((i64)b * nchunks + c) * nheads + h) * headdim * dstate;
    store_state_tile(cst, acc, dstate, p0, n0, wm, wn * 64, g, q, rows_p, cols_n);
}

// 2b. The sequential pass across chunks, in place, one thread per (batch b, head h, V
// consecutive elements e of [headdim, dstate]) (grid: x over the elements, y = heads, z =
// batch; V = 4 with 16-byte loads when headdim * dstate is a multiple of 4, else 1). On entry
// chunk_states[b, c, h] holds L_c (2a); with S_0 = initial_states (0 when absent):
//   chunk_states[b, c, h] = S_c,   S_{c+1} = fma(scale_c, S_c, L_c),   final_states = S_nchunks,
//   scale_c = exp(cs[last_c]) if seq(last_c) == seq(last_{c-1}) (seq(last_{-1}) = 0), else 0,
// the same fused multiply-add, in the same order, as the CPU reference's state passing. The
// loads of 8 chunks are issued before their chain is walked.
#define SP_THREADS 256
#define SP_UNROLL 8
template <int V>
struct vecf;
template <>
struct vecf<1> { typedef float T; };
template <>
struct vecf<4> { typedef float4 T; };
__device__ __forceinline__ float vfma(float s, float a, float b) { return fmaf(s, a, b); }
__device__ __forceinline__ float4 vfma(float s, float4 a, float4 b) {
    return make_float4(fmaf(s, a.x, b.x), fmaf(s, a.y, b.y), fmaf(s, a.z, b.z), fmaf(s, a.w, b.w));
}
template <int V>
__device__ __forceinline__ void state_passing_body(
    const float* __restrict__ dA_cumsum, const float* __restrict__ initial_states, const int* __restrict__ seq_idx,
    float* __restrict__ chunk_states, float* __restrict__ final_states, int seqlen, int nheads, int headdim,
    int dstate, int chunk_size, int nchunks)
{
    typedef typename vecf<V>::T T;
    const i64 n = (i64)headdim * dstate;
    const i64 e = ((i64)blockIdx.x * SP_THREADS + threadIdx.x) * V;
    const int h = blockIdx.y;
    const int b = blockIdx.z;
    if (e >= n) return;  // no barrier below
    const i64 bh = (i64)b * nheads + h;
    T run = T{};  // zero
    if (initial_states != nullptr) run = *reinterpret_cast<const T*>(initial_states + bh * n + e);
    const i64 cstride = (i64)nheads * n;  // from one chunk to the next
    float* p = chunk_states + ((i64)b * nchunks * nheads + h) * n + e;
    const float* cs_row = dA_cumsum + bh * nchunks * chunk_size;
    int seq_prev = 0;
    for (int c0 = 0; c0 < nchunks; c0 += SP_UNROLL) {
        T own[SP_UNROLL];
        float sc[SP_UNROLL];
        int seq_last[SP_UNROLL];
        // Every load of the SP_UNROLL chunks first, so that they are in flight together (the
        // exponent of a chunk used to wait for its cumsum load before the next chunk's loads).
#pragma unroll
        for (int k = 0; k < SP_UNROLL; ++k) {
            const int c = c0 + k;
            own[k] = T{};
            sc[k] = 0.0f;
            seq_last[k] = 0;
            if (c < nchunks) {
                own[k] = *reinterpret_cast<const T*>(p + (i64)c * cstride);
                const i64 t0 = (i64)c * chunk_size;
                const int last = (int)min((i64)chunk_size, (i64)seqlen - t0) - 1;
                if (seq_idx != nullptr) seq_last[k] = seq_idx[(i64)b * seqlen + t0 + last];
                sc[k] = cs_row[t0 + last];
            }
        }
#pragma unroll
        for (int k = 0; k < SP_UNROLL; ++k) {
            if (c0 + k < nchunks) {
                sc[k] = seq_last[k] == seq_prev ? expf(sc[k]) : 0.0f;
                seq_prev = seq_last[k];
            }
        }
#pragma unroll
        for (int k = 0; k < SP_UNROLL; ++k) {
            const int c = c0 + k;
            if (c < nchunks) {
                *reinterpret_cast<T*>(p + (i64)c * cstride) = run;
                run = vfma(sc[k], run, own[k]);
            }
        }
    }
    *reinterpret_cast<T*>(final_states + bh * n + e) = run;
}

extern "C" __global__ void __launch_bounds__(SP_THREADS) ssd_state_passing(
    const float* __restrict__ dA_cumsum,       // [batch, nheads, nchunks, chunk_size]
    const float* __restrict__ initial_states,  // [batch, nheads, headdim, dstate] or null
    const int* __restrict__ seq_idx,           // [batch, seqlen] or null
    float* __restrict__ chunk_states,          // [batch, nchunks, nheads, headdim, dstate]
    float* __restrict__ final_states,          // [batch, nheads, headdim, dstate]
    int seqlen, int nheads, int headdim, int dstate, int chunk_size, int nchunks, int vec4)
{
    if (vec4)
        state_passing_body<4>(dA_cumsum, initial_states, seq_idx, chunk_states, final_states, seqlen, nheads,
                              headdim, dstate, chunk_size, nchunks);
    else
        state_passing_body<1>(dA_cumsum, initial_states, seq_idx, chunk_states, final_states, seqlen, nheads,
                              headdim, dstate, chunk_size, nchunks);
}
