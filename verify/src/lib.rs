//! Verification for the Mamba-2 SSD forward: fixture cases, tolerance model, and the library
//! side of the `ssd-oracle` command line.
//!
//! - [`fixture`]: read and write cases (`ssd-fixture/1`: a JSON manifest plus a safetensors
//!   file) and any tensor file, such as a kernel's output under test.
//! - [`error`]: the crate's one error type, [`VerifyError`].
//! - [`tolerance`]: the error model (per-element bounds) and the comparison of a candidate's
//!   outputs with the float64 reference; [`magnitude`] computes its magnitudes.
//! - [`fuzz`]: seeded random cases over every size and option, and the harness that checks an
//!   implementation on them (failures shrunk to small cases).
//! - [`suites`]: the fixture suites `ssd-oracle gen` writes.
//! - [`report`]: the checker's report (table and JSON), shared by every front end;
//!   [`diagnose`] its failure map and hints, [`plot`] the map's picture.

pub mod diagnose;
pub mod error;
pub mod fixture;
pub mod fuzz;
pub mod magnitude;
pub mod plot;
pub mod report;
pub mod suites;
pub mod tolerance;

pub use error::VerifyError;
