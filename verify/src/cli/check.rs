//! `ssd-oracle check`: compare a kernel's outputs with a case, element by element, against
//! the error bound of the arithmetic it claims (`docs/tolerances.md`).
//!
//! Exit status: 0 every element within its bound; 1 some element over its bound, or NaN or
//! infinite (reported with its index); 2 unusable input (a file that cannot be read, a missing
//! `out` (or gradients), a tensor of the wrong shape or dtype, a gradient of an input the case
//! does not have or without the case's `dout`, a `--plot` path that is not `.svg` or cannot be
//! written), with a one-line reason.

use std::path::PathBuf;
use std::process::ExitCode;

use ssd_verify::fixture::{self, TensorFile};
use ssd_verify::plot;
use ssd_verify::report::{check_candidate, check_candidate_shape, list_names, Labels};
use ssd_verify::tolerance::{Oracle, OutputName, Precision};
use ssd_verify::VerifyError;

/// Check a kernel's outputs against a case: every output the candidate file holds (`out` at
/// least; `final_states`, `dA_cumsum`, `chunk_states` when present) and every gradient of a
/// backward pass (`dx`, `ddt`, `dA`, `dB`, `dC`, `dD`, `dz`, `ddt_bias`, `dinitial_states`;
/// a candidate of gradients only needs no `out`), in any float dtype. Expected outputs come
/// from the case, or are computed (float64 naive recurrence) when it has none; expected
/// gradients are computed by the float64 adjoint recurrence from the case's `dout` (and
/// `dfinal_states`).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The case's manifest (ssd-fixture/1 JSON).
    #[arg(long, value_name = "CASE.json")]
    pub case: PathBuf,

    /// The kernel's outputs: a safetensors file with `out` (and optionally `final_states`,
    /// `dA_cumsum`, `chunk_states`) and/or gradients (`dx`, `ddt`, `dA`, `dB`, `dC`, `dD`,
    /// `dz`, `ddt_bias`, `dinitial_states`, each of its input's shape), and for a packed case
    /// `varlen_states` and `position_states`, laid out as the contract says.
    #[arg(long, value_name = "CAND.safetensors")]
    pub candidate: PathBuf,

    /// The arithmetic the kernel claims: the bound allows exactly its rounding. f32 is the
    /// default (plain f32 kernels); use tf32 for TF32 tensor-core kernels (Triton's default for
    /// f32 dots), bf16 for kernels fed bfloat16 x, B, C, z.
    #[arg(long, value_enum, default_value = "f32")]
    pub precision: Precision,

    /// Print one JSON object on stdout instead of the table.
    #[arg(long)]
    pub json: bool,

    /// Draw where the candidate is wrong: per failing tensor, the heat map of error/bound over
    /// (token, head) with chunk boundaries and sequence starts, and the profile per position
    /// in the chunk (SVG; a passing check gives a picture that says so).
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
}

/// Whether the case has the (differentiable) input `name`.
fn case_has_input(problem: &ssd_reference::Problem<f64>, name: &str) -> bool {
    let i = problem.inputs();
    match name {
        "D" => i.D.is_some(),
        "z" => i.z.is_some(),
        "dt_bias" => i.dt_bias.is_some(),
        "initial_states" => i.initial_states.is_some(),
        _ => true,
    }
}

/// Runs the subcommand.
///
/// # Errors
/// Any [`VerifyError`] (exit status 2): the case or the candidate cannot be read, the
/// candidate has no `out`, a tensor has the wrong shape or a non-float dtype, or the case's
/// stored magnitudes disagree with its inputs.
pub fn run(args: &Args) -> Result<ExitCode, VerifyError> {
    if let Some(path) = &args.plot {
        plot::check_plot_path(path)?;
    }
    let loaded = fixture::read_case(&args.case)?;
    let problem = &loaded.case.problem;
    let file = TensorFile::open(&args.candidate)?;
    let dims = problem.dims();
    let chunk = problem.options().chunk_size;

    // The forward's outputs (`out` required when any is given) and the gradients.
    let mut present = Vec::new();
    let packing = loaded.case.packing.as_ref();
    for name in OutputName::ALL
        .into_iter()
        .chain(OutputName::PACKED)
        .chain(OutputName::GRADIENTS)
    {
        let Some(t) = file.read_float_opt(name.name())? else {
            continue;
        };
        if name.is_packed() {
            let Some(k) = packing else {
                return Err(VerifyError::Tensors {
                    path: args.candidate.clone(),
                    message: format!(
                        "tensor `{name}` is an output of packed cases, and the case has no `cu_seqlens`"
                    ),
                });
            };
            let want = fixture::expected_shape_packed(name.name(), dims, chunk, k)
                .expect("a packed output");
            if t.data.shape() != want.as_slice() {
                return Err(VerifyError::Tensors {
                    path: args.candidate.clone(),
                    message: format!(
                        "tensor `{name}` has shape {:?}, expected {} = {want:?} from the case",
                        t.data.shape(),
                        fixture::layout(name.name()).unwrap_or("?")
                    ),
                });
            }
        } else if let Some(input) = name.input() {
            if !case_has_input(problem, input) {
                return Err(VerifyError::Tensors {
                    path: args.candidate.clone(),
                    message: format!(
                        "tensor `{name}` is the gradient of `{input}`, which the case does not have"
                    ),
                });
            }
        } else {
            check_candidate_shape(name, t.data.shape(), dims, chunk).map_err(|message| {
                VerifyError::Tensors {
                    path: args.candidate.clone(),
                    message,
                }
            })?;
        }
        present.push((name, t));
    }
    let forward = present.iter().any(|(n, _)| !n.is_gradient());
    let gradients = present.iter().any(|(n, _)| n.is_gradient());
    if !present.iter().any(|(n, _)| *n == OutputName::Out) && (forward || !gradients) {
        return Err(VerifyError::Tensors {
            path: args.candidate.clone(),
            message: format!(
                "tensor `out` is missing (the candidate must hold at least `out`, or only gradients; found: {})",
                list_names(&file.names())
            ),
        });
    }
    let ignored: Vec<String> = file
        .names()
        .into_iter()
        .filter(|n| OutputName::from_name(n).is_none())
        .collect();

    let mut oracle = None;
    if forward {
        let o = match packing {
            Some(k) => Oracle::for_packed(problem, k)?,
            None => Oracle::with_expected(problem, &loaded.case.expected),
        };
        check_stored_magnitudes(&args.case, &loaded.case.expected, &o)?;
        oracle = Some(o);
    }
    if gradients && packing.is_some_and(|k| k.seq_initial_states.is_some()) {
        return Err(VerifyError::Usage(
            "gradients of cases with per-sequence initial states (`seq_initial_states`) are not supported yet".into(),
        ));
    }
    if gradients {
        let (dout, dfinal) = super::grad::read_upstream(&loaded)?;
        let (dout, dfinal) = (dout.view(), dfinal.as_ref().map(|a| a.view()));
        oracle = Some(match oracle {
            Some(o) => o.add_gradients(problem, dout, dfinal)?,
            None => Oracle::for_gradients(problem, dout, dfinal)?,
        });
        let built = oracle.as_ref().expect("built");
        for (name, t) in present.iter().filter(|(n, _)| n.is_gradient()) {
            if let Some(why) = built.refusal(*name, t.data.shape()) {
                return Err(VerifyError::Tensors {
                    path: args.candidate.clone(),
                    message: format!("tensor {why}"),
                });
            }
        }
    }
    let oracle = oracle.expect("out or a gradient is present");

    let tensors: Vec<_> = present
        .iter()
        .map(|(name, t)| (*name, &t.data, t.dtype))
        .collect();
    let labels = Labels {
        case: args.case.display().to_string(),
        candidate: args.candidate.display().to_string(),
    };
    let report = check_candidate(labels, problem, &oracle, &tensors, ignored, args.precision)?;
    if let Some(path) = &args.plot {
        plot::write_plot(&report, path)?;
    }
    if args.json {
        println!("{}", report.to_json()?);
    } else {
        print!("{}", report.text());
        if let Some(path) = &args.plot {
            println!("picture: {}", path.display());
        }
    }
    Ok(if report.passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// A case's `out_mag` and `final_states_mag`, when present, must be the magnitudes of its own
/// inputs: otherwise the case was edited or is stale, and its verdicts would not mean much.
fn check_stored_magnitudes(
    case: &std::path::Path,
    expected: &fixture::Expected,
    oracle: &Oracle,
) -> Result<(), VerifyError> {
    let mags = oracle.magnitudes();
    for (name, stored, computed) in [
        (
            "out_mag",
            expected.out_mag.as_ref().map(|a| a.view().into_dyn()),
            &mags.out.mag,
        ),
        (
            "final_states_mag",
            expected
                .final_states_mag
                .as_ref()
                .map(|a| a.view().into_dyn()),
            &mags.final_states.mag,
        ),
    ] {
        let Some(stored) = stored else { continue };
        let bad = stored
            .iter()
            .zip(computed.iter())
            .position(|(s, c)| (s - c).abs() > 1e-9 * s.abs().max(c.abs()) + 1e-300);
        if let Some(flat) = bad {
            let idx = ssd_reference::problem::unravel(flat, stored.shape());
            return Err(VerifyError::Tensors {
                path: case.to_path_buf(),
                message: format!(
                    "tensor `{name}` disagrees with the magnitudes of the case's inputs at {idx:?} (stale or edited case? regenerate it)"
                ),
            });
        }
    }
    Ok(())
}
