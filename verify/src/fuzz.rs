//! Shape fuzzing: seeded random cases over every size and option of the contract, and the
//! harness that checks an implementation on them.
//!
//! A [`FuzzCase`] is a [`ProblemSpec`] (sizes, options, value ranges) plus a seed for the
//! values. The specs come from the one generator of the workspace,
//! [`ssd_reference::random::random_spec`] (the GPU fuzz suite draws from it too, with a larger
//! cost cap), and the values from [`random_problem`], so a case is small to print and is
//! rebuilt from what it prints. [`cases`] draws a fixed list from a stream seed: every run
//! checks the same cases (`SSD_FUZZ_SEED` draws others, `SSD_FUZZ_CASES` sets how many).
//! [`check_all`] runs a check on every case in parallel and, on a failure, [`shrink`]s the
//! first failing case (smaller sizes, options off, the same value seed) before it panics, so
//! the message shows a small case. Any implementation joins the suite with
//!
//! ```no_run
//! use ssd_verify::fuzz::{cases, case_count, check_all, verdict, DEFAULT_SEED};
//! use ssd_verify::tolerance::{Candidate, Precision};
//!
//! #[test]
//! fn my_kernel_is_within_the_tf32_bound() {
//!     check_all("my kernel", &cases(case_count(), DEFAULT_SEED), |case| {
//!         let p = case.problem();
//!         let out = ssd_reference::chunked::forward(&p.cast::<f32>(), ssd_reference::MatmulPrecision::Tf32);
//!         let v = verdict(&p, &Candidate::from(&out), Precision::Tf32);
//!         if v.passed() { Ok(()) } else { Err(v.failures().join("; ")) }
//!     });
//! }
//! ```
use std::fmt;

use rayon::prelude::*;
use ssd_reference::random::{random_problem, random_spec, DSkip, ProblemSpec, SeqIdx, SpecRng};
use ssd_reference::{Dims, Options, Problem};

use crate::tolerance::{Candidate, Oracle, Precision, Verdict};

/// Cases per check when `SSD_FUZZ_CASES` is not set: keeps the whole default suite within a
/// few minutes on two cores.
pub const DEFAULT_CASES: usize = 256;

/// The stream seed of the default cases when `SSD_FUZZ_SEED` is not set.
pub const DEFAULT_SEED: u64 = 0x55D_F022;

/// The largest naive cost `batch * seqlen * nheads * headdim * dstate` of a CPU case: keeps a
/// case within milliseconds, while sequences of several chunks stay common (the generator
/// shortens seqlen to meet the cap).
pub const DEFAULT_CAP: usize = 100_000;

/// A number from the environment variable `name`, or `default`.
fn env_number<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

/// The number of cases per check: `SSD_FUZZ_CASES` if set to a number, else
/// [`DEFAULT_CASES`].
pub fn case_count() -> usize {
    env_number("SSD_FUZZ_CASES", DEFAULT_CASES)
}

/// The stream seed of the fuzz suites: `SSD_FUZZ_SEED` if set to a number, else
/// [`DEFAULT_SEED`] (a test may add its own offset, to check other cases than its
/// neighbours).
pub fn seed() -> u64 {
    env_number("SSD_FUZZ_SEED", DEFAULT_SEED)
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
    /// Never for a case from [`cases`] or [`shrink`]; a hand-made invalid spec panics with the
    /// reference's message.
    pub fn problem(&self) -> Problem<f64> {
        random_problem(&self.spec, self.seed)
            .unwrap_or_else(|e| panic!("fuzz case is not a valid problem ({self}): {e}"))
    }

    /// The naive cost `batch * seqlen * nheads * headdim * dstate`.
    pub fn size(&self) -> usize {
        let d = self.spec.dims;
        d.batch * d.seqlen * d.nheads * d.headdim * d.dstate
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

/// `n` cases drawn from the stream `seed` with [`DEFAULT_CAP`]: the same list on every run
/// and machine.
pub fn cases(n: usize, seed: u64) -> Vec<FuzzCase> {
    cases_with_cap(n, seed, DEFAULT_CAP)
}

/// `n` cases drawn from the stream `seed`, each of naive cost at most `cap` (see
/// [`random_spec`]): the spec first, then the seed of its values.
pub fn cases_with_cap(n: usize, seed: u64, cap: usize) -> Vec<FuzzCase> {
    let mut rng = SpecRng::new(seed);
    (0..n)
        .map(|_| {
            let spec = random_spec(&mut rng, cap);
            FuzzCase {
                spec,
                seed: rng.next_u64(),
            }
        })
        .collect()
}

/// The outcome of a check on one case: `Err` holds what failed.
pub type CaseResult = Result<(), String>;

/// Runs `check` on every case (in parallel) and returns the failing cases in order, each with
/// its message.
pub fn failures<F>(cases: &[FuzzCase], check: F) -> Vec<(FuzzCase, String)>
where
    F: Fn(&FuzzCase) -> CaseResult + Sync,
{
    let results: Vec<CaseResult> = cases.par_iter().map(&check).collect();
    cases
        .iter()
        .zip(results)
        .filter_map(|(c, r)| r.err().map(|e| (c.clone(), e)))
        .collect()
}

/// Runs `check` on every case (in parallel).
///
/// # Panics
/// When a case fails: the message gives the number of failing cases, the first one shrunk by
/// [`shrink`] with its failure, and the first one as drawn.
pub fn check_all<F>(label: &str, cases: &[FuzzCase], check: F)
where
    F: Fn(&FuzzCase) -> CaseResult + Sync,
{
    let failed = failures(cases, &check);
    if let Some((first, why)) = failed.first() {
        let (small, small_why) = shrink(first, why.clone(), &check);
        panic!(
            "{label}: {} of {} cases fail.\nshrunk: {small}\n    {small_why}\nas drawn: {first}\n    {why}",
            failed.len(),
            cases.len()
        );
    }
}

/// Smaller variants of `spec`, the most reducing first: fewer or shorter rows, fewer heads and
/// groups, narrower heads and states, smaller chunks, and each option switched off.
fn simpler(spec: &ProblemSpec) -> Vec<ProblemSpec> {
    let d = spec.dims;
    let mut out = Vec::new();
    let with_dims = |batch, seqlen, nheads, headdim, ngroups, dstate| ProblemSpec {
        dims: Dims::new(batch, seqlen, nheads, headdim, ngroups, dstate),
        ..*spec
    };
    let per_group = d.nheads / d.ngroups;
    for seqlen in [1, d.seqlen / 2, d.seqlen - 1] {
        if seqlen >= 1 && seqlen < d.seqlen {
            out.push(with_dims(
                d.batch, seqlen, d.nheads, d.headdim, d.ngroups, d.dstate,
            ));
        }
    }
    if d.batch > 1 {
        out.push(with_dims(
            1, d.seqlen, d.nheads, d.headdim, d.ngroups, d.dstate,
        ));
    }
    if d.ngroups > 1 {
        out.push(with_dims(
            d.batch, d.seqlen, per_group, d.headdim, 1, d.dstate,
        ));
        out.push(with_dims(
            d.batch,
            d.seqlen,
            per_group * (d.ngroups - 1),
            d.headdim,
            d.ngroups - 1,
            d.dstate,
        ));
    }
    if per_group > 1 {
        for per in [1, per_group - 1] {
            out.push(with_dims(
                d.batch,
                d.seqlen,
                d.ngroups * per,
                d.headdim,
                d.ngroups,
                d.dstate,
            ));
        }
    }
    for headdim in [1, d.headdim / 2, d.headdim - 1] {
        if headdim >= 1 && headdim < d.headdim {
            out.push(with_dims(
                d.batch, d.seqlen, d.nheads, headdim, d.ngroups, d.dstate,
            ));
        }
    }
    for dstate in [1, d.dstate / 2, d.dstate - 1] {
        if dstate >= 1 && dstate < d.dstate {
            out.push(with_dims(
                d.batch, d.seqlen, d.nheads, d.headdim, d.ngroups, dstate,
            ));
        }
    }
    if spec.options.chunk_size > 1 {
        out.push(ProblemSpec {
            options: Options {
                chunk_size: spec.options.chunk_size / 2,
                ..spec.options
            },
            ..*spec
        });
    }
    let plain = ProblemSpec::plain(d);
    let mut off = |changed: bool, s: ProblemSpec| {
        if changed {
            out.push(s);
        }
    };
    off(
        spec.d != DSkip::None,
        ProblemSpec {
            d: DSkip::None,
            ..*spec
        },
    );
    off(spec.z, ProblemSpec { z: false, ..*spec });
    off(
        spec.dt_bias,
        ProblemSpec {
            dt_bias: false,
            ..*spec
        },
    );
    off(
        spec.initial_states,
        ProblemSpec {
            initial_states: false,
            ..*spec
        },
    );
    off(
        spec.seq_idx != SeqIdx::None,
        ProblemSpec {
            seq_idx: SeqIdx::None,
            ..*spec
        },
    );
    off(
        spec.options.dt_limit != plain.options.dt_limit,
        ProblemSpec {
            options: Options {
                dt_limit: plain.options.dt_limit,
                ..spec.options
            },
            ..*spec
        },
    );
    off(
        spec.options.dt_softplus,
        ProblemSpec {
            options: Options {
                dt_softplus: false,
                ..spec.options
            },
            dt_range: plain.dt_range,
            ..*spec
        },
    );
    off(
        spec.a_range != plain.a_range,
        ProblemSpec {
            a_range: plain.a_range,
            ..*spec
        },
    );
    off(
        spec.dt_range != plain.dt_range && !spec.options.dt_softplus,
        ProblemSpec {
            dt_range: plain.dt_range,
            ..*spec
        },
    );
    out
}

/// Shrinks a failing case: repeatedly takes the first simpler variant (smaller sizes, an
/// option off; the values redrawn from the same seed) on which `check` still fails, until
/// none does. Returns the smallest failing case found and its failure (`case` and `why` when
/// nothing simpler fails). Deterministic: the same failure always shrinks to the same case.
pub fn shrink<F>(case: &FuzzCase, why: String, check: F) -> (FuzzCase, String)
where
    F: Fn(&FuzzCase) -> CaseResult + Sync,
{
    let mut best = (case.clone(), why);
    // Each accepted step removes at least one token, head, channel, state, chunk halving or
    // option, so this bound is never reached on the generator's cases.
    for _ in 0..10_000 {
        let next = simpler(&best.0.spec).into_iter().find_map(|spec| {
            let c = FuzzCase {
                spec,
                seed: best.0.seed,
            };
            check(&c).err().map(|e| (c, e))
        });
        match next {
            Some(n) => best = n,
            None => break,
        }
    }
    best
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cases_are_fixed_by_their_seed() {
        let a = cases(20, 3);
        assert_eq!(a, cases(20, 3));
        assert_ne!(a, cases(20, 4));
        assert!(a
            .iter()
            .all(|c| c.size() <= DEFAULT_CAP || c.spec.dims.seqlen == 1));
    }

    #[test]
    fn shrinking_finds_a_small_failing_case() {
        // "Fails" whenever there are several heads and z is on: shrinks to one group of two
        // heads, every other size 1 and every other option off.
        let fails = |c: &FuzzCase| {
            if c.spec.dims.nheads >= 2 && c.spec.z {
                Err("two heads and z".to_string())
            } else {
                Ok(())
            }
        };
        let all = cases(200, 5);
        let (first, why) = failures(&all, fails).remove(0);
        let (small, _) = shrink(&first, why, fails);
        let d = small.spec.dims;
        assert_eq!(
            (d.batch, d.seqlen, d.headdim, d.dstate, d.ngroups),
            (1, 1, 1, 1, 1)
        );
        assert_eq!(d.nheads, 2, "{small}");
        assert!(small.spec.z);
        assert!(!small.spec.dt_bias && !small.spec.initial_states);
        assert_eq!(small.spec.seq_idx, SeqIdx::None);
    }
}

/// A generated packed (serving) case ([`ssd_reference::serving`]): the problem's spec (batch
/// 1, no `seq_idx`), the sequence lengths, and how its states are given and wanted.
#[derive(Debug, Clone, PartialEq)]
pub struct PackedCase {
    pub spec: ProblemSpec,
    pub seed: u64,
    /// Tokens per sequence (zero-length ones included); their sum is `spec.dims.seqlen`.
    pub lens: Vec<usize>,
    /// One initial state per sequence (`seq_initial_states`), else mamba_ssm's convention
    /// (`spec.initial_states`) or none.
    pub per_sequence_states: bool,
    /// `seq_has_initial_state` given (some sequences start from zero).
    pub mask: bool,
    /// The per-sequence states are values of an f16 state cache (rounded to f16).
    pub f16_cache: bool,
    /// How many state positions, or `None` for every token (decode with per-token states).
    pub positions: Option<usize>,
}

impl PackedCase {
    /// The problem and its packing (valid by construction).
    ///
    /// # Panics
    /// Never for a case from [`packed_cases`].
    pub fn build(&self) -> (Problem<f64>, ssd_reference::serving::Packing<f64>) {
        let p = random_problem(&self.spec, self.seed)
            .unwrap_or_else(|e| panic!("packed case is not a valid problem ({self}): {e}"));
        let d = *p.dims();
        let mut cu = vec![0usize];
        for &l in &self.lens {
            cu.push(cu.last().expect("one") + l);
        }
        let mut k = ssd_reference::serving::Packing::new(cu);
        let mut rng = SpecRng::new(self.seed ^ 0x5e55_1045);
        let nseq = self.lens.len();
        if self.per_sequence_states {
            let round = |v: f64| {
                if self.f16_cache {
                    half::f16::from_f64(v).to_f64()
                } else {
                    v
                }
            };
            k.seq_initial_states = Some(ndarray::Array4::from_shape_fn(
                (nseq, d.nheads, d.headdim, d.dstate),
                |_| round(2.0 * rng.unit() - 1.0),
            ));
            if self.mask {
                k.seq_has_initial_state = Some((0..nseq).map(|_| rng.chance(0.6)).collect());
            }
        }
        k.state_positions = match self.positions {
            None => (0..d.seqlen).collect(),
            Some(n) => (0..n).map(|_| rng.range(0, d.seqlen - 1)).collect(),
        };
        (p, k)
    }
}

impl fmt::Display for PackedCase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.spec.dims;
        write!(
            f,
            "packed seed {} lens {:?} (h {}, p {}, g {}, n {}) chunk {} per-sequence states {} mask {} f16 cache {} positions {:?} mamba init {} softplus {} dt_limit {:?} D {:?} z {} dt_bias {} A in -{:?}",
            self.seed,
            self.lens,
            d.nheads,
            d.headdim,
            d.ngroups,
            d.dstate,
            self.spec.options.chunk_size,
            self.per_sequence_states,
            self.mask,
            self.f16_cache,
            self.positions,
            self.spec.initial_states,
            self.spec.options.dt_softplus,
            self.spec.options.dt_limit,
            self.spec.d,
            self.spec.z,
            self.spec.dt_bias,
            self.spec.a_range,
        )
    }
}

/// `n` packed cases drawn from the stream `seed`, each of naive cost at most `cap`: every
/// option of [`random_spec`], then the packing: prefill-like (1-8 sequences of 0-300 tokens,
/// zero-length ones and ones shorter than a chunk included, boundaries on and off the chunk
/// grid) or decode-like (1-48 sequences of 1-4 tokens each, per-token states wanted half the
/// time); per-sequence initial states (a third of them from an f16 cache, some masked) in
/// most cases, mamba_ssm's convention or none in the rest; 0-6 state positions.
pub fn packed_cases(n: usize, seed: u64, cap: usize) -> Vec<PackedCase> {
    let mut rng = SpecRng::new(seed);
    (0..n)
        .map(|_| {
            let mut spec = random_spec(&mut rng, cap);
            let decode = rng.chance(0.35);
            let per_token = spec.dims.nheads * spec.dims.headdim * spec.dims.dstate;
            let max_tokens = (cap / per_token).max(1);
            let mut lens: Vec<usize> = if decode {
                let t = rng.range(1, 4);
                vec![t; rng.range(1, 48)]
            } else {
                let l = spec.options.chunk_size;
                (0..rng.range(1, 8))
                    .map(|_| match rng.range(0, 4) {
                        0 => 0,
                        1 => rng.range(1, l.min(300)),
                        2 => l * rng.range(1, 3).min(300 / l.max(1)).max(1),
                        _ => rng.range(1, 300),
                    })
                    .collect()
            };
            // Within the cost cap, and at least one token.
            while lens.iter().sum::<usize>() > max_tokens {
                if decode && lens.len() > 1 {
                    lens.truncate(lens.len() / 2);
                } else {
                    let k = lens
                        .iter()
                        .enumerate()
                        .max_by_key(|(_, &l)| l)
                        .expect("one")
                        .0;
                    lens[k] /= 2;
                }
            }
            if lens.iter().sum::<usize>() == 0 {
                lens[0] = 1;
            }
            spec.dims = Dims::new(
                1,
                lens.iter().sum(),
                spec.dims.nheads,
                spec.dims.headdim,
                spec.dims.ngroups,
                spec.dims.dstate,
            );
            spec.seq_idx = SeqIdx::None;
            let per_sequence_states = rng.chance(0.7);
            spec.initial_states = !per_sequence_states && rng.chance(0.5);
            let mask = per_sequence_states && rng.chance(0.4);
            let f16_cache = per_sequence_states && rng.chance(0.33);
            let positions = if decode && rng.chance(0.5) {
                None
            } else {
                Some(rng.range(0, 6))
            };
            PackedCase {
                spec,
                seed: rng.next_u64(),
                lens,
                per_sequence_states,
                mask,
                f16_cache,
                positions,
            }
        })
        .collect()
}
