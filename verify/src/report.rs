//! The checker's report: what `ssd-oracle check` prints (as a table or as JSON) and what the
//! Python package raises or returns, built once here so that every front end says the same.
//!
//! [`check_candidate`] compares a kernel's output tensors with a problem's float64 reference
//! under the error bound of one [`Precision`] and, when the check fails, maps where the error
//! lives and draws the hints ([`crate::diagnose`]); [`Report::text`] renders the table (with
//! its `where` and `hint:` lines), `serde_json` the JSON form (`check --json`, with `hints` and
//! `error_map`), [`crate::plot`] the picture (`check --plot`).
//!
//! ```
//! use ssd_reference::random::{random_problem, ProblemSpec};
//! use ssd_reference::Dims;
//! use ssd_verify::fixture::Dtype;
//! use ssd_verify::report::{check_candidate, Labels};
//! use ssd_verify::tolerance::{Oracle, OutputName, Precision};
//!
//! let dims = Dims::new(1, 16, 2, 4, 1, 8);
//! let p = random_problem(&ProblemSpec::full(dims, 8), 7).unwrap();
//! let oracle = Oracle::new(&p);
//! let out = oracle.reference(OutputName::Out).clone();
//! let report = check_candidate(
//!     Labels::default(),
//!     &p,
//!     &oracle,
//!     &[(OutputName::Out, &out, Dtype::F64)],
//!     Vec::new(),
//!     Precision::F32,
//! )
//! .unwrap();
//! assert!(report.passed);
//! assert!(report.text().contains("PASS"));
//! ```

use std::fmt::Write as _;

use ndarray::ArrayD;
use serde::Serialize;
use ssd_reference::{Dims, Problem};

use crate::diagnose::{diagnose, Basis, Hint, Stage, TensorMap};
use crate::error::VerifyError;
use crate::fixture::{self, expected_shape, Dtype};
use crate::tolerance::{Oracle, OutputName, Precision, TensorReport, Verdict};

/// Where the case and the candidate came from, for the report's header (file paths for the
/// command line, a description for in-memory checks).
#[derive(Debug, Clone, Default)]
pub struct Labels {
    pub case: String,
    pub candidate: String,
}

/// The report of one check: the fields of `check --json`, plus the sizes for the table.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub case: String,
    pub candidate: String,
    pub precision: Precision,
    pub unit_roundoff: f64,
    /// Every element of every tensor within its bound, none non-finite.
    pub passed: bool,
    /// The worst error/bound ratio over every tensor (above 1 fails).
    pub worst_ratio: f64,
    pub tensors: Vec<TensorReport>,
    /// Tensors of the candidate that are not outputs of the contract.
    pub ignored: Vec<String>,
    /// The text of the first hint (kept for readers of the first JSON form).
    pub hint: Option<String>,
    /// Likely explanations of a failure, when the pattern is clear ([`crate::diagnose`]):
    /// stage, confidence (`sure` or `likely`) and text. Empty when the check passed.
    pub hints: Vec<Hint>,
    /// Where the failing tensors are wrong: per tensor, the error/bound ratio aggregated by
    /// position in the chunk, chunk, head, group, sequence, batch row, channel and state.
    pub error_map: Vec<TensorMap>,
    #[serde(skip)]
    dims: Dims,
    #[serde(skip)]
    chunk_size: usize,
}

/// Checks that a candidate tensor has the shape the contract gives it for this problem.
///
/// # Errors
/// The message names the tensor, its shape, and the layout and shape expected.
pub fn check_candidate_shape(
    name: OutputName,
    shape: &[usize],
    dims: &Dims,
    chunk_size: usize,
) -> Result<(), String> {
    let want = expected_shape(name.name(), dims, chunk_size).expect("an output name");
    if shape == want.as_slice() {
        return Ok(());
    }
    Err(format!(
        "tensor `{name}` has shape {shape:?}, expected {} = {want:?} from the case",
        fixture::layout(name.name()).unwrap_or("?")
    ))
}

/// Compares each `(name, values, storage dtype)` of a candidate with the oracle's reference at
/// `precision`, and adds the hint when the failure has a clear explanation.
///
/// # Errors
/// [`VerifyError::Usage`] when a tensor's shape differs from the contract's (check shapes with
/// [`check_candidate_shape`] first for a better message).
pub fn check_candidate(
    labels: Labels,
    problem: &Problem<f64>,
    oracle: &Oracle,
    present: &[(OutputName, &ArrayD<f64>, Dtype)],
    ignored: Vec<String>,
    precision: Precision,
) -> Result<Report, VerifyError> {
    let compare = |precision: Precision| -> Result<Verdict, VerifyError> {
        let tensors = present
            .iter()
            .map(|(name, t, dtype)| oracle.compare(*name, t, *dtype, precision))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Verdict { precision, tensors })
    };
    let verdict = compare(precision)?;
    let (hints, error_map) = if verdict.passed() {
        (Vec::new(), Vec::new())
    } else {
        let diagnosis = diagnose(problem, oracle, present, precision, &verdict)?;
        // Within the TF32 bound: a hint that explains the candidate first, then the precision;
        // one from the map's pattern is dropped (TF32 rounding has patterns of its own).
        let hints = match precision_hint(precision, &verdict, &compare)? {
            Some(h) => {
                let mut v: Vec<Hint> = diagnosis
                    .hints
                    .into_iter()
                    .filter(|h| h.basis == Basis::Explained)
                    .collect();
                v.push(h);
                v
            }
            None => diagnosis.hints,
        };
        (hints, diagnosis.maps)
    };
    Ok(Report {
        case: labels.case,
        candidate: labels.candidate,
        precision,
        unit_roundoff: precision.unit_roundoff(),
        passed: verdict.passed(),
        worst_ratio: verdict.max_ratio(),
        tensors: verdict.tensors,
        ignored,
        hint: hints.first().map(|h| h.text.clone()),
        hints,
        error_map,
        dims: *problem.dims(),
        chunk_size: problem.options().chunk_size,
    })
}

/// When a candidate fails at f64 or f32 but passes at TF32, it most likely is a TF32 kernel
/// (and the map's pattern is the rounding's, not a stage's).
fn precision_hint(
    precision: Precision,
    verdict: &Verdict,
    compare: &dyn Fn(Precision) -> Result<Verdict, VerifyError>,
) -> Result<Option<Hint>, VerifyError> {
    if verdict.tensors.iter().any(|t| t.non_finite > 0) {
        return Ok(None);
    }
    if matches!(precision, Precision::F64 | Precision::F32) && compare(Precision::Tf32)?.passed() {
        return Ok(Some(Hint::explained(
            Stage::Precision,
            "every element is within the TF32 bound: if the kernel multiplies with TF32 tensor cores (Triton's default for f32 dots), check it with --precision tf32",
        )));
    }
    Ok(None)
}

/// `` `a`, `b` `` or "no tensor".
pub fn list_names(names: &[String]) -> String {
    if names.is_empty() {
        "no tensor".into()
    } else {
        names
            .iter()
            .map(|n| format!("`{n}`"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// An index with its axis names: `(batch 0, seqlen 7, nheads 1, headdim 2)`.
pub fn at(name: OutputName, index: &[usize]) -> String {
    let parts: Vec<String> = name
        .axes()
        .iter()
        .zip(index)
        .map(|(a, i)| format!("{a} {i}"))
        .collect();
    format!("({})", parts.join(", "))
}

impl Report {
    /// The worst error/bound ratio of one tensor, when it was checked.
    pub fn tensor(&self, name: OutputName) -> Option<&TensorReport> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The lines that say why the check failed (empty when it passed): per failing tensor, its
    /// non-finite elements and its worst element, then the hint.
    pub fn failure_lines(&self) -> Vec<String> {
        let mut lines = Vec::new();
        for t in self.tensors.iter().filter(|t| !t.passed()) {
            if let Some(idx) = &t.first_non_finite {
                lines.push(format!(
                    "FAIL {}: {} non-finite element(s), the first at {}",
                    t.name,
                    t.non_finite,
                    at(t.name, idx)
                ));
            }
            if let Some(w) = &t.worst {
                if w.ratio.is_finite() {
                    lines.push(format!(
                        "FAIL {}: {} element(s) over the bound; worst at {}: candidate {:.9e}, expected {:.9e}, error {:.3e}, bound {:.3e} ({:.3e}x), magnitude {:.3e}",
                        t.name,
                        t.exceeding - t.non_finite,
                        at(t.name, &w.index),
                        w.candidate,
                        w.expected,
                        w.error,
                        w.bound,
                        w.ratio,
                        w.magnitude
                    ));
                }
            }
        }
        for m in &self.error_map {
            lines.push(format!("where {}", crate::diagnose::summary(m)));
        }
        if !self.passed {
            for h in &self.hints {
                lines.push(format!("hint: {} ({}): {}", h.stage, h.confidence, h.text));
            }
        }
        lines
    }

    /// The table `ssd-oracle check` prints: the sizes, one row per tensor, then the verdict.
    pub fn text(&self) -> String {
        let d = &self.dims;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "case {}: batch {}, seqlen {}, nheads {}, headdim {}, ngroups {}, dstate {}, chunk {}",
            self.case, d.batch, d.seqlen, d.nheads, d.headdim, d.ngroups, d.dstate, self.chunk_size
        );
        let _ = writeln!(
            s,
            "candidate {}, checked as --precision {} (unit roundoff {:.3e})",
            self.candidate, self.precision, self.unit_roundoff
        );
        let _ = writeln!(
            s,
            "{:<15} {:<6} {:>11} {:>11} {:>10} {:>14}  worst element",
            "tensor", "dtype", "max abs err", "rel L2 err", "err/bound", "over bound"
        );
        for t in &self.tensors {
            let worst = t
                .worst
                .as_ref()
                .map(|w| at(t.name, &w.index))
                .unwrap_or_default();
            let _ = writeln!(
                s,
                "{:<15} {:<6} {:>11.3e} {:>11.3e} {:>10.3e} {:>14}  {worst}",
                t.name.name(),
                t.dtype,
                t.max_abs_error,
                t.rel_l2,
                t.max_ratio(),
                format!("{}/{}", t.exceeding, t.elements),
            );
        }
        if !self.ignored.is_empty() {
            let _ = writeln!(
                s,
                "ignored (not an output of the contract): {}",
                list_names(&self.ignored)
            );
        }
        if self.passed {
            let _ = writeln!(
                s,
                "PASS: every element within its bound (worst error/bound {:.3})",
                self.worst_ratio
            );
        }
        for line in self.failure_lines() {
            let _ = writeln!(s, "{line}");
        }
        s
    }

    /// The report as pretty-printed JSON (`check --json`).
    ///
    /// # Errors
    /// [`VerifyError::Usage`] if serialisation fails (it does not for finite reports; a
    /// non-finite ratio is written as `null`).
    pub fn to_json(&self) -> Result<String, VerifyError> {
        serde_json::to_string_pretty(self)
            .map_err(|e| VerifyError::Usage(format!("cannot encode the report: {e}")))
    }
}
