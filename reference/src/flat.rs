//! Row-major flat views of a problem's tensors and of stage 1's output, shared by the chunked
//! stages (no copy when the arrays are already in standard layout), with the index arithmetic
//! of the contract's layouts.
use ndarray::{CowArray, Ix4};

use crate::chunk_cumsum::ChunkCumsum;
use crate::{MatmulPrecision, Problem, Real};

pub(crate) struct Flat<'a, T: Real> {
    pub p: &'a Problem<T>,
    /// How matrix-product operands are rounded.
    pub operands: MatmulPrecision,
    x: CowArray<'a, T, Ix4>,
    b: CowArray<'a, T, Ix4>,
    c: CowArray<'a, T, Ix4>,
    z: Option<CowArray<'a, T, Ix4>>,
    cum: CowArray<'a, T, Ix4>,
    dt: CowArray<'a, T, Ix4>,
}

impl<'a, T: Real> Flat<'a, T> {
    /// # Panics
    /// If `cumsum` does not have the shape `p` implies.
    pub fn new(p: &'a Problem<T>, cumsum: &'a ChunkCumsum<T>, precision: MatmulPrecision) -> Self {
        let d = p.dims();
        let want = [d.batch, d.nheads, p.nchunks(), p.options().chunk_size];
        assert_eq!(cumsum.dA_cumsum.shape(), &want, "dA_cumsum shape");
        assert_eq!(cumsum.dt.shape(), &want, "dt shape");
        let i = p.inputs();
        Flat {
            p,
            operands: precision,
            x: i.x.as_standard_layout(),
            b: i.B.as_standard_layout(),
            c: i.C.as_standard_layout(),
            z: i.z.as_ref().map(|z| z.as_standard_layout()),
            cum: cumsum.dA_cumsum.as_standard_layout(),
            dt: cumsum.dt.as_standard_layout(),
        }
    }

    fn s<'s>(a: &'s CowArray<'a, T, Ix4>) -> &'s [T] {
        a.as_slice().expect("standard layout")
    }

    /// `x` flat, and the offset of `x[b, t, h, 0]`; rows `t` are `nheads * headdim` apart.
    pub fn x(&self) -> &[T] {
        Self::s(&self.x)
    }
    pub fn x_off(&self, b: usize, t: usize, h: usize) -> usize {
        let d = self.p.dims();
        ((b * d.seqlen + t) * d.nheads + h) * d.headdim
    }
    /// `z` flat (same layout as `x`).
    pub fn z(&self) -> Option<&[T]> {
        self.z.as_ref().map(Self::s)
    }
    /// `B` and `C` flat, and the offset of `B[b, t, g, 0]`; rows `t` are `ngroups * dstate`
    /// apart.
    pub fn b(&self) -> &[T] {
        Self::s(&self.b)
    }
    pub fn c(&self) -> &[T] {
        Self::s(&self.c)
    }
    pub fn bc_off(&self, b: usize, t: usize, g: usize) -> usize {
        let d = self.p.dims();
        ((b * d.seqlen + t) * d.ngroups + g) * d.dstate
    }
    /// `dA_cumsum[b, h, c, 0..L]` and `dt'[b, h, c, 0..L]` of chunk `c` (`L` valid tokens).
    pub fn cum_dt(&self, b: usize, h: usize, c: usize) -> (&[T], &[T]) {
        let d = self.p.dims();
        let cs = self.p.options().chunk_size;
        let off = ((b * d.nheads + h) * self.p.nchunks() + c) * cs;
        let l = self.p.chunk_len(c);
        (
            &Self::s(&self.cum)[off..off + l],
            &Self::s(&self.dt)[off..off + l],
        )
    }
    /// `dA_cumsum[b, h, c, chunk_size - 1]`: the cumsum at the chunk's last valid token.
    pub fn cum_last(&self, b: usize, h: usize, c: usize) -> T {
        let d = self.p.dims();
        let cs = self.p.options().chunk_size;
        Self::s(&self.cum)[((b * d.nheads + h) * self.p.nchunks() + c) * cs + cs - 1]
    }
}

/// `dst = x_c` (`L x headdim`, row-major) of row `b`, chunk `c`, head `h`, rounded as
/// [`MatmulPrecision::round`] under the path's precision: a contiguous copy (rows of `x` are `nheads * headdim`
/// apart; used in place they would compete for the same cache sets).
pub(crate) fn copy_x_c<T: Real>(f: &Flat<'_, T>, (b, c, h): (usize, usize, usize), dst: &mut [T]) {
    let p = f.p;
    let hd = p.dims().headdim;
    let t0 = c * p.options().chunk_size;
    let x_flat = f.x();
    for (row, j) in dst.chunks_exact_mut(hd).zip(0..) {
        let off = f.x_off(b, t0 + j, h);
        row.copy_from_slice(&x_flat[off..off + hd]);
    }
    f.operands.round_all(dst);
}
