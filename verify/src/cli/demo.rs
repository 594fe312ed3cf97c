//! The built-in demonstration: what `ssd-oracle` (so `cargo run --release`) does with no
//! arguments.
//!
//! Random problems of built-in shapes, from tiny to a realistic Mamba-2 layer, go through every
//! implementation available; each result is compared with the float64 naive recurrence (the
//! ground truth) and timed.

use std::process::ExitCode;

use indicatif::{ProgressBar, ProgressStyle};
use ssd_reference::random::{random_problem, DSkip, ProblemSpec, SeqIdx};
use ssd_reference::{Dims, Options};
use ssd_verify::fixture::{Dtype, Outputs};
use ssd_verify::tolerance::{self, Oracle, OutputName};
use ssd_verify::VerifyError;

use super::run::{fmt_ms, ms};
use super::{compute, gpu_available, Impl, Precision, Prepared};

/// Run the built-in demonstration.
#[derive(Debug, Default, clap::Args)]
pub struct Args {
    /// Only the small shapes (a fraction of a second).
    #[arg(long)]
    pub quick: bool,
}

/// A built-in shape: a random problem and what it exercises.
struct Shape {
    title: &'static str,
    spec: ProblemSpec,
    seed: u64,
    /// Left out by `--quick`.
    large: bool,
}

/// One implementation run and compared with the truth.
struct Path {
    label: &'static str,
    imp: Impl,
    precision: Precision,
    /// The arithmetic whose error bound (docs/tolerances.md) the result must stay within.
    bound: tolerance::Precision,
    /// Which rounding the bound allows, in words.
    why: &'static str,
}

fn shapes() -> Vec<Shape> {
    let mut edges = ProblemSpec::full(Dims::new(2, 37, 6, 3, 3, 5), 64);
    edges.d = DSkip::PerHead;
    edges.seq_idx = SeqIdx::Segments {
        segments: 2,
        first: 1,
    };
    let mut resets = ProblemSpec::full(Dims::new(2, 200, 4, 16, 2, 8), 16);
    resets.seq_idx = SeqIdx::AtChunkStarts { every: 3 };
    let mut bench = ProblemSpec::plain(Dims::new(2, 2048, 8, 64, 8, 64));
    bench.options = Options {
        chunk_size: 64,
        ..Options::default()
    };
    vec![
        Shape {
            title: "tiny, every option",
            spec: ProblemSpec::full(Dims::new(1, 10, 2, 4, 1, 4), 4),
            seed: 1,
            large: false,
        },
        Shape {
            title: "one partial chunk (chunk_size > seqlen), 3 groups, D per head, initial state unused (seq_idx starts at 1)",
            spec: edges,
            seed: 2,
            large: false,
        },
        Shape {
            title: "ragged seqlen, sequences reset exactly at chunk starts",
            spec: resets,
            seed: 3,
            large: false,
        },
        Shape {
            title: "benchmark shape (docs/performance.md), plain options",
            spec: bench,
            seed: 4,
            large: true,
        },
        Shape {
            title: "a realistic Mamba-2 layer, every option",
            spec: ProblemSpec::full(Dims::new(1, 2048, 24, 64, 1, 128), 256),
            seed: 5,
            large: true,
        },
    ]
}

fn paths() -> Vec<Path> {
    let mut paths = vec![
        Path {
            label: "chunked f64",
            imp: Impl::Chunked,
            precision: Precision::F64,
            bound: tolerance::Precision::F64,
            why: "float64 rounding",
        },
        Path {
            label: "chunked f32",
            imp: Impl::Chunked,
            precision: Precision::F32,
            bound: tolerance::Precision::F32,
            why: "float32 rounding",
        },
        Path {
            label: "chunked tf32",
            imp: Impl::Chunked,
            precision: Precision::Tf32,
            bound: tolerance::Precision::Tf32,
            why: "TF32 operands",
        },
    ];
    if gpu_available().is_ok() {
        paths.push(Path {
            label: "gpu tf32",
            imp: Impl::Gpu,
            precision: Precision::Tf32,
            bound: tolerance::Precision::Tf32,
            why: "TF32 tensor cores",
        });
    }
    paths
}

fn describe_dims(spec: &ProblemSpec) -> String {
    let d = &spec.dims;
    let c = spec.options.chunk_size;
    let nchunks = d.nchunks(c);
    let ragged = if nchunks * c == d.seqlen {
        ""
    } else if nchunks == 1 {
        ", partial"
    } else {
        ", the last one partial"
    };
    format!(
        "batch {} x seqlen {}, {} heads x headdim {}, dstate {}, {} group{} ({} head{} each), chunk_size {} ({} chunk{}{ragged})",
        d.batch,
        d.seqlen,
        d.nheads,
        d.headdim,
        d.dstate,
        d.ngroups,
        if d.ngroups == 1 { "" } else { "s" },
        d.heads_per_group(),
        if d.heads_per_group() == 1 { "" } else { "s" },
        c,
        nchunks,
        if nchunks == 1 { "" } else { "s" },
    )
}

fn describe_options(spec: &ProblemSpec) -> String {
    let o = &spec.options;
    let mut parts = Vec::new();
    parts.push(match (o.dt_softplus, spec.dt_bias) {
        (true, true) => "dt' = softplus(dt + dt_bias)".to_string(),
        (true, false) => "dt' = softplus(dt)".to_string(),
        (false, true) => "dt' = dt + dt_bias".to_string(),
        (false, false) => "dt' = dt".to_string(),
    });
    let hi = if o.dt_limit.1.is_finite() {
        format!("{}", o.dt_limit.1)
    } else {
        "inf".to_string()
    };
    parts.push(format!("clamped to [{}, {hi}]", o.dt_limit.0));
    match spec.d {
        DSkip::None => {}
        DSkip::PerHead => parts.push("D per head".into()),
        DSkip::PerChannel => parts.push("D per channel".into()),
    }
    if spec.z {
        parts.push("z gate".into());
    }
    if spec.initial_states {
        parts.push("initial_states".into());
    }
    match spec.seq_idx {
        SeqIdx::None => {}
        SeqIdx::Segments { segments, first } => parts.push(format!(
            "seq_idx: up to {segments} sequences per row, numbered from {first}"
        )),
        SeqIdx::AtChunkStarts { every } => parts.push(format!(
            "seq_idx: a new sequence every {} tokens",
            every * spec.options.chunk_size
        )),
    }
    parts.join(", ")
}

/// Runs the demonstration; exit status 0 when every comparison agrees, 1 otherwise.
///
/// # Errors
/// Not expected (the built-in problems are valid); any [`VerifyError`] from the computation.
pub fn run(args: &Args) -> Result<ExitCode, VerifyError> {
    let shapes: Vec<Shape> = shapes()
        .into_iter()
        .filter(|s| !(args.quick && s.large))
        .collect();
    let paths = paths();
    let threads = rayon::current_num_threads();

    println!("ssd-oracle: a CPU oracle for Mamba-2 SSD kernels (the forward pass of mamba_ssm's mamba_chunk_scan_combined).");
    println!();
    println!("This demonstration draws random problems of {} built-in shapes and computes each in independent ways:", shapes.len());
    println!("  - naive f64: the recurrence token by token, exactly as the spec states it, in float64. This is the ground truth.");
    println!("  - chunked:   the chunked jump formula GPU kernels use (chunk_cumsum, fwd_pass_state, compute_out),");
    println!("               in float64, in float32, and in float32 with every matrix-product operand rounded to TF32");
    println!("               (what a correct TF32 tensor-core kernel computes).");
    match gpu_available() {
        Ok(()) => println!("  - gpu:       the CUDA kernels on this machine's GPU."),
        Err(e) => println!("  - gpu:       skipped ({e})."),
    }
    println!("Each result is compared with the truth on `out` (y, gated) and `final_states` (the state after the last token):");
    println!("rel err = ||result - truth|| / ||truth|| over the whole tensor, max abs = the largest |result - truth|.");
    println!(
        "Times are the computation alone, on {threads} thread{}.",
        if threads == 1 { "" } else { "s" }
    );

    let steps = (shapes.len() * (paths.len() + 1)) as u64;
    let pb = ProgressBar::new(steps);
    pb.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}").expect("valid template"),
    );

    let mut compared = 0usize;
    let mut disagreements = Vec::new();
    for (k, shape) in shapes.iter().enumerate() {
        pb.set_message(format!("{}: drawing the problem", shape.title));
        let problem = random_problem(&shape.spec, shape.seed)
            .map_err(|e| VerifyError::Usage(format!("built-in shape `{}`: {e}", shape.title)))?;
        pb.set_message(format!("{}: naive f64", shape.title));
        let (_, truth_time) = compute(&Prepared::F64(&problem), Impl::Naive, Precision::F64)?;
        // The float64 reference and the magnitudes its error bounds are built from.
        let oracle = Oracle::new(&problem);
        pb.inc(1);

        let mut rows = Vec::new();
        for path in &paths {
            pb.set_message(format!("{}: {}", shape.title, path.label));
            let prepared = Prepared::new(&problem, path.precision)?;
            let (result, took) = compute(&prepared, path.imp, path.precision)?;
            pb.inc(1);
            rows.push((path, took, verdict(&result, &oracle, path)?));
        }

        pb.suspend(|| {
            println!();
            println!("[{}/{}] {}", k + 1, shapes.len(), shape.title);
            println!("      {}", describe_dims(&shape.spec));
            println!("      options: {}", describe_options(&shape.spec));
            println!(
                "      {:<14} {:>10}   {:>9} {:>9}   {:>9} {:>9}   {:>11}   verdict",
                "path", "time", "out rel", "max abs", "final rel", "max abs", "err/bound"
            );
            println!(
                "      {:<14} {:>7} ms   (the truth)",
                "naive f64",
                fmt_ms(ms(truth_time))
            );
            for (path, took, v) in &rows {
                let word = if v.agrees { "agrees" } else { "DISAGREES" };
                println!(
                    "      {:<14} {:>7} ms   {:>9.1e} {:>9.1e}   {:>9.1e} {:>9.1e}   {:>11.2}   {word} (every element within the {} bound: {})",
                    path.label,
                    fmt_ms(ms(*took)),
                    v.out.0,
                    v.out.1,
                    v.final_states.0,
                    v.final_states.1,
                    v.worst_ratio,
                    path.bound,
                    path.why,
                );
            }
        });
        for (path, _, v) in &rows {
            compared += 1;
            if !v.agrees {
                disagreements.push(format!("{} on `{}`", path.label, shape.title));
            }
        }
    }
    pb.finish_and_clear();

    println!();
    if disagreements.is_empty() {
        println!(
            "All {compared} comparisons agree: the chunked jump formula (the algorithm of the GPU kernels) computes the same\n\
             function as the token-by-token recurrence: every element of `out` and `final_states` stays within the error\n\
             bound of its arithmetic (float64, float32, TF32; docs/tolerances.md), on every shape and option above."
        );
        println!();
        println!("Next: `ssd-oracle run --help` computes your own case (docs/fixture-format.md, docs/pytorch.md);");
        println!("`cargo test --release --workspace` runs the full test suite.");
        Ok(ExitCode::SUCCESS)
    } else {
        println!(
            "{} of {compared} comparisons DISAGREE: {}. This is a bug in the reference: please report it.",
            disagreements.len(),
            disagreements.join("; ")
        );
        Ok(ExitCode::from(1))
    }
}

struct Verdict {
    /// Normwise relative error and max abs error of `out`.
    out: (f64, f64),
    /// The same for `final_states`.
    final_states: (f64, f64),
    /// The largest error/bound ratio over both tensors (above 1: outside the bound).
    worst_ratio: f64,
    agrees: bool,
}

/// Checks `out` and `final_states` element by element against the error bound of the path's
/// arithmetic (the model of docs/tolerances.md, the one `ssd-oracle check` applies).
fn verdict(result: &Outputs<f64>, oracle: &Oracle, path: &Path) -> Result<Verdict, VerifyError> {
    let stored = match path.precision {
        Precision::F64 => Dtype::F64,
        Precision::F32 | Precision::Tf32 | Precision::Bf16 => Dtype::F32,
    };
    let check = |name, a: &ndarray::Array4<f64>| {
        oracle.compare(name, &a.clone().into_dyn(), stored, path.bound)
    };
    let out = check(OutputName::Out, &result.out)?;
    let fin = check(OutputName::FinalStates, &result.final_states)?;
    Ok(Verdict {
        out: (out.rel_l2, out.max_abs_error),
        final_states: (fin.rel_l2, fin.max_abs_error),
        worst_ratio: out.max_ratio().max(fin.max_ratio()),
        agrees: out.passed() && fin.passed(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_built_in_shape_is_valid() {
        for s in shapes() {
            random_problem(&s.spec, s.seed).unwrap_or_else(|e| panic!("{}: {e}", s.title));
        }
    }
}
