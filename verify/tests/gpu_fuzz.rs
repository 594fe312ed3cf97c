//! The GPU kernels against the float64 reference on seeded random problems covering every
//! size and option of the contract, plus run-to-run reproducibility and clean refusals.
//!
//! Without a GPU these tests print "skipped: no CUDA device" and pass; `SSD_REQUIRE_GPU=1`
//! makes that a failure. `SSD_GPU_CASES` sets the number of fuzz cases (default 2000),
//! `SSD_GPU_SEED` the first seed. Every case runs under every kernel variant
//! (`ssd_gpu::Variant::ALL`), each summarised on its own lines.

mod gpu_support;

use gpu_support::*;
use ssd_reference::random::{
    random_pair_spec, random_problem, random_spec, DSkip, ProblemSpec, SeqIdx, SpecRng,
};
use ssd_reference::{Dims, Options};

#[test]
fn gpu_fuzz_matches_float64_reference() {
    let Some(gpus) = gpus_or_skip("gpu_fuzz_matches_float64_reference") else {
        return;
    };
    let cases = env_usize("SSD_GPU_CASES", 2000);
    let first = env_usize("SSD_GPU_SEED", 1) as u64;
    let mut rng = SpecRng::new(0x55D_0000 + first);
    let specs: Vec<(ProblemSpec, u64)> = (0..cases as u64)
        .map(|k| (random_spec(&mut rng, 4_000_000), first + k))
        .collect();
    let runs = run_cases(&gpus, &specs, Io::F32);
    let count = |f: &dyn Fn(&ProblemSpec) -> bool| specs.iter().filter(|(s, _)| f(s)).count();
    println!(
        "fuzz coverage: seq_idx {} | initial_states {} | z {} | D per head {} / per channel {} | dt_bias {} | softplus {} | dt_limit set {} | ngroups>1 {} | ragged seqlen {} | chunk>=256 {} | dstate>128 {} | headdim%64!=0 {}",
        count(&|s| s.seq_idx != SeqIdx::None),
        count(&|s| s.initial_states),
        count(&|s| s.z),
        count(&|s| s.d == DSkip::PerHead),
        count(&|s| s.d == DSkip::PerChannel),
        count(&|s| s.dt_bias),
        count(&|s| s.options.dt_softplus),
        count(&|s| s.options.dt_limit != (0.0, f64::INFINITY)),
        count(&|s| s.dims.ngroups > 1),
        count(&|s| s.dims.seqlen % s.options.chunk_size != 0),
        count(&|s| s.options.chunk_size >= 256),
        count(&|s| s.dims.dstate > 128),
        count(&|s| s.dims.headdim % 64 != 0),
    );
    report("fuzz", &runs, specs.len());
}

#[test]
fn gpu_fuzz_pair_kernel_shapes() {
    let Some(gpus) = gpus_or_skip("gpu_fuzz_pair_kernel_shapes") else {
        return;
    };
    let gpu = &gpus[0].1;
    let cases = env_usize("SSD_GPU_PAIR_CASES", 400);
    let first = env_usize("SSD_GPU_SEED", 1) as u64;
    let mut rng = SpecRng::new(0x9A1_0000 + first);
    let specs: Vec<(ProblemSpec, u64)> = (0..cases as u64)
        .map(|k| (random_pair_spec(&mut rng, 4_000_000), 7_000_000 + first + k))
        .collect();
    let taken = |which: fn((bool, bool)) -> bool| {
        specs
            .iter()
            .filter(|(s, _)| which(gpu.uses_pair_kernels(&s.dims, &s.options)))
            .count()
    };
    let (state_pairs, out_pairs) = (taken(|k| k.0), taken(|k| k.1));
    println!(
        "pair kernel shapes: pair 2a in {state_pairs}, pair output kernel in {out_pairs} of {} cases",
        specs.len()
    );
    if out_pairs == 0 {
        println!("gpu_fuzz_pair_kernel_shapes: skipped: this device runs no pair kernel");
        return;
    }
    // Every drawn shape is one the pair output kernel serves: a generator that drifted would
    // leave this test checking the other kernels.
    assert_eq!(out_pairs, specs.len(), "shapes off the pair output kernel");
    report(
        "pair kernel shapes",
        &run_cases(&gpus, &specs, Io::F32),
        specs.len(),
    );
}

/// Fixed shapes for the sanitizer runs (and a quick check of their own): ragged seqlen,
/// seq_idx, ngroups > 1, every option, dstate at the limit, chunk 256 and the largest chunk.
pub fn sanitizer_specs() -> Vec<(ProblemSpec, u64)> {
    let dims = Dims::new;
    let mut specs = vec![
        ProblemSpec::full(dims(2, 300, 4, 40, 2, 72), 64),
        ProblemSpec::full(dims(1, 517, 2, 64, 1, 256), 256),
        ProblemSpec::full(dims(1, 70, 2, 16, 2, 16), ssd_gpu::MAX_CHUNK_SIZE),
        ProblemSpec::full(dims(2, 33, 6, 65, 3, 9), 1),
        ProblemSpec::plain(dims(1, 256, 2, 64, 1, 128)),
    ];
    specs[1].seq_idx = SeqIdx::AtChunkStarts { every: 1 };
    specs[3].d = DSkip::PerHead;
    specs[3].seq_idx = SeqIdx::Segments {
        segments: 3,
        first: 1,
    };
    specs.into_iter().zip(100..).collect()
}

#[test]
fn gpu_sanitizer_shapes() {
    let Some(gpus) = gpus_or_skip("gpu_sanitizer_shapes") else {
        return;
    };
    let specs = sanitizer_specs();
    report(
        "sanitizer shapes",
        &run_cases(&gpus, &specs, Io::F32),
        specs.len(),
    );
}

#[test]
fn gpu_is_bitwise_reproducible() {
    let Some(gpus) = gpus_or_skip("gpu_is_bitwise_reproducible") else {
        return;
    };
    let mut rng = SpecRng::new(77);
    let mut specs: Vec<ProblemSpec> = (0..6).map(|_| random_spec(&mut rng, 4_000_000)).collect();
    specs.push(ProblemSpec::full(
        Dims {
            batch: 2,
            seqlen: 1000,
            nheads: 8,
            headdim: 64,
            ngroups: 2,
            dstate: 128,
        },
        256,
    ));
    for (k, spec) in specs.iter().enumerate() {
        let (p32, _) = as_f32_problem(&random_problem(spec, 500 + k as u64).expect("valid spec"));
        for (variant, gpu) in &gpus {
            let first = bits(&gpu.forward(&p32).expect("GPU forward"));
            for _ in 0..3 {
                let again = bits(&gpu.forward(&p32).expect("GPU forward"));
                assert!(
                    first == again,
                    "run-to-run difference ({variant:?}) on {}",
                    describe(spec, 500 + k as u64)
                );
            }
        }
    }
    println!(
        "reproducible: {} problems, 4 runs each under each of {} variants, bitwise identical",
        specs.len(),
        gpus.len()
    );
}

#[test]
fn gpu_refuses_unsupported_shapes_cleanly() {
    let Some(gpus) = gpus_or_skip("gpu_refuses_unsupported_shapes_cleanly") else {
        return;
    };
    let mut spec = ProblemSpec::plain(Dims {
        batch: 1,
        seqlen: 10,
        nheads: 1,
        headdim: 4,
        ngroups: 1,
        dstate: ssd_gpu::MAX_DSTATE + 1,
    });
    spec.options = Options {
        chunk_size: 8,
        ..Options::default()
    };
    let (p32, _) = as_f32_problem(&random_problem(&spec, 1).expect("valid spec"));
    for (_, gpu) in &gpus {
        let err = gpu
            .forward(&p32)
            .expect_err("dstate above the limit must be refused");
        assert!(matches!(err, ssd_gpu::GpuError::Unsupported(_)), "{err}");
        assert!(err.to_string().contains("dstate"), "{err}");
    }
}
