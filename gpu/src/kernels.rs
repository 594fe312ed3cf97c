//! The CUDA sources and their NVRTC compilation, once per process and target.
//!
//! The kernels live in `gpu/kernels/` and are embedded in the binary; they are compiled to
//! PTX by NVRTC the first time a device of a given target asks for them, and the PTX is cached
//! for the rest of the process (module loading then happens once per [`crate::Gpu`]).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use cudarc::nvrtc::{CompileError, CompileOptions, Ptx};

use crate::GpuError;

/// The program NVRTC compiles, file by file: the inline PTX, the shared helpers, then each
/// stage's kernels (`gpu/emu/kernels.h` includes the same files in the same order, `ptx.cuh`
/// replaced by the emulation; a unit test keeps the two lists equal).
macro_rules! sources {
    ($($file:literal),* $(,)?) => {
        /// The whole program NVRTC compiles: [`SOURCE_FILES`] one after the other.
        pub const SOURCE: &str = concat!($(include_str!(concat!("../kernels/", $file)), "\n"),*);
        /// The files of [`SOURCE`], relative to `gpu/kernels/`, in order.
        pub const SOURCE_FILES: &[&str] = &[$($file),*];
    };
}
sources!(
    "ptx.cuh",
    "common.cuh",
    "chunk_cumsum.cu",
    "fwd_pass_state/tiles.cuh",
    "fwd_pass_state/fused.cu",
    "fwd_pass_state/local.cu",
    "fwd_pass_state/pair.cu",
    "fwd_pass_state/passing.cu",
    "fwd_pass_state/bf16.cu",
    "fwd_pass_state/chained.cu",
    "fwd_pass_state/walk.cu",
    "compute_out/tiles.cuh",
    "compute_out/fused.cu",
    "compute_out/scores.cu",
    "compute_out/tiled.cu",
    "compute_out/pair.cu",
    "compute_out/bf16.cu",
    "compute_out/wg_bf16.cu",
    "serving.cu",
    "convert.cu",
);

/// Every kernel of [`SOURCE`], once: its entry point, the threads of its blocks and its
/// parameter struct (`gpu/src/params.rs`). Its dynamic shared memory comes from the loaded
/// module (`K_layout`, see `gpu/kernels/common.cuh`): [`crate::Gpu::smem_bytes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// Stage 1, one thread per (batch, chunk, head).
    ChunkCumsum,
    /// Stage 1, one block per (batch, chunk, 32 heads).
    ChunkCumsumTiled,
    /// Stage 2a, 64 dstate columns per block.
    ChunkStateLocal,
    /// Stage 2a, 128 dstate columns per block.
    ChunkStateLocalWide,
    /// Stage 2a over pairs of units.
    ChunkStateLocalPair,
    /// Stage 2b, the pass across chunks.
    StatePassing,
    /// Stage 3a, the scores `C B^T`.
    ChunkCb,
    /// Stage 3b over 64 rows per block.
    ComputeOutCb,
    /// Stage 3b over 128 rows per block.
    ComputeOutCb128,
    /// Stage 3b over pairs of units.
    ComputeOutPair,
    /// Stage 2 in one kernel, sequential over the chunks (version 1; the fallback of 2a).
    FwdPassState,
    /// Stage 3 in one kernel that computes its own scores (version 1; other chunk sizes).
    ComputeOut,
    /// Packed sequences: each initial state's share of `out` in its sequence's first chunk.
    SeqInitOut,
    /// Packed sequences: the states after listed tokens.
    StatesAt,
    /// Stage 2a over pairs of units, bf16 `x` and `B`.
    ChunkStateLocalPairBf16,
    /// Stage 3a, the scores `C B^T` from bf16 `C` and `B`.
    ChunkCbBf16,
    /// Stage 3b over pairs of units, bf16 `x`, `C`, `z` and `out`.
    ComputeOutPairBf16,
    /// bf16 to f32, element-wise (the bf16 fallback's inputs).
    WidenBf16,
    /// f32 to bf16, element-wise (the bf16 fallback's `out`).
    NarrowBf16,
    /// Stage 2 (2a and 2b) in one kernel, chained over the chunks (version 3).
    StateChained,
    /// The chained stage 2 with bf16 `x` and `B`.
    StateChainedBf16,
    /// Stage 3 (scores included) on Hopper: bf16 `x`, `B`, `C`, `z` and `out`, TMA copies and
    /// `wgmma` products.
    ComputeOutWgBf16,
    /// Stage 2, each block walking the chunks with its units' states in registers: one unit
    /// per block.
    StateWalkX1,
    /// [`Kernel::StateWalkX1`] with two units per block.
    StateWalkX2,
    /// [`Kernel::StateWalkX1`] with five units per block.
    StateWalkX5,
    /// [`Kernel::StateWalkX1`] with bf16 `x` and `B`.
    StateWalkBf16x1,
    /// [`Kernel::StateWalkX2`] with bf16 `x` and `B`.
    StateWalkBf16x2,
    /// [`Kernel::StateWalkX5`] with bf16 `x` and `B`.
    StateWalkBf16x5,
    /// Stage 2 walked segment by segment (one unit and 128 dstate columns a block): each
    /// segment's own end state (phase 0), then each segment from its true start state
    /// (phase 1).
    StateWalkSegX1,
    /// [`Kernel::StateWalkSegX1`] with bf16 `x` and `B`.
    StateWalkSegBf16x1,
    /// Between the segmented walk's two phases: the segments' start states from their own end
    /// states, in place.
    StateWalkSegCombine,
    /// [`Kernel::ComputeOutWgBf16`] at dstate 256 (chunks of 128 tokens).
    ComputeOutWgBf16N256,
}

impl Kernel {
    /// Every kernel, in the order of [`crate::Gpu::kernel_resources`] and of the declaration
    /// (`k as usize` is `k`'s index here).
    pub const ALL: [Kernel; 32] = [
        Kernel::ChunkCumsum,
        Kernel::ChunkCumsumTiled,
        Kernel::ChunkStateLocal,
        Kernel::ChunkStateLocalWide,
        Kernel::ChunkStateLocalPair,
        Kernel::StatePassing,
        Kernel::ChunkCb,
        Kernel::ComputeOutCb,
        Kernel::ComputeOutCb128,
        Kernel::ComputeOutPair,
        Kernel::FwdPassState,
        Kernel::ComputeOut,
        Kernel::SeqInitOut,
        Kernel::StatesAt,
        Kernel::ChunkStateLocalPairBf16,
        Kernel::ChunkCbBf16,
        Kernel::ComputeOutPairBf16,
        Kernel::WidenBf16,
        Kernel::NarrowBf16,
        Kernel::StateChained,
        Kernel::StateChainedBf16,
        Kernel::ComputeOutWgBf16,
        Kernel::StateWalkX1,
        Kernel::StateWalkX2,
        Kernel::StateWalkX5,
        Kernel::StateWalkBf16x1,
        Kernel::StateWalkBf16x2,
        Kernel::StateWalkBf16x5,
        Kernel::StateWalkSegX1,
        Kernel::StateWalkSegBf16x1,
        Kernel::StateWalkSegCombine,
        Kernel::ComputeOutWgBf16N256,
    ];

    /// The entry point in [`SOURCE`].
    pub const fn name(self) -> &'static str {
        match self {
            Kernel::ChunkCumsum => "ssd_chunk_cumsum",
            Kernel::ChunkCumsumTiled => "ssd_chunk_cumsum_tiled",
            Kernel::FwdPassState => "ssd_fwd_pass_state",
            Kernel::ChunkStateLocal => "ssd_chunk_state_local",
            Kernel::ChunkStateLocalWide => "ssd_chunk_state_local_wide",
            Kernel::ChunkStateLocalPair => "ssd_chunk_state_local_pair",
            Kernel::StatePassing => "ssd_state_passing",
            Kernel::ComputeOut => "ssd_compute_out",
            Kernel::ChunkCb => "ssd_chunk_cb",
            Kernel::ComputeOutCb => "ssd_compute_out_cb",
            Kernel::ComputeOutCb128 => "ssd_compute_out_cb128",
            Kernel::ComputeOutPair => "ssd_compute_out_pair",
            Kernel::SeqInitOut => "ssd_seq_init_out",
            Kernel::StatesAt => "ssd_states_at",
            Kernel::ChunkStateLocalPairBf16 => "ssd_chunk_state_local_pair_bf16",
            Kernel::ChunkCbBf16 => "ssd_chunk_cb_bf16",
            Kernel::ComputeOutPairBf16 => "ssd_compute_out_pair_bf16",
            Kernel::WidenBf16 => "ssd_widen_bf16",
            Kernel::NarrowBf16 => "ssd_narrow_bf16",
            Kernel::StateChained => "ssd_state_chained",
            Kernel::StateChainedBf16 => "ssd_state_chained_bf16",
            Kernel::ComputeOutWgBf16 => "ssd_compute_out_wg_bf16",
            Kernel::StateWalkX1 => "ssd_state_walk_1",
            Kernel::StateWalkX2 => "ssd_state_walk_2",
            Kernel::StateWalkX5 => "ssd_state_walk_5",
            Kernel::StateWalkBf16x1 => "ssd_state_walk_bf16_1",
            Kernel::StateWalkBf16x2 => "ssd_state_walk_bf16_2",
            Kernel::StateWalkBf16x5 => "ssd_state_walk_bf16_5",
            Kernel::StateWalkSegX1 => "ssd_state_walk_seg_1",
            Kernel::StateWalkSegBf16x1 => "ssd_state_walk_seg_bf16_1",
            Kernel::StateWalkSegCombine => "ssd_state_walk_seg_combine",
            Kernel::ComputeOutWgBf16N256 => "ssd_compute_out_wg_bf16_n256",
        }
    }

    /// Threads per block: the kernel's `__launch_bounds__`, and what every launch uses.
    pub const fn threads(self) -> u32 {
        match self {
            Kernel::ChunkCumsum
            | Kernel::FwdPassState
            | Kernel::ChunkStateLocal
            | Kernel::ComputeOut
            | Kernel::ChunkCb
            | Kernel::ChunkCbBf16
            | Kernel::ComputeOutCb
            | Kernel::SeqInitOut
            | Kernel::StatesAt
            | Kernel::StateWalkX1
            | Kernel::StateWalkBf16x1
            | Kernel::StateWalkSegX1
            | Kernel::StateWalkSegBf16x1 => 128,
            Kernel::ChunkCumsumTiled
            | Kernel::ChunkStateLocalWide
            | Kernel::ChunkStateLocalPair
            | Kernel::StatePassing
            | Kernel::ComputeOutCb128
            | Kernel::ComputeOutPair
            | Kernel::ChunkStateLocalPairBf16
            | Kernel::ComputeOutPairBf16
            | Kernel::WidenBf16
            | Kernel::NarrowBf16
            | Kernel::StateChained
            | Kernel::StateChainedBf16
            | Kernel::StateWalkX2
            | Kernel::StateWalkBf16x2
            | Kernel::StateWalkSegCombine => 256,
            Kernel::ComputeOutWgBf16 | Kernel::ComputeOutWgBf16N256 => 384,
            Kernel::StateWalkX5 | Kernel::StateWalkBf16x5 => 640,
        }
    }

    /// Size of the kernel's parameter struct on the host side.
    pub(crate) const fn params_bytes(self) -> usize {
        use crate::params::*;
        use std::mem::size_of;
        match self {
            Kernel::ChunkCumsum | Kernel::ChunkCumsumTiled => size_of::<ChunkCumsumParams>(),
            Kernel::FwdPassState => size_of::<FwdPassStateParams>(),
            Kernel::ChunkStateLocal
            | Kernel::ChunkStateLocalWide
            | Kernel::ChunkStateLocalPair
            | Kernel::ChunkStateLocalPairBf16 => size_of::<ChunkStateLocalParams>(),
            Kernel::StatePassing => size_of::<StatePassingParams>(),
            Kernel::ComputeOut => size_of::<ComputeOutParams>(),
            Kernel::ChunkCb | Kernel::ChunkCbBf16 => size_of::<ChunkCbParams>(),
            Kernel::ComputeOutCb
            | Kernel::ComputeOutCb128
            | Kernel::ComputeOutPair
            | Kernel::ComputeOutPairBf16 => size_of::<ComputeOutCbParams>(),
            Kernel::SeqInitOut => size_of::<SeqInitOutParams>(),
            Kernel::StatesAt => size_of::<StatesAtParams>(),
            Kernel::WidenBf16 | Kernel::NarrowBf16 => size_of::<ConvertParams>(),
            Kernel::StateChained
            | Kernel::StateChainedBf16
            | Kernel::StateWalkX1
            | Kernel::StateWalkX2
            | Kernel::StateWalkX5
            | Kernel::StateWalkBf16x1
            | Kernel::StateWalkBf16x2
            | Kernel::StateWalkBf16x5 => size_of::<StateChainedParams>(),
            Kernel::StateWalkSegX1 | Kernel::StateWalkSegBf16x1 | Kernel::StateWalkSegCombine => {
                size_of::<StateWalkSegParams>()
            }
            Kernel::ComputeOutWgBf16 | Kernel::ComputeOutWgBf16N256 => {
                size_of::<ComputeOutWgParams>()
            }
        }
    }

    /// The Hopper output kernel for `dstate` (256: [`Kernel::ComputeOutWgBf16N256`], else
    /// [`Kernel::ComputeOutWgBf16`]).
    pub(crate) const fn wg_out(dstate: usize) -> Kernel {
        if dstate > 128 {
            Kernel::ComputeOutWgBf16N256
        } else {
            Kernel::ComputeOutWgBf16
        }
    }

    /// The name of the kernel's layout global in the module (`K_layout`).
    pub(crate) fn layout_symbol(self) -> String {
        format!("{}_layout", self.name())
    }
}

/// What the loaded module says of one kernel (`struct KernelLayout` in
/// `gpu/kernels/common.cuh`): the size of its parameter struct, and its dynamic shared memory
/// in bytes for dstate up to 64, 128, 192 and 256.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KernelLayout {
    pub params: u32,
    pub smem: [u32; 4],
}

impl KernelLayout {
    /// Bytes of the C struct.
    pub(crate) const BYTES: usize = 20;

    /// Reads the C struct's bytes (little-endian `u32`s, as on every CUDA host).
    pub(crate) fn from_bytes(b: &[u8]) -> Option<Self> {
        if b.len() != Self::BYTES {
            return None;
        }
        let word =
            |i: usize| u32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]);
        Some(KernelLayout {
            params: word(0),
            smem: [word(1), word(2), word(3), word(4)],
        })
    }

    /// Dynamic shared memory of a block for `dstate` (1 to 256), in bytes.
    pub fn smem_bytes(&self, dstate: usize) -> usize {
        self.smem[dstate.div_ceil(64).clamp(1, 4) - 1] as usize
    }
}

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

/// The environment variable whose whitespace-separated words [`ptx`] appends to its NVRTC
/// options: for kernel development only, e.g. `-DNAME=1` to build a kernel's alternative form
/// (the forms each `.cu` header lists) or `-lineinfo` for a profiler's source view. Read once per
/// process, at the first compilation; the tests and every documented figure use none.
pub const NVRTC_OPTIONS_ENV: &str = "SSD_NVRTC_OPTIONS";

/// The extra NVRTC options in `value` (the variable's content, if set): its words.
fn extra_options(value: Option<&str>) -> Vec<String> {
    value
        .map(|v| v.split_whitespace().map(String::from).collect())
        .unwrap_or_default()
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
    let mut options = vec!["--std=c++17".to_string()];
    let extra = extra_options(std::env::var(NVRTC_OPTIONS_ENV).ok().as_deref());
    if !extra.is_empty() {
        eprintln!(
            "ssd-gpu: NVRTC options from {NVRTC_OPTIONS_ENV}: {extra:?} (not the tested build)"
        );
        options.extend(extra);
    }
    let opts = CompileOptions {
        arch: Some(target),
        name: Some("ssd_kernels.cu".into()),
        options,
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
        source: e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extra_nvrtc_options_are_the_words_of_the_variable() {
        assert!(extra_options(None).is_empty());
        assert!(extra_options(Some("  ")).is_empty());
        assert_eq!(
            extra_options(Some(" -DA=1\t-lineinfo\n")),
            vec!["-DA=1".to_string(), "-lineinfo".to_string()]
        );
    }

    #[test]
    fn the_emulator_includes_the_same_files_in_the_same_order() {
        let list = include_str!("../emu/kernels.h");
        let included: Vec<&str> = list
            .lines()
            .filter_map(|l| l.strip_prefix("#include \"../kernels/"))
            .map(|l| l.trim_end_matches('"'))
            .collect();
        assert_eq!(
            SOURCE_FILES[0], "ptx.cuh",
            "emu.h stands in for the inline PTX"
        );
        assert_eq!(included, SOURCE_FILES[1..]);
    }

    #[test]
    fn inline_ptx_lives_in_one_file() {
        let ptx = include_str!("../kernels/ptx.cuh");
        let rest = &SOURCE[ptx.len()..];
        assert!(!rest.contains("asm(") && !rest.contains("asm volatile"));
    }

    #[test]
    fn every_kernel_is_named_once_and_defines_its_layout() {
        for k in Kernel::ALL {
            let entry = format!(" {}(const ", k.name());
            assert_eq!(SOURCE.matches(&entry).count(), 1, "{entry}");
            let layout = format!("({}, ", k.name());
            assert_eq!(
                SOURCE.matches(&layout).count(),
                1,
                "{} has no SSD_LAYOUT",
                k.name()
            );
            assert!(k.params_bytes() % 8 == 0);
        }
        for (i, k) in Kernel::ALL.into_iter().enumerate() {
            assert_eq!(k as usize, i, "{}", k.name());
        }
        let mut names: Vec<_> = Kernel::ALL.iter().map(|k| k.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Kernel::ALL.len());
    }

    #[test]
    fn layouts_read_back() {
        let mut b = Vec::new();
        for w in [80u32, 1, 2, 3, 4] {
            b.extend_from_slice(&w.to_le_bytes());
        }
        let l = KernelLayout::from_bytes(&b).unwrap();
        assert_eq!(l.params, 80);
        assert_eq!(
            [1, 64, 65, 128, 129, 256].map(|d| l.smem_bytes(d)),
            [1, 1, 2, 2, 3, 4]
        );
    }
}
