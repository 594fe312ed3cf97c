//! `ssd-oracle check`: compare a kernel's outputs with a case, element by element, against
//! the error bound of the arithmetic it claims (`docs/tolerances.md`).
//!
//! Exit status: 0 every element within its bound; 1 some element over its bound, or NaN or
//! infinite (reported with its index); 2 unusable input (a file that cannot be read, a missing
//! `out`, a tensor of the wrong shape or dtype), with a one-line reason.

use std::path::PathBuf;
use std::process::ExitCode;

use serde::Serialize;
use ssd_verify::fixture::{self, expected_shape, TensorFile};
use ssd_verify::tolerance::{Oracle, OutputName, Precision, TensorReport, Verdict};
use ssd_verify::VerifyError;

/// Check a kernel's outputs against a case: every output the candidate file holds (`out` at
/// least; `final_states`, `dA_cumsum`, `chunk_states` when present), in any float dtype.
/// Expected values come from the case, or are computed (float64 naive recurrence) when it has
/// none.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The case's manifest (ssd-fixture/1 JSON).
    #[arg(long, value_name = "CASE.json")]
    pub case: PathBuf,

    /// The kernel's outputs: a safetensors file with `out` (and optionally `final_states`,
    /// `dA_cumsum`, `chunk_states`) laid out as the contract says.
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
}

#[derive(Serialize)]
struct Report<'a> {
    case: String,
    candidate: String,
    precision: Precision,
    unit_roundoff: f64,
    passed: bool,
    worst_ratio: f64,
    tensors: &'a [TensorReport],
    ignored: Vec<String>,
    hint: Option<String>,
}

/// Runs the subcommand.
///
/// # Errors
/// Any [`VerifyError`] (exit status 2): the case or the candidate cannot be read, the
/// candidate has no `out`, a tensor has the wrong shape or a non-float dtype, or the case's
/// stored magnitudes disagree with its inputs.
pub fn run(args: &Args) -> Result<ExitCode, VerifyError> {
    let loaded = fixture::read_case(&args.case)?;
    let problem = &loaded.case.problem;
    let file = TensorFile::open(&args.candidate)?;
    let dims = problem.dims();
    let chunk = problem.options().chunk_size;

    let mut present = Vec::new();
    for name in OutputName::ALL {
        let Some(t) = file.read_float_opt(name.name())? else {
            if name == OutputName::Out {
                return Err(VerifyError::Tensors {
                    path: args.candidate.clone(),
                    message: format!(
                        "tensor `out` is missing (the candidate must hold at least `out`; found: {})",
                        list(&file.names())
                    ),
                });
            }
            continue;
        };
        let want = expected_shape(name.name(), dims, chunk).expect("an output name");
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
        present.push((name, t));
    }
    let ignored: Vec<String> = file
        .names()
        .into_iter()
        .filter(|n| OutputName::ALL.iter().all(|o| o.name() != n))
        .collect();

    let oracle = Oracle::with_expected(problem, &loaded.case.expected);
    check_stored_magnitudes(&args.case, &loaded.case.expected, &oracle)?;

    let compare = |precision: Precision| -> Result<Verdict, VerifyError> {
        let tensors = present
            .iter()
            .map(|(name, t)| oracle.compare(*name, &t.data, t.dtype, precision))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Verdict { precision, tensors })
    };
    let verdict = compare(args.precision)?;
    let hint = if verdict.passed() {
        None
    } else {
        hint(args.precision, &verdict, &compare)?
    };

    if args.json {
        let report = Report {
            case: args.case.display().to_string(),
            candidate: args.candidate.display().to_string(),
            precision: args.precision,
            unit_roundoff: args.precision.unit_roundoff(),
            passed: verdict.passed(),
            worst_ratio: verdict.max_ratio(),
            tensors: &verdict.tensors,
            ignored,
            hint,
        };
        let text = serde_json::to_string_pretty(&report)
            .map_err(|e| VerifyError::Usage(format!("cannot encode the report: {e}")))?;
        println!("{text}");
    } else {
        print_table(args, problem, &verdict, &ignored, hint.as_deref());
    }
    Ok(if verdict.passed() {
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

/// When a candidate fails at f64 or f32 but passes at TF32, it most likely is a TF32 kernel.
fn hint(
    precision: Precision,
    verdict: &Verdict,
    compare: &dyn Fn(Precision) -> Result<Verdict, VerifyError>,
) -> Result<Option<String>, VerifyError> {
    if verdict.tensors.iter().any(|t| t.non_finite > 0) {
        return Ok(None);
    }
    if matches!(precision, Precision::F64 | Precision::F32) && compare(Precision::Tf32)?.passed() {
        return Ok(Some(
            "every element is within the TF32 bound: if the kernel multiplies with TF32 tensor cores (Triton's default for f32 dots), check it with --precision tf32".into(),
        ));
    }
    Ok(None)
}

fn list(names: &[String]) -> String {
    if names.is_empty() {
        "no tensor".into()
    } else {
        names
            .iter()
            .map(|n| format!("`{n}`"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

fn at(name: OutputName, index: &[usize]) -> String {
    let parts: Vec<String> = name
        .axes()
        .iter()
        .zip(index)
        .map(|(a, i)| format!("{a} {i}"))
        .collect();
    format!("({})", parts.join(", "))
}

fn print_table(
    args: &Args,
    problem: &ssd_reference::Problem<f64>,
    verdict: &Verdict,
    ignored: &[String],
    hint: Option<&str>,
) {
    let d = problem.dims();
    println!(
        "case {}: batch {}, seqlen {}, nheads {}, headdim {}, ngroups {}, dstate {}, chunk {}",
        args.case.display(),
        d.batch,
        d.seqlen,
        d.nheads,
        d.headdim,
        d.ngroups,
        d.dstate,
        problem.options().chunk_size
    );
    println!(
        "candidate {}, checked as --precision {} (unit roundoff {:.3e})",
        args.candidate.display(),
        args.precision,
        args.precision.unit_roundoff()
    );
    println!(
        "{:<13} {:<6} {:>11} {:>11} {:>10} {:>14}  worst element",
        "tensor", "dtype", "max abs err", "rel L2 err", "err/bound", "over bound"
    );
    for t in &verdict.tensors {
        let worst = t
            .worst
            .as_ref()
            .map(|w| at(t.name, &w.index))
            .unwrap_or_default();
        println!(
            "{:<13} {:<6} {:>11.3e} {:>11.3e} {:>10.3e} {:>14}  {worst}",
            t.name.name(),
            t.dtype,
            t.max_abs_error,
            t.rel_l2,
            t.max_ratio(),
            format!("{}/{}", t.exceeding, t.elements),
        );
    }
    if !ignored.is_empty() {
        println!("ignored (not an output of the contract): {}", list(ignored));
    }
    if verdict.passed() {
        println!(
            "PASS: every element within its bound (worst error/bound {:.3})",
            verdict.max_ratio()
        );
        return;
    }
    for t in verdict.tensors.iter().filter(|t| !t.passed()) {
        if let Some(idx) = &t.first_non_finite {
            println!(
                "FAIL {}: {} non-finite element(s), the first at {}",
                t.name,
                t.non_finite,
                at(t.name, idx)
            );
        }
        if let Some(w) = &t.worst {
            if w.ratio.is_finite() {
                println!(
                    "FAIL {}: {} element(s) over the bound; worst at {}: candidate {:.9e}, expected {:.9e}, error {:.3e}, bound {:.3e} ({:.3e}x), magnitude {:.3e}",
                    t.name,
                    t.exceeding - t.non_finite,
                    at(t.name, &w.index),
                    w.candidate,
                    w.expected,
                    w.error,
                    w.bound,
                    w.ratio,
                    w.magnitude
                );
            }
        }
    }
    if let Some(h) = hint {
        println!("hint: {h}");
    }
}
