//! The chunked jump formula against the naive recurrence in f64, on random shapes and every
//! option.
//!
//! Bound: both sum the same terms (see `common::magnitudes`) with per-term relative
//! perturbations of at most `gamma_units(p) * u` together (derived in `common::gamma_units`),
//! so `|naive - chunked| <= gamma_units(p) * u * mag` element by element. A wrong formula, mask,
//! reset or index is off by a sizeable fraction of `mag`, orders of magnitude above the bound.
//! Separately, the normwise relative difference `max |naive - chunked| / max mag` is held to
//! the bar, 1e-12.
mod common;

use common::*;
use proptest::prelude::*;
use ssd_reference::random::{random_problem, DSkip, ProblemSpec, SeqIdx};
use ssd_reference::{chunked, naive, Dims, MatmulPrecision, Problem};

/// The bar for the normwise relative difference in f64.
const NORMWISE_BAR: f64 = 1e-12;

/// Compares naive and chunked on `p`; returns the normwise relative differences (out, final).
fn check(p: &Problem<f64>) -> (f64, f64) {
    let n = naive::forward(p);
    let c = chunked::forward(p, MatmulPrecision::Native);
    let mag = magnitudes(p);
    let bound = gamma_units(p) * U64;
    let (eo, no) = scaled_errors(&c.out, &n.out, &mag.out);
    let (ef, nf) = scaled_errors(&c.final_states, &n.final_states, &mag.final_states);
    assert!(
        eo <= bound && ef <= bound,
        "elementwise |naive - chunked| / mag: out {eo:e}, final_states {ef:e} > bound {bound:e} \
         for dims {:?}, options {:?}",
        p.dims(),
        p.options()
    );
    assert!(
        no <= NORMWISE_BAR && nf <= NORMWISE_BAR,
        "normwise relative difference out {no:e}, final_states {nf:e} > {NORMWISE_BAR:e}"
    );
    (no, nf)
}

proptest! {
    #![proptest_config(config(512, 0x55D_0001))]

    #[test]
    fn random_shapes_and_options(spec in any_spec(300), seed in any::<u64>()) {
        let p = random_problem(&spec, seed).unwrap();
        check(&p);
    }
}

fn dims(batch: usize, seqlen: usize, nheads: usize, ngroups: usize) -> Dims {
    Dims {
        batch,
        seqlen,
        nheads,
        headdim: 5,
        ngroups,
        dstate: 7,
    }
}

/// Every named corner case of the issue, each on a few seeds, full options otherwise.
#[test]
fn corner_cases() {
    let full = |d: Dims, cs: usize| ProblemSpec::full(d, cs);
    let mut cases: Vec<(&str, ProblemSpec)> = vec![
        ("seqlen 1", full(dims(2, 1, 4, 2), 16)),
        ("seqlen 1, chunk 1", full(dims(1, 1, 2, 1), 1)),
        ("chunk_size 1", full(dims(2, 37, 4, 2), 1)),
        ("chunk_size > seqlen", full(dims(2, 37, 4, 2), 64)),
        ("chunk_size = seqlen", full(dims(1, 32, 2, 2), 32)),
        ("ragged last chunk of 1", full(dims(2, 33, 3, 3), 8)),
        ("ngroups = nheads", full(dims(1, 50, 4, 4), 16)),
        ("ngroups 1, 6 heads", full(dims(1, 50, 6, 1), 16)),
        ("long, chunk 256", full(dims(1, 700, 2, 1), 256)),
    ];
    let mut at_starts = full(dims(2, 70, 4, 2), 8);
    at_starts.seq_idx = SeqIdx::AtChunkStarts { every: 1 };
    cases.push(("seq_idx resets at every chunk start", at_starts));
    at_starts.seq_idx = SeqIdx::AtChunkStarts { every: 3 };
    cases.push(("seq_idx resets at every third chunk start", at_starts));
    let mut first = full(dims(2, 45, 2, 1), 8);
    first.seq_idx = SeqIdx::Segments {
        segments: 3,
        first: 2,
    };
    cases.push(("seq_idx starting above 0", first));
    first.seq_idx = SeqIdx::Segments {
        segments: 12,
        first: 0,
    };
    cases.push(("many short sequences", first));
    let mut plain = ProblemSpec::plain(dims(2, 90, 4, 2));
    plain.options.chunk_size = 16;
    cases.push(("no option", plain));
    let mut per_head = full(dims(2, 40, 4, 2), 16);
    per_head.d = DSkip::PerHead;
    cases.push(("D per head", per_head));
    per_head.d = DSkip::None;
    per_head.z = false;
    cases.push(("no D, no z", per_head));
    let mut no_bias = full(dims(2, 40, 4, 2), 16);
    no_bias.dt_bias = false;
    no_bias.options.dt_softplus = false;
    no_bias.options.dt_limit = (0.0, f64::INFINITY);
    no_bias.dt_range = (-0.05, 0.2); // some raw dt < 0: the default clamp zeroes them
    cases.push(("no softplus, default clamp", no_bias));
    let mut zero_a = full(dims(1, 40, 2, 1), 8);
    zero_a.a_range = (0.0, 0.0);
    cases.push(("A = 0 (no decay)", zero_a));
    let mut strong = full(dims(1, 300, 2, 1), 128);
    strong.a_range = (8.0, 16.0);
    strong.options.dt_limit = (0.5, 2.0);
    cases.push(("strong decay (|cs| up to 4096)", strong));

    let mut worst: f64 = 0.0;
    for (name, spec) in cases {
        for seed in 0..4 {
            let p = random_problem(&spec, seed).unwrap_or_else(|e| panic!("{name}: {e}"));
            let (no, nf) = check(&p);
            worst = worst.max(no).max(nf);
        }
    }
    println!("worst normwise relative difference over the corner cases: {worst:e}");
}

/// The output does not depend on `chunk_size` beyond rounding: every chunk size from 1 to
/// past `seqlen` agrees with naive on the same problem.
#[test]
fn every_chunk_size_on_one_problem() {
    let spec = ProblemSpec::full(dims(2, 75, 4, 2), 1);
    let base = random_problem(&spec, 9).unwrap();
    for log in 0..=8 {
        let mut options = *base.options();
        options.chunk_size = 1 << log;
        let p = Problem::new(*base.dims(), options, base.inputs().clone()).unwrap();
        check(&p);
    }
}
