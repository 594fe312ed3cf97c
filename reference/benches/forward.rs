//! Timing of the naive and chunked forward passes at the reference shape.
//!
//! `cargo bench -p ssd-reference --bench forward [-- REPEATS] [-- FILTER]`: batch 2, seqlen
//! 2048, nheads 8, headdim 64, dstate 64, ngroups 8, chunk 64, every option off except the
//! defaults; f64 and f32 (native and TF32 operands). Prints, per path, the median, minimum and
//! maximum wall time of REPEATS runs (default 31) after 3 warm-up runs, plus the chunked
//! stages timed separately; FILTER keeps only the lines whose name contains it. Plain `std::time::Instant` on rayon's global pool. On Linux it also
//! prints the median on-CPU time of all threads together (from `/proc/self/task/*/schedstat`),
//! which a busy machine inflates far less than wall time: on an otherwise idle machine with
//! well-balanced work, wall time is about on-CPU time divided by the thread count.
use std::hint::black_box;
use std::time::Instant;

use ssd_reference::chunked::Schedule;
use ssd_reference::random::{random_problem, ProblemSpec};
use ssd_reference::{
    chunk_cumsum, chunked, compute_out, fwd_pass_state, naive, Dims, MatmulPrecision, Problem, Real,
};

/// On-CPU nanoseconds of all threads of this process so far (Linux: the first field of
/// `/proc/self/task/*/schedstat`), or `None` where that is not available.
fn cpu_ns() -> Option<u64> {
    let mut total = 0;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let stat = std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok()?;
        total += stat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(total)
}

/// Wall-clock statistics (median, min, max) in ms and the median on-CPU time in ms (all
/// threads together) of `repeats` calls after 3 warm-up calls.
struct Timing {
    median: f64,
    min: f64,
    max: f64,
    cpu_median: Option<f64>,
}

fn time<R>(repeats: usize, mut f: impl FnMut() -> R) -> Timing {
    for _ in 0..3 {
        black_box(f());
    }
    let mut wall = Vec::with_capacity(repeats);
    let mut cpu = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let c0 = cpu_ns();
        let t = Instant::now();
        black_box(f());
        wall.push(t.elapsed().as_secs_f64() * 1e3);
        if let (Some(c0), Some(c1)) = (c0, cpu_ns()) {
            cpu.push((c1 - c0) as f64 * 1e-6);
        }
    }
    wall.sort_by(f64::total_cmp);
    cpu.sort_by(f64::total_cmp);
    Timing {
        median: wall[wall.len() / 2],
        min: wall[0],
        max: wall[wall.len() - 1],
        cpu_median: (cpu.len() == repeats).then(|| cpu[cpu.len() / 2]),
    }
}

/// Only names containing this (from the command line) are timed.
static FILTER: std::sync::OnceLock<String> = std::sync::OnceLock::new();

fn wanted(name: &str) -> bool {
    FILTER.get().is_none_or(|f| name.contains(f.as_str()))
}

fn report<R>(name: &str, repeats: usize, f: impl FnMut() -> R) {
    if !wanted(name) {
        return;
    }
    let t = time(repeats, f);
    let cpu = t
        .cpu_median
        .map_or(String::new(), |c| format!("   cpu {c:8.2} ms"));
    println!(
        "{name:<30} median {:8.2} ms   min {:8.2}   max {:8.2}{cpu}",
        t.median, t.min, t.max
    );
}

fn bench<T: Real>(label: &str, p: &Problem<T>, repeats: usize) {
    report(&format!("naive {label}"), repeats, || naive::forward(p));
    let d = *p.dims();
    let dout =
        ndarray::Array4::<T>::from_elem((d.batch, d.seqlen, d.nheads, d.headdim), T::lit(0.5));
    report(&format!("adjoint {label}"), repeats, || {
        ssd_reference::adjoint::backward(p, dout.view(), None)
    });
    report(&format!("chunked {label}"), repeats, || {
        chunked::forward(p, MatmulPrecision::Native)
    });
    report(&format!("chunked {label} tf32"), repeats, || {
        chunked::forward(p, MatmulPrecision::Tf32)
    });
    for schedule in [Schedule::Staged, Schedule::Fused] {
        report(&format!("chunked {label} {schedule:?}"), repeats, || {
            chunked::forward_with(p, MatmulPrecision::Native, schedule)
        });
    }
    let cs = chunk_cumsum::chunk_cumsum(p);
    let local = fwd_pass_state::chunk_state(p, &cs, MatmulPrecision::Native);
    let st = fwd_pass_state::fwd_pass_state(p, &cs, MatmulPrecision::Native);
    report(&format!("  chunk_cumsum {label}"), repeats, || {
        chunk_cumsum::chunk_cumsum(p)
    });
    report(&format!("  chunk_state {label}"), repeats, || {
        fwd_pass_state::chunk_state(p, &cs, MatmulPrecision::Native)
    });
    report(&format!("  state_passing+clone {label}"), repeats, || {
        let mut s = local.clone();
        fwd_pass_state::state_passing(p, &cs, &mut s)
    });
    report(&format!("  clone of the states {label}"), repeats, || {
        local.clone()
    });
    report(&format!("  compute_out {label}"), repeats, || {
        compute_out::compute_out(p, &cs, &st.chunk_states, MatmulPrecision::Native)
    });
}

/// The chunked forward's stages in sequence, each timed (median over `repeats` runs).
fn stages_in_sequence<T: Real>(label: &str, p: &Problem<T>, repeats: usize) {
    let name = format!("stages in sequence {label}");
    if !wanted(&name) {
        return;
    }
    let mut ms = vec![Vec::new(); 4];
    for _ in 0..repeats + 3 {
        let t = Instant::now();
        let cs = chunk_cumsum::chunk_cumsum(p);
        let t1 = Instant::now();
        let st = fwd_pass_state::fwd_pass_state(p, &cs, MatmulPrecision::Native);
        let t2 = Instant::now();
        let out = compute_out::compute_out(p, &cs, &st.chunk_states, MatmulPrecision::Native);
        let t3 = Instant::now();
        black_box((cs, st, out));
        for (k, d) in [t1 - t, t2 - t1, t3 - t2, t3 - t].iter().enumerate() {
            ms[k].push(d.as_secs_f64() * 1e3);
        }
    }
    let med = |v: &mut Vec<f64>| {
        v.drain(..3);
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "{name:<30} cumsum {:.2}  fwd_pass_state {:.2}  compute_out {:.2}  total {:.2} ms (medians)",
        med(&mut ms[0]),
        med(&mut ms[1]),
        med(&mut ms[2]),
        med(&mut ms[3])
    );
}

fn main() {
    let mut repeats = 31;
    for arg in std::env::args().skip(1).filter(|a| a != "--bench") {
        match arg.parse::<usize>() {
            Ok(n) => repeats = n.max(1),
            Err(_) => {
                FILTER.set(arg).ok();
            }
        }
    }
    let dims = Dims {
        batch: 2,
        seqlen: 2048,
        nheads: 8,
        headdim: 64,
        ngroups: 8,
        dstate: 64,
    };
    let p64 = random_problem(&ProblemSpec::plain(dims), 1).expect("valid spec");
    let p32 = p64.cast::<f32>();
    println!(
        "shape {dims:?}, chunk_size {}, rayon threads {}, {repeats} repeats",
        p64.options().chunk_size,
        rayon::current_num_threads()
    );
    bench("f64", &p64, repeats);
    stages_in_sequence("f64", &p64, repeats);
    bench("f32", &p32, repeats);
    stages_in_sequence("f32", &p32, repeats);
}
