//! The naive time-step recurrence: the ground truth.
//!
//! It computes [`crate::definition`]'s textbook recurrence (one loop over tokens per row and
//! head, read that for the equations) with the same operations in the same order, so with the
//! same bits (the tests check it on every option), in a schedule tuned for speed.
//!
//! The state of one (row, head) is kept transposed, `dstate x headdim` row-major, so that both
//! the update and `y_t` are element-wise over `headdim` (`y[p] += s[n, p] * C[n]`, summed over
//! `n` in order): plain loops that LLVM turns into FMA vector code without reassociating any
//! sum (compiled for AVX2 + FMA where the processor has them, [`crate::simd`]). Tokens go through in blocks of 8: each tile of the state (4 rows x 8
//! columns) is loaded into registers once per block and every token of the block updates it
//! there, so the state crosses the caches once per block instead of once per token. Tiles go
//! row block by row block, so each `y[p]` still receives its terms in increasing `n`: the same
//! operations in the same order as token-by-token updates of the whole state.
//!
//! Parallel over (batch, block of heads): a task reads whole rows of `x`, `B`, `C` and `out`; no allocation per token.
use ndarray::{Array4, ArrayViewMut3, Axis};
use rayon::prelude::*;

use crate::prefetch;
use crate::problem::gate;
use crate::transpose::transpose_into;
use crate::{Output, Problem, Real};

/// Runs the recurrence token by token, parallel over (batch, block of heads).
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

/// Tokens per time block: the state passes through registers once per block of this many
/// tokens (their `u`, `y`, decays, B and C rows are staged first). 8 keeps the staged block
/// and the tile's state rows in L1 while amortising each tile's loads over enough tokens.
const TOKENS: usize = 8;
/// State rows (`n`) held in registers by one tile.
const ROWS: usize = 4;
/// `headdim` entries held in registers per state row by one tile.
const COLS: usize = 8;

/// One time block's staged per-token values, shared by every tile of the state.
struct TimeBlock<'a, T> {
    /// `a_t` per token of the block.
    decay: &'a [T],
    /// `u_t = dt'_t * x_t`, `[tokens, headdim]`.
    u: &'a [T],
    /// `B_t` and `C_t` per token of the block, `[tokens, dstate]`, copied together so that a
    /// tile's loads do not all fall in one cache set (consecutive tokens' rows lie
    /// `ngroups * dstate` values apart in B and C).
    b: &'a [T],
    c: &'a [T],
    headdim: usize,
    dstate: usize,
}

/// The recurrence, writing every entry of `dst.out` and `dst.final_states` (shapes as `p`
/// implies, standard layout).
///
/// One task per (row, block of heads): a row's heads are split into as few equal blocks as
/// give every thread the same work ([`crate::units_per_task`]), so that a task reads whole
/// `[heads, headdim]` rows of `x` (and of `B`, `C`, `z`, `out`), or large parts of them: consecutive tokens' rows are adjacent in memory, where a single head's
/// rows would each lie on another page. The states of a block's heads (`dstate x headdim`
/// each) stay in the L2 cache. Each head's arithmetic does not depend on the blocking.
fn recurrence<T: Real>(p: &Problem<T>, dst: &mut Output<T>) {
    let d = *p.dims();
    let i = p.inputs();
    let Output { out, final_states } = dst;

    // Flat row-major copies (no copy when the inputs are already standard layout).
    let x = i.x.as_standard_layout();
    let bm = i.B.as_standard_layout();
    let cm = i.C.as_standard_layout();
    let z = i.z.as_ref().map(|z| z.as_standard_layout());
    let flat = Flat {
        x: x.as_slice().expect("standard layout"),
        bm: bm.as_slice().expect("standard layout"),
        cm: cm.as_slice().expect("standard layout"),
        z: z.as_ref().map(|z| z.as_slice().expect("standard layout")),
    };

    let heads_per_task = crate::units_per_task(d.batch, d.nheads, rayon::current_num_threads());

    // One task per (b, head block j): the pieces out[b, t, h0..h1, :] of every row t (each
    // contiguous; as slices, so that writing a row costs no view arithmetic) and
    // final_states[b, h0..h1]. Tasks are ordered j-major, as the final_states blocks.
    let n_blocks = d.nheads.div_ceil(heads_per_task);
    let mut rows: Vec<Vec<&mut [T]>> = (0..n_blocks * d.batch)
        .map(|_| Vec::with_capacity(d.seqlen))
        .collect();
    let out_flat = out.as_slice_mut().expect("out in standard layout");
    for (bt, row) in out_flat.chunks_mut(d.nheads * d.headdim).enumerate() {
        let b = bt / d.seqlen;
        for (j, piece) in row.chunks_mut(heads_per_task * d.headdim).enumerate() {
            rows[j * d.batch + b].push(piece);
        }
    }
    let fins = final_states
        .axis_chunks_iter_mut(Axis(1), heads_per_task)
        .flat_map(|fb| fb.into_outer_iter_mut());
    let tasks: Vec<Task<T>> = rows
        .into_iter()
        .zip(fins)
        .enumerate()
        .map(|(jb, (out, fin))| Task {
            b: jb % d.batch,
            h0: jb / d.batch * heads_per_task,
            out,
            fin,
        })
        .collect();
    tasks
        .into_par_iter()
        .for_each(|task| run_task(p, &flat, task));
}

/// The inputs as flat row-major slices.
struct Flat<'a, T> {
    x: &'a [T],
    bm: &'a [T],
    cm: &'a [T],
    z: Option<&'a [T]>,
}

/// One row's block of heads `h0..h0 + fin.len_of(Axis(0))`, with its parts of the outputs:
/// `out[t]` is `out[b, t, h0.., :]` (`heads x headdim`, row-major) and `fin` is
/// `final_states[b, h0..]`.
struct Task<'a, T> {
    b: usize,
    h0: usize,
    out: Vec<&'a mut [T]>,
    fin: ArrayViewMut3<'a, T>,
}

crate::simd::multiversion! {
    /// Runs the recurrence for one task, [`TOKENS`] tokens at a time for all of its heads
    /// (compiled for AVX2 + FMA where the processor has them).
    fn run_task[T: Real](p: &Problem<T>, f: &Flat<T>, task: Task<T>) {
        run_task_body(p, f, task)
    }
}

/// [`run_task`]'s body.
#[inline(always)]
fn run_task_body<T: Real>(p: &Problem<T>, f: &Flat<T>, task: Task<T>) {
    let d = *p.dims();
    let i = p.inputs();
    let Task {
        b,
        h0,
        mut out,
        mut fin,
    } = task;
    let nh = fin.len_of(Axis(0));
    let (hd, ds) = (d.headdim, d.dstate);
    let g0 = d.group_of_head(h0);
    let (x_rs, bc_rs) = (d.nheads * hd, d.ngroups * ds);
    let x_row = |t: usize| ((b * d.seqlen + t) * d.nheads + h0) * hd;
    let bc_row = |t: usize| ((b * d.seqlen + t) * d.ngroups + g0) * ds;

    // States, transposed: st[hl][n * hd + p] = s[p, n] of head h0 + hl.
    let mut st: Vec<Vec<T>> = (0..nh)
        .map(|hl| {
            let mut s = vec![T::zero(); ds * hd];
            if let Some(s0) = &i.initial_states {
                for pp in 0..hd {
                    for n in 0..ds {
                        s[n * hd + pp] = s0[[b, h0 + hl, pp, n]];
                    }
                }
            }
            s
        })
        .collect();
    let d_skip: Vec<Vec<T>> = (0..nh)
        .map(|hl| (0..hd).map(|pp| p.d_skip(h0 + hl, pp)).collect())
        .collect();
    let mut reset = [false; TOKENS];
    let mut decay = [T::zero(); TOKENS];
    let mut u = vec![T::zero(); TOKENS * hd];
    let mut y = vec![T::zero(); TOKENS * hd];
    let mut b_blk = vec![T::zero(); TOKENS * ds];
    let mut c_blk = vec![T::zero(); TOKENS * ds];
    let mut prev_seq = 0i64;
    for t0 in (0..d.seqlen).step_by(TOKENS) {
        let nt = TOKENS.min(d.seqlen - t0);
        let (t1, nt1) = (t0 + nt, TOKENS.min(d.seqlen - t0 - nt));
        // A reset (a_t = 0) where seq_idx changes, seq_idx[b, -1] := 0.
        for (k, r) in reset.iter_mut().enumerate().take(nt) {
            let seq = p.seq_idx_at(b, t0 + k);
            *r = seq != prev_seq;
            prev_seq = seq;
        }
        for (hl, st) in st.iter_mut().enumerate() {
            let h = h0 + hl;
            let g = d.group_of_head(h) - g0;
            // Ask for the rows of the next (head, block) in this task's order now (into L2):
            // they arrive while this head's tiles run.
            let (hn, tn, ntn) = if hl + 1 < nh {
                (hl + 1, t0, nt)
            } else {
                (0, t1, nt1)
            };
            if ntn > 0 {
                let gn = d.group_of_head(h0 + hn) - g0;
                let bcn = bc_row(tn) + gn * ds;
                let xn = x_row(tn) + hn * hd;
                prefetch::rows(f.bm, bcn, bc_rs, ntn, ds);
                prefetch::rows(f.cm, bcn, bc_rs, ntn, ds);
                prefetch::rows(f.x, xn, x_rs, ntn, hd);
                if let Some(z) = f.z {
                    prefetch::rows(z, xn, x_rs, ntn, hd);
                }
                for row in &out[tn..tn + ntn] {
                    prefetch::rows(row, hn * hd, 0, 1, hd);
                }
            }
            // This block's rows of B and C (prefetched into L2 a head earlier) into L1, all at
            // once before they are copied: copied straight from L2, each row (4 KiB from the
            // last) would wait for its lines in turn.
            let bc0 = bc_row(t0) + g * ds;
            prefetch::rows_l1(f.bm, bc0, bc_rs, nt, ds);
            prefetch::rows_l1(f.cm, bc0, bc_rs, nt, ds);
            for k in 0..nt {
                let t = t0 + k;
                let dt = p.dt_processed(b, t, h);
                decay[k] = if reset[k] {
                    T::zero()
                } else {
                    (dt * i.A[h]).exp()
                };
                let bc = bc_row(t) + g * ds;
                b_blk[k * ds..(k + 1) * ds].copy_from_slice(&f.bm[bc..bc + ds]);
                c_blk[k * ds..(k + 1) * ds].copy_from_slice(&f.cm[bc..bc + ds]);
                let xo = x_row(t) + hl * hd;
                for ((uv, yv), &xv) in u[k * hd..(k + 1) * hd]
                    .iter_mut()
                    .zip(&mut y[k * hd..(k + 1) * hd])
                    .zip(&f.x[xo..xo + hd])
                {
                    *uv = dt * xv;
                    *yv = T::zero();
                }
            }
            let blk = TimeBlock {
                decay: &decay[..nt],
                u: &u[..nt * hd],
                b: &b_blk[..nt * ds],
                c: &c_blk[..nt * ds],
                headdim: hd,
                dstate: ds,
            };
            sweep(st, &mut y[..nt * hd], &blk);
            let d_skip = &d_skip[hl];
            for k in 0..nt {
                let t = t0 + k;
                let xo = x_row(t) + hl * hd;
                let x_t = &f.x[xo..xo + hd];
                let y_t = &y[k * hd..(k + 1) * hd];
                let o_t = &mut out[t][hl * hd..(hl + 1) * hd];
                let terms = o_t.iter_mut().zip(y_t).zip(d_skip).zip(x_t);
                match f.z {
                    Some(z) => {
                        for ((((o, &yv), &dv), &xv), &zv) in terms.zip(&z[xo..xo + hd]) {
                            *o = gate(yv + dv * xv, zv);
                        }
                    }
                    None => {
                        for (((o, &yv), &dv), &xv) in terms {
                            *o = yv + dv * xv;
                        }
                    }
                }
            }
        }
    }
    let fin = fin
        .as_slice_mut()
        .expect("a block's final_states are contiguous (standard layout)");
    for (st, dst) in st.iter().zip(fin.chunks_exact_mut(ds * hd)) {
        transpose_into((ds, hd), st, 0, hd, dst);
    }
}

crate::simd::multiversion! {
    /// [`sweep_body`], compiled for AVX2 + FMA where the processor has them (its fused
    /// multiply-adds are then instructions, not library calls).
    fn sweep[T: Real](st: &mut [T], y: &mut [T], blk: &TimeBlock<T>) {
        sweep_body(st, y, blk)
    }
}

/// Runs one time block's tokens through the whole transposed state `st` (`dstate` rows of
/// length `headdim`), adding `s_t[p, n] * C_t[n]` into `y[t, p]` for `n = 0, 1, ...` in order.
///
/// The state is cut into tiles of [`ROWS`] x [`COLS`] held in registers while every token
/// of the block passes; tiles are visited row block by row block, so each `y[t, p]` still
/// receives its terms in increasing `n`: the same operations, in the same order, as updating
/// the whole state token by token.
#[inline(always)]
fn sweep_body<T: Real>(st: &mut [T], y: &mut [T], blk: &TimeBlock<T>) {
    let ds = blk.dstate;
    let mut n = 0;
    while n + ROWS <= ds {
        row_block::<T, ROWS>(st, y, blk, n);
        n += ROWS;
    }
    while n < ds {
        row_block::<T, 1>(st, y, blk, n);
        n += 1;
    }
}

/// State rows `n..n + R`, in tiles of [`COLS`] columns (single columns at the end).
#[inline(always)]
fn row_block<T: Real, const R: usize>(st: &mut [T], y: &mut [T], blk: &TimeBlock<T>, n: usize) {
    let hd = blk.headdim;
    let mut p = 0;
    while p + COLS <= hd {
        tile::<T, R, COLS>(st, y, blk, n, p);
        p += COLS;
    }
    while p < hd {
        tile::<T, R, 1>(st, y, blk, n, p);
        p += 1;
    }
}

/// One `R x P` tile of the state (rows `n..n + R`, columns `p..p + P`) through every token
/// `k` of the block, in registers:
///
/// ```text
/// s[r][q] = a_k * s[r][q] + B_k[n + r] * u_k[p + q]
/// y[k, p + q] += s[r][q] * C_k[n + r]          for r = 0, 1, ... in order
/// ```
#[inline(always)]
fn tile<T: Real, const R: usize, const P: usize>(
    st: &mut [T],
    y: &mut [T],
    blk: &TimeBlock<T>,
    n: usize,
    p: usize,
) {
    let (hd, ds) = (blk.headdim, blk.dstate);
    let mut s = [[T::zero(); P]; R];
    for (r, s_r) in s.iter_mut().enumerate() {
        s_r.copy_from_slice(&st[(n + r) * hd + p..(n + r) * hd + p + P]);
    }
    for (k, &a) in blk.decay.iter().enumerate() {
        let off = k * ds + n;
        let b: &[T; R] = blk.b[off..off + R].try_into().expect("R values");
        let c: &[T; R] = blk.c[off..off + R].try_into().expect("R values");
        let u: &[T; P] = blk.u[k * hd + p..k * hd + p + P]
            .try_into()
            .expect("P values");
        let y_k: &mut [T; P] = (&mut y[k * hd + p..k * hd + p + P])
            .try_into()
            .expect("P values");
        let mut acc = *y_k;
        for r in 0..R {
            for q in 0..P {
                let v = a.mul_add(s[r][q], b[r] * u[q]);
                s[r][q] = v;
                acc[q] = v.mul_add(c[r], acc[q]);
            }
        }
        *y_k = acc;
    }
    for (r, s_r) in s.iter().enumerate() {
        st[(n + r) * hd + p..(n + r) * hd + p + P].copy_from_slice(s_r);
    }
}
