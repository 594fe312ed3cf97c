//! Every instruction-set path gives the same bits: the portable code (as with `SSD_SIMD=off`)
//! against the widest vector code this processor runs, for the naive path and its adjoint, the chunked paths (both
//! schedules, native and TF32 operands) in f64 and f32, and for the magnitudes, on random
//! shapes and every option. On a processor without AVX2 both runs take the portable code and
//! the test checks nothing more than determinism.
//!
//! One test in this file: the cap ([`simd::set_max_isa`]) is process-wide.
mod common;

use common::*;
use ndarray::{Array, Dimension};
use proptest::prelude::*;
use ssd_reference::chunked::{self, Schedule};
use ssd_reference::random::random_problem;
use ssd_reference::simd::{self, Isa};
use ssd_reference::{adjoint, magnitude, naive, MatmulPrecision, Problem, Real};

/// Every output of every path on `p`, flattened to bit patterns (f32 widened exactly).
fn all_bits<T: Real>(p: &Problem<T>) -> Vec<Vec<u64>> {
    fn bits<T: Real, D: Dimension>(a: &Array<T, D>) -> Vec<u64> {
        a.iter().map(|v| v.as_f64().to_bits()).collect()
    }
    let mut v = Vec::new();
    let n = naive::forward(p);
    v.push(bits(&n.out));
    v.push(bits(&n.final_states));
    // The adjoint, pulled back from the outputs themselves.
    let g = adjoint::backward(p, n.out.view(), Some(n.final_states.view())).expect("valid");
    for (_, a) in g.named() {
        v.push(a.iter().map(|x| x.as_f64().to_bits()).collect());
    }
    for precision in [MatmulPrecision::Native, MatmulPrecision::Tf32] {
        for schedule in [Schedule::Staged, Schedule::Fused] {
            let c = chunked::forward_with(p, precision, schedule);
            v.push(bits(&c.out));
            v.push(bits(&c.final_states));
            v.push(bits(&c.dA_cumsum));
            v.push(bits(&c.chunk_states));
        }
    }
    v
}

fn magnitude_bits(p: &Problem<f64>) -> Vec<Vec<u64>> {
    let m = magnitude::magnitudes(p);
    let mut v = Vec::new();
    for ch in [&m.out, &m.final_states, &m.dA_cumsum, &m.chunk_states] {
        for a in [&ch.mag, &ch.acc, &ch.io, &ch.op, &ch.tok] {
            v.push(a.iter().map(|x| x.to_bits()).collect());
        }
    }
    v.push(vec![m.floor_scale.to_bits()]);
    v
}

/// The bits of every path in f64 and f32 and of the magnitudes.
fn run_all(p: &Problem<f64>) -> Vec<Vec<u64>> {
    let mut v = all_bits(p);
    v.extend(all_bits(&p.cast::<f32>()));
    v.extend(magnitude_bits(p));
    v
}

proptest! {
    #![proptest_config(config(64, 16))]
    #[test]
    fn portable_and_vector_paths_give_the_same_bits(spec in any_spec(80), seed in any::<u64>()) {
        let p = random_problem(&spec, seed).expect("valid spec");
        simd::set_max_isa(Isa::Generic);
        assert_eq!(simd::isa(), Isa::Generic);
        let portable = run_all(&p);
        simd::set_max_isa(Isa::Avx512);
        assert_eq!(simd::isa(), simd::detected());
        let vector = run_all(&p);
        prop_assert!(portable == vector, "paths differ for {:?} (seed {seed})", spec);
    }
}
