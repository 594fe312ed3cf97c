//! Stage 3 on the GPU: the output of every chunk.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::runtime::{int, opt_ptr};
use crate::shape::{
    compute_out_cb_rows, compute_out_cb_smem_bytes, compute_out_pairs, compute_out_smem_bytes,
    score_tiles, CHUNK_CB_SMEM_BYTES, COMPUTE_OUT_PAIR_SMEM_BYTES, TILE_M, TILE_P,
};
use crate::{DeviceInputs, DeviceOutputs, Gpu, GpuError};

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
    /// # Errors
    /// [`GpuError::Unsupported`] when buffers and sizes disagree; driver errors.
    pub fn compute_out(
        &self,
        inputs: &DeviceInputs,
        outputs: &mut DeviceOutputs,
    ) -> Result<(), GpuError> {
        self.check_buffers(inputs, outputs)?;
        let d = inputs.dims;
        let o = inputs.options;
        let nchunks = d.nchunks(o.chunk_size);
        let itiles = o.chunk_size.div_ceil(TILE_M);
        let ptiles = d.headdim.div_ceil(TILE_P);
        let cfg = LaunchConfig {
            grid_dim: (
                (nchunks * itiles) as u32,
                (d.nheads * ptiles) as u32,
                d.batch as u32,
            ),
            block_dim: (128, 1, 1),
            shared_mem_bytes: compute_out_smem_bytes(d.dstate) as u32,
        };
        let stream = &self.stream;
        if let Some(scores) = outputs.scores.as_mut() {
            let t = score_tiles(&d, &o);
            let npairs = t * (t + 1) / 2;
            let cfg = LaunchConfig {
                grid_dim: ((nchunks * npairs) as u32, d.ngroups as u32, d.batch as u32),
                block_dim: (128, 1, 1),
                shared_mem_bytes: CHUNK_CB_SMEM_BYTES as u32,
            };
            // 16-byte copies of the B and C slabs where the rows allow them (every CudaSlice
            // allocation is 256-byte aligned).
            let cb_vec = i32::from(d.dstate.is_multiple_of(4));
            let cb_sizes = [
                int(d.seqlen),
                int(d.ngroups),
                int(d.dstate),
                int(o.chunk_size),
                int(nchunks),
                int(t),
            ];
            let mut launch = stream.launch_builder(&self.chunk_cb_fn);
            launch.arg(&inputs.B).arg(&inputs.C).arg(scores);
            for s in &cb_sizes {
                launch.arg(s);
            }
            launch.arg(&cb_vec);
            // SAFETY: the argument list matches `ssd_chunk_cb` in kernels/compute_out.cu; the
            // scratch was sized by `shape::scores_len` for these sizes (which also bounds the
            // grid), B and C were checked against the sizes, and 68 KB of dynamic shared memory
            // fit every device of compute capability 8.0 or newer (opt-in raised at load).
            unsafe { launch.launch(cfg) }?;
        }
        let (dskip, _g1) = opt_ptr(inputs.D.as_ref(), stream);
        let (z, _g2) = opt_ptr(inputs.z.as_ref(), stream);
        let (seq, _g3) = opt_ptr(inputs.seq_idx.as_ref(), stream);
        let d_per_channel = i32::from(inputs.D.as_ref().is_some_and(|v| v.len() != d.nheads));
        let has_initial_states = i32::from(inputs.initial_states.is_some());
        let sizes = [
            int(d.seqlen),
            int(d.nheads),
            int(d.headdim),
            int(d.ngroups),
            int(d.dstate),
            int(o.chunk_size),
            int(nchunks),
            d_per_channel,
            has_initial_states,
        ];
        if let Some(scores) = outputs.scores.as_ref() {
            let t = score_tiles(&d, &o);
            let rows = compute_out_cb_rows(t, self.max_smem_optin);
            let cfg = LaunchConfig {
                grid_dim: (
                    (nchunks * o.chunk_size.div_ceil(rows)) as u32,
                    cfg.grid_dim.1,
                    cfg.grid_dim.2,
                ),
                block_dim: (2 * rows as u32, 1, 1),
                shared_mem_bytes: compute_out_cb_smem_bytes(rows) as u32,
            };
            let tmax = int(t);
            // 16-byte copies of the x, C and state tiles: rows of 4-float multiples (every
            // CudaSlice allocation is 256-byte aligned).
            let vec = i32::from(d.headdim.is_multiple_of(4) && d.dstate.is_multiple_of(4));
            let pairs = self.pairs && compute_out_pairs(&d, t);
            let (f, cfg) = if pairs {
                // Two units (head, 64 headdim columns) per block, 128 rows, 256 threads.
                let cfg = LaunchConfig {
                    grid_dim: (cfg.grid_dim.0, cfg.grid_dim.1 / 2, cfg.grid_dim.2),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: COMPUTE_OUT_PAIR_SMEM_BYTES as u32,
                };
                (&self.compute_out_pair_fn, cfg)
            } else if rows == 128 {
                (&self.compute_out_cb128_fn, cfg)
            } else {
                (&self.compute_out_cb_fn, cfg)
            };
            let mut launch = stream.launch_builder(f);
            launch
                .arg(&inputs.x)
                .arg(&inputs.C)
                .arg(&dskip)
                .arg(&z)
                .arg(&outputs.dt)
                .arg(&outputs.dA_cumsum)
                .arg(&outputs.chunk_states)
                .arg(&seq)
                .arg(scores)
                .arg(&mut outputs.out);
            for s in &sizes {
                launch.arg(s);
            }
            launch.arg(&tmax).arg(&vec);
            // SAFETY: the argument list matches `ssd_compute_out_cb`, `ssd_compute_out_cb128`
            // and `ssd_compute_out_pair` in kernels/compute_out.cu, whose block size (2 * rows
            // threads; 256 for pairs) and rows per block (128 for pairs) the grid above uses;
            // the pair kernel's grid covers nheads * ptiles / 2 pairs (an even count per group,
            // checked by `compute_out_pairs`, 16-byte copies only where `vec` holds); every
            // buffer was checked against the sizes, the scores were written by `ssd_chunk_cb`
            // just before on this stream, and the dynamic shared memory (73 KB, or 109 KB and
            // 110 KB for pairs, both checked against this device by `compute_out_cb_rows` and
            // `pairs`) was opted in at load.
            unsafe { launch.launch(cfg) }?;
            return Ok(());
        }
        let mut launch = stream.launch_builder(&self.compute_out_fn);
        launch
            .arg(&inputs.x)
            .arg(&inputs.B)
            .arg(&inputs.C)
            .arg(&dskip)
            .arg(&z)
            .arg(&outputs.dt)
            .arg(&outputs.dA_cumsum)
            .arg(&outputs.chunk_states)
            .arg(&seq)
            .arg(&mut outputs.out);
        for s in &sizes {
            launch.arg(s);
        }
        // SAFETY: the argument list matches `ssd_compute_out` in kernels/compute_out.cu, every
        // buffer was checked against the sizes, and the dynamic shared memory was checked
        // against the device's opt-in limit (raised for this function when it was loaded).
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }
}
