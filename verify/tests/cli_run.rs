//! `ssd-oracle run` end to end: outputs, formats, timings, and every refusal.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;
use ssd_reference::random::{random_problem, ProblemSpec};
use ssd_reference::{naive, Dims};
use ssd_verify::fixture::{write_case, Case, CaseMeta, Dtype, Expected, FloatDtype, TensorFile};

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("cli_run-{name}"));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

fn dims() -> Dims {
    Dims {
        batch: 2,
        seqlen: 45,
        nheads: 4,
        headdim: 3,
        ngroups: 2,
        dstate: 5,
    }
}

/// Writes a valid case with every option (chunk 16: 3 chunks, the last partial) into `dir`.
fn write_full_case(dir: &Path) -> PathBuf {
    let problem = random_problem(&ProblemSpec::full(dims(), 16), 21).unwrap();
    let path = dir.join("case.json");
    let case = Case {
        meta: CaseMeta::default(),
        problem,
        expected: Expected::default(),
        packing: None,
    };
    write_case(&path, &case, FloatDtype::F64).unwrap();
    path
}

fn oracle(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ssd-oracle"))
        .args(args)
        .output()
        .expect("the binary runs")
}

/// `ssd-oracle run --case CASE --impl IMP --out OUT EXTRA...`
fn run(case: &Path, imp: &str, out: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["run", "--case", s(case), "--impl", imp, "--out", s(out)];
    args.extend_from_slice(extra);
    oracle(&args)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Exit status 2, one `error: ` line on stderr containing every needle, nothing on stdout.
fn assert_refused(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "stderr: {err}");
    assert!(err.starts_with("error: "), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "not one line: {err}");
    assert!(!err.contains("panicked"), "{err}");
    for n in needles {
        assert!(err.contains(n), "`{n}` not in: {err}");
    }
    assert!(
        o.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
}

/// The folder holds exactly these file names (no output, no temporary file).
fn assert_files(dir: &Path, want: &[&str]) {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, want);
}

/// `ssd-oracle check --case CASE --candidate OUT --precision PRECISION`.
fn check_at(case: &Path, out: &Path, precision: &str) -> Output {
    oracle(&[
        "check",
        "--case",
        s(case),
        "--candidate",
        s(out),
        "--precision",
        precision,
    ])
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn naive_and_chunked_write_the_contract_tensors_and_agree() {
    let dir = scratch("agree");
    let case = write_full_case(&dir);
    let naive_out = dir.join("naive.safetensors");
    let chunked_out = dir.join("chunked.safetensors");
    for (imp, out) in [("naive", &naive_out), ("chunked", &chunked_out)] {
        let o = run(&case, imp, out, &[]);
        assert!(o.status.success(), "{imp}: {}", stderr(&o));
        let said = String::from_utf8_lossy(&o.stdout);
        assert!(said.starts_with("wrote out, final_states"), "{said}");
    }

    // 45 tokens in chunks of 16: 3 chunks.
    let n = TensorFile::open(&naive_out).unwrap();
    assert_eq!(n.names(), ["final_states", "out"]);
    let c = TensorFile::open(&chunked_out).unwrap();
    assert_eq!(
        c.names(),
        ["chunk_states", "dA_cumsum", "final_states", "out"]
    );
    let shape = |f: &TensorFile, name: &str| f.read_float(name).unwrap().data.shape().to_vec();
    assert_eq!(shape(&c, "out"), [2, 45, 4, 3]);
    assert_eq!(shape(&c, "final_states"), [2, 4, 3, 5]);
    assert_eq!(shape(&c, "dA_cumsum"), [2, 4, 3, 16]);
    assert_eq!(shape(&c, "chunk_states"), [2, 3, 4, 3, 5]);
    assert_eq!(c.read_float("out").unwrap().dtype, Dtype::F64);

    for name in ["out", "final_states"] {
        let a = n.read_float(name).unwrap().data;
        let b = c.read_float(name).unwrap().data;
        assert_eq!(a.shape(), b.shape());
        let diff = (&a - &b).mapv(|v| v * v).sum().sqrt();
        let norm = a.mapv(|v| v * v).sum().sqrt();
        assert!(norm > 0.0);
        assert!(
            diff <= 1e-12 * norm,
            "{name}: naive and chunked differ by {diff:e} (norm {norm:e})"
        );
    }

    // And the naive output is the reference crate's naive forward of the case, bit for bit.
    let loaded = ssd_verify::fixture::read_case(&case).unwrap();
    let truth = naive::forward(&loaded.case.problem);
    assert_eq!(n.read_float("out").unwrap().data, truth.out.into_dyn());
    assert_files(
        &dir,
        &[
            "case.json",
            "case.safetensors",
            "chunked.safetensors",
            "naive.safetensors",
        ],
    );
}

#[test]
fn f32_and_tf32_write_f32_close_to_the_f64_result() {
    let dir = scratch("f32");
    let case = write_full_case(&dir);
    let truth = dir.join("truth.safetensors");
    let o = run(&case, "naive", &truth, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let truth = TensorFile::open(&truth)
        .unwrap()
        .read_float("out")
        .unwrap()
        .data;
    for (imp, precision, limit) in [
        ("naive", "f32", 1e-5),
        ("chunked", "f32", 1e-5),
        ("chunked", "tf32", 1e-2),
    ] {
        let out = dir.join(format!("{imp}-{precision}.safetensors"));
        let o = run(&case, imp, &out, &["--precision", precision]);
        assert!(o.status.success(), "{imp} {precision}: {}", stderr(&o));
        let t = TensorFile::open(&out).unwrap().read_float("out").unwrap();
        assert_eq!(t.dtype, Dtype::F32, "{imp} {precision}");
        let diff = (&t.data - &truth).mapv(|v| v * v).sum().sqrt();
        let rel = diff / truth.mapv(|v| v * v).sum().sqrt();
        // Lower precision really was used (not f64 written as F32) but it is still right.
        assert!(
            rel > 1e-9 && rel < limit,
            "{imp} {precision}: rel err {rel:e}"
        );
    }
}

#[test]
fn repeat_json_reports_timings_without_file_io() {
    let dir = scratch("json");
    let case = write_full_case(&dir);
    let out = dir.join("o.safetensors");
    let o = run(
        &case,
        "chunked",
        &out,
        &["--repeat", "5", "--json", "--precision", "tf32"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8(o.stdout).unwrap();
    assert_eq!(text.trim_end().lines().count(), 1, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["impl"], "chunked");
    assert_eq!(v["precision"], "tf32");
    assert_eq!(v["dtype"], "F32");
    assert_eq!(v["repeat"], 5);
    assert_eq!(v["chunk_size"], 16);
    assert_eq!(v["dims"]["seqlen"], 45);
    assert_eq!(v["dims"]["ngroups"], 2);
    assert_eq!(
        v["tensors"]["chunk_states"],
        serde_json::json!([2, 3, 4, 3, 5])
    );
    let times: Vec<f64> = v["compute_ms"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_f64().unwrap())
        .collect();
    assert_eq!(times.len(), 5);
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    assert_eq!(v["compute_ms_median"].as_f64().unwrap(), sorted[2]);
    assert_eq!(v["compute_ms_min"].as_f64().unwrap(), sorted[0]);
    assert!(sorted[0] > 0.0);
    assert!(out.exists());
}

#[test]
fn tf32_with_naive_is_refused_before_any_work() {
    let dir = scratch("tf32naive");
    let case = write_full_case(&dir);
    let out = dir.join("o.safetensors");
    let o = run(&case, "naive", &out, &["--precision", "tf32"]);
    assert_refused(&o, &["tf32", "--impl chunked"]);
    assert_files(&dir, &["case.json", "case.safetensors"]);
}

#[test]
fn bf16_with_naive_is_refused_before_any_work() {
    let dir = scratch("bf16naive");
    let case = write_full_case(&dir);
    let out = dir.join("o.safetensors");
    let o = run(&case, "naive", &out, &["--precision", "bf16"]);
    assert_refused(&o, &["bf16", "--impl chunked"]);
    assert_files(&dir, &["case.json", "case.safetensors"]);
}

/// The reference's bf16 emulation (bf16 inputs, bf16 operands) passes `check --precision
/// bf16` and is refused at tf32, whose bound has no room for bf16's roundings.
#[test]
fn chunked_bf16_passes_at_bf16_and_is_refused_at_tf32() {
    let dir = scratch("bf16chunked");
    let case = write_full_case(&dir);
    let out = dir.join("o.safetensors");
    let o = run(&case, "chunked", &out, &["--precision", "bf16"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let check = |precision: &str| check_at(&case, &out, precision);
    let at_bf16 = check("bf16");
    assert!(
        at_bf16.status.success(),
        "{}{}",
        String::from_utf8_lossy(&at_bf16.stdout),
        stderr(&at_bf16)
    );
    let at_tf32 = check("tf32");
    assert_eq!(at_tf32.status.code(), Some(1), "{}", stderr(&at_tf32));
}

#[test]
fn gpu_runs_or_says_no_cuda_in_one_line() {
    let dir = scratch("gpu");
    let case = write_full_case(&dir);
    let out = dir.join("o.safetensors");
    let o = run(&case, "gpu", &out, &[]);
    if o.status.success() {
        // A GPU is here: tf32 outputs with every tensor of the chunked path.
        let f = fs::read(&out).unwrap();
        let st = safetensors::SafeTensors::deserialize(&f).unwrap();
        for name in ["out", "final_states", "dA_cumsum", "chunk_states"] {
            assert_eq!(st.tensor(name).unwrap().dtype(), safetensors::Dtype::F32);
        }
        // bf16: `out` as the kernels write it (BF16), the rest F32; it passes at bf16.
        let o = run(&case, "gpu", &out, &["--precision", "bf16"]);
        assert!(o.status.success(), "{}", stderr(&o));
        let f = fs::read(&out).unwrap();
        let st = safetensors::SafeTensors::deserialize(&f).unwrap();
        assert_eq!(st.tensor("out").unwrap().dtype(), safetensors::Dtype::BF16);
        for name in ["final_states", "dA_cumsum", "chunk_states"] {
            assert_eq!(st.tensor(name).unwrap().dtype(), safetensors::Dtype::F32);
        }
        let checked = check_at(&case, &out, "bf16");
        assert!(checked.status.success(), "{}", stderr(&checked));
        return;
    }
    let err = stderr(&o);
    if std::env::var("SSD_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        panic!("SSD_REQUIRE_GPU=1 but the gpu run failed: {err}");
    }
    say_out_loud(&format!("skipped: no CUDA device ({})", err.trim_end()));
    assert_refused(&o, &["no CUDA"]);
    assert_files(&dir, &["case.json", "case.safetensors"]);
}

#[test]
fn unusable_cases_leave_no_output_and_keep_an_existing_one() {
    let dir = scratch("badcase");
    let case = write_full_case(&dir);
    let out = dir.join("o.safetensors");
    fs::write(&out, b"previous results").unwrap();

    // Missing manifest.
    let o = run(&dir.join("nope.json"), "naive", &out, &[]);
    assert_refused(&o, &["cannot read", "nope.json"]);

    // Wrong format string.
    let text = fs::read_to_string(&case).unwrap();
    let bad = dir.join("bad.json");
    fs::write(&bad, text.replace("ssd-fixture/1", "ssd-fixture/9")).unwrap();
    let o = run(&bad, "chunked", &out, &[]);
    assert_refused(&o, &["bad.json", "ssd-fixture/9"]);

    // A tensor file that is not safetensors.
    fs::write(dir.join("junk.safetensors"), b"junk").unwrap();
    fs::write(&bad, text.replace("case.safetensors", "junk.safetensors")).unwrap();
    let o = run(&bad, "naive", &out, &[]);
    assert_refused(&o, &["junk.safetensors", "not a valid safetensors file"]);

    // A bad value (the reference's check, through the CLI).
    fs::write(
        &bad,
        text.replace("\"chunk_size\": 16", "\"chunk_size\": 12"),
    )
    .unwrap();
    let o = run(&bad, "naive", &out, &[]);
    assert_refused(&o, &["chunk_size", "power of two"]);

    assert_eq!(fs::read(&out).unwrap(), b"previous results");
    assert_files(
        &dir,
        &[
            "bad.json",
            "case.json",
            "case.safetensors",
            "junk.safetensors",
            "o.safetensors",
        ],
    );
}

#[test]
fn a_chunk_size_too_large_for_memory_is_refused_not_aborted() {
    let dir = scratch("hugechunk");
    let case = write_full_case(&dir);
    let text = fs::read_to_string(&case).unwrap();
    fs::write(
        &case,
        text.replace("\"chunk_size\": 16", "\"chunk_size\": 1099511627776"),
    )
    .unwrap();
    let out = dir.join("o.safetensors");
    let o = run(&case, "chunked", &out, &[]);
    assert_refused(&o, &["chunk_size", "GiB"]);
    assert_files(&dir, &["case.json", "case.safetensors"]);
    // The naive path has no chunked intermediates: the same case runs.
    let o = run(&case, "naive", &out, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn unusable_output_paths_are_refused() {
    let dir = scratch("badout");
    let case = write_full_case(&dir);
    let tensors = dir.join("case.safetensors");
    let before = fs::read(&tensors).unwrap();

    let o = run(&case, "naive", &tensors, &[]);
    assert_refused(&o, &["refusing to overwrite an input"]);
    assert_eq!(fs::read(&tensors).unwrap(), before);

    let o = run(&case, "naive", &case, &[]);
    assert_refused(&o, &["refusing to overwrite an input"]);

    let missing = dir.join("no").join("such").join("o.safetensors");
    let o = run(&case, "naive", &missing, &[]);
    assert_refused(&o, &["does not exist"]);

    let o = run(&case, "naive", &dir, &[]);
    assert_refused(&o, &["not a folder"]);
    assert_files(&dir, &["case.json", "case.safetensors"]);
}

#[test]
fn command_line_mistakes_are_one_line_with_status_2() {
    let o = oracle(&["run", "--case", "c.json", "--impl", "naive"]);
    assert_refused(&o, &["--out"]);
    let o = oracle(&[
        "run",
        "--case",
        "c.json",
        "--impl",
        "cuda",
        "--out",
        "o.safetensors",
    ]);
    assert_refused(&o, &["cuda", "naive, chunked, gpu"]);
    let o = oracle(&[
        "run", "--case", "c.json", "--impl", "naive", "--out", "o", "--repeat", "0",
    ]);
    assert_refused(&o, &["--repeat"]);
    let o = oracle(&[
        "run",
        "--case",
        "c.json",
        "--impl",
        "naive",
        "--out",
        "o",
        "--precision",
        "f16",
    ]);
    assert_refused(&o, &["f16"]);
    let o = oracle(&["frobnicate"]);
    assert_refused(&o, &["frobnicate"]);
    assert!(!Path::new("o").exists() && !Path::new("o.safetensors").exists());
}

#[test]
fn help_lists_the_subcommands() {
    let o = oracle(&["--help"]);
    assert!(o.status.success());
    let text = String::from_utf8_lossy(&o.stdout);
    for word in ["run", "demo", "Mamba-2", "no subcommand"] {
        assert!(text.contains(word), "`{word}` not in help: {text}");
    }
    let o = oracle(&["run", "--help"]);
    assert!(o.status.success());
    let text = String::from_utf8_lossy(&o.stdout);
    for word in [
        "--case",
        "--impl",
        "--out",
        "--precision",
        "--repeat",
        "--json",
        "tf32",
    ] {
        assert!(text.contains(word), "`{word}` not in run help: {text}");
    }
}

/// Prints a line on the real stderr, past the test harness's output capture, so that a skip is
/// seen in the plain `cargo test` output.
#[allow(dead_code)]
fn say_out_loud(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}
