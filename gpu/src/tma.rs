//! Tensor-memory-access descriptors (`CUtensorMap`) for the Hopper kernels: a bf16 tensor seen
//! as a 3-D array, copied by the kernel in boxes of 64 x 64 x 1 elements with the 128-byte
//! swizzle (the layout the `wgmma` descriptors of `gpu/kernels/ptx.cuh` read).

use std::ffi::c_void;

use cudarc::driver::sys::{
    self, CUtensorMap, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave,
    CUtensorMapL2promotion, CUtensorMapSwizzle,
};

use crate::GpuError;

/// The descriptor of the bf16 array at device address `addr` with `dims` elements along each
/// axis (innermost first) and `strides` bytes between consecutive indices of axes 1 and 2,
/// read in boxes of 64 x 64 x 1 with the 128-byte swizzle; elements outside `dims` arrive as
/// zeros.
///
/// # Errors
/// [`GpuError::Unsupported`] when the driver refuses the layout (an address or stride not a
/// multiple of 16 bytes, a dimension beyond 2^32); [`GpuError::NoDriver`] when the driver has
/// no such entry point (before CUDA 12).
pub(crate) fn bf16_boxes_64(
    addr: u64,
    dims: [u64; 3],
    strides: [u64; 2],
) -> Result<CUtensorMap, GpuError> {
    let mut map = CUtensorMap { opaque: [0; 16] };
    let boxes = [64u32, 64, 1];
    let element_strides = [1u32, 1, 1];
    let encode = || {
        // SAFETY: every pointer is to a live local array of the rank's length (3 dims, 2 strides,
        // 3 box sizes, 3 element strides) and `map` is a writable CUtensorMap; the driver only
        // encodes the address, it does not access the memory.
        unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map,
                CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                3,
                addr as *mut c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                element_strides.as_ptr(),
                CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        }
    };
    // cudarc panics when the loaded driver lacks the symbol.
    let status = std::panic::catch_unwind(std::panic::AssertUnwindSafe(encode))
        .map_err(|_| GpuError::NoDriver("the driver has no cuTensorMapEncodeTiled".into()))?;
    status.result().map_err(|e| {
        GpuError::Unsupported(format!(
            "the driver refused a tensor map (dims {dims:?}, strides {strides:?}): {e:?}"
        ))
    })?;
    Ok(map)
}
