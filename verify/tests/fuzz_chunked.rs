//! Shape fuzzing of the reference's chunked path against the float64 naive recurrence, over
//! every size and option (`ssd_verify::fuzz::cases`), each at the bound of its precision.
//! `SSD_FUZZ_CASES` sets the number of cases per check (default
//! `ssd_verify::fuzz::DEFAULT_CASES`), `SSD_FUZZ_SEED` draws other cases; a failure is shrunk
//! to a small case, printed with the seed that rebuilds it.

use ssd_reference::{chunked, naive, MatmulPrecision, Options, Problem};
use ssd_verify::fuzz::{case_count, cases, check_all, seed, CaseResult, FuzzCase};
use ssd_verify::tolerance::{Candidate, Oracle, OutputName, Precision};

/// `Err` with the failures unless `passed`.
fn verdict_of(passed: bool, failures: impl FnOnce() -> Vec<String>) -> CaseResult {
    if passed {
        Ok(())
    } else {
        Err(failures().join("; "))
    }
}

fn check(
    case: &FuzzCase,
    cand: impl Fn(&Problem<f64>) -> Candidate,
    precision: Precision,
) -> CaseResult {
    let p = case.problem();
    let v = Oracle::new(&p).check(&cand(&p), precision).unwrap();
    verdict_of(v.passed(), || v.failures())
}

/// The cases of the check numbered `k` (each check draws its own).
fn suite(k: u64) -> Vec<FuzzCase> {
    cases(case_count(), seed().wrapping_add(k))
}

/// f64: chunked == naive within the f64 bound (`out`, `final_states`; the chunked path is
/// itself the reference for the intermediates, checked independently in `faults_power`).
#[test]
fn chunked_f64_matches_naive() {
    check_all("chunked f64 at f64", &suite(1), |case| {
        check(
            case,
            |p| (&chunked::forward(p, MatmulPrecision::Native)).into(),
            Precision::F64,
        )
    });
}

/// f32 (inputs rounded to f32): all four outputs within the f32 bound.
#[test]
fn chunked_f32_within_f32_bound() {
    check_all("chunked f32 at f32", &suite(2), |case| {
        check(
            case,
            |p| (&chunked::forward(&p.cast::<f32>(), MatmulPrecision::Native)).into(),
            Precision::F32,
        )
    });
}

/// TF32 operands, f32 accumulation: all four outputs within the TF32 bound.
#[test]
fn chunked_tf32_within_tf32_bound() {
    check_all("chunked tf32 at tf32", &suite(3), |case| {
        check(
            case,
            |p| (&chunked::forward(&p.cast::<f32>(), MatmulPrecision::Tf32)).into(),
            Precision::Tf32,
        )
    });
}

/// The naive recurrence in f32 is the chunked algorithm with chunk size 1: within the f32
/// bound of the same problem written with `chunk_size` 1.
#[test]
fn naive_f32_within_f32_bound_at_chunk_1() {
    check_all("naive f32 at f32 (chunk 1)", &suite(4), |case| {
        let p = case.problem();
        let p1 = Problem::new(
            *p.dims(),
            Options {
                chunk_size: 1,
                ..*p.options()
            },
            p.inputs().clone(),
        )
        .unwrap();
        let v = Oracle::new(&p1)
            .check(&(&naive::forward(&p1.cast::<f32>())).into(), Precision::F32)
            .unwrap();
        verdict_of(v.passed(), || v.failures())
    });
}

/// The bound does not depend on how the candidate is stored beyond its rounding: the f32
/// chunked result stored as bf16 passes at f32 with the bf16 storage term.
#[test]
fn storage_rounding_is_accounted() {
    check_all("chunked f32 stored as bf16, at f32", &suite(5), |case| {
        let p = case.problem();
        let c = chunked::forward(&p.cast::<f32>(), MatmulPrecision::Native);
        let mut cand: Candidate = (&c).into();
        let round =
            |a: &mut ndarray::ArrayD<f64>| a.mapv_inplace(|v| half::bf16::from_f64(v).to_f64());
        round(&mut cand.out);
        for t in [
            &mut cand.final_states,
            &mut cand.dA_cumsum,
            &mut cand.chunk_states,
        ]
        .into_iter()
        .flatten()
        {
            round(t);
        }
        cand.dtype = ssd_verify::fixture::Dtype::BF16;
        let v = Oracle::new(&p).check(&cand, Precision::F32).unwrap();
        verdict_of(v.passed() && v.tensor(OutputName::Out).is_some(), || {
            v.failures()
        })
    });
}
