//! Hopper's warpgroup matrix product (`wgmma`, TF32, f32 accumulation) as the kernels use it:
//! operands in shared memory in the no-swizzle K-major layout, described by matrix descriptors,
//! or the A operand in registers; the accumulator layout. Checked against a CPU product on an
//! sm_90 device; elsewhere it says "skipped" (SSD_REQUIRE_GPU=1 makes a missing GPU a failure,
//! a non-Hopper GPU is still a skip).

use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};

const PROBE: &str = r#"
// Element (r, k) of a K-major operand with 8 columns of k (one k8 step): core matrices of
// 8 rows x 4 floats (128 contiguous bytes), the two along k 128 bytes apart (LBO), the
// 8-row groups 256 bytes apart (SBO).
__device__ int kmajor(int r, int k) { return (r / 8) * 64 + (k / 4) * 32 + (r % 8) * 4 + (k % 4); }

__device__ unsigned long long desc(const float* p, unsigned lbo, unsigned sbo) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p);
    return (unsigned long long)((a >> 4) & 0x3FFF) | ((unsigned long long)((lbo >> 4) & 0x3FFF) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3FFF) << 32);
}

#define ACC64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define OUT64(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// mode 0: A and B from shared memory; mode 1: A from registers (row 16 w + g (+8), column
// q (+4) for warp w, g = lane / 4, q = lane % 4), B from shared memory.
// a: [64][8], b: [128][8] row-major in global; out[tid][64].
extern "C" __global__ void wgmma_probe(const float* a, const float* b, float* out, int mode, int lbo, int sbo) {
    __shared__ __align__(128) float as[64 * 8];
    __shared__ __align__(128) float bs[128 * 8];
    const int tid = threadIdx.x;
    for (int e = tid; e < 64 * 8; e += 128) as[kmajor(e / 8, e % 8)] = a[e];
    for (int e = tid; e < 128 * 8; e += 128) bs[kmajor(e / 8, e % 8)] = b[e];
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    float d[64];
    for (int i = 0; i < 64; ++i) d[i] = 0.0f;
    const unsigned long long db = desc(bs, lbo, sbo);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    if (mode == 0) {
        const unsigned long long da = desc(as, lbo, sbo);
        asm volatile("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 " ACC64 ", %64, %65, 1, 1, 1;\n"
                     : OUT64(d) : "l"(da), "l"(db));
    } else {
        const int w = tid / 32, g = (tid % 32) / 4, q = tid % 4;
        unsigned ra[4];
        ra[0] = __float_as_uint(a[(16 * w + g) * 8 + q]);
        ra[1] = __float_as_uint(a[(16 * w + g + 8) * 8 + q]);
        ra[2] = __float_as_uint(a[(16 * w + g) * 8 + q + 4]);
        ra[3] = __float_as_uint(a[(16 * w + g + 8) * 8 + q + 4]);
        asm volatile("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 " ACC64 ", {%64, %65, %66, %67}, %68, 1, 1, 1;\n"
                     : OUT64(d) : "r"(ra[0]), "r"(ra[1]), "r"(ra[2]), "r"(ra[3]), "l"(db));
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    for (int i = 0; i < 64; ++i) out[tid * 64 + i] = d[i];
}
"#;

fn require_gpu() -> bool {
    std::env::var("SSD_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

#[test]
fn wgmma_tf32_layouts() {
    let Some(ctx) = ssd_gpu::Gpu::new(0)
        .ok()
        .and_then(|_| CudaContext::new(0).ok())
    else {
        assert!(!require_gpu(), "SSD_REQUIRE_GPU=1 but no CUDA device");
        println!("skipped: no CUDA device");
        return;
    };
    if ctx.compute_capability().ok() != Some((9, 0)) {
        println!("skipped: wgmma needs compute capability 9.0");
        return;
    }
    let opts = CompileOptions {
        arch: Some("sm_90a"),
        options: vec!["--std=c++17".into()],
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(PROBE, opts).expect("the probe compiles");
    let module = ctx.load_module(ptx).expect("loads");
    let f = module.load_function("wgmma_probe").expect("has the probe");
    let stream = ctx.default_stream();
    // Small integers: exact in TF32 and in the f32 sums.
    let a: Vec<f32> = (0..64 * 8)
        .map(|i| ((i * 7 + 3) % 11) as f32 - 5.0)
        .collect();
    let b: Vec<f32> = (0..128 * 8)
        .map(|i| ((i * 5 + 1) % 13) as f32 - 6.0)
        .collect();
    let a_d = stream.clone_htod(&a).unwrap();
    let b_d = stream.clone_htod(&b).unwrap();
    let mut out_d = stream.alloc_zeros::<f32>(128 * 64).unwrap();
    let mut failures = Vec::new();
    for mode in [0i32, 1] {
        for (lbo, sbo) in [(128i32, 256i32), (256, 128)] {
            let mut l = stream.launch_builder(&f);
            l.arg(&a_d)
                .arg(&b_d)
                .arg(&mut out_d)
                .arg(&mode)
                .arg(&lbo)
                .arg(&sbo);
            let cfg = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the argument list matches wgmma_probe; the buffers hold 64 x 8, 128 x 8
            // and 128 x 64 floats.
            unsafe { l.launch(cfg) }.unwrap();
            let out = stream.clone_dtoh(&out_d).unwrap();
            let mut bad = 0;
            for tid in 0..128 {
                let (w, g, q) = (tid / 32, (tid % 32) / 4, tid % 4);
                for r in 0..64 {
                    let (nf, e) = (r / 4, r % 4);
                    let row = 16 * w + g + 8 * (e >> 1);
                    let col = 8 * nf + 2 * q + (e & 1);
                    let want: f32 = (0..8).map(|k| a[row * 8 + k] * b[col * 8 + k]).sum();
                    if out[tid * 64 + r] != want {
                        bad += 1;
                    }
                }
            }
            println!("wgmma mode {mode} (0: A in shared memory, 1: A in registers), LBO {lbo}, SBO {sbo}: {bad} of 8192 wrong");
            if (lbo, sbo) == (128, 256) && bad > 0 {
                failures.push(mode);
            }
        }
    }
    assert!(
        failures.is_empty(),
        "modes {failures:?} disagree with the assumed layouts"
    );
}
