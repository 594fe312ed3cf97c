//! The no-argument demonstration: the first thing a newcomer runs.

use std::process::Command;

#[test]
fn no_arguments_runs_the_demonstration_and_every_path_agrees() {
    let o = Command::new(env!("CARGO_BIN_EXE_ssd-oracle"))
        .output()
        .expect("the binary runs");
    let out = String::from_utf8_lossy(&o.stdout);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "stdout: {out}\nstderr: {err}");
    // It says what it checked, in words, for every built-in shape, from tiny to a real layer.
    for words in [
        "ground truth",
        "[1/5] tiny",
        "[5/5] a realistic Mamba-2 layer",
        "batch 2 x seqlen 2048, 8 heads x headdim 64, dstate 64, 8 groups",
        "batch 1 x seqlen 2048, 24 heads x headdim 64, dstate 128, 1 group",
        "chunked tf32",
        "All 15 comparisons agree",
    ] {
        assert!(out.contains(words), "`{words}` not in: {out}");
    }
    assert!(!out.contains("DISAGREE"), "{out}");
    assert_eq!(out.matches(" agrees (").count(), 15, "{out}");
}

#[test]
fn demo_quick_runs_the_small_shapes_only() {
    let o = Command::new(env!("CARGO_BIN_EXE_ssd-oracle"))
        .args(["demo", "--quick"])
        .output()
        .expect("the binary runs");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("[3/3]") && !out.contains("[4/"), "{out}");
    assert!(out.contains("All 9 comparisons agree"), "{out}");
}
