//! CPU reference for the Mamba-2 SSD (state space duality) forward pass, the function computed
//! by mamba_ssm 2.3.2.post1's `mamba_chunk_scan_combined`.
//!
//! Two algorithms compute it:
//! - [`naive`]: the time-step recurrence, exactly as the fixture contract states it. In float64
//!   this is the ground truth every other path is checked against. It is a tuned schedule of
//!   [`definition`], the textbook loop over tokens, with the same bits.
//! - [`chunked`]: the chunked "jump formula", stage by stage as the GPU kernels run it
//!   ([`chunk_cumsum`], [`fwd_pass_state`], [`compute_out`]), with every intermediate returned.
//!   The stage functions are public and can be run one by one; [`chunked::forward`] runs them
//!   in one of two bit-identical schedules ([`chunked::Schedule`]).
//!
//! Gradients come from two backward passes: [`adjoint`], the reverse-mode derivative of the
//! recurrence (in float64 the gradient ground truth), and [`chunked_backward`], the derivative
//! of the chunked path stage by stage as mamba_ssm's backward kernels run it, with every
//! intermediate (and optionally TF32-rounded matrix products).
//!
//! All of them are generic over `f32` and `f64` ([`Real`]) and parallel over independent work with
//! rayon's global pool; results do not depend on the number of threads. The chunked path can
//! round every matrix-product operand to TF32 ([`MatmulPrecision::Tf32`]) or bfloat16
//! ([`MatmulPrecision::Bf16`]) to emulate a correct TF32 or bf16 tensor-core kernel.
//!
//! The chunked path's matrix products are a small register-tiled kernel that reads its operands
//! in place (every entry a chain of fused multiply-adds in increasing `k`), and its decays use a
//! vectorised `exp` (within 2 ulp of the C library's). The vector code is chosen at run time
//! ([`simd`]: AVX2 + FMA, AVX-512F, or portable code; `SSD_SIMD=off` forces the last), with the
//! same bits on every path. [`magnitude`] computes the magnitudes and error budgets of every
//! output that the error model of `ssd-verify` and the tests here bound errors with.
//! `docs/math.md` in the repository derives every equation and lists the TF32 rounding points;
//! `docs/cpu.md` says how the CPU code is built and how fast it runs.

pub mod adjoint;
pub mod adjoint_magnitude;
pub mod chunk_cumsum;
pub mod chunked;
pub mod chunked_backward;
pub mod compute_out;
pub mod definition;
mod flat;
pub mod fwd_pass_state;
mod gemm;
pub mod magnitude;
pub mod naive;
mod prefetch;
pub mod problem;
pub mod random;
mod scratch;
pub mod serving;
pub mod simd;
pub mod tf32;
mod transpose;
mod vexp;

use ndarray::{Array4, Array5};

pub use chunked::ChunkedOutput;
pub use problem::{Dims, Inputs, Options, Problem};

/// The one error type of this crate.
#[derive(Debug, thiserror::Error)]
pub enum ReferenceError {
    /// Sizes, options or tensors that do not describe a valid problem; the message names the
    /// tensor (and the index, for a bad value).
    #[error("invalid problem: {0}")]
    InvalidProblem(String),
}

/// The float types the reference computes in: `f32` and `f64`.
pub trait Real:
    num_traits::Float
    + num_traits::FromPrimitive
    + std::iter::Sum
    + std::fmt::Debug
    + std::fmt::Display
    + Default
    + Send
    + Sync
    + 'static
{
    /// Converts an `f64` literal or value (rounding to nearest for `f32`).
    fn lit(v: f64) -> Self;
    /// Widens to `f64` (exact).
    fn as_f64(self) -> f64;
    /// Rounds to the nearest TF32 value (10 explicit mantissa bits, ties away from zero); see
    /// [`tf32`].
    fn round_tf32(self) -> Self;
    /// Rounds to the nearest bfloat16 value (7 explicit mantissa bits, ties to even), kept in
    /// `Self`; beyond bfloat16's range it overflows to infinity as the conversion does.
    fn round_bf16(self) -> Self;
    /// Replaces every entry of `values` by its exponential, in vectorised code (within 2 ulp of
    /// the C library's `exp`; `exp(0) = 1` exactly). The chunked path's decays use it.
    fn exp_all(values: &mut [Self]);
    /// The chunked path's decayed `C B^T` of a chunk in a single sequence, in one pass:
    /// `lmat[i, j] = (g[i, j] exp(cs[i] - cs[j])) dt[j]` for `j <= i`, with
    /// [`Real::exp_all`]'s exponential and each product rounded in that order; `lmat` and `g`
    /// are `l x l` row-major. Entries right of the diagonal are 0 or left as they were, and
    /// the exponential is evaluated only at `cs[i] - cs[j]` with `j <= i` (and at 0).
    fn decay_lower(l: usize, cs: &[Self], g: &[Self], dt: &[Self], lmat: &mut [Self]);
}

impl Real for f64 {
    #[inline]
    fn lit(v: f64) -> Self {
        v
    }
    #[inline]
    fn as_f64(self) -> f64 {
        self
    }
    #[inline]
    fn round_tf32(self) -> Self {
        tf32::round_f64(self)
    }
    #[inline]
    fn round_bf16(self) -> Self {
        half::bf16::from_f64(self).to_f64()
    }
    #[inline]
    fn exp_all(values: &mut [Self]) {
        vexp::exp_f64(values);
    }
    #[inline]
    fn decay_lower(l: usize, cs: &[Self], g: &[Self], dt: &[Self], lmat: &mut [Self]) {
        vexp::decay_lower_f64(l, cs, g, dt, lmat);
    }
}

impl Real for f32 {
    #[inline]
    fn lit(v: f64) -> Self {
        v as f32
    }
    #[inline]
    fn as_f64(self) -> f64 {
        self as f64
    }
    #[inline]
    fn round_tf32(self) -> Self {
        tf32::round_f32(self)
    }
    #[inline]
    fn round_bf16(self) -> Self {
        half::bf16::from_f32(self).to_f32()
    }
    #[inline]
    fn exp_all(values: &mut [Self]) {
        vexp::exp_f32(values);
    }
    #[inline]
    fn decay_lower(l: usize, cs: &[Self], g: &[Self], dt: &[Self], lmat: &mut [Self]) {
        vexp::decay_lower_f32(l, cs, g, dt, lmat);
    }
}

/// How the chunked path rounds the operands of its matrix products.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MatmulPrecision {
    /// Operands as they are, in `T`.
    #[default]
    Native,
    /// Every operand rounded to TF32 (10 explicit mantissa bits, round to nearest, ties away from
    /// zero, as `cvt.rna.tf32.f32` does) before the product; accumulation stays in `T`.
    /// Meant for `T = f32`: a correct TF32 tensor-core kernel computes this.
    Tf32,
    /// Every operand rounded to bfloat16 (8 significant bits, round to nearest, ties to even,
    /// as `__float2bfloat16_rn` and PyTorch's `.to(torch.bfloat16)` do) before the product;
    /// accumulation stays in `T`. A bf16 tensor-core kernel (`mma` m16n8k16 bf16, f32
    /// accumulation) computes this from its bf16 operands, as mamba_ssm's kernels do with bf16
    /// inputs (each dot's operands cast to the inputs' dtype). Its inputs `x`, `B`, `C`, `z` are
    /// bf16 values already: round them before (the checker's `--precision bf16` does).
    Bf16,
}

impl MatmulPrecision {
    /// `v` as a matrix-product operand under this precision: unchanged under
    /// [`MatmulPrecision::Native`], else rounded to TF32 or bfloat16.
    ///
    /// ```
    /// use ssd_reference::MatmulPrecision;
    /// assert_eq!(MatmulPrecision::Native.round(1.0f32 + 2f32.powi(-12)), 1.0 + 2f32.powi(-12));
    /// assert_eq!(MatmulPrecision::Tf32.round(1.0f32 + 2f32.powi(-12)), 1.0);
    /// assert_eq!(MatmulPrecision::Bf16.round(1.0f32 + 3.0 * 2f32.powi(-9)), 1.0 + 2f32.powi(-7));
    /// ```
    #[inline]
    pub fn round<T: Real>(self, v: T) -> T {
        match self {
            MatmulPrecision::Native => v,
            MatmulPrecision::Tf32 => v.round_tf32(),
            MatmulPrecision::Bf16 => v.round_bf16(),
        }
    }

    /// Whether operands are rounded at all (anything but [`MatmulPrecision::Native`]).
    #[inline]
    pub fn rounds(self) -> bool {
        self != MatmulPrecision::Native
    }

    /// Rounds every entry of `v` in place as [`MatmulPrecision::round`] does.
    pub(crate) fn round_all<T: Real>(self, v: &mut [T]) {
        if self.rounds() {
            v.iter_mut().for_each(|x| *x = self.round(*x));
        }
    }
}

/// The two outputs every implementation produces.
#[derive(Debug, Clone)]
pub struct Output<T> {
    /// `y` (gated by `z` when given): `[batch, seqlen, nheads, headdim]`.
    pub out: Array4<T>,
    /// State after the last token of each row: `[batch, nheads, headdim, dstate]`.
    pub final_states: Array4<T>,
}

/// A zero-filled array, the zeros written in parallel.
///
/// `Array::zeros` writes its zeros on the calling thread whenever the allocator hands back
/// reused memory (as in repeated calls); for the large outputs that is a measurable serial
/// pass over memory.
pub(crate) fn par_zeros<T: Real, D: ndarray::Dimension, Sh: ndarray::ShapeBuilder<Dim = D>>(
    shape: Sh,
) -> ndarray::Array<T, D> {
    use rayon::prelude::*;
    let shape = shape.into_shape_with_order();
    let n = shape.size();
    let mut v: Vec<T> = Vec::with_capacity(n);
    v.par_extend(rayon::iter::repeat_n(T::zero(), n));
    ndarray::Array::from_shape_vec(shape, v).expect("size matches the shape")
}

/// Shape helper for `[batch, nchunks, nheads, headdim, dstate]` tensors.
pub type ChunkStates<T> = Array5<T>;

/// How many of a row's `units` (heads, or groups) one task takes, when the work is split into
/// tasks of (row, block of units): the largest block (whole rows read contiguously, which is
/// what the blocks are for) that still gives every one of `threads` threads the same number of
/// equal tasks. That is the smallest block count `k >= threads / batch` with `k` dividing
/// `units` and `batch * k` a multiple of `threads`; one unit per task when there is none.
///
/// `batch = 2, units = 8` on 2 threads: whole rows; `batch = 3`: half rows (6 tasks, 3 per
/// thread, where whole rows would leave one thread with twice the other's work).
pub(crate) fn units_per_task(batch: usize, units: usize, threads: usize) -> usize {
    let (batch, units, threads) = (batch.max(1), units.max(1), threads.max(1));
    (threads.div_ceil(batch)..=units)
        .find(|&k| units.is_multiple_of(k) && (batch * k).is_multiple_of(threads))
        .map_or(1, |k| units / k)
}

#[cfg(test)]
mod tests {
    use super::units_per_task;

    #[test]
    fn units_per_task_balances_the_threads() {
        assert_eq!(units_per_task(2, 8, 2), 8); // whole rows, one per thread
        assert_eq!(units_per_task(3, 8, 2), 4); // half rows: 6 tasks
        assert_eq!(units_per_task(1, 8, 2), 4);
        assert_eq!(units_per_task(1, 3, 2), 1); // no even split: one head per task
        assert_eq!(units_per_task(8, 8, 2), 8);
        assert_eq!(units_per_task(1, 1, 4), 1);
        assert_eq!(units_per_task(2, 24, 16), 3); // 16 tasks of 3
        for batch in 1..6 {
            for units in 1..12 {
                for threads in 1..9 {
                    let k = units_per_task(batch, units, threads);
                    assert!(
                        k >= 1 && units.is_multiple_of(k),
                        "{batch} {units} {threads} -> {k}"
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod operand_rounding_tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn bf16_rounds_to_nearest_even_and_agrees_between_f32_and_f64() {
        let u = 2f32.powi(-8); // half of bf16's ulp at 1
        assert_eq!(MatmulPrecision::Bf16.round(1.0f32 + u), 1.0); // tie to even (down)
        assert_eq!(MatmulPrecision::Bf16.round(1.0f32 + 3.0 * u), 1.0 + 4.0 * u); // tie to even (up)
        assert_eq!(
            MatmulPrecision::Bf16.round(-(1.0f32 + 1.5 * u)),
            -(1.0 + 2.0 * u)
        );
        assert!(MatmulPrecision::Bf16.round(f32::MAX).is_infinite());
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        for _ in 0..100_000 {
            let v: f32 = rng.random_range(-1e6f32..1e6) * 2f32.powi(rng.random_range(-60..40));
            let r = MatmulPrecision::Bf16.round(v);
            assert_eq!(r.to_bits() & 0xFFFF, 0, "{v}: 16 low bits kept");
            assert!(((r - v) / v).abs() <= 2f32.powi(-8), "{v} -> {r}");
            assert_eq!(MatmulPrecision::Bf16.round(v as f64), r as f64, "{v}");
        }
        assert_eq!(MatmulPrecision::Native.round(1.0f32 + u), 1.0 + u);
        assert!(!MatmulPrecision::Native.rounds() && MatmulPrecision::Bf16.rounds());
    }

    #[test]
    fn chunked_bf16_rounds_its_operands() {
        use crate::random::{random_problem, ProblemSpec};
        let p = random_problem(&ProblemSpec::full(Dims::new(1, 40, 2, 8, 1, 8), 16), 3)
            .unwrap()
            .cast::<f32>();
        let native = chunked::forward(&p, MatmulPrecision::Native);
        let bf16 = chunked::forward(&p, MatmulPrecision::Bf16);
        let tf32 = chunked::forward(&p, MatmulPrecision::Tf32);
        let diff = |a: &Array4<f32>, b: &Array4<f32>| {
            a.iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0f32, f32::max)
        };
        let (db, dt) = (diff(&bf16.out, &native.out), diff(&tf32.out, &native.out));
        // bf16 keeps 3 fewer bits than TF32: its operands err about 8 times as much.
        assert!(db > 2.0 * dt && dt > 0.0, "bf16 {db} tf32 {dt}");
        assert!(db < 0.1, "bf16 {db}");
    }
}
