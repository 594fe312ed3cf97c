//! Packed (serving) cases: `cu_seqlens`, per-sequence initial states, state positions and the
//! expected `varlen_states` and `position_states` round-trip exactly, and every way a packed
//! case can be unusable gives one error line naming the tensor.

use std::fs;
use std::path::{Path, PathBuf};

use ndarray::{Array1, Array2, Array4};
use ssd_reference::random::{random_problem, ProblemSpec};
use ssd_reference::serving::{forward, implied_seq_idx, Algorithm, Packing};
use ssd_reference::{Dims, Problem};
use ssd_verify::fixture::{
    read_case, round_inputs, round_packing, write_case, Case, CaseMeta, Dtype, Expected,
    FloatDtype, LoadedCase, TensorFile, TensorWriter,
};
use ssd_verify::VerifyError;

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("fixture_packed-{name}"));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

/// 13 tokens, 4 heads x 3 channels, 2 groups, dstate 5, chunk 4.
fn dims(batch: usize) -> Dims {
    Dims::new(batch, 13, 4, 3, 2, 5)
}

/// Every option but mamba_ssm's `initial_states` and `seq_idx`.
fn row_problem(batch: usize) -> Problem<f64> {
    let mut spec = ProblemSpec::full(dims(batch), 4);
    spec.initial_states = false;
    spec.seq_idx = ssd_reference::random::SeqIdx::None;
    random_problem(&spec, 5).unwrap()
}

/// Four sequences of 4, 0, 5 and 4 tokens; the second and third have a cached state, the
/// first's is masked off; states wanted after tokens 0, 5, 12 and 5 again.
fn packing() -> Packing<f64> {
    let mut k = 0.0f64;
    let states = Array4::from_shape_simple_fn((4, 4, 3, 5), || {
        k += 1.0;
        (0.7 * k).sin()
    });
    Packing {
        cu_seqlens: vec![0, 4, 4, 9, 13],
        seq_initial_states: Some(states),
        seq_has_initial_state: Some(vec![false, true, true, true]),
        state_positions: vec![0, 5, 12, 5],
    }
}

/// A packed case with every new tensor and its expected outputs, written as `case.json`.
fn write_packed(test: &str) -> (PathBuf, Case) {
    let pk = packing();
    let problem = pk.with_seq_idx(&row_problem(1)).unwrap();
    let expected = Expected::from(forward(&problem, &pk, Algorithm::Naive).unwrap());
    assert!(expected.position_states.is_some());
    let case = Case {
        meta: CaseMeta::default(),
        problem,
        expected,
        packing: Some(pk),
    };
    let path = scratch(test).join("case.json");
    write_case(&path, &case, FloatDtype::F64).unwrap();
    (path, case)
}

/// Rewrites the case's tensor file through `edit`.
fn edit(manifest: &Path, edit: impl FnOnce(&mut TensorWriter)) {
    let tensors = manifest.with_extension("safetensors");
    let mut w = TensorWriter::new();
    w.push_all_from(&TensorFile::open(&tensors).unwrap());
    edit(&mut w);
    w.write(&tensors).unwrap();
}

fn index(values: &[i64]) -> Array1<i64> {
    Array1::from(values.to_vec())
}

/// Reads the case, expects an error, checks it is one line, names the file and contains every
/// `needle`.
fn expect_error(path: &Path, needles: &[&str]) -> VerifyError {
    let err = match read_case(path) {
        Ok(_) => panic!("`{}` was accepted; expected an error", path.display()),
        Err(e) => e,
    };
    let msg = err.to_string();
    assert!(!msg.contains('\n'), "not one line: {msg}");
    assert!(msg.contains("case."), "no file named: {msg}");
    for needle in needles {
        assert!(msg.contains(needle), "`{needle}` not in: {msg}");
    }
    err
}

fn read(path: &Path) -> LoadedCase {
    read_case(path).unwrap()
}

#[test]
fn a_packed_case_round_trips_exactly() {
    let (path, case) = write_packed("roundtrip");
    let loaded = read(&path);
    assert_eq!(loaded.case.packing, case.packing);
    assert_eq!(loaded.case.expected, case.expected);
    assert_eq!(loaded.case.problem.inputs().x, case.problem.inputs().x);
    assert_eq!(
        loaded.case.problem.inputs().seq_idx,
        case.problem.inputs().seq_idx
    );
    let e = &loaded.case.expected;
    assert_eq!(e.varlen_states.as_ref().unwrap().shape(), [4, 4, 3, 5]);
    assert_eq!(e.position_states.as_ref().unwrap().shape(), [4, 4, 3, 5]);
    for (name, dtype) in [
        ("cu_seqlens", Dtype::I64),
        ("state_positions", Dtype::I64),
        ("seq_initial_states", Dtype::F64),
        ("varlen_states", Dtype::F64),
        ("position_states", Dtype::F64),
    ] {
        assert_eq!(loaded.dtypes[name], dtype, "{name}");
    }
    // The mask is stored as BOOL, which `Dtype` does not list.
    let file = TensorFile::open(&loaded.tensors_path).unwrap();
    assert!(file.contains("seq_has_initial_state"));
    assert!(!loaded.dtypes.contains_key("seq_has_initial_state"));

    // Written again, it reads back the same.
    let again = path.with_file_name("again.json");
    write_case(&again, &loaded.case, FloatDtype::F64).unwrap();
    let twice = read(&again);
    assert_eq!(twice.case.packing, case.packing);
    assert_eq!(twice.case.expected, case.expected);
}

#[test]
fn a_packed_case_in_f32_reads_back_rounded() {
    let pk = packing();
    let problem =
        round_inputs(&pk.with_seq_idx(&row_problem(1)).unwrap(), FloatDtype::F32).unwrap();
    let case = Case {
        meta: CaseMeta::default(),
        problem,
        expected: Expected::default(),
        packing: Some(pk.clone()),
    };
    let path = scratch("f32").join("case.json");
    write_case(&path, &case, FloatDtype::F32).unwrap();
    let loaded = read(&path);
    assert_eq!(loaded.dtypes["seq_initial_states"], Dtype::F32);
    let rounded = round_packing(&pk, FloatDtype::F32);
    assert_ne!(rounded, pk);
    assert_eq!(loaded.case.packing, Some(rounded));
}

#[test]
fn seq_idx_is_implied_and_other_encodings_are_read() {
    let (path, case) = write_packed("implied");
    edit(&path, |w| {
        w.remove("seq_idx")
            .push_mask(
                "seq_has_initial_state",
                &Array1::from(vec![false, true, true, true]),
                true,
            )
            .push_index("cu_seqlens", &index(&[0, 4, 4, 9, 13]), true)
            .unwrap()
            .push_index("state_positions", &index(&[0, 5, 12, 5]), true)
            .unwrap();
    });
    let loaded = read(&path);
    let implied = Array2::from_shape_vec((1, 13), implied_seq_idx(&[0, 4, 4, 9, 13])).unwrap();
    assert_eq!(
        loaded.case.problem.inputs().seq_idx.as_ref(),
        Some(&implied)
    );
    assert_eq!(loaded.case.packing, case.packing);
    assert_eq!(loaded.dtypes["cu_seqlens"], Dtype::I32);
    assert_eq!(loaded.dtypes["state_positions"], Dtype::I32);

    // A mask in I64: nonzero is true.
    edit(&path, |w| {
        w.push_index("seq_has_initial_state", &index(&[0, 7, -1, 1]), false)
            .unwrap();
    });
    let loaded = read(&path);
    assert_eq!(loaded.case.packing, case.packing);
    assert_eq!(loaded.dtypes["seq_has_initial_state"], Dtype::I64);

    // Only cu_seqlens: no initial states, no positions.
    edit(&path, |w| {
        for name in [
            "seq_initial_states",
            "seq_has_initial_state",
            "state_positions",
            "position_states",
        ] {
            w.remove(name);
        }
    });
    let pk = read(&path).case.packing.unwrap();
    assert_eq!(pk, Packing::new(vec![0, 4, 4, 9, 13]));
}

#[test]
fn a_bf16_dt_is_read() {
    let problem = row_problem(1);
    let case = Case {
        meta: CaseMeta::default(),
        problem: problem.clone(),
        expected: Expected::default(),
        packing: None,
    };
    let path = scratch("bf16-dt").join("case.json");
    write_case(&path, &case, FloatDtype::F64).unwrap();
    edit(&path, |w| {
        w.push("dt", &problem.inputs().dt, FloatDtype::BF16);
    });
    let loaded = read(&path);
    assert_eq!(loaded.dtypes["dt"], Dtype::BF16);
    assert_eq!(
        loaded.case.problem.inputs().dt,
        problem.inputs().dt.mapv(|v| FloatDtype::BF16.round(v))
    );
    edit(&path, |w| {
        w.push("dt", &problem.inputs().dt, FloatDtype::F16);
    });
    assert_eq!(read(&path).dtypes["dt"], Dtype::F16);
}

#[test]
fn bad_cu_seqlens_are_refused_naming_the_tensor() {
    let cases: [(&str, &[i64], &[&str]); 5] = [
        (
            "start",
            &[1, 4, 4, 9, 13],
            &["`cu_seqlens` must start at 0"],
        ),
        ("decrease", &[0, 4, 3, 9, 13], &["`cu_seqlens` decreases"]),
        (
            "end",
            &[0, 4, 4, 9, 12],
            &["`cu_seqlens` must end at seqlen = 13"],
        ),
        (
            "seqidx",
            &[0, 4, 4, 10, 13],
            &["`seq_idx` disagrees with `cu_seqlens` at token 9"],
        ),
        (
            "negative",
            &[0, -4, 4, 9, 13],
            &["tensor `cu_seqlens` has a negative value (-4)"],
        ),
    ];
    for (test, cu, needles) in cases {
        let (path, _) = write_packed(&format!("cu-{test}"));
        edit(&path, |w| {
            w.push_index("cu_seqlens", &index(cu), false).unwrap();
        });
        expect_error(&path, needles);
    }

    let (path, _) = write_packed("cu-float");
    edit(&path, |w| {
        w.push(
            "cu_seqlens",
            &index(&[0, 4, 4, 9, 13]).mapv(|v| v as f64),
            FloatDtype::F64,
        );
    });
    let e = expect_error(
        &path,
        &["tensor `cu_seqlens` has dtype F64, expected I64 or I32"],
    );
    assert!(matches!(e, VerifyError::Tensors { .. }));

    let (path, _) = write_packed("cu-2d");
    edit(&path, |w| {
        let a = Array2::from_shape_vec((1, 5), vec![0i64, 4, 4, 9, 13]).unwrap();
        w.push_index("cu_seqlens", &a, false).unwrap();
    });
    expect_error(
        &path,
        &["tensor `cu_seqlens` has shape [1, 5]", "[nseq + 1]"],
    );
}

#[test]
fn a_packed_case_must_have_one_row() {
    let case = Case {
        meta: CaseMeta::default(),
        problem: row_problem(2),
        expected: Expected::default(),
        packing: None,
    };
    let path = scratch("batch2").join("case.json");
    write_case(&path, &case, FloatDtype::F64).unwrap();
    edit(&path, |w| {
        w.push_index("cu_seqlens", &index(&[0, 13]), false).unwrap();
    });
    let e = expect_error(&path, &["`cu_seqlens`", "batch must be 1, got 2"]);
    assert!(matches!(e, VerifyError::Problem { .. }));
}

#[test]
fn bad_initial_states_and_masks_are_refused_naming_the_tensor() {
    let (path, _) = write_packed("init-count");
    edit(&path, |w| {
        w.push(
            "seq_initial_states",
            &Array4::<f64>::zeros((3, 4, 3, 5)),
            FloatDtype::F64,
        );
    });
    expect_error(
        &path,
        &[
            "tensor `seq_initial_states` has shape [3, 4, 3, 5]",
            "[nseq, nheads, headdim, dstate] = [4, 4, 3, 5]",
            "`cu_seqlens`",
        ],
    );

    let (path, _) = write_packed("init-both");
    edit(&path, |w| {
        w.push(
            "initial_states",
            &Array4::<f64>::zeros((1, 4, 3, 5)),
            FloatDtype::F64,
        );
    });
    expect_error(
        &path,
        &[
            "`seq_initial_states`",
            "`initial_states`",
            "two conventions",
        ],
    );

    let (path, _) = write_packed("init-f16");
    edit(&path, |w| {
        let a = Array4::<f64>::zeros((4, 4, 3, 5));
        w.push("seq_initial_states", &a, FloatDtype::F16);
    });
    expect_error(
        &path,
        &["tensor `seq_initial_states` has dtype F16, expected F64 or F32"],
    );

    let (path, _) = write_packed("mask-length");
    edit(&path, |w| {
        w.push_mask("seq_has_initial_state", &Array1::from(vec![true; 3]), false);
    });
    expect_error(
        &path,
        &[
            "tensor `seq_has_initial_state` has shape [3]",
            "[nseq] = [4]",
        ],
    );

    let (path, _) = write_packed("mask-float");
    edit(&path, |w| {
        w.push(
            "seq_has_initial_state",
            &Array1::<f64>::ones(4),
            FloatDtype::F32,
        );
    });
    expect_error(
        &path,
        &["tensor `seq_has_initial_state` has dtype F32, expected BOOL, U8, I32 or I64"],
    );

    let (path, _) = write_packed("mask-alone");
    edit(&path, |w| {
        w.remove("seq_initial_states");
    });
    expect_error(
        &path,
        &["`seq_has_initial_state` is given without `seq_initial_states`"],
    );
}

#[test]
fn bad_positions_and_packed_outputs_are_refused_naming_the_tensor() {
    let (path, _) = write_packed("pos-range");
    edit(&path, |w| {
        w.push_index("state_positions", &index(&[0, 5, 13, 5]), false)
            .unwrap();
    });
    expect_error(&path, &["`state_positions[2]` = 13 is not a token index"]);

    let (path, _) = write_packed("pos-count");
    edit(&path, |w| {
        w.push_index("state_positions", &index(&[0, 5]), false)
            .unwrap();
    });
    expect_error(
        &path,
        &[
            "tensor `position_states` has shape [4, 4, 3, 5]",
            "[k, nheads, headdim, dstate] = [2, 4, 3, 5]",
            "`state_positions`",
        ],
    );

    let (path, _) = write_packed("varlen-count");
    edit(&path, |w| {
        w.push(
            "varlen_states",
            &Array4::<f64>::zeros((5, 4, 3, 5)),
            FloatDtype::F64,
        );
    });
    expect_error(&path, &["tensor `varlen_states` has shape [5, 4, 3, 5]"]);

    let (path, _) = write_packed("varlen-nan");
    edit(&path, |w| {
        let mut a = Array4::<f64>::zeros((4, 4, 3, 5));
        a[[1, 2, 0, 3]] = f64::NAN;
        w.push("varlen_states", &a, FloatDtype::F64);
    });
    expect_error(
        &path,
        &["tensor `varlen_states`", "non-finite", "[1, 2, 0, 3]"],
    );
}

#[test]
fn packed_tensors_without_cu_seqlens_are_refused() {
    for name in [
        "seq_initial_states",
        "seq_has_initial_state",
        "state_positions",
        "varlen_states",
        "position_states",
    ] {
        let (path, _) = write_packed(&format!("alone-{name}"));
        edit(&path, |w| {
            let others = [
                "cu_seqlens",
                "seq_initial_states",
                "seq_has_initial_state",
                "state_positions",
                "varlen_states",
                "position_states",
            ];
            for other in others.into_iter().filter(|&o| o != name) {
                w.remove(other);
            }
        });
        let e = expect_error(&path, &[&format!("tensor `{name}`"), "needs `cu_seqlens`"]);
        assert!(matches!(e, VerifyError::Tensors { .. }));
    }
}
