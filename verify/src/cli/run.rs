//! `ssd-oracle run`: compute a case with one implementation, write its outputs.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use ssd_reference::serving::{self, Algorithm, Packing, ServingOutput};
use ssd_reference::{MatmulPrecision, Problem, Real};
use ssd_verify::fixture::{self, FloatDtype, LoadedCase, Outputs, TensorWriter};
use ssd_verify::VerifyError;

use super::{
    check_combination, check_output_size, compute_reusing, Computed, Impl, Precision, Prepared,
};

/// Compute a case and write `out` and `final_states` (plus `dA_cumsum` and `chunk_states` for
/// the chunked path) to a safetensors file: F64 for --precision f64, F32 otherwise.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The case's manifest (ssd-fixture/1 JSON; its `tensors` key names the safetensors file).
    #[arg(long, value_name = "CASE.json")]
    pub case: PathBuf,

    /// The implementation that computes the forward pass.
    #[arg(long = "impl", value_enum, value_name = "IMPL")]
    pub implementation: Impl,

    /// Where to write the outputs (replaced atomically; nothing is written on error).
    #[arg(long, value_name = "OUT.safetensors")]
    pub out: PathBuf,

    /// The arithmetic: f64, f32 (inputs rounded to f32), or tf32 (f32 with TF32-rounded matrix
    /// products: the chunked path and the GPU). Default: f64, tf32 for the GPU (all it computes).
    #[arg(long, value_enum)]
    pub precision: Option<Precision>,

    /// Compute N times and report the timings (the outputs of the last run are written). Each
    /// run writes into the arrays of the one before: only the first pays for fresh memory.
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub repeat: u32,

    /// Print one JSON object on stdout (timings in milliseconds, implementation, precision,
    /// dims) instead of a sentence.
    #[arg(long)]
    pub json: bool,
}

/// Runs the subcommand.
///
/// # Errors
/// Any [`VerifyError`]: a bad combination of options, an unusable output path, a case that
/// cannot be read. The output file is written only after every computation succeeded.
pub fn run(args: &Args) -> Result<ExitCode, VerifyError> {
    let precision = args
        .precision
        .unwrap_or(args.implementation.default_precision());
    check_out_path(&args.out)?;
    let loaded = fixture::read_case(&args.case)?;
    check_not_an_input(&args.out, &loaded)?;
    if let Some(packing) = &loaded.case.packing {
        return run_packed(args, &loaded, packing, precision);
    }
    check_combination(args.implementation, precision)?;
    let problem = &loaded.case.problem;
    check_output_size(problem, args.implementation)?;
    let prepared = Prepared::new(problem, precision)?;

    let progress = (args.repeat > 1).then(|| {
        let pb = ProgressBar::new(u64::from(args.repeat));
        pb.set_style(
            ProgressStyle::with_template("{msg} {bar:30} {pos}/{len} [{elapsed}]")
                .expect("valid template"),
        );
        pb.set_message(format!(
            "{} {}",
            args.implementation.name(),
            precision.name()
        ));
        pb
    });
    let mut times = Vec::with_capacity(args.repeat as usize);
    let mut last: Option<Computed> = None;
    for _ in 0..args.repeat {
        // Each repeat writes into the previous one's arrays (same bits): only the last
        // result is written out.
        let (computed, took) =
            compute_reusing(&prepared, args.implementation, precision, last.take())?;
        times.push(took);
        last = Some(computed);
        if let Some(pb) = &progress {
            pb.inc(1);
        }
    }
    if let Some(pb) = progress {
        pb.finish_and_clear();
    }
    let outputs = last.expect("repeat >= 1").into_outputs();
    let out_dtype = precision.out_dtype(args.implementation);
    outputs.write_as(&args.out, out_dtype, precision.store_dtype())?;

    let ms: Vec<f64> = times.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    let median = median(&ms);
    let min = ms.iter().copied().fold(f64::INFINITY, f64::min);
    let dims = problem.dims();
    if args.json {
        let mut tensors = serde_json::Map::new();
        for (name, shape) in shapes(&outputs) {
            tensors.insert(name.into(), json!(shape));
        }
        let report = json!({
            "case": args.case.display().to_string(),
            "out": args.out.display().to_string(),
            "impl": args.implementation.name(),
            "precision": precision.name(),
            "dtype": fixture::Dtype::from(precision.store_dtype()).name(),
            "out_dtype": fixture::Dtype::from(out_dtype).name(),
            "dims": {
                "batch": dims.batch,
                "seqlen": dims.seqlen,
                "nheads": dims.nheads,
                "headdim": dims.headdim,
                "ngroups": dims.ngroups,
                "dstate": dims.dstate,
            },
            "chunk_size": problem.options().chunk_size,
            "threads": rayon::current_num_threads(),
            "repeat": args.repeat,
            "compute_ms": ms,
            "compute_ms_min": min,
            "compute_ms_median": median,
            "tensors": tensors,
        });
        println!("{report}");
    } else {
        let names: Vec<&str> = shapes(&outputs).into_iter().map(|(n, _)| n).collect();
        let timing = if args.repeat > 1 {
            format!(
                "median {} ms, min {} ms over {} runs",
                fmt_ms(median),
                fmt_ms(min),
                args.repeat
            )
        } else {
            format!("{} ms", fmt_ms(median))
        };
        let stored = if out_dtype == precision.store_dtype() {
            fixture::Dtype::from(out_dtype).to_string()
        } else {
            format!(
                "out {}, the rest {}",
                fixture::Dtype::from(out_dtype),
                fixture::Dtype::from(precision.store_dtype())
            )
        };
        println!(
            "wrote {} ({stored}) to {}: {} {} computed in {timing} on {} threads",
            names.join(", "),
            args.out.display(),
            args.implementation.name(),
            precision.name(),
            rayon::current_num_threads(),
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Checks that `out` can be written before any work is done: a file name in an existing folder,
/// not a folder itself.
pub(super) fn check_out_path(out: &Path) -> Result<(), VerifyError> {
    if out.file_name().is_none() || out.is_dir() {
        return Err(VerifyError::Usage(format!(
            "--out `{}` must be a file path, not a folder",
            out.display()
        )));
    }
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !parent.is_dir() {
        return Err(VerifyError::Usage(format!(
            "--out `{}`: the folder `{}` does not exist",
            out.display(),
            parent.display()
        )));
    }
    Ok(())
}

/// Refuses an output path that names one of the case's own files.
pub(super) fn check_not_an_input(out: &Path, loaded: &LoadedCase) -> Result<(), VerifyError> {
    for input in [&loaded.manifest_path, &loaded.tensors_path] {
        if same_file(out, input) {
            return Err(VerifyError::Usage(format!(
                "--out `{}` is the case's own file `{}`: refusing to overwrite an input",
                out.display(),
                input.display()
            )));
        }
    }
    Ok(())
}

/// Whether two paths name the same existing file.
fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

fn shapes(o: &Outputs<f64>) -> Vec<(&'static str, Vec<usize>)> {
    let mut v = vec![
        ("out", o.out.shape().to_vec()),
        ("final_states", o.final_states.shape().to_vec()),
    ];
    if let Some(a) = &o.dA_cumsum {
        v.push(("dA_cumsum", a.shape().to_vec()));
    }
    if let Some(a) = &o.chunk_states {
        v.push(("chunk_states", a.shape().to_vec()));
    }
    v
}

/// The median of a non-empty list (the mean of the two middle values for an even count).
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Milliseconds with three significant digits or so.
pub fn fmt_ms(ms: f64) -> String {
    if ms >= 100.0 {
        format!("{ms:.0}")
    } else if ms >= 10.0 {
        format!("{ms:.1}")
    } else if ms >= 1.0 {
        format!("{ms:.2}")
    } else {
        format!("{ms:.3}")
    }
}

/// Seconds as milliseconds.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A packed (serving) case: `out`, `final_states`, `varlen_states` and (when the case lists
/// positions) `position_states`, computed sequence by sequence ([`serving::forward`]) on the
/// CPU, or by the GPU kernels on the packed row ([`ssd_gpu::Gpu::forward_packed`]).
fn run_packed(
    args: &Args,
    loaded: &LoadedCase,
    packing: &Packing<f64>,
    precision: Precision,
) -> Result<ExitCode, VerifyError> {
    let problem = &loaded.case.problem;
    let algorithm = match (args.implementation, precision) {
        (Impl::Gpu, Precision::Tf32) => None,
        (Impl::Gpu, p) => {
            return Err(VerifyError::Usage(format!(
                "--impl gpu runs packed cases in tf32 only, not {} (bf16 serves unpacked cases)",
                p.name()
            )))
        }
        (Impl::Naive, p @ (Precision::Tf32 | Precision::Bf16)) => {
            return Err(VerifyError::Usage(format!(
                "--precision {} needs --impl chunked: the naive recurrence has no matrix products to round",
                p.name()
            )))
        }
        (Impl::Naive, _) => Some(Algorithm::Naive),
        (Impl::Chunked, Precision::Tf32) => Some(Algorithm::Chunked(MatmulPrecision::Tf32)),
        (Impl::Chunked, Precision::Bf16) => Some(Algorithm::Chunked(MatmulPrecision::Bf16)),
        (Impl::Chunked, _) => Some(Algorithm::Chunked(MatmulPrecision::Native)),
    };
    /// Runs `compute` (which returns the outputs and the milliseconds of the computation
    /// alone) `repeat` times and writes the last outputs.
    fn go<T: Real>(
        mut compute: impl FnMut() -> Result<(ServingOutput<T>, f64), VerifyError>,
        repeat: u32,
        w: &mut TensorWriter,
        dtype: FloatDtype,
        positions: bool,
    ) -> Result<Vec<f64>, VerifyError> {
        let mut times = Vec::new();
        let mut last = None;
        for _ in 0..repeat {
            let (o, ms) = compute()?;
            times.push(ms);
            last = Some(o);
        }
        let o = last.expect("repeat >= 1");
        w.push("out", &o.out, dtype);
        w.push("final_states", &o.final_states, dtype);
        w.push("varlen_states", &o.varlen_states, dtype);
        if positions {
            w.push("position_states", &o.position_states, dtype);
        }
        Ok(times)
    }
    /// The reference on the CPU, timed.
    fn cpu<T: Real>(
        p: &Problem<T>,
        k: &Packing<T>,
        alg: Algorithm,
    ) -> Result<(ServingOutput<T>, f64), VerifyError> {
        let t0 = std::time::Instant::now();
        let o = serving::forward(p, k, alg).map_err(|e| VerifyError::Usage(e.to_string()))?;
        Ok((o, t0.elapsed().as_secs_f64() * 1e3))
    }
    fn gpu_err(e: ssd_gpu::GpuError) -> VerifyError {
        match e {
            ssd_gpu::GpuError::Unsupported(m) => VerifyError::Usage(m),
            e => VerifyError::Unavailable(e.to_string()),
        }
    }
    let mut w = TensorWriter::new();
    let dtype = precision.store_dtype();
    let reps = args.repeat;
    let positions = !packing.state_positions.is_empty();
    let times = match (algorithm, precision) {
        (None, _) => {
            // Uploaded once; each repeat times the kernels alone (launch to synchronisation).
            let (p, k) = (problem.cast::<f32>(), packing.cast::<f32>());
            let gpu = ssd_gpu::gpu_for(ssd_gpu::GpuConfig::from_env())
                .map_err(|e| VerifyError::Unavailable(e.to_string()))?;
            let (inputs, dev) = gpu.upload_packed(&p, &k).map_err(gpu_err)?;
            let mut outs = gpu
                .alloc_outputs(&inputs.dims, &inputs.options)
                .map_err(gpu_err)?;
            let mut serv = gpu.alloc_serving_outputs(&dev).map_err(gpu_err)?;
            let compute = || {
                let t0 = std::time::Instant::now();
                gpu.forward_packed_into(&inputs, &dev, &mut outs, &mut serv)
                    .map_err(gpu_err)?;
                gpu.synchronize().map_err(gpu_err)?;
                let ms = t0.elapsed().as_secs_f64() * 1e3;
                Ok((
                    gpu.download_packed(&outs, &dev, &serv).map_err(gpu_err)?,
                    ms,
                ))
            };
            go(compute, reps, &mut w, dtype, positions)?
        }
        (Some(alg), Precision::F64) => go(
            || cpu(problem, packing, alg),
            reps,
            &mut w,
            dtype,
            positions,
        )?,
        (Some(alg), _) => {
            // A bf16 kernel reads x, B, C, z as bfloat16 values.
            let p = match precision {
                Precision::Bf16 => {
                    ssd_verify::fixture::round_inputs(problem, FloatDtype::BF16)?.cast::<f32>()
                }
                _ => problem.cast::<f32>(),
            };
            let k = packing.cast::<f32>();
            go(|| cpu(&p, &k, alg), reps, &mut w, dtype, positions)?
        }
    };
    w.write(&args.out)?;
    let med = median(&times);
    if args.json {
        let report = json!({
            "case": args.case.display().to_string(),
            "out": args.out.display().to_string(),
            "impl": args.implementation.name(),
            "precision": precision.name(),
            "nseq": packing.nseq(),
            "positions": packing.state_positions.len(),
            "compute_ms": times,
            "compute_ms_median": med,
        });
        println!("{report}");
    } else {
        println!(
            "wrote out, final_states, varlen_states{} to {} ({} {}, {} sequences): median {} ms over {} runs",
            if packing.state_positions.is_empty() { "" } else { ", position_states" },
            args.out.display(),
            args.implementation.name(),
            precision.name(),
            packing.nseq(),
            fmt_ms(med),
            times.len()
        );
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_odd_even() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[7.0]), 7.0);
        assert!(median(&[]).is_nan());
    }
}
