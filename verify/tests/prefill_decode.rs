//! Prefill/decode consistency: a prefill over the first part of every sequence, its final
//! states carried into decode steps over the last 1-4 tokens, checked against the case of the whole
//! sequences (`docs/pytorch.md`). Correct kernels pass; a decode that ignores `dt_limit`
//! fails.

use ndarray::{Array4, Axis};
use rayon::prelude::*;
use ssd_reference::serving::{forward, Algorithm, Packing};
use ssd_reference::{MatmulPrecision, Options, Problem};
use ssd_verify::fixture::Dtype;
use ssd_verify::fuzz::{case_count, packed_cases, DEFAULT_CAP, DEFAULT_SEED};
use ssd_verify::tolerance::{Oracle, OutputName, Precision};

/// Tokens `idx` of `p`'s row, as a problem of their own (no `seq_idx`: the packing gives it).
fn select(p: &Problem<f64>, idx: &[usize], options: Options) -> Problem<f64> {
    let i = p.inputs();
    let mut inputs = i.clone();
    inputs.x = i.x.select(Axis(1), idx);
    inputs.dt = i.dt.select(Axis(1), idx);
    inputs.B = i.B.select(Axis(1), idx);
    inputs.C = i.C.select(Axis(1), idx);
    inputs.z = i.z.as_ref().map(|z| z.select(Axis(1), idx));
    inputs.seq_idx = None;
    let dims = ssd_reference::Dims {
        seqlen: idx.len(),
        ..*p.dims()
    };
    Problem::new(dims, options, inputs).expect("a valid sub-problem")
}

/// The outputs of prefill (chunked, TF32) then decode (token by token, f32) over `p`, every
/// sequence split after `split[i]` of its tokens; the decode runs with `decode_options`.
fn prefill_then_decode(
    p: &Problem<f64>,
    k: &Packing<f64>,
    split: &[usize],
    decode_options: Options,
) -> (Array4<f64>, Array4<f64>) {
    let d = *p.dims();
    let nseq = k.nseq();
    let (mut pre_idx, mut dec_idx, mut pre_cu, mut dec_cu) = (vec![], vec![], vec![0], vec![0]);
    for (i, &cut) in split.iter().enumerate() {
        let (s, e) = (k.cu_seqlens[i], k.cu_seqlens[i + 1]);
        pre_idx.extend(s..s + cut);
        dec_idx.extend(s + cut..e);
        pre_cu.push(pre_idx.len());
        dec_cu.push(dec_idx.len());
    }
    let mut out = Array4::<f64>::zeros((1, d.seqlen, d.nheads, d.headdim));
    // Prefill: the sequences' own initial states; its final states go to the decode.
    let mut carried = Packing {
        cu_seqlens: pre_cu,
        seq_initial_states: k.seq_initial_states.clone(),
        seq_has_initial_state: k.seq_has_initial_state.clone(),
        state_positions: Vec::new(),
    };
    if k.seq_initial_states.is_none() {
        // mamba_ssm's convention: the first sequence's initial state, the others zero.
        let mut s0 = Array4::zeros((nseq, d.nheads, d.headdim, d.dstate));
        if let Some(init) = &p.inputs().initial_states {
            s0.index_axis_mut(Axis(0), 0)
                .assign(&init.index_axis(Axis(0), 0));
        }
        carried.seq_initial_states = Some(s0);
    }
    // A sequence without an initial state (the mask) starts from zero.
    let mut states = carried
        .seq_initial_states
        .clone()
        .expect("set")
        .mapv(|v| v as f32);
    if let Some(m) = &carried.seq_has_initial_state {
        for (i, &has) in m.iter().enumerate() {
            if !has {
                states.index_axis_mut(Axis(0), i).fill(0.0);
            }
        }
    }
    let mut p_no_init = p.clone();
    if p.inputs().initial_states.is_some() {
        let mut i = p.inputs().clone();
        i.initial_states = None;
        p_no_init = Problem::new(d, *p.options(), i).expect("valid");
    }
    if !pre_idx.is_empty() {
        let pp = select(&p_no_init, &pre_idx, *p.options());
        let o = forward(
            &pp.cast::<f32>(),
            &carried.cast::<f32>(),
            Algorithm::Chunked(MatmulPrecision::Tf32),
        )
        .expect("valid");
        for (j, &t) in pre_idx.iter().enumerate() {
            out.index_axis_mut(Axis(1), t)
                .assign(&o.out.index_axis(Axis(1), j).mapv(f64::from));
        }
        states = o.varlen_states;
    }
    if dec_idx.is_empty() {
        return (out, states.mapv(f64::from));
    }
    let pd = select(&p_no_init, &dec_idx, decode_options);
    let dec = Packing {
        cu_seqlens: dec_cu,
        seq_initial_states: Some(states),
        seq_has_initial_state: None,
        state_positions: Vec::new(),
    };
    let o = forward(&pd.cast::<f32>(), &dec, Algorithm::Naive).expect("valid");
    for (j, &t) in dec_idx.iter().enumerate() {
        out.index_axis_mut(Axis(1), t)
            .assign(&o.out.index_axis(Axis(1), j).mapv(f64::from));
    }
    (out, o.varlen_states.mapv(f64::from))
}

#[test]
fn prefill_then_decode_reproduces_the_whole_sequences() {
    let cases = packed_cases(case_count(), DEFAULT_SEED ^ 0xdec0, DEFAULT_CAP);
    let results: Vec<(bool, Option<bool>)> = cases
        .par_iter()
        .map(|case| {
            let (p, mut k) = case.build();
            k.state_positions.clear();
            let oracle = Oracle::for_packed(&p, &k).expect("valid");
            // Decode steps: the last 1-4 tokens of each sequence (a token-by-token kernel over
            // many tokens is the naive recurrence at a chunk size it does not have: the bound's
            // bookkeeping of roundings assumes the case's chunking, `docs/tolerances.md`).
            let split: Vec<usize> = (0..k.nseq())
                .map(|i| {
                    let len = k.cu_seqlens[i + 1] - k.cu_seqlens[i];
                    len - len.min(1 + (case.seed as usize).wrapping_add(i) % 4)
                })
                .collect();
            let passes = |options: Options| {
                let (out, varlen) = prefill_then_decode(&p, &k, &split, options);
                [(OutputName::Out, out), (OutputName::VarlenStates, varlen)]
                    .into_iter()
                    .all(|(n, t)| {
                        let r = oracle
                            .compare(n, &t.into_dyn(), Dtype::F32, Precision::Tf32)
                            .expect("shapes agree");
                        if !r.passed() && options == *p.options() {
                            println!(
                                "{case}: {n} worst {:.3} at {:?}",
                                r.max_ratio(),
                                r.worst.as_ref().map(|w| &w.index)
                            );
                        }
                        r.passed()
                    })
            };
            let right = passes(*p.options());
            // The decode without the prefill's dt_limit, where there is one and a decode part.
            let limited = p.options().dt_limit != (0.0, f64::INFINITY)
                && split
                    .iter()
                    .enumerate()
                    .any(|(i, &s)| s < k.cu_seqlens[i + 1] - k.cu_seqlens[i]);
            let wrong = limited.then(|| {
                passes(Options {
                    dt_limit: (0.0, f64::INFINITY),
                    ..*p.options()
                })
            });
            (right, wrong)
        })
        .collect();
    let right = results.iter().filter(|r| r.0).count();
    let applicable = results.iter().filter(|r| r.1.is_some()).count();
    let refused = results.iter().filter(|r| r.1 == Some(false)).count();
    println!(
        "prefill + decode: {right} of {} cases pass; decode without dt_limit refused on {refused} of {applicable}",
        results.len()
    );
    assert_eq!(right, results.len(), "a correct prefill + decode refused");
    assert!(refused > 0, "dt_limit ignored in the decode never refused");
}
