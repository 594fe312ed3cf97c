// Stage 3, 3b, the pair kernel (the host's choice where it applies, see docs/gpu.md): one block of 256
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
// cs_i and seq_i of the block's rows come with step 0's copies (one round trip fewer before the
// first step).
// Raw f32 operands (the tensor cores truncate them to TF32), f32 accumulation.
// Dynamic shared memory (floats): 3 stages of [128 x 36 (C slab or scores), then either the S
// slabs of both units (2 x 64 x 36) or x (32 x 136, unit u at column 64 u), cs_j[2][32],
// dt_j[2][32], seq_j[32]], then cs_i[2][128], seq_i[128], then 11 base addresses (8 bytes
// each, 96 bytes reserved). Every copy is 16 bytes wide: headdim
// and dstate multiples of 4 (the host's condition).
#define CP_A 36
#define CP_X 136
#define CP_STAGE (2 * 128 * CP_A)

__device__ __forceinline__ void compute_out_pair_body(
    const float* __restrict__ x, const float* __restrict__ Cm, const float* __restrict__ Dv,
    const float* __restrict__ z, const float* __restrict__ dt_out, const float* __restrict__ dA_cumsum,
    const float* __restrict__ chunk_states, const int* __restrict__ seq_idx, const float* __restrict__ cbuf,
    float* __restrict__ out, int seqlen, int nheads, int headdim, int ngroups, int dstate, int chunk_size,
    int nchunks, int d_per_channel, int has_initial_states, int tmax)
{
    SSD_DYNAMIC_SMEM(smem);
    constexpr int TM = 128, NT = 256;
    float* cs_i = smem + 3 * CP_STAGE;  // [2][TM]: unit u's head at u * TM
    int* seq_i = (int*)(cs_i + 2 * TM);
    // The block's base addresses, kept in shared memory and read by the copy code of each
    // step: held in registers across the loop they spilled (128 registers per thread).
    const float** ptab = (const float**)(seq_i + TM);

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
    {
        // cs_i of both units and seq_i join step 0's copies (zeros past the chunk's end).
        // Written out in both pair kernels: as one shared helper it moved ptxas's register
        // allocation (bf16: 16 -> 32 or 40 bytes of spills, version 39 in docs/perf-history.md).
        static_assert(NT == 2 * TM, "one cs_i entry per thread");
        const int u = tid / TM, rr = tid & (TM - 1);
        cp_async4(&cs_i[tid], dA_cumsum + (u ? cb_1 : cb_0) + i0 + rr, rr < rows_i, dA_cumsum);
        if (tid < TM) {
            if (has_seq)
                cp_async4(&seq_i[tid], seq_row + t0 + i0 + tid, tid < rows_i, seq_row);
            else
                seq_i[tid] = 0;
        }
    }

    const int NK = ((dstate + 7) / 8) * 8;
    const int nslab = (c > 0 || has_initial_states) ? (dstate + 31) / 32 : 0;
    const int nsteps = nslab + (min(i0 + TM, valid_c) + 31) / 32;
    const bool split = !has_seq && i0 > 0;
    // This warp's unit.
    const int h = wn ? h_1 : h_0, p0 = wn ? p_1 : p_0, cols_p = wn ? cols_1 : cols_0;
    const float R = split ? dA_cumsum[(wn ? cb_1 : cb_0) + i0 - 1] * LOG2E_F : 0.0f;

    auto issue = [&](int s) {
        const int tid = tid_fresh();  // the copy offsets recomputed here, not held across the loop
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

// The pair kernel's dynamic shared memory, as the body above carves it.
struct ComputeOutPairSmem {
    struct Stage {
        float a[128][CP_A];  // C slab or scores
        union {
            float s[2][64][CP_A];  // the S slabs of both units
            struct {
                float x[32][CP_X];  // unit u at column 64 u
                float cs_j[2][32], dt_j[2][32];
                int seq_j[32];
            } x;
        } b;
    } stage[3];
    float cs_i[2][128];
    int seq_i[128];
    const float* base[12];  // the block's 11 base addresses
};
static_assert(sizeof(ComputeOutPairSmem::Stage) == CP_STAGE * 4, "the pair kernel's stage");
static_assert(sizeof(ComputeOutPairSmem) == (3 * CP_STAGE + 3 * 128) * 4 + 96, "the pair kernel's layout");

// Every copy is 16 bytes wide: `vec` is 1 (the host's condition) and not read.
extern "C" __global__ void __launch_bounds__(256, 2) ssd_compute_out_pair(const ComputeOutCbParams p)
{
    compute_out_pair_body(p.x, p.Cm, p.Dv, p.z, p.dt_out, p.dA_cumsum, p.chunk_states, p.seq_idx, p.cbuf, p.out,
                          p.seqlen, p.nheads, p.headdim, p.ngroups, p.dstate, p.chunk_size, p.nchunks,
                          p.d_per_channel, p.has_initial_states, p.tmax);
}
SSD_LAYOUT_FIXED(ssd_compute_out_pair, ComputeOutCbParams, sizeof(ComputeOutPairSmem));

// What the host's choices of kernel rely on, checked where the layouts are written:
// 228 KB of shared memory per Hopper SM, 1 KB of it reserved per block; 227 KB per block on
// Hopper, 163 KB on an A100, 99 KB on compute capability 8.6 and 8.9.
// Three blocks per Hopper SM for the 64-row and 64-column kernels, which fit every device.
static_assert(3 * (sizeof(ComputeOutCbSmem<64>) + 1024) <= 228 * 1024 && sizeof(ComputeOutCbSmem<64>) <= 99 * 1024, "");
static_assert(3 * (sizeof(ChunkStateLocalSmem<64>) + 1024) <= 228 * 1024 && sizeof(ChunkStateLocalSmem<64>) <= 99 * 1024, "");
static_assert(3 * (sizeof(ChunkCbSmem) + 1024) <= 228 * 1024 && sizeof(ChunkCbSmem) <= 99 * 1024, "");
// Two blocks of 256 threads per Hopper SM for the wide state kernel and the 128-row output
// kernel, which fit an A100.
static_assert(2 * (sizeof(ChunkStateLocalSmem<128>) + 1024) <= 228 * 1024 && sizeof(ChunkStateLocalSmem<128>) <= 163 * 1024, "");
static_assert(2 * (sizeof(ComputeOutCbSmem<128>) + 1024) <= 228 * 1024 && sizeof(ComputeOutCbSmem<128>) <= 163 * 1024, "");
// The pair kernels fit an A100; the self-scoring output kernel fits Hopper at MAX_DSTATE (256).
static_assert(sizeof(ComputeOutPairSmem) <= 163 * 1024 && sizeof(ChunkStateLocalPairSmem) <= 163 * 1024, "");
static_assert(sizeof(ComputeOutSmem<4>) <= 227 * 1024, "");
