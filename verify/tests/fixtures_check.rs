//! `ssd-oracle check`: every exit path (0 pass, 1 over the bound or not finite, 2 unusable
//! input), the JSON report, and cases without expected values.

mod common;

use std::path::{Path, PathBuf};

use common::{oracle, TempDir};
use ndarray::{Array4, ArrayD, IxDyn};
use ssd_reference::{chunked, MatmulPrecision, Problem};
use ssd_verify::fixture::{write_case, Case, Expected, FloatDtype, Outputs, TensorWriter};
use ssd_verify::suites::{build, cases, Suite};

/// Writes the smoke suite's `full` case (every option) into `dir`; returns its manifest and
/// problem.
fn full_case(dir: &TempDir, with_expected: bool) -> (PathBuf, Problem<f64>) {
    let spec = cases(Suite::Smoke)
        .into_iter()
        .find(|c| c.name == "full")
        .unwrap();
    let mut case = build(&spec, Suite::Smoke, 5).unwrap();
    if !with_expected {
        case = Case {
            expected: Expected::default(),
            ..case
        };
    }
    let path = dir.path(if with_expected {
        "full.json"
    } else {
        "bare.json"
    });
    write_case(&path, &case, FloatDtype::F32).unwrap();
    (path, case.problem)
}

fn chunked32(p: &Problem<f64>, precision: MatmulPrecision) -> Outputs<f64> {
    Outputs::from(chunked::forward(&p.cast::<f32>(), precision)).to_f64()
}

fn write(path: &Path, o: &Outputs<f64>, dtype: FloatDtype) {
    o.write(path, dtype).unwrap();
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn check(case: &Path, cand: &Path, extra: &[&str]) -> (i32, String, String) {
    let mut args = vec!["check", "--case", s(case), "--candidate", s(cand)];
    args.extend_from_slice(extra);
    oracle(&args)
}

#[test]
fn a_correct_f32_candidate_passes_with_exit_0() {
    let dir = TempDir::new("check-pass");
    let (case, p) = full_case(&dir, true);
    let cand = dir.path("c.safetensors");
    write(
        &cand,
        &chunked32(&p, MatmulPrecision::Native),
        FloatDtype::F32,
    );
    let (code, out, err) = check(&case, &cand, &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("PASS"), "{out}");
    for name in ["out", "final_states", "dA_cumsum", "chunk_states"] {
        assert!(out.contains(name), "{name} not reported: {out}");
    }
    // f32 is the default: the same at --precision f32.
    let (code, ..) = check(&case, &cand, &["--precision", "f32"]);
    assert_eq!(code, 0);
}

#[test]
fn a_tf32_candidate_fails_at_f32_passes_at_tf32_with_a_hint() {
    let dir = TempDir::new("check-tf32");
    let (case, p) = full_case(&dir, true);
    let cand = dir.path("c.safetensors");
    write(
        &cand,
        &chunked32(&p, MatmulPrecision::Tf32),
        FloatDtype::F32,
    );
    let (code, out, _) = check(&case, &cand, &["--precision", "f32"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("FAIL out"), "{out}");
    assert!(out.contains("--precision tf32"), "no hint: {out}");
    let (code, out, _) = check(&case, &cand, &["--precision", "tf32"]);
    assert_eq!(code, 0, "{out}");
    // bf16 is looser still.
    let (code, ..) = check(&case, &cand, &["--precision", "bf16"]);
    assert_eq!(code, 0);
    // f64 is stricter.
    let (code, ..) = check(&case, &cand, &["--precision", "f64"]);
    assert_eq!(code, 1);
}

#[test]
fn one_wrong_element_fails_with_its_index() {
    let dir = TempDir::new("check-one");
    let (case, p) = full_case(&dir, true);
    let mut o = chunked32(&p, MatmulPrecision::Native);
    o.out[[1, 37, 2, 5]] += 1e-3;
    let cand = dir.path("c.safetensors");
    write(&cand, &o, FloatDtype::F32);
    let (code, out, _) = check(&case, &cand, &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("(batch 1, token 37, head 2, channel 5)"),
        "index not reported: {out}"
    );
    assert!(out.contains("1/6400"), "{out}");
    // JSON says the same.
    let (code, json, _) = check(&case, &cand, &["--json"]);
    assert_eq!(code, 1);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["passed"], false);
    let t = &v["tensors"][0];
    assert_eq!(t["name"], "out");
    assert_eq!(t["exceeding"], 1);
    assert_eq!(t["worst"]["index"], serde_json::json!([1, 37, 2, 5]));
    assert!(t["worst"]["ratio"].as_f64().unwrap() > 1.0);
    assert!(t["rel_l2"].as_f64().unwrap() > 0.0);
}

#[test]
fn nan_and_infinity_fail_with_their_index() {
    let dir = TempDir::new("check-nan");
    let (case, p) = full_case(&dir, true);
    let mut o = chunked32(&p, MatmulPrecision::Native);
    o.out[[0, 3, 1, 0]] = f64::NAN;
    o.final_states[[1, 2, 3, 4]] = f64::INFINITY;
    let cand = dir.path("c.safetensors");
    write(&cand, &o, FloatDtype::F32);
    let (code, out, _) = check(&case, &cand, &["--precision", "bf16"]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("non-finite") && out.contains("(batch 0, token 3, head 1, channel 0)"),
        "{out}"
    );
    assert!(
        out.contains("(batch 1, head 2, channel 3, state 4)"),
        "{out}"
    );
    let (_, json, _) = check(&case, &cand, &["--json", "--precision", "bf16"]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["tensors"][0]["non_finite"], 1);
    assert_eq!(
        v["tensors"][0]["first_non_finite"],
        serde_json::json!([0, 3, 1, 0])
    );
}

#[test]
fn any_float_dtype_is_accepted_and_its_rounding_allowed() {
    let dir = TempDir::new("check-dtypes");
    let (case, p) = full_case(&dir, true);
    let o = chunked32(&p, MatmulPrecision::Native);
    for dtype in [
        FloatDtype::F64,
        FloatDtype::F32,
        FloatDtype::BF16,
        FloatDtype::F16,
    ] {
        let cand = dir.path("c.safetensors");
        write(&cand, &o, dtype);
        let (code, out, err) = check(&case, &cand, &[]);
        assert_eq!(code, 0, "{dtype:?}: {out}{err}");
    }
}

#[test]
fn only_out_is_required_and_extra_tensors_are_ignored() {
    let dir = TempDir::new("check-out-only");
    let (case, p) = full_case(&dir, true);
    let o = chunked32(&p, MatmulPrecision::Native);
    let cand = dir.path("c.safetensors");
    let mut w = TensorWriter::new();
    w.push("out", &o.out, FloatDtype::F32);
    w.push("y_debug", &o.out, FloatDtype::F32);
    w.write(&cand).unwrap();
    let (code, out, _) = check(&case, &cand, &[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("ignored") && out.contains("y_debug"), "{out}");
    assert!(!out.contains("chunk_states"), "{out}");
}

#[test]
fn a_case_without_expected_values_is_computed() {
    let dir = TempDir::new("check-bare");
    let (case, p) = full_case(&dir, false);
    let cand = dir.path("c.safetensors");
    let mut o = chunked32(&p, MatmulPrecision::Native);
    write(&cand, &o, FloatDtype::F32);
    let (code, out, _) = check(&case, &cand, &[]);
    assert_eq!(code, 0, "{out}");
    o.final_states[[0, 0, 0, 0]] += 0.01;
    write(&cand, &o, FloatDtype::F32);
    let (code, out, _) = check(&case, &cand, &[]);
    assert_eq!(code, 1, "{out}");
}

fn assert_unusable(code: i32, err: &str, what: &str) {
    assert_eq!(code, 2, "{what}: {err}");
    assert_eq!(err.trim().lines().count(), 1, "{what}: not one line: {err}");
    assert!(err.starts_with("error: "), "{what}: {err}");
}

#[test]
fn unusable_input_exits_2_with_one_line() {
    let dir = TempDir::new("check-bad");
    let (case, p) = full_case(&dir, true);
    let o = chunked32(&p, MatmulPrecision::Native);

    // No `out`.
    let cand = dir.path("no-out.safetensors");
    let mut w = TensorWriter::new();
    w.push("final_states", &o.final_states, FloatDtype::F32);
    w.write(&cand).unwrap();
    let (code, _, err) = check(&case, &cand, &[]);
    assert_unusable(code, &err, "missing out");
    assert!(err.contains("`out` is missing"), "{err}");

    // Wrong shape.
    let cand = dir.path("shape.safetensors");
    let mut w = TensorWriter::new();
    w.push(
        "out",
        &Array4::<f64>::zeros((2, 100, 4, 7)),
        FloatDtype::F32,
    );
    w.write(&cand).unwrap();
    let (code, _, err) = check(&case, &cand, &[]);
    assert_unusable(code, &err, "wrong shape");
    assert!(err.contains("shape") && err.contains("`out`"), "{err}");

    // Wrong shape of an optional output.
    let cand = dir.path("shape2.safetensors");
    let mut w = TensorWriter::new();
    w.push("out", &o.out, FloatDtype::F32);
    w.push(
        "chunk_states",
        &ArrayD::<f64>::zeros(IxDyn(&[2, 3, 4, 8, 8])),
        FloatDtype::F32,
    );
    w.write(&cand).unwrap();
    let (code, _, err) = check(&case, &cand, &[]);
    assert_unusable(code, &err, "wrong chunk_states shape");
    assert!(err.contains("chunk_states"), "{err}");

    // Integer dtype.
    let cand = dir.path("int.safetensors");
    let mut w = TensorWriter::new();
    w.push_index("out", &o.out.mapv(|v| v as i64), false)
        .unwrap();
    w.write(&cand).unwrap();
    let (code, _, err) = check(&case, &cand, &[]);
    assert_unusable(code, &err, "integer out");
    assert!(err.contains("dtype"), "{err}");

    // Unreadable or missing files.
    let garbage = dir.path("garbage.safetensors");
    std::fs::write(&garbage, b"not a safetensors file").unwrap();
    let (code, _, err) = check(&case, &garbage, &[]);
    assert_unusable(code, &err, "garbage candidate");
    let (code, _, err) = check(&case, &dir.path("absent.safetensors"), &[]);
    assert_unusable(code, &err, "missing candidate");
    let good = dir.path("good.safetensors");
    write(&good, &o, FloatDtype::F32);
    let (code, _, err) = check(&dir.path("absent.json"), &good, &[]);
    assert_unusable(code, &err, "missing case");

    // A bad precision name is a usage error.
    let (code, _, err) = check(&case, &good, &["--precision", "fp8"]);
    assert_unusable(code, &err, "bad precision");
}

#[test]
fn stale_magnitudes_are_refused() {
    let dir = TempDir::new("check-stale");
    let spec = cases(Suite::Smoke)
        .into_iter()
        .find(|c| c.name == "full")
        .unwrap();
    let mut case = build(&spec, Suite::Smoke, 5).unwrap();
    if let Some(m) = case.expected.out_mag.as_mut() {
        m[[0, 0, 0, 0]] *= 2.0;
    }
    let path = dir.path("stale.json");
    write_case(&path, &case, FloatDtype::F32).unwrap();
    let cand = dir.path("c.safetensors");
    write(
        &cand,
        &chunked32(&case.problem, MatmulPrecision::Native),
        FloatDtype::F32,
    );
    let (code, _, err) = check(&path, &cand, &[]);
    assert_unusable(code, &err, "stale out_mag");
    assert!(err.contains("out_mag"), "{err}");
}
