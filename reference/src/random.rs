//! Seeded random problems: every size and option of the contract, reproducible from a seed.
//!
//! Two steps, each seeded: [`random_spec`] (or [`random_pair_spec`]) draws what a problem is
//! (sizes, options, value ranges) from a [`SpecRng`] stream, and [`random_problem`] draws its
//! values for a [`ProblemSpec`] and a seed. The same seeds give the same problem on every
//! machine (splitmix64 for specs, ChaCha8 for values, both drawn in a fixed order), so
//! fixtures, fuzz cases (CPU and GPU) and benchmarks can be regenerated.

use ndarray::{Array1, Array2, Array3, Array4, ArrayD, IxDyn};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::{Dims, Inputs, Options, Problem, ReferenceError};

/// Which `D` skip term a problem has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DSkip {
    None,
    /// `D` of shape `[nheads]`.
    PerHead,
    /// `D` of shape `[nheads, headdim]`.
    PerChannel,
}

/// How `seq_idx` is laid out along each row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SeqIdx {
    /// No `seq_idx` tensor.
    None,
    /// `segments` sequences per row (boundaries drawn at random, so some may coincide with chunk
    /// boundaries only by chance), numbered from `first` upwards. `first > 0` means the
    /// initial state seeds nothing.
    Segments { segments: usize, first: i64 },
    /// Boundaries exactly at every multiple of `chunk_size` times `every` (a reset right at
    /// chunk starts), numbered from 0.
    AtChunkStarts { every: usize },
}

/// Everything that describes a random problem except the values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProblemSpec {
    pub dims: Dims,
    pub options: Options,
    pub d: DSkip,
    pub z: bool,
    pub dt_bias: bool,
    pub initial_states: bool,
    pub seq_idx: SeqIdx,
    /// `A` drawn uniformly in `-[a_range.0, a_range.1]` (both non-negative, `0 <= lo <= hi`).
    pub a_range: (f64, f64),
    /// Raw `dt` drawn uniformly in `[dt_range.0, dt_range.1]` (before bias/softplus/clamp).
    pub dt_range: (f64, f64),
}

impl ProblemSpec {
    /// A plain problem of the given sizes: chunk 64, no optional tensor, `dt` already activated
    /// in `[0.001, 0.1]`, `A` in `[-8, -0.5]` (Mamba-2's usual ranges).
    pub fn plain(dims: Dims) -> Self {
        ProblemSpec {
            dims,
            options: Options::default(),
            d: DSkip::None,
            z: false,
            dt_bias: false,
            initial_states: false,
            seq_idx: SeqIdx::None,
            a_range: (0.5, 8.0),
            dt_range: (0.001, 0.1),
        }
    }

    /// Every option switched on: softplus with a bias, `dt_limit` `[0.001, 0.5]`, `D` per
    /// channel, `z`, initial states and three sequences per row.
    pub fn full(dims: Dims, chunk_size: usize) -> Self {
        ProblemSpec {
            dims,
            options: Options {
                chunk_size,
                dt_softplus: true,
                dt_limit: (0.001, 0.5),
            },
            d: DSkip::PerChannel,
            z: true,
            dt_bias: true,
            initial_states: true,
            seq_idx: SeqIdx::Segments {
                segments: 3,
                first: 0,
            },
            a_range: (0.5, 8.0),
            dt_range: (-4.0, 1.0),
        }
    }
}

fn uniform<R: Rng>(rng: &mut R, lo: f64, hi: f64) -> f64 {
    if hi > lo {
        lo + (hi - lo) * rng.random::<f64>()
    } else {
        lo
    }
}

fn fill<R: Rng, Sh: ndarray::ShapeBuilder>(
    rng: &mut R,
    shape: Sh,
    lo: f64,
    hi: f64,
) -> ndarray::Array<f64, Sh::Dim> {
    let mut a = ndarray::Array::zeros(shape);
    a.iter_mut().for_each(|v| *v = uniform(rng, lo, hi));
    a
}

/// splitmix64: the random stream specs are drawn from (seeded, the same on every machine).
#[derive(Debug, Clone)]
pub struct SpecRng(u64);

impl SpecRng {
    pub fn new(seed: u64) -> Self {
        SpecRng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi` (up to the modulo's tiny bias).
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }

    /// Uniform in `[0, 1)`: the top 53 bits of the next draw.
    pub fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64) / ((1u64 << 53) as f64)
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    /// One of `v`, uniformly.
    pub fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.range(0, v.len() - 1)]
    }
}

/// A random spec over every size and option of the contract: ragged seqlen, chunk sizes 1 to
/// 1024, ngroups > 1, headdim and dstate off the 64-wide tiles (dstate up to 256), every
/// optional tensor, seq_idx (segments, resets at chunk starts, leading run not 0), softplus,
/// dt_limit, and decays from none (A = 0) to very strong. The naive cost
/// `batch * seqlen * nheads * headdim * dstate` is capped at `cap` (by shortening seqlen, down
/// to 1).
///
/// The draws are part of the contract of the fuzz suites: the GPU fuzz suite's recorded worst
/// ratios are for exactly these cases, so any change here changes them.
pub fn random_spec(rng: &mut SpecRng, cap: usize) -> ProblemSpec {
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

/// A random spec of the shapes the GPU's output kernel over pairs of units serves (chunks of
/// 128 to 512 tokens, seqlen past one 64-row tile, headdim and dstate multiples of 4, an even
/// number of (head, 64 headdim columns) units per group), every option drawn as in
/// [`random_spec`] (whose sizes it then redraws; the cost cap keeps seqlen at least 65).
pub fn random_pair_spec(rng: &mut SpecRng, cap: usize) -> ProblemSpec {
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

/// Draws a problem from `spec` with `seed`.
///
/// Values: `x`, `B`, `C`, `z`, `initial_states` uniform in `[-1, 1]`; `D` in `[-1, 1]`;
/// `dt_bias` in `[-1, 0.5]`; `A` and raw `dt` from the spec's ranges.
///
/// # Errors
/// The spec's sizes or options are invalid (see [`Problem::new`]).
pub fn random_problem(spec: &ProblemSpec, seed: u64) -> Result<Problem<f64>, ReferenceError> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let Dims {
        batch,
        seqlen,
        nheads,
        headdim,
        ngroups,
        dstate,
    } = spec.dims;
    let x = fill(&mut rng, (batch, seqlen, nheads, headdim), -1.0, 1.0);
    let dt: Array3<f64> = fill(
        &mut rng,
        (batch, seqlen, nheads),
        spec.dt_range.0,
        spec.dt_range.1,
    );
    let a: Array1<f64> = fill(&mut rng, nheads, -spec.a_range.1, -spec.a_range.0);
    let b: Array4<f64> = fill(&mut rng, (batch, seqlen, ngroups, dstate), -1.0, 1.0);
    let c: Array4<f64> = fill(&mut rng, (batch, seqlen, ngroups, dstate), -1.0, 1.0);
    let d: Option<ArrayD<f64>> = match spec.d {
        DSkip::None => None,
        DSkip::PerHead => Some(fill(&mut rng, IxDyn(&[nheads]), -1.0, 1.0)),
        DSkip::PerChannel => Some(fill(&mut rng, IxDyn(&[nheads, headdim]), -1.0, 1.0)),
    };
    let z = spec
        .z
        .then(|| fill(&mut rng, (batch, seqlen, nheads, headdim), -1.0, 1.0));
    let dt_bias = spec.dt_bias.then(|| fill(&mut rng, nheads, -1.0, 0.5));
    let initial_states = spec
        .initial_states
        .then(|| fill(&mut rng, (batch, nheads, headdim, dstate), -1.0, 1.0));
    let seq_idx = match spec.seq_idx {
        SeqIdx::None => None,
        SeqIdx::Segments { segments, first } => {
            let mut s = Array2::<i64>::zeros((batch, seqlen));
            for bi in 0..batch {
                // segments - 1 boundaries in 1..seqlen (duplicates merge, so fewer is possible)
                let mut cuts: Vec<usize> = (1..segments.max(1))
                    .filter(|_| seqlen > 1)
                    .map(|_| rng.random_range(1..seqlen))
                    .collect();
                cuts.sort_unstable();
                let mut id = first;
                let mut next = cuts.iter().peekable();
                for t in 0..seqlen {
                    while next.peek().is_some_and(|&&c| c == t) {
                        next.next();
                        id += 1;
                    }
                    s[[bi, t]] = id;
                }
            }
            Some(s)
        }
        SeqIdx::AtChunkStarts { every } => {
            let period = spec.options.chunk_size * every.max(1);
            Some(Array2::from_shape_fn((batch, seqlen), |(_, t)| {
                (t / period) as i64
            }))
        }
    };
    Problem::new(
        spec.dims,
        spec.options,
        Inputs {
            x,
            dt,
            A: a,
            B: b,
            C: c,
            D: d,
            z,
            dt_bias,
            initial_states,
            seq_idx,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims() -> Dims {
        Dims {
            batch: 2,
            seqlen: 37,
            nheads: 4,
            headdim: 3,
            ngroups: 2,
            dstate: 5,
        }
    }

    #[test]
    fn same_seed_same_problem() {
        let spec = ProblemSpec::full(dims(), 8);
        let p = random_problem(&spec, 7).unwrap();
        let q = random_problem(&spec, 7).unwrap();
        let r = random_problem(&spec, 8).unwrap();
        assert_eq!(p.inputs().x, q.inputs().x);
        assert_eq!(p.inputs().seq_idx, q.inputs().seq_idx);
        assert_ne!(p.inputs().x, r.inputs().x);
    }

    /// The GPU fuzz suite's first specs (stream `0x55D_0001`): the recorded worst ratios are
    /// for exactly these draws.
    #[test]
    fn spec_draws_are_pinned() {
        let mut rng = SpecRng::new(0x55D_0001);
        let sizes: Vec<(Dims, usize)> = (0..3)
            .map(|_| {
                let s = random_spec(&mut rng, 4_000_000);
                (s.dims, s.options.chunk_size)
            })
            .collect();
        assert_eq!(
            sizes,
            [
                (Dims::new(3, 247, 2, 55, 1, 49), 4),
                (Dims::new(3, 14, 3, 44, 3, 13), 64),
                (Dims::new(1, 8, 6, 24, 2, 87), 256),
            ]
        );
        let pair = random_pair_spec(&mut SpecRng::new(0x9A1_0001), 4_000_000);
        assert!(pair.dims.seqlen >= 65 && pair.dims.headdim.is_multiple_of(4));
        assert!(pair.options.chunk_size >= 128);
    }

    #[test]
    fn seq_idx_is_valid_and_segmented() {
        let mut spec = ProblemSpec::full(dims(), 8);
        spec.seq_idx = SeqIdx::Segments {
            segments: 4,
            first: 2,
        };
        let p = random_problem(&spec, 1).unwrap();
        let s = p.inputs().seq_idx.as_ref().unwrap();
        for row in s.rows() {
            assert_eq!(row[0], 2);
            assert!(row[row.len() - 1] > 2, "several segments expected: {row}");
        }
    }
}
