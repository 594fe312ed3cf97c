//! A compact chunked implementation in plain loops, with a switch that plants one of the bugs
//! kernel authors really make. Test-only: it measures the power of the checks.
//!
//! With [`Fault::None`] it computes the contract's function (a test checks it against the
//! naive recurrence and the reference's chunked path); every other [`Fault`] is wrong in one
//! specific way. [`Rounding`] rounds every matrix-product operand as a TF32 or BF16 tensor-core
//! kernel does, independently of the reference crate's own TF32 emulation.
//!
//! The algorithm is mamba_ssm's, stage by stage, per (batch, head): the within-chunk cumsum of
//! `dt' A`, the per-chunk states `x^T diag(exp(cs_last - cs) dt') B`, the sequential state
//! passing, and per token the carried term `exp(cs_i) C_i . S_c` plus the causal, decayed
//! `sum_{j <= i} (C_i . B_j) exp(cs_i - cs_j) dt'_j x_j`, the `D` skip and the `z` gate.
#![allow(dead_code)]

use ndarray::{Array4, Array5};
use rayon::prelude::*;
use ssd_reference::{ChunkedOutput, Problem, Real};

/// One deliberately wrong variant of the chunked path (or none).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fault {
    /// The correct algorithm.
    None,
    /// Causal mask off by one: the intra-chunk sum keeps `j < i`, dropping the diagonal.
    CausalMaskOffByOne,
    /// Chunk states decayed from the wrong end of the chunk: `exp(cs_j)` (start to `j`)
    /// instead of `exp(cs_last - cs_j)` (`j` to the end).
    DecayWrongEnd,
    /// Last partial chunk mishandled: the cumsum is not carried past `seqlen`, so the padded
    /// positions hold 0 and the state pass reads `exp(0 - cs_j)` at `chunk_size - 1`.
    LastPartialChunk,
    /// Group mapping `h % ngroups` instead of `h / (nheads / ngroups)`.
    GroupModulo,
    /// softplus threshold wrong: `v > 0` takes the identity branch instead of `v > 20`.
    SoftplusThreshold,
    /// `D` skip added after the gate: `y silu(z) + D x` instead of `(y + D x) silu(z)`.
    DAfterGate,
    /// `initial_states` ignored.
    InitialStateDropped,
    /// seq_idx reset missed at a chunk boundary: the carried state is masked by comparing
    /// with the chunk's own first token instead of the previous chunk's last one.
    SeqIdxResetMissedAtChunkStart,
    /// State passing without decay: `S_{c+1} = S_c + states_c`.
    StatePassingNoDecay,
    /// `dt_bias` ignored.
    DtBiasIgnored,
    /// `dt_limit` clamp skipped.
    DtLimitIgnored,
    /// The gate written as `y sigmoid(z)` instead of `y z sigmoid(z)`.
    GateWithoutZ,
}

impl Fault {
    /// Every wrong variant.
    pub const WRONG: [Fault; 12] = [
        Fault::CausalMaskOffByOne,
        Fault::DecayWrongEnd,
        Fault::LastPartialChunk,
        Fault::GroupModulo,
        Fault::SoftplusThreshold,
        Fault::DAfterGate,
        Fault::InitialStateDropped,
        Fault::SeqIdxResetMissedAtChunkStart,
        Fault::StatePassingNoDecay,
        Fault::DtBiasIgnored,
        Fault::DtLimitIgnored,
        Fault::GateWithoutZ,
    ];
}

/// How matrix-product operands are rounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rounding {
    /// Not at all (plain `T` arithmetic).
    None,
    /// To TF32: 11 significant bits, round to nearest (ties away, as `cvt.rna.tf32.f32`).
    Tf32,
    /// To TF32 by truncation (the 13 low mantissa bits dropped): what a tensor core does with
    /// f32 registers fed to a TF32 `mma` without a `cvt.rna.tf32.f32` first.
    Tf32Truncate,
    /// To bfloat16: 8 significant bits, round to nearest even.
    Bf16,
}

impl Rounding {
    /// `v` rounded as a matrix-product operand.
    #[inline]
    pub fn apply<T: Real>(self, v: T) -> T {
        match self {
            Rounding::None => v,
            Rounding::Tf32 => T::lit(round_bits(v.as_f64(), 11)),
            Rounding::Tf32Truncate => {
                T::lit(f32::from_bits((v.as_f64() as f32).to_bits() & 0xFFFF_E000) as f64)
            }
            Rounding::Bf16 => T::lit(half::bf16::from_f64(v.as_f64()).to_f64()),
        }
    }
}

/// Rounds the significand of `v` to `bits` significant bits, half away from zero
/// (independent of the reference crate's TF32 bit trick; exact for f32-range values).
fn round_bits(v: f64, bits: i32) -> f64 {
    if v == 0.0 || !v.is_finite() {
        return v;
    }
    let e = v.abs().log2().floor() as i32;
    let scale = 2f64.powi(bits - 1 - e);
    let r = (v * scale).abs();
    let r = (r + 0.5).floor();
    v.signum() * r / scale
}

fn gate<T: Real>(y: T, z: T, fault: Fault) -> T {
    let sig = T::one() / (T::one() + (-z).exp());
    if fault == Fault::GateWithoutZ {
        y * sig
    } else {
        y * z * sig
    }
}

fn dt_processed<T: Real>(p: &Problem<T>, b: usize, t: usize, h: usize, fault: Fault) -> T {
    let i = p.inputs();
    let mut v = i.dt[[b, t, h]];
    if let Some(bias) = &i.dt_bias {
        if fault != Fault::DtBiasIgnored {
            v = v + bias[h];
        }
    }
    if p.options().dt_softplus {
        let thr = if fault == Fault::SoftplusThreshold {
            0.0
        } else {
            20.0
        };
        if v <= T::lit(thr) {
            v = v.exp().ln_1p();
        }
    }
    if fault == Fault::DtLimitIgnored {
        return v;
    }
    let (lo, hi) = p.options().dt_limit;
    v.max(T::lit(lo)).min(T::lit(hi))
}

/// The chunked forward pass with `fault` planted and operands rounded per `rounding`.
pub fn forward<T: Real>(p: &Problem<T>, fault: Fault, rounding: Rounding) -> ChunkedOutput<T> {
    let d = *p.dims();
    let (hd, ds) = (d.headdim, d.dstate);
    let l = p.options().chunk_size;
    let nc = p.nchunks();
    let lanes: Vec<_> = (0..d.batch * d.nheads)
        .into_par_iter()
        .map(|bh| lane(p, bh / d.nheads, bh % d.nheads, fault, rounding))
        .collect();
    let mut out = Array4::<T>::zeros((d.batch, d.seqlen, d.nheads, hd));
    let mut fin = Array4::<T>::zeros((d.batch, d.nheads, hd, ds));
    let mut cum = Array4::<T>::zeros((d.batch, d.nheads, nc, l));
    let mut chunks = Array5::<T>::zeros((d.batch, nc, d.nheads, hd, ds));
    for (bh, lane) in lanes.into_iter().enumerate() {
        let (b, h) = (bh / d.nheads, bh % d.nheads);
        for t in 0..d.seqlen {
            for pp in 0..hd {
                out[[b, t, h, pp]] = lane.out[t * hd + pp];
            }
        }
        for c in 0..nc {
            for k in 0..l {
                cum[[b, h, c, k]] = lane.cs[c * l + k];
            }
            for pp in 0..hd {
                for n in 0..ds {
                    chunks[[b, c, h, pp, n]] = lane.chunk_states[(c * hd + pp) * ds + n];
                }
            }
        }
        for pp in 0..hd {
            for n in 0..ds {
                fin[[b, h, pp, n]] = lane.fin[pp * ds + n];
            }
        }
    }
    ChunkedOutput {
        out,
        final_states: fin,
        dA_cumsum: cum,
        chunk_states: chunks,
    }
}

struct Lane<T> {
    out: Vec<T>,
    fin: Vec<T>,
    cs: Vec<T>,
    chunk_states: Vec<T>,
}

fn lane<T: Real>(p: &Problem<T>, b: usize, h: usize, fault: Fault, r: Rounding) -> Lane<T> {
    let d = *p.dims();
    let i = p.inputs();
    let (hd, ds, tl) = (d.headdim, d.dstate, d.seqlen);
    let l = p.options().chunk_size;
    let nc = p.nchunks();
    let g = if fault == Fault::GroupModulo {
        h % d.ngroups
    } else {
        h / (d.nheads / d.ngroups)
    };
    let seq = |t: usize| p.seq_idx_at(b, t);
    let a = i.A[h];

    // Stage 1: dt' and the within-chunk cumsum (flat past seqlen).
    let mut dt = vec![T::zero(); nc * l];
    let mut cs = vec![T::zero(); nc * l];
    for c in 0..nc {
        let mut acc = T::zero();
        for k in 0..l {
            let t = c * l + k;
            if t < tl {
                dt[c * l + k] = dt_processed(p, b, t, h, fault);
            } else if fault == Fault::LastPartialChunk {
                continue; // never written: stays 0
            }
            acc = acc + dt[c * l + k] * a;
            cs[c * l + k] = acc;
        }
    }

    // Stage 2: per-chunk states, then state passing.
    let mut own = vec![T::zero(); nc * hd * ds];
    for c in 0..nc {
        let t0 = c * l;
        let len = l.min(tl - t0);
        let last = if fault == Fault::LastPartialChunk {
            l - 1
        } else {
            len - 1
        };
        let cs_last = cs[c * l + last];
        let seq_last = seq(t0 + len - 1);
        for j in 0..len {
            if seq(t0 + j) != seq_last {
                continue;
            }
            let cj = cs[c * l + j];
            let decay = if fault == Fault::DecayWrongEnd {
                cj.exp()
            } else {
                (cs_last - cj).exp()
            };
            let w = decay * dt[c * l + j];
            for pp in 0..hd {
                let xv = r.apply(i.x[[b, t0 + j, h, pp]]);
                for n in 0..ds {
                    let bv = r.apply(i.B[[b, t0 + j, g, n]] * w);
                    let o = &mut own[(c * hd + pp) * ds + n];
                    *o = *o + xv * bv;
                }
            }
        }
    }
    let mut state = vec![T::zero(); hd * ds];
    if let Some(s0) = &i.initial_states {
        if fault != Fault::InitialStateDropped {
            for pp in 0..hd {
                for n in 0..ds {
                    state[pp * ds + n] = s0[[b, h, pp, n]];
                }
            }
        }
    }
    let mut chunk_states = vec![T::zero(); nc * hd * ds];
    let mut seq_prev = 0i64;
    for c in 0..nc {
        chunk_states[c * hd * ds..(c + 1) * hd * ds].copy_from_slice(&state);
        let len = l.min(tl - c * l);
        let seq_new = seq(c * l + len - 1);
        let scale = if seq_new != seq_prev {
            T::zero()
        } else if fault == Fault::StatePassingNoDecay {
            T::one()
        } else {
            cs[c * l + l - 1].exp()
        };
        seq_prev = seq_new;
        for k in 0..hd * ds {
            state[k] = scale * state[k] + own[c * hd * ds + k];
        }
    }

    // Stage 3: the output of every token.
    let mut out = vec![T::zero(); tl * hd];
    for c in 0..nc {
        let t0 = c * l;
        let len = l.min(tl - t0);
        let seq_prev = match (c, fault) {
            (_, Fault::SeqIdxResetMissedAtChunkStart) => seq(t0),
            (0, _) => 0,
            _ => seq(t0 - 1),
        };
        let s_c = &chunk_states[c * hd * ds..(c + 1) * hd * ds];
        for ii in 0..len {
            let t = t0 + ii;
            let cs_i = cs[c * l + ii];
            let c_row: Vec<T> = (0..ds).map(|n| r.apply(i.C[[b, t, g, n]])).collect();
            // Weights of the intra-chunk sum: round((C_i . B_j) exp(cs_i - cs_j) dt_j).
            let upto = if fault == Fault::CausalMaskOffByOne {
                ii
            } else {
                ii + 1
            };
            let weights: Vec<T> = (0..upto)
                .map(|j| {
                    if seq(t0 + j) != seq(t) {
                        return T::zero();
                    }
                    let mut gij = T::zero();
                    for (n, cv) in c_row.iter().enumerate() {
                        gij = gij + *cv * r.apply(i.B[[b, t0 + j, g, n]]);
                    }
                    r.apply(gij * (cs_i - cs[c * l + j]).exp() * dt[c * l + j])
                })
                .collect();
            let carried = seq(t) == seq_prev;
            let e = cs_i.exp();
            for pp in 0..hd {
                let mut y = T::zero();
                if carried {
                    let mut acc = T::zero();
                    for n in 0..ds {
                        acc = acc + c_row[n] * r.apply(s_c[pp * ds + n]);
                    }
                    y = acc * e;
                }
                for (j, w) in weights.iter().enumerate() {
                    y = y + *w * r.apply(i.x[[b, t0 + j, h, pp]]);
                }
                let dx = p.d_skip(h, pp) * i.x[[b, t, h, pp]];
                out[t * hd + pp] = match &i.z {
                    None => y + dx,
                    Some(z) => {
                        let zv = z[[b, t, h, pp]];
                        if fault == Fault::DAfterGate {
                            gate(y, zv, fault) + dx
                        } else {
                            gate(y + dx, zv, fault)
                        }
                    }
                };
            }
        }
    }
    Lane {
        out,
        fin: state,
        cs,
        chunk_states,
    }
}
