//! Timing of the naive and chunked forward passes at the reference shape.
//!
//! `cargo bench -p ssd-reference --bench forward` (optionally `-- REPEATS`): batch 2, seqlen
//! 2048, nheads 8, headdim 64, dstate 64, ngroups 8, chunk 64, every option off except the
//! defaults; f64 and f32 (native and TF32 operands). Prints, per path, the median, minimum and
//! maximum wall time of REPEATS runs (default 31) after 3 warm-up runs, plus the chunked
//! stages timed separately. Plain `std::time::Instant` on rayon's global pool.
use std::hint::black_box;
use std::time::Instant;

use ssd_reference::random::{random_problem, ProblemSpec};
use ssd_reference::{
    chunk_cumsum, chunked, compute_out, fwd_pass_state, naive, Dims, MatmulPrecision, Problem, Real,
};

fn time<R>(repeats: usize, mut f: impl FnMut() -> R) -> (f64, f64, f64) {
    for _ in 0..3 {
        black_box(f());
    }
    let mut ms: Vec<f64> = (0..repeats)
        .map(|_| {
            let t = Instant::now();
            black_box(f());
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    (ms[ms.len() / 2], ms[0], ms[ms.len() - 1])
}

fn report(name: &str, (median, min, max): (f64, f64, f64)) {
    println!("{name:<34} median {median:8.2} ms   min {min:8.2}   max {max:8.2}");
}

fn bench<T: Real>(label: &str, p: &Problem<T>, repeats: usize) {
    report(
        &format!("naive {label}"),
        time(repeats, || naive::forward(p)),
    );
    report(
        &format!("chunked {label}"),
        time(repeats, || chunked::forward(p, MatmulPrecision::Native)),
    );
    report(
        &format!("chunked {label} tf32"),
        time(repeats, || chunked::forward(p, MatmulPrecision::Tf32)),
    );
    let cs = chunk_cumsum::chunk_cumsum(p);
    let st = fwd_pass_state::fwd_pass_state(p, &cs, MatmulPrecision::Native);
    report(
        &format!("  chunk_cumsum {label}"),
        time(repeats, || chunk_cumsum::chunk_cumsum(p)),
    );
    report(
        &format!("  chunk_state {label}"),
        time(repeats, || {
            fwd_pass_state::chunk_state(p, &cs, MatmulPrecision::Native)
        }),
    );
    let local = fwd_pass_state::chunk_state(p, &cs, MatmulPrecision::Native);
    report(
        &format!("  state_passing {label}"),
        time(repeats, || {
            let mut s = local.clone();
            fwd_pass_state::state_passing(p, &cs, &mut s)
        }),
    );
    report(
        &format!("  (clone of the states) {label}"),
        time(repeats, || local.clone()),
    );
    report(
        &format!("  compute_out {label}"),
        time(repeats, || {
            compute_out::compute_out(p, &cs, &st.chunk_states, MatmulPrecision::Native)
        }),
    );
}

fn main() {
    let repeats = std::env::args()
        .skip(1)
        .find_map(|a| a.parse::<usize>().ok())
        .unwrap_or(31);
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
    bench("f32", &p32, repeats);
}
