//! Shape fuzzing: proptest strategies that build valid problems by construction, over every
//! size and option of the contract, and the harness that checks a candidate on them.
//!
//! A [`FuzzCase`] is a [`ProblemSpec`] (sizes, options, value ranges) plus a seed; the values
//! come from [`random_problem`], so a case is small to print and shrinks well: proptest shrinks
//! the sizes and switches options off (towards the first alternative of each choice) while the
//! failure persists. Any implementation joins the suite with
//!
//! ```no_run
//! use proptest::prelude::*;
//! use ssd_verify::fuzz::{case_strategy, config, verdict};
//! use ssd_verify::tolerance::{Candidate, Precision};
//!
//! proptest! {
//!     #![proptest_config(config())]
//!     #[test]
//!     fn my_kernel_is_within_the_tf32_bound(case in case_strategy()) {
//!         let p = case.problem();
//!         let out = ssd_reference::chunked::forward(&p.cast::<f32>(), ssd_reference::MatmulPrecision::Tf32);
//!         let v = verdict(&p, &Candidate::from(&out), Precision::Tf32);
//!         prop_assert!(v.passed(), "{}: {:?}", case, v.failures());
//!     }
//! }
//! ```
use std::fmt;

use proptest::prelude::*;
pub use proptest::test_runner::Config;
use proptest::test_runner::FileFailurePersistence;
use ssd_reference::random::{random_problem, DSkip, ProblemSpec, SeqIdx};
use ssd_reference::{Dims, Options, Problem};

use crate::tolerance::{Candidate, Oracle, Precision, Verdict};

/// Cases per property when `PROPTEST_CASES` is not set: keeps the whole default suite within a
/// few minutes on two cores.
pub const DEFAULT_CASES: u32 = 256;

/// The number of cases per property: `PROPTEST_CASES` if set to a number, else
/// [`DEFAULT_CASES`].
pub fn case_count() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(DEFAULT_CASES)
}

/// The proptest configuration of the fuzz suites: [`case_count`] cases, failures persisted in
/// `proptest-regressions/fuzz.txt` under the crate (commit it; proptest replays the seeds it
/// holds before new cases). Use [`config_for`] to give a test file its own regression file.
pub fn config() -> Config {
    config_for("fuzz")
}

/// Like [`config`], with failures persisted in `proptest-regressions/NAME.txt` (relative to
/// the crate's folder, where `cargo test` runs tests).
pub fn config_for(name: &str) -> Config {
    let path: &'static str = Box::leak(format!("proptest-regressions/{name}.txt").into_boxed_str());
    Config {
        cases: case_count(),
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(path))),
        ..Config::default()
    }
}

/// Upper limits of the generated sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub batch: usize,
    pub seqlen: usize,
    pub headdim: usize,
    pub dstate: usize,
    /// `log2` of the largest chunk size.
    pub log2_chunk: u32,
}

impl Default for Limits {
    /// Small enough for hundreds of cases a second on the CPU: batch 2, seqlen 300 (with most
    /// draws much shorter), headdim 8, dstate 16, chunk sizes 1 to 256; nheads is one of
    /// 1, 2, 3, 4, 6, 8.
    fn default() -> Self {
        Limits {
            batch: 2,
            seqlen: 300,
            headdim: 8,
            dstate: 16,
            log2_chunk: 8,
        }
    }
}

/// A generated case: what to draw and the seed to draw it with.
#[derive(Debug, Clone, PartialEq)]
pub struct FuzzCase {
    pub spec: ProblemSpec,
    pub seed: u64,
}

impl FuzzCase {
    /// The problem (valid by construction).
    ///
    /// # Panics
    /// Never for a case from [`case_strategy`]; a hand-made invalid spec panics with the
    /// reference's message.
    pub fn problem(&self) -> Problem<f64> {
        random_problem(&self.spec, self.seed)
            .unwrap_or_else(|e| panic!("fuzz strategy built an invalid problem ({self}): {e}"))
    }
}

impl fmt::Display for FuzzCase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.spec;
        let d = s.dims;
        write!(
            f,
            "seed {} dims (b {}, L {}, h {}, p {}, g {}, n {}) chunk {} softplus {} dt_limit {:?} D {:?} z {} dt_bias {} init {} seq_idx {:?} A in -{:?} dt in {:?}",
            self.seed,
            d.batch,
            d.seqlen,
            d.nheads,
            d.headdim,
            d.ngroups,
            d.dstate,
            s.options.chunk_size,
            s.options.dt_softplus,
            s.options.dt_limit,
            s.d,
            s.z,
            s.dt_bias,
            s.initial_states,
            s.seq_idx,
            s.a_range,
            s.dt_range
        )
    }
}

/// Sizes: `nheads` from {1, 2, 3, 4, 6, 8} with `ngroups` one of its divisors, the rest in
/// `1..=limit` (seqlen short most of the time: `1..=8`, `1..=64` or `1..=limit`).
pub fn dims_strategy(lim: Limits) -> impl Strategy<Value = Dims> {
    let seqlen = prop_oneof![
        3 => 1..=8usize,
        4 => 1..=64usize.min(lim.seqlen),
        2 => 1..=lim.seqlen,
    ];
    let heads = prop_oneof![Just(1usize), Just(2), Just(4), Just(3), Just(6), Just(8)];
    let heads_groups = heads.prop_flat_map(|h| {
        let divisors: Vec<usize> = (1..=h).filter(|g| h % g == 0).collect();
        (Just(h), proptest::sample::select(divisors))
    });
    (
        1..=lim.batch,
        seqlen,
        heads_groups,
        1..=lim.headdim,
        1..=lim.dstate,
    )
        .prop_map(|(batch, seqlen, (nheads, ngroups), headdim, dstate)| {
            Dims::new(batch, seqlen, nheads, headdim, ngroups, dstate)
        })
}

/// Options: chunk sizes `2^0` to `2^log2_chunk`, softplus on or off, `dt_limit` from the
/// default `[0, inf)` to tight clamps.
pub fn options_strategy(lim: Limits) -> impl Strategy<Value = Options> {
    let limits = prop_oneof![
        Just((0.0, f64::INFINITY)),
        Just((0.001, 0.5)),
        Just((0.01, 0.1)),
        Just((0.0, 0.05)),
        Just((0.05, f64::INFINITY)),
    ];
    (0..=lim.log2_chunk, any::<bool>(), limits).prop_map(|(k, dt_softplus, dt_limit)| Options {
        chunk_size: 1 << k,
        dt_softplus,
        dt_limit,
    })
}

/// `seq_idx` layouts: none; 1 to 5 sequences per row numbered from 0, 1 or 2 (a first value
/// above 0 leaves the initial state unused); resets exactly at every (or every other) chunk
/// start.
pub fn seq_idx_strategy() -> impl Strategy<Value = SeqIdx> {
    prop_oneof![
        2 => Just(SeqIdx::None),
        2 => (1..=5usize, 0..=2i64).prop_map(|(segments, first)| SeqIdx::Segments { segments, first }),
        1 => (1..=2usize).prop_map(|every| SeqIdx::AtChunkStarts { every }),
    ]
}

/// Ranges of `-A` and of the raw `dt`: Mamba-2's usual ones, no decay at all, tiny decays,
/// extreme decays (`|dt' A|` up to hundreds per token, so decays underflow), and raw `dt` on
/// both sides of the softplus threshold 20.
pub fn ranges_strategy() -> impl Strategy<Value = ((f64, f64), (f64, f64))> {
    let a = prop_oneof![
        3 => Just((0.5, 8.0)),
        1 => Just((0.0, 0.0)),
        1 => Just((0.0, 1e-3)),
        1 => Just((1.0, 30.0)),
        1 => Just((0.0, 16.0)),
    ];
    let dt = prop_oneof![
        3 => Just((0.001, 0.1)),
        2 => Just((-4.0, 1.0)),
        1 => Just((-25.0, 25.0)),
        1 => Just((0.0, 2.0)),
    ];
    (a, dt)
}

/// Valid cases over every size and option, with [`Limits::default`].
pub fn case_strategy() -> impl Strategy<Value = FuzzCase> {
    case_strategy_with(Limits::default())
}

/// Valid cases over every size and option within `lim`.
pub fn case_strategy_with(lim: Limits) -> impl Strategy<Value = FuzzCase> {
    let d = prop_oneof![
        Just(DSkip::None),
        Just(DSkip::PerHead),
        Just(DSkip::PerChannel)
    ];
    let flags = (any::<bool>(), any::<bool>(), any::<bool>());
    (
        dims_strategy(lim),
        options_strategy(lim),
        d,
        flags,
        seq_idx_strategy(),
        ranges_strategy(),
        any::<u64>(),
    )
        .prop_map(
            |(
                dims,
                options,
                d,
                (z, dt_bias, initial_states),
                seq_idx,
                (a_range, dt_range),
                seed,
            )| {
                FuzzCase {
                    spec: ProblemSpec {
                        dims,
                        options,
                        d,
                        z,
                        dt_bias,
                        initial_states,
                        seq_idx,
                        a_range,
                        dt_range,
                    },
                    seed,
                }
            },
        )
}

/// The verdict on `candidate` as an implementation of `p` in `precision`: computes the float64
/// reference and the bounds (use [`Oracle`] directly to check several candidates of one
/// problem).
///
/// # Panics
/// If a candidate tensor's shape differs from the contract's (a harness bug, not a verdict).
pub fn verdict(p: &Problem<f64>, candidate: &Candidate, precision: Precision) -> Verdict {
    Oracle::new(p)
        .check(candidate, precision)
        .unwrap_or_else(|e| panic!("{e}"))
}
