//! The GPU kernels, under every kernel variant, on every committed fixture case: `out`, `final_states`, `dA_cumsum` and
//! `chunk_states` against the case's expected tensors (or the float64 reference where the
//! case carries none), within the TF32 bound; and again with bf16 activations within the bf16
//! bound.
//!
//! The fixtures are found in `$SSD_FIXTURES_DIR`, else `./fixtures` under the working
//! directory, else the repository's `fixtures/` (so the test binary also runs from a bundle
//! copied to another machine). Without a GPU: "skipped: no CUDA device" (a failure with
//! `SSD_REQUIRE_GPU=1`).

mod gpu_support;

use std::path::{Path, PathBuf};

use gpu_support::*;

fn fixtures_dir() -> Option<PathBuf> {
    let candidates = [
        std::env::var_os("SSD_FIXTURES_DIR").map(PathBuf::from),
        Some(PathBuf::from("fixtures")),
        Some(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures")),
    ];
    candidates.into_iter().flatten().find(|p| p.is_dir())
}

fn manifests(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "json")
                && std::fs::read_to_string(&p).is_ok_and(|t| t.contains("ssd-fixture/1"))
            {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// Whether the case at `path` is a packed (serving) one.
fn is_packed(path: &Path) -> bool {
    ssd_verify::fixture::read_case(path).is_ok_and(|l| l.case.packing.is_some())
}

#[test]
fn gpu_passes_every_fixture() {
    every_fixture("gpu_passes_every_fixture", Io::F32);
}

/// The same cases through the bf16 path (`Gpu::forward_bf16`: the activations rounded to bf16
/// on upload), against the same expected tensors under the bf16 bound (whose `u_io` covers
/// that rounding).
#[test]
fn gpu_bf16_passes_every_fixture() {
    every_fixture("gpu_bf16_passes_every_fixture", Io::Bf16);
}

fn every_fixture(test: &str, io: Io) {
    let Some(gpus) = gpus_or_skip(test) else {
        return;
    };
    let Some(dir) = fixtures_dir() else {
        println!("{test}: no fixtures folder found (set SSD_FIXTURES_DIR)");
        return;
    };
    // Packed (serving) cases: `gpu_passes_every_serving_fixture`.
    let cases: Vec<PathBuf> = manifests(&dir)
        .into_iter()
        .filter(|p| !is_packed(p))
        .collect();
    println!("fixtures: {} cases under {}", cases.len(), dir.display());
    let mut failures = Vec::new();
    for (variant, gpu) in &gpus {
        let label = variant_label(
            if io == Io::Bf16 {
                "bf16 fixtures"
            } else {
                "fixtures"
            },
            *variant,
        );
        let mut worst = [0.0f64; 4];
        for path in &cases {
            let loaded = ssd_verify::fixture::read_case(path)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let case = loaded.case;
            let (p32, _) = as_f32_problem(&case.problem);
            let got = match io.forward(gpu, &p32) {
                Ok(o) => o,
                Err(ssd_gpu::GpuError::Unsupported(m)) => {
                    println!("{label}: {}: refused as unsupported ({m})", path.display());
                    continue;
                }
                Err(e) => panic!("{label}: {}: {e}", path.display()),
            };
            // The case's own expected tensors where it carries them, the float64 reference else.
            let v = io.check(&got, &Oracle::with_expected(&case.problem, &case.expected));
            for (k, name) in [
                OutputName::Out,
                OutputName::FinalStates,
                OutputName::DACumsum,
                OutputName::ChunkStates,
            ]
            .into_iter()
            .enumerate()
            {
                worst[k] = worst[k].max(v.tensor(name).map_or(0.0, |t| t.max_ratio()));
            }
            let bad = v.failures();
            if !bad.is_empty() {
                failures.push(format!("{label}: {}: {}", path.display(), bad.join("; ")));
            }
        }
        println!(
            "{label}: {} cases, worst error/bound out {:.3} final_states {:.3} dA_cumsum {:.3} chunk_states {:.3}, failing {}",
            cases.len(),
            worst[0],
            worst[1],
            worst[2],
            worst[3],
            failures.len()
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The packed (serving) fixtures through the packed path, every variant: `out`,
/// `final_states`, `varlen_states` and `position_states` against the float64 reference within
/// the TF32 bound.
#[test]
fn gpu_passes_every_serving_fixture() {
    let Some(gpus) = gpus_or_skip("gpu_passes_every_serving_fixture") else {
        return;
    };
    let Some(dir) = fixtures_dir() else {
        println!(
            "gpu_passes_every_serving_fixture: no fixtures folder found (set SSD_FIXTURES_DIR)"
        );
        return;
    };
    let cases: Vec<PathBuf> = manifests(&dir)
        .into_iter()
        .filter(|p| is_packed(p))
        .collect();
    assert!(
        !cases.is_empty(),
        "no packed fixture under {}",
        dir.display()
    );
    let names = [
        OutputName::Out,
        OutputName::FinalStates,
        OutputName::VarlenStates,
        OutputName::PositionStates,
    ];
    let mut failures = Vec::new();
    for (variant, gpu) in &gpus {
        let label = variant_label("serving fixtures", *variant);
        let mut worst = [0.0f64; 4];
        for path in &cases {
            let case = ssd_verify::fixture::read_case(path)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
                .case;
            let packing = case.packing.as_ref().expect("packed");
            let (p32, p64) = as_f32_problem(&case.problem);
            let k32 = packing.cast::<f32>();
            let oracle = Oracle::for_packed(&p64, &k32.cast::<f64>()).expect("valid packing");
            let o = gpu
                .forward_packed(&p32, &k32)
                .unwrap_or_else(|e| panic!("{label}: {}: {e}", path.display()));
            let got = [
                &o.out,
                &o.final_states,
                &o.varlen_states,
                &o.position_states,
            ];
            for (k, (name, t)) in names.into_iter().zip(got).enumerate() {
                let r = oracle
                    .compare(
                        name,
                        &t.mapv(f64::from).into_dyn(),
                        ssd_verify::fixture::Dtype::F32,
                        Precision::Tf32,
                    )
                    .expect("shapes agree");
                worst[k] = worst[k].max(r.max_ratio());
                if !r.passed() {
                    failures.push(format!(
                        "{label}: {}: {} worst error/bound {:.3}",
                        path.display(),
                        name.name(),
                        r.max_ratio()
                    ));
                }
            }
        }
        println!(
            "{label}: {} cases, worst error/bound out {:.3} final_states {:.3} varlen_states {:.3} position_states {:.3}",
            cases.len(),
            worst[0],
            worst[1],
            worst[2],
            worst[3]
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
