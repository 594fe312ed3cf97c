// Shared helpers of the SSD kernels: TF32 rounding and the m16n8k8 TF32 tensor-core product.
//
// Every kernel file is compiled in one NVRTC program, after this file. No CUDA header is
// needed: the tensor-core product is inline PTX.
//
// Fragment layouts of mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32, for lane
// `lane` with g = lane / 4 and q = lane % 4 (PTX ISA, "Matrix fragments for mma.m16n8k8"):
//   A (16 x 8, row major): a0 = A[g][q], a1 = A[g + 8][q], a2 = A[g][q + 4], a3 = A[g + 8][q + 4]
//   B (8 x 8, column):     b0 = B[q][g], b1 = B[q + 4][g]
//   C, D (16 x 8):         c0 = C[g][2q], c1 = C[g][2q + 1], c2 = C[g + 8][2q], c3 = C[g + 8][2q + 1]

typedef long long i64;

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

// Loads an A fragment (16 x 8) from shared memory laid out row-major with `stride` floats:
// A[row][col] = base[row * stride + col], rows [0, 16), cols [0, 8).
__device__ __forceinline__ void load_a_rowmajor(unsigned (&a)[4], const float* base, int stride, int g, int q) {
    a[0] = __float_as_uint(base[g * stride + q]);
    a[1] = __float_as_uint(base[(g + 8) * stride + q]);
    a[2] = __float_as_uint(base[g * stride + q + 4]);
    a[3] = __float_as_uint(base[(g + 8) * stride + q + 4]);
}

// Loads an A fragment (16 x 8) stored transposed: A[row][col] = base[col * stride + row].
__device__ __forceinline__ void load_a_colmajor(unsigned (&a)[4], const float* base, int stride, int g, int q) {
    a[0] = __float_as_uint(base[q * stride + g]);
    a[1] = __float_as_uint(base[q * stride + g + 8]);
    a[2] = __float_as_uint(base[(q + 4) * stride + g]);
    a[3] = __float_as_uint(base[(q + 4) * stride + g + 8]);
}

// Loads a B fragment (8 x 8) stored row-major (k rows): B[k][n] = base[k * stride + n].
__device__ __forceinline__ void load_b_krows(unsigned (&b)[2], const float* base, int stride, int g, int q) {
    b[0] = __float_as_uint(base[q * stride + g]);
    b[1] = __float_as_uint(base[(q + 4) * stride + g]);
}

// Loads a B fragment (8 x 8) stored with n rows: B[k][n] = base[n * stride + k].
__device__ __forceinline__ void load_b_nrows(unsigned (&b)[2], const float* base, int stride, int g, int q) {
    b[0] = __float_as_uint(base[g * stride + q]);
    b[1] = __float_as_uint(base[g * stride + q + 4]);
}

// Copies a rows x cols tile of a row-major global matrix into shared memory, rounded to TF32:
// dst[r * dst_stride + c] = src[r * src_stride + c] for r < rows_valid and c < cols_valid,
// 0 elsewhere in [0, rows) x [0, cols). Consecutive threads read consecutive columns.
__device__ __forceinline__ void load_tile_tf32(float* dst, int dst_stride, const float* __restrict__ src,
                                               i64 src_stride, int rows_valid, int rows, int cols_valid,
                                               int cols, int tid, int nthreads) {
    for (int e = tid; e < rows * cols; e += nthreads) {
        int r = e / cols;
        int c = e - r * cols;
        float v = 0.0f;
        if (r < rows_valid && c < cols_valid) v = src[(i64)r * src_stride + c];
        dst[r * dst_stride + c] = tf32_round(v);
    }
}
