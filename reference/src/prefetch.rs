//! Software prefetch of the next chunk's rows for the fused schedule.
//!
//! The rows of a chunk of `x`, `B` and `C` are `nheads * headdim` or `ngroups * dstate` entries
//! apart (4 KiB at issue 2's shape): every row starts on another page, where the hardware
//! prefetchers stop, so copying a chunk's operands waits on one memory latency per row. The
//! fused schedule knows which rows the next chunk reads and asks for them into L2 while the
//! current chunk's products run; the naive path also asks for a time block's rows of `B` and
//! `C` into L1 just before it copies them.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{_MM_HINT_T0, _MM_HINT_T1};

/// Prefetches (into L2) `rows` rows of `len` entries of `data`, the first at `off`, `rs`
/// entries apart. Rows past the end of `data` are skipped.
pub(crate) fn rows<T>(data: &[T], off: usize, rs: usize, nrows: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    rows_to::<T, _MM_HINT_T1>(data, off, rs, nrows, len);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, off, rs, nrows, len);
}

/// [`rows`] into L1: for lines needed right away (L1 holds 32 KiB).
pub(crate) fn rows_l1<T>(data: &[T], off: usize, rs: usize, nrows: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    rows_to::<T, _MM_HINT_T0>(data, off, rs, nrows, len);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, off, rs, nrows, len);
}

/// Prefetches (into L2) the lines of `len` entries from `start`: an address only, never
/// dereferenced (a prefetch cannot fault), so it may point into memory that something else
/// holds mutably.
pub(crate) fn span<T>(start: *const T, len: usize) {
    #[cfg(target_arch = "x86_64")]
    span_to::<T, _MM_HINT_T1>(start, len);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (start, len);
}

#[cfg(target_arch = "x86_64")]
fn rows_to<T, const HINT: i32>(data: &[T], off: usize, rs: usize, nrows: usize, len: usize) {
    for r in 0..nrows {
        let start = off + r * rs;
        let Some(row) = data.get(start..start + len) else {
            return;
        };
        span_to::<T, HINT>(row.as_ptr(), len);
    }
}

#[cfg(target_arch = "x86_64")]
fn span_to<T, const HINT: i32>(start: *const T, len: usize) {
    const LINE: usize = 64;
    let per_line = (LINE / std::mem::size_of::<T>().max(1)).max(1);
    for k in (0..len).step_by(per_line) {
        // SAFETY: SSE, which `_mm_prefetch` requires, is part of the x86-64 baseline, so the
        // instruction exists on every x86-64 target. A prefetch is a hint: it neither reads
        // into the program nor writes, and cannot fault, so the address need not be valid.
        unsafe { std::arch::x86_64::_mm_prefetch::<HINT>(start.wrapping_add(k).cast::<i8>()) }
    }
}
