//! The fixture suites `ssd-oracle gen` writes: named, seeded problems with their float64
//! expected outputs and magnitudes.
//!
//! - [`Suite::Smoke`]: three small cases (each well under 1 MB), every option at least once.
//! - [`Suite::Edge`]: every option and boundary of the contract, one case each: seqlen 1,
//!   chunk 1, chunk larger than seqlen, ragged last chunk, `seq_idx` resets exactly at chunk
//!   starts, a first `seq_idx` above 0, many short sequences, `D` per head and per channel, `z`,
//!   `dt + dt_bias` on both sides of the softplus threshold, `dt_limit` clamping at both ends,
//!   `ngroups` strictly between 1 and `nheads`, extreme and zero decays, bf16 and f64 inputs.
//! - [`Suite::Standard`]: realistic Mamba-2 layer shapes (tens of MB each: not committed).
//! - [`Suite::Backward`]: cases for backward kernels: the forward case plus upstream gradients
//!   `dout` and `dfinal_states` and the float64 gradients the adjoint recurrence gives
//!   ([`backward_tensors`]), every option at least once.
//!
//! Case `k` of a suite draws its values with seed `seed + k`, so a suite is reproducible from
//! its seed. Inputs are stored as F32 (as an f32 kernel reads them) unless the case says
//! otherwise; the expected outputs are computed in float64 from the inputs exactly as stored.
use ndarray::{Array4, ArrayD};
use serde_json::Value;
use ssd_reference::random::{random_problem, DSkip, ProblemSpec, SeqIdx};
use ssd_reference::serving::Packing;
use ssd_reference::{Dims, Options, Problem};

use crate::error::VerifyError;
use crate::fixture::{round_inputs, Case, CaseMeta, Expected, FloatDtype};
use crate::magnitude::magnitudes;
use crate::tolerance::reference_outputs;

/// A suite of cases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Suite {
    Smoke,
    Edge,
    Standard,
    Backward,
    Serving,
}

impl Suite {
    /// `"smoke"`, `"edge"`, `"standard"`, `"backward"`.
    pub fn name(self) -> &'static str {
        match self {
            Suite::Smoke => "smoke",
            Suite::Edge => "edge",
            Suite::Standard => "standard",
            Suite::Backward => "backward",
            Suite::Serving => "serving",
        }
    }
}

/// One case of a suite, before its values are drawn.
#[derive(Debug, Clone, PartialEq)]
pub struct CaseSpec {
    /// File stem and manifest `name`.
    pub name: &'static str,
    pub description: &'static str,
    pub spec: ProblemSpec,
    /// The dtype the inputs are stored in (F16/BF16 apply to `x`, `z`, `B`, `C` only).
    pub input_dtype: FloatDtype,
    /// A packed (serving) case: how the row splits into sequences ([`Suite::Serving`]).
    pub packing: Option<PackingSpec>,
}

/// The packing of a serving case, before its values are drawn.
#[derive(Debug, Clone, PartialEq)]
pub struct PackingSpec {
    /// Tokens per sequence; their sum is the case's seqlen.
    pub lens: Vec<usize>,
    /// One initial state per sequence (`seq_initial_states`), drawn from the case's seed.
    pub per_sequence_states: bool,
    /// Which sequences have one (`seq_has_initial_state`), when not all.
    pub mask: Option<Vec<bool>>,
    /// The per-sequence states hold values of an f16 state cache.
    pub f16_cache: bool,
    /// Token positions whose state is wanted; `None` for every token.
    pub positions: Option<Vec<usize>>,
}

fn case(name: &'static str, description: &'static str, spec: ProblemSpec) -> CaseSpec {
    CaseSpec {
        name,
        description,
        spec,
        input_dtype: FloatDtype::F32,
        packing: None,
    }
}

fn options(chunk_size: usize, dt_softplus: bool, dt_limit: (f64, f64)) -> Options {
    Options {
        chunk_size,
        dt_softplus,
        dt_limit,
    }
}

const NO_LIMIT: (f64, f64) = (0.0, f64::INFINITY);

/// The cases of `suite`, in order.
pub fn cases(suite: Suite) -> Vec<CaseSpec> {
    match suite {
        Suite::Smoke => smoke(),
        Suite::Edge => edge(),
        Suite::Standard => standard(),
        Suite::Backward => backward(),
        Suite::Serving => serving(),
    }
}

/// A serving case: batch 1, the given sequence lengths, every other option as `spec` says.
fn packed(
    name: &'static str,
    description: &'static str,
    spec: ProblemSpec,
    packing: PackingSpec,
) -> CaseSpec {
    let seqlen = packing.lens.iter().sum();
    let d = spec.dims;
    CaseSpec {
        spec: ProblemSpec {
            dims: Dims::new(1, seqlen, d.nheads, d.headdim, d.ngroups, d.dstate),
            seq_idx: SeqIdx::None,
            ..spec
        },
        packing: Some(packing),
        ..case(name, description, spec)
    }
}

fn serving() -> Vec<CaseSpec> {
    let full = ProblemSpec {
        initial_states: false,
        ..ProblemSpec::full(Dims::new(1, 1, 4, 8, 2, 8), 32)
    };
    let states = |lens: Vec<usize>, positions: Option<Vec<usize>>| PackingSpec {
        lens,
        per_sequence_states: true,
        mask: None,
        f16_cache: false,
        positions,
    };
    vec![
        packed(
            "prefill-mixed",
            "5 packed sequences of 0, 7, 45, 32 and 19 tokens (a zero-length one, one shorter than a chunk, boundaries on and off the 32-token grid), each from its own initial state, the second without one (mask), states at 4 positions; every option",
            full,
            PackingSpec {
                mask: Some(vec![true, false, true, true, true]),
                ..states(vec![0, 7, 45, 32, 19], Some(vec![3, 6, 40, 102]))
            },
        ),
        packed(
            "decode-1",
            "a decode step: 8 sequences of 1 token, each continuing from its own cached state (values of an f16 cache)",
            full,
            PackingSpec {
                f16_cache: true,
                ..states(vec![1; 8], Some(Vec::new()))
            },
        ),
        packed(
            "decode-4",
            "4 tokens per sequence for 6 sequences (speculative decoding): every per-token state wanted",
            full,
            states(vec![4; 6], None),
        ),
        packed(
            "mamba-varlen",
            "mamba_ssm's convention: 3 sequences of 20, 50 and 30 tokens, initial_states for the first only, varlen states out (return_varlen_states=True); dt_limit [0.001, 0.5]",
            ProblemSpec {
                initial_states: true,
                ..full
            },
            PackingSpec {
                per_sequence_states: false,
                ..states(vec![20, 50, 30], Some(Vec::new()))
            },
        ),
    ]
}

fn backward() -> Vec<CaseSpec> {
    let dims = Dims::new(2, 100, 4, 8, 2, 8);
    let full = ProblemSpec::full(dims, 32);
    vec![
        case(
            "plain",
            "one sequence per row, dt already activated, no optional tensor",
            ProblemSpec {
                options: options(32, false, NO_LIMIT),
                ..ProblemSpec::plain(Dims::new(1, 64, 2, 8, 1, 8))
            },
        ),
        case(
            "full",
            "every option: softplus + dt_bias, dt_limit, D per channel, z, initial states, 3 sequences per row, 2 groups",
            full,
        ),
        case(
            "resets-d-per-head",
            "D per head, no z, seq_idx resets at every chunk start, initial states (reaching only the first run)",
            ProblemSpec {
                d: DSkip::PerHead,
                z: false,
                seq_idx: SeqIdx::AtChunkStarts { every: 1 },
                ..full
            },
        ),
        case(
            "clamp-both-ends",
            "dt_limit [0.05, 0.2] clamping many tokens at both ends (gradient 0 there), first seq_idx above 0 (initial state unused)",
            ProblemSpec {
                options: options(32, true, (0.05, 0.2)),
                seq_idx: SeqIdx::Segments {
                    segments: 2,
                    first: 1,
                },
                ..full
            },
        ),
    ]
}

/// The backward part of a case of [`Suite::Backward`]: upstream gradients `dout` and
/// `dfinal_states` drawn uniformly in `[-1, 1)` from the specs' stream
/// ([`ssd_reference::random::SpecRng`]) seeded with `seed`, then every gradient the problem's
/// inputs have, by the adjoint recurrence in float64 (`ssd-oracle grad`'s names).
pub fn backward_tensors(problem: &Problem<f64>, seed: u64) -> Vec<(&'static str, ArrayD<f64>)> {
    let (dout, dfinal) = upstream_gradients(problem.dims(), seed);
    let g = ssd_reference::adjoint::backward(problem, dout.view(), Some(dfinal.view()))
        .expect("upstream gradients of the problem's shapes");
    let mut v = vec![
        ("dout", dout.into_dyn()),
        ("dfinal_states", dfinal.into_dyn()),
    ];
    v.extend(g.named().into_iter().map(|(n, a)| (n, a.to_owned())));
    v
}

/// Upstream gradients drawn from `seed`: `dout` `[batch, seqlen, nheads, headdim]` and
/// `dfinal_states` `[batch, nheads, headdim, dstate]`, uniform in `[-1, 1)`.
pub fn upstream_gradients(d: &Dims, seed: u64) -> (Array4<f64>, Array4<f64>) {
    let mut rng = ssd_reference::random::SpecRng::new(seed);
    let mut draw = |shape: (usize, usize, usize, usize)| {
        let mut a = Array4::<f64>::zeros(shape);
        a.iter_mut().for_each(|v| *v = 2.0 * rng.unit() - 1.0);
        a
    };
    let dout = draw((d.batch, d.seqlen, d.nheads, d.headdim));
    let dfinal = draw((d.batch, d.nheads, d.headdim, d.dstate));
    (dout, dfinal)
}

fn smoke() -> Vec<CaseSpec> {
    vec![
        case(
            "plain",
            "one sequence per row, dt already activated, no optional tensor",
            ProblemSpec {
                options: options(16, false, NO_LIMIT),
                ..ProblemSpec::plain(Dims::new(1, 64, 2, 8, 1, 8))
            },
        ),
        case(
            "full",
            "every option: softplus + dt_bias, dt_limit, D per channel, z, initial states, 3 sequences per row, 2 groups",
            ProblemSpec::full(Dims::new(2, 100, 4, 8, 2, 8), 32),
        ),
        case(
            "mamba2-mini",
            "a Mamba-2 layer in miniature: softplus + dt_bias, D per head, z, initial states, ragged last chunk",
            ProblemSpec {
                d: DSkip::PerHead,
                seq_idx: SeqIdx::None,
                dt_range: (-4.0, 0.0),
                options: options(64, true, NO_LIMIT),
                ..ProblemSpec::full(Dims::new(1, 200, 4, 16, 1, 16), 64)
            },
        ),
    ]
}

fn edge() -> Vec<CaseSpec> {
    let small = Dims::new(2, 40, 4, 4, 2, 4);
    let full = |d: Dims, chunk: usize| ProblemSpec::full(d, chunk);
    let mut v = vec![
        case(
            "seqlen-1",
            "a single token (chunk 64 > seqlen), every option",
            ProblemSpec {
                seq_idx: SeqIdx::None,
                ..full(Dims::new(2, 1, 4, 4, 2, 4), 64)
            },
        ),
        case(
            "chunk-1",
            "chunk size 1: every token is a chunk",
            full(Dims::new(1, 13, 2, 4, 1, 4), 1),
        ),
        case(
            "chunk-gt-seqlen",
            "chunk 256 > seqlen 20: one partial chunk",
            full(Dims::new(1, 20, 2, 4, 2, 4), 256),
        ),
        case(
            "ragged",
            "seqlen 77 with chunk 16: a last chunk of 13 tokens; initial states, no seq_idx",
            ProblemSpec {
                initial_states: true,
                options: options(16, false, NO_LIMIT),
                ..ProblemSpec::plain(Dims::new(2, 77, 2, 4, 1, 4))
            },
        ),
        case(
            "seq-idx-chunk-starts",
            "seq_idx resets exactly at every chunk start, initial states, slow decay",
            ProblemSpec {
                seq_idx: SeqIdx::AtChunkStarts { every: 1 },
                a_range: (0.05, 0.5),
                ..full(Dims::new(2, 64, 4, 4, 2, 4), 16)
            },
        ),
        case(
            "seq-idx-first-above-0",
            "seq_idx starts at 2: the initial state seeds nothing (but is chunk_states[:, 0])",
            ProblemSpec {
                seq_idx: SeqIdx::Segments {
                    segments: 3,
                    first: 2,
                },
                ..full(small, 8)
            },
        ),
        case(
            "seq-idx-many",
            "5 sequences per row in 50 tokens, chunk 8",
            ProblemSpec {
                seq_idx: SeqIdx::Segments {
                    segments: 5,
                    first: 0,
                },
                ..full(Dims::new(2, 50, 2, 4, 1, 4), 8)
            },
        ),
        case(
            "d-per-head-z",
            "D per head with the z gate, no seq_idx",
            ProblemSpec {
                d: DSkip::PerHead,
                seq_idx: SeqIdx::None,
                ..full(small, 16)
            },
        ),
        case(
            "softplus-threshold",
            "dt + dt_bias from 14 to 25.5: softplus below the threshold 20, identity above",
            ProblemSpec {
                dt_range: (15.0, 25.0),
                a_range: (0.01, 0.05),
                seq_idx: SeqIdx::None,
                options: options(16, true, NO_LIMIT),
                ..full(small, 16)
            },
        ),
        case(
            "softplus-negative",
            "softplus of dt + dt_bias from -6 to 1.5 with the default dt_limit [0, inf)",
            ProblemSpec {
                dt_range: (-5.0, 1.0),
                seq_idx: SeqIdx::None,
                options: options(16, true, NO_LIMIT),
                ..full(small, 16)
            },
        ),
        case(
            "dt-limit-clamp",
            "dt_limit [0.01, 0.1] clamping raw dt from -0.2 to 0.4 at both ends (no softplus)",
            ProblemSpec {
                dt_range: (-0.2, 0.4),
                options: options(8, false, (0.01, 0.1)),
                ..full(small, 8)
            },
        ),
        case(
            "ngroups",
            "8 heads in 4 groups (2 heads per group)",
            ProblemSpec {
                seq_idx: SeqIdx::None,
                ..full(Dims::new(1, 48, 8, 4, 4, 4), 16)
            },
        ),
        case(
            "ngroups-3",
            "6 heads in 3 groups, no optional tensor",
            ProblemSpec {
                options: options(8, false, NO_LIMIT),
                ..ProblemSpec::plain(Dims::new(1, 30, 6, 3, 3, 5))
            },
        ),
        case(
            "extreme-decay",
            "|dt' A| up to 60 per token: decays underflow within a few tokens",
            ProblemSpec {
                a_range: (1.0, 30.0),
                dt_range: (0.5, 2.0),
                options: options(16, false, NO_LIMIT),
                ..full(small, 16)
            },
        ),
        case(
            "no-decay",
            "A = 0: the state only accumulates",
            ProblemSpec {
                a_range: (0.0, 0.0),
                ..full(small, 16)
            },
        ),
    ];
    v.push(CaseSpec {
        input_dtype: FloatDtype::BF16,
        ..case(
            "bf16-inputs",
            "x, B, C, z stored as BF16 (a reduced-precision case), the rest F32",
            full(small, 16),
        )
    });
    v.push(CaseSpec {
        input_dtype: FloatDtype::F64,
        ..case("f64-inputs", "every input stored as F64", full(small, 16))
    });
    v
}

fn standard() -> Vec<CaseSpec> {
    let layer = |d: Dims, chunk: usize| ProblemSpec {
        d: DSkip::PerHead,
        z: false,
        dt_bias: true,
        initial_states: true,
        seq_idx: SeqIdx::None,
        dt_range: (-4.0, 0.0),
        options: options(chunk, true, NO_LIMIT),
        ..ProblemSpec::plain(d)
    };
    vec![
        case(
            "layer-2x2048-h8-p64-n64",
            "batch 2, seqlen 2048, 8 heads of 64, dstate 64, 8 groups, chunk 64",
            layer(Dims::new(2, 2048, 8, 64, 8, 64), 64),
        ),
        case(
            "layer-1x4096-h24-p64-n128",
            "batch 1, seqlen 4096, 24 heads of 64, dstate 128, 1 group, chunk 256",
            layer(Dims::new(1, 4096, 24, 64, 1, 128), 256),
        ),
        case(
            "layer-2x1000-h16-p64-n128-full",
            "batch 2, seqlen 1000 (ragged), 16 heads of 64, dstate 128, 2 groups, chunk 128, every option",
            ProblemSpec::full(Dims::new(2, 1000, 16, 64, 2, 128), 128),
        ),
    ]
}

/// Every expected tensor a case carries, computed from its inputs: `out` and `final_states`
/// from the float64 naive recurrence, `dA_cumsum` and `chunk_states` from the chunked path in
/// f64, and the magnitudes `out_mag` and `final_states_mag` of the error bound.
pub fn expected_outputs(problem: &Problem<f64>) -> Expected {
    let ([out, final_states, da, chunk_states], mags) =
        rayon::join(|| reference_outputs(problem), || magnitudes(problem));
    let fixed4 = |a: ArrayD<f64>| a.into_dimensionality().expect("contract shape");
    Expected {
        out: Some(fixed4(out)),
        final_states: Some(fixed4(final_states)),
        dA_cumsum: Some(fixed4(da)),
        chunk_states: Some(chunk_states.into_dimensionality().expect("contract shape")),
        out_mag: Some(fixed4(mags.out.mag)),
        final_states_mag: Some(fixed4(mags.final_states.mag)),
        varlen_states: None,
        position_states: None,
    }
}

/// Draws case `spec` with `seed` and computes its expected outputs and magnitudes from the
/// inputs as they will be stored.
///
/// # Errors
/// [`VerifyError::Usage`] when the spec does not describe a valid problem or its values cannot
/// be stored in the case's input dtype.
pub fn build(spec: &CaseSpec, suite: Suite, seed: u64) -> Result<Case, VerifyError> {
    let drawn = random_problem(&spec.spec, seed)
        .map_err(|e| VerifyError::Usage(format!("case `{}`: {e}", spec.name)))?;
    let problem = round_inputs(&drawn, spec.input_dtype)?;
    // The states as the case stores them (like initial_states, in the inputs' dtype).
    let packing = spec
        .packing
        .as_ref()
        .map(|k| crate::fixture::round_packing(&draw_packing(k, &problem, seed), spec.input_dtype));
    let expected = match &packing {
        None => expected_outputs(&problem),
        Some(k) => packed_expected(&problem, k)?,
    };
    let mut extra = serde_json::Map::new();
    extra.insert("suite".into(), Value::from(suite.name()));
    let generator = "ssd-oracle gen (float64 naive recurrence; chunked path in f64 for dA_cumsum and chunk_states)";
    let generator = match suite {
        Suite::Backward => format!("{generator}; upstream gradients from the case's seed, gradients by the float64 adjoint recurrence"),
        _ => generator.to_string(),
    };
    extra.insert("generator".into(), Value::from(generator));
    Ok(Case {
        meta: CaseMeta {
            name: Some(spec.name.to_string()),
            seed: Some(seed),
            description: Some(spec.description.to_string()),
            extra,
        },
        problem: match &packing {
            Some(k) => k
                .with_seq_idx(&problem)
                .map_err(|e| VerifyError::Usage(format!("case `{}`: {e}", spec.name)))?,
            None => problem,
        },
        expected,
        packing,
    })
}

/// The packing of `k` for `p`, its states drawn from `seed` (uniform in `[-1, 1)`, rounded to
/// f16 for an f16 cache).
fn draw_packing(k: &PackingSpec, p: &Problem<f64>, seed: u64) -> Packing<f64> {
    let d = *p.dims();
    let mut cu = vec![0usize];
    for &l in &k.lens {
        cu.push(cu.last().expect("one") + l);
    }
    let mut packing = Packing::new(cu);
    let mut rng = ssd_reference::random::SpecRng::new(seed ^ 0x5e55_1045);
    if k.per_sequence_states {
        packing.seq_initial_states = Some(Array4::from_shape_fn(
            (k.lens.len(), d.nheads, d.headdim, d.dstate),
            |_| {
                let v = 2.0 * rng.unit() - 1.0;
                if k.f16_cache {
                    half::f16::from_f64(v).to_f64()
                } else {
                    v
                }
            },
        ));
        packing.seq_has_initial_state = k.mask.clone();
    }
    packing.state_positions = k
        .positions
        .clone()
        .unwrap_or_else(|| (0..d.seqlen).collect());
    packing
}

/// The expected outputs of a packed case ([`crate::tolerance::packed_reference`]) and its
/// magnitudes.
///
/// # Errors
/// [`VerifyError::Usage`] when the packing does not fit the problem.
pub fn packed_expected(problem: &Problem<f64>, k: &Packing<f64>) -> Result<Expected, VerifyError> {
    let ([out, final_states, da, chunk_states], [varlen, positions]) =
        crate::tolerance::packed_reference(problem, k)?;
    let ps = k
        .with_seq_idx(problem)
        .map_err(|e| VerifyError::Usage(e.to_string()))?;
    let mags = ssd_reference::magnitude::magnitudes_packed(&ps, k);
    let fixed4 = |a: ArrayD<f64>| a.into_dimensionality().expect("contract shape");
    Ok(Expected {
        out: Some(fixed4(out)),
        final_states: Some(fixed4(final_states)),
        dA_cumsum: Some(fixed4(da)),
        chunk_states: Some(chunk_states.into_dimensionality().expect("contract shape")),
        out_mag: Some(fixed4(mags.out.mag)),
        final_states_mag: Some(fixed4(mags.final_states.mag)),
        varlen_states: Some(fixed4(varlen)),
        position_states: (!k.state_positions.is_empty()).then(|| fixed4(positions)),
    })
}
