//! The chunked jump formula: the three stages in order.
//!
//! 1. [`chunk_cumsum`](crate::chunk_cumsum::chunk_cumsum): `dt'` and `dA_cumsum`;
//! 2. [`fwd_pass_state`](crate::fwd_pass_state::fwd_pass_state): per-chunk states (one matrix
//!    product each) and the sequential pass across chunks: `chunk_states`, `final_states`;
//! 3. [`compute_out`](crate::compute_out::compute_out): carried-state term plus the causal,
//!    decayed `C B^T` times `dt' x`, the `D` skip and the `z` gate: `out`.
//!
//! Mathematically equal to the recurrence of [`naive`](crate::naive); the result depends on
//! `chunk_size` only through rounding.
use ndarray::{Array4, Array5};

use crate::chunk_cumsum::chunk_cumsum;
use crate::compute_out::compute_out;
use crate::fwd_pass_state::fwd_pass_state;
use crate::{MatmulPrecision, Output, Problem, Real};

/// Everything the chunked path computes, intermediates included.
#[allow(non_snake_case)]
#[derive(Debug, Clone)]
pub struct ChunkedOutput<T> {
    /// `[batch, seqlen, nheads, headdim]`
    pub out: Array4<T>,
    /// `[batch, nheads, headdim, dstate]`
    pub final_states: Array4<T>,
    /// `[batch, nheads, nchunks, chunk_size]`
    pub dA_cumsum: Array4<T>,
    /// `[batch, nchunks, nheads, headdim, dstate]`
    pub chunk_states: Array5<T>,
}

impl<T> ChunkedOutput<T> {
    /// Drops the intermediates.
    pub fn into_output(self) -> Output<T> {
        Output {
            out: self.out,
            final_states: self.final_states,
        }
    }
}

/// Runs the three stages; `precision` selects the rounding of every matrix-product operand.
pub fn forward<T: Real>(p: &Problem<T>, precision: MatmulPrecision) -> ChunkedOutput<T> {
    let cumsum = chunk_cumsum(p);
    let pass = fwd_pass_state(p, &cumsum, precision);
    let out = compute_out(p, &cumsum, &pass.chunk_states, precision);
    ChunkedOutput {
        out,
        final_states: pass.final_states,
        dA_cumsum: cumsum.dA_cumsum,
        chunk_states: pass.chunk_states,
    }
}
