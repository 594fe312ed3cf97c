//! Serving semantics: packed variable-length sequences, one initial state per sequence, the
//! final state of every sequence, and states at listed token positions.
//!
//! A serving kernel packs the tokens of many requests into one row (`batch = 1`): sequence `i`
//! holds tokens `cu_seqlens[i] .. cu_seqlens[i + 1]` (mamba_ssm's `cu_seqlens`, vLLM's
//! `query_start_loc`; zero-length sequences allowed). The state restarts at every sequence
//! start, from the sequence's own initial state (a cached prefix) or from zero:
//!
//! ```text
//! s_{start_i - 1} := init_i        (seq_initial_states[i] where seq_has_initial_state[i], else 0)
//! s_t = exp(dt'_t A) s_{t-1} + dt'_t x_t B_t^T        for t in start_i .. end_i
//! varlen_states[i]   = s_{end_i - 1}                  (init_i for a zero-length sequence)
//! position_states[j] = s_{state_positions[j]}
//! ```
//!
//! and `y`, `out` as for one row. With mamba_ssm's convention instead (`initial_states
//! [1, nheads, headdim, dstate]`, no `seq_initial_states`), only sequence 0 starts from
//! `initial_states` (the run whose `seq_idx` is 0); the two conventions are never mixed.
//!
//! [`forward`] computes this with either reference algorithm by splitting the row into
//! *segments*: each sequence, cut after every listed position, is one problem of its own
//! (`batch = 1`, no `seq_idx`) whose `initial_states` is the state its predecessor ended with.
//! A state carried into a segment enters the next token's update exactly as it would in one
//! uninterrupted run (`exp(dt' A) s + dt' x B^T`), so for the naive recurrence the segments
//! give the bits of the whole-row recurrence with these initial states. The chunked
//! algorithm runs with chunks aligned to each segment's start (vLLM's layout; the function
//! does not depend on the chunking).
use ndarray::{s, Array2, Array4, Axis};
use rayon::prelude::*;

use crate::{chunked, naive, Inputs, MatmulPrecision, Problem, Real, ReferenceError};

/// The serving part of a case: how the packed row splits into sequences, their initial
/// states, and where states are wanted.
#[derive(Debug, Clone, PartialEq)]
pub struct Packing<T> {
    /// `[nseq + 1]` token offsets: `cu_seqlens[0] = 0`, non-decreasing, `cu_seqlens[nseq] =
    /// seqlen`.
    pub cu_seqlens: Vec<usize>,
    /// `[nseq, nheads, headdim, dstate]`: the state before each sequence's first token.
    pub seq_initial_states: Option<Array4<T>>,
    /// `[nseq]`: which sequences start from their `seq_initial_states` (the others from
    /// zero); all of them when absent.
    pub seq_has_initial_state: Option<Vec<bool>>,
    /// `[k]` token indices of the packed row whose state (after the token) is wanted, in any
    /// order, repeats allowed.
    pub state_positions: Vec<usize>,
}

/// Which reference algorithm computes each segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// The naive recurrence ([`crate::naive`]): the ground truth in f64.
    Naive,
    /// The chunked jump formula ([`crate::chunked`]), chunks aligned to each segment's start.
    Chunked(MatmulPrecision),
}

/// The outputs of a packed problem.
#[derive(Debug, Clone)]
pub struct ServingOutput<T> {
    /// `[1, seqlen, nheads, headdim]`.
    pub out: Array4<T>,
    /// `[1, nheads, headdim, dstate]`: the state after the row's last token.
    pub final_states: Array4<T>,
    /// `[nseq, nheads, headdim, dstate]`: the state after each sequence's last token.
    pub varlen_states: Array4<T>,
    /// `[k, nheads, headdim, dstate]`: the state after each listed token.
    pub position_states: Array4<T>,
}

fn invalid(msg: String) -> ReferenceError {
    ReferenceError::InvalidProblem(msg)
}

/// The `seq_idx` that `cu_seqlens` implies: `seq_idx[t] = i` for `t` in sequence `i`.
pub fn implied_seq_idx(cu_seqlens: &[usize]) -> Vec<i64> {
    let mut v = Vec::with_capacity(cu_seqlens.last().copied().unwrap_or(0));
    for (i, w) in cu_seqlens.windows(2).enumerate() {
        v.extend(std::iter::repeat_n(i as i64, w[1].saturating_sub(w[0])));
    }
    v
}

impl<T: Real> Packing<T> {
    /// Packed sequences only: no initial states, no positions.
    pub fn new(cu_seqlens: Vec<usize>) -> Self {
        Packing {
            cu_seqlens,
            seq_initial_states: None,
            seq_has_initial_state: None,
            state_positions: Vec::new(),
        }
    }

    /// The number of sequences, `cu_seqlens.len() - 1`.
    pub fn nseq(&self) -> usize {
        self.cu_seqlens.len().saturating_sub(1)
    }

    /// Checks the packing against `p`.
    ///
    /// # Errors
    /// [`ReferenceError::InvalidProblem`] naming the tensor when: `batch > 1`; `cu_seqlens`
    /// has fewer than 2 entries, does not start at 0, decreases, or does not end at `seqlen`;
    /// `p`'s `seq_idx` disagrees with the one `cu_seqlens` implies; `seq_initial_states` is
    /// given together with `initial_states` or not of shape `[nseq, nheads, headdim,
    /// dstate]` or not finite; `seq_has_initial_state` is not of length `nseq` or given
    /// without `seq_initial_states`; a state position is not a token index.
    pub fn validate(&self, p: &Problem<T>) -> Result<(), ReferenceError> {
        let d = *p.dims();
        let cu = &self.cu_seqlens;
        if d.batch != 1 {
            return Err(invalid(format!(
                "`cu_seqlens` packs sequences into one row: batch must be 1, got {}",
                d.batch
            )));
        }
        if cu.len() < 2 {
            return Err(invalid(format!(
                "`cu_seqlens` needs at least 2 entries (one sequence), got {}",
                cu.len()
            )));
        }
        if cu[0] != 0 {
            return Err(invalid(format!(
                "`cu_seqlens` must start at 0, starts at {}",
                cu[0]
            )));
        }
        if let Some(i) = cu.windows(2).position(|w| w[1] < w[0]) {
            return Err(invalid(format!(
                "`cu_seqlens` decreases at index {}: {} after {}",
                i + 1,
                cu[i + 1],
                cu[i]
            )));
        }
        let last = *cu.last().expect("two entries");
        if last != d.seqlen {
            return Err(invalid(format!(
                "`cu_seqlens` must end at seqlen = {}, ends at {last}",
                d.seqlen
            )));
        }
        if let Some(seq) = &p.inputs().seq_idx {
            let implied = implied_seq_idx(cu);
            if let Some(t) = (0..d.seqlen).find(|&t| seq[[0, t]] != implied[t]) {
                return Err(invalid(format!(
                    "`seq_idx` disagrees with `cu_seqlens` at token {t}: seq_idx {}, sequence {}",
                    seq[[0, t]],
                    implied[t]
                )));
            }
        }
        let nseq = self.nseq();
        if let Some(s0) = &self.seq_initial_states {
            if p.inputs().initial_states.is_some() {
                return Err(invalid(
                    "`seq_initial_states` (one per sequence) and `initial_states` (mamba_ssm's, for the first sequence) are two conventions: give one".into(),
                ));
            }
            let want = [nseq, d.nheads, d.headdim, d.dstate];
            if s0.shape() != want {
                return Err(invalid(format!(
                    "`seq_initial_states` has shape {:?}, expected [nseq, nheads, headdim, dstate] = {want:?}",
                    s0.shape()
                )));
            }
            if let Some((k, _)) = s0.indexed_iter().find(|(_, v)| !v.is_finite()) {
                return Err(invalid(format!(
                    "`seq_initial_states` is not finite at {:?}",
                    [k.0, k.1, k.2, k.3]
                )));
            }
        }
        if let Some(m) = &self.seq_has_initial_state {
            if self.seq_initial_states.is_none() {
                return Err(invalid(
                    "`seq_has_initial_state` is given without `seq_initial_states`".into(),
                ));
            }
            if m.len() != nseq {
                return Err(invalid(format!(
                    "`seq_has_initial_state` has {} entries, expected nseq = {nseq}",
                    m.len()
                )));
            }
        }
        if let Some((j, &t)) = self
            .state_positions
            .iter()
            .enumerate()
            .find(|(_, &t)| t >= d.seqlen)
        {
            return Err(invalid(format!(
                "`state_positions[{j}]` = {t} is not a token index (seqlen {})",
                d.seqlen
            )));
        }
        Ok(())
    }

    /// `p` with the `seq_idx` that `cu_seqlens` implies, when it has none (an unchecked
    /// packing may give an invalid problem: validate first).
    ///
    /// # Errors
    /// [`ReferenceError::InvalidProblem`] as [`Problem::new`].
    pub fn with_seq_idx(&self, p: &Problem<T>) -> Result<Problem<T>, ReferenceError> {
        if p.inputs().seq_idx.is_some() {
            return Ok(p.clone());
        }
        let mut inputs = p.inputs().clone();
        let implied = implied_seq_idx(&self.cu_seqlens);
        inputs.seq_idx = Some(
            Array2::from_shape_vec((1, implied.len()), implied)
                .map_err(|e| invalid(format!("`cu_seqlens`: {e}")))?,
        );
        Problem::new(*p.dims(), *p.options(), inputs)
    }

    /// The state before sequence `i`'s first token (`None` for zero), by whichever
    /// convention the problem uses.
    pub fn initial_state(&self, p: &Problem<T>, i: usize) -> Option<Array4<T>> {
        if let Some(s0) = &self.seq_initial_states {
            let has = self.seq_has_initial_state.as_ref().is_none_or(|m| m[i]);
            return has.then(|| s0.slice(s![i..i + 1, .., .., ..]).to_owned());
        }
        (i == 0)
            .then(|| p.inputs().initial_states.clone())
            .flatten()
    }

    /// Converts the states to another float type.
    pub fn cast<U: Real>(&self) -> Packing<U> {
        Packing {
            cu_seqlens: self.cu_seqlens.clone(),
            seq_initial_states: self
                .seq_initial_states
                .as_ref()
                .map(|a| a.mapv(|v| U::lit(v.as_f64()))),
            seq_has_initial_state: self.seq_has_initial_state.clone(),
            state_positions: self.state_positions.clone(),
        }
    }
}

/// Tokens `t0..t1` of `p`'s only row as a problem of its own, starting from `init`.
fn window<T: Real>(
    p: &Problem<T>,
    t0: usize,
    t1: usize,
    init: Option<Array4<T>>,
) -> Result<Problem<T>, ReferenceError> {
    let inputs = Inputs {
        initial_states: init,
        seq_idx: None,
        ..p.token_inputs(t0..t1)
    };
    let dims = crate::Dims {
        seqlen: t1 - t0,
        ..*p.dims()
    };
    Problem::new(dims, *p.options(), inputs)
}

/// One sequence's part of the outputs.
struct SequenceOut<T> {
    /// `[len, nheads, headdim]`.
    out: Option<Array4<T>>,
    last: Option<Array4<T>>,
    /// `(position index, state)` for the listed positions in this sequence.
    at: Vec<(usize, Array4<T>)>,
}

/// Computes a packed problem (see the module documentation).
///
/// # Errors
/// [`ReferenceError::InvalidProblem`] as [`Packing::validate`].
///
/// # Example
/// ```
/// use ssd_reference::random::{random_problem, ProblemSpec};
/// use ssd_reference::serving::{forward, Algorithm, Packing};
/// use ssd_reference::{naive, Dims};
///
/// // Two sequences of 5 and 7 tokens, packed; the state after token 2 too.
/// let p = random_problem(&ProblemSpec::plain(Dims::new(1, 12, 2, 3, 1, 4)), 1).unwrap();
/// let mut packing = Packing::new(vec![0, 5, 12]);
/// packing.state_positions = vec![2];
/// let o = forward(&p, &packing, Algorithm::Naive).unwrap();
/// assert_eq!(o.varlen_states.shape(), &[2, 2, 3, 4]);
/// // The last sequence's final state is the row's.
/// assert_eq!(o.varlen_states.slice(ndarray::s![1..2, .., .., ..]), o.final_states);
/// ```
pub fn forward<T: Real>(
    p: &Problem<T>,
    packing: &Packing<T>,
    algorithm: Algorithm,
) -> Result<ServingOutput<T>, ReferenceError> {
    packing.validate(p)?;
    let d = *p.dims();
    let cu = &packing.cu_seqlens;
    let nseq = packing.nseq();
    let run = |q: &Problem<T>| -> crate::Output<T> {
        match algorithm {
            Algorithm::Naive => naive::forward(q),
            Algorithm::Chunked(mp) => chunked::forward(q, mp).into_output(),
        }
    };
    let per_seq: Vec<SequenceOut<T>> = (0..nseq)
        .into_par_iter()
        .map(|i| -> Result<SequenceOut<T>, ReferenceError> {
            let (start, end) = (cu[i], cu[i + 1]);
            let mut state = packing.initial_state(p, i);
            // Cut after every listed position inside the sequence.
            let mut cuts: Vec<usize> = packing
                .state_positions
                .iter()
                .filter(|&&t| t >= start && t < end)
                .map(|&t| t + 1)
                .collect();
            cuts.push(end);
            cuts.sort_unstable();
            cuts.dedup();
            let mut outs = Vec::new();
            let mut at = Vec::new();
            let mut t0 = start;
            for t1 in cuts {
                if t1 == t0 {
                    continue;
                }
                let q = window(p, t0, t1, state.take())?;
                let o = run(&q);
                outs.push(o.out);
                for (j, &pos) in packing.state_positions.iter().enumerate() {
                    if pos + 1 == t1 {
                        at.push((j, o.final_states.clone()));
                    }
                }
                state = Some(o.final_states);
                t0 = t1;
            }
            let out = if outs.is_empty() {
                None
            } else {
                let views: Vec<_> = outs.iter().map(|a| a.view()).collect();
                Some(ndarray::concatenate(Axis(1), &views).expect("same shapes but seqlen"))
            };
            Ok(SequenceOut {
                out,
                last: state,
                at,
            })
        })
        .collect::<Result<_, _>>()?;

    let zero_state = || Array4::<T>::zeros((1, d.nheads, d.headdim, d.dstate));
    let mut out = Array4::<T>::zeros((1, d.seqlen, d.nheads, d.headdim));
    let mut varlen = Array4::<T>::zeros((nseq, d.nheads, d.headdim, d.dstate));
    let mut positions =
        Array4::<T>::zeros((packing.state_positions.len(), d.nheads, d.headdim, d.dstate));
    let mut final_states = zero_state();
    for (i, s) in per_seq.into_iter().enumerate() {
        if let Some(o) = s.out {
            out.slice_mut(s![.., cu[i]..cu[i + 1], .., ..]).assign(&o);
        }
        let last = s.last.unwrap_or_else(zero_state);
        varlen.slice_mut(s![i..i + 1, .., .., ..]).assign(&last);
        if cu[i + 1] > cu[i] {
            final_states = last;
        }
        for (j, st) in s.at {
            positions.slice_mut(s![j..j + 1, .., .., ..]).assign(&st);
        }
    }
    Ok(ServingOutput {
        out,
        final_states,
        varlen_states: varlen,
        position_states: positions,
    })
}
