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
//! Every sum is taken in a fixed order, whatever the number of threads or the instruction
//! set: the per-token terms in decreasing `t`; `du_t[p]`, the rows of `da_t` and (with `z`)
//! `(s_t C_t)[p]` over `n` in 4 interleaved partial sums (column `n` into sum `n mod 4`, in
//! increasing `n`), added as `(s0 + s1) + (s2 + s3)`; `da_t` over its rows and `dC_t[n]`,
//! `dB_t[n]` over `p`, in increasing `p`; `<du_t, x_t>` in 4 interleaved partial sums over
//! `p`; `dB`, `dC` of a group over its heads in increasing `h`; `dA`, `ddt_bias`, `dD` over
//! rows in increasing `b` (each row's sum over its tokens first).
//!
//! # Schedule and memory
//! One (row, head) pair at a time per task. A first forward sweep keeps the state before each
//! block of [`BLOCK`] tokens (`seqlen / BLOCK * headdim * dstate` values per task, not
//! `seqlen * headdim * dstate`); the backward sweep then takes the blocks in reverse. Both go
//! through the state in register tiles of 4 rows (`p`) by 8 columns (`n`), as the naive
//! forward does: within a block, each tile's forward states are recomputed from the block's
//! checkpoint into a small buffer, then the tile of `S` is held in registers while the
//! block's tokens are walked in reverse. `S` of one entry depends on no other entry, so the
//! tiles are independent; what they share (`du`, `da`, `dC`, `dB`) is summed tile by tile in
//! the orders above, which are those of a token-by-token sweep over whole rows.
use ndarray::{
    Array1, Array3, Array4, ArrayD, ArrayView4, ArrayViewMut1, ArrayViewMut2, Axis, IxDyn,
};
use rayon::prelude::*;

use crate::prefetch;
use crate::problem::{check_finite, check_shape, softplus};
use crate::{Problem, Real, ReferenceError};

/// Tokens per recomputed block of forward states.
pub const BLOCK: usize = 32;

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

impl<T: Real> Gradients<T> {
    /// Every gradient widened to f64 (exactly).
    pub fn to_f64(&self) -> Gradients<f64> {
        let w4 = |a: &Array4<T>| a.mapv(Real::as_f64);
        Gradients {
            dx: w4(&self.dx),
            ddt: self.ddt.mapv(Real::as_f64),
            dA: self.dA.mapv(Real::as_f64),
            dB: w4(&self.dB),
            dC: w4(&self.dC),
            dD: self.dD.as_ref().map(|a| a.mapv(Real::as_f64)),
            dz: self.dz.as_ref().map(w4),
            ddt_bias: self.ddt_bias.as_ref().map(|a| a.mapv(Real::as_f64)),
            dinitial_states: self.dinitial_states.as_ref().map(w4),
        }
    }
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
    check_upstream(p, &dout, dfinal_states.as_ref())?;
    let d = *p.dims();
    let (bt, l, nh, hd, ng, ds) = (d.batch, d.seqlen, d.nheads, d.headdim, d.ngroups, d.dstate);
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
        dx: crate::par_zeros((bt, l, nh, hd)),
        ddt: Array3::zeros((bt, l, nh)),
        dA: Array1::zeros(nh),
        dB: crate::par_zeros((bt, l, ng, ds)),
        dC: crate::par_zeros((bt, l, ng, ds)),
        dD: i.D.as_ref().map(|a| ArrayD::zeros(IxDyn(a.shape()))),
        dz: i.z.as_ref().map(|_| crate::par_zeros((bt, l, nh, hd))),
        ddt_bias: i.dt_bias.as_ref().map(|_| Array1::zeros(nh)),
        dinitial_states: i
            .initial_states
            .as_ref()
            .map(|_| Array4::zeros((bt, nh, hd, ds))),
    };

    // Each unit (b, h) writes its own parts of dx, dz, ddt and dinitial_states. dB and dC sum
    // the heads of a group: with one head per group a unit writes its rows too; otherwise it
    // leaves its terms in its scratch and they are added, in unit order, after its wave.
    let direct = nh == ng;
    let Gradients {
        dx,
        ddt,
        dA,
        dB,
        dC,
        dD,
        dz,
        ddt_bias,
        dinitial_states,
    } = &mut g;
    let mut dx_v = per_unit(dx).into_iter();
    let mut dz_v = dz.as_mut().map(|a| per_unit(a).into_iter());
    let mut ddt_v = ddt
        .outer_iter_mut()
        .flat_map(|row| row.into_axis_iter_mut(Axis(1)))
        .collect::<Vec<_>>()
        .into_iter();
    let mut di_v = dinitial_states.as_mut().map(|a| {
        a.outer_iter_mut()
            .flat_map(|row| row.into_outer_iter_mut())
            .collect::<Vec<_>>()
            .into_iter()
    });
    // With one head per group, unit (b, h) owns dB[b, :, h, :] and dC[b, :, h, :].
    let (mut db_v, mut dc_v, mut bc_sum) = if direct {
        (
            Some(per_unit(dB).into_iter()),
            Some(per_unit(dC).into_iter()),
            None,
        )
    } else {
        (None, None, Some((dB, dC)))
    };

    // Units in b-major, h-minor order, computed in waves of independent tasks, each with its
    // scratch; what they share is added in unit order: the bits do not depend on the wave size.
    let wave = (2 * rayon::current_num_threads()).min(bt * nh).max(1);
    let mut scratch: Vec<Scratch<T>> = (0..wave).map(|_| Scratch::default()).collect();
    for u0 in (0..bt * nh).step_by(wave) {
        let part: Vec<Dest<T>> = (u0..(u0 + wave).min(bt * nh))
            .map(|u| Dest {
                b: u / nh,
                h: u % nh,
                dx: dx_v.next().expect("one view per unit"),
                dz: dz_v.as_mut().map(|v| v.next().expect("one view per unit")),
                ddt: ddt_v.next().expect("one view per unit"),
                db: db_v.as_mut().map(|v| v.next().expect("one view per unit")),
                dc: dc_v.as_mut().map(|v| v.next().expect("one view per unit")),
                dinit: di_v.as_mut().map(|v| v.next().expect("one view per unit")),
            })
            .collect();
        let results: Vec<UnitSums<T>> = part
            .into_par_iter()
            .zip(scratch.par_iter_mut())
            .map(|(dest, sc)| {
                let fin = dfinal_states
                    .as_ref()
                    .map(|f| f.slice(ndarray::s![dest.b, dest.h, .., ..]));
                unit(p, &flat, fin, dest, sc)
            })
            .collect();
        if let Some((db, dc)) = &mut bc_sum {
            add_heads(p, u0, &scratch[..results.len()], db, dc);
        }
        for (k, r) in results.into_iter().enumerate() {
            let h = (u0 + k) % nh;
            dA[h] = dA[h] + r.da;
            if let Some(db) = ddt_bias {
                db[h] = db[h] + r.ddt_bias;
            }
            if let Some(dd) = dD {
                if dd.ndim() == 1 {
                    let sum = r.dd.iter().fold(T::zero(), |a, &v| a + v);
                    dd[[h]] = dd[[h]] + sum;
                } else {
                    for (pp, &v) in r.dd.iter().enumerate() {
                        dd[[h, pp]] = dd[[h, pp]] + v;
                    }
                }
            }
        }
    }
    Ok(g)
}

/// Row `t` of a `[seqlen, n]` view whose rows are contiguous.
#[inline(always)]
fn row<'a, T>(a: &'a mut ArrayViewMut2<'_, T>, t: usize) -> &'a mut [T] {
    a.row_mut(t)
        .into_slice()
        .expect("rows of the last axis are contiguous")
}

/// The `[seqlen, last]` views `a[b, :, h, :]` of a `[batch, seqlen, heads, last]` array, in
/// b-major, h-minor order.
fn per_unit<T>(a: &mut Array4<T>) -> Vec<ArrayViewMut2<'_, T>> {
    a.outer_iter_mut()
        .flat_map(|row| row.into_axis_iter_mut(Axis(1)))
        .collect()
}

/// Adds the `dB`, `dC` terms the units `u0..` of a wave left in their scratch into `db`, `dc`
/// (`[batch, seqlen, ngroups, dstate]`), in unit order, parallel over `(b, t)`.
fn add_heads<T: Real>(
    p: &Problem<T>,
    u0: usize,
    scratch: &[Scratch<T>],
    db: &mut Array4<T>,
    dc: &mut Array4<T>,
) {
    let d = *p.dims();
    let (l, nh, ds) = (d.seqlen, d.nheads, d.dstate);
    for (dst, dc_side) in [(db, false), (dc, true)] {
        dst.as_slice_mut()
            .expect("standard layout")
            .par_chunks_mut(d.ngroups * ds)
            .enumerate()
            .for_each(|(bt, row)| {
                let (b, t) = (bt / l, bt % l);
                for (k, sc) in scratch.iter().enumerate() {
                    let u = u0 + k;
                    if u / nh != b {
                        continue;
                    }
                    let g = d.group_of_head(u % nh);
                    let src = if dc_side { &sc.dc } else { &sc.db };
                    for (a, &v) in row[g * ds..(g + 1) * ds]
                        .iter_mut()
                        .zip(&src[t * ds..(t + 1) * ds])
                    {
                        *a = *a + v;
                    }
                }
            });
    }
}

/// The checks of the upstream gradients, one error naming the tensor: `dout` of shape `[batch,
/// seqlen, nheads, headdim]`, `dfinal_states` of `[batch, nheads, headdim, dstate]`, both finite.
pub(crate) fn check_upstream<T: Real>(
    p: &Problem<T>,
    dout: &ArrayView4<T>,
    dfinal_states: Option<&ArrayView4<T>>,
) -> Result<(), ReferenceError> {
    let d = *p.dims();
    check_shape(
        "dout",
        dout.shape(),
        &[d.batch, d.seqlen, d.nheads, d.headdim],
    )?;
    check_finite("dout", dout)?;
    if let Some(f) = dfinal_states {
        check_shape(
            "dfinal_states",
            f.shape(),
            &[d.batch, d.nheads, d.headdim, d.dstate],
        )?;
        check_finite("dfinal_states", f)?;
    }
    Ok(())
}

/// The inputs as flat row-major slices.
struct Flat<'a, T> {
    x: &'a [T],
    bm: &'a [T],
    cm: &'a [T],
    z: Option<&'a [T]>,
    dout: &'a [T],
}

/// Where one (row, head) pair writes its gradients: its parts of the outputs.
struct Dest<'a, T> {
    b: usize,
    h: usize,
    /// `dx[b, :, h, :]` and `dz[b, :, h, :]`, `[seqlen, headdim]`.
    dx: ArrayViewMut2<'a, T>,
    dz: Option<ArrayViewMut2<'a, T>>,
    /// `ddt[b, :, h]`.
    ddt: ArrayViewMut1<'a, T>,
    /// `dB[b, :, h, :]` and `dC[b, :, h, :]` when every group has one head (else the terms
    /// go to the scratch).
    db: Option<ArrayViewMut2<'a, T>>,
    dc: Option<ArrayViewMut2<'a, T>>,
    /// `dinitial_states[b, h]`.
    dinit: Option<ArrayViewMut2<'a, T>>,
}

/// The sums a unit shares with others, added in unit order.
struct UnitSums<T> {
    /// `[headdim]`: this head's terms of `dD`, per channel (summed for a per-head `D`).
    dd: Vec<T>,
    da: T,
    ddt_bias: T,
}

/// One task's working memory, kept from unit to unit.
struct Scratch<T> {
    /// The state before each block, `[nblocks, headdim, dstate]`.
    ckpt: Vec<T>,
    /// `S`, `[headdim, dstate]`.
    sbar: Vec<T>,
    /// One block's staged `u`, `ybar` (by row blocks, [`Blk`]), `B`, `C` (by column tiles),
    /// and `ybar` again as `[BLOCK, headdim]`.
    u: Vec<T>,
    ybar: Vec<T>,
    ybn: Vec<T>,
    bb: Vec<T>,
    cc: Vec<T>,
    /// One block's `dC`, `dB` terms, by column tiles.
    dcb: Vec<T>,
    dbb: Vec<T>,
    /// A tile's recomputed states, `[BLOCK + 1, ROWS]` rows of up to `COLS`.
    hist: Vec<[T; COLS]>,
    /// Partial sums of a row block, `[BLOCK][ROWS]`.
    du4: Vec<[[T; 4]; ROWS]>,
    da4: Vec<[[T; 4]; ROWS]>,
    y4: Vec<[[T; 4]; ROWS]>,
    rows: RowSums<T>,
    /// This head's `dB`, `dC` terms, `[seqlen, dstate]`, when groups have several heads.
    db: Vec<T>,
    dc: Vec<T>,
}

impl<T> Default for Scratch<T> {
    fn default() -> Self {
        Scratch {
            ckpt: Vec::new(),
            sbar: Vec::new(),
            u: Vec::new(),
            ybar: Vec::new(),
            ybn: Vec::new(),
            bb: Vec::new(),
            cc: Vec::new(),
            dcb: Vec::new(),
            dbb: Vec::new(),
            hist: Vec::new(),
            du4: Vec::new(),
            da4: Vec::new(),
            y4: Vec::new(),
            rows: RowSums {
                du: Vec::new(),
                da: Vec::new(),
                y: Vec::new(),
            },
            db: Vec::new(),
            dc: Vec::new(),
        }
    }
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

/// State rows (`p`) a register tile holds.
const ROWS: usize = 4;
/// State columns (`n`) a register tile holds: a multiple of the 4 interleaved partial sums,
/// so that column `n0 + q` of a tile adds into partial sum `q mod 4`.
const COLS: usize = 8;

/// One block's per-token values (`nt` tokens), laid out tile by tile so that a tile reads
/// each as one contiguous run: the values of rows `p0..p0 + R` (a row block) are
/// `[nt, R]` at `p0 * nt`, those of columns `n0..n0 + P` (a column tile) `[nt, P]` at
/// `n0 * nt` (see [`tiles`]).
struct Blk<'a, T> {
    nt: usize,
    /// `a_t` (0 at a reset), `[nt]`.
    decay: &'a [T],
    /// `u_t = dt'_t x_t` and `ybar_t`, by row blocks.
    u: &'a [T],
    ybar: &'a [T],
    /// `B_t` and `C_t`, by column tiles.
    b: &'a [T],
    c: &'a [T],
    headdim: usize,
    dstate: usize,
}

/// What the tiles of one block add up, in the order a token's step takes them.
struct Sums<'a, T> {
    /// `dC_t` and `dB_t` of this head, by column tiles as [`Blk::b`]: each column summed
    /// over `p` in increasing order (row block after row block).
    dc: &'a mut [T],
    db: &'a mut [T],
    /// Per token and row of the current row block (`[nt][R]`), the 4 interleaved partial
    /// sums over `n` of `du = S B`, `da = <S, s_{t-1}>` and (with `z`) `s_t C`, column tile
    /// after column tile.
    du: &'a mut [[[T; 4]; ROWS]],
    da: &'a mut [[[T; 4]; ROWS]],
    y: &'a mut [[[T; 4]; ROWS]],
}

/// The column tiles `(n0, P)` of `dstate` columns, in increasing `n`: [`COLS`] wide, then
/// one of 4, then single columns.
fn tiles(ds: usize) -> impl Iterator<Item = (usize, usize)> {
    let full = ds / COLS * COLS;
    let four = if ds - full >= 4 { 4 } else { 0 };
    (0..full)
        .step_by(COLS)
        .map(|n0| (n0, COLS))
        .chain((full..full + four).step_by(4).map(|n0| (n0, 4)))
        .chain((full + four..ds).map(|n0| (n0, 1)))
}

/// The row blocks `(p0, R)` of `headdim` rows: [`ROWS`] high, then single rows.
fn row_blocks(hd: usize) -> impl Iterator<Item = (usize, usize)> {
    let full = hd / ROWS * ROWS;
    (0..full)
        .step_by(ROWS)
        .map(|p0| (p0, ROWS))
        .chain((full..hd).map(|p0| (p0, 1)))
}

/// The partial sum column `n0 + q` of a `P`-column tile adds into (`n mod 4`).
#[inline(always)]
fn lane<const P: usize>(n0: usize, q: usize) -> usize {
    if P.is_multiple_of(4) {
        q % 4
    } else {
        (n0 + q) % 4
    }
}

/// Loads the `R x P` tile at rows `p0..`, columns `n0..` of a `[headdim, dstate]` state.
#[inline(always)]
fn load_tile<T: Real, const R: usize, const P: usize>(
    s: &[T],
    ds: usize,
    p0: usize,
    n0: usize,
) -> [[T; P]; R] {
    let mut t = [[T::zero(); P]; R];
    for (r, row) in t.iter_mut().enumerate() {
        let o = (p0 + r) * ds + n0;
        row.copy_from_slice(&s[o..o + P]);
    }
    t
}

/// Stores an `R x P` tile at rows `p0..`, columns `n0..` of a `[headdim, dstate]` state.
#[inline(always)]
fn store_tile<T: Real, const R: usize, const P: usize>(
    s: &mut [T],
    ds: usize,
    p0: usize,
    n0: usize,
    t: &[[T; P]; R],
) {
    for (r, row) in t.iter().enumerate() {
        let o = (p0 + r) * ds + n0;
        s[o..o + P].copy_from_slice(row);
    }
}

/// One token's step of the forward on a tile, in registers: `s = a s + u B^T`, each entry
/// `a * s + (u[p] * B[n])` with one rounding for the multiply-add (as [`crate::naive`]).
#[inline(always)]
fn step_tile<T: Real, const R: usize, const P: usize>(
    s: &mut [[T; P]; R],
    a: T,
    u: &[T; R],
    b: &[T; P],
) {
    for (row, &ur) in s.iter_mut().zip(u) {
        for (v, &bn) in row.iter_mut().zip(b) {
            *v = a.mul_add(*v, ur * bn);
        }
    }
}

/// The rows `p0..p0 + R` of a block's values laid out by row blocks, `[nt, R]`.
#[inline(always)]
fn rows_of<T, const R: usize>(v: &[T], nt: usize, p0: usize) -> &[T] {
    &v[p0 * nt..(p0 + R) * nt]
}

/// The columns `n0..n0 + P` of a block's values laid out by column tiles, `[nt, P]`.
#[inline(always)]
fn cols_of<T, const P: usize>(v: &[T], nt: usize, n0: usize) -> &[T] {
    &v[n0 * nt..(n0 + P) * nt]
}

/// The forward through a whole block on the tile at rows `p0..`, columns `n0..`, from `before`
/// (the state before the block) into `after`.
#[inline(always)]
fn sweep_tile<T: Real, const R: usize, const P: usize>(
    blk: &Blk<T>,
    before: &[T],
    after: &mut [T],
    p0: usize,
    n0: usize,
) {
    let (nt, ds) = (blk.nt, blk.dstate);
    let mut s = load_tile::<T, R, P>(before, ds, p0, n0);
    let us = rows_of::<T, R>(blk.u, nt, p0).chunks_exact(R);
    let bs = cols_of::<T, P>(blk.b, nt, n0).chunks_exact(P);
    for ((&a, u), b) in blk.decay.iter().zip(us).zip(bs) {
        let u: &[T; R] = u.try_into().expect("R values");
        let b: &[T; P] = b.try_into().expect("P values");
        step_tile(&mut s, a, u, b);
    }
    store_tile(after, ds, p0, n0, &s);
}

/// The backward through a whole block on the tile at rows `p0..`, columns `n0..`: the tile's
/// forward states are recomputed from `before` (the state before the block) into `hist`, then
/// the tokens are walked in reverse with the tile of `S` (`sbar`) in registers. Per token
/// `k` and entry, in this order (as the token-by-token steps of the module documentation):
///
/// ```text
/// S = ybar[p] C[n] + S          dC[n] += ybar[p] s_t          dB[n] += u[p] S
/// du[p] += S B[n]               da[p] += S s_{t-1}            S = a S
/// ```
///
/// each multiply-add rounded once, `dC`, `dB` over the rows in increasing `p`, `du` and `da`
/// in the partial sum of column `n` (`n mod 4`); with `Z`, also `y[p] += s_t C[n]` (product
/// and sum rounded apart, as [`dot`]).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn back_tile<T: Real, const R: usize, const P: usize, const Z: bool>(
    blk: &Blk<T>,
    before: &[T],
    hist: &mut [[T; COLS]],
    sbar: &mut [T],
    sums: &mut Sums<T>,
    p0: usize,
    n0: usize,
) {
    let (nt, ds) = (blk.nt, blk.dstate);
    let us = rows_of::<T, R>(blk.u, nt, p0);
    let ys = rows_of::<T, R>(blk.ybar, nt, p0);
    let bs = cols_of::<T, P>(blk.b, nt, n0);
    let cs = cols_of::<T, P>(blk.c, nt, n0);
    let hist = &mut hist[..(nt + 1) * R];
    // The tile's states: hist[k * R + r] is its row r before token k (after token k - 1).
    let mut s = load_tile::<T, R, P>(before, ds, p0, n0);
    for (hr, sr) in hist[..R].iter_mut().zip(&s) {
        hr[..P].copy_from_slice(sr);
    }
    let steps = blk
        .decay
        .iter()
        .zip(us.chunks_exact(R))
        .zip(bs.chunks_exact(P))
        .zip(hist[R..].chunks_exact_mut(R));
    for (((&a, u), b), h) in steps {
        let u: &[T; R] = u.try_into().expect("R values");
        let b: &[T; P] = b.try_into().expect("P values");
        step_tile(&mut s, a, u, b);
        for (hr, sr) in h.iter_mut().zip(&s) {
            hr[..P].copy_from_slice(sr);
        }
    }
    let mut sb = load_tile::<T, R, P>(sbar, ds, p0, n0);
    // Token by token in reverse: zipped slices, so that no index needs a bounds check.
    let (dcs, dbs) = (
        &mut sums.dc[n0 * nt..(n0 + P) * nt],
        &mut sums.db[n0 * nt..(n0 + P) * nt],
    );
    let (hp, ht) = (&hist[..nt * R], &hist[R..]);
    let per_token = blk
        .decay
        .iter()
        .zip(hp.chunks_exact(R).zip(ht.chunks_exact(R)))
        .zip(cs.chunks_exact(P).zip(bs.chunks_exact(P)))
        .zip(ys.chunks_exact(R).zip(us.chunks_exact(R)))
        .zip(dcs.chunks_exact_mut(P).zip(dbs.chunks_exact_mut(P)))
        .zip(sums.du.iter_mut().zip(sums.da.iter_mut()))
        .enumerate()
        .rev();
    for (k, (((((&a, (s_prev, s_t)), (c, b)), (y, u)), (dc, db)), (du, da))) in per_token {
        let c: &[T; P] = c.try_into().expect("P values");
        let b: &[T; P] = b.try_into().expect("P values");
        let y: &[T; R] = y.try_into().expect("R values");
        let u: &[T; R] = u.try_into().expect("R values");
        let dc: &mut [T; P] = dc.try_into().expect("P values");
        let db: &mut [T; P] = db.try_into().expect("P values");
        let (mut dcv, mut dbv) = (*dc, *db);
        for r in 0..R {
            let (yr, ur) = (y[r], u[r]);
            let (mut dur, mut dar) = (du[r], da[r]);
            for q in 0..P {
                let j = lane::<P>(n0, q);
                let sv = yr.mul_add(c[q], sb[r][q]);
                dcv[q] = yr.mul_add(s_t[r][q], dcv[q]);
                dbv[q] = ur.mul_add(sv, dbv[q]);
                dur[j] = sv.mul_add(b[q], dur[j]);
                dar[j] = sv.mul_add(s_prev[r][q], dar[j]);
                sb[r][q] = a * sv;
            }
            du[r] = dur;
            da[r] = dar;
        }
        *dc = dcv;
        *db = dbv;
        if Z {
            let yk = &mut sums.y[k];
            for r in 0..R {
                let mut yv = yk[r];
                for q in 0..P {
                    let j = lane::<P>(n0, q);
                    yv[j] = yv[j] + s_t[r][q] * c[q];
                }
                yk[r] = yv;
            }
        }
    }
    store_tile(sbar, ds, p0, n0, &sb);
}

/// Writes `f(src[p])` for token `k` into `dst`, laid out by row blocks ([`Blk`]).
#[inline(always)]
fn put_by_rows<T: Copy>(dst: &mut [T], nt: usize, k: usize, src: &[T], f: impl Fn(T) -> T) {
    let full = src.len() / ROWS * ROWS;
    for (j, s) in src[..full].chunks_exact(ROWS).enumerate() {
        let o = j * ROWS * nt + k * ROWS;
        for (d, &v) in dst[o..o + ROWS].iter_mut().zip(s) {
            *d = f(v);
        }
    }
    for (p, &v) in src.iter().enumerate().skip(full) {
        dst[p * nt + k] = f(v);
    }
}

/// Writes token `k`'s row `src` into `dst`, laid out by column tiles ([`Blk`], [`tiles`]).
#[inline(always)]
fn put_by_cols<T: Copy>(dst: &mut [T], nt: usize, k: usize, src: &[T]) {
    let ds = src.len();
    let full = ds / COLS * COLS;
    for (j, s) in src[..full].chunks_exact(COLS).enumerate() {
        let o = j * COLS * nt + k * COLS;
        dst[o..o + COLS].copy_from_slice(s);
    }
    let mut n0 = full;
    if ds - full >= 4 {
        let o = n0 * nt + k * 4;
        dst[o..o + 4].copy_from_slice(&src[n0..n0 + 4]);
        n0 += 4;
    }
    for n in n0..ds {
        dst[n * nt + k] = src[n];
    }
}

/// Token `k`'s row of `src` (laid out by column tiles) into `dst` as `0 + v`: the sum over a
/// group's heads that starts from 0.
#[inline(always)]
fn take_by_cols<T: Real>(dst: &mut [T], src: &[T], nt: usize, k: usize) {
    let ds = dst.len();
    let full = ds / COLS * COLS;
    for (j, d) in dst[..full].chunks_exact_mut(COLS).enumerate() {
        let o = j * COLS * nt + k * COLS;
        for (a, &v) in d.iter_mut().zip(&src[o..o + COLS]) {
            *a = T::zero() + v;
        }
    }
    let mut n0 = full;
    if ds - full >= 4 {
        let o = n0 * nt + k * 4;
        for (a, &v) in dst[n0..n0 + 4].iter_mut().zip(&src[o..o + 4]) {
            *a = T::zero() + v;
        }
        n0 += 4;
    }
    for n in n0..ds {
        dst[n] = T::zero() + src[n * nt + k];
    }
}

/// `(s0 + s1) + (s2 + s3)`.
#[inline(always)]
fn total<T: Real>(s: [T; 4]) -> T {
    (s[0] + s[1]) + (s[2] + s[3])
}

/// The forward through one block on the whole state, tile by tile: `before` to `after`.
#[inline(always)]
fn sweep_block<T: Real>(blk: &Blk<T>, before: &[T], after: &mut [T]) {
    for (p0, r) in row_blocks(blk.headdim) {
        if r == ROWS {
            sweep_cols::<T, ROWS>(blk, before, after, p0);
        } else {
            sweep_cols::<T, 1>(blk, before, after, p0);
        }
    }
}

/// [`sweep_block`] on the rows `p0..p0 + R`.
#[inline(always)]
fn sweep_cols<T: Real, const R: usize>(blk: &Blk<T>, before: &[T], after: &mut [T], p0: usize) {
    for (n0, w) in tiles(blk.dstate) {
        match w {
            COLS => sweep_tile::<T, R, COLS>(blk, before, after, p0, n0),
            4 => sweep_tile::<T, R, 4>(blk, before, after, p0, n0),
            _ => sweep_tile::<T, R, 1>(blk, before, after, p0, n0),
        }
    }
}

/// The backward through one block for the rows `p0..p0 + R`, column tile after column tile;
/// the row sums of `du`, `da` (and `y`) are then complete.
#[inline(always)]
fn back_rows<T: Real, const R: usize, const Z: bool>(
    blk: &Blk<T>,
    before: &[T],
    sbar: &mut [T],
    sums: &mut Sums<T>,
    hist: &mut [[T; COLS]],
    p0: usize,
) {
    let nt = blk.nt;
    let ny = if Z { nt } else { 0 };
    for v in sums.du[..nt]
        .iter_mut()
        .chain(sums.da[..nt].iter_mut())
        .chain(sums.y[..ny].iter_mut())
    {
        *v = [[T::zero(); 4]; ROWS];
    }
    for (n0, w) in tiles(blk.dstate) {
        match w {
            COLS => back_tile::<T, R, COLS, Z>(blk, before, hist, sbar, sums, p0, n0),
            4 => back_tile::<T, R, 4, Z>(blk, before, hist, sbar, sums, p0, n0),
            _ => back_tile::<T, R, 1, Z>(blk, before, hist, sbar, sums, p0, n0),
        }
    }
}

/// The backward through one block on the whole state: row block after row block, each
/// column tile after column tile.
#[inline(always)]
fn back_block<T: Real, const Z: bool>(
    blk: &Blk<T>,
    before: &[T],
    sbar: &mut [T],
    sums: &mut Sums<T>,
    hist: &mut [[T; COLS]],
    rows: &mut RowSums<T>,
) {
    let (nt, hd) = (blk.nt, blk.headdim);
    rows.da[..nt].fill(T::zero());
    for (p0, r) in row_blocks(hd) {
        if r == ROWS {
            back_rows::<T, ROWS, Z>(blk, before, sbar, sums, hist, p0);
        } else {
            back_rows::<T, 1, Z>(blk, before, sbar, sums, hist, p0);
        }
        for k in 0..nt {
            for j in 0..r {
                rows.du[k * hd + p0 + j] = total(sums.du[k][j]);
                rows.da[k] = rows.da[k] + total(sums.da[k][j]);
                if Z {
                    rows.y[k * hd + p0 + j] = total(sums.y[k][j]);
                }
            }
        }
    }
}

/// The complete sums of one block over `n` (then `p` for `da`).
struct RowSums<T> {
    /// `du_t`, `[nt, headdim]`.
    du: Vec<T>,
    /// `da_t`, `[nt]`.
    da: Vec<T>,
    /// `s_t C_t` (without the skip), `[nt, headdim]`, with `z` only.
    y: Vec<T>,
}

crate::simd::multiversion! {
    /// [`unit_body`], compiled for AVX2 + FMA where the processor has them (the same
    /// operations, so the same bits, on every path).
    fn unit[T: Real](
        p: &Problem<T>,
        f: &Flat<'_, T>,
        dfinal: Option<ndarray::ArrayView2<'_, T>>,
        dest: Dest<'_, T>,
        sc: &mut Scratch<T>,
    ) -> UnitSums<T> {
        unit_body(p, f, dfinal, dest, sc)
    }
}

/// One (row, head) pair's share of the gradients: the forward sweep with its checkpoints, then
/// the backward sweep, block by block in reverse.
#[inline(always)]
fn unit_body<T: Real>(
    p: &Problem<T>,
    f: &Flat<T>,
    dfinal: Option<ndarray::ArrayView2<T>>,
    dest: Dest<T>,
    sc: &mut Scratch<T>,
) -> UnitSums<T> {
    if f.z.is_some() {
        unit_z::<T, true>(p, f, dfinal, dest, sc)
    } else {
        unit_z::<T, false>(p, f, dfinal, dest, sc)
    }
}

/// Copies one block's per-token values into the scratch (`u`, `B`, and for the backward sweep
/// (`back`) `ybar`, `C`), and asks for the rows of the block `next` (if any) into L2.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn stage<T: Real>(
    p: &Problem<T>,
    f: &Flat<T>,
    b: usize,
    h: usize,
    dtp: &[T],
    t0: usize,
    nt: usize,
    next: Option<usize>,
    back: bool,
    sc: &mut Scratch<T>,
) {
    let d = *p.dims();
    let (l, hd, ds) = (d.seqlen, d.headdim, d.dstate);
    let g = d.group_of_head(h);
    let x_at = |t: usize| ((b * l + t) * d.nheads + h) * hd;
    let bc_at = |t: usize| ((b * l + t) * d.ngroups + g) * ds;
    if let Some(n0) = next {
        let nn = BLOCK.min(l - n0);
        let (xs, bcs) = (d.nheads * hd, d.ngroups * ds);
        prefetch::rows(f.bm, bc_at(n0), bcs, nn, ds);
        prefetch::rows(f.x, x_at(n0), xs, nn, hd);
        if back {
            prefetch::rows(f.cm, bc_at(n0), bcs, nn, ds);
            prefetch::rows(f.dout, x_at(n0), xs, nn, hd);
            if let Some(z) = f.z {
                prefetch::rows(z, x_at(n0), xs, nn, hd);
            }
        }
    }
    for k in 0..nt {
        let t = t0 + k;
        let xo = x_at(t);
        let x = &f.x[xo..xo + hd];
        let dt = dtp[t];
        put_by_rows(&mut sc.u, nt, k, x, |v| dt * v);
        let bc = bc_at(t);
        put_by_cols(&mut sc.bb, nt, k, &f.bm[bc..bc + ds]);
        if !back {
            continue;
        }
        put_by_cols(&mut sc.cc, nt, k, &f.cm[bc..bc + ds]);
        let yb = &mut sc.ybn[k * hd..(k + 1) * hd];
        let go = &f.dout[xo..xo + hd];
        match f.z {
            Some(z) => {
                for ((v, &gv), &zv) in yb.iter_mut().zip(go).zip(&z[xo..xo + hd]) {
                    *v = gv * (zv * sigmoid(zv));
                }
            }
            None => yb.copy_from_slice(go),
        }
        put_by_rows(&mut sc.ybar, nt, k, &sc.ybn[k * hd..(k + 1) * hd], |v| v);
    }
}

/// [`unit_body`] with (`Z`) or without the gate.
#[inline(always)]
fn unit_z<T: Real, const Z: bool>(
    p: &Problem<T>,
    f: &Flat<T>,
    dfinal: Option<ndarray::ArrayView2<T>>,
    mut dest: Dest<T>,
    sc: &mut Scratch<T>,
) -> UnitSums<T> {
    let d = *p.dims();
    let i = p.inputs();
    let (b, h) = (dest.b, dest.h);
    let (l, hd, ds) = (d.seqlen, d.headdim, d.dstate);
    let sz = hd * ds;
    let a_h = i.A[h];
    let x_at = |t: usize| ((b * l + t) * d.nheads + h) * hd;
    let st = steps(p, b, h);
    let d_skip: Vec<T> = (0..hd).map(|pp| p.d_skip(h, pp)).collect();
    let nblocks = l.div_ceil(BLOCK);
    sc.u.resize(BLOCK * hd, T::zero());
    sc.ybar.resize(BLOCK * hd, T::zero());
    sc.ybn.resize(BLOCK * hd, T::zero());
    sc.bb.resize(BLOCK * ds, T::zero());
    sc.cc.resize(BLOCK * ds, T::zero());
    sc.dcb.resize(BLOCK * ds, T::zero());
    sc.dbb.resize(BLOCK * ds, T::zero());
    sc.hist.resize((BLOCK + 1) * ROWS, [T::zero(); COLS]);
    sc.du4.resize(BLOCK, [[T::zero(); 4]; ROWS]);
    sc.da4.resize(BLOCK, [[T::zero(); 4]; ROWS]);
    sc.y4
        .resize(if Z { BLOCK } else { 0 }, [[T::zero(); 4]; ROWS]);
    sc.rows.du.resize(BLOCK * hd, T::zero());
    sc.rows.da.resize(BLOCK, T::zero());
    sc.rows.y.resize(if Z { BLOCK * hd } else { 0 }, T::zero());
    if dest.db.is_none() {
        sc.db.resize(l * ds, T::zero());
        sc.dc.resize(l * ds, T::zero());
    }

    // Forward sweep: the state before each block of BLOCK tokens.
    sc.ckpt.resize(nblocks * sz, T::zero());
    match &i.initial_states {
        Some(s0) => {
            for pp in 0..hd {
                for n in 0..ds {
                    sc.ckpt[pp * ds + n] = s0[[b, h, pp, n]];
                }
            }
        }
        None => sc.ckpt[..sz].fill(T::zero()),
    }
    for blk in 0..nblocks - 1 {
        let t0 = blk * BLOCK;
        let next = (blk + 2 < nblocks).then_some(t0 + BLOCK);
        stage(p, f, b, h, &st.dtp, t0, BLOCK, next, false, sc);
        let (done, rest) = sc.ckpt.split_at_mut((blk + 1) * sz);
        let bk = Blk {
            nt: BLOCK,
            decay: &st.decay[t0..t0 + BLOCK],
            u: &sc.u,
            ybar: &sc.ybar,
            b: &sc.bb,
            c: &sc.cc,
            headdim: hd,
            dstate: ds,
        };
        sweep_block(&bk, &done[blk * sz..], &mut rest[..sz]);
    }

    let mut r = UnitSums {
        dd: vec![T::zero(); hd],
        da: T::zero(),
        ddt_bias: T::zero(),
    };
    // S = dL/ds_t, `[headdim, dstate]` row-major.
    sc.sbar.resize(sz, T::zero());
    match dfinal {
        Some(fin) => {
            for pp in 0..hd {
                for n in 0..ds {
                    sc.sbar[pp * ds + n] = fin[[pp, n]];
                }
            }
        }
        None => sc.sbar.fill(T::zero()),
    }
    for blk in (0..nblocks).rev() {
        let t0 = blk * BLOCK;
        let nt = BLOCK.min(l - t0);
        let next = blk.checked_sub(1).map(|pb| pb * BLOCK);
        stage(p, f, b, h, &st.dtp, t0, nt, next, true, sc);
        // The rows of the outputs the next block writes, into L2 (each on another page).
        if let Some(n0) = next {
            for t in n0..n0 + BLOCK {
                prefetch::span(dest.dx.row(t).as_ptr(), hd);
                for v in [&dest.dz, &dest.db, &dest.dc].into_iter().flatten() {
                    prefetch::span(v.row(t).as_ptr(), v.ncols());
                }
            }
        }
        sc.dcb[..nt * ds].fill(T::zero());
        sc.dbb[..nt * ds].fill(T::zero());
        let bk = Blk {
            nt,
            decay: &st.decay[t0..t0 + nt],
            u: &sc.u[..nt * hd],
            ybar: &sc.ybar[..nt * hd],
            b: &sc.bb[..nt * ds],
            c: &sc.cc[..nt * ds],
            headdim: hd,
            dstate: ds,
        };
        let mut sums = Sums {
            dc: &mut sc.dcb[..nt * ds],
            db: &mut sc.dbb[..nt * ds],
            du: &mut sc.du4[..nt],
            da: &mut sc.da4[..nt],
            y: &mut sc.y4,
        };
        back_block::<T, Z>(
            &bk,
            &sc.ckpt[blk * sz..(blk + 1) * sz],
            &mut sc.sbar,
            &mut sums,
            &mut sc.hist,
            &mut sc.rows,
        );
        // This head's dC_t, dB_t: into the outputs (0 + v, as the sum over a group's one
        // head) or the scratch.
        for k in 0..nt {
            let t = t0 + k;
            let (dcr, dbr): (&mut [T], &mut [T]) = match (&mut dest.dc, &mut dest.db) {
                (Some(dc), Some(db)) => (row(dc, t), row(db, t)),
                _ => (
                    &mut sc.dc[t * ds..(t + 1) * ds],
                    &mut sc.db[t * ds..(t + 1) * ds],
                ),
            };
            take_by_cols(dcr, &sc.dcb, nt, k);
            take_by_cols(dbr, &sc.dbb, nt, k);
        }
        // The per-token rest, in decreasing t.
        for k in (0..nt).rev() {
            let t = t0 + k;
            let xo = x_at(t);
            let x = &f.x[xo..xo + hd];
            let yb = &sc.ybn[k * hd..(k + 1) * hd];
            // The gate.
            if let (true, Some(z), Some(dz)) = (Z, f.z, &mut dest.dz) {
                let z = &z[xo..xo + hd];
                let go = &f.dout[xo..xo + hd];
                let y = &sc.rows.y[k * hd..(k + 1) * hd];
                let terms = row(dz, t).iter_mut().zip(y).zip(&d_skip).zip(x);
                for ((((o, &yv), &dv), &xv), (&gv, &zv)) in terms.zip(go.iter().zip(z)) {
                    let y = yv + dv * xv;
                    let sg = sigmoid(zv);
                    *o = gv * y * (sg * (T::one() + zv * (T::one() - sg)));
                }
            }
            // The skip connection, and through u_t = dt'_t x_t.
            let du = &sc.rows.du[k * hd..(k + 1) * hd];
            let dtp = st.dtp[t];
            for ((dd, &yv), &xv) in r.dd.iter_mut().zip(yb).zip(x) {
                *dd = *dd + yv * xv;
            }
            let dx = row(&mut dest.dx, t);
            for (((o, &dv), &yv), &duv) in dx.iter_mut().zip(&d_skip).zip(yb).zip(du) {
                *o = dv * yv + dtp * duv;
            }
            // Through a_t = exp(dt'_t A).
            let (a_t, da) = (st.decay[t], sc.rows.da[k]);
            let mut ddtp = dot(du, x);
            if !st.reset[t] {
                ddtp = ddtp + da * a_t * a_h;
                r.da = r.da + da * a_t * st.dtp[t];
            }
            let ddt = ddtp * st.ddtp_ddt[t];
            dest.ddt[t] = ddt;
            r.ddt_bias = r.ddt_bias + ddt;
        }
    }
    if let Some(di) = &mut dest.dinit {
        for pp in 0..hd {
            for n in 0..ds {
                di[[pp, n]] = sc.sbar[pp * ds + n];
            }
        }
    }
    r
}
