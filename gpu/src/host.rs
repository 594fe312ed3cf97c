//! Host-side convenience: a [`Problem<f32>`] in, ndarray outputs back.

use std::borrow::Cow;
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaSlice;
use ndarray::{Array, Dimension};
use ssd_reference::{ChunkedOutput, Problem};

use crate::shape::seq_idx_to_i32;
use crate::{DeviceInputs, DeviceOutputs, Gpu, GpuConfig, GpuError};

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
        let dims = *problem.dims();
        let options = *problem.options();
        self.check(&dims, &options)?;
        let i = problem.inputs();
        let opt = |a: Option<&Array<f32, _>>| a.map(|a| self.upload_array(a)).transpose();
        Ok(DeviceInputs {
            dims,
            options,
            x: self.upload_array(&i.x)?,
            dt: self.upload_array(&i.dt)?,
            A: self.upload_array(&i.A)?,
            B: self.upload_array(&i.B)?,
            C: self.upload_array(&i.C)?,
            D: i.D.as_ref().map(|a| self.upload_array(a)).transpose()?,
            z: opt(i.z.as_ref())?,
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
    /// # Errors
    /// Driver errors, including faults of the kernels that produced the outputs.
    pub fn download(&self, outputs: &DeviceOutputs) -> Result<ChunkedOutput<f32>, GpuError> {
        let d = outputs.dims;
        let nchunks = d.nchunks(outputs.options.chunk_size);
        let q = outputs.options.chunk_size;
        let get =
            |s: &CudaSlice<f32>| -> Result<Vec<f32>, GpuError> { Ok(self.stream.clone_dtoh(s)?) };
        let out = get(&outputs.out)?;
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
