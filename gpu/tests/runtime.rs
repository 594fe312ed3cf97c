//! What works without a GPU: clean errors instead of panics, and NVRTC compiling the kernels
//! (where the NVRTC library is installed).

use ssd_gpu::{kernels, Gpu, GpuConfig, GpuError, Kernel, Variant};
use ssd_reference::random::{random_problem, ProblemSpec};
use ssd_reference::Dims;

fn require_gpu() -> bool {
    std::env::var("SSD_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

#[test]
fn missing_driver_or_device_is_an_error_not_a_panic() {
    let spec = ProblemSpec::plain(Dims {
        batch: 1,
        seqlen: 5,
        nheads: 2,
        headdim: 3,
        ngroups: 1,
        dstate: 4,
    });
    let p: ssd_reference::Problem<f32> = random_problem(&spec, 3).expect("valid spec").cast();
    match (Gpu::new(0), ssd_gpu::forward(&p)) {
        (Ok(gpu), Ok(out)) => {
            println!(
                "device present ({}, {}): forward ran",
                gpu.device_name(),
                gpu.target()
            );
            assert_eq!(out.out.shape(), &[1, 5, 2, 3]);
        }
        (Err(e1), Err(e2)) => {
            for e in [&e1, &e2] {
                assert!(
                    matches!(e, GpuError::NoDriver(_) | GpuError::NoDevice(_)),
                    "unexpected error kind: {e}"
                );
                let msg = e.to_string();
                assert!(
                    msg.contains("no CUDA driver") || msg.contains("no CUDA device"),
                    "{msg}"
                );
            }
            assert!(!require_gpu(), "SSD_REQUIRE_GPU=1 but {e1}");
            say_out_loud(&format!("skipped: no CUDA device ({e1})"));
        }
        (a, b) => panic!("Gpu::new and forward disagree: {a:?} / {b:?}"),
    }
}

#[test]
fn every_variant_opens_and_agrees_with_the_default() {
    let spec = ProblemSpec::full(
        Dims {
            batch: 1,
            seqlen: 300,
            nheads: 4,
            headdim: 64,
            ngroups: 2,
            dstate: 128,
        },
        128,
    );
    let p: ssd_reference::Problem<f32> = random_problem(&spec, 5).expect("valid spec").cast();
    for variant in Variant::ALL {
        match Gpu::with_config(GpuConfig::variant(variant)) {
            Ok(gpu) => {
                assert_eq!(gpu.config().variant, variant);
                // Every kernel's layout was read from the module; the sizes of the parameter
                // structs were checked against it when the module was loaded.
                for k in Kernel::ALL {
                    assert!(gpu.layout(k).params > 0, "{}", k.name());
                }
                let out = gpu.forward(&p).expect("forward");
                assert_eq!(out.out.shape(), &[1, 300, 4, 64]);
                assert!(out.out.iter().all(|v| v.is_finite()), "{variant:?}");
            }
            Err(e) => {
                assert!(
                    matches!(e, GpuError::NoDriver(_) | GpuError::NoDevice(_)),
                    "{variant:?}: {e}"
                );
                assert!(!require_gpu(), "SSD_REQUIRE_GPU=1 but {e}");
            }
        }
    }
}

#[test]
fn nvrtc_compiles_the_kernels_for_every_target() {
    if !kernels::nvrtc_present() {
        assert!(
            !require_gpu(),
            "SSD_REQUIRE_GPU=1 but NVRTC cannot be loaded"
        );
        say_out_loud("skipped: no CUDA driver (NVRTC library not found)");
        return;
    }
    for target in ["sm_90a", "compute_80"] {
        let ptx = kernels::ptx_text(target).unwrap_or_else(|e| panic!("{e}"));
        for entry in [
            "ssd_chunk_cumsum",
            "ssd_fwd_pass_state",
            "ssd_compute_out",
            "ssd_chunk_state_local",
            "ssd_state_passing",
            "ssd_chunk_cb",
            "ssd_compute_out_cb",
        ] {
            assert!(
                ptx.contains(&format!(".entry {entry}")),
                "{target}: {entry} missing"
            );
        }
        assert!(
            ptx.contains("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"),
            "{target}: no TF32 mma"
        );
        assert!(
            ptx.contains("cvt.rna.tf32.f32"),
            "{target}: no TF32 rounding"
        );
        // Atomics that accumulate values would break run-to-run reproducibility. The one
        // atomic allowed is the chained stage 2's ticket (an integer add that orders the
        // blocks, never a value of the results): one per chained kernel.
        for entry in ptx.split(".entry ").skip(1) {
            let name = entry.split(['(', ' ', '\n']).next().unwrap_or("");
            let atomics: Vec<&str> = entry
                .lines()
                .filter(|l| l.contains("atom."))
                .map(str::trim)
                .collect();
            if name.starts_with("ssd_state_chained") {
                assert!(
                    atomics.len() == 1 && atomics[0].starts_with("atom.global.add"),
                    "{target}: {name}: one ticket add expected, found {atomics:?}"
                );
            } else {
                assert!(
                    atomics.is_empty(),
                    "{target}: {name}: atomics would break run-to-run reproducibility"
                );
            }
        }
        if let Ok(dir) = std::env::var("SSD_DUMP_PTX") {
            let path = std::path::Path::new(&dir).join(format!("ssd_{target}.ptx"));
            std::fs::write(&path, &ptx).expect("write PTX");
            println!("wrote {}", path.display());
        }
    }
}

#[test]
fn targets_follow_compute_capability() {
    assert_eq!(kernels::target_for(9, 0).unwrap(), "sm_90a");
    assert_eq!(kernels::target_for(8, 0).unwrap(), "compute_80");
    assert_eq!(kernels::target_for(12, 0).unwrap(), "compute_80");
    let e = kernels::target_for(7, 5).unwrap_err();
    assert!(e.to_string().contains("no CUDA device"), "{e}");
}

/// Prints a line on the real stderr, past the test harness's output capture, so that a skip is
/// seen in the plain `cargo test` output.
#[allow(dead_code)]
fn say_out_loud(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}
