//! The gradient magnitudes bound the gradients: every gradient element is a sum of terms whose
//! absolute values the magnitude adds up, so `|g| <= M` (up to the rounding of the two
//! passes), and the budget channels are at least the magnitude times the smallest coefficient.

use ssd_reference::adjoint::backward;
use ssd_reference::adjoint_magnitude::{gradient_magnitudes, CREATE};
use ssd_reference::random::{random_problem, random_spec, SpecRng};

#[test]
fn magnitudes_bound_every_gradient() {
    let mut rng = SpecRng::new(0x6d61_676e);
    for case in 0..150 {
        let spec = random_spec(&mut rng, 20_000);
        let p = random_problem(&spec, case).unwrap();
        let d = *p.dims();
        let mut up = SpecRng::new(case);
        let dout = ndarray::Array4::from_shape_fn((d.batch, d.seqlen, d.nheads, d.headdim), |_| {
            2.0 * up.unit() - 1.0
        });
        let dfin = ndarray::Array4::from_shape_fn((d.batch, d.nheads, d.headdim, d.dstate), |_| {
            2.0 * up.unit() - 1.0
        });
        let with_final = case % 2 == 0;
        let dfin = with_final.then_some(dfin.view());
        let g = backward(&p, dout.view(), dfin).unwrap();
        let m = gradient_magnitudes(&p, dout.view(), dfin).unwrap();
        assert_eq!(g.named().len(), m.tensors.len());
        for (name, v) in g.named() {
            let c = m.channels(name).unwrap();
            assert_eq!(v.shape(), c.mag.shape(), "{name}");
            // Both passes round in f64: a sum of n terms within (n u) of the exact one, far
            // below 1e-9 relatively for these sizes.
            for ((&g, &mag), &acc) in v.iter().zip(c.mag.iter()).zip(c.acc.iter()) {
                assert!(
                    g.abs() <= mag * (1.0 + 1e-9) + 1e-300,
                    "case {case} {name}: |g| = {} > M = {mag}",
                    g.abs()
                );
                assert!(
                    acc >= CREATE * mag * (1.0 - 1e-9),
                    "case {case} {name}: acc {acc} < 2 M {mag}"
                );
            }
        }
    }
}

#[test]
fn bad_upstream_shapes_are_named() {
    let mut rng = SpecRng::new(3);
    let p = random_problem(&random_spec(&mut rng, 2_000), 1).unwrap();
    let d = *p.dims();
    let dout = ndarray::Array4::<f64>::zeros((d.batch, d.seqlen + 1, d.nheads, d.headdim));
    let e = gradient_magnitudes(&p, dout.view(), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("dout"), "{e}");
    let dout = ndarray::Array4::<f64>::zeros((d.batch, d.seqlen, d.nheads, d.headdim));
    let dfin = ndarray::Array4::<f64>::zeros((d.batch, d.nheads, d.headdim + 1, d.dstate));
    let e = gradient_magnitudes(&p, dout.view(), Some(dfin.view()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("dfinal_states"), "{e}");
}
