//! Stage 1 on the GPU: dt processing and the within-chunk cumsum of `dt * A`.

use crate::kernels::Kernel;
use crate::params::ChunkCumsumParams;
use crate::runtime::{int, Args};
use crate::{DeviceInputs, DeviceOutputs, Gpu, GpuError, IoElement};

/// The largest chunk_size of `ssd_chunk_cumsum_tiled` (`CS_TILED_MAX` in the kernel).
const TILED_MAX_CHUNK: usize = 256;
/// Heads per block of `ssd_chunk_cumsum_tiled` (`CS_HEADS`).
const TILED_HEADS: usize = 32;
/// The most blocks for which `ssd_chunk_cumsum_tiled` is taken: beyond about one wave of
/// blocks, with most of each block's 32 head lanes idle when there are few heads, the
/// per-thread kernel is faster (`docs/perf-history.md`).
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
    pub fn chunk_cumsum<T: IoElement>(
        &self,
        inputs: &DeviceInputs<T>,
        outputs: &mut DeviceOutputs<T>,
    ) -> Result<(), GpuError> {
        self.check_buffers(inputs, outputs)?;
        let d = inputs.dims;
        let o = inputs.options;
        let nchunks = d.nchunks(o.chunk_size);
        let softplus = i32::from(o.dt_softplus);
        let (lo, hi) = (o.dt_limit.0 as f32, o.dt_limit.1 as f32);
        let head_tiles = d.nheads.div_ceil(TILED_HEADS);
        let tiled_blocks = d.batch * nchunks * head_tiles;
        let tiled = !self.legacy
            && o.chunk_size <= TILED_MAX_CHUNK
            && tiled_blocks <= TILED_MAX_BLOCKS
            && head_tiles <= 65_535
            && d.batch <= 65_535;
        let (kernel, grid) = if tiled {
            (
                Kernel::ChunkCumsumTiled,
                (nchunks as u32, head_tiles as u32, d.batch as u32),
            )
        } else {
            let threads = d.batch * nchunks * d.nheads;
            let per_block = Kernel::ChunkCumsum.threads() as usize;
            let blocks = u32::try_from(threads.div_ceil(per_block)).map_err(|_| {
                crate::error::unsupported("batch * nchunks * nheads is too large for one launch")
            })?;
            (Kernel::ChunkCumsum, (blocks, 1, 1))
        };
        let mut args = Args::new(&self.stream);
        let params = ChunkCumsumParams {
            dt: args.read(&inputs.dt),
            a: args.read(&inputs.A),
            dt_bias: args.opt(inputs.dt_bias.as_ref()),
            dt_out: args.write(&mut outputs.dt),
            da_cumsum: args.write(&mut outputs.dA_cumsum),
            batch: int(d.batch),
            seqlen: int(d.seqlen),
            nheads: int(d.nheads),
            chunk_size: int(o.chunk_size),
            nchunks: int(nchunks),
            dt_softplus: softplus,
            dt_lo: lo,
            dt_hi: hi,
            // version 2: 16 tokens' loads in flight (same sum, same bits); version 1's loop
            // otherwise (the tiled kernel does not read it)
            unroll16: i32::from(!self.legacy && o.chunk_size.is_multiple_of(16)),
        };
        // SAFETY: `ChunkCumsumParams` is both kernels' struct (kernels/chunk_cumsum.cu), and
        // every buffer was checked against the sizes by `check_buffers`. The tiled kernel:
        // chunk_size within its static shared memory (CS_TILED_MAX), grid within the launch
        // limits (at most TILED_MAX_BLOCKS blocks; y and z checked above).
        unsafe { self.launch(kernel, grid, d.dstate, &params) }?;
        drop(args);
        Ok(())
    }
}
