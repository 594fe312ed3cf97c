//! The power of the gradient checks, measured: every deliberately wrong backward pass
//! (`common::grad_faults`) must be refused at the f32 bound (computed in f32), at the TF32
//! bound (TF32 operands) and at the BF16 bound (bf16 inputs, `dout` and operands), on a case
//! that exercises it and on at least one of the fuzz suite's default cases; the correct pass
//! must never be. Prints the table of `docs/tolerances.md`.

mod common;

use common::grad_faults::{self, GradFault, Rounding};
use ndarray::Array4;
use rayon::prelude::*;
use ssd_reference::random::{random_problem, ProblemSpec};
use ssd_reference::{Dims, Problem};
use ssd_verify::fixture::Dtype;
use ssd_verify::fuzz::{case_count, cases, DEFAULT_SEED};
use ssd_verify::suites::upstream_gradients;
use ssd_verify::tolerance::{Oracle, Precision, Verdict};

/// The three claims checked: (precision, operand rounding of the faulty pass).
const CLAIMS: [(Precision, Rounding); 3] = [
    (Precision::F32, Rounding::None),
    (Precision::Tf32, Rounding::Tf32),
    (Precision::Bf16, Rounding::Bf16),
];

/// The oracle of `p` and its upstream gradients (of one sign when `p`'s inputs are).
fn oracle(p: &Problem<f64>, seed: u64) -> (Oracle, Array4<f64>, Array4<f64>) {
    let (mut dout, dfin) = upstream_gradients(p.dims(), seed);
    if one_sign(p) {
        dout.mapv_inplace(f64::abs);
    }
    let oracle = Oracle::for_gradients(p, dout.view(), Some(dfin.view())).unwrap();
    (oracle, dout, dfin)
}

/// The verdicts of the pass with `fault` on `p` under each claim.
fn verdicts(
    p: &Problem<f64>,
    (oracle, dout, dfin): &(Oracle, Array4<f64>, Array4<f64>),
    fault: GradFault,
) -> Vec<Verdict> {
    let p32: Problem<f32> = p.cast();
    let (o, f) = (dout.mapv(|v| v as f32), dfin.mapv(|v| v as f32));
    CLAIMS
        .iter()
        .map(|&(precision, rounding)| {
            let g = grad_faults::backward(&p32, o.view(), Some(f.view()), fault, rounding);
            oracle.check_gradients(&g, Dtype::F32, precision).unwrap()
        })
        .collect()
}

/// The case of [`exercising`] whose inputs all have one sign (then `dout` gets it too).
fn one_sign(p: &Problem<f64>) -> bool {
    let i = p.inputs();
    i.A.iter().all(|&a| a == 0.0) && i.x.iter().chain(i.B.iter()).all(|&v| v >= 0.0)
}

/// A case that exercises every fault: every option, 3 sequences per row, 2 groups, a ragged
/// last chunk; weak decay for the reset fault (what crosses a reset must not have decayed
/// away).
fn exercising(fault: GradFault) -> Problem<f64> {
    let full = ProblemSpec::full(Dims::new(2, 150, 4, 8, 2, 8), 32);
    let spec = match fault {
        GradFault::ResetIgnoredInBackward => ProblemSpec {
            a_range: (0.01, 0.1),
            ..full
        },
        // Without decay and with inputs of one sign, every `ddt` term has the same sign: the
        // sum over tokens does not cancel (with random signs it cancels to about
        // 1/sqrt(terms) of its magnitude, below what a TF32 kernel may err by).
        GradFault::DdtBiasNotSummed => ProblemSpec {
            a_range: (0.0, 0.0),
            ..full
        },
        _ => full,
    };
    let p = random_problem(&spec, 5).unwrap();
    if fault != GradFault::DdtBiasNotSummed {
        return p;
    }
    let mut i = p.inputs().clone();
    for a in [&mut i.x, &mut i.B, &mut i.C] {
        a.mapv_inplace(f64::abs);
    }
    if let Some(z) = &mut i.z {
        z.mapv_inplace(f64::abs);
    }
    Problem::new(*p.dims(), *p.options(), i).unwrap()
}

#[test]
fn every_fault_is_refused_on_a_case_that_exercises_it() {
    let p = exercising(GradFault::None);
    for v in verdicts(&p, &oracle(&p, 5), GradFault::None) {
        assert!(
            v.passed(),
            "the correct pass, at {}: {:?}",
            v.precision,
            v.failures()
        );
    }
    let rows: Vec<(GradFault, Vec<(f64, String)>)> = GradFault::WRONG
        .par_iter()
        .map(|&fault| {
            let p = exercising(fault);
            let v = verdicts(&p, &oracle(&p, 5), fault);
            let worst = v
                .iter()
                .map(|v| {
                    let t = v
                        .tensors
                        .iter()
                        .max_by(|a, b| a.max_ratio().total_cmp(&b.max_ratio()))
                        .unwrap();
                    (t.max_ratio(), t.name.to_string())
                })
                .collect();
            (fault, worst)
        })
        .collect();
    let mut missed = Vec::new();
    for (fault, worst) in &rows {
        println!(
            "{fault:<28?} {}",
            worst
                .iter()
                .zip(CLAIMS)
                .map(|((r, n), (pr, _))| format!("{pr}: {r:>10.3e} ({n})"))
                .collect::<Vec<_>>()
                .join("  ")
        );
        for ((r, _), (pr, _)) in worst.iter().zip(CLAIMS) {
            if *r <= 1.0 {
                missed.push(format!("{fault:?} at {pr}"));
            }
        }
    }
    assert!(missed.is_empty(), "faults not refused: {missed:?}");
}

/// On the fuzz suite's cases (`SSD_FUZZ_CASES`, 256 by default): the correct pass is never refused, and every fault is
/// refused on at least one case under each claim (the count is printed).
#[test]
fn every_fault_is_caught_by_the_fuzz_suite() {
    let cs = cases(case_count(), DEFAULT_SEED.wrapping_add(17));
    let mut all = vec![GradFault::None];
    all.extend(GradFault::WRONG);
    // Per case, per fault, per claim: refused.
    let flags: Vec<Vec<Vec<bool>>> = cs
        .par_iter()
        .map(|case| {
            let p = case.problem();
            let o = oracle(&p, case.seed);
            all.iter()
                .map(|&f| {
                    verdicts(&p, &o, f)
                        .iter()
                        .map(|v| {
                            if f == GradFault::None && !v.passed() {
                                println!(
                                    "FALSE ALARM at {} on {case}: {:?}",
                                    v.precision,
                                    v.failures()
                                );
                            }
                            !v.passed()
                        })
                        .collect()
                })
                .collect()
        })
        .collect();
    let mut problems = Vec::new();
    for (k, fault) in all.iter().enumerate() {
        let counts: Vec<usize> = (0..CLAIMS.len())
            .map(|c| flags.iter().filter(|f| f[k][c]).count())
            .collect();
        println!(
            "{fault:<28?} refused on {} of {} cases (f32, tf32, bf16)",
            counts
                .iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            cs.len()
        );
        let wrong = *fault != GradFault::None;
        for (c, (pr, _)) in counts.iter().zip(CLAIMS) {
            if wrong && *c == 0 {
                problems.push(format!("{fault:?} never refused at {pr}"));
            }
            if !wrong && *c > 0 {
                problems.push(format!("the correct pass refused {c} times at {pr}"));
            }
        }
    }
    assert!(problems.is_empty(), "{problems:?}");
}
