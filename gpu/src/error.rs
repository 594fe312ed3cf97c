//! The one error type of this crate.

use cudarc::driver::{result::DriverError, sys::CUresult};

/// Everything that can go wrong on the GPU path. Nothing in this crate panics on bad input or a
/// missing GPU: every failure comes back as one of these.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// The CUDA driver library (`libcuda`) or the NVRTC library (`libnvrtc`) cannot be loaded.
    #[error("no CUDA driver: {0}")]
    NoDriver(String),
    /// The driver loaded but there is no usable device (none at all, or the ordinal is out of
    /// range, or its compute capability is below 8.0, which the TF32 tensor cores need).
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    /// NVRTC refused the kernels; `log` is its full log, `source` its error.
    #[error("NVRTC failed to compile the SSD kernels for {arch}:\n{log}")]
    Compile {
        arch: String,
        log: String,
        #[source]
        source: cudarc::nvrtc::CompileError,
    },
    /// A device allocation failed (the driver's error kept as the source).
    #[error("out of GPU memory: {0}")]
    OutOfMemory(#[source] DriverError),
    /// Sizes or options the kernels do not support, or device buffers whose lengths do not
    /// match the sizes; the message says which and why.
    #[error("unsupported shape: {0}")]
    Unsupported(String),
    /// Any other CUDA driver error (a fault reported at synchronisation, ...), kept as the
    /// source.
    #[error("CUDA driver error: {0}")]
    Driver(#[source] DriverError),
    /// The host and the loaded kernels disagree (a parameter struct or layout of the wrong
    /// size, a downloaded buffer of the wrong length): a bug of this crate, never of the input.
    #[error("internal error: {0}")]
    Internal(String),
    /// The driver refused to launch a kernel, or reported an earlier asynchronous error there
    /// (`pending`: before this launch was asked for).
    #[error("CUDA driver error at the launch of {kernel}{}", if *.pending { " (pending from earlier)" } else { "" })]
    Launch {
        kernel: &'static str,
        pending: bool,
        #[source]
        source: DriverError,
    },
}

impl From<DriverError> for GpuError {
    fn from(e: DriverError) -> Self {
        match e.0 {
            CUresult::CUDA_ERROR_OUT_OF_MEMORY => GpuError::OutOfMemory(e),
            CUresult::CUDA_ERROR_NO_DEVICE | CUresult::CUDA_ERROR_INVALID_DEVICE => {
                GpuError::NoDevice(format!("{e:?}"))
            }
            _ => GpuError::Driver(e),
        }
    }
}

/// Shorthand for [`GpuError::Unsupported`].
pub(crate) fn unsupported(msg: impl Into<String>) -> GpuError {
    GpuError::Unsupported(msg.into())
}
