//! Stage 1: dt processing and the within-chunk cumsum of dt*A. STUB.
use ndarray::Array4;

use crate::{Problem, Real};

/// Output of [`chunk_cumsum`].
#[allow(non_snake_case)]
#[derive(Debug, Clone)]
pub struct ChunkCumsum<T> {
    /// Processed `dt'` laid out `[batch, nheads, nchunks, chunk_size]`, 0 past `seqlen`.
    pub dt: Array4<T>,
    /// Inclusive within-chunk cumsum of `dt' * A`: `[batch, nheads, nchunks, chunk_size]`.
    pub dA_cumsum: Array4<T>,
}

pub fn chunk_cumsum<T: Real>(p: &Problem<T>) -> ChunkCumsum<T> {
    let _ = p;
    todo!()
}
