//! The chunked backward pass, stage by stage, as the GPU kernels run it.
//!
//! The reverse-mode derivative of the chunked forward ([`crate::chunked`]): every stage of
//! mamba_ssm's backward is a public function here, returning its intermediate, so that a
//! kernel author can check one backward kernel at a time. It equals the adjoint recurrence
//! ([`crate::adjoint::backward`], the gradient ground truth) up to rounding; `docs/math.md`
//! ("The chunked backward, stage by stage") derives every equation and why.
//!
//! # Notation
//! Row `b`, head `h` of group `g`, chunk `c`: `t0 = c * chunk_size`, `L` valid tokens, local
//! indices `i, j, k` in `0..L`; `cs = dA_cumsum[b, h, c, :]` (length `chunk_size`, flat past
//! `L`), `dt'_j`, `seq_j = seq_idx[b, t0 + j]`, `seq_prev = seq_idx[b, t0 - 1]` (0 for
//! `c = 0`); `x_c`, `B_c`, `C_c` the chunk's rows (`L x headdim`, `L x dstate`, `L x dstate`);
//! `S_c = chunk_states[b, c, h]` the state entering the chunk (`headdim x dstate`). The masks
//! and decays of the forward:
//!
//! ```text
//! e_i    = exp(cs_i)                   if seq_i == seq_prev,  else 0      (carried term)
//! v_j    = exp(cs_{L-1} - cs_j)        if seq_j == seq_{L-1}, else 0      (chunk state)
//! w_j    = v_j * dt'_j
//! dec_ij = exp(cs_i - cs_j)            if j <= i and seq_j == seq_i, else 0
//! scale_c = exp(cs[chunk_size - 1])    if seq_{L-1} == seq_prev, else 0   (state passing)
//! ```
//!
//! # Stages
//! 1. [`bwd_gate`]: `ybar = dout * silu(z)` (or `dout`), the gradient of the output before
//!    the gate; `dz = dout * y * silu'(z)`, with `y` (before the gate) recomputed by the
//!    forward's [`compute_out`].
//! 2. [`bwd_dstates`]: each chunk's own contribution to the cotangent of the state entering
//!    it, `dstates[c] = sum_i e_i ybar_i C_i^T`.
//! 3. [`bwd_pass_state`]: the reverse pass across chunks: `dstates_passed[c] = dL/dS_{c+1}`
//!    (the cotangent of the state after chunk `c`, seeded by `dfinal_states`),
//!    `dchunk_states[c] = dL/dS_c`, `dinitial_states`, and `ddA_chunk_cumsum`.
//! 4. [`bwd_dx`]: `dx`, the part `ddt_x` of the `dt'` gradient that comes through `dt' x`,
//!    and `dD`.
//! 5. [`bwd_db`], [`bwd_dc`]: `dB`, `dC`, summed over the heads of a group.
//! 6. [`bwd_ddA_cumsum`]: the gradient with respect to `dA_cumsum` and, computed without
//!    cancellation, with respect to each token's `dA_k = dt'_k A` (its reverse cumsum).
//! 7. [`chunk_cumsum_bwd`]: from there to `ddt'`, `dA`, and through clamp, softplus and bias
//!    to `ddt`, `ddt_bias`.
//!
//! [`backward`] runs them all.
//!
//! # TF32 rounding points
//! Under [`MatmulPrecision::Tf32`] every operand of every matrix product is rounded to TF32
//! ([`Real::round_tf32`]; to bfloat16 at the same points under [`MatmulPrecision::Bf16`], which
//! is not calibrated for gradients); sums, masks, decays, dot products that are not matrix products,
//! and element-wise work stay in `T`. The products and their rounded operands (`X_c`, `Ybar_c`
//! the chunk's rows of `x` and `ybar`, `Sbar = dstates_passed[c]`):
//!
//! | stage | product | operands rounded |
//! | --- | --- | --- |
//! | `dstates` | `Ybar_c^T (diag(e) C_c)` | `Ybar_c`; `e_i C_i`, rounded after the scaling |
//! | `G` (dx, ddA) | `C_c B_c^T` | `C_c`, `B_c` |
//! | `dx` carried | `B_c Sbar^T`, rows then times `v_j` | `B_c`, `Sbar` |
//! | `dx` intra | `K^T Ybar_c`, `K_ij = G_ij dec_ij` | `K` (after decay and mask), `Ybar_c` |
//! | `M` (dB, dC, ddA) | `Ybar_c X_c^T` | `Ybar_c`, `X_c` |
//! | `dB` carried | `X_c Sbar`, rows then times `w_j` | `X_c`, `Sbar` |
//! | `dB` intra | `P^T C_c`, `P_ij = (M_ij dec_ij) dt'_j` | `P` (after decay, `dt'`, mask), `C_c` |
//! | `dC` carried | `Ybar_c S_c`, rows then times `e_i` | `Ybar_c`, `S_c` |
//! | `dC` intra | `P B_c` | `P`, `B_c` |
//!
//! The `ddA` terms reuse the products above (`G`, `M`, the carried `dC` and `dB` rows) and
//! finish with element-wise products and dot products with the unrounded `C_i`, `B_j` and
//! the unrounded `P`; `ddt_x` is the dot product of `du_j` with the unrounded `x_j`; the
//! `D` terms use the unrounded `x` and `ybar`.
//!
//! # Order of the sums
//! Every matrix product sums over its inner index in increasing order, one fused
//! multiply-add per term; the other sums run in the orders their functions state. Work is
//! split over (batch, chunk, head or group) or (batch, head) units in parallel, and each
//! unit's result is stored or added in unit order: the bits do not depend on the number of
//! threads.
//!
//! # Example
//! The stages one by one give the same bits as the driver:
//! ```
//! use ssd_reference::chunked_backward as cb;
//! use ssd_reference::random::{random_problem, ProblemSpec};
//! use ssd_reference::{chunk_cumsum::chunk_cumsum, fwd_pass_state::fwd_pass_state};
//! use ssd_reference::{Dims, MatmulPrecision};
//!
//! let p = random_problem(&ProblemSpec::full(Dims::new(1, 20, 2, 3, 1, 4), 8), 1).unwrap();
//! let dout = ndarray::Array4::<f64>::ones((1, 20, 2, 3));
//! let prec = MatmulPrecision::Native;
//! let cumsum = chunk_cumsum(&p);
//! let states = fwd_pass_state(&p, &cumsum, prec).chunk_states;
//! let gate = cb::bwd_gate(&p, &cumsum, states.view(), dout.view(), prec).unwrap();
//! let ybar = gate.ybar.view();
//! let dstates = cb::bwd_dstates(&p, &cumsum, ybar, prec).unwrap();
//! let pass = cb::bwd_pass_state(&p, &cumsum, states.view(), dstates.view(), None).unwrap();
//! let passed = pass.dstates_passed.view();
//! let dx = cb::bwd_dx(&p, &cumsum, ybar, passed, prec).unwrap();
//! let db = cb::bwd_db(&p, &cumsum, ybar, passed, prec).unwrap();
//! let dc = cb::bwd_dc(&p, &cumsum, ybar, states.view(), prec).unwrap();
//! let dda = cb::bwd_ddA_cumsum(
//!     &p, &cumsum, ybar, states.view(), passed, pass.ddA_chunk_cumsum.view(), prec,
//! )
//! .unwrap();
//! let ddt = cb::chunk_cumsum_bwd(&p, &cumsum, dda.ddA.view(), dx.ddt_x.view()).unwrap();
//!
//! let g = cb::backward(&p, dout.view(), None, prec).unwrap();
//! assert_eq!(g.grads.dx, dx.dx);
//! assert_eq!(g.grads.dB, db);
//! assert_eq!(g.grads.dC, dc);
//! assert_eq!(g.grads.ddt, ddt.ddt);
//! assert_eq!(g.grads.dA, ddt.dA);
//! ```
use ndarray::{Array1, Array3, Array4, Array5, ArrayD, ArrayView3, ArrayView4, ArrayView5, IxDyn};
use rayon::prelude::*;

use crate::adjoint::Gradients;
use crate::chunk_cumsum::{chunk_cumsum, ChunkCumsum};
use crate::compute_out::compute_out;
use crate::flat::Flat;
use crate::fwd_pass_state::{fwd_pass_state, pass_scale};
use crate::gemm::{gemm, Epilogue, Mat, Tri};
use crate::problem::{check_finite, check_shape, softplus};
use crate::{Inputs, MatmulPrecision, Problem, Real, ReferenceError};

/// Everything the chunked backward computes: the gradients and every intermediate.
#[allow(non_snake_case)]
#[derive(Debug, Clone)]
pub struct ChunkedGradients<T> {
    /// The gradients, the same fields, shapes and optional parts as
    /// [`crate::adjoint::backward`]'s.
    pub grads: Gradients<T>,
    /// `ybar = dout * silu(z)` (or `dout`): `[batch, seqlen, nheads, headdim]`.
    pub ybar: Array4<T>,
    /// `y`, the output before the gate, recomputed (only when the problem has `z`):
    /// `[batch, seqlen, nheads, headdim]`.
    pub y: Option<Array4<T>>,
    /// Forward: `dA_cumsum`, `[batch, nheads, nchunks, chunk_size]`.
    pub dA_cumsum: Array4<T>,
    /// Forward: the state entering each chunk, `[batch, nchunks, nheads, headdim, dstate]`.
    pub chunk_states: Array5<T>,
    /// [`bwd_dstates`]: each chunk's own contribution to the cotangent of the state entering
    /// it, `[batch, nchunks, nheads, headdim, dstate]`.
    pub dstates: Array5<T>,
    /// [`bwd_pass_state`]: `dL/dS_{c+1}`, the cotangent of the state after chunk `c` (index
    /// `nchunks - 1`: `dfinal_states` or 0), `[batch, nchunks, nheads, headdim, dstate]`.
    pub dstates_passed: Array5<T>,
    /// [`bwd_pass_state`]: `dL/dS_c`, the cotangent of the state entering chunk `c` (index 0:
    /// `dinitial_states`), `[batch, nchunks, nheads, headdim, dstate]`.
    pub dchunk_states: Array5<T>,
    /// [`bwd_pass_state`]: the gradient with respect to `dA_cumsum[.., chunk_size - 1]`
    /// through the state-passing decay only, `[batch, nheads, nchunks]`.
    pub ddA_chunk_cumsum: Array3<T>,
    /// [`bwd_dx`]: the `dt'` gradient through `dt' x`, `[batch, nheads, nchunks, chunk_size]`
    /// (0 past `seqlen`).
    pub ddt_x: Array4<T>,
    /// [`bwd_ddA_cumsum`]: `dL/d dA_cumsum`, `[batch, nheads, nchunks, chunk_size]`.
    pub ddA_cumsum: Array4<T>,
    /// [`bwd_ddA_cumsum`]: `dL/d dA_k` for each token's `dA_k = dt'_k A`, the reverse cumsum
    /// of `ddA_cumsum` within each chunk, `[batch, nheads, nchunks, chunk_size]`.
    pub ddA: Array4<T>,
    /// [`chunk_cumsum_bwd`]: `dL/d dt'` (before clamp and softplus), `[batch, nheads, nchunks,
    /// chunk_size]` (0 past `seqlen`).
    pub ddt_processed: Array4<T>,
}

/// The gradients of the forward at `p`, pulled back from `dout` and `dfinal_states` by the
/// chunked backward, stage by stage, with every intermediate.
///
/// Mathematically the same vector-Jacobian product as [`crate::adjoint::backward`]:
///
/// ```text
/// dI = d<dout, out>/dI + d<dfinal_states, final_states>/dI
/// ```
///
/// for every differentiable input `I`. Runs [`chunk_cumsum`] and [`fwd_pass_state`] (the
/// forward's `dA_cumsum` and `chunk_states`), then [`bwd_gate`], [`bwd_dstates`],
/// [`bwd_pass_state`], [`bwd_dx`], [`bwd_db`], [`bwd_dc`], [`bwd_ddA_cumsum`] and
/// [`chunk_cumsum_bwd`]. `precision` selects the rounding of every matrix-product operand
/// (see the module documentation), in the forward recomputation too.
///
/// # Errors
/// [`ReferenceError::InvalidProblem`] naming the tensor when `dout` or `dfinal_states` has the
/// wrong shape or a non-finite value (the same checks and messages as
/// [`crate::adjoint::backward`]).
///
/// # Example
/// ```
/// use ssd_reference::random::{random_problem, ProblemSpec};
/// use ssd_reference::{adjoint, chunked_backward, Dims, MatmulPrecision};
///
/// let p = random_problem(&ProblemSpec::full(Dims::new(1, 30, 2, 3, 1, 4), 8), 7).unwrap();
/// let dout = ndarray::Array4::<f64>::ones((1, 30, 2, 3));
/// let g = chunked_backward::backward(&p, dout.view(), None, MatmulPrecision::Native).unwrap();
/// let a = adjoint::backward(&p, dout.view(), None).unwrap();
/// for ((name, c), (_, r)) in g.grads.named().into_iter().zip(a.named()) {
///     let scale = r.iter().fold(1.0f64, |m, v| m.max(v.abs()));
///     for (u, v) in c.iter().zip(r.iter()) {
///         assert!((u - v).abs() <= 1e-12 * scale, "{name}: {u} vs {v}");
///     }
/// }
/// assert_eq!(g.dstates_passed.shape(), &[1, 4, 2, 3, 4]);
/// ```
pub fn backward<T: Real>(
    p: &Problem<T>,
    dout: ArrayView4<T>,
    dfinal_states: Option<ArrayView4<T>>,
    precision: MatmulPrecision,
) -> Result<ChunkedGradients<T>, ReferenceError> {
    crate::adjoint::check_upstream(p, &dout, dfinal_states.as_ref())?;
    let cumsum = chunk_cumsum(p);
    let chunk_states = fwd_pass_state(p, &cumsum, precision).chunk_states;
    let gate = bwd_gate(p, &cumsum, chunk_states.view(), dout, precision)?;
    let ybar = gate.ybar.view();
    let dstates = bwd_dstates(p, &cumsum, ybar, precision)?;
    let pass = bwd_pass_state(
        p,
        &cumsum,
        chunk_states.view(),
        dstates.view(),
        dfinal_states,
    )?;
    let passed = pass.dstates_passed.view();
    let dx = bwd_dx(p, &cumsum, ybar, passed, precision)?;
    let db = bwd_db(p, &cumsum, ybar, passed, precision)?;
    let dc = bwd_dc(p, &cumsum, ybar, chunk_states.view(), precision)?;
    let dda = bwd_ddA_cumsum(
        p,
        &cumsum,
        ybar,
        chunk_states.view(),
        passed,
        pass.ddA_chunk_cumsum.view(),
        precision,
    )?;
    let ct = chunk_cumsum_bwd(p, &cumsum, dda.ddA.view(), dx.ddt_x.view())?;
    let grads = Gradients {
        dx: dx.dx,
        ddt: ct.ddt,
        dA: ct.dA,
        dB: db,
        dC: dc,
        dD: dx.dD,
        dz: gate.dz,
        ddt_bias: ct.ddt_bias,
        dinitial_states: p
            .inputs()
            .initial_states
            .as_ref()
            .map(|_| pass.dinitial_states),
    };
    Ok(ChunkedGradients {
        grads,
        ybar: gate.ybar,
        y: gate.y,
        dA_cumsum: cumsum.dA_cumsum,
        chunk_states,
        dstates,
        dstates_passed: pass.dstates_passed,
        dchunk_states: pass.dchunk_states,
        ddA_chunk_cumsum: pass.ddA_chunk_cumsum,
        ddt_x: dx.ddt_x,
        ddA_cumsum: dda.ddA_cumsum,
        ddA: dda.ddA,
        ddt_processed: ct.ddt_processed,
    })
}

/// Checks that `cumsum` has the shapes [`chunk_cumsum`] gives for `p`.
fn check_cumsum<T: Real>(p: &Problem<T>, cumsum: &ChunkCumsum<T>) -> Result<(), ReferenceError> {
    let d = p.dims();
    let want = [d.batch, d.nheads, p.nchunks(), p.options().chunk_size];
    check_shape("dA_cumsum", cumsum.dA_cumsum.shape(), &want)?;
    check_shape("dt (processed, of chunk_cumsum)", cumsum.dt.shape(), &want)
}

/// `[batch, seqlen, nheads, headdim]` of `p`.
fn token_shape<T: Real>(p: &Problem<T>) -> [usize; 4] {
    let d = p.dims();
    [d.batch, d.seqlen, d.nheads, d.headdim]
}

/// `[batch, nchunks, nheads, headdim, dstate]` of `p`.
fn states_shape<T: Real>(p: &Problem<T>) -> [usize; 5] {
    let d = p.dims();
    [d.batch, p.nchunks(), d.nheads, d.headdim, d.dstate]
}

/// `[batch, nheads, nchunks, chunk_size]` of `p`.
fn chunk_shape<T: Real>(p: &Problem<T>) -> [usize; 4] {
    let d = p.dims();
    [d.batch, d.nheads, p.nchunks(), p.options().chunk_size]
}

#[inline]
fn sigmoid<T: Real>(v: T) -> T {
    T::one() / (T::one() + (-v).exp())
}

/// Output of [`bwd_gate`].
#[derive(Debug, Clone)]
pub struct GateBackward<T> {
    /// `ybar = dout * silu(z)` (or `dout` without `z`): `[batch, seqlen, nheads, headdim]`.
    pub ybar: Array4<T>,
    /// `y`, the output before the gate (with the `D` term), recomputed by [`compute_out`]
    /// (only with `z`).
    pub y: Option<Array4<T>>,
    /// `dz = dout * y * silu'(z)` (only with `z`).
    pub dz: Option<Array4<T>>,
}

/// The gate's backward: with `out = y * silu(z)`, `silu(z) = z sigmoid(z)`,
///
/// ```text
/// ybar = dout * (z * sigmoid(z))                               (dout without z)
/// dz   = dout * y * (sigmoid(z) * (1 + z * (1 - sigmoid(z))))    sigmoid(z) = 1 / (1 + exp(-z))
/// ```
///
/// evaluated in that order, with `y` recomputed by the forward's [`compute_out`] on the
/// problem without its gate (so under `precision`). Element-wise, parallel inside
/// [`compute_out`].
///
/// # Errors
/// [`ReferenceError::InvalidProblem`] naming the tensor when `dout` has the wrong shape or a
/// non-finite value, or `cumsum` or `chunk_states` do not have the shapes `p` implies.
pub fn bwd_gate<T: Real>(
    p: &Problem<T>,
    cumsum: &ChunkCumsum<T>,
    chunk_states: ArrayView5<T>,
    dout: ArrayView4<T>,
    precision: MatmulPrecision,
) -> Result<GateBackward<T>, ReferenceError> {
    check_shape("dout", dout.shape(), &token_shape(p))?;
    check_finite("dout", &dout)?;
    check_cumsum(p, cumsum)?;
    check_shape("chunk_states", chunk_states.shape(), &states_shape(p))?;
    let Some(z) = &p.inputs().z else {
        return Ok(GateBackward {
            ybar: dout.to_owned(),
            y: None,
            dz: None,
        });
    };
    let i = p.inputs();
    let ungated = Problem::new(
        *p.dims(),
        *p.options(),
        Inputs {
            x: i.x.clone(),
            dt: i.dt.clone(),
            A: i.A.clone(),
            B: i.B.clone(),
            C: i.C.clone(),
            D: i.D.clone(),
            z: None,
            dt_bias: i.dt_bias.clone(),
            initial_states: i.initial_states.clone(),
            seq_idx: i.seq_idx.clone(),
        },
    )?;
    let y = compute_out(&ungated, cumsum, &chunk_states.to_owned(), precision);
    let mut ybar = dout.to_owned();
    let mut dz = Array4::<T>::zeros(ybar.raw_dim());
    ndarray::Zip::from(&mut ybar)
        .and(&mut dz)
        .and(z)
        .and(&y)
        .par_for_each(|yb, dzv, &zv, &yv| {
            let go = *yb;
            let sg = sigmoid(zv);
            *yb = go * (zv * sg);
            *dzv = go * yv * (sg * (T::one() + zv * (T::one() - sg)));
        });
    Ok(GateBackward {
        ybar,
        y: Some(y),
        dz: Some(dz),
    })
}

/// The per-chunk quantities of the forward for row `b`, chunk `c`, head `h`.
struct ChunkGeo<T> {
    t0: usize,
    l: usize,
    /// `cs_0 .. cs_{L-1}`.
    cum: Vec<T>,
    /// `dt'_0 .. dt'_{L-1}`.
    dt: Vec<T>,
    seq: Vec<i64>,
    seq_prev: i64,
}

impl<T: Real> ChunkGeo<T> {
    fn new(f: &Flat<'_, T>, (b, c, h): (usize, usize, usize)) -> Self {
        let p = f.p;
        let t0 = c * p.options().chunk_size;
        let l = p.chunk_len(c);
        let (cum, dt) = f.cum_dt(b, h, c);
        ChunkGeo {
            t0,
            l,
            cum: cum.to_vec(),
            dt: dt.to_vec(),
            seq: (t0..t0 + l).map(|t| p.seq_idx_at(b, t)).collect(),
            seq_prev: if c == 0 { 0 } else { p.seq_idx_at(b, t0 - 1) },
        }
    }

    /// `e_i = exp(cs_i)` where `seq_i == seq_prev`, else 0.
    fn e(&self) -> Vec<T> {
        let mut e = self.cum.clone();
        T::exp_all(&mut e);
        for (v, &s) in e.iter_mut().zip(&self.seq) {
            if s != self.seq_prev {
                *v = T::zero();
            }
        }
        e
    }

    /// `v_j = exp(cs_{L-1} - cs_j)` where `seq_j == seq_{L-1}`, else 0.
    fn v(&self) -> Vec<T> {
        let l = self.l;
        let mut v: Vec<T> = self.cum.iter().map(|&c| self.cum[l - 1] - c).collect();
        T::exp_all(&mut v);
        for (vj, &s) in v.iter_mut().zip(&self.seq) {
            if s != self.seq[l - 1] {
                *vj = T::zero();
            }
        }
        v
    }

    /// `w_j = v_j * dt'_j`.
    fn w(&self) -> Vec<T> {
        self.v()
            .into_iter()
            .zip(&self.dt)
            .map(|(v, &d)| v * d)
            .collect()
    }

    /// `dec_ij = exp(cs_i - cs_j)` for `j <= i` and `seq_j == seq_i`, else 0 (`L x L`,
    /// row-major). The exponential is evaluated only where `j <= i`.
    fn dec(&self) -> Vec<T> {
        let l = self.l;
        let mut d = vec![T::zero(); l * l];
        for (i, row) in d.chunks_exact_mut(l).enumerate() {
            let row = &mut row[..=i];
            for (r, &cj) in row.iter_mut().zip(&self.cum) {
                *r = self.cum[i] - cj;
            }
            T::exp_all(row);
            for (r, &sj) in row.iter_mut().zip(&self.seq) {
                if sj != self.seq[i] {
                    *r = T::zero();
                }
            }
        }
        d
    }
}

/// `nrows` rows of `ncols` values, the first at `off`, `stride` apart, copied contiguously
/// (rounded to TF32 when `round`).
fn rows_copy<T: Real>(
    src: &[T],
    off: usize,
    stride: usize,
    (nrows, ncols): (usize, usize),
    round: MatmulPrecision,
) -> Vec<T> {
    let mut v = Vec::with_capacity(nrows * ncols);
    for r in 0..nrows {
        v.extend_from_slice(&src[off + r * stride..off + r * stride + ncols]);
    }
    round.round_all(&mut v);
    v
}

/// The transpose of a row-major `rows x cols` matrix.
fn transpose<T: Real>(src: &[T], rows: usize, cols: usize) -> Vec<T> {
    let mut t = vec![T::zero(); rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = src[r * cols + c];
        }
    }
    t
}

/// `a^T` for a row-major `a` with `cols` columns, as a product operand.
fn transposed<T>(a: &[T], cols: usize) -> Mat<'_, T> {
    Mat {
        data: a,
        off: 0,
        rs: 1,
        cs: cols,
    }
}

/// What a stage reads: the problem's tensors and stage 1's output as flat slices ([`Flat`])
/// and `ybar`; its methods copy out the chunk rows the matrix products take.
struct Operands<'a, T: Real> {
    f: Flat<'a, T>,
    ybar: &'a [T],
}

impl<T: Real> Operands<'_, T> {
    /// `Ybar_c` (`L x headdim`), rounded when `round`.
    fn ybar_c(&self, (b, h): (usize, usize), g: &ChunkGeo<T>, round: MatmulPrecision) -> Vec<T> {
        let d = self.f.p.dims();
        rows_copy(
            self.ybar,
            self.f.x_off(b, g.t0, h),
            d.nheads * d.headdim,
            (g.l, d.headdim),
            round,
        )
    }

    /// `x_c` (`L x headdim`), rounded when `round`.
    fn x_c(&self, (b, h): (usize, usize), g: &ChunkGeo<T>, round: MatmulPrecision) -> Vec<T> {
        let d = self.f.p.dims();
        rows_copy(
            self.f.x(),
            self.f.x_off(b, g.t0, h),
            d.nheads * d.headdim,
            (g.l, d.headdim),
            round,
        )
    }

    /// `B_c` or `C_c` (`L x dstate`) of group `grp`, rounded when `round`.
    fn bc_c(
        &self,
        which_c: bool,
        (b, grp): (usize, usize),
        g: &ChunkGeo<T>,
        round: MatmulPrecision,
    ) -> Vec<T> {
        let d = self.f.p.dims();
        let src = if which_c { self.f.c() } else { self.f.b() };
        rows_copy(
            src,
            self.f.bc_off(b, g.t0, grp),
            d.ngroups * d.dstate,
            (g.l, d.dstate),
            round,
        )
    }

    /// `G = C_c B_c^T` (`L x L`, only `j <= i` valid), operands rounded under TF32.
    fn gram(&self, (b, grp): (usize, usize), g: &ChunkGeo<T>) -> Vec<T> {
        let ds = self.f.p.dims().dstate;
        let l = g.l;
        let c_c = self.bc_c(true, (b, grp), g, self.f.operands);
        let b_t = transpose(&self.bc_c(false, (b, grp), g, self.f.operands), l, ds);
        let mut gm = vec![T::zero(); l * l];
        gemm(
            (l, l, ds),
            Mat::rows(&c_c, ds),
            Mat::rows(&b_t, l),
            &mut gm,
            l,
            Epilogue::Store,
            Tri::LowerC,
        );
        gm
    }

    /// `P_ij = (M_ij dec_ij) dt'_j` for `j <= i` (0 above), `M = Ybar_c X_c^T` with its
    /// operands rounded under TF32; `P` itself is not rounded.
    fn p_matrix(&self, (b, h): (usize, usize), g: &ChunkGeo<T>, dec: &[T]) -> Vec<T> {
        let hd = self.f.p.dims().headdim;
        let l = g.l;
        let operands = self.f.operands;
        let yc = self.ybar_c((b, h), g, operands);
        let xt = transpose(&self.x_c((b, h), g, operands), l, hd);
        let mut m = vec![T::zero(); l * l];
        gemm(
            (l, l, hd),
            Mat::rows(&yc, hd),
            Mat::rows(&xt, l),
            &mut m,
            l,
            Epilogue::Store,
            Tri::LowerC,
        );
        let mut pm = vec![T::zero(); l * l];
        for i in 0..l {
            for j in 0..=i {
                pm[i * l + j] = (m[i * l + j] * dec[i * l + j]) * g.dt[j];
            }
        }
        pm
    }
}

/// Each chunk's own contribution to the cotangent of the state entering it:
///
/// ```text
/// dstates[b, c, h] = sum_{i < L} e_i ybar_i C_i^T = Ybar_c^T (diag(e) C_c)     headdim x dstate
/// e_i = exp(cs_i) if seq_i == seq_prev, else 0
/// ```
///
/// `dL/dS_c` through chunk `c`'s outputs only: the carried term `e_i (C_i . S_c)` of every
/// output of the chunk whose run started before it. A `seq_idx` change inside the chunk
/// zeroes `e_i` from there on, so the terms after it do not reach the entering state.
/// `[batch, nchunks, nheads, headdim, dstate]`; one matrix product per (batch, chunk, head),
/// summed over `i` in increasing order; in parallel over those units.
///
/// # Errors
/// [`ReferenceError::InvalidProblem`] when `cumsum` or `ybar` do not have the shapes `p`
/// implies.
pub fn bwd_dstates<T: Real>(
    p: &Problem<T>,
    cumsum: &ChunkCumsum<T>,
    ybar: ArrayView4<T>,
    precision: MatmulPrecision,
) -> Result<Array5<T>, ReferenceError> {
    check_cumsum(p, cumsum)?;
    check_shape("ybar", ybar.shape(), &token_shape(p))?;
    let d = *p.dims();
    let (nc, nh, hd, ds) = (p.nchunks(), d.nheads, d.headdim, d.dstate);
    let yb = ybar.as_standard_layout();
    let ops = Operands {
        f: Flat::new(p, cumsum, precision),
        ybar: yb.as_slice().expect("standard layout"),
    };
    let mut out = Array5::<T>::zeros(states_shape(p));
    out.as_slice_mut()
        .expect("fresh array")
        .par_chunks_mut(hd * ds)
        .enumerate()
        .for_each(|(u, o)| {
            let (b, c, h) = (u / (nc * nh), (u / nh) % nc, u % nh);
            let g = ChunkGeo::new(&ops.f, (b, c, h));
            let yc = ops.ybar_c((b, h), &g, ops.f.operands);
            let e = g.e();
            let mut ec = ops.bc_c(true, (b, d.group_of_head(h)), &g, MatmulPrecision::Native);
            for (row, &ei) in ec.chunks_exact_mut(ds).zip(&e) {
                row.iter_mut().for_each(|v| *v = *v * ei);
            }
            ops.f.operands.round_all(&mut ec);
            gemm(
                (hd, ds, g.l),
                transposed(&yc, hd),
                Mat::rows(&ec, ds),
                o,
                ds,
                Epilogue::Store,
                Tri::Full,
            );
        });
    Ok(out)
}

/// Output of [`bwd_pass_state`].
#[allow(non_snake_case)]
#[derive(Debug, Clone)]
pub struct StatePassBackward<T> {
    /// `dL/dS_{c+1}`: the cotangent the reverse pass hands to chunk `c`, that of the state
    /// after the chunk's last token through the later chunks and `dfinal_states` only (what
    /// mamba_ssm's state-passing backward returns as `dstates`). Index `nchunks - 1` holds
    /// `dfinal_states` (or 0). `[batch, nchunks, nheads, headdim, dstate]`.
    pub dstates_passed: Array5<T>,
    /// `dL/dS_c`: the cotangent of the state entering chunk `c` (`chunk_states[b, c, h]`),
    /// through everything after it. `[batch, nchunks, nheads, headdim, dstate]`.
    pub dchunk_states: Array5<T>,
    /// `scale_c <dL/dS_{c+1}, S_c>`: the gradient with respect to `dA_cumsum[b, h, c,
    /// chunk_size - 1]` through the state-passing decay `scale_c` (0 at a reset).
    /// `[batch, nheads, nchunks]`.
    pub ddA_chunk_cumsum: Array3<T>,
    /// `dL/dS_0`, the cotangent of the initial state (0 where `seq_idx[b, 0] != 0`):
    /// `[batch, nheads, headdim, dstate]`, computed whether or not the problem has
    /// `initial_states`.
    pub dinitial_states: Array4<T>,
}

/// The reverse state pass across chunks.
///
/// The forward passes `S_{c+1} = scale_c S_c + states_c` (`scale_c = exp(cs[chunk_size -
/// 1])`, 0 at a reset, see the module documentation) and chunk `c`'s outputs read `S_c`.
/// Backwards, for each (row, head), from `R = dfinal_states[b, h]` (or 0), for `c =
/// nchunks - 1` down to 0:
///
/// ```text
/// dstates_passed[b, c, h]      = R                                (= dL/dS_{c+1})
/// ddA_chunk_cumsum[b, h, c]    = scale_c * sum_{p, n} R[p, n] S_c[p, n]
/// R                            = scale_c * R + dstates[b, c, h]   (one fused multiply-add)
/// dchunk_states[b, c, h]       = R                                (= dL/dS_c)
/// ```
///
/// and `dinitial_states[b, h] = R` at the end. A reset cuts the flow: `scale_c = 0` stops
/// `R` at chunk `c`, and then also `ddA_chunk_cumsum` is 0. The Frobenius sum runs over
/// `p`, then `n`, in increasing order. Parallel over (batch, head).
///
/// # Errors
/// [`ReferenceError::InvalidProblem`] naming the tensor when `dfinal_states` has the wrong
/// shape or a non-finite value, or `cumsum`, `chunk_states` or `dstates` do not have the
/// shapes `p` implies.
pub fn bwd_pass_state<T: Real>(
    p: &Problem<T>,
    cumsum: &ChunkCumsum<T>,
    chunk_states: ArrayView5<T>,
    dstates: ArrayView5<T>,
    dfinal_states: Option<ArrayView4<T>>,
) -> Result<StatePassBackward<T>, ReferenceError> {
    check_cumsum(p, cumsum)?;
    check_shape("chunk_states", chunk_states.shape(), &states_shape(p))?;
    check_shape("dstates", dstates.shape(), &states_shape(p))?;
    let d = *p.dims();
    let (bt, nc, nh, hd, ds) = (d.batch, p.nchunks(), d.nheads, d.headdim, d.dstate);
    if let Some(fin) = &dfinal_states {
        check_shape("dfinal_states", fin.shape(), &[bt, nh, hd, ds])?;
        check_finite("dfinal_states", fin)?;
    }
    let f = Flat::new(p, cumsum, MatmulPrecision::Native);
    let st = chunk_states.as_standard_layout();
    let st = st.as_slice().expect("standard layout");
    let dst = dstates.as_standard_layout();
    let dst = dst.as_slice().expect("standard layout");
    let n = hd * ds;
    let at = |b: usize, c: usize, h: usize| ((b * nc + c) * nh + h) * n;

    struct Lane<T> {
        passed: Vec<T>,
        entering: Vec<T>,
        dda: Vec<T>,
        init: Vec<T>,
    }
    let lanes: Vec<Lane<T>> = (0..bt * nh)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / nh, bh % nh);
            let mut scales = Vec::with_capacity(nc);
            let mut seq_prev = 0;
            for c in 0..nc {
                let (s, seq) = pass_scale(&f, (b, h, c), seq_prev);
                scales.push(s);
                seq_prev = seq;
            }
            let mut r = vec![T::zero(); n];
            if let Some(fin) = &dfinal_states {
                for (v, &x) in r
                    .iter_mut()
                    .zip(fin.slice(ndarray::s![b, h, .., ..]).iter())
                {
                    *v = x;
                }
            }
            let mut lane = Lane {
                passed: vec![T::zero(); nc * n],
                entering: vec![T::zero(); nc * n],
                dda: vec![T::zero(); nc],
                init: Vec::new(),
            };
            for c in (0..nc).rev() {
                lane.passed[c * n..(c + 1) * n].copy_from_slice(&r);
                let s_c = &st[at(b, c, h)..at(b, c, h) + n];
                let dot = r
                    .iter()
                    .zip(s_c)
                    .fold(T::zero(), |acc, (&a, &s)| a.mul_add(s, acc));
                lane.dda[c] = scales[c] * dot;
                let own = &dst[at(b, c, h)..at(b, c, h) + n];
                for (v, &o) in r.iter_mut().zip(own) {
                    *v = scales[c].mul_add(*v, o);
                }
                lane.entering[c * n..(c + 1) * n].copy_from_slice(&r);
            }
            lane.init = r;
            lane
        })
        .collect();

    let mut out = StatePassBackward {
        dstates_passed: Array5::zeros(states_shape(p)),
        dchunk_states: Array5::zeros(states_shape(p)),
        ddA_chunk_cumsum: Array3::zeros((bt, nh, nc)),
        dinitial_states: Array4::zeros((bt, nh, hd, ds)),
    };
    let passed = out.dstates_passed.as_slice_mut().expect("fresh array");
    let entering = out.dchunk_states.as_slice_mut().expect("fresh array");
    let init = out.dinitial_states.as_slice_mut().expect("fresh array");
    for (bh, lane) in lanes.into_iter().enumerate() {
        let (b, h) = (bh / nh, bh % nh);
        for c in 0..nc {
            passed[at(b, c, h)..at(b, c, h) + n].copy_from_slice(&lane.passed[c * n..(c + 1) * n]);
            entering[at(b, c, h)..at(b, c, h) + n]
                .copy_from_slice(&lane.entering[c * n..(c + 1) * n]);
            out.ddA_chunk_cumsum[[b, h, c]] = lane.dda[c];
        }
        init[bh * n..(bh + 1) * n].copy_from_slice(&lane.init);
    }
    Ok(out)
}

/// Output of [`bwd_dx`].
#[allow(non_snake_case)]
#[derive(Debug, Clone)]
pub struct DxBackward<T> {
    /// `[batch, seqlen, nheads, headdim]`.
    pub dx: Array4<T>,
    /// `ddt_x[b, h, c, j] = <du_j, x_j>`: the `dt'` gradient through `dt' x` (the rest comes
    /// through the decays, [`bwd_ddA_cumsum`]). `[batch, nheads, nchunks, chunk_size]`, 0
    /// past `seqlen`.
    pub ddt_x: Array4<T>,
    /// `dD = sum ybar * x` over rows and tokens (and `headdim` for a per-head `D`), as `D`
    /// (only when the problem has `D`).
    pub dD: Option<ArrayD<T>>,
}

/// `dx`, the `dt'` gradient through `dt' x`, and `dD`. For token `j` of chunk `c`, with
/// `Sbar = dstates_passed[b, c, h]` (`dL/dS_{c+1}`, from [`bwd_pass_state`]):
///
/// ```text
/// G     = C_c B_c^T                          K_ij = G_ij dec_ij   (0 unless j <= i, same seq)
/// du    = diag(v) (B_c Sbar^T) + K^T Ybar_c    L x headdim: carried + intra-chunk, that order
/// dx_j  = D ybar_j + dt'_j du_j                (two products, one sum)
/// ddt_x[j] = sum_p du_j[p] x_j[p]              (p increasing)
/// dD   += ybar_j x_j                           (per chunk over j increasing, then chunks, rows)
/// ```
///
/// `du_j = dL/du_j` for `u_j = dt'_j x_j`: the carried part is what `u_j` feeds into the
/// state after the chunk (`v_j B_j` decayed, then `Sbar`), the intra-chunk part what it feeds
/// into the chunk's own outputs. For a per-head `D`, `dD[h]` sums the per-channel sums over
/// `p` in increasing order. In parallel over (batch, chunk, group): `G` is shared by the
/// group's heads.
///
/// # Errors
/// [`ReferenceError::InvalidProblem`] when `cumsum`, `ybar` or `dstates_passed` do not have
/// the shapes `p` implies.
#[allow(non_snake_case)]
pub fn bwd_dx<T: Real>(
    p: &Problem<T>,
    cumsum: &ChunkCumsum<T>,
    ybar: ArrayView4<T>,
    dstates_passed: ArrayView5<T>,
    precision: MatmulPrecision,
) -> Result<DxBackward<T>, ReferenceError> {
    check_cumsum(p, cumsum)?;
    check_shape("ybar", ybar.shape(), &token_shape(p))?;
    check_shape("dstates_passed", dstates_passed.shape(), &states_shape(p))?;
    let d = *p.dims();
    let (bt, nc, nh, hd, ds, ng) = (
        d.batch,
        p.nchunks(),
        d.nheads,
        d.headdim,
        d.dstate,
        d.ngroups,
    );
    let hpg = d.heads_per_group();
    let cs = p.options().chunk_size;
    let yb = ybar.as_standard_layout();
    let ops = Operands {
        f: Flat::new(p, cumsum, precision),
        ybar: yb.as_slice().expect("standard layout"),
    };
    let sp = dstates_passed.as_standard_layout();
    let sp = sp.as_slice().expect("standard layout");
    let operands = ops.f.operands;

    /// One head's share: `dx` rows `[L, headdim]`, `ddt_x` `[L]`, `dD` terms `[headdim]`.
    struct Head<T> {
        dx: Vec<T>,
        ddt: Vec<T>,
        dd: Vec<T>,
    }
    let units: Vec<Vec<Head<T>>> = (0..bt * nc * ng)
        .into_par_iter()
        .map(|u| {
            let (b, c, grp) = (u / (nc * ng), (u / ng) % nc, u % ng);
            let g0 = ChunkGeo::new(&ops.f, (b, c, grp * hpg));
            let gm = ops.gram((b, grp), &g0);
            let b_c = ops.bc_c(false, (b, grp), &g0, operands);
            (0..hpg)
                .map(|hh| {
                    let h = grp * hpg + hh;
                    let g = ChunkGeo::new(&ops.f, (b, c, h));
                    let l = g.l;
                    let dec = g.dec();
                    let mut k = vec![T::zero(); l * l];
                    for i in 0..l {
                        for j in 0..=i {
                            k[i * l + j] = gm[i * l + j] * dec[i * l + j];
                        }
                    }
                    operands.round_all(&mut k);
                    let off = ((b * nc + c) * nh + h) * hd * ds;
                    let mut sbar_t = transpose(&sp[off..off + hd * ds], hd, ds);
                    operands.round_all(&mut sbar_t);
                    let v = g.v();
                    let mut du = vec![T::zero(); l * hd];
                    gemm(
                        (l, hd, ds),
                        Mat::rows(&b_c, ds),
                        Mat::rows(&sbar_t, hd),
                        &mut du,
                        hd,
                        Epilogue::ScaleRows(&v),
                        Tri::Full,
                    );
                    let yc_r = ops.ybar_c((b, h), &g, operands);
                    gemm(
                        (l, hd, l),
                        transposed(&k, l),
                        Mat::rows(&yc_r, hd),
                        &mut du,
                        hd,
                        Epilogue::Add,
                        Tri::Full,
                    );
                    let yc = ops.ybar_c((b, h), &g, MatmulPrecision::Native);
                    let xc = ops.x_c((b, h), &g, MatmulPrecision::Native);
                    let mut head = Head {
                        dx: vec![T::zero(); l * hd],
                        ddt: vec![T::zero(); l],
                        dd: vec![T::zero(); hd],
                    };
                    for j in 0..l {
                        let mut acc = T::zero();
                        for pp in 0..hd {
                            let q = j * hd + pp;
                            head.dx[q] = p.d_skip(h, pp) * yc[q] + g.dt[j] * du[q];
                            acc = du[q].mul_add(xc[q], acc);
                            head.dd[pp] = yc[q].mul_add(xc[q], head.dd[pp]);
                        }
                        head.ddt[j] = acc;
                    }
                    head
                })
                .collect()
        })
        .collect();

    let mut out = DxBackward {
        dx: Array4::zeros(token_shape(p)),
        ddt_x: Array4::zeros(chunk_shape(p)),
        dD: p
            .inputs()
            .D
            .as_ref()
            .map(|a| ArrayD::zeros(IxDyn(a.shape()))),
    };
    // Per-channel dD sums in (b, c) order, per head.
    let mut dd = vec![T::zero(); nh * hd];
    for (u, heads) in units.into_iter().enumerate() {
        let (b, c, grp) = (u / (nc * ng), (u / ng) % nc, u % ng);
        let t0 = c * cs;
        for (hh, head) in heads.into_iter().enumerate() {
            let h = grp * hpg + hh;
            let l = head.ddt.len();
            for j in 0..l {
                for pp in 0..hd {
                    out.dx[[b, t0 + j, h, pp]] = head.dx[j * hd + pp];
                }
                out.ddt_x[[b, h, c, j]] = head.ddt[j];
            }
            for pp in 0..hd {
                dd[h * hd + pp] = dd[h * hd + pp] + head.dd[pp];
            }
        }
    }
    if let Some(dD) = &mut out.dD {
        if dD.ndim() == 1 {
            for h in 0..nh {
                dD[[h]] = dd[h * hd..(h + 1) * hd]
                    .iter()
                    .fold(T::zero(), |a, &v| a + v);
            }
        } else {
            for h in 0..nh {
                for pp in 0..hd {
                    dD[[h, pp]] = dd[h * hd + pp];
                }
            }
        }
    }
    Ok(out)
}

/// `dB`, summed over the heads of each group. For token `j` of chunk `c`, with `Sbar =
/// dstates_passed[b, c, h]`:
///
/// ```text
/// M    = Ybar_c X_c^T                    P_ij = (M_ij dec_ij) dt'_j   (0 unless j <= i, same seq)
/// dB_c = sum_{h in g} ( diag(w) (X_c Sbar) + P^T C_c )      L x dstate: carried + intra-chunk
/// ```
///
/// `w_j = v_j dt'_j` is the chunk state's weight of token `j`; `P_ij` is `d y_i / d G_ij`
/// paired with `ybar_i`, and `G_ij = C_i . B_j`. The heads of a group are added in increasing
/// `h` (the first onto 0). `[batch, seqlen, ngroups, dstate]`; in parallel over (batch,
/// chunk, group).
///
/// # Errors
/// [`ReferenceError::InvalidProblem`] when `cumsum`, `ybar` or `dstates_passed` do not have
/// the shapes `p` implies.
pub fn bwd_db<T: Real>(
    p: &Problem<T>,
    cumsum: &ChunkCumsum<T>,
    ybar: ArrayView4<T>,
    dstates_passed: ArrayView5<T>,
    precision: MatmulPrecision,
) -> Result<Array4<T>, ReferenceError> {
    check_cumsum(p, cumsum)?;
    check_shape("ybar", ybar.shape(), &token_shape(p))?;
    check_shape("dstates_passed", dstates_passed.shape(), &states_shape(p))?;
    let yb = ybar.as_standard_layout();
    let ops = Operands {
        f: Flat::new(p, cumsum, precision),
        ybar: yb.as_slice().expect("standard layout"),
    };
    let sp = dstates_passed.as_standard_layout();
    let sp = sp.as_slice().expect("standard layout");
    Ok(group_rows(p, |(b, c, grp)| {
        let d = *p.dims();
        let ds = p.dims().dstate;
        let operands = ops.f.operands;
        let hpg = d.heads_per_group();
        let g0 = ChunkGeo::new(&ops.f, (b, c, grp * hpg));
        let l = g0.l;
        let c_c = ops.bc_c(true, (b, grp), &g0, operands);
        let mut acc = vec![T::zero(); l * ds];
        for hh in 0..hpg {
            let h = grp * hpg + hh;
            let g = ChunkGeo::new(&ops.f, (b, c, h));
            let dec = g.dec();
            let mut pm = ops.p_matrix((b, h), &g, &dec);
            operands.round_all(&mut pm);
            let mut db = carried_db(&ops, sp, (b, c, h), &g);
            gemm(
                (l, ds, l),
                transposed(&pm, l),
                Mat::rows(&c_c, ds),
                &mut db,
                ds,
                Epilogue::Add,
                Tri::Full,
            );
            for (a, &v) in acc.iter_mut().zip(&db) {
                *a = *a + v;
            }
        }
        acc
    }))
}

/// `dC`, summed over the heads of each group. For token `i` of chunk `c`, with `S_c =
/// chunk_states[b, c, h]` (the forward's state entering the chunk):
///
/// ```text
/// dC_c = sum_{h in g} ( diag(e) (Ybar_c S_c) + P B_c )       L x dstate: carried + intra-chunk
/// ```
///
/// with `P` as in [`bwd_db`]. The heads of a group are added in increasing `h` (the first
/// onto 0). `[batch, seqlen, ngroups, dstate]`; in parallel over (batch, chunk, group).
///
/// # Errors
/// [`ReferenceError::InvalidProblem`] when `cumsum`, `ybar` or `chunk_states` do not have the
/// shapes `p` implies.
pub fn bwd_dc<T: Real>(
    p: &Problem<T>,
    cumsum: &ChunkCumsum<T>,
    ybar: ArrayView4<T>,
    chunk_states: ArrayView5<T>,
    precision: MatmulPrecision,
) -> Result<Array4<T>, ReferenceError> {
    check_cumsum(p, cumsum)?;
    check_shape("ybar", ybar.shape(), &token_shape(p))?;
    check_shape("chunk_states", chunk_states.shape(), &states_shape(p))?;
    let yb = ybar.as_standard_layout();
    let ops = Operands {
        f: Flat::new(p, cumsum, precision),
        ybar: yb.as_slice().expect("standard layout"),
    };
    let st = chunk_states.as_standard_layout();
    let st = st.as_slice().expect("standard layout");
    Ok(group_rows(p, |(b, c, grp)| {
        let d = *p.dims();
        let ds = d.dstate;
        let operands = ops.f.operands;
        let hpg = d.heads_per_group();
        let g0 = ChunkGeo::new(&ops.f, (b, c, grp * hpg));
        let l = g0.l;
        let b_c = ops.bc_c(false, (b, grp), &g0, operands);
        let mut acc = vec![T::zero(); l * ds];
        for hh in 0..hpg {
            let h = grp * hpg + hh;
            let g = ChunkGeo::new(&ops.f, (b, c, h));
            let dec = g.dec();
            let mut pm = ops.p_matrix((b, h), &g, &dec);
            operands.round_all(&mut pm);
            let mut dc = carried_dc(&ops, st, (b, c, h), &g);
            gemm(
                (l, ds, l),
                Mat::rows(&pm, l),
                Mat::rows(&b_c, ds),
                &mut dc,
                ds,
                Epilogue::Add,
                Tri::LowerA,
            );
            for (a, &v) in acc.iter_mut().zip(&dc) {
                *a = *a + v;
            }
        }
        acc
    }))
}

/// `diag(e) (Ybar_c S_c)` (`L x dstate`), operands rounded under TF32.
fn carried_dc<T: Real>(
    ops: &Operands<'_, T>,
    st: &[T],
    (b, c, h): (usize, usize, usize),
    g: &ChunkGeo<T>,
) -> Vec<T> {
    let p = ops.f.p;
    let d = p.dims();
    let (nc, nh, hd, ds) = (p.nchunks(), d.nheads, d.headdim, d.dstate);
    let operands = ops.f.operands;
    let yc = ops.ybar_c((b, h), g, operands);
    let off = ((b * nc + c) * nh + h) * hd * ds;
    let s_c = rows_copy(st, off, ds, (hd, ds), operands);
    let e = g.e();
    let mut dc = vec![T::zero(); g.l * ds];
    gemm(
        (g.l, ds, hd),
        Mat::rows(&yc, hd),
        Mat::rows(&s_c, ds),
        &mut dc,
        ds,
        Epilogue::ScaleRows(&e),
        Tri::Full,
    );
    dc
}

/// `diag(w) (X_c Sbar)` (`L x dstate`), operands rounded under TF32.
fn carried_db<T: Real>(
    ops: &Operands<'_, T>,
    sp: &[T],
    (b, c, h): (usize, usize, usize),
    g: &ChunkGeo<T>,
) -> Vec<T> {
    let p = ops.f.p;
    let d = p.dims();
    let (nc, nh, hd, ds) = (p.nchunks(), d.nheads, d.headdim, d.dstate);
    let operands = ops.f.operands;
    let x_r = ops.x_c((b, h), g, operands);
    let off = ((b * nc + c) * nh + h) * hd * ds;
    let sbar = rows_copy(sp, off, ds, (hd, ds), operands);
    let w = g.w();
    let mut db = vec![T::zero(); g.l * ds];
    gemm(
        (g.l, ds, hd),
        Mat::rows(&x_r, hd),
        Mat::rows(&sbar, ds),
        &mut db,
        ds,
        Epilogue::ScaleRows(&w),
        Tri::Full,
    );
    db
}

/// `[batch, seqlen, ngroups, dstate]` from a function of (batch, chunk, group) giving the
/// chunk's `L x dstate` rows of the group; in parallel over the units, stored in order.
fn group_rows<T: Real, F>(p: &Problem<T>, unit: F) -> Array4<T>
where
    F: Fn((usize, usize, usize)) -> Vec<T> + Sync,
{
    let d = *p.dims();
    let (nc, ng, ds) = (p.nchunks(), d.ngroups, d.dstate);
    let cs = p.options().chunk_size;
    let rows: Vec<Vec<T>> = (0..d.batch * nc * ng)
        .into_par_iter()
        .map(|u| unit((u / (nc * ng), (u / ng) % nc, u % ng)))
        .collect();
    let mut out = Array4::<T>::zeros((d.batch, d.seqlen, ng, ds));
    for (u, r) in rows.into_iter().enumerate() {
        let (b, c, grp) = (u / (nc * ng), (u / ng) % nc, u % ng);
        for (j, row) in r.chunks_exact(ds).enumerate() {
            for (n, &v) in row.iter().enumerate() {
                out[[b, c * cs + j, grp, n]] = v;
            }
        }
    }
    out
}

/// Output of [`bwd_ddA_cumsum`].
#[allow(non_snake_case)]
#[derive(Debug, Clone)]
pub struct DdaBackward<T> {
    /// `dL/d dA_cumsum[b, h, c, k]`, every entry of the forward's cumsum taken as a variable of
    /// its own: `[batch, nheads, nchunks, chunk_size]`.
    pub ddA_cumsum: Array4<T>,
    /// `dL/d dA_k` for the per-token `dA_k = dt'_k A` (`cs_k = sum_{k' <= k} dA_k'`): the
    /// reverse cumsum `sum_{k' >= k} ddA_cumsum[k']`, computed term by term without
    /// cancellation. `[batch, nheads, nchunks, chunk_size]`.
    pub ddA: Array4<T>,
}

/// The gradient with respect to the within-chunk cumsum, and with respect to each token's
/// `dA_k = dt'_k A`.
///
/// The forward reads `dA_cumsum` in four places: the carried term's `e_i`, the intra-chunk
/// decays `dec_ij`, the chunk state's `v_j` (at index `L - 1`) and the state-passing
/// `scale_c` (at index `chunk_size - 1`). Their terms, for chunk `c` of row `b`, head `h`:
///
/// ```text
/// a_i = sum_n (diag(e) (Ybar_c S_c))[i, n] C_i[n]       through e_i      (the carried dC rows . C_i)
/// T_ij = G_ij P_ij,  j < i                              through dec_ij   (G, P as in bwd_dx, bwd_db)
/// W_j = sum_n (diag(w) (X_c Sbar))[j, n] B_j[n]         through v_j      (the carried dB rows . B_j)
/// dd  = ddA_chunk_cumsum[b, h, c]                       through scale_c  (bwd_pass_state)
/// ```
///
/// (`n` increasing; `P` unrounded). Each term is `+` for the later index of its decay and `-`
/// for the earlier one (`exp(cs_i - cs_j)`); diagonal terms cancel exactly and are left out:
///
/// ```text
/// ddA_cumsum[k] = a_k + sum_{j < k} T_kj - sum_{i > k} T_ik - [k < L-1] W_k
///               + [k = L-1] sum_{j < L-1} W_j + [k = chunk_size-1] dd        (left to right)
/// ```
///
/// Summing that backwards within the chunk would cancel the `T` and `W` terms of the pairs
/// that both lie after `k`, and leave their rounding behind. So `ddA[k] = sum_{k' >= k}
/// ddA_cumsum[k']` is computed term by term instead, each term where its decay spans token
/// `k` (pairs that straddle `k`), all of one sign for a given sign of the inputs:
///
/// ```text
/// ddA[k] = ((sum_{i >= k} a_i + sum_{i >= k} sum_{j < k} T_ij) + sum_{j < k <= L-1} W_j) + dd
/// ```
///
/// The first sum runs `i` downwards from `L - 1`; the second takes rows `i` in increasing
/// order, each row's prefix sum over `j` increasing; the third runs `j` upwards. In parallel
/// over (batch, chunk, group).
///
/// # Errors
/// [`ReferenceError::InvalidProblem`] when an argument does not have the shape `p` implies.
#[allow(non_snake_case)]
pub fn bwd_ddA_cumsum<T: Real>(
    p: &Problem<T>,
    cumsum: &ChunkCumsum<T>,
    ybar: ArrayView4<T>,
    chunk_states: ArrayView5<T>,
    dstates_passed: ArrayView5<T>,
    ddA_chunk_cumsum: ArrayView3<T>,
    precision: MatmulPrecision,
) -> Result<DdaBackward<T>, ReferenceError> {
    check_cumsum(p, cumsum)?;
    check_shape("ybar", ybar.shape(), &token_shape(p))?;
    check_shape("chunk_states", chunk_states.shape(), &states_shape(p))?;
    check_shape("dstates_passed", dstates_passed.shape(), &states_shape(p))?;
    let d = *p.dims();
    let (bt, nc, nh, ng, ds) = (d.batch, p.nchunks(), d.nheads, d.ngroups, d.dstate);
    let cs = p.options().chunk_size;
    check_shape("ddA_chunk_cumsum", ddA_chunk_cumsum.shape(), &[bt, nh, nc])?;
    let hpg = d.heads_per_group();
    let yb = ybar.as_standard_layout();
    let ops = Operands {
        f: Flat::new(p, cumsum, precision),
        ybar: yb.as_slice().expect("standard layout"),
    };
    let st = chunk_states.as_standard_layout();
    let st = st.as_slice().expect("standard layout");
    let sp = dstates_passed.as_standard_layout();
    let sp = sp.as_slice().expect("standard layout");

    // Per (b, c, g): for each head, (ddA_cumsum, ddA), each chunk_size long.
    let units: Vec<Vec<(Vec<T>, Vec<T>)>> = (0..bt * nc * ng)
        .into_par_iter()
        .map(|u| {
            let (b, c, grp) = (u / (nc * ng), (u / ng) % nc, u % ng);
            let g0 = ChunkGeo::new(&ops.f, (b, c, grp * hpg));
            let gm = ops.gram((b, grp), &g0);
            let l = g0.l;
            let c_raw = ops.bc_c(true, (b, grp), &g0, MatmulPrecision::Native);
            let b_raw = ops.bc_c(false, (b, grp), &g0, MatmulPrecision::Native);
            (0..hpg)
                .map(|hh| {
                    let h = grp * hpg + hh;
                    let g = ChunkGeo::new(&ops.f, (b, c, h));
                    let dec = g.dec();
                    let pm = ops.p_matrix((b, h), &g, &dec);
                    let dc = carried_dc(&ops, st, (b, c, h), &g);
                    let db = carried_db(&ops, sp, (b, c, h), &g);
                    let row_dot = |m: &[T], v: &[T], i: usize| {
                        m[i * ds..(i + 1) * ds]
                            .iter()
                            .zip(&v[i * ds..(i + 1) * ds])
                            .fold(T::zero(), |acc, (&x, &y)| x.mul_add(y, acc))
                    };
                    let a: Vec<T> = (0..l).map(|i| row_dot(&dc, &c_raw, i)).collect();
                    let w: Vec<T> = (0..l).map(|j| row_dot(&db, &b_raw, j)).collect();
                    let t = |i: usize, j: usize| gm[i * l + j] * pm[i * l + j];
                    let dd = ddA_chunk_cumsum[[b, h, c]];

                    // dL/d dA_cumsum
                    let mut lit = vec![T::zero(); cs];
                    for k in 0..l {
                        let row = (0..k).fold(T::zero(), |acc, j| acc + t(k, j));
                        let col = (k + 1..l).fold(T::zero(), |acc, i| acc + t(i, k));
                        let mut v = (a[k] + row) - col;
                        if k + 1 < l {
                            v = v - w[k];
                        } else {
                            v = v + w[..l - 1].iter().fold(T::zero(), |acc, &x| acc + x);
                        }
                        lit[k] = v;
                    }
                    lit[cs - 1] = lit[cs - 1] + dd;

                    // dL/d dA_k, term by term.
                    let mut rev_a = vec![T::zero(); cs];
                    let mut run = T::zero();
                    for k in (0..l).rev() {
                        run = run + a[k];
                        rev_a[k] = run;
                    }
                    let mut straddle = vec![T::zero(); cs];
                    for i in 0..l {
                        let mut run = T::zero();
                        for (j, s) in straddle[1..=i].iter_mut().enumerate() {
                            run = run + t(i, j);
                            *s = *s + run;
                        }
                    }
                    let mut prefix_w = vec![T::zero(); cs];
                    let mut run = T::zero();
                    for k in 1..l {
                        run = run + w[k - 1];
                        prefix_w[k] = run;
                    }
                    let stable = (0..cs)
                        .map(|k| ((rev_a[k] + straddle[k]) + prefix_w[k]) + dd)
                        .collect();
                    (lit, stable)
                })
                .collect()
        })
        .collect();

    let mut out = DdaBackward {
        ddA_cumsum: Array4::zeros(chunk_shape(p)),
        ddA: Array4::zeros(chunk_shape(p)),
    };
    for (u, heads) in units.into_iter().enumerate() {
        let (b, c, grp) = (u / (nc * ng), (u / ng) % nc, u % ng);
        for (hh, (lit, stable)) in heads.into_iter().enumerate() {
            let h = grp * hpg + hh;
            for k in 0..cs {
                out.ddA_cumsum[[b, h, c, k]] = lit[k];
                out.ddA[[b, h, c, k]] = stable[k];
            }
        }
    }
    Ok(out)
}

/// Output of [`chunk_cumsum_bwd`].
#[allow(non_snake_case)]
#[derive(Debug, Clone)]
pub struct CumsumBackward<T> {
    /// `dL/d dt'`: `[batch, nheads, nchunks, chunk_size]`, 0 past `seqlen`.
    pub ddt_processed: Array4<T>,
    /// With respect to the raw `dt`: `[batch, seqlen, nheads]`.
    pub ddt: Array3<T>,
    /// `[nheads]`.
    pub dA: Array1<T>,
    /// `[nheads]` (only when the problem has `dt_bias`).
    pub ddt_bias: Option<Array1<T>>,
}

/// Back through `dA_k = dt'_k A` and the step processing. For token `t = t0 + k`:
///
/// ```text
/// ddt'_t   = ddt_x[k] + ddA[k] * A[h]                       (bwd_dx, bwd_ddA_cumsum)
/// dA[h]   += ddA[k] * dt'_k                                 (k, then c increasing per row;
///                                                            then rows b increasing)
/// ddt_t    = ddt'_t * s_t,   s_t = 0 where the clamp is active (sp_t < lo or sp_t > hi),
///            else sigmoid(v_t) where softplus applies and v_t <= 20, else 1
/// ddt_bias[h] += ddt_t                                      (same order as dA)
/// ```
///
/// with `v_t = dt[b, t, h] + dt_bias[h]` and `sp_t = softplus(v_t)` (or `v_t`): mamba_ssm's
/// derivative at the kinks (the clamp passes the gradient on its boundaries, softplus's
/// derivative is that of the branch the forward took). Parallel over (batch, head).
///
/// # Errors
/// [`ReferenceError::InvalidProblem`] when an argument does not have the shape `p` implies.
#[allow(non_snake_case)]
pub fn chunk_cumsum_bwd<T: Real>(
    p: &Problem<T>,
    cumsum: &ChunkCumsum<T>,
    ddA: ArrayView4<T>,
    ddt_x: ArrayView4<T>,
) -> Result<CumsumBackward<T>, ReferenceError> {
    check_cumsum(p, cumsum)?;
    check_shape("ddA", ddA.shape(), &chunk_shape(p))?;
    check_shape("ddt_x", ddt_x.shape(), &chunk_shape(p))?;
    let d = *p.dims();
    let (bt, nc, nh) = (d.batch, p.nchunks(), d.nheads);
    let cs = p.options().chunk_size;
    let i = p.inputs();
    let o = p.options();
    let (lo, hi) = (T::lit(o.dt_limit.0), T::lit(o.dt_limit.1));

    struct Lane<T> {
        ddtp: Vec<T>,
        ddt: Vec<T>,
        da: T,
        dbias: T,
    }
    let lanes: Vec<Lane<T>> = (0..bt * nh)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / nh, bh % nh);
            let mut lane = Lane {
                ddtp: vec![T::zero(); nc * cs],
                ddt: vec![T::zero(); d.seqlen],
                da: T::zero(),
                dbias: T::zero(),
            };
            for c in 0..nc {
                for k in 0..p.chunk_len(c) {
                    let t = c * cs + k;
                    let g = ddA[[b, h, c, k]];
                    let ddtp = ddt_x[[b, h, c, k]] + g * i.A[h];
                    lane.ddtp[c * cs + k] = ddtp;
                    lane.da = lane.da + g * cumsum.dt[[b, h, c, k]];
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
                    let s = if sp < lo || sp > hi {
                        T::zero()
                    } else {
                        dsp_dv
                    };
                    let ddt = ddtp * s;
                    lane.ddt[t] = ddt;
                    lane.dbias = lane.dbias + ddt;
                }
            }
            lane
        })
        .collect();

    let mut out = CumsumBackward {
        ddt_processed: Array4::zeros(chunk_shape(p)),
        ddt: Array3::zeros((bt, d.seqlen, nh)),
        dA: Array1::zeros(nh),
        ddt_bias: i.dt_bias.as_ref().map(|_| Array1::zeros(nh)),
    };
    for (bh, lane) in lanes.into_iter().enumerate() {
        let (b, h) = (bh / nh, bh % nh);
        for c in 0..nc {
            for k in 0..cs {
                out.ddt_processed[[b, h, c, k]] = lane.ddtp[c * cs + k];
            }
        }
        for t in 0..d.seqlen {
            out.ddt[[b, t, h]] = lane.ddt[t];
        }
        out.dA[h] = out.dA[h] + lane.da;
        if let Some(db) = &mut out.ddt_bias {
            db[h] = db[h] + lane.dbias;
        }
    }
    Ok(out)
}
