//! [`Gpu`]: one CUDA device with the SSD kernels loaded, and the device-resident buffers.

use std::sync::Arc;

use cudarc::driver::{
    sys::{CUdevice_attribute, CUfunction_attribute},
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr,
};
use ssd_reference::{Dims, Options};

use crate::error::unsupported;
use crate::shape::{self, Lengths};
use crate::{kernels, GpuError};

/// One CUDA device, a stream on it and the three SSD kernels, compiled and loaded.
///
/// Every operation is enqueued on [`Gpu::stream`]; results are ready once the stream is
/// synchronised (the `download`/`forward` helpers do that).
#[derive(Debug)]
pub struct Gpu {
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) chunk_cumsum_fn: CudaFunction,
    pub(crate) chunk_cumsum_tiled_fn: CudaFunction,
    pub(crate) fwd_pass_state_fn: CudaFunction,
    pub(crate) compute_out_fn: CudaFunction,
    pub(crate) chunk_state_local_fn: CudaFunction,
    pub(crate) chunk_state_local_wide_fn: CudaFunction,
    pub(crate) state_passing_fn: CudaFunction,
    pub(crate) chunk_cb_fn: CudaFunction,
    pub(crate) compute_out_cb_fn: CudaFunction,
    pub(crate) compute_out_cb128_fn: CudaFunction,
    pub(crate) compute_out_pair_fn: CudaFunction,
    pub(crate) chunk_state_local_pair_fn: CudaFunction,
    /// Whether the kernels over pairs of units (2a and the output kernel) may be used: their
    /// shared memory fits this device, and `SSD_GPU_PAIR=0` was not set at [`Gpu::new`] (that
    /// keeps `ssd_chunk_state_local_wide` and `ssd_compute_out_cb128` everywhere, for
    /// comparison).
    pub(crate) pairs: bool,
    /// True when `SSD_GPU_V1=1` at [`Gpu::new`]: version 1 of the kernels (the fused sequential
    /// state pass and the output kernel that computes its own scores), kept selectable for
    /// comparison. Version 2, the default, was validated on the H200 like version 1.
    pub(crate) legacy: bool,
    target: &'static str,
    name: String,
    /// Dynamic shared memory a block may opt in to on this device, in bytes.
    pub(crate) max_smem_optin: usize,
}

/// Whether the CUDA driver library can be loaded at all.
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the shared library; nothing is called through it.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

impl Gpu {
    /// Opens device `ordinal`, compiles the kernels for it (once per process and target) and
    /// loads them.
    ///
    /// # Errors
    /// [`GpuError::NoDriver`] when `libcuda` or `libnvrtc` cannot be loaded,
    /// [`GpuError::NoDevice`] when there is no such device or it is older than compute
    /// capability 8.0, [`GpuError::Compile`] with NVRTC's log, [`GpuError::Driver`] otherwise.
    pub fn new(ordinal: usize) -> Result<Self, GpuError> {
        if !driver_present() {
            return Err(GpuError::NoDriver(
                "the CUDA driver library (libcuda) cannot be loaded".into(),
            ));
        }
        // cudarc panics when a driver symbol is missing; turn that into an error too.
        std::panic::catch_unwind(|| Self::open(ordinal)).unwrap_or_else(|_| {
            Err(GpuError::NoDriver(
                "the CUDA driver library could not be used (missing symbol or failed initialisation)".into(),
            ))
        })
    }

    fn open(ordinal: usize) -> Result<Self, GpuError> {
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
        let chunk_cumsum_fn = module.load_function(kernels::CHUNK_CUMSUM)?;
        let chunk_cumsum_tiled_fn = module.load_function(kernels::CHUNK_CUMSUM_TILED)?;
        let fwd_pass_state_fn = module.load_function(kernels::FWD_PASS_STATE)?;
        let compute_out_fn = module.load_function(kernels::COMPUTE_OUT)?;
        let chunk_state_local_fn = module.load_function(kernels::CHUNK_STATE_LOCAL)?;
        let chunk_state_local_wide_fn = module.load_function(kernels::CHUNK_STATE_LOCAL_WIDE)?;
        let state_passing_fn = module.load_function(kernels::STATE_PASSING)?;
        let chunk_cb_fn = module.load_function(kernels::CHUNK_CB)?;
        let compute_out_cb_fn = module.load_function(kernels::COMPUTE_OUT_CB)?;
        let compute_out_cb128_fn = module.load_function(kernels::COMPUTE_OUT_CB128)?;
        let compute_out_pair_fn = module.load_function(kernels::COMPUTE_OUT_PAIR)?;
        let chunk_state_local_pair_fn = module.load_function(kernels::CHUNK_STATE_LOCAL_PAIR)?;
        let max_smem_optin = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
            as usize;
        for f in [
            &compute_out_fn,
            &chunk_cb_fn,
            &compute_out_cb_fn,
            &compute_out_cb128_fn,
            &compute_out_pair_fn,
            &chunk_state_local_pair_fn,
            &chunk_state_local_fn,
            &chunk_state_local_wide_fn,
        ] {
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                max_smem_optin as i32,
            )?;
        }
        let legacy = std::env::var("SSD_GPU_V1").is_ok_and(|v| v == "1");
        let pairs = max_smem_optin
            >= shape::COMPUTE_OUT_PAIR_SMEM_BYTES.max(shape::CHUNK_STATE_LOCAL_PAIR_SMEM_BYTES)
            && !std::env::var("SSD_GPU_PAIR").is_ok_and(|v| v == "0");
        let name = ctx.name().unwrap_or_else(|_| "unknown".into());
        // The context's default stream: no cross-stream event bookkeeping on every launch.
        let stream = ctx.default_stream();
        Ok(Gpu {
            stream,
            chunk_cumsum_fn,
            chunk_cumsum_tiled_fn,
            fwd_pass_state_fn,
            compute_out_fn,
            chunk_state_local_fn,
            chunk_state_local_wide_fn,
            state_passing_fn,
            chunk_cb_fn,
            compute_out_cb_fn,
            compute_out_cb128_fn,
            compute_out_pair_fn,
            chunk_state_local_pair_fn,
            pairs,
            legacy,
            target,
            name,
            max_smem_optin,
        })
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

    /// Registers and local memory (spills) per thread of each kernel, and how many of its
    /// blocks fit one SM at the block size and dynamic shared memory the host launches it
    /// with (the largest, for the kernels whose shared memory grows with `dstate`: dstate 256):
    /// `(name, registers, local bytes, blocks per SM)`. For benchmarks and profiles.
    ///
    /// # Errors
    /// [`GpuError::Driver`] when the driver cannot answer.
    pub fn kernel_resources(&self) -> Result<Vec<(&'static str, i32, i32, u32)>, GpuError> {
        let kernels = [
            (kernels::CHUNK_CUMSUM, &self.chunk_cumsum_fn, 128, 0),
            (
                kernels::CHUNK_CUMSUM_TILED,
                &self.chunk_cumsum_tiled_fn,
                256,
                0,
            ),
            (
                kernels::CHUNK_STATE_LOCAL,
                &self.chunk_state_local_fn,
                128,
                shape::CHUNK_STATE_LOCAL_SMEM_BYTES,
            ),
            (
                kernels::CHUNK_STATE_LOCAL_WIDE,
                &self.chunk_state_local_wide_fn,
                256,
                shape::CHUNK_STATE_LOCAL_WIDE_SMEM_BYTES,
            ),
            (
                kernels::CHUNK_STATE_LOCAL_PAIR,
                &self.chunk_state_local_pair_fn,
                256,
                shape::CHUNK_STATE_LOCAL_PAIR_SMEM_BYTES,
            ),
            (kernels::STATE_PASSING, &self.state_passing_fn, 256, 0),
            (
                kernels::CHUNK_CB,
                &self.chunk_cb_fn,
                128,
                shape::CHUNK_CB_SMEM_BYTES,
            ),
            (
                kernels::COMPUTE_OUT_CB,
                &self.compute_out_cb_fn,
                128,
                shape::compute_out_cb_smem_bytes(64),
            ),
            (
                kernels::COMPUTE_OUT_CB128,
                &self.compute_out_cb128_fn,
                256,
                shape::compute_out_cb_smem_bytes(128),
            ),
            (
                kernels::COMPUTE_OUT_PAIR,
                &self.compute_out_pair_fn,
                256,
                shape::COMPUTE_OUT_PAIR_SMEM_BYTES,
            ),
            (kernels::FWD_PASS_STATE, &self.fwd_pass_state_fn, 128, 0),
            (
                kernels::COMPUTE_OUT,
                &self.compute_out_fn,
                128,
                shape::compute_out_smem_bytes(256),
            ),
        ];
        kernels
            .into_iter()
            .map(|(name, f, threads, smem)| {
                Ok((
                    name,
                    f.num_regs()?,
                    f.local_size_bytes()?,
                    if smem <= self.max_smem_optin {
                        f.occupancy_max_active_blocks_per_multiprocessor(threads, smem, None)?
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
        let state = shape::state_local_variant(dims, self.pairs, self.max_smem_optin)
            == shape::StateLocal::Pair;
        // The output kernels that read the scores scratch run only where it is allocated.
        let out = self.pairs
            && shape::scores_len(dims, options).is_some()
            && shape::compute_out_pairs(dims, shape::score_tiles(dims, options));
        (state, out)
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
        let smem = shape::compute_out_smem_bytes(dims.dstate);
        if smem > self.max_smem_optin {
            return Err(unsupported(format!(
                "dstate {} needs {smem} bytes of shared memory per block; this device allows {}",
                dims.dstate, self.max_smem_optin
            )));
        }
        Ok(lengths)
    }

    /// Allocates uninitialised outputs for a problem of these sizes.
    ///
    /// # Errors
    /// [`GpuError::Unsupported`] (see [`crate::check_shape`]), [`GpuError::OutOfMemory`].
    pub fn alloc_outputs(&self, dims: &Dims, options: &Options) -> Result<DeviceOutputs, GpuError> {
        let l = self.check(dims, options)?;
        // SAFETY: every element of every output is written by the kernels before it is read
        // (the kernels' documented coverage); nothing reads them before `forward_into`.
        let alloc = |n: usize| unsafe { self.stream.alloc::<f32>(n) };
        Ok(DeviceOutputs {
            dims: *dims,
            options: *options,
            out: alloc(l.x)?,
            final_states: alloc(l.states)?,
            dA_cumsum: alloc(l.cumsum)?,
            dt: alloc(l.cumsum)?,
            chunk_states: alloc(l.chunk_states)?,
            scores: match shape::scores_len(dims, options) {
                Some(n) if !self.legacy => Some(alloc(n)?),
                _ => None,
            },
        })
    }

    /// Runs the three stages in order on device-resident inputs, into `outputs`
    /// (allocated with [`Gpu::alloc_outputs`] for the same sizes). Enqueued only: synchronise
    /// (or download) before reading.
    ///
    /// # Errors
    /// [`GpuError::Unsupported`] when the buffers do not match the sizes, driver errors.
    pub fn forward_into(
        &self,
        inputs: &DeviceInputs,
        outputs: &mut DeviceOutputs,
    ) -> Result<(), GpuError> {
        self.chunk_cumsum(inputs, outputs)?;
        self.fwd_pass_state(inputs, outputs)?;
        self.compute_out(inputs, outputs)
    }

    /// [`Gpu::forward_into`] into freshly allocated outputs.
    ///
    /// # Errors
    /// As [`Gpu::alloc_outputs`] and [`Gpu::forward_into`].
    pub fn forward_device(&self, inputs: &DeviceInputs) -> Result<DeviceOutputs, GpuError> {
        let mut outputs = self.alloc_outputs(&inputs.dims, &inputs.options)?;
        self.forward_into(inputs, &mut outputs)?;
        Ok(outputs)
    }

    /// Checks that `inputs` and `outputs` agree with each other and with their sizes.
    pub(crate) fn check_buffers(
        &self,
        inputs: &DeviceInputs,
        outputs: &DeviceOutputs,
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
/// (see `docs/gpu.md`). Build one with [`Gpu::upload`], or from your own device buffers.
///
/// The kernels trust the values: `A <= 0`, every value finite, `seq_idx` non-negative and
/// non-decreasing along each row (as `i32`; [`crate::seq_idx_to_i32`] converts the contract's
/// `i64`). Lengths are checked against `dims` at every launch.
#[allow(non_snake_case)]
#[derive(Debug)]
pub struct DeviceInputs {
    pub dims: Dims,
    pub options: Options,
    /// `[batch, seqlen, nheads, headdim]`
    pub x: CudaSlice<f32>,
    /// `[batch, seqlen, nheads]` (raw: bias, softplus and clamp are applied by `chunk_cumsum`)
    pub dt: CudaSlice<f32>,
    /// `[nheads]`
    pub A: CudaSlice<f32>,
    /// `[batch, seqlen, ngroups, dstate]`
    pub B: CudaSlice<f32>,
    /// `[batch, seqlen, ngroups, dstate]`
    pub C: CudaSlice<f32>,
    /// `[nheads]` (per head) or `[nheads, headdim]` (per channel), told apart by length.
    pub D: Option<CudaSlice<f32>>,
    /// `[batch, seqlen, nheads, headdim]`
    pub z: Option<CudaSlice<f32>>,
    /// `[nheads]`
    pub dt_bias: Option<CudaSlice<f32>>,
    /// `[batch, nheads, headdim, dstate]`
    pub initial_states: Option<CudaSlice<f32>>,
    /// `[batch, seqlen]`
    pub seq_idx: Option<CudaSlice<i32>>,
}

/// Outputs and intermediates of one problem in device memory.
#[allow(non_snake_case)]
#[derive(Debug)]
pub struct DeviceOutputs {
    pub(crate) dims: Dims,
    pub(crate) options: Options,
    /// `[batch, seqlen, nheads, headdim]`
    pub out: CudaSlice<f32>,
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
}

impl DeviceOutputs {
    /// The sizes these outputs were allocated for.
    pub fn dims(&self) -> &Dims {
        &self.dims
    }

    /// The options these outputs were allocated for.
    pub fn options(&self) -> &Options {
        &self.options
    }
}

/// Raw device address of an optional buffer (null when absent), for kernel arguments.
/// The returned guard must live until the launch has been enqueued.
pub(crate) fn opt_ptr<'a, T>(
    s: Option<&'a CudaSlice<T>>,
    stream: &'a CudaStream,
) -> (u64, Option<cudarc::driver::SyncOnDrop<'a>>) {
    match s {
        Some(s) => {
            let (p, guard) = s.device_ptr(stream);
            (p, Some(guard))
        }
        None => (0, None),
    }
}

/// Converts a size already checked by [`shape::check`] to a kernel's `int` argument.
pub(crate) fn int(v: usize) -> i32 {
    i32::try_from(v).unwrap_or(i32::MAX)
}
