//! Host-side convenience: a [`Problem<f32>`] in, ndarray outputs back.

use std::borrow::Cow;
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaSlice;
use ndarray::{Array, Dimension};
use ssd_reference::{ChunkedOutput, Problem};

use crate::shape::seq_idx_to_i32;
use crate::{Bf16, DeviceInputs, DeviceOutputs, Gpu, GpuConfig, GpuError, IoElement};

fn contiguous<D: Dimension>(a: &Array<f32, D>) -> Cow<'_, [f32]> {
    match a.as_slice() {
        Some(s) => Cow::Borrowed(s),
        None => Cow::Owned(a.iter().copied().collect()),
    }
}

impl Gpu {
    pub(crate) fn upload_array<D: Dimension>(
        &self,
        a: &Array<f32, D>,
    ) -> Result<CudaSlice<f32>, GpuError> {
        Ok(self.stream.clone_htod(contiguous(a).as_ref())?)
    }

    /// Copies a validated problem's inputs to the device (`seq_idx` converted with
    /// [`seq_idx_to_i32`]).
    ///
    /// # Errors
    /// [`GpuError::Unsupported`] for sizes the kernels do not support, [`GpuError::OutOfMemory`],
    /// driver errors.
    pub fn upload(&self, problem: &Problem<f32>) -> Result<DeviceInputs, GpuError> {
        self.upload_as(problem)
    }

    /// [`Gpu::upload`] with the activations `x`, `B`, `C`, `z` rounded to bf16 (to nearest
    /// even; exact where they hold bf16 values already), for the bf16 kernels.
    ///
    /// # Errors
    /// As [`Gpu::upload`].
    pub fn upload_bf16(&self, problem: &Problem<f32>) -> Result<DeviceInputs<Bf16>, GpuError> {
        self.upload_as(problem)
    }

    /// [`Gpu::upload`] with the activations in `T`.
    fn upload_as<T: IoElement>(&self, problem: &Problem<f32>) -> Result<DeviceInputs<T>, GpuError> {
        let dims = *problem.dims();
        let options = *problem.options();
        self.check(&dims, &options)?;
        let i = problem.inputs();
        let act = |a: &Array<f32, ndarray::Ix4>| -> Result<CudaSlice<T>, GpuError> {
            Ok(self
                .stream
                .clone_htod(T::from_f32_slice(&contiguous(a)).as_ref())?)
        };
        Ok(DeviceInputs {
            dims,
            options,
            x: act(&i.x)?,
            dt: self.upload_array(&i.dt)?,
            A: self.upload_array(&i.A)?,
            B: act(&i.B)?,
            C: act(&i.C)?,
            D: i.D.as_ref().map(|a| self.upload_array(a)).transpose()?,
            z: i.z.as_ref().map(act).transpose()?,
            dt_bias: i
                .dt_bias
                .as_ref()
                .map(|a| self.upload_array(a))
                .transpose()?,
            initial_states: i
                .initial_states
                .as_ref()
                .map(|a| self.upload_array(a))
                .transpose()?,
            seq_idx: match &i.seq_idx {
                None => None,
                Some(s) => {
                    let flat: Vec<i64> = s.iter().copied().collect();
                    Some(
                        self.stream
                            .clone_htod(&seq_idx_to_i32(&flat, dims.seqlen))?,
                    )
                }
            },
        })
    }

    /// Waits for the stream and copies the outputs back as ndarray arrays in the contract's
    /// shapes: `out` `[batch, seqlen, nheads, headdim]`, `final_states` `[batch, nheads,
    /// headdim, dstate]`, `dA_cumsum` `[batch, nheads, nchunks, chunk_size]`, `chunk_states`
    /// `[batch, nchunks, nheads, headdim, dstate]`.
    ///
    /// With bf16 activations `out` holds the bf16 values, widened (exactly) to f32.
    ///
    /// # Errors
    /// Driver errors, including faults of the kernels that produced the outputs;
    /// [`GpuError::Unsupported`] for outputs that do not keep `chunk_states`
    /// ([`DeviceOutputs::set_keep_chunk_states`]): read their fields instead.
    pub fn download<T: IoElement>(
        &self,
        outputs: &DeviceOutputs<T>,
    ) -> Result<ChunkedOutput<f32>, GpuError> {
        if !outputs.keeps_chunk_states() {
            return Err(GpuError::Unsupported(
                "these outputs do not keep chunk_states (set_keep_chunk_states(false)): copy `out` and `final_states` from their fields instead".into(),
            ));
        }
        let d = outputs.dims;
        let nchunks = d.nchunks(outputs.options.chunk_size);
        let q = outputs.options.chunk_size;
        let get =
            |s: &CudaSlice<f32>| -> Result<Vec<f32>, GpuError> { Ok(self.stream.clone_dtoh(s)?) };
        let out: Vec<T> = self.stream.clone_dtoh(&outputs.out)?;
        let out: Vec<f32> = out.into_iter().map(T::to_f32).collect();
        let final_states = get(&outputs.final_states)?;
        let da = get(&outputs.dA_cumsum)?;
        let cst = get(&outputs.chunk_states)?;
        self.synchronize()?;
        let shape_err = |e: ndarray::ShapeError| {
            GpuError::Internal(format!("downloaded buffer has the wrong length: {e}"))
        };
        Ok(ChunkedOutput {
            out: Array::from_shape_vec((d.batch, d.seqlen, d.nheads, d.headdim), out)
                .map_err(shape_err)?,
            final_states: Array::from_shape_vec(
                (d.batch, d.nheads, d.headdim, d.dstate),
                final_states,
            )
            .map_err(shape_err)?,
            dA_cumsum: Array::from_shape_vec((d.batch, d.nheads, nchunks, q), da)
                .map_err(shape_err)?,
            chunk_states: Array::from_shape_vec(
                (d.batch, nchunks, d.nheads, d.headdim, d.dstate),
                cst,
            )
            .map_err(shape_err)?,
        })
    }

    /// Uploads `problem`, runs the forward pass and downloads every output and intermediate.
    ///
    /// # Errors
    /// As [`Gpu::upload`], [`Gpu::forward_device`] and [`Gpu::download`].
    pub fn forward(&self, problem: &Problem<f32>) -> Result<ChunkedOutput<f32>, GpuError> {
        let inputs = self.upload(problem)?;
        let outputs = self.forward_device(&inputs)?;
        self.download(&outputs)
    }

    /// [`Gpu::forward`] with bf16 activations: `x`, `B`, `C`, `z` rounded to bf16 on upload,
    /// bf16 products with f32 accumulation, `out` computed in bf16 (returned widened to f32).
    /// Check it against the float64 reference of the problem with those inputs rounded, at
    /// `--precision bf16` (`docs/tolerances.md`).
    ///
    /// # Errors
    /// As [`Gpu::forward`].
    pub fn forward_bf16(&self, problem: &Problem<f32>) -> Result<ChunkedOutput<f32>, GpuError> {
        let inputs = self.upload_bf16(problem)?;
        let outputs = self.forward_device(&inputs)?;
        self.download(&outputs)
    }
}

/// The process-wide [`Gpu`] on device 0 with the default kernels, opened on first use and
/// kept: [`gpu_for`] of [`GpuConfig::default`].
///
/// # Errors
/// As [`Gpu::new`].
pub fn default_gpu() -> Result<Arc<Gpu>, GpuError> {
    gpu_for(GpuConfig::default())
}

/// The process-wide [`Gpu`] of `config`, opened on first use and kept (one per configuration,
/// so that one process can run every [`crate::Variant`]). A failure is not cached: the next
/// call tries again.
///
/// # Errors
/// As [`Gpu::with_config`].
pub fn gpu_for(config: GpuConfig) -> Result<Arc<Gpu>, GpuError> {
    static GPUS: Mutex<Vec<Arc<Gpu>>> = Mutex::new(Vec::new());
    let mut open = GPUS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(g) = open.iter().find(|g| g.config() == config) {
        return Ok(g.clone());
    }
    let g = Arc::new(Gpu::with_config(config)?);
    open.push(g.clone());
    Ok(g)
}

/// The SSD forward of `problem` on device 0, TF32 tensor-core products with f32 accumulation:
/// `out`, `final_states`, `dA_cumsum` and `chunk_states` as ndarray arrays (the same type the
/// CPU reference's chunked path returns).
///
/// # Errors
/// [`GpuError::NoDriver`] / [`GpuError::NoDevice`] without a usable GPU (the message says
/// "no CUDA driver" / "no CUDA device"), [`GpuError::Unsupported`] for sizes the kernels do
/// not support, [`GpuError::Compile`], [`GpuError::OutOfMemory`], [`GpuError::Driver`].
pub fn forward(problem: &Problem<f32>) -> Result<ChunkedOutput<f32>, GpuError> {
    default_gpu()?.forward(problem)
}

/// [`forward`] with bf16 activations ([`Gpu::forward_bf16`]): `x`, `B`, `C`, `z` and `out` in
/// bf16, bf16 tensor-core products with f32 accumulation; the states and intermediates f32.
///
/// # Errors
/// As [`forward`].
///
/// # Example
/// ```no_run
/// use ssd_reference::random::{random_problem, ProblemSpec};
/// use ssd_reference::Dims;
///
/// let p = random_problem(&ProblemSpec::plain(Dims::new(1, 512, 4, 64, 1, 128)), 1).unwrap();
/// let o = ssd_gpu::forward_bf16(&p.cast::<f32>())?;
/// // `out` holds bf16 values: the low 16 bits of each f32 are zero.
/// assert!(o.out.iter().all(|v| v.to_bits() & 0xffff == 0));
/// # Ok::<(), ssd_gpu::GpuError>(())
/// ```
pub fn forward_bf16(problem: &Problem<f32>) -> Result<ChunkedOutput<f32>, GpuError> {
    default_gpu()?.forward_bf16(problem)
}

/// A packed (serving) problem on device 0: `out`, `final_states`, `varlen_states` and
/// `position_states`, as [`ssd_reference::serving::forward`] returns them.
///
/// # Errors
/// As [`forward`]; [`GpuError::Unsupported`] also for an invalid packing.
///
/// # Example
/// ```no_run
/// use ssd_reference::random::{random_problem, ProblemSpec};
/// use ssd_reference::serving::Packing;
/// use ssd_reference::Dims;
///
/// // Two sequences of 5 and 7 tokens, packed; the state after token 2 too.
/// let p = random_problem(&ProblemSpec::plain(Dims::new(1, 12, 2, 3, 1, 4)), 1).unwrap();
/// let mut packing = Packing::<f32>::new(vec![0, 5, 12]);
/// packing.state_positions = vec![2];
/// let o = ssd_gpu::forward_packed(&p.cast::<f32>(), &packing)?;
/// assert_eq!(o.varlen_states.shape(), &[2, 2, 3, 4]);
/// # Ok::<(), ssd_gpu::GpuError>(())
/// ```
pub fn forward_packed(
    problem: &Problem<f32>,
    packing: &ssd_reference::serving::Packing<f32>,
) -> Result<ssd_reference::serving::ServingOutput<f32>, GpuError> {
    default_gpu()?.forward_packed(problem, packing)
}
