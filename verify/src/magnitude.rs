//! Magnitudes and first-order error budgets of every output element: the input of the error
//! bound ([`crate::tolerance`]). The computation lives in the reference crate
//! ([`ssd_reference::magnitude`], where the module documentation states it), so that the
//! reference's own tests bound their comparisons with the same numbers; this module re-exports
//! it under its old path.

pub use ssd_reference::magnitude::*;

use crate::tolerance::OutputName;

impl From<OutputName> for OutputKind {
    fn from(name: OutputName) -> Self {
        match name {
            OutputName::Out => OutputKind::Out,
            OutputName::FinalStates => OutputKind::FinalStates,
            OutputName::DACumsum => OutputKind::DACumsum,
            OutputName::ChunkStates => OutputKind::ChunkStates,
            OutputName::VarlenStates => OutputKind::VarlenStates,
            OutputName::PositionStates => OutputKind::PositionStates,
            g => panic!("`{g}` is a gradient: its magnitudes are `GradMagnitudes`"),
        }
    }
}
