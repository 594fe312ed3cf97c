//! Stage 2: per-chunk states and the sequential pass across chunks. STUB.
use ndarray::{Array4, Array5};

use crate::chunk_cumsum::ChunkCumsum;
use crate::{MatmulPrecision, Problem, Real};

/// Output of [`fwd_pass_state`].
#[derive(Debug, Clone)]
pub struct StatePass<T> {
    /// State entering each chunk: `[batch, nchunks, nheads, headdim, dstate]`.
    pub chunk_states: Array5<T>,
    /// State after the last token: `[batch, nheads, headdim, dstate]`.
    pub final_states: Array4<T>,
}

pub fn fwd_pass_state<T: Real>(
    p: &Problem<T>,
    cumsum: &ChunkCumsum<T>,
    precision: MatmulPrecision,
) -> StatePass<T> {
    let _ = (p, cumsum, precision);
    todo!()
}
