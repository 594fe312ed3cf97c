//! Failure diagnosis: where a failing candidate is wrong (the error map) and which stage of
//! the SSD that points to (the hints). [`crate::report`] runs it for every failing check;
//! [`crate::plot`] draws the map.
//!
//! # The error map
//!
//! For each failing tensor, every element's ratio `r = |candidate - reference| / bound`
//! ([`crate::tolerance::Oracle::ratios`]; infinite for NaN or infinity) is aggregated over the
//! bins of each axis the tensor has. A [`Profile`] holds, per bin, the largest `r`
//! (`max_ratio`), the number of elements with `r > 1` (`over`) and the number of elements
//! (`elements`). The axes, with `L` the chunk size and `t` a token:
//!
//! | profile | bins | tensors |
//! | --- | --- | --- |
//! | `position_in_chunk` | `t mod L` (for `dA_cumsum` the position `k`) | `out`, `dA_cumsum` |
//! | `chunk` | `floor(t / L)` (the chunk axis of the states) | all but `final_states` |
//! | `head`, `group` | head `h`; its group `h / (nheads / ngroups)` | all |
//! | `batch` | batch row | all |
//! | `sequence` | the packed sequences: each run of equal `seq_idx` in a row, numbered row by row (one per row without `seq_idx`) | `out` |
//! | `reset_at_chunk_start` | 0: other tokens; 1: tokens of a sequence that starts exactly at the first token of a chunk, so that the state carried into the chunk must be dropped (in chunk 0: a row whose `seq_idx` starts above 0, which the initial state does not continue) | `out` |
//! | `past_seqlen` | 0: positions before `seqlen`; 1: the padding of the last partial chunk | `dA_cumsum` |
//! | `channel`, `state` | `headdim` index, `dstate` index | `final_states`, `chunk_states` |
//!
//! For the picture, [`Heat`] holds the largest `r` over a grid of at most [`MAX_COLS`] x
//! [`MAX_ROWS`] cells: token (all batch rows one after the other; for `chunk_states` the chunk,
//! for `final_states` the state) by head (for `final_states` the channel), each cell the maximum
//! over the elements it covers, so that a 65k-token, 80-head case stays a few hundred cells wide.
//!
//! # Hints
//!
//! A [`Hint`] names a [`Stage`] only when a rule's condition holds; nothing is said otherwise.
//! `u` is the unit roundoff of the precision checked; "equals the hypothesis" means every
//! element within the slack given, the same test as the check itself with the hypothesis in
//! place of the reference, and the hypothesis differs from the reference by more than the
//! bound somewhere (else it is no mistake on this case).
//! The rules, in order (the first that fires gives the hint):
//!
//! 1. `dA_cumsum` fails only at `past_seqlen` positions: the last partial chunk (sure).
//!    `dA_cumsum` fails before `seqlen`: dt processing; sure when the candidate's `dA_cumsum`
//!    is, within its bound, the cumsum of `dt'` computed with one usual mistake (no
//!    `dt_bias`, no `dt_limit` clamp, softplus dropped or added, softplus's threshold at 0
//!    instead of 20), likely otherwise.
//!    When `dA_cumsum` does not show it (absent, or `A = 0`) and the case is small
//!    ([`RECOMPUTE_LIMIT`]): sure when every output passes the check against the reference
//!    (and bounds) of the problem with one of those mistakes, whose reference fails the check
//!    against the true one.
//! 2. With `1 < ngroups < nheads`: the heads over the bound (in any tensor) are among those
//!    whose group `h mod ngroups` differs from `h / (nheads / ngroups)`: the head-to-group
//!    mapping (sure when they are all of them).
//! 3. `chunk_states` fails at chunk 0: the initial state (sure).
//! 4. `chunk_states` fails from chunk 1 on, or `final_states` fails: sure "state passing" when
//!    both (those present) equal, within their bound plus `2 (nchunks + L + 2) u M` (`M` the sum
//!    of the absolute values of the hypothesis' terms),
//!    the passing `S_{c+1} = S_c + states_c` without the decay; sure "chunk states" when they
//!    equal those with `states_c` decayed from the wrong end (`exp(cs_j)` instead of
//!    `exp(cs_last - cs_j)`); sure "initial state" when they equal those passed from a zero
//!    initial state; sure "last partial chunk" when they equal those with the last, partial
//!    chunk decayed as if the cumsum past `seqlen` were 0; otherwise likely "chunk states"
//!    (`states_c`, or the passing).
//! 5. `out` equals, within its bound plus `8 u |hypothesis|` at every element, the reference with
//!    one epilogue or mask mistake: the gate `y sigmoid(z)` (reference `/ z`, the bound over
//!    `|z|` where `|z| < 1`, elements with `|z| <= 1e-6` not tested), `D x` added
//!    after the gate (reference `+ D x (1 - z sigmoid(z))`), the diagonal of the causal mask
//!    dropped (reference `- (C_t . B_t) dt'_t x_t`, gated): sure.
//!    Also (small cases, as in 1): `out` passes the check against the reference with the
//!    initial state carried into the first sequence of the rows whose `seq_idx` starts above
//!    0: the `seq_idx` reset (sure); `out` passes the check against the reference without the
//!    initial state: the initial state (sure).
//! 6. `out` fails only at `reset_at_chunk_start` tokens (and other tokens exist): the `seq_idx`
//!    reset of the carried state (sure).
//! 7. From `out`'s map alone: chunk 0 passes and every later chunk fails: the state carried
//!    between chunks (likely); only the last, partial chunk fails: the seqlen tail (likely).
//!
//! A hint's [`Basis`] is `explained` for the hypotheses of rules 1, 4 and 5 (and for the
//! precision hint of [`crate::report`]), `pattern` for the others. When every element is within
//! the TF32 bound, the report puts an explained hint first, then the precision hint, and drops
//! pattern hints.
//!
//! A correct candidate passes, so it has no map and no hint; the calibration asserts this over
//! its 10,000 cases (`docs/tolerances.md`).

use std::collections::BTreeMap;
use std::fmt;

use ndarray::ArrayD;
use rayon::prelude::*;
use serde::Serialize;
use ssd_reference::chunk_cumsum::chunk_cumsum;
use ssd_reference::problem::softplus;
use ssd_reference::Problem;

use crate::error::VerifyError;
use crate::fixture::Dtype;
use crate::tolerance::{Oracle, OutputName, Precision, Verdict};

/// Largest number of columns of a [`Heat`].
pub const MAX_COLS: usize = 400;
/// Largest number of rows of a [`Heat`].
pub const MAX_ROWS: usize = 96;

/// One axis of the map: per bin, the largest ratio, the count over the bound, the count.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Profile {
    /// Largest error/bound ratio in the bin (`null` in JSON when infinite).
    pub max_ratio: Vec<f64>,
    /// Elements over their bound (non-finite ones included).
    pub over: Vec<usize>,
    /// Elements in the bin.
    pub elements: Vec<usize>,
}

impl Profile {
    fn new(n: usize) -> Self {
        Profile {
            max_ratio: vec![0.0; n],
            over: vec![0; n],
            elements: vec![0; n],
        }
    }

    #[inline]
    fn add(&mut self, bin: usize, max: f64, over: usize, n: usize) {
        if max > self.max_ratio[bin] {
            self.max_ratio[bin] = max;
        }
        self.over[bin] += over;
        self.elements[bin] += n;
    }

    /// The bins with an element over the bound.
    pub fn failing(&self) -> Vec<usize> {
        (0..self.over.len()).filter(|&i| self.over[i] > 0).collect()
    }
}

/// The grid of the picture: the largest ratio per cell (see the module documentation).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Heat {
    /// What the columns count: `"token"`, `"chunk"` or `"state"`.
    pub x_axis: &'static str,
    /// What the rows count: `"head"` or `"channel"`.
    pub y_axis: &'static str,
    /// Extent in units (tokens of all rows, heads, ...).
    pub x_len: usize,
    pub y_len: usize,
    /// Units per cell.
    pub x_bin: usize,
    pub y_bin: usize,
    pub cols: usize,
    pub rows: usize,
    /// `rows * cols` largest ratios, row-major.
    pub values: Vec<f64>,
    /// Chunk boundaries, in x units.
    pub chunk_marks: Vec<usize>,
    /// Sequence starts (`seq_idx` changes and batch rows), in x units.
    pub seq_marks: Vec<usize>,
    /// Where the padding past `seqlen` begins in each row (`dA_cumsum`), in x units.
    pub pad_marks: Vec<usize>,
}

impl Heat {
    fn new(x_axis: &'static str, y_axis: &'static str, x_len: usize, y_len: usize) -> Self {
        let x_bin = x_len.div_ceil(MAX_COLS).max(1);
        let y_bin = y_len.div_ceil(MAX_ROWS).max(1);
        let cols = x_len.div_ceil(x_bin);
        let rows = y_len.div_ceil(y_bin);
        Heat {
            x_axis,
            y_axis,
            x_len,
            y_len,
            x_bin,
            y_bin,
            cols,
            rows,
            values: vec![0.0; rows * cols],
            ..Heat::default()
        }
    }

    #[inline]
    fn add(&mut self, x: usize, y: usize, r: f64) {
        let i = (y / self.y_bin) * self.cols + x / self.x_bin;
        if r > self.values[i] {
            self.values[i] = r;
        }
    }
}

/// The map of one failing tensor.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TensorMap {
    pub tensor: OutputName,
    /// Elements over their bound.
    pub over: usize,
    pub elements: usize,
    /// The profiles, by axis name (see the module documentation).
    pub by: BTreeMap<String, Profile>,
    /// The grid of the picture (not in the JSON: its size grows with the case).
    #[serde(skip)]
    pub heat: Heat,
}

/// The stage of the SSD forward a hint points to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// The arithmetic, not the algorithm (a TF32 kernel checked at f32).
    Precision,
    /// `dt' = clamp(softplus(dt + dt_bias))` or its cumsum (`chunk_cumsum`).
    DtProcessing,
    /// The padding of the last partial chunk (the seqlen tail).
    LastPartialChunk,
    /// Which group of `B`, `C` a head reads.
    GroupMapping,
    /// `initial_states`.
    InitialState,
    /// The per-chunk states `states_c` (`chunk_state`).
    ChunkState,
    /// The state carried from chunk to chunk (`state_passing`).
    StatePassing,
    /// The reset of the carried state where `seq_idx` changes.
    SeqIdxReset,
    /// The causal mask of the within-chunk sum (`chunk_scan`).
    CausalMask,
    /// The output epilogue: the `D` skip and the `z` gate.
    Epilogue,
}

impl Stage {
    /// A few words for the report.
    pub fn describe(self) -> &'static str {
        match self {
            Stage::Precision => "precision",
            Stage::DtProcessing => "dt processing",
            Stage::LastPartialChunk => "last partial chunk",
            Stage::GroupMapping => "head-to-group mapping",
            Stage::InitialState => "initial state",
            Stage::ChunkState => "chunk states",
            Stage::StatePassing => "state passing",
            Stage::SeqIdxReset => "seq_idx reset",
            Stage::CausalMask => "causal mask",
            Stage::Epilogue => "D skip / z gate",
        }
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.describe())
    }
}

/// How sure a hint is: `sure` when the observed values are explained (or the pattern allows
/// one cause only), `likely` when the pattern points to the stage without proving it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Confidence {
    Sure,
    Likely,
}

impl fmt::Display for Confidence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Confidence::Sure => "sure",
            Confidence::Likely => "likely",
        })
    }
}

/// What a hint rests on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Basis {
    /// The candidate equals, within its bound, the reference with that one mistake (or, for
    /// the precision, the reference at another precision's bound).
    Explained,
    /// The map's pattern (where the elements over the bound are).
    Pattern,
}

/// A likely explanation of a failure.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Hint {
    pub stage: Stage,
    pub confidence: Confidence,
    pub basis: Basis,
    /// What was seen and what it points to.
    pub text: String,
}

impl Hint {
    /// A hint from the map's pattern.
    pub(crate) fn new(stage: Stage, confidence: Confidence, text: impl Into<String>) -> Self {
        Hint {
            stage,
            confidence,
            basis: Basis::Pattern,
            text: text.into(),
        }
    }

    /// A sure hint: the candidate is explained by the mistake it names.
    pub(crate) fn explained(stage: Stage, text: impl Into<String>) -> Self {
        Hint {
            stage,
            confidence: Confidence::Sure,
            basis: Basis::Explained,
            text: text.into(),
        }
    }
}

/// The maps of the failing tensors and the hints drawn from them.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Diagnosis {
    pub maps: Vec<TensorMap>,
    pub hints: Vec<Hint>,
}

/// Maps every failing tensor of `verdict` and draws the hints (rules 1-7 of the module
/// documentation).
///
/// # Errors
/// [`VerifyError::Usage`] when a tensor's shape differs from the reference's.
pub fn diagnose(
    problem: &Problem<f64>,
    oracle: &Oracle,
    present: &[(OutputName, &ArrayD<f64>, Dtype)],
    precision: Precision,
    verdict: &Verdict,
) -> Result<Diagnosis, VerifyError> {
    let mut maps = Vec::new();
    for (name, t, dtype) in present {
        // The maps and hints are the forward's stages; a failing gradient is reported by its
        // worst element.
        if name.is_gradient()
            || name.is_packed()
            || verdict.tensor(*name).is_none_or(|r| r.passed())
        {
            continue;
        }
        let r = oracle.ratios(*name, t, *dtype, precision)?;
        maps.push(error_map(problem, *name, &r));
    }
    let hints = if maps.is_empty() {
        Vec::new()
    } else {
        hints(problem, oracle, present, precision, &maps)
    };
    Ok(Diagnosis { maps, hints })
}

/// The map of one tensor from its ratios (any ratios of the tensor's shape).
///
/// # Panics
/// If `ratios` does not have the contract's shape of `name` for `problem`, or `name` is a
/// gradient (the maps are of the forward's outputs).
pub fn error_map(problem: &Problem<f64>, name: OutputName, ratios: &ArrayD<f64>) -> TensorMap {
    let r = ratios.as_standard_layout();
    let r = r.as_slice().expect("standard layout");
    match name {
        OutputName::Out => map_out(problem, r),
        OutputName::DACumsum => map_da(problem, r),
        OutputName::ChunkStates => map_chunk_states(problem, r),
        OutputName::FinalStates => map_final_states(problem, r),
        g => panic!("no error map for the gradient `{g}`"),
    }
}

/// The largest value and the count over 1 of a run of ratios.
#[inline]
fn run_stats(run: &[f64]) -> (f64, usize) {
    run.iter().fold((0.0_f64, 0usize), |(m, o), &v| {
        (if v > m { v } else { m }, o + usize::from(v > 1.0))
    })
}

struct Sequences {
    /// Sequence number of each `(b, t)`, row-major.
    id: Vec<usize>,
    count: usize,
    /// Tokens (over all rows, `b * seqlen + t`) where a sequence starts, row starts included.
    starts: Vec<usize>,
    /// Per `(b, t)`: the token belongs to a sequence that starts exactly at its chunk's first
    /// token (for chunk 0: a first `seq_idx` above 0, which the initial state does not
    /// continue).
    reset_at_chunk_start: Vec<bool>,
}

fn sequences(p: &Problem<f64>) -> Sequences {
    let d = p.dims();
    let l = p.options().chunk_size;
    let (bn, tn) = (d.batch, d.seqlen);
    let mut id = vec![0; bn * tn];
    let mut starts = Vec::new();
    let mut reset = vec![false; bn * tn];
    let mut count = 0;
    for b in 0..bn {
        for t in 0..tn {
            if t == 0 || p.seq_idx_at(b, t) != p.seq_idx_at(b, t - 1) {
                count += 1;
                starts.push(b * tn + t);
            }
            id[b * tn + t] = count - 1;
            // The carried state belongs to the sequence of the token before the chunk (to
            // sequence 0 before the first chunk: the initial state's).
            let t0 = t - t % l;
            let before = if t0 == 0 { 0 } else { p.seq_idx_at(b, t0 - 1) };
            reset[b * tn + t] =
                p.seq_idx_at(b, t0) != before && p.seq_idx_at(b, t) == p.seq_idx_at(b, t0);
        }
    }
    Sequences {
        id,
        count,
        starts,
        reset_at_chunk_start: reset,
    }
}

fn profiles(names: &[(&str, usize)]) -> BTreeMap<String, Profile> {
    names
        .iter()
        .map(|(n, k)| ((*n).to_string(), Profile::new(*k)))
        .collect()
}

fn finish(
    tensor: OutputName,
    by: BTreeMap<String, Profile>,
    heat: Heat,
    ratios: &[f64],
) -> TensorMap {
    let (_, over) = run_stats(ratios);
    TensorMap {
        tensor,
        over,
        elements: ratios.len(),
        by,
        heat,
    }
}

fn map_out(p: &Problem<f64>, r: &[f64]) -> TensorMap {
    let d = *p.dims();
    let l = p.options().chunk_size;
    let nc = p.nchunks();
    let seqs = sequences(p);
    let mut by = profiles(&[
        ("position_in_chunk", l.min(d.seqlen)),
        ("chunk", nc),
        ("head", d.nheads),
        ("group", d.ngroups),
        ("batch", d.batch),
        ("sequence", seqs.count),
        ("reset_at_chunk_start", 2),
    ]);
    let mut heat = Heat::new("token", "head", d.batch * d.seqlen, d.nheads);
    heat.chunk_marks = (0..d.batch)
        .flat_map(|b| (1..nc).map(move |c| b * d.seqlen + c * l))
        .collect();
    heat.seq_marks = seqs.starts.iter().copied().filter(|&s| s > 0).collect();
    let mut get = |k: &str| by.remove(k).expect("made above");
    let (mut pos, mut chunk, mut head, mut group) = (
        get("position_in_chunk"),
        get("chunk"),
        get("head"),
        get("group"),
    );
    let (mut batch, mut seq, mut reset) =
        (get("batch"), get("sequence"), get("reset_at_chunk_start"));
    let hd = d.headdim;
    for b in 0..d.batch {
        for t in 0..d.seqlen {
            let bt = b * d.seqlen + t;
            for h in 0..d.nheads {
                let start = (bt * d.nheads + h) * hd;
                let (m, o) = run_stats(&r[start..start + hd]);
                pos.add(t % l, m, o, hd);
                chunk.add(t / l, m, o, hd);
                head.add(h, m, o, hd);
                group.add(d.group_of_head(h), m, o, hd);
                batch.add(b, m, o, hd);
                seq.add(seqs.id[bt], m, o, hd);
                reset.add(usize::from(seqs.reset_at_chunk_start[bt]), m, o, hd);
                heat.add(bt, h, m);
            }
        }
    }
    for (k, v) in [
        ("position_in_chunk", pos),
        ("chunk", chunk),
        ("head", head),
        ("group", group),
        ("batch", batch),
        ("sequence", seq),
        ("reset_at_chunk_start", reset),
    ] {
        by.insert(k.to_string(), v);
    }
    finish(OutputName::Out, by, heat, r)
}

fn map_da(p: &Problem<f64>, r: &[f64]) -> TensorMap {
    let d = *p.dims();
    let l = p.options().chunk_size;
    let nc = p.nchunks();
    let row = nc * l;
    let mut pos = Profile::new(l);
    let mut chunk = Profile::new(nc);
    let mut head = Profile::new(d.nheads);
    let mut group = Profile::new(d.ngroups);
    let mut batch = Profile::new(d.batch);
    let mut past = Profile::new(2);
    let mut heat = Heat::new("token", "head", d.batch * row, d.nheads);
    heat.chunk_marks = (0..d.batch)
        .flat_map(|b| (1..nc).map(move |c| b * row + c * l))
        .collect();
    heat.seq_marks = (1..d.batch).map(|b| b * row).collect();
    heat.pad_marks = (0..d.batch)
        .filter(|_| row > d.seqlen)
        .map(|b| b * row + d.seqlen)
        .collect();
    for b in 0..d.batch {
        for h in 0..d.nheads {
            for c in 0..nc {
                for k in 0..l {
                    let v = r[((b * d.nheads + h) * nc + c) * l + k];
                    let (m, o) = (v, usize::from(v > 1.0));
                    pos.add(k, m, o, 1);
                    chunk.add(c, m, o, 1);
                    head.add(h, m, o, 1);
                    group.add(d.group_of_head(h), m, o, 1);
                    batch.add(b, m, o, 1);
                    past.add(usize::from(c * l + k >= d.seqlen), m, o, 1);
                    heat.add(b * row + c * l + k, h, m);
                }
            }
        }
    }
    let by = [
        ("position_in_chunk", pos),
        ("chunk", chunk),
        ("head", head),
        ("group", group),
        ("batch", batch),
        ("past_seqlen", past),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    finish(OutputName::DACumsum, by, heat, r)
}

fn map_chunk_states(p: &Problem<f64>, r: &[f64]) -> TensorMap {
    let d = *p.dims();
    let nc = p.nchunks();
    let (hd, ds) = (d.headdim, d.dstate);
    let mut chunk = Profile::new(nc);
    let mut head = Profile::new(d.nheads);
    let mut group = Profile::new(d.ngroups);
    let mut batch = Profile::new(d.batch);
    let mut channel = Profile::new(hd);
    let mut state = Profile::new(ds);
    let mut heat = Heat::new("chunk", "head", d.batch * nc, d.nheads);
    heat.seq_marks = (1..d.batch).map(|b| b * nc).collect();
    for b in 0..d.batch {
        for c in 0..nc {
            for h in 0..d.nheads {
                let base = ((b * nc + c) * d.nheads + h) * hd * ds;
                for pp in 0..hd {
                    let run = &r[base + pp * ds..base + (pp + 1) * ds];
                    let (m, o) = run_stats(run);
                    chunk.add(c, m, o, ds);
                    head.add(h, m, o, ds);
                    group.add(d.group_of_head(h), m, o, ds);
                    batch.add(b, m, o, ds);
                    channel.add(pp, m, o, ds);
                    for (n, &v) in run.iter().enumerate() {
                        state.add(n, v, usize::from(v > 1.0), 1);
                    }
                    heat.add(b * nc + c, h, m);
                }
            }
        }
    }
    let by = [
        ("chunk", chunk),
        ("head", head),
        ("group", group),
        ("batch", batch),
        ("channel", channel),
        ("state", state),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    finish(OutputName::ChunkStates, by, heat, r)
}

fn map_final_states(p: &Problem<f64>, r: &[f64]) -> TensorMap {
    let d = *p.dims();
    let (hd, ds) = (d.headdim, d.dstate);
    let mut head = Profile::new(d.nheads);
    let mut group = Profile::new(d.ngroups);
    let mut batch = Profile::new(d.batch);
    let mut channel = Profile::new(hd);
    let mut state = Profile::new(ds);
    let mut heat = Heat::new("state", "channel", ds, hd);
    for b in 0..d.batch {
        for h in 0..d.nheads {
            for pp in 0..hd {
                let base = ((b * d.nheads + h) * hd + pp) * ds;
                let run = &r[base..base + ds];
                let (m, o) = run_stats(run);
                head.add(h, m, o, ds);
                group.add(d.group_of_head(h), m, o, ds);
                batch.add(b, m, o, ds);
                channel.add(pp, m, o, ds);
                for (n, &v) in run.iter().enumerate() {
                    state.add(n, v, usize::from(v > 1.0), 1);
                    heat.add(n, pp, v);
                }
            }
        }
    }
    let by = [
        ("head", head),
        ("group", group),
        ("batch", batch),
        ("channel", channel),
        ("state", state),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    finish(OutputName::FinalStates, by, heat, r)
}

/// `0, 2-5, 9` for a sorted list.
pub fn ranges(v: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            v[i].to_string()
        } else {
            format!("{}-{}", v[i], v[j])
        });
        i = j + 1;
    }
    if parts.len() > 8 {
        let n = parts.len();
        parts.truncate(6);
        parts.push(format!("... ({n} runs)"));
    }
    parts.join(", ")
}

/// A candidate tensor, its bounds and its reference, row-major.
struct Tensor {
    cand: Vec<f64>,
    bounds: Vec<f64>,
    reference: Vec<f64>,
}

/// Whether a hypothesis explains a candidate tensor: every tested element of the candidate is
/// within `scale * bound + slack * |hyp|` of the hypothesis `(hyp, scale)` (elements where it
/// is `None` are skipped: it says nothing there; `scale` carries the bound over to a
/// hypothesis that divides the reference), at least one element is tested, and (`distinct`)
/// whether the hypothesis differs from the reference by more than the bound somewhere: a
/// hypothesis that does not is no mistake on this case and explains nothing.
fn explains(t: &Tensor, slack: f64, hyp: impl Fn(usize) -> Option<(f64, f64)>) -> (bool, bool) {
    explains_abs(t, slack, |_| 0.0, hyp)
}

/// [`explains`] with an absolute slack `abs(i)` added to element `i`'s.
fn explains_abs(
    t: &Tensor,
    slack: f64,
    abs: impl Fn(usize) -> f64,
    hyp: impl Fn(usize) -> Option<(f64, f64)>,
) -> (bool, bool) {
    let mut tested = 0usize;
    let mut distinct = false;
    for (i, ((&c, &b), &r)) in t.cand.iter().zip(&t.bounds).zip(&t.reference).enumerate() {
        let Some((h, scale)) = hyp(i) else { continue };
        tested += 1;
        if !c.is_finite() || !h.is_finite() || (c - h).abs() > scale * b + slack * h.abs() + abs(i)
        {
            return (false, false);
        }
        distinct |= (h - r).abs() > scale * b;
    }
    (tested > 0, distinct)
}

/// A hypothesis explains the tensor and is a mistake on this case.
fn explained(t: &Tensor, slack: f64, hyp: impl Fn(usize) -> Option<(f64, f64)>) -> bool {
    explains(t, slack, hyp) == (true, true)
}

fn hints(
    p: &Problem<f64>,
    oracle: &Oracle,
    present: &[(OutputName, &ArrayD<f64>, Dtype)],
    precision: Precision,
    maps: &[TensorMap],
) -> Vec<Hint> {
    let map = |n: OutputName| maps.iter().find(|m| m.tensor == n);
    let flat = |a: &ArrayD<f64>| a.as_standard_layout().iter().copied().collect::<Vec<f64>>();
    let cand = |n: OutputName| {
        present
            .iter()
            .find(|(m, _, _)| *m == n)
            .map(|(_, t, dt)| Tensor {
                cand: flat(t),
                bounds: flat(&oracle.bounds(n, precision, *dt)),
                reference: flat(oracle.reference(n)),
            })
    };
    let u = precision.unit_roundoff();
    let d = *p.dims();

    // 1. dA_cumsum.
    if let Some(m) = map(OutputName::DACumsum) {
        let past = &m.by["past_seqlen"];
        if past.over[0] == 0 && past.over[1] > 0 {
            let l = p.options().chunk_size;
            let first = d.seqlen % l;
            return vec![Hint::new(
                Stage::LastPartialChunk,
                Confidence::Sure,
                format!(
                    "dA_cumsum is wrong only past seqlen, at positions >= {first} of the last chunk: the padding of the last partial chunk is not handled (the cumsum must stay flat there, dt' = 0), so the decay to the chunk's end is wrong"
                ),
            )];
        }
        if let Some(t) = cand(OutputName::DACumsum) {
            for (what, f) in dt_variants(p) {
                let cs = variant_cumsum(p, &f);
                if explained(&t, 8.0 * u, |i| Some((cs[i], 1.0))) {
                    return vec![Hint::explained(
                        Stage::DtProcessing,
                        format!("dA_cumsum is the cumsum of dt' computed {what}: the dt processing (dt' = clamp(softplus(dt + dt_bias), dt_limit))"),
                    )];
                }
            }
        }
        let heads = m.by["head"].failing();
        return vec![Hint::new(
            Stage::DtProcessing,
            Confidence::Likely,
            format!(
                "dA_cumsum is wrong before seqlen ({} of {} elements, heads {}): dt' (dt_bias, softplus, dt_limit) or its cumsum within the chunk",
                m.over,
                m.elements,
                ranges(&heads)
            ),
        )];
    }

    // 1b. dt mistakes that dA_cumsum does not show (A = 0, or no dA_cumsum): recompute.
    if d.batch * d.seqlen * d.nheads * d.headdim * d.dstate <= RECOMPUTE_LIMIT {
        for (what, f) in dt_variants(p) {
            let Some(pv) = variant_problem(p, &f) else {
                continue;
            };
            if variant_explains(&pv, oracle, present, precision) {
                return vec![Hint::explained(
                    Stage::DtProcessing,
                    format!("every output equals the reference with dt' computed {what}: the dt processing (dt' = clamp(softplus(dt + dt_bias), dt_limit))"),
                )];
            }
        }
    }

    // 2. The head-to-group mapping.
    if d.ngroups > 1 && d.ngroups < d.nheads {
        let mut failing = vec![false; d.nheads];
        for m in maps {
            if let Some(h) = m.by.get("head") {
                for i in h.failing() {
                    failing[i] = true;
                }
            }
        }
        let modulo: Vec<bool> = (0..d.nheads)
            .map(|h| h % d.ngroups != d.group_of_head(h))
            .collect();
        let any = failing.iter().any(|&f| f);
        let inside = failing.iter().zip(&modulo).all(|(&f, &m)| !f || m);
        if any && inside {
            let all = failing == modulo;
            let list: Vec<usize> = (0..d.nheads).filter(|&h| failing[h]).collect();
            return vec![Hint::new(
                Stage::GroupMapping,
                if all { Confidence::Sure } else { Confidence::Likely },
                format!(
                    "only heads {} fail, {} whose group h % ngroups differs from h / (nheads / ngroups) = h / {}: the head-to-group mapping of B and C",
                    ranges(&list),
                    if all { "exactly the heads" } else { "among the heads" },
                    d.heads_per_group()
                ),
            )];
        }
    }

    // 3-4. The states.
    let states = map(OutputName::ChunkStates);
    if let Some(m) = states {
        let chunks = &m.by["chunk"];
        if chunks.over[0] > 0 {
            return vec![Hint::new(
                Stage::InitialState,
                Confidence::Sure,
                format!(
                    "chunk_states is wrong at chunk 0, the state entering the sequence (max ratio {:.3e}): initial_states is not loaded (or not the one given)",
                    chunks.max_ratio[0]
                ),
            )];
        }
    }
    if states.is_some() || map(OutputName::FinalStates).is_some() {
        let failing = states.map(|m| m.by["chunk"].failing());
        let seen = match &failing {
            Some(f) if !f.is_empty() => format!(
                "chunk 0 of chunk_states passes and chunks {} fail",
                ranges(f)
            ),
            Some(_) => "final_states fails while the states entering the chunks pass".to_string(),
            None => "final_states fails (chunk_states not given)".to_string(),
        };
        let slack = 2.0 * (p.nchunks() + p.options().chunk_size + 2) as f64 * u;
        for (mistake, stage, what) in [
            (
                StateMistake::NoDecay,
                Stage::StatePassing,
                "the states equal S_(c+1) = S_c + states_c: the state passing does not decay the carried state by exp(dA_cumsum at the chunk's end)",
            ),
            (
                StateMistake::DecayWrongEnd,
                Stage::ChunkState,
                "the states equal those with states_c decayed by exp(cs_j) (chunk start to j) instead of exp(cs_last - cs_j) (j to the chunk's end): the per-chunk states (chunk_state)",
            ),
            (
                StateMistake::InitialDropped,
                Stage::InitialState,
                "the states equal those passed from a zero initial state: initial_states is not loaded",
            ),
            (
                StateMistake::PaddedEnd,
                Stage::LastPartialChunk,
                "the states equal those with the last, partial chunk decayed as if the cumsum past seqlen were 0: the padding of the last partial chunk is not handled (the cumsum must stay flat there)",
            ),
        ] {
            if mistake == StateMistake::InitialDropped && p.inputs().initial_states.is_none() {
                continue;
            }
            if mistake == StateMistake::PaddedEnd && d.seqlen.is_multiple_of(p.options().chunk_size)
            {
                continue;
            }
            let hyp = states_with(p, mistake);
            let tested: Vec<(bool, bool)> = [
                (
                    OutputName::ChunkStates,
                    hyp.chunk_states.into_dyn(),
                    hyp.chunk_states_mag.into_dyn(),
                ),
                (
                    OutputName::FinalStates,
                    hyp.final_states.into_dyn(),
                    hyp.final_states_mag.into_dyn(),
                ),
            ]
            .into_iter()
            .filter_map(|(n, h, m)| {
                let t = cand(n)?;
                let h = h.as_slice().expect("fresh array");
                let m = m.as_slice().expect("fresh array");
                // Rounding grows with the terms summed, not with the sum.
                Some(explains_abs(
                    &t,
                    0.0,
                    |i| slack * m[i],
                    |i| Some((h[i], 1.0)),
                ))
            })
            .collect();
            if !tested.is_empty() && tested.iter().all(|r| r.0) && tested.iter().any(|r| r.1) {
                return vec![Hint::explained(stage, format!("{seen}; {what}"))];
            }
        }
        return vec![Hint::new(
            Stage::ChunkState,
            Confidence::Likely,
            format!(
                "{seen}, and neither a missing decay in the passing, a decay from the wrong end nor a dropped initial state explains it: the per-chunk states states_c = x^T diag(exp(cs_last - cs) dt') B (the chunk_state stage), or the passing"
            ),
        )];
    }

    let Some(m) = map(OutputName::Out) else {
        return Vec::new();
    };
    // 5. Explained by an epilogue or mask mistake.
    if let Some(t) = cand(OutputName::Out) {
        for (stage, what, hyp) in out_hypotheses(p, &t.reference) {
            if explained(&t, 8.0 * u, hyp) {
                return vec![Hint::explained(stage, what)];
            }
        }
    }
    // 5b. The initial state carried into a row whose seq_idx starts above 0.
    if d.batch * d.seqlen * d.nheads * d.headdim * d.dstate <= RECOMPUTE_LIMIT {
        if let Some(pv) = seq_from_zero_problem(p) {
            // The states passed the rules above: the mistake is in out's carried term.
            let out: Vec<_> = present
                .iter()
                .filter(|(n, _, _)| *n == OutputName::Out)
                .cloned()
                .collect();
            if variant_explains(&pv, oracle, &out, precision) {
                return vec![Hint::explained(
                    Stage::SeqIdxReset,
                    "out equals the reference with the initial state carried into the first sequence of rows whose seq_idx starts above 0: the carried state is not reset where seq_idx differs from the initial state's sequence (0)",
                )];
            }
        }
    }
    // 5c. out without the initial state (when the final state forgot it, rule 4 says so).
    if d.batch * d.seqlen * d.nheads * d.headdim * d.dstate <= RECOMPUTE_LIMIT
        && p.inputs().initial_states.is_some()
    {
        let mut inputs = p.inputs().clone();
        inputs.initial_states = None;
        if let Ok(pv) = Problem::new(d, *p.options(), inputs) {
            let out: Vec<_> = present
                .iter()
                .filter(|(n, _, _)| *n == OutputName::Out)
                .cloned()
                .collect();
            if variant_explains(&pv, oracle, &out, precision) {
                return vec![Hint::explained(
                    Stage::InitialState,
                    "out equals the reference without the initial state: initial_states is not loaded (or not carried into the first chunk)",
                )];
            }
        }
    }
    // 6. seq_idx resets at chunk starts.
    let reset = &m.by["reset_at_chunk_start"];
    if reset.elements[0] > 0 && reset.over[0] == 0 && reset.over[1] > 0 {
        return vec![Hint::new(
            Stage::SeqIdxReset,
            Confidence::Sure,
            "out is wrong only in sequences that start exactly at a chunk's first token (seq_idx changes at the chunk boundary): the state carried into the chunk is not reset there",
        )];
    }
    // 7. The map alone.
    let chunks = &m.by["chunk"];
    let nc = chunks.over.len();
    if nc >= 2 && chunks.over[0] == 0 && chunks.over[1..].iter().all(|&o| o > 0) {
        return vec![Hint::new(
            Stage::StatePassing,
            Confidence::Likely,
            "chunk 0 of out passes and every later chunk fails: the state carried between chunks (chunk_state or state_passing)",
        )];
    }
    let l = p.options().chunk_size;
    if nc >= 2 && !d.seqlen.is_multiple_of(l) && chunks.failing() == vec![nc - 1] {
        return vec![Hint::new(
            Stage::LastPartialChunk,
            Confidence::Likely,
            "only the last chunk, which is partial, fails: the seqlen tail is not masked",
        )];
    }
    Vec::new()
}

/// `dt'` from `(dt, dt_bias)` with one usual mistake.
type DtFn = Box<dyn Fn(f64, f64) -> f64 + Sync>;

/// The usual dt mistakes that apply to the problem's options, with their descriptions.
fn dt_variants(p: &Problem<f64>) -> Vec<(&'static str, DtFn)> {
    let o = *p.options();
    let i = p.inputs();
    let (lo, hi) = o.dt_limit;
    let clamp = move |v: f64| v.max(lo).min(hi);
    let sp = o.dt_softplus;
    let mut v: Vec<(&'static str, DtFn)> = Vec::new();
    if i.dt_bias.is_some() {
        v.push((
            "without dt_bias",
            Box::new(move |dt, _| clamp(if sp { softplus(dt) } else { dt })),
        ));
    }
    if o.dt_limit != (0.0, f64::INFINITY) || !sp {
        v.push((
            "without the dt_limit clamp",
            Box::new(move |dt, bias| if sp { softplus(dt + bias) } else { dt + bias }),
        ));
    }
    if sp {
        v.push((
            "without softplus",
            Box::new(move |dt, bias| clamp(dt + bias)),
        ));
        v.push((
            "with softplus's threshold at 0 instead of 20",
            Box::new(move |dt, bias| {
                let x = dt + bias;
                clamp(if x > 0.0 { x } else { x.exp().ln_1p() })
            }),
        ));
    } else {
        v.push((
            "with softplus applied (dt_softplus is false)",
            Box::new(move |dt, bias| clamp(softplus(dt + bias))),
        ));
    }
    v
}

/// dA_cumsum `[batch, nheads, nchunks, chunk_size]` (row-major) with `dt'` from `f`.
fn variant_cumsum(p: &Problem<f64>, f: &DtFn) -> Vec<f64> {
    let d = *p.dims();
    let i = p.inputs();
    let l = p.options().chunk_size;
    let nc = p.nchunks();
    let mut cs = vec![0.0; d.batch * d.nheads * nc * l];
    for b in 0..d.batch {
        for h in 0..d.nheads {
            let bias = i.dt_bias.as_ref().map_or(0.0, |x| x[h]);
            for c in 0..nc {
                let mut acc = 0.0;
                for k in 0..l {
                    let t = c * l + k;
                    if t < d.seqlen {
                        acc += f(i.dt[[b, t, h]], bias) * i.A[h];
                    }
                    cs[((b * d.nheads + h) * nc + c) * l + k] = acc;
                }
            }
        }
    }
    cs
}

/// The problem whose processed `dt'` is `f`'s (as its raw `dt`, with no bias, no softplus and
/// no clamp), or `None` when that is not a valid problem.
fn variant_problem(p: &Problem<f64>, f: &DtFn) -> Option<Problem<f64>> {
    let mut inputs = p.inputs().clone();
    let bias = inputs.dt_bias.take();
    let (dims, mut options) = (*p.dims(), *p.options());
    for ((_, _, h), v) in inputs.dt.indexed_iter_mut() {
        *v = f(*v, bias.as_ref().map_or(0.0, |x| x[h]));
    }
    options.dt_softplus = false;
    options.dt_limit = (f64::MIN, f64::INFINITY);
    Problem::new(dims, options, inputs).ok()
}

/// Every candidate tensor passes the check against the reference of the variant problem
/// `pv` (its own float64 reference and bounds, at the same precision), and the variant's
/// reference fails the check against the true reference somewhere (it is a mistake here).
fn variant_explains(
    pv: &Problem<f64>,
    oracle: &Oracle,
    present: &[(OutputName, &ArrayD<f64>, Dtype)],
    precision: Precision,
) -> bool {
    let ov = Oracle::new(pv);
    let passes = |o: &Oracle, n: OutputName, t: &ArrayD<f64>, dt: Dtype| {
        o.compare(n, t, dt, precision).is_ok_and(|r| r.passed())
    };
    present.iter().all(|(n, t, dt)| passes(&ov, *n, t, *dt))
        && present
            .iter()
            .any(|(n, _, _)| !passes(oracle, *n, ov.reference(*n), Dtype::F64))
}

/// The problem with each row's `seq_idx` shifted to start at 0, so that the initial state
/// carries into the row's first sequence; `None` when no row starts above 0 or there is no
/// initial state.
fn seq_from_zero_problem(p: &Problem<f64>) -> Option<Problem<f64>> {
    let i = p.inputs();
    i.initial_states.as_ref()?;
    let s = i.seq_idx.as_ref()?;
    if s.column(0).iter().all(|&v| v == 0) {
        return None;
    }
    let mut inputs = i.clone();
    let shifted = inputs.seq_idx.as_mut().expect("checked");
    for mut row in shifted.rows_mut() {
        let first = row[0];
        row.mapv_inplace(|v| v - first);
    }
    Problem::new(*p.dims(), *p.options(), inputs).ok()
}

/// The largest problem (`batch * seqlen * nheads * headdim * dstate`) for which mistakes are
/// tried by recomputing the reference of the mistaken problem (rules 1 and 5): at most about
/// a second each on two cores.
pub const RECOMPUTE_LIMIT: usize = 1 << 22;

/// The states of a [`StateMistake`] and the sums of the absolute values of their terms (the
/// scale of their rounding).
struct HypothesisStates {
    chunk_states: ndarray::Array5<f64>,
    final_states: ndarray::Array4<f64>,
    chunk_states_mag: ndarray::Array5<f64>,
    final_states_mag: ndarray::Array4<f64>,
}

/// One mistake in the states' stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StateMistake {
    /// `S_(c+1) = S_c + states_c`: the passing without the decay.
    NoDecay,
    /// `states_c` decayed by `exp(cs_j)` (chunk start to `j`) instead of `exp(cs_last - cs_j)`.
    DecayWrongEnd,
    /// `initial_states` not loaded: `S_0 = 0`.
    InitialDropped,
    /// The last, partial chunk decayed as if the cumsum at its end (past `seqlen`) were 0: its
    /// `states_c` by `exp(0 - cs_j)`, its passing by `exp(0)`.
    PaddedEnd,
}

/// chunk_states `[batch, nchunks, nheads, headdim, dstate]` and final_states with one
/// [`StateMistake`]: `S_0 = initial state`, `S_(c+1) = a_c S_c + states_c`, reset to
/// `states_c` where the sequence changes (as the reference's passing does).
fn states_with(p: &Problem<f64>, mistake: StateMistake) -> HypothesisStates {
    let cumsum = chunk_cumsum(p);
    let d = *p.dims();
    let nc = p.nchunks();
    let l = p.options().chunk_size;
    // Per (batch, chunk), in parallel: [nheads, headdim, dstate] blocks of states_c and of the
    // sum of its terms' absolute values, in row-major order.
    let i = p.inputs();
    let (hn, pn, nn) = (d.nheads, d.headdim, d.dstate);
    let blocks: Vec<(Vec<f64>, Vec<f64>)> = (0..d.batch * nc)
        .into_par_iter()
        .map(|bc| {
            let (b, c) = (bc / nc, bc % nc);
            let mut v = vec![0.0; hn * pn * nn];
            let mut a = vec![0.0; hn * pn * nn];
            let t0 = c * l;
            let len = l.min(d.seqlen - t0);
            let seq_last = p.seq_idx_at(b, t0 + len - 1);
            for h in 0..hn {
                let g = d.group_of_head(h);
                for j in 0..len {
                    if p.seq_idx_at(b, t0 + j) != seq_last {
                        continue;
                    }
                    let cs = |k: usize| cumsum.dA_cumsum[[b, h, c, k]];
                    let decay = match mistake {
                        StateMistake::DecayWrongEnd => cs(j).exp(),
                        StateMistake::PaddedEnd if len < l => (-cs(j)).exp(),
                        _ => (cs(len - 1) - cs(j)).exp(),
                    };
                    let w = decay * cumsum.dt[[b, h, c, j]];
                    let brow = i.B.slice(ndarray::s![b, t0 + j, g, ..]);
                    let xrow = i.x.slice(ndarray::s![b, t0 + j, h, ..]);
                    for (pp, &xv) in xrow.iter().enumerate() {
                        let xw = xv * w;
                        let k0 = (h * pn + pp) * nn;
                        let (vr, ar) = (&mut v[k0..k0 + nn], &mut a[k0..k0 + nn]);
                        for ((vo, ao), &bv) in vr.iter_mut().zip(ar.iter_mut()).zip(brow.iter()) {
                            let term = xw * bv;
                            *vo += term;
                            *ao += term.abs();
                        }
                    }
                }
            }
            (v, a)
        })
        .collect();
    let shape = (d.batch, nc, hn, pn, nn);
    let (own, own_abs): (Vec<Vec<f64>>, Vec<Vec<f64>>) = blocks.into_iter().unzip();
    let mut own = ndarray::Array5::from_shape_vec(shape, own.concat()).expect("row-major blocks");
    let mut own_abs =
        ndarray::Array5::from_shape_vec(shape, own_abs.concat()).expect("row-major blocks");
    let init = p.inputs().initial_states.as_ref();
    let mut fin = ndarray::Array4::zeros((d.batch, d.nheads, d.headdim, d.dstate));
    let mut fin_abs = fin.clone();
    for b in 0..d.batch {
        for h in 0..d.nheads {
            for pp in 0..d.headdim {
                for n in 0..d.dstate {
                    let mut run = match init {
                        Some(s) if mistake != StateMistake::InitialDropped => s[[b, h, pp, n]],
                        _ => 0.0,
                    };
                    let mut run_abs = run.abs();
                    let mut seq_prev = 0i64;
                    for c in 0..nc {
                        let last = (c * l + l).min(d.seqlen) - 1;
                        let seq_new = p.seq_idx_at(b, last);
                        let scale = if seq_new != seq_prev {
                            0.0
                        } else if mistake == StateMistake::NoDecay
                            || (mistake == StateMistake::PaddedEnd && last + 1 < c * l + l)
                        {
                            1.0
                        } else {
                            cumsum.dA_cumsum[[b, h, c, l - 1]].exp()
                        };
                        seq_prev = seq_new;
                        let slot = &mut own[[b, c, h, pp, n]];
                        let o = *slot;
                        *slot = run;
                        run = scale * run + o;
                        let slot = &mut own_abs[[b, c, h, pp, n]];
                        let o = *slot;
                        *slot = run_abs;
                        run_abs = scale * run_abs + o;
                    }
                    fin[[b, h, pp, n]] = run;
                    fin_abs[[b, h, pp, n]] = run_abs;
                }
            }
        }
    }
    HypothesisStates {
        chunk_states: own,
        final_states: fin,
        chunk_states_mag: own_abs,
        final_states_mag: fin_abs,
    }
}

/// `out` of the reference with one epilogue or mask mistake, per flat element (`None` where
/// the hypothesis cannot be evaluated), for the mistakes that apply to the problem.
type OutHypothesis<'a> = (
    Stage,
    &'static str,
    Box<dyn Fn(usize) -> Option<(f64, f64)> + Sync + 'a>,
);

fn out_hypotheses<'a>(p: &'a Problem<f64>, r: &'a [f64]) -> Vec<OutHypothesis<'a>> {
    let d = *p.dims();
    let i = p.inputs();
    let hd = d.headdim;
    let unravel = move |k: usize| {
        let pp = k % hd;
        let h = (k / hd) % d.nheads;
        let t = (k / hd / d.nheads) % d.seqlen;
        let b = k / hd / d.nheads / d.seqlen;
        (b, t, h, pp)
    };
    let g = |z: f64| z / (1.0 + (-z).exp());
    let mut out: Vec<OutHypothesis<'a>> = Vec::new();
    if let Some(z) = &i.z {
        out.push((
            Stage::Epilogue,
            "out equals the reference divided by z: the gate is y sigmoid(z) instead of y z sigmoid(z) (silu)",
            Box::new(move |k| {
                let (b, t, h, pp) = unravel(k);
                let zv = z[[b, t, h, pp]];
                (zv.abs() > 1e-6).then(|| (r[k] / zv, 1.0_f64.max(1.0 / zv.abs())))
            }),
        ));
        if i.D.is_some() {
            out.push((
                Stage::Epilogue,
                "out equals y silu(z) + D x: the D skip is added after the gate instead of before it ((y + D x) silu(z))",
                Box::new(move |k| {
                    let (b, t, h, pp) = unravel(k);
                    let dx = p.d_skip(h, pp) * i.x[[b, t, h, pp]];
                    Some((r[k] + dx * (1.0 - g(z[[b, t, h, pp]])), 1.0))
                }),
            ));
        }
    }
    out.push((
        Stage::CausalMask,
        "out equals the reference without the diagonal term (C_t . B_t) dt'_t x_t: the causal mask of the within-chunk sum excludes j = i (j < i instead of j <= i)",
        Box::new(move |k| {
            let (b, t, h, pp) = unravel(k);
            let gr = d.group_of_head(h);
            let cb: f64 = (0..d.dstate)
                .map(|n| i.C[[b, t, gr, n]] * i.B[[b, t, gr, n]])
                .sum();
            let diag = cb * p.dt_processed(b, t, h) * i.x[[b, t, h, pp]];
            let gate = i.z.as_ref().map_or(1.0, |z| g(z[[b, t, h, pp]]));
            Some((r[k] - diag * gate, 1.0))
        }),
    ));
    out
}

/// One line of where a tensor is over its bound: the failing bins of its token, chunk and
/// head axes (`out: 310 of 4096 elements over the bound; chunks 1-3 of 4; ...`).
pub fn summary(m: &TensorMap) -> String {
    let mut parts = vec![format!(
        "{}: {} of {} elements over the bound",
        m.tensor, m.over, m.elements
    )];
    for axis in ["chunk", "position_in_chunk", "head", "batch", "sequence"] {
        let Some(p) = m.by.get(axis) else { continue };
        let f = p.failing();
        if f.is_empty() || p.over.len() < 2 {
            continue;
        }
        let name = match axis {
            "position_in_chunk" => "positions in chunk",
            "chunk" => "chunks",
            "head" => "heads",
            "batch" => "batch rows",
            _ => "sequences",
        };
        if f.len() == p.over.len() {
            parts.push(format!("{name}: all {}", p.over.len()));
        } else {
            parts.push(format!("{name} {} of {}", ranges(&f), p.over.len()));
        }
    }
    parts.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use ssd_reference::random::{random_problem, ProblemSpec, SeqIdx};
    use ssd_reference::Dims;

    #[test]
    fn ranges_are_compact() {
        assert_eq!(ranges(&[0, 2, 3, 4, 9]), "0, 2-4, 9");
        assert_eq!(ranges(&[]), "");
        let many: Vec<usize> = (0..40).step_by(2).collect();
        assert!(ranges(&many).ends_with("(20 runs)"));
    }

    #[test]
    fn the_map_of_out_puts_each_element_in_its_bins() {
        // batch 1, 10 tokens, 4 heads in 2 groups, chunk 4; one element over at token 5, head 3.
        let dims = Dims::new(1, 10, 4, 2, 2, 3);
        let p = random_problem(&ProblemSpec::plain(dims), 1).unwrap();
        let p = ssd_reference::Problem::new(
            dims,
            ssd_reference::Options {
                chunk_size: 4,
                ..*p.options()
            },
            p.inputs().clone(),
        )
        .unwrap();
        let mut r = ArrayD::<f64>::zeros(ndarray::IxDyn(&[1, 10, 4, 2]));
        r[[0, 5, 3, 1]] = 7.0;
        r[[0, 9, 0, 0]] = 0.5;
        let m = error_map(&p, OutputName::Out, &r);
        assert_eq!((m.over, m.elements), (1, 80));
        assert_eq!(m.by["chunk"].over, vec![0, 1, 0]);
        assert_eq!(m.by["chunk"].max_ratio, vec![0.0, 7.0, 0.5]);
        assert_eq!(m.by["position_in_chunk"].over, vec![0, 1, 0, 0]);
        assert_eq!(m.by["head"].failing(), vec![3]);
        assert_eq!(m.by["group"].over, vec![0, 1]);
        assert_eq!(m.by["chunk"].elements, vec![32, 32, 16]);
        assert_eq!(m.heat.values.iter().filter(|&&v| v == 7.0).count(), 1);
        assert_eq!(m.heat.chunk_marks, vec![4, 8]);
    }

    #[test]
    fn a_sequence_starting_at_a_chunk_start_is_marked() {
        let dims = Dims::new(1, 64, 2, 2, 1, 2);
        let spec = ProblemSpec {
            seq_idx: SeqIdx::AtChunkStarts { every: 1 },
            ..ProblemSpec::full(dims, 16)
        };
        let p = random_problem(&spec, 2).unwrap();
        let s = sequences(&p);
        assert_eq!(s.count, 4);
        assert_eq!(s.starts, vec![0, 16, 32, 48]);
        // Chunks 1-3 begin a new sequence; chunk 0 continues the initial state's (seq 0).
        assert!(!s.reset_at_chunk_start[0] && !s.reset_at_chunk_start[15]);
        assert!(s.reset_at_chunk_start[16] && s.reset_at_chunk_start[63]);
    }

    #[test]
    fn a_hypothesis_equal_to_the_reference_explains_nothing() {
        let t = Tensor {
            cand: vec![1.0, 2.5],
            bounds: vec![0.1, 0.1],
            reference: vec![1.0, 2.0],
        };
        // Explains the candidate and differs from the reference: a mistake.
        assert!(explained(&t, 0.0, |i| Some(([1.0, 2.5][i], 1.0))));
        // Equal to the reference: does not explain (the candidate is off at element 1).
        assert!(!explained(&t, 0.0, |i| Some((t.reference[i], 1.0))));
        // Nothing tested.
        assert_eq!(explains(&t, 0.0, |_| None), (false, false));
    }
}
