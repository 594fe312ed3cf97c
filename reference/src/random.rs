//! Seeded random problems: every size and option of the contract, reproducible from a seed.
//!
//! The same `(ProblemSpec, seed)` gives the same problem on every machine (ChaCha8 stream,
//! values drawn in a fixed order), so fixtures, fuzz cases and benchmarks can be regenerated.

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
