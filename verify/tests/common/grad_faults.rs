//! A compact chunked backward pass in plain loops, with a switch that plants one of the bugs
//! kernel authors really make in a backward pass. Test-only: it measures the power of the
//! gradient checks, as [`super::faults`] does for the forward pass.
//!
//! With [`GradFault::None`] it computes the vector-Jacobian product of the contract's
//! function, the same quantity as `ssd_reference::adjoint::backward` (a test checks it), but
//! by the chunked algorithm a kernel uses; every other [`GradFault`] is wrong in one specific
//! way. [`Rounding`] (the forward's, reused) rounds every matrix-product operand as a TF32 or
//! BF16 tensor-core kernel does; with [`Rounding::Bf16`] the inputs `x`, `B`, `C`, `z` and the
//! upstream `dout` are rounded to bf16 first as well, as a bf16 training kernel receives them
//! (`dfinal_states`, the states and every other input stay in the working precision).
//!
//! # The algorithm, per (batch row, head), chunk by chunk
//! With the chunk's cumsum `cs_i` of `dt' A`, `e_i = exp(cs_i)`, the mask `carried_i`
//! (`seq_i` equals the sequence of the token before the chunk), `w_j = exp(cs_last - cs_j)
//! dt'_j` for `j` in the chunk's last run (else 0), `G = C B^T`, `M_ij = G_ij exp(cs_i - cs_j)
//! dt'_j` for `j <= i` in one run (else 0), and `ybar = dout silu(z)` (or `dout`):
//!
//! 1. Forward recomputation: the states `S_c` entering every chunk (`x^T diag(w) B` per
//!    chunk, state passing with `exp(cs_last)`, 0 at a reset) and, when there is a gate, `y`.
//! 2. Backwards over chunks, with `Sbar` the cotangent of the state after the chunk (starting
//!    from `dfinal_states`):
//!    - chunk-state pullback: `P = B Sbar^T`, `Q = X Sbar`; `dx_j += w_j P_j`, `dB_j += w_j
//!      Q_j`, `dw_j = <x_j, P_j>` into `ddt'_j` and `dcs`;
//!    - state passing: `dcs_last += <Sbar, S_c> exp(cs_last)` (not at a reset), and the new
//!      `Sbar = exp(cs_last) Sbar + (diag(e) Ybar_carried)^T C`;
//!    - carried term: `dC_i += e_i (Ybar S_c)_i`, and its `dcs_i`;
//!    - intra-chunk term: `dM = Ybar X^T`, `dx += M^T Ybar`, `dG = dM (.) decay (.) dt'`,
//!      `dC += dG B`, `dB += dG^T C`, and `dM (.) M` into `dcs`, `dM (.) G (.) decay` into
//!      `ddt'`;
//!    - skip term: `dx += D ybar`, `dD += ybar x`;
//!    - the cumsum's pullback: `ddt'_k += A sum_{k' >= k} dcs_k'`, `dA += dt'_k (same sum)`.
//! 3. Step processing: `ddt = ddt' sigmoid(v)` (softplus branch, `v <= 20`) or `ddt'`, and 0
//!    strictly outside the clamp; `ddt_bias` sums `ddt`. `dinitial_states` is the final `Sbar`.
//!
//! # The matrix products (the operands [`Rounding`] rounds)
//! Forward recomputation: `x^T (diag(w) B)` (operands `x` and `w_j B_j`), `C B^T`, `M x` (`M`
//! rounded after decay and `dt'`), `C S_c^T`. Backward: `(diag(e) Ybar)^T C` (the state
//! cotangent from `dout`: `e_i ybar_i` and `C`), `Ybar S_c` (carried `dC`), `Ybar X^T` (`dM`),
//! `M^T Ybar` (intra `dx`), `dG B` and `dG^T C` (intra `dC`, `dB`; `dG` rounded after decay
//! and `dt'`), `B Sbar^T` and `X Sbar` (chunk-state `dx`, `dB`). Everything else (the cumsum,
//! exponentials, masks, the state passing, `<x_j, P_j>`, `<Sbar, S_c>`, the gate, the skip
//! term, the step processing) stays in the working precision.
#![allow(dead_code)]

use ndarray::{Array1, Array3, Array4, ArrayD, ArrayView4, IxDyn};
use rayon::prelude::*;
use ssd_reference::adjoint::Gradients;
use ssd_reference::{Problem, Real};

pub use super::faults::Rounding;

/// One deliberately wrong variant of the chunked backward pass (or none).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GradFault {
    /// The correct algorithm.
    None,
    /// In the `dA_cumsum` gradient of the chunk states (what reaches `dA` and `ddt`), the
    /// decay taken from the chunk's start, `exp(cs_j)`, instead of to its end,
    /// `exp(cs_last - cs_j)`.
    DaDecayWrongEnd,
    /// softplus's derivative `sigmoid(v)` left out: `ddt = ddt'` where softplus applies.
    SoftplusDerivativeMissing,
    /// The clamp's mask inverted: the gradient passes strictly outside `[lo, hi]` and stops
    /// inside.
    ClampMaskInverted,
    /// `dz = dout y sigmoid(z)`: the derivative of `sigmoid(z)` inside `silu` forgotten.
    DzWithoutSiluDerivative,
    /// A per-channel `D` reduced like a per-head one: every channel `dD[h, p]` gets the
    /// head's total over tokens and `headdim` (summed over the wrong axis too). A per-head
    /// `D` is unaffected.
    DdSummedOverWrongAxis,
    /// The backward state pass ignores `seq_idx`: the state cotangent crosses every chunk
    /// boundary with `exp(cs_last)`, also where a reset falls inside the chunk (the forward
    /// recomputation stays right).
    ResetIgnoredInBackward,
    /// `dinitial_states` returned as zeros.
    DinitialStatesDropped,
    /// `ddt_bias` not summed over tokens: only each row's last token's `ddt`.
    DdtBiasNotSummed,
    /// `dB` without the `dt'` scaling: the chunk-state and intra-chunk `dB` terms use
    /// `exp(..)` where they need `exp(..) dt'_j`.
    DbWithoutDtScaling,
    /// `dC` from the state before the token: the intra-chunk `dC_i` sums over `j < i`,
    /// leaving out the token's own contribution `dt'_i x_i B_i^T` to the state it reads.
    DcStateBeforeToken,
    /// `dfinal_states` ignored: the state cotangent starts from 0.
    DfinalStatesIgnored,
    /// The group reduction of `dB` over the wrong heads: head `h` adds into group
    /// `h % ngroups` instead of `h / (nheads / ngroups)`.
    DbGroupWrongHeads,
}

impl GradFault {
    /// Every wrong variant.
    pub const WRONG: [GradFault; 12] = [
        GradFault::DaDecayWrongEnd,
        GradFault::SoftplusDerivativeMissing,
        GradFault::ClampMaskInverted,
        GradFault::DzWithoutSiluDerivative,
        GradFault::DdSummedOverWrongAxis,
        GradFault::ResetIgnoredInBackward,
        GradFault::DinitialStatesDropped,
        GradFault::DdtBiasNotSummed,
        GradFault::DbWithoutDtScaling,
        GradFault::DcStateBeforeToken,
        GradFault::DfinalStatesIgnored,
        GradFault::DbGroupWrongHeads,
    ];
}

fn sigmoid<T: Real>(v: T) -> T {
    T::one() / (T::one() + (-v).exp())
}

/// The gradients of the forward at `p`, pulled back from `dout` and `dfinal` by the chunked
/// algorithm, with `fault` planted and operands rounded per `rounding`. The optional
/// gradients are present exactly when the problem has the input (as the adjoint's).
///
/// # Panics
/// If `dout` or `dfinal` does not have the shape the problem implies.
pub fn backward<T: Real>(
    p: &Problem<T>,
    dout: ArrayView4<T>,
    dfinal: Option<ArrayView4<T>>,
    fault: GradFault,
    rounding: Rounding,
) -> Gradients<T> {
    let d = *p.dims();
    let (bt, l, nh, hd, ng, ds) = (d.batch, d.seqlen, d.nheads, d.headdim, d.ngroups, d.dstate);
    assert_eq!(dout.shape(), [bt, l, nh, hd], "dout");
    if let Some(f) = &dfinal {
        assert_eq!(f.shape(), [bt, nh, hd, ds], "dfinal_states");
    }
    // A bf16 kernel receives x, B, C, z and dout in bf16.
    let pre = |a: ArrayView4<T>| match rounding {
        Rounding::Bf16 => a.mapv(|v| rounding.apply(v)),
        _ => a.to_owned(),
    };
    let i = p.inputs();
    let inp = Rounded {
        x: pre(i.x.view()),
        b: pre(i.B.view()),
        c: pre(i.C.view()),
        z: i.z.as_ref().map(|z| pre(z.view())),
        dout: pre(dout),
    };
    let units: Vec<Unit<T>> = (0..bt * nh)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / nh, bh % nh);
            let fin = dfinal.as_ref().map(|f| f.slice(ndarray::s![b, h, .., ..]));
            unit(p, &inp, b, h, fin, fault, rounding)
        })
        .collect();

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
    for (bh, u) in units.into_iter().enumerate() {
        let (b, h) = (bh / nh, bh % nh);
        let grp = d.group_of_head(h);
        let grp_b = if fault == GradFault::DbGroupWrongHeads {
            h % ng
        } else {
            grp
        };
        for t in 0..l {
            for pp in 0..hd {
                g.dx[[b, t, h, pp]] = u.dx[t * hd + pp];
                if let Some(dz) = &mut g.dz {
                    dz[[b, t, h, pp]] = u.dz[t * hd + pp];
                }
            }
            g.ddt[[b, t, h]] = u.ddt[t];
            for n in 0..ds {
                g.dB[[b, t, grp_b, n]] = g.dB[[b, t, grp_b, n]] + u.db[t * ds + n];
                g.dC[[b, t, grp, n]] = g.dC[[b, t, grp, n]] + u.dc[t * ds + n];
            }
        }
        g.dA[h] = g.dA[h] + u.da;
        if let Some(bias) = &mut g.ddt_bias {
            let v = if fault == GradFault::DdtBiasNotSummed {
                u.ddt[l - 1]
            } else {
                u.ddt.iter().fold(T::zero(), |a, &v| a + v)
            };
            bias[h] = bias[h] + v;
        }
        if let Some(dd) = &mut g.dD {
            let total = u.dd.iter().fold(T::zero(), |a, &v| a + v);
            if dd.ndim() == 1 {
                dd[[h]] = dd[[h]] + total;
            } else {
                for pp in 0..hd {
                    let v = if fault == GradFault::DdSummedOverWrongAxis {
                        total
                    } else {
                        u.dd[pp]
                    };
                    dd[[h, pp]] = dd[[h, pp]] + v;
                }
            }
        }
        if let Some(di) = &mut g.dinitial_states {
            if fault != GradFault::DinitialStatesDropped {
                for pp in 0..hd {
                    for n in 0..ds {
                        di[[b, h, pp, n]] = u.sbar0[pp * ds + n];
                    }
                }
            }
        }
    }
    g
}

/// The inputs a kernel reads (rounded to bf16 for [`Rounding::Bf16`]).
struct Rounded<T> {
    x: Array4<T>,
    b: Array4<T>,
    c: Array4<T>,
    z: Option<Array4<T>>,
    dout: Array4<T>,
}

/// One (row, head) pair's share of the gradients.
struct Unit<T> {
    /// `[seqlen, headdim]`.
    dx: Vec<T>,
    dz: Vec<T>,
    /// `[seqlen]`, with respect to the raw `dt`.
    ddt: Vec<T>,
    /// `[seqlen, dstate]`: this head's terms.
    db: Vec<T>,
    dc: Vec<T>,
    /// `[headdim]`: `sum_t ybar x` per channel.
    dd: Vec<T>,
    da: T,
    /// The state cotangent before token 0, `[headdim, dstate]`.
    sbar0: Vec<T>,
}

#[allow(clippy::too_many_arguments)]
fn unit<T: Real>(
    p: &Problem<T>,
    inp: &Rounded<T>,
    b: usize,
    h: usize,
    dfinal: Option<ndarray::ArrayView2<T>>,
    fault: GradFault,
    r: Rounding,
) -> Unit<T> {
    let d = *p.dims();
    let i = p.inputs();
    let o = p.options();
    let (tl, hd, ds, cl) = (d.seqlen, d.headdim, d.dstate, o.chunk_size);
    let nc = p.nchunks();
    let g = d.group_of_head(h);
    let a = i.A[h];
    let q = |v: T| r.apply(v);
    let seq = |t: usize| p.seq_idx_at(b, t);
    let zero = T::zero();

    // The row's inputs, row-major per token.
    let x: Vec<T> = inp
        .x
        .slice(ndarray::s![b, .., h, ..])
        .iter()
        .copied()
        .collect();
    let bm: Vec<T> = inp
        .b
        .slice(ndarray::s![b, .., g, ..])
        .iter()
        .copied()
        .collect();
    let cm: Vec<T> = inp
        .c
        .slice(ndarray::s![b, .., g, ..])
        .iter()
        .copied()
        .collect();
    let go: Vec<T> = inp
        .dout
        .slice(ndarray::s![b, .., h, ..])
        .iter()
        .copied()
        .collect();
    let z: Option<Vec<T>> =
        (inp.z.as_ref()).map(|z| z.slice(ndarray::s![b, .., h, ..]).iter().copied().collect());
    let dskip: Vec<T> = (0..hd).map(|pp| p.d_skip(h, pp)).collect();
    // The same, rounded as matrix-product operands.
    let rnd = |v: &[T]| v.iter().map(|&v| q(v)).collect::<Vec<T>>();
    let (xr, br, cr) = (rnd(&x), rnd(&bm), rnd(&cm));

    // Step processing: dt' and d dt' / d dt (mamba_ssm's derivative at the kinks).
    let (lo, hi) = (T::lit(o.dt_limit.0), T::lit(o.dt_limit.1));
    let mut dtp = vec![zero; tl];
    let mut deriv = vec![zero; tl];
    for t in 0..tl {
        let mut v = i.dt[[b, t, h]];
        if let Some(bias) = &i.dt_bias {
            v = v + bias[h];
        }
        let (sp, dsp) = if o.dt_softplus && v <= T::lit(20.0) {
            let ds = if fault == GradFault::SoftplusDerivativeMissing {
                T::one()
            } else {
                sigmoid(v)
            };
            (v.exp().ln_1p(), ds)
        } else {
            (v, T::one())
        };
        dtp[t] = sp.max(lo).min(hi);
        let inside = lo <= sp && sp <= hi;
        let pass = inside != (fault == GradFault::ClampMaskInverted);
        deriv[t] = if pass { dsp } else { zero };
    }

    // The within-chunk cumsum of dt' A (valid tokens only; padding would keep it flat).
    let mut cs = vec![zero; tl];
    for c in 0..nc {
        let mut acc = zero;
        for t in c * cl..tl.min((c + 1) * cl) {
            acc = acc + dtp[t] * a;
            cs[t] = acc;
        }
    }
    let span = |c: usize| (c * cl, tl.min((c + 1) * cl));
    let seq_before = |c: usize| if c == 0 { 0 } else { seq(c * cl - 1) };

    // 1. Forward recomputation: the state entering every chunk, `states[c]`, and the last.
    let mut states = vec![zero; (nc + 1) * hd * ds];
    if let Some(s0) = &i.initial_states {
        for pp in 0..hd {
            for n in 0..ds {
                states[pp * ds + n] = s0[[b, h, pp, n]];
            }
        }
    }
    for c in 0..nc {
        let (t0, t1) = span(c);
        let (last, seq_last) = (t1 - 1, seq(t1 - 1));
        let scale = if seq_last == seq_before(c) {
            cs[last].exp()
        } else {
            zero
        };
        let (before, after) = states.split_at_mut((c + 1) * hd * ds);
        let (prev, next) = (&before[c * hd * ds..], &mut after[..hd * ds]);
        for k in 0..hd * ds {
            next[k] = scale * prev[k];
        }
        for j in (t0..t1).filter(|&j| seq(j) == seq_last) {
            let w = (cs[last] - cs[j]).exp() * dtp[j];
            for pp in 0..hd {
                let xv = xr[j * hd + pp];
                for n in 0..ds {
                    next[pp * ds + n] = next[pp * ds + n] + xv * q(bm[j * ds + n] * w);
                }
            }
        }
    }

    let mut u = Unit {
        dx: vec![zero; tl * hd],
        dz: vec![zero; if z.is_some() { tl * hd } else { 0 }],
        ddt: vec![zero; tl],
        db: vec![zero; tl * ds],
        dc: vec![zero; tl * ds],
        dd: vec![zero; hd],
        da: zero,
        sbar0: Vec::new(),
    };
    let mut ddtp = vec![zero; tl];
    // Sbar: the cotangent of the state after the current chunk, `[headdim, dstate]`.
    let mut sbar = vec![zero; hd * ds];
    if let (Some(f), false) = (&dfinal, fault == GradFault::DfinalStatesIgnored) {
        for pp in 0..hd {
            for n in 0..ds {
                sbar[pp * ds + n] = f[[pp, n]];
            }
        }
    }
    let mut ybar = vec![zero; cl * hd];
    let mut dcs = vec![zero; cl];
    let mut g_row = vec![zero; cl];
    for c in (0..nc).rev() {
        let (t0, t1) = span(c);
        let len = t1 - t0;
        let (last, seq_last, seq_prev) = (t1 - 1, seq(t1 - 1), seq_before(c));
        let s_c = &states[c * hd * ds..(c + 1) * hd * ds];
        let carried = |t: usize| seq(t) == seq_prev;
        dcs[..len].fill(zero);
        let (scr, sbr) = (rnd(s_c), rnd(&sbar));

        // The gate: ybar, and dz from the recomputed y.
        for ii in 0..len {
            let t = t0 + ii;
            let Some(z) = &z else {
                ybar[ii * hd..(ii + 1) * hd].copy_from_slice(&go[t * hd..(t + 1) * hd]);
                continue;
            };
            let gr: Vec<T> = (t0..=t).map(|j| gram(&cr, &br, t, j, ds)).collect();
            let e = cs[t].exp();
            for pp in 0..hd {
                let mut y = zero;
                if carried(t) {
                    for n in 0..ds {
                        y = y + cr[t * ds + n] * scr[pp * ds + n];
                    }
                    y = y * e;
                }
                let mut intra = zero;
                for j in (t0..=t).filter(|&j| seq(j) == seq(t)) {
                    let m = q(gr[j - t0] * (cs[t] - cs[j]).exp() * dtp[j]);
                    intra = intra + m * xr[j * hd + pp];
                }
                let y = y + intra + dskip[pp] * x[t * hd + pp];
                let (zv, sg) = (z[t * hd + pp], sigmoid(z[t * hd + pp]));
                ybar[ii * hd + pp] = go[t * hd + pp] * (zv * sg);
                let dsilu = if fault == GradFault::DzWithoutSiluDerivative {
                    sg
                } else {
                    sg * (T::one() + zv * (T::one() - sg))
                };
                u.dz[t * hd + pp] = go[t * hd + pp] * y * dsilu;
            }
        }

        let ybr = rnd(&ybar[..len * hd]);

        // Chunk-state pullback: P = B Sbar^T, Q = X Sbar over the chunk's last run.
        for j in (t0..t1).filter(|&j| seq(j) == seq_last) {
            let decay = (cs[last] - cs[j]).exp();
            let w = decay * dtp[j];
            let wb = if fault == GradFault::DbWithoutDtScaling {
                decay
            } else {
                w
            };
            let mut dw = zero;
            for pp in 0..hd {
                let mut pj = zero;
                for n in 0..ds {
                    pj = pj + br[j * ds + n] * sbr[pp * ds + n];
                }
                u.dx[j * hd + pp] = u.dx[j * hd + pp] + w * pj;
                dw = dw + x[j * hd + pp] * pj;
            }
            for n in 0..ds {
                let mut qj = zero;
                for pp in 0..hd {
                    qj = qj + xr[j * hd + pp] * sbr[pp * ds + n];
                }
                u.db[j * ds + n] = u.db[j * ds + n] + wb * qj;
            }
            ddtp[j] = ddtp[j] + dw * decay;
            let wa = if fault == GradFault::DaDecayWrongEnd {
                cs[j].exp() * dtp[j]
            } else {
                w
            };
            dcs[last - t0] = dcs[last - t0] + dw * wa;
            dcs[j - t0] = dcs[j - t0] - dw * wa;
        }

        // State passing, backwards: Sbar_c = scale Sbar_{c+1} + (diag(e) Ybar_carried)^T C.
        let reset = seq_last != seq_prev && fault != GradFault::ResetIgnoredInBackward;
        let scale = if reset { zero } else { cs[last].exp() };
        if !reset {
            let dscale = (0..hd * ds).fold(zero, |acc, k| acc + sbar[k] * s_c[k]);
            dcs[last - t0] = dcs[last - t0] + dscale * scale;
        }
        for v in sbar.iter_mut() {
            *v = scale * *v;
        }
        for t in (t0..t1).filter(|&t| carried(t)) {
            let ii = t - t0;
            let e = cs[t].exp();
            for pp in 0..hd {
                let ey = q(e * ybar[ii * hd + pp]);
                for n in 0..ds {
                    sbar[pp * ds + n] = sbar[pp * ds + n] + ey * cr[t * ds + n];
                }
            }
            // Carried term's dC = e (Ybar S_c)_i and its dcs_i = <C_i, dC_i>.
            for n in 0..ds {
                let mut acc = zero;
                for pp in 0..hd {
                    acc = acc + ybr[ii * hd + pp] * scr[pp * ds + n];
                }
                let dcn = e * acc;
                u.dc[t * ds + n] = u.dc[t * ds + n] + dcn;
                dcs[ii] = dcs[ii] + cm[t * ds + n] * dcn;
            }
        }

        // Intra-chunk term, one row i of the L x L matrices at a time.
        for i_t in t0..t1 {
            let ii = i_t - t0;
            for j in t0..=i_t {
                g_row[j - t0] = if seq(j) == seq(i_t) {
                    gram(&cr, &br, i_t, j, ds)
                } else {
                    zero
                };
            }
            for j in (t0..=i_t).filter(|&j| seq(j) == seq(i_t)) {
                let jj = j - t0;
                let decay = (cs[i_t] - cs[j]).exp();
                let m_raw = g_row[jj] * decay * dtp[j];
                let m = q(m_raw);
                let mut dm = zero;
                for pp in 0..hd {
                    let yb = ybr[ii * hd + pp];
                    dm = dm + yb * xr[j * hd + pp];
                    u.dx[j * hd + pp] = u.dx[j * hd + pp] + m * yb;
                }
                let dg = q(dm * decay * dtp[j]);
                let dg_b = if fault == GradFault::DbWithoutDtScaling {
                    q(dm * decay)
                } else {
                    dg
                };
                let to_c = !(fault == GradFault::DcStateBeforeToken && j == i_t);
                for n in 0..ds {
                    if to_c {
                        u.dc[i_t * ds + n] = u.dc[i_t * ds + n] + dg * br[j * ds + n];
                    }
                    u.db[j * ds + n] = u.db[j * ds + n] + dg_b * cr[i_t * ds + n];
                }
                ddtp[j] = ddtp[j] + dm * g_row[jj] * decay;
                dcs[ii] = dcs[ii] + dm * m_raw;
                dcs[jj] = dcs[jj] - dm * m_raw;
            }
        }

        // Skip term.
        for ii in 0..len {
            let t = t0 + ii;
            for pp in 0..hd {
                let yb = ybar[ii * hd + pp];
                u.dx[t * hd + pp] = u.dx[t * hd + pp] + dskip[pp] * yb;
                u.dd[pp] = u.dd[pp] + yb * x[t * hd + pp];
            }
        }

        // The cumsum's pullback: d(dt'_k A) = sum_{k' >= k} dcs_k'.
        let mut rev = zero;
        for ii in (0..len).rev() {
            rev = rev + dcs[ii];
            ddtp[t0 + ii] = ddtp[t0 + ii] + a * rev;
            u.da = u.da + dtp[t0 + ii] * rev;
        }
    }
    for t in 0..tl {
        u.ddt[t] = ddtp[t] * deriv[t];
    }
    u.sbar0 = sbar;
    u
}

/// `G[i, j] = C_i . B_j` (from the rounded operands).
fn gram<T: Real>(cr: &[T], br: &[T], i: usize, j: usize, ds: usize) -> T {
    (0..ds).fold(T::zero(), |acc, n| acc + cr[i * ds + n] * br[j * ds + n])
}
