// Packed sequences (serving, batch 1; docs/gpu.md): what the global chunk grid of stages 1-3 does
// not give by itself. Stage 2 takes each sequence's initial state into the chunk states
// (chunk_init in fwd_pass_state/passing.cu and fused.cu); these two kernels add the rest.
//
// With cs = dA_cumsum[0, h, c, :] of token t's chunk c, dt' = dt_out[0, h, c, :], g = h / (nheads /
// ngroups), and a sequence k holding tokens [s_k, e_k) of the row:
//
// ssd_seq_init_out: the initial state's share of `out` in the sequence's first chunk (later
// chunks get it through chunk_states). One block of 256 threads per (range r, head h, tile of 32
// headdim rows p); range r = tokens [t0, t1) of one chunk, sequence k starting at t0 = s_k:
//   out[t, h, p] += gate(z[t, h, p]) * exp(cs[t] - cs[t0 - 1]) * sum_n C[t, g, n] * init_k[h, p, n]
// cs[t0 - 1] = 0 when t0 is the chunk's first token; gate(z) = z * sigmoid(z) when z is given,
// else 1; init_k = seq_init[k]. f32 products, the sum over n in order.
//
// ssd_states_at: the state after token e of sequence k, for a list of targets (each sequence's
// last token: varlen_states; listed positions: position_states). One block of 256 threads per
// (target j, head h, tile of 16 headdim rows p); with c = e's chunk, c0 its first token,
//   S = exp(cs[e]) * chunk_states[c, h]                    if s_k < c0 (k entered c carried)
//     = exp(cs[e] - cs[s_k - 1]) * init[i_k, h]            else, if k has an initial state
//     = 0                                                  else,
//   S += sum_{t = max(s_k, c0)}^{e} x[t, h, p] * (exp(cs[e] - cs[t]) * dt'[t] * B[t, g, n])
// in token order (f32 fused multiply-adds). A target with e < 0 (an empty sequence) is its
// initial state, or 0.
#define SV_THREADS 256
#define SV_OUT_TP 32    // headdim rows per block of ssd_seq_init_out
#define SV_OUT_TK 8     // tokens per step (one warp each)
#define SV_AT_TP 16     // headdim rows per block of ssd_states_at
#define SV_AT_TK 16     // tokens per step of ssd_states_at
#define SV_MAX_N 256    // MAX_DSTATE

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

// Shared memory of ssd_seq_init_out: the tile of the initial state (stride dstate + 1: the 32
// threads of a warp read 32 rows at one column without bank conflicts) and a step's C rows.
struct SeqInitOutSmem {
    float init[SV_OUT_TP * (SV_MAX_N + 1)];
    float c[SV_OUT_TK * SV_MAX_N];
};
static_assert(sizeof(SeqInitOutSmem) <= 48 * 1024, "static shared memory");

extern "C" __global__ void __launch_bounds__(SV_THREADS) ssd_seq_init_out(const SeqInitOutParams p) {
    __shared__ SeqInitOutSmem sm;
    const int r = blockIdx.x, h = blockIdx.y, p0 = blockIdx.z * SV_OUT_TP;
    const int tid = threadIdx.x, tp = tid % SV_OUT_TP, tl = tid / SV_OUT_TP;
    const int t0 = p.ranges[4 * r], t1 = p.ranges[4 * r + 1], k = p.ranges[4 * r + 2];
    const int N = p.dstate, stride = N + 1;
    const int rows = min(SV_OUT_TP, p.headdim - p0);
    const float* init = p.seq_init + (((i64)k * p.nheads + h) * p.headdim + p0) * N;
    for (int i = tid; i < rows * N; i += SV_THREADS) sm.init[(i / N) * stride + i % N] = init[i];
    const int c = t0 / p.chunk_size, c0 = c * p.chunk_size;
    const float* cs = p.dA_cumsum + ((i64)h * p.nchunks + c) * p.chunk_size;
    const float cs_pre = t0 > c0 ? cs[t0 - 1 - c0] : 0.0f;
    const int g = h / (p.nheads / p.ngroups);
    for (int tb = t0; tb < t1; tb += SV_OUT_TK) {
        __syncthreads();  // init is ready; the previous step's C rows have been read
        const int nt = min(SV_OUT_TK, t1 - tb);
        for (int i = tid; i < nt * N; i += SV_THREADS)
            sm.c[i] = p.C[((i64)(tb + i / N) * p.ngroups + g) * N + i % N];
        __syncthreads();
        const int t = tb + tl;
        if (tl < nt && tp < rows) {
            float dot = 0.0f;
            for (int n = 0; n < N; ++n) dot = fmaf(sm.c[tl * N + n], sm.init[tp * stride + n], dot);
            float v = expf(cs[t - c0] - cs_pre) * dot;
            const i64 o = ((i64)t * p.nheads + h) * p.headdim + p0 + tp;
            if (p.z != nullptr) {
                const float zz = p.z[o];
                v = v * zz / (1.0f + expf(-zz));
            }
            p.out[o] += v;
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

// Shared memory of ssd_states_at: one step's x rows, weighted B rows and weights.
struct StatesAtSmem {
    float x[SV_AT_TK * SV_AT_TP];
    float b[SV_AT_TK * SV_MAX_N];
};
static_assert(sizeof(StatesAtSmem) <= 48 * 1024, "static shared memory");

extern "C" __global__ void __launch_bounds__(SV_THREADS) ssd_states_at(const StatesAtParams p) {
    __shared__ StatesAtSmem sm;
    constexpr int PER = SV_AT_TP * SV_MAX_N / SV_THREADS;  // elements per thread, at most
    const int j = blockIdx.x, h = blockIdx.y, p0 = blockIdx.z * SV_AT_TP;
    const int tid = threadIdx.x;
    const int e = p.targets[4 * j], s = p.targets[4 * j + 1], ik = p.targets[4 * j + 2];
    const int N = p.dstate;
    const int rows = min(SV_AT_TP, p.headdim - p0);
    const int nel = rows * N;
    const i64 hstate = (i64)p.headdim * N;  // one head's state
    float acc[PER];
    if (e < 0) {  // an empty sequence: its initial state, or 0
        const float* init = ik >= 0 ? p.init + ((i64)ik * p.nheads + h) * hstate + (i64)p0 * N : nullptr;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int el = tid + i * SV_THREADS;
            acc[i] = el < nel && init != nullptr ? init[el] : 0.0f;
        }
    } else {
        const int c = e / p.chunk_size, c0 = c * p.chunk_size;
        const float* cs = p.dA_cumsum + ((i64)h * p.nchunks + c) * p.chunk_size;
        const float* dto = p.dt_out + ((i64)h * p.nchunks + c) * p.chunk_size;
        const float cs_e = cs[e - c0];
        const float* base = nullptr;
        float decay = 0.0f;
        if (s < c0) {
            base = p.chunk_states + ((i64)c * p.nheads + h) * hstate + (i64)p0 * N;
            decay = expf(cs_e);
        } else if (ik >= 0) {
            base = p.init + ((i64)ik * p.nheads + h) * hstate + (i64)p0 * N;
            decay = expf(cs_e - (s > c0 ? cs[s - 1 - c0] : 0.0f));
        }
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int el = tid + i * SV_THREADS;
            acc[i] = el < nel && base != nullptr ? decay * base[el] : 0.0f;
        }
        const int g = h / (p.nheads / p.ngroups);
        for (int tb = max(s, c0); tb <= e; tb += SV_AT_TK) {
            const int nt = min(SV_AT_TK, e + 1 - tb);
            __syncthreads();  // the previous step's rows have been read
            for (int i = tid; i < nt * SV_AT_TP; i += SV_THREADS) {
                const int t = tb + i / SV_AT_TP, pr = i % SV_AT_TP;
                sm.x[i] = pr < rows ? p.x[((i64)t * p.nheads + h) * p.headdim + p0 + pr] : 0.0f;
            }
            for (int i = tid; i < nt * N; i += SV_THREADS) {
                const int t = tb + i / N;
                const float w = expf(cs_e - cs[t - c0]) * dto[t - c0];
                sm.b[i] = w * p.Bm[((i64)t * p.ngroups + g) * N + i % N];
            }
            __syncthreads();
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                const int el = tid + i * SV_THREADS;
                if (el < nel) {
                    const int pr = el / N, n = el % N;
                    for (int l = 0; l < nt; ++l) acc[i] = fmaf(sm.x[l * SV_AT_TP + pr], sm.b[l * N + n], acc[i]);
                }
            }
        }
    }
    float* dst = p.states + ((i64)j * p.nheads + h) * hstate + (i64)p0 * N;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int el = tid + i * SV_THREADS;
        if (el < nel) dst[el] = acc[i];
    }
}
SSD_LAYOUT_FIXED(ssd_states_at, StatesAtParams, 0);
