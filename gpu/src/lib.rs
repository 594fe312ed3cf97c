//! CUDA kernels for the Mamba-2 SSD forward (mamba_ssm 2.3.2.post1's
//! `mamba_chunk_scan_combined`), f32 inputs, TF32 tensor-core products with f32 accumulation.
//!
//! Three kernels, the stages of the chunked jump formula (`docs/math.md`), as the CPU
//! reference's [`ssd_reference::chunked`] runs them:
//! 1. [`Gpu::chunk_cumsum`]: `dt' = clamp(softplus?(dt + dt_bias), lo, hi)` and
//!    `dA_cumsum`, the within-chunk inclusive cumsum of `dt' * A`;
//! 2. [`Gpu::fwd_pass_state`]: each chunk's state as one matrix product, carried across the
//!    chunks in order -> `chunk_states` (the state entering each chunk), `final_states`;
//! 3. [`Gpu::compute_out`]: the carried-state term, the causally masked and decayed
//!    `C B^T` times `dt' x` built tile by tile on chip, the `D` skip and the `z` gate -> `out`.
//!
//! By default the kernels are version 3, validated on the H200: version 2 (stages 2 and 3 in
//! two kernels each: a parallel per-chunk state product and a per-element pass across chunks;
//! the scores `C B^T` once per group, then a cp.async pipelined output kernel), with stage 2
//! in one kernel chained over the chunks where the shape fills the device
//! ([`Gpu::uses_chained`]): each block computes its chunk's own state in registers and hands
//! the running state on to the next chunk's block through L2, with the same bits as version 2.
//! [`Variant::V2`] (the stage-by-stage kernels), [`Variant::V2Unpaired`] and [`Variant::V1`]
//! (one kernel per stage) are kept for comparison: pass a [`GpuConfig`] to
//! [`Gpu::with_config`]. The crate reads the environment in two places only: when asked
//! ([`GpuConfig::from_env`], for the command-line tools), and the development variable
//! [`kernels::NVRTC_OPTIONS_ENV`] (extra NVRTC options, said on standard error when set).
//!
//! Packed sequences (serving: `cu_seqlens`, one initial state per sequence, each sequence's
//! final state, states at listed tokens) run through the same stages plus two small kernels:
//! [`forward_packed`], or [`Gpu::upload_packed`] and [`Gpu::forward_packed_into`].
//!
//! Two ways in:
//! - host side: [`forward`] (or [`Gpu::forward`]) takes a validated
//!   [`ssd_reference::Problem<f32>`] and returns a [`ssd_reference::ChunkedOutput<f32>`];
//! - device side, for kernel authors who chain calls: [`Gpu::upload`] or your own
//!   [`DeviceInputs`], then [`Gpu::forward_into`] (or one stage at a time) into
//!   [`DeviceOutputs`] that stay on the device.
//!
//! The crate builds without any CUDA installation; the driver (`libcuda`) and NVRTC
//! (`libnvrtc`) are loaded at run time, and their absence is an error ([`GpuError::NoDriver`]),
//! never a panic. The kernels (`gpu/kernels/`, one parameter struct and one [`Kernel`] entry
//! each) are compiled by NVRTC once per process for
//! the device's target (`sm_90a` on Hopper, `compute_80` PTX on other devices of compute
//! capability 8.0 or newer). Limits: [`MAX_DSTATE`], [`MAX_CHUNK_SIZE`]; any `headdim`,
//! `seqlen`, `ngroups`. Results are bitwise reproducible (fixed summation order; the one
//! atomic, the chained stage 2's block ticket, orders blocks and never touches a value).
//! `docs/gpu.md` in the repository has the details.

mod chunk_cumsum;
mod compute_out;
mod error;
mod fwd_pass_state;
mod host;
mod io;
pub mod kernels;
mod params;
mod runtime;
mod serving;
mod shape;
mod tma;

pub use error::GpuError;
pub use host::{default_gpu, forward, forward_bf16, forward_packed, gpu_for};
pub use io::{Bf16, IoElement};
pub use kernels::Kernel;
pub use runtime::{
    driver_present, DeviceInputs, DeviceOutputs, Gpu, GpuConfig, StateWalk, Variant,
};
pub use serving::{DevicePacking, DeviceServingOutputs};
pub use shape::{check as check_shape, seq_idx_to_i32, Lengths, MAX_CHUNK_SIZE, MAX_DSTATE};
