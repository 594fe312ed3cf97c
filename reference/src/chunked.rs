//! The chunked jump formula: the three stages in order. STUB.
use ndarray::{Array4, Array5};

use crate::{MatmulPrecision, Output, Problem, Real};

/// Everything the chunked path computes, intermediates included.
#[allow(non_snake_case)]
#[derive(Debug, Clone)]
pub struct ChunkedOutput<T> {
    pub out: Array4<T>,
    pub final_states: Array4<T>,
    /// `[batch, nheads, nchunks, chunk_size]`
    pub dA_cumsum: Array4<T>,
    /// `[batch, nchunks, nheads, headdim, dstate]`
    pub chunk_states: Array5<T>,
}

impl<T> ChunkedOutput<T> {
    pub fn into_output(self) -> Output<T> {
        Output {
            out: self.out,
            final_states: self.final_states,
        }
    }
}

pub fn forward<T: Real>(p: &Problem<T>, precision: MatmulPrecision) -> ChunkedOutput<T> {
    let _ = (p, precision);
    todo!()
}
