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
    let specs = draw_specs(env_usize("SSD_GPU_CASES", 2000), 0x55D_0000, 0, |rng| {
        random_spec(rng, 4_000_000)
    });
    let runs = run_cases(&gpus, &specs, Io::F32);
    println!("fuzz coverage: {}", coverage(&specs));
    report("fuzz", &runs, specs.len());
}

#[test]
fn gpu_fuzz_pair_kernel_shapes() {
    let Some(gpus) = gpus_or_skip("gpu_fuzz_pair_kernel_shapes") else {
        return;
    };
    let specs = draw_specs(
        env_usize("SSD_GPU_PAIR_CASES", 400),
        0x9A1_0000,
        7_000_000,
        |rng| random_pair_spec(rng, 4_000_000),
    );
    let state_pairs = specs
        .iter()
        .filter(|(s, _)| gpus[0].1.uses_pair_kernels(&s.dims, &s.options).0)
        .count();
    println!(
        "pair kernel shapes: pair 2a in {state_pairs} of {} cases",
        specs.len()
    );
    run_served_cases(
        "pair kernel shapes",
        &gpus,
        &specs,
        Io::F32,
        "pair output kernel",
        |gpu, s| gpu.uses_pair_kernels(&s.dims, &s.options).1,
    );
}

#[test]
fn gpu_chained_matches_stage_by_stage() {
    let Some(gpus) = gpus_or_skip("gpu_chained_matches_stage_by_stage") else {
        return;
    };
    check_chained("chained f32", &gpus, Io::F32, 0xC4A_0000, 13_000_000);
}

/// Fixed shapes for the sanitizer runs (and a quick check of their own): ragged seqlen,
/// seq_idx, ngroups > 1, every option, dstate at the limit, chunk 256 and the largest chunk,
/// and one on the chained stage 2 (132 chains).
pub fn sanitizer_specs() -> Vec<(ProblemSpec, u64)> {
    let dims = Dims::new;
    let mut specs = vec![
        ProblemSpec::full(dims(2, 300, 4, 40, 2, 72), 64),
        ProblemSpec::full(dims(1, 517, 2, 64, 1, 256), 256),
        ProblemSpec::full(dims(1, 70, 2, 16, 2, 16), ssd_gpu::MAX_CHUNK_SIZE),
        ProblemSpec::full(dims(2, 33, 6, 65, 3, 9), 1),
        ProblemSpec::plain(dims(1, 256, 2, 64, 1, 128)),
        // 132 chains: the chained stage 2 on the H200, 3 chunks, every option.
        ProblemSpec::full(dims(1, 300, 264, 64, 2, 128), 128),
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
    // The walking stage 2, each form on the shapes above that it serves and on ten units a
    // group.
    let mut walk = specs;
    walk.extend(walk_fixed_specs());
    for form in WALK_FORMS {
        report_served(
            &format!("sanitizer shapes, walking stage 2, {}", walk_label(form)),
            &walk_gpu("gpu_sanitizer_shapes", form),
            &walk,
            Io::F32,
            |gpu, s| walk_serves(gpu, s, form, false),
        );
    }
}

/// The walking stage 2 in f32 (`ssd_state_walk_1`, `_2`, `_5`) forced on its shapes, each
/// form on `SSD_GPU_WALK_CASES` (default 700) cases of every option, against the float64
/// reference; then the sanitizer shapes and two more that it serves, on each form.
#[test]
fn gpu_walking_stage2_shapes() {
    let Some(_) = gpu_or_skip("gpu_walking_stage2_shapes") else {
        return;
    };
    let mut fixed = sanitizer_specs();
    fixed.extend(walk_fixed_specs());
    check_walk(
        "gpu_walking_stage2_shapes",
        Io::F32,
        0xF5_0000,
        17_000_000,
        &fixed,
    );
}

/// Every element of every output is written by the forward, on every variant (the coverage
/// `Gpu::alloc_outputs` relies on): outputs filled with NaN beforehand keep none.
#[test]
fn gpu_outputs_are_fully_written() {
    let Some(gpus) = gpus_or_skip("gpu_outputs_are_fully_written") else {
        return;
    };
    assert_fully_written(&gpus, &sanitizer_specs(), Io::F32);
    let mut walk = sanitizer_specs();
    walk.extend(walk_fixed_specs());
    for form in WALK_FORMS {
        assert_fully_written(
            &walk_gpu("gpu_outputs_are_fully_written", form),
            &walk,
            Io::F32,
        );
    }
}

#[test]
fn gpu_is_bitwise_reproducible() {
    let Some(gpus) = gpus_or_skip("gpu_is_bitwise_reproducible") else {
        return;
    };
    let mut rng = SpecRng::new(77);
    let mut specs: Vec<ProblemSpec> = (0..6).map(|_| random_spec(&mut rng, 4_000_000)).collect();
    specs.push(ProblemSpec::full(Dims::new(2, 1000, 8, 64, 2, 128), 256));
    // Ten units a group: every walking form but the segmented walk serves it; then the
    // segmented walk's shapes (no seq_idx), dstate 256 among them.
    specs.push(ProblemSpec::full(Dims::new(2, 600, 10, 64, 1, 128), 256));
    specs.extend(walk_fixed_specs().into_iter().skip(1).map(|(s, _)| s));
    let specs: Vec<(ProblemSpec, u64)> = specs.into_iter().zip(500..).collect();
    assert_reproducible(&gpus, &specs, Io::F32);
    for form in WALK_FORMS {
        assert_reproducible(
            &walk_gpu("gpu_is_bitwise_reproducible", form),
            &specs,
            Io::F32,
        );
    }
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
