//! `ssd-oracle grad` end to end: the gradients written, their dtypes, and the refusals.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ndarray::Array4;
use ssd_reference::random::{random_problem, ProblemSpec, SeqIdx};
use ssd_reference::{adjoint, Dims, Problem};
use ssd_verify::fixture::{
    write_case, Case, CaseMeta, Dtype, Expected, FloatDtype, TensorFile, TensorWriter,
};

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("cli_grad-{name}"));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

fn oracle(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ssd-oracle"))
        .args(args)
        .output()
        .expect("the binary runs")
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A case with every option but `seq_idx` (its values are covered by the reference's tests),
/// and the given upstream gradients added to its tensor file.
fn case_with(dir: &Path, extra: &[(&str, Array4<f64>)]) -> (PathBuf, Problem<f64>) {
    let mut spec = ProblemSpec::full(Dims::new(2, 21, 4, 3, 2, 5), 8);
    spec.seq_idx = SeqIdx::None;
    let problem = random_problem(&spec, 4).unwrap();
    let path = dir.join("case.json");
    let case = Case {
        meta: CaseMeta::default(),
        problem: problem.clone(),
        expected: Expected::default(),
        packing: None,
    };
    write_case(&path, &case, FloatDtype::F64).unwrap();
    let tensors = path.with_extension("safetensors");
    let file = TensorFile::open(&tensors).unwrap();
    let mut w = TensorWriter::new();
    for name in file.names() {
        w.push(
            &name,
            &file.read_float(&name).unwrap().data,
            FloatDtype::F64,
        );
    }
    for (name, a) in extra {
        w.push(name, a, FloatDtype::F64);
    }
    w.write(&tensors).unwrap();
    (path, problem)
}

fn upstream(p: &Problem<f64>) -> (Array4<f64>, Array4<f64>) {
    let d = *p.dims();
    let dout = Array4::from_shape_fn((d.batch, d.seqlen, d.nheads, d.headdim), |(b, t, h, q)| {
        ((b * 7 + t * 3 + h * 5 + q) % 11) as f64 / 11.0 - 0.5
    });
    let dfin = Array4::from_shape_fn((d.batch, d.nheads, d.headdim, d.dstate), |(b, h, q, n)| {
        ((b + h * 3 + q * 5 + n * 2) % 7) as f64 / 7.0 - 0.5
    });
    (dout, dfin)
}

#[test]
fn grad_writes_the_adjoint_of_every_input_the_case_has() {
    let dir = scratch("writes");
    let probe = random_problem(&ProblemSpec::full(Dims::new(2, 21, 4, 3, 2, 5), 8), 4).unwrap();
    let (dout, dfin) = upstream(&probe);
    let (case, problem) = case_with(
        &dir,
        &[("dout", dout.clone()), ("dfinal_states", dfin.clone())],
    );
    let out = dir.join("grads.safetensors");
    let o = oracle(&["grad", "--case", s(&case), "--out", s(&out)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let want = adjoint::backward(&problem, dout.view(), Some(dfin.view())).unwrap();
    let file = TensorFile::open(&out).unwrap();
    let mut names = file.names();
    names.sort();
    let mut expected: Vec<String> = want.named().iter().map(|(n, _)| n.to_string()).collect();
    expected.sort();
    assert_eq!(names, expected);
    for (name, a) in want.named() {
        let got = file.read_float(name).unwrap();
        assert_eq!(got.dtype, Dtype::F64, "{name}");
        assert_eq!(got.data, a.to_owned(), "{name}: not the adjoint's bits");
    }

    // f32: stored as F32, close to the f64 truth.
    let out32 = dir.join("grads32.safetensors");
    let o = oracle(&[
        "grad",
        "--case",
        s(&case),
        "--out",
        s(&out32),
        "--precision",
        "f32",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let file = TensorFile::open(&out32).unwrap();
    let dx = file.read_float("dx").unwrap();
    assert_eq!(dx.dtype, Dtype::F32);
    let scale = want.dx.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let worst = dx
        .data
        .iter()
        .zip(want.dx.iter())
        .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        worst > 0.0 && worst < 1e-4 * scale,
        "f32 dx off by {worst} (scale {scale})"
    );
}

#[test]
fn grad_refuses_a_case_without_dout_and_bad_upstream_gradients() {
    let dir = scratch("refuses");
    let out = dir.join("grads.safetensors");

    let (case, _) = case_with(&dir, &[]);
    let o = oracle(&["grad", "--case", s(&case), "--out", s(&out)]);
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(
        e.contains("`dout` is missing") && e.lines().count() == 1,
        "{e}"
    );
    assert!(!out.exists(), "nothing is written on failure");

    let (case, _) = case_with(&dir, &[("dout", Array4::zeros((2, 21, 4, 2)))]);
    let o = oracle(&["grad", "--case", s(&case), "--out", s(&out)]);
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(e.contains("`dout`") && e.contains("[2, 21, 4, 2]"), "{e}");
    assert!(!out.exists(), "nothing is written on failure");

    // The case's own tensor file as the output: refused, and left as it was.
    let (case, _) = case_with(&dir, &[("dout", Array4::zeros((2, 21, 4, 3)))]);
    let tensors = case.with_extension("safetensors");
    let before = fs::read(&tensors).unwrap();
    let o = oracle(&["grad", "--case", s(&case), "--out", s(&tensors)]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("refusing to overwrite an input"),
        "{}",
        stderr(&o)
    );
    assert_eq!(fs::read(&tensors).unwrap(), before);

    let (case, _) = case_with(
        &dir,
        &[
            ("dout", Array4::zeros((2, 21, 4, 3))),
            ("dfinal_states", Array4::zeros((2, 4, 3, 4))),
        ],
    );
    let o = oracle(&["grad", "--case", s(&case), "--out", s(&out)]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("`dfinal_states`"), "{}", stderr(&o));
    assert!(!out.exists(), "nothing is written on failure");
}

/// `check` on gradient candidates: what `grad` writes passes at its own precision, a TF32
/// chunked backward fails at f32, and a wrong gradient fails naming it.
#[test]
fn check_takes_gradient_candidates() {
    let dir = scratch("check");
    let dout = Array4::from_shape_fn((2, 21, 4, 3), |(b, t, h, p)| {
        ((b * 7 + t * 3 + h * 5 + p) % 11) as f64 / 5.0 - 1.0
    });
    let dfin = Array4::from_shape_fn((2, 4, 3, 5), |(b, h, p, n)| {
        ((b + h * 3 + p * 7 + n * 2) % 9) as f64 / 4.0 - 1.0
    });
    let (case, _) = case_with(&dir, &[("dout", dout), ("dfinal_states", dfin)]);
    let cand = dir.join("grads.safetensors");
    let run = |im: &str, pr: &str, check_at: &str| -> Output {
        let o = oracle(&[
            "grad",
            "--case",
            s(&case),
            "--out",
            s(&cand),
            "--impl",
            im,
            "--precision",
            pr,
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        oracle(&[
            "check",
            "--case",
            s(&case),
            "--candidate",
            s(&cand),
            "--precision",
            check_at,
        ])
    };
    for (im, pr) in [
        ("naive", "f32"),
        ("chunked", "f32"),
        ("chunked", "f64"),
        ("chunked", "tf32"),
    ] {
        let o = run(im, pr, pr);
        assert_eq!(
            o.status.code(),
            Some(0),
            "{im} {pr}: {}",
            String::from_utf8_lossy(&o.stdout)
        );
        let text = String::from_utf8_lossy(&o.stdout);
        for name in [
            "dx",
            "ddt",
            "dA",
            "dB",
            "dC",
            "dD",
            "dz",
            "ddt_bias",
            "dinitial_states",
        ] {
            assert!(
                text.lines().any(|l| l.starts_with(&format!("{name} "))),
                "{name} checked:\n{text}"
            );
        }
    }
    let o = run("chunked", "tf32", "f32");
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );

    // One gradient wrong: refused, and the report names it.
    let o = oracle(&[
        "grad",
        "--case",
        s(&case),
        "--out",
        s(&cand),
        "--precision",
        "f32",
    ]);
    assert!(o.status.success());
    let file = TensorFile::open(&cand).unwrap();
    let mut w = TensorWriter::new();
    for name in file.names() {
        let mut a = file.read_float(&name).unwrap().data;
        if name == "ddt_bias" {
            // About 0.4 of the element's value, far over its f32 bound (about 2e-3 here:
            // `ddt_bias` sums terms of both signs, so its bound scales with their magnitude).
            a[[1]] += 0.05;
        }
        w.push(&name, &a, FloatDtype::F32);
    }
    w.write(&cand).unwrap();
    let o = oracle(&["check", "--case", s(&case), "--candidate", s(&cand)]);
    assert_eq!(o.status.code(), Some(1));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("FAIL ddt_bias"), "{text}");
}

/// Bad gradient candidates: one line naming the tensor, exit status 2.
#[test]
fn check_refuses_bad_gradient_candidates() {
    let dir = scratch("check-refuses");
    let cand = dir.join("cand.safetensors");
    let write = |tensors: &[(&str, ndarray::ArrayD<f64>)]| {
        let mut w = TensorWriter::new();
        for (n, a) in tensors {
            w.push(n, a, FloatDtype::F32);
        }
        w.write(&cand).unwrap();
    };
    let refused = |case: &Path, what: &[&str]| {
        let o = oracle(&["check", "--case", s(case), "--candidate", s(&cand)]);
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        let e = stderr(&o);
        assert_eq!(e.lines().count(), 1, "{e}");
        for w in what {
            assert!(e.contains(w), "{w} in {e}");
        }
    };
    let (case, _) = case_with(&dir, &[("dout", Array4::zeros((2, 21, 4, 3)))]);
    // A gradient of the wrong shape.
    write(&[("dx", ndarray::ArrayD::zeros(ndarray::IxDyn(&[2, 21, 4, 2])))]);
    refused(&case, &["`dx`", "[2, 21, 4, 2]", "[2, 21, 4, 3]"]);
    write(&[("dD", ndarray::ArrayD::zeros(ndarray::IxDyn(&[4])))]);
    refused(&case, &["`dD`", "[4]"]);
    // A gradient of an input the case does not have.
    let plain = dir.join("plain");
    fs::create_dir_all(&plain).unwrap();
    let p = random_problem(&ProblemSpec::plain(Dims::new(1, 8, 2, 3, 1, 4)), 1).unwrap();
    let plain_case = plain.join("case.json");
    let c = Case {
        meta: CaseMeta::default(),
        problem: p,
        expected: Expected::default(),
        packing: None,
    };
    write_case(&plain_case, &c, FloatDtype::F64).unwrap();
    write(&[("dz", ndarray::ArrayD::zeros(ndarray::IxDyn(&[1, 8, 2, 3])))]);
    refused(&plain_case, &["`dz`", "`z`", "does not have"]);
    // Gradients against a case without `dout`.
    write(&[("dx", ndarray::ArrayD::zeros(ndarray::IxDyn(&[1, 8, 2, 3])))]);
    refused(&plain_case, &["`dout` is missing"]);
    // No `out` and no gradient.
    write(&[(
        "final_states",
        ndarray::ArrayD::zeros(ndarray::IxDyn(&[1, 2, 3, 4])),
    )]);
    refused(&plain_case, &["`out` is missing"]);
}
