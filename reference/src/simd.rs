//! Which vector instructions the CPU code runs on: chosen at run time, not at build time.
//!
//! The crate builds for the target's baseline (plain x86-64: SSE2) and carries, for each hot
//! loop, a version compiled for AVX2 + FMA and, where it pays, one for AVX-512F, selected by
//! what the processor has ([`detected`]). Every version performs the same IEEE operations in
//! the same order (a fused multiply-add is a fused multiply-add whether it is one instruction
//! or the C library's `fma`), so every path gives the same bits; only the speed differs.
//!
//! The environment variable `SSD_SIMD` caps the instruction set, read once per process:
//! `off` (or `generic`) forces the portable code everywhere, as on a processor without AVX2;
//! `avx2` stops at AVX2 + FMA; `avx512` (or unset, empty, `auto`) takes the widest the
//! processor has. [`set_max_isa`] changes the cap from inside the process (tests compare the
//! paths with it).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

/// An instruction set the vector code is compiled for, narrowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// The target's baseline (SSE2 on x86-64), and every target other than x86-64.
    Generic = 1,
    /// AVX2 and FMA (x86-64-v3: Haswell, Zen and newer).
    Avx2 = 2,
    /// AVX-512F on top of AVX2 and FMA.
    Avx512 = 3,
}

impl Isa {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => Isa::Generic,
            2 => Isa::Avx2,
            _ => Isa::Avx512,
        }
    }

    /// The cap `SSD_SIMD` asks for (see the module documentation).
    ///
    /// # Errors
    /// A value other than those listed there, as a message naming it.
    pub fn from_env_value(value: &str) -> Result<Self, String> {
        match value.trim().to_ascii_lowercase().as_str() {
            "off" | "generic" => Ok(Isa::Generic),
            "avx2" => Ok(Isa::Avx2),
            "" | "auto" | "avx512" => Ok(Isa::Avx512),
            other => Err(format!(
                "SSD_SIMD={other:?}: expected off, generic, avx2, avx512 or auto"
            )),
        }
    }
}

/// The widest instruction set this processor runs (AVX2 counts only together with FMA).
pub fn detected() -> Isa {
    static DETECTED: OnceLock<Isa> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma");
            if avx2 && std::arch::is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if avx2 {
                return Isa::Avx2;
            }
        }
        Isa::Generic
    })
}

/// The cap: 0 until `SSD_SIMD` has been read.
static CAP: AtomicU8 = AtomicU8::new(0);

/// The instruction set the vector code runs on now: [`detected`], capped by `SSD_SIMD` and
/// [`set_max_isa`].
///
/// # Panics
/// On the first call, if `SSD_SIMD` holds a value [`Isa::from_env_value`] rejects.
#[inline]
pub fn isa() -> Isa {
    let mut cap = CAP.load(Ordering::Relaxed);
    if cap == 0 {
        let from_env = match std::env::var("SSD_SIMD") {
            Ok(v) => Isa::from_env_value(&v).unwrap_or_else(|e| panic!("{e}")),
            Err(_) => Isa::Avx512,
        };
        // A concurrent set_max_isa wins over the environment.
        cap = match CAP.compare_exchange(0, from_env as u8, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => from_env as u8,
            Err(set) => set,
        };
    }
    detected().min(Isa::from_u8(cap))
}

/// Caps the instruction set for the rest of the process (or until the next call), whatever
/// `SSD_SIMD` says: `Isa::Generic` runs the portable code, `Isa::Avx512` lifts the cap. The
/// results do not change (see the module documentation), so a call while other threads
/// compute only changes the speed of what they do next.
pub fn set_max_isa(cap: Isa) {
    CAP.store(cap as u8, Ordering::Relaxed);
}

/// Defines `fn $name<generics>(args) -> ret { body }` twice: as written (the portable version)
/// and compiled for AVX2 + FMA, and calls the second where [`isa`] allows it. The body is
/// inlined into both, and with it every `#[inline(always)]` function it calls; a function it
/// calls that is not inlined runs as compiled on its own (with its own dispatch, where it has
/// one). Arguments are plain identifiers; the generics go in square brackets.
macro_rules! multiversion {
    ($(#[$attr:meta])* $vis:vis fn $name:ident [$($gen:tt)*] ($($arg:ident: $ty:ty),* $(,)?)
        $(-> $ret:ty)? $body:block) => {
        $(#[$attr])*
        $vis fn $name<$($gen)*>($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn body<$($gen)*>($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            if $crate::simd::isa() >= $crate::simd::Isa::Avx2 {
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn avx2<$($gen)*>($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                // SAFETY: the processor has AVX2 and FMA (`isa` never exceeds `detected`).
                return unsafe { avx2($($arg),*) };
            }
            body($($arg),*)
        }
    };
}
pub(crate) use multiversion;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_values() {
        assert_eq!(Isa::from_env_value("off"), Ok(Isa::Generic));
        assert_eq!(Isa::from_env_value(" OFF "), Ok(Isa::Generic));
        assert_eq!(Isa::from_env_value("generic"), Ok(Isa::Generic));
        assert_eq!(Isa::from_env_value("avx2"), Ok(Isa::Avx2));
        assert_eq!(Isa::from_env_value("avx512"), Ok(Isa::Avx512));
        assert_eq!(Isa::from_env_value(""), Ok(Isa::Avx512));
        assert_eq!(Isa::from_env_value("auto"), Ok(Isa::Avx512));
        assert!(Isa::from_env_value("sse").is_err());
        assert!(isa() <= detected());
    }
}
