// Stage 3 on Hopper with bf16 inputs and output, ssd_compute_out_wg_bf16: the copies on the copy
// engine (TMA), the products on warpgroup products (wgmma), sm_90a only (the body is empty for
// every other target and in the CPU emulation; the host chooses this kernel only on Hopper and
// only where it serves, see docs/gpu.md). The contract, operands and rounding points are those
// of ssd_compute_out_pair_bf16 (bf16.cu): the decayed scores rounded to bf16 (cb.to(x.dtype)),
// the carried state read as stage 2's bf16 copy (states_lo), f32 accumulation. It computes the
// scores C B^T itself (bf16 operands, f32 accumulation, as 3a does), so 3a does not run.
//
// It serves headdim 64, dstate 128, chunks of 128 or 256 tokens, no seq_idx,
// and an even number of heads per group. One block of 384 threads (three warpgroups, one block
// per SM) per (batch, chunk, pair of heads h0 = 2 blockIdx.y, h0 + 1 of one group); the chunk's
// T = ceil(valid / 64) token tiles of 64.
//
// Warpgroup 0 is the producer (40 registers a thread, setmaxnreg; the consumers take 232): its
// first thread issues the block's copies at the start, as TMA boxes of 64 x 64 bf16 (8 KB,
// 128-byte rows, CU_TENSOR_MAP_SWIZZLE_128B: 16-byte piece p of row r at p ^ (r % 8)), onto one
// mbarrier per piece: the carried states of both heads (bar_s, when there is one), each
// consumer's first C tile (bar_c[k], phase 0), then for each token tile t the B tile (bar_b[t])
// and both heads' x tiles (bar_x[t]). Rows past seqlen arrive as zeros. Its 128 threads stage
// log2(e) dA_cumsum and dt' of both heads in shared memory (bar_t). Then it exits.
//
// Warpgroups 1 and 2 (k = 0, 1) each own row tiles: T - 1 - k where that is above 1, then k (T
// = 4: {3, 0} and {2, 1}, the same causal work each). Each has one C slot: once the last
// product on its first row tile's C has completed, its first thread loads the second row
// tile's C there (phase 1 of bar_c[k]) while the row's last products run. Warp w of a
// warpgroup holds rows 16 w .. 16 w + 15 of the row tile r (the wgmma accumulator layout). For
// each head h of the pair, with csl = log2(e) dA_cumsum and R = csl[64 r - 1] (0 for r = 0):
//   acc_h  = C_r bf16(S_h)^T                  (2 x 4 wgmma m64n64k16, both operands K-major)
//   Sc     = C_r B_0^T                        (8 wgmma, f32, shared by both heads; same group)
//   acc_h *= 2^R
//   for each token tile j < r, while Sc' = C_r B_{j+1}^T runs:
//     A_h    = bf16(Sc 2^(R - csl_j) dt'_j)   (registers, the m16n8k16 A layout; both factors
//                                              <= 1: the split decay of the pair kernels)
//     acc_h += A_h x_{h, j}                   (4 wgmma, A from registers, x N-major)
//     Sc = Sc'
//   acc_h *= 2^(csl_i - R)
//   the diagonal tile j = r: A_h = bf16(Sc [j <= i] 2^(csl_i - csl_j) dt'_j), acc_h += A_h x_{h,r}
//   epilogue: + D x_i (x from the stage), the z gate, out stored as bf16 pairs.
// Each group of products is waited for before its registers are touched.
//
// Shared memory: ComputeOutWgBf16Smem, every tile 8 KB and 1024-byte aligned (the swizzle's
// atom), the block's base aligned up to 1024 bytes at run time (the layout adds the slack).
#define WGO_TILES 4  // token tiles of 64 per chunk, at most
struct ComputeOutWgBf16Smem {
    bf16_t x[WGO_TILES][2][64 * 64];  // [token tile][head]: x rows, 64 headdim columns
    bf16_t s[2][2][64 * 64];          // [head][dstate half]: bf16(S_h)[p][64 half ..]
    bf16_t b[WGO_TILES][2][64 * 64];  // [token tile][dstate half]: B rows
    bf16_t c[2][2][64 * 64];          // [consumer warpgroup][dstate half]: C rows of its row tile
    float csl[2][256];                // [head][token]: log2(e) dA_cumsum (-inf past the chunk's end)
    float dt[2][256];                 // [head][token]: dt' (0 past the chunk's end)
    unsigned long long bar_s, bar_c[2], bar_b[WGO_TILES], bar_x[WGO_TILES], bar_t;
};
static_assert(sizeof(bf16_t) * 64 * 64 == 8192, "8 KB tiles, each 1024-byte aligned in the struct");
static_assert(sizeof(ComputeOutWgBf16Smem) + 1024 <= 227 * 1024, "one block per Hopper SM, with the alignment slack");

// A TMA descriptor (CUtensorMap), filled by the host (cuTensorMapEncodeTiled), passed by value.
struct __align__(128) TmaDesc {
    unsigned long long opaque[16];
};

// The parameters of ssd_compute_out_wg_bf16 (Rust: ComputeOutWgParams), a __grid_constant__
// struct: the descriptors' addresses are taken in the parameter space.
struct ComputeOutWgBf16Params {
    TmaDesc tm_x;  // x: [batch][seqlen][nheads * headdim] bf16, box 64 x 64 x 1
    TmaDesc tm_c;  // C: [batch][seqlen][ngroups * dstate] bf16, box 64 x 64 x 1
    TmaDesc tm_b;  // B: the same
    TmaDesc tm_s;  // states_lo: [batch * nchunks * nheads][headdim][dstate] bf16, box 64 x 64 x 1
    const float* Dv;         // [nheads] or [nheads, headdim] or null
    const bf16_t* z;         // [batch, seqlen, nheads, headdim] or null
    const float* dt_out;     // [batch, nheads, nchunks, chunk_size]
    const float* dA_cumsum;  // [batch, nheads, nchunks, chunk_size]
    bf16_t* out;             // [batch, seqlen, nheads, headdim]
    int seqlen, nheads, headdim, ngroups, dstate, chunk_size, nchunks;
    int d_per_channel, has_initial_states;
};
static_assert(sizeof(ComputeOutWgBf16Params) == 640, "the Rust struct's size (ComputeOutWgParams)");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// sc = C_r B_j^T over dstate 128 (8 products, K-major operands: the C slot at c_s, the B tile at
// b_s, each two 8 KB dstate halves), issued, not committed.
__device__ __forceinline__ void scores_ss(float (&sc)[8][4], unsigned c_s, unsigned b_s) {
#pragma unroll
    for (int k = 0; k < 2; ++k)
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            wgmma_bf16_ss(sc, wgmma_desc_kmajor_sw128(c_s + k * 8192 + 32 * kk),
                          wgmma_desc_kmajor_sw128(b_s + k * 8192 + 32 * kk), (k | kk) != 0);
}
#endif

extern "C" __global__ void __launch_bounds__(384, 1)
    ssd_compute_out_wg_bf16(const __grid_constant__ ComputeOutWgBf16Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    SSD_DYNAMIC_SMEM(smem_raw);
    const unsigned raw = smem_addr(smem_raw);
    const unsigned base = (raw + 1023u) & ~1023u;
    ComputeOutWgBf16Smem& sm =
        *reinterpret_cast<ComputeOutWgBf16Smem*>(reinterpret_cast<char*>(smem_raw) + (base - raw));
    constexpr unsigned TILE = 8192;
    const int tid = threadIdx.x;
    const int ch = blockIdx.x, b = blockIdx.z;
    const int h0 = 2 * blockIdx.y;
    const int grp = h0 / (p.nheads / p.ngroups);
    const i64 t0 = (i64)ch * p.chunk_size;
    const int valid_c = (int)min((i64)p.chunk_size, (i64)p.seqlen - t0);
    const int T = (valid_c + 63) / 64;
    const bool has_state = ch > 0 || p.has_initial_states;
    const unsigned bar_s = smem_addr(&sm.bar_s), bar_t = smem_addr(&sm.bar_t);
    const i64 hstride = (i64)p.nchunks * p.chunk_size;
    const i64 cb0 = (((i64)b * p.nheads + h0) * p.nchunks + ch) * p.chunk_size;
    // Warpgroup k's row tiles: T - 1 - k first where it is above 1 (the longer one, so that its
    // C tile's slot is reloaded while its last products run), then k.
    auto rows_of = [&](int k, int& first, int& second) {
        const int hi = T - 1 - k;
        first = (hi > 1) ? hi : (k < T ? k : -1);
        second = (hi > 1) ? k : -1;
    };

    if (tid == 0) {
        mbar_init(bar_s, 1);
        mbar_init(bar_t, 128);
#pragma unroll
        for (int k = 0; k < 2; ++k) mbar_init(smem_addr(&sm.bar_c[k]), 1);
#pragma unroll
        for (int t = 0; t < WGO_TILES; ++t) {
            mbar_init(smem_addr(&sm.bar_b[t]), 1);
            mbar_init(smem_addr(&sm.bar_x[t]), 1);
        }
        mbar_init_fence();
    }
    __syncthreads();

    if (tid < 128) {
        setmaxnreg_dec<40>();
        // The producer: thread 0 issues the copies, in the order the consumers need them...
        if (tid == 0) {
            if (has_state) {
                mbar_expect_tx(bar_s, 4 * TILE);
                const int row = (b * p.nchunks + ch) * p.nheads + h0;
#pragma unroll
                for (int hh = 0; hh < 2; ++hh)
#pragma unroll
                    for (int k = 0; k < 2; ++k) tma_load_3d(smem_addr(&sm.s[hh][k][0]), &p.tm_s, 64 * k, 0, row + hh, bar_s);
            }
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                int first, second;
                rows_of(k, first, second);
                if (first < 0) continue;
                const unsigned bc = smem_addr(&sm.bar_c[k]);
                mbar_expect_tx(bc, 2 * TILE);
#pragma unroll
                for (int hk = 0; hk < 2; ++hk)
                    tma_load_3d(smem_addr(&sm.c[k][hk][0]), &p.tm_c, grp * p.dstate + 64 * hk, (int)t0 + 64 * first, b,
                                bc);
            }
            for (int t = 0; t < T; ++t) {
                const int tok = (int)t0 + 64 * t;
                const unsigned bb = smem_addr(&sm.bar_b[t]), bx = smem_addr(&sm.bar_x[t]);
                mbar_expect_tx(bb, 2 * TILE);
                mbar_expect_tx(bx, 2 * TILE);
#pragma unroll
                for (int k = 0; k < 2; ++k)
                    tma_load_3d(smem_addr(&sm.b[t][k][0]), &p.tm_b, grp * p.dstate + 64 * k, tok, b, bb);
#pragma unroll
                for (int hh = 0; hh < 2; ++hh)
                    tma_load_3d(smem_addr(&sm.x[t][hh][0]), &p.tm_x, (h0 + hh) * p.headdim, tok, b, bx);
            }
        }
        // ... and all 128 threads stage log2(e) dA_cumsum and dt' of both heads.
        for (int e = tid; e < 2 * 256; e += 128) {
            const int hh = e >> 8, j = e & 255;
            const bool ok = j < valid_c;
            sm.csl[hh][j] = ok ? p.dA_cumsum[cb0 + hh * hstride + j] * LOG2E_F : NEG_INF_F;
            sm.dt[hh][j] = ok ? p.dt_out[cb0 + hh * hstride + j] : 0.0f;
        }
        mbar_arrive(bar_t);
        return;
    }

    setmaxnreg_inc<232>();
    const int wg = tid / 128 - 1;
    const int w = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const unsigned tok_stride_x = (unsigned)(p.nheads * p.headdim);
    const unsigned c_s = smem_addr(&sm.c[wg][0][0]);
    int rfirst, rsecond;
    rows_of(wg, rfirst, rsecond);
    mbar_wait(bar_t, 0);

    for (int pass = 0; pass < 2; ++pass) {
        const int r = pass == 0 ? rfirst : rsecond;
        if (r < 0) break;
        mbar_wait(smem_addr(&sm.bar_c[wg]), pass);
        float R[2], csl[2][2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            R[hh] = r > 0 ? sm.csl[hh][64 * r - 1] : 0.0f;
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) csl[hh][hf] = sm.csl[hh][64 * r + 16 * w + g + 8 * hf];
        }
        float acc[2][8][4];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
            for (int nf = 0; nf < 8; ++nf)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[hh][nf][e] = 0.0f;
        // The state products and the scores of token tile 0, one group.
        float sc[8][4], sn[8][4];
        mbar_wait(smem_addr(&sm.bar_b[0]), 0);
        if (has_state) mbar_wait(bar_s, 0);
        wgmma_fence();
        if (has_state) {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const unsigned s_s = smem_addr(&sm.s[hh][0][0]);
#pragma unroll
                for (int k = 0; k < 2; ++k)
#pragma unroll
                    for (int kk = 0; kk < 4; ++kk)
                        wgmma_bf16_ss(acc[hh], wgmma_desc_kmajor_sw128(c_s + k * TILE + 32 * kk),
                                      wgmma_desc_kmajor_sw128(s_s + k * TILE + 32 * kk), (k | kk) != 0);
            }
        }
        scores_ss(sc, c_s, smem_addr(&sm.b[0][0][0]));
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_hold(acc[0]);
        wgmma_hold(acc[1]);
        wgmma_hold(sc);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const float f = ex2_approx(R[hh]);
#pragma unroll
            for (int nf = 0; nf < 8; ++nf)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[hh][nf][e] *= f;
        }

        // The token tiles left of the row tile: the scores of tile jt + 1 run on the tensor
        // cores while tile jt's are decayed and multiplied by x.
        for (int jt = 0; jt < r; ++jt) {
            mbar_wait(smem_addr(&sm.bar_b[jt + 1]), 0);
            mbar_wait(smem_addr(&sm.bar_x[jt]), 0);
            wgmma_fence();
            scores_ss(sn, c_s, smem_addr(&sm.b[jt + 1][0][0]));
            wgmma_commit();
            unsigned a[2][4][4];
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
                for (int nf = 0; nf < 8; ++nf) {
                    const int jl = 8 * nf + 2 * q;  // this thread's columns jl, jl + 1 of the tile
                    const float2 cj = *reinterpret_cast<const float2*>(&sm.csl[hh][64 * jt + jl]);
                    const float2 dj = *reinterpret_cast<const float2*>(&sm.dt[hh][64 * jt + jl]);
                    const float f0 = ex2_approx(R[hh] - cj.x) * dj.x, f1 = ex2_approx(R[hh] - cj.y) * dj.y;
                    a[hh][nf >> 1][2 * (nf & 1)] = pack_bf16x2(sc[nf][0] * f0, sc[nf][1] * f1);
                    a[hh][nf >> 1][2 * (nf & 1) + 1] = pack_bf16x2(sc[nf][2] * f0, sc[nf][3] * f1);
                }
                const unsigned x_s = smem_addr(&sm.x[jt][hh][0]);
                wgmma_fence();
#pragma unroll
                for (int ks = 0; ks < 4; ++ks)
                    wgmma_bf16_rs_nmajor(acc[hh], a[hh][ks], wgmma_desc_nmajor_sw128(x_s + 2048 * ks));
                wgmma_commit();
            }
            wgmma_wait<0>();
            wgmma_hold(acc[0]);
            wgmma_hold(acc[1]);
            wgmma_hold(sn);
#pragma unroll
            for (int nf = 0; nf < 8; ++nf)
#pragma unroll
                for (int e = 0; e < 4; ++e) sc[nf][e] = sn[nf][e];
        }
        if (pass == 0 && rsecond >= 0 && tid % 128 == 0) {
            // This warpgroup's C slot is read no more in this row tile (every product on it has
            // completed): its second row tile's C tile comes in meanwhile (phase 1 of bar_c[wg]).
            const unsigned bc = smem_addr(&sm.bar_c[wg]);
            mbar_expect_tx(bc, 2 * TILE);
#pragma unroll
            for (int hk = 0; hk < 2; ++hk)
                tma_load_3d(c_s + hk * TILE, &p.tm_c, grp * p.dstate + 64 * hk, (int)t0 + 64 * rsecond, b, bc);
        }

        // Everything so far takes its row factor 2^(csl_i - R) (0 past the chunk's end); then the
        // diagonal tile, masked.
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const float f = ex2_approx(csl[hh][hf] - R[hh]);
#pragma unroll
                for (int nf = 0; nf < 8; ++nf) {
                    acc[hh][nf][2 * hf] *= f;
                    acc[hh][nf][2 * hf + 1] *= f;
                }
            }
        mbar_wait(smem_addr(&sm.bar_x[r]), 0);
        {
            unsigned a[2][4][4];
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
                for (int nf = 0; nf < 8; ++nf) {
                    const int jl = 8 * nf + 2 * q;
                    const float2 cj = *reinterpret_cast<const float2*>(&sm.csl[hh][64 * r + jl]);
                    const float2 dj = *reinterpret_cast<const float2*>(&sm.dt[hh][64 * r + jl]);
                    float f[2][2];  // [hf][e]
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) {
                        const int il = 16 * w + g + 8 * hf;
                        f[hf][0] = jl <= il ? ex2_approx(csl[hh][hf] - cj.x) * dj.x : 0.0f;
                        f[hf][1] = jl + 1 <= il ? ex2_approx(csl[hh][hf] - cj.y) * dj.y : 0.0f;
                    }
                    a[hh][nf >> 1][2 * (nf & 1)] = pack_bf16x2(sc[nf][0] * f[0][0], sc[nf][1] * f[0][1]);
                    a[hh][nf >> 1][2 * (nf & 1) + 1] = pack_bf16x2(sc[nf][2] * f[1][0], sc[nf][3] * f[1][1]);
                }
                const unsigned x_s = smem_addr(&sm.x[r][hh][0]);
                wgmma_fence();
#pragma unroll
                for (int ks = 0; ks < 4; ++ks)
                    wgmma_bf16_rs_nmajor(acc[hh], a[hh][ks], wgmma_desc_nmajor_sw128(x_s + 2048 * ks));
                wgmma_commit();
            }
            wgmma_wait<0>();
            wgmma_hold(acc[0]);
            wgmma_hold(acc[1]);
        }

        // Epilogue: y += D x_i, the z gate (y z sigmoid(z), sigmoid through ex2.approx), out as
        // bf16 pairs.
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int h = h0 + hh;
            const char* xt = reinterpret_cast<const char*>(&sm.x[r][hh][0]);
            const float dh = (p.Dv != nullptr && !p.d_per_channel) ? p.Dv[h] : 0.0f;
#pragma unroll
            for (int nf = 0; nf < 8; ++nf) {
                const int col = 8 * nf + 2 * q;
                float d0 = dh, d1 = dh;
                if (p.Dv != nullptr && p.d_per_channel) {
                    const float2 dv = *reinterpret_cast<const float2*>(p.Dv + (i64)h * p.headdim + col);
                    d0 = dv.x;
                    d1 = dv.y;
                }
#pragma unroll
                for (int hf = 0; hf < 2; ++hf) {
                    const int il = 16 * w + g + 8 * hf;
                    const int i = 64 * r + il;
                    if (i >= valid_c) continue;
                    const i64 off = ((i64)b * p.seqlen + t0 + i) * tok_stride_x + (i64)h * p.headdim + col;
                    const unsigned xv =
                        *reinterpret_cast<const unsigned*>(xt + il * 128 + ((nf ^ (il & 7)) << 4) + 4 * q);
                    float y0 = acc[hh][nf][2 * hf] + d0 * bf16_lo(xv);
                    float y1 = acc[hh][nf][2 * hf + 1] + d1 * bf16_hi(xv);
                    if (p.z != nullptr) {
                        const unsigned zv = *reinterpret_cast<const unsigned*>(p.z + off);
                        const float z0 = bf16_lo(zv), z1 = bf16_hi(zv);
                        y0 = __fdividef(y0 * z0, 1.0f + ex2_approx(-z0 * LOG2E_F));
                        y1 = __fdividef(y1 * z1, 1.0f + ex2_approx(-z1 * LOG2E_F));
                    }
                    *reinterpret_cast<unsigned*>(p.out + off) = pack_bf16x2(y0, y1);
                }
            }
        }
    }
#endif
}
SSD_LAYOUT_FIXED(ssd_compute_out_wg_bf16, ComputeOutWgBf16Params, sizeof(ComputeOutWgBf16Smem) + 1024);
