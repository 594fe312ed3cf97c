//! `ssd_oracle._native`: the Rust half of the `ssd_oracle` Python package.
//!
//! Thin over the workspace's crates: every function turns float64 numpy arrays into a
//! [`Problem`], calls `ssd-reference` or `ssd-verify`, and hands the result back as numpy
//! arrays or as the checker's JSON report. The Python half (`ssd_oracle/__init__.py`) accepts
//! torch tensors and other dtypes, and gives the functions mamba_ssm's signatures.
//!
//! Every computation runs with the GIL released. Errors: a problem the reference refuses, a
//! tensor of the wrong rank or shape, an unknown name, raise `ValueError` naming the tensor;
//! a file that cannot be read or written raises `OSError`.

use std::collections::BTreeMap;

use ndarray::{Array, ArrayD, Dimension, Ix4};
use numpy::{IntoPyArray, PyArrayDyn, PyReadonlyArrayDyn};
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use ssd_reference::chunk_cumsum::chunk_cumsum;
use ssd_reference::compute_out::compute_out;
use ssd_reference::fwd_pass_state::{chunk_state, state_passing};
use ssd_reference::serving::{self, Packing};
use ssd_reference::{naive, Dims, Inputs, MatmulPrecision, Options, Problem, Real};
use ssd_verify::fixture::{self, Case, CaseMeta, Dtype, Expected, FloatDtype};
use ssd_verify::report::{check_candidate, check_candidate_shape, Labels};
use ssd_verify::suites::expected_outputs;
use ssd_verify::tolerance::{Oracle, OutputName, Precision};
use ssd_verify::VerifyError;

type F64In<'py> = PyReadonlyArrayDyn<'py, f64>;
type I64In<'py> = PyReadonlyArrayDyn<'py, i64>;

fn value_error(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

fn verify_error(e: VerifyError) -> PyErr {
    match e {
        VerifyError::Io { .. } => PyOSError::new_err(e.to_string()),
        other => value_error(other),
    }
}

/// `a` as an owned array of rank `D`, or a `ValueError` naming the tensor and its layout.
fn owned<T: Copy, D: Dimension>(name: &str, a: ArrayD<T>) -> PyResult<Array<T, D>> {
    let ndim = a.ndim();
    a.into_dimensionality::<D>().map_err(|_| {
        value_error(format!(
            "`{name}` has {ndim} dimension(s), expected {}",
            fixture::layout(name).unwrap_or("?")
        ))
    })
}

/// The inputs of one call, as numpy hands them over (float64, any layout).
struct RawInputs<'py> {
    x: F64In<'py>,
    dt: F64In<'py>,
    a: F64In<'py>,
    b: F64In<'py>,
    c: F64In<'py>,
    d: Option<F64In<'py>>,
    z: Option<F64In<'py>>,
    dt_bias: Option<F64In<'py>>,
    initial_states: Option<F64In<'py>>,
    seq_idx: Option<I64In<'py>>,
}

/// Builds the validated problem: sizes from `x` (batch, seqlen, nheads, headdim) and `B`
/// (ngroups, dstate), everything else checked against them by [`Problem::new`].
fn problem(raw: RawInputs<'_>, options: Options) -> PyResult<Problem<f64>> {
    let get = |a: &F64In<'_>| a.as_array().to_owned();
    let x: ndarray::Array4<f64> = owned("x", get(&raw.x))?;
    let b: ndarray::Array4<f64> = owned("B", get(&raw.b))?;
    let (bs, s, h, p) = x.dim();
    let (_, _, g, n) = b.dim();
    let d = raw.d.as_ref().map(get);
    if let Some(d) = &d {
        if !(1..=2).contains(&d.ndim()) {
            return Err(value_error(format!(
                "`D` has {} dimension(s), expected [nheads] or [nheads, headdim]",
                d.ndim()
            )));
        }
    }
    let inputs = Inputs {
        x,
        dt: owned("dt", get(&raw.dt))?,
        A: owned("A", get(&raw.a))?,
        B: b,
        C: owned("C", get(&raw.c))?,
        D: d,
        z: raw.z.as_ref().map(get).map(|a| owned("z", a)).transpose()?,
        dt_bias: raw
            .dt_bias
            .as_ref()
            .map(get)
            .map(|a| owned("dt_bias", a))
            .transpose()?,
        initial_states: raw
            .initial_states
            .as_ref()
            .map(get)
            .map(|a| owned("initial_states", a))
            .transpose()?,
        seq_idx: raw
            .seq_idx
            .as_ref()
            .map(|a| owned("seq_idx", a.as_array().to_owned()))
            .transpose()?,
    };
    Problem::new(Dims::new(bs, s, h, p, g, n), options, inputs).map_err(value_error)
}

/// The packing of `cu_seqlens` (mamba_ssm's varlen convention: no per-sequence states).
fn packing(cu: &I64In<'_>) -> PyResult<Packing<f64>> {
    let cu: Vec<usize> = cu
        .as_array()
        .iter()
        .map(|&v| {
            usize::try_from(v)
                .map_err(|_| value_error(format!("`cu_seqlens` holds a negative value {v}")))
        })
        .collect::<PyResult<_>>()?;
    Ok(Packing::new(cu))
}

fn options(chunk_size: usize, dt_softplus: bool, dt_limit: (f64, f64)) -> Options {
    Options {
        chunk_size,
        dt_softplus,
        dt_limit,
    }
}

fn precision(name: &str) -> PyResult<Precision> {
    Precision::ALL
        .iter()
        .copied()
        .find(|p| p.name() == name.to_ascii_lowercase())
        .ok_or_else(|| {
            value_error(format!(
                "unknown precision `{name}`: expected f64, f32, tf32 or bf16"
            ))
        })
}

fn storage_dtype(name: &str, tensor: &str) -> PyResult<Dtype> {
    Ok(match name.to_ascii_uppercase().as_str() {
        "F64" => Dtype::F64,
        "F32" => Dtype::F32,
        "F16" => Dtype::F16,
        "BF16" => Dtype::BF16,
        other => {
            return Err(value_error(format!(
                "`{tensor}`: storage dtype `{other}` is not F64, F32, F16 or BF16"
            )))
        }
    })
}

fn to_numpy<'py, T: Real, D: Dimension>(
    py: Python<'py>,
    a: &Array<T, D>,
) -> Bound<'py, PyArrayDyn<f64>> {
    a.mapv(Real::as_f64).into_dyn().into_pyarray(py)
}

/// The stage-by-stage results of the chunked path in `T`, widened to f64.
struct Stages {
    dt: ArrayD<f64>,
    da_cumsum: ArrayD<f64>,
    states: ArrayD<f64>,
    chunk_states: ArrayD<f64>,
    final_states: ArrayD<f64>,
    out: ArrayD<f64>,
}

fn stages<T: Real>(p: &Problem<T>, precision: MatmulPrecision) -> Stages {
    let w = |a: ArrayD<T>| a.mapv(Real::as_f64);
    let cumsum = chunk_cumsum(p);
    let local = chunk_state(p, &cumsum, precision);
    let mut chunk_states = local.clone();
    let final_states = state_passing(p, &cumsum, &mut chunk_states);
    let out = compute_out(p, &cumsum, &chunk_states, precision);
    Stages {
        dt: w(cumsum.dt.clone().into_dyn()),
        da_cumsum: w(cumsum.dA_cumsum.into_dyn()),
        states: w(local.into_dyn()),
        chunk_states: w(chunk_states.into_dyn()),
        final_states: w(final_states.into_dyn()),
        out: w(out.into_dyn()),
    }
}

/// The forward pass: `out` and `final_states` of the naive recurrence (`algorithm="naive"`,
/// float64 only: the ground truth), or every stage of the chunked path (`"chunked"`: also
/// `dt` (processed), `dA_cumsum`, `states` (each chunk's own, before the state pass) and
/// `chunk_states` (the state entering each chunk)) in f64, f32 or f32 with TF32 operands.
#[pyfunction]
#[pyo3(signature = (x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
    initial_states=None, seq_idx=None, dt_softplus=false, dt_limit=(0.0, f64::INFINITY),
    algorithm="naive", precision="f64", cu_seqlens=None))]
#[allow(non_snake_case, clippy::too_many_arguments)]
fn forward<'py>(
    py: Python<'py>,
    x: F64In<'py>,
    dt: F64In<'py>,
    A: F64In<'py>,
    B: F64In<'py>,
    C: F64In<'py>,
    chunk_size: usize,
    D: Option<F64In<'py>>,
    z: Option<F64In<'py>>,
    dt_bias: Option<F64In<'py>>,
    initial_states: Option<F64In<'py>>,
    seq_idx: Option<I64In<'py>>,
    dt_softplus: bool,
    dt_limit: (f64, f64),
    algorithm: &str,
    precision: &str,
    cu_seqlens: Option<I64In<'py>>,
) -> PyResult<Bound<'py, PyDict>> {
    let raw = RawInputs {
        x,
        dt,
        a: A,
        b: B,
        c: C,
        d: D,
        z,
        dt_bias,
        initial_states,
        seq_idx,
    };
    let p = problem(raw, options(chunk_size, dt_softplus, dt_limit))?;
    let dict = PyDict::new(py);
    if let Some(cu) = cu_seqlens {
        // Packed sequences: mamba_ssm's varlen convention (`initial_states` for the first).
        if (algorithm, precision) != ("naive", "f64") {
            return Err(value_error(
                "packed sequences (cu_seqlens) are computed by the naive recurrence in f64 only",
            ));
        }
        let k = packing(&cu)?;
        let o = py
            .detach(|| serving::forward(&p, &k, serving::Algorithm::Naive))
            .map_err(|e| value_error(e.to_string()))?;
        dict.set_item("out", to_numpy(py, &o.out))?;
        dict.set_item("final_states", to_numpy(py, &o.final_states))?;
        dict.set_item("varlen_states", to_numpy(py, &o.varlen_states))?;
        return Ok(dict);
    }
    match (algorithm, precision) {
        ("naive", "f64") => {
            let o = py.detach(|| naive::forward(&p));
            dict.set_item("out", to_numpy(py, &o.out))?;
            dict.set_item("final_states", to_numpy(py, &o.final_states))?;
        }
        ("naive", other) => {
            return Err(value_error(format!(
                "the naive recurrence is the float64 truth: precision `{other}` is for algorithm=\"chunked\""
            )))
        }
        ("chunked", prec) => {
            let s = py.detach(|| -> PyResult<Stages> {
                Ok(match prec {
                    "f64" => stages(&p, MatmulPrecision::Native),
                    "f32" => stages(&p.cast::<f32>(), MatmulPrecision::Native),
                    "tf32" => stages(&p.cast::<f32>(), MatmulPrecision::Tf32),
                    // A bf16 kernel reads x, B, C, z as bfloat16 values.
                    "bf16" => stages(
                        &ssd_verify::fixture::round_inputs(&p, ssd_verify::fixture::FloatDtype::BF16)
                            .map_err(|e| value_error(e.to_string()))?
                            .cast::<f32>(),
                        MatmulPrecision::Bf16,
                    ),
                    other => {
                        return Err(value_error(format!(
                            "unknown precision `{other}` for the chunked path: expected f64, f32, tf32 or bf16"
                        )))
                    }
                })
            })?;
            for (name, a) in [
                ("out", s.out),
                ("final_states", s.final_states),
                ("dt", s.dt),
                ("dA_cumsum", s.da_cumsum),
                ("states", s.states),
                ("chunk_states", s.chunk_states),
            ] {
                dict.set_item(name, a.into_pyarray(py))?;
            }
        }
        (other, _) => {
            return Err(value_error(format!(
                "unknown algorithm `{other}`: expected \"naive\" or \"chunked\""
            )))
        }
    }
    Ok(dict)
}

/// The gradients of the forward at these inputs, pulled back from `dout` (and
/// `dfinal_states`) by the adjoint recurrence in float64: a dict of every gradient the inputs
/// have (`dx`, `ddt`, `dA`, `dB`, `dC`, `dD`, `dz`, `ddt_bias`, `dinitial_states`).
#[pyfunction]
#[pyo3(signature = (dout, x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
    initial_states=None, seq_idx=None, dt_softplus=false, dt_limit=(0.0, f64::INFINITY),
    dfinal_states=None))]
#[allow(non_snake_case, clippy::too_many_arguments)]
fn backward<'py>(
    py: Python<'py>,
    dout: F64In<'py>,
    x: F64In<'py>,
    dt: F64In<'py>,
    A: F64In<'py>,
    B: F64In<'py>,
    C: F64In<'py>,
    chunk_size: usize,
    D: Option<F64In<'py>>,
    z: Option<F64In<'py>>,
    dt_bias: Option<F64In<'py>>,
    initial_states: Option<F64In<'py>>,
    seq_idx: Option<I64In<'py>>,
    dt_softplus: bool,
    dt_limit: (f64, f64),
    dfinal_states: Option<F64In<'py>>,
) -> PyResult<Bound<'py, PyDict>> {
    let raw = RawInputs {
        x,
        dt,
        a: A,
        b: B,
        c: C,
        d: D,
        z,
        dt_bias,
        initial_states,
        seq_idx,
    };
    let p = problem(raw, options(chunk_size, dt_softplus, dt_limit))?;
    let dout: ndarray::Array4<f64> = owned("dout", dout.as_array().to_owned())?;
    let dfinal: Option<ndarray::Array4<f64>> = dfinal_states
        .map(|a| owned("dfinal_states", a.as_array().to_owned()))
        .transpose()?;
    let g = py
        .detach(|| {
            ssd_reference::adjoint::backward(&p, dout.view(), dfinal.as_ref().map(|a| a.view()))
        })
        .map_err(value_error)?;
    let dict = PyDict::new(py);
    for (name, a) in g.named() {
        dict.set_item(name, a.to_owned().into_pyarray(py))?;
    }
    Ok(dict)
}

/// Checks a kernel's outputs and/or gradients against the float64 reference of the inputs,
/// within the error bound of `precision`. `candidates` maps each output name (`out`,
/// `final_states`, `dA_cumsum`, `chunk_states`) or gradient name (`dx`, `ddt`, `dA`, `dB`,
/// `dC`, `dD`, `dz`, `ddt_bias`, `dinitial_states`) to `(values as float64, storage dtype
/// name)`; gradients need the upstream `dout` (and optionally `dfinal_states`). Returns the
/// report as `(json, text)`: the fields of `ssd-oracle check --json` and its table.
#[pyfunction]
#[pyo3(signature = (candidates, x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
    initial_states=None, seq_idx=None, dt_softplus=false, dt_limit=(0.0, f64::INFINITY),
    precision="f32", case_label="(in memory)", candidate_label="(in memory)", dout=None,
    dfinal_states=None, cu_seqlens=None))]
#[allow(non_snake_case, clippy::too_many_arguments)]
fn check<'py>(
    py: Python<'py>,
    candidates: Vec<(String, F64In<'py>, String)>,
    x: F64In<'py>,
    dt: F64In<'py>,
    A: F64In<'py>,
    B: F64In<'py>,
    C: F64In<'py>,
    chunk_size: usize,
    D: Option<F64In<'py>>,
    z: Option<F64In<'py>>,
    dt_bias: Option<F64In<'py>>,
    initial_states: Option<F64In<'py>>,
    seq_idx: Option<I64In<'py>>,
    dt_softplus: bool,
    dt_limit: (f64, f64),
    precision: &str,
    case_label: &str,
    candidate_label: &str,
    dout: Option<F64In<'py>>,
    dfinal_states: Option<F64In<'py>>,
    cu_seqlens: Option<I64In<'py>>,
) -> PyResult<(String, String)> {
    let precision = self::precision(precision)?;
    let raw = RawInputs {
        x,
        dt,
        a: A,
        b: B,
        c: C,
        d: D,
        z,
        dt_bias,
        initial_states,
        seq_idx,
    };
    let p = problem(raw, options(chunk_size, dt_softplus, dt_limit))?;
    let mut present: Vec<(OutputName, ArrayD<f64>, Dtype)> = Vec::new();
    for (name, values, dtype) in &candidates {
        let output = OutputName::from_name(name).ok_or_else(|| {
            value_error(format!(
                "`{name}` is not an output of the contract (out, final_states, dA_cumsum, chunk_states) nor a gradient (dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial_states)"
            ))
        })?;
        if present.iter().any(|(o, _, _)| *o == output) {
            return Err(value_error(format!("`{name}` is given twice")));
        }
        let values = values.as_array().to_owned();
        if !output.is_gradient() && !output.is_packed() {
            check_candidate_shape(output, values.shape(), p.dims(), chunk_size)
                .map_err(value_error)?;
        }
        present.push((output, values, storage_dtype(dtype, name)?));
    }
    if present.is_empty() {
        return Err(value_error("nothing to check: no output tensor was given"));
    }
    let forward = present.iter().any(|(n, _, _)| !n.is_gradient());
    let gradients = present.iter().any(|(n, _, _)| n.is_gradient());
    if forward && !present.iter().any(|(n, _, _)| *n == OutputName::Out) {
        return Err(value_error("the outputs must hold `out`"));
    }
    let upstream = match (gradients, &dout) {
        (true, None) => {
            return Err(value_error(
                "gradients need the upstream gradient `dout` they were pulled back from",
            ))
        }
        (true, Some(d)) => {
            let d = d.as_array().into_dimensionality::<Ix4>().map_err(|_| {
                value_error("`dout` must have 4 dimensions [batch, seqlen, nheads, headdim]")
            })?;
            let f = match &dfinal_states {
                Some(f) => Some(f.as_array().into_dimensionality::<Ix4>().map_err(|_| {
                    value_error(
                        "`dfinal_states` must have 4 dimensions [batch, nheads, headdim, dstate]",
                    )
                })?),
                None => None,
            };
            Some((d, f))
        }
        (false, _) => None,
    };
    let labels = Labels {
        case: case_label.to_string(),
        candidate: candidate_label.to_string(),
    };
    let k = cu_seqlens.as_ref().map(packing).transpose()?;
    if k.is_none() {
        if let Some((n, _, _)) = present.iter().find(|(n, _, _)| n.is_packed()) {
            return Err(value_error(format!(
                "`{n}` needs cu_seqlens (packed sequences)"
            )));
        }
    }
    if k.is_some() && gradients {
        return Err(value_error(
            "gradients of packed sequences (cu_seqlens) are not supported yet",
        ));
    }
    let oracle = py.detach(|| -> Result<Oracle, VerifyError> {
        let o = match &k {
            Some(k) => Some(Oracle::for_packed(&p, k)?),
            None => forward.then(|| Oracle::new(&p)),
        };
        match (&upstream, o) {
            (Some((d, f)), Some(o)) => o.add_gradients(&p, d.view(), f.as_ref().map(|f| f.view())),
            (Some((d, f)), None) => {
                Oracle::for_gradients(&p, d.view(), f.as_ref().map(|f| f.view()))
            }
            (None, Some(o)) => Ok(o),
            (None, None) => unreachable!("something is present"),
        }
    });
    let oracle = oracle.map_err(verify_error)?;
    for (name, values, _) in present
        .iter()
        .filter(|(n, _, _)| n.is_gradient() || n.is_packed())
    {
        if let Some(why) = oracle.refusal(*name, values.shape()) {
            return Err(value_error(why));
        }
    }
    let report = py.detach(|| {
        let tensors: Vec<_> = present.iter().map(|(n, a, d)| (*n, a, *d)).collect();
        check_candidate(labels, &p, &oracle, &tensors, Vec::new(), precision)
    });
    let report = report.map_err(verify_error)?;
    Ok((report.to_json().map_err(verify_error)?, report.text()))
}

/// Reads an `ssd-fixture/1` case: a dict with `inputs` (float64 arrays; `seq_idx` int64),
/// `chunk_size`, `dt_softplus`, `dt_limit`, `expected` (the expected outputs and magnitudes
/// it carries), `dtypes` (each stored tensor's dtype) and `name`, `seed`, `description`.
#[pyfunction]
fn load_case<'py>(py: Python<'py>, path: std::path::PathBuf) -> PyResult<Bound<'py, PyDict>> {
    let loaded = py
        .detach(|| fixture::read_case(&path))
        .map_err(verify_error)?;
    let case = loaded.case;
    let p = &case.problem;
    let i = p.inputs();
    let inputs = PyDict::new(py);
    inputs.set_item("x", to_numpy(py, &i.x))?;
    inputs.set_item("dt", to_numpy(py, &i.dt))?;
    inputs.set_item("A", to_numpy(py, &i.A))?;
    inputs.set_item("B", to_numpy(py, &i.B))?;
    inputs.set_item("C", to_numpy(py, &i.C))?;
    if let Some(a) = &i.D {
        inputs.set_item("D", to_numpy(py, a))?;
    }
    if let Some(a) = &i.z {
        inputs.set_item("z", to_numpy(py, a))?;
    }
    if let Some(a) = &i.dt_bias {
        inputs.set_item("dt_bias", to_numpy(py, a))?;
    }
    if let Some(a) = &i.initial_states {
        inputs.set_item("initial_states", to_numpy(py, a))?;
    }
    if let Some(a) = &i.seq_idx {
        inputs.set_item("seq_idx", a.clone().into_dyn().into_pyarray(py))?;
    }
    let e = &case.expected;
    let expected = PyDict::new(py);
    for (name, a) in [
        ("out", &e.out),
        ("final_states", &e.final_states),
        ("dA_cumsum", &e.dA_cumsum),
        ("out_mag", &e.out_mag),
        ("final_states_mag", &e.final_states_mag),
    ] {
        if let Some(a) = a {
            expected.set_item(name, to_numpy(py, a))?;
        }
    }
    if let Some(a) = &e.chunk_states {
        expected.set_item("chunk_states", to_numpy(py, a))?;
    }
    let dtypes: BTreeMap<String, &str> = loaded
        .dtypes
        .iter()
        .map(|(k, v)| (k.clone(), v.name()))
        .collect();
    let o = p.options();
    let out = PyDict::new(py);
    out.set_item("inputs", inputs)?;
    out.set_item("chunk_size", o.chunk_size)?;
    out.set_item("dt_softplus", o.dt_softplus)?;
    out.set_item("dt_limit", o.dt_limit)?;
    out.set_item("expected", expected)?;
    out.set_item("dtypes", dtypes)?;
    out.set_item("name", case.meta.name)?;
    out.set_item("seed", case.meta.seed)?;
    out.set_item("description", case.meta.description)?;
    Ok(out)
}

/// Writes an `ssd-fixture/1` case (manifest at `path`, tensors beside it), atomically. Inputs
/// are stored as `input_dtype` (`f64`, `f32`; `bf16`/`f16` for `x`, `z`, `B`, `C` with the rest
/// as f32); with `with_expected`, the expected outputs and magnitudes are computed from the
/// inputs as stored, exactly as `ssd-oracle gen` does.
#[pyfunction]
#[pyo3(signature = (path, x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
    initial_states=None, seq_idx=None, dt_softplus=false, dt_limit=(0.0, f64::INFINITY),
    name=None, description=None, seed=None, input_dtype="f64", with_expected=true))]
#[allow(non_snake_case, clippy::too_many_arguments)]
fn save_case<'py>(
    py: Python<'py>,
    path: std::path::PathBuf,
    x: F64In<'py>,
    dt: F64In<'py>,
    A: F64In<'py>,
    B: F64In<'py>,
    C: F64In<'py>,
    chunk_size: usize,
    D: Option<F64In<'py>>,
    z: Option<F64In<'py>>,
    dt_bias: Option<F64In<'py>>,
    initial_states: Option<F64In<'py>>,
    seq_idx: Option<I64In<'py>>,
    dt_softplus: bool,
    dt_limit: (f64, f64),
    name: Option<String>,
    description: Option<String>,
    seed: Option<u64>,
    input_dtype: &str,
    with_expected: bool,
) -> PyResult<()> {
    let dtype = match input_dtype.to_ascii_lowercase().as_str() {
        "f64" => FloatDtype::F64,
        "f32" => FloatDtype::F32,
        "f16" => FloatDtype::F16,
        "bf16" => FloatDtype::BF16,
        other => {
            return Err(value_error(format!(
                "unknown input_dtype `{other}`: expected f64, f32, f16 or bf16"
            )))
        }
    };
    let raw = RawInputs {
        x,
        dt,
        a: A,
        b: B,
        c: C,
        d: D,
        z,
        dt_bias,
        initial_states,
        seq_idx,
    };
    let p = problem(raw, options(chunk_size, dt_softplus, dt_limit))?;
    py.detach(|| -> Result<(), VerifyError> {
        let problem = fixture::round_inputs(&p, dtype)?;
        let expected = if with_expected {
            expected_outputs(&problem)
        } else {
            Expected::default()
        };
        let case = Case {
            meta: CaseMeta {
                name,
                seed,
                description,
                extra: Default::default(),
            },
            problem,
            expected,
            packing: None,
        };
        fixture::write_case(&path, &case, dtype)
    })
    .map_err(verify_error)
}

/// The native half of `ssd_oracle`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(forward, m)?)?;
    m.add_function(wrap_pyfunction!(backward, m)?)?;
    m.add_function(wrap_pyfunction!(check, m)?)?;
    m.add_function(wrap_pyfunction!(load_case, m)?)?;
    m.add_function(wrap_pyfunction!(save_case, m)?)?;
    Ok(())
}
