//! The error model: a per-element bound on how far a correct implementation may be from the
//! float64 reference, and the comparison of a candidate's outputs against it.
//!
//! For every element of `out`, `final_states`, `dA_cumsum` and `chunk_states`:
//!
//! ```text
//! |candidate - reference| <= SAFETY * ( (u_acc + u_ref) acc + u_io io + u_op op + 4 u_ref tok
//!                                       + eta F )
//!                            + u_store |reference| + eta_store
//! ```
//!
//! where `acc`, `io`, `op`, `tok` are the element's weighted magnitudes
//! ([`crate::magnitude`]: its terms' absolute values times their first-order error
//! coefficients), `u_*` the unit roundoffs of the claimed arithmetic ([`Precision::units`]),
//! `u_ref = 2^-53` the reference's own, `F` the underflow scale, and `u_store`, `eta_store`
//! the rounding of the candidate's storage dtype. Written as `kappa u M` with `M` the plain
//! magnitude, the effective `kappa` of an element is its bound over `u M`; `docs/tolerances.md`
//! derives every coefficient and records the calibration.
//!
//! [`Oracle`] computes the reference and the magnitudes of a problem once and checks any
//! number of candidates against them.
use std::fmt;

use ndarray::{ArrayD, ArrayView4};
use serde::Serialize;
use ssd_reference::adjoint::{self, Gradients};
use ssd_reference::adjoint_magnitude::{gradient_magnitudes, GradMagnitudes};
use ssd_reference::magnitude::magnitudes_packed;
use ssd_reference::serving::{self, implied_seq_idx, Algorithm, Packing};
use ssd_reference::{chunked, naive, ChunkedOutput, MatmulPrecision, Output, Problem, Real};

use crate::error::VerifyError;
use crate::fixture::{Dtype, Expected, Outputs};
use crate::magnitude::{magnitudes, Magnitudes};

/// Multiplies the first-order budget: covers the second-order terms the analysis drops and
/// one more rounded operand than the analysis counts.
pub const SAFETY: f64 = 2.0;

/// The arithmetic a candidate claims to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// float64 throughout.
    F64,
    /// float32 throughout (inputs rounded to f32 once).
    F32,
    /// float32 with every matrix-product operand rounded or truncated to TF32 (10 explicit
    /// mantissa bits), accumulation in f32: a TF32 tensor-core kernel.
    Tf32,
    /// `x`, `B`, `C`, `z` rounded to bfloat16 before the kernel and every matrix-product
    /// operand rounded to bfloat16, accumulation and everything else in f32.
    Bf16,
}

/// The unit roundoffs one [`Precision`] stands for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Units {
    /// The working arithmetic (sums, products, `exp`, the cumsum, `dt'`, the gate).
    pub acc: f64,
    /// The conversion of `x`, `B`, `C`, `z` to the kernel's input format.
    pub io: f64,
    /// The rounding of matrix-product operands beyond `acc` (0 when operands are not rounded):
    /// `2^-10` for TF32, whose operands a tensor core may truncate instead of rounding, `2^-8`
    /// for BF16 (round to nearest).
    pub op: f64,
    /// The float64 reference's own arithmetic.
    pub reference: f64,
    /// The smallest normal number of the working arithmetic (underflow, flush to zero).
    pub eta: f64,
}

const U64: f64 = 1.0 / 9_007_199_254_740_992.0; // 2^-53
const U32: f64 = 1.0 / 16_777_216.0; // 2^-24
const U_TF32: f64 = 1.0 / 2048.0; // 2^-11
/// TF32 operands may be truncated rather than rounded: a tensor core fed f32 registers drops
/// their 13 low mantissa bits (mamba_ssm's Triton kernels do this); truncation errs by < 2^-10.
const U_TF32_OPERAND: f64 = 1.0 / 1024.0; // 2^-10
const U_BF16: f64 = 1.0 / 256.0; // 2^-8
const ETA64: f64 = f64::MIN_POSITIVE; // 2^-1022
const ETA32: f64 = f32::MIN_POSITIVE as f64; // 2^-126

impl Precision {
    /// Every precision, strictest first.
    pub const ALL: [Precision; 4] = [
        Precision::F64,
        Precision::F32,
        Precision::Tf32,
        Precision::Bf16,
    ];

    /// `"f64"`, `"f32"`, `"tf32"`, `"bf16"`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F64 => "f64",
            Precision::F32 => "f32",
            Precision::Tf32 => "tf32",
            Precision::Bf16 => "bf16",
        }
    }

    /// The headline unit roundoff `u` (the one `kappa` is quoted in): `2^-53`, `2^-24`,
    /// `2^-11` (TF32 keeps 11 significant bits), `2^-8` (bfloat16 keeps 8).
    pub fn unit_roundoff(self) -> f64 {
        match self {
            Precision::F64 => U64,
            Precision::F32 => U32,
            Precision::Tf32 => U_TF32,
            Precision::Bf16 => U_BF16,
        }
    }

    /// The unit roundoffs of each group of roundings (see [`Units`]).
    pub fn units(self) -> Units {
        let (acc, io, op, eta) = match self {
            Precision::F64 => (U64, U64, 0.0, ETA64),
            Precision::F32 => (U32, U32, 0.0, ETA32),
            Precision::Tf32 => (U32, U32, U_TF32_OPERAND, ETA32),
            Precision::Bf16 => (U32, U_BF16, U_BF16, ETA32),
        };
        Units {
            acc,
            io,
            op,
            reference: U64,
            eta,
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Rounding of a value stored in `dtype`: relative `u_store` and absolute `eta_store` (half
/// the spacing of the subnormals).
pub fn storage_rounding(dtype: Dtype) -> (f64, f64) {
    match dtype {
        Dtype::F64 | Dtype::I64 | Dtype::I32 => (U64, 0.0),
        Dtype::F32 => (U32, f32::MIN_POSITIVE as f64 * U32),
        Dtype::BF16 => (U_BF16, f32::MIN_POSITIVE as f64 * U_BF16),
        Dtype::F16 => (1.0 / 2048.0, 6.103_515_625e-5 / 2048.0),
    }
}

/// The four outputs, in the contract's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum OutputName {
    #[serde(rename = "out")]
    Out,
    #[serde(rename = "final_states")]
    FinalStates,
    #[serde(rename = "dA_cumsum")]
    DACumsum,
    #[serde(rename = "chunk_states")]
    ChunkStates,
    /// The gradients of a backward pass (mamba_ssm's names): `[batch, seqlen, nheads, headdim]`.
    #[serde(rename = "dx")]
    Dx,
    /// `[batch, seqlen, nheads]`, with respect to the raw `dt`.
    #[serde(rename = "ddt")]
    Ddt,
    /// `[nheads]`.
    #[serde(rename = "dA")]
    DA,
    /// `[batch, seqlen, ngroups, dstate]`.
    #[serde(rename = "dB")]
    DB,
    /// `[batch, seqlen, ngroups, dstate]`.
    #[serde(rename = "dC")]
    DC,
    /// `[nheads]` or `[nheads, headdim]`, as `D`.
    #[serde(rename = "dD")]
    DD,
    /// `[batch, seqlen, nheads, headdim]`.
    #[serde(rename = "dz")]
    Dz,
    /// `[nheads]`.
    #[serde(rename = "ddt_bias")]
    DdtBias,
    /// `[batch, nheads, headdim, dstate]`.
    #[serde(rename = "dinitial_states")]
    DinitialStates,
    /// A packed case's state after each sequence: `[nseq, nheads, headdim, dstate]`.
    #[serde(rename = "varlen_states")]
    VarlenStates,
    /// A packed case's state after each listed token: `[k, nheads, headdim, dstate]`.
    #[serde(rename = "position_states")]
    PositionStates,
}

impl OutputName {
    /// In the contract's order.
    pub const ALL: [OutputName; 4] = [
        OutputName::Out,
        OutputName::FinalStates,
        OutputName::DACumsum,
        OutputName::ChunkStates,
    ];

    /// The gradients, in [`ssd_reference::adjoint::Gradients::named`]'s order.
    pub const GRADIENTS: [OutputName; 9] = [
        OutputName::Dx,
        OutputName::Ddt,
        OutputName::DA,
        OutputName::DB,
        OutputName::DC,
        OutputName::DD,
        OutputName::Dz,
        OutputName::DdtBias,
        OutputName::DinitialStates,
    ];

    /// The contract's name.
    pub fn name(self) -> &'static str {
        match self {
            OutputName::Out => "out",
            OutputName::FinalStates => "final_states",
            OutputName::DACumsum => "dA_cumsum",
            OutputName::ChunkStates => "chunk_states",
            OutputName::Dx => "dx",
            OutputName::Ddt => "ddt",
            OutputName::DA => "dA",
            OutputName::DB => "dB",
            OutputName::DC => "dC",
            OutputName::DD => "dD",
            OutputName::Dz => "dz",
            OutputName::DdtBias => "ddt_bias",
            OutputName::DinitialStates => "dinitial_states",
            OutputName::VarlenStates => "varlen_states",
            OutputName::PositionStates => "position_states",
        }
    }

    /// The outputs of a packed case ([`ssd_reference::serving`]).
    pub const PACKED: [OutputName; 2] = [OutputName::VarlenStates, OutputName::PositionStates];

    /// The output or gradient of this name.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .chain(Self::PACKED)
            .chain(Self::GRADIENTS)
            .find(|o| o.name() == name)
    }

    /// A gradient of the backward pass (not an output of the forward).
    pub fn is_gradient(self) -> bool {
        Self::GRADIENTS.contains(&self)
    }

    /// An output only a packed case has.
    pub fn is_packed(self) -> bool {
        Self::PACKED.contains(&self)
    }

    /// The input this gradient belongs to (`x` for `dx`, ...); `None` for a forward output.
    pub fn input(self) -> Option<&'static str> {
        self.is_gradient().then(|| &self.name()[1..])
    }

    /// The names of the axes, for reporting an index.
    pub fn axes(self) -> &'static [&'static str] {
        match self {
            OutputName::Out => &["batch", "token", "head", "channel"],
            OutputName::FinalStates => &["batch", "head", "channel", "state"],
            OutputName::DACumsum => &["batch", "head", "chunk", "position"],
            OutputName::ChunkStates => &["batch", "chunk", "head", "channel", "state"],
            OutputName::Dx | OutputName::Dz => &["batch", "token", "head", "channel"],
            OutputName::Ddt => &["batch", "token", "head"],
            OutputName::DA | OutputName::DdtBias => &["head"],
            OutputName::DB | OutputName::DC => &["batch", "token", "group", "state"],
            OutputName::DD => &["head", "channel"],
            OutputName::DinitialStates => &["batch", "head", "channel", "state"],
            OutputName::VarlenStates => &["sequence", "head", "channel", "state"],
            OutputName::PositionStates => &["position", "head", "channel", "state"],
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for OutputName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The bound of one element (see the module documentation).
#[inline]
fn element_bound(
    u: &Units,
    floor: f64,
    (u_store, eta_store): (f64, f64),
    [acc, io, op, tok]: [f64; 4],
    reference: f64,
) -> f64 {
    SAFETY * ((u.acc + u.reference) * acc + u.io * io + u.op * op + 4.0 * u.reference * tok + floor)
        + u_store * reference.abs()
        + eta_store
}

/// `|candidate - reference| / bound`: 0 for no error, infinite for a non-finite candidate.
#[inline]
pub fn ratio(candidate: f64, reference: f64, bound: f64) -> f64 {
    if !candidate.is_finite() {
        return f64::INFINITY;
    }
    let e = (candidate - reference).abs();
    if e == 0.0 {
        0.0
    } else {
        e / bound
    }
}

/// The element that is furthest over (or closest to) its bound.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Worst {
    /// Row-major index, one entry per axis of [`OutputName::axes`].
    pub index: Vec<usize>,
    pub candidate: f64,
    pub expected: f64,
    /// `|candidate - expected|` (infinite for a NaN or infinite candidate).
    pub error: f64,
    pub bound: f64,
    /// `error / bound`: above 1 fails.
    pub ratio: f64,
    /// The plain magnitude `M` of the element.
    pub magnitude: f64,
}

/// The comparison of one output tensor.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TensorReport {
    pub name: OutputName,
    pub shape: Vec<usize>,
    /// The dtype the candidate stored this tensor in.
    pub dtype: String,
    pub elements: usize,
    /// Largest `|candidate - expected|` over the finite elements.
    pub max_abs_error: f64,
    /// `||candidate - expected||_2 / ||expected||_2` over all elements (infinite when an
    /// element is not finite; the plain norm of the error when the expected values are all 0).
    pub rel_l2: f64,
    /// Number of elements over their bound, the non-finite ones included.
    pub exceeding: usize,
    /// Number of NaN or infinite candidate elements.
    pub non_finite: usize,
    /// Index of the first non-finite candidate element.
    pub first_non_finite: Option<Vec<usize>>,
    /// The element with the largest error/bound ratio (a non-finite one first).
    pub worst: Option<Worst>,
    /// Largest `error / bound / (u M)` effective kappa of the bound over the tensor (the bound
    /// without the floor, over `u M`), for the record.
    pub kappa_max: f64,
}

impl TensorReport {
    /// No element over its bound, none non-finite.
    pub fn passed(&self) -> bool {
        self.exceeding == 0
    }

    /// The worst error/bound ratio (0 for an empty tensor, infinite for a non-finite element).
    pub fn max_ratio(&self) -> f64 {
        self.worst.as_ref().map_or(0.0, |w| w.ratio)
    }
}

/// The comparison of a set of candidate outputs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Verdict {
    pub precision: Precision,
    pub tensors: Vec<TensorReport>,
}

impl Verdict {
    /// Every tensor passed.
    pub fn passed(&self) -> bool {
        self.tensors.iter().all(TensorReport::passed)
    }

    /// The worst error/bound ratio over every tensor.
    pub fn max_ratio(&self) -> f64 {
        self.tensors
            .iter()
            .map(TensorReport::max_ratio)
            .fold(0.0, f64::max)
    }

    /// The report of one output, when it was compared.
    pub fn tensor(&self, name: OutputName) -> Option<&TensorReport> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// One line per failing tensor: name, count over the bound, worst element.
    pub fn failures(&self) -> Vec<String> {
        self.tensors
            .iter()
            .filter(|t| !t.passed())
            .map(|t| {
                let w = t.worst.as_ref();
                format!(
                    "{}: {} of {} elements over the bound ({} not finite), worst at {:?}: {} vs {} (ratio {:.3e})",
                    t.name,
                    t.exceeding,
                    t.elements,
                    t.non_finite,
                    w.map(|w| w.index.clone()).unwrap_or_default(),
                    w.map_or(f64::NAN, |w| w.candidate),
                    w.map_or(f64::NAN, |w| w.expected),
                    t.max_ratio()
                )
            })
            .collect()
    }
}

/// Candidate outputs to check: `out` always, the others when the implementation produced them,
/// all widened to f64, with the dtype they were stored in (the storage rounding is part of the
/// bound).
#[allow(non_snake_case)]
#[derive(Debug, Clone)]
pub struct Candidate {
    pub out: ArrayD<f64>,
    pub final_states: Option<ArrayD<f64>>,
    pub dA_cumsum: Option<ArrayD<f64>>,
    pub chunk_states: Option<ArrayD<f64>>,
    /// The dtype the values were produced or stored in (`F32` for an f32 kernel).
    pub dtype: Dtype,
}

fn dtype_of<T: Real>() -> Dtype {
    if std::mem::size_of::<T>() == 8 {
        Dtype::F64
    } else {
        Dtype::F32
    }
}

fn widen<T: Real, D: ndarray::Dimension>(a: &ndarray::Array<T, D>) -> ArrayD<f64> {
    a.mapv(Real::as_f64).into_dyn()
}

impl<T: Real> From<&ChunkedOutput<T>> for Candidate {
    fn from(o: &ChunkedOutput<T>) -> Self {
        Candidate {
            out: widen(&o.out),
            final_states: Some(widen(&o.final_states)),
            dA_cumsum: Some(widen(&o.dA_cumsum)),
            chunk_states: Some(widen(&o.chunk_states)),
            dtype: dtype_of::<T>(),
        }
    }
}

impl<T: Real> From<&Output<T>> for Candidate {
    fn from(o: &Output<T>) -> Self {
        Candidate {
            out: widen(&o.out),
            final_states: Some(widen(&o.final_states)),
            dA_cumsum: None,
            chunk_states: None,
            dtype: dtype_of::<T>(),
        }
    }
}

impl<T: Real> From<&Outputs<T>> for Candidate {
    fn from(o: &Outputs<T>) -> Self {
        Candidate {
            out: widen(&o.out),
            final_states: Some(widen(&o.final_states)),
            dA_cumsum: o.dA_cumsum.as_ref().map(widen),
            chunk_states: o.chunk_states.as_ref().map(widen),
            dtype: dtype_of::<T>(),
        }
    }
}

impl Candidate {
    /// The present tensors, in the contract's order.
    pub fn tensors(&self) -> Vec<(OutputName, &ArrayD<f64>)> {
        let mut v = vec![(OutputName::Out, &self.out)];
        for (name, t) in [
            (OutputName::FinalStates, &self.final_states),
            (OutputName::DACumsum, &self.dA_cumsum),
            (OutputName::ChunkStates, &self.chunk_states),
        ] {
            if let Some(t) = t {
                v.push((name, t));
            }
        }
        v
    }
}

/// The float64 reference values of the four outputs of `p`: `out` and `final_states` from the
/// naive recurrence (the ground truth), `dA_cumsum` and `chunk_states` from the chunked path
/// in f64 (the naive recurrence has no intermediates).
pub fn reference_outputs(p: &Problem<f64>) -> [ArrayD<f64>; 4] {
    let n = naive::forward(p);
    let c = chunked::forward(p, MatmulPrecision::Native);
    [
        n.out.into_dyn(),
        n.final_states.into_dyn(),
        c.dA_cumsum.into_dyn(),
        c.chunk_states.into_dyn(),
    ]
}

/// `[out, final_states, dA_cumsum, chunk_states]` and `[varlen_states, position_states]`.
pub type PackedReference = ([ArrayD<f64>; 4], [ArrayD<f64>; 2]);

/// The float64 reference of a packed (serving) problem ([`ssd_reference::serving`]):
/// `[out, final_states, dA_cumsum, chunk_states]` and `[varlen_states, position_states]`.
/// `out`, `final_states` and the states come from the naive recurrence run sequence by
/// sequence from each sequence's initial state, `dA_cumsum` from the chunked path with the
/// implied `seq_idx`, `chunk_states` (the state entering each chunk of the global grid) from
/// the chunked path without per-sequence states and from the recurrence's states at the chunk
/// ends with them.
///
/// # Errors
/// [`VerifyError::Usage`] naming the tensor when the packing does not fit `p`.
pub fn packed_reference(
    p: &Problem<f64>,
    packing: &Packing<f64>,
) -> Result<PackedReference, VerifyError> {
    let usage = |e: ssd_reference::ReferenceError| VerifyError::Usage(e.to_string());
    packing.validate(p).map_err(usage)?;
    let ps = packing.with_seq_idx(p).map_err(usage)?;
    let d = *p.dims();
    let l = p.options().chunk_size;
    let (served, chunked_out) = rayon::join(
        || serving::forward(p, packing, Algorithm::Naive),
        || chunked::forward(&ps, MatmulPrecision::Native),
    );
    let served = served.map_err(usage)?;
    let mut chunk_states = chunked_out.chunk_states;
    if packing.seq_initial_states.is_some() {
        // The state entering chunk c > 0 is the state after token c L - 1; chunk 0's is the
        // state before token 0, the initial state of the sequence holding it.
        let ends = Packing {
            state_positions: (1..ps.nchunks()).map(|c| c * l - 1).collect(),
            ..packing.clone()
        };
        let at = serving::forward(p, &ends, Algorithm::Naive).map_err(usage)?;
        let first = implied_seq_idx(&packing.cu_seqlens)[0] as usize;
        let s0 = packing
            .initial_state(p, first)
            .unwrap_or_else(|| ndarray::Array4::zeros((1, d.nheads, d.headdim, d.dstate)));
        chunk_states
            .slice_mut(ndarray::s![0, 0, .., .., ..])
            .assign(&s0.slice(ndarray::s![0, .., .., ..]));
        for c in 1..ps.nchunks() {
            chunk_states
                .slice_mut(ndarray::s![0, c, .., .., ..])
                .assign(&at.position_states.slice(ndarray::s![c - 1, .., .., ..]));
        }
    }
    Ok((
        [
            served.out.into_dyn(),
            served.final_states.into_dyn(),
            chunked_out.dA_cumsum.into_dyn(),
            chunk_states.into_dyn(),
        ],
        [
            served.varlen_states.into_dyn(),
            served.position_states.into_dyn(),
        ],
    ))
}

/// The float64 reference gradients of a problem and their magnitudes.
#[derive(Debug, Clone)]
struct GradPart {
    reference: Vec<(OutputName, ArrayD<f64>)>,
    mags: GradMagnitudes,
}

/// The reference values and magnitudes of one problem, computed once; checks candidates.
///
/// It holds the forward's four outputs ([`Oracle::new`], [`Oracle::with_expected`]), the
/// gradients of a backward pass ([`Oracle::for_gradients`]), or both
/// ([`Oracle::add_gradients`]).
#[derive(Debug, Clone)]
pub struct Oracle {
    forward: Option<([ArrayD<f64>; 4], Magnitudes)>,
    /// A packed case's `varlen_states` and `position_states` (the magnitudes are in
    /// `forward`'s).
    packed: Option<[ArrayD<f64>; 2]>,
    gradients: Option<GradPart>,
}

/// The channels of one tensor's bound.
struct ChannelRefs<'a> {
    mag: &'a ArrayD<f64>,
    acc: &'a ArrayD<f64>,
    io: &'a ArrayD<f64>,
    op: &'a ArrayD<f64>,
    /// The reference's steps (forward outputs only: the gradients' `acc` holds the reference's
    /// share, multiplied by `u_acc + u_ref`).
    tok: Option<&'a ArrayD<f64>>,
    floor_scale: f64,
}

impl ChannelRefs<'_> {
    /// `tok`, or `zero` broadcast to the tensor's shape (no allocation).
    fn tok_or_zero<'z>(&'z self, zero: &'z ndarray::Array0<f64>) -> ndarray::ArrayViewD<'z, f64> {
        match self.tok {
            Some(t) => t.view(),
            None => zero
                .broadcast(self.mag.shape())
                .expect("a 0-d array broadcasts to any shape")
                .into_dyn(),
        }
    }
}

impl Oracle {
    /// Computes the float64 reference ([`reference_outputs`]) and the magnitudes of `p`.
    pub fn new(p: &Problem<f64>) -> Self {
        let (reference, mags) = rayon::join(|| reference_outputs(p), || magnitudes(p));
        Oracle {
            forward: Some((reference, mags)),
            packed: None,
            gradients: None,
        }
    }

    /// Like [`Oracle::new`], but takes the expected values a case carries instead of computing
    /// them (those it lacks are computed).
    pub fn with_expected(p: &Problem<f64>, expected: &Expected) -> Self {
        let given = [
            expected.out.as_ref().map(|a| a.clone().into_dyn()),
            expected.final_states.as_ref().map(|a| a.clone().into_dyn()),
            expected.dA_cumsum.as_ref().map(|a| a.clone().into_dyn()),
            expected.chunk_states.as_ref().map(|a| a.clone().into_dyn()),
        ];
        if given.iter().all(Option::is_some) {
            let mags = magnitudes(p);
            let reference = given.map(|g| g.expect("checked"));
            return Oracle {
                forward: Some((reference, mags)),
                packed: None,
                gradients: None,
            };
        }
        let mut o = Oracle::new(p);
        let (reference, _) = o.forward.as_mut().expect("computed");
        for (slot, g) in reference.iter_mut().zip(given) {
            if let Some(g) = g {
                *slot = g;
            }
        }
        o
    }

    /// A packed (serving) problem ([`ssd_reference::serving`]): `out`, `final_states`,
    /// `varlen_states` and `position_states` from the naive recurrence run sequence by sequence
    /// from each sequence's initial state, `dA_cumsum` from the chunked path with the implied
    /// `seq_idx`, `chunk_states` (the state entering each chunk of the global grid) from the
    /// recurrence's states at the chunk ends; the magnitudes of
    /// [`ssd_reference::magnitude::magnitudes_packed`].
    ///
    /// # Errors
    /// [`VerifyError::Usage`] naming the tensor when the packing does not fit `p`.
    pub fn for_packed(p: &Problem<f64>, packing: &Packing<f64>) -> Result<Self, VerifyError> {
        let usage = |e: ssd_reference::ReferenceError| VerifyError::Usage(e.to_string());
        packing.validate(p).map_err(usage)?;
        let ps = packing.with_seq_idx(p).map_err(usage)?;
        let (refs, mags) = rayon::join(
            || packed_reference(p, packing),
            || magnitudes_packed(&ps, packing),
        );
        let (reference, packed) = refs?;
        Ok(Oracle {
            forward: Some((reference, mags)),
            packed: Some(packed),
            gradients: None,
        })
    }

    /// The gradients only: the float64 adjoint of `p` pulled back from `dout` and
    /// `dfinal_states` ([`ssd_reference::adjoint::backward`]) and their magnitudes
    /// ([`ssd_reference::adjoint_magnitude`]). The forward's outputs are not computed.
    ///
    /// # Errors
    /// [`VerifyError::Usage`] naming the tensor when `dout` or `dfinal_states` has the wrong
    /// shape or a non-finite value.
    pub fn for_gradients(
        p: &Problem<f64>,
        dout: ArrayView4<f64>,
        dfinal_states: Option<ArrayView4<f64>>,
    ) -> Result<Self, VerifyError> {
        let (g, mags) = rayon::join(
            || adjoint::backward(p, dout, dfinal_states),
            || gradient_magnitudes(p, dout, dfinal_states),
        );
        let usage = |e: ssd_reference::ReferenceError| VerifyError::Usage(e.to_string());
        let (g, mags) = (g.map_err(usage)?, mags.map_err(usage)?);
        let reference = g
            .named()
            .into_iter()
            .map(|(name, a)| {
                let name = OutputName::from_name(name).expect("a gradient's name");
                (name, a.to_owned())
            })
            .collect();
        Ok(Oracle {
            forward: None,
            packed: None,
            gradients: Some(GradPart { reference, mags }),
        })
    }

    /// This oracle, able to check gradients too ([`Oracle::for_gradients`]).
    ///
    /// # Errors
    /// As [`Oracle::for_gradients`].
    pub fn add_gradients(
        mut self,
        p: &Problem<f64>,
        dout: ArrayView4<f64>,
        dfinal_states: Option<ArrayView4<f64>>,
    ) -> Result<Self, VerifyError> {
        self.gradients = Oracle::for_gradients(p, dout, dfinal_states)?.gradients;
        Ok(self)
    }

    /// Whether the oracle can check `name`: a forward output when it has the forward's part, a
    /// gradient when it has gradients and the problem has the input.
    pub fn has(&self, name: OutputName) -> bool {
        if name.is_gradient() {
            self.gradients
                .as_ref()
                .is_some_and(|g| g.reference.iter().any(|(n, _)| *n == name))
        } else if name.is_packed() {
            self.packed.is_some()
        } else {
            self.forward.is_some()
        }
    }

    /// Why a candidate tensor `name` of shape `shape` cannot be compared, if it cannot: the
    /// oracle has no reference for it (a gradient of an input the problem lacks, a packed output
    /// of an unpacked problem), or the shapes differ. One line, naming the tensor.
    pub fn refusal(&self, name: OutputName, shape: &[usize]) -> Option<String> {
        let Ok(want) = self.try_reference(name).map(|r| r.shape()) else {
            return Some(match name.input() {
                Some(input) => {
                    format!(
                        "`{name}` is the gradient of `{input}`, which the problem does not have"
                    )
                }
                None => format!("the oracle has no reference for `{name}`"),
            });
        };
        (shape != want).then(|| {
            let of = name
                .input()
                .map_or(String::new(), |i| format!(" (the shape of `{i}`)"));
            format!("`{name}` has shape {shape:?}, expected {want:?}{of}")
        })
    }

    /// The reference values of one output or gradient.
    ///
    /// # Panics
    /// When the oracle cannot check `name` ([`Oracle::has`]).
    pub fn reference(&self, name: OutputName) -> &ArrayD<f64> {
        self.try_reference(name).unwrap_or_else(|e| panic!("{e}"))
    }

    fn try_reference(&self, name: OutputName) -> Result<&ArrayD<f64>, VerifyError> {
        let missing = || {
            VerifyError::Usage(format!(
                "no reference for `{name}`: {}",
                if name.is_gradient() {
                    "the oracle has no gradients, or the case has no such input"
                } else if name.is_packed() {
                    "the case is not packed (no `cu_seqlens`)"
                } else {
                    "the oracle was built for gradients only"
                }
            ))
        };
        if name.is_gradient() {
            let g = self.gradients.as_ref().ok_or_else(missing)?;
            g.reference
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, a)| a)
                .ok_or_else(missing)
        } else if name.is_packed() {
            let [v, pos] = self.packed.as_ref().ok_or_else(missing)?;
            Ok(if name == OutputName::VarlenStates {
                v
            } else {
                pos
            })
        } else {
            let (r, _) = self.forward.as_ref().ok_or_else(missing)?;
            Ok(&r[name.index()])
        }
    }

    /// The magnitudes of the forward's outputs.
    ///
    /// # Panics
    /// When the oracle was built for gradients only.
    pub fn magnitudes(&self) -> &Magnitudes {
        &self
            .forward
            .as_ref()
            .expect("the oracle was built for gradients only")
            .1
    }

    fn channels(&self, name: OutputName) -> Result<ChannelRefs<'_>, VerifyError> {
        self.try_reference(name)?;
        if name.is_gradient() {
            let g = self.gradients.as_ref().expect("checked");
            let c = g.mags.channels(name.name()).expect("checked");
            Ok(ChannelRefs {
                mag: &c.mag,
                acc: &c.acc,
                io: &c.io,
                op: &c.op,
                tok: None,
                floor_scale: g.mags.floor_scale,
            })
        } else {
            let m = self.magnitudes();
            let c = m.channels(name);
            Ok(ChannelRefs {
                mag: &c.mag,
                acc: &c.acc,
                io: &c.io,
                op: &c.op,
                tok: Some(&c.tok),
                floor_scale: m.floor_scale,
            })
        }
    }

    /// The per-element bound of one output or gradient.
    ///
    /// # Panics
    /// When the oracle cannot check `name` ([`Oracle::has`]).
    pub fn bounds(&self, name: OutputName, precision: Precision, storage: Dtype) -> ArrayD<f64> {
        let ch = self.channels(name).unwrap_or_else(|e| panic!("{e}"));
        let u = precision.units();
        let floor = u.eta * ch.floor_scale;
        let st = storage_rounding(storage);
        let reference = self.reference(name);
        let zero = ndarray::arr0(0.0);
        let tok = ch.tok_or_zero(&zero);
        let mut out = ArrayD::zeros(reference.shape());
        ndarray::Zip::from(&mut out)
            .and(reference)
            .and(ch.acc)
            .and(ch.io)
            .and(ch.op)
            .and(tok)
            .for_each(|o, &r, &acc, &io, &op, &tok| {
                *o = element_bound(&u, floor, st, [acc, io, op, tok], r);
            });
        out
    }

    /// The per-element ratio `|candidate - reference| / bound` of one output (0 where the
    /// error is 0, infinite where the candidate is NaN or infinite), in the reference's
    /// row-major layout: the input of the failure map ([`crate::diagnose`]).
    ///
    /// # Errors
    /// [`VerifyError::Usage`] when the shapes differ or the oracle cannot check `name`.
    pub fn ratios(
        &self,
        name: OutputName,
        candidate: &ArrayD<f64>,
        storage: Dtype,
        precision: Precision,
    ) -> Result<ArrayD<f64>, VerifyError> {
        let expected = self.same_shape(name, candidate)?;
        let mut out = self.bounds(name, precision, storage);
        ndarray::Zip::from(&mut out)
            .and(candidate)
            .and(expected)
            .par_for_each(|o, &c, &r| *o = ratio(c, r, *o));
        Ok(out)
    }

    /// The reference of `name`, when `candidate` has its shape.
    fn same_shape(
        &self,
        name: OutputName,
        candidate: &ArrayD<f64>,
    ) -> Result<&ArrayD<f64>, VerifyError> {
        let expected = self.try_reference(name)?;
        if candidate.shape() != expected.shape() {
            return Err(VerifyError::Usage(format!(
                "candidate `{name}` has shape {:?}, expected {:?}",
                candidate.shape(),
                expected.shape()
            )));
        }
        Ok(expected)
    }

    /// Compares one candidate tensor, stored as `storage`, with the reference.
    ///
    /// # Errors
    /// [`VerifyError::Usage`] when the shapes differ or the oracle cannot check `name`.
    pub fn compare(
        &self,
        name: OutputName,
        candidate: &ArrayD<f64>,
        storage: Dtype,
        precision: Precision,
    ) -> Result<TensorReport, VerifyError> {
        let expected = self.same_shape(name, candidate)?;
        let ch = self.channels(name)?;
        let u = precision.units();
        let floor = u.eta * ch.floor_scale;
        let st = storage_rounding(storage);
        let uh = precision.unit_roundoff();
        let shape = expected.shape().to_vec();
        let zero = ndarray::arr0(0.0);
        let tok = ch.tok_or_zero(&zero);

        let mut max_abs = 0.0_f64;
        let (mut err2, mut ref2) = (0.0_f64, 0.0_f64);
        let mut exceeding = 0usize;
        let mut non_finite = 0usize;
        let mut first_non_finite = None;
        let mut worst: Option<(usize, f64, f64, f64)> = None; // flat, error, bound, ratio
        let mut kappa_max = 0.0_f64;
        let it = candidate
            .iter()
            .zip(expected.iter())
            .zip(ch.acc.iter().zip(ch.io.iter()))
            .zip(ch.op.iter().zip(tok.iter()).zip(ch.mag.iter()));
        for (flat, (((&c, &r), (&acc, &io)), ((&op, &tok), &m))) in it.enumerate() {
            let bound = element_bound(&u, floor, st, [acc, io, op, tok], r);
            if m > 0.0 {
                kappa_max = kappa_max.max((bound - SAFETY * floor) / (uh * m));
            }
            ref2 += r * r;
            if !c.is_finite() {
                non_finite += 1;
                exceeding += 1;
                err2 = f64::INFINITY;
                if first_non_finite.is_none() {
                    first_non_finite = Some(flat);
                    worst = Some((flat, f64::INFINITY, bound, f64::INFINITY));
                }
                continue;
            }
            let e = (c - r).abs();
            max_abs = max_abs.max(e);
            err2 += e * e;
            let ratio = ratio(c, r, bound);
            if ratio > 1.0 {
                exceeding += 1;
            }
            if worst.is_none_or(|(_, _, _, w)| ratio > w) {
                worst = Some((flat, e, bound, ratio));
            }
        }
        let unravel = |flat| ssd_reference::problem::unravel(flat, &shape);
        let worst = worst.map(|(flat, error, bound, ratio)| Worst {
            index: unravel(flat),
            candidate: *candidate.iter().nth(flat).expect("in range"),
            expected: *expected.iter().nth(flat).expect("in range"),
            error,
            bound,
            ratio,
            magnitude: *ch.mag.iter().nth(flat).expect("in range"),
        });
        let rel_l2 = if ref2 > 0.0 {
            (err2 / ref2).sqrt()
        } else {
            err2.sqrt()
        };
        let first_non_finite = first_non_finite.map(unravel);
        Ok(TensorReport {
            name,
            shape: shape.clone(),
            dtype: storage.name().to_string(),
            elements: candidate.len(),
            max_abs_error: max_abs,
            rel_l2,
            exceeding,
            non_finite,
            first_non_finite,
            worst,
            kappa_max,
        })
    }

    /// Checks every tensor `candidate` holds.
    ///
    /// # Errors
    /// [`VerifyError::Usage`] when a tensor's shape differs from the reference's.
    pub fn check(
        &self,
        candidate: &Candidate,
        precision: Precision,
    ) -> Result<Verdict, VerifyError> {
        let tensors = candidate
            .tensors()
            .into_iter()
            .map(|(name, t)| self.compare(name, t, candidate.dtype, precision))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Verdict { precision, tensors })
    }

    /// Checks every gradient in `g` (computed or stored as `storage`).
    ///
    /// # Errors
    /// [`VerifyError::Usage`] when a gradient's shape differs from the reference's or the
    /// oracle has no gradients.
    pub fn check_gradients<T: Real>(
        &self,
        g: &Gradients<T>,
        storage: Dtype,
        precision: Precision,
    ) -> Result<Verdict, VerifyError> {
        let tensors = g
            .named()
            .into_iter()
            .map(|(name, a)| {
                let name = OutputName::from_name(name).expect("a gradient's name");
                self.compare(name, &a.mapv(Real::as_f64), storage, precision)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Verdict { precision, tensors })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ssd_reference::random::{random_problem, ProblemSpec};
    use ssd_reference::Dims;

    fn problem() -> Problem<f64> {
        let dims = Dims {
            batch: 1,
            seqlen: 20,
            nheads: 2,
            headdim: 3,
            ngroups: 1,
            dstate: 4,
        };
        random_problem(&ProblemSpec::full(dims, 8), 1).unwrap()
    }

    #[test]
    fn unit_roundoffs() {
        assert_eq!(Precision::F32.unit_roundoff(), f32::EPSILON as f64 / 2.0);
        assert_eq!(Precision::F64.unit_roundoff(), f64::EPSILON / 2.0);
        assert_eq!(Precision::Tf32.unit_roundoff(), 2f64.powi(-11));
        assert_eq!(Precision::Bf16.unit_roundoff(), 2f64.powi(-8));
        assert_eq!(Precision::Tf32.units().op, 2f64.powi(-10));
        assert_eq!(storage_rounding(Dtype::BF16).0, 2f64.powi(-8));
    }

    #[test]
    fn reference_passes_itself_and_a_nan_fails_with_its_index() {
        let p = problem();
        let o = Oracle::new(&p);
        let exact = o.reference(OutputName::Out).clone();
        let r = o
            .compare(OutputName::Out, &exact, Dtype::F64, Precision::F64)
            .unwrap();
        assert!(r.passed());
        assert_eq!(r.max_ratio(), 0.0);
        assert_eq!(r.max_abs_error, 0.0);
        let mut bad = exact.clone();
        bad[[0, 7, 1, 2]] = f64::NAN;
        let r = o
            .compare(OutputName::Out, &bad, Dtype::F32, Precision::Bf16)
            .unwrap();
        assert!(!r.passed());
        assert_eq!(r.non_finite, 1);
        assert_eq!(r.first_non_finite, Some(vec![0, 7, 1, 2]));
        assert_eq!(r.worst.as_ref().unwrap().index, vec![0, 7, 1, 2]);
        assert!(r.rel_l2.is_infinite());
    }

    #[test]
    fn bounds_grow_with_the_precision_and_shapes_are_checked() {
        let p = problem();
        let o = Oracle::new(&p);
        let b: Vec<ArrayD<f64>> = Precision::ALL
            .iter()
            .map(|&pr| o.bounds(OutputName::Out, pr, Dtype::F64))
            .collect();
        for w in b.windows(2) {
            assert!(w[0].iter().zip(w[1].iter()).all(|(a, c)| a < c));
        }
        let wrong = ArrayD::<f64>::zeros(ndarray::IxDyn(&[1, 20, 2, 4]));
        assert!(o
            .compare(OutputName::Out, &wrong, Dtype::F32, Precision::F32)
            .is_err());
    }
}
