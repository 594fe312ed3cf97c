//! `ssd-oracle grad`: the gradients of a case's forward, pulled back from the case's upstream
//! gradients, by the adjoint recurrence (the ground truth) or the chunked backward (stage by
//! stage, as a kernel runs it).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use ndarray::{Array4, Ix4};
use ssd_reference::adjoint::{self, Gradients};
use ssd_reference::{chunked_backward, MatmulPrecision, Problem, Real};
use ssd_verify::fixture::{self, FloatDtype, TensorFile, TensorWriter};
use ssd_verify::VerifyError;

/// The arithmetic of the backward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum GradPrecision {
    /// float64: with `--impl naive`, the ground truth.
    F64,
    /// float32 throughout (inputs and upstream gradients rounded to f32 first).
    F32,
    /// float32 with every matrix-product operand rounded to TF32 (`--impl chunked` only):
    /// what a correct TF32 tensor-core backward computes.
    Tf32,
}

/// The algorithm of the backward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum GradImpl {
    /// The adjoint recurrence, token by token (the reverse mode of the naive recurrence).
    Naive,
    /// The chunked backward, stage by stage (`ssd_reference::chunked_backward`).
    Chunked,
}

/// Compute the gradients of a case's forward with respect to every input it has, from the
/// upstream gradients `dout` (required) and `dfinal_states` (optional) stored among the case's
/// tensors, and write them (mamba_ssm's names: dx, ddt, dA, dB, dC, and dD, dz, ddt_bias,
/// dinitial_states where the case has the input) to a safetensors file: F64 for --precision
/// f64, F32 for f32 and tf32.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The case's manifest (ssd-fixture/1 JSON); its tensors must include `dout`.
    #[arg(long, value_name = "CASE.json")]
    pub case: PathBuf,

    /// Where to write the gradients (replaced atomically; nothing is written on error).
    #[arg(long, value_name = "GRADS.safetensors")]
    pub out: PathBuf,

    /// The algorithm.
    #[arg(long = "impl", value_enum, default_value_t = GradImpl::Naive)]
    pub implementation: GradImpl,

    /// The arithmetic.
    #[arg(long, value_enum, default_value_t = GradPrecision::F64)]
    pub precision: GradPrecision,
}

/// Runs the subcommand.
///
/// # Errors
/// Any [`VerifyError`]: an unreadable case, `dout` missing or of the wrong shape or dtype,
/// `dfinal_states` of the wrong shape, an unusable output path (one of the case's own files
/// included).
pub fn run(args: &Args) -> Result<ExitCode, VerifyError> {
    super::run::check_out_path(&args.out)?;
    let loaded = fixture::read_case(&args.case)?;
    super::run::check_not_an_input(&args.out, &loaded)?;
    let problem = &loaded.case.problem;
    let (dout, dfinal) = read_upstream(&loaded)?;

    if args.precision == GradPrecision::Tf32 && args.implementation == GradImpl::Naive {
        return Err(VerifyError::Usage(
            "--precision tf32 needs --impl chunked (the recurrence has no matrix product)".into(),
        ));
    }
    let t0 = Instant::now();
    let mut w = TensorWriter::new();
    let file = &loaded.tensors_path;
    let (dtype, names) = match args.precision {
        GradPrecision::F64 => {
            let g = pull_back(
                problem,
                &dout,
                dfinal.as_ref(),
                args.implementation,
                MatmulPrecision::Native,
                file,
            )?;
            (FloatDtype::F64, push_all(&mut w, &g, FloatDtype::F64))
        }
        GradPrecision::F32 | GradPrecision::Tf32 => {
            let p32: Problem<f32> = problem.cast();
            let cast = |a: &Array4<f64>| a.mapv(|v| v as f32);
            let dfinal32 = dfinal.as_ref().map(cast);
            let mp = if args.precision == GradPrecision::Tf32 {
                MatmulPrecision::Tf32
            } else {
                MatmulPrecision::Native
            };
            let g = pull_back(
                &p32,
                &cast(&dout),
                dfinal32.as_ref(),
                args.implementation,
                mp,
                file,
            )?;
            (FloatDtype::F32, push_all(&mut w, &g, FloatDtype::F32))
        }
    };
    let took = t0.elapsed();
    w.write(&args.out)?;
    println!(
        "wrote {} ({}) to {}: {} {} computed in {:.1} ms on {} threads",
        names.join(", "),
        fixture::Dtype::from(dtype),
        args.out.display(),
        match args.implementation {
            GradImpl::Naive => "adjoint recurrence",
            GradImpl::Chunked => "chunked backward",
        },
        match args.precision {
            GradPrecision::F64 => "f64",
            GradPrecision::F32 => "f32",
            GradPrecision::Tf32 => "tf32",
        },
        took.as_secs_f64() * 1e3,
        rayon::current_num_threads(),
    );
    Ok(ExitCode::SUCCESS)
}

/// The upstream gradients a case stores: `dout` (required; an error naming it when missing,
/// not of a float dtype, or not of `[batch, seqlen, nheads, headdim]`) and `dfinal_states`
/// (optional; `[batch, nheads, headdim, dstate]`).
///
/// # Errors
/// [`VerifyError::Tensors`] naming the tensor and the case's tensor file.
pub(crate) fn read_upstream(
    loaded: &fixture::LoadedCase,
) -> Result<(Array4<f64>, Option<Array4<f64>>), VerifyError> {
    let tensors = TensorFile::open(&loaded.tensors_path)?;
    let d = *loaded.case.problem.dims();
    let upstream = |name: &str, want: [usize; 4]| -> Result<Option<Array4<f64>>, VerifyError> {
        let Some(t) = tensors.read_float_opt(name)? else {
            return Ok(None);
        };
        if t.data.shape() != want {
            return Err(VerifyError::Tensors {
                path: loaded.tensors_path.clone(),
                message: format!(
                    "tensor `{name}` has shape {:?}, expected {want:?} from the case",
                    t.data.shape()
                ),
            });
        }
        Ok(Some(
            t.data.into_dimensionality::<Ix4>().expect("4 dimensions"),
        ))
    };
    let dout = upstream("dout", [d.batch, d.seqlen, d.nheads, d.headdim])?.ok_or_else(|| {
        VerifyError::Tensors {
            path: loaded.tensors_path.clone(),
            message: "tensor `dout` is missing (the upstream gradient of `out`, which gradients are pulled back from; `ssd-oracle gen --suite backward` writes cases with it)".into(),
        }
    })?;
    let dfinal = upstream("dfinal_states", [d.batch, d.nheads, d.headdim, d.dstate])?;
    Ok((dout, dfinal))
}

/// The backward pass, its shape errors reported against the case's tensor file.
fn pull_back<T: Real>(
    p: &Problem<T>,
    dout: &Array4<T>,
    dfinal: Option<&Array4<T>>,
    implementation: GradImpl,
    precision: MatmulPrecision,
    file: &std::path::Path,
) -> Result<Gradients<T>, VerifyError> {
    let (dout, dfinal) = (dout.view(), dfinal.map(|a| a.view()));
    match implementation {
        GradImpl::Naive => adjoint::backward(p, dout, dfinal),
        GradImpl::Chunked => {
            chunked_backward::backward(p, dout, dfinal, precision).map(|c| c.grads)
        }
    }
    .map_err(|source| VerifyError::Problem {
        path: file.to_path_buf(),
        source,
    })
}

/// Adds every gradient to `w`; returns their names in order.
fn push_all<T: Real>(
    w: &mut TensorWriter,
    g: &Gradients<T>,
    dtype: FloatDtype,
) -> Vec<&'static str> {
    g.named()
        .into_iter()
        .map(|(name, a)| {
            w.push(name, &a, dtype);
            name
        })
        .collect()
}
