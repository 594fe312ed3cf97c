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
