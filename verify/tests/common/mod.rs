//! Test-only helpers shared by the fuzz, fault and fixture tests.
#![allow(dead_code)]

pub mod faults;

use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{RngAlgorithm, TestRng, TestRunner};
use ssd_verify::fuzz::{case_strategy, Config, FuzzCase};

/// `n` cases drawn from the default fuzz strategy with a fixed seed (the same every run).
pub fn fixed_cases(n: usize, seed: u8) -> Vec<FuzzCase> {
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::from_seed(RngAlgorithm::ChaCha, &[seed; 32]),
    );
    let strategy = case_strategy();
    (0..n)
        .map(|_| {
            strategy
                .new_tree(&mut runner)
                .expect("the strategy never rejects")
                .current()
        })
        .collect()
}
