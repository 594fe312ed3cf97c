//! Shared by the GPU tests (`verify/tests/gpu_*.rs`): getting the device or skipping, random
//! problem specs, and the comparison against the float64 reference.
//!
//! Without a usable GPU every GPU test prints "skipped: no CUDA device" (or driver) and passes;
//! with `SSD_REQUIRE_GPU=1` in the environment that skip is a failure instead.

#![allow(dead_code)]

use std::sync::Arc;

use ndarray::Dimension;
use ssd_gpu::{Gpu, GpuError};
use ssd_reference::random::{DSkip, ProblemSpec, SeqIdx};
use ssd_reference::{Dims, MatmulPrecision, Options, Problem};

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
            println!("{test}: skipped: no CUDA device ({e})");
            None
        }
        Err(e) => panic!("{test}: the GPU could not be set up: {e}"),
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
    let dims = Dims {
        batch,
        seqlen,
        nheads,
        headdim,
        ngroups,
        dstate,
    };
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

/// Rounds a float64 problem to f32 inputs (what the GPU gets) and back, so that the float64
/// reference sees exactly the values the kernels see.
pub fn as_f32_problem(p: &Problem<f64>) -> (Problem<f32>, Problem<f64>) {
    let p32: Problem<f32> = p.cast();
    let p64: Problem<f64> = p32.cast();
    (p32, p64)
}

/// The same problem with `x`, `B`, `C`, `D`, `z`, `initial_states` replaced by their absolute
/// values: run through the float64 reference it gives each output element's magnitude
/// (decays unchanged, the gate `z * sigmoid(z)` bounded by `|z| * sigmoid(|z|)`).
pub fn magnitude_problem(p: &Problem<f64>) -> Problem<f64> {
    let mut i = p.inputs().clone();
    let abs = |a: &mut ndarray::Array<f64, _>| a.mapv_inplace(f64::abs);
    abs(&mut i.x);
    i.B.mapv_inplace(f64::abs);
    i.C.mapv_inplace(f64::abs);
    if let Some(d) = i.D.as_mut() {
        d.mapv_inplace(f64::abs);
    }
    if let Some(z) = i.z.as_mut() {
        z.mapv_inplace(f64::abs);
    }
    if let Some(s) = i.initial_states.as_mut() {
        s.mapv_inplace(f64::abs);
    }
    Problem::new(*p.dims(), *p.options(), i).expect("absolute values keep a problem valid")
}

/// Unit roundoff of TF32 operands (10 explicit mantissa bits, round to nearest).
pub const U_TF32: f64 = 1.0 / 2048.0;
/// Unit roundoff of f32.
pub const U_F32: f64 = 1.0 / 16_777_216.0;

/// PROVISIONAL error bound, to be replaced by `ssd_verify::tolerance` once it exists (TODO for
/// the lead: switch `check_all` to it). Per element of `out`, `final_states`, `chunk_states`
/// of row `b`, head `h`:
/// `|gpu - ref| <= (KAPPA * U_TF32 + 2 * delta[b, h]) * mag + FLOOR * max(mag)`, where
/// - KAPPA = 8 counts the TF32 operand roundings on the longest path to `out` (C and B for the
///   scores, the decayed scores, x; for the carried term C, the state, and inside the state x
///   and the decayed B), each at most u, with f32 accumulation far below u;
/// - `delta[b, h] = (chunk_size + 1) * U_F32 * max_c sum_l |dt' A|` bounds the error of an
///   exponent `cs_i - cs_j` or `cs_i` formed from f32 within-chunk cumsums (each of the at most
///   `chunk_size` additions between j and i rounds by at most `U_F32` times the running sum),
///   hence the relative error of a decay factor; once for the in-chunk decays, once for the
///   carried state;
/// - `mag` is the output of the same problem on absolute values (see [`magnitude_problem`]).
pub const KAPPA: f64 = 8.0;
pub const FLOOR: f64 = 1e-6;

/// One tensor's comparison.
#[derive(Debug, Clone, Default)]
pub struct Compared {
    pub name: &'static str,
    /// Largest `|gpu - ref| / bound` (<= 1 passes).
    pub worst_ratio: f64,
    pub worst_index: Vec<usize>,
    /// `||gpu - ref||_2 / ||ref||_2`.
    pub rel_l2: f64,
    pub max_abs: f64,
    pub failures: usize,
    pub non_finite: usize,
}

/// Compares `got` (f32) against `want` (f64) element by element against `bound`.
pub fn compare<D: Dimension>(
    name: &'static str,
    got: &ndarray::Array<f32, D>,
    want: &ndarray::Array<f64, D>,
    bound: &ndarray::Array<f64, D>,
) -> Compared {
    assert_eq!(got.shape(), want.shape(), "{name}: shape");
    let mut c = Compared {
        name,
        ..Default::default()
    };
    let (mut num, mut den) = (0.0f64, 0.0f64);
    let shape = got.shape().to_vec();
    for (flat, ((g, w), b)) in got.iter().zip(want.iter()).zip(bound.iter()).enumerate() {
        let g = *g as f64;
        if !g.is_finite() {
            c.non_finite += 1;
            c.failures += 1;
            c.worst_ratio = f64::INFINITY;
            c.worst_index = ssd_reference::problem::unravel(flat, &shape);
            continue;
        }
        let err = (g - w).abs();
        let ratio = err / (b + f64::MIN_POSITIVE);
        if ratio > 1.0 {
            c.failures += 1;
        }
        if ratio > c.worst_ratio {
            c.worst_ratio = ratio;
            c.worst_index = ssd_reference::problem::unravel(flat, &shape);
        }
        c.max_abs = c.max_abs.max(err);
        num += err * err;
        den += w * w;
    }
    c.rel_l2 = if den > 0.0 {
        (num / den).sqrt()
    } else {
        num.sqrt()
    };
    c
}

/// The float64 references of one problem (inputs already rounded to f32) and the bounds.
pub struct Reference {
    pub out: ndarray::Array4<f64>,
    pub final_states: ndarray::Array4<f64>,
    pub da_cumsum: ndarray::Array4<f64>,
    pub chunk_states: ndarray::Array5<f64>,
    pub out_bound: ndarray::Array4<f64>,
    pub final_bound: ndarray::Array4<f64>,
    pub chunk_states_bound: ndarray::Array5<f64>,
    pub da_bound: ndarray::Array4<f64>,
}

fn provisional_bound<D: Dimension>(
    mag: ndarray::Array<f64, D>,
    delta: &ndarray::Array2<f64>,
    (axis_b, axis_h): (usize, usize),
) -> ndarray::Array<f64, D> {
    use ndarray::IntoDimension;
    let max_mag = mag.iter().fold(0.0f64, |m, &v| m.max(v));
    let floor = FLOOR * max_mag;
    let mut b = mag;
    for (i, v) in b.indexed_iter_mut() {
        let i = i.into_dimension();
        *v = (KAPPA * U_TF32 + 2.0 * delta[[i[axis_b], i[axis_h]]]) * *v + floor;
    }
    b
}

/// Computes the truth (naive recurrence, float64) for `out` and `final_states`, the float64
/// chunked path for `dA_cumsum` and `chunk_states`, and the provisional bounds.
pub fn reference(p64: &Problem<f64>) -> Reference {
    let d = *p64.dims();
    let q = p64.options().chunk_size;
    let naive = ssd_reference::naive::forward(p64);
    let chunked = ssd_reference::chunked::forward(p64, MatmulPrecision::Native);
    let mag = ssd_reference::chunked::forward(&magnitude_problem(p64), MatmulPrecision::Native);
    let cs = ssd_reference::chunk_cumsum::chunk_cumsum(p64);
    let a = &p64.inputs().A;
    // dA_cumsum: an f32 running sum of l + 1 terms is off by at most (l + 1) U_F32 times the
    // running sum of |terms|; softplus/log1p/exp add a few ulp per term: bound 4 (l + 2) U_F32 S_l.
    let (nb, nh, nc, nq) = cs.dt.dim();
    let mut da_bound = ndarray::Array4::<f64>::zeros((nb, nh, nc, nq));
    let mut delta = ndarray::Array2::<f64>::zeros((d.batch, d.nheads));
    for b in 0..nb {
        for h in 0..nh {
            for c in 0..nc {
                let mut s = 0.0;
                for l in 0..nq {
                    s += (cs.dt[[b, h, c, l]] * a[h]).abs();
                    da_bound[[b, h, c, l]] = 4.0 * (l as f64 + 2.0) * U_F32 * s;
                }
                delta[[b, h]] = delta[[b, h]].max((q as f64 + 1.0) * U_F32 * s);
            }
        }
    }
    Reference {
        out: naive.out,
        final_states: naive.final_states,
        da_cumsum: chunked.dA_cumsum,
        chunk_states: chunked.chunk_states,
        out_bound: provisional_bound(mag.out, &delta, (0, 2)),
        final_bound: provisional_bound(mag.final_states, &delta, (0, 1)),
        chunk_states_bound: provisional_bound(mag.chunk_states, &delta, (0, 2)),
        da_bound,
    }
}

/// Compares every output of the GPU against the reference.
pub fn check_all(gpu: &ssd_reference::ChunkedOutput<f32>, r: &Reference) -> [Compared; 4] {
    [
        compare("out", &gpu.out, &r.out, &r.out_bound),
        compare(
            "final_states",
            &gpu.final_states,
            &r.final_states,
            &r.final_bound,
        ),
        compare("dA_cumsum", &gpu.dA_cumsum, &r.da_cumsum, &r.da_bound),
        compare(
            "chunk_states",
            &gpu.chunk_states,
            &r.chunk_states,
            &r.chunk_states_bound,
        ),
    ]
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
