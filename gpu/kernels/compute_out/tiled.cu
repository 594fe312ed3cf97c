// Stage 3, 3b. One block of 2 TM threads (TM / 16 warps) per (batch b, chunk c, TM rows i of the chunk,
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
        const int tid = tid_fresh();  // the copy offsets recomputed here, not held across the loop
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

// The parameters of ssd_compute_out_cb, ssd_compute_out_cb128 and ssd_compute_out_pair (Rust:
// ComputeOutCbParams).
struct ComputeOutCbParams {
    const float* x;             // [batch, seqlen, nheads, headdim]
    const float* Cm;            // [batch, seqlen, ngroups, dstate]
    const float* Dv;            // [nheads] or [nheads, headdim] or null
    const float* z;             // [batch, seqlen, nheads, headdim] or null
    const float* dt_out;        // [batch, nheads, nchunks, chunk_size]
    const float* dA_cumsum;     // [batch, nheads, nchunks, chunk_size]
    const float* chunk_states;  // [batch, nchunks, nheads, headdim, dstate]
    const int* seq_idx;         // [batch, seqlen] or null
    const float* cbuf;          // [batch, nchunks, ngroups, npairs, 64, 64]
    float* out;                 // [batch, seqlen, nheads, headdim]
    int seqlen, nheads, headdim, ngroups, dstate, chunk_size, nchunks;
    int d_per_channel, has_initial_states, tmax;
    int vec;  // 1: 16-byte copies (the pair kernel's only path)
};
static_assert(sizeof(ComputeOutCbParams) == 128, "ComputeOutCbParams: the Rust struct has 128 bytes");
#define CO_CB_FIELDS                                                                                              \
    smem, p.x, p.Cm, p.Dv, p.z, p.dt_out, p.dA_cumsum, p.chunk_states, p.seq_idx, p.cbuf, p.out, p.seqlen, p.nheads, \
        p.headdim, p.ngroups, p.dstate, p.chunk_size, p.nchunks, p.d_per_channel, p.has_initial_states, p.tmax

// 3b's dynamic shared memory over TM rows per block, as the body above carves it.
template <int TM>
struct ComputeOutCbSmem {
    struct Buf {
        float a[TM][CO2_A];           // C slab or scores
        float b[64][CO_XSTRIDE];      // S slab (at stride 68) or x (at 72)
        float cs_j[64], dt_j[64];
        int seq_j[64];
    } buf[2];
    float cs_i[TM];
    int seq_i[TM];
};
static_assert(sizeof(ComputeOutCbSmem<64>::Buf) == CO2_BUF(64) * 4, "3b's buffer");
static_assert(sizeof(ComputeOutCbSmem<128>) == (2 * CO2_BUF(128) + 2 * 128) * 4, "3b's layout");

// 64 rows per block, 128 threads (chunks of 64 tokens or fewer).
extern "C" __global__ void __launch_bounds__(128, 3) ssd_compute_out_cb(const ComputeOutCbParams p)
{
    SSD_DYNAMIC_SMEM(smem);
    if (p.vec)
        compute_out_cb_body<true, 64>(CO_CB_FIELDS);
    else
        compute_out_cb_body<false, 64>(CO_CB_FIELDS);
}
SSD_LAYOUT_FIXED(ssd_compute_out_cb, ComputeOutCbParams, sizeof(ComputeOutCbSmem<64>));

// 128 rows per block, 256 threads, two blocks per SM (chunks over 64 tokens).
extern "C" __global__ void __launch_bounds__(256, 2) ssd_compute_out_cb128(const ComputeOutCbParams p)
{
    SSD_DYNAMIC_SMEM(smem);
    if (p.vec)
        compute_out_cb_body<true, 128>(CO_CB_FIELDS);
    else
        compute_out_cb_body<false, 128>(CO_CB_FIELDS);
}
SSD_LAYOUT_FIXED(ssd_compute_out_cb128, ComputeOutCbParams, sizeof(ComputeOutCbSmem<128>));
