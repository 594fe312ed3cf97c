//! Shared helpers of the integration tests: error magnitudes, bounds and random specs.
#![allow(dead_code)]

use ndarray::{Array4, Array5, Dimension};
use proptest::prelude::*;
use ssd_reference::random::{DSkip, ProblemSpec, SeqIdx};
use ssd_reference::{Dims, Options, Problem, Real};

/// Unit roundoff of f64 and f32.
pub const U64: f64 = f64::EPSILON / 2.0;
pub const U32: f64 = f32::EPSILON as f64 / 2.0;

/// Per-element magnitudes of the terms summed into each output.
pub struct Magnitudes {
    /// `[batch, seqlen, nheads, headdim]`
    pub out: Array4<f64>,
    /// `[batch, nheads, headdim, dstate]`
    pub final_states: Array4<f64>,
    /// `[batch, nchunks, nheads, headdim, dstate]`: magnitude of the state entering each chunk.
    pub chunk_states: Array5<f64>,
}

/// For every output, the sum of the absolute values of the terms it is made of: the
/// recurrence run on absolute values ([`ssd_reference::magnitude`], the magnitudes the error
/// model of `ssd-verify` uses), with fixed dimensions. Any algorithm that sums these terms in
/// some order with relative perturbations of at most `gamma` per term is within
/// `gamma * mag` of the exact value: the bound every comparison below is stated against.
pub fn magnitudes(p: &Problem<f64>) -> Magnitudes {
    let m = ssd_reference::magnitude::magnitudes(p);
    Magnitudes {
        out: m.out.mag.into_dimensionality().expect("4 axes"),
        final_states: m.final_states.mag.into_dimensionality().expect("4 axes"),
        chunk_states: m.chunk_states.mag.into_dimensionality().expect("5 axes"),
    }
}

/// Largest `|dA_cumsum|` of the problem (the cumsum restarts at every chunk).
pub fn max_abs_cumsum(p: &Problem<f64>) -> f64 {
    let d = *p.dims();
    let cs = p.options().chunk_size;
    let mut worst: f64 = 0.0;
    for b in 0..d.batch {
        for h in 0..d.nheads {
            let mut acc: f64 = 0.0;
            for t in 0..d.seqlen {
                if t % cs == 0 {
                    acc = 0.0;
                }
                acc += (p.dt_processed(b, t, h) * p.inputs().A[h]).abs();
                worst = worst.max(acc);
            }
        }
    }
    worst
}

/// Relative perturbation per term that naive and chunked may each carry, in units of the
/// unit roundoff `u`, for `p`:
///
/// - naive: a term entering the state at token `j` and read at `t` goes through `t - j + 1`
///   updates `s = a s + u b` (an `exp` within 1 ulp, one product, one fused multiply-add: 3
///   roundings each), then a `dstate`-long dot product (`dstate` roundings), the `D` term and
///   the gate (3): `3 seqlen + dstate + 3`;
/// - chunked: `dA_cumsum` is a left-to-right sum of same-sign terms, so entry `k` is off by at
///   most `k u |cs|max`, and `exp(cs_i - cs_j)`, `exp(cs_i)`, `exp(cs_last - cs_j)` inherit
///   twice that as a relative error: `2 chunk_size |cs|max + 2` per decay, at most three decays
///   on a path (chunk state, state passing scale, carried term); dot products of length
///   `chunk_size` (chunk state, `Lmat x`) and `dstate` (`C S^T`, `C B^T`); `2 nchunks` for the
///   state pass; 10 for the remaining products, `D` and gate.
///
/// The comparison bound is the sum of both.
pub fn gamma_units(p: &Problem<f64>) -> f64 {
    let d = p.dims();
    let cs = p.options().chunk_size.min(d.seqlen) as f64;
    let naive = 3.0 * d.seqlen as f64 + d.dstate as f64 + 3.0;
    let decay = 2.0 * cs * max_abs_cumsum(p) + 2.0;
    let chunked = 3.0 * decay + 2.0 * cs + 2.0 * d.dstate as f64 + 2.0 * p.nchunks() as f64 + 10.0;
    naive + chunked
}

/// `max |a - b| / mag` over elements (0/0 counts as 0), and `max |a - b| / max mag`.
pub fn scaled_errors<D: Dimension, T: Real>(
    a: &ndarray::Array<T, D>,
    b: &ndarray::Array<f64, D>,
    mag: &ndarray::Array<f64, D>,
) -> (f64, f64) {
    assert_eq!(a.shape(), b.shape());
    assert_eq!(a.shape(), mag.shape());
    let mut elem: f64 = 0.0;
    let mut worst_diff: f64 = 0.0;
    let mut worst_mag: f64 = 0.0;
    for ((x, y), m) in a.iter().zip(b.iter()).zip(mag.iter()) {
        let diff = (x.as_f64() - y).abs();
        assert!(diff.is_finite(), "non-finite value: {} vs {y}", x.as_f64());
        if diff > 0.0 {
            elem = elem.max(diff / m);
        }
        worst_diff = worst_diff.max(diff);
        worst_mag = worst_mag.max(*m);
    }
    let norm = if worst_mag > 0.0 {
        worst_diff / worst_mag
    } else {
        worst_diff
    };
    (elem, norm)
}

/// Converts a result to f64 for comparisons.
pub fn widen<T: Real, D: Dimension>(a: &ndarray::Array<T, D>) -> ndarray::Array<f64, D> {
    a.mapv(|v| v.as_f64())
}

/// Number of proptest cases: `PROPTEST_CASES` if set, else `default`.
pub fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A proptest configuration with a fixed seed (reproducible runs) and no regression files.
pub fn config(default_cases: u32, seed: u64) -> ProptestConfig {
    ProptestConfig {
        cases: cases(default_cases),
        rng_seed: proptest::test_runner::RngSeed::Fixed(seed),
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Random problem specs: every size and option of the contract, small enough to be quick.
pub fn any_spec(max_seqlen: usize) -> impl Strategy<Value = ProblemSpec> {
    let dims = (
        1usize..=2,
        prop_oneof![Just(1usize), 1..=max_seqlen],
        1usize..=3,
        1usize..=3,
        1usize..=20,
        1usize..=40,
    )
        .prop_map(|(batch, seqlen, ngroups, hpg, headdim, dstate)| Dims {
            batch,
            seqlen,
            nheads: ngroups * hpg,
            headdim,
            ngroups,
            dstate,
        });
    let options = (
        0u32..=8,
        any::<bool>(),
        prop_oneof![
            Just((0.0, f64::INFINITY)),
            Just((0.001, 0.5)),
            Just((0.05, 0.2))
        ],
    )
        .prop_map(|(log_cs, dt_softplus, dt_limit)| Options {
            chunk_size: 1 << log_cs,
            dt_softplus,
            dt_limit,
        });
    let d = prop_oneof![
        Just(DSkip::None),
        Just(DSkip::PerHead),
        Just(DSkip::PerChannel)
    ];
    let seq = prop_oneof![
        Just(SeqIdx::None),
        (1usize..=5, 0i64..=2).prop_map(|(segments, first)| SeqIdx::Segments { segments, first }),
        (1usize..=2).prop_map(|every| SeqIdx::AtChunkStarts { every }),
    ];
    let a_range = prop_oneof![Just((0.5, 8.0)), Just((0.0, 1.0)), Just((0.0, 0.0))];
    (dims, options, d, any::<(bool, bool, bool)>(), seq, a_range).prop_map(
        |(dims, options, d, (z, dt_bias, initial_states), seq_idx, a_range)| ProblemSpec {
            dims,
            options,
            d,
            z,
            dt_bias,
            initial_states,
            seq_idx,
            a_range,
            dt_range: if options.dt_softplus {
                (-4.0, 1.0)
            } else {
                (0.001, 0.3)
            },
        },
    )
}
