// The kernel sources, included as they are, in the order NVRTC compiles them (SOURCE_FILES in
// gpu/src/kernels.rs, which a unit test keeps equal to this list), with emu.h in place of
// kernels/ptx.cuh: the inline PTX is all there, and emu.h emulates each of its helpers.
#include "emu.h"
#include "../kernels/common.cuh"
#include "../kernels/chunk_cumsum.cu"
#include "../kernels/fwd_pass_state/tiles.cuh"
#include "../kernels/fwd_pass_state/fused.cu"
#include "../kernels/fwd_pass_state/local.cu"
#include "../kernels/fwd_pass_state/pair.cu"
#include "../kernels/fwd_pass_state/passing.cu"
#include "../kernels/compute_out/tiles.cuh"
#include "../kernels/compute_out/fused.cu"
#include "../kernels/compute_out/scores.cu"
#include "../kernels/compute_out/tiled.cu"
#include "../kernels/compute_out/pair.cu"
#include "../kernels/serving.cu"
