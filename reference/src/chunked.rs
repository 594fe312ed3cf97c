//! The chunked jump formula: the three stages in order.
//!
//! 1. [`chunk_cumsum`]: `dt'` and `dA_cumsum`;
//! 2. [`fwd_pass_state`]: per-chunk states (one matrix
//!    product each) and the sequential pass across chunks: `chunk_states`, `final_states`;
//! 3. [`compute_out`]: carried-state term plus the causal,
//!    decayed `C B^T` times `dt' x`, the `D` skip and the `z` gate: `out`.
//!
//! Mathematically equal to the recurrence of [`naive`](crate::naive); the result depends on
//! `chunk_size` only through rounding.
//!
//! Two schedules run the same arithmetic and give bit-identical results ([`Schedule`]):
//! `Staged` runs each stage over the whole problem in turn, parallel over (batch, chunk, head);
//! `Fused` sweeps the chunks of each (batch, group) in order, doing stage 2 and stage 3 of a
//! chunk while its data is in cache, parallel over (batch, block of groups): a task takes a
//! row's groups chunk by chunk, so that it reads whole rows of the inputs. The second moves
//! about a third of the memory traffic of the first.
use ndarray::{s, Array4, Array5, ArrayViewMut3, ArrayViewMut4, ArrayViewMut5, Axis};
use rayon::prelude::*;

use crate::chunk_cumsum::{chunk_cumsum, ChunkCumsum};
use crate::compute_out::{compute_out, out_block, HeadStates};
use crate::flat::Flat;
use crate::fwd_pass_state::{fwd_pass_state, local_state_t, pass_scale, StateScratch};
use crate::gemm::Epilogue;
use crate::prefetch;
use crate::scratch::OutScratch;
use crate::transpose::{transpose_into, Cell};
use crate::{MatmulPrecision, Output, Problem, Real};

/// How [`forward_with`] orders the work of stages 2 and 3 (stage 1 always runs first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Schedule {
    /// [`fwd_pass_state`] then [`compute_out`]: the stage functions, each parallel over
    /// (batch, chunk, head or group).
    Staged,
    /// For each (batch, group), chunk by chunk in order: store the entering state, compute the
    /// output block, then the chunk state of every head and the state update. In parallel
    /// over (batch, block of groups), each task going through its groups chunk by chunk, or,
    /// with fewer (batch, group) pairs than threads, over (batch, group, block of heads).
    Fused,
    /// `Fused` when its tasks load rayon's threads evenly (a multiple of the thread count, or
    /// at least two per thread), `Staged` otherwise (as for one row of one head, which only
    /// the staged schedule's parallelism over chunks spreads over the threads).
    #[default]
    Auto,
}

/// Everything the chunked path computes, intermediates included.
#[allow(non_snake_case)]
#[derive(Debug, Clone)]
pub struct ChunkedOutput<T> {
    /// `[batch, seqlen, nheads, headdim]`
    pub out: Array4<T>,
    /// `[batch, nheads, headdim, dstate]`
    pub final_states: Array4<T>,
    /// `[batch, nheads, nchunks, chunk_size]`
    pub dA_cumsum: Array4<T>,
    /// `[batch, nchunks, nheads, headdim, dstate]`
    pub chunk_states: Array5<T>,
}

impl<T> ChunkedOutput<T> {
    /// Drops the intermediates.
    pub fn into_output(self) -> Output<T> {
        Output {
            out: self.out,
            final_states: self.final_states,
        }
    }
}

/// Runs the three stages ([`Schedule::Auto`]); `precision` selects the rounding of every
/// matrix-product operand.
pub fn forward<T: Real>(p: &Problem<T>, precision: MatmulPrecision) -> ChunkedOutput<T> {
    forward_with(p, precision, Schedule::Auto)
}

/// [`forward`] with an explicit [`Schedule`]. Every schedule gives the same bits.
pub fn forward_with<T: Real>(
    p: &Problem<T>,
    precision: MatmulPrecision,
    schedule: Schedule,
) -> ChunkedOutput<T> {
    let cumsum = chunk_cumsum(p);
    if is_fused(p, schedule) {
        return fused_forward(p, cumsum, precision);
    }
    let pass = fwd_pass_state(p, &cumsum, precision);
    let out = compute_out(p, &cumsum, &pass.chunk_states, precision);
    ChunkedOutput {
        out,
        final_states: pass.final_states,
        dA_cumsum: cumsum.dA_cumsum,
        chunk_states: pass.chunk_states,
    }
}

/// [`forward`] into the arrays of an earlier result, for a caller that computes many problems
/// of one shape: the same bits as [`forward`].
///
/// Under the fused schedule (which [`Schedule::Auto`] picks when its tasks load rayon's
/// threads evenly), `out`, `chunk_states` and `final_states`
/// are overwritten in place when their shapes fit `p` and they are in standard layout: no
/// allocation, and no fresh pages for the operating system to map (at issue 2's shape, 34 MB
/// per call). Otherwise, or under the staged schedule, `dst` is replaced by a fresh result.
pub fn forward_into<T: Real>(
    p: &Problem<T>,
    precision: MatmulPrecision,
    dst: &mut ChunkedOutput<T>,
) {
    let d = *p.dims();
    let nc = p.nchunks();
    let fits = dst.out.shape() == [d.batch, d.seqlen, d.nheads, d.headdim]
        && dst.chunk_states.shape() == [d.batch, nc, d.nheads, d.headdim, d.dstate]
        && dst.final_states.shape() == [d.batch, d.nheads, d.headdim, d.dstate]
        && dst.out.is_standard_layout()
        && dst.chunk_states.is_standard_layout()
        && dst.final_states.is_standard_layout();
    if !(fits && is_fused(p, Schedule::Auto)) {
        *dst = forward(p, precision);
        return;
    }
    let cumsum = chunk_cumsum(p);
    fused_sweep(
        p,
        &cumsum,
        precision,
        dst.out.view_mut(),
        dst.chunk_states.view_mut(),
        &mut dst.final_states,
    );
    dst.dA_cumsum = cumsum.dA_cumsum;
}

/// Whether `schedule` runs as [`Schedule::Fused`] for `p`.
fn is_fused<T: Real>(p: &Problem<T>, schedule: Schedule) -> bool {
    match schedule {
        Schedule::Staged => false,
        Schedule::Fused => true,
        Schedule::Auto => {
            let threads = rayon::current_num_threads();
            let tasks = fused_blocks(p.dims(), threads).tasks;
            tasks.is_multiple_of(threads) || tasks >= 2 * threads
        }
    }
}

/// How the fused schedule cuts its work into tasks.
struct FusedBlocks {
    /// Heads per (batch, group, block) unit: all of a group's, or a divisor of it.
    heads_per_block: usize,
    /// Groups per task when blocks are whole groups (1 otherwise).
    groups_per_task: usize,
    /// The number of tasks.
    tasks: usize,
}

/// Tasks of (batch, block of whole groups), as few equal blocks per row as give every thread
/// the same work ([`crate::units_per_task`]): a task then reads whole rows (or large parts)
/// of `x`, `B` and `C` for each chunk (the rows of one group are 1/ngroups of a row, each on
/// another page at issue 2's shape). When that leaves the threads unevenly loaded (fewer
/// (batch, group) pairs than threads, as with one row and one group), tasks of (batch, group,
/// block of the group's heads) instead, each computing the group's `C B^T` for its heads.
fn fused_blocks(d: &crate::Dims, threads: usize) -> FusedBlocks {
    let hpg = d.heads_per_group();
    let gpt = crate::units_per_task(d.batch, d.ngroups, threads);
    let tasks = d.batch * (d.ngroups / gpt);
    if tasks.is_multiple_of(threads) || tasks >= 2 * threads {
        return FusedBlocks {
            heads_per_block: hpg,
            groups_per_task: gpt,
            tasks,
        };
    }
    let hpb = crate::units_per_task(d.batch * d.ngroups, hpg, threads);
    FusedBlocks {
        heads_per_block: hpb,
        groups_per_task: 1,
        tasks: d.batch * d.ngroups * (hpg / hpb),
    }
}

/// One (batch, group, block of the group's heads) of the fused sweep: its parts of the
/// outputs and its running states. The block is all of the group's heads unless there are
/// too few (batch, group) pairs to keep the threads busy ([`fused_blocks`]).
struct GroupSweep<'a, T, O> {
    b: usize,
    g: usize,
    /// The block's first head, counted within the group (the block has `hpb` heads, see
    /// [`fused_blocks`]).
    hh0: usize,
    /// `out[b, :, heads of the block, :]`
    out: ArrayViewMut3<'a, O>,
    /// `chunk_states[b, :, heads of the block]`
    states: ArrayViewMut4<'a, O>,
    /// `final_states[b, heads of the block]` (`[hpb, headdim, dstate]`, contiguous)
    fin: &'a mut [T],
    /// The transposed states entering the current chunk of the block's heads: `[hpb, dstate,
    /// headdim]`, the layout the carried term's product reads.
    run_t: Vec<T>,
    /// `seq_idx` of the token before the current chunk (0 before the first).
    seq_prev: i64,
}

/// Slices in which the fused schedule prefetches the next chunk's rows.
const PF_STEPS: usize = 6;

/// [`Schedule::Fused`]: the arithmetic of the stage functions (the same building blocks in the
/// same order for every value), swept chunk by chunk per (batch, group).
fn fused_forward<T: Real>(
    p: &Problem<T>,
    cumsum: ChunkCumsum<T>,
    precision: MatmulPrecision,
) -> ChunkedOutput<T> {
    let d = *p.dims();
    let nc = p.nchunks();
    // Not zeroed: the sweep writes every entry of both exactly once (see below).
    let mut out = Array4::<T>::uninit((d.batch, d.seqlen, d.nheads, d.headdim));
    let mut chunk_states = Array5::<T>::uninit((d.batch, nc, d.nheads, d.headdim, d.dstate));
    let mut final_states = Array4::<T>::zeros((d.batch, d.nheads, d.headdim, d.dstate));
    fused_sweep(
        p,
        &cumsum,
        precision,
        out.view_mut(),
        chunk_states.view_mut(),
        &mut final_states,
    );
    // SAFETY: every entry of `out` and `chunk_states` has been written ([`fused_sweep`] sets
    // every entry of both; see there). Had it panicked, the panic would have propagated before
    // this point and the arrays would have been dropped as `MaybeUninit` (nothing read).
    let (out, chunk_states) = unsafe { (out.assume_init(), chunk_states.assume_init()) };
    ChunkedOutput {
        out,
        final_states,
        dA_cumsum: cumsum.dA_cumsum,
        chunk_states,
    }
}

/// The sweep of [`Schedule::Fused`], writing `out` (`[batch, seqlen, nheads, headdim]`),
/// `chunk_states` (`[batch, nchunks, nheads, headdim, dstate]`) and `final_states`
/// (`[batch, nheads, headdim, dstate]`, standard layout).
///
/// Every entry of the three is written exactly once and none is read, so the first two may
/// be memory not yet written ([`Cell`]). The (batch, group) pairs partition them (split along
/// batch and, within a batch, into the heads of each group). For its pair, the sweep writes,
/// for every chunk `c` in `0..nchunks`: `chunk_states[b, c, heads of g]` entire (the
/// transposes of the `hpg` states `run_t`, each `dstate x headdim` into `headdim x dstate`,
/// which cover the contiguous slice `entering`), and `out[b, t0..t0 + L, heads of g, :]`
/// entire (`out_block` sets every (row, head, channel) of its block); the chunks' row ranges
/// `t0..t0 + L` cover `0..seqlen`. At the end it writes every head's `final_states`.
///
/// # Panics
/// If the shapes are not those `p` implies, or `chunk_states` or `final_states` is not in
/// standard layout.
fn fused_sweep<T: Real, O: Cell<T> + Send>(
    p: &Problem<T>,
    cumsum: &ChunkCumsum<T>,
    precision: MatmulPrecision,
    mut out: ArrayViewMut4<'_, O>,
    mut chunk_states: ArrayViewMut5<'_, O>,
    final_states: &mut Array4<T>,
) {
    let d = *p.dims();
    let nc = p.nchunks();
    let cs = p.options().chunk_size;
    let hpg = d.heads_per_group();
    let n = d.headdim * d.dstate;
    let f = Flat::new(p, cumsum, precision);
    assert_eq!(
        out.shape(),
        &[d.batch, d.seqlen, d.nheads, d.headdim],
        "out"
    );
    assert_eq!(
        chunk_states.shape(),
        &[d.batch, nc, d.nheads, d.headdim, d.dstate],
        "chunk_states"
    );
    assert_eq!(
        final_states.shape(),
        &[d.batch, d.nheads, d.headdim, d.dstate],
        "final_states"
    );
    let blocks = fused_blocks(&d, rayon::current_num_threads());
    let hpb = blocks.heads_per_block;
    // Per (b, g, block of heads): out[b, :, heads, :], chunk_states[b, :, heads],
    // final_states[b, heads] (contiguous: [hpb, headdim, dstate]).
    let outs: Vec<ArrayViewMut3<O>> = out
        .view_mut()
        .into_outer_iter_mut()
        .flat_map(|ob| ob.into_axis_chunks_iter_mut(Axis(1), hpb))
        .collect();
    let states: Vec<ArrayViewMut4<O>> = chunk_states
        .view_mut()
        .into_outer_iter_mut()
        .flat_map(|sb| sb.into_axis_chunks_iter_mut(Axis(1), hpb))
        .collect();
    let fins: Vec<&mut [T]> = final_states
        .as_slice_mut()
        .expect("final_states in standard layout")
        .chunks_mut(hpb * n)
        .collect();
    let blocks_per_group = hpg / hpb;
    let mut tasks: Vec<Vec<GroupSweep<T, O>>> = Vec::new();
    for (k, ((out, states), fin)) in outs.into_iter().zip(states).zip(fins).enumerate() {
        let (bg, j) = (k / blocks_per_group, k % blocks_per_group);
        let (b, g, hh0) = (bg / d.ngroups, bg % d.ngroups, j * hpb);
        let mut run_t = vec![T::zero(); hpb * n];
        if let Some(s0) = &p.inputs().initial_states {
            for (kh, rt) in run_t.chunks_exact_mut(n).enumerate() {
                let s0 = s0.slice(s![b, g * hpg + hh0 + kh, .., ..]);
                rt.iter_mut().zip(s0.t().iter()).for_each(|(r, &v)| *r = v);
            }
        }
        let sweep = GroupSweep {
            b,
            g,
            hh0,
            out,
            states,
            fin,
            run_t,
            seq_prev: 0,
        };
        // A task takes `groups_per_task` whole groups, or one block of heads.
        if hpb < hpg || g % blocks.groups_per_task == 0 {
            tasks.push(Vec::new());
        }
        tasks.last_mut().expect("pushed above").push(sweep);
    }
    tasks.into_par_iter().for_each(|mut groups| {
        // Addresses only (for the prefetches of another group's rows; never dereferenced).
        let rows_at: Vec<(*const O, usize, *const O, usize)> = groups
            .iter()
            .map(|gs| {
                let (o, st) = (&gs.out, &gs.states);
                (
                    o.as_ptr(),
                    o.strides()[0].unsigned_abs(),
                    st.as_ptr(),
                    st.strides()[0].unsigned_abs(),
                )
            })
            .collect();
        let mut out_sc = OutScratch::default();
        let mut st_sc = StateScratch::default();
        for c in 0..nc {
            for gi in 0..groups.len() {
                // The next (group, chunk) of this task, whose rows are prefetched.
                let (gn, cn) = if gi + 1 < groups.len() {
                    (gi + 1, c)
                } else {
                    (0, c + 1)
                };
                let (g_next, hh0_next) = (groups[gn].g, groups[gn].hh0);
                let GroupSweep {
                    b,
                    g,
                    hh0,
                    out: o,
                    states: st,
                    fin: _,
                    run_t,
                    seq_prev,
                } = &mut groups[gi];
                let (b, g, hh0) = (*b, *g, *hh0);
                let t0 = c * cs;
                let l = p.chunk_len(c);
                let mut entering = st.index_axis_mut(Axis(0), c);
                let entering = entering
                    .as_slice_mut()
                    .expect("the heads of a group are contiguous (standard layout)");
                for (hh, dst) in entering.chunks_exact_mut(n).enumerate() {
                    transpose_into((d.dstate, d.headdim), run_t, hh * n, d.headdim, dst);
                }
                // Prefetches of what the next (group, chunk) reads (its rows of C, B, x) and
                // writes (its rows of out, its entering states), in PF_STEPS slices of its
                // rows issued between this chunk's products: all at once, they queued up
                // behind the cache's outstanding misses and stalled the core.
                let mut step = 0;
                let (o_ptr, o_rs, st_ptr, st_rs) = rows_at[gn];
                let mut prefetch_step = || {
                    if cn >= nc || step >= PF_STEPS {
                        return;
                    }
                    let (t1, l1) = (cn * cs, p.chunk_len(cn));
                    let (r0, r1) = (step * l1 / PF_STEPS, (step + 1) * l1 / PF_STEPS);
                    step += 1;
                    let bc_rs = d.ngroups * d.dstate;
                    let bc = f.bc_off(b, t1 + r0, g_next);
                    prefetch::rows(f.c(), bc, bc_rs, r1 - r0, d.dstate);
                    prefetch::rows(f.b(), bc, bc_rs, r1 - r0, d.dstate);
                    let x_rs = d.nheads * d.headdim;
                    let xo = f.x_off(b, t1 + r0, g_next * hpg + hh0_next);
                    prefetch::rows(f.x(), xo, x_rs, r1 - r0, hpb * d.headdim);
                    for r in t1 + r0..t1 + r1 {
                        prefetch::span(o_ptr.wrapping_add(r * o_rs), hpb * d.headdim);
                    }
                    let (a, e) = (r0 * hpb * n / l1, r1 * hpb * n / l1);
                    prefetch::span(st_ptr.wrapping_add(cn * st_rs + a), e - a);
                };
                let mut block = o.slice_mut(s![t0..t0 + l, .., ..]);
                out_block(
                    &f,
                    (b, c, g),
                    hh0..hh0 + hpb,
                    HeadStates::Transposed(run_t),
                    &mut block,
                    &mut out_sc,
                    &mut prefetch_step,
                );
                let mut seq_new = *seq_prev;
                for (kh, run_h) in run_t.chunks_exact_mut(n).enumerate() {
                    let h = g * hpg + hh0 + kh;
                    // x_c as out_block left it for this head
                    let x_c = &out_sc.x_copy[kh * l * d.headdim..(kh + 1) * l * d.headdim];
                    let b_t = &out_sc.b_t[..d.dstate * l];
                    let (scale, seq) = pass_scale(&f, (b, h, c), *seq_prev);
                    seq_new = seq;
                    // run = scale run + states_c, as the product stores states_c
                    let epi = Epilogue::ScaleAdd(scale);
                    local_state_t(&f, (b, c, h), b_t, x_c, &mut st_sc, run_h, epi);
                    prefetch_step();
                }
                for _ in 0..PF_STEPS {
                    prefetch_step();
                }
                *seq_prev = seq_new;
            }
        }
        for gs in groups {
            for (hh, dst) in gs.fin.chunks_exact_mut(n).enumerate() {
                transpose_into((d.dstate, d.headdim), &gs.run_t, hh * n, d.headdim, dst);
            }
        }
    });
}
