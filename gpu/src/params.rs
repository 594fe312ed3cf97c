//! The parameter structs of the kernels: one per kernel contract, `#[repr(C)]`, field for field
//! the C struct of the same name in `gpu/kernels/` (which each kernel takes by value as its one
//! argument). Device buffers are raw device addresses (0 for an absent optional buffer).
//!
//! Their sizes are checked three times: a `static_assert` in the C source, a const assert
//! here, and at load against the size the loaded module reports (`K_layout.params`, see
//! [`crate::kernels::Kernel`]).

use cudarc::driver::DeviceRepr;

/// `ssd_chunk_cumsum` and `ssd_chunk_cumsum_tiled` (`gpu/kernels/chunk_cumsum.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct ChunkCumsumParams {
    pub dt: u64,
    pub a: u64,
    pub dt_bias: u64,
    pub dt_out: u64,
    pub da_cumsum: u64,
    pub batch: i32,
    pub seqlen: i32,
    pub nheads: i32,
    pub chunk_size: i32,
    pub nchunks: i32,
    pub dt_softplus: i32,
    pub dt_lo: f32,
    pub dt_hi: f32,
    pub unroll16: i32,
}

/// `ssd_fwd_pass_state` (`gpu/kernels/fwd_pass_state/fused.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct FwdPassStateParams {
    pub x: u64,
    pub b: u64,
    pub dt_out: u64,
    pub da_cumsum: u64,
    pub initial_states: u64,
    pub seq_idx: u64,
    pub chunk_states: u64,
    pub final_states: u64,
    pub sizes: StateSizes,
    /// Packed sequences (batch 1): `[nseq, nheads, headdim, dstate]`, or 0.
    pub seq_init: u64,
    /// `[nchunks, 2]` `(k or -1, first token of k in the chunk)`, or 0.
    pub chunk_init: u64,
}

/// The sizes every stage-2 and stage-3 kernel takes, in this order.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct StateSizes {
    pub seqlen: i32,
    pub nheads: i32,
    pub headdim: i32,
    pub ngroups: i32,
    pub dstate: i32,
    pub chunk_size: i32,
    pub nchunks: i32,
}

impl StateSizes {
    /// The sizes of a problem (already checked by `shape::check`, so that each fits an `int`).
    pub(crate) fn new(d: &ssd_reference::Dims, o: &ssd_reference::Options) -> Self {
        use crate::runtime::int;
        StateSizes {
            seqlen: int(d.seqlen),
            nheads: int(d.nheads),
            headdim: int(d.headdim),
            ngroups: int(d.ngroups),
            dstate: int(d.dstate),
            chunk_size: int(o.chunk_size),
            nchunks: int(d.nchunks(o.chunk_size)),
        }
    }
}

/// `ssd_chunk_state_local`, `ssd_chunk_state_local_wide` (`fwd_pass_state/local.cu`) and
/// `ssd_chunk_state_local_pair` (`fwd_pass_state/pair.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct ChunkStateLocalParams {
    pub x: u64,
    pub b: u64,
    pub dt_out: u64,
    pub da_cumsum: u64,
    pub seq_idx: u64,
    pub chunk_states: u64,
    pub sizes: StateSizes,
}

/// `ssd_state_passing` (`fwd_pass_state/passing.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct StatePassingParams {
    pub da_cumsum: u64,
    pub initial_states: u64,
    pub seq_idx: u64,
    pub chunk_states: u64,
    pub final_states: u64,
    pub seqlen: i32,
    pub nheads: i32,
    pub headdim: i32,
    pub dstate: i32,
    pub chunk_size: i32,
    pub nchunks: i32,
    pub vec4: i32,
    /// 1: `chunk_states` is not written (bf16 outputs that do not keep it: `states_lo` is
    /// written, and `chunk_states` keeps each chunk's own state as 2a left it); else 0.
    pub lean: i32,
    /// Packed sequences (batch 1): `[nseq, nheads, headdim, dstate]`, or 0.
    pub seq_init: u64,
    /// `[nchunks, 2]` `(k or -1, first token of k in the chunk)`, or 0.
    pub chunk_init: u64,
    /// With bf16 activations: `chunk_states` rounded to bf16, written beside it; else 0.
    pub states_lo: u64,
}

/// `ssd_chunk_cb` (`compute_out/scores.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct ChunkCbParams {
    pub b: u64,
    pub c: u64,
    pub cbuf: u64,
    pub seqlen: i32,
    pub ngroups: i32,
    pub dstate: i32,
    pub chunk_size: i32,
    pub nchunks: i32,
    pub tmax: i32,
    pub vec: i32,
}

/// `ssd_compute_out` (`compute_out/fused.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct ComputeOutParams {
    pub x: u64,
    pub b: u64,
    pub c: u64,
    pub d: u64,
    pub z: u64,
    pub dt_out: u64,
    pub da_cumsum: u64,
    pub chunk_states: u64,
    pub seq_idx: u64,
    pub out: u64,
    pub sizes: StateSizes,
    pub d_per_channel: i32,
    pub has_initial_states: i32,
}

/// `ssd_compute_out_cb`, `ssd_compute_out_cb128` (`compute_out/tiled.cu`) and
/// `ssd_compute_out_pair` (`compute_out/pair.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct ComputeOutCbParams {
    pub x: u64,
    pub c: u64,
    pub d: u64,
    pub z: u64,
    pub dt_out: u64,
    pub da_cumsum: u64,
    pub chunk_states: u64,
    pub seq_idx: u64,
    pub cbuf: u64,
    pub out: u64,
    pub sizes: StateSizes,
    pub d_per_channel: i32,
    pub has_initial_states: i32,
    pub tmax: i32,
    pub vec: i32,
}

/// `ssd_compute_out_wg_bf16` (`compute_out/wg_bf16.cu`): five TMA descriptors first (x, C, B
/// and the states' bf16 copy read, out written), then the buffers read directly.
#[repr(C, align(128))]
#[derive(Debug, Clone, Copy)]
pub(crate) struct ComputeOutWgParams {
    pub tm_x: cudarc::driver::sys::CUtensorMap,
    pub tm_c: cudarc::driver::sys::CUtensorMap,
    pub tm_b: cudarc::driver::sys::CUtensorMap,
    pub tm_s: cudarc::driver::sys::CUtensorMap,
    pub tm_out: cudarc::driver::sys::CUtensorMap,
    pub d: u64,
    pub z: u64,
    pub dt_out: u64,
    pub da_cumsum: u64,
    pub sizes: StateSizes,
    pub d_per_channel: i32,
    pub has_initial_states: i32,
    pub batch: i32,
}

/// `ssd_seq_init_out` (`serving.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct SeqInitOutParams {
    pub c: u64,
    pub z: u64,
    pub da_cumsum: u64,
    pub seq_init: u64,
    pub ranges: u64,
    pub out: u64,
    pub sizes: StateSizes,
    pub nranges: i32,
}

/// `ssd_states_at` (`serving.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct StatesAtParams {
    pub x: u64,
    pub b: u64,
    pub dt_out: u64,
    pub da_cumsum: u64,
    pub chunk_states: u64,
    pub init: u64,
    pub targets: u64,
    pub states: u64,
    pub sizes: StateSizes,
    pub ntargets: i32,
}

/// `ssd_widen_bf16` and `ssd_narrow_bf16` (`convert.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConvertParams {
    pub src: u64,
    pub dst: u64,
    pub n: i64,
}

/// `ssd_state_chained` and `ssd_state_chained_bf16` (`fwd_pass_state/chained.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct StateChainedParams {
    pub x: u64,
    pub b: u64,
    pub dt_out: u64,
    pub da_cumsum: u64,
    pub initial_states: u64,
    pub seq_idx: u64,
    /// 0 with bf16 activations where the outputs do not keep `chunk_states`.
    pub chunk_states: u64,
    /// Also the chains' running state, overwritten chunk by chunk.
    pub final_states: u64,
    pub chain: u64,
    pub sizes: StateSizes,
    pub batch: i32,
    /// With bf16 activations: `chunk_states` rounded to bf16, written beside it; else 0.
    pub states_lo: u64,
}

/// The segmented walk's kernels (`ssd_state_walk_seg_1`, `ssd_state_walk_seg_bf16_1` and
/// `ssd_state_walk_seg_combine`, `fwd_pass_state/walk.cu`): the walking kernels' struct, with
/// `chunk_states` always given (the phases' scratch), and the segments.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct StateWalkSegParams {
    pub walk: StateChainedParams,
    /// Chunks per segment (the last segment holds the rest).
    pub seg_chunks: i32,
    /// Segments per unit.
    pub nseg: i32,
    /// 0: each segment's own end state; 1: the walk from the true start states.
    pub phase: i32,
    /// 1: phase 1 writes every chunk's f32 state to `chunk_states`; 0: the bf16 copy alone.
    pub keep: i32,
}

// SAFETY: plain `#[repr(C)]` structs of integers and floats, laid out like their C twins (the
// sizes are asserted below, in the C source and against the loaded module).
unsafe impl DeviceRepr for ChunkCumsumParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for FwdPassStateParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for ChunkStateLocalParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for StatePassingParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for ChunkCbParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for ComputeOutParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for ComputeOutCbParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for SeqInitOutParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for StatesAtParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for ConvertParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for StateChainedParams {}
// SAFETY: as above.
unsafe impl DeviceRepr for StateWalkSegParams {}
// SAFETY: as above; the descriptors are 128-byte opaque words (CUtensorMap), 128-byte aligned
// in the struct as in the C twin, and the kernel takes the struct as a __grid_constant__.
unsafe impl DeviceRepr for ComputeOutWgParams {}

const _: () = {
    use std::mem::size_of;
    // The same numbers as the `static_assert`s of the C structs.
    assert!(size_of::<ChunkCumsumParams>() == 80);
    assert!(size_of::<FwdPassStateParams>() == 112);
    assert!(size_of::<ChunkStateLocalParams>() == 80);
    assert!(size_of::<StatePassingParams>() == 96);
    assert!(size_of::<ChunkCbParams>() == 56);
    assert!(size_of::<ComputeOutParams>() == 120);
    assert!(size_of::<ComputeOutCbParams>() == 128);
    assert!(size_of::<SeqInitOutParams>() == 80);
    assert!(size_of::<StatesAtParams>() == 96);
    assert!(size_of::<ConvertParams>() == 24);
    assert!(size_of::<StateChainedParams>() == 112);
    assert!(size_of::<StateWalkSegParams>() == 128);
    assert!(size_of::<ComputeOutWgParams>() == 768);
};
