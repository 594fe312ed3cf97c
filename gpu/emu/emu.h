// Host-side stand-ins for what the SSD kernels use of CUDA, for the CPU emulation (gpu/emu/),
// in place of kernels/ptx.cuh (every helper of that file is emulated here under its name, but
// the Hopper-only ones: the kernel that uses them, compute_out/wg_bf16.cu, is empty here):
// a block runs as blockDim host threads with std::barrier for __syncthreads/__syncwarp;
// mma.sync m16n8k8 TF32 and m16n8k16 BF16 are emulated warp-wide through a per-warp scratch (f32 sums in k order,
// so only comparisons between kernel versions are meaningful, not bits against the GPU);
// cp.async copies are queued per thread and done at cp.async.wait_group, so a read before the
// wait sees stale data; dynamic shared memory starts as NaN.
#pragma once
#include <cmath>
#include <cstring>
#include <cstdint>
#include <thread>
#include <barrier>
#include <vector>
#include <functional>
#include <algorithm>
#include <cstdio>
using std::min; using std::max;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __restrict__
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static
#define __constant__
// The block's dynamic shared memory (see launch in main.cpp).
#define SSD_DYNAMIC_SMEM(name) float* name = g_dyn
struct dim3e { unsigned x, y, z; };
struct float4 { float x, y, z, w; };
struct float2 { float x, y; };
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct int4 { int x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
template <class T> inline T __ldg(const T* p) { return *p; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
struct WarpScratch { float A[16][8]; float B[8][8]; unsigned addr[32]; float A16[16][16]; float B16[16][8]; };
// Up to 20 warps a block (the walking stage 2 with five units: 640 threads).
struct BlockCtx { std::barrier<>* bar; std::barrier<>* wbar[20]; WarpScratch ws[20]; float* dyn; };
extern thread_local dim3e threadIdx, blockIdx, blockDim;
extern thread_local BlockCtx* g_blk;
inline void __syncthreads() { g_blk->bar->arrive_and_wait(); }
inline void __syncwarp() { g_blk->wbar[threadIdx.x / 32]->arrive_and_wait(); }
#define g_dyn (g_blk->dyn)
inline float tf32_round(float v) {
    unsigned u = __float_as_uint(v);
    if ((u & 0x7f800000u) == 0x7f800000u) return v;
    u += 0x1000u; u &= 0xffffe000u; return __uint_as_float(u);
}
inline void mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    WarpScratch& w = g_blk->ws[threadIdx.x / 32];
    w.A[g][q] = __uint_as_float(a[0]); w.A[g + 8][q] = __uint_as_float(a[1]);
    w.A[g][q + 4] = __uint_as_float(a[2]); w.A[g + 8][q + 4] = __uint_as_float(a[3]);
    w.B[q][g] = __uint_as_float(b[0]); w.B[q + 4][g] = __uint_as_float(b[1]);
    __syncwarp();
    int rr[4] = {g, g, g + 8, g + 8}, cc[4] = {2 * q, 2 * q + 1, 2 * q, 2 * q + 1};
    for (int e = 0; e < 4; ++e) {
        float s = 0; for (int k = 0; k < 8; ++k) s += w.A[rr[e]][k] * w.B[k][cc[e]];
        d[e] = d[e] + s;
    }
    __syncwarp();
}
// bf16: round to nearest even (cvt.rn.bf16x2.f32), and the m16n8k16 product.
inline unsigned emu_bf16_rne(float v) {
    unsigned u = __float_as_uint(v);
    if ((u & 0x7f800000u) == 0x7f800000u) return (u >> 16) | ((u & 0xffffu) ? 0x40u : 0u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return u >> 16;
}
inline unsigned pack_bf16x2(float lo, float hi) { return emu_bf16_rne(lo) | (emu_bf16_rne(hi) << 16); }
inline float emu_lo(unsigned v) { return __uint_as_float(v << 16); }
inline float emu_hi(unsigned v) { return __uint_as_float(v & 0xffff0000u); }
inline void mma_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    WarpScratch& w = g_blk->ws[threadIdx.x / 32];
    for (int h = 0; h < 2; ++h) {
        w.A16[g][2 * q + 8 * h] = emu_lo(a[2 * h]); w.A16[g][2 * q + 8 * h + 1] = emu_hi(a[2 * h]);
        w.A16[g + 8][2 * q + 8 * h] = emu_lo(a[2 * h + 1]); w.A16[g + 8][2 * q + 8 * h + 1] = emu_hi(a[2 * h + 1]);
        w.B16[2 * q + 8 * h][g] = emu_lo(b[h]); w.B16[2 * q + 8 * h + 1][g] = emu_hi(b[h]);
    }
    __syncwarp();
    int rr[4] = {g, g, g + 8, g + 8}, cc[4] = {2 * q, 2 * q + 1, 2 * q, 2 * q + 1};
    for (int e = 0; e < 4; ++e) {
        float s = 0; for (int k = 0; k < 16; ++k) s += w.A16[rr[e]][k] * w.B16[k][cc[e]];
        d[e] = d[e] + s;
    }
    __syncwarp();
}
// deferred cp.async
struct Copy { void* dst; const void* src; int n; bool valid; };
extern thread_local std::vector<std::vector<Copy>> g_groups;
extern thread_local std::vector<Copy> g_cur;
inline void cp_async16(float* dst, const float* src, bool valid, const float*) { g_cur.push_back({dst, src, 16, valid}); }
inline void cp_async4(void* dst, const void* src, bool valid, const void*) { g_cur.push_back({dst, src, 4, valid}); }
inline void cp_async16_all(unsigned dst, const float* src) { g_cur.push_back({(char*)g_dyn + dst, src, 16, true}); }
inline void cp_async_commit() { g_groups.push_back(g_cur); g_cur.clear(); }
template <int N> inline void cp_async_wait() {
    while ((int)g_groups.size() > N) {
        for (auto& c : g_groups.front()) { if (c.valid) memcpy(c.dst, c.src, c.n); else memset(c.dst, 0, c.n); }
        g_groups.erase(g_groups.begin());
    }
}
// Shared addresses are byte offsets into the block's dynamic shared memory.
inline unsigned smem_addr(const void* p) { return (unsigned)((const char*)p - (const char*)g_dyn); }
inline void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
    int lane = threadIdx.x & 31;
    WarpScratch& w = g_blk->ws[threadIdx.x / 32];
    w.addr[lane] = addr;
    __syncwarp();
    for (int m = 0; m < 4; ++m) {
        unsigned a = w.addr[m * 8 + lane / 4] + 4u * (lane % 4);
        if (a % 4 || w.addr[m * 8 + lane / 4] % 16) { fprintf(stderr, "ldmatrix: misaligned row\n"); abort(); }
        memcpy(&r[m], (const char*)g_dyn + a, 4);
    }
    __syncwarp();
}
inline void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
    int lane = threadIdx.x & 31;
    WarpScratch& w = g_blk->ws[threadIdx.x / 32];
    w.addr[lane] = addr;
    __syncwarp();
    for (int m = 0; m < 4; ++m) {
        unsigned short lo, hi;
        unsigned r0 = w.addr[m * 8 + 2 * (lane % 4)], r1 = w.addr[m * 8 + 2 * (lane % 4) + 1];
        if (r0 % 16 || r1 % 16) { fprintf(stderr, "ldmatrix.trans: misaligned row\n"); abort(); }
        memcpy(&lo, (const char*)g_dyn + r0 + 2u * (lane / 4), 2);
        memcpy(&hi, (const char*)g_dyn + r1 + 2u * (lane / 4), 2);
        r[m] = (unsigned)lo | ((unsigned)hi << 16);
    }
    __syncwarp();
}
inline float ex2_approx(float v) { return exp2f(v); }
inline int tid_fresh() { return (int)threadIdx.x; }
// The chained stage 2's hand-off: blocks run one after the other here, in launch order, so a
// flag a block waits for was set by an earlier block; the atomics keep the host threads honest.
inline int ld_acquire_gpu(const int* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void st_release_gpu(int* p, int v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __nanosleep(unsigned) { std::this_thread::yield(); }
// L2 eviction policies: hints only, nothing to emulate.
inline unsigned long long l2_evict_first() { return 0; }
inline void cp_async16_hint(float* dst, const float* src, bool valid, const float* f, unsigned long long) { cp_async16(dst, src, valid, f); }
inline void st_hint_b32(void* p, unsigned v, unsigned long long) { std::memcpy(p, &v, 4); }
inline void st_v4(void* p, unsigned a, unsigned b, unsigned c, unsigned d) {
    const unsigned v[4] = {a, b, c, d};
    std::memcpy(p, v, 16);
}
inline void st_hint_v4(void* p, unsigned a, unsigned b, unsigned c, unsigned d, unsigned long long) { st_v4(p, a, b, c, d); }
inline void cp_async16_all_hint(unsigned dst, const float* src, unsigned long long) { cp_async16_all(dst, src); }
