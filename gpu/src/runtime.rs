//! [`Gpu`]: one CUDA device with the SSD kernels loaded, and the device-resident buffers.

use std::sync::Arc;

use cudarc::driver::{
    result::DriverError,
    sys::{CUdevice_attribute, CUfunction_attribute},
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
    LaunchConfig, PushKernelArg, SyncOnDrop,
};
use ssd_reference::{Dims, Options};

use crate::error::unsupported;
use crate::io::{Bf16, IoElement};
use crate::kernels::{self, Kernel, KernelLayout};
use crate::shape::{self, Lengths};
use crate::GpuError;

/// Which kernels serve each stage (`docs/gpu.md`). Every variant computes the same contract;
/// version 3 is the default, the others are kept for comparison, and a test process can open
/// one [`Gpu`] per variant to run them all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Variant {
    /// Version 3: version 2, with stage 2 in one kernel chained over the chunks
    /// (`ssd_state_chained`) where it applies ([`Gpu::uses_chained`]).
    #[default]
    V3,
    /// Version 2 with the kernels over pairs of units where they apply and fit the device:
    /// the stage-by-stage path.
    V2,
    /// Version 2 without the kernels over pairs of units (`ssd_chunk_state_local_wide` and
    /// `ssd_compute_out_cb128` everywhere).
    V2Unpaired,
    /// Version 1: one kernel per stage (the plain cumsum, the fused sequential state pass and
    /// the output kernel that computes its own scores).
    V1,
}

impl Variant {
    /// Every variant, the default first.
    pub const ALL: [Variant; 4] = [Variant::V3, Variant::V2, Variant::V2Unpaired, Variant::V1];
}

/// How a [`Gpu`] is opened: passed to [`Gpu::with_config`]; nothing in this crate reads the
/// environment ([`GpuConfig::from_env`] is there for programs that want to).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct GpuConfig {
    /// Device ordinal.
    pub ordinal: usize,
    /// Which kernels serve each stage.
    pub variant: Variant,
    /// The most blocks a persistent kernel (the Hopper output kernel) launches; `None`: one
    /// per SM. Tests set a small cap so that every block walks many work items.
    pub persistent_blocks: Option<usize>,
    /// Keeps stage 3 of bf16 activations off the Hopper output kernel (3a and the pair kernel
    /// instead, as in [`Variant::V2`]) while the rest of [`Variant::V3`] stays: for comparing
    /// the two output stages in one program (`SSD_GPU_WG=0` in [`GpuConfig::from_env`]).
    pub no_wg_out: bool,
    /// Lets the Hopper output kernel serve dstate 256 too (`ssd_compute_out_wg_bf16_n256`,
    /// chunks of 128 tokens; version 70, not yet timed against the pair kernel that serves it
    /// otherwise): for tests and A/B runs (`SSD_GPU_WG=n256` in [`GpuConfig::from_env`]).
    pub wg_out_n256: bool,
    /// Where stage 2 walks the chunks with the states in registers (`ssd_state_walk_*`,
    /// [`Gpu::state_walk_units`]).
    pub state_walk: StateWalk,
}

/// Whether stage 2 runs on the walking kernels (`ssd_state_walk_1`, `_2`, `_5` and
/// `ssd_state_walk_bf16_*`: each block holds 1, 2 or 5 units' states in registers and walks
/// the chunks in order, see `docs/gpu.md`) in [`Variant::V3`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum StateWalk {
    /// bf16 activations on Hopper, where the units (batch x heads x 64-row slices of headdim)
    /// fill the device, with the units per block that leave the fewest to a block slot
    /// ([`Gpu::state_walk_units`]); elsewhere as [`StateWalk::Off`]. The default: the form
    /// that measured faster than the chained kernel (`docs/gpu.md`).
    #[default]
    Auto,
    /// Never: the chained kernel or 2a + 2b.
    Off,
    /// Always where the kernel with this many units per block (1, 2 or 5) serves the shape,
    /// however few the units: for tests and A/B runs.
    Units(usize),
    /// The segmented walk ([`Gpu::state_walk_segments`]: each unit's chunks cut into this many
    /// segments, each walked by its own block, in two phases with a combination between them;
    /// 0: as many as fill the device's block slots) wherever it serves the shape: for tests
    /// and A/B runs (not yet timed against the other forms, `docs/gpu.md`).
    Segments(usize),
}

impl GpuConfig {
    /// Device 0 with `variant`.
    pub fn variant(variant: Variant) -> Self {
        GpuConfig {
            ordinal: 0,
            variant,
            persistent_blocks: None,
            no_wg_out: false,
            wg_out_n256: false,
            state_walk: StateWalk::default(),
        }
    }

    /// The configuration the command-line tools take from the environment: `SSD_GPU_V1=1`
    /// selects [`Variant::V1`], else `SSD_GPU_PAIR=0` [`Variant::V2Unpaired`], else
    /// `SSD_GPU_CHAINED=0` [`Variant::V2`]; `SSD_GPU_WG=0` sets [`GpuConfig::no_wg_out`],
    /// `SSD_GPU_WG=n256` [`GpuConfig::wg_out_n256`];
    /// `SSD_GPU_WALK=0` sets [`StateWalk::Off`], `SSD_GPU_WALK=auto` [`StateWalk::Auto`],
    /// `SSD_GPU_WALK=1`, `2` or `5` [`StateWalk::Units`], `SSD_GPU_WALK=seg` `StateWalk::Segments(0)`
    /// and `SSD_GPU_WALK=seg:N` `StateWalk::Segments(N)`; device 0.
    pub fn from_env() -> Self {
        let on = |name: &str, v: &str| std::env::var(name).is_ok_and(|x| x == v);
        let variant = if on("SSD_GPU_V1", "1") {
            Variant::V1
        } else if on("SSD_GPU_PAIR", "0") {
            Variant::V2Unpaired
        } else if on("SSD_GPU_CHAINED", "0") {
            Variant::V2
        } else {
            Variant::V3
        };
        let state_walk = match std::env::var("SSD_GPU_WALK").ok().as_deref() {
            Some("0") => StateWalk::Off,
            Some("auto") => StateWalk::Auto,
            Some("seg") => StateWalk::Segments(0),
            Some(v) => match v.strip_prefix("seg:") {
                Some(n) => n.parse().map_or(StateWalk::default(), StateWalk::Segments),
                None => v.parse().map_or(StateWalk::default(), StateWalk::Units),
            },
            None => StateWalk::default(),
        };
        GpuConfig {
            no_wg_out: on("SSD_GPU_WG", "0"),
            wg_out_n256: on("SSD_GPU_WG", "n256"),
            state_walk,
            ..GpuConfig::variant(variant)
        }
    }
}

/// One CUDA device, a stream on it and the SSD kernels, compiled and loaded.
///
/// Every operation is enqueued on [`Gpu::stream`]; results are ready once the stream is
/// synchronised (the `download`/`forward` helpers do that).
#[derive(Debug)]
pub struct Gpu {
    pub(crate) stream: Arc<CudaStream>,
    /// The functions and layouts of [`Kernel::ALL`], in that order.
    functions: Vec<CudaFunction>,
    layouts: Vec<KernelLayout>,
    /// Whether the kernels over pairs of units (2a and the output kernel) may be used: the
    /// variant is [`Variant::V2`] or [`Variant::V3`] and their shared memory fits this device.
    pub(crate) pairs: bool,
    /// Whether the chained stage 2 may be used: [`Variant::V3`], and it fits this device.
    pub(crate) chained: bool,
    /// Streaming multiprocessors of this device.
    pub(crate) sm_count: usize,
    /// True for [`Variant::V1`].
    pub(crate) legacy: bool,
    config: GpuConfig,
    target: &'static str,
    name: String,
    /// Dynamic shared memory a block of each kernel of [`Kernel::ALL`] may opt in to on this
    /// device, in bytes: the device's opt-in limit less the kernel's static shared memory.
    smem_limits: Vec<usize>,
    /// Blocks of each kernel of [`Kernel::ALL`] that one SM holds at a time at its shared
    /// memory for dstate 128 (the driver's occupancy; 0 where that does not fit or the driver
    /// cannot say): [`Gpu::resident_blocks`].
    resident: Vec<usize>,
}

/// Whether the CUDA driver library can be loaded at all.
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the shared library; nothing is called through it.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

impl Gpu {
    /// Opens device `ordinal` with the default kernels ([`Variant::V3`]): [`Gpu::with_config`].
    ///
    /// # Errors
    /// As [`Gpu::with_config`].
    pub fn new(ordinal: usize) -> Result<Self, GpuError> {
        Self::with_config(GpuConfig {
            ordinal,
            ..GpuConfig::default()
        })
    }

    /// Opens device `config.ordinal`, compiles the kernels for it (once per process and target)
    /// and loads them, to run `config.variant`.
    ///
    /// # Errors
    /// [`GpuError::NoDriver`] when `libcuda` or `libnvrtc` cannot be loaded,
    /// [`GpuError::NoDevice`] when there is no such device or it is older than compute
    /// capability 8.0, [`GpuError::Compile`] with NVRTC's log, [`GpuError::Driver`] otherwise
    /// (also when the module's layouts disagree with this crate's parameter structs).
    pub fn with_config(config: GpuConfig) -> Result<Self, GpuError> {
        if !driver_present() {
            return Err(GpuError::NoDriver(
                "the CUDA driver library (libcuda) cannot be loaded".into(),
            ));
        }
        // cudarc panics when a driver symbol is missing; turn that into an error too.
        std::panic::catch_unwind(|| Self::open(config)).unwrap_or_else(|_| {
            Err(GpuError::NoDriver(
                "the CUDA driver library could not be used (missing symbol or failed initialisation)".into(),
            ))
        })
    }

    fn open(config: GpuConfig) -> Result<Self, GpuError> {
        let ordinal = config.ordinal;
        cudarc::driver::result::init()
            .map_err(|e| GpuError::NoDevice(format!("cuInit failed: {e:?}")))?;
        let count = CudaContext::device_count()?;
        if count <= 0 {
            return Err(GpuError::NoDevice("the driver reports no device".into()));
        }
        if ordinal >= count as usize {
            return Err(GpuError::NoDevice(format!(
                "device {ordinal} requested, the driver reports {count}"
            )));
        }
        let ctx = CudaContext::new(ordinal)?;
        let (major, minor) = ctx.compute_capability()?;
        let target = kernels::target_for(major, minor)?;
        let ptx = kernels::ptx(target)?;
        let module = ctx.load_module(ptx)?;
        // The context's default stream: no cross-stream event bookkeeping on every launch.
        let stream = ctx.default_stream();
        let max_smem_optin = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
            as usize;
        let sm_count =
            ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize;
        let mut functions = Vec::with_capacity(Kernel::ALL.len());
        let mut layouts = Vec::with_capacity(Kernel::ALL.len());
        let mut smem_limits = Vec::with_capacity(Kernel::ALL.len());
        let mut resident = Vec::with_capacity(Kernel::ALL.len());
        for k in Kernel::ALL {
            let f = module.load_function(k.name())?;
            let symbol = module.get_global(&k.layout_symbol(), &stream)?;
            let bytes = stream.clone_dtoh(&symbol)?;
            stream.synchronize()?;
            let layout = KernelLayout::from_bytes(&bytes)
                .filter(|l| l.params as usize == k.params_bytes())
                .ok_or_else(|| {
                    GpuError::Internal(format!(
                        "{}: the module's layout ({} bytes: {bytes:?}) does not match the {}-byte parameter struct of this crate",
                        k.layout_symbol(),
                        bytes.len(),
                        k.params_bytes()
                    ))
                })?;
            // The opt-in covers static and dynamic shared memory together: a kernel with static
            // shared memory may ask for that much less dynamic (the driver refuses more).
            let static_smem =
                f.get_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)?;
            let limit = max_smem_optin.saturating_sub(usize::try_from(static_smem).unwrap_or(0));
            if layout.smem.iter().any(|&b| b > 0) {
                f.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    i32::try_from(limit).unwrap_or(i32::MAX),
                )?;
            }
            let smem128 = layout.smem_bytes(128);
            // 0 where the driver cannot say: the walking stage 2's choice then passes that form.
            resident.push(if smem128 <= limit {
                f.occupancy_max_active_blocks_per_multiprocessor(k.threads(), smem128, None)
                    .map_or(0, |n| n as usize)
            } else {
                0
            });
            functions.push(f);
            layouts.push(layout);
            smem_limits.push(limit);
        }
        let fits = |k: Kernel| layouts[k as usize].smem_bytes(256) <= smem_limits[k as usize];
        let legacy = config.variant == Variant::V1;
        let pairs = matches!(config.variant, Variant::V2 | Variant::V3)
            && fits(Kernel::ComputeOutPair)
            && fits(Kernel::ChunkStateLocalPair);
        let chained = pairs
            && config.variant == Variant::V3
            && fits(Kernel::StateChained)
            && fits(Kernel::StateChainedBf16);
        let name = ctx.name().unwrap_or_else(|_| "unknown".into());
        Ok(Gpu {
            stream,
            functions,
            layouts,
            pairs,
            chained,
            sm_count,
            legacy,
            config,
            target,
            name,
            smem_limits,
            resident,
        })
    }

    /// The configuration this `Gpu` was opened with.
    pub fn config(&self) -> GpuConfig {
        self.config
    }

    /// The loaded function of `k`.
    pub(crate) fn function(&self, k: Kernel) -> &CudaFunction {
        &self.functions[k as usize]
    }

    /// What the loaded module says of `k`: its parameter size and dynamic shared memory.
    pub fn layout(&self, k: Kernel) -> KernelLayout {
        self.layouts[k as usize]
    }

    /// Dynamic shared memory of a block of `k` for `dstate`, in bytes, as the kernel source
    /// lays it out.
    pub fn smem_bytes(&self, k: Kernel, dstate: usize) -> usize {
        self.layout(k).smem_bytes(dstate)
    }

    /// Dynamic shared memory a block of `k` may have on this device, in bytes: the device's
    /// opt-in limit less `k`'s static shared memory.
    pub fn smem_limit(&self, k: Kernel) -> usize {
        self.smem_limits[k as usize]
    }

    /// Whether a block of `k` at `dstate` fits this device's shared memory.
    pub(crate) fn fits(&self, k: Kernel, dstate: usize) -> bool {
        self.smem_bytes(k, dstate) <= self.smem_limit(k)
    }

    /// How many blocks of `k` one SM holds at a time at its shared memory for dstate 128 (the
    /// driver's occupancy at its block size, registers and dynamic shared memory, asked once
    /// when the kernels are loaded); 0 where that does not fit or the driver cannot say. Exact
    /// for kernels whose shared memory does not grow with dstate, such as the walking stage 2's.
    pub(crate) fn resident_blocks(&self, k: Kernel) -> usize {
        self.resident[k as usize]
    }

    /// Enqueues `k` over `grid` with its block size and its dynamic shared memory at `dstate`,
    /// passing `params` by value as its one argument.
    ///
    /// # Safety
    /// `params` must be `k`'s parameter struct, every address in it valid for what the kernel
    /// reads and writes over `grid` (the kernel's documented coverage), and the shapes within
    /// the kernel's limits.
    pub(crate) unsafe fn launch<P: DeviceRepr>(
        &self,
        k: Kernel,
        grid: (u32, u32, u32),
        dstate: usize,
        params: &P,
    ) -> Result<(), GpuError> {
        if std::mem::size_of::<P>() != k.params_bytes() {
            return Err(GpuError::Internal(format!(
                "{}: launched with a parameter struct of the wrong size",
                k.name()
            )));
        }
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (k.threads(), 1, 1),
            shared_mem_bytes: self.smem_bytes(k, dstate) as u32,
        };
        let failed = |pending: bool| {
            move |source: DriverError| GpuError::Launch {
                kernel: k.name(),
                pending,
                source,
            }
        };
        self.stream.context().check_err().map_err(failed(true))?;
        let mut launch = self.stream.launch_builder(self.function(k));
        launch.arg(params);
        // SAFETY: the caller's contract; the struct's size was checked against the kernel's
        // (at load, against the module's layout), and the opt-in shared memory was raised at
        // load for every kernel with dynamic shared memory.
        unsafe { launch.launch(cfg) }.map_err(failed(false))?;
        Ok(())
    }

    /// The stream every operation of this `Gpu` is enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The NVRTC target the kernels were compiled for (`sm_90a` on the H200).
    pub fn target(&self) -> &'static str {
        self.target
    }

    /// The device's name as the driver reports it.
    pub fn device_name(&self) -> &str {
        &self.name
    }

    /// Registers and local memory (spills) per thread of each kernel of [`Kernel::ALL`], and
    /// how many of its blocks fit one SM at its block size and dynamic shared memory (the
    /// largest, for the kernels whose shared memory grows with `dstate`: dstate 256):
    /// `(name, registers, local bytes, blocks per SM)`. For benchmarks and profiles.
    ///
    /// # Errors
    /// [`GpuError::Driver`] when the driver cannot answer.
    pub fn kernel_resources(&self) -> Result<Vec<(&'static str, i32, i32, u32)>, GpuError> {
        Kernel::ALL
            .into_iter()
            .map(|k| {
                let f = self.function(k);
                let smem = self.smem_bytes(k, 256);
                Ok((
                    k.name(),
                    f.num_regs()?,
                    f.local_size_bytes()?,
                    if smem <= self.smem_limit(k) {
                        f.occupancy_max_active_blocks_per_multiprocessor(k.threads(), smem, None)?
                    } else {
                        0 // never launched on this device
                    },
                ))
            })
            .collect()
    }

    /// Whether the kernels over pairs of units serve `dims` with `options` on this device
    /// (see `docs/gpu.md`): `(2a, output kernel)`.
    pub fn uses_pair_kernels(&self, dims: &Dims, options: &Options) -> (bool, bool) {
        if self.legacy {
            return (false, false);
        }
        let state = self.state_local_variant(dims) == Kernel::ChunkStateLocalPair;
        // The output kernels that read the scores scratch run only where it is allocated.
        let out = self.pairs
            && shape::scores_len(dims, options).is_some()
            && shape::compute_out_pairs(dims, shape::score_tiles(dims, options));
        (state, out)
    }

    /// Whether stage 3 of bf16 activations runs on the Hopper output kernel
    /// (`ssd_compute_out_wg_bf16`: TMA copies, `wgmma` products, the scores computed in the same
    /// kernel) rather than on 3a and the pair kernel: in [`Variant::V3`] (the default, unless
    /// [`GpuConfig::no_wg_out`]) on a Hopper device (`sm_90a`), where the bf16 kernels serve
    /// ([`Gpu::runs_bf16`]) and the shape is one it serves: headdim 64, dstate 128 with chunks of
    /// 128 or 256 tokens (or, with [`GpuConfig::wg_out_n256`], dstate 256 with chunks of 128:
    /// `ssd_compute_out_wg_bf16_n256`), no `seq_idx` (`seq_idx`: whether the problem has one), an
    /// even number of heads per group.
    pub fn runs_wg_out(&self, dims: &Dims, options: &Options, seq_idx: bool) -> bool {
        let q = options.chunk_size;
        let sized = match dims.dstate {
            128 => q == 128 || q == 256,
            256 => self.config.wg_out_n256 && q == 128,
            _ => false,
        };
        self.config.variant == Variant::V3
            && !self.config.no_wg_out
            && self.target == "sm_90a"
            && !seq_idx
            && dims.headdim == 64
            && sized
            && dims.ngroups > 0
            && (dims.nheads / dims.ngroups).is_multiple_of(2)
            && dims
                .batch
                .checked_mul(dims.nchunks(q))
                .and_then(|v| v.checked_mul(dims.nheads))
                .is_some_and(|v| v <= i32::MAX as usize)
            && dims
                .seqlen
                .checked_add(q)
                .is_some_and(|v| v <= i32::MAX as usize)
            && self.fits(Kernel::wg_out(dims.dstate), dims.dstate)
            && self.runs_bf16(dims, options)
    }

    /// Whether bf16 activations run on the bf16 kernels for `dims` with `options` (else
    /// [`Gpu::forward_into`] runs them through widened f32 copies, see `docs/gpu.md`): see
    /// [`Gpu::check_bf16`].
    pub fn runs_bf16(&self, dims: &Dims, options: &Options) -> bool {
        self.check_bf16(dims, options).is_ok()
    }

    /// Why the bf16 kernels do not serve `dims` with `options`, if they do not: they are
    /// version 2's kernels over pairs of units (in [`Variant::V3`], the default, and
    /// [`Variant::V2`], where they fit this device), so they ask what those ask (an even number of 64-column units per group, chunks
    /// of 65 to 512 tokens, every offset within 32 bits), `headdim` and `dstate` multiples of 8
    /// (16-byte rows of bf16), and a 2a grid within `i32`.
    ///
    /// # Errors
    /// [`GpuError::Unsupported`] saying which condition fails.
    pub fn check_bf16(&self, dims: &Dims, options: &Options) -> Result<(), GpuError> {
        let why = if !self.pairs {
            "they run only in the kernel variants with the pair kernels (Variant::V3, the default, and Variant::V2), where those fit the device"
        } else if !(dims.headdim.is_multiple_of(8) && dims.dstate.is_multiple_of(8)) {
            "headdim and dstate must be multiples of 8"
        } else if shape::scores_len(dims, options).is_none()
            || !shape::compute_out_pairs(dims, shape::score_tiles(dims, options))
        {
            "the output kernel over pairs of units does not serve this shape (it needs chunks of 65 to 512 tokens and an even number of 64-column units per group)"
        } else if !self.fits(Kernel::ChunkStateLocalPairBf16, dims.dstate)
            || !self.fits(Kernel::ComputeOutPairBf16, dims.dstate)
        {
            "their shared memory does not fit this device"
        } else if dims
            .nchunks(options.chunk_size)
            .checked_mul(dims.dstate.div_ceil(128))
            .and_then(|g| g.checked_mul(dims.nheads * dims.headdim.div_ceil(64) / 2))
            .is_none_or(|g| g > i32::MAX as usize)
        {
            "the chunk-state grid would overflow"
        } else {
            return Ok(());
        };
        Err(unsupported(format!(
            "the bf16 kernels do not serve this problem: {why}"
        )))
    }

    /// Waits until everything enqueued so far has finished.
    ///
    /// # Errors
    /// [`GpuError::Driver`] for a fault reported by an earlier kernel.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        Ok(self.stream.synchronize()?)
    }

    /// Checks the shape against the kernels and this device's shared memory.
    pub(crate) fn check(&self, dims: &Dims, options: &Options) -> Result<Lengths, GpuError> {
        let lengths = shape::check(dims, options)?;
        let smem = self.smem_bytes(Kernel::ComputeOut, dims.dstate);
        let limit = self.smem_limit(Kernel::ComputeOut);
        if smem > limit {
            return Err(unsupported(format!(
                "dstate {} needs {smem} bytes of shared memory per block; this device allows {limit}",
                dims.dstate
            )));
        }
        Ok(lengths)
    }

    /// Allocates uninitialised outputs for a problem of these sizes, `out` in `T` (f32 or
    /// [`crate::Bf16`], as the inputs' activations).
    ///
    /// # Errors
    /// [`GpuError::Unsupported`] (see [`crate::check_shape`]), [`GpuError::OutOfMemory`].
    pub fn alloc_outputs<T: IoElement>(
        &self,
        dims: &Dims,
        options: &Options,
    ) -> Result<DeviceOutputs<T>, GpuError> {
        let l = self.check(dims, options)?;
        // SAFETY: every element of every output is written by the kernels before it is read
        // (the kernels' documented coverage); nothing reads them before `forward_into`.
        let alloc = |n: usize| unsafe { self.stream.alloc::<f32>(n) };
        Ok(DeviceOutputs {
            dims: *dims,
            options: *options,
            // SAFETY: as above.
            out: unsafe { self.stream.alloc::<T>(l.x) }?,
            final_states: alloc(l.states)?,
            dA_cumsum: alloc(l.cumsum)?,
            dt: alloc(l.cumsum)?,
            chunk_states: alloc(l.chunk_states)?,
            scores: match shape::scores_len(dims, options) {
                Some(n) if !self.legacy => Some(alloc(n)?),
                _ => None,
            },
            chain: match self.chain_len(dims, options) {
                // SAFETY: the chained kernel's scratch is cleared on the stream before each use.
                Some(n) => Some(unsafe { self.stream.alloc::<i32>(n) }?),
                None => None,
            },
            // SAFETY: written by stage 2 (every chunk's state, as `chunk_states`) before the
            // output kernel reads it.
            states_lo: if T::BF16 && self.runs_bf16(dims, options) {
                Some(unsafe { self.stream.alloc::<Bf16>(l.chunk_states) }?)
            } else {
                None
            },
            keep_chunk_states: true,
        })
    }

    /// Runs the three stages in order on device-resident inputs, into `outputs`
    /// (allocated with [`Gpu::alloc_outputs`] for the same sizes). Enqueued only: synchronise
    /// (or download) before reading. With bf16 activations, where [`Gpu::runs_bf16`] is false,
    /// through widened f32 copies (`crate::io`).
    ///
    /// # Errors
    /// [`GpuError::Unsupported`] when the buffers do not match the sizes, driver errors.
    pub fn forward_into<T: IoElement>(
        &self,
        inputs: &DeviceInputs<T>,
        outputs: &mut DeviceOutputs<T>,
    ) -> Result<(), GpuError> {
        if T::BF16 && !self.runs_bf16(&inputs.dims, &inputs.options) {
            self.check_buffers(inputs, outputs)?;
            return self.forward_widened(inputs, outputs);
        }
        self.chunk_cumsum(inputs, outputs)?;
        self.fwd_pass_state(inputs, outputs)?;
        self.compute_out(inputs, outputs)
    }

    /// [`Gpu::forward_into`] into freshly allocated outputs.
    ///
    /// # Errors
    /// As [`Gpu::alloc_outputs`] and [`Gpu::forward_into`].
    pub fn forward_device<T: IoElement>(
        &self,
        inputs: &DeviceInputs<T>,
    ) -> Result<DeviceOutputs<T>, GpuError> {
        let mut outputs = self.alloc_outputs(&inputs.dims, &inputs.options)?;
        self.forward_into(inputs, &mut outputs)?;
        Ok(outputs)
    }

    /// Checks that `inputs` and `outputs` agree with each other and with their sizes.
    pub(crate) fn check_buffers<T: IoElement>(
        &self,
        inputs: &DeviceInputs<T>,
        outputs: &DeviceOutputs<T>,
    ) -> Result<Lengths, GpuError> {
        if inputs.dims != outputs.dims || inputs.options != outputs.options {
            return Err(unsupported(
                "outputs were allocated for other sizes or options than the inputs",
            ));
        }
        let l = self.check(&inputs.dims, &inputs.options)?;
        let d = &inputs.dims;
        let want = |name: &str, got: usize, n: usize| -> Result<(), GpuError> {
            if got != n {
                return Err(unsupported(format!(
                    "device buffer `{name}` holds {got} elements, the sizes need {n}"
                )));
            }
            Ok(())
        };
        want("x", inputs.x.len(), l.x)?;
        want("dt", inputs.dt.len(), l.dt)?;
        want("A", inputs.A.len(), d.nheads)?;
        want("B", inputs.B.len(), l.bc)?;
        want("C", inputs.C.len(), l.bc)?;
        if let Some(dd) = &inputs.D {
            if dd.len() != d.nheads && dd.len() != d.nheads * d.headdim {
                return Err(unsupported(format!(
                    "device buffer `D` holds {} elements, expected nheads ({}) or nheads * headdim ({})",
                    dd.len(),
                    d.nheads,
                    d.nheads * d.headdim
                )));
            }
        }
        if let Some(z) = &inputs.z {
            want("z", z.len(), l.x)?;
        }
        if let Some(bias) = &inputs.dt_bias {
            want("dt_bias", bias.len(), d.nheads)?;
        }
        if let Some(s) = &inputs.initial_states {
            want("initial_states", s.len(), l.states)?;
        }
        if let Some(s) = &inputs.seq_idx {
            want("seq_idx", s.len(), l.seq_idx)?;
        }
        want("out", outputs.out.len(), l.x)?;
        want("final_states", outputs.final_states.len(), l.states)?;
        want("dA_cumsum", outputs.dA_cumsum.len(), l.cumsum)?;
        want("dt (processed)", outputs.dt.len(), l.cumsum)?;
        want("chunk_states", outputs.chunk_states.len(), l.chunk_states)?;
        Ok(l)
    }
}

/// Inputs of one problem in device memory, row-major, in the contract's names and layouts
/// (see `docs/gpu.md`). Build one with [`Gpu::upload`] (f32) or [`Gpu::upload_bf16`], or from
/// your own device buffers. `T` is the type of the activations `x`, `B`, `C`, `z` (f32 or
/// [`crate::Bf16`]); the rest is f32.
///
/// The kernels trust the values: `A <= 0`, every value finite, `seq_idx` non-negative and
/// non-decreasing along each row (as `i32`; [`crate::seq_idx_to_i32`] converts the contract's
/// `i64`). Lengths are checked against `dims` at every launch.
#[allow(non_snake_case)]
#[derive(Debug)]
pub struct DeviceInputs<T: IoElement = f32> {
    pub dims: Dims,
    pub options: Options,
    /// `[batch, seqlen, nheads, headdim]`
    pub x: CudaSlice<T>,
    /// `[batch, seqlen, nheads]` (raw: bias, softplus and clamp are applied by `chunk_cumsum`)
    pub dt: CudaSlice<f32>,
    /// `[nheads]`
    pub A: CudaSlice<f32>,
    /// `[batch, seqlen, ngroups, dstate]`
    pub B: CudaSlice<T>,
    /// `[batch, seqlen, ngroups, dstate]`
    pub C: CudaSlice<T>,
    /// `[nheads]` (per head) or `[nheads, headdim]` (per channel), told apart by length.
    pub D: Option<CudaSlice<f32>>,
    /// `[batch, seqlen, nheads, headdim]`
    pub z: Option<CudaSlice<T>>,
    /// `[nheads]`
    pub dt_bias: Option<CudaSlice<f32>>,
    /// `[batch, nheads, headdim, dstate]`
    pub initial_states: Option<CudaSlice<f32>>,
    /// `[batch, seqlen]`
    pub seq_idx: Option<CudaSlice<i32>>,
}

/// Outputs and intermediates of one problem in device memory: `out` in `T` (the inputs'
/// activation type), the rest f32.
#[allow(non_snake_case)]
#[derive(Debug)]
pub struct DeviceOutputs<T: IoElement = f32> {
    pub(crate) dims: Dims,
    pub(crate) options: Options,
    /// `[batch, seqlen, nheads, headdim]`
    pub out: CudaSlice<T>,
    /// `[batch, nheads, headdim, dstate]`
    pub final_states: CudaSlice<f32>,
    /// `[batch, nheads, nchunks, chunk_size]`
    pub dA_cumsum: CudaSlice<f32>,
    /// The processed `dt' = clamp(softplus?(dt + dt_bias))`, `[batch, nheads, nchunks,
    /// chunk_size]`, 0 past `seqlen`.
    pub dt: CudaSlice<f32>,
    /// `[batch, nchunks, nheads, headdim, dstate]`: the state entering each chunk.
    pub chunk_states: CudaSlice<f32>,
    /// Scratch of the fast output path: the scores `C B^T` per (batch, chunk, group, pair of
    /// 64-row tiles on or below the diagonal), `[batch, nchunks, ngroups, npairs, 64, 64]`;
    /// `None` where that path does not apply ([`shape::scores_len`]).
    pub(crate) scores: Option<CudaSlice<f32>>,
    /// Scratch of the chained kernel: its ticket counter and one flag per (batch, pair of
    /// units, chunk); `None` where it does not serve ([`Gpu::uses_chained`]).
    pub(crate) chain: Option<CudaSlice<i32>>,
    /// Scratch of the bf16 kernels: `chunk_states` rounded to bf16 (to nearest even), written
    /// by stage 2 beside it and read by the output kernel, whose product takes the state as a
    /// bf16 operand; `None` for f32 outputs and where the bf16 kernels do not serve
    /// ([`Gpu::runs_bf16`]).
    pub(crate) states_lo: Option<CudaSlice<Bf16>>,
    /// Whether the forward must write `chunk_states` ([`DeviceOutputs::set_keep_chunk_states`]).
    pub(crate) keep_chunk_states: bool,
}

impl<T: IoElement> DeviceOutputs<T> {
    /// Checks that bf16 outputs hold the bf16 copy of the states that the bf16 kernels write
    /// and read (`states_lo`), for these sizes.
    pub(crate) fn check_states_lo(&self) -> Result<(), GpuError> {
        if T::BF16
            && self
                .states_lo
                .as_ref()
                .is_none_or(|s| s.len() != self.chunk_states.len())
        {
            return Err(unsupported(
                "the outputs were allocated by a Gpu that does not run the bf16 kernels for these sizes: they hold no bf16 copy of the states (allocate them with this Gpu)",
            ));
        }
        Ok(())
    }

    /// Whether the forward writes `chunk_states` into these outputs: `true` (the default of
    /// [`Gpu::alloc_outputs`]) or `false`, where the caller needs `out` and `final_states`
    /// only. With `false`, `chunk_states` holds unspecified values after a forward wherever a
    /// kernel does not need it as its own scratch: with bf16 activations stage 2 then writes
    /// only the states' bf16 copy that the output kernel reads (the chained kernel: 0.65 GB
    /// fewer DRAM writes at (8, 8192, 80, 64, 128), 4% of its time, measured on an H200; the
    /// pass 2b: `chunk_states` keeps 2a's own states, 1.07 GB fewer writes at (4, 65536, 8,
    /// 64, 256), where stage 2 went from 1.24 to 0.93 ms on an H200). Every other output and
    /// intermediate (`out`, `final_states`, `dA_cumsum`, `dt`) holds the same
    /// bits either way, and so does `chunk_states` with f32 activations, whose output kernel
    /// reads it.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), ssd_gpu::GpuError> {
    /// use ssd_gpu::{Bf16, Gpu};
    /// use ssd_reference::random::{random_problem, ProblemSpec};
    /// use ssd_reference::Dims;
    ///
    /// let gpu = Gpu::new(0)?;
    /// let spec = ProblemSpec::plain(Dims::new(2, 1024, 8, 64, 1, 128));
    /// let problem = random_problem(&spec, 1).expect("a valid spec").cast::<f32>();
    /// let inputs = gpu.upload_bf16(&problem)?;
    /// let mut outputs = gpu.alloc_outputs::<Bf16>(&inputs.dims, &inputs.options)?;
    /// outputs.set_keep_chunk_states(false); // out and final_states only
    /// gpu.forward_into(&inputs, &mut outputs)?;
    /// let final_states: Vec<f32> = gpu.stream().clone_dtoh(&outputs.final_states)?;
    /// # let _ = final_states;
    /// # Ok(())
    /// # }
    /// ```
    pub fn set_keep_chunk_states(&mut self, keep: bool) {
        self.keep_chunk_states = keep;
    }

    /// Whether the forward writes `chunk_states` (see [`DeviceOutputs::set_keep_chunk_states`]).
    pub fn keeps_chunk_states(&self) -> bool {
        self.keep_chunk_states
    }

    /// The sizes these outputs were allocated for.
    pub fn dims(&self) -> &Dims {
        &self.dims
    }

    /// The options these outputs were allocated for.
    pub fn options(&self) -> &Options {
        &self.options
    }
}

/// Raw device addresses of the buffers of one launch, for its parameter struct. Holds the
/// buffers' guards (which record the launch's reads and writes on the stream) until it is
/// dropped: keep it alive until the launch has been enqueued.
pub(crate) struct Args<'a> {
    stream: &'a CudaStream,
    guards: Vec<SyncOnDrop<'a>>,
}

impl<'a> Args<'a> {
    pub(crate) fn new(stream: &'a CudaStream) -> Self {
        Args {
            stream,
            guards: Vec::with_capacity(12),
        }
    }

    /// The address of a buffer the kernel reads.
    pub(crate) fn read<T>(&mut self, s: &'a CudaSlice<T>) -> u64 {
        let (p, guard) = s.device_ptr(self.stream);
        self.guards.push(guard);
        p
    }

    /// The address of an optional buffer the kernel reads, 0 (null) when absent.
    pub(crate) fn opt<T>(&mut self, s: Option<&'a CudaSlice<T>>) -> u64 {
        s.map_or(0, |s| self.read(s))
    }

    /// The address of a buffer the kernel writes.
    pub(crate) fn write<T>(&mut self, s: &'a mut CudaSlice<T>) -> u64 {
        let (p, guard) = s.device_ptr_mut(self.stream);
        self.guards.push(guard);
        p
    }
}

/// Converts a size already checked by [`shape::check`] to a kernel's `int` argument.
pub(crate) fn int(v: usize) -> i32 {
    i32::try_from(v).unwrap_or(i32::MAX)
}
