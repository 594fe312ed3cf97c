//! Times the GPU forward on the shapes of the speed issue, with CUDA events: warm-up, then the
//! median of many runs, input sets rotated so that the 60 MB L2 does not flatter us, random
//! non-zero data from `ssd_reference::random::random_problem` (dt already activated, D per
//! head, initial states in, final states out), once with fp32 activations (TF32 products) and
//! once with bf16 activations (`x`, `B`, `C`, `out` in bf16, bf16 products). Also each stage's
//! share. Prints a table and one `BENCH_JSON {...}` line per shape and dtype for scripts
//! (`"dtype"`: `"f32"` or `"bf16"`). The forward is timed into outputs that do not keep
//! `chunk_states` (`DeviceOutputs::set_keep_chunk_states(false)`: `out` and the final states,
//! what the anchors return), and once more with it kept (`"kept_ms"`).
//!
//! Then the serving shape: 64 requests of 19 to 3,982 tokens (64,783 in all) packed into one row
//! at the 2.7B layer's sizes, through the packed path (`Gpu::forward_packed_into`: `out`, the
//! final state and every request's final state), without and with one initial state per
//! request; one `SERVING_JSON {...}` line each, with the lengths, for scripts.
//!
//! `cargo bench -p ssd-gpu --bench forward [-- --reps N] [--only K[,K...]] [--dtype D]` (`--only
//! K`: the K-th shape alone, from 0, e.g. under a profiler, or those of a list; 5 is the serving
//! shape; `--dtype f32` or `bf16`: that dtype's table alone). `SSD_GPU_V1=1`,
//! `SSD_GPU_PAIR=0`, `SSD_GPU_CHAINED=0` or `SSD_GPU_WG=0` in the environment times another
//! variant (`GpuConfig::from_env`). Without a GPU it says so and exits 0.

use std::sync::Arc;

use cudarc::driver::{sys::CUevent_flags, CudaEvent, CudaStream};
use ssd_gpu::{Bf16, DeviceInputs, DeviceOutputs, Gpu, GpuConfig, GpuError, IoElement};
use ssd_reference::random::{random_problem, DSkip, ProblemSpec, SpecRng};
use ssd_reference::serving::Packing;
use ssd_reference::{Dims, Options, Problem};

/// (batch, seqlen, nheads, headdim, dstate, ngroups, chunk)
const SHAPES: [(usize, usize, usize, usize, usize, usize, usize); 5] = [
    (4, 4096, 80, 64, 128, 1, 256),
    (8, 8192, 80, 64, 128, 1, 256),
    (8, 2048, 24, 64, 128, 1, 256),
    (4, 16384, 8, 64, 128, 1, 128),
    (4, 65536, 8, 64, 256, 1, 128),
];

fn problem(dims: Dims, options: Options, seed: u64) -> Result<Problem<f32>, GpuError> {
    let spec = ProblemSpec {
        options,
        d: DSkip::PerHead,
        initial_states: true,
        ..ProblemSpec::plain(dims)
    };
    let problem = random_problem(&spec, seed)
        .map_err(|e| GpuError::Unsupported(format!("random problem: {e}")))?;
    Ok(problem.cast::<f32>())
}

/// The inputs with activations in `T`.
trait Upload: IoElement {
    const NAME: &'static str;
    fn upload(gpu: &Gpu, p: &Problem<f32>) -> Result<DeviceInputs<Self>, GpuError>;
}
impl Upload for f32 {
    const NAME: &'static str = "f32";
    fn upload(gpu: &Gpu, p: &Problem<f32>) -> Result<DeviceInputs<f32>, GpuError> {
        gpu.upload(p)
    }
}
impl Upload for Bf16 {
    const NAME: &'static str = "bf16";
    fn upload(gpu: &Gpu, p: &Problem<f32>) -> Result<DeviceInputs<Bf16>, GpuError> {
        gpu.upload_bf16(p)
    }
}

fn median(mut v: Vec<f32>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2] as f64
}

struct Events {
    marks: Vec<CudaEvent>,
}

impl Events {
    fn new(stream: &Arc<CudaStream>, n: usize) -> Result<Self, GpuError> {
        let ctx = stream.context();
        let marks = (0..n)
            .map(|_| ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)))
            .collect::<Result<_, _>>()?;
        Ok(Events { marks })
    }
}

fn bench<T: Upload>(
    gpu: &Gpu,
    shape: (usize, usize, usize, usize, usize, usize, usize),
    reps: usize,
) -> Result<String, GpuError> {
    let (batch, seqlen, nheads, headdim, dstate, ngroups, chunk) = shape;
    let dims = Dims::new(batch, seqlen, nheads, headdim, ngroups, dstate);
    let options = Options {
        chunk_size: chunk,
        dt_softplus: false,
        dt_limit: (0.0, f64::INFINITY),
    };
    // Minimal bytes: read x, dt, B, C, initial states once; write out and final states once
    // (x, B, C and out in T, the rest f32).
    let (f, a) = (4.0, std::mem::size_of::<T>() as f64);
    let bytes = a * (2.0 * (batch * seqlen * nheads * headdim) as f64)
        + f * (batch * seqlen * nheads) as f64
        + a * (2.0 * (batch * seqlen * ngroups * dstate) as f64)
        + f * (2.0 * (batch * nheads * headdim * dstate) as f64);
    let set_bytes = bytes;
    let sets = ((3.0 * 60e6 / set_bytes).ceil() as usize).clamp(2, 8);
    // The sets are made on one thread each (a serial generator: tens of seconds a set at the
    // largest shapes), then uploaded in order.
    let problems: Vec<Result<Problem<f32>, GpuError>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..sets)
            .map(|k| s.spawn(move || problem(dims, options, 1000 + 10 * k as u64)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("random problem thread panicked"))
            .collect()
    });
    let ins: Vec<DeviceInputs<T>> = problems
        .into_iter()
        .map(|p| T::upload(gpu, &p?))
        .collect::<Result<_, _>>()?;
    // The forward as a caller that needs `out` and `final_states` runs it (the anchors
    // return those); timed again below with `chunk_states` kept.
    let mut outs: DeviceOutputs<T> = gpu.alloc_outputs(&dims, &options)?;
    outs.set_keep_chunk_states(false);
    for k in 0..3 {
        gpu.forward_into(&ins[k % sets], &mut outs)?;
    }
    gpu.synchronize()?;
    let ev = Events::new(gpu.stream(), 4)?;
    let stream = gpu.stream();
    let (mut total, mut s1, mut s2, mut s3) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for r in 0..reps {
        let i = &ins[r % sets];
        ev.marks[0].record(stream)?;
        gpu.chunk_cumsum(i, &mut outs)?;
        ev.marks[1].record(stream)?;
        gpu.fwd_pass_state(i, &mut outs)?;
        ev.marks[2].record(stream)?;
        gpu.compute_out(i, &mut outs)?;
        ev.marks[3].record(stream)?;
        s1.push(ev.marks[0].elapsed_ms(&ev.marks[1])?);
        s2.push(ev.marks[1].elapsed_ms(&ev.marks[2])?);
        s3.push(ev.marks[2].elapsed_ms(&ev.marks[3])?);
        total.push(ev.marks[0].elapsed_ms(&ev.marks[3])?);
    }
    let (t, a, b, c) = (median(total), median(s1), median(s2), median(s3));
    outs.set_keep_chunk_states(true);
    let mut kept = Vec::new();
    for r in 0..reps {
        ev.marks[0].record(stream)?;
        gpu.forward_into(&ins[r % sets], &mut outs)?;
        ev.marks[1].record(stream)?;
        kept.push(ev.marks[0].elapsed_ms(&ev.marks[1])?);
    }
    let kept = median(kept);
    let kind = |pair: bool| if pair { "pair" } else { "single" };
    let (state_pair, out_pair) = gpu.uses_pair_kernels(&dims, &options);
    let (state_kernel, out_kernel) = (kind(state_pair), kind(out_pair));
    // Stage 3 on the Hopper output kernel (bf16, Variant::V3, where it serves; no seq_idx here).
    let out_kernel = if T::BF16 && gpu.runs_wg_out(&dims, &options, false) {
        "wgmma"
    } else {
        out_kernel
    };
    // Stage 2 as the walking kernel with `h` units a block, the segmented walk in `n` segments,
    // or as one chained kernel (Variant::V3, where they serve, in that order:
    // `Gpu::forward_into`'s choice; no seq_idx here).
    let state_kernel = if let Some(h) = gpu.state_walk_units(&dims, &options, T::BF16) {
        format!("walk{h}")
    } else if let Some((_, n)) = gpu.state_walk_segments(&dims, &options, T::BF16, false) {
        format!("walkseg{n}")
    } else if gpu.uses_chained(&dims, &options) {
        "chained".to_string()
    } else {
        state_kernel.to_string()
    };
    let gbs = bytes / (t * 1e-3) / 1e9;
    println!(
        "{:>4} {:>2} {:>6} {:>3} {:>3} {:>4} {:>2} {:>4} | ours {:>8.3} ms (chunk_states kept {kept:.3}) | cumsum {:>4.1}% state {:>4.1}% out {:>4.1}% | {:>6.0} GB/s of minimal bytes | kernels stage 2 {state_kernel}, output {out_kernel}",
        T::NAME, batch, seqlen, nheads, headdim, dstate, ngroups, chunk, t,
        100.0 * a / (a + b + c), 100.0 * b / (a + b + c), 100.0 * c / (a + b + c), gbs
    );
    Ok(format!(
        "{{\"dtype\":\"{}\",\"shape\":[{batch},{seqlen},{nheads},{headdim},{dstate},{ngroups},{chunk}],\"ours_ms\":{t:.4},\"kept_ms\":{kept:.4},\"cumsum_ms\":{a:.4},\"state_ms\":{b:.4},\"out_ms\":{c:.4},\"state_kernel\":\"{state_kernel}\",\"out_kernel\":\"{out_kernel}\",\"min_bytes\":{bytes:.0},\"reps\":{reps},\"input_sets\":{sets}}}",
        T::NAME
    ))
}

/// The serving shape's request lengths: 16 * 256^(((i + 0.5) / 64)^0.65) tokens for i < 64
/// (19 to 3,982, 64,783 in all), in a seeded shuffled order.
fn serving_lengths() -> Vec<usize> {
    let mut lens: Vec<usize> = (0..64)
        .map(|i| (16.0 * 256f64.powf(((i as f64 + 0.5) / 64.0).powf(0.65))).round() as usize)
        .collect();
    let mut rng = SpecRng::new(64);
    for i in (1..lens.len()).rev() {
        lens.swap(i, rng.range(0, i));
    }
    lens
}

/// The serving shape (nheads 80, headdim 64, dstate 128, ngroups 1, chunk 256), through the
/// packed path, with one initial state per request or none.
fn bench_serving(gpu: &Gpu, reps: usize, per_request_states: bool) -> Result<String, GpuError> {
    let lens = serving_lengths();
    let total: usize = lens.iter().sum();
    let (nheads, headdim, dstate, chunk) = (80, 64, 128, 256);
    let dims = Dims::new(1, total, nheads, headdim, 1, dstate);
    let options = Options {
        chunk_size: chunk,
        dt_softplus: false,
        dt_limit: (0.0, f64::INFINITY),
    };
    let spec = ProblemSpec {
        options,
        d: DSkip::PerHead,
        ..ProblemSpec::plain(dims)
    };
    let mut cu = vec![0usize];
    for l in &lens {
        cu.push(cu.last().copied().unwrap_or(0) + l);
    }
    let nseq = lens.len();
    let state = nheads * headdim * dstate;
    let mut packing = Packing::<f32>::new(cu);
    if per_request_states {
        let mut rng = SpecRng::new(7);
        packing.seq_initial_states = Some(ndarray::Array4::from_shape_fn(
            (nseq, nheads, headdim, dstate),
            |_| (2.0 * rng.unit() - 1.0) as f32,
        ));
    }
    let sets = 2;
    let mut ins = Vec::new();
    for k in 0..sets {
        let p = random_problem(&spec, 2000 + k as u64)
            .map_err(|e| GpuError::Unsupported(format!("random problem: {e}")))?;
        ins.push(gpu.upload_packed(&p.cast::<f32>(), &packing)?);
    }
    let mut outs = gpu.alloc_outputs(&dims, &options)?;
    let mut serving = gpu.alloc_serving_outputs(&ins[0].1)?;
    for k in 0..3 {
        let (i, k) = &ins[k % sets];
        gpu.forward_packed_into(i, k, &mut outs, &mut serving)?;
    }
    gpu.synchronize()?;
    let ev = Events::new(gpu.stream(), 2)?;
    let stream = gpu.stream();
    let mut total_ms = Vec::new();
    for r in 0..reps {
        let (i, k) = &ins[r % sets];
        ev.marks[0].record(stream)?;
        gpu.forward_packed_into(i, k, &mut outs, &mut serving)?;
        ev.marks[1].record(stream)?;
        total_ms.push(ev.marks[0].elapsed_ms(&ev.marks[1])?);
    }
    let t = median(total_ms);
    // Of which the three stages alone (the same inputs and seq_idx, no packing tables).
    let mut stages_ms = Vec::new();
    for r in 0..reps {
        let (i, _) = &ins[r % sets];
        ev.marks[0].record(stream)?;
        gpu.forward_into(i, &mut outs)?;
        ev.marks[1].record(stream)?;
        stages_ms.push(ev.marks[0].elapsed_ms(&ev.marks[1])?);
    }
    let stages = median(stages_ms);
    // Minimal bytes: read x, dt, B, C (and the initial states), write out and the states.
    let f = 4.0;
    let states = if per_request_states {
        2 * nseq + 1
    } else {
        nseq + 1
    };
    let bytes = f
        * (2.0 * (total * nheads * headdim) as f64
            + (total * nheads) as f64
            + 2.0 * (total * dstate) as f64
            + (states * state) as f64);
    println!(
        "serving: {nseq} requests, {total} tokens, H {nheads} P {headdim} N {dstate} Q {chunk}, initial states per request {per_request_states} | ours {t:>8.3} ms (three stages alone {stages:.3} ms) | {:>6.0} GB/s of minimal bytes",
        bytes / (t * 1e-3) / 1e9
    );
    let lens_json: Vec<String> = lens.iter().map(|l| l.to_string()).collect();
    Ok(format!(
        "{{\"lens\":[{}],\"shape\":[1,{total},{nheads},{headdim},{dstate},1,{chunk}],\"per_request_states\":{per_request_states},\"ours_ms\":{t:.4},\"stages_ms\":{stages:.4},\"min_bytes\":{bytes:.0},\"reps\":{reps}}}",
        lens_json.join(",")
    ))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let reps = args
        .iter()
        .position(|a| a == "--reps")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(30usize);
    // `--only K` or `--only K,L,...`: those shapes alone (0 to SHAPES.len(), the last the
    // serving shape).
    let only: Option<Vec<usize>> = args
        .iter()
        .position(|a| a == "--only")
        .map(|i| args.get(i + 1).map_or("", String::as_str))
        .map(|v| {
            v.split(',')
                .map(|k| k.trim().parse().ok().filter(|&k| k <= SHAPES.len()))
                .collect::<Option<_>>()
                .unwrap_or_else(|| {
                    eprintln!(
                        "--only {v:?}: expected shape indices 0 to {}, e.g. 1,0",
                        SHAPES.len()
                    );
                    std::process::exit(2);
                })
        });
    let chosen = |k: usize| only.as_ref().is_none_or(|o| o.contains(&k));
    let dtype: Option<String> = args
        .iter()
        .position(|a| a == "--dtype")
        .and_then(|i| args.get(i + 1))
        .cloned();
    if let Some(d) = dtype.as_deref().filter(|d| !matches!(*d, "f32" | "bf16")) {
        eprintln!("--dtype {d}: expected f32 or bf16");
        std::process::exit(2);
    }
    if args.iter().any(|a| a == "--list" || a == "--test") {
        return; // `cargo test --benches` runs nothing
    }
    let gpu = match Gpu::with_config(GpuConfig::from_env()) {
        Ok(g) => g,
        Err(e @ (GpuError::NoDriver(_) | GpuError::NoDevice(_))) => {
            println!("skipped: no CUDA device ({e})");
            return;
        }
        Err(e) => {
            eprintln!("the GPU could not be set up: {e}");
            std::process::exit(1);
        }
    };
    println!(
        "ssd-gpu forward on {} ({}, {:?}), f32 activations with TF32 products, then bf16 activations with bf16 products, median of {reps} (CUDA events)",
        gpu.device_name(),
        gpu.target(),
        gpu.config().variant
    );
    match gpu.kernel_resources() {
        Ok(list) => {
            for (name, regs, local, blocks) in list {
                println!(
                    "kernel {name}: {regs} registers, {local} bytes local, {blocks} blocks per SM"
                );
            }
        }
        Err(e) => println!("kernel resources unavailable: {e}"),
    }
    println!("dtype b      L   H   P    N  G    Q");
    let mut json = Vec::new();
    for bf16 in [false, true] {
        if dtype
            .as_deref()
            .is_some_and(|d| d != if bf16 { "bf16" } else { "f32" })
        {
            continue;
        }
        for (k, shape) in SHAPES.into_iter().enumerate() {
            if !chosen(k) {
                continue;
            }
            let got = if bf16 {
                bench::<Bf16>(&gpu, shape, reps)
            } else {
                bench::<f32>(&gpu, shape, reps)
            };
            match got {
                Ok(j) => json.push(j),
                Err(e) => println!("{shape:?}: {e}"),
            }
        }
    }
    for j in json {
        println!("BENCH_JSON {j}");
    }
    if chosen(SHAPES.len()) {
        for per_request_states in [false, true] {
            match bench_serving(&gpu, reps, per_request_states) {
                Ok(j) => println!("SERVING_JSON {j}"),
                Err(e) => println!("serving shape: {e}"),
            }
        }
    }
}
