// The inline PTX of the SSD kernels, in one file: TF32 rounding, the m16n8k8 TF32 and m16n8k16
// BF16 tensor-core products, bf16 packing, cp.async copies, ldmatrix and 2^x, and the
// declaration of the dynamic shared memory.
//
// NVRTC compiles this file first. The CPU emulation (gpu/emu/) includes every other kernel
// file as it is and replaces this one with gpu/emu/emu.h, which emulates each helper below
// under the same name: keep every `asm` of the kernels here.
//
// Fragment layouts of mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32, for lane
// `lane` with g = lane / 4 and q = lane % 4 (PTX ISA, "Matrix fragments for mma.m16n8k8"):
//   A (16 x 8, row major): a0 = A[g][q], a1 = A[g + 8][q], a2 = A[g][q + 4], a3 = A[g + 8][q + 4]
//   B (8 x 8, column):     b0 = B[q][g], b1 = B[q + 4][g]
//   C, D (16 x 8):         c0 = C[g][2q], c1 = C[g][2q + 1], c2 = C[g + 8][2q], c3 = C[g + 8][2q + 1]
// and of mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 ("for mma.m16n8k16"), each 32-bit
// register holding two bf16, the lower column (A) or row (B) in its low half:
//   A (16 x 16, row major): a0 = A[g][2q, 2q + 1], a1 = A[g + 8][2q, 2q + 1],
//                           a2 = A[g][2q + 8, 2q + 9], a3 = A[g + 8][2q + 8, 2q + 9]
//   B (16 x 8, column):     b0 = B[2q, 2q + 1][g], b1 = B[2q + 8, 2q + 9][g]
//   C, D: as above.

// The block's dynamic shared memory, as `float name[]` (16-byte aligned).
#define SSD_DYNAMIC_SMEM(name) extern __shared__ __align__(16) float name[]

// Rounds an f32 to TF32 (10 explicit mantissa bits), to nearest with ties away from zero, as
// the CPU emulation `MatmulPrecision::Tf32` does. The result is an f32 with 13 zero low bits.
__device__ __forceinline__ float tf32_round(float v) {
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
    return __uint_as_float(r);
}

// d += a * b on the tensor cores; operands are f32 bit patterns already rounded to TF32.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d += a * b on the tensor cores, bf16 operands (two per register), f32 accumulation.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Two f32 rounded to bf16 (to nearest, ties to even, as the CPU emulation
// `MatmulPrecision::Bf16` does), packed: `lo` in the low half.
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Asynchronous global -> shared copies (sm_80+). `valid == false` zero-fills the destination
// without reading (the source address is then replaced by `fallback`, a valid address).
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned long long a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (unsigned)a;
}

__device__ __forceinline__ void cp_async16(float* dst, const float* src, bool valid, const float* fallback) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
                 "l"(valid ? src : fallback), "r"(valid ? 16 : 0));
}

// The same, every byte valid.
__device__ __forceinline__ void cp_async16_all(unsigned dst, const float* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}

__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid, const void* fallback) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)),
                 "l"(valid ? src : fallback), "r"(valid ? 4 : 0));
}

// L2 eviction priority (sm_80+): a policy for the .L2::cache_hint copies below. evict_first
// marks data read once: it leaves L2 before the lines of normal priority.
__device__ __forceinline__ unsigned long long l2_evict_first() {
    unsigned long long pol;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}
__device__ __forceinline__ void cp_async16_hint(float* dst, const float* src, bool valid, const float* fallback,
                                                unsigned long long pol) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(smem_addr(dst)),
                 "l"(valid ? src : fallback), "r"(valid ? 16 : 0), "l"(pol));
}
__device__ __forceinline__ void cp_async16_all_hint(unsigned dst, const float* src, unsigned long long pol) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "l"(pol));
}
// A store with an L2 policy: data written for a later kernel, not for this one.
__device__ __forceinline__ void st_hint_b32(void* p, unsigned v, unsigned long long pol) {
    asm volatile("st.global.L2::cache_hint.b32 [%0], %1, %2;\n" ::"l"(p), "r"(v), "l"(pol) : "memory");
}
// 16-byte stores of four 32-bit words (p 16-byte aligned): plain, and with an L2 policy.
__device__ __forceinline__ void st_v4(void* p, unsigned a, unsigned b, unsigned c, unsigned d) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
__device__ __forceinline__ void st_hint_v4(void* p, unsigned a, unsigned b, unsigned c, unsigned d,
                                           unsigned long long pol) {
    asm volatile("st.global.L2::cache_hint.v4.b32 [%0], {%1, %2, %3, %4}, %5;\n" ::"l"(p), "r"(a), "r"(b), "r"(c),
                 "r"(d), "l"(pol)
                 : "memory");
}
// threadIdx.x read afresh (a volatile read of %tid.x that the compiler cannot hoist): for
// per-thread copy offsets recomputed at each step, where the hoisted values would be held in
// registers across a loop and spill (the pair output kernels at 128 registers).
__device__ __forceinline__ int tid_fresh() {
    int t;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
    return t;
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most N of this thread's committed groups are still pending; the completed
// copies are then visible to this thread (to the others after a barrier).
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Four 8 x 4 matrices of 32-bit words from shared memory, one instruction (ldmatrix with b16
// pairs read as one 32-bit word): lane l gives the address of row l % 8 of matrix l / 8, and
// receives in r[m] word l % 4 of row l / 4 of matrix m, which is the TF32 fragment layout
// (A: a0 = A[g][q]; B stored n-major: b0 = B[q][g]). Rows must be 16-byte aligned.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// The same four 8 x 8 matrices of 16-bit elements, transposed on the way: lane l receives in
// r[m] elements (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4) of matrix m (row, column as
// stored), the low half first. A row-major [k][n] bf16 tile so gives the m16n8k16 B fragment
// (b0 = B[2q, 2q + 1][g]), and a [k][m] tile the A fragment of its transpose.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// 2^v (ex2.approx: relative error below 2^-22, far under TF32's 2^-11; 2^-inf = 0).
__device__ __forceinline__ float ex2_approx(float v) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
    return r;
}

// The chained stage 2's hand-off between blocks (fwd_pass_state/chained.cu): a flag read with
// acquire and written with release semantics at GPU scope, so that the state a block wrote
// before its release is seen by the block that acquires the flag.
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_gpu(int* p, int v) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

// Hopper only (sm_90a; compiled out for every other target; the CPU emulation's sm_90a build
// emulates each under its name): tensor-memory copies (TMA) onto mbarriers, and warpgroup
// products (wgmma) with f32 accumulators.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// An mbarrier in shared memory (`addr` from smem_addr), expecting `count` arrivals per phase.
__device__ __forceinline__ void mbar_init(unsigned addr, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(addr), "r"(count) : "memory");
}
// Makes the initialised mbarriers visible to the copy engine (then a block barrier).
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;\n" ::: "memory");
}
// One arrival that also announces `bytes` of copies completing on this phase.
__device__ __forceinline__ void mbar_expect_tx(unsigned addr, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(addr), "r"(bytes) : "memory");
}
// One plain arrival (release semantics: this thread's earlier shared-memory writes are seen by
// the threads that then wait on the phase).
__device__ __forceinline__ void mbar_arrive(unsigned addr) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(addr) : "memory");
}
// Waits until phase `parity` of the mbarrier has completed (its copies are then visible).
__device__ __forceinline__ void mbar_wait(unsigned addr, unsigned parity) {
    unsigned done = 0;
    while (!done)
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(addr), "r"(parity)
            : "memory");
}
// A 3-D box of a tensor map (`tmap`: the generic address of a __grid_constant__ parameter) at
// coordinates (c0, c1, c2), innermost first, into shared memory at `dst`, completing on the
// mbarrier at `bar`. Elements outside the tensor arrive as zeros (and count as bytes).
__device__ __forceinline__ void tma_load_3d(unsigned dst, const void* tmap, int c0, int c1, int c2, unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(dst),
        "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}
// A 3-D box from shared memory at `src` to the tensor of `tmap` at (c0, c1, c2), innermost
// first, in this thread's bulk group; elements outside the tensor are not written. The source
// must have been written before a fence_proxy_async_smem by each writing thread.
__device__ __forceinline__ void tma_store_3d(const void* tmap, unsigned src, int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(tmap),
                 "r"(src), "r"(c0), "r"(c1), "r"(c2)
                 : "memory");
}
// Closes this thread's bulk group of stores.
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's bulk groups still read their shared-memory sources.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// Waits until all of this thread's bulk groups have completed (their writes are done).
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// Makes this thread's shared-memory writes visible to the copy engine (the async proxy).
__device__ __forceinline__ void fence_proxy_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// A barrier of `count` threads (a multiple of 32) on hardware barrier `id` (1 to 15; 0 is
// __syncthreads').
__device__ __forceinline__ void named_bar_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// Moves registers between the warpgroups of a block (all warps of the warpgroup execute it):
// the producer gives up registers (dec), the consumers take them (inc), per thread, a multiple
// of 8 between 24 and 256; the block's total stays that of its launch.
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// wgmma.mma_async.m64n64k16, bf16 operands, f32 accumulators d[8][4]: warp w of the warpgroup
// holds rows 16 w .. 16 w + 15 in the m16n8 C layout above (d[nf] the columns 8 nf ..); an A
// operand in registers takes the m16n8k16 A layout for the same rows. Shared operands come
// through matrix descriptors. The products run asynchronously: wgmma_fence before products whose
// registers other instructions wrote, wgmma_commit after them, wgmma_wait<N> until at most N
// committed groups are pending; only then may their registers be touched or their shared
// operands overwritten.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses of d across a fence or wait.
__device__ __forceinline__ void wgmma_hold(float (&d)[8][4]) {
#pragma unroll
    for (int nf = 0; nf < 8; ++nf)
        asm volatile("" : "+f"(d[nf][0]), "+f"(d[nf][1]), "+f"(d[nf][2]), "+f"(d[nf][3])::"memory");
}
// Descriptors of 64-row tiles stored as 128-byte rows with the 128-byte swizzle (16-byte piece
// p of row r at p ^ (r % 8); TMA's CU_TENSOR_MAP_SWIZZLE_128B), 8-row groups 1024 bytes apart,
// the tile 1024-byte aligned. K-major: a row holds 64 consecutive k of one m (or n); the k16
// slice kk of the row starts 32 kk bytes in. N-major (B only): a row holds 64 consecutive n of
// one k; the k16 slice kk starts 2048 kk bytes in.
__device__ __forceinline__ unsigned long long wgmma_desc_kmajor_sw128(unsigned addr) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | (1ull << 16) | ((unsigned long long)(1024u >> 4) << 32) |
           (1ull << 62);
}
__device__ __forceinline__ unsigned long long wgmma_desc_nmajor_sw128(unsigned addr) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | ((unsigned long long)(8192u >> 4) << 16) |
           ((unsigned long long)(1024u >> 4) << 32) | (1ull << 62);
}
#define SSD_WGMMA_D8x4(d)                                                                                            \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),         \
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),     \
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),     \
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),     \
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define SSD_WGMMA_D_LIST                                                                                             \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                        \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
// d = (accumulate ? d : 0) + A B over k = 16, A and B both K-major in shared memory.
__device__ __forceinline__ void wgmma_bf16_ss(float (&d)[8][4], unsigned long long da, unsigned long long db,
                                              int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " SSD_WGMMA_D_LIST
                 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : SSD_WGMMA_D8x4(d)
                 : "l"(da), "l"(db), "r"(accumulate));
}
// d += A B over k = 16: A (bf16 pairs, the m16n8k16 A layout) from registers, B N-major in
// shared memory.
__device__ __forceinline__ void wgmma_bf16_rs_nmajor(float (&d)[8][4], const unsigned (&a)[4], unsigned long long db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " SSD_WGMMA_D_LIST
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : SSD_WGMMA_D8x4(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
#endif
