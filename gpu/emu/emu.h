// Host-side stand-ins for what the SSD kernels use of CUDA, for the CPU emulation (gpu/emu/),
// in place of kernels/ptx.cuh (every helper of that file is emulated here under its name; the
// Hopper-only ones, TMA, mbarriers and wgmma, where SSD_EMU_SM90 is defined, which also takes
// the kernels' sm_90a paths: see the end of this file):
// a block runs as blockDim host threads with std::barrier for __syncthreads/__syncwarp;
// mma.sync m16n8k8 TF32 and m16n8k16 BF16 are emulated warp-wide through a per-warp scratch (f32 sums in k order,
// so only comparisons between kernel versions are meaningful, not bits against the GPU);
// cp.async copies are queued per thread and done at cp.async.wait_group, so a read before the
// wait sees stale data; dynamic shared memory starts as NaN.
#pragma once
#ifdef SSD_EMU_SM90
#define __CUDA_ARCH_FEAT_SM90_ALL 1
#endif
#include <map>
#include <memory>
#include <mutex>
#include <chrono>
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
// An mbarrier's state (SSD_EMU_SM90): arrivals expected per phase, still pending in this one,
// transaction bytes still pending, phases completed.
struct MbarState { unsigned count, pending; long long tx; unsigned phase; };
// Per block: the barriers, each warp's and warpgroup's scratch, the mbarriers (by shared address)
// and the named barriers (created at first use with their thread count), under `mu`.
struct BlockCtx {
    std::barrier<>* bar; std::barrier<>* wbar[20]; WarpScratch ws[20]; float* dyn;
    std::barrier<>* gbar[5]; float WA[5][64][16];
    std::mutex mu; std::map<unsigned, MbarState> mbar; std::unique_ptr<std::barrier<>> nbar[16];
};
extern thread_local dim3e threadIdx, blockIdx, blockDim, gridDim;
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

#ifdef SSD_EMU_SM90
// The Hopper-only helpers (ptx.cuh's sm_90a section), emulated synchronously: a TMA copy is
// done when issued and then completes its bytes on the mbarrier; a wgmma computes its result
// when issued (the warpgroup exchanging register operands through a scratch between two
// 128-thread barriers), so fences, commits and waits have nothing to do; an mbarrier is a state
// under the block's mutex, and its waits spin (yielding) until the phase completes, aborting
// after 60 s (a deadlock). Operand layouts are read as the hardware reads them: the 128-byte
// swizzle XORs address bits 4-6 with bits 7-9 of the shared address (byte offsets from the block's
// dynamic shared memory, which therefore starts 1024-byte aligned).
inline float __fdividef(float a, float b) { return a / b; }
inline void emu_die(const char* what) { fprintf(stderr, "emulation: %s\n", what); abort(); }
inline MbarState& emu_mbar(unsigned addr) {
    auto it = g_blk->mbar.find(addr);
    if (it == g_blk->mbar.end()) emu_die("mbarrier used before mbarrier.init");
    return it->second;
}
inline void emu_mbar_settle(MbarState& s) {
    if (s.pending == 0 && s.tx == 0) { s.phase++; s.pending = s.count; }
}
inline void mbar_init(unsigned addr, unsigned count) {
    std::lock_guard<std::mutex> l(g_blk->mu);
    g_blk->mbar[addr] = {count, count, 0, 0};
}
inline void mbar_init_fence() {}
inline void emu_mbar_arrive(unsigned addr, long long bytes) {
    std::lock_guard<std::mutex> l(g_blk->mu);
    MbarState& s = emu_mbar(addr);
    if (s.pending == 0) emu_die("mbarrier: more arrivals than its count in one phase");
    s.tx += bytes;
    s.pending--;
    emu_mbar_settle(s);
}
inline void mbar_expect_tx(unsigned addr, unsigned bytes) { emu_mbar_arrive(addr, bytes); }
inline void mbar_arrive(unsigned addr) { emu_mbar_arrive(addr, 0); }
inline void emu_mbar_complete_tx(unsigned addr, long long bytes) {
    std::lock_guard<std::mutex> l(g_blk->mu);
    MbarState& s = emu_mbar(addr);
    s.tx -= bytes;
    emu_mbar_settle(s);
}
inline void mbar_wait(unsigned addr, unsigned parity) {
    const auto t0 = std::chrono::steady_clock::now();
    for (;;) {
        {
            std::lock_guard<std::mutex> l(g_blk->mu);
            if ((emu_mbar(addr).phase & 1u) != (parity & 1u)) return;
        }
        if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(60)) emu_die("mbarrier wait: 60 s (deadlock)");
        std::this_thread::yield();
    }
}
// The tensor map (TmaDesc's 128 bytes; the host's cuTensorMapEncodeTiled in gpu/src/tma.rs):
// a bf16 array at `base`, dims innermost first, byte strides of axes 1 and 2, boxes of
// 64 x 64 x 1 with the 128-byte swizzle. emu_tmap_3d fills one.
struct EmuTmap { const unsigned short* base; long long dims[3], strides[2]; };
inline void emu_tmap_3d(void* desc, const void* base, long long d0, long long d1, long long d2, long long s1, long long s2) {
    static_assert(sizeof(EmuTmap) <= 128, "fits a CUtensorMap");
    const EmuTmap t = {(const unsigned short*)base, {d0, d1, d2}, {s1, s2}};
    memset(desc, 0, 128);
    memcpy(desc, &t, sizeof t);
}
inline unsigned emu_swz128(unsigned a) { return a ^ (((a >> 7) & 7u) << 4); }
// Element (c0, c1, c2) of the map, or null outside it.
inline unsigned short* emu_tmap_at(const EmuTmap& t, long long c0, long long c1, long long c2) {
    const bool ok = c0 >= 0 && c1 >= 0 && c2 >= 0 && c0 < t.dims[0] && c1 < t.dims[1] && c2 < t.dims[2];
    return ok ? (unsigned short*)((const char*)t.base + c2 * t.strides[1] + c1 * t.strides[0] + c0 * 2) : nullptr;
}
// One 64 x 64 box at (c0, c1, c2) between the map and the swizzled tile at shared address `tile`:
// a load zero-fills what lies outside the tensor, a store skips it.
inline void emu_tma_box(const void* tmap, unsigned tile, int c0, int c1, int c2, bool load) {
    EmuTmap t;
    memcpy(&t, tmap, sizeof t);
    if (tile % 1024) emu_die("TMA: shared tile not 1024-byte aligned (the swizzle's atom)");
    for (int r = 0; r < 64; ++r)
        for (int e = 0; e < 64; ++e) {
            unsigned short* g = emu_tmap_at(t, (long long)c0 + e, (long long)c1 + r, c2);
            char* sh = (char*)g_dyn + emu_swz128(tile + 128u * r + 2u * e);
            if (load) {
                const unsigned short v = g ? *g : 0;
                memcpy(sh, &v, 2);
            } else if (g) {
                memcpy(g, sh, 2);
            }
        }
}
inline void tma_load_3d(unsigned dst, const void* tmap, int c0, int c1, int c2, unsigned bar) {
    emu_tma_box(tmap, dst, c0, c1, c2, true);
    emu_mbar_complete_tx(bar, 8192);
}
inline void tma_store_3d(const void* tmap, unsigned src, int c0, int c1, int c2) {
    emu_tma_box(tmap, src, c0, c1, c2, false);
}
inline void bulk_commit() {}
template <int N> inline void bulk_wait_read() {}
inline void bulk_wait_all() {}
inline void fence_proxy_async_smem() {}
inline void named_bar_sync(int id, int count) {
    std::barrier<>* b;
    {
        std::lock_guard<std::mutex> l(g_blk->mu);
        if (!g_blk->nbar[id]) g_blk->nbar[id].reset(new std::barrier<>(count));
        b = g_blk->nbar[id].get();
    }
    b->arrive_and_wait();
}
template <int N> inline void setmaxnreg_dec() {}
template <int N> inline void setmaxnreg_inc() {}
inline void wgmma_fence() {}
inline void wgmma_commit() {}
template <int N> inline void wgmma_wait() {}
inline void wgmma_hold(float (&)[8][4]) {}
// The descriptors as ptx.cuh builds them (start address / 16 in bits 0-13, leading byte offset
// / 16 in 16-29, stride byte offset / 16 in 32-45, the 128-byte swizzle in 62-63).
inline unsigned long long wgmma_desc_kmajor_sw128(unsigned addr) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | (1ull << 16) | ((unsigned long long)(1024u >> 4) << 32) | (1ull << 62);
}
inline unsigned long long wgmma_desc_nmajor_sw128(unsigned addr) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | ((unsigned long long)(8192u >> 4) << 16) |
           ((unsigned long long)(1024u >> 4) << 32) | (1ull << 62);
}
// Element (row, col) of a 128-byte-swizzled operand: rows of 64 bf16 (128 bytes), 8-row groups
// the descriptor's stride byte offset apart. K-major: row m (or n), column k; N-major: row k,
// column n (n < 64: one swizzle atom wide, the leading byte offset unused).
inline float emu_desc_at(unsigned long long d, int row, int col) {
    if ((d >> 62) != 1) emu_die("wgmma descriptor: not the 128-byte swizzle");
    const unsigned start = (unsigned)(d & 0x3FFFu) << 4, sbo = (unsigned)((d >> 32) & 0x3FFFu) << 4;
    unsigned short v;
    memcpy(&v, (const char*)g_dyn + emu_swz128(start + (row / 8) * sbo + (row % 8) * 128u + 2u * col), 2);
    return emu_lo(v);
}
// wgmma m64n64k16: thread (warp w of the warpgroup, lane g, q) holds d[nf][2 hf + e] at row
// 16 w + g + 8 hf, column 8 nf + 2 q + e. f32 sums in k order, then added to d.
template <class AF, class BF>
inline void emu_wgmma(float (&d)[8][4], AF a, BF b, bool accumulate) {
    const int w = (threadIdx.x % 128) / 32, g = (threadIdx.x & 31) >> 2, q = threadIdx.x & 3;
    for (int nf = 0; nf < 8; ++nf)
        for (int e = 0; e < 4; ++e) {
            const int row = 16 * w + g + 8 * (e >> 1), col = 8 * nf + 2 * q + (e & 1);
            float s = 0;
            for (int k = 0; k < 16; ++k) s += a(row, k) * b(k, col);
            d[nf][e] = (accumulate ? d[nf][e] : 0.0f) + s;
        }
}
// d = (accumulate ? d : 0) + A B, A and B K-major in shared memory.
inline void wgmma_bf16_ss(float (&d)[8][4], unsigned long long da, unsigned long long db, int accumulate) {
    emu_wgmma(d, [&](int m, int k) { return emu_desc_at(da, m, k); }, [&](int k, int n) { return emu_desc_at(db, n, k); },
              accumulate != 0);
}
// d += A B, A (the m16n8k16 A layout, this warp's 16 rows) from registers through the
// warpgroup's scratch, B N-major in shared memory.
inline void wgmma_bf16_rs_nmajor(float (&d)[8][4], const unsigned (&a)[4], unsigned long long db) {
    if (blockDim.x % 128) emu_die("wgmma in a block that is not whole warpgroups");
    const int wg = threadIdx.x / 128, w = (threadIdx.x % 128) / 32, g = (threadIdx.x & 31) >> 2, q = threadIdx.x & 3;
    float(&A)[64][16] = g_blk->WA[wg];
    for (int h = 0; h < 2; ++h) {
        A[16 * w + g][2 * q + 8 * h] = emu_lo(a[2 * h]);
        A[16 * w + g][2 * q + 8 * h + 1] = emu_hi(a[2 * h]);
        A[16 * w + g + 8][2 * q + 8 * h] = emu_lo(a[2 * h + 1]);
        A[16 * w + g + 8][2 * q + 8 * h + 1] = emu_hi(a[2 * h + 1]);
    }
    g_blk->gbar[wg]->arrive_and_wait();
    emu_wgmma(d, [&](int m, int k) { return A[m][k]; }, [&](int k, int n) { return emu_desc_at(db, k, n); }, true);
    g_blk->gbar[wg]->arrive_and_wait();
}
#endif
