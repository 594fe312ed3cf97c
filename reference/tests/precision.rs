//! f32 and TF32 results against the f64 naive recurrence (the ground truth), with bounds from
//! the error model of `common::gamma_units`.
//!
//! - f32 (naive or chunked, `MatmulPrecision::Native`): the f64 inputs are first rounded to f32
//!   (relative `u32` on every input; through `dt` and `A` this moves every `dA_cumsum` entry by up
//!   to `3 u32 |cs|max`, hence every decay by up to `6 u32 |cs|max` relative), then the
//!   algorithm runs with unit roundoff `u32`: `|f32 - f64| <= (gamma_units + 10 + 6 |cs|max) *
//!   u32 * mag`.
//! - TF32 (chunked, `MatmulPrecision::Tf32`, f32): on top of that, every term of an output
//!   passes through at most four TF32 operand roundings (carried term: `x` and `diag(w) B` in
//!   the chunk state, then `S` and `C`; intra-chunk term: `C` and `B` in `G`, then `Lmat` and
//!   `x`), each a relative `2^-11`: `(1 + 2^-11)^4 - 1 < 4.01 * 2^-11` more.
//!
//! A last test checks that the TF32 option really rounds: its error is far above f32's.
mod common;

use common::*;
use proptest::prelude::*;
use ssd_reference::random::{random_problem, ProblemSpec};
use ssd_reference::{chunked, naive, Dims, MatmulPrecision, Problem};

const U_TF32: f64 = 1.0 / 2048.0;

fn gamma32(p: &Problem<f64>) -> f64 {
    (gamma_units(p) + 10.0 + 6.0 * max_abs_cumsum(p)) * U32
}

/// Elementwise scaled errors (out, final_states) of f32 naive, f32 chunked and TF32 chunked
/// against f64 naive, asserting the bounds of the module documentation.
fn check(p: &Problem<f64>) -> [(f64, f64); 3] {
    let truth = naive::forward(p);
    let mag = magnitudes(p);
    let q = p.cast::<f32>();
    let g32 = gamma32(p);
    let gtf = 4.01 * U_TF32 + g32;
    let runs = [
        ("f32 naive", naive::forward(&q), g32),
        (
            "f32 chunked",
            chunked::forward(&q, MatmulPrecision::Native).into_output(),
            g32,
        ),
        (
            "tf32 chunked",
            chunked::forward(&q, MatmulPrecision::Tf32).into_output(),
            gtf,
        ),
    ];
    runs.map(|(name, o, bound)| {
        let (eo, _) = scaled_errors(&o.out, &truth.out, &mag.out);
        let (ef, _) = scaled_errors(&o.final_states, &truth.final_states, &mag.final_states);
        assert!(
            eo <= bound && ef <= bound,
            "{name}: |err| / mag out {eo:e}, final_states {ef:e} > bound {bound:e} for {:?}",
            p.dims()
        );
        (eo, ef)
    })
}

proptest! {
    #![proptest_config(config(128, 0x55D_0003))]

    #[test]
    fn f32_and_tf32_within_their_bounds(spec in any_spec(120), seed in any::<u64>()) {
        check(&random_problem(&spec, seed).unwrap());
    }
}

#[test]
fn realistic_layer_slice() {
    // Mamba-2-like sizes (headdim 64, dstate 64, chunk 64), one row of 256 tokens.
    let dims = Dims {
        batch: 1,
        seqlen: 256,
        nheads: 2,
        headdim: 64,
        ngroups: 1,
        dstate: 64,
    };
    let p = random_problem(&ProblemSpec::full(dims, 64), 7).unwrap();
    let [naive32, chunked32, tf32] = check(&p);
    println!("scaled errors: f32 naive {naive32:?}, f32 chunked {chunked32:?}, tf32 {tf32:?}");
}

#[test]
fn tf32_really_rounds_the_operands() {
    let dims = Dims {
        batch: 1,
        seqlen: 128,
        nheads: 2,
        headdim: 32,
        ngroups: 1,
        dstate: 32,
    };
    let p = random_problem(&ProblemSpec::full(dims, 32), 8).unwrap();
    let [_, (native, _), (tf32, _)] = check(&p);
    // Rounding 10 of the 23 mantissa bits away makes the errors about 2^13 times larger; a
    // factor 64 leaves a wide margin while no f32-level discrepancy can reach it.
    assert!(
        tf32 > 64.0 * native,
        "TF32 error {tf32:e} not clearly above f32's {native:e}: operands not rounded?"
    );
}
