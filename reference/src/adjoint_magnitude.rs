//! Magnitudes and first-order error budgets of every gradient element: the input of the
//! gradient bound (`ssd_verify::grad_tolerance`). `docs/tolerances.md` ("Gradients") derives
//! every coefficient used here.
//!
//! Every gradient element is a sum of *terms*, each the product of an upstream factor
//! (`ybar_t C_t^T` with `ybar = dout silu(z)`, or `dfinal_states`), the decays between the token
//! where the upstream factor enters and the token where the term leaves the state cotangent, and
//! the factors of that token (`dt' x`, `B`, the forward state, ...), as [`crate::adjoint`]
//! computes them. The *magnitude* `M` of an element is the same sum over the absolute values of
//! its terms: the adjoint recurrence run on `|dout|`, `|silu(z)|`, `|C|`, `|B|`, `|x|`, `|D|`,
//! `|dt'|`, `|A|`, `|initial_states|`, `|dfinal_states|`, the decays unchanged, and every
//! derivative of a scalar function by its absolute value (`|silu'(z)|` written as
//! `sigmoid(z) (1 + |z| (1 - sigmoid(z)))`, which does not vanish where `silu'` does).
//!
//! Each term also carries a relative error coefficient `e(T)`, so that a correct
//! implementation errs on the element by at most `sum_T |T| e(T)` to first order. The
//! coefficients fall in groups by the unit roundoff they multiply ([`GradChannels`]):
//!
//! - `acc`, the working arithmetic: products, `exp`, every sum in any order (a sum of `n`
//!   terms costs each term `n - 1` additions), the within-chunk cumsum of `dt' A` whose
//!   absolute error moves the argument of every `exp(cs_t - cs_s)` (the forward's `phi`),
//!   the `dt'` processing (its absolute error `rho`, [`crate::magnitude::dt_sensitivity`]),
//!   the gate and its derivative, and the final reductions of `dA`, `ddt_bias`, `dD` over rows
//!   and tokens. A term pays, along its path:
//!   - at creation, token `t`: `2 + 2 phi_t` (`+4` through the gate);
//!   - per token `k` whose decay it crosses: `STEP + 2 (phi_k - phi_{k-1})` (the exp, the
//!     multiply, the add, its one more place in a sum over chunk positions, and the growth of
//!     the cumsum's error), and at a chunk's first token `CROSSING + 2 phi_last` of the
//!     previous chunk (the state pass: exp of that chunk's total, multiply, add);
//!   - at the gradient: the dot products over `dstate` or `headdim` (and the heads of a group)
//!     and the products with the token's factors;
//!   - for `ddt`, `dA`, `ddt_bias` (the decay's gradient): a chunked schedule sums the gradient
//!     of the within-chunk cumsum backwards over the chunk, where a term spanning `j+1..i`
//!     enters at `i` and cancels at `j`: exactly, but not its rounding. So token `k` carries
//!     the budgets of every term spanning any later token of its chunk (a reverse
//!     within-chunk sum of the per-token budgets, the terms created and read at one token
//!     included), and `2 chunk_size + nchunks` more additions.
//!
//!   The same per-token weights bound the token-by-token recurrence (the adjoint itself, and the
//!   float64 reference) and any chunked schedule.
//! - `io`, the rounding of `x`, `B`, `C`, `z`, `dout` to the kernel's input format: a term has at
//!   most four rounded input factors, and `ybar` moves by `q(z) = |1 + z (1 - sigmoid z)|`
//!   relatively when `z` is rounded; `dz` by `|dout| |y| |z silu''(z)|` absolutely.
//! - `op`, the rounding of matrix-product operands (TF32, BF16): a term goes through at most two
//!   chained products (four rounded operands), three for `ddt`, `dA`, `ddt_bias` (the decay's
//!   gradient pairs the state cotangent, itself a product of `dout` and `C`, with the forward
//!   state, itself a product of `x` and `B`).
//!
//! All quantities are computed in f64 from the (exact) inputs of the problem.
use ndarray::{Array1, Array3, Array4, ArrayD, ArrayView4, IxDyn};
use rayon::prelude::*;

use crate::adjoint::Gradients;
use crate::magnitude::dt_sensitivity;
use crate::{Problem, ReferenceError};

/// Tokens per recomputed block of forward states.
const BLOCK: usize = 64;

/// The exp of a decay, the multiply by it, the add into the carried sum, and one more place
/// in a sum over chunk positions.
pub const STEP: f64 = 5.0;
/// A chunk boundary: exp of the chunk's total, multiply, add.
pub const CROSSING: f64 = 4.0;
/// Creation of a term: the product of its upstream factors and the add.
pub const CREATE: f64 = 2.0;
/// `silu(z)` or its derivative: `exp`, add, divide, and up to four more products and adds.
pub const GATE: f64 = 8.0;
/// Rounded input factors per term (`dout`, `C`, `B`, `x`).
pub const IO_FACTORS: f64 = 4.0;
/// Rounded matrix-product operands per term: two chained products.
pub const OPERANDS: f64 = 4.0;
/// ... three for the gradients through the decays (`ddt`, `dA`, `ddt_bias`).
pub const OPERANDS_DECAY: f64 = 6.0;

/// The weighted magnitudes of one gradient tensor, each of the tensor's shape.
#[derive(Debug, Clone)]
pub struct GradChannels {
    /// `M`: the gradient computed on absolute values.
    pub mag: ArrayD<f64>,
    /// `sum |T| e_acc(T)` (multiplies the working arithmetic's unit roundoff plus the
    /// reference's).
    pub acc: ArrayD<f64>,
    /// `sum |T| e_io(T)` (multiplies the unit roundoff of the `x`, `B`, `C`, `z`, `dout`
    /// inputs).
    pub io: ArrayD<f64>,
    /// `sum |T| e_op(T)` (multiplies the unit roundoff of matrix-product operands).
    pub op: ArrayD<f64>,
}

/// The weighted magnitudes of every gradient of a problem, in [`Gradients::named`]'s order
/// and names, and the scale of the underflow floor.
#[derive(Debug, Clone)]
pub struct GradMagnitudes {
    pub tensors: Vec<(&'static str, GradChannels)>,
    /// An upper bound on the sum, over the terms of any element, of the product of the term's
    /// factors other than the decays; the floor is `eta * floor_scale`.
    pub floor_scale: f64,
}

impl GradMagnitudes {
    /// The channels of the gradient named `name` (`"dx"`, `"ddt"`, ...), when the problem has it.
    pub fn channels(&self, name: &str) -> Option<&GradChannels> {
        self.tensors
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, c)| c)
    }
}

/// Per-token quantities of one (row, head) lane.
struct Tokens {
    dtp: Vec<f64>,
    rho: Vec<f64>,
    decay: Vec<f64>,
    reset: Vec<bool>,
    /// `|d dt' / d dt|` (0 where clamped).
    ddtp_ddt: Vec<f64>,
    /// The sensitivity of that derivative to the rounding of `dt + dt_bias`, relative.
    ddtp_sens: Vec<f64>,
    /// `|a_t| + its error`, the weight of `exp(a_t)` in the decay's gradient.
    a_err: Vec<f64>,
    /// `phi_t`: the error scale of the within-chunk cumsum at `t`.
    phi: Vec<f64>,
    /// The weight a term pays crossing token `t`'s decay.
    w: Vec<f64>,
}

fn tokens(p: &Problem<f64>, b: usize, h: usize) -> Tokens {
    let d = *p.dims();
    let i = p.inputs();
    let o = p.options();
    let l = o.chunk_size;
    let a_abs = i.A[h].abs();
    let n = d.seqlen;
    let mut tk = Tokens {
        dtp: Vec::with_capacity(n),
        rho: Vec::with_capacity(n),
        decay: Vec::with_capacity(n),
        reset: Vec::with_capacity(n),
        ddtp_ddt: Vec::with_capacity(n),
        ddtp_sens: Vec::with_capacity(n),
        a_err: Vec::with_capacity(n),
        phi: Vec::with_capacity(n),
        w: Vec::with_capacity(n),
    };
    let (lo, hi) = o.dt_limit;
    let mut prev_seq = 0i64;
    let (mut cum, mut errs, mut phi_prev, mut phi_last_chunk) = (0.0, 0.0, 0.0, 0.0);
    for t in 0..n {
        let seq = p.seq_idx_at(b, t);
        let reset = seq != prev_seq;
        prev_seq = seq;
        let dt = i.dt[[b, t, h]];
        let bias = i.dt_bias.as_ref().map_or(0.0, |a| a[h]);
        let v = dt + bias;
        let (sp, deriv, sens) = if o.dt_softplus && v <= 20.0 {
            let s = 1.0 / (1.0 + (-v).exp());
            // sigmoid(v) moves by (1 - s) |dv| relatively; |dv| <= 2u (|dt| + |dt_bias|).
            (
                crate::problem::softplus(v),
                s,
                2.0 * (1.0 - s) * (dt.abs() + bias.abs()),
            )
        } else {
            (v, 1.0, 0.0)
        };
        let clamped = sp < lo || sp > hi;
        let dtp = p.dt_processed(b, t, h);
        let rho = dt_sensitivity(p, b, t, h);
        let a = dtp * i.A[h];
        let a_err = a_abs * (rho + 2.0 * dtp.abs());
        if t % l == 0 {
            phi_last_chunk = phi_prev;
            cum = 0.0;
            errs = 0.0;
            phi_prev = 0.0;
        }
        let pos = (t % l) as f64;
        cum += a.abs();
        errs += a_err;
        let phi = pos * cum + errs;
        let mut w = STEP + 2.0 * (phi - phi_prev);
        if t % l == 0 && t > 0 {
            w += CROSSING + 2.0 * phi_last_chunk;
        }
        phi_prev = phi;
        tk.dtp.push(dtp);
        tk.rho.push(rho);
        tk.decay.push(if reset { 0.0 } else { a.exp() });
        tk.reset.push(reset);
        tk.ddtp_ddt.push(if clamped { 0.0 } else { deriv });
        tk.ddtp_sens.push(sens);
        tk.a_err.push(a.abs() + a_err);
        tk.phi.push(phi);
        tk.w.push(w);
    }
    tk
}

/// `|silu(z)|`, its relative sensitivity `q(z)`, the magnitude of `silu'(z)` and the
/// absolute sensitivity `|z silu''(z)|` of `silu'` to a relative change of `z`.
fn gate_parts(z: f64) -> [f64; 4] {
    let (silu, q) = crate::magnitude::gate_parts(z);
    let s = 1.0 / (1.0 + (-z).exp());
    let dmag = s * (1.0 + z.abs() * (1.0 - s));
    let d2 = (z * s * (1.0 - s) * (2.0 + z * (1.0 - 2.0 * s))).abs();
    [silu, q, dmag, d2]
}

/// One lane's share: per gradient, magnitude and `acc` (the `io` and `op` channels follow
/// from the magnitude, plus the gate's absolute part of `dz`).
struct Lane {
    dx: [Vec<f64>; 2],
    dz: [Vec<f64>; 3],
    ddt: [Vec<f64>; 2],
    db: [Vec<f64>; 2],
    dc: [Vec<f64>; 2],
    dd: [Vec<f64>; 2],
    da: [f64; 2],
    ddt_bias: [f64; 2],
    dinit: [Vec<f64>; 2],
}

/// The weighted magnitudes of every gradient of `p` pulled back from `dout` and
/// `dfinal_states` (see the module documentation).
///
/// # Errors
/// [`ReferenceError::InvalidProblem`] naming the tensor when `dout` or `dfinal_states` has the
/// wrong shape or a non-finite value.
///
/// # Example
/// ```
/// use ssd_reference::random::{random_problem, ProblemSpec};
/// use ssd_reference::{adjoint, adjoint_magnitude, Dims};
///
/// let p = random_problem(&ProblemSpec::full(Dims::new(1, 9, 2, 3, 1, 4), 4), 7).unwrap();
/// let dout = ndarray::Array4::<f64>::ones((1, 9, 2, 3));
/// let g = adjoint::backward(&p, dout.view(), None).unwrap();
/// let m = adjoint_magnitude::gradient_magnitudes(&p, dout.view(), None).unwrap();
/// // Every gradient is at most its magnitude.
/// for (name, v) in g.named() {
///     let mag = &m.channels(name).unwrap().mag;
///     assert!(v.iter().zip(mag.iter()).all(|(g, m)| g.abs() <= m * (1.0 + 1e-12)));
/// }
/// ```
pub fn gradient_magnitudes(
    p: &Problem<f64>,
    dout: ArrayView4<f64>,
    dfinal_states: Option<ArrayView4<f64>>,
) -> Result<GradMagnitudes, ReferenceError> {
    crate::adjoint::check_upstream(p, &dout, dfinal_states.as_ref())?;
    let d = *p.dims();
    let (bt, l, nh, hd, ng, ds) = (d.batch, d.seqlen, d.nheads, d.headdim, d.ngroups, d.dstate);
    let i = p.inputs();
    let units: Vec<(usize, usize)> = (0..bt).flat_map(|b| (0..nh).map(move |h| (b, h))).collect();
    let lanes: Vec<Lane> = units
        .par_iter()
        .map(|&(b, h)| lane(p, &dout, dfinal_states.as_ref(), b, h))
        .collect();

    // The reductions over rows and tokens (any order) and over the heads of a group.
    let tokens_total = (bt * l) as f64;
    let q_max = i.z.as_ref().map_or(0.0, |z| {
        z.iter().fold(0.0_f64, |m, &v| m.max(gate_parts(v)[1]))
    });
    let mut g: Gradients<[f64; 2]> = Gradients {
        dx: Array4::from_elem((bt, l, nh, hd), [0.0; 2]),
        ddt: Array3::from_elem((bt, l, nh), [0.0; 2]),
        dA: Array1::from_elem(nh, [0.0; 2]),
        dB: Array4::from_elem((bt, l, ng, ds), [0.0; 2]),
        dC: Array4::from_elem((bt, l, ng, ds), [0.0; 2]),
        dD: i
            .D
            .as_ref()
            .map(|a| ArrayD::from_elem(IxDyn(a.shape()), [0.0; 2])),
        dz: i
            .z
            .as_ref()
            .map(|_| Array4::from_elem((bt, l, nh, hd), [0.0; 2])),
        ddt_bias: i.dt_bias.as_ref().map(|_| Array1::from_elem(nh, [0.0; 2])),
        dinitial_states: i
            .initial_states
            .as_ref()
            .map(|_| Array4::from_elem((bt, nh, hd, ds), [0.0; 2])),
    };
    let mut dz_gate = i.z.as_ref().map(|_| Array4::<f64>::zeros((bt, l, nh, hd)));
    let add = |a: &mut [f64; 2], m: f64, e: f64| {
        a[0] += m;
        a[1] += e;
    };
    for (&(b, h), r) in units.iter().zip(&lanes) {
        let grp = d.group_of_head(h);
        for t in 0..l {
            for pp in 0..hd {
                let k = t * hd + pp;
                g.dx[[b, t, h, pp]] = [r.dx[0][k], r.dx[1][k]];
                if let (Some(dz), Some(gz)) = (&mut g.dz, &mut dz_gate) {
                    dz[[b, t, h, pp]] = [r.dz[0][k], r.dz[1][k]];
                    gz[[b, t, h, pp]] = r.dz[2][k];
                }
            }
            g.ddt[[b, t, h]] = [r.ddt[0][t], r.ddt[1][t]];
            for n in 0..ds {
                add(
                    &mut g.dB[[b, t, grp, n]],
                    r.db[0][t * ds + n],
                    r.db[1][t * ds + n],
                );
                add(
                    &mut g.dC[[b, t, grp, n]],
                    r.dc[0][t * ds + n],
                    r.dc[1][t * ds + n],
                );
            }
        }
        add(&mut g.dA[h], r.da[0], r.da[1]);
        if let Some(a) = &mut g.ddt_bias {
            add(&mut a[h], r.ddt_bias[0], r.ddt_bias[1]);
        }
        if let Some(a) = &mut g.dD {
            for pp in 0..hd {
                let idx = if a.ndim() == 1 { vec![h] } else { vec![h, pp] };
                add(&mut a[IxDyn(&idx)], r.dd[0][pp], r.dd[1][pp]);
            }
        }
        if let Some(a) = &mut g.dinitial_states {
            for k in 0..hd * ds {
                a[[b, h, k / ds, k % ds]] = [r.dinit[0][k], r.dinit[1][k]];
            }
        }
    }

    let per_head_d = i.D.as_ref().is_some_and(|a| a.ndim() == 1);
    let tensors = g
        .named()
        .into_iter()
        .map(|(name, v)| {
            // Reductions taken after the per-lane sums: over rows and tokens (and channels of a
            // per-head D), in any order.
            let reduce = match name {
                "dA" | "ddt_bias" => tokens_total,
                "dD" if per_head_d => tokens_total * hd as f64,
                "dD" => tokens_total,
                _ => 0.0,
            };
            let operands = match name {
                "ddt" | "dA" | "ddt_bias" => OPERANDS_DECAY,
                _ => OPERANDS,
            };
            let mag = v.mapv(|a| a[0]);
            let acc = v.mapv(|a| a[1] + reduce * a[0]);
            let mut io = mag.mapv(|m| (IO_FACTORS + q_max) * m);
            if name == "dz" {
                if let Some(gz) = &dz_gate {
                    io.zip_mut_with(&gz.view().into_dyn(), |a, &gv| *a += gv);
                }
            }
            let op = mag.mapv(|m| operands * m);
            (name, GradChannels { mag, acc, io, op })
        })
        .collect();
    Ok(GradMagnitudes {
        tensors,
        floor_scale: floor_scale(p, &dout, dfinal_states.as_ref()),
    })
}

/// `F`: the forward's floor scale times the largest upstream factor and the largest factor a
/// gradient multiplies in (`dt'`, `x`, `B`, `C`, `A`, the state), times the number of terms a
/// reduction adds.
fn floor_scale(p: &Problem<f64>, dout: &ArrayView4<f64>, dfinal: Option<&ArrayView4<f64>>) -> f64 {
    let d = *p.dims();
    let i = p.inputs();
    let m = |it: &mut dyn Iterator<Item = f64>| it.fold(0.0_f64, |a, v| a.max(v.abs()));
    let mo = m(&mut dout.iter().copied()).max(dfinal.map_or(0.0, |f| m(&mut f.iter().copied())));
    let mx = m(&mut i.x.iter().copied());
    let mb = m(&mut i.B.iter().copied());
    let mc = m(&mut i.C.iter().copied());
    let ma = m(&mut i.A.iter().copied());
    let fwd = crate::magnitude::floor_scale(p);
    let factors = (1.0 + mx) * (1.0 + mb) * (1.0 + mc) * (1.0 + ma) * (1.0 + fwd);
    (d.batch * d.seqlen + 2) as f64 * (d.headdim + d.dstate + 2) as f64 * (1.0 + mo) * factors
}

/// The magnitude pass of one (row, head) lane: a forward sweep of the state magnitudes and
/// budgets (checkpointed every [`BLOCK`] tokens), then the adjoint recurrence backwards on
/// absolute values with its error budget, the states recomputed one block at a time.
#[allow(clippy::needless_range_loop)] // indices shared by several arrays and closures
fn lane(
    p: &Problem<f64>,
    dout: &ArrayView4<f64>,
    dfinal: Option<&ArrayView4<f64>>,
    b: usize,
    h: usize,
) -> Lane {
    let d = *p.dims();
    let i = p.inputs();
    let (l, hd, ds) = (d.seqlen, d.headdim, d.dstate);
    let hpg = d.heads_per_group() as f64;
    let g = d.group_of_head(h);
    let ns = hd * ds;
    let tk = tokens(p, b, h);
    let a_abs = i.A[h].abs();
    let chunk = p.options().chunk_size as f64;
    let nchunks = p.nchunks() as f64;
    let x = |t: usize, pp: usize| i.x[[b, t, h, pp]].abs();
    let bm = |t: usize, n: usize| i.B[[b, t, g, n]].abs();
    let cm = |t: usize, n: usize| i.C[[b, t, g, n]].abs();
    let dsk: Vec<f64> = (0..hd).map(|pp| p.d_skip(h, pp).abs()).collect();
    // ybar = |dout silu(z)|, and the gate's parts.
    let gate: Vec<[f64; 4]> = (0..l * hd)
        .map(|k| {
            i.z.as_ref().map_or([1.0, 0.0, 0.0, 0.0], |z| {
                gate_parts(z[[b, k / hd, h, k % hd]])
            })
        })
        .collect();
    let gate_acc = if i.z.is_some() { GATE } else { 0.0 };

    // Forward sweep of the state magnitude and budget, one token: `next` from `prev`.
    let step = |t: usize, prev: (&[f64], &[f64]), next: (&mut [f64], &mut [f64])| {
        let (a, w) = (tk.decay[t], tk.w[t]);
        let create = CREATE + 2.0 + 2.0 * tk.phi[t];
        for pp in 0..hd {
            let u = tk.dtp[t].abs() * x(t, pp);
            for n in 0..ds {
                let k = pp * ds + n;
                let nt = u * bm(t, n);
                next.0[k] = a * prev.0[k] + nt;
                next.1[k] =
                    a * (prev.1[k] + w * prev.0[k]) + create * nt + tk.rho[t] * x(t, pp) * bm(t, n);
            }
        }
    };
    // The states before each block of BLOCK tokens (checkpoints), then, block by block
    // backwards, the states of the block recomputed: `[BLOCK + 1][ns]`, index 0 the state
    // before the block's first token.
    let nblocks = l.div_ceil(BLOCK).max(1);
    let mut ckpt = [vec![0.0; nblocks * ns], vec![0.0; nblocks * ns]];
    if let Some(s0) = &i.initial_states {
        if p.seq_idx_at(b, 0) == 0 {
            for k in 0..ns {
                ckpt[0][k] = s0[[b, h, k / ds, k % ds]].abs();
                ckpt[1][k] = ckpt[0][k];
            }
        }
    }
    let mut sm = vec![0.0; (BLOCK + 1) * ns];
    let mut se = vec![0.0; (BLOCK + 1) * ns];
    let fill = |blk: usize, ckpt: &[Vec<f64>; 2], sm: &mut [f64], se: &mut [f64]| {
        sm[..ns].copy_from_slice(&ckpt[0][blk * ns..(blk + 1) * ns]);
        se[..ns].copy_from_slice(&ckpt[1][blk * ns..(blk + 1) * ns]);
        let t0 = blk * BLOCK;
        for k in 0..BLOCK.min(l - t0) {
            let (bm_, am_) = sm.split_at_mut((k + 1) * ns);
            let (be_, ae_) = se.split_at_mut((k + 1) * ns);
            step(
                t0 + k,
                (&bm_[k * ns..], &be_[k * ns..]),
                (&mut am_[..ns], &mut ae_[..ns]),
            );
        }
    };
    for blk in 0..nblocks - 1 {
        fill(blk, &ckpt, &mut sm, &mut se);
        let at = (blk + 1) * ns;
        ckpt[0][at..at + ns].copy_from_slice(&sm[BLOCK * ns..]);
        ckpt[1][at..at + ns].copy_from_slice(&se[BLOCK * ns..]);
    }

    let mut r = Lane {
        dx: [vec![0.0; l * hd], vec![0.0; l * hd]],
        dz: [vec![0.0; l * hd], vec![0.0; l * hd], vec![0.0; l * hd]],
        ddt: [vec![0.0; l], vec![0.0; l]],
        db: [vec![0.0; l * ds], vec![0.0; l * ds]],
        dc: [vec![0.0; l * ds], vec![0.0; l * ds]],
        dd: [vec![0.0; hd], vec![0.0; hd]],
        da: [0.0; 2],
        ddt_bias: [0.0; 2],
        dinit: [Vec::new(), Vec::new()],
    };
    // The state cotangent: magnitude and budget.
    let mut lm = vec![0.0; ns];
    let mut le = vec![0.0; ns];
    if let Some(f) = dfinal {
        let last = l.saturating_sub(1);
        let seed = CROSSING + 2.0 * tk.phi.get(last).copied().unwrap_or(0.0);
        for k in 0..ns {
            lm[k] = f[[b, h, k / ds, k % ds]].abs();
            le[k] = seed * lm[k];
        }
    }
    let mut du = [vec![0.0; hd], vec![0.0; hd]];
    let mut tail = [0.0; 2];
    for t in (0..l).rev() {
        let k0 = t % BLOCK;
        if t == l - 1 || k0 == BLOCK - 1 {
            fill(t / BLOCK, &ckpt, &mut sm, &mut se);
        }
        let s_t = (
            &sm[(k0 + 1) * ns..(k0 + 2) * ns],
            &se[(k0 + 1) * ns..(k0 + 2) * ns],
        );
        let s_p = (&sm[k0 * ns..(k0 + 1) * ns], &se[k0 * ns..(k0 + 1) * ns]);
        let create = CREATE + 2.0 * tk.phi[t] + gate_acc;
        let (dtp, rho) = (tk.dtp[t].abs(), tk.rho[t]);
        // The gate, the skip connection, and the new terms of the cotangent.
        for pp in 0..hd {
            let [silu, _, dmag, d2] = gate[t * hd + pp];
            let go = dout[[b, t, h, pp]].abs();
            let yb = go * silu;
            let xp = x(t, pp);
            let (mut ym, mut ye) = (dsk[pp] * xp, 4.0 * dsk[pp] * xp);
            for n in 0..ds {
                let k = pp * ds + n;
                let c = cm(t, n);
                ym += s_t.0[k] * c;
                ye += (s_t.1[k] + (ds as f64 + 2.0) * s_t.0[k]) * c;
                lm[k] += yb * c;
                le[k] += create * yb * c;
                r.dc[0][t * ds + n] += yb * s_t.0[k];
                r.dc[1][t * ds + n] +=
                    yb * (s_t.1[k] + (hd as f64 * hpg + 2.0 + gate_acc) * s_t.0[k]);
            }
            if i.z.is_some() {
                r.dz[0][t * hd + pp] = go * ym * dmag;
                r.dz[1][t * hd + pp] = go * dmag * (ye + GATE * ym);
                r.dz[2][t * hd + pp] = go * ym * d2;
            }
            r.dd[0][pp] += yb * xp;
            r.dd[1][pp] += (2.0 + gate_acc) * yb * xp;
            r.dx[0][t * hd + pp] = dsk[pp] * yb;
            r.dx[1][t * hd + pp] = (4.0 + gate_acc) * dsk[pp] * yb;
        }
        // Through s_t = a_t s_{t-1} + dt' x_t B_t^T.
        let (mut dam, mut dae) = (0.0, 0.0);
        for pp in 0..hd {
            let xp = x(t, pp);
            let u = dtp * xp;
            let (mut dum, mut due) = (0.0, 0.0);
            for n in 0..ds {
                let k = pp * ds + n;
                let bn = bm(t, n);
                dum += lm[k] * bn;
                due += (le[k] + (ds as f64 + 2.0) * lm[k]) * bn;
                r.db[0][t * ds + n] += u * lm[k];
                r.db[1][t * ds + n] +=
                    u * (le[k] + (hd as f64 * hpg + 3.0) * lm[k]) + rho * xp * lm[k];
                if !tk.reset[t] {
                    dam += lm[k] * s_p.0[k];
                    dae +=
                        le[k] * s_p.0[k] + lm[k] * s_p.1[k] + (ns as f64 + 2.0) * lm[k] * s_p.0[k];
                }
            }
            du[0][pp] = dum;
            du[1][pp] = due;
            r.dx[0][t * hd + pp] += dtp * dum;
            r.dx[1][t * hd + pp] += dtp * (due + 2.0 * dum) + rho * dum;
        }
        // ddt' = <du, x> + A a_t da; dA += dt' a_t da.
        let (mut m1, mut e1) = (0.0, 0.0);
        for pp in 0..hd {
            let xp = x(t, pp);
            m1 += du[0][pp] * xp;
            e1 += (du[1][pp] + (hd as f64 + 2.0) * du[0][pp]) * xp;
        }
        let a_t = tk.decay[t];
        let decay_w = 4.0 + tk.a_err[t];
        // The decay's gradient of token t, without the factor A (for dA) and with it (ddt').
        let (ma, ea) = (a_t * dam, a_t * (dae + decay_w * dam));
        // A chunked schedule takes it through the gradient of the within-chunk cumsum, then a
        // reverse cumsum over the chunk: a term spanning tokens j+1..i enters at i and leaves
        // at j, and the two cancel exactly for every token k <= j, but not their rounding. So
        // token k's result carries the rounding of every term spanning any token of the rest
        // of its chunk: the reverse within-chunk sum of the per-token budgets (`tail`), plus
        // up to chunk_size + nchunks more additions per term.
        if t == l - 1 || (t + 1) % p.options().chunk_size == 0 {
            tail = [0.0; 2];
        }
        // The chunk's terms of the cumsum's gradient at token t also include the term created
        // and read at t itself (`C_t . B_t dt'_t ybar_t . x_t`, no decay): it enters and leaves
        // at t, so it spans no token and no `da` holds it.
        let cb: f64 = (0..ds).map(|n| cm(t, n) * bm(t, n)).sum();
        let yx: f64 = (0..hd)
            .map(|pp| dout[[b, t, h, pp]].abs() * gate[t * hd + pp][0] * x(t, pp))
            .sum();
        let diag = dtp * yx * cb;
        tail[0] += ma + diag;
        tail[1] += ea + (CREATE + (ds + hd) as f64 + 4.0 + gate_acc) * diag + rho * yx * cb;
        let cs_depth = 2.0 * chunk + nchunks;
        let (mt, et) = (
            m1 + a_abs * ma,
            e1 + a_abs * (tail[1] + cs_depth * tail[0]) + cs_depth * m1,
        );
        let dd = tk.ddtp_ddt[t];
        let ddt = [dd * mt, dd * (et + (4.0 + tk.ddtp_sens[t]) * mt)];
        r.ddt[0][t] = ddt[0];
        r.ddt[1][t] = ddt[1];
        r.ddt_bias[0] += ddt[0];
        r.ddt_bias[1] += ddt[1];
        r.da[0] += dtp * ma;
        r.da[1] += dtp * (tail[1] + cs_depth * tail[0]) + rho * ma;
        // The decay backwards across token t (0 at a reset).
        let w = tk.w[t];
        for k in 0..ns {
            le[k] = a_t * (le[k] + w * lm[k]);
            lm[k] *= a_t;
        }
    }
    if i.initial_states.is_some() {
        r.dinit = [lm, le];
    }
    r
}
