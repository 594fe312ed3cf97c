//! The tuned ground truth ([`naive`]) against the definition ([`definition`], the textbook
//! recurrence): bit for bit, f64 and f32, on random shapes and every option (`seq_idx`,
//! initial states, `D` per head and per channel, `z`, `dt_bias`, softplus, `dt_limit`,
//! `ngroups > 1`, sequences shorter and longer than a time block).
mod common;

use common::*;
use ndarray::{Array, Dimension};
use proptest::prelude::*;
use ssd_reference::random::random_problem;
use ssd_reference::{definition, naive, Problem, Real};

/// Asserts `a` and `b` hold the same bits (the sign of zero included).
fn same_bits<T: Real, D: Dimension>(what: &str, a: &Array<T, D>, b: &Array<T, D>) {
    assert_eq!(a.shape(), b.shape(), "{what}: shapes");
    for (k, (x, y)) in a.iter().zip(b.iter()).enumerate() {
        assert!(
            x.as_f64().to_bits() == y.as_f64().to_bits(),
            "{what}: entry {k}: {x} vs {y}"
        );
    }
}

fn check<T: Real>(p: &Problem<T>) {
    let want = definition::forward(p);
    let got = naive::forward(p);
    same_bits("out", &got.out, &want.out);
    same_bits("final_states", &got.final_states, &want.final_states);
}

proptest! {
    #![proptest_config(config(96, 15))]
    #[test]
    fn naive_is_the_definition_bit_for_bit(spec in any_spec(40), seed in any::<u64>()) {
        let p = random_problem(&spec, seed).expect("valid spec");
        check(&p);
        check(&p.cast::<f32>());
    }
}
