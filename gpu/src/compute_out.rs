//! Stage 3 on the GPU: the output of every chunk.

use crate::kernels::Kernel;
use crate::params::{
    ChunkCbParams, ComputeOutCbParams, ComputeOutParams, ComputeOutWgParams, StateSizes,
};
use crate::runtime::{int, Args};
use crate::shape::{compute_out_cb_rows, compute_out_pairs, score_tiles, TILE_M, TILE_P};
use crate::tma;
use crate::{DeviceInputs, DeviceOutputs, Gpu, GpuError, IoElement};

impl Gpu {
    /// Enqueues stage 3 (after [`Gpu::fwd_pass_state`]), writing `outputs.out`.
    ///
    /// For token `i` of chunk `c` (`cs = dA_cumsum[b, h, c, :]`, `S = chunk_states[b, c, h]`):
    /// `y_i = exp(cs_i) (C_i . S)` [only if `seq(i)` equals the seq_idx of the token before
    /// the chunk, 0 before chunk 0] `+ sum_{j <= i in the chunk, seq(j) = seq(i)} (C_i . B_j)
    /// exp(cs_i - cs_j) dt'_j x_j + D x_i`, then `out = y * z * sigmoid(z)` when `z` is given.
    /// The causal matrix is built in 64 x 64 tiles on chip, only for tiles on or below the
    /// diagonal, the exponent evaluated only where `j <= i`. Products in TF32, f32 accumulation.
    /// One block per `(b, chunk, 64 rows, h, 64 headdim columns)`.
    ///
    /// Where the outputs hold the scores scratch (chunk sizes 64 to 512, see `docs/gpu.md`):
    /// first `C B^T` once per (batch, chunk, group) and pair of 64-row tiles on or below the
    /// diagonal (`ssd_chunk_cb`), then the output kernel that reads those scores and streams
    /// its tiles through a cp.async double buffer (`ssd_compute_out_cb`, over 128 rows per
    /// block when the chunk has more than 64 tokens: raw f32 operands, the
    /// tensor cores truncate them to TF32; left of the diagonal without `seq_idx` the decay
    /// splits into a row and a column factor, both at most 1). The single kernel
    /// (`ssd_compute_out`) serves every other chunk size.
    ///
    /// With bf16 activations the output kernel reads `S` as the bf16 copy that
    /// [`Gpu::fwd_pass_state`] wrote beside `chunk_states` (the operand its product rounds the
    /// state to), not `chunk_states` itself: run the stages in order on the same outputs.
    ///
    /// # Errors
    /// [`GpuError::Unsupported`] when buffers and sizes disagree; driver errors.
    pub fn compute_out<T: IoElement>(
        &self,
        inputs: &DeviceInputs<T>,
        outputs: &mut DeviceOutputs<T>,
    ) -> Result<(), GpuError> {
        self.check_buffers(inputs, outputs)?;
        if T::BF16 {
            // The bf16 kernels: 3a and the pair output kernel (`check_bf16` guarantees both
            // serve, and that the scores scratch is allocated).
            self.check_bf16(&inputs.dims, &inputs.options)?;
            outputs.check_states_lo()?;
        }
        let d = inputs.dims;
        let o = inputs.options;
        let nchunks = d.nchunks(o.chunk_size);
        let itiles = o.chunk_size.div_ceil(TILE_M);
        let ptiles = d.headdim.div_ceil(TILE_P);
        let grid = (
            (nchunks * itiles) as u32,
            (d.nheads * ptiles) as u32,
            d.batch as u32,
        );
        let sizes = StateSizes::new(&d, &o);
        let d_per_channel = i32::from(inputs.D.as_ref().is_some_and(|v| v.len() != d.nheads));
        let has_initial_states = i32::from(inputs.initial_states.is_some());
        if T::BF16 && self.runs_wg_out(&d, &o, inputs.seq_idx.is_some()) {
            return self.compute_out_wg(inputs, outputs, sizes, d_per_channel, has_initial_states);
        }
        if let Some(scores) = outputs.scores.as_mut() {
            let t = score_tiles(&d, &o);
            let npairs = t * (t + 1) / 2;
            let mut args = Args::new(&self.stream);
            let params = ChunkCbParams {
                b: args.read(&inputs.B),
                c: args.read(&inputs.C),
                cbuf: args.write(scores),
                seqlen: int(d.seqlen),
                ngroups: int(d.ngroups),
                dstate: int(d.dstate),
                chunk_size: int(o.chunk_size),
                nchunks: int(nchunks),
                tmax: int(t),
                // 16-byte copies of the B and C slabs where the rows allow them (every
                // CudaSlice allocation is 256-byte aligned).
                vec: i32::from(d.dstate.is_multiple_of(4)),
            };
            let cb_grid = ((nchunks * npairs) as u32, d.ngroups as u32, d.batch as u32);
            // SAFETY: `ChunkCbParams` is the struct of `ssd_chunk_cb`
            // (kernels/compute_out/scores.cu) and of `ssd_chunk_cb_bf16` (bf16.cu: bf16 B and C,
            // which `T` is then, dstate a multiple of 8 by `check_bf16`); the scratch was sized by `shape::scores_len` for
            // these sizes (which also bounds the grid), B and C were checked against the sizes,
            // and its 68 KB of dynamic shared memory fit every device of compute capability 8.0
            // or newer.
            let kernel = if T::BF16 {
                Kernel::ChunkCbBf16
            } else {
                Kernel::ChunkCb
            };
            unsafe { self.launch(kernel, cb_grid, d.dstate, &params) }?;
        }
        if let Some(scores) = outputs.scores.as_ref() {
            let t = score_tiles(&d, &o);
            let rows = compute_out_cb_rows(t, self.fits(Kernel::ComputeOutCb128, d.dstate));
            let pairs = self.pairs && compute_out_pairs(&d, t);
            let grid_x = (nchunks * o.chunk_size.div_ceil(rows)) as u32;
            let (kernel, grid) = if T::BF16 {
                (Kernel::ComputeOutPairBf16, (grid_x, grid.1 / 2, grid.2))
            } else if pairs {
                // Two units (head, 64 headdim columns) per block, 128 rows, 256 threads.
                (Kernel::ComputeOutPair, (grid_x, grid.1 / 2, grid.2))
            } else if rows == 128 {
                (Kernel::ComputeOutCb128, (grid_x, grid.1, grid.2))
            } else {
                (Kernel::ComputeOutCb, (grid_x, grid.1, grid.2))
            };
            let mut args = Args::new(&self.stream);
            let params = ComputeOutCbParams {
                x: args.read(&inputs.x),
                c: args.read(&inputs.C),
                d: args.opt(inputs.D.as_ref()),
                z: args.opt(inputs.z.as_ref()),
                dt_out: args.read(&outputs.dt),
                da_cumsum: args.read(&outputs.dA_cumsum),
                // The bf16 kernel reads the states' bf16 copy that stage 2 wrote.
                chunk_states: match outputs.states_lo.as_ref() {
                    Some(lo) if T::BF16 => args.read(lo),
                    _ => args.read(&outputs.chunk_states),
                },
                seq_idx: args.opt(inputs.seq_idx.as_ref()),
                cbuf: args.read(scores),
                out: args.write(&mut outputs.out),
                sizes,
                d_per_channel,
                has_initial_states,
                tmax: int(t),
                // 16-byte copies of the x, C and state tiles: rows of 4-float multiples (every
                // CudaSlice allocation is 256-byte aligned).
                vec: i32::from(d.headdim.is_multiple_of(4) && d.dstate.is_multiple_of(4)),
            };
            // SAFETY: `ComputeOutCbParams` is the struct of `ssd_compute_out_cb`,
            // `ssd_compute_out_cb128` (kernels/compute_out/tiled.cu), `ssd_compute_out_pair`
            // (pair.cu) and `ssd_compute_out_pair_bf16` (bf16.cu: bf16 x, C, z and out, which `T`
            // is then, and the states' bf16 copy in place of `chunk_states`, checked by
            // `check_states_lo`; its conditions checked by `check_bf16`), whose rows per block (64, 128,
            // 128 for pairs) the grid above uses; the
            // pair kernel's grid covers nheads * ptiles / 2 pairs (an even count per group,
            // checked by `compute_out_pairs`, 16-byte copies only where `vec` holds); every
            // buffer was checked against the sizes, the scores were written by `ssd_chunk_cb`
            // just before on this stream, and the dynamic shared memory (73 KB, or 109 KB and
            // 110 KB for pairs) was checked against this device by `compute_out_cb_rows` and
            // `pairs`.
            unsafe { self.launch(kernel, grid, d.dstate, &params) }?;
            return Ok(());
        }
        if T::BF16 {
            return Err(GpuError::Internal(
                "bf16 activations reached the single output kernel".into(),
            ));
        }
        let mut args = Args::new(&self.stream);
        let params = ComputeOutParams {
            x: args.read(&inputs.x),
            b: args.read(&inputs.B),
            c: args.read(&inputs.C),
            d: args.opt(inputs.D.as_ref()),
            z: args.opt(inputs.z.as_ref()),
            dt_out: args.read(&outputs.dt),
            da_cumsum: args.read(&outputs.dA_cumsum),
            chunk_states: args.read(&outputs.chunk_states),
            seq_idx: args.opt(inputs.seq_idx.as_ref()),
            out: args.write(&mut outputs.out),
            sizes,
            d_per_channel,
            has_initial_states,
        };
        // SAFETY: `ComputeOutParams` is the struct of `ssd_compute_out`
        // (kernels/compute_out/fused.cu), every buffer was checked against the sizes, and the
        // dynamic shared memory was checked against the device's opt-in limit by `check`.
        unsafe { self.launch(Kernel::ComputeOut, grid, d.dstate, &params) }?;
        drop(args);
        Ok(())
    }

    /// Stage 3 on Hopper for bf16 activations (`ssd_compute_out_wg_bf16`, where
    /// [`Gpu::runs_wg_out`]): the scores, the decay and both products in one kernel, its
    /// operands copied by TMA, its products on `wgmma`. A persistent grid, one block per SM,
    /// walking the (batch, chunk, pair of heads) items.
    fn compute_out_wg<T: IoElement>(
        &self,
        inputs: &DeviceInputs<T>,
        outputs: &mut DeviceOutputs<T>,
        sizes: StateSizes,
        d_per_channel: i32,
        has_initial_states: i32,
    ) -> Result<(), GpuError> {
        let d = inputs.dims;
        let nchunks = d.nchunks(inputs.options.chunk_size);
        let Some(lo) = outputs.states_lo.as_ref() else {
            return Err(GpuError::Internal(
                "the Hopper output kernel found no bf16 copy of the states".into(),
            ));
        };
        let mut args = Args::new(&self.stream);
        let x = args.read(&inputs.x);
        let c = args.read(&inputs.C);
        let b = args.read(&inputs.B);
        let s = args.read(lo);
        let out = args.write(&mut outputs.out);
        let u = |v: usize| v as u64;
        let (len, batch) = (u(d.seqlen), u(d.batch));
        let xw = u(d.nheads * d.headdim);
        let bw = u(d.ngroups * d.dstate);
        let params = ComputeOutWgParams {
            tm_x: tma::bf16_boxes_64(x, [xw, len, batch], [2 * xw, 2 * xw * len])?,
            tm_c: tma::bf16_boxes_64(c, [bw, len, batch], [2 * bw, 2 * bw * len])?,
            tm_b: tma::bf16_boxes_64(b, [bw, len, batch], [2 * bw, 2 * bw * len])?,
            tm_s: tma::bf16_boxes_64(
                s,
                [u(d.dstate), u(d.headdim), u(d.batch * nchunks * d.nheads)],
                [2 * u(d.dstate), 2 * u(d.headdim * d.dstate)],
            )?,
            tm_out: tma::bf16_boxes_64(out, [xw, len, batch], [2 * xw, 2 * xw * len])?,
            d: args.opt(inputs.D.as_ref()),
            z: args.opt(inputs.z.as_ref()),
            dt_out: args.read(&outputs.dt),
            da_cumsum: args.read(&outputs.dA_cumsum),
            sizes,
            d_per_channel,
            has_initial_states,
            batch: int(d.batch),
        };
        // Persistent: one block per SM (or per item, where there are fewer; or the configured
        // cap), each taking the items k, k + grid, ... of (batch, chunk, pair of heads).
        let items = d.batch * nchunks * (d.nheads / 2);
        let blocks = self.config().persistent_blocks.unwrap_or(self.sm_count);
        let grid = (items.min(blocks).max(1) as u32, 1, 1);
        // SAFETY: `ComputeOutWgParams` is the struct of `ssd_compute_out_wg_bf16`
        // (kernels/compute_out/wg_bf16.cu: bf16 x, B, C, z and out, which `T` is; the states'
        // bf16 copy checked by `check_states_lo`); its descriptors cover exactly x, C, B, that
        // copy and out at the checked sizes (the copy engine reads and writes nothing outside
        // them); `runs_wg_out`
        // checked its conditions (headdim 64, dstate 128 with chunks of 128 or 256 tokens, or
        // 256 with chunks of 128 on `ssd_compute_out_wg_bf16_n256`, as `Kernel::wg_out`; no
        // seq_idx, pairs of heads within a group, every TMA coordinate and the item count within
        // `i32`), that this device is Hopper and that its dynamic shared memory fits; the blocks
        // stride over every (batch, chunk, pair of heads) item, and dt and dA_cumsum were
        // written by stage 1 on this stream.
        unsafe { self.launch(Kernel::wg_out(d.dstate), grid, d.dstate, &params) }?;
        Ok(())
    }
}
