//! The adjoint recurrence: the reverse-mode derivative of [`crate::naive`], the gradient
//! ground truth.
//!
//! Given the forward problem and the upstream gradients `dout` (`[batch, seqlen, nheads,
//! headdim]`) and, optionally, `dfinal_states` (`[batch, nheads, headdim, dstate]`), this
//! computes the vector-Jacobian product of the forward with respect to every differentiable
//! input. For row `b`, head `h` (group `g`), with the forward's quantities
//!
//! ```text
//! v_t = dt[b, t, h] + dt_bias[h]          sp_t = softplus?(v_t)       dt'_t = clamp(sp_t, lo, hi)
//! a_t = exp(dt'_t A[h])  (0 at a reset)   u_t = dt'_t x_t             s_t = a_t s_{t-1} + u_t B_t^T
//! y_t = s_t C_t + D x_t                   out_t = y_t * silu(z_t)     (silu(z) = z sigmoid(z))
//! ```
//!
//! the state cotangent `S_t = dL/ds_t` starts from `S = dfinal_states[b, h]` (or 0) after the
//! last token and runs backwards in time; at token `t` (from `seqlen - 1` down to 0):
//!
//! ```text
//! ybar_t = dout_t * silu(z_t)                          (dout_t without z)
//! dz_t   = dout_t * y_t * sigmoid(z_t) (1 + z_t (1 - sigmoid(z_t)))
//! S      = S + ybar_t C_t^T                            (S is now dL/ds_t, all of it)
//! dC_t  += s_t^T ybar_t          dD += ybar_t * x_t     dx_t = D ybar_t
//! du_t   = S B_t                 dB_t += S^T u_t
//! da_t   = <S, s_{t-1}>          (0 at a reset)
//! S      = a_t S                 (0 at a reset: the gradient flow is cut there)
//! dx_t  += dt'_t du_t
//! ddt'_t = <du_t, x_t> + da_t a_t A[h]                 dA[h] += da_t a_t dt'_t
//! dsp_t  = ddt'_t where lo <= sp_t <= hi, 0 where clamped (sp_t < lo or sp_t > hi)
//! ddt_t  = dsp_t * sigmoid(v_t) when softplus applies (v_t <= 20), dsp_t otherwise
//! ddt_bias[h] += ddt_t
//! ```
//!
//! and `dinitial_states[b, h] = S` after token 0 (0 when `seq_idx[b, 0] != 0`: the initial
//! state does not reach the first run then). `dB` and `dC` of a group sum the heads of the
//! group; `dA`, `ddt_bias` and `dD` sum over rows and tokens. At the forward's two kinks the
//! derivative is mamba_ssm's: the clamp passes the gradient where `lo <= sp_t <= hi`
//! (boundaries included) and stops it strictly outside; softplus's derivative is
//! `sigmoid(v)` up to its threshold `v <= 20` and 1 above, the derivative of the branch the
//! forward took. `docs/math.md` derives every line.
//!
//! # Order of the sums
//! Every sum is taken in a fixed order, whatever the number of threads: the per-token terms
//! in decreasing `t`; over `p` and `n` as the loops below run them (4 interleaved partial
//! sums, added in a fixed order); `dB`, `dC` of a group over its heads in increasing `h`;
//! `dA`, `ddt_bias`, `dD` over rows in increasing `b` (each row's sum over its tokens first).
//!
//! # Memory
//! One (row, head) pair at a time per task: the forward states are recomputed backwards one
//! block of [`BLOCK`] tokens at a time from checkpoints (the state before each block, kept by
//! a first forward sweep), so a task holds `(seqlen / BLOCK + BLOCK) * headdim * dstate`
//! values, not `seqlen * headdim * dstate`.
use ndarray::{Array1, Array3, Array4, ArrayD, ArrayView4, IxDyn};
use rayon::prelude::*;

use crate::problem::{check_finite, check_shape, softplus};
use crate::{Problem, Real, ReferenceError};

/// Tokens per recomputed block of forward states.
pub const BLOCK: usize = 16;

/// The gradients of every differentiable input of a forward problem, in mamba_ssm's names and
/// the shapes of the inputs they belong to. The optional ones are present exactly when the
/// problem has the input.
#[allow(non_snake_case)]
#[derive(Debug, Clone)]
pub struct Gradients<T> {
    /// `[batch, seqlen, nheads, headdim]`.
    pub dx: Array4<T>,
    /// With respect to the raw `dt` (before bias, softplus and clamp): `[batch, seqlen, nheads]`.
    pub ddt: Array3<T>,
    /// `[nheads]`.
    pub dA: Array1<T>,
    /// `[batch, seqlen, ngroups, dstate]`.
    pub dB: Array4<T>,
    /// `[batch, seqlen, ngroups, dstate]`.
    pub dC: Array4<T>,
    /// `[nheads]` or `[nheads, headdim]`, as `D`.
    pub dD: Option<ArrayD<T>>,
    /// `[batch, seqlen, nheads, headdim]`.
    pub dz: Option<Array4<T>>,
    /// `[nheads]`.
    pub ddt_bias: Option<Array1<T>>,
    /// `[batch, nheads, headdim, dstate]`.
    pub dinitial_states: Option<Array4<T>>,
}

impl<T> Gradients<T> {
    /// Every gradient present, with its name (mamba_ssm's), in a fixed order.
    pub fn named(&self) -> Vec<(&'static str, ndarray::ArrayViewD<'_, T>)> {
        let mut v = vec![
            ("dx", self.dx.view().into_dyn()),
            ("ddt", self.ddt.view().into_dyn()),
            ("dA", self.dA.view().into_dyn()),
            ("dB", self.dB.view().into_dyn()),
            ("dC", self.dC.view().into_dyn()),
        ];
        if let Some(a) = &self.dD {
            v.push(("dD", a.view()));
        }
        if let Some(a) = &self.dz {
            v.push(("dz", a.view().into_dyn()));
        }
        if let Some(a) = &self.ddt_bias {
            v.push(("ddt_bias", a.view().into_dyn()));
        }
        if let Some(a) = &self.dinitial_states {
            v.push(("dinitial_states", a.view().into_dyn()));
        }
        v
    }
}

/// The gradients of the forward at `p`, pulled back from `dout` and `dfinal_states`.
///
/// # Errors
/// [`ReferenceError::InvalidProblem`] naming the tensor when `dout` or `dfinal_states` has the
/// wrong shape or a non-finite value.
///
/// # Example
/// ```
/// use ssd_reference::random::{random_problem, ProblemSpec};
/// use ssd_reference::{adjoint, naive, Dims};
///
/// let p = random_problem(&ProblemSpec::plain(Dims::new(1, 5, 2, 3, 1, 4)), 7).unwrap();
/// // L = sum(out): the gradient of a sum is a tensor of ones.
/// let dout = ndarray::Array4::<f64>::ones((1, 5, 2, 3));
/// let g = adjoint::backward(&p, dout.view(), None).unwrap();
/// assert_eq!(g.dx.shape(), &[1, 5, 2, 3]);
/// assert_eq!(g.dB.shape(), &[1, 5, 1, 4]);
/// # let _ = naive::forward(&p);
/// ```
pub fn backward<T: Real>(
    p: &Problem<T>,
    dout: ArrayView4<T>,
    dfinal_states: Option<ArrayView4<T>>,
) -> Result<Gradients<T>, ReferenceError> {
    let d = *p.dims();
    let (bt, l, nh, hd, ng, ds) = (d.batch, d.seqlen, d.nheads, d.headdim, d.ngroups, d.dstate);
    check_shape("dout", dout.shape(), &[bt, l, nh, hd])?;
    check_finite("dout", &dout)?;
    if let Some(f) = &dfinal_states {
        check_shape("dfinal_states", f.shape(), &[bt, nh, hd, ds])?;
        check_finite("dfinal_states", f)?;
    }
    let i = p.inputs();
    let x = i.x.as_standard_layout();
    let bm = i.B.as_standard_layout();
    let cm = i.C.as_standard_layout();
    let z = i.z.as_ref().map(|z| z.as_standard_layout());
    let go = dout.as_standard_layout();
    let flat = Flat {
        x: x.as_slice().expect("standard layout"),
        bm: bm.as_slice().expect("standard layout"),
        cm: cm.as_slice().expect("standard layout"),
        z: z.as_ref().map(|z| z.as_slice().expect("standard layout")),
        dout: go.as_slice().expect("standard layout"),
    };

    let mut g = Gradients {
        dx: Array4::zeros((bt, l, nh, hd)),
        ddt: Array3::zeros((bt, l, nh)),
        dA: Array1::zeros(nh),
        dB: Array4::zeros((bt, l, ng, ds)),
        dC: Array4::zeros((bt, l, ng, ds)),
        dD: i.D.as_ref().map(|a| ArrayD::zeros(IxDyn(a.shape()))),
        dz: i.z.as_ref().map(|_| Array4::zeros((bt, l, nh, hd))),
        ddt_bias: i.dt_bias.as_ref().map(|_| Array1::zeros(nh)),
        dinitial_states: i
            .initial_states
            .as_ref()
            .map(|_| Array4::zeros((bt, nh, hd, ds))),
    };

    // Units (b, h) in b-major, h-minor order, computed in waves of independent tasks and
    // added into the sums in unit order: the bits do not depend on the wave size.
    let units: Vec<(usize, usize)> = (0..bt).flat_map(|b| (0..nh).map(move |h| (b, h))).collect();
    let wave = (2 * rayon::current_num_threads()).max(1);
    for part in units.chunks(wave) {
        let results: Vec<Unit<T>> = part
            .par_iter()
            .map(|&(b, h)| {
                let fin = dfinal_states
                    .as_ref()
                    .map(|f| f.slice(ndarray::s![b, h, .., ..]));
                unit(p, &flat, b, h, fin)
            })
            .collect();
        for (&(b, h), r) in part.iter().zip(results) {
            scatter(p, &mut g, b, h, r);
        }
    }
    Ok(g)
}

/// The inputs as flat row-major slices.
struct Flat<'a, T> {
    x: &'a [T],
    bm: &'a [T],
    cm: &'a [T],
    z: Option<&'a [T]>,
    dout: &'a [T],
}

/// One (row, head) pair's share of the gradients.
struct Unit<T> {
    /// `[seqlen, headdim]`.
    dx: Vec<T>,
    /// `[seqlen, headdim]` when the problem has `z`.
    dz: Vec<T>,
    /// `[seqlen]`: with respect to the raw `dt`.
    ddt: Vec<T>,
    /// This head's terms of `dB` and `dC`, `[seqlen, dstate]`.
    db: Vec<T>,
    dc: Vec<T>,
    /// `[headdim]`: this head's terms of `dD`, per channel (summed for a per-head `D`).
    dd: Vec<T>,
    da: T,
    ddt_bias: T,
    /// `[headdim, dstate]`.
    dinit: Vec<T>,
}

/// Per-token values of the forward for one (row, head) pair.
struct Steps<T> {
    /// `dt'_t`.
    dtp: Vec<T>,
    /// `a_t` (0 at a reset).
    decay: Vec<T>,
    reset: Vec<bool>,
    /// `d dt'_t / d dt_t` as mamba_ssm defines it: 0 where clamped, softplus's derivative
    /// (of the branch taken) otherwise.
    ddtp_ddt: Vec<T>,
}

fn steps<T: Real>(p: &Problem<T>, b: usize, h: usize) -> Steps<T> {
    let d = *p.dims();
    let i = p.inputs();
    let o = p.options();
    let (lo, hi) = (T::lit(o.dt_limit.0), T::lit(o.dt_limit.1));
    let mut s = Steps {
        dtp: Vec::with_capacity(d.seqlen),
        decay: Vec::with_capacity(d.seqlen),
        reset: Vec::with_capacity(d.seqlen),
        ddtp_ddt: Vec::with_capacity(d.seqlen),
    };
    let mut prev_seq = 0i64;
    for t in 0..d.seqlen {
        let seq = p.seq_idx_at(b, t);
        let reset = seq != prev_seq;
        prev_seq = seq;
        let mut v = i.dt[[b, t, h]];
        if let Some(bias) = &i.dt_bias {
            v = v + bias[h];
        }
        let (sp, dsp_dv) = if o.dt_softplus {
            if v > T::lit(20.0) {
                (v, T::one())
            } else {
                (softplus(v), sigmoid(v))
            }
        } else {
            (v, T::one())
        };
        let dtp = sp.max(lo).min(hi);
        debug_assert!(dtp == p.dt_processed(b, t, h));
        let clamped = sp < lo || sp > hi;
        s.dtp.push(dtp);
        s.decay.push(if reset {
            T::zero()
        } else {
            (dtp * i.A[h]).exp()
        });
        s.reset.push(reset);
        s.ddtp_ddt.push(if clamped { T::zero() } else { dsp_dv });
    }
    s
}

#[inline]
fn sigmoid<T: Real>(v: T) -> T {
    T::one() / (T::one() + (-v).exp())
}

/// `sum_k a[k] b[k]` in 4 interleaved partial sums, `(s0 + s1) + (s2 + s3)`.
#[inline(always)]
fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut s = [T::zero(); 4];
    let mut ca = a.chunks_exact(4);
    let mut cb = b.chunks_exact(4);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for k in 0..4 {
            s[k] = s[k] + x[k] * y[k];
        }
    }
    for (k, (x, y)) in ca.remainder().iter().zip(cb.remainder()).enumerate() {
        s[k] = s[k] + *x * *y;
    }
    (s[0] + s[1]) + (s[2] + s[3])
}

/// One state row `p` of a token's step backwards (all slices `dstate` long).
struct Rows<'a, T> {
    /// `S[p, :]`, on entry from the later tokens only; on exit `a_t S[p, :]`, what token
    /// `t - 1` receives.
    sbar: &'a mut [T],
    s_t: &'a [T],
    s_prev: &'a [T],
    c: &'a [T],
    b: &'a [T],
    /// `dC_t` and `dB_t` of this head, accumulated over `p`.
    dc: &'a mut [T],
    db: &'a mut [T],
}

/// For one state row, in one pass over `n`: `S += ybar C^T`, `dC += ybar s_t`,
/// `du = <S, B>`, `dB += u S`, `da = <S, s_{t-1}>` (0 at a reset), `S = a S` (0 at a reset).
/// Returns `(du, da)`, each summed in 4 interleaved partial sums (`n mod 4`), added as
/// `(s0 + s1) + (s2 + s3)`.
#[inline(always)]
fn row_step<T: Real>(r: Rows<T>, ybar: T, u: T, a: T, reset: bool) -> (T, T) {
    let n = r.sbar.len();
    let (mut du, mut da) = ([T::zero(); 4], [T::zero(); 4]);
    let (a, keep) = if reset {
        (T::zero(), T::zero())
    } else {
        (a, T::one())
    };
    let (sbar, s_t, s_prev) = (&mut r.sbar[..n], &r.s_t[..n], &r.s_prev[..n]);
    let (c, b, dc, db) = (&r.c[..n], &r.b[..n], &mut r.dc[..n], &mut r.db[..n]);
    // Element-wise updates first (vector code), then the two dot products over the updated
    // row, then the decay.
    for k in 0..n {
        let s = ybar.mul_add(c[k], sbar[k]);
        sbar[k] = s;
        dc[k] = ybar.mul_add(s_t[k], dc[k]);
        db[k] = u.mul_add(s, db[k]);
    }
    let sb: &[T] = sbar;
    let full = n - n % 4;
    for ((s4, b4), p4) in sb[..full]
        .chunks_exact(4)
        .zip(b[..full].chunks_exact(4))
        .zip(s_prev[..full].chunks_exact(4))
    {
        for j in 0..4 {
            du[j] = s4[j].mul_add(b4[j], du[j]);
            da[j] = s4[j].mul_add(p4[j], da[j]);
        }
    }
    for k in full..n {
        du[k - full] = sb[k].mul_add(b[k], du[k - full]);
        da[k - full] = sb[k].mul_add(s_prev[k], da[k - full]);
    }
    for v in sbar.iter_mut() {
        *v = a * *v;
    }
    let da = da.map(|v| keep * v);
    (
        (du[0] + du[1]) + (du[2] + du[3]),
        (da[0] + da[1]) + (da[2] + da[3]),
    )
}

/// The state after a token from the state before it: `next = a prev + u B^T` (both
/// `[headdim, dstate]` row-major).
#[inline(always)]
fn step_into<T: Real>(next: &mut [T], prev: &[T], a: T, u: &[T], bt: &[T]) {
    let ds = bt.len();
    for ((row, prow), &up) in next.chunks_exact_mut(ds).zip(prev.chunks_exact(ds)).zip(u) {
        for ((v, &pv), &bn) in row.iter_mut().zip(prow).zip(bt) {
            *v = a.mul_add(pv, up * bn);
        }
    }
}

crate::simd::multiversion! {
    /// [`unit_body`], compiled for AVX2 + FMA where the processor has them (the same
    /// operations, so the same bits, on every path).
    fn unit[T: Real](
        p: &Problem<T>,
        f: &Flat<'_, T>,
        b: usize,
        h: usize,
        dfinal: Option<ndarray::ArrayView2<'_, T>>,
    ) -> Unit<T> {
        unit_body(p, f, b, h, dfinal)
    }
}

/// One (row, head) pair's share of the gradients: the forward sweep with its checkpoints, then
/// the backward sweep.
#[inline(always)]
fn unit_body<T: Real>(
    p: &Problem<T>,
    f: &Flat<T>,
    b: usize,
    h: usize,
    dfinal: Option<ndarray::ArrayView2<T>>,
) -> Unit<T> {
    let d = *p.dims();
    let i = p.inputs();
    let (l, hd, ds) = (d.seqlen, d.headdim, d.dstate);
    let g = d.group_of_head(h);
    let a_h = i.A[h];
    let x_at = |t: usize| ((b * l + t) * d.nheads + h) * hd;
    let bc_at = |t: usize| ((b * l + t) * d.ngroups + g) * ds;
    let st = steps(p, b, h);
    let d_skip: Vec<T> = (0..hd).map(|pp| p.d_skip(h, pp)).collect();
    let u_at = |t: usize, u: &mut [T]| {
        let x = &f.x[x_at(t)..x_at(t) + hd];
        for (v, &xv) in u.iter_mut().zip(x) {
            *v = st.dtp[t] * xv;
        }
    };

    // The states after each token of one block, `[BLOCK, headdim, dstate]`, from the state
    // before the block: filled once per block by the forward sweep and again, block by block
    // in reverse, by the backward sweep.
    let mut states = vec![T::zero(); BLOCK * hd * ds];
    let mut u = vec![T::zero(); hd];
    let block_states = |states: &mut [T], before: &[T], t0: usize, nt: usize, u: &mut [T]| {
        for k in 0..nt {
            let (done, rest) = states.split_at_mut(k * hd * ds);
            let prev = if k == 0 {
                before
            } else {
                &done[(k - 1) * hd * ds..]
            };
            let t = t0 + k;
            u_at(t, u);
            step_into(
                &mut rest[..hd * ds],
                prev,
                st.decay[t],
                u,
                &f.bm[bc_at(t)..bc_at(t) + ds],
            );
        }
    };

    // Forward sweep: the state before each block of BLOCK tokens.
    let nblocks = l.div_ceil(BLOCK);
    let mut ckpt = vec![T::zero(); nblocks * hd * ds];
    if let Some(s0) = &i.initial_states {
        for pp in 0..hd {
            for n in 0..ds {
                ckpt[pp * ds + n] = s0[[b, h, pp, n]];
            }
        }
    }
    for blk in 0..nblocks - 1 {
        let (before, after) = ckpt.split_at_mut((blk + 1) * hd * ds);
        block_states(
            &mut states,
            &before[blk * hd * ds..],
            blk * BLOCK,
            BLOCK,
            &mut u,
        );
        after[..hd * ds].copy_from_slice(&states[(BLOCK - 1) * hd * ds..]);
    }

    let mut r = Unit {
        dx: vec![T::zero(); l * hd],
        dz: if f.z.is_some() {
            vec![T::zero(); l * hd]
        } else {
            Vec::new()
        },
        ddt: vec![T::zero(); l],
        db: vec![T::zero(); l * ds],
        dc: vec![T::zero(); l * ds],
        dd: vec![T::zero(); hd],
        da: T::zero(),
        ddt_bias: T::zero(),
        dinit: Vec::new(),
    };
    // S = dL/ds_t, `[headdim, dstate]` row-major.
    let mut sbar = vec![T::zero(); hd * ds];
    if let Some(fin) = dfinal {
        for pp in 0..hd {
            for n in 0..ds {
                sbar[pp * ds + n] = fin[[pp, n]];
            }
        }
    }
    let mut ybar = vec![T::zero(); hd];
    let mut du = vec![T::zero(); hd];
    for blk in (0..nblocks).rev() {
        let t0 = blk * BLOCK;
        let nt = BLOCK.min(l - t0);
        let before = &ckpt[blk * hd * ds..(blk + 1) * hd * ds];
        block_states(&mut states, before, t0, nt, &mut u);
        for k in (0..nt).rev() {
            let t = t0 + k;
            let s_t = &states[k * hd * ds..(k + 1) * hd * ds];
            let s_prev = if k == 0 {
                before
            } else {
                &states[(k - 1) * hd * ds..k * hd * ds]
            };
            let xo = x_at(t);
            let x = &f.x[xo..xo + hd];
            let go = &f.dout[xo..xo + hd];
            let bt = &f.bm[bc_at(t)..bc_at(t) + ds];
            let ct = &f.cm[bc_at(t)..bc_at(t) + ds];
            u_at(t, &mut u);
            // The gate.
            match f.z {
                Some(z) => {
                    let z = &z[xo..xo + hd];
                    for pp in 0..hd {
                        let y = dot(&s_t[pp * ds..(pp + 1) * ds], ct) + d_skip[pp] * x[pp];
                        let sg = sigmoid(z[pp]);
                        ybar[pp] = go[pp] * (z[pp] * sg);
                        r.dz[t * hd + pp] =
                            go[pp] * y * (sg * (T::one() + z[pp] * (T::one() - sg)));
                    }
                }
                None => ybar.copy_from_slice(go),
            }
            // The skip connection.
            for pp in 0..hd {
                r.dd[pp] = r.dd[pp] + ybar[pp] * x[pp];
                r.dx[t * hd + pp] = d_skip[pp] * ybar[pp];
            }
            // Through y_t = s_t C_t, then s_t = a_t s_{t-1} + u_t B_t^T, one state row at a
            // time.
            let dc = &mut r.dc[t * ds..(t + 1) * ds];
            let db = &mut r.db[t * ds..(t + 1) * ds];
            let (a_t, reset) = (st.decay[t], st.reset[t]);
            let mut da = T::zero();
            for pp in 0..hd {
                let rows = Rows {
                    sbar: &mut sbar[pp * ds..(pp + 1) * ds],
                    s_t: &s_t[pp * ds..(pp + 1) * ds],
                    s_prev: &s_prev[pp * ds..(pp + 1) * ds],
                    c: ct,
                    b: bt,
                    dc: &mut *dc,
                    db: &mut *db,
                };
                let (dup, dap) = row_step(rows, ybar[pp], u[pp], a_t, reset);
                du[pp] = dup;
                da = da + dap;
            }
            // Through u_t = dt'_t x_t and a_t = exp(dt'_t A).
            for (v, &dup) in r.dx[t * hd..(t + 1) * hd].iter_mut().zip(&du) {
                *v = *v + st.dtp[t] * dup;
            }
            let mut ddtp = dot(&du, x);
            if !reset {
                ddtp = ddtp + da * a_t * a_h;
                r.da = r.da + da * a_t * st.dtp[t];
            }
            let ddt = ddtp * st.ddtp_ddt[t];
            r.ddt[t] = ddt;
            r.ddt_bias = r.ddt_bias + ddt;
        }
    }
    if i.initial_states.is_some() {
        r.dinit = sbar;
    }
    r
}

/// Adds one unit's share into the gradients (called in unit order).
fn scatter<T: Real>(p: &Problem<T>, g: &mut Gradients<T>, b: usize, h: usize, r: Unit<T>) {
    let d = *p.dims();
    let (l, hd, ds) = (d.seqlen, d.headdim, d.dstate);
    let grp = d.group_of_head(h);
    for t in 0..l {
        let mut dx = g.dx.slice_mut(ndarray::s![b, t, h, ..]);
        dx.assign(&ndarray::ArrayView1::from(&r.dx[t * hd..(t + 1) * hd]));
        if let Some(dz) = &mut g.dz {
            let mut dz = dz.slice_mut(ndarray::s![b, t, h, ..]);
            dz.assign(&ndarray::ArrayView1::from(&r.dz[t * hd..(t + 1) * hd]));
        }
        g.ddt[[b, t, h]] = r.ddt[t];
        let mut db = g.dB.slice_mut(ndarray::s![b, t, grp, ..]);
        db.zip_mut_with(
            &ndarray::ArrayView1::from(&r.db[t * ds..(t + 1) * ds]),
            |a, &v| *a = *a + v,
        );
        let mut dc = g.dC.slice_mut(ndarray::s![b, t, grp, ..]);
        dc.zip_mut_with(
            &ndarray::ArrayView1::from(&r.dc[t * ds..(t + 1) * ds]),
            |a, &v| *a = *a + v,
        );
    }
    g.dA[h] = g.dA[h] + r.da;
    if let Some(db) = &mut g.ddt_bias {
        db[h] = db[h] + r.ddt_bias;
    }
    if let Some(dd) = &mut g.dD {
        if dd.ndim() == 1 {
            let sum = r.dd.iter().fold(T::zero(), |a, &v| a + v);
            dd[[h]] = dd[[h]] + sum;
        } else {
            for pp in 0..hd {
                dd[[h, pp]] = dd[[h, pp]] + r.dd[pp];
            }
        }
    }
    if let Some(di) = &mut g.dinitial_states {
        for pp in 0..hd {
            for n in 0..ds {
                di[[b, h, pp, n]] = r.dinit[pp * ds + n];
            }
        }
    }
}
