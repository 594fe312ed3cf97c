//! Verification for the Mamba-2 SSD forward: fixture cases, tolerance model, and the library
//! side of the `ssd-oracle` command line.
//!
//! - [`fixture`]: read and write cases (`ssd-fixture/1`: a JSON manifest plus a safetensors
//!   file) and any tensor file, such as a kernel's output under test.
//! - [`error`]: the crate's one error type, [`VerifyError`].

pub mod error;
pub mod fixture;

pub use error::VerifyError;
