//! Packed sequences on the GPU (serving): many requests in one row, each from its own initial
//! state, each sequence's final state and the states at listed tokens.
//!
//! The row runs through the same three stages on mamba_ssm's global chunk grid, with the
//! `seq_idx` that `cu_seqlens` implies (the states never cross a sequence boundary). What that
//! grid does not give by itself is added by the packing's tables (`docs/gpu.md`):
//! - stage 2 takes sequence `k`'s initial state into the state leaving the chunk where `k`
//!   starts, when `k` is that chunk's last sequence (`chunk_init`);
//! - `ssd_seq_init_out` adds the initial state's share of `out` in each sequence's first chunk
//!   (later chunks get it through `chunk_states`);
//! - `ssd_states_at` computes the state after a listed token from the state entering its chunk
//!   (or the sequence's initial state) and the chunk's tokens up to it: `varlen_states` (each
//!   sequence's last token) and `position_states`.
//!
//! With mamba_ssm's convention (`initial_states [1, ...]`, no `seq_initial_states`) stages 1-3
//! are exactly the seq_idx forward, and only `ssd_states_at` is added.

use cudarc::driver::CudaSlice;
use ndarray::Array4;
use ssd_reference::serving::{implied_seq_idx, Packing, ServingOutput};
use ssd_reference::{Dims, Options, Problem};

use crate::error::unsupported;
use crate::kernels::Kernel;
use crate::params::{SeqInitOutParams, StateSizes, StatesAtParams};
use crate::runtime::{int, Args};
use crate::{DeviceInputs, DeviceOutputs, Gpu, GpuError};

/// Headdim rows and dstate columns per block of `ssd_seq_init_out` and `ssd_states_at` (stage
/// 2's tile, `ST_TP` and `ST_TN`).
const TILE_ROWS: usize = 64;
const AT_COLS: usize = 64;

/// The packing of one problem in device memory: the tables the packed kernels read, built on
/// the host from a validated [`Packing`] by [`Gpu::upload_packed`].
#[derive(Debug)]
pub struct DevicePacking {
    dims: Dims,
    options: Options,
    nseq: usize,
    npositions: usize,
    /// `[nseq, nheads, headdim, dstate]`, the serving convention's initial states.
    seq_init: Option<CudaSlice<f32>>,
    /// `[nchunks, 2]`: `(k, first token of k in the chunk)` where the chunk's last sequence
    /// `k` starts in it from an initial state, else `(-1, 0)`; with `seq_init` only.
    chunk_init: Option<CudaSlice<i32>>,
    /// `[nranges, 4]`: `(t0, t1, k, 0)`, the tokens of sequence `k`'s first chunk, for every
    /// non-empty sequence with an initial state (serving convention).
    ranges: Option<(CudaSlice<i32>, usize)>,
    /// `[nseq, 4]`: `(last token or -1, first token, initial state index or -1, 0)`.
    seq_targets: CudaSlice<i32>,
    /// `[npositions, 4]`, as `seq_targets`.
    position_targets: Option<CudaSlice<i32>>,
}

impl DevicePacking {
    /// The number of sequences.
    pub fn nseq(&self) -> usize {
        self.nseq
    }

    /// The number of listed state positions.
    pub fn npositions(&self) -> usize {
        self.npositions
    }
}

/// The packed outputs beyond [`DeviceOutputs`], in device memory.
#[derive(Debug)]
pub struct DeviceServingOutputs {
    /// `[nseq, nheads, headdim, dstate]`: the state after each sequence's last token.
    pub varlen_states: CudaSlice<f32>,
    /// `[npositions, nheads, headdim, dstate]`, `None` without positions.
    pub position_states: Option<CudaSlice<f32>>,
}

/// The host-side tables of a validated packing (see [`DevicePacking`]).
struct Tables {
    chunk_init: Vec<i32>,
    ranges: Vec<i32>,
    seq_targets: Vec<i32>,
    position_targets: Vec<i32>,
}

fn tables(dims: &Dims, chunk_size: usize, packing: &Packing<f32>, mamba_init: bool) -> Tables {
    let cu = &packing.cu_seqlens;
    let nseq = cu.len() - 1;
    let serving = packing.seq_initial_states.is_some();
    let has = |k: usize| packing.seq_has_initial_state.as_ref().is_none_or(|m| m[k]);
    // Which initial state sequence k starts from (an index into the init table), or -1.
    let init_index = |k: usize| -> i32 {
        if serving {
            if has(k) {
                int(k)
            } else {
                -1
            }
        } else if k == 0 && mamba_init {
            0
        } else {
            -1
        }
    };
    let seq = implied_seq_idx(cu);
    let q = chunk_size;
    let nchunks = dims.nchunks(q);
    let mut chunk_init = Vec::new();
    if serving {
        chunk_init.reserve(2 * nchunks);
        for c in 0..nchunks {
            let last = ((c + 1) * q).min(dims.seqlen) - 1;
            let k = seq[last] as usize;
            if cu[k] >= c * q && init_index(k) >= 0 {
                chunk_init.extend([int(k), int(cu[k] - c * q)]);
            } else {
                chunk_init.extend([-1, 0]);
            }
        }
    }
    let mut ranges = Vec::new();
    let mut seq_targets = Vec::with_capacity(4 * nseq);
    for k in 0..nseq {
        let (s, e) = (cu[k], cu[k + 1]);
        if serving && e > s && init_index(k) >= 0 {
            let t1 = e.min((s / q + 1) * q);
            ranges.extend([int(s), int(t1), int(k), 0]);
        }
        let last = if e > s { int(e - 1) } else { -1 };
        seq_targets.extend([last, int(s), init_index(k), 0]);
    }
    let mut position_targets = Vec::with_capacity(4 * packing.state_positions.len());
    for &t in &packing.state_positions {
        let k = seq[t] as usize;
        position_targets.extend([int(t), int(cu[k]), init_index(k), 0]);
    }
    Tables {
        chunk_init,
        ranges,
        seq_targets,
        position_targets,
    }
}

impl Gpu {
    /// Copies a packed problem to the device: its inputs (with the `seq_idx` that
    /// `cu_seqlens` implies, when it has none) and the packing's tables.
    ///
    /// # Errors
    /// [`GpuError::Unsupported`] for an invalid packing (the reference's message, naming the
    /// tensor) or sizes the kernels do not support; [`GpuError::OutOfMemory`], driver errors.
    pub fn upload_packed(
        &self,
        problem: &Problem<f32>,
        packing: &Packing<f32>,
    ) -> Result<(DeviceInputs, DevicePacking), GpuError> {
        let invalid = |e: ssd_reference::ReferenceError| unsupported(e.to_string());
        packing.validate(problem).map_err(invalid)?;
        let problem = packing.with_seq_idx(problem).map_err(invalid)?;
        let inputs = self.upload(&problem)?;
        let dims = *problem.dims();
        let options = *problem.options();
        let t = tables(
            &dims,
            options.chunk_size,
            packing,
            problem.inputs().initial_states.is_some(),
        );
        let up = |v: &[i32]| -> Result<Option<CudaSlice<i32>>, GpuError> {
            if v.is_empty() {
                Ok(None)
            } else {
                Ok(Some(self.stream.clone_htod(v)?))
            }
        };
        let seq_init = packing
            .seq_initial_states
            .as_ref()
            .map(|s| self.upload_array(s))
            .transpose()?;
        let nranges = t.ranges.len() / 4;
        let packing_dev = DevicePacking {
            dims,
            options,
            nseq: packing.nseq(),
            npositions: packing.state_positions.len(),
            seq_init,
            chunk_init: up(&t.chunk_init)?,
            ranges: up(&t.ranges)?.map(|r| (r, nranges)),
            seq_targets: self.stream.clone_htod(&t.seq_targets)?,
            position_targets: up(&t.position_targets)?,
        };
        Ok((inputs, packing_dev))
    }

    /// Allocates the packed outputs for `packing` (uninitialised: every element is written by
    /// [`Gpu::forward_packed_into`]).
    ///
    /// # Errors
    /// [`GpuError::OutOfMemory`].
    pub fn alloc_serving_outputs(
        &self,
        packing: &DevicePacking,
    ) -> Result<DeviceServingOutputs, GpuError> {
        let d = &packing.dims;
        let state = d.nheads * d.headdim * d.dstate;
        // SAFETY: every element is written by `ssd_states_at` before it is read.
        let alloc = |n: usize| unsafe { self.stream.alloc::<f32>(n) };
        Ok(DeviceServingOutputs {
            varlen_states: alloc(packing.nseq * state)?,
            position_states: if packing.npositions > 0 {
                Some(alloc(packing.npositions * state)?)
            } else {
                None
            },
        })
    }

    /// Runs a packed problem: the three stages with the packing's initial states, then the
    /// initial states' share of `out` and the states after listed tokens. Enqueued only.
    ///
    /// # Errors
    /// [`GpuError::Unsupported`] when the buffers do not match the sizes, driver errors.
    pub fn forward_packed_into(
        &self,
        inputs: &DeviceInputs,
        packing: &DevicePacking,
        outputs: &mut DeviceOutputs,
        serving: &mut DeviceServingOutputs,
    ) -> Result<(), GpuError> {
        if inputs.dims != packing.dims || inputs.options != packing.options {
            return Err(unsupported(
                "the packing was uploaded for other sizes or options than the inputs",
            ));
        }
        let d = inputs.dims;
        let state = d.nheads * d.headdim * d.dstate;
        if serving.varlen_states.len() != packing.nseq * state
            || serving.position_states.as_ref().map_or(0, |s| s.len()) != packing.npositions * state
        {
            return Err(unsupported(
                "the serving outputs were allocated for another packing",
            ));
        }
        self.chunk_cumsum(inputs, outputs)?;
        let seq = packing.seq_init.as_ref().zip(packing.chunk_init.as_ref());
        self.fwd_pass_state_with(inputs, seq, outputs)?;
        self.compute_out(inputs, outputs)?;
        let o = inputs.options;
        let sizes = StateSizes::new(&d, &o);
        if let (Some(init), Some((ranges, nranges))) = (&packing.seq_init, &packing.ranges) {
            let mut args = Args::new(&self.stream);
            let params = SeqInitOutParams {
                c: args.read(&inputs.C),
                z: args.opt(inputs.z.as_ref()),
                da_cumsum: args.read(&outputs.dA_cumsum),
                seq_init: args.read(init),
                ranges: args.read(ranges),
                out: args.write(&mut outputs.out),
                sizes,
                nranges: int(*nranges),
            };
            let grid = (
                *nranges as u32,
                d.nheads as u32,
                d.headdim.div_ceil(TILE_ROWS) as u32,
            );
            // SAFETY: `SeqInitOutParams` is the struct of `ssd_seq_init_out` (serving.cu); the
            // inputs and outputs were checked against the sizes by stage 3, `seq_init` holds
            // nseq states (validated packing), every range lies in one chunk of the row and
            // names a sequence below nseq (built by `tables`); grid z covers headdim (at
            // most 65535 tiles with the heads, by `shape::check`).
            unsafe { self.launch(Kernel::SeqInitOut, grid, d.dstate, &params) }?;
        }
        let init = packing.seq_init.as_ref().or(inputs.initial_states.as_ref());
        let states_at = |targets: &CudaSlice<i32>,
                         n: usize,
                         dst: &mut CudaSlice<f32>|
         -> Result<(), GpuError> {
            let mut args = Args::new(&self.stream);
            let params = StatesAtParams {
                x: args.read(&inputs.x),
                b: args.read(&inputs.B),
                dt_out: args.read(&outputs.dt),
                da_cumsum: args.read(&outputs.dA_cumsum),
                chunk_states: args.read(&outputs.chunk_states),
                init: args.opt(init),
                targets: args.read(targets),
                states: args.write(dst),
                sizes,
                ntargets: int(n),
            };
            let tiles = d.headdim.div_ceil(TILE_ROWS) * d.dstate.div_ceil(AT_COLS);
            if tiles > 65535 || n > i32::MAX as usize {
                return Err(unsupported(format!(
                    "packed states: headdim {} needs {tiles} tiles per state, at most 65535",
                    d.headdim
                )));
            }
            let grid = (n as u32, d.nheads as u32, tiles as u32);
            // SAFETY: `StatesAtParams` is the struct of `ssd_states_at` (serving.cu); the
            // buffers were checked against the sizes, `dst` holds n states (checked above),
            // every target's token, sequence start and initial-state index lie in the row
            // and the init table (built by `tables` from a validated packing); grid z covers
            // [headdim, dstate] in 64 x 64 tiles (checked above), y the heads (at most
            // 65535 by `shape::check`).
            unsafe { self.launch(Kernel::StatesAt, grid, d.dstate, &params) }
        };
        states_at(
            &packing.seq_targets,
            packing.nseq,
            &mut serving.varlen_states,
        )?;
        if let (Some(t), Some(dst)) = (&packing.position_targets, &mut serving.position_states) {
            states_at(t, packing.npositions, dst)?;
        }
        Ok(())
    }

    /// Uploads a packed problem, runs it and downloads `out`, `final_states`, `varlen_states`
    /// and `position_states` (`[0, ...]` without positions), as the reference's
    /// [`ssd_reference::serving::forward`] returns them.
    ///
    /// # Errors
    /// As [`Gpu::upload_packed`] and [`Gpu::forward_packed_into`]; driver errors.
    pub fn forward_packed(
        &self,
        problem: &Problem<f32>,
        packing: &Packing<f32>,
    ) -> Result<ServingOutput<f32>, GpuError> {
        let (inputs, dev) = self.upload_packed(problem, packing)?;
        let mut outputs = self.alloc_outputs(&inputs.dims, &inputs.options)?;
        let mut serving = self.alloc_serving_outputs(&dev)?;
        self.forward_packed_into(&inputs, &dev, &mut outputs, &mut serving)?;
        self.download_packed(&outputs, &dev, &serving)
    }

    /// Waits for the stream and copies a packed problem's outputs back.
    ///
    /// # Errors
    /// Driver errors, including faults of the kernels that produced the outputs.
    pub fn download_packed(
        &self,
        outputs: &DeviceOutputs,
        packing: &DevicePacking,
        serving: &DeviceServingOutputs,
    ) -> Result<ServingOutput<f32>, GpuError> {
        let d = packing.dims;
        let get =
            |s: &CudaSlice<f32>| -> Result<Vec<f32>, GpuError> { Ok(self.stream.clone_dtoh(s)?) };
        let out = get(&outputs.out)?;
        let fin = get(&outputs.final_states)?;
        let var = get(&serving.varlen_states)?;
        let pos = match &serving.position_states {
            Some(s) => get(s)?,
            None => Vec::new(),
        };
        self.synchronize()?;
        let shape_err = |e: ndarray::ShapeError| {
            GpuError::Internal(format!("downloaded buffer has the wrong length: {e}"))
        };
        let states = |n: usize, v: Vec<f32>| {
            Array4::from_shape_vec((n, d.nheads, d.headdim, d.dstate), v).map_err(shape_err)
        };
        Ok(ServingOutput {
            out: Array4::from_shape_vec((1, d.seqlen, d.nheads, d.headdim), out)
                .map_err(shape_err)?,
            final_states: states(1, fin)?,
            varlen_states: states(packing.nseq, var)?,
            position_states: states(packing.npositions, pos)?,
        })
    }
}
