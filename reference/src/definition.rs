//! The definition: the SSD forward pass as the textbook recurrence, one loop over tokens.
//!
//! For row `b`, head `h` (group `g = h / (nheads / ngroups)`), token by token:
//!
//! ```text
//! dt'_t = clamp(softplus?(dt[b, t, h] + dt_bias[h]), lo, hi)
//! a_t   = exp(dt'_t * A[h])               or 0 when seq_idx[b, t] != seq_idx[b, t - 1]
//! s_t[p, n] = a_t * s_{t-1}[p, n] + B[b, t, g, n] * (dt'_t * x[b, t, h, p])
//! y_t[p]    = sum_n s_t[p, n] * C[b, t, g, n] + D[h(, p)] * x[b, t, h, p]
//! out[b, t, h, p] = y_t[p] * (z * sigmoid(z))      z = z[b, t, h, p], when z is given
//! ```
//!
//! with `s_{-1} = initial_states[b, h]` (or 0) and `seq_idx[b, -1] := 0`. Each state update is
//! one fused multiply-add (`a_t s + (B (dt' x))`, the product rounded first), and the sum over
//! `n` runs in increasing `n` from 0, one fused multiply-add per term; the `D` term is a
//! product and an add. These are the roundings of the ground truth, [`crate::naive`], which
//! computes the same operations in the same order in a tuned schedule (blocks of tokens,
//! register tiles, a transposed state): the tests check that both give the same bits on every
//! option. This function is slow (indexed array accesses, no parallelism); it is the
//! definition, not a path to use.

use ndarray::Array4;

use crate::problem::gate;
use crate::{Output, Problem, Real};

/// `out` and `final_states` of `p` by the recurrence of the module documentation.
pub fn forward<T: Real>(p: &Problem<T>) -> Output<T> {
    let d = *p.dims();
    let i = p.inputs();
    let mut out = Array4::<T>::zeros((d.batch, d.seqlen, d.nheads, d.headdim));
    let mut final_states = Array4::<T>::zeros((d.batch, d.nheads, d.headdim, d.dstate));
    for b in 0..d.batch {
        for h in 0..d.nheads {
            let g = d.group_of_head(h);
            let mut s = match &i.initial_states {
                Some(s0) => s0.slice(ndarray::s![b, h, .., ..]).to_owned(),
                None => ndarray::Array2::<T>::zeros((d.headdim, d.dstate)),
            };
            let mut seq_prev = 0;
            for t in 0..d.seqlen {
                let dt = p.dt_processed(b, t, h);
                let seq = p.seq_idx_at(b, t);
                let a = if seq == seq_prev {
                    (dt * i.A[h]).exp()
                } else {
                    T::zero()
                };
                seq_prev = seq;
                for pp in 0..d.headdim {
                    let x = i.x[[b, t, h, pp]];
                    let u = dt * x;
                    let mut y = T::zero();
                    for n in 0..d.dstate {
                        let v = a.mul_add(s[[pp, n]], i.B[[b, t, g, n]] * u);
                        s[[pp, n]] = v;
                        y = v.mul_add(i.C[[b, t, g, n]], y);
                    }
                    let y = y + p.d_skip(h, pp) * x;
                    out[[b, t, h, pp]] = match &i.z {
                        Some(z) => gate(y, z[[b, t, h, pp]]),
                        None => y,
                    };
                }
            }
            final_states.slice_mut(ndarray::s![b, h, .., ..]).assign(&s);
        }
    }
    Output { out, final_states }
}
