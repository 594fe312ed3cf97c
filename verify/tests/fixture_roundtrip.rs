//! Fixture cases: what is written reads back as the same problem, in every storage dtype.

use std::fs;
use std::path::PathBuf;

use ndarray::{Array4, Array5, ArrayD, IxDyn};
use serde_json::{json, Value};
use ssd_reference::random::{random_problem, DSkip, ProblemSpec, SeqIdx};
use ssd_reference::{Dims, Problem};
use ssd_verify::fixture::{
    read_case, read_tensor, round_inputs, write_case, Case, CaseMeta, Dtype, Expected, FloatDtype,
    Outputs, TensorFile, TensorWriter,
};

/// A fresh, empty folder for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("fixture_roundtrip-{name}"));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

fn dims() -> Dims {
    Dims {
        batch: 2,
        seqlen: 37,
        nheads: 4,
        headdim: 3,
        ngroups: 2,
        dstate: 5,
    }
}

fn full_problem() -> Problem<f64> {
    random_problem(&ProblemSpec::full(dims(), 8), 11).unwrap()
}

fn case(problem: Problem<f64>) -> Case {
    Case {
        meta: CaseMeta::default(),
        problem,
        expected: Expected::default(),
        packing: None,
    }
}

/// Every size, option and input tensor equal (exactly).
fn assert_same_problem(a: &Problem<f64>, b: &Problem<f64>) {
    assert_eq!(a.dims(), b.dims());
    assert_eq!(a.options(), b.options());
    let (a, b) = (a.inputs(), b.inputs());
    assert_eq!(a.x, b.x, "x");
    assert_eq!(a.dt, b.dt, "dt");
    assert_eq!(a.A, b.A, "A");
    assert_eq!(a.B, b.B, "B");
    assert_eq!(a.C, b.C, "C");
    assert_eq!(a.D, b.D, "D");
    assert_eq!(a.z, b.z, "z");
    assert_eq!(a.dt_bias, b.dt_bias, "dt_bias");
    assert_eq!(a.initial_states, b.initial_states, "initial_states");
    assert_eq!(a.seq_idx, b.seq_idx, "seq_idx");
}

#[test]
fn f64_case_round_trips_exactly_with_its_meta() {
    let dir = scratch("f64");
    let p = full_problem();
    let mut extra = serde_json::Map::new();
    extra.insert("generator".into(), json!("a test"));
    let c = Case {
        meta: CaseMeta {
            name: Some("full".into()),
            seed: Some(11),
            description: Some("every option".into()),
            extra,
        },
        problem: p.clone(),
        expected: Expected::default(),
        packing: None,
    };
    let path = dir.join("full.json");
    write_case(&path, &c, FloatDtype::F64).unwrap();

    let loaded = read_case(&path).unwrap();
    assert_same_problem(&loaded.case.problem, &p);
    assert_eq!(loaded.case.meta, c.meta);
    assert!(loaded.case.expected.is_empty());
    assert_eq!(loaded.tensors_path, dir.join("full.safetensors"));
    for name in [
        "x",
        "dt",
        "A",
        "B",
        "C",
        "D",
        "z",
        "dt_bias",
        "initial_states",
    ] {
        assert_eq!(loaded.dtypes[name], Dtype::F64, "{name}");
    }
    assert_eq!(loaded.dtypes["seq_idx"], Dtype::I64);

    // The manifest says what the contract says, in plain JSON.
    let m: Value = serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(m["format"], "ssd-fixture/1");
    assert_eq!(m["tensors"], "full.safetensors");
    assert_eq!(m["chunk_size"], 8);
    assert_eq!(m["dt_softplus"], true);
    assert_eq!(m["dt_limit"], json!([0.001, 0.5]));
    assert_eq!(
        m["dims"],
        json!({"batch": 2, "seqlen": 37, "nheads": 4, "headdim": 3, "ngroups": 2, "dstate": 5})
    );
    assert_eq!(m["generator"], "a test");

    // Nothing else in the folder: no temporary file left behind.
    let mut names: Vec<String> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["full.json", "full.safetensors"]);
}

#[test]
fn reduced_precision_inputs_read_back_rounded_with_their_dtypes() {
    let p = full_problem();
    for (dtype, reduced) in [
        (FloatDtype::F32, Dtype::F32),
        (FloatDtype::F16, Dtype::F16),
        (FloatDtype::BF16, Dtype::BF16),
    ] {
        let dir = scratch(&format!("reduced-{reduced}"));
        let path = dir.join("case.json");
        write_case(&path, &case(p.clone()), dtype).unwrap();
        let loaded = read_case(&path).unwrap();
        let rounded = round_inputs(&p, dtype).unwrap();
        assert_same_problem(&loaded.case.problem, &rounded);
        // Rounding really happened: the test would notice a writer that stores F64.
        assert_ne!(loaded.case.problem.inputs().x, p.inputs().x, "{reduced}");
        for name in ["x", "z", "B", "C"] {
            assert_eq!(loaded.dtypes[name], reduced, "{name} as {reduced}");
        }
        for name in ["dt", "A", "D", "dt_bias", "initial_states"] {
            assert_eq!(loaded.dtypes[name], Dtype::F32, "{name} with {reduced}");
        }
    }
}

#[test]
fn round_inputs_rounds_to_the_storage_type() {
    let p = full_problem();
    let r = round_inputs(&p, FloatDtype::BF16).unwrap();
    let (x, rx) = (p.inputs().x[[0, 0, 0, 0]], r.inputs().x[[0, 0, 0, 0]]);
    assert_eq!(rx, half::bf16::from_f64(x).to_f64());
    // dt is stored as F32 in a BF16 case.
    let (dt, rdt) = (p.inputs().dt[[1, 2, 3]], r.inputs().dt[[1, 2, 3]]);
    assert_eq!(rdt, dt as f32 as f64);
    let same = round_inputs(&p, FloatDtype::F64).unwrap();
    assert_same_problem(&same, &p);
}

#[test]
fn seq_idx_stored_as_i32_reads_back() {
    let dir = scratch("i32");
    let p = full_problem();
    let path = dir.join("case.json");
    write_case(&path, &case(p.clone()), FloatDtype::F64).unwrap();

    // Rewrite the tensors with seq_idx as I32, the way torch.int32 would store it.
    let file = TensorFile::open(dir.join("case.safetensors")).unwrap();
    let mut w = TensorWriter::new();
    for name in file.names() {
        if name != "seq_idx" {
            let t = file.read_float(&name).unwrap();
            w.push(&name, &t.data, FloatDtype::F64);
        }
    }
    w.push_index("seq_idx", p.inputs().seq_idx.as_ref().unwrap(), true)
        .unwrap();
    w.write(dir.join("case.safetensors")).unwrap();

    let loaded = read_case(&path).unwrap();
    assert_eq!(loaded.dtypes["seq_idx"], Dtype::I32);
    assert_same_problem(&loaded.case.problem, &p);
}

#[test]
fn absent_optional_tensors_stay_absent() {
    let dir = scratch("plain");
    let p = random_problem(&ProblemSpec::plain(dims()), 3).unwrap();
    let path = dir.join("plain.json");
    write_case(&path, &case(p.clone()), FloatDtype::F64).unwrap();
    let loaded = read_case(&path).unwrap();
    let i = loaded.case.problem.inputs();
    assert!(i.D.is_none() && i.z.is_none() && i.dt_bias.is_none());
    assert!(i.initial_states.is_none() && i.seq_idx.is_none());
    assert_eq!(
        TensorFile::open(&loaded.tensors_path).unwrap().names(),
        ["A", "B", "C", "dt", "x"]
    );
    assert_same_problem(&loaded.case.problem, &p);
}

#[test]
fn d_per_head_and_seq_idx_at_chunk_starts_round_trip() {
    let dir = scratch("dhead");
    let mut spec = ProblemSpec::full(dims(), 4);
    spec.d = DSkip::PerHead;
    spec.seq_idx = SeqIdx::AtChunkStarts { every: 2 };
    spec.options.dt_limit = (0.0, f64::INFINITY);
    let p = random_problem(&spec, 5).unwrap();
    let path = dir.join("case.json");
    write_case(&path, &case(p.clone()), FloatDtype::F64).unwrap();
    let m: Value = serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(m["dt_limit"], json!([0.0, null]));
    let loaded = read_case(&path).unwrap();
    assert_eq!(
        loaded.case.problem.inputs().D.as_ref().unwrap().shape(),
        [4]
    );
    assert_same_problem(&loaded.case.problem, &p);
}

fn ramp4(shape: (usize, usize, usize, usize), scale: f64) -> Array4<f64> {
    let mut k = 0.0f64;
    Array4::from_shape_simple_fn(shape, || {
        k += 1.0;
        scale * k.sin()
    })
}

#[test]
fn expected_outputs_and_magnitudes_round_trip() {
    let dir = scratch("expected");
    let p = full_problem();
    let d = *p.dims();
    let nchunks = p.nchunks();
    let cs = p.options().chunk_size;
    let mut k = 0.0f64;
    let expected = Expected {
        out: Some(ramp4((d.batch, d.seqlen, d.nheads, d.headdim), 1.0)),
        final_states: Some(ramp4((d.batch, d.nheads, d.headdim, d.dstate), 2.0)),
        dA_cumsum: Some(ramp4((d.batch, d.nheads, nchunks, cs), -3.0)),
        chunk_states: Some(Array5::from_shape_simple_fn(
            (d.batch, nchunks, d.nheads, d.headdim, d.dstate),
            || {
                k += 1.0;
                k.cos()
            },
        )),
        out_mag: Some(ramp4((d.batch, d.seqlen, d.nheads, d.headdim), 1.0).mapv(f64::abs)),
        final_states_mag: Some(ramp4((d.batch, d.nheads, d.headdim, d.dstate), 1.0).mapv(f64::abs)),
        ..Expected::default()
    };
    let c = Case {
        meta: CaseMeta::default(),
        problem: p,
        expected: expected.clone(),
        packing: None,
    };
    let path = dir.join("case.json");
    write_case(&path, &c, FloatDtype::F64).unwrap();
    let loaded = read_case(&path).unwrap();
    assert_eq!(loaded.case.expected, expected);
    assert_eq!(loaded.dtypes["chunk_states"], Dtype::F64);
}

#[test]
fn manifest_defaults_unknown_keys_and_relative_tensor_paths() {
    let dir = scratch("manifest");
    let p = random_problem(&ProblemSpec::plain(dims()), 9).unwrap();
    // Write a case, then move its tensors to another folder and write a minimal manifest by
    // hand, as a user would.
    write_case(dir.join("orig.json"), &case(p.clone()), FloatDtype::F64).unwrap();
    fs::create_dir_all(dir.join("data")).unwrap();
    fs::create_dir_all(dir.join("cases")).unwrap();
    fs::rename(
        dir.join("orig.safetensors"),
        dir.join("data").join("t.safetensors"),
    )
    .unwrap();
    let manifest = json!({
        "chunk_size": 64,
        "tensors": "../data/t.safetensors",
        "dims": {"dstate": 5, "batch": 2, "seqlen": 37, "nheads": 4, "headdim": 3, "ngroups": 2,
                 "comment": "ignored"},
        "format": "ssd-fixture/1",
        "seed": 9,
        "made_by": {"tool": "pytorch"},
    });
    let path = dir.join("cases").join("mine.json");
    fs::write(&path, manifest.to_string()).unwrap();
    let loaded = read_case(&path).unwrap();
    let o = loaded.case.problem.options();
    assert_eq!(o.chunk_size, 64);
    assert!(!o.dt_softplus, "dt_softplus defaults to false");
    assert_eq!(
        o.dt_limit,
        (0.0, f64::INFINITY),
        "dt_limit defaults to [0, inf)"
    );
    assert_eq!(loaded.case.meta.seed, Some(9));
    assert_eq!(loaded.case.meta.name, None);
    assert_eq!(
        loaded.case.meta.extra["made_by"],
        json!({"tool": "pytorch"})
    );
    assert!(!loaded.case.meta.extra.contains_key("format"));
    assert_same_problem(&loaded.case.problem, &p);

    // Without `tensors`, the file is STEM.safetensors next to the manifest.
    let mut m2 = manifest.clone();
    m2.as_object_mut().unwrap().remove("tensors");
    fs::write(dir.join("data").join("t.json"), m2.to_string()).unwrap();
    let loaded = read_case(dir.join("data").join("t.json")).unwrap();
    assert_eq!(loaded.tensors_path, dir.join("data").join("t.safetensors"));

    // dt_limit with a finite upper end, softplus on.
    let mut m3 = manifest;
    m3["dt_limit"] = json!([0.01, 0.25]);
    m3["dt_softplus"] = json!(true);
    fs::write(&path, m3.to_string()).unwrap();
    let o = *read_case(&path).unwrap().case.problem.options();
    assert_eq!(o.dt_limit, (0.01, 0.25));
    assert!(o.dt_softplus);
}

#[test]
fn extra_tensors_in_the_file_are_ignored() {
    let dir = scratch("extra");
    let p = random_problem(&ProblemSpec::plain(dims()), 4).unwrap();
    let path = dir.join("case.json");
    write_case(&path, &case(p.clone()), FloatDtype::F64).unwrap();
    let file = TensorFile::open(dir.join("case.safetensors")).unwrap();
    let mut w = TensorWriter::new();
    for name in file.names() {
        let t = file.read_float(&name).unwrap();
        w.push(&name, &t.data, FloatDtype::F64);
    }
    w.push(
        "debug_scratch",
        &ArrayD::<f64>::zeros(IxDyn(&[3, 3])),
        FloatDtype::F16,
    );
    w.push_index("step", &ndarray::arr1(&[7i64]), false)
        .unwrap();
    w.write(dir.join("case.safetensors")).unwrap();
    assert_same_problem(&read_case(&path).unwrap().case.problem, &p);
}

#[test]
fn outputs_write_in_f64_and_f32_and_read_back_with_their_dtype() {
    let dir = scratch("outputs");
    let out = ramp4((1, 5, 2, 3), 1.0 / 3.0);
    let final_states = ramp4((1, 2, 3, 4), 0.1);
    let o = Outputs {
        out: out.clone(),
        final_states: final_states.clone(),
        dA_cumsum: None,
        chunk_states: None,
    };
    o.write(dir.join("o64.safetensors"), FloatDtype::F64)
        .unwrap();
    o.write(dir.join("o32.safetensors"), FloatDtype::F32)
        .unwrap();

    let f = TensorFile::open(dir.join("o64.safetensors")).unwrap();
    assert_eq!(f.names(), ["final_states", "out"]);
    let t = f.read_float("out").unwrap();
    assert_eq!(t.dtype, Dtype::F64);
    assert_eq!(t.data, out.clone().into_dyn());

    let t = read_tensor(dir.join("o32.safetensors"), "final_states").unwrap();
    assert_eq!(t.dtype, Dtype::F32);
    assert_eq!(t.data, final_states.mapv(|v| v as f32 as f64).into_dyn());
    assert_ne!(t.data, final_states.into_dyn(), "F32 storage rounds");
}

#[test]
fn candidate_tensors_of_any_float_dtype_read_with_their_dtype_and_keep_nan() {
    let dir = scratch("candidate");
    let mut a = ramp4((2, 3, 1, 2), 100.0);
    a[[1, 2, 0, 1]] = f64::NAN;
    a[[0, 0, 0, 0]] = f64::INFINITY;
    let mut w = TensorWriter::new();
    w.push("h", &a, FloatDtype::F16);
    w.push("b", &a, FloatDtype::BF16);
    // Not contiguous: written in logical row-major order.
    w.push("t", &a.t(), FloatDtype::F64);
    let path = dir.join("cand.safetensors");
    w.write(&path).unwrap();
    let f = TensorFile::open(&path).unwrap();
    for (name, dtype, round) in [
        ("h", Dtype::F16, FloatDtype::F16),
        ("b", Dtype::BF16, FloatDtype::BF16),
    ] {
        let t = f.read_float(name).unwrap();
        assert_eq!(t.dtype, dtype);
        assert_eq!(t.data.shape(), [2, 3, 1, 2]);
        assert!(t.data[[1, 2, 0, 1]].is_nan());
        assert_eq!(t.data[[0, 0, 0, 0]], f64::INFINITY);
        assert_eq!(t.data[[0, 1, 0, 1]], round.round(a[[0, 1, 0, 1]]));
    }
    let t = f.read_float("t").unwrap();
    assert_eq!(t.data.shape(), [2, 1, 3, 2]);
    assert_eq!(t.data[[1, 0, 2, 0]], a[[0, 2, 0, 1]]);
    assert!(f.contains("h") && !f.contains("out"));
    assert!(f.read_float_opt("out").unwrap().is_none());
}
