//! Stage 1 on the GPU: dt processing and the within-chunk cumsum of `dt * A`.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::runtime::{int, opt_ptr};
use crate::{DeviceInputs, DeviceOutputs, Gpu, GpuError};

const THREADS: u32 = 128;
/// The largest chunk_size of `ssd_chunk_cumsum_tiled` (`CS_TILED_MAX` in the kernel).
const TILED_MAX_CHUNK: usize = 256;
/// Heads per block of `ssd_chunk_cumsum_tiled` (`CS_HEADS`).
const TILED_HEADS: usize = 32;
/// The most blocks for which `ssd_chunk_cumsum_tiled` is taken. Measured on the H200 (ncu,
/// docs/performance.md, version 15): with 64 to 768 blocks it took 11-39 us where the
/// per-thread kernel took 17-57 us; with 2,048 blocks (4 x 512 chunks, 8 heads: 24 of each
/// block's 32 head lanes idle, 8 waves of blocks) 42 us against 21 us.
const TILED_MAX_BLOCKS: usize = 1024;

impl Gpu {
    /// Enqueues stage 1, writing `outputs.dt` and `outputs.dA_cumsum`.
    ///
    /// For batch `b`, head `h`, chunk `c` and position `l` of the chunk (token
    /// `t = c * chunk_size + l`):
    /// `dt'[b, h, c, l] = clamp(softplus?(dt[b, t, h] + dt_bias[h]), lo, hi)` for `t < seqlen`,
    /// 0 past it, with `softplus(v) = v` above 20 and `log1p(exp(v))` otherwise; and
    /// `dA_cumsum[b, h, c, l] = sum_{k <= l} dt'[b, h, c, k] * A[h]`, summed in order.
    /// One thread per `(b, c, h)` (`ssd_chunk_cumsum`); by default, for `chunk_size <= 256`
    /// and at most 1,024 such blocks, one block per `(b, c, 32 heads)` that first loads the
    /// chunk's `dt` with every load in flight (`ssd_chunk_cumsum_tiled`, the same sums in the
    /// same order: the same bits).
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
        let (lo, hi) = (o.dt_limit.0 as f32, o.dt_limit.1 as f32);
        let head_tiles = d.nheads.div_ceil(TILED_HEADS);
        let tiled_blocks = d.batch * nchunks * head_tiles;
        let tiled = !self.legacy
            && o.chunk_size <= TILED_MAX_CHUNK
            && tiled_blocks <= TILED_MAX_BLOCKS
            && head_tiles <= 65_535
            && d.batch <= 65_535;
        let (f, cfg) = if tiled {
            let cfg = LaunchConfig {
                grid_dim: (nchunks as u32, head_tiles as u32, d.batch as u32),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            (&self.chunk_cumsum_tiled_fn, cfg)
        } else {
            let threads = d.batch * nchunks * d.nheads;
            let blocks = u32::try_from(threads.div_ceil(THREADS as usize)).map_err(|_| {
                crate::error::unsupported("batch * nchunks * nheads is too large for one launch")
            })?;
            let cfg = LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            (&self.chunk_cumsum_fn, cfg)
        };
        // version 2: 16 tokens' loads in flight (same sum, same bits); version 1's loop otherwise
        let unroll16 = i32::from(!self.legacy && o.chunk_size.is_multiple_of(16));
        let mut launch = stream.launch_builder(f);
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
            .arg(&hi);
        if !tiled {
            launch.arg(&unroll16);
        }
        // SAFETY: the argument list matches `ssd_chunk_cumsum_tiled` (tiled) or
        // `ssd_chunk_cumsum` (with `unroll16`) in kernels/chunk_cumsum.cu, and every buffer was
        // checked against the sizes by `check_buffers`. The tiled kernel: chunk_size within its
        // static shared memory (CS_TILED_MAX), grid within the launch limits (at most
        // TILED_MAX_BLOCKS blocks; y and z checked above).
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }
}
