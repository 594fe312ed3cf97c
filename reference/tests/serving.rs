//! Packed sequences, per-sequence initial states and states at positions
//! (`ssd_reference::serving`), against the whole-row recurrence (bit for bit where it applies)
//! and an independent scalar loop; and the refusals.

use ndarray::{s, Array4};
use ssd_reference::random::{random_problem, ProblemSpec, SpecRng};
use ssd_reference::serving::{forward, implied_seq_idx, Algorithm, Packing};
use ssd_reference::{naive, Dims, MatmulPrecision, Problem};

/// A random packing of `seqlen` tokens into 1-6 sequences (zero-length ones included).
fn random_cu(rng: &mut SpecRng, seqlen: usize) -> Vec<usize> {
    let nseq = rng.range(1, 6);
    let mut cuts: Vec<usize> = (0..nseq - 1).map(|_| rng.range(0, seqlen)).collect();
    if rng.chance(0.3) && nseq > 1 {
        cuts[0] = 0; // a zero-length first sequence
    }
    cuts.sort_unstable();
    let mut cu = vec![0];
    cu.extend(cuts);
    cu.push(seqlen);
    cu
}

fn random_case(seed: u64) -> (Problem<f64>, Packing<f64>) {
    let mut rng = SpecRng::new(seed);
    let seqlen = rng.range(1, 90);
    let dims = Dims::new(
        1,
        seqlen,
        2 * rng.range(1, 2),
        rng.range(1, 6),
        rng.range(1, 2),
        rng.range(1, 7),
    );
    let mut spec = ProblemSpec::full(dims, 1 << rng.range(0, 5));
    spec.seq_idx = ssd_reference::random::SeqIdx::None;
    spec.initial_states = rng.chance(0.3);
    let p = random_problem(&spec, seed).unwrap();
    let mut packing = Packing::new(random_cu(&mut rng, seqlen));
    let nseq = packing.nseq();
    if !spec.initial_states && rng.chance(0.7) {
        packing.seq_initial_states = Some(Array4::from_shape_fn(
            (nseq, dims.nheads, dims.headdim, dims.dstate),
            |_| 2.0 * rng.unit() - 1.0,
        ));
        if rng.chance(0.5) {
            packing.seq_has_initial_state = Some((0..nseq).map(|_| rng.chance(0.5)).collect());
        }
    }
    packing.state_positions = (0..rng.range(0, 5))
        .map(|_| rng.range(0, seqlen - 1))
        .collect();
    (p, packing)
}

#[allow(clippy::needless_range_loop)] // the equations' indices
/// The recurrence written out in scalar loops: `(out, varlen_states, position_states)`.
fn scalar(p: &Problem<f64>, k: &Packing<f64>) -> (Array4<f64>, Array4<f64>, Array4<f64>) {
    let d = *p.dims();
    let i = p.inputs();
    let nseq = k.nseq();
    let mut out = Array4::zeros((1, d.seqlen, d.nheads, d.headdim));
    let mut varlen = Array4::zeros((nseq, d.nheads, d.headdim, d.dstate));
    let mut at = Array4::zeros((k.state_positions.len(), d.nheads, d.headdim, d.dstate));
    for h in 0..d.nheads {
        let g = d.group_of_head(h);
        for q in 0..nseq {
            let mut st = vec![vec![0.0; d.dstate]; d.headdim];
            if let Some(s0) = k.initial_state(p, q) {
                for (pp, row) in st.iter_mut().enumerate() {
                    for (n, v) in row.iter_mut().enumerate() {
                        *v = s0[[0, h, pp, n]];
                    }
                }
            }
            for t in k.cu_seqlens[q]..k.cu_seqlens[q + 1] {
                let dtp = p.dt_processed(0, t, h);
                let a = (dtp * i.A[h]).exp();
                for pp in 0..d.headdim {
                    let mut y = 0.0;
                    for n in 0..d.dstate {
                        st[pp][n] = a * st[pp][n] + dtp * i.x[[0, t, h, pp]] * i.B[[0, t, g, n]];
                        y += st[pp][n] * i.C[[0, t, g, n]];
                    }
                    y += p.d_skip(h, pp) * i.x[[0, t, h, pp]];
                    if let Some(z) = &i.z {
                        y = ssd_reference::problem::gate(y, z[[0, t, h, pp]]);
                    }
                    out[[0, t, h, pp]] = y;
                }
                for (j, &pos) in k.state_positions.iter().enumerate() {
                    if pos == t {
                        for pp in 0..d.headdim {
                            for n in 0..d.dstate {
                                at[[j, h, pp, n]] = st[pp][n];
                            }
                        }
                    }
                }
            }
            for pp in 0..d.headdim {
                for n in 0..d.dstate {
                    varlen[[q, h, pp, n]] = st[pp][n];
                }
            }
        }
    }
    (out, varlen, at)
}

fn max_rel(a: &Array4<f64>, b: &Array4<f64>) -> f64 {
    let scale = b.iter().fold(1e-300_f64, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b)
        .fold(0.0_f64, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

#[test]
fn packed_rows_equal_the_whole_row_recurrence_bit_for_bit() {
    for seed in 0..200 {
        let (p, mut k) = random_case(seed);
        // Without per-sequence states, the whole row with the implied seq_idx is the same
        // recurrence: resets where sequences start, mamba_ssm's initial_states for sequence 0.
        k.seq_initial_states = None;
        k.seq_has_initial_state = None;
        let whole = naive::forward(&k.with_seq_idx(&p).unwrap());
        let o = forward(&p, &k, Algorithm::Naive).unwrap();
        assert_eq!(o.out, whole.out, "seed {seed}");
        assert_eq!(o.final_states, whole.final_states, "seed {seed}");
        // Each sequence's final state is the state of the prefix ending with it.
        for q in 0..k.nseq() {
            let end = k.cu_seqlens[q + 1];
            if end > k.cu_seqlens[q] {
                let pre = naive::forward(&k.with_seq_idx(&p).unwrap().prefix(end).unwrap());
                assert_eq!(
                    o.varlen_states.slice(s![q..q + 1, .., .., ..]),
                    pre.final_states,
                    "seed {seed} seq {q}"
                );
            }
        }
    }
}

#[test]
fn per_sequence_states_and_positions_match_a_scalar_loop() {
    let mut with_init = 0;
    for seed in 0..300 {
        let (p, k) = random_case(seed);
        with_init += usize::from(k.seq_initial_states.is_some());
        let (out, varlen, at) = scalar(&p, &k);
        let o = forward(&p, &k, Algorithm::Naive).unwrap();
        // Different association of the same sums (the scalar loop rounds a*s and the product
        // separately): far below 1e-12 of the largest value on these short sequences.
        assert!(
            max_rel(&o.out, &out) < 1e-12,
            "seed {seed} out {}",
            max_rel(&o.out, &out)
        );
        assert!(
            max_rel(&o.varlen_states, &varlen) < 1e-12,
            "seed {seed} varlen"
        );
        assert!(
            max_rel(&o.position_states, &at) < 1e-12,
            "seed {seed} positions"
        );
        {
            let c = forward(&p, &k, Algorithm::Chunked(MatmulPrecision::Native)).unwrap();
            assert!(max_rel(&c.out, &out) < 1e-11, "seed {seed} chunked out");
            assert!(
                max_rel(&c.varlen_states, &varlen) < 1e-11,
                "seed {seed} chunked varlen"
            );
            assert!(
                max_rel(&c.position_states, &at) < 1e-11,
                "seed {seed} chunked positions"
            );
        }
    }
    assert!(
        with_init > 100,
        "the cases exercise per-sequence states ({with_init})"
    );
}

#[test]
fn zero_length_sequences_keep_their_initial_state() {
    let p = random_problem(&ProblemSpec::plain(Dims::new(1, 6, 2, 3, 1, 4)), 3).unwrap();
    let mut k = Packing::new(vec![0, 0, 6, 6]);
    let init = Array4::from_shape_fn((3, 2, 3, 4), |(a, b, c, d)| (a + b + c + d) as f64 * 0.1);
    k.seq_initial_states = Some(init.clone());
    k.seq_has_initial_state = Some(vec![true, false, true]);
    let o = forward(&p, &k, Algorithm::Naive).unwrap();
    assert_eq!(
        o.varlen_states.slice(s![0, .., .., ..]),
        init.slice(s![0, .., .., ..])
    );
    assert_eq!(
        o.varlen_states.slice(s![2, .., .., ..]),
        init.slice(s![2, .., .., ..])
    );
    // The row's final state is the last non-empty sequence's, which started from zero.
    assert_eq!(o.final_states, naive::forward(&p).final_states);
    assert_eq!(implied_seq_idx(&[0, 0, 2, 2, 5]), vec![1, 1, 3, 3, 3]);
}

#[test]
fn bad_packings_are_refused_naming_the_tensor() {
    let p = random_problem(&ProblemSpec::plain(Dims::new(1, 6, 2, 3, 1, 4)), 3).unwrap();
    let err = |k: &Packing<f64>, p: &Problem<f64>| {
        forward(p, k, Algorithm::Naive).unwrap_err().to_string()
    };
    for (cu, what) in [
        (vec![1, 6], "start at 0"),
        (vec![0, 4, 3, 6], "decreases at index 2"),
        (vec![0, 5], "end at seqlen = 6"),
        (vec![0], "at least 2"),
    ] {
        let e = err(&Packing::new(cu), &p);
        assert!(e.contains("`cu_seqlens`") && e.contains(what), "{e}");
    }
    let two = random_problem(&ProblemSpec::plain(Dims::new(2, 6, 2, 3, 1, 4)), 3).unwrap();
    assert!(err(&Packing::new(vec![0, 6]), &two).contains("batch must be 1"));
    let mut k = Packing::new(vec![0, 2, 6]);
    k.seq_initial_states = Some(Array4::zeros((3, 2, 3, 4)));
    let e = err(&k, &p);
    assert!(
        e.contains("`seq_initial_states`") && e.contains("[2, 2, 3, 4]"),
        "{e}"
    );
    k.seq_initial_states = Some(Array4::zeros((2, 2, 3, 4)));
    k.seq_has_initial_state = Some(vec![true]);
    assert!(err(&k, &p).contains("`seq_has_initial_state`"));
    k.seq_has_initial_state = None;
    k.state_positions = vec![6];
    assert!(err(&k, &p).contains("`state_positions[0]` = 6"));
    let mut spec = ProblemSpec::plain(Dims::new(1, 6, 2, 3, 1, 4));
    spec.initial_states = true;
    let with_init = random_problem(&spec, 3).unwrap();
    let mut k = Packing::new(vec![0, 6]);
    k.seq_initial_states = Some(Array4::zeros((1, 2, 3, 4)));
    assert!(err(&k, &with_init).contains("two conventions"));
    let mut spec = ProblemSpec::plain(Dims::new(1, 6, 2, 3, 1, 4));
    spec.seq_idx = ssd_reference::random::SeqIdx::Segments {
        segments: 2,
        first: 0,
    };
    let segs = random_problem(&spec, 3).unwrap();
    let e = err(&Packing::new(vec![0, 6]), &segs);
    assert!(e.contains("`seq_idx` disagrees with `cu_seqlens`"), "{e}");
}
