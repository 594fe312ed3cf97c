//! Stage 3: the output of every chunk. STUB.
use ndarray::{Array4, Array5};

use crate::chunk_cumsum::ChunkCumsum;
use crate::{MatmulPrecision, Problem, Real};

/// `out`: `[batch, seqlen, nheads, headdim]`.
pub fn compute_out<T: Real>(
    p: &Problem<T>,
    cumsum: &ChunkCumsum<T>,
    chunk_states: &Array5<T>,
    precision: MatmulPrecision,
) -> Array4<T> {
    let _ = (p, cumsum, chunk_states, precision);
    todo!()
}
