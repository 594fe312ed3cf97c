//! `ssd-oracle gen`: write a suite of fixture cases.

use std::path::PathBuf;
use std::process::ExitCode;

use indicatif::{ProgressBar, ProgressStyle};
use ssd_verify::fixture::{write_case, FloatDtype, TensorFile, TensorWriter};
use ssd_verify::suites::{backward_tensors, build, cases, Suite};
use ssd_verify::VerifyError;

/// Write a suite of cases (manifest + safetensors each) with their float64 expected outputs
/// (`out`, `final_states`, `dA_cumsum`, `chunk_states`) and magnitudes (`out_mag`,
/// `final_states_mag`). The same suite and seed always give the same files.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// smoke: 3 small cases; edge: every option and boundary; standard: realistic Mamba-2
    /// layer shapes (large: tens of MB per case); backward: cases with upstream gradients
    /// (`dout`, `dfinal_states`) and their float64 gradients, for backward kernels.
    #[arg(long, value_enum)]
    pub suite: Suite,

    /// The folder to write into (created if missing; cases of the same name are replaced).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,

    /// Base seed: case k of the suite draws its values with seed + k.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Runs the subcommand.
///
/// # Errors
/// [`VerifyError::Io`] when the folder cannot be created or a file cannot be written.
pub fn run(args: &Args) -> Result<ExitCode, VerifyError> {
    std::fs::create_dir_all(&args.out).map_err(|source| VerifyError::Io {
        action: "create",
        path: args.out.clone(),
        source,
    })?;
    let specs = cases(args.suite);
    let pb = ProgressBar::new(specs.len() as u64);
    pb.set_style(
        ProgressStyle::with_template("{msg:32} {bar:30} {pos}/{len} [{elapsed}]")
            .expect("valid template"),
    );
    for (k, spec) in specs.iter().enumerate() {
        pb.set_message(spec.name);
        let seed = args.seed.wrapping_add(k as u64);
        let case = build(spec, args.suite, seed)?;
        let path = args.out.join(format!("{}.json", spec.name));
        write_case(&path, &case, spec.input_dtype)?;
        if args.suite == Suite::Backward {
            // The upstream gradients (drawn with the case's seed) and the gradients, added to
            // the case's tensor file, all F64.
            let tensors = path.with_extension("safetensors");
            let mut w = TensorWriter::new();
            w.push_all_from(&TensorFile::open(&tensors)?);
            for (name, a) in backward_tensors(&case.problem, seed) {
                w.push(name, &a, FloatDtype::F64);
            }
            w.write(&tensors)?;
        }
        pb.inc(1);
    }
    pb.finish_and_clear();
    println!(
        "wrote {} {} cases to {} (seed {})",
        specs.len(),
        args.suite.name(),
        args.out.display(),
        args.seed
    );
    Ok(ExitCode::SUCCESS)
}
