//! Shared by the GPU tests (`verify/tests/gpu_*.rs`): getting the device (one per kernel
//! variant) or skipping, and the comparison against the float64 reference under the TF32 error
//! model (`ssd_verify::tolerance`, `docs/tolerances.md`). Random specs come from
//! `ssd_reference::random` (`random_spec`, `random_pair_spec`).
//!
//! Without a usable GPU every GPU test prints "skipped: no CUDA device" (or driver) and passes;
//! with `SSD_REQUIRE_GPU=1` in the environment that skip is a failure instead.

#![allow(dead_code)]

use std::sync::Arc;

use rayon::prelude::*;
use ssd_gpu::{
    DeviceInputs, DeviceOutputs, Gpu, GpuConfig, GpuError, IoElement, StateWalk, Variant,
};
use ssd_reference::random::{
    random_pair_spec, random_problem, DSkip, ProblemSpec, SeqIdx, SpecRng,
};
use ssd_reference::{ChunkedOutput, Dims, Problem};
use ssd_verify::fixture::{round_inputs, Dtype, FloatDtype};
pub use ssd_verify::tolerance::{Candidate, Oracle, OutputName, Precision, Verdict};

/// The device, or `None` after printing why the test is skipped.
///
/// # Panics
/// When `SSD_REQUIRE_GPU=1` and there is no usable device, or on any other GPU error
/// (compilation failure, driver error): those are failures, never skips.
pub fn gpu_or_skip(test: &str) -> Option<Arc<Gpu>> {
    match ssd_gpu::default_gpu() {
        Ok(g) => Some(g),
        Err(e @ (GpuError::NoDriver(_) | GpuError::NoDevice(_))) => {
            if std::env::var("SSD_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("{test}: SSD_REQUIRE_GPU=1 but {e}");
            }
            say_out_loud(&format!("{test}: skipped: no CUDA device ({e})"));
            None
        }
        Err(e) => panic!("{test}: the GPU could not be set up: {e}"),
    }
}

/// Device 0 with `variant`, and `SSD_GPU_WG=0` honoured ([`GpuConfig::no_wg_out`]: the Hopper
/// bf16 output kernel off). The GPU bundle's initcheck run sets it: the tool does not count
/// that kernel's TMA stores of `out` as writes, and reports each stored byte as uninitialised
/// when `out` is copied back; [`assert_fully_written`] shows them written instead.
pub fn variant_config(variant: Variant) -> GpuConfig {
    GpuConfig {
        no_wg_out: GpuConfig::from_env().no_wg_out,
        ..GpuConfig::variant(variant)
    }
}

/// One device per kernel variant ([`Variant::ALL`], the default first), so that a test runs
/// every variant in one process; `None` after printing why the test is skipped (as
/// [`gpu_or_skip`]).
///
/// # Panics
/// As [`gpu_or_skip`].
pub fn gpus_or_skip(test: &str) -> Option<Vec<(Variant, Arc<Gpu>)>> {
    gpu_or_skip(test)?;
    Some(
        Variant::ALL
            .into_iter()
            .map(|v| match ssd_gpu::gpu_for(variant_config(v)) {
                Ok(g) => (v, g),
                Err(e) => panic!("{test}: the GPU could not be set up for {v:?}: {e}"),
            })
            .collect(),
    )
}

/// The default variant with the persistent kernels' grid capped at `blocks`
/// (`GpuConfig::persistent_blocks`), so that each block walks many work items even on small
/// shapes.
pub fn capped_gpu(test: &str, blocks: usize) -> Vec<(Variant, Arc<Gpu>)> {
    let config = GpuConfig {
        persistent_blocks: Some(blocks),
        ..variant_config(Variant::V3)
    };
    match ssd_gpu::gpu_for(config) {
        Ok(g) => vec![(Variant::V3, g)],
        Err(e) => {
            panic!("{test}: the GPU could not be set up with {blocks} persistent blocks: {e}")
        }
    }
}

/// The default variant with the Hopper output kernel let serve dstate 256
/// (`GpuConfig::wg_out_n256`, `ssd_compute_out_wg_bf16_n256`), its persistent grid capped at
/// `blocks` where given.
pub fn wg_n256_gpu(test: &str, blocks: Option<usize>) -> Vec<(Variant, Arc<Gpu>)> {
    let config = GpuConfig {
        wg_out_n256: true,
        persistent_blocks: blocks,
        ..variant_config(Variant::V3)
    };
    match ssd_gpu::gpu_for(config) {
        Ok(g) => vec![(Variant::V3, g)],
        Err(e) => panic!(
            "{test}: the GPU could not be set up with the dstate-256 Hopper output kernel: {e}"
        ),
    }
}

/// The default variant with the walking stage 2 off (`StateWalk::Off`): the chained kernel or
/// 2a + 2b wherever the default would walk.
pub fn chained_gpu(test: &str) -> Vec<(Variant, Arc<Gpu>)> {
    let config = GpuConfig {
        state_walk: StateWalk::Off,
        ..variant_config(Variant::V3)
    };
    match ssd_gpu::gpu_for(config) {
        Ok(g) => vec![(Variant::V3, g)],
        Err(e) => panic!("{test}: the GPU could not be set up without the walking stage 2: {e}"),
    }
}

/// The forms of the walking stage 2 that the tests force, each wherever it serves the shape
/// however few its units: 1, 2 and 5 units a block (`StateWalk::Units`), and the segmented walk
/// with as many segments as fill the device and with 3 segments (`StateWalk::Segments`).
pub const WALK_FORMS: [StateWalk; 5] = [
    StateWalk::Units(1),
    StateWalk::Units(2),
    StateWalk::Units(5),
    StateWalk::Segments(0),
    StateWalk::Segments(3),
];

/// A walking form's name in the reports.
pub fn walk_label(form: StateWalk) -> String {
    match form {
        StateWalk::Units(h) => format!("{h} units a block"),
        StateWalk::Segments(0) => "segmented, the device's segments".to_string(),
        StateWalk::Segments(n) => format!("segmented, {n} segments"),
        other => format!("{other:?}"),
    }
}

/// Whether `form` (the configuration of `gpu`) serves `spec` with activations in bf16 or not.
pub fn walk_serves(gpu: &Gpu, spec: &ProblemSpec, form: StateWalk, bf16: bool) -> bool {
    let (d, o) = (&spec.dims, &spec.options);
    match form {
        StateWalk::Units(h) => gpu.state_walk_units(d, o, bf16) == Some(h),
        StateWalk::Segments(_) => gpu
            .state_walk_segments(d, o, bf16, spec.seq_idx != SeqIdx::None)
            .is_some(),
        _ => false,
    }
}

/// The default variant with the walking stage 2 forced to `form` (one of [`WALK_FORMS`]).
pub fn walk_gpu(test: &str, form: StateWalk) -> Vec<(Variant, Arc<Gpu>)> {
    let config = GpuConfig {
        state_walk: form,
        ..variant_config(Variant::V3)
    };
    match ssd_gpu::gpu_for(config) {
        Ok(g) => vec![(Variant::V3, g)],
        Err(e) => {
            panic!(
                "{test}: the GPU could not be set up with the walking stage 2 ({}): {e}",
                walk_label(form)
            )
        }
    }
}

/// A shape the walking stage 2 in `form` serves when forced: a pair kernel shape
/// (`random_pair_spec`, every option) with `headdim` and `dstate` multiples of `multiple` (8
/// for the bf16 kernels), dstate at most 128 (the segmented walk: at most 256, and no
/// `seq_idx`), and for five units a block ten units per group (5 heads of 65 to 128 rows or 10
/// of at most 64).
pub fn walk_spec(rng: &mut SpecRng, form: StateWalk, multiple: usize) -> ProblemSpec {
    let mut spec = random_pair_spec(rng, 4_000_000);
    let segmented = matches!(form, StateWalk::Segments(_));
    let d = &mut spec.dims;
    d.headdim = d.headdim.next_multiple_of(multiple);
    d.dstate = d
        .dstate
        .next_multiple_of(multiple)
        .min(if segmented { 256 } else { 128 });
    if form == StateWalk::Units(5) {
        d.nheads = d.ngroups * 10 / d.headdim.div_ceil(64);
        let per_token = d.batch * d.nheads * d.headdim * d.dstate;
        d.seqlen = d.seqlen.min((4_000_000 / per_token).max(65));
    }
    if segmented {
        spec.seq_idx = SeqIdx::None;
    }
    spec
}

/// The walking stage 2 forced in each of its forms ([`WALK_FORMS`]), activations in `io`:
/// `SSD_GPU_WALK_CASES` (default 700) [`walk_spec`] cases each against the float64 reference
/// (fails if a drawn shape misses the form), then `fixed` (the sanitizer shapes and more), each
/// form on those it serves.
pub fn check_walk(test: &str, io: Io, salt: u64, seed0: u64, fixed: &[(ProblemSpec, u64)]) {
    let bf16 = io == Io::Bf16;
    let tag = if bf16 { "bf16 " } else { "" };
    for (k, form) in WALK_FORMS.into_iter().enumerate() {
        let gpus = walk_gpu(test, form);
        let name = walk_label(form);
        let specs = draw_specs(
            env_usize("SSD_GPU_WALK_CASES", 700),
            salt + k as u64 * 0x1000,
            seed0 + k as u64 * 100_000,
            |rng| walk_spec(rng, form, if bf16 { 8 } else { 4 }),
        );
        let label = format!("{tag}walking stage 2 shapes, {name}");
        println!("{label}: {}", coverage(&specs));
        run_served_cases(&label, &gpus, &specs, io, "walking stage 2", |gpu, s| {
            walk_serves(gpu, s, form, bf16)
        });
        let served = report_served(
            &format!("{tag}walking stage 2 fixed shapes, {name}"),
            &gpus,
            fixed,
            io,
            |gpu, s| walk_serves(gpu, s, form, bf16),
        );
        println!(
            "{tag}walking stage 2 fixed shapes: {served} of {} served ({name})",
            fixed.len()
        );
    }
}

/// Shapes of the walking stage 2 (f32 and bf16): ten units a group, which every form of
/// [`WALK_FORMS`] but the segmented walk serves, with every option; then two row tiles a head
/// with a ragged last one, dstate 80, without seq_idx (every form); then four units of 128
/// dstate columns walking 8 chunks (2 heads, dstate 256, without seq_idx: the segmented walk
/// alone).
pub fn walk_fixed_specs() -> Vec<(ProblemSpec, u64)> {
    let mut tiles = ProblemSpec::full(Dims::new(2, 260, 10, 72, 2, 80), 128);
    tiles.seq_idx = SeqIdx::None;
    let mut wide = ProblemSpec::full(Dims::new(1, 1000, 2, 64, 1, 256), 128);
    wide.seq_idx = SeqIdx::None;
    vec![
        (
            ProblemSpec::full(Dims::new(1, 300, 10, 64, 1, 72), 128),
            330,
        ),
        (tiles, 331),
        (wide, 332),
    ]
}

/// A summary label for `variant`: `label` for the default, `label [variant]` for the others.
pub fn variant_label(label: &str, variant: Variant) -> String {
    if variant == Variant::default() {
        label.to_string()
    } else {
        format!("{label} [{variant:?}]")
    }
}

/// A number from the environment, or `default`.
pub fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Rounds a float64 problem to f32 inputs (what the GPU gets) and back, so that the float64
/// reference sees exactly the values the kernels see.
pub fn as_f32_problem(p: &Problem<f64>) -> (Problem<f32>, Problem<f64>) {
    let p32: Problem<f32> = p.cast();
    let p64: Problem<f64> = p32.cast();
    (p32, p64)
}

/// Rounds a float64 problem's activations (`x`, `B`, `C`, `z`) to bf16 and its other inputs to
/// f32 (what the bf16 kernels get) and back: the f32 problem to upload (its activations hold
/// bf16 values) and the float64 problem of exactly those values, for the reference.
pub fn as_bf16_problem(p: &Problem<f64>) -> (Problem<f32>, Problem<f64>) {
    as_f32_problem(&round_inputs(p, FloatDtype::BF16).expect("values in bf16's range"))
}

/// Checks every output of the GPU's bf16 path against the float64 reference under the bf16
/// error model: `out` stored as bf16, the states and `dA_cumsum` as f32.
pub fn check_bf16(gpu: &ChunkedOutput<f32>, oracle: &Oracle) -> Verdict {
    let candidate = Candidate::from(gpu);
    let tensors = candidate
        .tensors()
        .into_iter()
        .map(|(name, t)| {
            let stored = if name == OutputName::Out {
                Dtype::BF16
            } else {
                Dtype::F32
            };
            oracle
                .compare(name, t, stored, Precision::Bf16)
                .expect("the GPU's outputs have the contract's shapes")
        })
        .collect();
    Verdict {
        precision: Precision::Bf16,
        tensors,
    }
}

/// The activations' type a GPU test runs: f32 (checked at TF32) or bf16 (checked at bf16).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Io {
    F32,
    Bf16,
}

impl Io {
    /// The problem to upload and the float64 problem of the same values.
    pub fn problems(self, p: &Problem<f64>) -> (Problem<f32>, Problem<f64>) {
        match self {
            Io::F32 => as_f32_problem(p),
            Io::Bf16 => as_bf16_problem(p),
        }
    }

    /// The GPU's forward of `p32` with these activations.
    pub fn forward(self, gpu: &Gpu, p32: &Problem<f32>) -> Result<ChunkedOutput<f32>, GpuError> {
        match self {
            Io::F32 => gpu.forward(p32),
            Io::Bf16 => gpu.forward_bf16(p32),
        }
    }

    /// Bit patterns of `out`, `final_states` and `dA_cumsum` (the order of [`bits`]) from a
    /// forward into outputs that do not keep `chunk_states`
    /// (`DeviceOutputs::set_keep_chunk_states(false)`).
    pub fn forward_lean_bits(self, gpu: &Gpu, p32: &Problem<f32>) -> Result<Vec<u32>, GpuError> {
        match self {
            Io::F32 => lean_bits(gpu, &gpu.upload(p32)?),
            Io::Bf16 => lean_bits(gpu, &gpu.upload_bf16(p32)?),
        }
    }

    /// The verdict on `got` under this path's error model.
    pub fn check(self, got: &ChunkedOutput<f32>, oracle: &Oracle) -> Verdict {
        match self {
            Io::F32 => check_tf32(got, oracle),
            Io::Bf16 => check_bf16(got, oracle),
        }
    }
}

fn lean_bits<T: IoElement>(gpu: &Gpu, inputs: &DeviceInputs<T>) -> Result<Vec<u32>, GpuError> {
    let mut outputs = gpu.alloc_outputs::<T>(&inputs.dims, &inputs.options)?;
    outputs.set_keep_chunk_states(false);
    gpu.forward_into(inputs, &mut outputs)?;
    let out: Vec<T> = gpu.stream().clone_dtoh(&outputs.out)?;
    let fin: Vec<f32> = gpu.stream().clone_dtoh(&outputs.final_states)?;
    let da: Vec<f32> = gpu.stream().clone_dtoh(&outputs.dA_cumsum)?;
    gpu.synchronize()?;
    let mut v: Vec<u32> = out.into_iter().map(|x| x.to_f32().to_bits()).collect();
    v.extend(fin.iter().chain(&da).map(|x| x.to_bits()));
    Ok(v)
}

/// What one kernel variant gave on a list of cases.
pub struct Run {
    pub variant: Variant,
    pub verdicts: Vec<Verdict>,
    pub failures: Vec<String>,
}

/// Runs `specs` (seeded) on the GPU under every variant of `gpus`, with activations in `io`,
/// and checks each against the float64 reference under that path's error model (one
/// generator of cases, every variant, both activation types).
pub fn run_cases(gpus: &[(Variant, Arc<Gpu>)], specs: &[(ProblemSpec, u64)], io: Io) -> Vec<Run> {
    let mut runs: Vec<Run> = gpus
        .iter()
        .map(|(variant, _)| Run {
            variant: *variant,
            verdicts: Vec::with_capacity(specs.len()),
            failures: Vec::new(),
        })
        .collect();
    for batch in specs.chunks(32) {
        let problems: Vec<_> = batch
            .par_iter()
            .map(|(spec, seed)| io.problems(&random_problem(spec, *seed).expect("valid spec")))
            .collect();
        let oracles: Vec<Oracle> = problems
            .par_iter()
            .map(|(_, p64)| Oracle::new(p64))
            .collect();
        for ((variant, gpu), run) in gpus.iter().zip(runs.iter_mut()) {
            let outs: Vec<_> = problems
                .iter()
                .zip(batch)
                .map(|((p32, _), (spec, seed))| {
                    io.forward(gpu, p32).unwrap_or_else(|e| {
                        panic!(
                            "GPU ({variant:?}, {io:?}) failed on {}: {e}",
                            describe(spec, *seed)
                        )
                    })
                })
                .collect();
            let checked: Vec<Verdict> = oracles
                .par_iter()
                .zip(outs.par_iter())
                .map(|(oracle, o)| io.check(o, oracle))
                .collect();
            for (v, (spec, seed)) in checked.into_iter().zip(batch) {
                if !v.passed() {
                    run.failures.push(format!(
                        "{variant:?} {io:?} {}\n    {}",
                        describe(spec, *seed),
                        v.failures().join("\n    ")
                    ));
                }
                run.verdicts.push(v);
            }
        }
    }
    runs
}

/// Prints each variant's summary and fails with the first 20 failures when there are any.
pub fn report(label: &str, runs: &[Run], cases: usize) {
    for run in runs {
        summarise(&variant_label(label, run.variant), &run.verdicts);
    }
    let failures: Vec<String> = runs.iter().flat_map(|r| r.failures.clone()).collect();
    assert!(
        failures.is_empty(),
        "{} of {} cases (times each variant) exceed the bound:\n{}",
        failures.len(),
        cases,
        failures[..failures.len().min(20)].join("\n")
    );
}

/// `cases` specs drawn by `draw` from `SpecRng::new(salt + first)`, the k-th seeded `seed0 +
/// first + k`, where `first` is `SSD_GPU_SEED` (default 1).
pub fn draw_specs(
    cases: usize,
    salt: u64,
    seed0: u64,
    mut draw: impl FnMut(&mut SpecRng) -> ProblemSpec,
) -> Vec<(ProblemSpec, u64)> {
    let first = env_usize("SSD_GPU_SEED", 1) as u64;
    let mut rng = SpecRng::new(salt + first);
    (0..cases as u64)
        .map(|k| (draw(&mut rng), seed0 + first + k))
        .collect()
}

/// How many of `specs` have each option and size class, one line.
pub fn coverage(specs: &[(ProblemSpec, u64)]) -> String {
    let count = |f: &dyn Fn(&ProblemSpec) -> bool| specs.iter().filter(|(s, _)| f(s)).count();
    format!(
        "seq_idx {} | initial_states {} | z {} | D per head {} / per channel {} | dt_bias {} | softplus {} | dt_limit set {} | ngroups>1 {} | ragged seqlen {} | chunk>=256 {} | dstate>128 {} | headdim%64!=0 {}",
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
    )
}

/// Reports `label` over those of `specs` that `served` says the first device of `gpus` runs
/// on the kernels under test (the others are left to other checks), and returns their count.
pub fn report_served(
    label: &str,
    gpus: &[(Variant, Arc<Gpu>)],
    specs: &[(ProblemSpec, u64)],
    io: Io,
    served: impl Fn(&Gpu, &ProblemSpec) -> bool,
) -> usize {
    let subset: Vec<(ProblemSpec, u64)> = specs
        .iter()
        .filter(|(s, _)| served(&gpus[0].1, s))
        .cloned()
        .collect();
    report(label, &run_cases(gpus, &subset, io), subset.len());
    subset.len()
}

/// Runs `specs`, which were drawn for the kernels that `served` says serve them on the default
/// variant (`served` returns their name, or `None`): prints how many of the cases they took;
/// when none (this device runs no such kernel) says so and returns; else asserts that every
/// case took them (a generator that drifted would leave the test checking other kernels) and
/// runs them all under every variant.
pub fn run_served_cases(
    label: &str,
    gpus: &[(Variant, Arc<Gpu>)],
    specs: &[(ProblemSpec, u64)],
    io: Io,
    kernels: &str,
    served: impl Fn(&Gpu, &ProblemSpec) -> bool,
) {
    let taken = specs.iter().filter(|(s, _)| served(&gpus[0].1, s)).count();
    println!("{label}: {kernels} in {taken} of {} cases", specs.len());
    if taken == 0 {
        println!("{label}: skipped: this device runs no {kernels}");
        return;
    }
    assert_eq!(taken, specs.len(), "{label}: shapes off the {kernels}");
    report(label, &run_cases(gpus, specs, io), specs.len());
}

/// A shape the chained stage 2 serves on a device of up to 132 SMs (the H200's count): a pair
/// kernel shape (`random_pair_spec`, every option) with `dstate` 68 to 128, enough groups that
/// the chains (batch x pairs of units) number 66 (half the SMs) to 200, and 2 to 3 chunks (so
/// that states are handed on), `headdim` and `dstate` multiples of `multiple` (8 for the bf16
/// kernels).
pub fn chained_spec(rng: &mut SpecRng, multiple: usize) -> ProblemSpec {
    let mut spec = random_pair_spec(rng, 4_000_000);
    let d = &mut spec.dims;
    d.headdim = d.headdim.next_multiple_of(multiple);
    d.dstate = (4 * rng.range(17, 32)).next_multiple_of(multiple);
    let heads_per_group = d.nheads / d.ngroups;
    // An even count of 64-column units per group (random_pair_spec's), so pairs = units / 2.
    let pairs_per_group = heads_per_group * d.headdim.div_ceil(64) / 2;
    d.ngroups = rng
        .range(66, 200)
        .div_ceil(d.batch * pairs_per_group)
        .max(1);
    d.nheads = d.ngroups * heads_per_group;
    let chunk = rng.pick(&[128usize, 256]);
    spec.options.chunk_size = chunk;
    spec.dims.seqlen = rng.range(chunk + 1, 3 * chunk);
    spec
}

/// The chained stage 2's test in `io`: `SSD_GPU_CHAINED_CASES` (default 64) [`chained_spec`]
/// shapes drawn from `salt`, seeded from `seed0`, bitwise against version 2
/// ([`assert_chained_matches_staged`]), and the first 16 against the float64 reference under
/// every variant.
pub fn check_chained(label: &str, gpus: &[(Variant, Arc<Gpu>)], io: Io, salt: u64, seed0: u64) {
    let multiple = if io == Io::Bf16 { 8 } else { 4 };
    let specs = draw_specs(env_usize("SSD_GPU_CHAINED_CASES", 64), salt, seed0, |rng| {
        chained_spec(rng, multiple)
    });
    assert_chained_matches_staged(label, gpus, &specs, io);
    let some = &specs[..specs.len().min(16)];
    report(
        &format!("{label} shapes"),
        &run_cases(gpus, some, io),
        some.len(),
    );
}

/// Runs each spec (seeded) that the chained kernel serves ([`Gpu::uses_chained`] on
/// [`Variant::V3`]) under [`Variant::V3`] and [`Variant::V2`], activations in `io`, and asserts
/// bitwise identical outputs: the chained kernel computes the stage-by-stage kernels' products
/// in the same order. Says so when this device runs no chained kernel on these shapes (more
/// SMs than the shapes have chains); else fails if any shape misses it.
pub fn assert_chained_matches_staged(
    label: &str,
    gpus: &[(Variant, Arc<Gpu>)],
    specs: &[(ProblemSpec, u64)],
    io: Io,
) {
    let find = |v: Variant| gpus.iter().find(|(x, _)| *x == v).map(|(_, g)| g.clone());
    let (Some(chained), Some(staged)) = (find(Variant::V3), find(Variant::V2)) else {
        println!("{label}: skipped: the chained or the stage-by-stage variant is not open");
        return;
    };
    // The chained kernel's own device: the walking stage 2 off, whatever the default.
    let chained = ssd_gpu::gpu_for(GpuConfig {
        state_walk: StateWalk::Off,
        ..chained.config()
    })
    .expect("the GPU, the walking stage 2 off");
    let mut served = 0;
    for (spec, seed) in specs {
        if !chained.uses_chained(&spec.dims, &spec.options) {
            continue;
        }
        let (p32, _) = io.problems(&random_problem(spec, *seed).expect("valid spec"));
        let a = bits(&io.forward(&chained, &p32).expect("GPU forward (chained)"));
        let b = bits(
            &io.forward(&staged, &p32)
                .expect("GPU forward (stage by stage)"),
        );
        assert!(
            a == b,
            "{label}: the chained kernel and the stage-by-stage kernels differ ({io:?}) on {}",
            describe(spec, *seed)
        );
        // Without chunk_states kept (the bf16 chained kernel then skips writing them): the
        // same out, final states and dA_cumsum.
        let lean = io
            .forward_lean_bits(&chained, &p32)
            .expect("GPU forward (chained, chunk_states not kept)");
        assert!(
            lean[..] == a[..lean.len()],
            "{label}: the chained kernel's outputs change when chunk_states is not kept ({io:?}) on {}",
            describe(spec, *seed)
        );
        served += 1;
    }
    if served == 0 {
        println!("{label}: skipped: this device runs the chained stage 2 on none of these shapes");
        return;
    }
    // A generator that drifted off the chained shapes would leave the test checking less.
    assert_eq!(
        served,
        specs.len(),
        "{label}: shapes off the chained stage 2"
    );
    println!(
        "{label}: chained stage 2 in {served} of {} cases, bitwise equal to the stage-by-stage kernels",
        specs.len()
    );
}

/// Runs each spec (seeded) 4 times under every variant of `gpus` with activations in `io` and
/// asserts bitwise identical outputs.
pub fn assert_reproducible(gpus: &[(Variant, Arc<Gpu>)], specs: &[(ProblemSpec, u64)], io: Io) {
    for (spec, seed) in specs {
        let (p32, _) = io.problems(&random_problem(spec, *seed).expect("valid spec"));
        for (variant, gpu) in gpus {
            let first = bits(&io.forward(gpu, &p32).expect("GPU forward"));
            for _ in 0..3 {
                let again = bits(&io.forward(gpu, &p32).expect("GPU forward"));
                assert!(
                    first == again,
                    "run-to-run difference ({variant:?}, {io:?}) on {}",
                    describe(spec, *seed)
                );
            }
        }
    }
    println!(
        "{}reproducible: {} problems, 4 runs each under each of {} variants, bitwise identical",
        if io == Io::Bf16 { "bf16 " } else { "" },
        specs.len(),
        gpus.len()
    );
}

/// Checks every output of the GPU (`out`, `final_states`, `dA_cumsum`, `chunk_states`, f32)
/// against the float64 reference of `p64` under the TF32 error model of
/// [`ssd_verify::tolerance`].
pub fn check_tf32(gpu: &ssd_reference::ChunkedOutput<f32>, oracle: &Oracle) -> Verdict {
    oracle
        .check(&Candidate::from(gpu), Precision::Tf32)
        .expect("the GPU's outputs have the contract's shapes")
}

/// Worst error/bound ratio, worst relative L2 error and elements over the bound of each
/// output over many verdicts, printed one line per output.
pub fn summarise(label: &str, verdicts: &[Verdict]) {
    for name in [
        OutputName::Out,
        OutputName::FinalStates,
        OutputName::DACumsum,
        OutputName::ChunkStates,
    ] {
        let reports: Vec<_> = verdicts.iter().filter_map(|v| v.tensor(name)).collect();
        let worst = reports.iter().map(|t| t.max_ratio()).fold(0.0, f64::max);
        let worst_l2 = reports.iter().map(|t| t.rel_l2).fold(0.0, f64::max);
        let over: usize = reports.iter().map(|t| t.exceeding).sum();
        println!(
            "{label}: {:<13} cases {:>5}  worst error/bound {worst:.3}  worst rel L2 {worst_l2:.2e}  elements over bound {over}",
            name.name(),
            reports.len()
        );
    }
}

/// A one-line description of a spec, for failure messages.
pub fn describe(spec: &ProblemSpec, seed: u64) -> String {
    let d = spec.dims;
    format!(
        "seed {seed}: batch {} seqlen {} nheads {} headdim {} ngroups {} dstate {} chunk {} softplus {} dt_limit {:?} D {:?} z {} dt_bias {} init {} seq_idx {:?} A {:?} dt {:?}",
        d.batch, d.seqlen, d.nheads, d.headdim, d.ngroups, d.dstate, spec.options.chunk_size,
        spec.options.dt_softplus, spec.options.dt_limit, spec.d, spec.z, spec.dt_bias,
        spec.initial_states, spec.seq_idx, spec.a_range, spec.dt_range
    )
}

/// Bit patterns of every output, for the reproducibility test.
pub fn bits(o: &ssd_reference::ChunkedOutput<f32>) -> Vec<u32> {
    let mut v: Vec<u32> = o.out.iter().map(|x| x.to_bits()).collect();
    v.extend(o.final_states.iter().map(|x| x.to_bits()));
    v.extend(o.dA_cumsum.iter().map(|x| x.to_bits()));
    v.extend(o.chunk_states.iter().map(|x| x.to_bits()));
    v
}

/// Prints a line on the real stderr, past the test harness's output capture, so that a skip is
/// seen in the plain `cargo test` output.
#[allow(dead_code)]
fn say_out_loud(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// The outputs' elements that `run` (the forward, or a part of it) leaves unwritten: every
/// output buffer is filled with NaN before it (`out` in `T`, the rest f32; the processed `dt`
/// too), and the NaN that remain afterwards are counted, per buffer. The reference has no NaN
/// on these problems, and the kernels never produce one from finite inputs, so a NaN left is
/// an element that no kernel wrote (the coverage `Gpu::alloc_outputs` promises). Returns
/// "buffer: count of total unwritten (first at flat index)" for each buffer with any.
pub fn unwritten<T: IoElement>(
    gpu: &Gpu,
    inputs: &DeviceInputs<T>,
    run: impl FnOnce(&Gpu, &DeviceInputs<T>, &mut DeviceOutputs<T>) -> Result<(), GpuError>,
) -> Result<Vec<String>, GpuError> {
    let s = gpu.stream();
    let mut o = gpu.alloc_outputs::<T>(&inputs.dims, &inputs.options)?;
    let nan = |n: usize| vec![f32::NAN; n];
    s.memcpy_htod(T::from_f32_slice(&nan(o.out.len())).as_ref(), &mut o.out)?;
    for b in [
        &mut o.final_states,
        &mut o.dA_cumsum,
        &mut o.dt,
        &mut o.chunk_states,
    ] {
        s.memcpy_htod(&nan(b.len()), b)?;
    }
    run(gpu, inputs, &mut o)?;
    let out: Vec<f32> = s.clone_dtoh(&o.out)?.into_iter().map(T::to_f32).collect();
    let rest = [
        ("final_states", s.clone_dtoh(&o.final_states)?),
        ("dA_cumsum", s.clone_dtoh(&o.dA_cumsum)?),
        ("dt (processed)", s.clone_dtoh(&o.dt)?),
        ("chunk_states", s.clone_dtoh(&o.chunk_states)?),
    ];
    gpu.synchronize()?;
    Ok(std::iter::once(("out", out))
        .chain(rest)
        .filter_map(|(name, v)| {
            let first = v.iter().position(|x| x.is_nan())?;
            let n = v.iter().filter(|x| x.is_nan()).count();
            Some(format!(
                "{name}: {n} of {} unwritten (first at flat index {first})",
                v.len()
            ))
        })
        .collect())
}

/// [`unwritten`] for `spec`'s problem with activations in `io`, of the forward (`full`) or of
/// stage 1 alone.
fn unwritten_io(gpu: &Gpu, spec: &ProblemSpec, seed: u64, io: Io, full: bool) -> Vec<String> {
    fn on<T: IoElement>(gpu: &Gpu, inputs: &DeviceInputs<T>, full: bool) -> Vec<String> {
        if full {
            unwritten(gpu, inputs, Gpu::forward_into)
        } else {
            unwritten(gpu, inputs, Gpu::chunk_cumsum)
        }
        .unwrap_or_else(|e| panic!("GPU failed: {e}"))
    }
    let (p32, _) = io.problems(&random_problem(spec, seed).expect("valid spec"));
    match io {
        Io::F32 => on(gpu, &gpu.upload(&p32).expect("upload"), full),
        Io::Bf16 => on(gpu, &gpu.upload_bf16(&p32).expect("upload"), full),
    }
}

/// Runs [`unwritten`] on every spec under every variant, with activations in `io`, and fails
/// listing each (variant, case, buffer) that kept a NaN. First its power: on the first spec,
/// stage 1 alone must leave exactly `out`, `final_states` and `chunk_states` unwritten, and
/// the check must name those three and no other.
pub fn assert_fully_written(gpus: &[(Variant, Arc<Gpu>)], specs: &[(ProblemSpec, u64)], io: Io) {
    let (spec, seed) = &specs[0];
    let named: Vec<String> = unwritten_io(&gpus[0].1, spec, *seed, io, false)
        .iter()
        .map(|l| l.split(':').next().unwrap_or_default().to_string())
        .collect();
    assert_eq!(
        named,
        ["out", "final_states", "chunk_states"],
        "fully written {io:?}: stage 1 alone should leave exactly these unwritten"
    );
    println!("fully written {io:?}, power: stage 1 alone leaves {named:?} unwritten, all named");
    let mut failures = Vec::new();
    for (spec, seed) in specs {
        for (variant, gpu) in gpus {
            let left = unwritten_io(gpu, spec, *seed, io, true);
            failures.extend(
                left.into_iter()
                    .map(|l| format!("{variant:?} {io:?} {}: {l}", describe(spec, *seed))),
            );
        }
    }
    println!(
        "fully written {io:?}: {} cases x {} variants, {} buffers with unwritten elements",
        specs.len(),
        gpus.len(),
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
