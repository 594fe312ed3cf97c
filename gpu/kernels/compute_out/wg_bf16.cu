// Stage 3 on Hopper with bf16 inputs and output, ssd_compute_out_wg_bf16: the copies on the copy
// engine (TMA), the products on warpgroup products (wgmma), sm_90a only (the body is empty for
// every other target, and in the CPU emulation but its sm_90a build, scripts/gpu-emu.sh; the
// host chooses this kernel only on Hopper and only where it serves, see docs/gpu.md). The
// contract, operands and rounding points are those of ssd_compute_out_pair_bf16 (bf16.cu): the
// decayed scores rounded to bf16 (cb.to(x.dtype)), the carried state read as stage 2's bf16
// copy (states_lo), f32 accumulation. It computes the scores C B^T itself (bf16 operands, f32
// accumulation, as 3a does), so 3a does not run.
//
// It serves headdim 64, dstate 128, chunks of 128 or 256 tokens, no seq_idx, and an even
// number of heads per group; ssd_compute_out_wg_bf16_n256 (version 70, the same body with
// NQ = 4 dstate quarters, WgSizes below) dstate 256 with chunks of 128 tokens, where the host
// lets it (GpuConfig::wg_out_n256, until it is timed against the pair kernel). Below, "dstate
// half" reads "dstate quarter" there: each operand of dstate columns is NQ tiles of 64.
// A work item is (batch, chunk, pair of heads h0, h0 + 1 of one group), numbered
// ((b nchunks + chunk) npairs + pair), so that items running at the same time share the group's
// B and C in L2; the chunk's T = ceil(valid / 64) token tiles of 64. The grid is persistent:
// block k takes items k, k + gridDim.x, ... (one block of 384 threads, three warpgroups, per
// SM).
//
// Warpgroup 0 produces (WGO_PREG registers a thread, 24 by default, setmaxnreg; the consumers take
// WGO_CREG, 240):
// - its thread 0 streams each item's ring stages through WGO_STAGES slots of 32 KB, in the
//   order the consumers use them: the carried states of both heads (when there is one), then
//   for each token tile j the B tile and both heads' x tiles; a slot is refilled once every
//   consumer thread (WGO_RELEASERS) has arrived on its `empty` barrier;
// - its warps 1 to 3 fill the item's other half of the double-buffered per-item data, once the
//   consumers have released that half (`cempty`): the item's C row tiles (TMA, thread 32), and
//   log2(e) dA_cumsum and dt' of both heads (all 96 threads; 97 arrivals on `cfull`).
// Every copy is a TMA box of 64 x 64 bf16 (8 KB, 128-byte rows, CU_TENSOR_MAP_SWIZZLE_128B:
// 16-byte piece p of row r at p ^ (r % 8)). Rows past seqlen arrive as zeros.
//
// Warpgroups 1 and 2 (k = 0, 1) walk an item in passes, one row tile each a pass, with an
// accumulator per head in registers (wg_pass_row below): pass 0 row tile T - 1 - k over all T
// token tiles, pass 1 (T > 2) row tile k where k <= T - 3 over the first T - 2 (T = 4: rows 3
// and 2, then 0 and 1: causal visits 4 + 1 and 3 + 2). Each pass streams the state stage (if
// any) and its token tiles through the ring; both warpgroups use each stage and then release it.
// Warp w of a warpgroup holds rows 16 w .. 16 w + 15 of a row tile r (the wgmma accumulator
// layout). For each head h of the pair, with csl = log2(e) dA_cumsum and R = csl[64 r - 1] (0
// for r = 0):
//   the state stage:    acc_{r,h} = C_r bf16(S_h)^T 2^R    (2 x 4 wgmma m64n64k16, K-major)
//   token tile j < r:   Sc = C_r B_j^T                     (8 wgmma, shared by both heads)
//                       A_h = bf16(Sc 2^(R - csl_j) dt'_j) (registers, the m16n8k16 A layout;
//                                                           both factors <= 1)
//                       acc_{r,h} += A_h x_{h, j}          (4 wgmma, A from registers, x N-major)
//   token tile j = r:   acc_{r,h} *= 2^(csl_i - R), then the diagonal tile masked,
//                       A_h = bf16(Sc [j <= i] 2^(csl_i - csl_j) dt'_j), acc_{r,h} += A_h x_{h,r},
//                       then the row's epilogue: + D x_i (x from the stage), the z gate, out
//                       rounded to bf16 into the warpgroup's staging tile (swizzled as the
//                       loads), which one thread stores by TMA (cp.async.bulk.tensor, clipped
//                       at seqlen), after the copy engine has read the tile's previous store.
// Each group of products is waited for before its registers are touched; each consumer thread
// arrives on a stage's `empty` barrier after its last product and read of that stage, on `cempty`
// after its item's last.
//
// Shared memory: ComputeOutWgBf16Smem, every tile 8 KB and 1024-byte aligned (the swizzle's
// atom), the block's base aligned up to 1024 bytes at run time (the layout adds the slack).
//
// Sizes that can be set before the include (NVRTC options, e.g. through SSD_NVRTC_OPTIONS,
// docs/gpu.md): WGO_CBUF 1 or 2 per-item buffers, WGO_STAGES ring slots, WGO_OUTH staging tiles
// per consumer warpgroup; WGO_PASS 0 (version 58's form) walks an item in one pass, each
// consumer warpgroup holding two row tiles, T - 1 - k where that is above 1, and k, token tile j
// outer (128 accumulators a head). The forms that versions 52 to 60 and 66 tried and did not
// keep (the decay's form chosen per fragment, the column factors from the producer or from a
// per-item table, a timing-only decay, the next unit's scores issued before the decay, three
// consumer warpgroups) are in the history
// (docs/perf-history.md), with the commits that hold them. A timing-only form must keep every
// product's result alive: ptxas removes the products (and the decay feeding them) whose
// accumulators reach no memory. A form must also compile without ptxas's "Potential Performance
// Loss" note (scripts/kernel-resources.sh prints it): with it ptxas waits after every product,
// which no timing reveals by itself.
#define WGO_TILES 4  // token tiles of 64 per chunk, at most
#ifndef WGO_STAGES
#define WGO_STAGES 2  // ring slots
#endif
#ifndef WGO_OUTH
#define WGO_OUTH 1  // staging tiles of out per consumer warpgroup
#endif
// Every consumer thread arrives on `empty` and `cempty` (each mbarrier arrive releases its own
// thread's reads): one arrival per warp after the warp's barrier (version 56) left racecheck
// reporting the consumers' reads of dA_cumsum / dt' against the producer's next writes.
#define WGO_RELEASERS 256  // arrivals that release a stage or a buffer
#ifndef WGO_PASS
#define WGO_PASS 1
#endif
// Registers a thread after setmaxnreg: the producer warpgroup's and the consumers'. The block
// launches with 168 a thread (384 threads, one block an SM), so WGO_PREG + 2 WGO_CREG <= 504.
// At 24 ptxas spills the producer's loop state (47 local loads and stores in its SASS, thread 0
// reloading its item's fields between the ring's waits); at 40 it spills none, and the consumers
// at 232 spill 8 bytes outside the visit loop (version 68, docs/perf-history.md: not yet timed).
#ifndef WGO_PREG
#define WGO_PREG 24
#endif
#ifndef WGO_CREG
#define WGO_CREG 240
#endif
static_assert(WGO_PREG + 2 * WGO_CREG <= 504 && WGO_PREG % 8 == 0 && WGO_CREG % 8 == 0 && WGO_PREG >= 24 &&
                  WGO_CREG <= 256,
              "setmaxnreg's range (24 to 256, multiples of 8), within the block's 384 x 168 registers");
// Row slots a consumer warpgroup holds accumulators for: 2, or 1 in passes.
#define NSLOT (WGO_PASS ? 1 : 2)
#ifndef WGO_CBUF
#define WGO_CBUF 2  // per-item buffers (C, dA_cumsum, dt')
#endif
// The kernel's sizes for dstate NQ x 64: NQ = 2 (dstate 128: ssd_compute_out_wg_bf16) as set
// above; NQ = 4 (dstate 256: ssd_compute_out_wg_bf16_n256, version 70): chunks of at most 128
// tokens (2 row tiles), one per-item buffer (C's two row tiles take 64 KB) and ring slots of 8
// tiles (a state stage holds both heads' 4 dstate quarters; a token stage B's 4 and the two x).
template <int NQ>
struct WgSizes {
    static_assert(NQ == 2 || NQ == 4, "dstate 128 or 256");
    static constexpr int TILES = NQ == 2 ? WGO_TILES : 2;  // row (and token) tiles a chunk, at most
    static constexpr int CBUF = NQ == 2 ? WGO_CBUF : 1;    // per-item buffers
    static constexpr int RING = 2 * NQ;                    // tiles a ring slot
};
template <int NQ>
struct ComputeOutWgBf16SmemT {
    typedef WgSizes<NQ> Z;
    bf16_t c[Z::CBUF][Z::TILES][NQ][64 * 64];  // [item parity][row tile][dstate quarter]: C rows
    bf16_t ring[WGO_STAGES][Z::RING][64 * 64];  // the states: [NQ head + dstate quarter] bf16(S_h)[p][..];
                                                // token tile j: [dstate quarter] B_j, then [NQ + head] x_j
    bf16_t o[2][WGO_OUTH][64 * 64];             // [consumer warpgroup][slot]: out rows, for TMA stores
    float csl[Z::CBUF][2][256];                 // [item parity][head][token]: log2(e) dA_cumsum
                                                // (-inf past the chunk's end)
    float dt[Z::CBUF][2][256];                  // [item parity][head][token]: dt' (0 past the end)
    unsigned long long full[WGO_STAGES], empty[WGO_STAGES], cfull[Z::CBUF], cempty[Z::CBUF];
};
typedef ComputeOutWgBf16SmemT<2> ComputeOutWgBf16Smem;
typedef ComputeOutWgBf16SmemT<4> ComputeOutWgBf16N256Smem;
static_assert(sizeof(bf16_t) * 64 * 64 == 8192, "8 KB tiles, each 1024-byte aligned in the struct");
static_assert(sizeof(ComputeOutWgBf16Smem) + 1024 <= 227 * 1024, "one block per Hopper SM, with the alignment slack");
static_assert(sizeof(ComputeOutWgBf16N256Smem) + 1024 <= 227 * 1024, "dstate 256: one block per Hopper SM");

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
    TmaDesc tm_out;  // out: [batch][seqlen][nheads * headdim] bf16, box 64 x 64 x 1 (stores)
    const float* Dv;         // [nheads] or [nheads, headdim] or null
    const bf16_t* z;         // [batch, seqlen, nheads, headdim] or null
    const float* dt_out;     // [batch, nheads, nchunks, chunk_size]
    const float* dA_cumsum;  // [batch, nheads, nchunks, chunk_size]
    int seqlen, nheads, headdim, ngroups, dstate, chunk_size, nchunks;
    int d_per_channel, has_initial_states, batch;
};
static_assert(sizeof(ComputeOutWgBf16Params) == 768, "the Rust struct's size (ComputeOutWgParams)");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// sc = C_r B_j^T over dstate NQ x 64 (4 NQ products, K-major operands: dc and db the descriptors
// of the C tile and the B tile, each NQ 8 KB dstate quarters), issued, not committed. The slices'
// descriptors are the base's plus the slice's offset / 16 (the start address field).
template <int NQ>
__device__ __forceinline__ void scores_ss(float (&sc)[8][4], unsigned long long dc, unsigned long long db) {
#pragma unroll
    for (int k = 0; k < NQ; ++k)
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            const unsigned long long o = (k * 8192 + 32 * kk) >> 4;
            wgmma_bf16_ss(sc, dc + o, db + o, (k | kk) != 0);
        }
}

// One work item: (batch, chunk, pair of heads) and what follows from it.
struct WgItem {
    int b, ch, h0, grp, valid, T;
    i64 t0;
    bool has_state;
};
__device__ __forceinline__ WgItem wg_item(const ComputeOutWgBf16Params& p, int item) {
    const int npairs = p.nheads / 2;
    WgItem w;
    w.b = item / (p.nchunks * npairs);
    const int rem = item - w.b * p.nchunks * npairs;
    w.ch = rem / npairs;
    w.h0 = 2 * (rem - w.ch * npairs);
    w.grp = w.h0 / (p.nheads / p.ngroups);
    w.t0 = (i64)w.ch * p.chunk_size;
    w.valid = (int)min((i64)p.chunk_size, (i64)p.seqlen - w.t0);
    w.T = (w.valid + 63) / 64;
    w.has_state = w.ch > 0 || p.has_initial_states;
    return w;
}

// WGO_PASS: an item in passes, each warpgroup one row tile a pass (64 accumulators a head
// instead of 128): T <= 2, one pass, row wg; T > 2, pass 0 rows T - 1 - wg over all T token
// tiles, pass 1 rows wg <= T - 3 over the first T - 2 (T = 4: causal visits 4 + 1 and 3 + 2).
// Each pass streams the state stage (if any) and its token tiles again. Without WGO_PASS one
// pass of both row slots.
__device__ __forceinline__ int wg_npass(int T) { return (WGO_PASS && T > 2) ? 2 : 1; }
__device__ __forceinline__ int wg_pass_tiles(int T, int pass) { return (WGO_PASS && pass == 1) ? T - 2 : T; }
__device__ __forceinline__ int wg_pass_row(int T, int pass, int wg) {
    if (T <= 2) return wg < T ? wg : -1;
    if (pass == 0) return T - 1 - wg;
    return wg <= T - 3 ? wg : -1;
}

// The row tile's epilogue for one head: y = acc + D x_i, the z gate, rounded to bf16 into the
// staging tile ot (swizzled as the loads). RARE: the form with the z gate or D per channel, each
// tested at run time inside it; the common form (no z, D per head or none) has neither.
template <bool RARE>
__device__ __forceinline__ void wg_epilogue(const ComputeOutWgBf16Params& p, const float (&acc)[8][4],
                                            const char* xt, char* ot, float dh, int h, int w, int g, int q,
                                            int row0, const WgItem& wi, unsigned tok_stride_x) {
#pragma unroll
    for (int nf = 0; nf < 8; ++nf) {
        const int col = 8 * nf + 2 * q;
        float d0 = dh, d1 = dh;
        if (RARE && p.Dv != nullptr && p.d_per_channel) {
            const float2 dv = *reinterpret_cast<const float2*>(p.Dv + (i64)h * p.headdim + col);
            d0 = dv.x;
            d1 = dv.y;
        }
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int il = 16 * w + g + 8 * hf;
            const int sw = il * 128 + ((nf ^ (il & 7)) << 4) + 4 * q;  // swizzled byte
            const unsigned xv = *reinterpret_cast<const unsigned*>(xt + sw);
            float y0 = acc[nf][2 * hf] + d0 * bf16_lo(xv);
            float y1 = acc[nf][2 * hf + 1] + d1 * bf16_hi(xv);
            if (RARE && p.z != nullptr) {
                const int i = row0 + il;
                unsigned zv = 0;
                if (i < wi.valid)
                    zv = *reinterpret_cast<const unsigned*>(p.z + ((i64)wi.b * p.seqlen + wi.t0 + i) * tok_stride_x +
                                                            (i64)h * p.headdim + col);
                const float z0 = bf16_lo(zv), z1 = bf16_hi(zv);
                y0 = __fdividef(y0 * z0, 1.0f + ex2_approx(-z0 * LOG2E_F));
                y1 = __fdividef(y1 * z1, 1.0f + ex2_approx(-z1 * LOG2E_F));
            }
            *reinterpret_cast<unsigned*>(ot + sw) = pack_bf16x2(y0, y1);
        }
    }
}

// The kernel's body for dstate NQ x 64 (the entry points below).
template <int NQ>
__device__ __forceinline__ void wg_out_body(const ComputeOutWgBf16Params& p) {
    typedef WgSizes<NQ> Z;
    SSD_DYNAMIC_SMEM(smem_raw);
    const unsigned raw = smem_addr(smem_raw);
    const unsigned base = (raw + 1023u) & ~1023u;
    ComputeOutWgBf16SmemT<NQ>& sm =
        *reinterpret_cast<ComputeOutWgBf16SmemT<NQ>*>(reinterpret_cast<char*>(smem_raw) + (base - raw));
    constexpr unsigned TILE = 8192;
    const int tid = threadIdx.x;
    const int items = p.batch * p.nchunks * (p.nheads / 2);

    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < WGO_STAGES; ++s) {
            mbar_init(smem_addr(&sm.full[s]), 1);
            mbar_init(smem_addr(&sm.empty[s]), WGO_RELEASERS);
        }
#pragma unroll
        for (int k = 0; k < Z::CBUF; ++k) {
            mbar_init(smem_addr(&sm.cfull[k]), 97);
            mbar_init(smem_addr(&sm.cempty[k]), WGO_RELEASERS);
        }
        mbar_init_fence();
    }
    __syncthreads();

    if (tid < 128) {
        setmaxnreg_dec<WGO_PREG>();
        if (tid == 0) {
            // The ring: the states, then (B_j, x_j) for each token tile, item after item.
            unsigned s = 0;
            for (int item = blockIdx.x; item < items; item += gridDim.x) {
                const WgItem w = wg_item(p, item);
                for (int pass = 0; pass < wg_npass(w.T); ++pass) {
                    const int nst = (w.has_state ? 1 : 0) + wg_pass_tiles(w.T, pass);
                    for (int st = 0; st < nst; ++st, ++s) {
                        const unsigned slot = s % WGO_STAGES, n = s / WGO_STAGES;
                        const unsigned full = smem_addr(&sm.full[slot]);
                        if (n > 0) mbar_wait(smem_addr(&sm.empty[slot]), (n - 1) & 1);
                        // A state stage: 2 NQ tiles; a token stage: NQ + 2 (the same 4 at NQ = 2).
                        mbar_expect_tx(full, (NQ == 2 ? 4 : (w.has_state && st == 0) ? 2 * NQ : NQ + 2) * TILE);
                        if (w.has_state && st == 0) {
                            const int row = (w.b * p.nchunks + w.ch) * p.nheads + w.h0;
#pragma unroll
                            for (int hh = 0; hh < 2; ++hh)
#pragma unroll
                                for (int k = 0; k < NQ; ++k)
                                    tma_load_3d(smem_addr(&sm.ring[slot][NQ * hh + k][0]), &p.tm_s, 64 * k, 0, row + hh,
                                                full);
                        } else {
                            const int j = st - (w.has_state ? 1 : 0);
                            const int tok = (int)w.t0 + 64 * j;
#pragma unroll
                            for (int k = 0; k < NQ; ++k)
                                tma_load_3d(smem_addr(&sm.ring[slot][k][0]), &p.tm_b, w.grp * p.dstate + 64 * k, tok,
                                            w.b, full);
#pragma unroll
                            for (int hh = 0; hh < 2; ++hh)
                                tma_load_3d(smem_addr(&sm.ring[slot][NQ + hh][0]), &p.tm_x, (w.h0 + hh) * p.headdim, tok,
                                            w.b, full);
                        }
                    }
                }
            }
        } else if (tid >= 32) {
            // The per-item data, double-buffered by item parity: C's row tiles, log2(e)
            // dA_cumsum and dt' of both heads.
            int it = 0;
            for (int item = blockIdx.x; item < items; item += gridDim.x, ++it) {
                const WgItem w = wg_item(p, item);
                const int par = it % Z::CBUF, n = it / Z::CBUF;
                const unsigned cfull = smem_addr(&sm.cfull[par]);
                if (n > 0) mbar_wait(smem_addr(&sm.cempty[par]), (n - 1) & 1);
                if (tid == 32) {
                    mbar_expect_tx(cfull, (unsigned)w.T * NQ * TILE);
                    for (int r = 0; r < w.T; ++r)
#pragma unroll
                        for (int hk = 0; hk < NQ; ++hk)
                            tma_load_3d(smem_addr(&sm.c[par][r][hk][0]), &p.tm_c, w.grp * p.dstate + 64 * hk,
                                        (int)w.t0 + 64 * r, w.b, cfull);
                }
                const i64 hstride = (i64)p.nchunks * p.chunk_size;
                const i64 cb0 = (((i64)w.b * p.nheads + w.h0) * p.nchunks + w.ch) * p.chunk_size;
                for (int e = tid - 32; e < 2 * 256; e += 96) {
                    const int hh = e >> 8, j = e & 255;
                    const bool ok = j < w.valid;
                    sm.csl[par][hh][j] = ok ? p.dA_cumsum[cb0 + hh * hstride + j] * LOG2E_F : NEG_INF_F;
                    sm.dt[par][hh][j] = ok ? p.dt_out[cb0 + hh * hstride + j] : 0.0f;
                }
                mbar_arrive(cfull);
            }
        }
        return;
    }

    setmaxnreg_inc<WGO_CREG>();
    const int wg = tid / 128 - 1;
    const int w = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const unsigned tok_stride_x = (unsigned)(p.nheads * p.headdim);
    unsigned s = 0;
    int it = 0;
    for (int item = blockIdx.x; item < items; item += gridDim.x, ++it) {
        const WgItem wi = wg_item(p, item);
        const int par = it % Z::CBUF;
        // D per head of the pair, read before the wait so that its latency hides behind it.
        float dhead[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
            dhead[hh] = (p.Dv != nullptr && !p.d_per_channel) ? p.Dv[wi.h0 + hh] : 0.0f;
        mbar_wait(smem_addr(&sm.cfull[par]), (it / Z::CBUF) & 1);
        for (int pass = 0; pass < wg_npass(wi.T); ++pass) {
            const int TJ = wg_pass_tiles(wi.T, pass);  // this pass's token tiles
            // This warpgroup's row tiles: T - 1 - wg where that is above 1, and wg (WGO_PASS: the
            // pass's one row tile; rows[1] unused, NSLOT = 1).
            int rows[2];
            if (WGO_PASS) {
                rows[0] = wg_pass_row(wi.T, pass, wg);
                rows[1] = -1;
            } else {
                const int hi = wi.T - 1 - wg;
                rows[0] = (hi > 1) ? hi : (wg < wi.T ? wg : -1);
                rows[1] = (hi > 1) ? wg : -1;
            }
            float R[NSLOT][2], csl[NSLOT][2][2];  // [row slot][head], [row slot][head][row half]
#pragma unroll
            for (int ri = 0; ri < NSLOT; ++ri) {
                const int r = max(rows[ri], 0);
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    R[ri][hh] = r > 0 ? sm.csl[par][hh][64 * r - 1] : 0.0f;
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) csl[ri][hh][hf] = sm.csl[par][hh][64 * r + 16 * w + g + 8 * hf];
                }
            }
            float acc[NSLOT][2][8][4];  // [row slot][head]
#pragma unroll
            for (int ri = 0; ri < NSLOT; ++ri)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh)
#pragma unroll
                    for (int nf = 0; nf < 8; ++nf)
#pragma unroll
                        for (int e = 0; e < 4; ++e) acc[ri][hh][nf][e] = 0.0f;

            if (wi.has_state) {
                // The state stage: acc = C_r bf16(S_h)^T 2^R.
                const unsigned slot = s % WGO_STAGES;
                mbar_wait(smem_addr(&sm.full[slot]), (s / WGO_STAGES) & 1);
#pragma unroll
                for (int ri = 0; ri < NSLOT; ++ri) {
                    if (rows[ri] < 0) continue;
                    const unsigned long long dc = wgmma_desc_kmajor_sw128(smem_addr(&sm.c[par][rows[ri]][0][0]));
                    wgmma_fence();
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh)
                        scores_ss<NQ>(acc[ri][hh], dc, wgmma_desc_kmajor_sw128(smem_addr(&sm.ring[slot][NQ * hh][0])));
                    wgmma_commit();
                    wgmma_wait<0>();
                    wgmma_hold(acc[ri][0]);
                    wgmma_hold(acc[ri][1]);
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        const float f = ex2_approx(R[ri][hh]);
#pragma unroll
                        for (int nf = 0; nf < 8; ++nf)
#pragma unroll
                            for (int e = 0; e < 4; ++e) acc[ri][hh][nf][e] *= f;
                    }
                }
                mbar_arrive(smem_addr(&sm.empty[slot]));
                ++s;
            }

            // The pieces of a visit (row slot ri, token tile j), as lambdas over this item and pass.
            // The row factor 2^(csl_i - R) on the diagonal tile: everything so far takes it (0
            // past the chunk's end).
            const auto diag_scale = [&](const int ri) {
#pragma unroll
                for (int hh = 0; hh < 2; ++hh)
#pragma unroll
                    for (int hf = 0; hf < 2; ++hf) {
                        const float f = ex2_approx(csl[ri][hh][hf] - R[ri][hh]);
#pragma unroll
                        for (int nf = 0; nf < 8; ++nf) {
                            acc[ri][hh][nf][2 * hf] *= f;
                            acc[ri][hh][nf][2 * hf + 1] *= f;
                        }
                    }
            };
            // Both heads' A operands from the scores, column pair by column pair (each score dies
            // once both are built). The decay's form (diagonal tile or not) is DG, a constant at
            // each call, outside the unrolled fragment loops (chosen inside them, each of the 16
            // (column pair, head) fragments carried its own branch, and ptxas scheduled each
            // alone).
            const auto build_a = [&](const bool DG, const int ri, const int j, const float(&sc)[8][4],
                                     unsigned(&a)[2][4][4]) {
#pragma unroll
                for (int nf = 0; nf < 8; ++nf) {
                    const int jl = 8 * nf + 2 * q;  // this thread's columns jl, jl + 1
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        const float2 cj = *reinterpret_cast<const float2*>(&sm.csl[par][hh][64 * j + jl]);
                        const float2 dj = *reinterpret_cast<const float2*>(&sm.dt[par][hh][64 * j + jl]);
                        float f[2][2];  // [hf][e]
                        if (DG) {
#pragma unroll
                            for (int hf = 0; hf < 2; ++hf) {
                                const int il = 16 * w + g + 8 * hf;
                                f[hf][0] = jl <= il ? ex2_approx(csl[ri][hh][hf] - cj.x) * dj.x : 0.0f;
                                f[hf][1] = jl + 1 <= il ? ex2_approx(csl[ri][hh][hf] - cj.y) * dj.y : 0.0f;
                            }
                        } else {
                            f[0][0] = f[1][0] = ex2_approx(R[ri][hh] - cj.x) * dj.x;
                            f[0][1] = f[1][1] = ex2_approx(R[ri][hh] - cj.y) * dj.y;
                        }
                        a[hh][nf >> 1][2 * (nf & 1)] = pack_bf16x2(sc[nf][0] * f[0][0], sc[nf][1] * f[0][1]);
                        a[hh][nf >> 1][2 * (nf & 1) + 1] = pack_bf16x2(sc[nf][2] * f[1][0], sc[nf][3] * f[1][1]);
                    }
                }
            };
            // Both heads' products acc += A x_j in one group (issued and committed, not waited).
            const auto products = [&](const int ri, const unsigned slot, const unsigned(&a)[2][4][4]) {
                wgmma_fence();
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const unsigned long long dx = wgmma_desc_nmajor_sw128(smem_addr(&sm.ring[slot][NQ + hh][0]));
#pragma unroll
                    for (int ks = 0; ks < 4; ++ks) wgmma_bf16_rs_nmajor(acc[ri][hh], a[hh][ks], dx + (2048 * ks >> 4));
                }
                wgmma_commit();
            };
            // The row tile is complete: y = acc + D x_i, the z gate (y z sigmoid(z), sigmoid through
            // ex2.approx), rounded to bf16 into this warpgroup's staging tile (the 128-byte
            // swizzle), stored by TMA (which clips the rows past seqlen). x_i is in ring slot slot.
            const auto finish_row = [&](const int ri, const int r, const unsigned slot) {
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int h = wi.h0 + hh;
                    const char* xt = reinterpret_cast<const char*>(&sm.ring[slot][NQ + hh][0]);
                    char* ot = reinterpret_cast<char*>(&sm.o[wg][hh % WGO_OUTH][0]);
                    const float dh = dhead[hh];
                    // The staging tile is free once the copy engine has read the store before.
                    if (tid % 128 == 0) bulk_wait_read<WGO_OUTH - 1>();
                    named_bar_sync(1 + wg, 128);
                    // The gate and per-channel D chosen once, outside the unrolled loops, so that the
                    // common form (no z, D per head or none) runs a short straight block.
                    if (p.z == nullptr && !(p.Dv != nullptr && p.d_per_channel))
                        wg_epilogue<false>(p, acc[ri][hh], xt, ot, dh, h, w, g, q, 64 * r, wi, tok_stride_x);
                    else
                        wg_epilogue<true>(p, acc[ri][hh], xt, ot, dh, h, w, g, q, 64 * r, wi, tok_stride_x);
                    fence_proxy_async_smem();
                    named_bar_sync(1 + wg, 128);
                    if (tid % 128 == 0) {
                        tma_store_3d(&p.tm_out, smem_addr(ot), h * p.headdim, (int)wi.t0 + 64 * r, wi.b);
                        bulk_commit();
                    }
                }
            };

            for (int j = 0; j < TJ; ++j, ++s) {
                const unsigned slot = s % WGO_STAGES;
                mbar_wait(smem_addr(&sm.full[slot]), (s / WGO_STAGES) & 1);
                const unsigned long long db = wgmma_desc_kmajor_sw128(smem_addr(&sm.ring[slot][0][0]));
#pragma unroll
                for (int ri = 0; ri < NSLOT; ++ri) {
                    const int r = rows[ri];
                    if (r < j) continue;  // also the absent row tile (-1)
                    float sc[8][4];
                    wgmma_fence();
                    scores_ss<NQ>(sc, wgmma_desc_kmajor_sw128(smem_addr(&sm.c[par][r][0][0])), db);
                    wgmma_commit();
                    wgmma_wait<0>();
                    wgmma_hold(sc);
                    const bool diag = r == j;
                    unsigned a[2][4][4];
                    if (diag) {
                        diag_scale(ri);
                        build_a(true, ri, j, sc, a);
                    } else {
                        build_a(false, ri, j, sc, a);
                    }
                    products(ri, slot, a);
                    wgmma_wait<0>();
                    wgmma_hold(acc[ri][0]);
                    wgmma_hold(acc[ri][1]);
                    if (diag) finish_row(ri, r, slot);
                }
                mbar_arrive(smem_addr(&sm.empty[slot]));
            }
        }
        mbar_arrive(smem_addr(&sm.cempty[par]));
    }
    // The last stores must have read their staging tiles before the block's shared memory goes.
    if (tid % 128 == 0) bulk_wait_all();
}
#endif

extern "C" __global__ void __launch_bounds__(384, 1)
    ssd_compute_out_wg_bf16(const __grid_constant__ ComputeOutWgBf16Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    wg_out_body<2>(p);
#endif
}
SSD_LAYOUT_FIXED(ssd_compute_out_wg_bf16, ComputeOutWgBf16Params, sizeof(ComputeOutWgBf16Smem) + 1024);
// dstate 256, chunks of at most 128 tokens (version 70; the host takes it only where asked,
// GpuConfig::wg_out_n256, until it is timed against the pair kernel).
extern "C" __global__ void __launch_bounds__(384, 1)
    ssd_compute_out_wg_bf16_n256(const __grid_constant__ ComputeOutWgBf16Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    wg_out_body<4>(p);
#endif
}
SSD_LAYOUT_FIXED(ssd_compute_out_wg_bf16_n256, ComputeOutWgBf16Params, sizeof(ComputeOutWgBf16N256Smem) + 1024);
