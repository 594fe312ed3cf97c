//! The committed fixtures under `fixtures/`: they regenerate identically, correct
//! implementations pass them, and every deliberately wrong variant fails at least one of them
//! through `ssd-oracle check`.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::faults::{self, Fault, Rounding};
use common::{fixtures_root, manifests, oracle, TempDir};
use rayon::prelude::*;
use ssd_reference::{chunked, MatmulPrecision};
use ssd_verify::fixture::{read_case, FloatDtype, Outputs, TensorFile};
use ssd_verify::tolerance::{Candidate, Oracle, Precision};

const SUITES: [&str; 2] = ["smoke", "edge"];

fn committed() -> Vec<PathBuf> {
    let m = manifests(&fixtures_root());
    assert!(m.len() >= 20, "committed fixtures missing: {m:?}");
    m
}

/// Compares two tensor files value by value; `None` when identical to the bit.
fn tensor_difference(a: &Path, b: &Path) -> Option<String> {
    let (fa, fb) = (TensorFile::open(a).unwrap(), TensorFile::open(b).unwrap());
    if fa.names() != fb.names() {
        return Some(format!("tensor names {:?} vs {:?}", fa.names(), fb.names()));
    }
    for name in fa.names() {
        let (Ok(ta), Ok(tb)) = (fa.read_float(&name), fb.read_float(&name)) else {
            continue; // seq_idx: compared with the bytes
        };
        if ta.dtype != tb.dtype || ta.data.shape() != tb.data.shape() {
            return Some(format!("`{name}`: dtype or shape differs"));
        }
        let worst = ta
            .data
            .iter()
            .zip(tb.data.iter())
            .map(|(x, y)| (x - y).abs() / x.abs().max(y.abs()).max(1e-300))
            .fold(0.0_f64, f64::max);
        if worst > 0.0 {
            return Some(format!("`{name}` differs by {worst:.2e} relative"));
        }
    }
    None
}

/// `ssd-oracle gen` writes the committed suites again, identically (see fixtures/README.md for
/// the command). Inputs and manifests are byte-identical; the expected values too on the
/// platform they were made on (another libm may round `exp` differently in the last bit, which
/// this test reports and allows up to 1e-12 relative).
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
        let committed_dir = fixtures_root().join(suite);
        let mut names: Vec<String> = std::fs::read_dir(&committed_dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        let mut fresh: Vec<String> = std::fs::read_dir(&out)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        fresh.sort();
        assert_eq!(names, fresh, "{suite}: the file lists differ");
        for name in names {
            let (a, b) = (committed_dir.join(&name), out.join(&name));
            let (ba, bb) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
            if ba == bb {
                continue;
            }
            assert!(
                name.ends_with(".safetensors"),
                "{suite}/{name}: the manifest differs"
            );
            match tensor_difference(&a, &b) {
                None => {}
                Some(d) => {
                    println!("{suite}/{name}: not byte-identical: {d}");
                    let f = TensorFile::open(&a).unwrap();
                    for t in ["x", "dt", "A", "B", "C"] {
                        let (x, y) = (
                            f.read_float(t).unwrap(),
                            TensorFile::open(&b).unwrap().read_float(t).unwrap(),
                        );
                        assert_eq!(x.data, y.data, "{suite}/{name}: input `{t}` differs");
                    }
                    assert!(
                        !d.contains("dtype") && !d.contains("names"),
                        "{suite}/{name}: {d}"
                    );
                    let rel: f64 = d
                        .split_whitespace()
                        .find_map(|w| w.parse().ok())
                        .unwrap_or(f64::INFINITY);
                    assert!(rel <= 1e-12, "{suite}/{name}: {d}");
                }
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
