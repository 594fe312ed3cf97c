// Stage 3: the output of every chunk; the kernel that computes its own scores (version 1's
// stage 3, and version 2's for chunk sizes outside 64..=512, see docs/gpu.md).
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

__device__ __forceinline__ void compute_out_body(
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
    SSD_DYNAMIC_SMEM(smem);
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

// The parameters of ssd_compute_out (Rust: ComputeOutParams).
struct ComputeOutParams {
    const float* x;             // [batch, seqlen, nheads, headdim]
    const float* Bm;            // [batch, seqlen, ngroups, dstate]
    const float* Cm;            // [batch, seqlen, ngroups, dstate]
    const float* Dv;            // [nheads] or [nheads, headdim] or null
    const float* z;             // [batch, seqlen, nheads, headdim] or null
    const float* dt_out;        // [batch, nheads, nchunks, chunk_size]
    const float* dA_cumsum;     // [batch, nheads, nchunks, chunk_size]
    const float* chunk_states;  // [batch, nchunks, nheads, headdim, dstate]
    const int* seq_idx;         // [batch, seqlen] or null
    float* out;                 // [batch, seqlen, nheads, headdim]
    int seqlen, nheads, headdim, ngroups, dstate, chunk_size, nchunks;
    int d_per_channel, has_initial_states;
};
static_assert(sizeof(ComputeOutParams) == 120, "ComputeOutParams: the Rust struct has 120 bytes");

// The dynamic shared memory of ssd_compute_out for dstate up to 64 NSLAB, as the body above
// carves it (NS = 64 NSLAB + 4).
template <int NSLAB>
struct ComputeOutSmem {
    float c_tile[CO_TM][64 * NSLAB + 4];
    float b_tile[CO_TJ][64 * NSLAB + 4];
    float x_tile[CO_TJ][CO_XSTRIDE];
    float stage[4][16][CO_SSTRIDE];
    float cs_i[CO_TM], cs_j[CO_TJ], dt_j[CO_TJ];
    int seq_i[CO_TM], seq_j[CO_TJ];
};
static_assert(sizeof(ComputeOutSmem<4>) == (2 * CO_TM * 260 + CO_TJ * CO_XSTRIDE + 4 * 16 * CO_SSTRIDE + 5 * 64) * 4,
              "ssd_compute_out's layout");

extern "C" __global__ void __launch_bounds__(CO_THREADS) ssd_compute_out(const ComputeOutParams p) {
    compute_out_body(p.x, p.Bm, p.Cm, p.Dv, p.z, p.dt_out, p.dA_cumsum, p.chunk_states, p.seq_idx, p.out, p.seqlen,
                     p.nheads, p.headdim, p.ngroups, p.dstate, p.chunk_size, p.nchunks, p.d_per_channel,
                     p.has_initial_states);
}
SSD_LAYOUT(ssd_compute_out, ComputeOutParams, sizeof(ComputeOutSmem<1>), sizeof(ComputeOutSmem<2>),
           sizeof(ComputeOutSmem<3>), sizeof(ComputeOutSmem<4>));
