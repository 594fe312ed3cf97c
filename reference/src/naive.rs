//! The naive time-step recurrence (the ground truth). STUB: to be implemented.
use crate::{Output, Problem, Real};

/// Runs the recurrence token by token, parallel over (batch, head).
pub fn forward<T: Real>(p: &Problem<T>) -> Output<T> {
    let _ = p;
    todo!("naive recurrence")
}
