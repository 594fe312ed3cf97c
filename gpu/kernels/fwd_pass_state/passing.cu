// Stage 2, 2b. The sequential pass across chunks, in place, one thread per (batch b, head h, V
// consecutive elements e of [headdim, dstate]) (grid: x over the elements, y = heads, z =
// batch; V = 4 with 16-byte loads when headdim * dstate is a multiple of 4, else 1). On entry
// chunk_states[b, c, h] holds L_c (2a); with S_0 = initial_states (0 when absent):
//   chunk_states[b, c, h] = S_c,   S_{c+1} = fma(scale_c, S_c, L_c),   final_states = S_nchunks,
//   scale_c = exp(cs[last_c]) if seq(last_c) == seq(last_{c-1}) (seq(last_{-1}) = 0), else 0,
// the same fused multiply-add, in the same order, as the CPU reference's state passing. The
// loads of 8 chunks are issued before their chain is walked.
// Packed sequences with one initial state each (serving, batch 1; docs/gpu.md): where
// chunk_init[c] = (k, s) with k >= 0, the sequence of the chunk's last token starts at the chunk's
// token s from seq_init[k], and L_c gains that state's share before the pass:
//   L_c <- fma(exp(cs[last_c] - cs[s - 1]), seq_init[k, h], L_c)  (cs[-1] = 0),  scale_c = 0.
// With bf16 activations the pass also writes states_lo[b, c, h] = bf16(S_c) (to nearest even):
// the operand the bf16 output kernel's product takes (bf16.cu), read there in half the bytes.
// With `lean` (bf16 outputs that do not keep chunk_states) it writes states_lo only: chunk_states
// keeps L_c (unspecified for the caller), a third of the pass's bytes fewer.
#define SP_THREADS 256
#define SP_UNROLL 8
template <int V>
struct vecf;
template <>
struct vecf<1> { typedef float T; };
template <>
struct vecf<4> { typedef float4 T; };
// S_c rounded to bf16 (to nearest even, as pack_bf16x2) into states_lo.
__device__ __forceinline__ void store_lo(bf16_t* dst, float v) { *dst = (bf16_t)(pack_bf16x2(v, 0.0f) & 0xffffu); }
__device__ __forceinline__ void store_lo(bf16_t* dst, float4 v) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(pack_bf16x2(v.x, v.y), pack_bf16x2(v.z, v.w));
}
__device__ __forceinline__ float vfma(float s, float a, float b) { return fmaf(s, a, b); }
__device__ __forceinline__ float4 vfma(float s, float4 a, float4 b) {
    return make_float4(fmaf(s, a.x, b.x), fmaf(s, a.y, b.y), fmaf(s, a.z, b.z), fmaf(s, a.w, b.w));
}
template <int V>
__device__ __forceinline__ void state_passing_body(
    const float* __restrict__ dA_cumsum, const float* __restrict__ initial_states, const int* __restrict__ seq_idx,
    float* __restrict__ chunk_states, float* __restrict__ final_states, int seqlen, int nheads, int headdim,
    int dstate, int chunk_size, int nchunks, const float* __restrict__ seq_init, const int* __restrict__ chunk_init,
    bf16_t* __restrict__ states_lo, bool lean)
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
    bf16_t* lo = states_lo != nullptr ? states_lo + ((i64)b * nchunks * nheads + h) * n + e : nullptr;
    const float* cs_row = dA_cumsum + bh * nchunks * chunk_size;
    int seq_prev = 0;
    for (int c0 = 0; c0 < nchunks; c0 += SP_UNROLL) {
        T own[SP_UNROLL];
        float sc[SP_UNROLL];
        int seq_last[SP_UNROLL];
        bool injected[SP_UNROLL];
        // Every load of the SP_UNROLL chunks first, so that they are in flight together (rather
        // than each chunk's exponent waiting for its cumsum load before the next chunk's loads).
#pragma unroll
        for (int k = 0; k < SP_UNROLL; ++k) {
            const int c = c0 + k;
            own[k] = T{};
            sc[k] = 0.0f;
            seq_last[k] = 0;
            injected[k] = false;
            if (c < nchunks) {
                own[k] = *reinterpret_cast<const T*>(p + (i64)c * cstride);
                const i64 t0 = (i64)c * chunk_size;
                const int last = (int)min((i64)chunk_size, (i64)seqlen - t0) - 1;
                if (seq_idx != nullptr) seq_last[k] = seq_idx[(i64)b * seqlen + t0 + last];
                sc[k] = cs_row[t0 + last];
                if (chunk_init != nullptr && chunk_init[2 * c] >= 0) {
                    const int s = chunk_init[2 * c + 1];
                    const float decay = expf(sc[k] - (s > 0 ? cs_row[t0 + s - 1] : 0.0f));
                    const T init = *reinterpret_cast<const T*>(seq_init + ((i64)chunk_init[2 * c] * nheads + h) * n + e);
                    own[k] = vfma(decay, init, own[k]);
                    injected[k] = true;  // scale_c = 0 below
                }
            }
        }
#pragma unroll
        for (int k = 0; k < SP_UNROLL; ++k) {
            if (c0 + k < nchunks) {
                sc[k] = !injected[k] && seq_last[k] == seq_prev ? expf(sc[k]) : 0.0f;
                seq_prev = seq_last[k];
            }
        }
#pragma unroll
        for (int k = 0; k < SP_UNROLL; ++k) {
            const int c = c0 + k;
            if (c < nchunks) {
                if (!lean) *reinterpret_cast<T*>(p + (i64)c * cstride) = run;
                if (lo != nullptr) store_lo(lo + (i64)c * cstride, run);
                run = vfma(sc[k], run, own[k]);
            }
        }
    }
    *reinterpret_cast<T*>(final_states + bh * n + e) = run;
}

// The parameters of ssd_state_passing (Rust: StatePassingParams).
struct StatePassingParams {
    const float* dA_cumsum;       // [batch, nheads, nchunks, chunk_size]
    const float* initial_states;  // [batch, nheads, headdim, dstate] or null
    const int* seq_idx;           // [batch, seqlen] or null
    float* chunk_states;          // [batch, nchunks, nheads, headdim, dstate]
    float* final_states;          // [batch, nheads, headdim, dstate]
    int seqlen, nheads, headdim, dstate, chunk_size, nchunks;
    int vec4;  // 1: 4 elements per thread (headdim * dstate a multiple of 4)
    int lean;  // 1: chunk_states not written (states_lo given, the outputs do not keep it)
    const float* seq_init;        // [nseq, nheads, headdim, dstate] or null (packed, batch 1)
    const int* chunk_init;        // [nchunks, 2]: (k or -1, first token of k in the chunk) or null
    bf16_t* states_lo;            // [batch, nchunks, nheads, headdim, dstate] or null
};
static_assert(sizeof(StatePassingParams) == 96, "StatePassingParams: the Rust struct has 96 bytes");

extern "C" __global__ void __launch_bounds__(SP_THREADS) ssd_state_passing(const StatePassingParams p) {
    if (p.vec4)
        state_passing_body<4>(p.dA_cumsum, p.initial_states, p.seq_idx, p.chunk_states, p.final_states, p.seqlen,
                              p.nheads, p.headdim, p.dstate, p.chunk_size, p.nchunks, p.seq_init, p.chunk_init, p.states_lo,
                              p.lean != 0 && p.states_lo != nullptr);
    else
        state_passing_body<1>(p.dA_cumsum, p.initial_states, p.seq_idx, p.chunk_states, p.final_states, p.seqlen,
                              p.nheads, p.headdim, p.dstate, p.chunk_size, p.nchunks, p.seq_init, p.chunk_init, p.states_lo,
                              p.lean != 0 && p.states_lo != nullptr);
}
SSD_LAYOUT_FIXED(ssd_state_passing, StatePassingParams, 0);
