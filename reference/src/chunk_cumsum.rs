//! Stage 1: dt processing and the within-chunk cumsum of `dt' * A`.
//!
//! Mirrors mamba_ssm's `_chunk_cumsum_fwd`. For token `t = c * chunk_size + k` of row `b`,
//! head `h`:
//!
//! ```text
//! dt'[b, h, c, k]        = clamp(softplus?(dt[b, t, h] + dt_bias[h]), lo, hi)   t <  seqlen
//!                        = 0                                                     t >= seqlen
//! dA_cumsum[b, h, c, k]  = sum_{k' <= k} dt'[b, h, c, k'] * A[h]
//! ```
//!
//! Positions past `seqlen` (only in the last chunk) have `dt' = 0`, so the cumsum stays flat
//! there and `dA_cumsum[b, h, c, chunk_size - 1]` is the cumsum at the chunk's last valid token.
use ndarray::{Array4, Axis, Zip};

use crate::{Problem, Real};

/// Output of [`chunk_cumsum`].
#[allow(non_snake_case)]
#[derive(Debug, Clone)]
pub struct ChunkCumsum<T> {
    /// Processed `dt'` laid out `[batch, nheads, nchunks, chunk_size]`, 0 past `seqlen`.
    pub dt: Array4<T>,
    /// Inclusive within-chunk cumsum of `dt' * A`: `[batch, nheads, nchunks, chunk_size]`.
    pub dA_cumsum: Array4<T>,
}

/// Computes `dt'` and `dA_cumsum` (see the module documentation for the formulas).
///
/// The cumsum is summed left to right in `T`, one product `dt' * A` rounded per term.
/// Parallel over (batch, head).
pub fn chunk_cumsum<T: Real>(p: &Problem<T>) -> ChunkCumsum<T> {
    let d = *p.dims();
    let cs = p.options().chunk_size;
    let nc = p.nchunks();
    let shape = (d.batch, d.nheads, nc, cs);
    let mut dt = Array4::<T>::zeros(shape);
    #[allow(non_snake_case)]
    let mut dA = Array4::<T>::zeros(shape);
    {
        let flat = (d.batch * d.nheads, nc * cs);
        let mut dt2 = dt
            .view_mut()
            .into_shape_with_order(flat)
            .expect("fresh arrays are contiguous");
        let mut da2 = dA
            .view_mut()
            .into_shape_with_order(flat)
            .expect("fresh arrays are contiguous");
        Zip::indexed(dt2.rows_mut())
            .and(da2.rows_mut())
            .par_for_each(|bh, mut dt_row, mut da_row| {
                let (b, h) = (bh / d.nheads, bh % d.nheads);
                let a = p.inputs().A[h];
                for (c, (mut dt_c, mut da_c)) in dt_row
                    .axis_chunks_iter_mut(Axis(0), cs)
                    .zip(da_row.axis_chunks_iter_mut(Axis(0), cs))
                    .enumerate()
                {
                    let mut acc = T::zero();
                    for k in 0..cs {
                        let t = c * cs + k;
                        let v = if t < d.seqlen {
                            p.dt_processed(b, t, h)
                        } else {
                            T::zero()
                        };
                        dt_c[k] = v;
                        acc = acc + v * a;
                        da_c[k] = acc;
                    }
                }
            });
    }
    ChunkCumsum { dt, dA_cumsum: dA }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::random::{random_problem, ProblemSpec};
    use crate::Dims;

    #[test]
    fn flat_past_seqlen_and_matches_a_direct_sum() {
        let dims = Dims {
            batch: 2,
            seqlen: 21,
            nheads: 3,
            headdim: 2,
            ngroups: 1,
            dstate: 2,
        };
        let p = random_problem(&ProblemSpec::full(dims, 8), 3).unwrap();
        let r = chunk_cumsum(&p);
        assert_eq!(r.dt.shape(), &[2, 3, 3, 8]);
        for b in 0..2 {
            for h in 0..3 {
                // last chunk holds tokens 16..21: positions 5.. are padding
                for k in 5..8 {
                    assert_eq!(r.dt[[b, h, 2, k]], 0.0);
                    assert_eq!(r.dA_cumsum[[b, h, 2, k]], r.dA_cumsum[[b, h, 2, 4]]);
                }
                for t in 0..21 {
                    let (c, k) = (t / 8, t % 8);
                    assert_eq!(r.dt[[b, h, c, k]], p.dt_processed(b, t, h));
                    let direct: f64 = (c * 8..=t)
                        .map(|s| p.dt_processed(b, s, h) * p.inputs().A[h])
                        .sum();
                    // same terms, same order: identical
                    assert_eq!(r.dA_cumsum[[b, h, c, k]], direct);
                }
            }
        }
    }
}
