//! The worst error/bound ratio per (implementation, tensor) over a calibration run.

use std::collections::BTreeMap;
use std::fmt::Display;

use ssd_verify::tolerance::TensorReport;

/// (label, tensor) -> (worst ratio, cases, failing cases, the worst case).
#[derive(Default)]
pub struct Stats {
    worst: BTreeMap<(String, String), (f64, usize, usize, String)>,
}

impl Stats {
    /// Records one tensor's comparison on `case`.
    pub fn add(&mut self, label: &str, case: &dyn Display, t: &TensorReport) {
        let e = self
            .worst
            .entry((label.to_string(), t.name.to_string()))
            .or_insert((0.0, 0, 0, String::new()));
        e.1 += 1;
        if !t.passed() {
            e.2 += 1;
        }
        if t.max_ratio() >= e.0 {
            e.0 = t.max_ratio();
            e.3 = case.to_string();
        }
    }

    /// Prints one line per (implementation, tensor); returns one line per false alarm.
    pub fn report(&self) -> Vec<String> {
        let mut bad = Vec::new();
        for ((label, name), (w, n, f, case)) in &self.worst {
            println!("{label:<52} {name:<16} worst {w:.3} over {n} cases, {f} failing");
            if *f > 0 {
                bad.push(format!(
                    "{label} {name}: {f} of {n} cases over the bound (worst {w:.3} at {case})"
                ));
            }
        }
        bad
    }
}
