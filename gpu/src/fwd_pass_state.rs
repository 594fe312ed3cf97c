//! Stage 2 on the GPU: the state entering every chunk, and the final state.

use cudarc::driver::CudaSlice;
use ssd_reference::{Dims, Options};

use crate::error::unsupported;
use crate::kernels::Kernel;
use crate::params::{
    ChunkStateLocalParams, FwdPassStateParams, StateChainedParams, StatePassingParams, StateSizes,
    StateWalkSegParams,
};
use crate::runtime::{int, Args};
use crate::shape::{state_local_variant, StateLocal, TILE_N, TILE_P};
use crate::{DeviceInputs, DeviceOutputs, Gpu, GpuError, IoElement};

/// The walking stage 2's kernels by units per block: `(units, f32 kernel, bf16 kernel)`.
const WALK_UNITS: [(usize, Kernel, Kernel); 3] = [
    (1, Kernel::StateWalkX1, Kernel::StateWalkBf16x1),
    (2, Kernel::StateWalkX2, Kernel::StateWalkBf16x2),
    (5, Kernel::StateWalkX5, Kernel::StateWalkBf16x5),
];

/// The walking kernel with `units` units per block for bf16 activations or f32 ones.
fn walk_kernel(units: usize, bf16: bool) -> Option<Kernel> {
    WALK_UNITS
        .iter()
        .find(|(u, _, _)| *u == units)
        .map(|&(_, f, b)| if bf16 { b } else { f })
}

/// [`crate::StateWalk::Auto`]'s choice of units per block for `units` units on `sms` SMs,
/// among those that `serves` (1, 2 or 5), `resident(h)` blocks of `h` units fitting one SM at
/// a time: none when the units are fewer than the SMs; else the one that leaves the fewest
/// units to a block slot, `h * ceil(units / h / (resident(h) * sms))` (units a block times
/// waves of blocks), the larger on a tie (a block's units share each B tile).
///
/// The model behind it, measured on an H100 (`docs/perf-history.md`, version 62): an SM
/// streams about one unit-chunk every 3 us whatever the form, so a form's time is its waves
/// times the units each block walks. At (8, 8192, 80) 640 one-unit blocks on 264 slots take
/// 3 waves (cost 3) and won (-9% of stage 2); five units a block (one wave, cost 5) lost.
pub(crate) fn walk_units_for(
    units: usize,
    sms: usize,
    serves: impl Fn(usize) -> bool,
    resident: impl Fn(usize) -> usize,
) -> Option<usize> {
    if units < sms || sms == 0 {
        return None;
    }
    WALK_UNITS
        .iter()
        .map(|&(h, _, _)| h)
        .filter(|&h| serves(h) && resident(h) > 0)
        .min_by_key(|&h| {
            let waves = (units / h).div_ceil(resident(h) * sms);
            (h * waves, std::cmp::Reverse(h))
        })
}

/// The segmented walk's plan for rows of `nchunks` chunks: `(chunks per segment, segments)`,
/// from `wanted` segments (0: `slots / units`, the segments that fill the device's block
/// slots, at least 1), at most one chunk a segment, and no empty last segment (the count is
/// that of `ceil(nchunks / per segment)`).
pub(crate) fn walk_segments_for(
    wanted: usize,
    nchunks: usize,
    units: usize,
    slots: usize,
) -> (usize, usize) {
    let n = if wanted == 0 {
        (slots / units.max(1)).max(1)
    } else {
        wanted
    };
    let per = nchunks.div_ceil(n.clamp(1, nchunks.max(1)));
    (per, nchunks.div_ceil(per))
}

/// Largest `dstate` of the segmented walk: a block holds 128 columns, two blocks a unit's row.
const SEGMENTED_MAX_DSTATE: usize = 256;

/// The segmented walk's kernel for bf16 activations or f32 ones.
const fn walk_seg_kernel(bf16: bool) -> Kernel {
    if bf16 {
        Kernel::StateWalkSegBf16x1
    } else {
        Kernel::StateWalkSegX1
    }
}

/// A row's units in the segmented walk: (head, 64 headdim rows, 128 dstate columns).
fn walk_seg_row_units(dims: &Dims) -> usize {
    dims.nheads * dims.headdim.div_ceil(TILE_P) * dims.dstate.div_ceil(2 * TILE_N)
}

/// Largest `dstate` of the chained stage 2: one block holds a unit's whole state rows (128
/// columns) in its accumulators.
const CHAINED_MAX_DSTATE: usize = 128;

impl Gpu {
    /// Enqueues stage 2 (after [`Gpu::chunk_cumsum`]), writing `outputs.chunk_states` and
    /// `outputs.final_states`. With bf16 activations it also writes `chunk_states` rounded to
    /// bf16, which [`Gpu::compute_out`] reads, and may leave `chunk_states` itself unwritten
    /// where the outputs do not keep it ([`crate::DeviceOutputs::set_keep_chunk_states`]).
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
    /// In version 2, two launches for parallelism: every chunk's own product in parallel
    /// (`ssd_chunk_state_local`), then one thread per state element walking the chunks
    /// (`ssd_state_passing`, `S_{c+1} = fma(scale_c, S_c, L_c)` as the CPU reference); the
    /// fused sequential kernel (`ssd_fwd_pass_state`) in [`crate::Variant::V1`], and where 2a's
    /// grid would overflow.
    /// In [`crate::Variant::V3`] (the default), where [`Gpu::uses_chained`]: one launch of
    /// `ssd_state_chained`, the same products and the same pass chained over the chunks, the
    /// same bits.
    ///
    /// # Errors
    /// [`GpuError::Unsupported`] when buffers and sizes disagree; driver errors.
    pub fn fwd_pass_state<T: IoElement>(
        &self,
        inputs: &DeviceInputs<T>,
        outputs: &mut DeviceOutputs<T>,
    ) -> Result<(), GpuError> {
        self.fwd_pass_state_with(inputs, None, outputs)
    }

    /// [`Gpu::fwd_pass_state`], with packed sequences' initial states taken in where `seq`
    /// is given (`crate::DevicePacking`): `(seq_init [nseq, nheads, headdim, dstate],
    /// chunk_init [nchunks, 2])`, both checked by the caller against the sizes.
    pub(crate) fn fwd_pass_state_with<T: IoElement>(
        &self,
        inputs: &DeviceInputs<T>,
        seq: Option<(&CudaSlice<f32>, &CudaSlice<i32>)>,
        outputs: &mut DeviceOutputs<T>,
    ) -> Result<(), GpuError> {
        self.check_buffers(inputs, outputs)?;
        if T::BF16 {
            self.check_bf16(&inputs.dims, &inputs.options)?;
            outputs.check_states_lo()?;
        }
        let d = inputs.dims;
        let o = inputs.options;
        let nchunks = d.nchunks(o.chunk_size);
        let tiles = d.headdim.div_ceil(TILE_P) * d.dstate.div_ceil(TILE_N);
        let sizes = StateSizes::new(&d, &o);
        // 2a's tiles: two units (head, 64 headdim rows) of a group per block and 128 dstate
        // columns where `state_local_variant` allows, one unit and 128 columns above dstate 64,
        // else 64 columns (4 warps).
        // With bf16 activations: the bf16 pair kernel (`check_bf16` above).
        let state_local = if T::BF16 {
            Kernel::ChunkStateLocalPairBf16
        } else {
            self.state_local_variant(&d)
        };
        let split_tiles = match state_local {
            Kernel::ChunkStateLocalPair | Kernel::ChunkStateLocalPairBf16 => {
                d.dstate.div_ceil(2 * TILE_N)
            }
            Kernel::ChunkStateLocalWide => {
                d.headdim.div_ceil(TILE_P) * d.dstate.div_ceil(2 * TILE_N)
            }
            _ => tiles,
        };
        // 2a's blocks over (chunk and tile, unit), the unit fastest (kernels' `tile_and_unit`):
        // x = (c * split_tiles + tile) * units + unit; the fused pass where that overflows i32.
        let units = if matches!(
            state_local,
            Kernel::ChunkStateLocalPair | Kernel::ChunkStateLocalPairBf16
        ) {
            d.nheads * d.headdim.div_ceil(TILE_P) / 2
        } else {
            d.nheads
        };
        let split_grid = nchunks
            .checked_mul(split_tiles)
            .and_then(|g| g.checked_mul(units))
            .filter(|&g| g <= i32::MAX as usize);
        if let (None, Some(units)) = (seq, self.state_walk_units(&d, &o, T::BF16)) {
            return self.state_walk(inputs, outputs, units);
        }
        let has_seq_idx = inputs.seq_idx.is_some();
        if let (None, Some(plan)) = (seq, self.state_walk_segments(&d, &o, T::BF16, has_seq_idx)) {
            return self.state_walk_seg(inputs, outputs, plan);
        }
        if let (Some(len), None) = (self.chain_len(&d, &o), seq) {
            return self.state_chained(inputs, outputs, len);
        }
        if let (false, Some(gx)) = (self.legacy, split_grid) {
            // 2a: every chunk's own state, in parallel.
            let mut args = Args::new(&self.stream);
            let params = ChunkStateLocalParams {
                x: args.read(&inputs.x),
                b: args.read(&inputs.B),
                dt_out: args.read(&outputs.dt),
                da_cumsum: args.read(&outputs.dA_cumsum),
                seq_idx: args.opt(inputs.seq_idx.as_ref()),
                chunk_states: args.write(&mut outputs.chunk_states),
                sizes,
            };
            // SAFETY: `ChunkStateLocalParams` is the struct of the four 2a kernels
            // (kernels/fwd_pass_state/local.cu, pair.cu, bf16.cu: the same fields, bf16 `x` and
            // `B` for the last, which `T` is then); buffers checked against the sizes, grid
            // checked above (for pairs: nheads * ceil(headdim / 64) / 2 pairs, an even count per
            // group and 16-byte copies, checked by `state_pairs`, or for bf16 by `check_bf16`);
            // the dynamic shared memory checked against this device by `state_local_variant`
            // or `check_bf16`.
            unsafe {
                self.launch(
                    state_local,
                    (gx as u32, 1, d.batch as u32),
                    d.dstate,
                    &params,
                )
            }?;
            drop(args);
            // 2b: the sequential pass, one thread per state element.
            let n = d.headdim * d.dstate;
            // 4 elements per thread (16-byte loads) where the rows allow it.
            let vec4 = n.is_multiple_of(4);
            let per_block = Kernel::StatePassing.threads() as usize * if vec4 { 4 } else { 1 };
            let grid = (
                n.div_ceil(per_block) as u32,
                d.nheads as u32,
                d.batch as u32,
            );
            let mut args = Args::new(&self.stream);
            let params = StatePassingParams {
                da_cumsum: args.read(&outputs.dA_cumsum),
                initial_states: args.opt(inputs.initial_states.as_ref()),
                seq_idx: args.opt(inputs.seq_idx.as_ref()),
                chunk_states: args.write(&mut outputs.chunk_states),
                final_states: args.write(&mut outputs.final_states),
                seqlen: int(d.seqlen),
                nheads: int(d.nheads),
                headdim: int(d.headdim),
                dstate: int(d.dstate),
                chunk_size: int(o.chunk_size),
                nchunks: int(nchunks),
                vec4: i32::from(vec4),
                // The bf16 output kernel reads `states_lo`: `chunk_states` is written only
                // where the outputs keep it (2a's own states stay there, unspecified).
                lean: i32::from(T::BF16 && !outputs.keep_chunk_states),
                seq_init: seq.map_or(0, |(s, _)| args.read(s)),
                chunk_init: seq.map_or(0, |(_, c)| args.read(c)),
                states_lo: outputs.states_lo.as_mut().map_or(0, |s| args.write(s)),
            };
            // SAFETY: `StatePassingParams` is the struct of `ssd_state_passing`
            // (kernels/fwd_pass_state/passing.cu); buffers checked against the sizes; grid x <=
            // ceil(headdim * dstate / 256), small (every CudaSlice allocation is 256-byte
            // aligned, so the 16-byte loads are too) since `shape::check` bounds headdim by
            // 65535 * 64 and dstate by 256; `states_lo`, where given (bf16), has the length of
            // `chunk_states` (`check_states_lo`).
            unsafe { self.launch(Kernel::StatePassing, grid, d.dstate, &params) }?;
            return Ok(());
        }
        if T::BF16 {
            return Err(GpuError::Internal(
                "bf16 activations reached the fused state pass".into(),
            ));
        }
        let mut args = Args::new(&self.stream);
        let params = FwdPassStateParams {
            x: args.read(&inputs.x),
            b: args.read(&inputs.B),
            dt_out: args.read(&outputs.dt),
            da_cumsum: args.read(&outputs.dA_cumsum),
            initial_states: args.opt(inputs.initial_states.as_ref()),
            seq_idx: args.opt(inputs.seq_idx.as_ref()),
            chunk_states: args.write(&mut outputs.chunk_states),
            final_states: args.write(&mut outputs.final_states),
            sizes,
            seq_init: seq.map_or(0, |(s, _)| args.read(s)),
            chunk_init: seq.map_or(0, |(_, c)| args.read(c)),
        };
        let grid = (tiles as u32, d.nheads as u32, d.batch as u32);
        // SAFETY: `FwdPassStateParams` is the struct of `ssd_fwd_pass_state`
        // (kernels/fwd_pass_state/fused.cu); every buffer was checked against the sizes and the
        // grid by `shape::check`.
        unsafe { self.launch(Kernel::FwdPassState, grid, d.dstate, &params) }?;
        drop(args);
        Ok(())
    }

    /// Whether stage 2 runs as the chained kernel (`ssd_state_chained`, or
    /// `ssd_state_chained_bf16` for bf16 activations) for `dims` with `options`: the variant is
    /// [`crate::Variant::V3`], the pair 2a kernel serves the shape, `dstate <= 128` (a block
    /// holds a unit's whole state rows), the chains (batch x pairs of units) are at least half
    /// as many as this device's SMs, and the grid fits `i32`. Packed problems with per-sequence
    /// initial states run the separate kernels.
    ///
    /// Why the chains must keep most of the device busy: each chunk waits for the state its
    /// chain's previous chunk hands on (one L2 round trip per hop), so a chain of `nchunks`
    /// chunks takes at least `nchunks` hops; with few chains the hops are not hidden behind
    /// the other chains' work (`docs/gpu.md`, "The chained stage 2"). On the H200 it gained at
    /// 96 chains (132 SMs) and lost 4x at 16.
    pub fn uses_chained(&self, dims: &Dims, options: &Options) -> bool {
        self.chain_len(dims, options).is_some()
    }

    /// Length of the chained kernel's scratch (`1 + batch * pairs * nchunks`: the ticket
    /// counter and one flag per chunk of each chain) where it serves.
    pub(crate) fn chain_len(&self, dims: &Dims, options: &Options) -> Option<usize> {
        if !self.chained
            || dims.dstate > CHAINED_MAX_DSTATE
            || self.state_local_variant(dims) != Kernel::ChunkStateLocalPair
        {
            return None;
        }
        let chains = dims.batch * (dims.nheads * dims.headdim.div_ceil(TILE_P) / 2);
        if 2 * chains < self.sm_count {
            return None;
        }
        chains
            .checked_mul(dims.nchunks(options.chunk_size))
            .filter(|&n| n < i32::MAX as usize)
            .map(|n| n + 1)
    }

    /// Enqueues the chained stage 2 (`chain_len` is `Some(len)` for these sizes).
    fn state_chained<T: IoElement>(
        &self,
        inputs: &DeviceInputs<T>,
        outputs: &mut DeviceOutputs<T>,
        len: usize,
    ) -> Result<(), GpuError> {
        let d = inputs.dims;
        let o = inputs.options;
        let Some(chain) = outputs.chain.as_mut().filter(|c| c.len() == len) else {
            return Err(unsupported(
                "the outputs were allocated by a Gpu of another variant: they hold no scratch for the chained stage 2 (allocate them with this Gpu)",
            ));
        };
        self.stream.memset_zeros(chain)?;
        let mut args = Args::new(&self.stream);
        let params = StateChainedParams {
            x: args.read(&inputs.x),
            b: args.read(&inputs.B),
            dt_out: args.read(&outputs.dt),
            da_cumsum: args.read(&outputs.dA_cumsum),
            initial_states: args.opt(inputs.initial_states.as_ref()),
            seq_idx: args.opt(inputs.seq_idx.as_ref()),
            // The bf16 output kernel reads `states_lo`: `chunk_states` is written only where
            // the caller keeps it. The f32 one reads `chunk_states`.
            chunk_states: if T::BF16 && !outputs.keep_chunk_states {
                0
            } else {
                args.write(&mut outputs.chunk_states)
            },
            final_states: args.write(&mut outputs.final_states),
            chain: args.write(chain),
            sizes: StateSizes::new(&d, &o),
            batch: int(d.batch),
            states_lo: outputs.states_lo.as_mut().map_or(0, |s| args.write(s)),
        };
        let kernel = if T::BF16 {
            Kernel::StateChainedBf16
        } else {
            Kernel::StateChained
        };
        // SAFETY: `StateChainedParams` is the struct of both chained kernels
        // (kernels/fwd_pass_state/chained.cu: bf16 x and B for the second, which `T` is then);
        // every buffer was checked against the sizes (`check_buffers`); `chain_len` checked
        // what the pair 2a kernel asks (an even count of units per group, 16-byte copies; for
        // bf16 `check_bf16` above), dstate <= 128, and the grid (one block per ticket, `len - 1`
        // < i32::MAX); the scratch has `len` flags and was cleared above on this stream; the
        // dynamic shared memory fits this device (`chained`); `states_lo`, where given (bf16),
        // has the length of `chunk_states` (`check_states_lo`); `chunk_states` is 0 (not
        // written) only with bf16, whose output kernel reads `states_lo` instead;
        // `final_states` is the chains' running state, written by chunk 0's block before any
        // block reads it (chunk 0 reads `initial_states`).
        unsafe { self.launch(kernel, ((len - 1) as u32, 1, 1), d.dstate, &params) }?;
        Ok(())
    }

    /// Units per block of the walking stage 2 (`ssd_state_walk_1`, `_2` or `_5`, and
    /// `ssd_state_walk_bf16_*` for bf16 activations: `bf16`) where it serves `dims` with
    /// `options` (packed problems with per-sequence initial states excepted), else `None`. It
    /// serves in [`crate::Variant::V3`] with `headdim` and `dstate` multiples of 4 (16-byte
    /// copies; for bf16 where the bf16 kernels serve, [`Gpu::runs_bf16`]), `dstate <= 128`, a
    /// block's units (head, 64 headdim rows) share one group (the units per group a multiple
    /// of the units per block), the grid within `i32`, and its shared memory fits this device.
    /// [`crate::StateWalk::Auto`] (the default) takes it for bf16 activations on Hopper
    /// (`sm_90a`, where its products run on `wgmma`) where the units (batch x nheads x
    /// ceil(headdim / 64)) are at least as many as the SMs, with the units per block that
    /// leave the fewest units to a block slot ([`walk_units_for`], with the driver's count of
    /// resident blocks). It keeps f32 and other devices on the chained kernel: version 61's
    /// `mma.sync` walker, timed on an H100, lost to it at (4, 4096, 80) in every form and at
    /// (8, 8192, 80) in the form this rule picks (it gained with 5 units a block there, and
    /// with 1 at (8, 2048, 24); `docs/perf-history.md`).
    ///
    /// Why the units must fill the device: a block walks its units' chunks one after the
    /// other, so with fewer units than SMs the chunks of a long row run on a few SMs (at
    /// (4, 16384, 8) 32 units of 128 chunks each), where 2a + 2b spreads them over all.
    pub fn state_walk_units(&self, dims: &Dims, options: &Options, bf16: bool) -> Option<usize> {
        if self.config().variant != crate::Variant::V3
            || dims.dstate > CHAINED_MAX_DSTATE
            || !(dims.headdim.is_multiple_of(4) && dims.dstate.is_multiple_of(4))
            || (bf16 && !self.runs_bf16(dims, options))
        {
            return None;
        }
        let per_group = dims.nheads / dims.ngroups * dims.headdim.div_ceil(TILE_P);
        let units = dims.batch * dims.nheads * dims.headdim.div_ceil(TILE_P);
        if units > i32::MAX as usize {
            return None;
        }
        let serves = |h: usize| {
            per_group.is_multiple_of(h)
                && walk_kernel(h, bf16).is_some_and(|k| self.fits(k, dims.dstate))
        };
        match self.config().state_walk {
            crate::StateWalk::Off | crate::StateWalk::Segments(_) => None,
            crate::StateWalk::Units(h) => serves(h).then_some(h),
            crate::StateWalk::Auto if bf16 && self.target() == "sm_90a" => {
                walk_units_for(units, self.sm_count, serves, |h| {
                    walk_kernel(h, bf16).map_or(0, |k| self.resident_blocks(k))
                })
            }
            crate::StateWalk::Auto => None,
        }
    }

    /// The segmented walk's plan `(chunks per segment, segments)` where it serves `dims` with
    /// `options` and [`crate::StateWalk::Segments`] asks for it, else `None`: each unit (head,
    /// 64 headdim rows, 128 dstate columns) has its chunks cut into segments, each walked by
    /// its own block (`ssd_state_walk_seg_1`, `ssd_state_walk_seg_bf16_1`), for rows whose units
    /// alone are too few to fill the device (at (4, 16384, 8) 32 units of 128 chunks). It
    /// serves in [`crate::Variant::V3`] with `headdim` and `dstate` multiples of 4 (for bf16
    /// where the bf16 kernels serve, [`Gpu::runs_bf16`]), `dstate <= 256`, no `seq_idx`
    /// (`seq_idx`: whether the problem has one), the grids within their limits, and its shared
    /// memory fits this device. `Segments(0)` takes as many segments as fill the block slots
    /// ([`walk_segments_for`] with the driver's count of resident blocks). No default takes it
    /// yet: it has not been timed against 2a + 2b.
    pub fn state_walk_segments(
        &self,
        dims: &Dims,
        options: &Options,
        bf16: bool,
        seq_idx: bool,
    ) -> Option<(usize, usize)> {
        let crate::StateWalk::Segments(wanted) = self.config().state_walk else {
            return None;
        };
        let kernel = walk_seg_kernel(bf16);
        if self.config().variant != crate::Variant::V3
            || dims.dstate > SEGMENTED_MAX_DSTATE
            || !(dims.headdim.is_multiple_of(4) && dims.dstate.is_multiple_of(4))
            || seq_idx
            || (bf16 && !self.runs_bf16(dims, options))
            || !self.fits(kernel, dims.dstate)
        {
            return None;
        }
        let row_units = walk_seg_row_units(dims);
        let units = dims.batch * row_units;
        let nchunks = dims.nchunks(options.chunk_size);
        let slots = self.resident_blocks(kernel) * self.sm_count;
        let (per, nseg) = walk_segments_for(wanted, nchunks, units, slots);
        // Both phases' grids ((units of a row, segments, batch): y and z at most 65,535) and
        // the combination's (a thread per two state elements) within i32.
        let elements = dims.batch * dims.nheads * dims.headdim * dims.dstate;
        (row_units <= i32::MAX as usize
            && nseg <= 65_535
            && dims.batch <= 65_535
            && elements / 2 <= i32::MAX as usize)
            .then_some((per, nseg))
    }

    /// Enqueues the segmented walk with `(chunks per segment, segments)` from
    /// [`Gpu::state_walk_segments`]: phase 0 (skipped with one segment), the combination,
    /// phase 1.
    fn state_walk_seg<T: IoElement>(
        &self,
        inputs: &DeviceInputs<T>,
        outputs: &mut DeviceOutputs<T>,
        (per, nseg): (usize, usize),
    ) -> Result<(), GpuError> {
        let d = inputs.dims;
        let o = inputs.options;
        if T::BF16 && outputs.states_lo.is_none() {
            return Err(GpuError::Internal(
                "bf16 outputs without the states' bf16 copy".into(),
            ));
        }
        let kernel = walk_seg_kernel(T::BF16);
        let units = walk_seg_row_units(&d) as u32;
        let (nseg_u, batch) = (nseg as u32, d.batch as u32);
        let pairs = d.batch * d.nheads * d.headdim * d.dstate / 2;
        let combine_blocks = pairs.div_ceil(Kernel::StateWalkSegCombine.threads() as usize) as u32;
        let keep = i32::from(!T::BF16 || outputs.keep_chunk_states);
        // Phase 0 and the combination (none with one segment), then phase 1: (kernel, grid,
        // phase; the combination reads no phase).
        let steps = [
            (kernel, (units, nseg_u - 1, batch), 0),
            (Kernel::StateWalkSegCombine, (combine_blocks, 1, 1), 0),
            (kernel, (units, nseg_u, batch), 1),
        ];
        for (k, grid, phase) in steps.into_iter().skip(if nseg == 1 { 2 } else { 0 }) {
            let mut args = Args::new(&self.stream);
            let params = StateWalkSegParams {
                walk: StateChainedParams {
                    x: args.read(&inputs.x),
                    b: args.read(&inputs.B),
                    dt_out: args.read(&outputs.dt),
                    da_cumsum: args.read(&outputs.dA_cumsum),
                    initial_states: args.opt(inputs.initial_states.as_ref()),
                    seq_idx: 0,
                    chunk_states: args.write(&mut outputs.chunk_states),
                    final_states: args.write(&mut outputs.final_states),
                    chain: 0,
                    sizes: StateSizes::new(&d, &o),
                    batch: int(d.batch),
                    states_lo: outputs.states_lo.as_mut().map_or(0, |s| args.write(s)),
                },
                seg_chunks: int(per),
                nseg: int(nseg),
                phase,
                keep,
            };
            // SAFETY: `StateWalkSegParams` is the struct of the three kernels
            // (kernels/fwd_pass_state/walk.cu: bf16 x and B in the bf16 kernel, which `T` is
            // then; `chain` and `seq_idx` unread, `states_lo` unread in f32); every buffer was
            // checked against the sizes (`check_buffers`); `state_walk_segments` checked what
            // the kernels ask: headdim and dstate multiples of 4 (bf16: of 8, `check_bf16`),
            // dstate <= 256 (two 128-column units a row above 128), no seq_idx, the grids within
            // their limits (`grid`: a row's units, the segments, the batch; or a thread per two
            // state elements), the shared memory fits this device; `per` and `nseg` from
            // `walk_segments_for`:
            // every segment but the last holds `per` chunks and the last at least one, so the
            // chunk after each of the first `nseg - 1` segments exists in `chunk_states`, which
            // is always given (the phases' scratch, `nchunks` states a head); `states_lo` has the
            // length of `chunk_states` (`check_states_lo`) where given. Phase 0 writes only those
            // chunks' states, the combination only rereads and rewrites them, phase 1 reads each
            // segment's first and writes its own chunks (and `final_states`, the last segment).
            unsafe { self.launch(k, grid, d.dstate, &params) }?;
        }
        Ok(())
    }

    /// Enqueues the walking stage 2 with `units` units per block ([`Gpu::state_walk_units`]).
    fn state_walk<T: IoElement>(
        &self,
        inputs: &DeviceInputs<T>,
        outputs: &mut DeviceOutputs<T>,
        units: usize,
    ) -> Result<(), GpuError> {
        let d = inputs.dims;
        let o = inputs.options;
        let Some(kernel) = walk_kernel(units, T::BF16) else {
            return Err(GpuError::Internal(format!(
                "no walking stage 2 with {units} units per block"
            )));
        };
        let blocks = d.batch * d.nheads * d.headdim.div_ceil(TILE_P) / units;
        if T::BF16 && outputs.states_lo.is_none() {
            return Err(GpuError::Internal(
                "bf16 outputs without the states' bf16 copy".into(),
            ));
        }
        let mut args = Args::new(&self.stream);
        let params = StateChainedParams {
            x: args.read(&inputs.x),
            b: args.read(&inputs.B),
            dt_out: args.read(&outputs.dt),
            da_cumsum: args.read(&outputs.dA_cumsum),
            initial_states: args.opt(inputs.initial_states.as_ref()),
            seq_idx: args.opt(inputs.seq_idx.as_ref()),
            // The bf16 output kernel reads `states_lo`, the f32 one `chunk_states`.
            chunk_states: if T::BF16 && !outputs.keep_chunk_states {
                0
            } else {
                args.write(&mut outputs.chunk_states)
            },
            final_states: args.write(&mut outputs.final_states),
            chain: 0,
            sizes: StateSizes::new(&d, &o),
            batch: int(d.batch),
            states_lo: outputs.states_lo.as_mut().map_or(0, |s| args.write(s)),
        };
        // SAFETY: `StateChainedParams` is the struct of the walking kernels
        // (kernels/fwd_pass_state/walk.cu reads it as the chained kernels' struct, bf16 x and B
        // in the bf16 kernels, which `T` is then; `chain` unread, `states_lo` unread in f32);
        // every buffer was checked against the sizes (`check_buffers`); `state_walk_units`
        // checked what the kernel asks: headdim and dstate multiples of 4, 16-byte rows (for
        // bf16 `check_bf16`: multiples of 8; the kernel's 32-bit offsets stay within one
        // stage's rows, its row offsets are 64-bit), dstate <= 128,
        // the units per group a multiple of `units` (so `blocks` is whole and each block's
        // units share a group), and its shared memory fits this device; the grid is `blocks`
        // (at most the units, within i32 by `state_walk_units`); `states_lo` has
        // the length of `chunk_states` (`check_states_lo`) where given; `chunk_states` is 0
        // (not written) only for bf16 outputs that do not keep it.
        unsafe { self.launch(kernel, (blocks as u32, 1, 1), d.dstate, &params) }?;
        Ok(())
    }

    /// Which 2a kernel serves `dims` on this device (see [`state_local_variant`]).
    pub(crate) fn state_local_variant(&self, dims: &Dims) -> Kernel {
        let wide_fits = self.fits(Kernel::ChunkStateLocalWide, dims.dstate);
        match state_local_variant(dims, self.pairs, wide_fits) {
            StateLocal::Pair => Kernel::ChunkStateLocalPair,
            StateLocal::Wide => Kernel::ChunkStateLocalWide,
            StateLocal::Narrow => Kernel::ChunkStateLocal,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{walk_segments_for, walk_units_for};

    #[test]
    fn walk_units_leave_the_fewest_to_a_block_slot() {
        let all = |_: usize| true;
        // The H100's and H200's residency of the bf16 kernels: 2, 2 and 1 blocks an SM.
        let hopper = |h: usize| if h == 5 { 1 } else { 2 };
        // (8, 8192, 80, 64): 640 units on 132 SMs: one a block takes 3 waves of 264 blocks
        // (cost 3), two 2 waves (4), five 1 wave (5).
        assert_eq!(walk_units_for(640, 132, all, hopper), Some(1));
        // (4, 4096, 80, 64): 320 units: one a block 2 waves (2), two 1 wave (2, and B shared),
        // five 5.
        assert_eq!(walk_units_for(320, 132, all, hopper), Some(2));
        // (8, 2048, 24, 64): 192 units: one a block fits one wave (1).
        assert_eq!(walk_units_for(192, 132, all, hopper), Some(1));
        // One block an SM for every form: the fewest units on the busiest SM.
        assert_eq!(walk_units_for(640, 132, all, |_| 1), Some(5));
        // Only what serves and fits: 24 heads a group is no multiple of 5.
        assert_eq!(walk_units_for(640, 132, |h| h != 1, hopper), Some(2));
        assert_eq!(
            walk_units_for(640, 132, all, |h| usize::from(h == 5)),
            Some(5)
        );
        // Fewer units than SMs: the chunks of a row would run on a few SMs.
        assert_eq!(walk_units_for(32, 132, all, hopper), None);
        assert_eq!(walk_units_for(640, 132, |_| false, hopper), None);
    }

    #[test]
    fn walk_segments_fill_the_slots_and_none_is_empty() {
        // Hopper, three one-unit blocks an SM: (4, 16384, 8) 32 units of 128 chunks; (4, 65536,
        // 8, dstate 256) 64 units of 512.
        assert_eq!(walk_segments_for(0, 128, 32, 396), (11, 12));
        assert_eq!(walk_segments_for(0, 512, 64, 396), (86, 6));
        // Forced counts; more than the chunks; units that fill the slots alone; one chunk.
        assert_eq!(walk_segments_for(3, 8, 4, 396), (3, 3));
        assert_eq!(walk_segments_for(100, 5, 4, 396), (1, 5));
        assert_eq!(walk_segments_for(0, 64, 1000, 396), (64, 1));
        assert_eq!(walk_segments_for(0, 1, 4, 396), (1, 1));
        // Rounding may take fewer segments than asked, never an empty one.
        assert_eq!(walk_segments_for(6, 10, 4, 396), (2, 5));
        for nchunks in 1..70 {
            for wanted in 0..80 {
                let (per, n) = walk_segments_for(wanted, nchunks, 7, 100);
                assert!(per >= 1 && n >= 1);
                assert!(
                    per * (n - 1) < nchunks && nchunks <= per * n,
                    "{wanted} of {nchunks}"
                );
            }
        }
    }
}
