//! The naive time-step recurrence: the ground truth.
//!
//! For row `b`, head `h` (group `g = h / (nheads / ngroups)`), token by token:
//!
//! ```text
//! dt'_t = clamp(softplus?(dt[b, t, h] + dt_bias[h]), lo, hi)
//! a_t   = exp(dt'_t * A[h])               or 0 when seq_idx[b, t] != seq_idx[b, t - 1]
//! s_t[p, n] = a_t * s_{t-1}[p, n] + (dt'_t * x[b, t, h, p]) * B[b, t, g, n]
//! y_t[p]    = sum_n s_t[p, n] * C[b, t, g, n] + D[h(, p)] * x[b, t, h, p]
//! out[b, t, h, p] = y_t[p] * (z * sigmoid(z))      z = z[b, t, h, p], when z is given
//! ```
//!
//! with `s_{-1} = initial_states[b, h]` (or 0) and `seq_idx[b, -1] := 0` (mamba_ssm's rule: the
//! initial state seeds only a leading run whose `seq_idx` is 0). A reset uses `a_t = 0`, which
//! is exactly a reset: `0 * s + v = v` for finite `s`.
//!
//! The state of one (row, head) is a `headdim x dstate` row-major buffer; the update of a row
//! `s[p, :]` and its dot product with `C_t` are one fused pass written with independent
//! accumulators, which LLVM turns into FMA vector code. Parallel over (batch, head).
use ndarray::{Array4, ArrayViewMut2, Axis};
use rayon::prelude::*;

use crate::problem::gate;
use crate::{Output, Problem, Real};

/// Independent partial sums in the `y` reduction (enough to hide FMA latency for f64 and f32).
const LANES: usize = 16;

/// Runs the recurrence token by token, parallel over (batch, head).
///
/// Returns `out` `[batch, seqlen, nheads, headdim]` and `final_states`
/// `[batch, nheads, headdim, dstate]` (the state after the last token of each row).
pub fn forward<T: Real>(p: &Problem<T>) -> Output<T> {
    let d = *p.dims();
    let i = p.inputs();
    let mut out = Array4::<T>::zeros((d.batch, d.seqlen, d.nheads, d.headdim));
    let mut final_states = Array4::<T>::zeros((d.batch, d.nheads, d.headdim, d.dstate));

    // Flat row-major copies (no copy when the inputs are already standard layout).
    let x = i.x.as_standard_layout();
    let bm = i.B.as_standard_layout();
    let cm = i.C.as_standard_layout();
    let z = i.z.as_ref().map(|z| z.as_standard_layout());
    let (x, bm, cm) = (
        x.as_slice().expect("standard layout"),
        bm.as_slice().expect("standard layout"),
        cm.as_slice().expect("standard layout"),
    );
    let z = z.as_ref().map(|z| z.as_slice().expect("standard layout"));

    // One task per (b, h): its out[b, :, h, :] view and its final_states[b, h] slice.
    let out_bh: Vec<ArrayViewMut2<T>> = out
        .view_mut()
        .permuted_axes([0, 2, 1, 3])
        .into_outer_iter_mut()
        .flat_map(|ob| ob.into_outer_iter_mut())
        .collect();
    let fin_bh: Vec<&mut [T]> = final_states
        .as_slice_mut()
        .expect("fresh array")
        .chunks_mut(d.headdim * d.dstate)
        .collect();

    out_bh
        .into_par_iter()
        .zip(fin_bh)
        .enumerate()
        .for_each(|(bh, (mut o, state))| {
            let (b, h) = (bh / d.nheads, bh % d.nheads);
            let g = d.group_of_head(h);
            let (hd, ds) = (d.headdim, d.dstate);
            if let Some(s0) = &i.initial_states {
                for (dst, src) in state
                    .iter_mut()
                    .zip(s0.index_axis(Axis(0), b).index_axis(Axis(0), h))
                {
                    *dst = *src;
                }
            } // else: zeros
            let d_skip: Vec<T> = (0..hd).map(|pp| p.d_skip(h, pp)).collect();
            let mut prev_seq = 0i64;
            for t in 0..d.seqlen {
                let dt = p.dt_processed(b, t, h);
                let seq = p.seq_idx_at(b, t);
                let decay = if seq == prev_seq {
                    (dt * i.A[h]).exp()
                } else {
                    T::zero()
                };
                prev_seq = seq;
                let bc_off = ((b * d.seqlen + t) * d.ngroups + g) * ds;
                let b_t = &bm[bc_off..bc_off + ds];
                let c_t = &cm[bc_off..bc_off + ds];
                let x_off = ((b * d.seqlen + t) * d.nheads + h) * hd;
                let x_t = &x[x_off..x_off + hd];
                for (pp, row) in state.chunks_exact_mut(ds).enumerate() {
                    let y = update_row(row, b_t, c_t, decay, dt * x_t[pp]) + d_skip[pp] * x_t[pp];
                    o[[t, pp]] = match z {
                        Some(z) => gate(y, z[x_off + pp]),
                        None => y,
                    };
                }
            }
        });
    Output { out, final_states }
}

/// `s[n] = a * s[n] + u * b[n]` for every `n`, returning `sum_n s[n] * c[n]` (new `s`).
///
/// The sum uses [`LANES`] independent partial sums combined pairwise, so the compiler can keep
/// them in vector registers; the result differs from a left-to-right sum only by rounding.
#[inline]
fn update_row<T: Real>(s: &mut [T], b: &[T], c: &[T], a: T, u: T) -> T {
    let n = s.len();
    debug_assert!(b.len() == n && c.len() == n);
    let mut acc = [T::zero(); LANES];
    let split = n - n % LANES;
    let (s_main, s_tail) = s.split_at_mut(split);
    for ((sv, bv), cv) in s_main
        .chunks_exact_mut(LANES)
        .zip(b[..split].chunks_exact(LANES))
        .zip(c[..split].chunks_exact(LANES))
    {
        for k in 0..LANES {
            let v = a.mul_add(sv[k], u * bv[k]);
            sv[k] = v;
            acc[k] = v.mul_add(cv[k], acc[k]);
        }
    }
    for (k, sv) in s_tail.iter_mut().enumerate() {
        let v = a.mul_add(*sv, u * b[split + k]);
        *sv = v;
        acc[k] = v.mul_add(c[split + k], acc[k]);
    }
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for k in 0..width {
            acc[k] = acc[k] + acc[k + width];
        }
    }
    acc[0]
}
