//! The chunked backward against the adjoint recurrence (the gradient ground truth).
use rand::{Rng, SeedableRng};
use ssd_reference::random::{random_problem, random_spec, SpecRng};
use ssd_reference::{adjoint, chunked_backward, MatmulPrecision};

/// Normwise: `max |chunked - adjoint| / max |adjoint|` per gradient, held to the forward's
/// bar for f64 (1e-12), on random problems with every option.
#[test]
fn agrees_with_the_adjoint_normwise() {
    let mut rng = SpecRng::new(1);
    for case in 0..60 {
        let spec = random_spec(&mut rng, 30_000);
        let p = random_problem(&spec, case).unwrap();
        let d = *p.dims();
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(case);
        let dout = ndarray::Array4::from_shape_fn((d.batch, d.seqlen, d.nheads, d.headdim), |_| {
            r.random_range(-1.0..1.0)
        });
        let dfin = ndarray::Array4::from_shape_fn((d.batch, d.nheads, d.headdim, d.dstate), |_| {
            r.random_range(-1.0..1.0)
        });
        let a = adjoint::backward(&p, dout.view(), Some(dfin.view())).unwrap();
        let c =
            chunked_backward::backward(&p, dout.view(), Some(dfin.view()), MatmulPrecision::Native)
                .unwrap();
        for ((name, x), (_, y)) in c.grads.named().into_iter().zip(a.named()) {
            let m = y.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            let e = x
                .iter()
                .zip(y.iter())
                .fold(0.0f64, |m, (u, v)| m.max((u - v).abs()));
            assert!(e <= 1e-12 * m, "case {case} {name}: {e:e} vs max {m:e}");
        }
    }
}
