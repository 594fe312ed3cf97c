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
//! The state of one (row, head) is kept transposed, `dstate x headdim` row-major, so that both
//! the update and `y_t` are element-wise over `headdim` (`y[p] += s[n, p] * C[n]`, summed over
//! `n` in order): plain loops that LLVM turns into FMA vector code without reassociating any
//! sum. Four state rows are updated per pass to amortise the loads and stores of `y`.
//! Parallel over (batch, head); no allocation per token.
use ndarray::{Array4, ArrayViewMut2};
use rayon::prelude::*;

use crate::problem::gate;
use crate::{Output, Problem, Real};

/// Runs the recurrence token by token, parallel over (batch, head).
///
/// Returns `out` `[batch, seqlen, nheads, headdim]` and `final_states`
/// `[batch, nheads, headdim, dstate]` (the state after the last token of each row).
pub fn forward<T: Real>(p: &Problem<T>) -> Output<T> {
    let d = *p.dims();
    let mut dst = Output {
        out: crate::par_zeros((d.batch, d.seqlen, d.nheads, d.headdim)),
        final_states: Array4::<T>::zeros((d.batch, d.nheads, d.headdim, d.dstate)),
    };
    recurrence(p, &mut dst);
    dst
}

/// [`forward`] into the arrays of an earlier result, for a caller that computes many problems
/// of one shape: the same bits as [`forward`]. `out` and `final_states` are overwritten in
/// place when their shapes fit `p` and they are in standard layout (no allocation); otherwise
/// `dst` is replaced by a fresh result.
pub fn forward_into<T: Real>(p: &Problem<T>, dst: &mut Output<T>) {
    let d = *p.dims();
    let fits = dst.out.shape() == [d.batch, d.seqlen, d.nheads, d.headdim]
        && dst.final_states.shape() == [d.batch, d.nheads, d.headdim, d.dstate]
        && dst.out.is_standard_layout()
        && dst.final_states.is_standard_layout();
    if fits {
        recurrence(p, dst);
    } else {
        *dst = forward(p);
    }
}

/// The recurrence, writing every entry of `dst.out` and `dst.final_states` (shapes as `p`
/// implies, standard layout).
fn recurrence<T: Real>(p: &Problem<T>, dst: &mut Output<T>) {
    let d = *p.dims();
    let i = p.inputs();
    let Output { out, final_states } = dst;

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
        .expect("final_states in standard layout")
        .chunks_mut(d.headdim * d.dstate)
        .collect();

    out_bh
        .into_par_iter()
        .zip(fin_bh)
        .enumerate()
        .for_each(|(bh, (mut o, fin))| {
            let (b, h) = (bh / d.nheads, bh % d.nheads);
            let g = d.group_of_head(h);
            let (hd, ds) = (d.headdim, d.dstate);
            // st[n * hd + p] = s[p, n]
            let mut st = vec![T::zero(); ds * hd];
            if let Some(s0) = &i.initial_states {
                for pp in 0..hd {
                    for n in 0..ds {
                        st[n * hd + pp] = s0[[b, h, pp, n]];
                    }
                }
            }
            let d_skip: Vec<T> = (0..hd).map(|pp| p.d_skip(h, pp)).collect();
            let mut u = [vec![T::zero(); hd], vec![T::zero(); hd]];
            let mut y = [vec![T::zero(); hd], vec![T::zero(); hd]];
            let mut prev_seq = 0i64;
            // Token t's decay, and the offsets of its B/C rows and of its x/z/out row.
            let mut token = |t: usize, u: &mut [T], y: &mut [T]| {
                let dt = p.dt_processed(b, t, h);
                let seq = p.seq_idx_at(b, t);
                let decay = if seq == prev_seq {
                    (dt * i.A[h]).exp()
                } else {
                    T::zero()
                };
                prev_seq = seq;
                let bc_off = ((b * d.seqlen + t) * d.ngroups + g) * ds;
                let x_off = ((b * d.seqlen + t) * d.nheads + h) * hd;
                for ((uv, yv), &xv) in u.iter_mut().zip(y.iter_mut()).zip(&x[x_off..x_off + hd]) {
                    *uv = dt * xv;
                    *yv = T::zero();
                }
                (decay, bc_off, x_off)
            };
            let mut t = 0;
            while t < d.seqlen {
                // Two tokens per pass over the state when possible (same arithmetic as two
                // single steps, half the state traffic).
                let n_tok = if t + 1 < d.seqlen { 2 } else { 1 };
                let [u0, u1] = &mut u;
                let [y0, y1] = &mut y;
                let (a0, bc0, x0) = token(t, u0, y0);
                let bc = |off: usize| (&bm[off..off + ds], &cm[off..off + ds]);
                let (b0, c0) = bc(bc0);
                let mut offs = [x0, 0];
                if n_tok == 2 {
                    let (a1, bc1, x1) = token(t + 1, u1, y1);
                    let (b1, c1) = bc(bc1);
                    offs[1] = x1;
                    update_state_2(&mut st, [u0, u1], [y0, y1], [b0, b1], [c0, c1], [a0, a1]);
                } else {
                    update_state(&mut st, u0, y0, b0, c0, a0);
                }
                for (k, &x_off) in offs.iter().enumerate().take(n_tok) {
                    let x_t = &x[x_off..x_off + hd];
                    let mut row = o.row_mut(t + k);
                    for (pp, o_tp) in row.iter_mut().enumerate() {
                        let yv = y[k][pp] + d_skip[pp] * x_t[pp];
                        *o_tp = match z {
                            Some(z) => gate(yv, z[x_off + pp]),
                            None => yv,
                        };
                    }
                }
                t += n_tok;
            }
            for pp in 0..hd {
                for n in 0..ds {
                    fin[pp * ds + n] = st[n * hd + pp];
                }
            }
        });
}

/// Two consecutive tokens' updates of a transposed state, fused: for every state element,
/// `v = a[0] s + B_0[n] u[0]`, `y[0] += v C_0[n]`, then `s = a[1] v + B_1[n] u[1]`,
/// `y[1] += s C_1[n]`: the arithmetic of two [`update_state`] calls, one pass over memory.
#[inline]
fn update_state_2<T: Real>(
    st: &mut [T],
    u: [&[T]; 2],
    y: [&mut [T]; 2],
    b: [&[T]; 2],
    c: [&[T]; 2],
    a: [T; 2],
) {
    let hd = u[0].len();
    let [y0, y1] = y;
    let (u0, u1, y0, y1) = (&u[0][..hd], &u[1][..hd], &mut y0[..hd], &mut y1[..hd]);
    let ds = b[0].len();
    let mut rows = st.chunks_exact_mut(hd);
    let mut n = 0;
    while n + 2 <= ds {
        let r0 = &mut rows.next().expect("dstate rows")[..hd];
        let r1 = &mut rows.next().expect("dstate rows")[..hd];
        let (b00, b01, b10, b11) = (b[0][n], b[0][n + 1], b[1][n], b[1][n + 1]);
        let (c00, c01, c10, c11) = (c[0][n], c[0][n + 1], c[1][n], c[1][n + 1]);
        for p in 0..hd {
            let v0 = a[0].mul_add(r0[p], b00 * u0[p]);
            let v1 = a[0].mul_add(r1[p], b01 * u0[p]);
            y0[p] = v1.mul_add(c01, v0.mul_add(c00, y0[p]));
            let w0 = a[1].mul_add(v0, b10 * u1[p]);
            let w1 = a[1].mul_add(v1, b11 * u1[p]);
            y1[p] = w1.mul_add(c11, w0.mul_add(c10, y1[p]));
            r0[p] = w0;
            r1[p] = w1;
        }
        n += 2;
    }
    if let Some(r) = rows.next() {
        let r = &mut r[..hd];
        for p in 0..hd {
            let v = a[0].mul_add(r[p], b[0][n] * u0[p]);
            y0[p] = v.mul_add(c[0][n], y0[p]);
            let w = a[1].mul_add(v, b[1][n] * u1[p]);
            y1[p] = w.mul_add(c[1][n], y1[p]);
            r[p] = w;
        }
    }
}

/// One token's update of a transposed state `st` (`dstate` rows of length `headdim`):
/// `st[n, :] = a * st[n, :] + B[n] * u` and `y += st[n, :] * C[n]` for `n = 0, 1, ...` in
/// order, with `u = dt' * x_t`.
#[inline]
fn update_state<T: Real>(st: &mut [T], u: &[T], y: &mut [T], b: &[T], c: &[T], a: T) {
    let hd = u.len();
    let mut rows = st.chunks_exact_mut(hd);
    let mut n = 0;
    while n + 4 <= b.len() {
        let (r0, r1, r2, r3) = (
            rows.next().expect("dstate rows"),
            rows.next().expect("dstate rows"),
            rows.next().expect("dstate rows"),
            rows.next().expect("dstate rows"),
        );
        let (b0, b1, b2, b3) = (b[n], b[n + 1], b[n + 2], b[n + 3]);
        let (c0, c1, c2, c3) = (c[n], c[n + 1], c[n + 2], c[n + 3]);
        for (((((s0, s1), s2), s3), &uv), yv) in r0
            .iter_mut()
            .zip(r1.iter_mut())
            .zip(r2.iter_mut())
            .zip(r3.iter_mut())
            .zip(u)
            .zip(y.iter_mut())
        {
            let v0 = a.mul_add(*s0, b0 * uv);
            let v1 = a.mul_add(*s1, b1 * uv);
            let v2 = a.mul_add(*s2, b2 * uv);
            let v3 = a.mul_add(*s3, b3 * uv);
            *s0 = v0;
            *s1 = v1;
            *s2 = v2;
            *s3 = v3;
            *yv = v3.mul_add(c3, v2.mul_add(c2, v1.mul_add(c1, v0.mul_add(c0, *yv))));
        }
        n += 4;
    }
    for (r, (&bn, &cn)) in rows.zip(b[n..].iter().zip(&c[n..])) {
        for ((sv, &uv), yv) in r.iter_mut().zip(u).zip(y.iter_mut()) {
            let v = a.mul_add(*sv, bn * uv);
            *sv = v;
            *yv = v.mul_add(cn, *yv);
        }
    }
}
