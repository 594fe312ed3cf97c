//! The adjoint recurrence against central finite differences of the naive forward, in f64,
//! on small problems with every option: every element of every differentiable input.
//!
//! For `L = <dout, out> + <dfinal_states, final_states>` (random upstream gradients), the
//! derivative along one input element `v` is estimated by Richardson-extrapolated central
//! differences, `R = (4 D(h/2) - D(h)) / 3` with `D(h) = (L(v + h) - L(v - h)) / 2h` and
//! `h = 1e-3 max(1, |v|)`: the truncation error is `O(h^4)` (about `1e-12` times the fifth
//! derivative), and the rounding error of each `L` is at most a few `u` times
//! `Lmag = sum |dout| |out| + sum |dfinal| |final| + 1` (u = 2^-53), amplified by
//! `(4 + 1) / 3 / h` at most: about `2e-13 Lmag / max(1, |v|)`. The comparison allows
//! `1e-8 Lmag`, four orders of magnitude above both, and far below any real mistake (the power
//! test below shows a missing softplus derivative caught). Elements whose perturbation would
//! cross one of the forward's kinks (the `dt_limit` clamp, softplus's threshold) are skipped:
//! finite differences measure neither one-sided derivative there.
use ndarray::Array4;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use ssd_reference::random::{random_problem, DSkip, ProblemSpec, SeqIdx};
use ssd_reference::{adjoint, naive, Dims, Inputs, Problem};

fn loss(p: &Problem<f64>, dout: &Array4<f64>, dfin: &Array4<f64>) -> (f64, f64) {
    let o = naive::forward(p);
    let mut l = 0.0;
    let mut mag = 1.0;
    for (a, b) in o.out.iter().zip(dout) {
        l += a * b;
        mag += (a * b).abs();
    }
    for (a, b) in o.final_states.iter().zip(dfin) {
        l += a * b;
        mag += (a * b).abs();
    }
    (l, mag)
}

/// Mutable access to element `k` of input `name`.
fn element<'a>(i: &'a mut Inputs<f64>, name: &str, k: usize) -> &'a mut f64 {
    let it: Box<dyn Iterator<Item = &mut f64>> = match name {
        "x" => Box::new(i.x.iter_mut()),
        "dt" => Box::new(i.dt.iter_mut()),
        "A" => Box::new(i.A.iter_mut()),
        "B" => Box::new(i.B.iter_mut()),
        "C" => Box::new(i.C.iter_mut()),
        "D" => Box::new(i.D.as_mut().expect("D").iter_mut()),
        "z" => Box::new(i.z.as_mut().expect("z").iter_mut()),
        "dt_bias" => Box::new(i.dt_bias.as_mut().expect("dt_bias").iter_mut()),
        "initial_states" => Box::new(i.initial_states.as_mut().expect("init").iter_mut()),
        _ => unreachable!("{name}"),
    };
    { it }.nth(k).expect("index in range")
}

/// The input each gradient belongs to.
fn input_of(grad: &str) -> &str {
    match grad {
        "dinitial_states" => "initial_states",
        "ddt_bias" => "dt_bias",
        g => &g[1..],
    }
}

/// Whether moving `dt[b, t, h]` (or `dt_bias[h]`, `t = None`: every token) by up to `h`
/// could cross a kink of the forward.
fn near_kink(p: &Problem<f64>, b: Option<usize>, t: Option<usize>, head: usize, h: f64) -> bool {
    let d = *p.dims();
    let o = p.options();
    let i = p.inputs();
    let rows: Vec<usize> = b.map_or((0..d.batch).collect(), |b| vec![b]);
    let toks: Vec<usize> = t.map_or((0..d.seqlen).collect(), |t| vec![t]);
    for &b in &rows {
        for &t in &toks {
            let v = i.dt[[b, t, head]] + i.dt_bias.as_ref().map_or(0.0, |bias| bias[head]);
            // softplus and the identity move by at most |dv|.
            let sp = if o.dt_softplus {
                if (v - 20.0).abs() < 2.0 * h {
                    return true;
                }
                ssd_reference::problem::softplus(v)
            } else {
                v
            };
            if (sp - o.dt_limit.0).abs() < 2.0 * h || (sp - o.dt_limit.1).abs() < 2.0 * h {
                return true;
            }
        }
    }
    false
}

struct Outcome {
    checked: usize,
    skipped: usize,
    worst: f64,
    failures: Vec<String>,
}

fn compare(
    p: &Problem<f64>,
    g: &adjoint::Gradients<f64>,
    dout: &Array4<f64>,
    dfin: &Array4<f64>,
) -> Outcome {
    let (_, lmag) = loss(p, dout, dfin);
    let tol = 1e-8 * lmag;
    let d = *p.dims();
    let mut o = Outcome {
        checked: 0,
        skipped: 0,
        worst: 0.0,
        failures: Vec::new(),
    };
    for (name, grad) in g.named() {
        let input = input_of(name);
        let shape = grad.shape().to_vec();
        for (k, &adj) in grad.iter().enumerate() {
            let idx = ssd_reference::problem::unravel(k, &shape);
            let v0 = *element(&mut p.inputs().clone(), input, k);
            let h = 1e-3 * v0.abs().max(1.0);
            let kink = match input {
                "dt" => near_kink(p, Some(idx[0]), Some(idx[1]), idx[2], h),
                "dt_bias" => near_kink(p, None, None, idx[0], h),
                _ => false,
            };
            if kink {
                o.skipped += 1;
                continue;
            }
            let at = |delta: f64| {
                let mut i = p.inputs().clone();
                *element(&mut i, input, k) = v0 + delta;
                let q = Problem::new(d, *p.options(), i).expect("still valid");
                loss(&q, dout, dfin).0
            };
            let central = |h: f64| (at(h) - at(-h)) / (2.0 * h);
            let fd = (4.0 * central(h / 2.0) - central(h)) / 3.0;
            let err = (adj - fd).abs();
            o.worst = o.worst.max(err / tol);
            o.checked += 1;
            if err > tol {
                o.failures.push(format!(
                    "{name}{idx:?}: adjoint {adj:.12e}, finite differences {fd:.12e}, error {err:.3e} > {tol:.3e}"
                ));
            }
        }
    }
    o
}

fn upstream(p: &Problem<f64>, seed: u64) -> (Array4<f64>, Array4<f64>) {
    let d = *p.dims();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut r = |shape: (usize, usize, usize, usize)| {
        let mut a = Array4::zeros(shape);
        a.iter_mut()
            .for_each(|v| *v = rng.random::<f64>() * 2.0 - 1.0);
        a
    };
    let dout = r((d.batch, d.seqlen, d.nheads, d.headdim));
    let dfin = r((d.batch, d.nheads, d.headdim, d.dstate));
    (dout, dfin)
}

/// Small specs that together switch every option on and off.
fn specs() -> Vec<(&'static str, ProblemSpec)> {
    let dims = Dims::new(2, 9, 4, 3, 2, 5);
    let full = ProblemSpec::full(dims, 4);
    vec![
        ("plain", ProblemSpec::plain(Dims::new(2, 7, 2, 3, 1, 4))),
        ("full", full),
        (
            "D per head, no z, no clamp",
            ProblemSpec {
                d: DSkip::PerHead,
                z: false,
                options: ssd_reference::Options {
                    dt_limit: (0.0, f64::INFINITY),
                    ..full.options
                },
                ..full
            },
        ),
        (
            "no softplus, initial state not reaching the first run",
            ProblemSpec {
                options: ssd_reference::Options {
                    dt_softplus: false,
                    dt_limit: (0.0, f64::INFINITY),
                    ..full.options
                },
                dt_range: (0.001, 0.3),
                seq_idx: SeqIdx::Segments {
                    segments: 2,
                    first: 1,
                },
                ..full
            },
        ),
        (
            "resets at chunk starts, strong clamp",
            ProblemSpec {
                seq_idx: SeqIdx::AtChunkStarts { every: 1 },
                options: ssd_reference::Options {
                    dt_limit: (0.05, 0.2),
                    ..full.options
                },
                ..full
            },
        ),
    ]
}

#[test]
fn adjoint_equals_finite_differences_on_every_option() {
    let mut report = Vec::new();
    for (seed, (label, spec)) in specs().into_iter().enumerate() {
        let p = random_problem(&spec, 100 + seed as u64).expect("valid spec");
        let (dout, dfin) = upstream(&p, 200 + seed as u64);
        let g = adjoint::backward(&p, dout.view(), Some(dfin.view())).expect("valid");
        let o = compare(&p, &g, &dout, &dfin);
        println!(
            "{label}: {} elements checked, {} skipped at kinks, worst error / allowance {:.2e}",
            o.checked, o.skipped, o.worst
        );
        assert!(o.checked > 100, "{label}: too few elements checked");
        report.extend(o.failures.into_iter().map(|f| format!("{label}: {f}")));
    }
    assert!(report.is_empty(), "{}", report.join("\n"));
}

/// The comparison's power: the gradients of a forward that differs from `p` only in its
/// softplus option (the softplus derivative missing, in effect) must fail it.
#[test]
fn finite_differences_catch_a_missing_softplus_derivative() {
    let spec = ProblemSpec::full(Dims::new(1, 6, 2, 3, 1, 4), 4);
    let p = random_problem(&spec, 5).expect("valid spec");
    let (dout, dfin) = upstream(&p, 6);
    let mut wrong = *p.options();
    wrong.dt_softplus = false;
    // The raw dt shifted so that the no-softplus forward has the same dt' (the same state
    // path), so only the chain rule through softplus differs.
    let mut i = p.inputs().clone();
    for t in 0..6 {
        for h in 0..2 {
            i.dt[[0, t, h]] = p.dt_processed(0, t, h) - i.dt_bias.as_ref().unwrap()[h];
        }
    }
    let q = Problem::new(*p.dims(), wrong, i).expect("valid");
    let g = adjoint::backward(&q, dout.view(), Some(dfin.view())).expect("valid");
    let o = compare(&p, &g, &dout, &dfin);
    let ddt_failures = o.failures.iter().filter(|f| f.starts_with("ddt[")).count();
    assert!(ddt_failures > 0, "the wrong ddt went unnoticed");
}

#[test]
fn bad_upstream_gradients_are_refused_naming_the_tensor() {
    let p = random_problem(&ProblemSpec::plain(Dims::new(1, 4, 2, 3, 1, 4)), 1).unwrap();
    let wrong = Array4::<f64>::zeros((1, 4, 2, 2));
    let e = adjoint::backward(&p, wrong.view(), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("`dout`") && e.contains("[1, 4, 2, 2]"), "{e}");
    let mut nan = Array4::<f64>::zeros((1, 4, 2, 3));
    nan[[0, 2, 1, 0]] = f64::NAN;
    let e = adjoint::backward(&p, nan.view(), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("`dout`") && e.contains("[0, 2, 1, 0]"), "{e}");
    let ok = Array4::<f64>::zeros((1, 4, 2, 3));
    let fin = Array4::<f64>::zeros((1, 2, 3, 5));
    let e = adjoint::backward(&p, ok.view(), Some(fin.view()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("`dfinal_states`"), "{e}");
}

/// The derivative at the kinks is mamba_ssm's: the clamp passes the gradient at its
/// boundaries and stops it strictly outside; softplus above its threshold is the identity.
#[test]
fn kinks_follow_mamba_ssm() {
    let dims = Dims::new(1, 3, 1, 1, 1, 1);
    let mut spec = ProblemSpec::plain(dims);
    spec.options.dt_limit = (0.1, 0.5);
    let p = random_problem(&spec, 3).unwrap();
    let mut i = p.inputs().clone();
    // Token 0 at the lower bound exactly, token 1 below it, token 2 above the upper bound.
    i.dt = ndarray::Array3::from_shape_vec((1, 3, 1), vec![0.1, 0.05, 0.7]).unwrap();
    let q = Problem::new(dims, spec.options, i.clone()).unwrap();
    let dout = Array4::<f64>::ones((1, 3, 1, 1));
    let g = adjoint::backward(&q, dout.view(), None).unwrap();
    assert!(g.ddt[[0, 0, 0]] != 0.0, "the boundary passes the gradient");
    assert_eq!(g.ddt[[0, 1, 0]], 0.0);
    assert_eq!(g.ddt[[0, 2, 0]], 0.0);

    // Softplus above 20: derivative 1, i.e. the same ddt as without softplus.
    let mut o = spec.options;
    o.dt_limit = (0.0, f64::INFINITY);
    i.dt = ndarray::Array3::from_elem((1, 3, 1), 20.5);
    let mut on = o;
    on.dt_softplus = true;
    let with = adjoint::backward(
        &Problem::new(dims, on, i.clone()).unwrap(),
        dout.view(),
        None,
    )
    .unwrap();
    let without = adjoint::backward(&Problem::new(dims, o, i).unwrap(), dout.view(), None).unwrap();
    assert_eq!(with.ddt, without.ddt);
}
