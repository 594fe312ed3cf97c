//! The CUDA sources and their NVRTC compilation, once per process and target.
//!
//! The kernels live in `gpu/kernels/*.cu` and are embedded in the binary; they are compiled to
//! PTX by NVRTC the first time a device of a given target asks for them, and the PTX is cached
//! for the rest of the process (module loading then happens once per [`crate::Gpu`]).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use cudarc::nvrtc::{CompileError, CompileOptions, Ptx};

use crate::GpuError;

/// The whole program NVRTC compiles: the shared helpers first, then one file per stage.
pub const SOURCE: &str = concat!(
    include_str!("../kernels/common.cuh"),
    "\n",
    include_str!("../kernels/chunk_cumsum.cu"),
    "\n",
    include_str!("../kernels/fwd_pass_state.cu"),
    "\n",
    include_str!("../kernels/compute_out.cu"),
);

/// Entry points of [`SOURCE`].
pub(crate) const CHUNK_CUMSUM: &str = "ssd_chunk_cumsum";
pub(crate) const CHUNK_CUMSUM_TILED: &str = "ssd_chunk_cumsum_tiled";
pub(crate) const FWD_PASS_STATE: &str = "ssd_fwd_pass_state";
pub(crate) const COMPUTE_OUT: &str = "ssd_compute_out";
pub(crate) const CHUNK_STATE_LOCAL: &str = "ssd_chunk_state_local";
pub(crate) const CHUNK_STATE_LOCAL_WIDE: &str = "ssd_chunk_state_local_wide";
pub(crate) const CHUNK_STATE_LOCAL_PAIR: &str = "ssd_chunk_state_local_pair";
pub(crate) const STATE_PASSING: &str = "ssd_state_passing";
pub(crate) const CHUNK_CB: &str = "ssd_chunk_cb";
pub(crate) const COMPUTE_OUT_CB: &str = "ssd_compute_out_cb";
pub(crate) const COMPUTE_OUT_CB128: &str = "ssd_compute_out_cb128";
pub(crate) const COMPUTE_OUT_PAIR: &str = "ssd_compute_out_pair";

/// The NVRTC target for a device of compute capability `major.minor`.
///
/// `sm_90a` on Hopper (9.0, the H100 and H200), so that later kernels may use its own
/// instructions; `compute_80` (portable PTX that the driver compiles for the device at load
/// time) on every other device of compute capability 8.0 or newer.
///
/// # Errors
/// [`GpuError::NoDevice`] below 8.0: the kernels need TF32 tensor cores (`mma.sync` m16n8k8 tf32).
pub fn target_for(major: i32, minor: i32) -> Result<&'static str, GpuError> {
    match (major, minor) {
        (9, 0) => Ok("sm_90a"),
        (m, _) if m >= 8 => Ok("compute_80"),
        _ => Err(GpuError::NoDevice(format!(
            "compute capability {major}.{minor} has no TF32 tensor cores; these kernels need 8.0 or newer"
        ))),
    }
}

/// Whether the NVRTC library can be loaded (checked before any call that would otherwise panic).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the shared library; nothing is called through it.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// PTX of [`SOURCE`] for `target` (e.g. `"sm_90a"`), compiled once per process and cached.
/// Needs the NVRTC library but no GPU.
///
/// # Errors
/// [`GpuError::NoDriver`] if NVRTC cannot be loaded; [`GpuError::Compile`] with NVRTC's log if
/// the compilation fails.
pub fn ptx(target: &'static str) -> Result<Ptx, GpuError> {
    static CACHE: OnceLock<Mutex<HashMap<&'static str, Ptx>>> = OnceLock::new();
    if !nvrtc_present() {
        return Err(GpuError::NoDriver(
            "the NVRTC library (libnvrtc) cannot be loaded: install the CUDA toolkit or put its lib folder on LD_LIBRARY_PATH".into(),
        ));
    }
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    let mut cache = cache
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(p) = cache.get(target) {
        return Ok(p.clone());
    }
    let opts = CompileOptions {
        arch: Some(target),
        name: Some("ssd_kernels.cu".into()),
        options: vec!["--std=c++17".into()],
        ..Default::default()
    };
    let compiled = std::panic::catch_unwind(|| cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts))
        .map_err(|_| GpuError::NoDriver("NVRTC could not be called".into()))?;
    let p = compiled.map_err(|e| compile_error(target, e))?;
    cache.insert(target, p.clone());
    Ok(p)
}

/// The PTX text for `target`, e.g. to read it or feed it to `ptxas` for a resource report.
///
/// # Errors
/// As [`ptx`].
pub fn ptx_text(target: &'static str) -> Result<String, GpuError> {
    Ok(ptx(target)?.to_src())
}

fn compile_error(target: &str, e: CompileError) -> GpuError {
    let log = match &e {
        CompileError::CompileError { log, options, .. } => {
            format!("options {options:?}\n{}", log.to_string_lossy())
        }
        other => format!("{other:?}"),
    };
    GpuError::Compile {
        arch: target.to_string(),
        log,
    }
}
