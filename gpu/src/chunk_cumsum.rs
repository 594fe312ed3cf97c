//! Stage 1 on the GPU: dt processing and the within-chunk cumsum of `dt * A`.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::runtime::{int, opt_ptr};
use crate::{DeviceInputs, DeviceOutputs, Gpu, GpuError};

const THREADS: u32 = 128;

impl Gpu {
    /// Enqueues stage 1, writing `outputs.dt` and `outputs.dA_cumsum`.
    ///
    /// For batch `b`, head `h`, chunk `c` and position `l` of the chunk (token
    /// `t = c * chunk_size + l`):
    /// `dt'[b, h, c, l] = clamp(softplus?(dt[b, t, h] + dt_bias[h]), lo, hi)` for `t < seqlen`,
    /// 0 past it, with `softplus(v) = v` above 20 and `log1p(exp(v))` otherwise; and
    /// `dA_cumsum[b, h, c, l] = sum_{k <= l} dt'[b, h, c, k] * A[h]`, summed in order.
    /// One thread per `(b, c, h)`.
    ///
    /// # Errors
    /// [`GpuError::Unsupported`] when buffers and sizes disagree; driver errors.
    pub fn chunk_cumsum(
        &self,
        inputs: &DeviceInputs,
        outputs: &mut DeviceOutputs,
    ) -> Result<(), GpuError> {
        self.check_buffers(inputs, outputs)?;
        let d = inputs.dims;
        let o = inputs.options;
        let nchunks = d.nchunks(o.chunk_size);
        let threads = d.batch * nchunks * d.nheads;
        let blocks = u32::try_from(threads.div_ceil(THREADS as usize)).map_err(|_| {
            crate::error::unsupported("batch * nchunks * nheads is too large for one launch")
        })?;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let stream = &self.stream;
        let (bias, _g) = opt_ptr(inputs.dt_bias.as_ref(), stream);
        let (batch, seqlen, nheads, q, nc) = (
            int(d.batch),
            int(d.seqlen),
            int(d.nheads),
            int(o.chunk_size),
            int(nchunks),
        );
        let softplus = i32::from(o.dt_softplus);
        // version 2: 16 tokens' loads in flight (same sum, same bits); version 1's loop otherwise
        let unroll16 = i32::from(!self.legacy && o.chunk_size.is_multiple_of(16));
        let (lo, hi) = (o.dt_limit.0 as f32, o.dt_limit.1 as f32);
        let mut launch = stream.launch_builder(&self.chunk_cumsum_fn);
        launch
            .arg(&inputs.dt)
            .arg(&inputs.A)
            .arg(&bias)
            .arg(&mut outputs.dt)
            .arg(&mut outputs.dA_cumsum)
            .arg(&batch)
            .arg(&seqlen)
            .arg(&nheads)
            .arg(&q)
            .arg(&nc)
            .arg(&softplus)
            .arg(&lo)
            .arg(&hi)
            .arg(&unroll16);
        // SAFETY: the argument list matches `ssd_chunk_cumsum` in kernels/chunk_cumsum.cu and
        // every buffer was checked against the sizes by `check_buffers`.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }
}
