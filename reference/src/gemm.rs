//! The small matrix products of the chunked path: `c (+)= a b` with `a` of any strides, `b`
//! with contiguous rows, `c` row-major, and an optional triangular restriction.
//!
//! The operands of the chunked path are at most `chunk_size x max(chunk_size, headdim,
//! dstate)` and sit in cache; a general-purpose GEMM spends as much time re-packing such
//! operands as multiplying them. This one reads them in place: it walks `c` in register tiles
//! of 4 rows by up to three AVX2 vectors (4 x 12 for f64, 4 x 24 for f32: twelve independent
//! accumulators) or, where the processor has AVX-512 (detected at run time, [`Kernels`]), up
//! to four AVX-512 vectors (4 x 32 for f64, 4 x 64 for f32: sixteen accumulators),
//! broadcasting `a[i, k]` and loading `b[k, j..j + NR]`: intrinsics where the processor has
//! AVX2 and FMA ([`crate::simd::isa`]), a generic loop otherwise.
//!
//! Every entry is `sum_k a[i, k] b[k, j]` accumulated by one fused multiply-add per `k`, in
//! increasing `k`, starting from 0; the [`Epilogue`] then stores that sum, or combines it with
//! the old `c[i, j]` or a row factor (one more rounding). The result does not depend on the
//! tile sizes, and is the same as storing the sum and applying the epilogue in a later pass.

use crate::Real;

/// A read-only matrix inside a flat slice: entry `(i, k)` is `data[off + i * rs + k * cs]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mat<'a, T> {
    pub data: &'a [T],
    pub off: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a, T> Mat<'a, T> {
    /// A row-major matrix with `cols` columns occupying all of `data`.
    pub fn rows(data: &'a [T], cols: usize) -> Self {
        Mat {
            data,
            off: 0,
            rs: cols,
            cs: 1,
        }
    }
}

/// Which part of the product is needed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tri {
    /// All of `c`.
    Full,
    /// `a` is lower triangular (`a[i, k] = 0` for `k > i`): the row tile `[i0, i0 + MR)` stops
    /// at `k = i0 + MR`, skipping only products with exact zeros.
    LowerA,
    /// Only `c[i, j]` with `j <= i` is wanted: the row tile `[i0, i0 + MR)` computes the column
    /// tiles that reach column `i0 + MR - 1` and leaves the rest of its rows untouched (entries
    /// just right of the diagonal may be computed or not).
    LowerC,
}

/// What a product does with each sum `s = sum_k a[i, k] b[k, j]` (one rounding each, so the
/// bits are those of storing `s` and applying the same operation in a later pass over `c`).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Epilogue<'a, T> {
    /// `c[i, j] = s`
    Store,
    /// `c[i, j] = c[i, j] + s`
    Add,
    /// `c[i, j] = f c[i, j] + s` (one fused multiply-add): a decayed state plus a chunk's own.
    ScaleAdd(T),
    /// `c[i, j] = s f[i]` (`f` has an entry per row of `c`).
    ScaleRows(&'a [T]),
}

impl<T: Real> Epilogue<'_, T> {
    /// The new `c[i, j]` from the old one and the sum (row `i`).
    #[inline(always)]
    fn apply(&self, old: T, s: T, i: usize) -> T {
        match *self {
            Epilogue::Store => s,
            Epilogue::Add => old + s,
            Epilogue::ScaleAdd(f) => f.mul_add(old, s),
            Epilogue::ScaleRows(f) => s * f[i],
        }
    }
}

/// The register-tile kernels a product runs on: a generic loop, AVX2 (16 vector registers of
/// 256 bits) or AVX-512 (32 registers of 512 bits), as the processor allows (detected at run
/// time). All compute every entry by the same fused multiply-adds in the same order: the same
/// bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Kernels {
    /// The generic loop, compiled for the target's baseline (`mul_add` may be a library call).
    Generic,
    /// 4-row tiles of 3, 2 and 1 AVX2 vectors (f64: 12, 8, 4 columns).
    Avx2,
    /// 4-row tiles of 4, 2 and 1 AVX-512 vectors (f64: 32, 16, 8 columns: sixteen
    /// accumulators, which AVX2's 16 registers cannot hold with their operands), then one
    /// AVX2 vector. At 64 columns of f64 the AVX2 tiles split 4 x 12 + 2 x 8, and 8-wide
    /// tiles keep fewer FMAs in flight than 12-wide ones.
    Avx512,
}

impl Kernels {
    /// The widest kernels allowed now ([`crate::simd::isa`]).
    pub(crate) fn detect() -> Self {
        match crate::simd::isa() {
            crate::simd::Isa::Generic => Kernels::Generic,
            crate::simd::Isa::Avx2 => Kernels::Avx2,
            crate::simd::Isa::Avx512 => Kernels::Avx512,
        }
    }
}

/// `c = a b`, or another [`Epilogue`], for `a` `m x k`, `b` `k x n` (`b.cs == 1`), `c` `m x n`
/// row-major with row stride `ldc`, restricted by `tri`, on the widest kernels the processor
/// runs ([`Kernels::detect`]).
///
/// # Panics
/// If `b.cs != 1`, an operand is too short for its shape, or a row factor of
/// [`Epilogue::ScaleRows`] is missing.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm<T: Real>(
    shape: (usize, usize, usize),
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    c: &mut [T],
    ldc: usize,
    epi: Epilogue<'_, T>,
    tri: Tri,
) {
    gemm_on(Kernels::detect(), shape, a, b, c, ldc, epi, tri);
}

/// [`gemm`] on the given kernels, or the widest allowed where those are wider (the tests run
/// every kernel the processor has).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_on<T: Real>(
    kernels: Kernels,
    (m, n, k): (usize, usize, usize),
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    c: &mut [T],
    ldc: usize,
    epi: Epilogue<'_, T>,
    tri: Tri,
) {
    assert_eq!(b.cs, 1, "b must have contiguous rows");
    if let Epilogue::ScaleRows(f) = epi {
        assert!(f.len() >= m, "a row factor per row of c");
    }
    let kernels = kernels.min(Kernels::detect());
    run_tiles(((m, n, k), a, b, c, ldc, epi, tri, kernels));
}

crate::simd::multiversion! {
    /// [`tiles`] for the element type and kernels, compiled for AVX2 + FMA where the processor
    /// has them (the edges' single entries and epilogues, inlined here, use `mul_add`).
    fn run_tiles[T: Real](args: TileArgs<'_, '_, T>) {
        let wide = args.7 == Kernels::Avx512;
        match (std::mem::size_of::<T>() == 8, wide) {
            (true, false) => tiles::<T, 4, 12, 8, 4, 4>(args),
            (true, true) => tiles::<T, 4, 32, 16, 8, 4>(args),
            (false, false) => tiles::<T, 4, 24, 16, 8, 8>(args),
            (false, true) => tiles::<T, 4, 64, 32, 16, 8>(args),
        }
    }
}

/// The arguments of [`tiles`]: [`gemm`]'s, and the kernels that run.
type TileArgs<'a, 'c, T> = (
    (usize, usize, usize),
    Mat<'a, T>,
    Mat<'a, T>,
    &'c mut [T],
    usize,
    Epilogue<'a, T>,
    Tri,
    Kernels,
);

/// Tiles of `MR` rows by `NR` columns (three AVX2 or four AVX-512 vectors: twelve or sixteen
/// independent accumulators), then `NRM` (two vectors: still enough accumulators to keep the
/// FMA pipes busy), then `NR2` (one vector), then `NR3` (one AVX2 vector, when `NR2` is an
/// AVX-512 one), then single entries. The split prefers two `NRM` tiles to one `NR` tile
/// followed by a latency-bound `NR2` tile: 64 columns of f64 are 4 x 12 + 2 x 8 on AVX2, not
/// 5 x 12 + 4.
///
/// Column panel by column panel, each through every row block (`Full`, `LowerA`): the panel
/// of `b` (`k x NR`, 16 KB at 64 x 32 f64) stays in L1 while the row blocks pass, where row
/// block by row block all of `b` went through L1 once per 4 rows. `LowerC`, whose column
/// range ends at each row block's diagonal, goes row block by row block.
#[inline(always)]
fn tiles<
    T: Real,
    const MR: usize,
    const NR: usize,
    const NRM: usize,
    const NR2: usize,
    const NR3: usize,
>(
    ((m, n, k), a, b, c, ldc, epi, tri, kernels): TileArgs<'_, '_, T>,
) {
    // The width of the next column tile when `rem` columns are left (None: single entries).
    let next = |rem: usize| {
        if rem == NR || rem >= NR + NRM {
            Some(NR)
        } else if rem >= NRM {
            Some(NRM)
        } else if rem >= NR2 {
            Some(NR2)
        } else if rem >= NR3 {
            Some(NR3)
        } else {
            None
        }
    };
    let tile = |panel: Panel, nr: usize, c: &mut [T]| match nr {
        _ if nr == NR => full_tiles::<T, MR, NR>(panel, a, b, c, ldc, epi, kernels),
        _ if nr == NRM => full_tiles::<T, MR, NRM>(panel, a, b, c, ldc, epi, kernels),
        _ if nr == NR2 => full_tiles::<T, MR, NR2>(panel, a, b, c, ldc, epi, kernels),
        _ => full_tiles::<T, MR, NR3>(panel, a, b, c, ldc, epi, kernels),
    };
    // Entries one at a time: the same sums.
    let single = |rows: std::ops::Range<usize>, cols: std::ops::Range<usize>, c: &mut [T]| {
        for i in rows {
            let k_end = match tri {
                Tri::Full | Tri::LowerC => k,
                Tri::LowerA => (i / MR * MR + MR).min(m).min(k),
            };
            for q in cols.clone() {
                let mut sum = T::zero();
                for kk in 0..k_end {
                    let av = a.data[a.off + i * a.rs + kk * a.cs];
                    sum = av.mul_add(b.data[b.off + kk * b.rs + q], sum);
                }
                let cv = &mut c[i * ldc + q];
                *cv = epi.apply(*cv, sum, i);
            }
        }
    };
    let full_m = m / MR * MR;
    if tri != Tri::LowerC {
        let mut j0 = 0;
        while let Some(nr) = next(n - j0) {
            tile(
                Panel {
                    i0: 0,
                    blocks: full_m / MR,
                    j0,
                    k,
                    lower_a: tri == Tri::LowerA,
                },
                nr,
                c,
            );
            j0 += nr;
        }
        single(0..full_m, j0..n, c);
        single(full_m..m, 0..n, c);
        return;
    }
    for i0 in (0..full_m).step_by(MR) {
        // column tiles up to the diagonal (a few entries right of it come along)
        let n_end = (i0 + MR).next_multiple_of(NR3).min(n);
        let mut j0 = 0;
        while let Some(nr) = next(n_end - j0) {
            let panel = Panel {
                i0,
                blocks: 1,
                j0,
                k,
                lower_a: false,
            };
            tile(panel, nr, c);
            j0 += nr;
        }
        single(i0..i0 + MR, j0..n_end, c);
    }
    let n_end = m.next_multiple_of(NR3).min(n);
    single(full_m..m, 0..n_end, c);
}

/// A column of full tiles: row blocks `i0 + MR q` (`q < blocks`) at columns `j0..j0 + NR`,
/// each summing `k` from 0 to `k` (or, with `lower_a`, to the block's last row + 1).
#[derive(Debug, Clone, Copy)]
struct Panel {
    i0: usize,
    blocks: usize,
    j0: usize,
    k: usize,
    lower_a: bool,
}

impl Panel {
    /// The end of the sum over `k` for row block `q`.
    fn k_end<const MR: usize>(&self, q: usize) -> usize {
        if self.lower_a {
            (self.i0 + MR * q + MR).min(self.k)
        } else {
            self.k
        }
    }
}

/// The full `MR x NR` tiles of a [`Panel`] of `c`: in AVX2 or AVX-512 intrinsics on those
/// kernels ([`simd`], one call for the whole panel), otherwise the loop below.
// The loop is written with index loops over a local fixed-size accumulator that nothing else
// touches: the shape in which LLVM's SLP vectoriser usually keeps the accumulators in vector
// registers.
#[inline(never)]
#[allow(clippy::needless_range_loop)]
fn full_tiles<T: Real, const MR: usize, const NR: usize>(
    panel: Panel,
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    c: &mut [T],
    ldc: usize,
    epi: Epilogue<'_, T>,
    kernels: Kernels,
) {
    #[cfg(target_arch = "x86_64")]
    if MR == 4 && kernels != Kernels::Generic {
        // SAFETY: the processor has AVX2 and FMA (`kernels` never exceeds
        // [`Kernels::detect`]), and AVX-512F where `kernels` is `Avx512`.
        if unsafe { full_tiles_x86::<T, NR>(panel, a, b, c, ldc, epi, kernels) } {
            return;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = kernels;
    let j0 = panel.j0;
    for q in 0..panel.blocks {
        let i0 = panel.i0 + MR * q;
        let mut acc = [[T::zero(); NR]; MR];
        for kk in 0..panel.k_end::<MR>(q) {
            let bo = b.off + kk * b.rs + j0;
            let brow: &[T; NR] = b.data[bo..bo + NR].try_into().expect("NR entries");
            for r in 0..MR {
                let av = a.data[a.off + (i0 + r) * a.rs + kk * a.cs];
                for q in 0..NR {
                    acc[r][q] = av.mul_add(brow[q], acc[r][q]);
                }
            }
        }
        for r in 0..MR {
            let co = (i0 + r) * ldc + j0;
            let crow: &mut [T; NR] = (&mut c[co..co + NR]).try_into().expect("NR entries");
            for q in 0..NR {
                crow[q] = epi.apply(crow[q], acc[r][q], i0 + r);
            }
        }
    }
}

/// [`simd::full_tiles`] compiled for AVX2 + FMA, so that the AVX2 tile kernels are inlined
/// into it (one function per panel, as the generic loop).
///
/// # Safety
/// The processor must have AVX2 and FMA, and AVX-512F where `kernels` is `Avx512`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline(never)]
#[allow(clippy::too_many_arguments)]
unsafe fn full_tiles_x86<T: Real, const NR: usize>(
    panel: Panel,
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    c: &mut [T],
    ldc: usize,
    epi: Epilogue<'_, T>,
    kernels: Kernels,
) -> bool {
    simd::full_tiles(panel, a, b, c, ldc, epi, (NR, kernels == Kernels::Avx512))
}

/// The full tiles in AVX2 + FMA (or AVX-512F) intrinsics, for f64 and f32: the same fused
/// multiply-adds in the same order as the generic loop (so the same bits), with the
/// accumulators in registers and no bounds checks inside the `k` loop (one check of the
/// tile's extent before it). The generic loop relies on LLVM's SLP vectoriser, which does not
/// always keep the accumulators in vector registers, and checks every index of `a`. Called
/// only where the processor has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
mod simd {
    use super::{Epilogue, Mat, Panel};
    use crate::Real;
    use std::any::TypeId;
    use std::arch::x86_64::{
        __m256, __m256d, __m512, __m512d, _mm256_add_pd, _mm256_add_ps, _mm256_broadcast_sd,
        _mm256_broadcast_ss, _mm256_fmadd_pd, _mm256_fmadd_ps, _mm256_loadu_pd, _mm256_loadu_ps,
        _mm256_mul_pd, _mm256_mul_ps, _mm256_setzero_pd, _mm256_setzero_ps, _mm256_storeu_pd,
        _mm256_storeu_ps, _mm512_add_pd, _mm512_add_ps, _mm512_fmadd_pd, _mm512_fmadd_ps,
        _mm512_loadu_pd, _mm512_loadu_ps, _mm512_mul_pd, _mm512_mul_ps, _mm512_set1_pd,
        _mm512_set1_ps, _mm512_setzero_pd, _mm512_setzero_ps, _mm512_storeu_pd, _mm512_storeu_ps,
    };

    /// The `4 x nr` tiles of a panel of `c` (see [`super::full_tiles`]) when `T` is f64 or f32
    /// and `nr` is 1, 2 or 3 AVX2 vectors (1, 2 or 4 AVX-512 ones where `wide`); returns false
    /// (nothing done) otherwise. The caller has checked that the processor has AVX2 and FMA
    /// (and AVX-512F where `wide`).
    ///
    /// # Panics
    /// If an operand is too short for the tile.
    #[inline(always)]
    pub(super) fn full_tiles<T: Real>(
        panel: Panel,
        a: Mat<'_, T>,
        b: Mat<'_, T>,
        c: &mut [T],
        ldc: usize,
        epi: Epilogue<'_, T>,
        (nr, wide): (usize, bool),
    ) -> bool {
        let f64_elems = if TypeId::of::<T>() == TypeId::of::<f64>() {
            true
        } else if TypeId::of::<T>() == TypeId::of::<f32>() {
            false
        } else {
            return false;
        };
        // AVX-512 vectors (where `wide`: the processor has AVX-512F) for 1, 2 or 4 of them,
        // AVX2 vectors for 1 to 3.
        let lanes_512 = if f64_elems { 8 } else { 16 };
        let lanes = if f64_elems { 4 } else { 8 };
        let zmm = wide && nr.is_multiple_of(lanes_512) && [1, 2, 4].contains(&(nr / lanes_512));
        if !zmm && (!nr.is_multiple_of(lanes) || !(1..=3).contains(&(nr / lanes))) {
            return false;
        }
        let Panel { i0, blocks, j0, .. } = panel;
        if blocks == 0 {
            return true;
        }
        // The last row block reaches furthest in a, b and c (its sum runs longest); empty
        // sums (k = 0) are left to the generic loop.
        let (i_last, k_last) = (i0 + 4 * blocks - 4, panel.k_end::<4>(blocks - 1));
        if k_last == 0 {
            return false;
        }
        // The extent of every read and write below, checked once.
        let a_last = a.off + (i_last + 3) * a.rs + (k_last - 1) * a.cs;
        assert!(a_last < a.data.len(), "a too short for the tiles");
        assert!(
            b.off + (k_last - 1) * b.rs + j0 + nr <= b.data.len(),
            "b too short"
        );
        assert!((i_last + 3) * ldc + j0 + nr <= c.len(), "c too short");
        let a_p = a.data[a.off + i0 * a.rs..].as_ptr();
        let b_p = b.data[b.off + j0..].as_ptr();
        let c_p = c[i0 * ldc + j0..].as_mut_ptr();
        let g = Geometry {
            a_rs: a.rs,
            a_cs: a.cs,
            b_rs: b.rs,
            ldc,
            blocks,
            k: panel.k,
            lower_a: panel.lower_a,
            row0: i0,
            epi: match &epi {
                Epilogue::Store => Epi::Store,
                Epilogue::Add => Epi::Add,
                Epilogue::ScaleAdd(f) => Epi::ScaleAdd(std::ptr::from_ref(f).cast()),
                Epilogue::ScaleRows(f) => Epi::ScaleRows(f[i0..i0 + 4 * blocks].as_ptr().cast()),
            },
        };
        // SAFETY: `T` is the element type of the vector chosen (f64 or f32, by `f64_elems`),
        // so the casts keep the element type; every offset the kernel forms lies within the
        // extents asserted above (rows i0..i_last + 4 of a up to column k_last - 1, rows
        // 0..k_last of b and the same rows of c over nr columns, a whole number of vectors;
        // each block's sum ends at or before k_last). The processor has AVX2 and FMA (the
        // caller's contract); the AVX-512 kernels run only where `wide` says it has
        // AVX-512F (detected at run time, [`super::Kernels::detect`]).
        unsafe {
            match (f64_elems, zmm, nr / if zmm { lanes_512 } else { lanes }) {
                (true, true, 1) => tile_512::<__m512d, 1>(a_p.cast(), b_p.cast(), c_p.cast(), &g),
                (true, true, 2) => tile_512::<__m512d, 2>(a_p.cast(), b_p.cast(), c_p.cast(), &g),
                (true, true, _) => tile_512::<__m512d, 4>(a_p.cast(), b_p.cast(), c_p.cast(), &g),
                (false, true, 1) => tile_512::<__m512, 1>(a_p.cast(), b_p.cast(), c_p.cast(), &g),
                (false, true, 2) => tile_512::<__m512, 2>(a_p.cast(), b_p.cast(), c_p.cast(), &g),
                (false, true, _) => tile_512::<__m512, 4>(a_p.cast(), b_p.cast(), c_p.cast(), &g),
                (true, false, 1) => tile::<__m256d, 1>(a_p.cast(), b_p.cast(), c_p.cast(), &g),
                (true, false, 2) => tile::<__m256d, 2>(a_p.cast(), b_p.cast(), c_p.cast(), &g),
                (true, false, _) => tile::<__m256d, 3>(a_p.cast(), b_p.cast(), c_p.cast(), &g),
                (false, false, 1) => tile::<__m256, 1>(a_p.cast(), b_p.cast(), c_p.cast(), &g),
                (false, false, 2) => tile::<__m256, 2>(a_p.cast(), b_p.cast(), c_p.cast(), &g),
                (false, false, _) => tile::<__m256, 3>(a_p.cast(), b_p.cast(), c_p.cast(), &g),
            }
        }
        true
    }

    struct Geometry {
        a_rs: usize,
        a_cs: usize,
        b_rs: usize,
        ldc: usize,
        /// Row blocks of 4, one after the other.
        blocks: usize,
        /// The sum runs over `0..k`, or with `lower_a` over `0..min(block's rows end, k)`.
        k: usize,
        lower_a: bool,
        /// The first block's first row (for `lower_a`).
        row0: usize,
        epi: Epi,
    }

    /// [`Epilogue`] for the kernels, its factors by address (of the element type of the
    /// kernel's vectors): the factor of `ScaleAdd`, the tile's first row's of `ScaleRows`.
    #[derive(Clone, Copy)]
    enum Epi {
        Store,
        Add,
        ScaleAdd(*const ()),
        ScaleRows(*const ()),
    }

    /// A vector of f64 or f32 and the operations the tile needs.
    ///
    /// # Safety
    /// The pointer arguments must be valid for `LANES` elements (one for `splat`).
    trait Vector: Copy {
        type Elem;
        const LANES: usize;
        unsafe fn zero() -> Self;
        unsafe fn load(p: *const Self::Elem) -> Self;
        unsafe fn splat(p: *const Self::Elem) -> Self;
        /// `a b + c`, rounded once.
        unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self;
        unsafe fn add(a: Self, b: Self) -> Self;
        unsafe fn mul(a: Self, b: Self) -> Self;
        unsafe fn store(p: *mut Self::Elem, v: Self);
        /// `v` unchanged, computed before the loads that follow in the source (an empty
        /// `asm!` block for AVX2 vectors, see [`fence_pd`]; nothing for AVX-512 ones).
        unsafe fn fence(v: Self) -> Self;
    }

    macro_rules! vector {
        ($(#[$attr:meta])*; $v:ty, $e:ty, $lanes:expr, $zero:ident, $load:ident, $splat:ident,
         $fmadd:ident, $add:ident, $mul:ident, $store:ident, $fence:path) => {
            // (unsafe blocks around the intrinsics that are safe inside an AVX-512 function)
            #[allow(unused_unsafe)]
            impl Vector for $v {
                type Elem = $e;
                const LANES: usize = $lanes;
                // SAFETY (all eight): the functions carry their instruction sets'
                // `target_feature` attributes and are only called from kernels compiled for
                // them, which run only where the processor has those; the caller passes
                // pointers valid for the lanes read or written.
                $(#[$attr])*
                unsafe fn zero() -> Self {
                    unsafe { $zero() }
                }
                $(#[$attr])*
                unsafe fn load(p: *const $e) -> Self {
                    unsafe { $load(p) }
                }
                $(#[$attr])*
                unsafe fn splat(p: *const $e) -> Self {
                    unsafe { $splat(*p) }
                }
                $(#[$attr])*
                unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self {
                    unsafe { $fmadd(a, b, c) }
                }
                $(#[$attr])*
                unsafe fn add(a: Self, b: Self) -> Self {
                    unsafe { $add(a, b) }
                }
                $(#[$attr])*
                unsafe fn mul(a: Self, b: Self) -> Self {
                    unsafe { $mul(a, b) }
                }
                $(#[$attr])*
                unsafe fn store(p: *mut $e, v: Self) {
                    unsafe { $store(p, v) }
                }
                $(#[$attr])*
                unsafe fn fence(v: Self) -> Self {
                    $fence(v)
                }
            }
        };
    }
    // `fence_pd` and `fence_ps` return `v` unchanged, passed through an empty `asm!` block
    // that keeps it in its register. The block has side effects, so the compiler keeps it in
    // program order with the loads and the other such blocks: the fused multiply-add that
    // computes `v` stays before the loads that follow it in the source. The 4 x 3 AVX2 tile
    // (twelve accumulators, three vectors of `b` and one broadcast of `a`: all sixteen
    // registers) needs that: in a function with AVX2 enabled on a baseline build, the
    // instruction scheduler (tuned for a generic x86-64, not for x86-64-v3 as a build with
    // `-C target-cpu=x86-64-v3` is) moves the next row's broadcast above the last
    // multiply-adds of a row, and the seventeenth live vector goes through the stack, with
    // register moves around it, in every step of `k`.
    macro_rules! fence_256 {
        ($name:ident, $v:ty) => {
            /// `v` unchanged, in the order of the source (see the comment above `fence_256`).
            #[inline]
            #[target_feature(enable = "avx2,fma")]
            fn $name(mut v: $v) -> $v {
                // SAFETY: the block is empty: it reads and writes no memory, touches no flags
                // or stack, and leaves the register it names as it found it (a `ymm` register,
                // which this function, compiled for AVX2, may use).
                unsafe {
                    std::arch::asm!(
                        "/* {0} */",
                        inout(ymm_reg) v,
                        options(nomem, nostack, preserves_flags)
                    );
                }
                v
            }
        };
    }
    fence_256!(fence_pd, __m256d);
    fence_256!(fence_ps, __m256);
    /// `_mm256_broadcast_sd` by value.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn splat_pd(v: f64) -> __m256d {
        _mm256_broadcast_sd(&v)
    }
    /// `_mm256_broadcast_ss` by value.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn splat_ps(v: f32) -> __m256 {
        _mm256_broadcast_ss(&v)
    }
    vector!(
        #[inline]
        #[target_feature(enable = "avx2,fma")];
        __m256d,
        f64,
        4,
        _mm256_setzero_pd,
        _mm256_loadu_pd,
        splat_pd,
        _mm256_fmadd_pd,
        _mm256_add_pd,
        _mm256_mul_pd,
        _mm256_storeu_pd,
        fence_pd
    );
    vector!(
        #[inline]
        #[target_feature(enable = "avx2,fma")];
        __m256,
        f32,
        8,
        _mm256_setzero_ps,
        _mm256_loadu_ps,
        splat_ps,
        _mm256_fmadd_ps,
        _mm256_add_ps,
        _mm256_mul_ps,
        _mm256_storeu_ps,
        fence_ps
    );
    vector!(
        #[inline]
        #[target_feature(enable = "avx2,fma,avx512f")];
        __m512d,
        f64,
        8,
        _mm512_setzero_pd,
        _mm512_loadu_pd,
        _mm512_set1_pd,
        _mm512_fmadd_pd,
        _mm512_add_pd,
        _mm512_mul_pd,
        _mm512_storeu_pd,
        std::convert::identity
    );
    vector!(
        #[inline]
        #[target_feature(enable = "avx2,fma,avx512f")];
        __m512,
        f32,
        16,
        _mm512_setzero_ps,
        _mm512_loadu_ps,
        _mm512_set1_ps,
        _mm512_fmadd_ps,
        _mm512_add_ps,
        _mm512_mul_ps,
        _mm512_storeu_ps,
        std::convert::identity
    );

    /// The body of [`tile`] and [`tile_512`] (the same code, compiled for AVX2 or AVX-512).
    macro_rules! tile_body {
        ($V:ty, $NV:expr, $a:expr, $b:expr, $c:expr, $g:expr) => {{
            let (a0, b, c0, g) = ($a, $b, $c, $g);
            for blk in 0..g.blocks {
                let (a, c) = (a0.add(4 * blk * g.a_rs), c0.add(4 * blk * g.ldc));
                let k_end = if g.lower_a {
                    (4 * blk + 4 + g.row0).min(g.k)
                } else {
                    g.k
                };
                let mut acc: [[$V; $NV]; 4] = [[<$V>::zero(); $NV]; 4];
                for kk in 0..k_end {
                    let bp = b.add(kk * g.b_rs);
                    let mut bv: [$V; $NV] = [<$V>::zero(); $NV];
                    for (v, bvv) in bv.iter_mut().enumerate() {
                        *bvv = <$V>::load(bp.add(<$V>::LANES * v));
                    }
                    for (r, acc_r) in acc.iter_mut().enumerate() {
                        let av = <$V>::splat(a.add(r * g.a_rs + kk * g.a_cs));
                        for (acc_rv, &bvv) in acc_r.iter_mut().zip(&bv) {
                            *acc_rv = <$V>::fmadd(av, bvv, *acc_rv);
                            // The widest AVX2 tile fills the sixteen registers: keep its
                            // multiply-adds in the order written (see `fence_pd`).
                            if $NV >= 3 {
                                *acc_rv = <$V>::fence(*acc_rv);
                            }
                        }
                    }
                }
                for (r, acc_r) in acc.iter().enumerate() {
                    for (v, &acc_rv) in acc_r.iter().enumerate() {
                        let cp = c.add(r * g.ldc + <$V>::LANES * v);
                        let val = match g.epi {
                            Epi::Store => acc_rv,
                            Epi::Add => <$V>::add(<$V>::load(cp), acc_rv),
                            Epi::ScaleAdd(f) => {
                                <$V>::fmadd(<$V>::splat(f.cast()), <$V>::load(cp), acc_rv)
                            }
                            Epi::ScaleRows(f) => {
                                let f: *const <$V as Vector>::Elem = f.cast();
                                <$V>::mul(acc_rv, <$V>::splat(f.add(4 * blk + r)))
                            }
                        };
                        <$V>::store(cp, val);
                    }
                }
            }
        }};
    }

    /// `c[r, j..j + LANES NV]` from `sum_k a[r, k] b[k, j..]` for the rows `r < 4 blocks`,
    /// block by block: one fused multiply-add per `k`, in increasing `k` (to each block's
    /// `k_end`), then the epilogue (at most one rounding).
    ///
    /// # Safety
    /// The offsets `r * a_rs + k * a_cs` of `a`, `k * b_rs + LANES NV` of `b` and `r * ldc +
    /// LANES NV` of `c` (`r < 4 blocks`, `k` below the block's `k_end`) must be in bounds, and
    /// the epilogue's factors (one, or one per row) valid for reads of the vectors' element
    /// type.
    /// As well, the processor must have AVX2 and FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile<V: Vector, const NV: usize>(
        a: *const V::Elem,
        b: *const V::Elem,
        c: *mut V::Elem,
        g: &Geometry,
    ) {
        // SAFETY: the offsets are in bounds by the contract; the caller checked AVX2 and FMA.
        unsafe { tile_body!(V, NV, a, b, c, g) }
    }

    /// [`tile`] compiled for AVX-512F (`V` one of its vectors).
    ///
    /// # Safety
    /// As [`tile`]; and the processor must have AVX-512F.
    #[target_feature(enable = "avx2,fma,avx512f")]
    unsafe fn tile_512<V: Vector, const NV: usize>(
        a: *const V::Elem,
        b: *const V::Elem,
        c: *mut V::Elem,
        g: &Geometry,
    ) {
        // SAFETY: the offsets are in bounds by the contract; the caller checked AVX-512F.
        unsafe { tile_body!(V, NV, a, b, c, g) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// The same sums by a triple loop: fma over k in order from 0, as documented.
    fn reference<T: Real>(
        (m, n, k): (usize, usize, usize),
        a: &Mat<'_, T>,
        b: &Mat<'_, T>,
        c: &mut [T],
        ldc: usize,
        epi: Epilogue<'_, T>,
        tri: Tri,
    ) {
        for i in 0..m {
            for j in 0..n {
                if tri == Tri::LowerC && j > i {
                    continue;
                }
                let mut s = T::zero();
                for kk in 0..k {
                    let av = a.data[a.off + i * a.rs + kk * a.cs];
                    s = av.mul_add(b.data[b.off + kk * b.rs + j], s);
                }
                let cv = &mut c[i * ldc + j];
                *cv = match epi {
                    Epilogue::Store => s,
                    Epilogue::Add => *cv + s,
                    Epilogue::ScaleAdd(f) => f.mul_add(*cv, s),
                    Epilogue::ScaleRows(f) => s * f[i],
                };
            }
        }
    }

    /// Random shapes (up to 80, so that every tile width of both kernels and their edges
    /// occur), strides and modes, on both kernels, against the triple loop: bit for bit.
    fn check_random_shapes<T: Real>(seed: u64) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        for case in 0..400 {
            let (m, n, k) = (
                rng.random_range(1..80),
                rng.random_range(1..80),
                rng.random_range(1..80),
            );
            let tri = match case % 3 {
                0 => Tri::Full,
                1 => Tri::LowerA,
                _ => Tri::LowerC,
            };
            let k = if tri == Tri::LowerA { m } else { k };
            let factors: Vec<T> = (0..m)
                .map(|_| T::lit(rng.random_range(-2.0..2.0)))
                .collect();
            let epi = match case % 8 {
                0 | 4 => Epilogue::Store,
                1 | 5 => Epilogue::Add,
                2 | 6 => Epilogue::ScaleAdd(T::lit(rng.random_range(0.0..1.0))),
                _ => Epilogue::ScaleRows(&factors),
            };
            // a stored transposed half of the time, with padding between rows/columns
            let pad = rng.random_range(0..3);
            let (rs, cs) = if case % 4 < 2 {
                (k + pad, 1)
            } else {
                (1, m + pad)
            };
            let off = rng.random_range(0..5);
            let mut a_data: Vec<T> = (0..off + m * k * (2 + pad) + 4)
                .map(|_| T::lit(rng.random_range(-1.0..1.0)))
                .collect();
            if tri == Tri::LowerA {
                for i in 0..m {
                    for kk in i + 1..k {
                        a_data[off + i * rs + kk * cs] = T::zero();
                    }
                }
            }
            let b_rs = n + rng.random_range(0..3);
            let b_data: Vec<T> = (0..k * b_rs + 3)
                .map(|_| T::lit(rng.random_range(-1.0..1.0)))
                .collect();
            let a = Mat {
                data: &a_data,
                off,
                rs,
                cs,
            };
            let b = Mat {
                data: &b_data,
                off: 1,
                rs: b_rs,
                cs: 1,
            };
            let ldc = n + 1;
            let c0: Vec<T> = (0..m * ldc)
                .map(|_| T::lit(rng.random_range(-1.0..1.0)))
                .collect();
            let mut want = c0.clone();
            reference((m, n, k), &a, &b, &mut want, ldc, epi, tri);
            for kernels in [Kernels::Generic, Kernels::Avx2, Kernels::Avx512] {
                let mut got = c0.clone();
                gemm_on(kernels, (m, n, k), a, b, &mut got, ldc, epi, tri);
                // LowerA skips exact zeros only; same order, so the results are identical
                // (up to the sign of zero).
                for (idx, (g, w)) in got.iter().zip(&want).enumerate() {
                    let (i, j) = (idx / ldc, idx % ldc);
                    if tri == Tri::LowerC && j > i && j < n {
                        // may or may not be computed (tile granularity): either the old value
                        // or the product
                        continue;
                    }
                    assert!(
                        g == w,
                        "{kernels:?}, case {case} ({m}x{n}x{k}, {tri:?}, {epi:?}) at ({i}, {j}): \
                         {g} vs {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn matches_a_triple_loop_on_random_shapes_strides_and_modes() {
        check_random_shapes::<f64>(21);
        check_random_shapes::<f32>(23);
        println!("kernels of this processor: {:?}", Kernels::detect());
    }

    #[test]
    fn f32_tiles_match_f64_to_rounding() {
        let mut rng = ChaCha8Rng::seed_from_u64(22);
        let (m, n, k) = (37, 50, 45);
        let a: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let b: Vec<f32> = (0..k * n).map(|_| rng.random_range(-1.0..1.0)).collect();
        let a64: Vec<f64> = a.iter().map(|&v| v as f64).collect();
        let b64: Vec<f64> = b.iter().map(|&v| v as f64).collect();
        let mut c = vec![0f32; m * n];
        let mut c64 = vec![0f64; m * n];
        gemm(
            (m, n, k),
            Mat::rows(&a, k),
            Mat::rows(&b, n),
            &mut c,
            n,
            Epilogue::Store,
            Tri::Full,
        );
        gemm(
            (m, n, k),
            Mat::rows(&a64, k),
            Mat::rows(&b64, n),
            &mut c64,
            n,
            Epilogue::Store,
            Tri::Full,
        );
        // each f32 entry: k fused multiply-adds of terms <= 1: |error| <= k * u32 * sum|terms|
        // <= k * 2^-24 * k
        let bound = (k * k) as f64 * f64::from(f32::EPSILON) / 2.0;
        for (x, y) in c.iter().zip(&c64) {
            assert!((*x as f64 - y).abs() <= bound, "{x} vs {y}");
        }
    }
}
