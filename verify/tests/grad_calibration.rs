//! Calibration of the gradient error model: the largest error/bound ratio over many random
//! cases, per implementation and gradient, for correct backward passes (no false alarm
//! allowed).
//!
//! `grad_calibration_quick` runs in the default suite; `grad_calibration_10k` (ignored) is the
//! recorded run of `docs/tolerances.md`:
//!
//! ```text
//! CALIBRATION_CASES=10000 cargo test -p ssd-verify --release --test grad_calibration -- --ignored --nocapture
//! ```

mod common;

use std::sync::Mutex;

use common::grad_faults::{self, GradFault, Rounding};
use common::stats::Stats;
use ndarray::Array4;
use rayon::prelude::*;
use ssd_reference::adjoint::{self, Gradients};
use ssd_reference::{chunked_backward, MatmulPrecision, Problem};
use ssd_verify::fixture::Dtype;
use ssd_verify::fuzz::{cases, DEFAULT_SEED};
use ssd_verify::suites::upstream_gradients;
use ssd_verify::tolerance::{Oracle, Precision};

/// A backward pass: the problem and upstream gradients in, the gradients and the dtype they
/// were computed in out.
type Backward = fn(&Problem<f64>, &Array4<f64>, &Array4<f64>) -> (Gradients<f64>, Dtype);

/// One correct backward pass: its label, the precision it claims, and how it computes.
struct Path {
    label: &'static str,
    precision: Precision,
    run: Backward,
}

fn adjoint_f32(
    p: &Problem<f64>,
    dout: &Array4<f64>,
    dfin: &Array4<f64>,
) -> (Gradients<f64>, Dtype) {
    let p32: Problem<f32> = p.cast();
    let (o, f) = (dout.mapv(|v| v as f32), dfin.mapv(|v| v as f32));
    let g = adjoint::backward(&p32, o.view(), Some(f.view())).expect("shapes agree");
    (g.to_f64(), Dtype::F32)
}

/// The plain-loops chunked backward (`common::grad_faults`, no fault) in f32 with `rounding`.
fn loops_f32(
    p: &Problem<f64>,
    dout: &Array4<f64>,
    dfin: &Array4<f64>,
    rounding: Rounding,
) -> (Gradients<f64>, Dtype) {
    let p32: Problem<f32> = p.cast();
    let (o, f) = (dout.mapv(|v| v as f32), dfin.mapv(|v| v as f32));
    let g = grad_faults::backward(&p32, o.view(), Some(f.view()), GradFault::None, rounding);
    (g.to_f64(), Dtype::F32)
}

/// The reference's chunked backward (`ssd_reference::chunked_backward`) in f32.
fn chunked_f32(
    p: &Problem<f64>,
    dout: &Array4<f64>,
    dfin: &Array4<f64>,
    precision: MatmulPrecision,
) -> (Gradients<f64>, Dtype) {
    let p32: Problem<f32> = p.cast();
    let (o, f) = (dout.mapv(|v| v as f32), dfin.mapv(|v| v as f32));
    let g = chunked_backward::backward(&p32, o.view(), Some(f.view()), precision)
        .expect("shapes agree");
    (g.grads.to_f64(), Dtype::F32)
}

fn paths() -> Vec<Path> {
    vec![
        Path {
            label: "reference chunked f64, at f64",
            precision: Precision::F64,
            run: |p, o, f| {
                let g = chunked_backward::backward(
                    p,
                    o.view(),
                    Some(f.view()),
                    MatmulPrecision::Native,
                )
                .expect("shapes agree");
                (g.grads, Dtype::F64)
            },
        },
        Path {
            label: "reference chunked f32, at f32",
            precision: Precision::F32,
            run: |p, o, f| chunked_f32(p, o, f, MatmulPrecision::Native),
        },
        Path {
            label: "reference chunked TF32, at tf32",
            precision: Precision::Tf32,
            run: |p, o, f| chunked_f32(p, o, f, MatmulPrecision::Tf32),
        },
        Path {
            label: "adjoint recurrence f32, at f32",
            precision: Precision::F32,
            run: adjoint_f32,
        },
        Path {
            label: "plain-loops chunked f64, at f64",
            precision: Precision::F64,
            run: |p, o, f| {
                let g = grad_faults::backward(
                    p,
                    o.view(),
                    Some(f.view()),
                    GradFault::None,
                    Rounding::None,
                );
                (g, Dtype::F64)
            },
        },
        Path {
            label: "plain-loops chunked f32, at f32",
            precision: Precision::F32,
            run: |p, o, f| loops_f32(p, o, f, Rounding::None),
        },
        Path {
            label: "plain-loops TF32 (rounding), at tf32",
            precision: Precision::Tf32,
            run: |p, o, f| loops_f32(p, o, f, Rounding::Tf32),
        },
        Path {
            label: "plain-loops TF32 (truncating), at tf32",
            precision: Precision::Tf32,
            run: |p, o, f| loops_f32(p, o, f, Rounding::Tf32Truncate),
        },
        Path {
            label: "plain-loops BF16 (bf16 inputs, dout, operands), at bf16",
            precision: Precision::Bf16,
            run: |p, o, f| loops_f32(p, o, f, Rounding::Bf16),
        },
    ]
}

fn calibrate(n: usize, seed: u64) -> Stats {
    let stats = Mutex::new(Stats::default());
    let paths = paths();
    cases(n, seed).par_iter().for_each(|case| {
        let p = case.problem();
        let (dout, dfin) = upstream_gradients(p.dims(), case.seed);
        let oracle =
            Oracle::for_gradients(&p, dout.view(), Some(dfin.view())).expect("shapes agree");
        for path in &paths {
            let (g, dtype) = (path.run)(&p, &dout, &dfin);
            let v = oracle
                .check_gradients(&g, dtype, path.precision)
                .expect("shapes agree");
            let mut s = stats.lock().unwrap();
            for t in &v.tensors {
                s.add(path.label, case, t);
            }
        }
    });
    stats.into_inner().unwrap()
}

#[test]
fn grad_calibration_quick() {
    let s = calibrate(48, DEFAULT_SEED);
    let f = s.report();
    assert!(f.is_empty(), "false alarms:\n{}", f.join("\n"));
}

#[test]
#[ignore = "the recorded calibration run (minutes); see docs/tolerances.md"]
fn grad_calibration_10k() {
    let n = std::env::var("CALIBRATION_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let s = calibrate(n, DEFAULT_SEED);
    let f = s.report();
    assert!(f.is_empty(), "false alarms:\n{}", f.join("\n"));
}
