//! Fixture cases: every way a case can be unusable gives one error line that names the problem.

use std::fs;
use std::path::{Path, PathBuf};

use ndarray::{ArrayD, IxDyn};
use serde_json::{json, Value};
use ssd_reference::random::{random_problem, ProblemSpec};
use ssd_reference::Dims;
use ssd_verify::fixture::{read_case, read_tensor, FloatDtype, TensorFile, TensorWriter};
use ssd_verify::VerifyError;

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("fixture_errors-{name}"));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

/// A case under construction: the manifest as JSON and the tensors as they will be stored.
struct Raw {
    manifest: Value,
    floats: Vec<(String, ArrayD<f64>, FloatDtype)>,
    ints: Vec<(String, ArrayD<i64>)>,
}

impl Raw {
    /// A valid case with every option: 2 x 9 tokens, 4 heads x 3 channels, 2 groups, dstate 5,
    /// chunk 4.
    fn valid() -> Raw {
        let dims = Dims {
            batch: 2,
            seqlen: 9,
            nheads: 4,
            headdim: 3,
            ngroups: 2,
            dstate: 5,
        };
        let p = random_problem(&ProblemSpec::full(dims, 4), 1).unwrap();
        let i = p.inputs();
        let f = |name: &str, a: ArrayD<f64>| (name.to_string(), a, FloatDtype::F64);
        Raw {
            manifest: json!({
                "format": "ssd-fixture/1",
                "dims": {"batch": 2, "seqlen": 9, "nheads": 4, "headdim": 3, "ngroups": 2, "dstate": 5},
                "chunk_size": 4,
                "dt_softplus": true,
                "dt_limit": [0.0, null],
                "tensors": "case.safetensors",
            }),
            floats: vec![
                f("x", i.x.clone().into_dyn()),
                f("dt", i.dt.clone().into_dyn()),
                f("A", i.A.clone().into_dyn()),
                f("B", i.B.clone().into_dyn()),
                f("C", i.C.clone().into_dyn()),
                f("D", i.D.clone().unwrap()),
                f("z", i.z.clone().unwrap().into_dyn()),
                f("dt_bias", i.dt_bias.clone().unwrap().into_dyn()),
                f(
                    "initial_states",
                    i.initial_states.clone().unwrap().into_dyn(),
                ),
            ],
            ints: vec![("seq_idx".to_string(), i.seq_idx.clone().unwrap().into_dyn())],
        }
    }

    fn float(&mut self, name: &str) -> &mut ArrayD<f64> {
        &mut self.floats.iter_mut().find(|(n, ..)| n == name).unwrap().1
    }

    fn set_float(&mut self, name: &str, a: ArrayD<f64>, dtype: FloatDtype) {
        self.remove(name);
        self.floats.push((name.to_string(), a, dtype));
    }

    fn remove(&mut self, name: &str) {
        self.floats.retain(|(n, ..)| n != name);
        self.ints.retain(|(n, ..)| n != name);
    }

    /// Writes `case.json` and `case.safetensors` into a fresh folder; returns the manifest path.
    fn write(&self, test: &str) -> PathBuf {
        let dir = scratch(test);
        let mut w = TensorWriter::new();
        for (name, a, dtype) in &self.floats {
            w.push(name, a, *dtype);
        }
        for (name, a) in &self.ints {
            w.push_index(name, a, false).unwrap();
        }
        w.write(dir.join("case.safetensors")).unwrap();
        let path = dir.join("case.json");
        fs::write(&path, self.manifest.to_string()).unwrap();
        path
    }
}

/// Reads the case, expects an error, checks it is one line and contains every `needle`.
fn expect_error(path: &Path, needles: &[&str]) -> VerifyError {
    let err = match read_case(path) {
        Ok(_) => panic!("`{}` was accepted; expected an error", path.display()),
        Err(e) => e,
    };
    let msg = err.to_string();
    assert!(!msg.contains('\n'), "not one line: {msg}");
    for needle in needles {
        assert!(msg.contains(needle), "`{needle}` not in: {msg}");
    }
    err
}

#[test]
fn the_valid_case_is_accepted() {
    // The base every test below breaks in one place.
    read_case(Raw::valid().write("valid")).unwrap();
}

#[test]
fn wrong_or_missing_format_is_refused() {
    let mut raw = Raw::valid();
    raw.manifest["format"] = json!("ssd-fixture/2");
    let e = expect_error(
        &raw.write("format2"),
        &["`format`", "ssd-fixture/2", "ssd-fixture/1"],
    );
    assert!(matches!(e, VerifyError::Manifest { .. }));
    raw.manifest.as_object_mut().unwrap().remove("format");
    expect_error(&raw.write("noformat"), &["missing key `format`"]);
    raw.manifest["format"] = json!(1);
    expect_error(&raw.write("format-number"), &["`format`"]);
}

#[test]
fn malformed_json_is_refused_with_a_hint_for_infinity() {
    let raw = Raw::valid();
    let path = raw.write("badjson");
    fs::write(&path, "{\"format\": \"ssd-fixture/1\",").unwrap();
    expect_error(&path, &["case.json", "not valid JSON"]);
    // Python's json.dump writes Infinity for float("inf").
    let text = raw.manifest.to_string().replace("null", "Infinity");
    fs::write(&path, text).unwrap();
    expect_error(&path, &["not valid JSON", "write null"]);
    fs::write(&path, "[1, 2]").unwrap();
    expect_error(&path, &["JSON object"]);
}

#[test]
fn bad_dims_are_refused_naming_the_key() {
    let mut raw = Raw::valid();
    raw.manifest["dims"]
        .as_object_mut()
        .unwrap()
        .remove("headdim");
    expect_error(&raw.write("nohd"), &["dims.headdim"]);
    let mut raw = Raw::valid();
    raw.manifest["dims"]["batch"] = json!(-2);
    expect_error(&raw.write("negbatch"), &["dims.batch", "-2"]);
    let mut raw = Raw::valid();
    raw.manifest["dims"]["dstate"] = json!(5.5);
    expect_error(&raw.write("fracdstate"), &["dims.dstate"]);
    let mut raw = Raw::valid();
    raw.manifest["dims"] = json!([2, 9, 4, 3, 2, 5]);
    expect_error(&raw.write("dimsarray"), &["`dims` must be an object"]);
    // ngroups that does not divide nheads (the tensors agree with the dims: the reference refuses).
    let mut raw = Raw::valid();
    raw.manifest["dims"]["ngroups"] = json!(3);
    raw.manifest["dims"]["nheads"] = json!(4);
    for name in ["B", "C"] {
        raw.set_float(name, ArrayD::zeros(IxDyn(&[2, 9, 3, 5])), FloatDtype::F64);
    }
    let e = expect_error(&raw.write("ngroups"), &["ngroups"]);
    assert!(matches!(e, VerifyError::Problem { .. }));
}

#[test]
fn bad_chunk_size_is_refused() {
    let mut raw = Raw::valid();
    raw.manifest["chunk_size"] = json!(6);
    expect_error(&raw.write("chunk6"), &["chunk_size", "power of two"]);
    raw.manifest["chunk_size"] = json!(0);
    expect_error(&raw.write("chunk0"), &["chunk_size"]);
    raw.manifest["chunk_size"] = json!("64");
    expect_error(&raw.write("chunkstr"), &["`chunk_size`"]);
    raw.manifest.as_object_mut().unwrap().remove("chunk_size");
    expect_error(&raw.write("nochunk"), &["missing key `chunk_size`"]);
}

#[test]
fn bad_dt_limit_and_dt_softplus_are_refused() {
    for (k, bad) in [
        json!([0.5, 0.1]),
        json!([0.1]),
        json!([0.0, null, 1.0]),
        json!([null, 1.0]),
        json!("0, inf"),
        json!([0.0, "inf"]),
    ]
    .into_iter()
    .enumerate()
    {
        let mut raw = Raw::valid();
        raw.manifest["dt_limit"] = bad.clone();
        expect_error(&raw.write(&format!("dtlimit{k}")), &["`dt_limit`"]);
    }
    let mut raw = Raw::valid();
    raw.manifest["dt_softplus"] = json!("yes");
    expect_error(&raw.write("softplus"), &["`dt_softplus`"]);
    let mut raw = Raw::valid();
    raw.manifest["tensors"] = json!(3);
    expect_error(&raw.write("tensorskey"), &["`tensors`"]);
}

#[test]
fn missing_or_unreadable_files_are_refused() {
    let dir = scratch("nofiles");
    expect_error(&dir.join("absent.json"), &["cannot read", "absent.json"]);

    let mut raw = Raw::valid();
    raw.manifest["tensors"] = json!("elsewhere.safetensors");
    let e = expect_error(
        &raw.write("notensors"),
        &["cannot read", "elsewhere.safetensors"],
    );
    assert!(matches!(e, VerifyError::Io { .. }));

    let raw = Raw::valid();
    let path = raw.write("garbage");
    fs::write(
        path.with_file_name("case.safetensors"),
        b"definitely not safetensors",
    )
    .unwrap();
    expect_error(&path, &["case.safetensors", "not a valid safetensors file"]);
}

#[test]
fn each_missing_required_tensor_is_named() {
    for name in ["x", "dt", "A", "B", "C"] {
        let mut raw = Raw::valid();
        raw.remove(name);
        let e = expect_error(
            &raw.write(&format!("missing-{name}")),
            &[&format!("tensor `{name}` is missing"), "case.safetensors"],
        );
        assert!(matches!(e, VerifyError::Tensors { .. }));
    }
}

#[test]
fn wrong_shapes_are_refused_naming_the_tensor_and_its_layout() {
    let cases: [(&str, &[usize], &str); 6] = [
        ("x", &[2, 8, 4, 3], "[batch, seqlen, nheads, headdim]"),
        ("dt", &[2, 9], "[batch, seqlen, nheads]"),
        ("B", &[2, 9, 1, 5], "[batch, seqlen, ngroups, dstate]"),
        ("D", &[3], "[nheads] or [nheads, headdim]"),
        (
            "initial_states",
            &[2, 4, 5, 3],
            "[batch, nheads, headdim, dstate]",
        ),
        ("dt_bias", &[4, 1], "[nheads]"),
    ];
    for (name, shape, layout) in cases {
        let mut raw = Raw::valid();
        raw.set_float(name, ArrayD::zeros(IxDyn(shape)), FloatDtype::F64);
        expect_error(
            &raw.write(&format!("shape-{name}")),
            &[&format!("tensor `{name}` has shape {shape:?}"), layout],
        );
    }
    let mut raw = Raw::valid();
    raw.ints = vec![("seq_idx".into(), ArrayD::zeros(IxDyn(&[9, 2])))];
    expect_error(
        &raw.write("shape-seqidx"),
        &["tensor `seq_idx` has shape [9, 2]"],
    );
}

#[test]
fn wrong_dtypes_are_refused_naming_the_tensor() {
    let mut raw = Raw::valid();
    let a = raw.float("A").clone();
    raw.set_float("A", a, FloatDtype::BF16);
    expect_error(
        &raw.write("dtype-A"),
        &["tensor `A` has dtype BF16, expected F64 or F32"],
    );

    let mut raw = Raw::valid();
    let a = raw.float("initial_states").clone();
    raw.set_float("initial_states", a, FloatDtype::F16);
    expect_error(
        &raw.write("dtype-init"),
        &["tensor `initial_states` has dtype F16"],
    );

    let mut raw = Raw::valid();
    let s = raw.ints[0].1.mapv(|v| v as f64);
    raw.remove("seq_idx");
    raw.set_float("seq_idx", s, FloatDtype::F32);
    expect_error(
        &raw.write("dtype-seqidx"),
        &["tensor `seq_idx` has dtype F32, expected I64 or I32"],
    );

    let mut raw = Raw::valid();
    raw.remove("x");
    raw.ints
        .push(("x".into(), ArrayD::zeros(IxDyn(&[2, 9, 4, 3]))));
    expect_error(
        &raw.write("dtype-x"),
        &["tensor `x` has dtype I64, expected F64, F32, F16 or BF16"],
    );
}

#[test]
fn bad_values_are_refused_naming_the_tensor_and_index() {
    let mut raw = Raw::valid();
    raw.float("x")[[1, 2, 3, 0]] = f64::NAN;
    let e = expect_error(
        &raw.write("nan-x"),
        &["tensor `x`", "non-finite", "[1, 2, 3, 0]"],
    );
    assert!(matches!(e, VerifyError::Problem { .. }));

    let mut raw = Raw::valid();
    raw.float("dt")[[0, 4, 1]] = f64::INFINITY;
    expect_error(
        &raw.write("inf-dt"),
        &["tensor `dt`", "non-finite", "[0, 4, 1]"],
    );

    // F16 overflow in a stored value is caught after widening, too.
    let mut raw = Raw::valid();
    let mut b = raw.float("B").clone();
    b[[0, 0, 0, 0]] = 1e6;
    raw.set_float("B", b, FloatDtype::F16);
    expect_error(&raw.write("f16-overflow"), &["tensor `B`", "non-finite"]);

    let mut raw = Raw::valid();
    raw.float("A")[[2]] = 0.5;
    expect_error(&raw.write("positive-a"), &["tensor `A`", "[2]"]);

    let mut raw = Raw::valid();
    raw.ints[0].1[[1, 8]] = -1;
    expect_error(&raw.write("neg-seqidx"), &["tensor `seq_idx`", "[1, 8]"]);
    let mut raw = Raw::valid();
    raw.ints[0].1.fill(2);
    raw.ints[0].1[[0, 5]] = 1;
    expect_error(
        &raw.write("dec-seqidx"),
        &["tensor `seq_idx`", "decreases", "[0, 5]"],
    );
}

#[test]
fn bad_expected_outputs_are_refused() {
    let mut raw = Raw::valid();
    raw.set_float("out", ArrayD::zeros(IxDyn(&[2, 9, 4])), FloatDtype::F64);
    expect_error(
        &raw.write("out-shape"),
        &[
            "tensor `out` has shape [2, 9, 4]",
            "[batch, seqlen, nheads, headdim]",
        ],
    );

    // nchunks = ceil(9 / 4) = 3.
    let mut raw = Raw::valid();
    raw.set_float(
        "dA_cumsum",
        ArrayD::zeros(IxDyn(&[2, 4, 2, 4])),
        FloatDtype::F64,
    );
    expect_error(
        &raw.write("dacs-shape"),
        &["tensor `dA_cumsum`", "[2, 4, 3, 4]", "nchunks"],
    );
    let mut raw = Raw::valid();
    raw.set_float(
        "dA_cumsum",
        ArrayD::zeros(IxDyn(&[2, 4, 3, 4])),
        FloatDtype::F64,
    );
    raw.set_float(
        "chunk_states",
        ArrayD::zeros(IxDyn(&[2, 3, 4, 3, 5])),
        FloatDtype::F32,
    );
    let loaded = read_case(raw.write("intermediates-ok")).unwrap();
    assert_eq!(
        loaded.case.expected.chunk_states.unwrap().shape(),
        [2, 3, 4, 3, 5]
    );

    let mut raw = Raw::valid();
    let mut fs_ = ArrayD::zeros(IxDyn(&[2, 4, 3, 5]));
    fs_[[1, 3, 2, 4]] = f64::NAN;
    raw.set_float("final_states", fs_, FloatDtype::F64);
    expect_error(
        &raw.write("fs-nan"),
        &["tensor `final_states`", "non-finite", "[1, 3, 2, 4]"],
    );

    let mut raw = Raw::valid();
    let mut m = ArrayD::zeros(IxDyn(&[2, 9, 4, 3]));
    m[[0, 1, 2, 0]] = -1.0;
    raw.set_float("out_mag", m, FloatDtype::F64);
    expect_error(
        &raw.write("mag-neg"),
        &["tensor `out_mag`", "negative", "[0, 1, 2, 0]"],
    );
}

#[test]
fn candidate_tensor_errors_name_the_problem() {
    let dir = scratch("candidate");
    let path = dir.join("cand.safetensors");
    let mut w = TensorWriter::new();
    w.push(
        "out",
        &ArrayD::<f64>::zeros(IxDyn(&[2, 2])),
        FloatDtype::F32,
    );
    w.push_index("steps", &ArrayD::<i64>::zeros(IxDyn(&[2])), true)
        .unwrap();
    w.write(&path).unwrap();

    let msg = |r: Result<_, VerifyError>| r.map(|_| ()).unwrap_err().to_string();
    let m = msg(read_tensor(&path, "final_states"));
    assert!(
        m.contains("tensor `final_states` is missing") && m.contains("cand.safetensors"),
        "{m}"
    );
    let m = msg(read_tensor(&path, "steps"));
    assert!(m.contains("tensor `steps` has dtype I32"), "{m}");
    let m = msg(read_tensor(dir.join("nope.safetensors"), "out"));
    assert!(
        m.contains("cannot read") && m.contains("nope.safetensors"),
        "{m}"
    );
    fs::write(dir.join("bad.safetensors"), [0u8; 3]).unwrap();
    let m = TensorFile::open(dir.join("bad.safetensors"))
        .unwrap_err()
        .to_string();
    assert!(m.contains("not a valid safetensors file"), "{m}");
    assert_eq!(read_tensor(&path, "out").unwrap().data.shape(), [2, 2]);
}

#[test]
fn writing_into_a_missing_folder_fails_cleanly() {
    let dir = scratch("nofolder");
    let mut w = TensorWriter::new();
    w.push("out", &ArrayD::<f64>::zeros(IxDyn(&[1])), FloatDtype::F64);
    let target = dir.join("absent").join("o.safetensors");
    let e = w.write(&target).unwrap_err();
    assert!(matches!(e, VerifyError::Io { .. }), "{e}");
    assert!(e.to_string().contains("o.safetensors"), "{e}");
    assert!(!dir.join("absent").exists());
    assert_eq!(fs::read_dir(&dir).unwrap().count(), 0);
}
