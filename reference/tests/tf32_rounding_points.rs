//! The TF32 rounding points, as documented in `fwd_pass_state` and `compute_out` (and in
//! docs/math.md), reproduced by hand in f32 and compared with the chunked path.
//!
//! The hand computation rounds exactly the documented operands, builds them with the same f32
//! operations in the same order (so every rounded operand is bit-identical to the crate's), and
//! accumulates the final products in f64. What remains is the crate's f32 accumulation: a sum
//! of `K` terms accumulated by fused multiply-adds is within `K * u32 * sum |terms|`, so
//!
//! ```text
//! chunk state:  |got - want| <= (L + 1) u32 sum_j |x_j w_j B_j|
//! output:       |got - want| <= (dstate + L + 8) u32 M
//! ```
//!
//! with `M` the sum of the absolute values of the terms of the output (carried, intra-chunk and
//! `D` terms) times `|z sigmoid(z)|`. A rounding point added or left out changes a term by up
//! to `2^-11` relative, hundreds of times these bounds for the sizes used here.
use ndarray::{s, Array4, Array5};
use ssd_reference::random::{random_problem, ProblemSpec};
use ssd_reference::{
    chunk_cumsum, compute_out, fwd_pass_state, Dims, MatmulPrecision, Problem, Real,
};

const U32: f64 = f32::EPSILON as f64 / 2.0;

fn r(v: f32) -> f32 {
    v.round_tf32()
}

fn problem() -> Problem<f32> {
    let dims = Dims {
        batch: 2,
        seqlen: 45,
        nheads: 4,
        headdim: 8,
        ngroups: 2,
        dstate: 8,
    };
    random_problem(&ProblemSpec::full(dims, 16), 12)
        .unwrap()
        .cast::<f32>()
}

#[test]
fn chunk_state_rounds_x_and_the_scaled_b() {
    let p = problem();
    let d = *p.dims();
    let i = p.inputs();
    let cs = p.options().chunk_size;
    let cum = chunk_cumsum::chunk_cumsum(&p);
    let got = fwd_pass_state::chunk_state(&p, &cum, MatmulPrecision::Tf32);
    for b in 0..d.batch {
        for c in 0..p.nchunks() {
            for h in 0..d.nheads {
                let g = d.group_of_head(h);
                let (t0, l) = (c * cs, p.chunk_len(c));
                let cs_c = cum.dA_cumsum.slice(s![b, h, c, ..]);
                let dt = cum.dt.slice(s![b, h, c, ..]);
                let seq_last = p.seq_idx_at(b, t0 + l - 1);
                // w_j = exp(cs_last - cs_j) * dt'_j (the crate's vectorised exp)
                let mut w: Vec<f32> = (0..l).map(|j| cs_c[l - 1] - cs_c[j]).collect();
                f32::exp_all(&mut w);
                for pp in 0..d.headdim {
                    for n in 0..d.dstate {
                        let (mut want, mut mag) = (0.0f64, 0.0f64);
                        for j in 0..l {
                            if p.seq_idx_at(b, t0 + j) != seq_last {
                                continue;
                            }
                            // operands: round(x), round(B * (w * dt'))
                            let wb = r(i.B[[b, t0 + j, g, n]] * (w[j] * dt[j]));
                            let term = r(i.x[[b, t0 + j, h, pp]]) as f64 * wb as f64;
                            want += term;
                            mag += term.abs();
                        }
                        let gv = got[[b, c, h, pp, n]] as f64;
                        let bound = (l + 1) as f64 * U32 * mag;
                        assert!(
                            (gv - want).abs() <= bound,
                            "chunk state [{b}, {c}, {h}, {pp}, {n}]: {gv} vs {want} (bound {bound:e})"
                        );
                    }
                }
            }
        }
    }
}

/// The hand computation of one output entry's terms: (value, magnitude) before the gate.
#[allow(clippy::too_many_arguments)]
fn hand_output(
    p: &Problem<f32>,
    cum: &chunk_cumsum::ChunkCumsum<f32>,
    states: &Array5<f32>,
    (b, c, h): (usize, usize, usize),
    i_row: usize,
    pp: usize,
    g_row: &[f32],
    decay_row: &[f32],
    e_i: f32,
) -> (f64, f64) {
    let d = *p.dims();
    let inp = p.inputs();
    let cs = p.options().chunk_size;
    let (t0, g) = (c * cs, d.group_of_head(h));
    let dt = cum.dt.slice(s![b, h, c, ..]);
    let (mut want, mut mag) = (0.0f64, 0.0f64);
    // carried: e_i * (round(C_i) . round(S_c[p, :]))
    let mut carried = 0.0f64;
    let mut carried_mag = 0.0f64;
    for n in 0..d.dstate {
        let term = r(inp.C[[b, t0 + i_row, g, n]]) as f64 * r(states[[b, c, h, pp, n]]) as f64;
        carried += term;
        carried_mag += term.abs();
    }
    want += carried * e_i as f64;
    mag += carried_mag * e_i as f64;
    // intra-chunk: sum_k round(Lmat[i, k]) round(x_k[p]),
    // Lmat[i, k] = (G[i, k] * exp(cs_i - cs_k)) * dt'_k for the same sequence
    for k in 0..=i_row {
        if p.seq_idx_at(b, t0 + k) != p.seq_idx_at(b, t0 + i_row) {
            continue;
        }
        let lmat = r(g_row[k] * decay_row[k] * dt[k]);
        let term = lmat as f64 * r(inp.x[[b, t0 + k, h, pp]]) as f64;
        want += term;
        mag += term.abs();
    }
    let dx = p.d_skip(h, pp) as f64 * inp.x[[b, t0 + i_row, h, pp]] as f64;
    (want + dx, mag + dx.abs())
}

#[test]
fn compute_out_rounds_c_b_s_lmat_and_x() {
    let p = problem();
    let d = *p.dims();
    let inp = p.inputs();
    let cs = p.options().chunk_size;
    let cum = chunk_cumsum::chunk_cumsum(&p);
    let states = fwd_pass_state::fwd_pass_state(&p, &cum, MatmulPrecision::Tf32).chunk_states;
    let got: Array4<f32> = compute_out::compute_out(&p, &cum, &states, MatmulPrecision::Tf32);
    for b in 0..d.batch {
        for c in 0..p.nchunks() {
            let (t0, l) = (c * cs, p.chunk_len(c));
            let seq_prev = if c == 0 { 0 } else { p.seq_idx_at(b, t0 - 1) };
            for h in 0..d.nheads {
                let g = d.group_of_head(h);
                let cs_c = cum.dA_cumsum.slice(s![b, h, c, ..]);
                let mut e: Vec<f32> = (0..l).map(|i| cs_c[i]).collect();
                f32::exp_all(&mut e);
                for i_row in 0..l {
                    // G[i, :] = round(C_i) . round(B_k): one f32 fma per n, in order from 0
                    let g_row: Vec<f32> = (0..=i_row)
                        .map(|k| {
                            (0..d.dstate).fold(0.0f32, |acc, n| {
                                r(inp.C[[b, t0 + i_row, g, n]])
                                    .mul_add(r(inp.B[[b, t0 + k, g, n]]), acc)
                            })
                        })
                        .collect();
                    let mut decay: Vec<f32> = (0..=i_row).map(|k| cs_c[i_row] - cs_c[k]).collect();
                    f32::exp_all(&mut decay);
                    let e_i = if p.seq_idx_at(b, t0 + i_row) == seq_prev {
                        e[i_row]
                    } else {
                        0.0
                    };
                    for pp in 0..d.headdim {
                        let (y, mag) = hand_output(
                            &p,
                            &cum,
                            &states,
                            (b, c, h),
                            i_row,
                            pp,
                            &g_row,
                            &decay,
                            e_i,
                        );
                        let gate = match &inp.z {
                            Some(z) => {
                                let zv = z[[b, t0 + i_row, h, pp]] as f64;
                                zv / (1.0 + (-zv).exp())
                            }
                            None => 1.0,
                        };
                        let want = y * gate;
                        let gv = got[[b, t0 + i_row, h, pp]] as f64;
                        let bound = (d.dstate + l + 8) as f64 * U32 * mag * gate.abs();
                        assert!(
                            (gv - want).abs() <= bound,
                            "out [{b}, {}, {h}, {pp}]: {gv} vs {want} (bound {bound:e})",
                            t0 + i_row
                        );
                    }
                }
            }
        }
    }
}
