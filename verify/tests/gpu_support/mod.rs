//! Shared by the GPU tests (`verify/tests/gpu_*.rs`): getting the device (one per kernel
//! variant) or skipping, random problem specs, and the comparison against the float64 reference under the TF32 error
//! model (`ssd_verify::tolerance`, `docs/tolerances.md`).
//!
//! Without a usable GPU every GPU test prints "skipped: no CUDA device" (or driver) and passes;
//! with `SSD_REQUIRE_GPU=1` in the environment that skip is a failure instead.

#![allow(dead_code)]

use std::sync::Arc;

use ssd_gpu::{Gpu, GpuConfig, GpuError, Variant};
use ssd_reference::random::{DSkip, ProblemSpec, SeqIdx};
use ssd_reference::{Dims, Options, Problem};
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
            .map(|v| match ssd_gpu::gpu_for(GpuConfig::variant(v)) {
                Ok(g) => (v, g),
                Err(e) => panic!("{test}: the GPU could not be set up for {v:?}: {e}"),
            })
            .collect(),
    )
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

/// splitmix64: the specs' random stream (seeded, the same on every machine).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }
    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        ((self.next() >> 11) as f64) / ((1u64 << 53) as f64) < p
    }
    pub fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.range(0, v.len() - 1)]
    }
}

/// A random spec over every size and option of the contract: ragged seqlen, chunk sizes 1 to
/// 1024, ngroups > 1, headdim and dstate off the 64-wide tiles (dstate up to the 256 limit),
/// every optional tensor, seq_idx (segments, resets at chunk starts, leading run not 0),
/// softplus, dt_limit, and decays from none (A = 0) to very strong. The naive cost
/// `batch * seqlen * nheads * headdim * dstate` is capped at `cap`.
pub fn random_spec(rng: &mut Rng, cap: usize) -> ProblemSpec {
    let chunk_size = if rng.chance(0.05) {
        rng.pick(&[512usize, 1024])
    } else {
        1 << rng.range(0, 8)
    };
    let ngroups = rng.range(1, 3);
    let nheads = ngroups * rng.range(1, 3);
    let headdim = if rng.chance(0.5) {
        rng.pick(&[1usize, 8, 16, 32, 63, 64, 65, 80, 128])
    } else {
        rng.range(1, 96)
    };
    let dstate = if rng.chance(0.08) {
        rng.pick(&[255usize, 256])
    } else if rng.chance(0.5) {
        rng.pick(&[1usize, 16, 32, 64, 100, 128])
    } else {
        rng.range(1, 140)
    };
    let batch = rng.range(1, 3);
    let mut seqlen = match rng.range(0, 3) {
        0 => rng.range(1, 16),
        1 => rng.range(1, 3 * chunk_size.min(256) + 7),
        _ => rng.range(1, 700),
    };
    let per_token = batch * nheads * headdim * dstate;
    seqlen = seqlen.min((cap / per_token).max(1));
    let dims = Dims::new(batch, seqlen, nheads, headdim, ngroups, dstate);
    let dt_softplus = rng.chance(0.5);
    let dt_limit = match rng.range(0, 3) {
        0 | 1 => (0.0, f64::INFINITY),
        2 => (0.001, 0.5),
        _ => (0.01, 0.1),
    };
    let seq_idx = match rng.range(0, 5) {
        0 | 1 => SeqIdx::None,
        2 => SeqIdx::Segments {
            segments: rng.range(1, 5),
            first: 0,
        },
        3 => SeqIdx::Segments {
            segments: rng.range(1, 4),
            first: rng.range(0, 1) as i64,
        },
        _ => SeqIdx::AtChunkStarts {
            every: rng.range(1, 2),
        },
    };
    let a_range = match rng.range(0, 5) {
        0 => (0.0, 0.0),
        1 => (5.0, 30.0),
        _ => (0.5, 8.0),
    };
    let dt_range = if dt_softplus {
        (-4.0, 1.0)
    } else if rng.chance(0.2) {
        (0.0, 2.0)
    } else {
        (0.001, 0.2)
    };
    ProblemSpec {
        dims,
        options: Options {
            chunk_size,
            dt_softplus,
            dt_limit,
        },
        d: rng.pick(&[DSkip::None, DSkip::PerHead, DSkip::PerChannel]),
        z: rng.chance(0.5),
        dt_bias: rng.chance(0.5),
        initial_states: rng.chance(0.5),
        seq_idx,
        a_range,
        dt_range,
    }
}

/// A random spec of the shapes the output kernel over pairs of units serves (chunks of 128 to
/// 512 tokens, seqlen past one 64-row tile, headdim and dstate multiples of 4, an even number
/// of (head, 64 headdim columns) units per group), every option drawn as in [`random_spec`].
pub fn random_pair_spec(rng: &mut Rng, cap: usize) -> ProblemSpec {
    let mut spec = random_spec(rng, cap);
    let ngroups = rng.range(1, 3);
    let (headdim, heads_per_group) = if rng.chance(0.5) {
        (4 * rng.range(1, 16), 2 * rng.range(1, 2))
    } else {
        (4 * rng.range(17, 32), rng.range(1, 3))
    };
    let dstate = 4 * rng.range(1, 64);
    let chunk_size = rng.pick(&[128usize, 256, 256, 512]);
    let batch = rng.range(1, 2);
    let nheads = ngroups * heads_per_group;
    let per_token = batch * nheads * headdim * dstate;
    let seqlen = rng.range(65, 1100).min((cap / per_token).max(65));
    spec.dims = Dims::new(batch, seqlen, nheads, headdim, ngroups, dstate);
    spec.options.chunk_size = chunk_size;
    spec
}

/// Rounds a float64 problem to f32 inputs (what the GPU gets) and back, so that the float64
/// reference sees exactly the values the kernels see.
pub fn as_f32_problem(p: &Problem<f64>) -> (Problem<f32>, Problem<f64>) {
    let p32: Problem<f32> = p.cast();
    let p64: Problem<f64> = p32.cast();
    (p32, p64)
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
