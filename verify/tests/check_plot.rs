//! `ssd-oracle check --plot` and the failure map through the command line: the picture of a
//! failing check, the hints in the table and in `--json`, one-line errors for a bad path, and
//! (ignored, run by hand) the timing at the 2.7B layer's size and the example picture of
//! `docs/tolerances.md`.

mod common;

use std::time::Instant;

use common::faults::{self, Fault, Rounding};
use common::{fixtures_root, oracle, TempDir};
use ssd_reference::random::{random_problem, ProblemSpec, SeqIdx};
use ssd_reference::Dims;
use ssd_verify::fixture::Dtype;
use ssd_verify::fixture::{read_case, FloatDtype, Outputs};
use ssd_verify::plot::{render_svg, write_plot};
use ssd_verify::report::{check_candidate, Labels};
use ssd_verify::tolerance::{Oracle, OutputName, Precision};

/// A committed case and a candidate with `fault`, written under `tmp`.
fn faulty_candidate(tmp: &TempDir, fault: Fault) -> (String, String) {
    let case = fixtures_root().join("smoke/full.json");
    let loaded = read_case(&case).unwrap();
    let out = faults::forward(&loaded.case.problem.cast::<f32>(), fault, Rounding::None);
    let cand = tmp.path(&format!("{fault:?}.safetensors"));
    Outputs::from(out).write(&cand, FloatDtype::F32).unwrap();
    (
        case.to_str().unwrap().to_string(),
        cand.to_str().unwrap().to_string(),
    )
}

#[test]
fn a_failing_check_draws_its_map_and_prints_its_hint() {
    let tmp = TempDir::new("plot");
    let (case, cand) = faulty_candidate(&tmp, Fault::StatePassingNoDecay);
    let svg = tmp.path("map.svg");
    let (code, out, err) = oracle(&[
        "check",
        "--case",
        &case,
        "--candidate",
        &cand,
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert_eq!(code, 1, "{out}{err}");
    let hints: Vec<&str> = out.lines().filter(|l| l.starts_with("hint:")).collect();
    assert_eq!(hints.len(), 1, "{out}");
    assert!(hints[0].contains("state passing (sure)"), "{out}");
    assert!(out.lines().any(|l| l.starts_with("where out:")), "{out}");
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg"), "not an SVG");
    assert!(
        text.contains("1 = bound") && text.contains("state passing"),
        "labels missing"
    );
    for t in ["out", "final_states", "chunk_states"] {
        assert!(text.contains(&format!("{t}: ")), "no panel for {t}");
    }
    // Only the picture is left in the folder: no temporary file.
    let names: Vec<_> = std::fs::read_dir(&tmp.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.contains("map"))
        .collect();
    assert_eq!(names, vec!["map.svg".to_string()]);
}

#[test]
fn the_json_report_carries_the_hints_and_the_map() {
    let tmp = TempDir::new("plot-json");
    let (case, cand) = faulty_candidate(&tmp, Fault::CausalMaskOffByOne);
    let (code, out, err) = oracle(&["check", "--case", &case, "--candidate", &cand, "--json"]);
    assert_eq!(code, 1, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let hints = v["hints"].as_array().unwrap();
    assert_eq!(hints[0]["stage"], "causal_mask", "{out}");
    assert_eq!(hints[0]["confidence"], "sure");
    assert_eq!(v["hint"], hints[0]["text"]);
    let map = v["error_map"].as_array().unwrap();
    assert_eq!(map[0]["tensor"], "out");
    let pos = &map[0]["by"]["position_in_chunk"];
    let chunk = v["tensors"][0]["shape"].clone();
    assert_eq!(chunk[1], 100);
    assert!(pos["max_ratio"].as_array().unwrap().len() <= 100);
    for axis in [
        "chunk",
        "head",
        "group",
        "batch",
        "sequence",
        "reset_at_chunk_start",
    ] {
        assert!(map[0]["by"][axis]["over"].is_array(), "no {axis} profile");
    }
    // Every over-bound element is counted once per axis.
    let over = map[0]["over"].as_u64().unwrap();
    let sum: u64 = map[0]["by"]["head"]["over"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .sum();
    assert_eq!(over, sum);
    assert_eq!(over, v["tensors"][0]["exceeding"].as_u64().unwrap());
}

#[test]
fn a_correct_candidate_gets_no_hint_and_a_plain_picture() {
    let tmp = TempDir::new("plot-pass");
    let (case, cand) = faulty_candidate(&tmp, Fault::None);
    let svg = tmp.path("pass.svg");
    let (code, out, err) = oracle(&[
        "check",
        "--case",
        &case,
        "--candidate",
        &cand,
        "--plot",
        svg.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["hints"].as_array().unwrap().len(), 0);
    assert!(v["hint"].is_null());
    assert_eq!(v["error_map"].as_array().unwrap().len(), 0);
    assert!(std::fs::read_to_string(&svg)
        .unwrap()
        .contains("nothing to draw"));
}

#[test]
fn a_bad_plot_path_is_refused_in_one_line() {
    let tmp = TempDir::new("plot-bad");
    let (case, cand) = faulty_candidate(&tmp, Fault::CausalMaskOffByOne);
    for (path, want) in [
        (tmp.path("map.png"), "ending in .svg"),
        (tmp.path("map"), "ending in .svg"),
        (tmp.path("no-such-folder/map.svg"), "cannot write"),
    ] {
        let (code, out, err) = oracle(&[
            "check",
            "--case",
            &case,
            "--candidate",
            &cand,
            "--plot",
            path.to_str().unwrap(),
        ]);
        assert_eq!(code, 2, "{}: {out}{err}", path.display());
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains(want), "{err}");
        assert!(!path.exists());
    }
    // A folder in the way: the rename fails, and no temporary file is left.
    let dir = tmp.path("taken.svg");
    std::fs::create_dir(&dir).unwrap();
    let (code, _, err) = oracle(&[
        "check",
        "--case",
        &case,
        "--candidate",
        &cand,
        "--plot",
        dir.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("cannot write"), "{err}");
    let left: Vec<_> = std::fs::read_dir(&tmp.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// The 2.7B layer's size (batch 1, 4,096 tokens, 80 heads, headdim 64, dstate 128, chunk
/// 256), `out` wrong from chunk 1 on, growing: times the check (with the map and the hints)
/// and the picture.
#[test]
#[ignore = "the 2.7B layer's size: about a minute on two cores; run by hand for docs/tolerances.md"]
fn plot_at_the_2p7b_layer_size() {
    let dims = Dims::new(1, 4096, 80, 64, 1, 128);
    let p = random_problem(&ProblemSpec::full(dims, 256), 5).unwrap();
    let t = Instant::now();
    let o = Oracle::new(&p);
    println!(
        "reference and magnitudes: {:.2} s",
        t.elapsed().as_secs_f64()
    );
    let mut out = o.reference(OutputName::Out).clone();
    for (i, v) in out.iter_mut().enumerate() {
        let tok = i / (80 * 64);
        *v *= 1.0 + 1e-2 * (tok / 256) as f64;
    }
    let t = Instant::now();
    let r = check_candidate(
        Labels {
            case: "2.7B layer".into(),
            candidate: "planted".into(),
        },
        &p,
        &o,
        &[(OutputName::Out, &out, Dtype::F32)],
        Vec::new(),
        Precision::F32,
    )
    .unwrap();
    println!(
        "check with map and hints: {:.2} s",
        t.elapsed().as_secs_f64()
    );
    assert!(!r.passed);
    let tmp = TempDir::new("plot-big");
    let svg = tmp.path("big.svg");
    let t = Instant::now();
    write_plot(&r, &svg).unwrap();
    let secs = t.elapsed().as_secs_f64();
    let size = std::fs::metadata(&svg).unwrap().len();
    println!("picture: {secs:.3} s, {size} bytes; hints: {:?}", r.hints);
    assert!(secs < 1.0, "the picture took {secs:.2} s");
    // The states wrong too: the state hypotheses run at this size.
    let mut fin = o.reference(OutputName::FinalStates).clone();
    fin.iter_mut().for_each(|v| *v *= 1.01);
    let t = Instant::now();
    let r = check_candidate(
        Labels::default(),
        &p,
        &o,
        &[
            (OutputName::Out, &out, Dtype::F32),
            (OutputName::FinalStates, &fin, Dtype::F32),
        ],
        Vec::new(),
        Precision::F32,
    )
    .unwrap();
    println!(
        "check of out and final_states with map and hints: {:.2} s; hints: {:?}",
        t.elapsed().as_secs_f64(),
        r.hints
    );
}

/// The example picture of `docs/tolerances.md`: a state-passing fault (no decay) on a
/// 2 x 1024-token, 16-head case with packed sequences, checked at f32.
#[test]
#[ignore = "writes docs/check-plot-example.svg; run by hand"]
fn example_picture() {
    let dims = Dims::new(2, 1024, 16, 16, 4, 16);
    let spec = ProblemSpec {
        seq_idx: SeqIdx::Segments {
            segments: 3,
            first: 0,
        },
        ..ProblemSpec::full(dims, 64)
    };
    let p = random_problem(&spec, 3).unwrap();
    let o = Oracle::new(&p);
    let c = faults::forward(&p.cast::<f32>(), Fault::StatePassingNoDecay, Rounding::None);
    let w = |a: ndarray::ArrayD<f32>| a.mapv(f64::from);
    let out = w(c.out.into_dyn());
    let fin = w(c.final_states.into_dyn());
    let r = check_candidate(
        Labels {
            case: "2 x 1024 tokens, 16 heads, chunk 64, 3 sequences per row".into(),
            candidate: "StatePassingNoDecay (f32)".into(),
        },
        &p,
        &o,
        &[
            (OutputName::Out, &out, Dtype::F32),
            (OutputName::FinalStates, &fin, Dtype::F32),
        ],
        Vec::new(),
        Precision::F32,
    )
    .unwrap();
    print!("{}", r.text());
    let path =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/check-plot-example.svg");
    write_plot(&r, &path).unwrap();
    assert!(render_svg(&r).unwrap().len() > 1000);
}
