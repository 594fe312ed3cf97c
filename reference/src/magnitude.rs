//! Magnitudes and first-order error budgets of every output element: the input of the error
//! bound (`ssd_verify::tolerance`, which re-exports this module as `ssd_verify::magnitude`).
//! `docs/tolerances.md` derives every coefficient used here.
//!
//! Every output element is a sum of *terms*. With `w(t, s) = exp(sum_{k=s+1..t} a_k)`,
//! `a_k = dt'_k A_h`, the state of row `b`, head `h` after token `t` is
//!
//! ```text
//! S_t[p, n] = sum_{s <= t, same sequence} w(t, s) dt'_s x_s[p] B_s[n]  (+ w(t, -1) S_init[p, n])
//! ```
//!
//! and `y_t[p] = sum_n C_t[n] S_t[p, n] + D x_t[p]`, `out = y silu(z)`. The *magnitude* `M` of
//! an element is the same sum over the absolute values of its terms (the algorithm run on `|x|`,
//! `|B|`, `|C|`, `|D|`, `|initial_states|`, `|silu(z)|`, decays unchanged). Each term `T` also
//! carries a first-order relative error coefficient `e(T)`, so that a correct implementation's
//! error is at most `sum_T |T| e(T)`. The coefficients fall in groups by the unit roundoff
//! they multiply, and the pass returns one weighted magnitude per group ([`Channels`]):
//!
//! - `acc`: `sum |T| e_acc(T)`, roundings of the working arithmetic (f32 or f64): input
//!   conversion of `dt`, `A`, `D`, `dt_bias`, `initial_states`; products; `exp`; sums of
//!   `dstate`, `chunk_size` and `nchunks` terms in any order; the cumsum of `dt' A`, whose
//!   absolute error moves the argument of every `exp` and grows with the decay it spans; the
//!   `dt'` processing; the gate. Plus the absolute error of `dt'` itself
//!   (`rho_s |x_s| |B_s|`, see [`dt_sensitivity`]).
//! - `io`: `sum |T| e_io(T)`, the rounding of `x`, `B`, `C`, `z` to the kernel's input format.
//! - `op`: `sum |T| e_op(T)`, the rounding of matrix-product operands (TF32, BF16): at most
//!   four per term (two products in a chain).
//! - `tok`: `sum |T| (t - s)`, the number of time steps a term went through: the float64 naive
//!   recurrence (the reference) rounds once per step.
//!
//! All quantities are computed in f64 from the (exact) inputs of the problem.
use crate::serving::Packing;
use crate::Problem;
use ndarray::{Array4, Array5, ArrayD};
use rayon::prelude::*;

/// The weighted magnitudes of one output tensor, each of the tensor's shape.
#[derive(Debug, Clone)]
pub struct Channels {
    /// `M`: the output computed on absolute values.
    pub mag: ArrayD<f64>,
    /// `sum |T| e_acc(T)` (multiplies the working arithmetic's unit roundoff).
    pub acc: ArrayD<f64>,
    /// `sum |T| e_io(T)` (multiplies the unit roundoff of the `x`, `B`, `C`, `z` inputs).
    pub io: ArrayD<f64>,
    /// `sum |T| e_op(T)` (multiplies the unit roundoff of matrix-product operands).
    pub op: ArrayD<f64>,
    /// `sum |T| (steps)` (multiplies 4 times the reference's unit roundoff).
    pub tok: ArrayD<f64>,
}

impl Channels {
    /// The channels in field order (`mag`, `acc`, `io`, `op`, `tok`).
    fn from_five(v: impl IntoIterator<Item = ArrayD<f64>>) -> Self {
        let mut it = v.into_iter();
        let mut next = || it.next().expect("five channels");
        Channels {
            mag: next(),
            acc: next(),
            io: next(),
            op: next(),
            tok: next(),
        }
    }
}

/// The weighted magnitudes of the four outputs, and the scale of the underflow floor.
#[allow(non_snake_case)]
#[derive(Debug, Clone)]
pub struct Magnitudes {
    /// `[batch, seqlen, nheads, headdim]`
    pub out: Channels,
    /// `[batch, nheads, headdim, dstate]`
    pub final_states: Channels,
    /// `[batch, nheads, nchunks, chunk_size]`
    pub dA_cumsum: Channels,
    /// `[batch, nchunks, nheads, headdim, dstate]`
    pub chunk_states: Channels,
    /// `[nseq, nheads, headdim, dstate]`, for a packed problem ([`magnitudes_packed`]).
    pub varlen_states: Option<Channels>,
    /// `[k, nheads, headdim, dstate]`, for a packed problem's listed positions.
    pub position_states: Option<Channels>,
    /// `F`: an upper bound on the sum, over the terms of any element, of the product of the
    /// term's factors other than the decay; the floor is `eta * F` (`ssd_verify::tolerance`).
    pub floor_scale: f64,
}

/// One of the four outputs, to pick its channels ([`Magnitudes::channels`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OutputKind {
    /// `out`
    Out,
    /// `final_states`
    FinalStates,
    /// `dA_cumsum`
    DACumsum,
    /// `chunk_states`
    ChunkStates,
    /// `varlen_states` (packed problems)
    VarlenStates,
    /// `position_states` (packed problems)
    PositionStates,
}

impl Magnitudes {
    /// The channels of one output (ssd-verify names outputs by its own type, which converts).
    pub fn channels(&self, name: impl Into<OutputKind>) -> &Channels {
        match name.into() {
            OutputKind::Out => &self.out,
            OutputKind::FinalStates => &self.final_states,
            OutputKind::DACumsum => &self.dA_cumsum,
            OutputKind::ChunkStates => &self.chunk_states,
            OutputKind::VarlenStates => self
                .varlen_states
                .as_ref()
                .expect("magnitudes of a packed problem"),
            OutputKind::PositionStates => self
                .position_states
                .as_ref()
                .expect("magnitudes of a packed problem"),
        }
    }
}

/// Coefficient of a chunk boundary crossed by a state: `exp` (2), the multiply and the add.
const CROSSING: f64 = 4.0;
/// Creation of a term: products `dt' x`, `* B`, `* w` (3) and one `exp` (2).
const PRODUCTS: f64 = 5.0;
/// Output level: the `C` product, the two additions `C S + intra + D x` (on top of the
/// `dstate - 1` of the dot product).
const OUT_EXTRA: f64 = 3.0;
/// `D x`: conversion of `D`, the product, the two additions.
const D_TERM: f64 = 4.0;
/// The gate `y * (z / (1 + exp(-z)))`: `exp`, add, divide, multiply.
const GATE: f64 = 4.0;

/// Absolute error, in units of `u`, of softplus evaluated as `log(1 + exp(v))` without
/// `log1p`, as mamba_ssm's Triton kernels do: rounding `1 + exp(v)` costs `u` absolutely
/// whatever `v`, and an approximate `log` near 1 (`lg2.approx`) up to about 3u more.
pub const SOFTPLUS_ABS: f64 = 4.0;

/// The error scale `rho` of the processed step `dt'` of one token: a correct implementation
/// computes `dt'` with an absolute error of at most `u * rho`.
///
/// With `v = dt + dt_bias` and `s = softplus'(v) = sigmoid(v)` when softplus applies (1
/// otherwise): rounding `dt` and `dt_bias` and adding them errs by `2u (|dt| + |dt_bias|)` in
/// `v`, which moves `dt'` by `s` times that; softplus itself errs by `2u |dt'|` relatively
/// (`exp` and `log`, with `sigmoid <= softplus`) plus [`SOFTPLUS_ABS`]` u` absolutely. The clamp
/// is 1-Lipschitz and its limits are rounded once (`u |dt'|`). So
/// `rho = 2 s (|dt| + |dt_bias|) + 2 |dt'| (+ SOFTPLUS_ABS below the threshold)`.
pub fn dt_sensitivity(p: &Problem<f64>, b: usize, t: usize, h: usize) -> f64 {
    let i = p.inputs();
    let dt = i.dt[[b, t, h]];
    let bias = i.dt_bias.as_ref().map_or(0.0, |d| d[h]);
    let v = dt + bias;
    let (s, abs) = if p.options().dt_softplus && v <= 20.0 {
        (1.0 / (1.0 + (-v).exp()), SOFTPLUS_ABS)
    } else {
        (1.0, 0.0)
    };
    2.0 * s * (dt.abs() + bias.abs()) + 2.0 * p.dt_processed(b, t, h).abs() + abs
}

/// `|silu(z)|` and the relative sensitivity `|z silu'(z) / silu(z)| = |1 + z (1 - sigmoid(z))|`
/// of the gate to a relative change of `z`.
pub(crate) fn gate_parts(z: f64) -> (f64, f64) {
    let sig = 1.0 / (1.0 + (-z).exp());
    ((z * sig).abs(), (1.0 + z * (1.0 - sig)).abs())
}

/// One (batch, head) lane's part of every output channel (magnitude, acc, io, op, tok; the
/// last two of `dA_cumsum` are zero), each slice lane-major: the lane writes its own memory.
struct Lane<'a> {
    /// `[seqlen * headdim]` per channel
    out: Vec<&'a mut [f64]>,
    /// `[headdim * dstate]` per channel
    fin: Vec<&'a mut [f64]>,
    /// `[nchunks * headdim * dstate]` per channel
    chunks: Vec<&'a mut [f64]>,
    /// `[nchunks * chunk_size]`: magnitude and `acc` of `dA_cumsum`
    cumsum: Vec<&'a mut [f64]>,
    /// `[nseq * headdim * dstate]` and `[k * headdim * dstate]` per channel (packed problems;
    /// empty otherwise).
    varlen: Vec<&'a mut [f64]>,
    positions: Vec<&'a mut [f64]>,
}

impl Lane<'_> {
    fn record(dst: &mut [&mut [f64]], at: usize, sm: &[f64], se: &[f64], sk: &[f64]) {
        let n = sm.len();
        let [m, e, io, op, k] = dst else {
            unreachable!("five channels")
        };
        m[at..at + n].copy_from_slice(sm);
        e[at..at + n].copy_from_slice(se);
        for (j, &v) in sm.iter().enumerate() {
            io[at + j] = 2.0 * v;
            op[at + j] = 2.0 * v;
        }
        k[at..at + n].copy_from_slice(sk);
    }
}

/// [`split_lanes`], or `lanes` empty lists when `per` is 0 (no such tensor).
fn split_or_empty(bufs: &mut [Vec<f64>], per: usize, lanes: usize) -> Vec<Vec<&mut [f64]>> {
    if per == 0 {
        (0..lanes).map(|_| Vec::new()).collect()
    } else {
        split_lanes(bufs, per)
    }
}

/// `channels` buffers of `lanes * per` values, split into one slice per (lane, channel).
fn split_lanes(bufs: &mut [Vec<f64>], per: usize) -> Vec<Vec<&mut [f64]>> {
    let mut columns: Vec<std::vec::IntoIter<&mut [f64]>> = bufs
        .iter_mut()
        .map(|b| b.chunks_mut(per.max(1)).collect::<Vec<_>>().into_iter())
        .collect();
    let lanes = columns.first().map_or(0, |c| c.len());
    (0..lanes)
        .map(|_| {
            columns
                .iter_mut()
                .map(|c| c.next().expect("equal lengths"))
                .collect()
        })
        .collect()
}

/// Computes the magnitudes and error budgets of every output of `p`.
///
/// Cost: about three times the naive recurrence (three state channels), parallel over
/// (batch, head).
pub fn magnitudes(p: &Problem<f64>) -> Magnitudes {
    magnitudes_with(p, None)
}

/// [`magnitudes`] of a packed problem: the state restarts at every sequence start from the
/// sequence's own initial state ([`crate::serving`]), with the channels of `varlen_states`
/// and `position_states` (each taken after its token, plus one state pass). `p` must carry
/// the `seq_idx` the packing implies ([`Packing::with_seq_idx`]) and the packing must be
/// valid for it ([`Packing::validate`]).
///
/// With per-sequence initial states, `chunk_states[:, 0]` is the state before token 0 (the
/// first sequence's initial state).
pub fn magnitudes_packed(p: &Problem<f64>, packing: &Packing<f64>) -> Magnitudes {
    magnitudes_with(p, Some(packing))
}

fn magnitudes_with(p: &Problem<f64>, packing: Option<&Packing<f64>>) -> Magnitudes {
    let d = *p.dims();
    let nc = p.nchunks();
    let l = p.options().chunk_size;
    let (bsz, t_len, nh, hd, ds) = (d.batch, d.seqlen, d.nheads, d.headdim, d.dstate);
    let nstate = hd * ds;
    let lanes_n = bsz * nh;
    let buffers = |per: usize, k: usize| -> Vec<Vec<f64>> { vec![vec![0.0; lanes_n * per]; k] };
    let (mut out_b, mut fin_b) = (buffers(t_len * hd, 5), buffers(nstate, 5));
    let (mut chunk_b, mut cs_b) = (buffers(nc * nstate, 5), buffers(nc * l, 2));
    let (nseq, npos) = packing.map_or((0, 0), |k| (k.nseq(), k.state_positions.len()));
    let (mut var_b, mut pos_b) = (buffers(nseq * nstate, 5), buffers(npos * nstate, 5));
    let lanes: Vec<Lane> = split_lanes(&mut out_b, t_len * hd)
        .into_iter()
        .zip(split_lanes(&mut fin_b, nstate))
        .zip(split_lanes(&mut chunk_b, nc * nstate))
        .zip(split_lanes(&mut cs_b, nc * l))
        .zip(split_or_empty(&mut var_b, nseq * nstate, lanes_n))
        .zip(split_or_empty(&mut pos_b, npos * nstate, lanes_n))
        .map(
            |(((((out, fin), chunks), cumsum), varlen), positions)| Lane {
                out,
                fin,
                chunks,
                cumsum,
                varlen,
                positions,
            },
        )
        .collect();
    lanes
        .into_par_iter()
        .enumerate()
        .for_each(|(bh, mut ln)| lane(p, packing, bh / nh, bh % nh, &mut ln));

    // Lane-major [batch, nheads, ...] into the contract's layouts.
    let out: Vec<ArrayD<f64>> = out_b
        .into_par_iter()
        .map(|v| {
            let a = Array4::from_shape_vec((bsz, nh, t_len, hd), v).expect("lane-major size");
            a.permuted_axes([0, 2, 1, 3])
                .as_standard_layout()
                .into_owned()
                .into_dyn()
        })
        .collect();
    let fin: Vec<ArrayD<f64>> = fin_b
        .into_iter()
        .map(|v| {
            Array4::from_shape_vec((bsz, nh, hd, ds), v)
                .expect("lane-major size")
                .into_dyn()
        })
        .collect();
    let chunks: Vec<ArrayD<f64>> = chunk_b
        .into_par_iter()
        .map(|v| {
            let a = Array5::from_shape_vec((bsz, nh, nc, hd, ds), v).expect("lane-major size");
            a.permuted_axes([0, 2, 1, 3, 4])
                .as_standard_layout()
                .into_owned()
                .into_dyn()
        })
        .collect();
    let mut cs = cs_b
        .into_iter()
        .map(|v| Array4::from_shape_vec((bsz, nh, nc, l), v).expect("lane-major size"));
    let cs_mag = cs.next().expect("two channels");
    let cs_acc = cs.next().expect("two channels");
    let channels = Channels::from_five;
    let zeros = ArrayD::<f64>::zeros(cs_mag.shape());
    Magnitudes {
        out: channels(out),
        final_states: channels(fin),
        chunk_states: channels(chunks),
        dA_cumsum: Channels {
            mag: cs_mag.into_dyn(),
            acc: cs_acc.into_dyn(),
            io: zeros.clone(),
            op: zeros.clone(),
            tok: zeros,
        },
        varlen_states: packing.map(|_| states_channels(var_b, nseq, nh, hd, ds)),
        position_states: packing.map(|_| states_channels(pos_b, npos, nh, hd, ds)),
        floor_scale: floor_scale(p),
    }
}

/// Lane-major `[nheads, k, headdim, dstate]` buffers (batch 1) into `[k, nheads, headdim,
/// dstate]` channels.
fn states_channels(bufs: Vec<Vec<f64>>, k: usize, nh: usize, hd: usize, ds: usize) -> Channels {
    Channels::from_five(bufs.into_iter().map(|b| {
        Array4::from_shape_vec((nh, k, hd, ds), b)
            .expect("lane-major size")
            .permuted_axes([1, 0, 2, 3])
            .as_standard_layout()
            .into_owned()
            .into_dyn()
    }))
}

crate::simd::multiversion! {
    /// [`lane_body`], compiled for AVX2 + FMA where the processor has them (wider vectors;
    /// no fused operation: the same bits).
    fn lane[](p: &Problem<f64>, packing: Option<&Packing<f64>>, b: usize, h: usize, lane: &mut Lane<'_>) {
        lane_body(p, packing, b, h, lane)
    }
}

/// The budget recurrence of one (batch, head) lane. See the module documentation and
/// `docs/tolerances.md` for every coefficient.
#[inline(always)]
fn lane_body(
    p: &Problem<f64>,
    packing: Option<&Packing<f64>>,
    b: usize,
    h: usize,
    lane: &mut Lane<'_>,
) {
    let d = *p.dims();
    let i = p.inputs();
    let (hd, ds) = (d.headdim, d.dstate);
    let l = p.options().chunk_size;
    let g = d.group_of_head(h);
    let a_abs = i.A[h].abs();
    let nstate = hd * ds;

    // State channels: magnitude, acc budget, token steps, and the magnitude of the terms
    // created in the current chunk (their sum over chunk positions is still growing).
    let mut sm = vec![0.0; nstate];
    let mut scur = vec![0.0; nstate];
    let mut se = vec![0.0; nstate];
    let mut sk = vec![0.0; nstate];
    let init = i.initial_states.as_ref();
    if let Some(s0) = init {
        if p.seq_idx_at(b, 0) == 0 {
            for pp in 0..hd {
                for n in 0..ds {
                    let v = s0[[b, h, pp, n]].abs();
                    sm[pp * ds + n] = v;
                    se[pp * ds + n] = v; // conversion of initial_states
                }
            }
        }
    }
    // A packed problem's per-sequence initial state, `|init|` (`None` for zero).
    let seq_init = |q: usize| -> Option<Vec<f64>> {
        let k = packing?;
        let s0 = k.seq_initial_states.as_ref()?;
        if !k.seq_has_initial_state.as_ref().is_none_or(|m| m[q]) {
            return None;
        }
        Some(
            (0..nstate)
                .map(|e| s0[[q, h, e / ds, e % ds]].abs())
                .collect(),
        )
    };
    let seed = |sm: &mut [f64], se: &mut [f64], q: usize| {
        if let Some(v) = seq_init(q) {
            sm.copy_from_slice(&v);
            se.copy_from_slice(&v); // conversion of the state
        }
    };
    let per_seq_init = packing.is_some_and(|k| k.seq_initial_states.is_some());
    if per_seq_init {
        seed(&mut sm, &mut se, p.seq_idx_at(b, 0) as usize);
    }

    let c_abs: Vec<f64> = (0..d.seqlen * ds)
        .map(|k| i.C[[b, k / ds, g, k % ds]].abs())
        .collect();
    let b_abs: Vec<f64> = (0..d.seqlen * ds)
        .map(|k| i.B[[b, k / ds, g, k % ds]].abs())
        .collect();
    let mut prev_seq = 0i64;
    let mut cum_mag = 0.0; // sum of |a| since the chunk start
    let mut a_errs = 0.0; // sum of the errors of the a_k since the chunk start
    for t in 0..d.seqlen {
        if t % l == 0 {
            let c = t / l;
            // The pass into chunk c (exp of the last chunk's cumsum, multiply, add).
            for k in 0..nstate {
                se[k] += CROSSING * sm[k];
            }
            let at = c * nstate;
            if c == 0 && per_seq_init {
                // The state before token 0: the first sequence's initial state.
                Lane::record(&mut lane.chunks, 0, &sm, &se, &sk);
            } else if c == 0 {
                // chunk_states[:, 0] is initial_states, whatever seq_idx says.
                for pp in 0..hd {
                    for n in 0..ds {
                        let v = init.map_or(0.0, |s0| s0[[b, h, pp, n]].abs());
                        for (ch, w) in lane.chunks.iter_mut().zip([v, v, 2.0 * v, 2.0 * v, 0.0]) {
                            ch[at + pp * ds + n] = w;
                        }
                    }
                }
            } else {
                Lane::record(&mut lane.chunks, at, &sm, &se, &sk);
            }
            cum_mag = 0.0;
            a_errs = 0.0;
            scur.iter_mut().for_each(|v| *v = 0.0);
        }
        let seq = p.seq_idx_at(b, t);
        if seq != prev_seq {
            sm.iter_mut().for_each(|v| *v = 0.0);
            se.iter_mut().for_each(|v| *v = 0.0);
            sk.iter_mut().for_each(|v| *v = 0.0);
            scur.iter_mut().for_each(|v| *v = 0.0);
            if per_seq_init {
                seed(&mut sm, &mut se, seq as usize);
            }
        }
        prev_seq = seq;
        let pos = (t % l) as f64;

        let dtp = p.dt_processed(b, t, h);
        let rho = dt_sensitivity(p, b, t, h);
        let a = dtp * i.A[h];
        let decay = a.exp();
        // Error of a_t = dt' A as computed: the product, the conversion of A, and dt''s own.
        let a_err = a_abs * (rho + 2.0 * dtp.abs());
        // The cumsum at chunk position `pos` is a sum of pos + 1 terms: in any order its error
        // is at most phi = pos * cum_mag + a_errs. Existing terms see their exp argument
        // cs_t - cs_s move by phi_t - phi_{t-1}, plus the subtraction's rounding.
        let inc = (pos + 1.0) * a.abs() + cum_mag + a_err;
        cum_mag += a.abs();
        a_errs += a_err;
        let phi = pos * cum_mag + a_errs;
        lane.cumsum[0][(t / l) * l + t % l] = cum_mag;
        lane.cumsum[1][(t / l) * l + t % l] = phi;
        // A new term: products and exp, its place `pos` in the sum over chunk positions (one
        // more addition per later position, below), and the cumsum at both ends of its exp
        // argument (2 phi).
        let e0 = PRODUCTS + pos + 2.0 * phi;

        // Every state element on its own (slices, so that the loop has no bounds checks and
        // vectorises; the arithmetic per element is the same).
        let b_t = &b_abs[t * ds..(t + 1) * ds];
        for pp in 0..hd {
            let xp = i.x[[b, t, h, pp]].abs();
            let row = pp * ds..(pp + 1) * ds;
            let lanes = se[row.clone()]
                .iter_mut()
                .zip(&mut sk[row.clone()])
                .zip(&mut sm[row.clone()])
                .zip(&mut scur[row])
                .zip(b_t);
            for ((((se_k, sk_k), sm_k), scur_k), &bn) in lanes {
                let nt = dtp.abs() * xp * bn;
                let m_old = *sm_k;
                *se_k = decay * (*se_k + inc * m_old + *scur_k) + e0 * nt + rho * xp * bn;
                *sk_k = decay * (*sk_k + m_old);
                *sm_k = decay * m_old + nt;
                *scur_k = decay * *scur_k + nt;
            }
        }

        // Output level.
        let c_t = &c_abs[t * ds..(t + 1) * ds];
        for pp in 0..hd {
            let row = pp * ds..(pp + 1) * ds;
            let [s1, s2, s3] = dot3(c_t, [&sm[row.clone()], &se[row.clone()], &sk[row]]);
            let xp = i.x[[b, t, h, pp]].abs();
            let dx = p.d_skip(h, pp).abs() * xp;
            let m_y = s1 + dx;
            // dot of dstate terms (dstate - 1), the C product and the two additions.
            let acc_y = s2 + (ds as f64 - 1.0 + OUT_EXTRA) * s1 + D_TERM * dx;
            // C (and x in D x) converted; the terms' x and B are counted at creation.
            let io_y = 2.0 * s1 + s1 + dx;
            // two more operands (C and the state, or the scaled C B^T and x).
            let op_y = 2.0 * s1 + 2.0 * s1;
            let v = match &i.z {
                None => [m_y, acc_y, io_y, op_y, s3],
                Some(z) => {
                    let (gz, q) = gate_parts(z[[b, t, h, pp]]);
                    [
                        gz * m_y,
                        gz * (acc_y + GATE * m_y),
                        gz * (io_y + q * m_y),
                        gz * op_y,
                        gz * s3,
                    ]
                }
            };
            for (ch, w) in lane.out.iter_mut().zip(v) {
                ch[t * hd + pp] = w;
            }
        }

        // A packed problem's states after this token: the last of a sequence, a listed
        // position. A kernel passes them out of the chunk like a chunk state (one crossing).
        if let Some(k) = packing {
            let q = seq as usize;
            let is_end = k.cu_seqlens[q + 1] == t + 1;
            let wanted = k.state_positions.contains(&t);
            if is_end || wanted {
                let out_e: Vec<f64> = se.iter().zip(&sm).map(|(e, m)| e + CROSSING * m).collect();
                if is_end {
                    Lane::record(&mut lane.varlen, q * nstate, &sm, &out_e, &sk);
                }
                for (j, _) in k
                    .state_positions
                    .iter()
                    .enumerate()
                    .filter(|(_, &pos)| pos == t)
                {
                    Lane::record(&mut lane.positions, j * nstate, &sm, &out_e, &sk);
                }
            }
        }
    }
    // Zero-length sequences keep their initial state.
    if let Some(k) = packing {
        for q in 0..k.nseq() {
            if k.cu_seqlens[q] == k.cu_seqlens[q + 1] {
                let v = seq_init(q).unwrap_or_else(|| {
                    let mamba_init = (q == 0).then_some(init).flatten();
                    (0..nstate)
                        .map(|e| mamba_init.map_or(0.0, |s0| s0[[b, h, e / ds, e % ds]].abs()))
                        .collect()
                });
                let zeros = vec![0.0; nstate];
                Lane::record(&mut lane.varlen, q * nstate, &v, &v, &zeros);
            }
        }
    }
    // Positions past seqlen in the last chunk: the cumsum stays flat.
    let last = d.seqlen - 1;
    let phi = ((last % l) as f64) * cum_mag + a_errs;
    for k in (last % l + 1)..l {
        lane.cumsum[0][(last / l) * l + k] = cum_mag;
        lane.cumsum[1][(last / l) * l + k] = phi;
    }
    // The final pass out of the last chunk.
    for k in 0..nstate {
        se[k] += CROSSING * sm[k];
    }
    Lane::record(&mut lane.fin, 0, &sm, &se, &sk);
}

/// `[c . v0, c . v1, c . v2]`, each summed in four interleaved partial sums (one per residue
/// of the index mod 4, added pairwise at the end): a magnitude needs no particular order, and
/// four independent chains keep the adds from waiting on each other.
fn dot3(c: &[f64], v: [&[f64]; 3]) -> [f64; 3] {
    let mut acc = [[0.0_f64; 4]; 3];
    let n4 = c.len() / 4 * 4;
    let (c4, c_tail) = c.split_at(n4);
    for (a, v) in acc.iter_mut().zip(v) {
        let (v4, v_tail) = v.split_at(n4);
        for (cq, vq) in c4.chunks_exact(4).zip(v4.chunks_exact(4)) {
            for q in 0..4 {
                a[q] += cq[q] * vq[q];
            }
        }
        for (j, (&cj, &vj)) in c_tail.iter().zip(v_tail).enumerate() {
            a[j] += cj * vj;
        }
    }
    acc.map(|a| (a[0] + a[1]) + (a[2] + a[3]))
}

/// `F` of [`Magnitudes::floor_scale`]: `(seqlen + 2) (dstate + 2) X (1 + max |z|)`, with `X`
/// the largest product of a term's non-decay factors,
/// `(1 + max|C|) (1 + max|dt'| max|x| max|B| + max|S_init|) + max|D| max|x|`,
/// plus `chunk_size max|dt' A|` for `dA_cumsum`.
pub(crate) fn floor_scale(p: &Problem<f64>) -> f64 {
    let d = *p.dims();
    let i = p.inputs();
    let max_abs = |it: &mut dyn Iterator<Item = f64>| it.fold(0.0_f64, |m, v| m.max(v.abs()));
    let mx = max_abs(&mut i.x.iter().copied());
    let mb = max_abs(&mut i.B.iter().copied());
    let mc = max_abs(&mut i.C.iter().copied());
    let md =
        i.D.as_ref()
            .map_or(0.0, |a| max_abs(&mut a.iter().copied()));
    let mz =
        i.z.as_ref()
            .map_or(0.0, |a| max_abs(&mut a.iter().copied()));
    let ms = i
        .initial_states
        .as_ref()
        .map_or(0.0, |a| max_abs(&mut a.iter().copied()));
    let mut mdt = 0.0_f64;
    let mut ma = 0.0_f64;
    for b in 0..d.batch {
        for t in 0..d.seqlen {
            for h in 0..d.nheads {
                let v = p.dt_processed(b, t, h).abs();
                mdt = mdt.max(v);
                ma = ma.max(v * i.A[h].abs());
            }
        }
    }
    let x = (1.0 + mc) * (1.0 + mdt * mx * mb + ms) + md * mx;
    (d.seqlen as f64 + 2.0) * (d.dstate as f64 + 2.0) * x * (1.0 + mz)
        + p.options().chunk_size as f64 * ma
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::random::{random_problem, ProblemSpec, SeqIdx};
    use crate::{chunked, naive, Dims, Inputs, MatmulPrecision, Options};
    use ndarray::{arr1, Array3, Array4};

    /// With every input non-negative and no gate, no term can cancel: the magnitude is the
    /// output itself (and the states the reference's states).
    #[test]
    fn magnitude_of_non_negative_data_is_the_output() {
        let dims = Dims {
            batch: 2,
            seqlen: 37,
            nheads: 4,
            headdim: 3,
            ngroups: 2,
            dstate: 5,
        };
        let mut spec = ProblemSpec::full(dims, 8);
        spec.z = false;
        spec.seq_idx = SeqIdx::Segments {
            segments: 3,
            first: 0,
        };
        let p = random_problem(&spec, 3).unwrap();
        let i = p.inputs().clone();
        let abs4 = |a: &Array4<f64>| a.mapv(f64::abs);
        let inputs = Inputs {
            x: abs4(&i.x),
            B: abs4(&i.B),
            C: abs4(&i.C),
            D: i.D.as_ref().map(|d| d.mapv(f64::abs)),
            initial_states: i.initial_states.as_ref().map(abs4),
            ..i
        };
        let p = Problem::new(dims, *p.options(), inputs).unwrap();
        let m = magnitudes(&p);
        let n = naive::forward(&p);
        let c = chunked::forward(&p, MatmulPrecision::Native);
        let close = |a: &ArrayD<f64>, b: &ArrayD<f64>| {
            a.iter()
                .zip(b.iter())
                .all(|(x, y)| (x - y).abs() <= 1e-12 * (1.0 + x.abs()))
        };
        assert!(close(&m.out.mag, &n.out.into_dyn()));
        assert!(close(&m.final_states.mag, &n.final_states.into_dyn()));
        assert!(close(&m.chunk_states.mag, &c.chunk_states.into_dyn()));
        let cs = c.dA_cumsum.mapv(f64::abs).into_dyn();
        assert!(close(&m.dA_cumsum.mag, &cs));
    }

    /// One token, worked by hand: x = 2, B = -3, C = 0.5, dt' = 0.1, A = -1, D = -1.
    #[test]
    fn one_token_by_hand() {
        let dims = Dims {
            batch: 1,
            seqlen: 1,
            nheads: 1,
            headdim: 1,
            ngroups: 1,
            dstate: 1,
        };
        let one = |v: f64| Array4::from_elem((1, 1, 1, 1), v);
        let inputs = Inputs {
            x: one(2.0),
            dt: Array3::from_elem((1, 1, 1), 0.1),
            A: arr1(&[-1.0]),
            B: one(-3.0),
            C: one(0.5),
            D: Some(arr1(&[-1.0]).into_dyn()),
            z: None,
            dt_bias: None,
            initial_states: None,
            seq_idx: None,
        };
        let p = Problem::new(dims, Options::default(), inputs).unwrap();
        let m = magnitudes(&p);
        // |C dt' x B| + |D x| = 0.5 * 0.1 * 2 * 3 + 2
        let term = 0.3;
        assert!((m.out.mag[[0, 0, 0, 0]] - (term + 2.0)).abs() < 1e-15);
        // rho = 2 |dt| + 2 |dt'| = 0.4; a_err = |A| (rho + 2 dt') = 0.6; phi_0 = 0 + a_err.
        let rho = 0.4;
        let phi = 0.6;
        let e0 = 5.0 + 0.0 + 2.0 * phi;
        // state: e0 |dt' x B| + rho |x B|; output: |C| (E + (dstate + 2) M) + 4 |D x|
        let state_e = e0 * 0.6 + rho * 6.0;
        let acc = 0.5 * (state_e + 3.0 * 0.6) + 4.0 * 2.0;
        assert!(
            (m.out.acc[[0, 0, 0, 0]] - acc).abs() < 1e-12,
            "{}",
            m.out.acc
        );
        assert!((m.out.io[[0, 0, 0, 0]] - (3.0 * term + 2.0)).abs() < 1e-12);
        assert!((m.out.op[[0, 0, 0, 0]] - 4.0 * term).abs() < 1e-12);
        assert_eq!(m.out.tok[[0, 0, 0, 0]], 0.0);
        // final state: the term, plus the last pass (4 M).
        assert!((m.final_states.acc[[0, 0, 0, 0]] - (state_e + 4.0 * 0.6)).abs() < 1e-12);
        assert!((m.dA_cumsum.acc[[0, 0, 0, 0]] - phi).abs() < 1e-15);
        assert!((m.dA_cumsum.mag[[0, 0, 0, 0]] - 0.1).abs() < 1e-15);
    }
}
