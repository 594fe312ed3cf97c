// Stage 3: the output of every chunk.
//
// One block of 128 threads (4 warps) per (batch b, chunk c, tile of 64 rows i of the chunk,
// head h, tile of 64 headdim columns p). Each warp owns 16 rows. With cs = dA_cumsum[b, h, c, :],
// dt' = dt_out[b, h, c, :], S = chunk_states[b, c, h] ([headdim, dstate]) and seq() the seq_idx
// of a token (0 everywhere without seq_idx):
//   y[i, p] = exp(cs[i]) * (C[i, :] . S[p, :])   if seq(i) == seq(token before the chunk), where
//                                                that token's seq is 0 for chunk 0
//           + sum_{j <= i, seq(j) == seq(i)} (C[i, :] . B[j, :]) * exp(cs[i] - cs[j]) * dt'[j] * x[j, p]
//           + D[h(, p)] * x[i, p]
//   out[i, p] = y * z * sigmoid(z)  when z is given, else y.
// The causal matrix (C B^T masked and decayed) is built 64 x 64 tile by tile in registers and
// shared memory, only for column tiles j0 <= i; the mask comes from the indices and the
// exponent is evaluated only where j <= i (so it never overflows). All matrix products are
// TF32 tensor-core products (operands rounded with cvt.rna) with f32 accumulation.
//
// Dynamic shared memory (floats), NS = round_up(dstate, 64) + 4:
//   cs_tile [64 x NS]   C rows of this tile (rows i)
//   bs_tile [64 x NS]   B rows of the current column tile (rows j), or S (rows p) at first
//   xs_tile [64 x 72]   x of the current column tile ([j][p])
//   stage   [4 x 16 x 68] each warp's masked, decayed scores, re-read as an A operand
//   cs_i[64], cs_j[64], dt_j[64], seq_i[64] (int), seq_j[64] (int)

#define CO_TM 64
#define CO_TP 64
#define CO_TJ 64
#define CO_XSTRIDE 72
#define CO_SSTRIDE 68
#define CO_THREADS 128

extern "C" __global__ void __launch_bounds__(CO_THREADS) ssd_compute_out(
    const float* __restrict__ x,             // [batch, seqlen, nheads, headdim]
    const float* __restrict__ Bm,            // [batch, seqlen, ngroups, dstate]
    const float* __restrict__ Cm,            // [batch, seqlen, ngroups, dstate]
    const float* __restrict__ Dv,            // [nheads] or [nheads, headdim] or null
    const float* __restrict__ z,             // [batch, seqlen, nheads, headdim] or null
    const float* __restrict__ dt_out,        // [batch, nheads, nchunks, chunk_size]
    const float* __restrict__ dA_cumsum,     // [batch, nheads, nchunks, chunk_size]
    const float* __restrict__ chunk_states,  // [batch, nchunks, nheads, headdim, dstate]
    const int* __restrict__ seq_idx,         // [batch, seqlen] or null
    float* __restrict__ out,                 // [batch, seqlen, nheads, headdim]
    int seqlen, int nheads, int headdim, int ngroups, int dstate, int chunk_size, int nchunks,
    int d_per_channel, int has_initial_states)
{
    extern __shared__ __align__(16) float smem[];
    const int NC64 = ((dstate + 63) / 64) * 64;   // columns of the C and B tiles (zero padded)
    const int NS = NC64 + 4;
    const int NK = ((dstate + 7) / 8) * 8;   // k extent of the C products (zero padded)
    float* c_tile = smem;
    float* b_tile = c_tile + CO_TM * NS;
    float* x_tile = b_tile + CO_TJ * NS;
    float* stage = x_tile + CO_TJ * CO_XSTRIDE;
    float* cs_i = stage + 4 * 16 * CO_SSTRIDE;
    float* cs_j = cs_i + CO_TM;
    float* dt_j = cs_j + CO_TJ;
    int* seq_i = (int*)(dt_j + CO_TJ);
    int* seq_j = seq_i + CO_TM;

    const int tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int itiles = (chunk_size + CO_TM - 1) / CO_TM;
    const int c = blockIdx.x / itiles;
    const int i0 = (blockIdx.x % itiles) * CO_TM;
    const int ptiles = (headdim + CO_TP - 1) / CO_TP;
    const int h = blockIdx.y / ptiles;
    const int p0 = (blockIdx.y % ptiles) * CO_TP;
    const int b = blockIdx.z;
    const int grp = h / (nheads / ngroups);

    const i64 t0 = (i64)c * chunk_size;
    const int valid_c = (int)min((i64)chunk_size, (i64)seqlen - t0);
    if (i0 >= valid_c) return;  // the whole tile lies past seqlen (block-uniform)
    const int rows_i = min(CO_TM, valid_c - i0);
    const int cols_p = min(CO_TP, headdim - p0);
    const i64 cb = (((i64)b * nheads + h) * nchunks + c) * chunk_size;
    const i64 tok_stride_x = (i64)nheads * headdim;
    const i64 tok_stride_b = (i64)ngroups * dstate;
    const float* xh = x + (i64)b * seqlen * tok_stride_x + (i64)h * headdim + p0;     // token 0 of row b
    const float* bg = Bm + (i64)b * seqlen * tok_stride_b + (i64)grp * dstate;
    const float* cg = Cm + (i64)b * seqlen * tok_stride_b + (i64)grp * dstate;
    const int* seq_row = seq_idx != nullptr ? seq_idx + (i64)b * seqlen : nullptr;

    for (int r = tid; r < CO_TM; r += CO_THREADS) {
        cs_i[r] = r < rows_i ? dA_cumsum[cb + i0 + r] : 0.0f;
        seq_i[r] = (seq_row != nullptr && r < rows_i) ? seq_row[t0 + i0 + r] : 0;
    }
    load_tile_tf32<CO_TM, CO_THREADS>(c_tile, NS, cg + (t0 + i0) * tok_stride_b, tok_stride_b, rows_i, dstate, NC64, tid);

    float acc[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
    }

    const int r0 = warp * 16 + g;  // this thread's rows: r0 and r0 + 8
    // The carried state of chunk 0 without initial states is zero: skip its product.
    if (c > 0 || has_initial_states) {
        // The carried-state term: C[i, :] . S[p, :], S rows p in b_tile.
        const float* st = chunk_states + (((i64)b * nchunks + c) * nheads + h) * headdim * dstate + (i64)p0 * dstate;
        load_tile_tf32<CO_TP, CO_THREADS>(b_tile, NS, st, dstate, cols_p, dstate, NC64, tid);
        __syncthreads();
        mma_16x64_nmajor(acc, c_tile + warp * 16 * NS, b_tile, NS, NK, g, q);
        const int seq_prev = (seq_row == nullptr || c == 0) ? 0 : seq_row[t0 - 1];
        const float f0 = seq_i[r0] == seq_prev ? expf(cs_i[r0]) : 0.0f;
        const float f1 = seq_i[r0 + 8] == seq_prev ? expf(cs_i[r0 + 8]) : 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            acc[j][0] *= f0;
            acc[j][1] *= f0;
            acc[j][2] *= f1;
            acc[j][3] *= f1;
        }
    }

    float* my_stage = stage + warp * 16 * CO_SSTRIDE;
    for (int j0 = 0; j0 < i0 + rows_i; j0 += CO_TJ) {
        const int rows_j = min(CO_TJ, valid_c - j0);
        __syncthreads();  // every warp is done with b_tile / x_tile / cs_j of the previous tile
        for (int r = tid; r < CO_TJ; r += CO_THREADS) {
            bool ok = r < rows_j;
            cs_j[r] = ok ? dA_cumsum[cb + j0 + r] : 0.0f;
            dt_j[r] = ok ? dt_out[cb + j0 + r] : 0.0f;
            seq_j[r] = seq_row == nullptr ? 0 : (ok ? seq_row[t0 + j0 + r] : -1);
        }
        load_tile_tf32<CO_TJ, CO_THREADS>(b_tile, NS, bg + (t0 + j0) * tok_stride_b, tok_stride_b, rows_j, dstate, NC64, tid);
        load_block64_tf32<CO_TJ, CO_THREADS, false>(x_tile, CO_XSTRIDE, xh + (t0 + j0) * tok_stride_x, tok_stride_x, rows_j, cols_p, nullptr, tid);
        __syncthreads();

        // scores[i, j] = C[i, :] . B[j, :] for this warp's 16 rows and the 64 columns.
        float sc[8][4];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) sc[j][e] = 0.0f;
        }
        mma_16x64_nmajor(sc, c_tile + warp * 16 * NS, b_tile, NS, NK, g, q);
        // Mask (causal, same sequence, inside seqlen) and decay, then stage as TF32.
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                int r = r0 + ((e & 2) ? 8 : 0);
                int col = j * 8 + 2 * q + (e & 1);
                int i = i0 + r, jj = j0 + col;
                float v = 0.0f;
                if (jj <= i && r < rows_i && col < rows_j && seq_j[col] == seq_i[r])
                    v = sc[j][e] * expf(cs_i[r] - cs_j[col]) * dt_j[col];
                my_stage[(r - warp * 16) * CO_SSTRIDE + col] = tf32_round(v);
            }
        }
        __syncwarp();
        // acc[i, p] += stage[i, j] . x[j, p]
#pragma unroll
        for (int kk = 0; kk < CO_TJ; kk += 8) {
            unsigned a[4];
            load_a_rowmajor(a, my_stage + kk, CO_SSTRIDE, g, q);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                unsigned bf[2];
                load_b_krows(bf, x_tile + kk * CO_XSTRIDE + j * 8, CO_XSTRIDE, g, q);
                mma_tf32(acc[j], a, bf);
            }
        }
        __syncwarp();  // the stage is read before the next tile overwrites it
    }

    // Epilogue: D skip, z gate, store.
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int r = r0 + ((e & 2) ? 8 : 0);
            int col = j * 8 + 2 * q + (e & 1);
            if (r < rows_i && col < cols_p) {
                i64 off = (i64)b * seqlen * tok_stride_x + (t0 + i0 + r) * tok_stride_x + (i64)h * headdim + p0 + col;
                float y = acc[j][e];
                if (Dv != nullptr) {
                    float d = d_per_channel ? Dv[(i64)h * headdim + p0 + col] : Dv[h];
                    y += d * x[off];
                }
                if (z != nullptr) {
                    float zz = z[off];
                    y = y * zz / (1.0f + expf(-zz));
                }
                out[off] = y;
            }
        }
    }
}

// Stage 3, fast path (chunk sizes 64 to 512; ssd_compute_out above serves every other size
// and stays selectable): the scores C B^T once per (batch, chunk, group), shared by the group's
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

extern "C" __global__ void __launch_bounds__(128, 3) ssd_chunk_cb(
    const float* __restrict__ Bm,  // [batch, seqlen, ngroups, dstate]
    const float* __restrict__ Cm,  // [batch, seqlen, ngroups, dstate]
    float* __restrict__ cbuf,      // [batch, nchunks, ngroups, npairs, 64, 64]
    int seqlen, int ngroups, int dstate, int chunk_size, int nchunks, int tmax, int vec)
{
    extern __shared__ __align__(16) float smem[];
    if (vec)
        chunk_cb_body<true>(smem, Bm, Cm, cbuf, seqlen, ngroups, dstate, chunk_size, nchunks, tmax);
    else
        chunk_cb_body<false>(smem, Bm, Cm, cbuf, seqlen, ngroups, dstate, chunk_size, nchunks, tmax);
}

// 3b. One block of 2 TM threads (TM / 16 warps) per (batch b, chunk c, TM rows i of the chunk,
// head h, 64 headdim columns p): TM = 128 when the chunk holds two or more 64-row tiles
// (ssd_compute_out_cb128), else TM = 64 (ssd_compute_out_cb). The warps split the TM x 64
// output tile in 32 x 32 quarters (warp w: rows 32 (w / 2), columns 32 (w % 2)). The block
// walks a pipeline of steps, each one pair of tiles copied with cp.async into one half of a
// double buffer while the other half is used:
//   steps 0 .. nslab-1 (only when the carried state is not 0): C[i, n0:n0+64] (TM rows) and
//     S[p, n0:n0+64]; acc += C S^T;
//   then acc *= exp(cs_i) (0 where seq(i) differs from the seq before the chunk);
//   steps for each 64-wide column tile jt that holds a j <= i of the block: for each 64-row
//     half rt of the block with jt <= rt, the raw scores cb[b, c, g, pair(rt, jt)]; and x[j, p].
//     The block turns the scores in place into the causal matrix
//       M[i, j] = score * 2^((cs_i - cs_j) log2 e) * dt'_j   where j <= i and seq(j) = seq(i),
//       0 elsewhere (the exponent is -inf there: never evaluated on cs_i - cs_j),
//     then acc += M x (a warp whose rows lie above the tile skips it).
// A block over 128 rows reads each state slab and each x tile once for both of its halves:
// 22% fewer bytes from L2 than two 64-row blocks at chunk 256.
// Operands go to the tensor cores as raw f32 bit patterns (the TF32 product uses their top 19
// bits, i.e. truncates them: the error model's TF32 operand unit 2^-10); f32 accumulation.
// Fragments of C, S and M come through ldmatrix, those of x through conflict-free 32-bit loads.
// Dynamic shared memory (floats): 2 buffers of [TM x 68 (C slab or scores), 64 x 72 (S slab at
// stride 68, or x at 72), cs_j[64], dt_j[64], seq_j[64]], then cs_i[TM], seq_i[TM].
// vec: every global tile may be copied 16 bytes at a time (headdim and dstate multiples of 4,
// 16-byte aligned buffers), decided by the host.
#define CO2_A 68
#define CO2_BUF(TM) ((TM) * CO2_A + 64 * CO_XSTRIDE + 3 * 64)
template <bool VEC, int TM>
__device__ __forceinline__ void compute_out_cb_body(
    float* smem, const float* __restrict__ x, const float* __restrict__ Cm, const float* __restrict__ Dv,
    const float* __restrict__ z, const float* __restrict__ dt_out, const float* __restrict__ dA_cumsum,
    const float* __restrict__ chunk_states, const int* __restrict__ seq_idx, const float* __restrict__ cbuf,
    float* __restrict__ out, int seqlen, int nheads, int headdim, int ngroups, int dstate, int chunk_size,
    int nchunks, int d_per_channel, int has_initial_states, int tmax)
{
    constexpr int NT = 2 * TM;
    constexpr int BUF = CO2_BUF(TM);
    float* cs_i = smem + 2 * BUF;
    int* seq_i = (int*)(cs_i + TM);

    const int tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int wm = warp >> 1, wn = warp & 1;  // this warp's 32 x 32 quarter of the output tile
    const int itiles = (chunk_size + TM - 1) / TM;
    const int c = blockIdx.x / itiles;
    const int i0 = (blockIdx.x % itiles) * TM;
    const int t64 = i0 / 64;  // the block's first 64-row tile
    const int ptiles = (headdim + CO_TP - 1) / CO_TP;
    const int h = blockIdx.y / ptiles;
    const int p0 = (blockIdx.y % ptiles) * CO_TP;
    const int b = blockIdx.z;
    const int grp = h / (nheads / ngroups);

    const i64 t0 = (i64)c * chunk_size;
    const int valid_c = (int)min((i64)chunk_size, (i64)seqlen - t0);
    if (i0 >= valid_c) return;  // the whole tile lies past seqlen (block-uniform)
    const int rows_i = min(TM, valid_c - i0);
    const int cols_p = min(CO_TP, headdim - p0);
    const i64 cb = (((i64)b * nheads + h) * nchunks + c) * chunk_size;
    const i64 tok_stride_x = (i64)nheads * headdim;
    const i64 tok_stride_b = (i64)ngroups * dstate;
    const float* xh = x + (i64)b * seqlen * tok_stride_x + (i64)h * headdim + p0;
    const float* cg = Cm + (i64)b * seqlen * tok_stride_b + (i64)grp * dstate + (t0 + i0) * tok_stride_b;
    const float* st = chunk_states + (((i64)b * nchunks + c) * nheads + h) * headdim * dstate + (i64)p0 * dstate;
    const int npairs = tmax * (tmax + 1) / 2;
    const float* cbc = cbuf + (((i64)b * nchunks + c) * ngroups + grp) * npairs * 4096;
    const int* seq_row = seq_idx != nullptr ? seq_idx + (i64)b * seqlen : nullptr;
    const bool has_seq = seq_row != nullptr;

    for (int r = tid; r < TM; r += NT) {
        cs_i[r] = r < rows_i ? dA_cumsum[cb + i0 + r] : 0.0f;
        seq_i[r] = (has_seq && r < rows_i) ? seq_row[t0 + i0 + r] : 0;
    }

    const int NC64 = ((dstate + 63) / 64) * 64;
    const int NK = ((dstate + 7) / 8) * 8;
    const int nslab = (c > 0 || has_initial_states) ? NC64 / 64 : 0;
    const int nsteps = nslab + (min(i0 + TM, valid_c) + 63) / 64;
    // Without seq_idx, below the first row tile: the tiles left of the block skip the mask and
    // split the decay at R = log2(e) cs[i0 - 1] (see the score steps).
    const bool split = !has_seq && i0 > 0;
    const float R = split ? dA_cumsum[cb + i0 - 1] * LOG2E_F : 0.0f;
    // The 64-row tile of this warp's product rows and of its decay-pass rows; a warp takes part
    // in the score step of column tile jt only when jt <= that tile (and the tile holds tokens).
    const int rt_mma = t64 + (wm * 32) / 64;
    const int rt_decay = t64 + (warp * 16) / 64;
    const bool rows_mma = wm * 32 < rows_i;
    const bool rows_decay = (warp * 16) / 64 * 64 < rows_i;

    // Starts the copies of step s into buffer s & 1.
    auto issue = [&](int s) {
        float* ta = smem + (s & 1) * BUF;
        float* tb = ta + TM * CO2_A;
        if (s < nslab) {
            const int n0 = s * 64;
#pragma unroll
            for (int hh = 0; hh < TM / 64; ++hh)
                if (hh * 64 < rows_i)
                    async_block64_v<VEC, NT>(ta + hh * 64 * CO2_A, CO2_A, cg + hh * 64 * tok_stride_b + n0,
                                             tok_stride_b, rows_i - hh * 64, dstate - n0, tid);
            async_block64_v<VEC, NT>(tb, CO2_A, st + n0, dstate, cols_p, dstate - n0, tid);
        } else {
            const int jt = s - nslab;
            const int j0 = jt * 64;
            const int rows_j = min(CO_TJ, valid_c - j0);
#pragma unroll
            for (int hh = 0; hh < TM / 64; ++hh) {
                const int rt = t64 + hh;
                if (jt <= rt && hh * 64 < rows_i)
                    async_block64_v<true, NT>(ta + hh * 64 * CO2_A, CO2_A, cbc + (rt * (rt + 1) / 2 + jt) * 4096, 64,
                                              64, 64, tid);
            }
            async_block64_v<VEC, NT>(tb, CO_XSTRIDE, xh + (t0 + j0) * tok_stride_x, tok_stride_x, rows_j, cols_p, tid);
            float* cs_j = tb + 64 * CO_XSTRIDE;
            float* dt_j = cs_j + 64;
            int* seq_j = (int*)(dt_j + 64);
            if (tid < 64) {
                const bool ok = tid < rows_j;
                cp_async4(cs_j + tid, dA_cumsum + cb + j0 + tid, ok, dA_cumsum);
                cp_async4(dt_j + tid, dt_out + cb + j0 + tid, ok, dt_out);
                if (has_seq) cp_async4(seq_j + tid, seq_row + t0 + j0 + tid, ok, seq_row);
            }
        }
    };

    float acc[2][4][4];
    zero_2xn(acc);

    // ldmatrix lane offset (floats) of an A fragment (16 rows x 8 k) of a row-major tile at
    // stride CO2_A (the scores; mma_slab_2xn computes its own).
    const int a_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * CO2_A + (lane >> 4) * 4;
    const unsigned smem_base = smem_addr(smem);
    // The decay pass: this thread's 4 columns and 8 rows of the TM x 64 scores tile.
    const int col4 = (lane & 15) << 2;
    const int rbase = warp * 16 + (lane >> 4);  // rows rbase + 2k, k < 8

    issue(0);
    cp_async_commit();
    float csl_r[8];
    int seq_r[8];
    for (int s = 0; s < nsteps; ++s) {
        cp_async_wait<0>();  // this thread's copies of step s have landed
        __syncthreads();     // everyone's have, and everyone is done with step s - 1's buffer
        if (s + 1 < nsteps) issue(s + 1);
        cp_async_commit();
        float* ta = smem + (s & 1) * BUF;
        float* tb = ta + TM * CO2_A;
        const unsigned ta_s = smem_base + (unsigned)((s & 1) * BUF) * 4u;
        if (s == 0) {
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const int r = rbase + 2 * k;
                csl_r[k] = r < rows_i ? cs_i[r] * LOG2E_F : NEG_INF_F;
                seq_r[k] = seq_i[r];
            }
        }
        if (s < nslab) {
            if (!rows_mma) continue;  // this warp's rows lie past the chunk's end
            const unsigned tb_s = ta_s + (unsigned)(TM * CO2_A) * 4u;
            mma_slab_2xn(acc, ta_s, tb_s, CO2_A, wm * 32, wn * 32, min(64, NK - s * 64), lane);
        } else {
            const int jt = s - nslab;
            if (s == nslab && nslab > 0 && split) {
                // exp(cs_i) = 2^R 2^(csl_i - R): 2^R now, the row factor before the diagonal tile
                const float f = ex2_approx(R);
#pragma unroll
                for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                    for (int nf = 0; nf < 4; ++nf)
#pragma unroll
                        for (int e = 0; e < 4; ++e) acc[mi][nf][e] *= f;
            } else if (s == nslab && nslab > 0) {
                const int seq_prev = (!has_seq || c == 0) ? 0 : seq_row[t0 - 1];
#pragma unroll
                for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) {
                        const int r = wm * 32 + mi * 16 + g + 8 * hf;
                        const float f = seq_i[r] == seq_prev ? expf(cs_i[r]) : 0.0f;
#pragma unroll
                        for (int nf = 0; nf < 4; ++nf) {
                            acc[mi][nf][2 * hf] *= f;
                            acc[mi][nf][2 * hf + 1] *= f;
                        }
                    }
            }
            const float* cs_j = tb + 64 * CO_XSTRIDE;
            if (split && jt == t64) {
                // Everything so far (the carried-state term times 2^R, the tiles left of the
                // block) takes its row factor 2^(csl_i - R) <= 1 (0 past the chunk's end).
#pragma unroll
                for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) {
                        const int r = wm * 32 + mi * 16 + g + 8 * hf;
                        const float f = r < rows_i ? ex2_approx(cs_i[r] * LOG2E_F - R) : 0.0f;
#pragma unroll
                        for (int nf = 0; nf < 4; ++nf) {
                            acc[mi][nf][2 * hf] *= f;
                            acc[mi][nf][2 * hf + 1] *= f;
                        }
                    }
            }
            if (split && jt < t64) {
                // A tile left of the block, without seq_idx: no mask, and the decay
                // 2^(csl_i - csl_j) = 2^(csl_i - R) 2^(R - csl_j) splits into a row factor
                // (applied above, later) and a column factor, both <= 1 since the cumsum does
                // not increase. The scores stay raw; x's rows take 2^(R - csl_j) dt'_j.
#pragma unroll
                for (int k = 0; k < 64 * 16 / NT; ++k) {
                    const int r = (tid >> 4) + (NT / 16) * k;
                    const float f = ex2_approx(R - cs_j[r] * LOG2E_F) * cs_j[64 + r];
                    float4* pv = reinterpret_cast<float4*>(tb + r * CO_XSTRIDE + ((tid & 15) << 2));
                    const float4 v = *pv;
                    *pv = make_float4(v.x * f, v.y * f, v.z * f, v.w * f);
                }
            } else if (jt <= rt_decay && rows_decay) {
            // The causal matrix, in place: this thread's 8 x 4 elements of the scores tile.
            const float4 cj = *reinterpret_cast<const float4*>(cs_j + col4);
            const float4 dj = *reinterpret_cast<const float4*>(cs_j + 64 + col4);
            const float cslj[4] = {cj.x * LOG2E_F, cj.y * LOG2E_F, cj.z * LOG2E_F, cj.w * LOG2E_F};
            const float dtj[4] = {dj.x, dj.y, dj.z, dj.w};
            int seqj[4] = {0, 0, 0, 0};
            if (has_seq) {
                const int4 sj = *reinterpret_cast<const int4*>(cs_j + 128 + col4);
                seqj[0] = sj.x;
                seqj[1] = sj.y;
                seqj[2] = sj.z;
                seqj[3] = sj.w;
            }
            // Column col4 + u (token j0 + col4 + u) is masked where it lies after row r (token
            // i0 + r), i.e. where u > i0 - j0 + r - col4 (only on tiles that cross the
            // diagonal), or where its seq differs (seq_i and seq_j are all 0 without seq_idx).
            // One code path for every case: no branch per tile kind.
            const int lim0 = i0 - jt * 64 + rbase - col4;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const int r = rbase + 2 * k;
                const int lim = lim0 + 2 * k;
                float4* pv = reinterpret_cast<float4*>(ta + r * CO2_A + col4);
                const float4 sv = *pv;
                const float sc[4] = {sv.x, sv.y, sv.z, sv.w};
                float v[4];
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const bool keep = u <= lim && seqj[u] == seq_r[k];
                    const float arg = keep ? csl_r[k] - cslj[u] : NEG_INF_F;
                    v[u] = sc[u] * ex2_approx(arg) * dtj[u];
                }
                *pv = make_float4(v[0], v[1], v[2], v[3]);
            }
            }
            __syncthreads();
            if (jt > rt_mma || !rows_mma) continue;  // this warp's rows lie above the tile or past the end
            const float* xb = tb + wn * 32 + g;
#pragma unroll
            for (int kk = 0; kk < CO_TJ; kk += 8) {
                unsigned a[2][4], bf[4][2];
#pragma unroll
                for (int mi = 0; mi < 2; ++mi)
                    ldmatrix_x4(a[mi], ta_s + (unsigned)((wm * 32 + mi * 16) * CO2_A + kk + a_off) * 4u);
#pragma unroll
                for (int nf = 0; nf < 4; ++nf) {
                    bf[nf][0] = __float_as_uint(xb[(kk + q) * CO_XSTRIDE + nf * 8]);
                    bf[nf][1] = __float_as_uint(xb[(kk + q + 4) * CO_XSTRIDE + nf * 8]);
                }
                mma_2xn(acc, a, bf);
            }
        }
    }

    // Epilogue: D skip, z gate, store (pairs of neighbouring columns). The block's own x rows
    // are those of its last one or two steps (column tiles t64 and t64 + 1), unscaled and still
    // in shared memory: the D term reads them there instead of from L2.
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int r = wm * 32 + mi * 16 + g + 8 * hf;
            if (r >= rows_i) continue;
            const float* x_own = smem + ((nslab + t64 + (r >> 6)) & 1) * BUF + TM * CO2_A + (r & 63) * CO_XSTRIDE;
            const i64 row_off = (i64)b * seqlen * tok_stride_x + (t0 + i0 + r) * tok_stride_x + (i64)h * headdim + p0;
#pragma unroll
            for (int nf = 0; nf < 4; ++nf) {
                const int col = wn * 32 + nf * 8 + 2 * q;
                float y[2] = {acc[mi][nf][2 * hf], acc[mi][nf][2 * hf + 1]};
                if (VEC) {
                    if (col >= cols_p) continue;  // cols_p is a multiple of 4: col + 1 is in too
                    const i64 off = row_off + col;
                    if (Dv != nullptr) {
                        const float2 xv = *reinterpret_cast<const float2*>(x_own + col);
                        const float d0 = d_per_channel ? Dv[(i64)h * headdim + p0 + col] : Dv[h];
                        const float d1 = d_per_channel ? Dv[(i64)h * headdim + p0 + col + 1] : d0;
                        y[0] += d0 * xv.x;
                        y[1] += d1 * xv.y;
                    }
                    if (z != nullptr) {
                        const float2 zv = *reinterpret_cast<const float2*>(z + off);
                        y[0] = y[0] * zv.x / (1.0f + expf(-zv.x));
                        y[1] = y[1] * zv.y / (1.0f + expf(-zv.y));
                    }
                    *reinterpret_cast<float2*>(out + off) = make_float2(y[0], y[1]);
                } else {
#pragma unroll
                    for (int u = 0; u < 2; ++u) {
                        if (col + u >= cols_p) continue;
                        const i64 off = row_off + col + u;
                        float yy = y[u];
                        if (Dv != nullptr) {
                            const float d = d_per_channel ? Dv[(i64)h * headdim + p0 + col + u] : Dv[h];
                            yy += d * x_own[col + u];
                        }
                        if (z != nullptr) {
                            const float zz = z[off];
                            yy = yy * zz / (1.0f + expf(-zz));
                        }
                        out[off] = yy;
                    }
                }
            }
        }
}

#define CO_CB_PARAMS                                                                                               \
    const float *__restrict__ x,             /* [batch, seqlen, nheads, headdim] */                                \
        const float *__restrict__ Cm,        /* [batch, seqlen, ngroups, dstate] */                                \
        const float *__restrict__ Dv,        /* [nheads] or [nheads, headdim] or null */                           \
        const float *__restrict__ z,         /* [batch, seqlen, nheads, headdim] or null */                        \
        const float *__restrict__ dt_out,    /* [batch, nheads, nchunks, chunk_size] */                            \
        const float *__restrict__ dA_cumsum, /* [batch, nheads, nchunks, chunk_size] */                            \
        const float *__restrict__ chunk_states, /* [batch, nchunks, nheads, headdim, dstate] */                    \
        const int *__restrict__ seq_idx,     /* [batch, seqlen] or null */                                         \
        const float *__restrict__ cbuf,      /* [batch, nchunks, ngroups, npairs, 64, 64] */                       \
        float *__restrict__ out,             /* [batch, seqlen, nheads, headdim] */                                \
        int seqlen, int nheads, int headdim, int ngroups, int dstate, int chunk_size, int nchunks,                \
        int d_per_channel, int has_initial_states, int tmax, int vec
#define CO_CB_ARGS                                                                                                 \
    smem, x, Cm, Dv, z, dt_out, dA_cumsum, chunk_states, seq_idx, cbuf, out, seqlen, nheads, headdim, ngroups,     \
        dstate, chunk_size, nchunks, d_per_channel, has_initial_states, tmax

// 64 rows per block, 128 threads (chunks of 64 tokens or fewer).
extern "C" __global__ void __launch_bounds__(128, 3) ssd_compute_out_cb(CO_CB_PARAMS)
{
    extern __shared__ __align__(16) float smem[];
    if (vec)
        compute_out_cb_body<true, 64>(CO_CB_ARGS);
    else
        compute_out_cb_body<false, 64>(CO_CB_ARGS);
}

// 128 rows per block, 256 threads, two blocks per SM (chunks over 64 tokens).
extern "C" __global__ void __launch_bounds__(256, 2) ssd_compute_out_cb128(CO_CB_PARAMS)
{
    extern __shared__ __align__(16) float smem[];
    if (vec)
        compute_out_cb_body<true, 128>(CO_CB_ARGS);
    else
        compute_out_cb_body<false, 128>(CO_CB_ARGS);
}

// 3b, the pair kernel (the host's choice where it applies, see docs/gpu.md): one block of 256
// threads (8 warps, two blocks per SM) per (batch b, chunk c, 128 rows i of the chunk, pair of
// units), a unit being a head h and 64 of its headdim columns p (units in head-major order:
// unit u = h * ceil(headdim / 64) + p / 64). Both units of a pair lie in one group (the host
// asks that a group's units be even in number), so they share every C slab and every score
// tile, which cross from L2 once for both instead of once per unit. Warp w owns rows
// 32 (w / 2) .. + 31 and unit w % 2: a 32 x 64 output tile.
// Its steps, 32 wide, flow through a 3-stage cp.async ring (one barrier per step):
//   steps over dstate (only when the carried state is not 0): C[i, n0:n0+32] (128 rows) and
//     S_u[p, n0:n0+32] of both units; acc += C S_u^T;
//   then acc *= exp(cs_i) (0 where seq(i) differs from the seq before the chunk);
//   steps over the chunk's columns j0 .. j0 + 31 up to the block's last row: the raw scores of
//     the block's rows (from cb, for the 64-row halves on or below the column tile), x_u[j, p]
//     of both units, cs_j and dt'_j of both heads, seq_j. Each warp turns its A fragments of
//     the raw scores into the causal matrix of its own head in registers (no pass over shared
//     memory, so both units read one copy of the scores):
//       M[i, j] = score * 2^((cs_i - cs_j) log2 e) * dt'_j  where j <= i and seq(j) = seq(i),
//       0 elsewhere (the exponent is -inf there, never evaluated on cs_i - cs_j);
//     left of the block without seq_idx the decay splits as in 3b above: the fragments take
//     the column factor 2^(R - csl_j) dt'_j, the rows 2^(csl_i - R) once the block's own
//     columns begin. A warp skips the steps right of its rows. At the step of the warp's own
//     rows the D skip term is added from the x stage (x is not read twice from L2).
// Raw f32 operands (the tensor cores truncate them to TF32), f32 accumulation.
// Dynamic shared memory (floats): 3 stages of [128 x 36 (C slab or scores), then either the S
// slabs of both units (2 x 64 x 36) or x (32 x 136, unit u at column 64 u), cs_j[2][32],
// dt_j[2][32], seq_j[32]], then cs_i[2][128], seq_i[128], then 11 base addresses (8 bytes
// each, 96 bytes reserved). Every copy is 16 bytes wide: headdim
// and dstate multiples of 4 (the host's condition).
#define CP_A 36
#define CP_X 136
#define CP_STAGE (2 * 128 * CP_A)

extern "C" __global__ void __launch_bounds__(256, 2) ssd_compute_out_pair(CO_CB_PARAMS)
{
    extern __shared__ __align__(16) float smem[];
    constexpr int TM = 128, NT = 256;
    float* cs_i = smem + 3 * CP_STAGE;  // [2][TM]: unit u's head at u * TM
    int* seq_i = (int*)(cs_i + 2 * TM);
    // The block's base addresses, kept in shared memory and read by the copy code of each
    // step: held in registers across the loop they spilled (128 registers per thread).
    const float** ptab = (const float**)(seq_i + TM);
    (void)vec;

    const int tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const int wm = warp >> 1, wn = warp & 1;  // rows 32 wm, unit wn
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
    const float* x_0 = x + (i64)b * seqlen * tok_stride_x + (i64)h_0 * headdim + p_0;
    const float* x_1 = x + (i64)b * seqlen * tok_stride_x + (i64)h_1 * headdim + p_1;
    const float* cg = Cm + (i64)b * seqlen * tok_stride_b + (i64)grp * dstate + (t0 + i0) * tok_stride_b;
    const float* st_0 = chunk_states + ((((i64)b * nchunks + c) * nheads + h_0) * headdim + p_0) * dstate;
    const float* st_1 = chunk_states + ((((i64)b * nchunks + c) * nheads + h_1) * headdim + p_1) * dstate;
    const int npairs = tmax * (tmax + 1) / 2;
    const float* cbc = cbuf + (((i64)b * nchunks + c) * ngroups + grp) * npairs * 4096;
    const int* seq_row = seq_idx != nullptr ? seq_idx + (i64)b * seqlen : nullptr;
    const bool has_seq = seq_row != nullptr;

    if (tid == 0) {
        ptab[0] = x_0 + t0 * tok_stride_x;
        ptab[1] = x_1 + t0 * tok_stride_x;
        ptab[2] = st_0;
        ptab[3] = st_1;
        ptab[4] = cg;
        ptab[5] = cbc;
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
    // This warp's unit.
    const int h = wn ? h_1 : h_0, p0 = wn ? p_1 : p_0, cols_p = wn ? cols_1 : cols_0;
    const float R = split ? dA_cumsum[(wn ? cb_1 : cb_0) + i0 - 1] * LOG2E_F : 0.0f;

    auto issue = [&](int s) {
        float* ta = smem + (s % 3) * CP_STAGE;
        float* tb = ta + TM * CP_A;
        if (s < nslab) {
            const int n0 = s * 32;
            async_rows<TM, 32, NT>(ta, CP_A, ptab[4] + n0, (unsigned)tok_stride_b, rows_i, dstate - n0, tid);
            async_rows<64, 32, NT>(tb, CP_A, ptab[2] + n0, dstate, cols_0, dstate - n0, tid);
            async_rows<64, 32, NT>(tb + 64 * CP_A, CP_A, ptab[3] + n0, dstate, cols_1, dstate - n0, tid);
        } else {
            const int j0 = (s - nslab) * 32;
            const int jt = j0 >> 6;
            const int rows_j = min(32, valid_c - j0);
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int rt = t64 + hh;
                if (jt <= rt && hh * 64 < rows_i)
                    async_rows<64, 32, NT>(ta + hh * 64 * CP_A, CP_A, ptab[5] + (rt * (rt + 1) / 2 + jt) * 4096 + (j0 & 63),
                                           64, 64, 32, tid);
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

    float acc[2][8][4];
    zero_2xn(acc);

    const int r_w = wm * 32;  // the warp's first row in the block
    const bool rows_mma = r_w < rows_i;
    const int a_off = ((lane & 7) + ((lane >> 3) & 1) * 8) * CP_A + (lane >> 4) * 4;
    const unsigned smem_base = smem_addr(smem);
    // The rows of this thread's fragments, r_w + 16 mi + g + 8 hf: log2(e) cs_i (-inf past the
    // chunk's end) and seq.
    float csl[2][2];
    int sq[2][2];

    __syncthreads();  // the base addresses
    issue(0);
    cp_async_commit();
    if (nsteps > 1) issue(1);
    cp_async_commit();
    for (int s = 0; s < nsteps; ++s) {
        cp_async_wait<1>();  // this thread's copies of step s have landed (s + 1 may still fly)
        __syncthreads();     // everyone's have, and everyone is done with step s - 1's stage
        if (s + 2 < nsteps) issue(s + 2);
        cp_async_commit();
        if (s == 0) {
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int r = r_w + 16 * mi + g + 8 * hf;
                    csl[mi][hf] = r < rows_i ? cs_i[wn * TM + r] * LOG2E_F : NEG_INF_F;
                    sq[mi][hf] = seq_i[r];
                }
        }
        if (!rows_mma) continue;  // this warp's rows lie past the chunk's end
        const unsigned ta_s = smem_base + (unsigned)((s % 3) * CP_STAGE) * 4u;
        if (s < nslab) {
            const unsigned tb_s = ta_s + (unsigned)(TM * CP_A) * 4u;
            mma_slab_2xn(acc, ta_s, tb_s, CP_A, r_w, wn * 64, min(32, NK - s * 32), lane);
            continue;
        }
        const int j0 = (s - nslab) * 32;
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
                        const int r = r_w + 16 * mi + g + 8 * hf;
                        const float f = sq[mi][hf] == seq_prev ? expf(cs_i[wn * TM + r]) : 0.0f;
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
        if (j0 > i0 + r_w) continue;  // every column of the step lies right of this warp's rows
        const float* tb = smem + (s % 3) * CP_STAGE + TM * CP_A;
        const float* vj = tb + 32 * CP_X;
        const float* cs_j = vj + wn * 32;
        const float* dt_j = vj + 64 + wn * 32;
        const int* seq_j = (const int*)(vj + 128);
        if (j0 == i0 + r_w && Dv != nullptr) {
            // The step of the warp's own rows: y += D x from the stage (unscaled x).
#pragma unroll
            for (int nf = 0; nf < 8; ++nf) {
                const int col = nf * 8 + 2 * q;
                if (col >= cols_p) continue;  // cols_p is a multiple of 4: col + 1 is in too
                const float d0 = d_per_channel ? Dv[(i64)h * headdim + p0 + col] : Dv[h];
                const float d1 = d_per_channel ? Dv[(i64)h * headdim + p0 + col + 1] : d0;
#pragma unroll
                for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) {
                        const float2 xv =
                            *reinterpret_cast<const float2*>(tb + (16 * mi + g + 8 * hf) * CP_X + wn * 64 + col);
                        acc[mi][nf][2 * hf] += d0 * xv.x;
                        acc[mi][nf][2 * hf + 1] += d1 * xv.y;
                    }
            }
        }
        const bool colf = split && j0 < i0;  // left of the block: the split decay, no mask
        // Column k of the step is masked for fragment row (mi, hf) where k > lim + 16 mi + 8 hf.
        const int lim = i0 + r_w - j0 + g;
        const float* xs = tb + wn * 64 + g;
#pragma unroll
        for (int kk = 0; kk < 32; kk += 8) {
            unsigned a[2][4], bf[8][2];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
                ldmatrix_x4(a[mi], ta_s + (unsigned)((r_w + mi * 16) * CP_A + kk + a_off) * 4u);
            const int k0 = kk + q, k1 = kk + q + 4;
            const float cj0 = cs_j[k0] * LOG2E_F, cj1 = cs_j[k1] * LOG2E_F;
            const float d0 = dt_j[k0], d1 = dt_j[k1];
            if (colf) {
                const float f0 = ex2_approx(R - cj0) * d0, f1 = ex2_approx(R - cj1) * d1;
#pragma unroll
                for (int mi = 0; mi < 2; ++mi) {
                    a[mi][0] = __float_as_uint(__uint_as_float(a[mi][0]) * f0);
                    a[mi][1] = __float_as_uint(__uint_as_float(a[mi][1]) * f0);
                    a[mi][2] = __float_as_uint(__uint_as_float(a[mi][2]) * f1);
                    a[mi][3] = __float_as_uint(__uint_as_float(a[mi][3]) * f1);
                }
            } else {
                const int s0 = has_seq ? seq_j[k0] : 0, s1 = has_seq ? seq_j[k1] : 0;
#pragma unroll
                for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) {
                        // a[mi][hf]: row 16 mi + g + 8 hf, column k0; a[mi][2 + hf]: column k1.
                        const int lm = lim + 16 * mi + 8 * hf;
                        const float arg0 = (k0 <= lm && s0 == sq[mi][hf]) ? csl[mi][hf] - cj0 : NEG_INF_F;
                        const float arg1 = (k1 <= lm && s1 == sq[mi][hf]) ? csl[mi][hf] - cj1 : NEG_INF_F;
                        a[mi][hf] = __float_as_uint(__uint_as_float(a[mi][hf]) * ex2_approx(arg0) * d0);
                        a[mi][2 + hf] = __float_as_uint(__uint_as_float(a[mi][2 + hf]) * ex2_approx(arg1) * d1);
                    }
            }
#pragma unroll
            for (int nf = 0; nf < 8; ++nf) {
                bf[nf][0] = __float_as_uint(xs[k0 * CP_X + nf * 8]);
                bf[nf][1] = __float_as_uint(xs[k1 * CP_X + nf * 8]);
            }
            mma_2xn(acc, a, bf);
        }
    }

    // Epilogue: z gate, store (pairs of neighbouring columns; the D term is in already).
    if (!rows_mma) return;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int r = r_w + 16 * mi + g + 8 * hf;
            if (r >= rows_i) continue;
            const i64 row_off = ((i64)b * seqlen + t0 + i0 + r) * tok_stride_x + (i64)h * headdim + p0;
#pragma unroll
            for (int nf = 0; nf < 8; ++nf) {
                const int col = nf * 8 + 2 * q;
                if (col >= cols_p) continue;
                float y0 = acc[mi][nf][2 * hf], y1 = acc[mi][nf][2 * hf + 1];
                if (z != nullptr) {
                    const float2 zv = *reinterpret_cast<const float2*>(z + row_off + col);
                    y0 = y0 * zv.x / (1.0f + expf(-zv.x));
                    y1 = y1 * zv.y / (1.0f + expf(-zv.y));
                }
                *reinterpret_cast<float2*>(out + row_off + col) = make_float2(y0, y1);
            }
        }
}
