//! Stage 2: per-chunk states, then the sequential pass across chunks.
//!
//! Mirrors mamba_ssm's `_chunk_state_fwd` ([`chunk_state`]) followed by `_state_passing_fwd`
//! ([`state_passing`]). Notation for row `b`, head `h` (group `g`), chunk `c`: `t0 = c *
//! chunk_size`, `L = min(chunk_size, seqlen - t0)` valid tokens, `cs = dA_cumsum[b, h, c, :]`,
//! `cs_last = cs[L - 1]`, `seq_j = seq_idx[b, t0 + j]` (0 without `seq_idx`), `x_c = x[b, t0..t0
//! + L, h, :]` (`L x headdim`) and `B_c = B[b, t0..t0 + L, g, :]` (`L x dstate`).
//!
//! **Chunk state** (the chunk's own contribution to the state after its last valid token), one
//! matrix product:
//!
//! ```text
//! w_j        = exp(cs_last - cs_j) * dt'_j     if seq_j == seq_{L-1},  else 0
//! states_c   = x_c^T  (diag(w) B_c)            headdim x dstate
//! ```
//!
//! `A <= 0` and `dt' >= 0` make `cs` non-increasing, so `cs_last - cs_j <= 0` for `j <= L - 1`
//! and the exponential never overflows. (A `dt_limit` with a negative lower end could make `dt'`
//! negative; the same formula is still evaluated.)
//!
//! **State passing**, sequential over chunks, starting from `S_0 = initial_states[b, h]` (or 0):
//!
//! ```text
//! scale_c    = exp(cs_last of chunk c)     or 0 when seq_idx at the last token of chunk c
//!                                           differs from seq_idx at the last token of chunk
//!                                           c - 1 (from 0 for c = 0)
//! S_{c+1}    = scale_c * S_c + states_c          (one fused multiply-add per element)
//! chunk_states[b, c, h] = S_c,   final_states[b, h] = S_nchunks
//! ```
//!
//! So `chunk_states[:, 0]` is always `initial_states` (even when the row starts with a nonzero
//! `seq_idx`, where it is then never used) and `chunk_states[:, c]`, `c > 0`, is the
//! reset-aware state after token `c * chunk_size - 1`.
//!
//! Under [`MatmulPrecision::Tf32`] the two operands of the chunk-state product, `x_c` and the
//! already-scaled `diag(w) B_c`, are rounded to TF32 ([`Real::round_tf32`]; to bfloat16 under
//! [`MatmulPrecision::Bf16`]); `w` itself, the product's accumulation and the state pass stay
//! in `T`.
use ndarray::{s, Array4, Array5, ArrayView2, ArrayViewMut3, Axis};
use rayon::prelude::*;

use crate::chunk_cumsum::ChunkCumsum;
use crate::flat::{copy_x_c, Flat};
use crate::gemm::{gemm, Epilogue, Mat, Tri};
use crate::scratch::scratch;
use crate::{MatmulPrecision, Problem, Real};

/// Output of [`fwd_pass_state`].
#[derive(Debug, Clone)]
pub struct StatePass<T> {
    /// State entering each chunk: `[batch, nchunks, nheads, headdim, dstate]`.
    pub chunk_states: Array5<T>,
    /// State after the last token: `[batch, nheads, headdim, dstate]`.
    pub final_states: Array4<T>,
}

/// Both halves of stage 2: [`chunk_state`] then [`state_passing`] (in place).
///
/// # Panics
/// If `cumsum` was not computed from `p` (shapes differ).
pub fn fwd_pass_state<T: Real>(
    p: &Problem<T>,
    cumsum: &ChunkCumsum<T>,
    precision: MatmulPrecision,
) -> StatePass<T> {
    let mut chunk_states = chunk_state(p, cumsum, precision);
    let final_states = state_passing(p, cumsum, &mut chunk_states);
    StatePass {
        chunk_states,
        final_states,
    }
}

/// The per-chunk states `states_c = x_c^T (diag(w) B_c)` (see the module documentation),
/// `[batch, nchunks, nheads, headdim, dstate]`, before state passing.
///
/// Parallel over (batch, chunk, head).
///
/// # Panics
/// If `cumsum` was not computed from `p` (shapes differ).
pub fn chunk_state<T: Real>(
    p: &Problem<T>,
    cumsum: &ChunkCumsum<T>,
    precision: MatmulPrecision,
) -> Array5<T> {
    let d = *p.dims();
    let nc = p.nchunks();
    let (hd, ds) = (d.headdim, d.dstate);
    let f = Flat::new(p, cumsum, precision);
    let mut states: Array5<T> = crate::par_zeros((d.batch, nc, d.nheads, hd, ds));
    states
        .as_slice_mut()
        .expect("fresh array")
        .par_chunks_mut(hd * ds)
        .enumerate()
        .for_each_init(StateScratch::default, |sc, (bch, out)| {
            let (b, c, h) = (bch / (nc * d.nheads), (bch / d.nheads) % nc, bch % d.nheads);
            local_state(&f, (b, c, h), sc, out);
        });
    states
}

/// Work buffers of [`local_state`], reused from task to task.
#[derive(Default)]
pub(crate) struct StateScratch<T> {
    w: Vec<T>,
    wb: Vec<T>,
    x_c: Vec<T>,
}

/// `out = states_c` (`headdim x dstate`, row-major) for row `b`, chunk `c`, head `h`.
pub(crate) fn local_state<T: Real>(
    f: &Flat<'_, T>,
    (b, c, h): (usize, usize, usize),
    sc: &mut StateScratch<T>,
    out: &mut [T],
) {
    let l = f.p.chunk_len(c);
    let hd = f.p.dims().headdim;
    let mut x_c = std::mem::take(&mut sc.x_c);
    let x = scratch(&mut x_c, l * hd);
    copy_x_c(f, (b, c, h), x);
    local_state_with_x(f, (b, c, h), x, sc, out);
    sc.x_c = x_c;
}

/// [`local_state`] given `x_c` as [`copy_x_c`] makes it.
pub(crate) fn local_state_with_x<T: Real>(
    f: &Flat<'_, T>,
    (b, c, h): (usize, usize, usize),
    x_c: &[T],
    sc: &mut StateScratch<T>,
    out: &mut [T],
) {
    let p = f.p;
    let d = *p.dims();
    let (hd, ds) = (d.headdim, d.dstate);
    let g = d.group_of_head(h);
    let t0 = c * p.options().chunk_size;
    let l = p.chunk_len(c);
    let w = scratch(&mut sc.w, l);
    masked_weights(f, (b, c, h), w);
    // diag(w) B_c, L x dstate
    let wb = scratch(&mut sc.wb, l * ds);
    let b_flat = f.b();
    for (j, row) in wb.chunks_exact_mut(ds).enumerate() {
        let wj = w[j];
        let off = f.bc_off(b, t0 + j, g);
        for (o, &v) in row.iter_mut().zip(&b_flat[off..off + ds]) {
            *o = v * wj;
        }
    }
    f.operands.round_all(wb);
    // x_c^T: entry (p, j) = x_c[j, p]
    let xt = Mat {
        data: x_c,
        off: 0,
        rs: 1,
        cs: hd,
    };
    gemm(
        (hd, ds, l),
        xt,
        Mat::rows(wb, ds),
        out,
        ds,
        Epilogue::Store,
        Tri::Full,
    );
}

/// `w[j] = exp(cs_last - cs_j) * dt'_j`, or 0 for a token of another sequence than the last
/// one of the chunk (row `b`, chunk `c`, head `h`).
fn masked_weights<T: Real>(f: &Flat<'_, T>, (b, c, h): (usize, usize, usize), w: &mut [T]) {
    let p = f.p;
    let t0 = c * p.options().chunk_size;
    let l = p.chunk_len(c);
    let (cum, dt) = f.cum_dt(b, h, c);
    let seq_last = p.seq_idx_at(b, t0 + l - 1);
    for (wj, &cj) in w.iter_mut().zip(cum) {
        *wj = cum[l - 1] - cj;
    }
    T::exp_all(w);
    for (j, (wj, &dj)) in w.iter_mut().zip(dt).enumerate() {
        *wj = if p.seq_idx_at(b, t0 + j) == seq_last {
            *wj * dj
        } else {
            T::zero()
        };
    }
}

/// [`local_state_with_x`] transposed: `states_c^T` (`dstate x headdim`, row-major) into
/// `out_t` through `epi` (the fused schedule's state pass: `out_t = scale out_t + states_c^T`),
/// given `B_c^T` (`dstate x L`, not rounded) and `x_c` as [`copy_x_c`] makes it. Every entry
/// is the same fused multiply-add chain as in [`local_state_with_x`] (`diag(w) B_c` has the
/// same entries, the sum runs over the tokens in the same order), so the bits are the same.
pub(crate) fn local_state_t<T: Real>(
    f: &Flat<'_, T>,
    (b, c, h): (usize, usize, usize),
    b_t: &[T],
    x_c: &[T],
    sc: &mut StateScratch<T>,
    out_t: &mut [T],
    epi: Epilogue<'_, T>,
) {
    let d = *f.p.dims();
    let (hd, ds) = (d.headdim, d.dstate);
    let l = f.p.chunk_len(c);
    let w = scratch(&mut sc.w, l);
    masked_weights(f, (b, c, h), w);
    // (diag(w) B_c)^T, dstate x L
    let wbt = scratch(&mut sc.wb, ds * l);
    for (dst, src) in wbt.chunks_exact_mut(l).zip(b_t.chunks_exact(l)) {
        for ((o, &v), &wj) in dst.iter_mut().zip(src).zip(w.iter()) {
            *o = v * wj;
        }
    }
    f.operands.round_all(wbt);
    gemm(
        (ds, hd, l),
        Mat::rows(wbt, l),
        Mat::rows(x_c, hd),
        out_t,
        hd,
        epi,
        Tri::Full,
    );
}

/// The decay applied to the state entering chunk `c` on its way out: `exp(dA_cumsum[b, h, c,
/// chunk_size - 1])`, or 0 when `seq_idx` at the chunk's last valid token differs from
/// `seq_prev` (that of the previous chunk's last token, 0 for `c = 0`). Returns it with the new
/// `seq_prev`.
pub(crate) fn pass_scale<T: Real>(
    f: &Flat<'_, T>,
    (b, h, c): (usize, usize, usize),
    seq_prev: i64,
) -> (T, i64) {
    let p = f.p;
    let last = c * p.options().chunk_size + p.chunk_len(c) - 1;
    let seq_new = p.seq_idx_at(b, last);
    let scale = if seq_new == seq_prev {
        f.cum_last(b, h, c).exp()
    } else {
        T::zero()
    };
    (scale, seq_new)
}

/// The sequential pass across chunks, in place: on entry `states` holds the per-chunk states
/// of [`chunk_state`], on return `chunk_states` (the state entering each chunk). Returns
/// `final_states`.
///
/// Parallel over (batch, head); each state element runs its own chain over the chunks.
///
/// # Panics
/// If the shapes of `states` or `cumsum` do not match `p`.
pub fn state_passing<T: Real>(
    p: &Problem<T>,
    cumsum: &ChunkCumsum<T>,
    states: &mut Array5<T>,
) -> Array4<T> {
    let d = *p.dims();
    let nc = p.nchunks();
    let f = Flat::new(p, cumsum, MatmulPrecision::Native);
    assert_eq!(
        states.shape(),
        &[d.batch, nc, d.nheads, d.headdim, d.dstate],
        "states shape"
    );
    let mut final_states = Array4::<T>::zeros((d.batch, d.nheads, d.headdim, d.dstate));
    let init = p.inputs().initial_states.as_ref();
    let n = d.headdim * d.dstate;
    // Per (b, h): the [nchunks, headdim, dstate] view of states and the final-state slice.
    let views: Vec<_> = states
        .view_mut()
        .permuted_axes([0, 2, 1, 3, 4])
        .into_outer_iter_mut()
        .flat_map(|v| v.into_outer_iter_mut())
        .collect();
    let fin: Vec<&mut [T]> = final_states
        .as_slice_mut()
        .expect("fresh array")
        .chunks_mut(n)
        .collect();
    views
        .into_par_iter()
        .zip(fin)
        .enumerate()
        .for_each(|(bh, (v, s))| {
            let (b, h) = (bh / d.nheads, bh % d.nheads);
            if let Some(s0) = init {
                let s0: ArrayView2<T> = s0.slice(s![b, h, .., ..]);
                for (dst, src) in s.iter_mut().zip(s0.iter()) {
                    *dst = *src;
                }
            }
            pass_lane(&f, (b, h), v, s);
        });
    final_states
}

crate::simd::multiversion! {
    /// The pass of [`state_passing`] for row `b`, head `h` (`bh`): `states[b, :, h]` in `v`,
    /// the running state (the initial state on entry, the final one on return) in `s`
    /// (compiled for AVX2 + FMA where the processor has them).
    fn pass_lane[T: Real](
        f: &Flat<'_, T>,
        bh: (usize, usize),
        v: ArrayViewMut3<'_, T>,
        s: &mut [T],
    ) {
        let (b, h) = bh;
        let mut v = v;
        let mut seq_prev = 0i64;
        for c in 0..f.p.nchunks() {
            let (scale, seq_new) = pass_scale(f, (b, h, c), seq_prev);
            seq_prev = seq_new;
            let mut local = v.index_axis_mut(Axis(0), c);
            let step = |dst: &mut T, run: &mut T| {
                let own = *dst;
                *dst = *run;
                *run = scale.mul_add(*run, own);
            };
            match local.as_slice_mut() {
                // the usual case: a contiguous [headdim, dstate] block, vectorised
                Some(local) => local
                    .iter_mut()
                    .zip(s.iter_mut())
                    .for_each(|(d, r)| step(d, r)),
                None => local
                    .iter_mut()
                    .zip(s.iter_mut())
                    .for_each(|(d, r)| step(d, r)),
            }
        }
    }
}
