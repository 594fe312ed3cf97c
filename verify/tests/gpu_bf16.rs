//! The GPU's bf16 path (`Gpu::forward_bf16`: `x`, `B`, `C`, `z` and `out` in bf16, bf16
//! tensor-core products, f32 states) against the float64 reference of the same bf16 inputs,
//! under the bf16 error model (`docs/tolerances.md`, `--precision bf16`), on seeded random
//! problems over every size and option, under every kernel variant (the variants and shapes
//! the bf16 kernels do not serve run through widened f32 copies, and are checked the same way);
//! plus shapes that the bf16 kernels serve, fixed shapes for the sanitizer, run-to-run
//! reproducibility and the refusals.
//!
//! Without a GPU these tests print "skipped: no CUDA device" and pass; `SSD_REQUIRE_GPU=1`
//! makes that a failure. `SSD_GPU_BF16_CASES` sets the number of fuzz cases (default 2000),
//! `SSD_GPU_BF16_PAIR_CASES` those on the bf16 kernels' shapes (default 2000),
//! `SSD_GPU_BF16_WG_CASES` those on the Hopper output kernel's shapes (default 2000),
//! `SSD_GPU_WALK_CASES` those of each form of the walking stage 2 (default 700), `SSD_GPU_SEED`
//! the first seed.

mod gpu_support;

use gpu_support::*;
use ssd_reference::random::{
    random_pair_spec, random_problem, random_spec, DSkip, ProblemSpec, SeqIdx, SpecRng,
};
use ssd_reference::Dims;

/// A spec the bf16 kernels serve on the default variant: a pair kernel shape
/// ([`random_pair_spec`]) with headdim and dstate rounded up to multiples of 8 (which keeps
/// the number of 64-column units, so the units still pair up).
fn bf16_kernel_spec(rng: &mut SpecRng) -> ProblemSpec {
    let mut spec = random_pair_spec(rng, 4_000_000);
    spec.dims.headdim = spec.dims.headdim.next_multiple_of(8);
    spec.dims.dstate = spec.dims.dstate.next_multiple_of(8);
    spec
}

#[test]
fn gpu_bf16_fuzz_matches_float64_reference() {
    let Some(gpus) = gpus_or_skip("gpu_bf16_fuzz_matches_float64_reference") else {
        return;
    };
    let specs = draw_specs(
        env_usize("SSD_GPU_BF16_CASES", 2000),
        0xBF1_0000,
        11_000_000,
        |rng| random_spec(rng, 4_000_000),
    );
    let native = specs
        .iter()
        .filter(|(s, _)| gpus[0].1.runs_bf16(&s.dims, &s.options))
        .count();
    println!(
        "bf16 fuzz coverage: on the bf16 kernels (default variant) {native} | {}",
        coverage(&specs)
    );
    report(
        "bf16 fuzz",
        &run_cases(&gpus, &specs, Io::Bf16),
        specs.len(),
    );
}

#[test]
fn gpu_bf16_kernel_shapes() {
    let Some(gpus) = gpus_or_skip("gpu_bf16_kernel_shapes") else {
        return;
    };
    let specs = draw_specs(
        env_usize("SSD_GPU_BF16_PAIR_CASES", 2000),
        0xBF2_0000,
        12_000_000,
        bf16_kernel_spec,
    );
    run_served_cases(
        "bf16 kernel shapes",
        &gpus,
        &specs,
        Io::Bf16,
        "bf16 kernels",
        |gpu, s| gpu.runs_bf16(&s.dims, &s.options),
    );
}

/// A spec the Hopper output kernel serves (`Gpu::runs_wg_out`): headdim 64, dstate 128, chunks
/// of 128 or 256 tokens, no seq_idx, 2 or 4 heads per group, every other option drawn.
fn wg_kernel_spec(rng: &mut SpecRng) -> ProblemSpec {
    let mut spec = random_spec(rng, 4_000_000);
    let ngroups = rng.range(1, 2);
    let nheads = ngroups * rng.pick(&[2usize, 4]);
    let chunk = rng.pick(&[128usize, 256]);
    spec.dims = Dims::new(
        rng.range(1, 2),
        rng.range(65, 700),
        nheads,
        64,
        ngroups,
        128,
    );
    spec.options.chunk_size = chunk;
    spec.seq_idx = SeqIdx::None;
    spec
}

/// A spec the Hopper output kernel serves at dstate 256 where `GpuConfig::wg_out_n256` lets it:
/// [`wg_kernel_spec`] with dstate 256 and chunks of 128 tokens.
fn wg256_kernel_spec(rng: &mut SpecRng) -> ProblemSpec {
    let mut spec = wg_kernel_spec(rng);
    spec.dims.dstate = 256;
    spec.options.chunk_size = 128;
    spec
}

/// The Hopper output kernel at dstate 256 (`ssd_compute_out_wg_bf16_n256`, version 70, taken
/// only where `GpuConfig::wg_out_n256` lets it): `SSD_GPU_BF16_WG256_CASES` (default 1000) cases
/// of its shapes against the float64 reference, then the same with the persistent grid capped
/// at 3 blocks.
#[test]
fn gpu_bf16_hopper_output_kernel_dstate256_shapes() {
    let Some(_) = gpu_or_skip("gpu_bf16_hopper_output_kernel_dstate256_shapes") else {
        return;
    };
    let test = "gpu_bf16_hopper_output_kernel_dstate256_shapes";
    let specs = draw_specs(
        env_usize("SSD_GPU_BF16_WG256_CASES", 1000),
        0xBF4_0000,
        16_000_000,
        wg256_kernel_spec,
    );
    println!(
        "bf16 Hopper output kernel dstate 256 shapes: {}",
        coverage(&specs)
    );
    for (label, gpus) in [
        (
            "bf16 Hopper output kernel dstate 256 shapes",
            wg_n256_gpu(test, None),
        ),
        (
            "bf16 Hopper output kernel dstate 256 shapes, 3 persistent blocks",
            wg_n256_gpu(test, Some(3)),
        ),
    ] {
        run_served_cases(
            label,
            &gpus,
            &specs,
            Io::Bf16,
            "Hopper output kernel",
            |gpu, s| gpu.runs_wg_out(&s.dims, &s.options, s.seq_idx != SeqIdx::None),
        );
    }
}

#[test]
fn gpu_bf16_hopper_output_kernel_shapes() {
    let Some(gpus) = gpus_or_skip("gpu_bf16_hopper_output_kernel_shapes") else {
        return;
    };
    let specs = draw_specs(
        env_usize("SSD_GPU_BF16_WG_CASES", 2000),
        0xBF3_0000,
        15_000_000,
        wg_kernel_spec,
    );
    println!("bf16 Hopper output kernel shapes: {}", coverage(&specs));
    run_served_cases(
        "bf16 Hopper output kernel shapes",
        &gpus,
        &specs,
        Io::Bf16,
        "Hopper output kernel",
        |gpu, s| gpu.runs_wg_out(&s.dims, &s.options, s.seq_idx != SeqIdx::None),
    );
    // The same cases with the persistent grid capped at 3 blocks: each block then walks up to
    // a few dozen items, through every ring slot and both halves of the per-item buffers.
    run_served_cases(
        "bf16 Hopper output kernel shapes, 3 persistent blocks",
        &capped_gpu("gpu_bf16_hopper_output_kernel_shapes", 3),
        &specs,
        Io::Bf16,
        "Hopper output kernel",
        |gpu, s| gpu.runs_wg_out(&s.dims, &s.options, s.seq_idx != SeqIdx::None),
    );
}

/// The walking stage 2 (`ssd_state_walk_bf16_1`, `_2`, `_5`) forced on its shapes, each form
/// on `SSD_GPU_WALK_CASES` (default 700) cases of every option, against the float64 reference;
/// then the sanitizer shapes and two more that it serves, on each form.
#[test]
fn gpu_bf16_walking_stage2_shapes() {
    let Some(_) = gpu_or_skip("gpu_bf16_walking_stage2_shapes") else {
        return;
    };
    let mut fixed = bf16_sanitizer_specs();
    fixed.extend(walk_fixed_specs());
    check_walk(
        "gpu_bf16_walking_stage2_shapes",
        Io::Bf16,
        0xBF5_0000,
        16_000_000,
        &fixed,
    );
}

#[test]
fn gpu_bf16_chained_matches_stage_by_stage() {
    let Some(gpus) = gpus_or_skip("gpu_bf16_chained_matches_stage_by_stage") else {
        return;
    };
    check_chained("chained bf16", &gpus, Io::Bf16, 0xC4B_0000, 14_000_000);
}

/// Fixed shapes for the sanitizer runs (and a quick check of their own): on the bf16 kernels
/// with every option, seq_idx, ragged seqlen, ngroups > 1, dstate 256 and 8, chunk 512; and
/// one shape each variant widens (headdim 36); and one on the chained stage 2 (132 chains).
pub fn bf16_sanitizer_specs() -> Vec<(ProblemSpec, u64)> {
    let dims = Dims::new;
    let mut specs = vec![
        ProblemSpec::full(dims(2, 300, 4, 64, 2, 72), 128),
        ProblemSpec::full(dims(1, 517, 2, 64, 1, 256), 256),
        ProblemSpec::full(dims(1, 700, 4, 40, 2, 8), 512),
        ProblemSpec::plain(dims(1, 256, 2, 64, 1, 128)),
        ProblemSpec::full(dims(1, 200, 2, 36, 1, 16), 128),
        // 132 chains: the chained stage 2 on the H200 (the walking stage 2 by default on
        // Hopper, 264 units), 3 chunks, every option.
        ProblemSpec::full(dims(1, 300, 264, 64, 2, 128), 128),
    ];
    specs[1].seq_idx = SeqIdx::AtChunkStarts { every: 1 };
    specs[2].d = DSkip::PerHead;
    specs[2].seq_idx = SeqIdx::Segments {
        segments: 3,
        first: 1,
    };
    specs[3].options.chunk_size = 256;
    specs.into_iter().zip(300..).collect()
}

#[test]
fn gpu_bf16_sanitizer_shapes() {
    let Some(gpus) = gpus_or_skip("gpu_bf16_sanitizer_shapes") else {
        return;
    };
    let specs = bf16_sanitizer_specs();
    let native = specs
        .iter()
        .filter(|(s, _)| gpus[0].1.runs_bf16(&s.dims, &s.options))
        .count();
    println!(
        "bf16 sanitizer shapes: {native} of {} on the bf16 kernels",
        specs.len()
    );
    report(
        "bf16 sanitizer shapes",
        &run_cases(&gpus, &specs, Io::Bf16),
        specs.len(),
    );
    // The Hopper output kernel's shapes with its persistent grid capped at 2 blocks, so that
    // each block walks several items (24 and 16 here): every option, then a ragged last chunk.
    let mut wg = vec![
        ProblemSpec::full(Dims::new(2, 700, 4, 64, 2, 128), 128),
        ProblemSpec::full(Dims::new(1, 1000, 8, 64, 2, 128), 256),
    ];
    for s in &mut wg {
        s.seq_idx = SeqIdx::None;
    }
    let wg: Vec<(ProblemSpec, u64)> = wg.into_iter().zip(320..).collect();
    // The walking stage 2, each form on the shapes above that it serves, and on ten units a
    // group.
    let mut walk = bf16_sanitizer_specs();
    walk.extend(walk_fixed_specs());
    for form in WALK_FORMS {
        report_served(
            &format!(
                "bf16 sanitizer shapes, walking stage 2, {}",
                walk_label(form)
            ),
            &walk_gpu("gpu_bf16_sanitizer_shapes", form),
            &walk,
            Io::Bf16,
            |gpu, s| walk_serves(gpu, s, form, true),
        );
    }
    // The chained stage 2 on the shapes it serves, with the walking stage 2 off (the default
    // walks bf16 on Hopper where the units fill the device: the 132-chain shape there).
    report_served(
        "bf16 sanitizer shapes, chained stage 2",
        &chained_gpu("gpu_bf16_sanitizer_shapes"),
        &specs,
        Io::Bf16,
        |gpu, s| gpu.uses_chained(&s.dims, &s.options),
    );
    let capped = capped_gpu("gpu_bf16_sanitizer_shapes", 2);
    if wg
        .iter()
        .all(|(s, _)| capped[0].1.runs_wg_out(&s.dims, &s.options, false))
    {
        report(
            "bf16 sanitizer shapes, Hopper output kernel, 2 persistent blocks",
            &run_cases(&capped, &wg, Io::Bf16),
            wg.len(),
        );
    } else {
        println!(
            "bf16 sanitizer shapes: skipped the Hopper output kernel's: not run here (not a Hopper device, or SSD_GPU_WG=0)"
        );
    }
    // The same kernel at dstate 256 (`GpuConfig::wg_out_n256`), 2 persistent blocks: every
    // option but seq_idx, then a ragged last chunk.
    let wide = wg256_sanitizer_specs();
    report_served(
        "bf16 sanitizer shapes, Hopper output kernel dstate 256, 2 persistent blocks",
        &wg_n256_gpu("gpu_bf16_sanitizer_shapes", Some(2)),
        &wide,
        Io::Bf16,
        |gpu, s| gpu.runs_wg_out(&s.dims, &s.options, false),
    );
}

/// Two shapes of the dstate-256 Hopper output kernel: every option but seq_idx (2 groups of 2
/// heads), then one group of 4 heads with a ragged last chunk.
fn wg256_sanitizer_specs() -> Vec<(ProblemSpec, u64)> {
    let mut specs = vec![
        ProblemSpec::full(Dims::new(2, 500, 4, 64, 2, 256), 128),
        ProblemSpec::full(Dims::new(1, 700, 4, 64, 1, 256), 128),
    ];
    for s in &mut specs {
        s.seq_idx = SeqIdx::None;
    }
    specs.into_iter().zip(340..).collect()
}

/// Every element of every output is written by the forward, on every variant (the coverage
/// `Gpu::alloc_outputs` relies on): outputs filled with NaN beforehand keep none.
#[test]
fn gpu_bf16_outputs_are_fully_written() {
    let Some(gpus) = gpus_or_skip("gpu_bf16_outputs_are_fully_written") else {
        return;
    };
    assert_fully_written(&gpus, &bf16_sanitizer_specs(), Io::Bf16);
    // The walking stage 2, also on shapes every form serves.
    let mut walk = bf16_sanitizer_specs();
    walk.extend(walk_fixed_specs());
    for form in WALK_FORMS {
        assert_fully_written(
            &walk_gpu("gpu_bf16_outputs_are_fully_written", form),
            &walk,
            Io::Bf16,
        );
    }
    assert_fully_written(
        &wg_n256_gpu("gpu_bf16_outputs_are_fully_written", None),
        &wg256_sanitizer_specs(),
        Io::Bf16,
    );
}

#[test]
fn gpu_bf16_is_bitwise_reproducible() {
    let Some(gpus) = gpus_or_skip("gpu_bf16_is_bitwise_reproducible") else {
        return;
    };
    let mut rng = SpecRng::new(78);
    let mut specs: Vec<ProblemSpec> = (0..4).map(|_| bf16_kernel_spec(&mut rng)).collect();
    specs.extend((0..2).map(|_| random_spec(&mut rng, 4_000_000)));
    specs.push(ProblemSpec::full(Dims::new(2, 1000, 8, 64, 2, 128), 256));
    // The same without seq_idx: the Hopper output kernel's shape.
    let mut wg = ProblemSpec::full(Dims::new(2, 1000, 8, 64, 2, 128), 256);
    wg.seq_idx = SeqIdx::None;
    specs.push(wg);
    // Ten units a group: every walking form but the segmented walk serves it; then the
    // segmented walk's shapes (no seq_idx), dstate 256 among them.
    specs.push(ProblemSpec::full(Dims::new(2, 600, 10, 64, 1, 128), 256));
    specs.extend(walk_fixed_specs().into_iter().skip(1).map(|(s, _)| s));
    let specs: Vec<(ProblemSpec, u64)> = specs.into_iter().zip(600..).collect();
    assert_reproducible(&gpus, &specs, Io::Bf16);
    for form in WALK_FORMS {
        assert_reproducible(
            &walk_gpu("gpu_bf16_is_bitwise_reproducible", form),
            &specs,
            Io::Bf16,
        );
    }
    assert_reproducible(
        &wg_n256_gpu("gpu_bf16_is_bitwise_reproducible", None),
        &wg256_sanitizer_specs(),
        Io::Bf16,
    );
}

/// Outputs that do not keep `chunk_states` (`set_keep_chunk_states(false)`) get the same
/// `out`, final states and dA_cumsum, bit for bit, under every variant, on both stage 2 paths:
/// the chained kernel, and 2a + 2b, whose pass then writes the states' bf16 copy alone (dstate
/// 256 and few chains below, and the bf16 kernel shapes that the chained kernel does not take).
#[test]
fn gpu_bf16_lean_outputs_match_kept() {
    let Some(gpus) = gpus_or_skip("gpu_bf16_lean_outputs_match_kept") else {
        return;
    };
    let mut rng = SpecRng::new(79);
    let mut specs: Vec<ProblemSpec> = (0..8).map(|_| bf16_kernel_spec(&mut rng)).collect();
    specs.push(ProblemSpec::full(Dims::new(1, 700, 4, 64, 1, 256), 128));
    specs.push(ProblemSpec::full(Dims::new(2, 1000, 8, 64, 2, 128), 256));
    specs.push(ProblemSpec::full(Dims::new(2, 600, 10, 64, 1, 128), 256));
    // The segmented walk's shapes (no seq_idx), dstate 256 among them.
    specs.extend(walk_fixed_specs().into_iter().skip(1).map(|(s, _)| s));
    let mut gpus = gpus;
    for form in WALK_FORMS {
        gpus.extend(walk_gpu("gpu_bf16_lean_outputs_match_kept", form));
    }
    let mut staged = 0;
    for (spec, seed) in specs.iter().zip(700..) {
        let (p32, _) = Io::Bf16.problems(&random_problem(spec, seed).expect("valid spec"));
        for (variant, gpu) in &gpus {
            if *variant == gpus[0].0
                && gpu.runs_bf16(&spec.dims, &spec.options)
                && !gpu.uses_chained(&spec.dims, &spec.options)
                && gpu
                    .state_walk_units(&spec.dims, &spec.options, true)
                    .is_none()
                && gpu
                    .state_walk_segments(
                        &spec.dims,
                        &spec.options,
                        true,
                        spec.seq_idx != SeqIdx::None,
                    )
                    .is_none()
            {
                staged += 1;
            }
            let kept = bits(&Io::Bf16.forward(gpu, &p32).expect("GPU forward"));
            let lean = Io::Bf16
                .forward_lean_bits(gpu, &p32)
                .expect("GPU forward, chunk_states not kept");
            assert!(
                lean[..] == kept[..lean.len()],
                "bf16 outputs change when chunk_states is not kept ({variant:?}) on {}",
                describe(spec, seed)
            );
        }
    }
    // dstate 256 always takes 2a + 2b on the bf16 kernels.
    assert!(staged > 0, "no case reached 2a + 2b on the bf16 kernels");
    println!(
        "bf16 lean outputs: {} cases under {} variants bitwise equal with and without chunk_states kept, {staged} on 2a + 2b",
        specs.len(),
        gpus.len()
    );
}

#[test]
fn gpu_bf16_out_holds_bf16_values_and_refusals_are_clean() {
    let Some(gpus) = gpus_or_skip("gpu_bf16_out_holds_bf16_values_and_refusals_are_clean") else {
        return;
    };
    let gpu = &gpus[0].1;
    let spec = ProblemSpec::full(Dims::new(1, 300, 4, 64, 1, 128), 256);
    let (p32, _) = as_bf16_problem(&random_problem(&spec, 5).expect("valid spec"));
    let o = gpu.forward_bf16(&p32).expect("GPU forward");
    assert!(
        o.out.iter().all(|v| v.to_bits() & 0xffff == 0),
        "out must hold bf16 values"
    );
    // The stage functions refuse bf16 activations on a shape the bf16 kernels do not serve
    // (the whole forward widens instead), naming the condition.
    let odd = ProblemSpec::plain(Dims::new(1, 300, 2, 36, 1, 16));
    let (p32, _) = as_bf16_problem(&random_problem(&odd, 6).expect("valid spec"));
    let inputs = gpu.upload_bf16(&p32).expect("upload");
    let mut outputs = gpu
        .alloc_outputs::<ssd_gpu::Bf16>(&inputs.dims, &inputs.options)
        .expect("alloc");
    gpu.chunk_cumsum(&inputs, &mut outputs)
        .expect("stage 1 takes any activations");
    let err = gpu
        .fwd_pass_state(&inputs, &mut outputs)
        .expect_err("stage 2 must refuse bf16 activations on this shape");
    assert!(
        matches!(err, ssd_gpu::GpuError::Unsupported(_))
            && err.to_string().contains("multiples of 8"),
        "{err}"
    );
    gpu.forward_into(&inputs, &mut outputs)
        .expect("the whole forward widens instead");
    // Outputs that do not keep chunk_states cannot be downloaded whole: refused, not garbage.
    outputs.set_keep_chunk_states(false);
    gpu.forward_into(&inputs, &mut outputs)
        .expect("a forward without chunk_states");
    let err = gpu
        .download(&outputs)
        .expect_err("download must refuse outputs without chunk_states");
    assert!(
        matches!(err, ssd_gpu::GpuError::Unsupported(_))
            && err.to_string().contains("chunk_states"),
        "{err}"
    );
    // dstate above the limit: refused like the f32 path.
    let mut big = ProblemSpec::plain(Dims::new(1, 10, 1, 8, 1, ssd_gpu::MAX_DSTATE + 8));
    big.options.chunk_size = 8;
    let (p32, _) = as_bf16_problem(&random_problem(&big, 1).expect("valid spec"));
    let err = gpu.forward_bf16(&p32).expect_err("dstate above the limit");
    assert!(matches!(err, ssd_gpu::GpuError::Unsupported(_)), "{err}");
}
