//! The `ssd-oracle` command line: one variant of [`Command`] per subcommand, each handled in
//! `cli/<name>.rs` by a `run(&Args) -> Result<ExitCode, VerifyError>`.
//!
//! This module tree belongs to the binary: whatever another program could reuse (reading
//! cases, the tolerance model, ...) lives in the `ssd_verify` library and is used from here.
//!
//! Errors reach the user as one line, `error: <message>`, on stderr, with exit status 2
//! ("unusable input"); 1 is kept for verdicts ("the candidate is wrong").

pub mod check;
pub mod demo;
pub mod gen;
pub mod grad;
pub mod run;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand, ValueEnum};
use ssd_reference::{chunked, naive, ChunkedOutput, MatmulPrecision, Output, Problem};
use ssd_verify::fixture::{FloatDtype, Outputs};
use ssd_verify::VerifyError;

const ABOUT: &str = "An oracle for Mamba-2 SSD kernels: the forward pass of mamba_ssm's \
mamba_chunk_scan_combined, computed on the CPU.";

const AFTER_HELP: &str = "With no subcommand, runs the built-in demonstration (same as `ssd-oracle demo`).\n\
Cases use the ssd-fixture/1 format (a JSON manifest plus a safetensors file): see docs/fixture-format.md.";

#[derive(Debug, Parser)]
#[command(name = "ssd-oracle", version, about = ABOUT, after_help = AFTER_HELP)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

/// One variant per subcommand.
#[derive(Debug, Subcommand)]
enum Command {
    /// Compute a case with one implementation and write its outputs to a safetensors file.
    Run(run::Args),
    /// Compare the implementations on built-in random problems, from tiny to a realistic
    /// Mamba-2 layer (what runs with no arguments).
    Demo(demo::Args),
    /// Check a kernel's outputs against a case, element by element, within the error bound of
    /// the arithmetic it claims (exit 0 pass, 1 fail, 2 unusable input).
    Check(check::Args),
    /// Write a suite of fixture cases with their float64 expected outputs and magnitudes.
    Gen(gen::Args),
    /// Compute the gradients of a case's forward from its upstream gradients (`dout`,
    /// optionally `dfinal_states`) by the adjoint recurrence, and write them.
    Grad(grad::Args),
}

/// Parses the command line, runs the subcommand, and turns any error into one line on stderr.
pub fn main() -> ExitCode {
    install_panic_hook();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return clap_error(e),
    };
    let result = match cli.command {
        None => demo::run(&demo::Args::default()),
        Some(Command::Run(args)) => run::run(&args),
        Some(Command::Demo(args)) => demo::run(&args),
        Some(Command::Check(args)) => check::run(&args),
        Some(Command::Gen(args)) => gen::run(&args),
        Some(Command::Grad(args)) => grad::run(&args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", one_line(&e.to_string()));
            ExitCode::from(e.exit_code())
        }
    }
}

/// Help and version go out as clap prints them; usage errors become one line, exit status 2.
fn clap_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    match e.kind() {
        ErrorKind::DisplayHelp
        | ErrorKind::DisplayVersion
        | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = e.print();
            ExitCode::SUCCESS
        }
        _ => {
            let text = e.render().to_string();
            let parts: Vec<&str> = text
                .lines()
                .map(str::trim)
                .take_while(|l| !l.starts_with("Usage:"))
                .filter(|l| !l.is_empty() && !l.starts_with("For more information"))
                .collect();
            let msg = parts.join(" ");
            let msg = msg.strip_prefix("error: ").unwrap_or(&msg);
            eprintln!("error: {msg} (see `ssd-oracle --help`)");
            ExitCode::from(2)
        }
    }
}

/// Collapses a message onto one line.
fn one_line(msg: &str) -> String {
    msg.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// A bug must still end as one line on stderr, not a multi-line panic report (unless a
/// backtrace was asked for with RUST_BACKTRACE).
fn install_panic_hook() {
    if std::env::var_os("RUST_BACKTRACE").is_some() {
        return;
    }
    std::panic::set_hook(Box::new(|info| {
        let payload = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_string());
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        eprintln!(
            "error: internal error, a bug in ssd-oracle: {}{at} (rerun with RUST_BACKTRACE=1 for details)",
            one_line(&payload)
        );
    }));
}

/// Which implementation computes the forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Impl {
    /// The time-step recurrence, token by token (the ground truth in f64).
    Naive,
    /// The chunked jump formula, stage by stage as the GPU kernels run it.
    Chunked,
    /// The CUDA kernels of the ssd-gpu crate.
    Gpu,
}

impl Impl {
    pub fn name(self) -> &'static str {
        match self {
            Impl::Naive => "naive",
            Impl::Chunked => "chunked",
            Impl::Gpu => "gpu",
        }
    }

    /// The precision used when none is asked for: f64 on the CPU, tf32 on the GPU.
    pub fn default_precision(self) -> Precision {
        match self {
            Impl::Gpu => Precision::Tf32,
            Impl::Naive | Impl::Chunked => Precision::F64,
        }
    }
}

/// The arithmetic a computation uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Precision {
    /// float64 throughout.
    F64,
    /// float32 throughout (the inputs rounded to f32 first).
    F32,
    /// float32 with every matrix-product operand rounded to TF32 (chunked path only).
    Tf32,
    /// float32 with `x`, `B`, `C`, `z` rounded to bfloat16 first and every matrix-product
    /// operand rounded to bfloat16 (chunked path only): a bf16 tensor-core kernel's arithmetic.
    Bf16,
}

impl Precision {
    pub fn name(self) -> &'static str {
        match self {
            Precision::F64 => "f64",
            Precision::F32 => "f32",
            Precision::Tf32 => "tf32",
            Precision::Bf16 => "bf16",
        }
    }

    /// The dtype outputs computed in this precision are stored as.
    /// The dtype `out` is stored in by `imp` at this precision: BF16 from the GPU's bf16
    /// kernels (they write it so), else [`Precision::store_dtype`].
    pub fn out_dtype(self, imp: Impl) -> FloatDtype {
        if imp == Impl::Gpu && self == Precision::Bf16 {
            FloatDtype::BF16
        } else {
            self.store_dtype()
        }
    }

    pub fn store_dtype(self) -> FloatDtype {
        match self {
            Precision::F64 => FloatDtype::F64,
            Precision::F32 | Precision::Tf32 | Precision::Bf16 => FloatDtype::F32,
        }
    }
}

/// Refuses combinations that cannot run, before any work is done.
///
/// # Errors
/// [`VerifyError::Usage`] for TF32 with the naive path (it has no matrix products);
/// [`VerifyError::Unavailable`] for the GPU while it is not wired in.
pub fn check_combination(imp: Impl, precision: Precision) -> Result<(), VerifyError> {
    if imp == Impl::Naive && matches!(precision, Precision::Tf32 | Precision::Bf16) {
        return Err(VerifyError::Usage(format!(
            "--precision {} needs --impl chunked: the naive recurrence has no matrix products to round",
            precision.name()
        )));
    }
    if imp == Impl::Gpu {
        gpu_available()?;
        if !matches!(precision, Precision::Tf32 | Precision::Bf16) {
            return Err(VerifyError::Usage(format!(
                "--impl gpu computes in tf32 (f32 inputs, TF32 tensor-core products) or bf16 (bf16 x, B, C, z and out, bf16 products), not {}",
                precision.name()
            )));
        }
    }
    Ok(())
}

/// The most memory the outputs of one computation may take: beyond it a run is refused up front
/// rather than aborted by a failed allocation.
const MAX_OUTPUT_BYTES: u128 = 16 << 30;

/// Refuses a problem whose outputs would not fit in memory (a huge `chunk_size` pads
/// `dA_cumsum` and `chunk_states` on the chunked path).
///
/// # Errors
/// [`VerifyError::Usage`] naming the sizes.
pub fn check_output_size(problem: &Problem<f64>, imp: Impl) -> Result<(), VerifyError> {
    let d = problem.dims();
    let [b, s, h, p, n] = [d.batch, d.seqlen, d.nheads, d.headdim, d.dstate].map(|v| v as u128);
    let chunk = problem.options().chunk_size as u128;
    let nchunks = problem.nchunks() as u128;
    let mut elements = b * s * h * p + b * h * p * n;
    if imp != Impl::Naive {
        elements += b * h * nchunks * chunk + b * nchunks * h * p * n;
    }
    let bytes = elements * 8;
    if bytes <= MAX_OUTPUT_BYTES {
        return Ok(());
    }
    let gib = bytes as f64 / (1u64 << 30) as f64;
    Err(VerifyError::Usage(format!(
        "the outputs of --impl {} would take {gib:.0} GiB (dA_cumsum is [batch, nheads, nchunks, chunk_size] = [{b}, {h}, {nchunks}, {chunk}], chunk_states [{b}, {nchunks}, {h}, {p}, {n}]), more than the {} GiB allowed; a smaller chunk_size gives the same out and final_states",
        imp.name(),
        MAX_OUTPUT_BYTES >> 30
    )))
}

/// The problem in the precision a computation reads: `f64` as given, or rounded to `f32`.
pub enum Prepared<'a> {
    F64(&'a Problem<f64>),
    F32(Box<Problem<f32>>),
}

impl<'a> Prepared<'a> {
    /// Converts once, so that repeated timings measure the computation alone.
    ///
    /// # Errors
    /// [`VerifyError::Usage`] when an input overflows bfloat16 (`--precision bf16`).
    pub fn new(problem: &'a Problem<f64>, precision: Precision) -> Result<Self, VerifyError> {
        Ok(match precision {
            Precision::F64 => Prepared::F64(problem),
            Precision::F32 | Precision::Tf32 => Prepared::F32(Box::new(problem.cast::<f32>())),
            Precision::Bf16 => Prepared::F32(Box::new(
                ssd_verify::fixture::round_inputs(problem, FloatDtype::BF16)?.cast::<f32>(),
            )),
        })
    }
}

/// Computes the forward pass of `problem` with `imp` in `precision` and returns the outputs
/// (widened to f64, exactly) and the time spent in the computation itself (no conversion, no
/// file I/O).
///
/// # Errors
/// As [`check_combination`].
pub fn compute(
    problem: &Prepared<'_>,
    imp: Impl,
    precision: Precision,
) -> Result<(Outputs<f64>, Duration), VerifyError> {
    let (computed, took) = compute_reusing(problem, imp, precision, None)?;
    Ok((computed.into_outputs(), took))
}

/// A result in the precision it was computed in, which the next computation of the same
/// problem can write into ([`compute_reusing`]).
pub enum Computed {
    NaiveF64(Output<f64>),
    NaiveF32(Output<f32>),
    ChunkedF64(ChunkedOutput<f64>),
    ChunkedF32(ChunkedOutput<f32>),
    Gpu(Outputs<f64>),
}

impl Computed {
    /// The outputs widened to f64 (moved, not copied, when they are f64 already).
    pub fn into_outputs(self) -> Outputs<f64> {
        match self {
            Computed::NaiveF64(o) => Outputs::from(o),
            Computed::ChunkedF64(o) => Outputs::from(o),
            Computed::NaiveF32(o) => Outputs::from(o).to_f64(),
            Computed::ChunkedF32(o) => Outputs::from(o).to_f64(),
            Computed::Gpu(o) => o,
        }
    }
}

/// [`compute`], writing into the arrays of `previous` (an earlier result of the same problem,
/// implementation and precision) where the implementation allows: the CPU paths then allocate
/// no outputs, so that repeated timings measure the computation, not the operating system
/// mapping fresh pages for every call's outputs. The result is the same either way.
///
/// # Errors
/// As [`check_combination`].
pub fn compute_reusing(
    problem: &Prepared<'_>,
    imp: Impl,
    precision: Precision,
    previous: Option<Computed>,
) -> Result<(Computed, Duration), VerifyError> {
    check_combination(imp, precision)?;
    let matmul = match precision {
        Precision::Tf32 => MatmulPrecision::Tf32,
        Precision::Bf16 => MatmulPrecision::Bf16,
        Precision::F64 | Precision::F32 => MatmulPrecision::Native,
    };
    Ok(match (imp, problem, previous) {
        (Impl::Naive, Prepared::F64(p), Some(Computed::NaiveF64(mut o))) => {
            let took = timed(|| naive::forward_into(*p, &mut o));
            (Computed::NaiveF64(o), took)
        }
        (Impl::Naive, Prepared::F64(p), _) => {
            let (o, took) = timed_value(|| naive::forward(*p));
            (Computed::NaiveF64(o), took)
        }
        (Impl::Naive, Prepared::F32(p), Some(Computed::NaiveF32(mut o))) => {
            let took = timed(|| naive::forward_into(p, &mut o));
            (Computed::NaiveF32(o), took)
        }
        (Impl::Naive, Prepared::F32(p), _) => {
            let (o, took) = timed_value(|| naive::forward(p));
            (Computed::NaiveF32(o), took)
        }
        (Impl::Chunked, Prepared::F64(p), Some(Computed::ChunkedF64(mut o))) => {
            let took = timed(|| chunked::forward_into(*p, matmul, &mut o));
            (Computed::ChunkedF64(o), took)
        }
        (Impl::Chunked, Prepared::F64(p), _) => {
            let (o, took) = timed_value(|| chunked::forward(*p, matmul));
            (Computed::ChunkedF64(o), took)
        }
        (Impl::Chunked, Prepared::F32(p), Some(Computed::ChunkedF32(mut o))) => {
            let took = timed(|| chunked::forward_into(p, matmul, &mut o));
            (Computed::ChunkedF32(o), took)
        }
        (Impl::Chunked, Prepared::F32(p), _) => {
            let (o, took) = timed_value(|| chunked::forward(p, matmul));
            (Computed::ChunkedF32(o), took)
        }
        (Impl::Gpu, _, _) => {
            let (o, took) = gpu_forward(problem, precision)?;
            (Computed::Gpu(o), took)
        }
    })
}

fn timed(f: impl FnOnce()) -> Duration {
    let start = Instant::now();
    f();
    start.elapsed()
}

fn timed_value<R>(f: impl FnOnce() -> R) -> (R, Duration) {
    let start = Instant::now();
    let r = f();
    (r, start.elapsed())
}

// ---------------------------------------------------------------------------------------------
// GPU hook: the ssd-gpu crate plugs in here (availability check and the forward pass).

/// Whether the GPU implementation can run here: a CUDA driver, a device, and kernels that compile.
///
/// # Errors
/// [`VerifyError::Unavailable`] with the reason (e.g. "no CUDA driver: ...").
pub fn gpu_available() -> Result<(), VerifyError> {
    ssd_gpu::gpu_for(ssd_gpu::GpuConfig::from_env())
        .map(|_| ())
        .map_err(|e| VerifyError::Unavailable(e.to_string()))
}

/// The GPU forward pass: uploads the f32 problem (its activations as bf16 at `--precision
/// bf16`, where [`Prepared::new`] has rounded them already), times the kernels alone (launch to
/// synchronisation), downloads every output and widens it to f64.
fn gpu_forward(
    problem: &Prepared<'_>,
    precision: Precision,
) -> Result<(Outputs<f64>, Duration), VerifyError> {
    let Prepared::F32(p) = problem else {
        return Err(VerifyError::Usage(format!(
            "--impl gpu computes in tf32 or bf16, not {}",
            precision.name()
        )));
    };
    let unavailable = |e: ssd_gpu::GpuError| VerifyError::Unavailable(e.to_string());
    // The kernel variant from the environment (`SSD_GPU_V1=1`, `SSD_GPU_PAIR=0`, `SSD_GPU_CHAINED=0`; see
    // `GpuConfig::from_env`), the default one otherwise.
    let gpu = ssd_gpu::gpu_for(ssd_gpu::GpuConfig::from_env()).map_err(unavailable)?;
    fn timed<T: ssd_gpu::IoElement>(
        gpu: &ssd_gpu::Gpu,
        inputs: &ssd_gpu::DeviceInputs<T>,
    ) -> Result<(ssd_reference::ChunkedOutput<f32>, Duration), ssd_gpu::GpuError> {
        let start = Instant::now();
        let outputs = gpu.forward_device(inputs)?;
        gpu.synchronize()?;
        let took = start.elapsed();
        Ok((gpu.download(&outputs)?, took))
    }
    let (host, took) = if precision == Precision::Bf16 {
        timed(&gpu, &gpu.upload_bf16(p).map_err(unavailable)?)
    } else {
        timed(&gpu, &gpu.upload(p).map_err(unavailable)?)
    }
    .map_err(unavailable)?;
    Ok((Outputs::from(host).to_f64(), took))
}
