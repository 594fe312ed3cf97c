//! The chunked backward ([`chunked_backward`]) against the adjoint recurrence (the gradient
//! ground truth) and, stage by stage, against independent computations.
//!
//! # The bound
//! Both compute every gradient element as a sum of the same terms (products of inputs,
//! upstream gradients and decays), grouped differently; no step cancels terms that are not
//! cancelled in the exact value too (the chunked `ddA` is formed pair by pair, see
//! `bwd_ddA_cumsum`). So if each term carries a relative perturbation of at most `gamma` in
//! either computation, `|chunked - adjoint| <= gamma * mag`, where `mag` is the sum of the
//! terms' absolute values (`magnitudes` below: the adjoint run on absolute values, and for
//! `ddt` and `dA` a plain recurrence that keeps the two parts of `ddt'` apart, since `A <= 0`
//! gives them opposite signs). `gamma = n u` with `n` from `gamma_units`, derived there.
//! A wrong term, mask, reset or index is off by a sizeable fraction of `mag`, orders of
//! magnitude above the bound.
use ndarray::{s, Array3, Array4, ArrayD, Axis};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use ssd_reference::random::{random_problem, random_spec, SpecRng};
use ssd_reference::{adjoint, chunked_backward, naive, Inputs, MatmulPrecision, Problem};

const U64: f64 = f64::EPSILON / 2.0;

/// Random upstream gradients in `[-1, 1]`: `dout`, and `dfinal_states` when `with_final`.
fn upstream(p: &Problem<f64>, seed: u64, with_final: bool) -> (Array4<f64>, Option<Array4<f64>>) {
    let d = *p.dims();
    let mut r = ChaCha8Rng::seed_from_u64(seed ^ 0xD0D0);
    let dout = Array4::from_shape_fn((d.batch, d.seqlen, d.nheads, d.headdim), |_| {
        r.random_range(-1.0..1.0)
    });
    let dfin = with_final.then(|| {
        Array4::from_shape_fn((d.batch, d.nheads, d.headdim, d.dstate), |_| {
            r.random_range(-1.0..1.0)
        })
    });
    (dout, dfin)
}

#[inline]
fn sigmoid(v: f64) -> f64 {
    1.0 / (1.0 + (-v).exp())
}

/// `ybar = dout * silu(z)` (or `dout`).
fn ybar_of(p: &Problem<f64>, dout: &Array4<f64>) -> Array4<f64> {
    match &p.inputs().z {
        None => dout.clone(),
        Some(z) => {
            let mut y = dout.clone();
            y.zip_mut_with(z, |a, &zv| *a *= zv * sigmoid(zv));
            y
        }
    }
}

/// The problem on absolute values, without its gate: `|x|`, `|B|`, `|C|`, `|D|`,
/// `|initial_states|`; `dt`, `A`, `dt_bias`, `seq_idx` and the options unchanged (so the same
/// `dt'` and decays).
fn abs_problem(p: &Problem<f64>) -> Problem<f64> {
    let i = p.inputs();
    Problem::new(
        *p.dims(),
        *p.options(),
        Inputs {
            x: i.x.mapv(f64::abs),
            dt: i.dt.clone(),
            A: i.A.clone(),
            B: i.B.mapv(f64::abs),
            C: i.C.mapv(f64::abs),
            D: i.D.as_ref().map(|d| d.mapv(f64::abs)),
            z: None,
            dt_bias: i.dt_bias.clone(),
            initial_states: i.initial_states.as_ref().map(|s| s.mapv(f64::abs)),
            seq_idx: i.seq_idx.clone(),
        },
    )
    .unwrap()
}

/// Per token `t` of row `b`, head `h`, from a plain recurrence (the state `s_t` forward, the
/// cotangent `S_t = dL/ds_t` backward): `P[b, t, h] = <du_t, x_t>` with `du_t = S_t B_t`
/// (the `dt'` gradient through `u_t = dt'_t x_t`) and `Q[b, t, h] = a_t <S_t, s_{t-1}>` (the
/// gradient with respect to the log-decay `dt'_t A` of token `t`; 0 at a reset). With `abs`,
/// the same on absolute values (`|x|`, `|B|`, `|C|`, `|ybar|`, `|initial_states|`,
/// `|dfinal_states|`): every term counted with its magnitude.
fn token_terms(
    p: &Problem<f64>,
    dout: &Array4<f64>,
    dfin: Option<&Array4<f64>>,
    abs: bool,
) -> (Array3<f64>, Array3<f64>) {
    let d = *p.dims();
    let i = p.inputs();
    let (l, hd, ds) = (d.seqlen, d.headdim, d.dstate);
    let f = |v: f64| if abs { v.abs() } else { v };
    let ybar = ybar_of(p, dout);
    let mut pt = Array3::zeros((d.batch, l, d.nheads));
    let mut qt = Array3::zeros((d.batch, l, d.nheads));
    for b in 0..d.batch {
        for h in 0..d.nheads {
            let g = d.group_of_head(h);
            let mut a = vec![0.0; l];
            let mut st = vec![0.0; (l + 1) * hd * ds];
            if let Some(s0) = &i.initial_states {
                for pp in 0..hd {
                    for n in 0..ds {
                        st[pp * ds + n] = f(s0[[b, h, pp, n]]);
                    }
                }
            }
            let mut prev = 0;
            for t in 0..l {
                let seq = p.seq_idx_at(b, t);
                let dtp = p.dt_processed(b, t, h);
                a[t] = if seq != prev {
                    0.0
                } else {
                    (dtp * i.A[h]).exp()
                };
                prev = seq;
                for pp in 0..hd {
                    for n in 0..ds {
                        let before = st[(t * hd + pp) * ds + n];
                        st[((t + 1) * hd + pp) * ds + n] =
                            a[t] * before + dtp * f(i.x[[b, t, h, pp]]) * f(i.B[[b, t, g, n]]);
                    }
                }
            }
            let mut sb = vec![0.0; hd * ds];
            if let Some(fin) = dfin {
                for pp in 0..hd {
                    for n in 0..ds {
                        sb[pp * ds + n] = f(fin[[b, h, pp, n]]);
                    }
                }
            }
            for t in (0..l).rev() {
                let mut ptv = 0.0;
                let mut qtv = 0.0;
                for pp in 0..hd {
                    let yb = f(ybar[[b, t, h, pp]]);
                    let mut du = 0.0;
                    for n in 0..ds {
                        let k = pp * ds + n;
                        sb[k] += yb * f(i.C[[b, t, g, n]]);
                        du += sb[k] * f(i.B[[b, t, g, n]]);
                        qtv += sb[k] * st[t * hd * ds + k];
                    }
                    ptv += du * f(i.x[[b, t, h, pp]]);
                }
                pt[[b, t, h]] = ptv;
                qt[[b, t, h]] = a[t] * qtv;
                sb.iter_mut().for_each(|v| *v *= a[t]);
            }
        }
    }
    (pt, qt)
}

/// For every gradient, the sum of the absolute values of its terms (see the module
/// documentation of the test for how each is obtained), in the order of
/// `Gradients::named`.
fn magnitudes(
    p: &Problem<f64>,
    dout: &Array4<f64>,
    dfin: Option<&Array4<f64>>,
) -> Vec<(&'static str, ArrayD<f64>)> {
    let d = *p.dims();
    let ap = abs_problem(p);
    let ybar_abs = ybar_of(p, dout).mapv(f64::abs);
    let dfin_abs = dfin.map(|f| f.mapv(f64::abs));
    let g = adjoint::backward(&ap, ybar_abs.view(), dfin_abs.as_ref().map(|f| f.view())).unwrap();
    let (pa, qa) = token_terms(p, dout, dfin, true);
    let mut ddt = Array3::<f64>::zeros((d.batch, d.seqlen, d.nheads));
    let mut da = ndarray::Array1::<f64>::zeros(d.nheads);
    for b in 0..d.batch {
        for t in 0..d.seqlen {
            for h in 0..d.nheads {
                let q = qa[[b, t, h]];
                ddt[[b, t, h]] = pa[[b, t, h]] + p.inputs().A[h].abs() * q;
                da[h] += q * p.dt_processed(b, t, h);
            }
        }
    }
    let mut v: Vec<(&'static str, ArrayD<f64>)> = vec![
        ("dx", g.dx.into_dyn()),
        ("ddt", ddt.clone().into_dyn()),
        ("dA", da.into_dyn()),
        ("dB", g.dB.into_dyn()),
        ("dC", g.dC.into_dyn()),
    ];
    if let Some(dd) = g.dD {
        v.push(("dD", dd));
    }
    if let Some(z) = &p.inputs().z {
        // dz = dout y silu'(z): the terms of y, times |dout silu'(z)|.
        let y = naive::forward(&ap).out;
        let mut m = y.clone();
        ndarray::Zip::from(&mut m)
            .and(dout)
            .and(z)
            .for_each(|m, &go, &zv| {
                let sg = sigmoid(zv);
                *m *= (go * sg * (1.0 + zv * (1.0 - sg))).abs();
            });
        v.push(("dz", m.into_dyn()));
    }
    if p.inputs().dt_bias.is_some() {
        v.push((
            "ddt_bias",
            ddt.sum_axis(Axis(1)).sum_axis(Axis(0)).into_dyn(),
        ));
    }
    if let Some(di) = g.dinitial_states {
        v.push(("dinitial_states", di.into_dyn()));
    }
    v
}

/// `max |a - b| / mag` over elements (`0 / 0` counts as 0).
fn worst_ratio<'a>(
    a: impl IntoIterator<Item = &'a f64>,
    b: impl IntoIterator<Item = &'a f64>,
    mag: impl IntoIterator<Item = &'a f64>,
) -> f64 {
    let mut w: f64 = 0.0;
    for ((x, y), m) in a.into_iter().zip(b).zip(mag) {
        let e = (x - y).abs();
        assert!(e.is_finite(), "non-finite difference: {x} vs {y}");
        if e > 0.0 {
            w = w.max(e / m);
        }
    }
    w
}

/// Largest `|dA_cumsum|` within a chunk, and the largest total log-decay `sum_t |dt'_t A|`
/// of a (row, head).
fn decay_spans(p: &Problem<f64>) -> (f64, f64) {
    let d = *p.dims();
    let cs = p.options().chunk_size;
    let (mut chunk, mut row): (f64, f64) = (0.0, 0.0);
    for b in 0..d.batch {
        for h in 0..d.nheads {
            let (mut acc, mut tot) = (0.0f64, 0.0f64);
            for t in 0..d.seqlen {
                if t % cs == 0 {
                    acc = 0.0;
                }
                let v = (p.dt_processed(b, t, h) * p.inputs().A[h]).abs();
                acc += v;
                tot += v;
                chunk = chunk.max(acc);
            }
            row = row.max(tot);
        }
    }
    (chunk, row)
}

/// Relative perturbation per term, in units of `u`, that the adjoint and the chunked
/// backward may carry together:
///
/// - adjoint: the state cotangent goes through one decay (`exp`, 1 ulp), one product and one
///   fused multiply-add per token (3 per step, `3 seqlen`), the forward state it pairs with as
///   many again (`3 seqlen`); dot products over `dstate` and `headdim`; the gate, `D`, `dt' du`
///   and the `dt` derivative (10);
/// - chunked: a term's decay is a product of exponentials of differences of `dA_cumsum`
///   entries (`e_i`, `dec_ij`, `v_j` and the `scale_c` of the chunks between). Entry `k` of
///   the cumsum, a left-to-right sum of same-sign terms, is off by at most `k u |cs_k|`, so the
///   arguments along a path are off by at most `2 L u` times the total log-decay they span
///   plus the two partial chunks, `2 L (lambda + 2 |cs|max)`, and by one ulp per
///   exponential (at most `nchunks + 2` of them). The total log-decay `lambda` of a term that
///   is not 0 in both is at most 745 (`exp(-745)` underflows to 0), and at most the largest
///   row total. Sums: matrix products of length `L`, `dstate`, `headdim` (two in a chain at
///   most, so twice each), the state pass (`2 nchunks`), the `ddA` prefix sums (`2 L`), 20 for
///   the scalar products, masks, gate and `dt` derivative;
/// - reductions over rows and tokens (`dA`, `ddt_bias`, `dD`: `batch * seqlen + headdim`) and
///   over the heads of a group (`dB`, `dC`).
fn gamma_units(p: &Problem<f64>) -> f64 {
    let d = *p.dims();
    let l = p.options().chunk_size.min(d.seqlen) as f64;
    let (cs_max, row) = decay_spans(p);
    let nc = p.nchunks() as f64;
    let (ds, hd) = (d.dstate as f64, d.headdim as f64);
    let adjoint = 6.0 * d.seqlen as f64 + ds + hd + 10.0;
    let decay = 2.0 * l * (row.min(745.0) + 2.0 * cs_max) + nc + 2.0;
    let chunked = decay + 2.0 * (l + ds + hd) + 2.0 * nc + 2.0 * l + 20.0;
    let reductions = (d.batch * d.seqlen + d.headdim + d.heads_per_group()) as f64;
    adjoint + chunked + reductions
}

/// An absolute floor for results near underflow: an operation on subnormal values errs by at
/// most `2^-1075` absolutely, and no element takes `10^7` of them (`< 1e-316`); any real
/// mistake is far larger.
const FLOOR: f64 = 1e-300;

/// Compares the f64 chunked backward with the adjoint on `p`, element by element against
/// `gamma_units(p) * u * mag + FLOOR`, and normwise (`max |err| / max mag`) against 1e-12, the
/// bar of the f64 forward comparisons. Returns the worst `err / (u mag)` and `err / bound`
/// per gradient.
fn check_against_adjoint(
    p: &Problem<f64>,
    dout: &Array4<f64>,
    dfin: Option<&Array4<f64>>,
) -> Vec<(&'static str, f64, f64)> {
    let a = adjoint::backward(p, dout.view(), dfin.map(|f| f.view())).unwrap();
    let c = chunked_backward::backward(
        p,
        dout.view(),
        dfin.map(|f| f.view()),
        MatmulPrecision::Native,
    )
    .unwrap();
    let mags = magnitudes(p, dout, dfin);
    let gamma = gamma_units(p);
    let got = c.grads.named();
    let want = a.named();
    assert_eq!(got.len(), want.len(), "the same optional gradients");
    assert_eq!(got.len(), mags.len());
    let mut out = Vec::new();
    for (((name, x), (name_a, y)), (name_m, m)) in got.into_iter().zip(want).zip(&mags) {
        assert_eq!((name, name), (name_a, *name_m));
        assert_eq!(x.shape(), y.shape(), "{name}");
        let mut raw: f64 = 0.0;
        let mut rel: f64 = 0.0;
        let (mut worst_err, mut worst_mag): (f64, f64) = (0.0, 0.0);
        for ((u, v), mg) in x.iter().zip(y.iter()).zip(m.iter()) {
            let e = (u - v).abs();
            assert!(e.is_finite(), "{name}: {u} vs {v}");
            let bound = gamma * U64 * mg + FLOOR;
            assert!(
                e <= bound,
                "{name}: |chunked - adjoint| = {e:e} > bound {bound:e} ({u} vs {v}, mag {mg:e}) \
                 for dims {:?}, options {:?}",
                p.dims(),
                p.options()
            );
            if e > 0.0 {
                raw = raw.max(e / (U64 * mg));
                rel = rel.max(e / bound);
            }
            worst_err = worst_err.max(e);
            worst_mag = worst_mag.max(*mg);
        }
        assert!(
            worst_err <= 1e-12 * worst_mag,
            "{name}: normwise {:e}",
            worst_err / worst_mag
        );
        out.push((name, raw, rel));
    }
    out
}

/// At least 200 random problems over every size and option of the contract (chunk sizes 1
/// to 1024, ragged seqlen, ngroups > 1, every optional tensor, seq_idx resets, softplus,
/// dt_limit, strong and no decay), half of them with `dfinal_states`; the cost
/// `batch * seqlen * nheads * headdim * dstate` is capped at 100 000.
#[test]
fn f64_chunked_backward_equals_the_adjoint_on_random_problems() {
    let cases = std::env::var("CHUNKED_BWD_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(240u64);
    let mut rng = SpecRng::new(0xC4_B0);
    let mut worst = std::collections::BTreeMap::<&str, (f64, f64)>::new();
    for case in 0..cases {
        let spec = random_spec(&mut rng, 100_000);
        let p = random_problem(&spec, case).unwrap();
        let (dout, dfin) = upstream(&p, case, case % 2 == 0);
        for (name, raw, rel) in check_against_adjoint(&p, &dout, dfin.as_ref()) {
            let w = worst.entry(name).or_insert((0.0, 0.0));
            *w = (w.0.max(raw), w.1.max(rel));
        }
    }
    for (name, (raw, rel)) in worst {
        println!("{name:>16}: worst |err| / (u mag) {raw:8.1}, worst |err| / bound {rel:.2e}");
    }
}

/// The problem restricted to tokens `t0..t1` of every row, with zero initial states that seed
/// exactly when the full problem's state after token `t0 - 1` reaches token `t0` (`seq_idx`
/// shifted by its value at `t0 - 1`; unchanged for `t0 = 0`). Its `dinitial_states` is then
/// the cotangent of the state after token `t0 - 1` (before token 0 for `t0 = 0`) through the
/// outputs `t0..t1` (and `final_states`, when `t1 = seqlen`).
fn window(p: &Problem<f64>, t0: usize, t1: usize) -> Problem<f64> {
    let i = p.inputs();
    let d = *p.dims();
    let cut4 = |a: &Array4<f64>| a.slice(s![.., t0..t1, .., ..]).to_owned();
    let seq_idx = i.seq_idx.as_ref().map(|sq| {
        let mut w = sq.slice(s![.., t0..t1]).to_owned();
        if t0 > 0 {
            for (mut row, base) in w.outer_iter_mut().zip(sq.column(t0 - 1)) {
                row.mapv_inplace(|v| v - base);
            }
        }
        w
    });
    Problem::new(
        ssd_reference::Dims {
            seqlen: t1 - t0,
            ..d
        },
        *p.options(),
        Inputs {
            x: cut4(&i.x),
            dt: i.dt.slice(s![.., t0..t1, ..]).to_owned(),
            A: i.A.clone(),
            B: cut4(&i.B),
            C: cut4(&i.C),
            D: i.D.clone(),
            z: i.z.as_ref().map(cut4),
            dt_bias: i.dt_bias.clone(),
            initial_states: Some(Array4::zeros((d.batch, d.nheads, d.headdim, d.dstate))),
            seq_idx,
        },
    )
    .unwrap()
}

/// `dinitial_states` of `window(p, t0, t1)` pulled back from `dout[:, t0..t1]` (and
/// `dfin` when `t1 = seqlen`), with its magnitude (the same on absolute values).
fn window_cotangent(
    p: &Problem<f64>,
    dout: &Array4<f64>,
    dfin: Option<&Array4<f64>>,
    (t0, t1): (usize, usize),
) -> (Array4<f64>, Array4<f64>) {
    let w = window(p, t0, t1);
    let go = dout.slice(s![.., t0..t1, .., ..]).to_owned();
    let fin = if t1 == p.dims().seqlen { dfin } else { None };
    let g = adjoint::backward(&w, go.view(), fin.map(|f| f.view())).unwrap();
    let wa = abs_problem(&w);
    let go_abs = ybar_of(&w, &go).mapv(f64::abs);
    let fin_abs = fin.map(|f| f.mapv(f64::abs));
    let m = adjoint::backward(&wa, go_abs.view(), fin_abs.as_ref().map(|f| f.view())).unwrap();
    (
        g.dinitial_states.expect("window has initial states"),
        m.dinitial_states.expect("window has initial states"),
    )
}

/// The chunks a stage test looks at: all of them up to 8, else the first two, two in the
/// middle and the last two.
fn some_chunks(nc: usize) -> Vec<usize> {
    if nc <= 8 {
        (0..nc).collect()
    } else {
        vec![0, 1, nc / 2, nc / 2 + 1, nc - 2, nc - 1]
    }
}

/// Random problems for the stage tests: every option, cost capped at 20 000.
fn stage_cases(stream: u64, n: u64) -> impl Iterator<Item = (u64, Problem<f64>)> {
    let mut rng = SpecRng::new(stream);
    (0..n).map(move |case| {
        let spec = random_spec(&mut rng, 20_000);
        (case, random_problem(&spec, case ^ stream).unwrap())
    })
}

/// `dstates[c]` is the cotangent of the state entering chunk `c` through the chunk's own
/// outputs: the adjoint's `dinitial_states` of the chunk alone (`dfinal_states` 0), and
/// `dchunk_states[c]` the same through every later output and `dfinal_states`: the adjoint's
/// `dinitial_states` of the problem from the chunk's first token on. `dstates_passed[c]` is
/// `dchunk_states[c + 1]` (`dfinal_states` or 0 for the last chunk) and `dinitial_states`
/// is `dchunk_states[0]`, bit for bit.
#[test]
fn state_cotangents_are_the_adjoints_at_chunk_starts() {
    let mut worst: f64 = 0.0;
    for (case, p) in stage_cases(0x57A7E, 60) {
        let d = *p.dims();
        let (dout, dfin) = upstream(&p, case, case % 2 == 1);
        let c = chunked_backward::backward(
            &p,
            dout.view(),
            dfin.as_ref().map(|f| f.view()),
            MatmulPrecision::Native,
        )
        .unwrap();
        let gamma = gamma_units(&p) * U64;
        let cs = p.options().chunk_size;
        let nc = p.nchunks();
        for ch in some_chunks(nc) {
            let (t0, t1) = (ch * cs, ch * cs + p.chunk_len(ch));
            let own = window_cotangent(&p, &dout, None, (t0, t1));
            let all = window_cotangent(&p, &dout, dfin.as_ref(), (t0, d.seqlen));
            for (got, (want, mag), name) in [
                (c.dstates.index_axis(Axis(1), ch), own, "dstates"),
                (
                    c.dchunk_states.index_axis(Axis(1), ch),
                    all,
                    "dchunk_states",
                ),
            ] {
                let r = worst_ratio(
                    got.iter(),
                    want.iter(),
                    mag.mapv(|m| gamma * m + FLOOR).iter(),
                );
                assert!(r <= 1.0, "{name}[{ch}]: {r} of the bound, case {case}");
                worst = worst.max(r);
            }
        }
        for ch in 0..nc {
            let passed = c.dstates_passed.index_axis(Axis(1), ch);
            if ch + 1 < nc {
                assert_eq!(passed, c.dchunk_states.index_axis(Axis(1), ch + 1));
            } else {
                match &dfin {
                    Some(f) => assert_eq!(passed, f.view()),
                    None => assert!(passed.iter().all(|&v| v == 0.0)),
                }
            }
        }
        match &c.grads.dinitial_states {
            Some(di) => assert_eq!(di.view(), c.dchunk_states.index_axis(Axis(1), 0)),
            None => assert!(p.inputs().initial_states.is_none()),
        }
    }
    println!("state cotangents: worst |err| / bound {worst:.2e}");
}

/// `ddt_x` and `ddA` are, token by token, the two parts of the `dt'` gradient from a plain
/// recurrence: `<du_t, x_t>` and `a_t <S_t, s_{t-1}>`; `ddt_processed` is `ddt_x + A ddA`.
#[test]
fn per_token_terms_match_a_plain_recurrence() {
    let mut worst: f64 = 0.0;
    for (case, p) in stage_cases(0x70C3, 80) {
        let d = *p.dims();
        let (dout, dfin) = upstream(&p, case, case % 2 == 0);
        let c = chunked_backward::backward(
            &p,
            dout.view(),
            dfin.as_ref().map(|f| f.view()),
            MatmulPrecision::Native,
        )
        .unwrap();
        let (pt, qt) = token_terms(&p, &dout, dfin.as_ref(), false);
        let (pa, qa) = token_terms(&p, &dout, dfin.as_ref(), true);
        let gamma = gamma_units(&p) * U64;
        let cs = p.options().chunk_size;
        for b in 0..d.batch {
            for h in 0..d.nheads {
                let a = p.inputs().A[h];
                for t in 0..d.seqlen {
                    let (ch, k) = (t / cs, t % cs);
                    let at = [b, h, ch, k];
                    let checks = [
                        ("ddt_x", c.ddt_x[at], pt[[b, t, h]], pa[[b, t, h]]),
                        ("ddA", c.ddA[at], qt[[b, t, h]], qa[[b, t, h]]),
                        (
                            "ddt_processed",
                            c.ddt_processed[at],
                            pt[[b, t, h]] + a * qt[[b, t, h]],
                            pa[[b, t, h]] + a.abs() * qa[[b, t, h]],
                        ),
                    ];
                    for (name, got, want, mag) in checks {
                        let bound = gamma * mag + FLOOR;
                        let e = (got - want).abs();
                        assert!(e <= bound, "{name} at {at:?}: {got} vs {want}, case {case}");
                        if e > 0.0 {
                            worst = worst.max(e / bound);
                        }
                    }
                }
                // Past seqlen, nothing.
                let last = p.nchunks() - 1;
                for k in p.chunk_len(last)..cs {
                    assert_eq!(c.ddt_x[[b, h, last, k]], 0.0);
                    assert_eq!(c.ddt_processed[[b, h, last, k]], 0.0);
                }
            }
        }
    }
    println!("per-token terms: worst |err| / bound {worst:.2e}");
}

/// The loss `<dout, out> + <dfinal, final>` of the forward stages run on a given
/// `dA_cumsum`: `dA_cumsum` as the chunk states and the output read it, and `pass` as the
/// state pass reads it (its last entries, for the decays `scale_c`).
fn stage_loss(
    p: &Problem<f64>,
    cum: &ssd_reference::chunk_cumsum::ChunkCumsum<f64>,
    pass: &ssd_reference::chunk_cumsum::ChunkCumsum<f64>,
    dout: &Array4<f64>,
    dfin: &Array4<f64>,
) -> (f64, f64) {
    use ssd_reference::{compute_out, fwd_pass_state};
    let mut states = fwd_pass_state::chunk_state(p, cum, MatmulPrecision::Native);
    let fin = fwd_pass_state::state_passing(p, pass, &mut states);
    let out = compute_out::compute_out(p, cum, &states, MatmulPrecision::Native);
    let mut l = 0.0;
    let mut mag = 1.0;
    for (a, b) in out.iter().zip(dout).chain(fin.iter().zip(dfin)) {
        l += a * b;
        mag += (a * b).abs();
    }
    (l, mag)
}

/// `ddA_cumsum` and `ddA_chunk_cumsum` against Richardson-extrapolated central differences
/// of the forward stages, perturbing one `dA_cumsum` entry at a time: everywhere for the
/// first, and only where the state pass reads it for the second. As in `adjoint_fd.rs`, with
/// `h = 1e-3 max(1, |v|)` the truncation error is `O(h^4)` and the rounding error about
/// `2e-13 Lmag`; the comparison allows `1e-8 Lmag`. The loss is smooth in `dA_cumsum`
/// (exponentials; the masks do not move). The reverse cumsum of `ddA_cumsum` within each
/// chunk is `ddA` up to its rounding (`1e-10` of the summed magnitudes, far above it).
#[test]
fn cumsum_gradients_match_finite_differences() {
    use ssd_reference::random::{ProblemSpec, SeqIdx};
    use ssd_reference::Dims;
    let mut specs = vec![
        ProblemSpec::full(Dims::new(1, 13, 2, 3, 1, 4), 4),
        ProblemSpec::full(Dims::new(2, 12, 2, 2, 2, 3), 4),
        ProblemSpec::plain(Dims::new(1, 9, 1, 3, 1, 2)),
    ];
    specs[2].options.chunk_size = 8;
    specs[2].initial_states = true;
    let mut resets = ProblemSpec::full(Dims::new(1, 16, 1, 2, 1, 3), 4);
    resets.seq_idx = SeqIdx::AtChunkStarts { every: 1 };
    specs.push(resets);
    let mut late = ProblemSpec::full(Dims::new(1, 10, 1, 2, 1, 2), 8);
    late.seq_idx = SeqIdx::Segments {
        segments: 2,
        first: 1,
    };
    specs.push(late);
    let mut checked = 0;
    for (k, spec) in specs.iter().enumerate() {
        let p = random_problem(spec, 40 + k as u64).unwrap();
        let (dout, dfin) = upstream(&p, k as u64, true);
        let dfin = dfin.unwrap();
        let c =
            chunked_backward::backward(&p, dout.view(), Some(dfin.view()), MatmulPrecision::Native)
                .unwrap();
        let base = ssd_reference::chunk_cumsum::chunk_cumsum(&p);
        let (_, lmag) = stage_loss(&p, &base, &base, &dout, &dfin);
        let sh = base.dA_cumsum.shape().to_vec();
        let (cs, nc) = (sh[3], sh[2]);
        for idx in ndarray::indices((sh[0], sh[1], sh[2], sh[3])) {
            let (b, h, ch, kk) = idx;
            let v = base.dA_cumsum[[b, h, ch, kk]];
            let step = 1e-3 * v.abs().max(1.0);
            let fd = |whole: bool| {
                let at = |e: f64| {
                    let mut q = base.clone();
                    q.dA_cumsum[[b, h, ch, kk]] = v + e;
                    if whole {
                        stage_loss(&p, &q, &q, &dout, &dfin).0
                    } else {
                        stage_loss(&p, &base, &q, &dout, &dfin).0
                    }
                };
                let dd = |e: f64| (at(e) - at(-e)) / (2.0 * e);
                (4.0 * dd(step / 2.0) - dd(step)) / 3.0
            };
            let want = fd(true);
            let got = c.ddA_cumsum[[b, h, ch, kk]];
            assert!(
                (got - want).abs() <= 1e-8 * lmag,
                "ddA_cumsum{idx:?}: {got} vs finite differences {want} (spec {k})"
            );
            if kk == cs - 1 {
                let want = fd(false);
                let got = c.ddA_chunk_cumsum[[b, h, ch]];
                assert!(
                    (got - want).abs() <= 1e-8 * lmag,
                    "ddA_chunk_cumsum[{b}, {h}, {ch}]: {got} vs {want} (spec {k})"
                );
            }
            checked += 1;
        }
        for b in 0..sh[0] {
            for h in 0..sh[1] {
                for ch in 0..nc {
                    let (mut run, mut mag) = (0.0f64, 0.0f64);
                    for kk in (0..cs).rev() {
                        run += c.ddA_cumsum[[b, h, ch, kk]];
                        mag += c.ddA_cumsum[[b, h, ch, kk]].abs();
                        let stable = c.ddA[[b, h, ch, kk]];
                        assert!(
                            (run - stable).abs() <= 1e-10 * (mag + stable.abs()),
                            "reverse cumsum of ddA_cumsum at [{b}, {h}, {ch}, {kk}]: {run} vs ddA {stable}"
                        );
                    }
                }
            }
        }
    }
    assert!(checked >= 128, "{checked} entries checked");
}

/// Relative L2 error `||a - b|| / ||b||`.
fn rel_l2<'a>(a: impl IntoIterator<Item = f64>, b: impl IntoIterator<Item = &'a f64>) -> f64 {
    let (mut num, mut den) = (0.0, 0.0);
    for (x, y) in a.into_iter().zip(b) {
        num += (x - y) * (x - y);
        den += y * y;
    }
    if den > 0.0 {
        (num / den).sqrt()
    } else {
        num.sqrt()
    }
}

/// f32 (native and TF32 products) against the f64 adjoint of the same (f32-rounded) inputs,
/// on well-scaled problems (Mamba-2's usual ranges, every option). The relative L2 error of
/// every gradient is held to 1e-4 (f32) and 2e-2 (TF32): gross-bug detectors, calibrated by
/// the error model elsewhere. Justification: the f64 comparison's term model with `u =
/// 2^-24` gives `n u` with `n` a few hundred at these sizes (chunk 64, `dstate`, `headdim`
/// 32, a few hundred tokens), about 2e-5 of the magnitudes worst case and far less in the
/// root-mean-square; TF32 adds at most four rounded operands per term, `4 * 2^-11 = 2e-3`.
/// `ddt`, `dA` and `ddt_bias` sum terms of both signs (the two parts of `ddt'` have opposite
/// signs), which may shrink the value below the magnitudes by a small factor: the bars keep
/// an order of magnitude above the measured errors.
#[test]
fn f32_and_tf32_are_close_to_the_f64_adjoint() {
    use ssd_reference::random::ProblemSpec;
    use ssd_reference::Dims;
    let specs = [
        ProblemSpec::full(Dims::new(2, 200, 4, 32, 2, 32), 64),
        ProblemSpec::plain(Dims::new(1, 300, 2, 32, 1, 32)),
        ProblemSpec::full(Dims::new(1, 150, 3, 16, 1, 24), 32),
    ];
    let mut worst = [0.0f64; 2];
    for (k, spec) in specs.iter().enumerate() {
        let p32 = random_problem(spec, 900 + k as u64).unwrap().cast::<f32>();
        let p = p32.cast::<f64>();
        let (dout, dfin) = upstream(&p, k as u64, true);
        let dout32 = dout.mapv(|v| v as f32);
        let dfin32 = dfin.as_ref().map(|f| f.mapv(|v| v as f32));
        let dout = dout32.mapv(f64::from);
        let dfin = dfin32.as_ref().map(|f| f.mapv(f64::from));
        let a = adjoint::backward(&p, dout.view(), dfin.as_ref().map(|f| f.view())).unwrap();
        for (m, (prec, bar)) in [
            (MatmulPrecision::Native, 1e-4),
            (MatmulPrecision::Tf32, 2e-2),
        ]
        .into_iter()
        .enumerate()
        {
            let c = chunked_backward::backward(
                &p32,
                dout32.view(),
                dfin32.as_ref().map(|f| f.view()),
                prec,
            )
            .unwrap();
            for ((name, x), (_, y)) in c.grads.named().into_iter().zip(a.named()) {
                let e = rel_l2(x.iter().map(|&v| f64::from(v)), y.iter());
                println!("spec {k} {prec:?} {name:>16}: relative L2 error {e:.2e}");
                assert!(
                    e < bar,
                    "spec {k} {prec:?} {name}: relative L2 error {e:e} >= {bar:e}"
                );
                worst[m] = worst[m].max(e);
            }
        }
    }
    println!(
        "worst relative L2: f32 {:.2e}, TF32 {:.2e}",
        worst[0], worst[1]
    );
}

/// Every output of the driver, as raw bits.
fn all_bits<T: ssd_reference::Real>(c: &chunked_backward::ChunkedGradients<T>) -> Vec<u64> {
    let mut v: Vec<u64> = Vec::new();
    let mut put = |a: ndarray::ArrayViewD<'_, T>| v.extend(a.iter().map(|x| x.as_f64().to_bits()));
    for (_, a) in c.grads.named() {
        put(a);
    }
    put(c.ybar.view().into_dyn());
    if let Some(y) = &c.y {
        put(y.view().into_dyn());
    }
    put(c.dstates.view().into_dyn());
    put(c.dstates_passed.view().into_dyn());
    put(c.dchunk_states.view().into_dyn());
    put(c.ddA_chunk_cumsum.view().into_dyn());
    put(c.ddt_x.view().into_dyn());
    put(c.ddA_cumsum.view().into_dyn());
    put(c.ddA.view().into_dyn());
    put(c.ddt_processed.view().into_dyn());
    v
}

/// The same bits on 1 and 3 threads, in f64 and in f32 with TF32 products.
#[test]
fn bits_do_not_depend_on_the_thread_count() {
    let pool = |n| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .unwrap()
    };
    let (one, three) = (pool(1), pool(3));
    for (case, p) in stage_cases(0x7EAD, 12) {
        let (dout, dfin) = upstream(&p, case, case % 2 == 0);
        let run64 = || {
            all_bits(
                &chunked_backward::backward(
                    &p,
                    dout.view(),
                    dfin.as_ref().map(|f| f.view()),
                    MatmulPrecision::Native,
                )
                .unwrap(),
            )
        };
        assert_eq!(one.install(run64), three.install(run64), "f64, case {case}");
        let p32 = p.cast::<f32>();
        let dout32 = dout.mapv(|v| v as f32);
        let run32 = || {
            all_bits(
                &chunked_backward::backward(&p32, dout32.view(), None, MatmulPrecision::Tf32)
                    .unwrap(),
            )
        };
        assert_eq!(
            one.install(run32),
            three.install(run32),
            "f32 TF32, case {case}"
        );
    }
}

/// Bad upstream gradients give the adjoint's errors, naming the tensor; so do the stage
/// functions' arguments of the wrong shape.
#[test]
fn bad_inputs_give_clear_errors() {
    use ssd_reference::random::ProblemSpec;
    use ssd_reference::Dims;
    let p = random_problem(&ProblemSpec::full(Dims::new(2, 10, 2, 3, 1, 4), 4), 3).unwrap();
    let bad = Array4::<f64>::zeros((2, 10, 2, 4));
    let good = Array4::<f64>::zeros((2, 10, 2, 3));
    let nat = MatmulPrecision::Native;
    let msg = |r: Result<chunked_backward::ChunkedGradients<f64>, _>| match r {
        Err(e) => format!("{e}"),
        Ok(_) => panic!("accepted"),
    };
    let adj = |r: Result<adjoint::Gradients<f64>, _>| match r {
        Err(e) => format!("{e}"),
        Ok(_) => panic!("accepted"),
    };
    let m = msg(chunked_backward::backward(&p, bad.view(), None, nat));
    assert_eq!(m, adj(adjoint::backward(&p, bad.view(), None)));
    assert!(m.contains("`dout`"), "{m}");

    let mut nan = good.clone();
    nan[[1, 2, 0, 1]] = f64::NAN;
    let m = msg(chunked_backward::backward(&p, nan.view(), None, nat));
    assert_eq!(m, adj(adjoint::backward(&p, nan.view(), None)));
    assert!(m.contains("`dout`") && m.contains("[1, 2, 0, 1]"), "{m}");

    let fin = Array4::<f64>::zeros((2, 2, 3, 5));
    let m = msg(chunked_backward::backward(
        &p,
        good.view(),
        Some(fin.view()),
        nat,
    ));
    assert_eq!(m, adj(adjoint::backward(&p, good.view(), Some(fin.view()))));
    assert!(m.contains("`dfinal_states`"), "{m}");

    let cumsum = ssd_reference::chunk_cumsum::chunk_cumsum(&p);
    let wrong = ndarray::Array5::<f64>::zeros((2, 3, 2, 3, 5));
    let e = chunked_backward::bwd_dx(&p, &cumsum, good.view(), wrong.view(), nat).unwrap_err();
    assert!(format!("{e}").contains("`dstates_passed`"), "{e}");
    let e = chunked_backward::bwd_dstates(&p, &cumsum, bad.view(), nat).unwrap_err();
    assert!(format!("{e}").contains("`ybar`"), "{e}");
}
