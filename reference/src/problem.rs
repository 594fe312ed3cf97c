//! The problem description: sizes, options and input tensors, validated once.
//!
//! Names and layouts follow the fixture contract (`ssd-fixture/1`), which in turn follows the
//! arguments of mamba_ssm's `mamba_chunk_scan_combined`:
//!
//! | name             | shape                                   |
//! | ---------------- | --------------------------------------- |
//! | `x`              | `[batch, seqlen, nheads, headdim]`      |
//! | `dt`             | `[batch, seqlen, nheads]`               |
//! | `A`              | `[nheads]`, every value `<= 0`          |
//! | `B`, `C`         | `[batch, seqlen, ngroups, dstate]`      |
//! | `D`              | `[nheads]` or `[nheads, headdim]`       |
//! | `z`              | `[batch, seqlen, nheads, headdim]`      |
//! | `dt_bias`        | `[nheads]`                              |
//! | `initial_states` | `[batch, nheads, headdim, dstate]`      |
//! | `seq_idx`        | `[batch, seqlen]`, `>= 0`, non-decreasing along each row |

use ndarray::{Array1, Array2, Array3, Array4, ArrayD, Axis};

use crate::{Real, ReferenceError};

/// The six sizes of a problem.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Dims {
    pub batch: usize,
    pub seqlen: usize,
    pub nheads: usize,
    pub headdim: usize,
    pub ngroups: usize,
    pub dstate: usize,
}

impl Dims {
    /// The sizes in the manifest's order: `batch, seqlen, nheads, headdim, ngroups, dstate`.
    pub fn new(
        batch: usize,
        seqlen: usize,
        nheads: usize,
        headdim: usize,
        ngroups: usize,
        dstate: usize,
    ) -> Self {
        Dims {
            batch,
            seqlen,
            nheads,
            headdim,
            ngroups,
            dstate,
        }
    }

    /// Number of heads that share one group of `B`/`C`: `nheads / ngroups`.
    pub fn heads_per_group(&self) -> usize {
        self.nheads / self.ngroups
    }

    /// The group read by head `h`: `h / (nheads / ngroups)`.
    pub fn group_of_head(&self, h: usize) -> usize {
        h / self.heads_per_group()
    }

    /// The six sizes with their contract names, in the manifest's order.
    pub fn named(&self) -> [(&'static str, usize); 6] {
        [
            ("batch", self.batch),
            ("seqlen", self.seqlen),
            ("nheads", self.nheads),
            ("headdim", self.headdim),
            ("ngroups", self.ngroups),
            ("dstate", self.dstate),
        ]
    }

    /// Number of chunks of `chunk_size` tokens covering `seqlen` (the last one may be partial).
    pub fn nchunks(&self, chunk_size: usize) -> usize {
        self.seqlen.div_ceil(chunk_size)
    }
}

/// Options of the forward pass (everything in the manifest that is not a size or a tensor).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Options {
    /// Tokens per chunk: a power of two, at least 1.
    pub chunk_size: usize,
    /// Apply `softplus` (threshold 20) to `dt + dt_bias`.
    pub dt_softplus: bool,
    /// Clamp `[lo, hi]` applied after softplus; `hi = +inf` means no upper bound.
    pub dt_limit: (f64, f64),
}

impl Default for Options {
    fn default() -> Self {
        Options {
            chunk_size: 64,
            dt_softplus: false,
            dt_limit: (0.0, f64::INFINITY),
        }
    }
}

/// The input tensors, owned, in the contract's names and layouts.
///
/// Build one, then hand it to [`Problem::new`], which checks everything once.
#[allow(non_snake_case)]
#[derive(Debug, Clone)]
pub struct Inputs<T> {
    pub x: Array4<T>,
    pub dt: Array3<T>,
    pub A: Array1<T>,
    pub B: Array4<T>,
    pub C: Array4<T>,
    /// `[nheads]` (per head) or `[nheads, headdim]` (per channel).
    pub D: Option<ArrayD<T>>,
    pub z: Option<Array4<T>>,
    pub dt_bias: Option<Array1<T>>,
    pub initial_states: Option<Array4<T>>,
    pub seq_idx: Option<Array2<i64>>,
}

/// A validated problem: sizes, options and inputs that agree with each other.
///
/// Every algorithm of this crate takes a `&Problem<T>` and may rely on its invariants.
#[derive(Debug, Clone)]
pub struct Problem<T> {
    dims: Dims,
    options: Options,
    inputs: Inputs<T>,
}

impl<T: Real> Problem<T> {
    /// Checks `inputs` against `dims` and `options`.
    ///
    /// # Errors
    /// [`ReferenceError::InvalidProblem`] naming the tensor (and the index, for bad values) when:
    /// a size is zero (`seqlen` may not be zero either: there is no token to compute), a shape
    /// disagrees with `dims`, `nheads % ngroups != 0`, `chunk_size` is not a power of two,
    /// `dt_limit` is not `lo <= hi` with `lo` finite, a value is not finite, `A > 0`, or
    /// `seq_idx` is negative or decreases along a row.
    pub fn new(dims: Dims, options: Options, inputs: Inputs<T>) -> Result<Self, ReferenceError> {
        validate(&dims, &options, &inputs)?;
        Ok(Problem {
            dims,
            options,
            inputs,
        })
    }

    pub fn dims(&self) -> &Dims {
        &self.dims
    }

    pub fn options(&self) -> &Options {
        &self.options
    }

    pub fn inputs(&self) -> &Inputs<T> {
        &self.inputs
    }

    pub fn into_inputs(self) -> Inputs<T> {
        self.inputs
    }

    /// Number of chunks: `ceil(seqlen / chunk_size)`.
    pub fn nchunks(&self) -> usize {
        self.dims.nchunks(self.options.chunk_size)
    }

    /// `D` for head `h`, channel `p` (0 when there is no `D`).
    #[inline]
    pub fn d_skip(&self, h: usize, p: usize) -> T {
        match &self.inputs.D {
            None => T::zero(),
            Some(d) if d.ndim() == 1 => d[[h]],
            Some(d) => d[[h, p]],
        }
    }

    /// The processed step `dt' = clamp(softplus?(dt + dt_bias), lo, hi)` for one token.
    ///
    /// softplus(v) = log(1 + exp(v)) for v <= 20 and v itself above (mamba_ssm's threshold).
    #[inline]
    pub fn dt_processed(&self, b: usize, t: usize, h: usize) -> T {
        let mut v = self.inputs.dt[[b, t, h]];
        if let Some(bias) = &self.inputs.dt_bias {
            v = v + bias[h];
        }
        if self.options.dt_softplus {
            v = softplus(v);
        }
        let lo = T::lit(self.options.dt_limit.0);
        let hi = T::lit(self.options.dt_limit.1);
        v.max(lo).min(hi)
    }

    /// Number of valid tokens in chunk `c`: `min(chunk_size, seqlen - c * chunk_size)`.
    ///
    /// # Panics
    /// If `c >= nchunks()`.
    #[inline]
    pub fn chunk_len(&self, c: usize) -> usize {
        let cs = self.options.chunk_size;
        assert!(c < self.nchunks(), "chunk {c} out of range");
        cs.min(self.dims.seqlen - c * cs)
    }

    /// `seq_idx[b, t]`, or 0 when the problem has no `seq_idx` (one sequence per row).
    #[inline]
    pub fn seq_idx_at(&self, b: usize, t: usize) -> i64 {
        match &self.inputs.seq_idx {
            None => 0,
            Some(s) => s[[b, t]],
        }
    }

    /// The same problem restricted to the first `len` tokens of every row (`1 <= len <=
    /// seqlen`). Its `final_states` is the state after token `len - 1` of the full problem.
    ///
    /// # Errors
    /// [`ReferenceError::InvalidProblem`] when `len` is 0 or larger than `seqlen`.
    pub fn prefix(&self, len: usize) -> Result<Self, ReferenceError> {
        if len == 0 || len > self.dims.seqlen {
            return Err(invalid(format!(
                "prefix length {len} is not in 1..={}",
                self.dims.seqlen
            )));
        }
        let inputs = self.token_inputs(0..len);
        let dims = Dims {
            seqlen: len,
            ..self.dims
        };
        Problem::new(dims, self.options, inputs)
    }

    /// The inputs of tokens `range` of every row (`seq_idx` sliced too; `initial_states` and
    /// the per-head tensors as they are): a window's inputs, to validate as a problem.
    pub(crate) fn token_inputs(&self, range: std::ops::Range<usize>) -> Inputs<T> {
        let i = &self.inputs;
        let t = ndarray::Slice::from(range);
        let cut4 = |a: &Array4<T>| a.slice_axis(Axis(1), t).to_owned();
        Inputs {
            x: cut4(&i.x),
            dt: i.dt.slice_axis(Axis(1), t).to_owned(),
            A: i.A.clone(),
            B: cut4(&i.B),
            C: cut4(&i.C),
            D: i.D.clone(),
            z: i.z.as_ref().map(cut4),
            dt_bias: i.dt_bias.clone(),
            initial_states: i.initial_states.clone(),
            seq_idx: i
                .seq_idx
                .as_ref()
                .map(|s| s.slice_axis(Axis(1), t).to_owned()),
        }
    }

    /// Converts every tensor to another float type (seq_idx is kept as is).
    pub fn cast<U: Real>(&self) -> Problem<U> {
        fn c<U: Real, T: Real, D: ndarray::Dimension>(
            a: &ndarray::Array<T, D>,
        ) -> ndarray::Array<U, D> {
            a.mapv(|v| U::lit(v.as_f64()))
        }
        let i = &self.inputs;
        Problem {
            dims: self.dims,
            options: self.options,
            inputs: Inputs {
                x: c(&i.x),
                dt: c(&i.dt),
                A: c(&i.A),
                B: c(&i.B),
                C: c(&i.C),
                D: i.D.as_ref().map(c),
                z: i.z.as_ref().map(c),
                dt_bias: i.dt_bias.as_ref().map(c),
                initial_states: i.initial_states.as_ref().map(c),
                seq_idx: i.seq_idx.clone(),
            },
        }
    }
}

/// softplus with mamba_ssm's threshold: `v` above 20, `log(1 + exp(v))` otherwise.
#[inline]
pub fn softplus<T: Real>(v: T) -> T {
    if v > T::lit(20.0) {
        v
    } else {
        v.exp().ln_1p()
    }
}

/// The output gate of mamba_ssm: `y * (z * sigmoid(z))` with `sigmoid(z) = 1 / (1 + exp(-z))`
/// (`exp(-z)` may overflow to infinity for very negative `z`, giving a gate of exactly 0).
#[inline]
pub fn gate<T: Real>(y: T, z: T) -> T {
    y * (z / (T::one() + (-z).exp()))
}

fn invalid(msg: String) -> ReferenceError {
    ReferenceError::InvalidProblem(msg)
}

pub(crate) fn check_shape(name: &str, got: &[usize], want: &[usize]) -> Result<(), ReferenceError> {
    if got != want {
        return Err(invalid(format!(
            "tensor `{name}` has shape {got:?}, expected {want:?} from dims"
        )));
    }
    Ok(())
}

pub(crate) fn check_finite<T: Real, S: ndarray::Data<Elem = T>, D: ndarray::Dimension>(
    name: &str,
    a: &ndarray::ArrayBase<S, D>,
) -> Result<(), ReferenceError> {
    // `iter` walks in logical row-major order whatever the memory layout.
    if let Some((flat, v)) = a.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        return Err(invalid(format!(
            "tensor `{name}` has the non-finite value {v:?} at index {:?}",
            unravel(flat, a.shape())
        )));
    }
    Ok(())
}

/// The row-major multi-index of flat position `flat` in an array of `shape`.
pub fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for (k, &n) in shape.iter().enumerate().rev() {
        if n > 0 {
            idx[k] = flat % n;
            flat /= n;
        }
    }
    idx
}

fn validate<T: Real>(dims: &Dims, options: &Options, i: &Inputs<T>) -> Result<(), ReferenceError> {
    let Dims {
        batch,
        seqlen,
        nheads,
        headdim,
        ngroups,
        dstate,
    } = *dims;
    for (name, v) in dims.named() {
        if v == 0 {
            return Err(invalid(format!(
                "dims.{name} is 0: every size must be at least 1"
            )));
        }
    }
    if nheads % ngroups != 0 {
        return Err(invalid(format!(
            "nheads ({nheads}) is not a multiple of ngroups ({ngroups})"
        )));
    }
    if !options.chunk_size.is_power_of_two() {
        return Err(invalid(format!(
            "chunk_size {} is not a power of two",
            options.chunk_size
        )));
    }
    let (lo, hi) = options.dt_limit;
    if !lo.is_finite() || hi.is_nan() || lo > hi {
        return Err(invalid(format!(
            "dt_limit [{lo}, {hi}] is not an interval with a finite lower end"
        )));
    }
    check_shape("x", i.x.shape(), &[batch, seqlen, nheads, headdim])?;
    check_shape("dt", i.dt.shape(), &[batch, seqlen, nheads])?;
    check_shape("A", i.A.shape(), &[nheads])?;
    check_shape("B", i.B.shape(), &[batch, seqlen, ngroups, dstate])?;
    check_shape("C", i.C.shape(), &[batch, seqlen, ngroups, dstate])?;
    if let Some(d) = &i.D {
        if d.shape() != [nheads] && d.shape() != [nheads, headdim] {
            return Err(invalid(format!(
                "tensor `D` has shape {:?}, expected [{nheads}] or [{nheads}, {headdim}]",
                d.shape()
            )));
        }
    }
    if let Some(z) = &i.z {
        check_shape("z", z.shape(), &[batch, seqlen, nheads, headdim])?;
    }
    if let Some(bias) = &i.dt_bias {
        check_shape("dt_bias", bias.shape(), &[nheads])?;
    }
    if let Some(s) = &i.initial_states {
        check_shape(
            "initial_states",
            s.shape(),
            &[batch, nheads, headdim, dstate],
        )?;
    }
    if let Some(s) = &i.seq_idx {
        check_shape("seq_idx", s.shape(), &[batch, seqlen])?;
    }

    check_finite("x", &i.x)?;
    check_finite("dt", &i.dt)?;
    check_finite("A", &i.A)?;
    check_finite("B", &i.B)?;
    check_finite("C", &i.C)?;
    if let Some(d) = &i.D {
        check_finite("D", d)?;
    }
    if let Some(z) = &i.z {
        check_finite("z", z)?;
    }
    if let Some(bias) = &i.dt_bias {
        check_finite("dt_bias", bias)?;
    }
    if let Some(s) = &i.initial_states {
        check_finite("initial_states", s)?;
    }
    if let Some((h, a)) = i.A.iter().enumerate().find(|(_, a)| **a > T::zero()) {
        return Err(invalid(format!(
            "tensor `A` has the positive value {a:?} at index [{h}]: A must be <= 0"
        )));
    }
    if let Some(s) = &i.seq_idx {
        for (b, row) in s.axis_iter(Axis(0)).enumerate() {
            let mut prev = 0i64;
            for (t, &v) in row.iter().enumerate() {
                if v < 0 {
                    return Err(invalid(format!(
                        "tensor `seq_idx` has the negative value {v} at index [{b}, {t}]"
                    )));
                }
                if t > 0 && v < prev {
                    return Err(invalid(format!(
                        "tensor `seq_idx` decreases at index [{b}, {t}] ({prev} then {v}): it must be non-decreasing along each row"
                    )));
                }
                prev = v;
            }
        }
    }
    Ok(())
}
