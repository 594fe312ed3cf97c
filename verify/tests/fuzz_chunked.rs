//! Shape fuzzing of the reference's chunked path against the float64 naive recurrence, over
//! every size and option (`ssd_verify::fuzz::case_strategy`), each at the bound of its
//! precision. `PROPTEST_CASES` sets the number of cases per property (default
//! `ssd_verify::fuzz::DEFAULT_CASES`); failures shrink to small cases and are persisted in
//! `proptest-regressions/fuzz_chunked.txt`.

use proptest::prelude::*;
use ssd_reference::{chunked, naive, MatmulPrecision, Options, Problem};
use ssd_verify::fuzz::{case_strategy, config_for, FuzzCase};
use ssd_verify::tolerance::{Candidate, Oracle, OutputName, Precision};

fn check(case: &FuzzCase, cand: impl Fn(&Problem<f64>) -> Candidate, precision: Precision) {
    let p = case.problem();
    let v = Oracle::new(&p).check(&cand(&p), precision).unwrap();
    assert!(v.passed(), "{case}: {:?}", v.failures());
}

proptest! {
    #![proptest_config(config_for("fuzz_chunked"))]

    /// f64: chunked == naive within the f64 bound (`out`, `final_states`; the chunked path is
    /// itself the reference for the intermediates, checked independently in `faults_power`).
    #[test]
    fn chunked_f64_matches_naive(case in case_strategy()) {
        check(&case, |p| (&chunked::forward(p, MatmulPrecision::Native)).into(), Precision::F64);
    }

    /// f32 (inputs rounded to f32): all four outputs within the f32 bound.
    #[test]
    fn chunked_f32_within_f32_bound(case in case_strategy()) {
        check(&case, |p| (&chunked::forward(&p.cast::<f32>(), MatmulPrecision::Native)).into(), Precision::F32);
    }

    /// TF32 operands, f32 accumulation: all four outputs within the TF32 bound.
    #[test]
    fn chunked_tf32_within_tf32_bound(case in case_strategy()) {
        check(&case, |p| (&chunked::forward(&p.cast::<f32>(), MatmulPrecision::Tf32)).into(), Precision::Tf32);
    }

    /// The naive recurrence in f32 is the chunked algorithm with chunk size 1: within the f32
    /// bound of the same problem written with `chunk_size` 1.
    #[test]
    fn naive_f32_within_f32_bound_at_chunk_1(case in case_strategy()) {
        let p = case.problem();
        let p1 = Problem::new(*p.dims(), Options { chunk_size: 1, ..*p.options() }, p.inputs().clone()).unwrap();
        let v = Oracle::new(&p1).check(&(&naive::forward(&p1.cast::<f32>())).into(), Precision::F32).unwrap();
        prop_assert!(v.passed(), "{case}: {:?}", v.failures());
    }

    /// The bound does not depend on how the candidate is stored beyond its rounding: the f32
    /// chunked result stored as bf16 passes at f32 with the bf16 storage term.
    #[test]
    fn storage_rounding_is_accounted(case in case_strategy()) {
        let p = case.problem();
        let c = chunked::forward(&p.cast::<f32>(), MatmulPrecision::Native);
        let mut cand: Candidate = (&c).into();
        let round = |a: &mut ndarray::ArrayD<f64>| a.mapv_inplace(|v| half::bf16::from_f64(v).to_f64());
        round(&mut cand.out);
        for t in [&mut cand.final_states, &mut cand.dA_cumsum, &mut cand.chunk_states].into_iter().flatten() {
            round(t);
        }
        cand.dtype = ssd_verify::fixture::Dtype::BF16;
        let oracle = Oracle::new(&p);
        let v = oracle.check(&cand, Precision::F32).unwrap();
        prop_assert!(v.passed(), "{case}: {:?}", v.failures());
        prop_assert!(v.tensor(OutputName::Out).is_some());
    }
}
