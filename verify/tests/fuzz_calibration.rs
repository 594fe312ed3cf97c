//! Calibration of the error model: the largest error/bound ratio over many random cases, per
//! precision and tensor, for correct implementations (no false alarm allowed, and no hint in
//! the checker's report), and how often a TF32 result is (rightly) refused at the f32 bound
//! (with the precision hint first).
//!
//! `calibration_quick` runs in the default suite; `calibration_10k` (ignored) is the recorded
//! run of `docs/tolerances.md`:
//!
//! ```text
//! CALIBRATION_CASES=10000 cargo test -p ssd-verify --release --test fuzz_calibration -- --ignored --nocapture
//! ```

mod common;

use std::collections::BTreeMap;
use std::sync::Mutex;

use common::faults::{self, Fault, Rounding};
use rayon::prelude::*;
use ssd_reference::{chunked, naive, MatmulPrecision, Options, Problem};
use ssd_verify::diagnose::Stage;
use ssd_verify::fuzz::{cases, FuzzCase, DEFAULT_SEED};
use ssd_verify::report::{check_candidate, Labels};
use ssd_verify::tolerance::{Candidate, Oracle, Precision, Verdict};

/// Rounds `x`, `B`, `C`, `z` to bfloat16 ("before the kernel").
fn bf16_inputs(p: &Problem<f64>) -> Problem<f64> {
    ssd_verify::fixture::round_inputs(p, ssd_verify::fixture::FloatDtype::BF16)
        .expect("bf16 keeps every value finite")
}

/// The same problem with another chunk size (the function does not depend on it).
fn with_chunk(p: &Problem<f64>, chunk_size: usize) -> Problem<f64> {
    let options = Options {
        chunk_size,
        ..*p.options()
    };
    Problem::new(*p.dims(), options, p.inputs().clone()).expect("valid")
}

#[derive(Default)]
struct Stats {
    /// (label, tensor) -> (worst ratio, cases, failing cases, worst case)
    worst: BTreeMap<(String, String), (f64, usize, usize, String)>,
    /// label -> (reports, reports with a hint, first hints not naming the precision)
    hints: BTreeMap<String, (usize, usize, usize)>,
    /// label -> first hint's stage -> reports
    first: BTreeMap<String, BTreeMap<String, usize>>,
}

/// The checker's report on `candidate` (every tensor it holds): its hints.
fn report_hints(
    p: &Problem<f64>,
    oracle: &Oracle,
    candidate: &Candidate,
    precision: Precision,
) -> Vec<Stage> {
    let present: Vec<_> = candidate
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t, candidate.dtype))
        .collect();
    let r = check_candidate(
        Labels::default(),
        p,
        oracle,
        &present,
        Vec::new(),
        precision,
    )
    .expect("shapes agree");
    assert_eq!(
        r.passed,
        r.error_map.is_empty(),
        "a map exactly when the check fails"
    );
    r.hints.iter().map(|h| h.stage).collect()
}

impl Stats {
    fn add(&mut self, label: &str, v: &Verdict, case: &FuzzCase) {
        for t in &v.tensors {
            let e = self
                .worst
                .entry((label.to_string(), t.name.name().to_string()))
                .or_insert((0.0, 0, 0, String::new()));
            e.1 += 1;
            if !t.passed() {
                e.2 += 1;
            }
            if t.max_ratio() > e.0 {
                e.0 = t.max_ratio();
                e.3 = case.to_string();
            }
        }
    }

    fn add_hints(&mut self, label: &str, stages: &[Stage]) {
        let e = self.hints.entry(label.to_string()).or_default();
        e.0 += 1;
        if !stages.is_empty() {
            e.1 += 1;
        }
        if stages.first().is_some_and(|s| *s != Stage::Precision) {
            e.2 += 1;
        }
        if let Some(s) = stages.first() {
            *self
                .first
                .entry(label.to_string())
                .or_default()
                .entry(format!("{s:?}"))
                .or_default() += 1;
        }
    }

    fn print(&self) {
        for (label, (n, with, other)) in &self.hints {
            println!("{label:<34} reports {n:>6}  with a hint {with:>6}  first hint not the precision {other:>6}  first hints {:?}", self.first.get(label));
        }
        for ((label, tensor), (w, n, f, case)) in &self.worst {
            println!("{label:<34} {tensor:<13} cases {n:>6}  failing {f:>6}  worst ratio {w:.3e}");
            if *f > 0 && !label.contains("expect-fail") {
                println!("    worst case: {case}");
            }
        }
    }

    fn failing(&self, label: &str) -> usize {
        self.worst
            .iter()
            .filter(|((l, _), _)| l == label)
            .map(|(_, v)| v.2)
            .sum()
    }
}

/// Runs every correct implementation on `n` fixed cases; returns the statistics.
fn calibrate(n: usize, seed: u64) -> Stats {
    let cases = cases(n, seed);
    let stats = Mutex::new(Stats::default());
    cases.par_iter().for_each(|case| {
        let p = case.problem();
        let oracle = Oracle::new(&p);
        let p32 = p.cast::<f32>();
        let mut local: Vec<(&str, Verdict)> = Vec::new();
        let mut hints: Vec<(&str, Vec<Stage>)> = Vec::new();
        let check = |c: Candidate, prec| oracle.check(&c, prec).expect("shapes agree");
        // Through the report, as `check` prints it: its hints.
        let report = |c: Candidate, prec| report_hints(&p, &oracle, &c, prec);

        let c64 = chunked::forward(&p, MatmulPrecision::Native);
        local.push(("chunked f64 @f64", check((&c64).into(), Precision::F64)));
        hints.push(("chunked f64 @f64", report((&c64).into(), Precision::F64)));
        let c32 = chunked::forward(&p32, MatmulPrecision::Native);
        local.push(("chunked f32 @f32", check((&c32).into(), Precision::F32)));
        hints.push(("chunked f32 @f32", report((&c32).into(), Precision::F32)));
        let ct = chunked::forward(&p32, MatmulPrecision::Tf32);
        local.push(("chunked tf32 @tf32", check((&ct).into(), Precision::Tf32)));
        hints.push(("chunked tf32 @tf32", report((&ct).into(), Precision::Tf32)));
        hints.push((
            "chunked tf32 @f32 (expect-fail)",
            report((&ct).into(), Precision::F32),
        ));
        local.push((
            "chunked tf32 @f32 (expect-fail)",
            check((&ct).into(), Precision::F32),
        ));
        // The independent plain-loops implementation, all four tensors.
        let f64c = faults::forward(&p, Fault::None, Rounding::None);
        local.push(("plain f64 @f64", check((&f64c).into(), Precision::F64)));
        hints.push(("plain f64 @f64", report((&f64c).into(), Precision::F64)));
        let ft = faults::forward(&p32, Fault::None, Rounding::Tf32);
        local.push(("plain tf32 @tf32", check((&ft).into(), Precision::Tf32)));
        hints.push(("plain tf32 @tf32", report((&ft).into(), Precision::Tf32)));
        let ftt = faults::forward(&p32, Fault::None, Rounding::Tf32Truncate);
        local.push((
            "plain tf32-truncating @tf32",
            check((&ftt).into(), Precision::Tf32),
        ));
        hints.push((
            "plain tf32-truncating @tf32",
            report((&ftt).into(), Precision::Tf32),
        ));
        // BF16: inputs rounded before the kernel, operands rounded to bf16.
        let pb = bf16_inputs(&p).cast::<f32>();
        let fb = faults::forward(&pb, Fault::None, Rounding::Bf16);
        local.push(("plain bf16 @bf16", check((&fb).into(), Precision::Bf16)));
        hints.push(("plain bf16 @bf16", report((&fb).into(), Precision::Bf16)));
        // The reference's own bf16 emulation: the chunked path with bf16 operands.
        let cb = chunked::forward(&pb, MatmulPrecision::Bf16);
        local.push(("chunked bf16 @bf16", check((&cb).into(), Precision::Bf16)));
        hints.push(("chunked bf16 @bf16", report((&cb).into(), Precision::Bf16)));
        // The naive recurrence in f32 is the chunked algorithm with chunk size 1.
        let p1 = with_chunk(&p, 1);
        let oracle1 = Oracle::new(&p1);
        let n32 = naive::forward(&p1.cast::<f32>());
        let v = oracle1
            .check(&(&n32).into(), Precision::F32)
            .expect("shapes agree");
        local.push(("naive f32 @f32 (chunk 1)", v));
        hints.push((
            "naive f32 @f32 (chunk 1)",
            report_hints(&p1, &oracle1, &(&n32).into(), Precision::F32),
        ));

        let mut s = stats.lock().expect("no poisoned lock");
        for (label, v) in &local {
            s.add(label, v, case);
        }
        for (label, h) in &hints {
            s.add_hints(label, h);
        }
    });
    stats.into_inner().expect("no poisoned lock")
}

const CORRECT: [&str; 9] = [
    "plain tf32-truncating @tf32",
    "chunked f64 @f64",
    "chunked f32 @f32",
    "chunked tf32 @tf32",
    "plain f64 @f64",
    "plain tf32 @tf32",
    "plain bf16 @bf16",
    "chunked bf16 @bf16",
    "naive f32 @f32 (chunk 1)",
];

fn assert_no_false_alarm(s: &Stats) {
    for label in CORRECT {
        assert_eq!(s.failing(label), 0, "false alarms for {label}");
        // No hint for a correct candidate, through the report `check` prints.
        let (n, with, _) = s.hints[label];
        assert!(n > 0, "{label}: no report");
        assert_eq!(with, 0, "hints for the correct {label}");
    }
    // A TF32 result checked at f32 is told about the precision first, never a stage.
    let (_, with, other) = s.hints["chunked tf32 @f32 (expect-fail)"];
    assert!(with > 0, "no hint for a TF32 result at f32");
    assert_eq!(other, 0, "a TF32 result at f32 hinted at a stage first");
    // TF32 is far outside the f32 bound: most cases are refused.
    let (refused, n) = s
        .worst
        .iter()
        .filter(|((l, t), _)| l.contains("expect-fail") && t == "out")
        .map(|(_, v)| (v.2, v.1))
        .next()
        .expect("recorded");
    assert!(
        refused * 10 >= n * 8,
        "a TF32 result passed the f32 bound in {} of {n} cases",
        n - refused
    );
}

#[test]
fn calibration_quick() {
    let s = calibrate(48, DEFAULT_SEED + 11);
    s.print();
    assert_no_false_alarm(&s);
}

#[test]
#[ignore = "10,000 cases: minutes; run by hand for docs/tolerances.md"]
fn calibration_10k() {
    let n = std::env::var("CALIBRATION_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let s = calibrate(n, 42);
    s.print();
    assert_no_false_alarm(&s);
}
