//! Work buffers reused from task to task by the chunked path's stages.

use crate::Real;

/// Per-thread work buffers of [`crate::compute_out::out_block`], reused from task to task.
#[derive(Default)]
pub(crate) struct OutScratch<T> {
    pub(crate) seq: Vec<i64>,
    pub(crate) c_copy: Vec<T>,
    /// `B_c^T` (`dstate x L`), not rounded.
    pub(crate) b_t: Vec<T>,
    /// `B_c^T` rounded to TF32 or bfloat16 (only under [`crate::MatmulPrecision::Tf32`] and
    /// [`crate::MatmulPrecision::Bf16`]).
    pub(crate) b_t_r: Vec<T>,
    pub(crate) gm: Vec<T>,
    pub(crate) lmat: Vec<T>,
    pub(crate) s_t: Vec<T>,
    pub(crate) y: Vec<T>,
    /// `x_c` of every head of the block (rounded under TF32): `[heads, L, headdim]`.
    pub(crate) x_copy: Vec<T>,
    /// The `L` for which `lmat` holds zeros above the diagonal.
    pub(crate) lmat_len: usize,
    pub(crate) e: Vec<T>,
    pub(crate) d_skip: Vec<T>,
}

/// The first `n` entries of a reused buffer (grown with zeros when too short; the contents
/// are whatever the last task left).
pub(crate) fn scratch<T: Real>(v: &mut Vec<T>, n: usize) -> &mut [T] {
    if v.len() < n {
        v.resize(n, T::zero());
    }
    &mut v[..n]
}
