// Stage 1: dt processing and the within-chunk inclusive cumsum of dt * A.
//
// One thread per (batch b, chunk c, head h), heads fastest so that a warp reads consecutive
// heads of one token (coalesced). For token t = c * chunk_size + l of the chunk:
//   dt'[l] = clamp(softplus?(dt[b, t, h] + dt_bias[h]), lo, hi)      (0 for t >= seqlen)
//   dA_cumsum[b, h, c, l] = sum_{k <= l} dt'[k] * A[h]                (sequential: deterministic)
// softplus(v) = v for v > 20, log1p(exp(v)) otherwise. Both outputs are [batch, nheads, nchunks,
// chunk_size]; past seqlen dt' = 0, so the cumsum stays flat there.
// dt' of one valid token: clamp(softplus?(v + dt_bias[h]), lo, hi), `bias` being dt_bias[h] or
// ignored when `has_bias` is 0. Every stage-1 kernel computes it here, so all give the same bits.
__device__ __forceinline__ float dt_processed(float v, int has_bias, float bias, int dt_softplus,
                                              float dt_lo, float dt_hi) {
    if (has_bias) v += bias;
    if (dt_softplus) v = v > 20.0f ? v : log1pf(expf(v));
    return fminf(fmaxf(v, dt_lo), dt_hi);
}

__device__ __forceinline__ void chunk_cumsum_body(
    const float* __restrict__ dt,       // [batch, seqlen, nheads]
    const float* __restrict__ A,        // [nheads]
    const float* __restrict__ dt_bias,  // [nheads] or null
    float* __restrict__ dt_out,         // [batch, nheads, nchunks, chunk_size]
    float* __restrict__ dA_cumsum,      // [batch, nheads, nchunks, chunk_size]
    int batch, int seqlen, int nheads, int chunk_size, int nchunks,
    int dt_softplus, float dt_lo, float dt_hi,
    int unroll16)  // 1: the 16-token path below (chunk_size a multiple of 16; version 2)
{
    i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    i64 total = (i64)batch * nchunks * nheads;
    if (idx >= total) return;
    int h = (int)(idx % nheads);
    i64 rest = idx / nheads;
    int c = (int)(rest % nchunks);
    int b = (int)(rest / nchunks);

    float a = A[h];
    float bias = dt_bias != nullptr ? dt_bias[h] : 0.0f;
    i64 t0 = (i64)c * chunk_size;
    i64 valid = (i64)seqlen - t0;
    if (valid > chunk_size) valid = chunk_size;
    const float* src = dt + ((i64)b * seqlen + t0) * nheads + h;
    i64 out = (((i64)b * nheads + h) * nchunks + c) * chunk_size;

    float cs = 0.0f;
    if (unroll16 && (chunk_size & 15) == 0) {
        // 16 tokens at a time: their loads in flight together, then the same sequential sum,
        // stored 16 bytes wide (out and l are multiples of 16 here).
        for (int l0 = 0; l0 < chunk_size; l0 += 16) {
            float v[16];
#pragma unroll
            for (int k = 0; k < 16; ++k) v[k] = l0 + k < valid ? src[(i64)(l0 + k) * nheads] : 0.0f;
            float cv[16];
#pragma unroll
            for (int k = 0; k < 16; ++k) {
                float u = 0.0f;
                if (l0 + k < valid) u = dt_processed(v[k], dt_bias != nullptr, bias, dt_softplus, dt_lo, dt_hi);
                v[k] = u;
                cs = __fadd_rn(cs, __fmul_rn(u, a));
                cv[k] = cs;
            }
#pragma unroll
            for (int k = 0; k < 16; k += 4) {
                *reinterpret_cast<float4*>(dt_out + out + l0 + k) = make_float4(v[k], v[k + 1], v[k + 2], v[k + 3]);
                *reinterpret_cast<float4*>(dA_cumsum + out + l0 + k) = make_float4(cv[k], cv[k + 1], cv[k + 2], cv[k + 3]);
            }
        }
        return;
    }
    for (int l = 0; l < chunk_size; ++l) {
        float v = 0.0f;
        if (l < valid) v = dt_processed(src[(i64)l * nheads], dt_bias != nullptr, bias, dt_softplus, dt_lo, dt_hi);
        cs = __fadd_rn(cs, __fmul_rn(v, a));
        dt_out[out + l] = v;
        dA_cumsum[out + l] = cs;
    }
}

// The parameters of ssd_chunk_cumsum and ssd_chunk_cumsum_tiled (Rust: ChunkCumsumParams).
struct ChunkCumsumParams {
    const float* dt;       // [batch, seqlen, nheads]
    const float* A;        // [nheads]
    const float* dt_bias;  // [nheads] or null
    float* dt_out;         // [batch, nheads, nchunks, chunk_size]
    float* dA_cumsum;      // [batch, nheads, nchunks, chunk_size]
    int batch, seqlen, nheads, chunk_size, nchunks;
    int dt_softplus;
    float dt_lo, dt_hi;
    int unroll16;  // ssd_chunk_cumsum only: 1 for the 16-token path (chunk_size a multiple of 16)
};
static_assert(sizeof(ChunkCumsumParams) == 80, "ChunkCumsumParams: the Rust struct has 80 bytes");

extern "C" __global__ void __launch_bounds__(128) ssd_chunk_cumsum(const ChunkCumsumParams p) {
    chunk_cumsum_body(p.dt, p.A, p.dt_bias, p.dt_out, p.dA_cumsum, p.batch, p.seqlen, p.nheads, p.chunk_size,
                      p.nchunks, p.dt_softplus, p.dt_lo, p.dt_hi, p.unroll16);
}
SSD_LAYOUT_FIXED(ssd_chunk_cumsum, ChunkCumsumParams, 0);

// Version 2's stage 1 for chunk_size <= CS_TILED_MAX: one block of 256 threads per (batch b,
// chunk c, 32 heads h0 ..). The block first loads the chunk's dt of its heads with every load
// in flight at once (a row of 32 heads of one token per warp: coalesced; up to 32 loads per
// thread issued before the first is used) and turns each value
// into dt' in shared memory; one thread per head then walks the chunk in order (the same
// products and the same sequential sum as above, so the same bits), storing dA_cumsum 16 bytes
// at a time; last, the whole block stores dt' row by row (coalesced). The per-thread kernel
// above waits one memory latency per 16 tokens, with few threads when batch * nchunks * nheads
// is small. Shared memory: chunk_size x 33 floats (static, 33.8 KB at chunk 256).
#define CS_TILED_MAX 256
#define CS_HEADS 32
__device__ __forceinline__ void chunk_cumsum_tiled_body(
    const float* __restrict__ dt,       // [batch, seqlen, nheads]
    const float* __restrict__ A,        // [nheads]
    const float* __restrict__ dt_bias,  // [nheads] or null
    float* __restrict__ dt_out,         // [batch, nheads, nchunks, chunk_size]
    float* __restrict__ dA_cumsum,      // [batch, nheads, nchunks, chunk_size]
    int batch, int seqlen, int nheads, int chunk_size, int nchunks,
    int dt_softplus, float dt_lo, float dt_hi)
{
    __shared__ float s[CS_TILED_MAX * (CS_HEADS + 1)];  // s[l * 33 + hh] = dt' of token l, head h0 + hh
    const int tid = threadIdx.x;
    const int c = blockIdx.x;
    const int h0 = blockIdx.y * CS_HEADS;
    const int b = blockIdx.z;
    const i64 t0 = (i64)c * chunk_size;
    const int valid = (int)min((i64)chunk_size, (i64)seqlen - t0);
    const int nh = min(CS_HEADS, nheads - h0);
    const float* src = dt + ((i64)b * seqlen + t0) * nheads + h0;
    // every load of the thread (up to 32) issued before the first is used
    constexpr int PER = CS_TILED_MAX * CS_HEADS / 256;
    const int hh = tid % CS_HEADS;  // the same head for every k: 256 is a multiple of CS_HEADS
    const bool head_ok = hh < nh;
    const float bias = (dt_bias != nullptr && head_ok) ? dt_bias[h0 + hh] : 0.0f;
    float v[PER];
#pragma unroll
    for (int k = 0; k < PER; ++k) {
        const int l = (tid + 256 * k) / CS_HEADS;
        v[k] = (l < valid && head_ok) ? src[(i64)l * nheads + hh] : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < PER; ++k) {
        const int l = (tid + 256 * k) / CS_HEADS;
        if (l >= chunk_size) break;  // l grows with k
        float u = 0.0f;
        if (l < valid && head_ok) u = dt_processed(v[k], dt_bias != nullptr, bias, dt_softplus, dt_lo, dt_hi);
        s[l * (CS_HEADS + 1) + hh] = u;
    }
    __syncthreads();
    if (tid < nh) {
        const int h = h0 + tid;
        const float a = A[h];
        float* out = dA_cumsum + (((i64)b * nheads + h) * nchunks + c) * chunk_size;
        float cs = 0.0f;
        for (int l0 = 0; l0 < chunk_size; l0 += 4) {
            float cv[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int l = l0 + k;
                const float u = l < chunk_size ? s[l * (CS_HEADS + 1) + tid] : 0.0f;
                cs = __fadd_rn(cs, __fmul_rn(u, a));
                cv[k] = cs;
            }
            if (l0 + 4 <= chunk_size && (chunk_size & 3) == 0) {
                *reinterpret_cast<float4*>(out + l0) = make_float4(cv[0], cv[1], cv[2], cv[3]);
            } else {
#pragma unroll
                for (int k = 0; k < 4; ++k)
                    if (l0 + k < chunk_size) out[l0 + k] = cv[k];
            }
        }
    }
    // dt' rows, consecutive threads along l
    for (int e = tid; e < nh * chunk_size; e += 256) {
        const int hh = e / chunk_size, l = e % chunk_size;
        dt_out[(((i64)b * nheads + h0 + hh) * nchunks + c) * chunk_size + l] = s[l * (CS_HEADS + 1) + hh];
    }
}

extern "C" __global__ void __launch_bounds__(256) ssd_chunk_cumsum_tiled(const ChunkCumsumParams p) {
    chunk_cumsum_tiled_body(p.dt, p.A, p.dt_bias, p.dt_out, p.dA_cumsum, p.batch, p.seqlen, p.nheads, p.chunk_size,
                            p.nchunks, p.dt_softplus, p.dt_lo, p.dt_hi);
}
// Static shared memory only (CS_TILED_MAX x 33 floats).
SSD_LAYOUT_FIXED(ssd_chunk_cumsum_tiled, ChunkCumsumParams, 0);
