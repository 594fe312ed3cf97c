//! Registers, stack frame and spills of every kernel, without a GPU: the kernels compiled by
//! NVRTC exactly as [`ssd_gpu::Gpu`] compiles them ([`ssd_gpu::kernels::ptx_text`]), then
//! `ptxas -v` for the target's architecture.
//!
//! Needs libnvrtc on the library path and `ptxas` (the `PTXAS` variable, else `ptxas` on
//! `PATH`); `scripts/kernel-resources.sh` fetches both from NVIDIA's pip wheels and runs this:
//!
//! ```text
//! cargo run --release -p ssd-gpu --example kernel_resources -- [TARGET] [FILTER]
//! ```
//!
//! `TARGET` is an NVRTC target, `sm_90a` (the H200's, the default) or `compute_80` (the PTX
//! that other devices get); `FILTER` keeps the kernels whose name contains it. With
//! `SSD_PTX_OUT=FILE` the PTX that ptxas compiled is also written to `FILE` (for comparing the
//! code of two builds, `scripts/ptx-diff.sh`). Local memory
//! per thread (the stack frame) is what the driver reports as `local` on the device, and spills
//! in an issue-bound loop cost time (docs/performance.md).

use std::process::{Command, ExitCode};

/// One kernel's line of `ptxas -v`.
#[derive(Default)]
struct Resources {
    name: String,
    registers: Option<u32>,
    stack: Option<u32>,
    spill_stores: Option<u32>,
    spill_loads: Option<u32>,
}

/// The number before `unit` in `line` ("56 bytes stack frame" -> 56 for "bytes stack frame").
fn number_before(line: &str, unit: &str) -> Option<u32> {
    let head = &line[..line.find(unit)?];
    head.split(|c: char| !c.is_ascii_digit())
        .rfind(|s| !s.is_empty())?
        .parse()
        .ok()
}

/// Parses `ptxas -v`: an entry's properties follow its "Compiling entry function" line.
fn parse(log: &str) -> Vec<Resources> {
    let mut out: Vec<Resources> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default().to_string();
            out.push(Resources {
                name,
                ..Resources::default()
            });
            continue;
        }
        let Some(cur) = out.last_mut() else { continue };
        if line.contains("bytes stack frame") {
            cur.stack = number_before(line, "bytes stack frame");
            cur.spill_stores = number_before(line, "bytes spill stores");
            cur.spill_loads = number_before(line, "bytes spill loads");
        } else if line.contains("Used") && line.contains("registers") {
            cur.registers = number_before(line, "registers");
        }
    }
    out
}

fn show(v: Option<u32>) -> String {
    v.map_or_else(|| "?".into(), |n| n.to_string())
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let target: &'static str = match args.next().as_deref() {
        None | Some("sm_90a") => "sm_90a",
        Some("compute_80") => "compute_80",
        Some(other) => {
            eprintln!("error: unknown target {other:?} (sm_90a or compute_80)");
            return ExitCode::FAILURE;
        }
    };
    let filter = args.next().unwrap_or_default();
    let ptx = match ssd_gpu::kernels::ptx_text(target) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let arch = target.replace("compute_", "sm_");
    let dir = std::env::temp_dir().join(format!("ssd-kernel-resources-{}", std::process::id()));
    let result = (|| -> Result<String, String> {
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let ptx_path = dir.join("kernels.ptx");
        std::fs::write(&ptx_path, &ptx).map_err(|e| format!("{}: {e}", ptx_path.display()))?;
        if let Some(out) = std::env::var_os("SSD_PTX_OUT") {
            std::fs::write(&out, &ptx).map_err(|e| {
                format!("SSD_PTX_OUT {}: {e}", std::path::Path::new(&out).display())
            })?;
        }
        let ptxas = std::env::var("PTXAS").unwrap_or_else(|_| "ptxas".into());
        let run = Command::new(&ptxas)
            .arg(format!("-arch={arch}"))
            .arg("-v")
            .arg(&ptx_path)
            .arg("-o")
            .arg(dir.join("kernels.cubin"))
            .output()
            .map_err(|e| format!("cannot run {ptxas:?} (set PTXAS): {e}"))?;
        let log = String::from_utf8_lossy(&run.stderr).into_owned();
        if !run.status.success() {
            return Err(format!("ptxas failed:\n{log}"));
        }
        Ok(log)
    })();
    // Best effort: the folder is ours alone, and a leftover temporary file harms nothing.
    let _ = std::fs::remove_dir_all(&dir);
    let log = match result {
        Ok(log) => log,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    // ptxas's warnings and its performance notes (e.g. `(C7510)`-style "Potential Performance
    // Loss" lines, printed as `info`, which say that it serialized wgmma products) go to stderr
    // as they are.
    for line in log
        .lines()
        .filter(|l| l.contains("warning") || l.contains("Performance Loss"))
    {
        eprintln!("{line}");
    }
    let mut kernels = parse(&log);
    kernels.retain(|k| k.name.contains(&filter));
    kernels.sort_by(|a, b| a.name.cmp(&b.name));
    println!(
        "{arch}: registers, stack frame (local bytes per thread), spill stores / loads (bytes)"
    );
    for k in &kernels {
        println!(
            "{:<40} {:>4} regs {:>5} B stack {:>5} / {:<5} B spills",
            k.name,
            show(k.registers),
            show(k.stack),
            show(k.spill_stores),
            show(k.spill_loads)
        );
    }
    if kernels.is_empty() {
        eprintln!("error: no kernel matched {filter:?}");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_ptxas_verbose_output() {
        let log = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'ssd_a' for 'sm_90a'
ptxas info    : Function properties for ssd_a
    56 bytes stack frame, 48 bytes spill stores, 52 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 56 bytes cumulative stack size
ptxas info    : Compiling entry function 'ssd_b' for 'sm_90a'
ptxas info    : Function properties for ssd_b
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 96 registers
";
        let k = parse(log);
        assert_eq!(k.len(), 2);
        assert_eq!(
            (
                &*k[0].name,
                k[0].registers,
                k[0].stack,
                k[0].spill_stores,
                k[0].spill_loads
            ),
            ("ssd_a", Some(128), Some(56), Some(48), Some(52))
        );
        assert_eq!(
            (
                &*k[1].name,
                k[1].registers,
                k[1].stack,
                k[1].spill_stores,
                k[1].spill_loads
            ),
            ("ssd_b", Some(96), Some(0), Some(0), Some(0))
        );
    }
}
