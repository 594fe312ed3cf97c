//! The power of the checks, measured: every deliberately wrong variant of the chunked path
//! (`common::faults`) must be flagged on at least one of the fuzz suite's default number of
//! cases, at the f32 bound (computed in f32) and at the TF32 bound (computed with TF32
//! operands); the correct variant must never be.

mod common;

use common::faults::{self, Fault, Rounding};
use rayon::prelude::*;
use ssd_reference::random::{random_problem, DSkip, ProblemSpec, SeqIdx};
use ssd_reference::{chunked, Dims, MatmulPrecision};
use ssd_verify::fixture::{round_inputs, FloatDtype};
use ssd_verify::fuzz::{
    case_count, cases, check_all, failures, seed, shrink, CaseResult, DEFAULT_CASES, DEFAULT_SEED,
};
use ssd_verify::tolerance::{Candidate, Oracle, Precision};

/// `Err` naming `what` and the failures unless `v` passed.
fn passed(what: &str, v: &ssd_verify::tolerance::Verdict) -> CaseResult {
    if v.passed() {
        Ok(())
    } else {
        Err(format!("{what}: {:?}", v.failures()))
    }
}

/// The plain-loops implementation without a fault is a correct implementation: all four
/// outputs within the f64 bound in f64, the TF32 bound with TF32 operands (rounded or
/// truncated), the BF16 bound with bf16 inputs and operands.
#[test]
fn plain_loops_without_fault_are_correct() {
    check_all(
        "plain loops",
        &cases(case_count(), seed().wrapping_add(6)),
        |case| {
            let p = case.problem();
            let oracle = Oracle::new(&p);
            let v = oracle
                .check(
                    &(&faults::forward(&p, Fault::None, Rounding::None)).into(),
                    Precision::F64,
                )
                .unwrap();
            passed("f64", &v)?;
            let p32 = p.cast::<f32>();
            let v = oracle
                .check(
                    &(&faults::forward(&p32, Fault::None, Rounding::Tf32)).into(),
                    Precision::Tf32,
                )
                .unwrap();
            passed("tf32", &v)?;
            let v = oracle
                .check(
                    &(&faults::forward(&p32, Fault::None, Rounding::Tf32Truncate)).into(),
                    Precision::Tf32,
                )
                .unwrap();
            passed("tf32 (truncating)", &v)?;
            let pb = round_inputs(&p, FloatDtype::BF16).unwrap().cast::<f32>();
            let v = oracle
                .check(
                    &(&faults::forward(&pb, Fault::None, Rounding::Bf16)).into(),
                    Precision::Bf16,
                )
                .unwrap();
            passed("bf16", &v)
        },
    );
}

/// For each fault: on how many of the default number of fuzz cases it is flagged, at f32 and
/// at TF32. Prints the table of `docs/tolerances.md`.
#[test]
fn every_fault_is_caught_by_the_fuzz_suite() {
    // The default cases, whatever SSD_FUZZ_CASES says: the claim is about the default suite.
    let n = DEFAULT_CASES;
    let cases = cases(n, DEFAULT_SEED);
    // Per case: for each fault, (flagged at f32, flagged at tf32).
    let flags: Vec<Vec<(bool, bool)>> = cases
        .par_iter()
        .map(|case| {
            let p = case.problem();
            let oracle = Oracle::new(&p);
            let p32 = p.cast::<f32>();
            let none32 = oracle
                .check(
                    &(&faults::forward(&p32, Fault::None, Rounding::None)).into(),
                    Precision::F32,
                )
                .unwrap();
            assert!(
                none32.passed(),
                "false alarm on {case}: {:?}",
                none32.failures()
            );
            Fault::WRONG
                .iter()
                .map(|&f| {
                    let c32: Candidate = (&faults::forward(&p32, f, Rounding::None)).into();
                    let ct: Candidate = (&faults::forward(&p32, f, Rounding::Tf32)).into();
                    (
                        !oracle.check(&c32, Precision::F32).unwrap().passed(),
                        !oracle.check(&ct, Precision::Tf32).unwrap().passed(),
                    )
                })
                .collect()
        })
        .collect();
    println!("fault                          flagged @f32   flagged @tf32   (of {n} cases)");
    let mut missed = Vec::new();
    for (k, f) in Fault::WRONG.iter().enumerate() {
        let a = flags.iter().filter(|v| v[k].0).count();
        let b = flags.iter().filter(|v| v[k].1).count();
        println!("{:<30} {a:>12}   {b:>13}", format!("{f:?}"));
        if a == 0 || b == 0 {
            missed.push(format!("{f:?} (f32 {a}, tf32 {b})"));
        }
    }
    assert!(missed.is_empty(), "faults never flagged: {missed:?}");
}

/// A TF32 result is far outside the f32 bound on a realistic shape: the bound is tight enough
/// to tell the two arithmetics apart, while the same result passes at the TF32 bound.
#[test]
fn tf32_result_fails_the_f32_bound() {
    let dims = Dims {
        batch: 1,
        seqlen: 200,
        nheads: 4,
        headdim: 16,
        ngroups: 2,
        dstate: 16,
    };
    for (spec, seed) in [
        (ProblemSpec::plain(dims), 1),
        (ProblemSpec::full(dims, 64), 2),
        (
            ProblemSpec {
                d: DSkip::PerHead,
                seq_idx: SeqIdx::AtChunkStarts { every: 1 },
                ..ProblemSpec::full(dims, 32)
            },
            3,
        ),
    ] {
        let p = random_problem(&spec, seed).unwrap();
        let oracle = Oracle::new(&p);
        let ct = chunked::forward(&p.cast::<f32>(), MatmulPrecision::Tf32);
        let at_tf32 = oracle.check(&(&ct).into(), Precision::Tf32).unwrap();
        assert!(at_tf32.passed(), "{:?}", at_tf32.failures());
        let at_f32 = oracle.check(&(&ct).into(), Precision::F32).unwrap();
        for t in &at_f32.tensors {
            if t.name.name() == "dA_cumsum" {
                continue; // no matrix product: TF32 does not touch it
            }
            println!("{}: TF32 at {:.1}x the f32 bound", t.name, t.max_ratio());
            assert!(
                !t.passed(),
                "{}: a TF32 result passed the f32 bound",
                t.name
            );
        }
        // And the f32 result passes at f32.
        let c32 = chunked::forward(&p.cast::<f32>(), MatmulPrecision::Native);
        assert!(oracle
            .check(&(&c32).into(), Precision::F32)
            .unwrap()
            .passed());
    }
}

/// Shrinking works: the fuzz suite run on a planted fault fails, and the harness shrinks the
/// first failing case to a small case that still shows the fault (printed for the record).
/// Shrinking redraws the values from the case's seed at every step, so a fault that needs a
/// particular value pattern (a reset exactly at a chunk start) may stop shrinking early; the
/// faults here need only sizes and options.
#[test]
fn planted_faults_shrink_to_small_cases() {
    let all = cases(DEFAULT_CASES, DEFAULT_SEED);
    for fault in [
        Fault::CausalMaskOffByOne,
        Fault::GroupModulo,
        Fault::LastPartialChunk,
        Fault::DAfterGate,
    ] {
        let check = |case: &ssd_verify::fuzz::FuzzCase| {
            let p = case.problem();
            let c: Candidate = (&faults::forward(&p.cast::<f32>(), fault, Rounding::None)).into();
            passed("f32", &Oracle::new(&p).check(&c, Precision::F32).unwrap())
        };
        let failed = failures(&all, check);
        let Some((first, why)) = failed.first() else {
            panic!("{fault:?} was not found by the fuzz suite");
        };
        let (minimal, _) = shrink(first, why.clone(), check);
        println!("{fault:?} shrinks to {minimal}");
        assert!(
            minimal.size() <= 64,
            "{fault:?}: the shrunk case is still large: {minimal}"
        );
        // Still failing, by construction of the shrinker; check it once more.
        assert!(check(&minimal).is_err());
    }
}
