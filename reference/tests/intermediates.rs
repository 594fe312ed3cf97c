//! The chunked path's intermediates against their definitions, and determinism.
//!
//! - `chunk_states[:, 0]` is `initial_states` (or 0), whatever `seq_idx` says;
//! - `chunk_states[:, c]`, `c > 0`, is the reset-aware state after token `c * chunk_size - 1`:
//!   the `final_states` of the naive recurrence on the first `c * chunk_size` tokens. Bound as
//!   in `naive_vs_chunked`: `gamma_units(p) * u` times the magnitude of that state;
//! - `dA_cumsum` is the within-chunk cumsum of `dt' A`, flat past `seqlen`;
//! - `chunk_state` followed by `state_passing` is `fwd_pass_state`;
//! - results do not depend on the number of threads (every sum has a fixed order), nor on the
//!   schedule (`Staged` and `Fused` give the same bits), nor on whether the outputs are
//!   written into an earlier result's arrays (`forward_into`).
mod common;

use common::*;
use proptest::prelude::*;
use ssd_reference::chunked::Schedule;
use ssd_reference::random::{random_problem, ProblemSpec, SeqIdx};
use ssd_reference::{chunk_cumsum, chunked, fwd_pass_state, naive, Dims, MatmulPrecision, Problem};

fn check_chunk_states(p: &Problem<f64>) {
    let c = chunked::forward(p, MatmulPrecision::Native);
    let d = *p.dims();
    let cs = p.options().chunk_size;
    let mag = magnitudes(p);
    let bound = gamma_units(p) * U64;
    for chunk in 0..p.nchunks() {
        let got = c.chunk_states.index_axis(ndarray::Axis(1), chunk);
        if chunk == 0 {
            match &p.inputs().initial_states {
                Some(s0) => assert_eq!(got, s0.view(), "chunk_states[:, 0] = initial_states"),
                None => assert!(got.iter().all(|&v| v == 0.0), "chunk_states[:, 0] = 0"),
            }
            continue;
        }
        let want = naive::forward(&p.prefix(chunk * cs).unwrap()).final_states;
        let m = mag.chunk_states.index_axis(ndarray::Axis(1), chunk);
        for ((g, w), m) in got.iter().zip(want.iter()).zip(m.iter()) {
            assert!(
                (g - w).abs() <= bound * m,
                "chunk {chunk}: {g} vs {w} (mag {m}) for {d:?}, chunk_size {cs}"
            );
        }
    }
}

proptest! {
    #![proptest_config(config(128, 0x55D_0002))]

    #[test]
    fn chunk_states_are_the_states_entering_each_chunk(spec in any_spec(90), seed in any::<u64>()) {
        check_chunk_states(&random_problem(&spec, seed).unwrap());
    }

    #[test]
    fn staged_and_fused_schedules_agree_bit_for_bit(
        spec in any_spec(200),
        seed in any::<u64>(),
        tf32 in any::<bool>(),
    ) {
        let p = random_problem(&spec, seed).unwrap();
        let q = p.cast::<f32>();
        let prec = if tf32 { MatmulPrecision::Tf32 } else { MatmulPrecision::Native };
        let a = chunked::forward_with(&p, prec, Schedule::Staged);
        let b = chunked::forward_with(&p, prec, Schedule::Fused);
        prop_assert_eq!(&a.out, &b.out);
        prop_assert_eq!(&a.final_states, &b.final_states);
        prop_assert_eq!(&a.chunk_states, &b.chunk_states);
        prop_assert_eq!(&a.dA_cumsum, &b.dA_cumsum);
        let a = chunked::forward_with(&q, prec, Schedule::Staged);
        let b = chunked::forward_with(&q, prec, Schedule::Fused);
        prop_assert_eq!(&a.out, &b.out);
        prop_assert_eq!(&a.final_states, &b.final_states);
        prop_assert_eq!(&a.chunk_states, &b.chunk_states);
    }
}

proptest! {
    #![proptest_config(config(64, 0x55D_0003))]

    /// `forward_into` over the result of another problem of the same shape (every stale entry
    /// must be overwritten) or of another shape (replaced) gives the bits of `forward`.
    #[test]
    fn forward_into_an_earlier_result_gives_the_same_bits(
        spec in any_spec(120),
        seed in any::<u64>(),
        tf32 in any::<bool>(),
        threads in 1usize..=2,
    ) {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            let p = random_problem(&spec, seed).unwrap();
            let other = random_problem(&spec, seed ^ 0x5EED).unwrap();
            let prec = if tf32 { MatmulPrecision::Tf32 } else { MatmulPrecision::Native };
            let want = chunked::forward(&p, prec);
            let mut got = chunked::forward(&other, prec);
            chunked::forward_into(&p, prec, &mut got);
            prop_assert_eq!(&got.out, &want.out);
            prop_assert_eq!(&got.final_states, &want.final_states);
            prop_assert_eq!(&got.chunk_states, &want.chunk_states);
            prop_assert_eq!(&got.dA_cumsum, &want.dA_cumsum);
            let smaller = p.prefix(p.dims().seqlen.div_ceil(2)).unwrap();
            let mut got = chunked::forward(&smaller, prec);
            chunked::forward_into(&p, prec, &mut got);
            prop_assert_eq!(&got.out, &want.out);
            prop_assert_eq!(&got.chunk_states, &want.chunk_states);

            let want = naive::forward(&p);
            let mut got = naive::forward(&other);
            naive::forward_into(&p, &mut got);
            prop_assert_eq!(&got.out, &want.out);
            prop_assert_eq!(&got.final_states, &want.final_states);
            Ok(())
        })?;
    }
}

/// Where the fused schedule runs, `forward_into` writes into the arrays it was given.
#[test]
fn forward_into_reuses_the_arrays_under_the_fused_schedule() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    pool.install(|| {
        let dims = Dims::new(2, 50, 4, 3, 2, 5);
        let spec = ProblemSpec::full(dims, 8);
        let (p, other) = (
            random_problem(&spec, 1).unwrap(),
            random_problem(&spec, 2).unwrap(),
        );
        let mut got = chunked::forward(&other, MatmulPrecision::Native);
        let ptrs = (got.out.as_ptr(), got.chunk_states.as_ptr());
        chunked::forward_into(&p, MatmulPrecision::Native, &mut got);
        assert_eq!((got.out.as_ptr(), got.chunk_states.as_ptr()), ptrs);
        let want = chunked::forward(&p, MatmulPrecision::Native);
        assert_eq!(got.out, want.out);
        assert_eq!(got.chunk_states, want.chunk_states);
        assert_eq!(got.final_states, want.final_states);
        let mut got = naive::forward(&other);
        let ptr = got.out.as_ptr();
        naive::forward_into(&p, &mut got);
        assert_eq!(got.out.as_ptr(), ptr);
        assert_eq!(got.out, naive::forward(&p).out);
    });
}

#[test]
fn chunk_states_with_resets_at_chunk_starts_and_a_late_first_sequence() {
    let dims = Dims {
        batch: 2,
        seqlen: 41,
        nheads: 4,
        headdim: 3,
        ngroups: 2,
        dstate: 5,
    };
    let mut spec = ProblemSpec::full(dims, 8);
    for seq_idx in [
        SeqIdx::AtChunkStarts { every: 1 },
        SeqIdx::AtChunkStarts { every: 2 },
        SeqIdx::Segments {
            segments: 3,
            first: 1,
        },
    ] {
        spec.seq_idx = seq_idx;
        for seed in 0..3 {
            check_chunk_states(&random_problem(&spec, seed).unwrap());
        }
    }
}

#[test]
#[allow(non_snake_case)] // the contract's name
fn dA_cumsum_is_the_within_chunk_cumsum() {
    let dims = Dims {
        batch: 2,
        seqlen: 29,
        nheads: 3,
        headdim: 2,
        ngroups: 3,
        dstate: 2,
    };
    let p = random_problem(&ProblemSpec::full(dims, 8), 4).unwrap();
    let c = chunked::forward(&p, MatmulPrecision::Native);
    for b in 0..2 {
        for h in 0..3 {
            for chunk in 0..4 {
                let mut acc = 0.0;
                for k in 0..8 {
                    let t = chunk * 8 + k;
                    if t < 29 {
                        acc += p.dt_processed(b, t, h) * p.inputs().A[h];
                    }
                    // same additions in the same order: identical
                    assert_eq!(c.dA_cumsum[[b, h, chunk, k]], acc);
                }
            }
        }
    }
}

#[test]
fn stage_functions_compose() {
    let dims = Dims {
        batch: 2,
        seqlen: 50,
        nheads: 4,
        headdim: 6,
        ngroups: 2,
        dstate: 7,
    };
    let p = random_problem(&ProblemSpec::full(dims, 16), 5).unwrap();
    let cs = chunk_cumsum::chunk_cumsum(&p);
    let both = fwd_pass_state::fwd_pass_state(&p, &cs, MatmulPrecision::Native);
    let mut states = fwd_pass_state::chunk_state(&p, &cs, MatmulPrecision::Native);
    let fin = fwd_pass_state::state_passing(&p, &cs, &mut states);
    assert_eq!(states, both.chunk_states);
    assert_eq!(fin, both.final_states);
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    let dims = Dims {
        batch: 2,
        seqlen: 300,
        nheads: 4,
        headdim: 16,
        ngroups: 2,
        dstate: 16,
    };
    let p = random_problem(&ProblemSpec::full(dims, 64), 6).unwrap();
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let three = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    let (n1, c1) = one.install(|| {
        (
            naive::forward(&p),
            chunked::forward(&p, MatmulPrecision::Native),
        )
    });
    let (n3, c3) = three.install(|| {
        (
            naive::forward(&p),
            chunked::forward(&p, MatmulPrecision::Native),
        )
    });
    assert_eq!(n1.out, n3.out);
    assert_eq!(n1.final_states, n3.final_states);
    assert_eq!(c1.out, c3.out);
    assert_eq!(c1.chunk_states, c3.chunk_states);
    assert_eq!(c1.final_states, c3.final_states);
    // Both paths split a row's heads (groups) into blocks by the thread count: one block of
    // 4 heads (2 groups) per row on 1 thread, blocks of 2 heads (1 group) on 4.
    let four = rayon::ThreadPoolBuilder::new()
        .num_threads(4)
        .build()
        .unwrap();
    let fused = |pool: &rayon::ThreadPool| {
        pool.install(|| chunked::forward_with(&p, MatmulPrecision::Native, Schedule::Fused))
    };
    let (f1, f4) = (fused(&one), fused(&four));
    let n4 = four.install(|| naive::forward(&p));
    assert_eq!(n1.out, n4.out);
    assert_eq!(n1.final_states, n4.final_states);
    assert_eq!(f1.out, f4.out);
    assert_eq!(f1.chunk_states, f4.chunk_states);
    assert_eq!(f1.final_states, f4.final_states);
    assert_eq!(f1.out, c1.out);
}

/// With fewer (batch, group) pairs than threads, the fused schedule splits a group's heads
/// into blocks (each block computing the group's `C B^T` for itself): one row and one group
/// of 4 heads runs as 1 task on 1 thread, 2 blocks of 2 heads on 2 threads, 4 of 1 on 4. The
/// bits must not move, and must be the staged schedule's.
#[test]
fn fused_blocks_of_heads_give_the_same_bits() {
    let dims = Dims {
        batch: 1,
        seqlen: 200,
        nheads: 4,
        headdim: 12,
        ngroups: 1,
        dstate: 9,
    };
    let p = random_problem(&ProblemSpec::full(dims, 32), 11).unwrap();
    let staged = chunked::forward_with(&p, MatmulPrecision::Native, Schedule::Staged);
    for threads in [1, 2, 3, 4] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let fused =
            pool.install(|| chunked::forward_with(&p, MatmulPrecision::Native, Schedule::Fused));
        assert_eq!(fused.out, staged.out, "{threads} threads");
        assert_eq!(fused.chunk_states, staged.chunk_states, "{threads} threads");
        assert_eq!(fused.final_states, staged.final_states, "{threads} threads");
        let auto = pool.install(|| chunked::forward(&p, MatmulPrecision::Native));
        assert_eq!(auto.out, staged.out, "{threads} threads, Auto");
    }
}
