//! Fixture cases (`ssd-fixture/1`) and tensor files: reading, writing, checking.
//!
//! A case is two files: a JSON manifest (`STEM.json`) and a safetensors file named by its
//! `tensors` key, relative to the manifest. `docs/fixture-format.md` is the full contract; in
//! short:
//!
//! | manifest key  | meaning                                                                   |
//! | ------------- | ------------------------------------------------------------------------- |
//! | `format`      | `"ssd-fixture/1"`, anything else is refused                               |
//! | `dims`        | `batch`, `seqlen`, `nheads`, `headdim`, `ngroups`, `dstate`                |
//! | `chunk_size`  | a power of two                                                            |
//! | `dt_softplus` | bool; absent means `false` (mamba_ssm's default)                          |
//! | `dt_limit`    | `[lo, hi]`, `null` for `hi` means +inf; absent means `[0.0, null]`        |
//! | `tensors`     | the safetensors file; absent means `STEM.safetensors`                     |
//!
//! Other keys are kept in [`CaseMeta`] (`name`, `seed`, `description`, and the rest verbatim)
//! and otherwise ignored.
//!
//! Inputs are read into a [`Problem<f64>`], widening exactly: F64 or F32 for every float input,
//! F16 or BF16 also for `x`, `z`, `B` and `C`; `seq_idx` I32 or I64. Expected outputs, when the
//! case carries them, are read into [`Expected`]. Any other tensor file (a kernel's output under
//! test) is read with [`TensorFile`], which reports the dtype each tensor was stored in.

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use half::{bf16, f16};
use ndarray::{Array, Array4, Array5, ArrayBase, ArrayD, Data, Dimension, IxDyn};
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;
use serde_json::{Map, Value};
use ssd_reference::{ChunkedOutput, Dims, Inputs, Options, Output, Problem, Real};

use crate::error::VerifyError;

/// The value of the manifest's `format` key.
pub const FORMAT: &str = "ssd-fixture/1";

/// The input tensors of a case, in the contract's order.
pub const INPUT_NAMES: [&str; 10] = [
    "x",
    "dt",
    "A",
    "B",
    "C",
    "D",
    "z",
    "dt_bias",
    "initial_states",
    "seq_idx",
];

/// The output tensors an implementation produces (the last two only on the chunked path).
pub const OUTPUT_NAMES: [&str; 4] = ["out", "final_states", "dA_cumsum", "chunk_states"];

/// The per-element magnitudes a case may carry for the error bound.
pub const MAGNITUDE_NAMES: [&str; 2] = ["out_mag", "final_states_mag"];

// ---------------------------------------------------------------------------------------------
// dtypes

/// The element type a tensor is stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dtype {
    F64,
    F32,
    F16,
    BF16,
    I64,
    I32,
}

impl Dtype {
    fn from_safetensors(d: safetensors::Dtype) -> Option<Self> {
        Some(match d {
            safetensors::Dtype::F64 => Dtype::F64,
            safetensors::Dtype::F32 => Dtype::F32,
            safetensors::Dtype::F16 => Dtype::F16,
            safetensors::Dtype::BF16 => Dtype::BF16,
            safetensors::Dtype::I64 => Dtype::I64,
            safetensors::Dtype::I32 => Dtype::I32,
            _ => return None,
        })
    }

    fn to_safetensors(self) -> safetensors::Dtype {
        match self {
            Dtype::F64 => safetensors::Dtype::F64,
            Dtype::F32 => safetensors::Dtype::F32,
            Dtype::F16 => safetensors::Dtype::F16,
            Dtype::BF16 => safetensors::Dtype::BF16,
            Dtype::I64 => safetensors::Dtype::I64,
            Dtype::I32 => safetensors::Dtype::I32,
        }
    }

    /// The name safetensors uses: `"F64"`, `"BF16"`, ...
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F64 => "F64",
            Dtype::F32 => "F32",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I64 => "I64",
            Dtype::I32 => "I32",
        }
    }

    /// `true` for the four float types.
    pub fn is_float(self) -> bool {
        !matches!(self, Dtype::I64 | Dtype::I32)
    }

    fn size(self) -> usize {
        match self {
            Dtype::F64 | Dtype::I64 => 8,
            Dtype::F32 | Dtype::I32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The float type a writer stores values in (values are rounded to nearest).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum FloatDtype {
    #[default]
    F64,
    F32,
    F16,
    BF16,
}

impl From<FloatDtype> for Dtype {
    fn from(d: FloatDtype) -> Dtype {
        match d {
            FloatDtype::F64 => Dtype::F64,
            FloatDtype::F32 => Dtype::F32,
            FloatDtype::F16 => Dtype::F16,
            FloatDtype::BF16 => Dtype::BF16,
        }
    }
}

impl FloatDtype {
    /// `v` as it reads back after being stored in this type (round to nearest even).
    pub fn round(self, v: f64) -> f64 {
        match self {
            FloatDtype::F64 => v,
            FloatDtype::F32 => v as f32 as f64,
            FloatDtype::F16 => f16::from_f64(v).to_f64(),
            FloatDtype::BF16 => bf16::from_f64(v).to_f64(),
        }
    }

    fn encode(self, v: f64, buf: &mut Vec<u8>) {
        match self {
            FloatDtype::F64 => buf.extend_from_slice(&v.to_le_bytes()),
            FloatDtype::F32 => buf.extend_from_slice(&(v as f32).to_le_bytes()),
            FloatDtype::F16 => buf.extend_from_slice(&f16::from_f64(v).to_le_bytes()),
            FloatDtype::BF16 => buf.extend_from_slice(&bf16::from_f64(v).to_le_bytes()),
        }
    }
}

const ANY_FLOAT: &[Dtype] = &[Dtype::F64, Dtype::F32, Dtype::F16, Dtype::BF16];
const FULL_FLOAT: &[Dtype] = &[Dtype::F64, Dtype::F32];
const INDEX: &[Dtype] = &[Dtype::I64, Dtype::I32];

/// The dtypes an input tensor may be stored in.
fn allowed_input_dtypes(name: &str) -> &'static [Dtype] {
    match name {
        "x" | "z" | "B" | "C" => ANY_FLOAT,
        "seq_idx" => INDEX,
        _ => FULL_FLOAT,
    }
}

/// The dtype `write_case` stores input `name` in when asked for `dtype`: F64 and F32 apply to
/// every float input; F16 and BF16 only to `x`, `z`, `B`, `C` (the rest is stored as F32).
fn stored_input_dtype(name: &str, dtype: FloatDtype) -> FloatDtype {
    match dtype {
        FloatDtype::F64 | FloatDtype::F32 => dtype,
        FloatDtype::F16 | FloatDtype::BF16 => match name {
            "x" | "z" | "B" | "C" => dtype,
            _ => FloatDtype::F32,
        },
    }
}

fn list(dtypes: &[Dtype]) -> String {
    let names: Vec<&str> = dtypes.iter().map(|d| d.name()).collect();
    match names.as_slice() {
        [one] => one.to_string(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
        [] => String::new(),
    }
}

// ---------------------------------------------------------------------------------------------
// layouts

/// The layout of a named tensor of the contract, e.g. `"[batch, seqlen, nheads, headdim]"`
/// (`D`: `"[nheads] or [nheads, headdim]"`); `None` for a name the contract does not know.
pub fn layout(name: &str) -> Option<&'static str> {
    Some(match name {
        "x" | "z" | "out" | "out_mag" => "[batch, seqlen, nheads, headdim]",
        "dt" => "[batch, seqlen, nheads]",
        "A" | "dt_bias" => "[nheads]",
        "B" | "C" => "[batch, seqlen, ngroups, dstate]",
        "D" => "[nheads] or [nheads, headdim]",
        "initial_states" | "final_states" | "final_states_mag" => {
            "[batch, nheads, headdim, dstate]"
        }
        "seq_idx" => "[batch, seqlen]",
        "dA_cumsum" => "[batch, nheads, nchunks, chunk_size]",
        "chunk_states" => "[batch, nchunks, nheads, headdim, dstate]",
        _ => return None,
    })
}

/// The shape the contract requires of tensor `name` for these sizes; `None` for `D` (two shapes
/// are allowed, see [`layout`]) and for names the contract does not know.
pub fn expected_shape(name: &str, dims: &Dims, chunk_size: usize) -> Option<Vec<usize>> {
    let Dims {
        batch: b,
        seqlen: s,
        nheads: h,
        headdim: p,
        ngroups: g,
        dstate: n,
    } = *dims;
    let c = s.div_ceil(chunk_size.max(1));
    Some(match name {
        "x" | "z" | "out" | "out_mag" => vec![b, s, h, p],
        "dt" => vec![b, s, h],
        "A" | "dt_bias" => vec![h],
        "B" | "C" => vec![b, s, g, n],
        "initial_states" | "final_states" | "final_states_mag" => vec![b, h, p, n],
        "seq_idx" => vec![b, s],
        "dA_cumsum" => vec![b, h, c, chunk_size],
        "chunk_states" => vec![b, c, h, p, n],
        _ => return None,
    })
}

/// Checks that tensor `name` has the contract's shape for `dims`; the message names the tensor
/// and its layout.
fn check_shape(
    file: &Path,
    name: &str,
    got: &[usize],
    dims: &Dims,
    chunk_size: usize,
) -> Result<(), VerifyError> {
    let ok = match expected_shape(name, dims, chunk_size) {
        Some(want) => got == want.as_slice(),
        None if name == "D" => got == [dims.nheads] || got == [dims.nheads, dims.headdim],
        None => true,
    };
    if ok {
        return Ok(());
    }
    let want = match expected_shape(name, dims, chunk_size) {
        Some(want) => format!("{want:?}"),
        None => format!("[{}] or [{}, {}]", dims.nheads, dims.nheads, dims.headdim),
    };
    Err(VerifyError::tensors(
        file,
        format!(
            "tensor `{name}` has shape {got:?}, expected {} = {want} from the manifest's dims and chunk_size",
            layout(name).unwrap_or("?")
        ),
    ))
}

// ---------------------------------------------------------------------------------------------
// reading tensor files

/// A tensor read from a file and widened to `f64` (exactly), with the dtype it was stored in.
#[derive(Debug, Clone)]
pub struct LoadedTensor {
    pub data: ArrayD<f64>,
    pub dtype: Dtype,
}

/// A safetensors file held in memory, checked once when opened.
///
/// Use it for any tensor file: a case's tensors, the `run` command's output, or a kernel's
/// output under test.
#[derive(Debug, Clone)]
pub struct TensorFile {
    path: PathBuf,
    bytes: Vec<u8>,
}

impl TensorFile {
    /// Reads and parses the file at `path`.
    ///
    /// # Errors
    /// [`VerifyError::Io`] when the file cannot be read, [`VerifyError::Tensors`] when it is not
    /// a valid safetensors file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, VerifyError> {
        let path = path.as_ref();
        let bytes = fs::read(path).map_err(VerifyError::io("read", path))?;
        SafeTensors::deserialize(&bytes).map_err(|e| {
            VerifyError::tensors(path, format!("not a valid safetensors file ({e})"))
        })?;
        Ok(TensorFile {
            path: path.to_path_buf(),
            bytes,
        })
    }

    /// The path the file was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn parsed(&self) -> SafeTensors<'_> {
        // `open` has parsed the same bytes successfully.
        SafeTensors::deserialize(&self.bytes).expect("checked in TensorFile::open")
    }

    /// The names of the tensors in the file, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .parsed()
            .names()
            .into_iter()
            .map(str::to_string)
            .collect();
        names.sort();
        names
    }

    /// Whether the file holds a tensor called `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.parsed().tensor(name).is_ok()
    }

    /// Reads float tensor `name` (F64, F32, F16 or BF16), widened to `f64`. Values are not
    /// checked: NaN and infinities come through as they are.
    ///
    /// # Errors
    /// [`VerifyError::Tensors`] naming the tensor when it is missing or not of a float dtype.
    pub fn read_float(&self, name: &str) -> Result<LoadedTensor, VerifyError> {
        self.read_float_opt(name)?.ok_or_else(|| self.missing(name))
    }

    /// Like [`TensorFile::read_float`], with `Ok(None)` for a missing tensor.
    ///
    /// # Errors
    /// [`VerifyError::Tensors`] naming the tensor when it is not of a float dtype.
    pub fn read_float_opt(&self, name: &str) -> Result<Option<LoadedTensor>, VerifyError> {
        self.read_as(name, ANY_FLOAT)
    }

    fn missing(&self, name: &str) -> VerifyError {
        VerifyError::tensors(&self.path, format!("tensor `{name}` is missing"))
    }

    fn view(&self, name: &str, allowed: &[Dtype]) -> Result<Option<TensorView<'_>>, VerifyError> {
        let view = match self.parsed().tensor(name) {
            Ok(v) => v,
            Err(_) => return Ok(None),
        };
        match Dtype::from_safetensors(view.dtype()) {
            Some(d) if allowed.contains(&d) => Ok(Some(view)),
            _ => Err(VerifyError::tensors(
                &self.path,
                format!(
                    "tensor `{name}` has dtype {}, expected {}",
                    view.dtype(),
                    list(allowed)
                ),
            )),
        }
    }

    /// Reads tensor `name` if present, accepting only the float dtypes in `allowed`.
    fn read_as(&self, name: &str, allowed: &[Dtype]) -> Result<Option<LoadedTensor>, VerifyError> {
        let Some(view) = self.view(name, allowed)? else {
            return Ok(None);
        };
        let dtype = Dtype::from_safetensors(view.dtype()).expect("checked by view");
        let bytes = view.data();
        let values: Vec<f64> = match dtype {
            Dtype::F64 => decode::<8, _>(bytes, f64::from_le_bytes),
            Dtype::F32 => decode::<4, _>(bytes, |b| f32::from_le_bytes(b) as f64),
            Dtype::F16 => decode::<2, _>(bytes, |b| f16::from_le_bytes(b).to_f64()),
            Dtype::BF16 => decode::<2, _>(bytes, |b| bf16::from_le_bytes(b).to_f64()),
            Dtype::I64 | Dtype::I32 => unreachable!("only float dtypes are allowed here"),
        };
        let data = ArrayD::from_shape_vec(IxDyn(view.shape()), values).map_err(|e| {
            VerifyError::tensors(&self.path, format!("tensor `{name}` is malformed ({e})"))
        })?;
        Ok(Some(LoadedTensor { data, dtype }))
    }

    /// Reads integer tensor `name` (I64 or I32) if present.
    fn read_index(&self, name: &str) -> Result<Option<(ArrayD<i64>, Dtype)>, VerifyError> {
        let Some(view) = self.view(name, INDEX)? else {
            return Ok(None);
        };
        let dtype = Dtype::from_safetensors(view.dtype()).expect("checked by view");
        let bytes = view.data();
        let values: Vec<i64> = match dtype {
            Dtype::I64 => decode::<8, _>(bytes, i64::from_le_bytes),
            _ => decode::<4, _>(bytes, |b| i32::from_le_bytes(b) as i64),
        };
        let data = ArrayD::from_shape_vec(IxDyn(view.shape()), values).map_err(|e| {
            VerifyError::tensors(&self.path, format!("tensor `{name}` is malformed ({e})"))
        })?;
        Ok(Some((data, dtype)))
    }
}

/// Decodes little-endian elements of `N` bytes (safetensors data need not be aligned).
fn decode<const N: usize, T>(bytes: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
    bytes
        .chunks_exact(N)
        .map(|c| f(c.try_into().expect("chunks_exact yields N bytes")))
        .collect()
}

/// Reads float tensor `name` from the safetensors file at `path` (any float dtype), widened to
/// `f64`, with the dtype it was stored in. Values are not checked.
///
/// # Errors
/// [`VerifyError::Io`] for an unreadable file, [`VerifyError::Tensors`] for a file that is not
/// safetensors, a missing tensor, or a tensor that is not of a float dtype.
pub fn read_tensor(path: impl AsRef<Path>, name: &str) -> Result<LoadedTensor, VerifyError> {
    TensorFile::open(path)?.read_float(name)
}

// ---------------------------------------------------------------------------------------------
// writing tensor files

/// Collects tensors, then writes them as one safetensors file, atomically.
///
/// ```no_run
/// # use ssd_verify::fixture::{FloatDtype, TensorWriter};
/// # let out = ndarray::Array4::<f64>::zeros((1, 2, 3, 4));
/// let mut w = TensorWriter::new();
/// w.push("out", &out, FloatDtype::F32);
/// w.write("candidate.safetensors")?;
/// # Ok::<(), ssd_verify::error::VerifyError>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct TensorWriter {
    entries: Vec<(String, Dtype, Vec<usize>, Vec<u8>)>,
}

impl TensorWriter {
    pub fn new() -> Self {
        Self::default()
    }

    fn insert(&mut self, name: &str, dtype: Dtype, shape: Vec<usize>, bytes: Vec<u8>) {
        self.entries.retain(|(n, ..)| n != name);
        self.entries.push((name.to_string(), dtype, shape, bytes));
    }

    /// Adds float tensor `name`, stored as `dtype` (rounded to nearest), in row-major order
    /// whatever `a`'s memory layout. A tensor of the same name is replaced.
    pub fn push<T, S, D>(&mut self, name: &str, a: &ArrayBase<S, D>, dtype: FloatDtype) -> &mut Self
    where
        T: Real,
        S: Data<Elem = T>,
        D: Dimension,
    {
        let mut bytes = Vec::with_capacity(a.len() * Dtype::from(dtype).size());
        // `iter` walks in logical row-major order.
        a.iter().for_each(|v| dtype.encode(v.as_f64(), &mut bytes));
        self.insert(name, dtype.into(), a.shape().to_vec(), bytes);
        self
    }

    /// Adds integer tensor `name` (such as `seq_idx`), stored as I64, or as I32 when `i32` is
    /// set.
    ///
    /// # Errors
    /// [`VerifyError::Usage`] when `i32` is set and a value does not fit in 32 bits.
    pub fn push_index<S, D>(
        &mut self,
        name: &str,
        a: &ArrayBase<S, D>,
        i32: bool,
    ) -> Result<&mut Self, VerifyError>
    where
        S: Data<Elem = i64>,
        D: Dimension,
    {
        let mut bytes = Vec::with_capacity(a.len() * if i32 { 4 } else { 8 });
        for &v in a.iter() {
            if i32 {
                let v = i32::try_from(v).map_err(|_| {
                    VerifyError::Usage(format!(
                        "tensor `{name}`: the value {v} does not fit in I32"
                    ))
                })?;
                bytes.extend_from_slice(&v.to_le_bytes());
            } else {
                bytes.extend_from_slice(&v.to_le_bytes());
            }
        }
        let dtype = if i32 { Dtype::I32 } else { Dtype::I64 };
        self.insert(name, dtype, a.shape().to_vec(), bytes);
        Ok(self)
    }

    /// The safetensors bytes.
    ///
    /// # Errors
    /// [`VerifyError::Usage`] if safetensors refuses the collection (it should not).
    pub fn to_bytes(&self) -> Result<Vec<u8>, VerifyError> {
        let views = self
            .entries
            .iter()
            .map(|(name, dtype, shape, bytes)| {
                TensorView::new(dtype.to_safetensors(), shape.clone(), bytes)
                    .map(|v| (name.as_str(), v))
            })
            .collect::<Result<Vec<_>, _>>()
            .and_then(|views| safetensors::serialize(views, None));
        views.map_err(|e| VerifyError::Usage(format!("cannot encode safetensors: {e}")))
    }

    /// Writes the file atomically: a temporary file in the same folder, then a rename. On error
    /// nothing is left behind (an existing file at `path` is untouched).
    ///
    /// # Errors
    /// [`VerifyError::Io`] when the folder is not writable or does not exist.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<(), VerifyError> {
        write_atomic(path.as_ref(), &self.to_bytes()?)
    }
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A temporary sibling of `path`: same folder, hidden, unique to this process and call.
fn temp_path(path: &Path) -> Result<PathBuf, VerifyError> {
    let name = path
        .file_name()
        .ok_or_else(|| VerifyError::Usage(format!("`{}` is not a file name", path.display())))?;
    let unique = format!(
        ".{}.{}-{}.tmp",
        name.to_string_lossy(),
        std::process::id(),
        TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    );
    Ok(path.with_file_name(unique))
}

/// Writes `bytes` to a temporary sibling of `path`; the caller renames it into place.
fn write_temp(path: &Path, bytes: &[u8]) -> Result<PathBuf, VerifyError> {
    let tmp = temp_path(path)?;
    if let Err(e) = fs::write(&tmp, bytes) {
        let _ = fs::remove_file(&tmp);
        return Err(VerifyError::io("write", path)(e));
    }
    Ok(tmp)
}

fn rename_into_place(tmp: &Path, path: &Path) -> Result<(), VerifyError> {
    fs::rename(tmp, path).map_err(|e| {
        let _ = fs::remove_file(tmp);
        VerifyError::io("write", path)(e)
    })
}

pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), VerifyError> {
    let tmp = write_temp(path, bytes)?;
    rename_into_place(&tmp, path)
}

// ---------------------------------------------------------------------------------------------
// outputs

/// The outputs of one computation, in the contract's names; `dA_cumsum` and `chunk_states`
/// only when the chunked path produced them.
#[allow(non_snake_case)]
#[derive(Debug, Clone)]
pub struct Outputs<T> {
    /// `[batch, seqlen, nheads, headdim]`
    pub out: Array4<T>,
    /// `[batch, nheads, headdim, dstate]`
    pub final_states: Array4<T>,
    /// `[batch, nheads, nchunks, chunk_size]`
    pub dA_cumsum: Option<Array4<T>>,
    /// `[batch, nchunks, nheads, headdim, dstate]`
    pub chunk_states: Option<Array5<T>>,
}

impl<T> From<Output<T>> for Outputs<T> {
    fn from(o: Output<T>) -> Self {
        Outputs {
            out: o.out,
            final_states: o.final_states,
            dA_cumsum: None,
            chunk_states: None,
        }
    }
}

impl<T> From<ChunkedOutput<T>> for Outputs<T> {
    fn from(o: ChunkedOutput<T>) -> Self {
        Outputs {
            out: o.out,
            final_states: o.final_states,
            dA_cumsum: Some(o.dA_cumsum),
            chunk_states: Some(o.chunk_states),
        }
    }
}

impl<T: Real> Outputs<T> {
    /// Widens every tensor to `f64` (exact).
    pub fn to_f64(&self) -> Outputs<f64> {
        Outputs {
            out: self.out.mapv(Real::as_f64),
            final_states: self.final_states.mapv(Real::as_f64),
            dA_cumsum: self.dA_cumsum.as_ref().map(|a| a.mapv(Real::as_f64)),
            chunk_states: self.chunk_states.as_ref().map(|a| a.mapv(Real::as_f64)),
        }
    }

    /// Adds the present outputs to `w`, stored as `dtype`.
    pub fn push_to(&self, w: &mut TensorWriter, dtype: FloatDtype) {
        w.push("out", &self.out, dtype);
        w.push("final_states", &self.final_states, dtype);
        if let Some(a) = &self.dA_cumsum {
            w.push("dA_cumsum", a, dtype);
        }
        if let Some(a) = &self.chunk_states {
            w.push("chunk_states", a, dtype);
        }
    }

    /// Writes the present outputs to a safetensors file, stored as `dtype`, atomically.
    ///
    /// # Errors
    /// [`VerifyError::Io`] when the file cannot be written.
    pub fn write(&self, path: impl AsRef<Path>, dtype: FloatDtype) -> Result<(), VerifyError> {
        let mut w = TensorWriter::new();
        self.push_to(&mut w, dtype);
        w.write(path)
    }
}

/// The expected outputs and magnitudes a case may carry (each optional), widened to `f64`.
#[allow(non_snake_case)]
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Expected {
    pub out: Option<Array4<f64>>,
    pub final_states: Option<Array4<f64>>,
    pub dA_cumsum: Option<Array4<f64>>,
    pub chunk_states: Option<Array5<f64>>,
    /// Per-element magnitude of `out` for the error bound, `>= 0`.
    pub out_mag: Option<Array4<f64>>,
    /// Per-element magnitude of `final_states` for the error bound, `>= 0`.
    pub final_states_mag: Option<Array4<f64>>,
}

impl From<Outputs<f64>> for Expected {
    fn from(o: Outputs<f64>) -> Self {
        Expected {
            out: Some(o.out),
            final_states: Some(o.final_states),
            dA_cumsum: o.dA_cumsum,
            chunk_states: o.chunk_states,
            out_mag: None,
            final_states_mag: None,
        }
    }
}

impl Expected {
    /// Whether no expected tensor is present.
    pub fn is_empty(&self) -> bool {
        *self == Expected::default()
    }
}

// ---------------------------------------------------------------------------------------------
// cases

/// The informational part of a manifest: `name`, `seed`, `description`, and every other key
/// the format does not define, kept verbatim (writers may add keys; readers ignore them).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CaseMeta {
    pub name: Option<String>,
    pub seed: Option<u64>,
    pub description: Option<String>,
    /// Other keys, written as they are after the known ones.
    pub extra: Map<String, Value>,
}

/// A case: the problem (sizes, options, inputs), its expected outputs if any, and its
/// informational keys.
#[derive(Debug, Clone)]
pub struct Case {
    pub meta: CaseMeta,
    pub problem: Problem<f64>,
    pub expected: Expected,
}

/// A case as read from disk, with where its tensors came from and how they were stored.
#[derive(Debug, Clone)]
pub struct LoadedCase {
    pub case: Case,
    /// The manifest read.
    pub manifest_path: PathBuf,
    /// The safetensors file the manifest names.
    pub tensors_path: PathBuf,
    /// The dtype each tensor present in the file was stored in (inputs and expected outputs).
    pub dtypes: BTreeMap<String, Dtype>,
}

/// The keys the format defines (the rest goes to [`CaseMeta::extra`]).
const MANIFEST_KEYS: [&str; 9] = [
    "format",
    "dims",
    "chunk_size",
    "dt_softplus",
    "dt_limit",
    "tensors",
    "name",
    "seed",
    "description",
];

const DIM_NAMES: [&str; 6] = ["batch", "seqlen", "nheads", "headdim", "ngroups", "dstate"];

/// The manifest's content, parsed and checked.
struct Manifest {
    dims: Dims,
    options: Options,
    tensors: Option<String>,
    meta: CaseMeta,
}

fn json_hint(e: serde_json::Error, text: &str) -> String {
    let mut msg = format!("not valid JSON ({e})");
    if text.contains("Infinity") || text.contains("NaN") {
        msg.push_str(
            "; JSON has no Infinity or NaN: write null for an unbounded dt_limit upper end",
        );
    }
    msg
}

fn parse_manifest(text: &str) -> Result<Manifest, String> {
    let value: Value = serde_json::from_str(text).map_err(|e| json_hint(e, text))?;
    let Value::Object(obj) = value else {
        return Err("the manifest must be a JSON object".into());
    };
    match obj.get("format") {
        Some(Value::String(s)) if s == FORMAT => {}
        Some(other) => {
            return Err(format!(
                "unsupported `format` {other}: this reader knows \"{FORMAT}\" only"
            ))
        }
        None => return Err(format!("missing key `format` (it must be \"{FORMAT}\")")),
    }

    let dims_obj = match obj.get("dims") {
        Some(Value::Object(d)) => d,
        Some(other) => return Err(format!("`dims` must be an object, got {other}")),
        None => return Err("missing key `dims`".into()),
    };
    let mut sizes = [0usize; 6];
    for (slot, key) in sizes.iter_mut().zip(DIM_NAMES) {
        let v = dims_obj
            .get(key)
            .ok_or_else(|| format!("missing key `dims.{key}`"))?;
        *slot = as_size(v)
            .ok_or_else(|| format!("`dims.{key}` must be a non-negative integer, got {v}"))?;
    }
    let [batch, seqlen, nheads, headdim, ngroups, dstate] = sizes;
    let dims = Dims::new(batch, seqlen, nheads, headdim, ngroups, dstate);

    let chunk_size = match obj.get("chunk_size") {
        Some(v) => {
            as_size(v).ok_or_else(|| format!("`chunk_size` must be a positive integer, got {v}"))?
        }
        None => return Err("missing key `chunk_size`".into()),
    };
    let dt_softplus = match obj.get("dt_softplus") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => return Err(format!("`dt_softplus` must be true or false, got {other}")),
    };
    let dt_limit = match obj.get("dt_limit") {
        None | Some(Value::Null) => (0.0, f64::INFINITY),
        Some(v) => parse_dt_limit(v)?,
    };
    let tensors = match obj.get("tensors") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(other) => {
            return Err(format!(
                "`tensors` must be the safetensors file's path, got {other}"
            ))
        }
    };

    let meta = CaseMeta {
        name: obj.get("name").and_then(Value::as_str).map(str::to_string),
        seed: obj.get("seed").and_then(Value::as_u64),
        description: obj
            .get("description")
            .and_then(Value::as_str)
            .map(str::to_string),
        extra: obj
            .iter()
            .filter(|(k, _)| !MANIFEST_KEYS.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
    };
    Ok(Manifest {
        dims,
        options: Options {
            chunk_size,
            dt_softplus,
            dt_limit,
        },
        tensors,
        meta,
    })
}

fn as_size(v: &Value) -> Option<usize> {
    v.as_u64().and_then(|u| usize::try_from(u).ok())
}

fn parse_dt_limit(v: &Value) -> Result<(f64, f64), String> {
    let bad =
        || format!("`dt_limit` must be [lo, hi] with numbers lo <= hi (null hi = +inf), got {v}");
    let Value::Array(items) = v else {
        return Err(bad());
    };
    let [lo, hi] = items.as_slice() else {
        return Err(bad());
    };
    let lo = lo.as_f64().ok_or_else(bad)?;
    let hi = match hi {
        Value::Null => f64::INFINITY,
        other => other.as_f64().ok_or_else(bad)?,
    };
    if !(lo.is_finite() && lo <= hi) {
        return Err(bad());
    }
    Ok((lo, hi))
}

/// Reads the case whose manifest is at `manifest_path`: the manifest, then its tensors
/// (inputs, and expected outputs and magnitudes when present), checked against the contract.
///
/// Tensors the contract does not name are ignored.
///
/// # Errors
/// One line naming the file and the key or tensor at fault:
/// - [`VerifyError::Io`]: the manifest or the safetensors file cannot be read;
/// - [`VerifyError::Manifest`]: not JSON, `format` not `"ssd-fixture/1"`, a key missing or of
///   the wrong type, a bad `dt_limit`;
/// - [`VerifyError::Tensors`]: not a safetensors file, a required tensor missing, a tensor of a
///   dtype the contract does not allow for it, a shape that disagrees with `dims`, an expected
///   output that is not finite or a magnitude that is negative;
/// - [`VerifyError::Problem`]: what the reference refuses (non-finite input, `A > 0`,
///   `seq_idx` decreasing or negative, `chunk_size` not a power of two, a zero size, ...).
pub fn read_case(manifest_path: impl AsRef<Path>) -> Result<LoadedCase, VerifyError> {
    let path = manifest_path.as_ref();
    let text = fs::read_to_string(path).map_err(VerifyError::io("read", path))?;
    let manifest = parse_manifest(&text).map_err(|m| VerifyError::manifest(path, m))?;
    let tensors_path = match &manifest.tensors {
        Some(t) => path.parent().unwrap_or(Path::new("")).join(t),
        None => path.with_extension("safetensors"),
    };
    if tensors_path == path {
        return Err(VerifyError::manifest(
            path,
            "`tensors` names the manifest itself",
        ));
    }
    let file = TensorFile::open(&tensors_path)?;
    let dims = manifest.dims;
    let chunk_size = manifest.options.chunk_size;
    let mut dtypes = BTreeMap::new();

    let mut float = |name: &str, required: bool| -> Result<Option<ArrayD<f64>>, VerifyError> {
        let allowed = if INPUT_NAMES.contains(&name) {
            allowed_input_dtypes(name)
        } else {
            ANY_FLOAT
        };
        match file.read_as(name, allowed)? {
            Some(t) => {
                check_shape(&tensors_path, name, t.data.shape(), &dims, chunk_size)?;
                dtypes.insert(name.to_string(), t.dtype);
                Ok(Some(t.data))
            }
            None if required => Err(file.missing(name)),
            None => Ok(None),
        }
    };
    let x = float("x", true)?.expect("required");
    let dt = float("dt", true)?.expect("required");
    let a = float("A", true)?.expect("required");
    let b = float("B", true)?.expect("required");
    let c = float("C", true)?.expect("required");
    let d = float("D", false)?;
    let z = float("z", false)?;
    let dt_bias = float("dt_bias", false)?;
    let initial_states = float("initial_states", false)?;
    let out = float("out", false)?;
    let final_states = float("final_states", false)?;
    let da_cumsum = float("dA_cumsum", false)?;
    let chunk_states = float("chunk_states", false)?;
    let out_mag = float("out_mag", false)?;
    let final_states_mag = float("final_states_mag", false)?;
    let seq_idx = match file.read_index("seq_idx")? {
        Some((s, dtype)) => {
            check_shape(&tensors_path, "seq_idx", s.shape(), &dims, chunk_size)?;
            dtypes.insert("seq_idx".to_string(), dtype);
            Some(s)
        }
        None => None,
    };

    for (name, t) in [
        ("out", &out),
        ("final_states", &final_states),
        ("dA_cumsum", &da_cumsum),
        ("chunk_states", &chunk_states),
    ] {
        if let Some(t) = t {
            check_values(
                &tensors_path,
                name,
                t,
                |v| v.is_finite(),
                "a non-finite value",
            )?;
        }
    }
    for (name, t) in [
        ("out_mag", &out_mag),
        ("final_states_mag", &final_states_mag),
    ] {
        if let Some(t) = t {
            check_values(
                &tensors_path,
                name,
                t,
                |v| v.is_finite() && v >= 0.0,
                "a negative or non-finite magnitude",
            )?;
        }
    }

    // Shapes (hence ranks) are checked above, so the conversions below cannot fail.
    let inputs = Inputs {
        x: fixed(x),
        dt: fixed(dt),
        A: fixed(a),
        B: fixed(b),
        C: fixed(c),
        D: d,
        z: z.map(fixed),
        dt_bias: dt_bias.map(fixed),
        initial_states: initial_states.map(fixed),
        seq_idx: seq_idx.map(fixed),
    };
    let problem =
        Problem::new(dims, manifest.options, inputs).map_err(|source| VerifyError::Problem {
            path: path.to_path_buf(),
            source,
        })?;
    let expected = Expected {
        out: out.map(fixed),
        final_states: final_states.map(fixed),
        dA_cumsum: da_cumsum.map(fixed),
        chunk_states: chunk_states.map(fixed),
        out_mag: out_mag.map(fixed),
        final_states_mag: final_states_mag.map(fixed),
    };
    Ok(LoadedCase {
        case: Case {
            meta: manifest.meta,
            problem,
            expected,
        },
        manifest_path: path.to_path_buf(),
        tensors_path,
        dtypes,
    })
}

fn fixed<T, D: Dimension>(a: ArrayD<T>) -> Array<T, D> {
    a.into_dimensionality::<D>()
        .expect("the shape was checked against the contract")
}

fn check_values(
    file: &Path,
    name: &str,
    a: &ArrayD<f64>,
    ok: impl Fn(f64) -> bool,
    what: &str,
) -> Result<(), VerifyError> {
    match a.iter().position(|&v| !ok(v)) {
        None => Ok(()),
        Some(flat) => {
            let idx = ssd_reference::problem::unravel(flat, a.shape());
            let v = a.iter().nth(flat).copied().unwrap_or(f64::NAN);
            Err(VerifyError::tensors(
                file,
                format!("tensor `{name}` has {what} ({v}) at index {idx:?}"),
            ))
        }
    }
}

/// The problem exactly as it reads back after [`write_case`] stores its inputs as `dtype`
/// (values rounded to nearest; see [`write_case`] for which tensors each dtype applies to).
///
/// Compute a case's expected outputs from this problem when writing its inputs in less than
/// F64, so that they match what a reader sees.
///
/// # Errors
/// [`VerifyError::Usage`] when rounding makes a value non-finite (an F16 overflow).
pub fn round_inputs(
    problem: &Problem<f64>,
    dtype: FloatDtype,
) -> Result<Problem<f64>, VerifyError> {
    let r = |name: &str| {
        let d = stored_input_dtype(name, dtype);
        move |v: f64| d.round(v)
    };
    let i = problem.inputs();
    let inputs = Inputs {
        x: i.x.mapv(r("x")),
        dt: i.dt.mapv(r("dt")),
        A: i.A.mapv(r("A")),
        B: i.B.mapv(r("B")),
        C: i.C.mapv(r("C")),
        D: i.D.as_ref().map(|a| a.mapv(r("D"))),
        z: i.z.as_ref().map(|a| a.mapv(r("z"))),
        dt_bias: i.dt_bias.as_ref().map(|a| a.mapv(r("dt_bias"))),
        initial_states: i
            .initial_states
            .as_ref()
            .map(|a| a.mapv(r("initial_states"))),
        seq_idx: i.seq_idx.clone(),
    };
    Problem::new(*problem.dims(), *problem.options(), inputs).map_err(|e| {
        VerifyError::Usage(format!(
            "the inputs cannot be stored as {}: {e}",
            Dtype::from(dtype)
        ))
    })
}

fn manifest_json(case: &Case, tensors_file: &str) -> Value {
    let dims = case.problem.dims();
    let options = case.problem.options();
    let (lo, hi) = options.dt_limit;
    let mut m = Map::new();
    m.insert("format".into(), FORMAT.into());
    if let Some(name) = &case.meta.name {
        m.insert("name".into(), name.clone().into());
    }
    if let Some(description) = &case.meta.description {
        m.insert("description".into(), description.clone().into());
    }
    if let Some(seed) = case.meta.seed {
        m.insert("seed".into(), seed.into());
    }
    let mut d = Map::new();
    for (key, v) in DIM_NAMES.iter().zip([
        dims.batch,
        dims.seqlen,
        dims.nheads,
        dims.headdim,
        dims.ngroups,
        dims.dstate,
    ]) {
        d.insert((*key).into(), v.into());
    }
    m.insert("dims".into(), Value::Object(d));
    m.insert("chunk_size".into(), options.chunk_size.into());
    m.insert("dt_softplus".into(), options.dt_softplus.into());
    let hi = if hi.is_finite() {
        Value::from(hi)
    } else {
        Value::Null
    };
    m.insert("dt_limit".into(), Value::Array(vec![lo.into(), hi]));
    m.insert("tensors".into(), tensors_file.into());
    for (k, v) in &case.meta.extra {
        if !MANIFEST_KEYS.contains(&k.as_str()) {
            m.insert(k.clone(), v.clone());
        }
    }
    Value::Object(m)
}

/// Writes `case` as a manifest at `manifest_path` plus `STEM.safetensors` next to it (the
/// manifest's `tensors` key names it), both atomically: nothing is left behind on error.
///
/// Inputs are stored as `input_dtype`: F64 (exact) or F32 for every float input; F16 or BF16
/// for `x`, `z`, `B`, `C` with the other float inputs as F32 (a reduced-precision case).
/// Values are rounded to nearest: compute the expected outputs from
/// [`round_inputs`]`(problem, input_dtype)` so that they match what readers see.
/// `seq_idx` is stored as I64, expected outputs and magnitudes as F64.
///
/// # Errors
/// [`VerifyError::Usage`] when the manifest path has no file stem or would be its own tensor
/// file, [`VerifyError::Io`] when a file cannot be written.
pub fn write_case(
    manifest_path: impl AsRef<Path>,
    case: &Case,
    input_dtype: FloatDtype,
) -> Result<(), VerifyError> {
    let path = manifest_path.as_ref();
    let tensors_path = path.with_extension("safetensors");
    if tensors_path == path {
        return Err(VerifyError::Usage(format!(
            "the manifest path `{}` must not end in .safetensors",
            path.display()
        )));
    }
    let tensors_file = tensors_path
        .file_name()
        .ok_or_else(|| VerifyError::Usage(format!("`{}` is not a file name", path.display())))?
        .to_string_lossy()
        .into_owned();

    let mut w = TensorWriter::new();
    let i = case.problem.inputs();
    let s = |name: &str| stored_input_dtype(name, input_dtype);
    w.push("x", &i.x, s("x"))
        .push("dt", &i.dt, s("dt"))
        .push("A", &i.A, s("A"))
        .push("B", &i.B, s("B"))
        .push("C", &i.C, s("C"));
    if let Some(a) = &i.D {
        w.push("D", a, s("D"));
    }
    if let Some(a) = &i.z {
        w.push("z", a, s("z"));
    }
    if let Some(a) = &i.dt_bias {
        w.push("dt_bias", a, s("dt_bias"));
    }
    if let Some(a) = &i.initial_states {
        w.push("initial_states", a, s("initial_states"));
    }
    if let Some(a) = &i.seq_idx {
        w.push_index("seq_idx", a, false)?;
    }
    let e = &case.expected;
    let f = FloatDtype::F64;
    for (name, a) in [
        ("out", &e.out),
        ("final_states", &e.final_states),
        ("dA_cumsum", &e.dA_cumsum),
        ("out_mag", &e.out_mag),
        ("final_states_mag", &e.final_states_mag),
    ] {
        if let Some(a) = a {
            w.push(name, a, f);
        }
    }
    if let Some(a) = &e.chunk_states {
        w.push("chunk_states", a, f);
    }

    let mut manifest = serde_json::to_string_pretty(&manifest_json(case, &tensors_file))
        .map_err(|e| VerifyError::Usage(format!("cannot encode the manifest: {e}")))?;
    manifest.push('\n');

    let tensors_tmp = write_temp(&tensors_path, &w.to_bytes()?)?;
    let manifest_tmp = match write_temp(path, manifest.as_bytes()) {
        Ok(t) => t,
        Err(e) => {
            let _ = fs::remove_file(&tensors_tmp);
            return Err(e);
        }
    };
    if let Err(e) = rename_into_place(&tensors_tmp, &tensors_path) {
        let _ = fs::remove_file(&manifest_tmp);
        return Err(e);
    }
    if let Err(e) = rename_into_place(&manifest_tmp, path) {
        // The pair is incomplete: take the tensors back out rather than leave half a case.
        let _ = fs::remove_file(&tensors_path);
        return Err(e);
    }
    Ok(())
}

// Keep the contract's names and the reader in one place: every tensor the reader accepts is
// one of these.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_contract_name_has_a_layout() {
        for name in INPUT_NAMES
            .iter()
            .chain(OUTPUT_NAMES.iter())
            .chain(MAGNITUDE_NAMES.iter())
        {
            assert!(layout(name).is_some(), "{name}");
        }
        assert!(layout("y").is_none());
    }

    #[test]
    fn dtype_lists_read_naturally() {
        assert_eq!(list(FULL_FLOAT), "F64 or F32");
        assert_eq!(list(ANY_FLOAT), "F64, F32, F16 or BF16");
    }

    #[test]
    fn dt_limit_parsing() {
        let p = |s: &str| parse_dt_limit(&serde_json::from_str(s).unwrap());
        assert_eq!(p("[0.0, null]").unwrap(), (0.0, f64::INFINITY));
        assert_eq!(p("[0.001, 0.1]").unwrap(), (0.001, 0.1));
        assert!(p("[0.2, 0.1]").is_err());
        assert!(p("[null, 0.1]").is_err());
        assert!(p("[0.1]").is_err());
        assert!(p("\"0,1\"").is_err());
    }
}
