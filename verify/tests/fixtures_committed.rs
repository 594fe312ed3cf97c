//! The committed fixtures under `fixtures/`: they regenerate identically, correct
//! implementations pass them, and every deliberately wrong variant fails at least one of them
//! through `ssd-oracle check`.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::faults::{self, Fault, Rounding};
use common::{fixtures_root, manifests, oracle, TempDir};
use ndarray::Array4;
use rayon::prelude::*;
use ssd_reference::{chunked, MatmulPrecision};
use ssd_verify::fixture::{read_case, Dtype, FloatDtype, Outputs, TensorFile};
use ssd_verify::tolerance::{Candidate, Oracle, OutputName, Precision};

const SUITES: [&str; 4] = ["smoke", "edge", "backward", "serving"];

/// The committed cases of one row per batch element (the packed ones, `serving/`, are checked
/// by [`committed_serving_cases_pass_and_refuse`]).
fn committed() -> Vec<PathBuf> {
    let m: Vec<PathBuf> = manifests(&fixtures_root())
        .into_iter()
        .filter(|p| !p.starts_with(fixtures_root().join("serving")))
        .collect();
    assert!(m.len() >= 20, "committed fixtures missing: {m:?}");
    m
}

/// Why two versions of a case's tensor file differ, if they do in a way that matters: the
/// inputs must be identical, the magnitudes identical to 1e-12 relative, and the expected
/// outputs within the f64 error bound of each other (two correct float64 computations: the
/// reference may change its summation order, and another libm may round `exp` differently).
fn meaningful_difference(committed: &Path, fresh: &Path) -> Option<String> {
    let a = read_case(committed).unwrap().case;
    let b = read_case(fresh).unwrap().case;
    let (ia, ib) = (a.problem.inputs(), b.problem.inputs());
    if ia.x != ib.x || ia.dt != ib.dt || ia.A != ib.A || ia.B != ib.B || ia.C != ib.C {
        return Some("inputs differ".into());
    }
    if ia.D != ib.D || ia.z != ib.z || ia.dt_bias != ib.dt_bias {
        return Some("optional inputs differ".into());
    }
    if ia.initial_states != ib.initial_states || ia.seq_idx != ib.seq_idx {
        return Some("initial_states or seq_idx differ".into());
    }
    if a.packing != b.packing {
        return Some("the packing (cu_seqlens, per-sequence states, positions) differs".into());
    }
    if let Some(k) = &a.packing {
        // Every expected tensor within the f64 bound of the fresh one.
        let oracle = Oracle::for_packed(&a.problem, k).unwrap();
        let e = &b.expected;
        let fresh = [
            (OutputName::Out, e.out.clone().map(|t| t.into_dyn())),
            (
                OutputName::FinalStates,
                e.final_states.clone().map(|t| t.into_dyn()),
            ),
            (
                OutputName::DACumsum,
                e.dA_cumsum.clone().map(|t| t.into_dyn()),
            ),
            (
                OutputName::ChunkStates,
                e.chunk_states.clone().map(|t| t.into_dyn()),
            ),
            (
                OutputName::VarlenStates,
                e.varlen_states.clone().map(|t| t.into_dyn()),
            ),
            (
                OutputName::PositionStates,
                e.position_states.clone().map(|t| t.into_dyn()),
            ),
        ];
        for (name, t) in fresh {
            let Some(t) = t else { continue };
            let r = oracle
                .compare(name, &t, Dtype::F64, Precision::F64)
                .unwrap();
            if !r.passed() {
                return Some(format!("{name} differs beyond the f64 bound"));
            }
        }
        return None;
    }
    let close = |x: &Option<Array4<f64>>, y: &Option<Array4<f64>>| match (x, y) {
        (Some(x), Some(y)) => x
            .iter()
            .zip(y.iter())
            .all(|(u, v)| (u - v).abs() <= 1e-12 * u.abs().max(v.abs())),
        (None, None) => true,
        _ => false,
    };
    if !close(&a.expected.out_mag, &b.expected.out_mag)
        || !close(&a.expected.final_states_mag, &b.expected.final_states_mag)
    {
        return Some("magnitudes differ".into());
    }
    if let Some(d) = gradients_differ(committed, fresh) {
        return Some(d);
    }
    let oracle = Oracle::with_expected(&a.problem, &a.expected);
    let e = &b.expected;
    let cand = Candidate {
        out: e.out.clone()?.into_dyn(),
        final_states: e.final_states.clone().map(|t| t.into_dyn()),
        dA_cumsum: e.dA_cumsum.clone().map(|t| t.into_dyn()),
        chunk_states: e.chunk_states.clone().map(|t| t.into_dyn()),
        dtype: Dtype::F64,
    };
    let v = oracle.check(&cand, Precision::F64).unwrap();
    if !v.passed() {
        return Some(format!(
            "expected values differ beyond the f64 bound: {:?}",
            v.failures()
        ));
    }
    println!(
        "{}: expected values not bit-identical, within {:.3} of the f64 bound",
        committed.display(),
        v.max_ratio()
    );
    None
}

/// For backward cases: the upstream gradients must be identical, and every gradient within
/// `1e-12` of the largest magnitude of its tensor (two correct float64 computations of the
/// same sums; another libm may round `exp` differently).
fn gradients_differ(committed: &Path, fresh: &Path) -> Option<String> {
    let files = |m: &Path| TensorFile::open(read_case(m).unwrap().tensors_path).unwrap();
    let (a, b) = (files(committed), files(fresh));
    if a.names() != b.names() {
        return Some("the tensor names differ".into());
    }
    for name in a.names() {
        let upstream = name == "dout" || name == "dfinal_states";
        if !(upstream || GRADIENTS.contains(&name.as_str())) {
            continue;
        }
        let (x, y) = (
            a.read_float(&name).unwrap().data,
            b.read_float(&name).unwrap().data,
        );
        if upstream && x != y {
            return Some(format!("`{name}` differs"));
        }
        let scale = x.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        if x.iter()
            .zip(y.iter())
            .any(|(u, v)| (u - v).abs() > 1e-12 * scale)
        {
            return Some(format!(
                "gradient `{name}` differs beyond 1e-12 of its scale"
            ));
        }
    }
    None
}

const GRADIENTS: [&str; 9] = [
    "dx",
    "ddt",
    "dA",
    "dB",
    "dC",
    "dD",
    "dz",
    "ddt_bias",
    "dinitial_states",
];

/// Every committed backward case: `ssd-oracle grad` writes the stored gradients again, bit for
/// bit, and the case holds exactly the gradients of the inputs it has.
#[test]
fn committed_backward_cases_hold_the_adjoint() {
    let tmp = TempDir::new("grad");
    let dir = fixtures_root().join("backward");
    let list = manifests(&dir);
    assert!(list.len() >= 4, "backward fixtures missing: {list:?}");
    for m in list {
        let out = tmp.path("grads.safetensors");
        let (code, stdout, err) = oracle(&[
            "grad",
            "--case",
            m.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{stdout}{err}");
        let fresh = TensorFile::open(&out).unwrap();
        let stored = TensorFile::open(read_case(&m).unwrap().tensors_path).unwrap();
        let stored_grads: Vec<String> = stored
            .names()
            .into_iter()
            .filter(|n| GRADIENTS.contains(&n.as_str()))
            .collect();
        assert_eq!(stored_grads, fresh.names(), "{}", m.display());
        for name in fresh.names() {
            assert_eq!(
                fresh.read_float(&name).unwrap().data,
                stored.read_float(&name).unwrap().data,
                "{}: `{name}` is not the adjoint's",
                m.display()
            );
        }
    }
}

/// `ssd-oracle gen` writes the committed suites again, identically (see fixtures/README.md for
/// the command): manifests byte for byte, tensor files byte for byte or, failing that, the same
/// inputs and magnitudes and expected values within the f64 bound of each other (reported).
#[test]
fn committed_fixtures_regenerate_identically() {
    let tmp = TempDir::new("regen");
    for suite in SUITES {
        let out = tmp.path(suite);
        let (code, stdout, err) = oracle(&[
            "gen",
            "--suite",
            suite,
            "--out",
            out.to_str().unwrap(),
            "--seed",
            "0",
        ]);
        assert_eq!(code, 0, "{stdout}{err}");
        let list = |dir: &Path| {
            let mut v: Vec<String> = std::fs::read_dir(dir)
                .unwrap()
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            v.sort();
            v
        };
        let committed_dir = fixtures_root().join(suite);
        let names = list(&committed_dir);
        assert_eq!(names, list(&out), "{suite}: the file lists differ");
        for name in names {
            let (a, b) = (committed_dir.join(&name), out.join(&name));
            if std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap() {
                continue;
            }
            assert!(
                name.ends_with(".safetensors"),
                "{suite}/{name}: the manifest differs"
            );
            let manifest = a.with_extension("json");
            let fresh_manifest = b.with_extension("json");
            if let Some(d) = meaningful_difference(&manifest, &fresh_manifest) {
                panic!("{suite}/{name}: {d}");
            }
        }
    }
}

/// The reference's chunked path in f32 passes every fixture at f32, and with TF32 operands at
/// TF32 (no false alarm), including the fixtures' own expected values and magnitudes.
#[test]
fn correct_implementations_pass_every_fixture() {
    for m in committed() {
        let loaded = read_case(&m).unwrap();
        let p = &loaded.case.problem;
        let o = Oracle::with_expected(p, &loaded.case.expected);
        // The stored magnitudes are the oracle's.
        let stored = loaded.case.expected.out_mag.as_ref().unwrap();
        assert!(
            stored
                .iter()
                .zip(o.magnitudes().out.mag.iter())
                .all(|(a, b)| (a - b).abs() <= 1e-12 * a.abs()),
            "{}",
            m.display()
        );
        for (prec, mp) in [
            (Precision::F32, MatmulPrecision::Native),
            (Precision::Tf32, MatmulPrecision::Tf32),
        ] {
            let c: Candidate = (&chunked::forward(&p.cast::<f32>(), mp)).into();
            let v = o.check(&c, prec).unwrap();
            assert!(v.passed(), "{} @{prec}: {:?}", m.display(), v.failures());
        }
    }
}

/// Each wrong variant, computed in f32 with TF32 operands on each fixture's inputs and
/// written as a candidate, is refused by `ssd-oracle check --precision tf32` (exit 1) on at
/// least one committed fixture; the correct variant passes them all (exit 0).
#[test]
fn every_fault_fails_a_committed_fixture_through_check() {
    let cases = committed();
    let tmp = TempDir::new("faults");
    let mut variants = vec![Fault::None];
    variants.extend(Fault::WRONG);
    // fault -> fixtures that refused it
    let caught: BTreeMap<String, Vec<String>> = variants
        .par_iter()
        .map(|&fault| {
            let mut refused = Vec::new();
            for (k, m) in cases.iter().enumerate() {
                let loaded = read_case(m).unwrap();
                let p32 = loaded.case.problem.cast::<f32>();
                let out = faults::forward(&p32, fault, Rounding::Tf32);
                let cand = tmp.path(&format!("{fault:?}-{k}.safetensors"));
                Outputs::from(out).write(&cand, FloatDtype::F32).unwrap();
                let (code, stdout, err) = oracle(&[
                    "check",
                    "--case",
                    m.to_str().unwrap(),
                    "--candidate",
                    cand.to_str().unwrap(),
                    "--precision",
                    "tf32",
                ]);
                assert!(
                    code == 0 || code == 1,
                    "{fault:?} {}: {stdout}{err}",
                    m.display()
                );
                if fault == Fault::None {
                    assert_eq!(code, 0, "false alarm on {}: {stdout}", m.display());
                }
                if code == 1 {
                    let rel = m.strip_prefix(fixtures_root()).unwrap_or(m);
                    refused.push(rel.display().to_string());
                }
                let _ = std::fs::remove_file(&cand);
            }
            (format!("{fault:?}"), refused)
        })
        .collect();
    println!(
        "fault                          fixtures refusing it (of {})",
        cases.len()
    );
    for (fault, refused) in &caught {
        println!("{fault:<30} {:>3}  {}", refused.len(), refused.join(" "));
    }
    let missed: Vec<&String> = caught
        .iter()
        .filter(|(f, r)| f.as_str() != "None" && r.is_empty())
        .map(|(f, _)| f)
        .collect();
    assert!(
        missed.is_empty(),
        "faults no committed fixture catches: {missed:?}"
    );
}

/// Every committed serving case: what `ssd-oracle run` writes with the naive recurrence in f32
/// and the chunked path with TF32 operands passes `ssd-oracle check` at f32 and tf32; with one
/// sequence's initial state withheld (or, for mamba_ssm's convention, the first sequence's),
/// the same run is refused.
#[test]
fn committed_serving_cases_pass_and_refuse() {
    let cases = manifests(&fixtures_root().join("serving"));
    assert!(cases.len() >= 4, "serving fixtures missing: {cases:?}");
    let tmp = TempDir::new("serving");
    for m in &cases {
        let ms = m.to_str().unwrap();
        let cand = tmp.path("cand.safetensors");
        let cs = cand.to_str().unwrap();
        for (imp, prec) in [("naive", "f32"), ("chunked", "tf32")] {
            let (code, out, err) = oracle(&[
                "run",
                "--case",
                ms,
                "--impl",
                imp,
                "--precision",
                prec,
                "--out",
                cs,
            ]);
            assert_eq!(code, 0, "{}: {out}{err}", m.display());
            let (code, out, err) = oracle(&[
                "check",
                "--case",
                ms,
                "--candidate",
                cs,
                "--precision",
                prec,
            ]);
            assert_eq!(code, 0, "{} {imp} {prec}: {out}{err}", m.display());
            assert!(out.contains("varlen_states"), "{out}");
        }
        // One sequence's initial state withheld: the candidate computed as if it had none.
        let loaded = read_case(m).unwrap();
        let k = loaded.case.packing.clone().unwrap();
        let mut wrong = k.clone();
        let p = &loaded.case.problem;
        let mut p2 = p.clone();
        if let Some(s0) = &mut wrong.seq_initial_states {
            let q = (0..k.nseq())
                .find(|&q| {
                    k.seq_has_initial_state.as_ref().is_none_or(|h| h[q])
                        && k.cu_seqlens[q + 1] > k.cu_seqlens[q]
                })
                .unwrap();
            s0.index_axis_mut(ndarray::Axis(0), q).fill(0.0);
        } else {
            let mut i = p.inputs().clone();
            i.initial_states = None;
            p2 = ssd_reference::Problem::new(*p.dims(), *p.options(), i).unwrap();
        }
        let o = ssd_reference::serving::forward(
            &p2.cast::<f32>(),
            &wrong.cast::<f32>(),
            ssd_reference::serving::Algorithm::Naive,
        )
        .unwrap();
        let mut w = ssd_verify::fixture::TensorWriter::new();
        w.push("out", &o.out, FloatDtype::F32);
        w.push("varlen_states", &o.varlen_states, FloatDtype::F32);
        w.write(&cand).unwrap();
        let (code, out, err) = oracle(&[
            "check",
            "--case",
            ms,
            "--candidate",
            cs,
            "--precision",
            "f32",
        ]);
        assert_eq!(code, 1, "{} with a state withheld: {out}{err}", m.display());
    }
}
