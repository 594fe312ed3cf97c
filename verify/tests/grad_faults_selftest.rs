//! The faulty-backward test material checks itself: without a fault it is a correct backward
//! pass (equal to the float64 adjoint within rounding, in f64 and with TF32/BF16 operands),
//! and every planted fault changes the gradients by far more than rounding does.

mod common;

use common::grad_faults::{backward, GradFault, Rounding};
use ndarray::{Array4, ArrayViewD};
use rayon::prelude::*;
use ssd_reference::adjoint::{self, Gradients};
use ssd_reference::random::{random_problem, random_spec, ProblemSpec, SpecRng};
use ssd_reference::{Dims, Problem};

/// Upstream gradients uniform in `[-1, 1]`, drawn from `seed`.
fn upstream(p: &Problem<f64>, seed: u64, with_final: bool) -> (Array4<f64>, Option<Array4<f64>>) {
    let d = *p.dims();
    let mut rng = SpecRng::new(seed);
    let mut draw = |_| 2.0 * rng.unit() - 1.0;
    let dout = Array4::from_shape_fn((d.batch, d.seqlen, d.nheads, d.headdim), &mut draw);
    let fin = with_final
        .then(|| Array4::from_shape_fn((d.batch, d.nheads, d.headdim, d.dstate), &mut draw));
    (dout, fin)
}

/// `max |a - b| / max |b|` (0 when both are 0).
fn rel_max(a: &ArrayViewD<f64>, b: &ArrayViewD<f64>) -> f64 {
    let err = a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((x - y).abs()));
    let mag = b.iter().fold(0f64, |m, y| m.max(y.abs()));
    if err == 0.0 {
        0.0
    } else {
        err / mag
    }
}

/// `||a - b||_2 / ||b||_2` (0 when both are 0).
fn rel_l2(a: &ArrayViewD<f64>, b: &ArrayViewD<f64>) -> f64 {
    let err: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let mag: f64 = b.iter().map(|y| y * y).sum();
    if err == 0.0 {
        0.0
    } else {
        (err / mag).sqrt()
    }
}

/// Per gradient present in `want`, `metric(got, want)`; panics unless both have the same
/// gradients (the presence rules).
fn per_tensor(
    got: &Gradients<f64>,
    want: &Gradients<f64>,
    metric: fn(&ArrayViewD<f64>, &ArrayViewD<f64>) -> f64,
) -> Vec<(&'static str, f64)> {
    let (g, w) = (got.named(), want.named());
    let names = |v: &[(&'static str, ArrayViewD<f64>)]| v.iter().map(|t| t.0).collect::<Vec<_>>();
    assert_eq!(names(&g), names(&w), "the same gradients present");
    g.iter()
        .zip(&w)
        .map(|((name, a), (_, b))| {
            assert_eq!(a.shape(), b.shape(), "{name}");
            (*name, metric(a, b))
        })
        .collect()
}

/// The largest `|cs|` of any chunk: `sum |dt' A|` over a chunk.
fn cs_max(p: &Problem<f64>) -> f64 {
    let d = *p.dims();
    let cl = p.options().chunk_size;
    let mut m = 0f64;
    for b in 0..d.batch {
        for h in 0..d.nheads {
            for c in 0..p.nchunks() {
                let s: f64 = (c * cl..d.seqlen.min((c + 1) * cl))
                    .map(|t| (p.dt_processed(b, t, h) * p.inputs().A[h]).abs())
                    .sum();
                m = m.max(s);
            }
        }
    }
    m
}

/// The number of roundings of the working arithmetic on the longest path of one term, both
/// in the chunked backward and in the adjoint: `2 L |cs|max` for a decay (the cumsum's
/// absolute error moves its argument, as in the forward's model of `docs/math.md`), `2 L` for
/// the within-chunk sums and the cumsum's pullback, `seqlen` for the state cotangent passed
/// token by token (adjoint) or chunk by chunk, `headdim + dstate` for the dot products.
fn path_roundings(p: &Problem<f64>) -> f64 {
    let d = *p.dims();
    let l = p.options().chunk_size.min(d.seqlen) as f64;
    2.0 * l * cs_max(p) + 2.0 * l + (d.seqlen + d.headdim + d.dstate) as f64
}

/// `x`, `B`, `C` and `z` rounded to bf16: the inputs a bf16 kernel sees.
fn bf16_inputs(p: &Problem<f64>) -> Problem<f64> {
    let r = |v: f64| Rounding::Bf16.apply(v);
    let mut i = p.inputs().clone();
    i.x.mapv_inplace(r);
    i.B.mapv_inplace(r);
    i.C.mapv_inplace(r);
    if let Some(z) = &mut i.z {
        z.mapv_inplace(r);
    }
    Problem::new(*p.dims(), *p.options(), i).unwrap()
}

/// `(fault, rounding)` on the f32 cast of `p`, widened to f64.
fn backward32(
    p: &Problem<f64>,
    dout: &Array4<f64>,
    fin: Option<&Array4<f64>>,
    fault: GradFault,
    r: Rounding,
) -> Gradients<f64> {
    let d32 = dout.mapv(|v| v as f32);
    let f32s = fin.map(|f| f.mapv(|v| v as f32));
    backward(
        &p.cast::<f32>(),
        d32.view(),
        f32s.as_ref().map(|f| f.view()),
        fault,
        r,
    )
    .to_f64()
}

fn adjoint_of(p: &Problem<f64>, dout: &Array4<f64>, fin: Option<&Array4<f64>>) -> Gradients<f64> {
    adjoint::backward(p, dout.view(), fin.map(|f| f.view())).unwrap()
}

/// The gradient with the largest `metric`, and the metric.
fn worst(v: &[(&'static str, f64)]) -> (&'static str, f64) {
    v.iter()
        .fold(("-", 0f64), |m, &(n, e)| if e > m.1 { (n, e) } else { m })
}

/// Without a fault, in f64, the chunked backward is the adjoint up to rounding, on 200 random
/// problems of every size and option (costs up to 100 000), half of them with
/// `dfinal_states`.
///
/// Bound, per gradient, on `max |err| / max |g|`: each term of a gradient element passes at
/// most `n = path_roundings` roundings in either computation, so `|err| <= 2 n u sum |T|`
/// (`u = 2^-53`, both sides). `sum |T|` exceeds `max |g|` by the cancellation of the
/// random-sign terms, about `sqrt(N)` for a sum of `N` of them; the largest sum, `dA`, has
/// `N = batch seqlen L (headdim + dstate)` (each token pair of a chunk, each channel and state
/// index). So the bound is `2 n u sqrt(N)`. A wrong formula gives errors of order 1.
#[test]
fn without_fault_equals_the_adjoint_in_f64() {
    let mut rng = SpecRng::new(0x6AD_F417);
    let specs: Vec<(ProblemSpec, u64)> = (0..200)
        .map(|k| (random_spec(&mut rng, 100_000), 1000 + k))
        .collect();
    let u = f64::EPSILON / 2.0;
    // Per case: (worst error, its gradient, error / bound).
    let res: Vec<(f64, &'static str, f64)> = specs
        .par_iter()
        .map(|(spec, seed)| {
            let p = random_problem(spec, *seed).unwrap();
            let (dout, fin) = upstream(&p, *seed, seed % 2 == 0);
            let want = adjoint_of(&p, &dout, fin.as_ref());
            let fin_v = fin.as_ref().map(|f| f.view());
            let got = backward(&p, dout.view(), fin_v, GradFault::None, Rounding::None);
            let (name, err) = worst(&per_tensor(&got, &want, rel_max));
            let d = spec.dims;
            let l = spec.options.chunk_size.min(d.seqlen);
            let terms = (d.batch * d.seqlen * l * (d.headdim + d.dstate)) as f64;
            let bound = 2.0 * path_roundings(&p) * u * terms.sqrt();
            (err, name, err / bound)
        })
        .collect();
    let (k, w) = res.iter().enumerate().fold(
        (0, res[0]),
        |m, (k, &v)| if v.0 > m.1 .0 { (k, v) } else { m },
    );
    let ratio = res.iter().fold(0f64, |m, v| m.max(v.2));
    println!(
        "f64: worst max|err|/max|g| {:.2e} ({} of {:?}, chunk {}); worst error/bound {ratio:.2e}",
        w.0, w.1, specs[k].0.dims, specs[k].0.options.chunk_size
    );
    for (c, ((spec, _), r)) in specs.iter().zip(&res).enumerate() {
        assert!(
            r.2 <= 1.0,
            "case {c} ({spec:?}): {} off by {:.2e}",
            r.1,
            r.0
        );
    }
}

/// With f32 arithmetic and TF32 (rounded or truncated) or BF16 operands, the result stays
/// close to the float64 adjoint (for BF16: the adjoint of the bf16-rounded `x`, `B`, `C`, `z`,
/// `dout`, the inputs the kernel sees), on 40 random problems.
///
/// Bound, per gradient, on the relative L2 error: a term passes through at most 4 rounded
/// operands (two chained products: e.g. `dB += round(dM decay dt') round(C)` with `dM =
/// round(ybar) . round(x)`), each off by at most `u_op` relatively (`2^-11` for TF32 rounded to
/// nearest, `2^-10` truncated, `2^-8` for BF16), plus `n = path_roundings` f32 roundings
/// (`2^-24`, the input casts included). Elementwise `|err| <= (4 u_op + n 2^-24) sum |T|`; the
/// L2 norm of `sum |T|` exceeds that of `g` by a cancellation factor, which we allow up to 8
/// (the random-sign terms make it about 1 to 3 on most gradients; reductions of few terms,
/// `dA`, `dD`, `ddt_bias`, reach the most).
#[test]
fn rounded_operands_stay_close_to_the_adjoint() {
    let mut rng = SpecRng::new(0x7F3_2B16);
    let specs: Vec<(ProblemSpec, u64)> = (0..40)
        .map(|k| (random_spec(&mut rng, 100_000), 5000 + k))
        .collect();
    let modes = [
        ("f32", Rounding::None, 0.0),
        ("tf32", Rounding::Tf32, 2f64.powi(-11)),
        ("tf32 truncated", Rounding::Tf32Truncate, 2f64.powi(-10)),
        ("bf16", Rounding::Bf16, 2f64.powi(-8)),
    ];
    // Per case and mode: (worst relative L2, its gradient, error / bound).
    let res: Vec<Vec<(f64, &'static str, f64)>> = specs
        .par_iter()
        .map(|(spec, seed)| {
            let p = random_problem(spec, *seed).unwrap();
            let (dout, fin) = upstream(&p, *seed, seed % 2 == 1);
            let want = adjoint_of(&p, &dout, fin.as_ref());
            let pb = bf16_inputs(&p);
            let doutb = dout.mapv(|v| Rounding::Bf16.apply(v));
            let want_b = adjoint_of(&pb, &doutb, fin.as_ref());
            let n = path_roundings(&p);
            modes
                .iter()
                .map(|&(_, r, u_op)| {
                    let got = backward32(&p, &dout, fin.as_ref(), GradFault::None, r);
                    let want = if r == Rounding::Bf16 { &want_b } else { &want };
                    let (name, e) = worst(&per_tensor(&got, want, rel_l2));
                    (e, name, e / (8.0 * (4.0 * u_op + n * 2f64.powi(-24))))
                })
                .collect()
        })
        .collect();
    for (m, (what, _, _)) in modes.iter().enumerate() {
        let (k, w) = res.iter().enumerate().fold((0, res[0][m]), |a, (k, v)| {
            if v[m].0 > a.1 .0 {
                (k, v[m])
            } else {
                a
            }
        });
        let ratio = res.iter().fold(0f64, |a, v| a.max(v[m].2));
        println!(
            "{what}: worst relative L2 {:.2e} ({} of {:?}, chunk {}); worst error/bound {ratio:.2}",
            w.0, w.1, specs[k].0.dims, specs[k].0.options.chunk_size
        );
        for (c, v) in res.iter().enumerate() {
            assert!(
                v[m].2 <= 1.0,
                "{what}, case {c} ({:?}): {:?}",
                specs[c].0,
                v[m]
            );
        }
    }
}

/// Every planted fault is real and reachable: on a problem that exercises it, it moves some
/// gradient by a relative L2 distance above 1e-2 and above 10 times what TF32 operands move
/// that gradient by.
#[test]
fn every_fault_moves_the_gradients_far_more_than_rounding() {
    // Every option on: D per channel, z, dt_bias, softplus, dt_limit [0.001, 0.5] (raw dt in
    // [-4, 1] plus bias: both sides of both kinks), initial states, three runs per row, two
    // heads per group, several chunks, and dfinal_states below.
    let full = ProblemSpec::full(Dims::new(2, 150, 4, 8, 2, 8), 32);
    for fault in GradFault::WRONG {
        let spec = match fault {
            // Weak decay, so that what crosses a reset wrongly is not decayed away.
            GradFault::ResetIgnoredInBackward => ProblemSpec {
                a_range: (0.01, 0.1),
                ..full
            },
            _ => full,
        };
        let p = random_problem(&spec, 11).unwrap();
        let (dout, fin) = upstream(&p, 11, true);
        let fin_v = fin.as_ref().map(|f| f.view());
        let none = backward(&p, dout.view(), fin_v, GradFault::None, Rounding::None);
        let tf32 = backward32(&p, &dout, fin.as_ref(), GradFault::None, Rounding::Tf32);
        let rounding = per_tensor(&tf32, &none, rel_l2);
        let moved = per_tensor(
            &backward(&p, dout.view(), fin_v, fault, Rounding::None),
            &none,
            rel_l2,
        );
        let (name, by, tf) = moved
            .iter()
            .zip(&rounding)
            .map(|(&(n, e), &(_, r))| (n, e, r))
            .fold(("-", 0.0, 0.0), |m, v| {
                if v.1 / v.2 > m.1 / m.2 || m.1 == 0.0 {
                    v
                } else {
                    m
                }
            });
        println!("{fault:?}: {name} moved by {by:.2e} (TF32 rounding: {tf:.2e})");
        assert!(
            moved
                .iter()
                .zip(&rounding)
                .any(|(&(_, e), &(_, r))| e > 1e-2 && e > 10.0 * r),
            "{fault:?} barely moves the gradients: {moved:?} (TF32: {rounding:?})"
        );
    }
}

/// A 1 x 512 x 4 x 32 x 32 problem (chunk 64, every option) in f64 and with TF32 operands:
/// the times, for the record.
#[test]
fn a_realistic_shape_takes_well_under_a_second() {
    let p = random_problem(&ProblemSpec::full(Dims::new(1, 512, 4, 32, 1, 32), 64), 3).unwrap();
    let (dout, fin) = upstream(&p, 3, true);
    let t = std::time::Instant::now();
    let fin_v = fin.as_ref().map(|f| f.view());
    let _ = backward(&p, dout.view(), fin_v, GradFault::None, Rounding::None);
    let f64_time = t.elapsed();
    let t = std::time::Instant::now();
    let _ = backward32(&p, &dout, fin.as_ref(), GradFault::None, Rounding::Tf32);
    println!(
        "1x512x4x32x32: f64 {f64_time:.2?}, f32 with TF32 operands {:.2?}",
        t.elapsed()
    );
}
