// Stage 2, 2a and 2b in one kernel, chained over the chunks (the host's choice where it
// applies, Variant::V3, see docs/gpu.md): ssd_state_chained and ssd_state_chained_bf16. They
// compute what 2a's pair kernels and 2b compute, bit for bit (the same products in the same
// order, the same fused multiply-add of the pass), without writing each chunk's own state L_c
// to memory and reading it back.
//
// One block of 256 threads (8 warps, two blocks per SM) per (batch b, pair of units, chunk c),
// the pairs and units of 2a's pair kernel (pair.cu: a unit is a head h and 64 of its headdim
// rows p, both units of a pair in one group), dstate <= 128 (one block holds both units' whole
// [64, dstate] tiles). A chain is a (b, pair); its blocks hand the state on from chunk to
// chunk. Blocks take their (chain, chunk) from a ticket (an atomic counter), chunk-major: a
// block waits only for a block that took its ticket earlier and so is running or done, which
// rules out a deadlock whatever order the hardware starts blocks in. With S_c the state
// entering chunk c (S_0 the initial state or 0), block (b, pair, c):
//   A. computes L_c for both units into the tensor-core accumulators (2a's pair body, pair.cu,
//      or its bf16 twin, bf16.cu);
//   B. waits until chunk c - 1's block has published S_c (its flag set, acquire), copies S_c
//      into shared memory (all of it in flight at once), writes S_{c+1} = fma(scale_c, S_c, L_c)
//      (2b's formula, scale_c = exp(cs[last_c]) if seq(last_c) = seq(last_{c-1}), else 0) to
//      the hand-off (below; final_states after the last chunk), and releases chunk c + 1's flag
//      (fence, release).
// The hand-off is chunk_states[b, c + 1] (at c = 0 the block also writes S_0 to
// chunk_states[b, 0]). With bf16 activations chunk_states is null unless the caller keeps it
// (the bf16 output kernel reads states_lo only); then the hand-off is final_states[b, h] itself,
// the chain's running state, overwritten in place chunk after chunk (64 KB per chain, 21 MB at
// (8, 8192, 80): it can stay in L2). In place is safe: only the block holding chunk c's turn
// touches it, between its acquire (after chunk c - 1's block wrote it) and its release (after
// its own reads and writes).
// With bf16 activations the block also writes S_{c+1} rounded to bf16 (to nearest even) to
// states_lo[b, c + 1] (and S_0 to states_lo[b, 0]), after the release, off the chain's
// critical path: the operand of the bf16 output kernel's product (compute_out/bf16.cu).
// So the states cross HBM twice in the forward (written here, read by 3b) instead of four
// times (2a's write, 2b's read and write, 3b's read); without chunk_states only their bf16 copy
// does (the running states stay in L2 where they fit). Only phase B lies on a chain's critical path: one round trip through L2 per chunk.
// L2 priorities: S_c is written by chunk c - 1's block about one wave of blocks before chunk
// c's block reads it, and in between some 260 blocks stream their x (128 KB each in f32)
// through L2. With normal priority much of S_c came back from HBM (ncu: 2.09 GB of DRAM reads
// in f32 at (8, 8192, 80) where x and B take 1.4 GB). Phase A reads x, and phase B S_c, with
// priority evict_first: read once, they leave L2 before the states written since. The
// running state, rewritten at once, is read at normal priority, and the bf16 copies written
// beside it with evict_first.
// The kept and the lean hand-off are two instantiations of chain_hand_off (keep), chosen once
// per block. Measured (docs/perf-history.md, version 36): handing off through the running state
// where chunk_states is kept too, with chunk_states written after the release, made stage 2
// slower (0.858 -> 0.958 ms at (8, 8192, 80) in f32: twice the stores); the lean form as
// runtime branches of one body gained nothing, as its own instantiation 4% of stage 2 there.
// Scratch: chain[0] the ticket counter, then one flag per (b, pair, chunk), chunk-minor; all
// zero at launch (the host clears them on the stream before each launch).

// Dynamic shared memory: 2a's pair layout (or its bf16 twin), which phase B reuses for S_c,
// then the ticket.
#define CHAIN_S 136
template <typename Smem>
struct StateChainedSmem {
    union {
        Smem state;                   // phase A
        float stage[2][64][CHAIN_S];  // phase B: S_c of both units
    } u;
    int ticket;
    int pad[3];
};
static_assert(sizeof(StateChainedSmem<ChunkStateLocalPairSmem>) <= 113 * 1024, "two blocks per Hopper SM");
static_assert(sizeof(StateChainedSmem<ChunkStateLocalPairBf16Smem>) <= 113 * 1024, "two blocks per Hopper SM");

// The parameters of ssd_state_chained and ssd_state_chained_bf16 (Rust: StateChainedParams;
// X is float or bf16_t: x and B).
template <typename X>
struct StateChainedParamsT {
    const X* x;                   // [batch, seqlen, nheads, headdim]
    const X* Bm;                  // [batch, seqlen, ngroups, dstate]
    const float* dt_out;          // [batch, nheads, nchunks, chunk_size]
    const float* dA_cumsum;       // [batch, nheads, nchunks, chunk_size]
    const float* initial_states;  // [batch, nheads, headdim, dstate] or null
    const int* seq_idx;           // [batch, seqlen] or null
    float* chunk_states;          // [batch, nchunks, nheads, headdim, dstate]; bf16: null = not written
    float* final_states;          // [batch, nheads, headdim, dstate], also the chains' running state
    int* chain;                   // [1 + batch * pairs * nchunks], zero at launch
    int seqlen, nheads, headdim, ngroups, dstate, chunk_size, nchunks;
    int batch;
    bf16_t* states_lo;            // [batch, nchunks, nheads, headdim, dstate] or null
};
typedef StateChainedParamsT<float> StateChainedParams;
typedef StateChainedParamsT<bf16_t> StateChainedBf16Params;
static_assert(sizeof(StateChainedParams) == 112, "StateChainedParams: the Rust struct has 112 bytes");
static_assert(sizeof(StateChainedBf16Params) == 112, "one Rust struct for both");

// f(mi, hf, nf, sr, row, nc) for each of the thread's pairs of neighbouring columns (dstate is
// a multiple of 4) inside its unit's state, in chain_hand_off's layout: accumulator
// acc[mi][nf][2 hf (+1)], row sr of the shared stage, element offset row + nc in a state.
template <bool rows16, typename F>
__device__ __forceinline__ void each_state_pair(int rows_p, int cols_n, int p0, int dstate, F&& f) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int wm = (warp >> 1) & 1, col0 = (warp & 1) * 64;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
            const int pr = wm * 32 + (rows16 ? 16 * mi + g + 8 * hf : 4 * g + 2 * mi + hf);
            if (pr >= rows_p) continue;
            const i64 row = (i64)(p0 + pr) * dstate;
            const int sr = wm * 32 + 16 * mi + g + 8 * hf;
#pragma unroll
            for (int nf = 0; nf < 8; ++nf) {
                const int nc = col0 + nf * 8 + 2 * q;
                if (nc < cols_n) f(mi, hf, nf, sr, row, nc);
            }
        }
}

// The block's part of the hand-off (phase B) for (b, pair, c), its chunk's own state in acc
// (warp w: unit w / 4, rows 32 ((w / 2) % 2), columns 64 (w % 2); within the 32 rows, fragment
// row (mi, hf) at 4 g + 2 mi + hf, as store_state_tile, or at 16 mi + g + 8 hf with rows16).
// Waits for S_c, writes S_{c+1} = fma(scale_c, S_c, L_c) to the hand-off (with keep
// chunk_states[b, c + 1], and S_0 to chunk_states[b, 0] at c = 0; without, final_states[b, h]
// in place; final_states after the last chunk), releases c + 1; then, where states_lo is
// given, the bf16 copies (acc holds S_{c+1} on return).
template <bool rows16, bool keep>
__device__ __forceinline__ void chain_hand_off(float (&acc)[2][8][4], const float* __restrict__ dA_cumsum,
                                               const int* __restrict__ seq_idx, const float* initial_states,
                                               float* chunk_states, float* final_states, bf16_t* states_lo,
                                               int* flags, int seqlen, int nheads, int headdim, int dstate,
                                               int chunk_size, int nchunks, int b, int c, int pair) {
    const int tid = threadIdx.x, warp = tid >> 5;
    const int ptiles = (headdim + 63) / 64;
    const int unit = 2 * pair + (warp >> 2);
    const int h = unit / ptiles, p0 = (unit % ptiles) * 64;
    const int rows_p = min(64, headdim - p0), cols_n = min(128, dstate);
    const i64 bh = (i64)b * nheads + h;
    const i64 n = (i64)headdim * dstate;
    const i64 t0 = (i64)c * chunk_size;
    const int last = (int)min((i64)chunk_size, (i64)seqlen - t0) - 1;
    const float cs_last = dA_cumsum[(bh * nchunks + c) * chunk_size + last];
    int seq_last = 0, seq_prev = 0;
    if (seq_idx != nullptr) {
        seq_last = seq_idx[(i64)b * seqlen + t0 + last];
        seq_prev = c > 0 ? seq_idx[(i64)b * seqlen + t0 - 1] : 0;
    }
    const float scale = seq_last == seq_prev ? expf(cs_last) : 0.0f;
    const i64 at_c = (((i64)b * nchunks + c) * nheads + h) * n;
    const i64 next = (i64)nheads * n;  // from chunk c's states to chunk c + 1's
    float* st_c = keep ? chunk_states + at_c : nullptr;
    float* run = final_states + bh * n;
    const float* src = c > 0 ? (keep ? st_c : run) : (initial_states != nullptr ? initial_states + bh * n : nullptr);
    float* dst = keep && c + 1 < nchunks ? st_c + next : run;
    bf16_t* lo_c = states_lo != nullptr ? states_lo + at_c : nullptr;
    if (tid == 0 && c > 0) {
        while (ld_acquire_gpu(flags + c) == 0) __nanosleep(100);
    }
    __syncthreads();  // S_c is published, and phase A is done with the shared memory
    // S_c of the thread's unit into shared memory, all 16 of the thread's copies in flight at
    // once (one L2 round trip on the chain's critical path), read with priority evict_first
    // (nothing reads it after this block), except the running state, which this block
    // rewrites right after. Row pr of the unit at row 32 (pr / 32) + the fragment order's index
    // of pr % 32 (16 mi + g + 8 hf), so that the reads below are free of bank conflicts at a
    // row stride of 8 mod 32 words (CHAIN_S).
    SSD_DYNAMIC_SMEM(stage_raw);
    float* stage = stage_raw + (warp >> 2) * 64 * CHAIN_S;
    const unsigned long long pol = l2_evict_first();
    if (src != nullptr) {
        const int t = tid & 127;
#pragma unroll
        for (int k = 0; k < 16; ++k) {
            const int piece = t + 128 * k;  // 64 rows of 32 pieces of 16 bytes
            const int pr = piece >> 5, nc = (piece & 31) * 4;
            const int lr = pr & 31;
            const int sr = (pr & 32) + (rows16 ? lr : 16 * ((lr >> 1) & 1) + (lr >> 2) + 8 * (lr & 1));
            const bool ok = pr < rows_p && nc < cols_n;
            const float* from = ok ? src + (i64)(p0 + pr) * dstate + nc : src;
            if (!keep && c > 0)
                cp_async16(stage + sr * CHAIN_S + nc, from, ok, src);
            else
                cp_async16_hint(stage + sr * CHAIN_S + nc, from, ok, src, pol);
        }
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();  // every thread's copies have landed (and were read: the running state is
                      // overwritten in place only after this barrier)
    // The fma and the stores.
    each_state_pair<rows16>(rows_p, cols_n, p0, dstate, [&](int mi, int hf, int nf, int sr, i64 row, int nc) {
        const float2 s_c =
            src != nullptr ? *reinterpret_cast<const float2*>(stage + sr * CHAIN_S + nc) : make_float2(0.0f, 0.0f);
        if (keep && c == 0) {
            *reinterpret_cast<float2*>(st_c + row + nc) = s_c;
            if (lo_c != nullptr) *reinterpret_cast<unsigned*>(lo_c + row + nc) = pack_bf16x2(s_c.x, s_c.y);
        }
        acc[mi][nf][2 * hf] = fmaf(scale, s_c.x, acc[mi][nf][2 * hf]);
        acc[mi][nf][2 * hf + 1] = fmaf(scale, s_c.y, acc[mi][nf][2 * hf + 1]);
        *reinterpret_cast<float2*>(dst + row + nc) = make_float2(acc[mi][nf][2 * hf], acc[mi][nf][2 * hf + 1]);
    });
    __threadfence();
    __syncthreads();  // every thread's part of S_{c+1} is written and fenced
    if (tid == 0 && c + 1 < nchunks) st_release_gpu(flags + c + 1, 1);
    if (lo_c == nullptr) return;
    // The bf16 copies for the output kernel, which runs after this kernel: no fence needed.
    // Without chunk_states, with priority evict_first, so as not to push the running states
    // out of L2, and S_0 (from the stage) here too.
    if (!keep && c == 0) {
        each_state_pair<rows16>(rows_p, cols_n, p0, dstate, [&](int, int, int, int sr, i64 row, int nc) {
            const float2 s_0 =
                src != nullptr ? *reinterpret_cast<const float2*>(stage + sr * CHAIN_S + nc) : make_float2(0.0f, 0.0f);
            st_hint_b32(lo_c + row + nc, pack_bf16x2(s_0.x, s_0.y), pol);
        });
    }
    if (c + 1 >= nchunks) return;
    bf16_t* lo_next = lo_c + next;
    if (!rows16) {
        each_state_pair<rows16>(rows_p, cols_n, p0, dstate, [&](int mi, int hf, int nf, int, i64 row, int nc) {
            const unsigned v = pack_bf16x2(acc[mi][nf][2 * hf], acc[mi][nf][2 * hf + 1]);
            if (keep)
                *reinterpret_cast<unsigned*>(lo_next + row + nc) = v;
            else
                st_hint_b32(lo_next + row + nc, v, pol);
        });
        return;
    }
    // rows16 (the bf16 kernel, whose accumulator rows are in order: sr is the unit's row): the
    // copy staged through shared memory, over S_c's stage (dead since the release barrier but
    // for S_0 above), then stored 16 bytes at a time. The unit's tile [64][CHAIN_S] bf16: the
    // pairs' 4-byte writes of a warp hit 32 distinct banks (row stride 68 words), the 16-byte
    // reads of 8 threads one row's 128 contiguous bytes.
    bf16_t* lo_s = reinterpret_cast<bf16_t*>(stage_raw) + (warp >> 2) * 64 * CHAIN_S;
    if (!keep && c == 0) __syncthreads();  // S_0 is read out of the stage (block-uniform)
    each_state_pair<rows16>(rows_p, cols_n, p0, dstate, [&](int mi, int hf, int nf, int sr, i64, int nc) {
        *reinterpret_cast<unsigned*>(lo_s + sr * CHAIN_S + nc) = pack_bf16x2(acc[mi][nf][2 * hf], acc[mi][nf][2 * hf + 1]);
    });
    __syncthreads();  // the unit's tile is whole
    const int t = tid & 127;
    bf16_t* lo_u = lo_next + (i64)p0 * dstate;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int piece = t + 128 * k;  // 64 rows of 16 pieces of 8 bf16
        const int pr = piece >> 4, nc = (piece & 15) * 8;
        if (pr >= rows_p || nc >= cols_n) continue;  // cols_n (dstate) is a multiple of 8
        const uint4 v = *reinterpret_cast<const uint4*>(lo_s + pr * CHAIN_S + nc);
        if (keep)
            st_v4(lo_u + (i64)pr * dstate + nc, v.x, v.y, v.z, v.w);
        else
            st_hint_v4(lo_u + (i64)pr * dstate + nc, v.x, v.y, v.z, v.w, pol);
    }
}

// The block's (b, pair, c) from its ticket, chunk-major; the chain's flags.
__device__ __forceinline__ void chain_ticket(int* chain, int& ticket_smem, int batch, int nheads, int headdim,
                                             int nchunks, int& b, int& c, int& pair, int*& flags) {
    if (threadIdx.x == 0) ticket_smem = atomicAdd(chain, 1);
    __syncthreads();
    const int npairs = nheads * ((headdim + 63) / 64) / 2;
    const int nchains = batch * npairs;
    const int ticket = ticket_smem;
    c = ticket / nchains;
    const int ch = ticket % nchains;
    b = ch / npairs;
    pair = ch % npairs;
    flags = chain + 1 + (i64)ch * nchunks;
}

extern "C" __global__ void __launch_bounds__(256, 2) ssd_state_chained(const StateChainedParams p) {
    SSD_DYNAMIC_SMEM(smem_raw);
    StateChainedSmem<ChunkStateLocalPairSmem>& sm = *reinterpret_cast<StateChainedSmem<ChunkStateLocalPairSmem>*>(smem_raw);
    int b, c, pair;
    int* flags;
    chain_ticket(p.chain, sm.ticket, p.batch, p.nheads, p.headdim, p.nchunks, b, c, pair, flags);
    // A: the chunk's own state, both units, every dstate column (rows as store_state_tile).
    float acc[2][8][4];
    chunk_state_local_pair_body(p.x, p.Bm, p.dt_out, p.dA_cumsum, p.seq_idx, p.seqlen, p.nheads, p.headdim,
                                p.ngroups, p.dstate, p.chunk_size, p.nchunks, b, c, 0, pair, acc);
    // B: the hand-off.
    chain_hand_off<false, true>(acc, p.dA_cumsum, p.seq_idx, p.initial_states, p.chunk_states, p.final_states,
                                nullptr, flags, p.seqlen, p.nheads, p.headdim, p.dstate, p.chunk_size, p.nchunks, b, c,
                                pair);
}
SSD_LAYOUT_FIXED(ssd_state_chained, StateChainedParams, sizeof(StateChainedSmem<ChunkStateLocalPairSmem>));

// bf16 x and B: the bf16 pair body, whose accumulators hold their rows in the standard order.
extern "C" __global__ void __launch_bounds__(256, 2) ssd_state_chained_bf16(const StateChainedBf16Params p) {
    SSD_DYNAMIC_SMEM(smem_raw);
    StateChainedSmem<ChunkStateLocalPairBf16Smem>& sm =
        *reinterpret_cast<StateChainedSmem<ChunkStateLocalPairBf16Smem>*>(smem_raw);
    int b, c, pair;
    int* flags;
    chain_ticket(p.chain, sm.ticket, p.batch, p.nheads, p.headdim, p.nchunks, b, c, pair, flags);
    float acc[2][8][4];
    {
        const ChunkStateLocalBf16Params sp = {p.x,      p.Bm,      p.dt_out,  p.dA_cumsum, p.seq_idx,
                                              nullptr,  p.seqlen,  p.nheads,  p.headdim,   p.ngroups,
                                              p.dstate, p.chunk_size, p.nchunks};
        chunk_state_local_pair_bf16_body(sp, b, c, 0, pair, acc);
    }
    if (p.chunk_states != nullptr)
        chain_hand_off<true, true>(acc, p.dA_cumsum, p.seq_idx, p.initial_states, p.chunk_states, p.final_states,
                                   p.states_lo, flags, p.seqlen, p.nheads, p.headdim, p.dstate, p.chunk_size,
                                   p.nchunks, b, c, pair);
    else
        chain_hand_off<true, false>(acc, p.dA_cumsum, p.seq_idx, p.initial_states, nullptr, p.final_states,
                                    p.states_lo, flags, p.seqlen, p.nheads, p.headdim, p.dstate, p.chunk_size,
                                    p.nchunks, b, c, pair);
}
SSD_LAYOUT_FIXED(ssd_state_chained_bf16, StateChainedBf16Params, sizeof(StateChainedSmem<ChunkStateLocalPairBf16Smem>));
