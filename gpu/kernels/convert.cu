// Element-wise conversions between bf16 and f32, for bf16 I/O where no bf16 kernel serves the
// shape or the kernel variant (the host widens x, B, C and z to f32, runs the f32 kernels and
// narrows out to bf16; docs/gpu.md, "bf16 I/O"). One thread per element, 256 per block.

// The parameters of ssd_widen_bf16 and ssd_narrow_bf16 (Rust: ConvertParams).
struct ConvertParams {
    const void* src;  // n elements: bf16 (widen) or f32 (narrow)
    void* dst;        // n elements: f32 (widen) or bf16 (narrow)
    i64 n;
};
static_assert(sizeof(ConvertParams) == 24, "ConvertParams: the Rust struct has 24 bytes");

// dst[i] = src[i], exactly (every bf16 is an f32).
extern "C" __global__ void __launch_bounds__(256) ssd_widen_bf16(const ConvertParams p) {
    const i64 i = (i64)blockIdx.x * 256 + threadIdx.x;
    if (i < p.n) static_cast<float*>(p.dst)[i] = bf16_lo(static_cast<const bf16_t*>(p.src)[i]);
}
SSD_LAYOUT_FIXED(ssd_widen_bf16, ConvertParams, 0);

// dst[i] = bf16(src[i]), to nearest even.
extern "C" __global__ void __launch_bounds__(256) ssd_narrow_bf16(const ConvertParams p) {
    const i64 i = (i64)blockIdx.x * 256 + threadIdx.x;
    if (i < p.n) static_cast<bf16_t*>(p.dst)[i] = (bf16_t)(pack_bf16x2(static_cast<const float*>(p.src)[i], 0.0f) & 0xffffu);
}
SSD_LAYOUT_FIXED(ssd_narrow_bf16, ConvertParams, 0);
