//! The GPU kernels on packed (serving) problems against the float64 reference: `out`,
//! `final_states`, `varlen_states` and `position_states` within the TF32 bound, on the packed
//! fuzz cases (`ssd_verify::fuzz::packed_cases`: zero-length sequences, sequences shorter than a
//! chunk, boundaries on and off the chunk grid, per-sequence initial states with and without a
//! mask, from an f16 cache, mamba_ssm's convention, state positions, decode steps), under every
//! kernel variant; run-to-run reproducibility; clean refusals of bad packings.
//!
//! Without a GPU these tests print "skipped: no CUDA device" and pass; `SSD_REQUIRE_GPU=1`
//! makes that a failure. `SSD_GPU_PACKED_CASES` sets the number of fuzz cases (default 2000;
//! `SSD_GPU_CASES` when only that is set).

mod gpu_support;

use std::sync::Arc;

use gpu_support::*;
use ndarray::ArrayD;
use rayon::prelude::*;
use ssd_gpu::{Gpu, GpuError, Variant};
use ssd_reference::random::{DSkip, ProblemSpec, SeqIdx};
use ssd_reference::serving::{Packing, ServingOutput};
use ssd_reference::{Dims, Problem};
use ssd_verify::fixture::Dtype;
use ssd_verify::fuzz::{packed_cases, PackedCase};

const NAMES: [OutputName; 4] = [
    OutputName::Out,
    OutputName::FinalStates,
    OutputName::VarlenStates,
    OutputName::PositionStates,
];

/// The case rounded to f32 (what the kernels get) and back, so that the float64 reference sees
/// exactly the values the kernels see.
fn rounded(case: &PackedCase) -> (Problem<f32>, Packing<f32>, Problem<f64>, Packing<f64>) {
    let (p, k) = case.build();
    let (p32, p64) = as_f32_problem(&p);
    let k32 = k.cast::<f32>();
    let k64 = k32.cast::<f64>();
    (p32, k32, p64, k64)
}

fn widen(o: &ServingOutput<f32>) -> [ArrayD<f64>; 4] {
    let w = |a: &ndarray::Array4<f32>| a.mapv(f64::from).into_dyn();
    [
        w(&o.out),
        w(&o.final_states),
        w(&o.varlen_states),
        w(&o.position_states),
    ]
}

/// Worst error/bound per output and the failures (one line each).
fn check(oracle: &Oracle, o: &ServingOutput<f32>) -> ([f64; 4], Vec<String>) {
    let mut worst = [0.0; 4];
    let mut bad = Vec::new();
    for (i, (name, t)) in NAMES.into_iter().zip(widen(o)).enumerate() {
        let r = oracle
            .compare(name, &t, Dtype::F32, Precision::Tf32)
            .expect("the GPU's outputs have the contract's shapes");
        worst[i] = r.max_ratio();
        if !r.passed() {
            bad.push(format!(
                "{} over its bound: worst error/bound {:.3}",
                name.name(),
                r.max_ratio()
            ));
        }
    }
    (worst, bad)
}

/// Runs `cases` under every variant; prints each variant's worst ratios and fails with the
/// first 20 failures.
fn run_cases(label: &str, gpus: &[(Variant, Arc<Gpu>)], cases: &[PackedCase]) {
    let mut failures = Vec::new();
    let mut worst = vec![[0.0f64; 4]; gpus.len()];
    for batch in cases.chunks(32) {
        let prepared: Vec<_> = batch
            .par_iter()
            .map(|case| {
                let (p32, k32, p64, k64) = rounded(case);
                let oracle = Oracle::for_packed(&p64, &k64).expect("valid packing");
                (p32, k32, oracle)
            })
            .collect();
        for (v, (variant, gpu)) in gpus.iter().enumerate() {
            for (case, (p32, k32, oracle)) in batch.iter().zip(&prepared) {
                let o = gpu
                    .forward_packed(p32, k32)
                    .unwrap_or_else(|e| panic!("GPU ({variant:?}) failed on {case}: {e}"));
                let (w, bad) = check(oracle, &o);
                for i in 0..4 {
                    worst[v][i] = worst[v][i].max(w[i]);
                }
                if !bad.is_empty() {
                    failures.push(format!("{variant:?} {case}\n    {}", bad.join("\n    ")));
                }
            }
        }
    }
    for (v, (variant, _)) in gpus.iter().enumerate() {
        println!(
            "{}: {} cases, worst error/bound out {:.3} final_states {:.3} varlen_states {:.3} position_states {:.3}",
            variant_label(label, *variant),
            cases.len(),
            worst[v][0],
            worst[v][1],
            worst[v][2],
            worst[v][3]
        );
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases (times each variant) exceed the bound:\n{}",
        failures.len(),
        cases.len(),
        failures[..failures.len().min(20)].join("\n")
    );
}

#[test]
fn gpu_packed_fuzz_matches_float64_reference() {
    let Some(gpus) = gpus_or_skip("gpu_packed_fuzz_matches_float64_reference") else {
        return;
    };
    let n = env_usize("SSD_GPU_PACKED_CASES", env_usize("SSD_GPU_CASES", 2000));
    let first = env_usize("SSD_GPU_SEED", 1) as u64;
    // Four times the CPU suite's cost cap: more sequences that span several chunks.
    let cases = packed_cases(n, 0x9AC_0000 + first, 400_000);
    let count = |f: &dyn Fn(&PackedCase) -> bool| cases.iter().filter(|c| f(c)).count();
    let q = |c: &PackedCase| c.spec.options.chunk_size;
    println!(
        "packed fuzz coverage: per-sequence states {} (mask {}, f16 cache {}) | mamba init {} | zero-length sequence {} | sequence shorter than a chunk {} | start off the chunk grid {} | sequence over a chunk boundary {} | positions {} (every token {}) | decode-shaped {}",
        count(&|c| c.per_sequence_states),
        count(&|c| c.mask),
        count(&|c| c.f16_cache),
        count(&|c| !c.per_sequence_states && c.spec.initial_states),
        count(&|c| c.lens.contains(&0)),
        count(&|c| c.lens.iter().any(|&l| l > 0 && l < q(c))),
        count(&|c| starts(c).any(|s| s % q(c) != 0)),
        count(&|c| starts(c).zip(&c.lens).any(|(s, &l)| l > 0 && s / q(c) != (s + l - 1) / q(c))),
        count(&|c| c.positions != Some(0)),
        count(&|c| c.positions.is_none()),
        count(&|c| c.lens.len() > 1 && c.lens.iter().all(|&l| l <= 4)),
    );
    run_cases("packed fuzz", &gpus, &cases);
}

/// Each sequence's first token.
fn starts(c: &PackedCase) -> impl Iterator<Item = usize> + '_ {
    c.lens.iter().scan(0, |s, &l| {
        let start = *s;
        *s += l;
        Some(start)
    })
}

/// Fixed packed shapes for the sanitizer runs (and a quick check of their own): zero-length
/// sequences, starts on and off the chunk grid, a masked per-sequence state, ngroups > 1,
/// dstate 256 and chunk 256, mamba_ssm's convention, decode steps with per-token states.
pub fn sanitizer_cases() -> Vec<PackedCase> {
    let case = |dims: Dims, chunk: usize, lens: Vec<usize>, per_seq: bool, positions| {
        let mut spec = ProblemSpec::full(dims, chunk);
        spec.initial_states = !per_seq;
        spec.seq_idx = SeqIdx::None; // implied by the lengths
        PackedCase {
            spec,
            seed: 900 + lens.len() as u64,
            lens,
            per_sequence_states: per_seq,
            mask: per_seq,
            f16_cache: false,
            positions,
        }
    };
    let mut v = vec![
        case(
            Dims::new(1, 300, 4, 40, 2, 72),
            64,
            vec![0, 37, 27, 0, 100, 136],
            true,
            Some(5),
        ),
        case(
            Dims::new(1, 517, 2, 64, 1, 256),
            256,
            vec![256, 5, 256],
            true,
            Some(3),
        ),
        case(
            Dims::new(1, 130, 2, 16, 1, 16),
            64,
            vec![70, 60],
            false,
            Some(2),
        ),
        case(
            Dims::new(1, 12, 6, 65, 3, 9),
            4,
            vec![3, 3, 3, 3],
            true,
            None,
        ),
    ];
    v[3].spec.d = DSkip::PerHead;
    v
}

#[test]
fn gpu_packed_sanitizer_shapes() {
    let Some(gpus) = gpus_or_skip("gpu_packed_sanitizer_shapes") else {
        return;
    };
    run_cases("packed sanitizer shapes", &gpus, &sanitizer_cases());
}

fn bits(o: &ServingOutput<f32>) -> Vec<u32> {
    [
        &o.out,
        &o.final_states,
        &o.varlen_states,
        &o.position_states,
    ]
    .into_iter()
    .flat_map(|a| a.iter().map(|x| x.to_bits()))
    .collect()
}

#[test]
fn gpu_packed_is_bitwise_reproducible() {
    let Some(gpus) = gpus_or_skip("gpu_packed_is_bitwise_reproducible") else {
        return;
    };
    let mut cases = sanitizer_cases();
    cases.extend(packed_cases(6, 0x7E9, 400_000));
    for case in &cases {
        let (p32, k32, _, _) = rounded(case);
        for (variant, gpu) in &gpus {
            let first = bits(&gpu.forward_packed(&p32, &k32).expect("GPU forward"));
            for _ in 0..3 {
                let again = bits(&gpu.forward_packed(&p32, &k32).expect("GPU forward"));
                assert!(
                    first == again,
                    "run-to-run difference ({variant:?}) on {case}"
                );
            }
        }
    }
    println!(
        "packed reproducible: {} problems, 4 runs each under each of {} variants, bitwise identical",
        cases.len(),
        gpus.len()
    );
}

#[test]
fn gpu_packed_refuses_bad_packings_cleanly() {
    let Some(gpu) = gpu_or_skip("gpu_packed_refuses_bad_packings_cleanly") else {
        return;
    };
    let (p32, k32, _, _) = rounded(&sanitizer_cases()[0]);
    let bad = |edit: &dyn Fn(&mut Packing<f32>), want: &str| {
        let mut k = k32.clone();
        edit(&mut k);
        match gpu.forward_packed(&p32, &k) {
            Err(GpuError::Unsupported(m)) => {
                assert!(m.contains(want), "{want:?} not in {m:?}");
                println!("refused: {m}");
            }
            other => panic!("expected a refusal naming {want}, got {other:?}"),
        }
    };
    bad(&|k| k.cu_seqlens[0] = 1, "cu_seqlens");
    bad(&|k| *k.cu_seqlens.last_mut().unwrap() -= 1, "cu_seqlens");
    bad(&|k| k.cu_seqlens.swap(2, 3), "cu_seqlens");
    bad(&|k| k.state_positions.push(300), "state_positions");
    bad(
        &|k| {
            k.seq_initial_states = k
                .seq_initial_states
                .as_ref()
                .map(|s| s.slice(ndarray::s![1.., .., .., ..]).to_owned())
        },
        "seq_initial_states",
    );
}
