//! Software prefetch of the next chunk's rows for the fused schedule.
//!
//! The rows of a chunk of `x`, `B` and `C` are `nheads * headdim` or `ngroups * dstate` entries
//! apart (4 KiB at issue 2's shape): every row starts on another page, where the hardware
//! prefetchers stop, so copying a chunk's operands waits on one memory latency per row. The
//! fused schedule knows which rows the next chunk reads and asks for them into L2 while the
//! current chunk's products run.

/// Prefetches (into L2) `rows` rows of `len` entries of `data`, the first at `off`, `rs`
/// entries apart. Rows past the end of `data` are skipped.
pub(crate) fn rows<T>(data: &[T], off: usize, rs: usize, nrows: usize, len: usize) {
    for r in 0..nrows {
        let start = off + r * rs;
        let Some(row) = data.get(start..start + len) else {
            return;
        };
        span(row.as_ptr(), len);
    }
}

/// Prefetches (into L2) the lines of `len` entries from `start`: an address only, never
/// dereferenced (a prefetch cannot fault), so it may point into memory that something else
/// holds mutably.
pub(crate) fn span<T>(start: *const T, len: usize) {
    const LINE: usize = 64;
    let per_line = (LINE / std::mem::size_of::<T>().max(1)).max(1);
    for k in (0..len).step_by(per_line) {
        line_at(start.wrapping_add(k));
    }
}

/// Prefetches the cache line holding the address `p` into L2 (not dereferenced).
#[inline(always)]
fn line_at<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        // SAFETY: SSE, which `_mm_prefetch` requires, is part of the x86-64 baseline, so the
        // instruction exists on every x86-64 target. A prefetch is a hint: it neither reads
        // into the program nor writes, and cannot fault, so `p` need not be valid.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p.cast::<i8>()) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}
