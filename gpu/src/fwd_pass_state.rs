//! Stage 2 on the GPU: the state entering every chunk, and the final state.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use crate::runtime::{int, opt_ptr};
use crate::shape::{
    state_local_variant, StateLocal, CHUNK_STATE_LOCAL_PAIR_SMEM_BYTES,
    CHUNK_STATE_LOCAL_SMEM_BYTES, CHUNK_STATE_LOCAL_WIDE_SMEM_BYTES, TILE_N, TILE_P,
};
use crate::{DeviceInputs, DeviceOutputs, Gpu, GpuError};

impl Gpu {
    /// Enqueues stage 2 (after [`Gpu::chunk_cumsum`]), writing `outputs.chunk_states` and
    /// `outputs.final_states`.
    ///
    /// With `S_0 = initial_states` (zeros when absent), for each chunk `c` with last real
    /// token `last`, `cs = dA_cumsum[b, h, c, :]`:
    /// `chunk_states[b, c, h] = S_c` and
    /// `S_{c+1} = scale_c * S_c + sum_{l <= last, seq(l) = seq(last)} x[l]^T (exp(cs[last] - cs[l]) * dt'[l] * B[l])`,
    /// one TF32 product `[headdim, l] x [l, dstate]` per chunk, where
    /// `scale_c = exp(cs[last])` if `seq(last)` equals the seq_idx of the token before the chunk
    /// (0 before chunk 0), else 0. `final_states = S_nchunks`. One block per
    /// `(b, h, 64 x 64 tile of [headdim, dstate])`, walking the chunks in order.
    ///
    /// By default in two launches for parallelism: every chunk's own product in parallel
    /// (`ssd_chunk_state_local`), then one thread per state element walking the chunks
    /// (`ssd_state_passing`, `S_{c+1} = fma(scale_c, S_c, L_c)` as the CPU reference); the
    /// fused sequential kernel (`ssd_fwd_pass_state`) with `SSD_GPU_V1=1`.
    ///
    /// # Errors
    /// [`GpuError::Unsupported`] when buffers and sizes disagree; driver errors.
    pub fn fwd_pass_state(
        &self,
        inputs: &DeviceInputs,
        outputs: &mut DeviceOutputs,
    ) -> Result<(), GpuError> {
        self.check_buffers(inputs, outputs)?;
        let d = inputs.dims;
        let o = inputs.options;
        let nchunks = d.nchunks(o.chunk_size);
        let tiles = d.headdim.div_ceil(TILE_P) * d.dstate.div_ceil(TILE_N);
        let stream = &self.stream;
        let (init, _g1) = opt_ptr(inputs.initial_states.as_ref(), stream);
        let (seq, _g2) = opt_ptr(inputs.seq_idx.as_ref(), stream);
        let sizes = [
            int(d.seqlen),
            int(d.nheads),
            int(d.headdim),
            int(d.ngroups),
            int(d.dstate),
            int(o.chunk_size),
            int(nchunks),
        ];
        // 2a's tiles: two units (head, 64 headdim rows) of a group per block and 128 dstate
        // columns where `state_local_variant` allows, one unit and 128 columns above dstate 64,
        // else 64 columns (4 warps).
        let variant = state_local_variant(&d, self.pairs, self.max_smem_optin);
        let pairs = variant == StateLocal::Pair;
        let (split_tiles, threads, smem, state_local_fn) = match variant {
            StateLocal::Pair => {
                let t = d.dstate.div_ceil(2 * TILE_N);
                let f = &self.chunk_state_local_pair_fn;
                (t, 256, CHUNK_STATE_LOCAL_PAIR_SMEM_BYTES, f)
            }
            StateLocal::Wide => {
                let t = d.headdim.div_ceil(TILE_P) * d.dstate.div_ceil(2 * TILE_N);
                let f = &self.chunk_state_local_wide_fn;
                (t, 256, CHUNK_STATE_LOCAL_WIDE_SMEM_BYTES, f)
            }
            StateLocal::Narrow => (
                tiles,
                128,
                CHUNK_STATE_LOCAL_SMEM_BYTES,
                &self.chunk_state_local_fn,
            ),
        };
        // 2a's blocks over (chunk and tile, unit), the unit fastest (kernels' `tile_and_unit`):
        // x = (c * split_tiles + tile) * units + unit; the fused pass where that overflows i32.
        let units = if pairs {
            d.nheads * d.headdim.div_ceil(TILE_P) / 2
        } else {
            d.nheads
        };
        let split_grid = nchunks
            .checked_mul(split_tiles)
            .and_then(|g| g.checked_mul(units))
            .filter(|&g| g <= i32::MAX as usize);
        if let (false, Some(gx)) = (self.legacy, split_grid) {
            // 2a: every chunk's own state, in parallel.
            let cfg = LaunchConfig {
                grid_dim: (gx as u32, 1, d.batch as u32),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: smem as u32,
            };
            let mut launch = stream.launch_builder(state_local_fn);
            launch
                .arg(&inputs.x)
                .arg(&inputs.B)
                .arg(&outputs.dt)
                .arg(&outputs.dA_cumsum)
                .arg(&seq)
                .arg(&mut outputs.chunk_states);
            for s in &sizes {
                launch.arg(s);
            }
            // SAFETY: the argument list matches `ssd_chunk_state_local`,
            // `ssd_chunk_state_local_wide` and `ssd_chunk_state_local_pair` in
            // kernels/fwd_pass_state.cu; buffers checked against the sizes, grid checked above
            // (for pairs: nheads * ceil(headdim / 64) / 2 pairs, an even count per group and
            // 16-byte copies, checked by `state_pairs`); 74 KB of dynamic shared memory, or
            // 106 KB and 105 KB (pairs), both checked against this device by
            // `state_local_variant`, opted in at load.
            unsafe { launch.launch(cfg) }?;
            // 2b: the sequential pass, one thread per state element.
            let n = d.headdim * d.dstate;
            // 4 elements per thread (16-byte loads) where the rows allow it.
            let vec4 = n.is_multiple_of(4);
            let per_block = if vec4 { 1024 } else { 256 };
            let cfg = LaunchConfig {
                grid_dim: (
                    n.div_ceil(per_block) as u32,
                    d.nheads as u32,
                    d.batch as u32,
                ),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let pass_sizes = [
                int(d.seqlen),
                int(d.nheads),
                int(d.headdim),
                int(d.dstate),
                int(o.chunk_size),
                int(nchunks),
            ];
            let mut launch = stream.launch_builder(&self.state_passing_fn);
            launch
                .arg(&outputs.dA_cumsum)
                .arg(&init)
                .arg(&seq)
                .arg(&mut outputs.chunk_states)
                .arg(&mut outputs.final_states);
            for s in &pass_sizes {
                launch.arg(s);
            }
            let vec4 = i32::from(vec4);
            launch.arg(&vec4);
            // SAFETY: the argument list matches `ssd_state_passing` in kernels/fwd_pass_state.cu;
            // buffers checked against the sizes; grid x <= ceil(headdim * dstate / 256), small
            // (every CudaSlice allocation is 256-byte aligned, so the 16-byte loads are too)
            // since `shape::check` bounds headdim by 65535 * 64 and dstate by 256.
            unsafe { launch.launch(cfg) }?;
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (tiles as u32, d.nheads as u32, d.batch as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = stream.launch_builder(&self.fwd_pass_state_fn);
        launch
            .arg(&inputs.x)
            .arg(&inputs.B)
            .arg(&outputs.dt)
            .arg(&outputs.dA_cumsum)
            .arg(&init)
            .arg(&seq)
            .arg(&mut outputs.chunk_states)
            .arg(&mut outputs.final_states);
        for s in &sizes {
            launch.arg(s);
        }
        // SAFETY: the argument list matches `ssd_fwd_pass_state` in kernels/fwd_pass_state.cu,
        // every buffer was checked against the sizes and the grid by `shape::check`.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }
}
