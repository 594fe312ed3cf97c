//! What the kernels support, checked before anything touches the device.

use ssd_reference::{Dims, Options};

use crate::error::unsupported;
use crate::GpuError;

/// Largest `dstate`: the output kernel that computes its own scores (`ssd_compute_out`) keeps
/// a 64-token tile of `C` and one of `B` (or of the carried state) in shared memory,
/// `2 * 64 * (round_up(dstate, 64) + 4)` floats plus about 37 KB, which fits the 227 KB a
/// Hopper block may take up to `dstate = 256` (Ampere's 163 KB: up to 192).
pub const MAX_DSTATE: usize = 256;

/// Largest `chunk_size` (a power of two). The kernels themselves loop over any chunk; the
/// limit bounds the padded intermediates (`dA_cumsum` holds `nchunks * chunk_size` values per
/// row and head, however short `seqlen` is) and keeps every in-chunk index far inside `i32`.
pub const MAX_CHUNK_SIZE: usize = 1 << 16;

/// Tile sizes of the kernels (rows of a tile of `out`, headdim columns per block, dstate
/// columns per block of the state pass). `headdim` and `dstate` need not be multiples: the
/// last tile is masked.
pub(crate) const TILE_M: usize = 64;
pub(crate) const TILE_P: usize = 64;
pub(crate) const TILE_N: usize = 64;

/// Sizes of the buffers of one problem, in elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lengths {
    /// `x`, `z`, `out`: `batch * seqlen * nheads * headdim`.
    pub x: usize,
    /// `dt`: `batch * seqlen * nheads`.
    pub dt: usize,
    /// `B`, `C`: `batch * seqlen * ngroups * dstate`.
    pub bc: usize,
    /// `initial_states`, `final_states`: `batch * nheads * headdim * dstate`.
    pub states: usize,
    /// `dA_cumsum` and the processed `dt`: `batch * nheads * nchunks * chunk_size`.
    pub cumsum: usize,
    /// `chunk_states`: `batch * nchunks * nheads * headdim * dstate`.
    pub chunk_states: usize,
    /// `seq_idx`: `batch * seqlen`.
    pub seq_idx: usize,
}

/// Checks that the kernels support `dims` and `options` and returns the buffer lengths.
///
/// # Errors
/// [`GpuError::Unsupported`] naming the size or option: a zero size, `nheads % ngroups != 0`,
/// a `chunk_size` that is not a power of two or exceeds [`MAX_CHUNK_SIZE`], `dstate` above
/// [`MAX_DSTATE`], a `dt_limit` that is not an interval with a finite lower end, a size that
/// overflows the launch grid or `i32`, or buffers too large to count.
pub fn check(dims: &Dims, options: &Options) -> Result<Lengths, GpuError> {
    let Dims {
        batch,
        seqlen,
        nheads,
        headdim,
        ngroups,
        dstate,
    } = *dims;
    for (name, v) in dims.named() {
        if v == 0 {
            return Err(unsupported(format!(
                "{name} is 0: every size must be at least 1"
            )));
        }
        if v > i32::MAX as usize {
            return Err(unsupported(format!("{name} = {v} exceeds i32::MAX")));
        }
    }
    if nheads % ngroups != 0 {
        return Err(unsupported(format!(
            "nheads ({nheads}) is not a multiple of ngroups ({ngroups})"
        )));
    }
    let q = options.chunk_size;
    if !q.is_power_of_two() {
        return Err(unsupported(format!("chunk_size {q} is not a power of two")));
    }
    if q > MAX_CHUNK_SIZE {
        return Err(unsupported(format!(
            "chunk_size {q} exceeds the GPU kernels' limit of {MAX_CHUNK_SIZE}"
        )));
    }
    if dstate > MAX_DSTATE {
        return Err(unsupported(format!(
            "dstate {dstate} exceeds the GPU kernels' limit of {MAX_DSTATE} (shared-memory tiles of C and B)"
        )));
    }
    let (lo, hi) = options.dt_limit;
    if !lo.is_finite() || hi.is_nan() || lo > hi {
        return Err(unsupported(format!(
            "dt_limit [{lo}, {hi}] is not an interval with a finite lower end"
        )));
    }
    let nchunks = seqlen.div_ceil(q);
    let ptiles = headdim.div_ceil(TILE_P);
    let ntiles = dstate.div_ceil(TILE_N);
    let itiles = q.div_ceil(TILE_M);
    let grid_x = nchunks.checked_mul(itiles);
    if grid_x.is_none_or(|g| g > i32::MAX as usize) || nheads * ptiles > 65535 || batch > 65535 {
        return Err(unsupported(format!(
            "the launch grid overflows: nchunks * ceil(chunk_size/64) = {nchunks} * {itiles} must stay below 2^31, \
             nheads * ceil(headdim/64) = {} and batch = {batch} at most 65535",
            nheads * ptiles
        )));
    }
    if nchunks > i32::MAX as usize || ptiles * ntiles > i32::MAX as usize {
        return Err(unsupported("nchunks or the tile count exceeds i32::MAX"));
    }
    let too_big = || unsupported("buffer sizes overflow usize");
    let mul = |f: &[usize]| -> Result<usize, GpuError> {
        f.iter()
            .try_fold(1usize, |acc, &v| acc.checked_mul(v))
            .ok_or_else(too_big)
    };
    Ok(Lengths {
        x: mul(&[batch, seqlen, nheads, headdim])?,
        dt: mul(&[batch, seqlen, nheads])?,
        bc: mul(&[batch, seqlen, ngroups, dstate])?,
        states: mul(&[batch, nheads, headdim, dstate])?,
        cumsum: mul(&[batch, nheads, nchunks, q])?,
        chunk_states: mul(&[batch, nchunks, nheads, headdim, dstate])?,
        seq_idx: mul(&[batch, seqlen])?,
    })
}

/// Largest scratch of the shared scores (`scores_len`), in floats: 256 Mi (1 GiB).
const MAX_SCORES: usize = 1 << 28;

/// Tiles of 64 rows per chunk that can hold real tokens: `ceil(min(chunk_size, seqlen) / 64)`.
pub(crate) fn score_tiles(dims: &Dims, options: &Options) -> usize {
    options.chunk_size.min(dims.seqlen).div_ceil(TILE_M)
}

/// Length of the shared-scores scratch of the fast output path (`ssd_chunk_cb` +
/// `ssd_compute_out_cb`), or `None` where that path does not apply: `chunk_size` outside
/// 64..=512 (below 64 a 64 x 64 score tile per chunk would be mostly padding; above 512 the
/// pairs of tiles grow quadratically), a scratch above 1 GiB, or a launch grid that overflows.
/// Elsewhere the output kernel computes its own scores (`ssd_compute_out`).
pub(crate) fn scores_len(dims: &Dims, options: &Options) -> Option<usize> {
    let q = options.chunk_size;
    if !(64..=512).contains(&q) {
        return None;
    }
    let t = score_tiles(dims, options);
    let npairs = t * (t + 1) / 2;
    let nchunks = dims.seqlen.div_ceil(q);
    let grid_x = nchunks.checked_mul(npairs)?;
    if grid_x > i32::MAX as usize || dims.ngroups > 65535 {
        return None;
    }
    let n = [dims.batch, nchunks, dims.ngroups, npairs, 64 * 64]
        .iter()
        .try_fold(1usize, |acc, &v| acc.checked_mul(v))?;
    (n <= MAX_SCORES).then_some(n)
}

/// The output kernel's rows per block: 128 (`ssd_compute_out_cb128`, 256 threads) when a chunk
/// holds two or more 64-row score tiles and the device allows its shared memory (`fits128`;
/// not on compute capability 8.6 and 8.9, 99 KB per block), else 64 (`ssd_compute_out_cb`,
/// 128 threads, 73 KB).
pub(crate) fn compute_out_cb_rows(score_tiles: usize, fits128: bool) -> usize {
    if score_tiles >= 2 && fits128 {
        128
    } else {
        64
    }
}

/// The variant of 2a (`kernels/fwd_pass_state.cu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StateLocal {
    /// `ssd_chunk_state_local_pair`: two units per block, 128 dstate columns.
    Pair,
    /// `ssd_chunk_state_local_wide`: one unit, 128 dstate columns.
    Wide,
    /// `ssd_chunk_state_local`: one unit, 64 dstate columns (74 KB: every device).
    Narrow,
}

/// Which 2a serves `dims`: the pair kernel where `pairs` (the device's shared memory allows it
/// and the variant uses it) and [`state_pairs`] hold, the wide one above dstate 64 where its
/// 106 KB fit the device (`wide_fits`), else the narrow one.
pub(crate) fn state_local_variant(dims: &Dims, pairs: bool, wide_fits: bool) -> StateLocal {
    if pairs && state_pairs(dims) {
        StateLocal::Pair
    } else if dims.dstate > TILE_N && wide_fits {
        StateLocal::Wide
    } else {
        StateLocal::Narrow
    }
}

/// What both pair kernels ask of a shape: an even number of units (head, 64 headdim columns)
/// per group, so that no pair straddles two groups; 16-byte copies everywhere (headdim and
/// dstate multiples of 4); and every offset their copies take from a row's first token (at most
/// `seqlen` tokens of `x`, `B` or `C`) within their 32-bit unsigned arithmetic.
fn units_pair_up(dims: &Dims) -> bool {
    let units_per_group = dims.nheads / dims.ngroups * dims.headdim.div_ceil(64);
    let widest = (dims.nheads * dims.headdim).max(dims.ngroups * dims.dstate);
    units_per_group.is_multiple_of(2)
        && dims.headdim.is_multiple_of(4)
        && dims.dstate.is_multiple_of(4)
        && dims
            .seqlen
            .checked_mul(widest)
            .is_some_and(|v| v < 1usize << 32)
}

/// Whether the output kernel over pairs of units (`ssd_compute_out_pair`: two 64-column units
/// of one group per block, sharing its C slabs and scores) serves this shape: chunks of two or
/// more 64-row score tiles, and what [`units_pair_up`] asks.
pub(crate) fn compute_out_pairs(dims: &Dims, score_tiles: usize) -> bool {
    score_tiles >= 2 && units_pair_up(dims)
}

/// Whether 2a over pairs of units (`ssd_chunk_state_local_pair`) serves this shape: dstate
/// above 64 (its blocks span 128 dstate columns), and what [`units_pair_up`] asks.
pub(crate) fn state_pairs(dims: &Dims) -> bool {
    dims.dstate > TILE_N && units_pair_up(dims)
}

/// `seq_idx` as the kernels take it: `i32`, per row, equal where the input is equal and 0
/// exactly where the input is 0 (the kernels only compare neighbours and test for 0, so any
/// `i64` values fit). Rows are `seqlen` long.
///
/// The input must be non-negative and non-decreasing along each row (the contract), which
/// [`ssd_reference::Problem`] guarantees.
pub fn seq_idx_to_i32(seq_idx: &[i64], seqlen: usize) -> Vec<i32> {
    let mut out = Vec::with_capacity(seq_idx.len());
    for row in seq_idx.chunks(seqlen.max(1)) {
        let mut id: i32 = if row.first() == Some(&0) { 0 } else { 1 };
        let mut prev = row.first().copied();
        for &v in row {
            if Some(v) != prev {
                id += 1;
                prev = Some(v);
            }
            out.push(id);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims() -> Dims {
        Dims {
            batch: 2,
            seqlen: 100,
            nheads: 4,
            headdim: 16,
            ngroups: 2,
            dstate: 8,
        }
    }

    fn opts(chunk_size: usize) -> Options {
        Options {
            chunk_size,
            ..Options::default()
        }
    }

    #[test]
    fn kernel_variants_follow_the_shapes_and_the_device() {
        // What fits which device is asserted in the kernel source, next to each layout.
        let mamba = Dims::new(2, 4096, 8, 64, 1, 128);
        assert_eq!(state_local_variant(&mamba, true, true), StateLocal::Pair);
        assert_eq!(state_local_variant(&mamba, false, true), StateLocal::Wide);
        assert_eq!(
            state_local_variant(&mamba, false, false),
            StateLocal::Narrow
        );
        let odd_heads = Dims::new(2, 4096, 3, 64, 1, 128);
        assert_eq!(
            state_local_variant(&odd_heads, true, true),
            StateLocal::Wide
        );
        let small_state = Dims::new(2, 4096, 8, 64, 1, 64);
        assert_eq!(
            state_local_variant(&small_state, true, true),
            StateLocal::Narrow
        );
        assert_eq!(compute_out_cb_rows(4, true), 128);
        assert_eq!(compute_out_cb_rows(4, false), 64);
        assert_eq!(compute_out_cb_rows(1, true), 64);
    }

    #[test]
    fn units_pair_only_within_a_group() {
        // headdim 64: two heads per pair, so the heads of a group must be even in number.
        assert!(state_pairs(&Dims::new(1, 100, 8, 64, 2, 128)));
        assert!(!state_pairs(&Dims::new(1, 100, 6, 64, 2, 128)));
        // headdim 65 to 128: the two 64-column units of one head pair up.
        assert!(state_pairs(&Dims::new(1, 100, 3, 128, 3, 128)));
        assert!(compute_out_pairs(&Dims::new(1, 100, 3, 96, 1, 128), 2));
        // 16-byte copies only: headdim and dstate multiples of 4.
        assert!(!compute_out_pairs(&Dims::new(1, 100, 2, 62, 1, 128), 2));
        assert!(!compute_out_pairs(&Dims::new(1, 100, 2, 64, 1, 126), 2));
        // One score tile per chunk: the 64-row kernel.
        assert!(!compute_out_pairs(&Dims::new(1, 100, 2, 64, 1, 128), 1));
        // Rows whose offsets would overflow the copies' 32-bit arithmetic.
        assert!(!state_pairs(&Dims::new(1, 1 << 20, 64, 64, 1, 128)));
        assert!(state_pairs(&Dims::new(1, 1 << 19, 64, 64, 1, 128)));
    }

    #[test]
    fn lengths_follow_the_contract() {
        let l = check(&dims(), &opts(32)).unwrap();
        assert_eq!(l.x, 2 * 100 * 4 * 16);
        assert_eq!(l.dt, 2 * 100 * 4);
        assert_eq!(l.bc, 2 * 100 * 2 * 8);
        assert_eq!(l.states, 2 * 4 * 16 * 8);
        assert_eq!(l.cumsum, 2 * 4 * 4 * 32);
        assert_eq!(l.chunk_states, 2 * 4 * 4 * 16 * 8);
        assert_eq!(l.seq_idx, 200);
    }

    #[test]
    fn refuses_what_the_kernels_cannot_do() {
        let msg = |d: Dims, o: Options| check(&d, &o).unwrap_err().to_string();
        assert!(msg(dims(), opts(48)).contains("power of two"));
        assert!(msg(dims(), opts(MAX_CHUNK_SIZE * 2)).contains("limit"));
        let mut d = dims();
        d.dstate = MAX_DSTATE + 1;
        assert!(msg(d, opts(64)).contains("dstate"));
        let mut d = dims();
        d.ngroups = 3;
        assert!(msg(d, opts(64)).contains("multiple"));
        let mut d = dims();
        d.seqlen = 0;
        assert!(msg(d, opts(64)).contains("seqlen"));
        let mut o = opts(64);
        o.dt_limit = (1.0, 0.5);
        assert!(msg(dims(), o).contains("dt_limit"));
        assert!(check(&dims(), &opts(MAX_CHUNK_SIZE)).is_ok());
        let mut d = dims();
        d.dstate = MAX_DSTATE;
        d.headdim = 65;
        assert!(check(&d, &opts(1)).is_ok());
    }

    #[test]
    fn seq_idx_keeps_equality_and_zero() {
        let s = [0, 0, 5, 5, 1 << 40, 7, 7, 8, 9, 9];
        // two rows of 5 (the second row is its own sequence numbering)
        let got = seq_idx_to_i32(&s, 5);
        assert_eq!(got, vec![0, 0, 1, 1, 2, 1, 1, 2, 3, 3]);
        assert_eq!(seq_idx_to_i32(&[3, 3, 3], 3), vec![1, 1, 1]);
    }
}
