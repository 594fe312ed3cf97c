//! Tiny problems whose outputs are worked out by hand (the arithmetic is in the comments), run
//! through the naive recurrence and the chunked path at several chunk sizes.
//!
//! Tolerance: every expected value below is reached in at most a dozen floating-point
//! operations on numbers of magnitude at most 32 (the decays `exp(-ln 2)` and `exp(-25)` are
//! within 2 ulp), so both paths are within `12 * 32 * u = 4.3e-14` of the exact value; we allow
//! `TOL = 5e-14`.
use ndarray::{arr1, arr2, Array1, Array3, Array4, ArrayD, IxDyn};
use ssd_reference::{chunked, naive, Dims, Inputs, MatmulPrecision, Options, Problem};

const TOL: f64 = 5e-14;
const LN2: f64 = std::f64::consts::LN_2;

fn close(got: f64, want: f64, what: &str) {
    assert!(
        (got - want).abs() <= TOL,
        "{what}: got {got:.17}, want {want:.17} (diff {:e})",
        (got - want).abs()
    );
}

/// Runs naive and chunked (at each chunk size) and checks `out[b, t, h, p]` and
/// `final_states[b, h, p, n]` against the hand values.
fn check_all(
    dims: Dims,
    options: Options,
    inputs: &Inputs<f64>,
    chunk_sizes: &[usize],
    out: &Array4<f64>,
    final_states: &Array4<f64>,
) {
    let naive = naive::forward(&Problem::new(dims, options, inputs.clone()).unwrap());
    for ((got, want), idx) in naive.out.iter().zip(out).zip(0..) {
        close(*got, *want, &format!("naive out #{idx}"));
    }
    for (got, want) in naive.final_states.iter().zip(final_states) {
        close(*got, *want, "naive final_states");
    }
    for &cs in chunk_sizes {
        let opts = Options {
            chunk_size: cs,
            ..options
        };
        let p = Problem::new(dims, opts, inputs.clone()).unwrap();
        let c = chunked::forward(&p, MatmulPrecision::Native);
        for ((got, want), idx) in c.out.iter().zip(out).zip(0..) {
            close(*got, *want, &format!("chunked (chunk {cs}) out #{idx}"));
        }
        for (got, want) in c.final_states.iter().zip(final_states) {
            close(*got, *want, &format!("chunked (chunk {cs}) final_states"));
        }
    }
}

fn dims(seqlen: usize, nheads: usize, headdim: usize, dstate: usize) -> Dims {
    Dims {
        batch: 1,
        seqlen,
        nheads,
        headdim,
        ngroups: 1,
        dstate,
    }
}

/// One head, one channel, one state: `A = -ln 2` and `dt' = 1` give a decay of exactly 1/2.
///
/// ```text
/// x = [1, 2, 3], B = [1, 2, 1], C = [1, 1, 2], D = 0.5, s_{-1} = 4
/// t0: s = 0.5 * 4   + 1 * 1 * 1 = 3      y = 3 * 1    + 0.5 * 1 = 3.5
/// t1: s = 0.5 * 3   + 1 * 2 * 2 = 5.5    y = 5.5 * 1  + 0.5 * 2 = 6.5
/// t2: s = 0.5 * 5.5 + 1 * 3 * 1 = 5.75   y = 5.75 * 2 + 0.5 * 3 = 13
/// ```
/// With chunk 2 (ragged: chunks {0, 1}, {2}): dA_cumsum = [[-ln2, -2 ln2], [-ln2, -ln2]]
/// (flat past seqlen), chunk_states = [4, 5.5] (initial state; state after token 1).
fn ragged_single_head() -> (Dims, Options, Inputs<f64>) {
    let inputs = Inputs {
        x: Array4::from_shape_vec((1, 3, 1, 1), vec![1.0, 2.0, 3.0]).unwrap(),
        dt: Array3::from_elem((1, 3, 1), 1.0),
        A: arr1(&[-LN2]),
        B: Array4::from_shape_vec((1, 3, 1, 1), vec![1.0, 2.0, 1.0]).unwrap(),
        C: Array4::from_shape_vec((1, 3, 1, 1), vec![1.0, 1.0, 2.0]).unwrap(),
        D: Some(ArrayD::from_shape_vec(IxDyn(&[1]), vec![0.5]).unwrap()),
        z: None,
        dt_bias: None,
        initial_states: Some(Array4::from_elem((1, 1, 1, 1), 4.0)),
        seq_idx: None,
    };
    (dims(3, 1, 1, 1), Options::default(), inputs)
}

#[test]
fn ragged_single_head_outputs() {
    let (d, o, i) = ragged_single_head();
    let out = Array4::from_shape_vec((1, 3, 1, 1), vec![3.5, 6.5, 13.0]).unwrap();
    let fin = Array4::from_elem((1, 1, 1, 1), 5.75);
    check_all(d, o, &i, &[1, 2, 4, 64], &out, &fin);
}

#[test]
fn ragged_single_head_intermediates() {
    let (d, o, i) = ragged_single_head();
    let p = Problem::new(d, Options { chunk_size: 2, ..o }, i).unwrap();
    let c = chunked::forward(&p, MatmulPrecision::Native);
    assert_eq!(c.dA_cumsum.shape(), &[1, 1, 2, 2]);
    let want = [-LN2, -2.0 * LN2, -LN2, -LN2];
    for (got, want) in c.dA_cumsum.iter().zip(want) {
        close(*got, want, "dA_cumsum");
    }
    assert_eq!(c.chunk_states.shape(), &[1, 2, 1, 1, 1]);
    close(c.chunk_states[[0, 0, 0, 0, 0]], 4.0, "chunk_states[0]");
    close(c.chunk_states[[0, 1, 0, 0, 0]], 5.5, "chunk_states[1]");
}

/// Two heads sharing one group, `dstate = 2`, a reset exactly at a chunk start, and the
/// `dt_limit` clamp on both sides.
///
/// ```text
/// A = [-ln 2, 0], D = [1, 0] (per head), dt_limit = [0, 1], seq_idx = [0, 0, 1, 1]
/// B_t = [1,0], [0,1], [1,1], [2,0]      C_t = [1,1], [1,0], [0,1], [1,2]
/// head 0: raw dt = [1, 2, -0.5, 1] -> dt' = [1, 1, 0, 1];  x = [1, 2, 3, 4];  s_{-1} = [2, 4]
///   t0: s = 0.5 [2,4] + 1*1 [1,0]  = [2,2]   y = 2 + 2         + 1*1 = 5
///   t1: s = 0.5 [2,2] + 1*2 [0,1]  = [1,3]   y = 1*1 + 3*0     + 1*2 = 3
///   t2: reset (seq 0 -> 1): s = 0*3 [1,1] = [0,0]   y = 0      + 1*3 = 3
///   t3: s = 0.5 [0,0] + 1*4 [2,0]  = [8,0]   y = 8*1 + 0*2     + 1*4 = 12
/// head 1: dt' = 1, decay exp(0) = 1, x = 1, s_{-1} = [1, 1]
///   t0: s = [1,1] + [1,0] = [2,1]   y = 2 + 1 = 3
///   t1: s = [2,1] + [0,1] = [2,2]   y = 2*1 + 2*0 = 2
///   t2: reset: s = [1,1]            y = 1*0 + 1*1 = 1
///   t3: s = [1,1] + [2,0] = [3,1]   y = 3*1 + 1*2 = 5
/// ```
/// With chunk 2: chunk_states[0] = initial states, chunk_states[1] = state after token 1:
/// head 0 [1, 3], head 1 [2, 2] (stored even though the reset at t2 means chunk 1 never uses
/// it). dA_cumsum head 0 = [[-ln2, -2 ln2], [0, -ln2]], head 1 = 0.
fn two_heads_with_reset() -> (Dims, Options, Inputs<f64>) {
    let inputs = Inputs {
        x: Array4::from_shape_vec((1, 4, 2, 1), vec![1.0, 1.0, 2.0, 1.0, 3.0, 1.0, 4.0, 1.0])
            .unwrap(),
        dt: Array3::from_shape_vec((1, 4, 2), vec![1.0, 1.0, 2.0, 1.0, -0.5, 1.0, 1.0, 1.0])
            .unwrap(),
        A: arr1(&[-LN2, 0.0]),
        B: Array4::from_shape_vec((1, 4, 1, 2), vec![1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 2.0, 0.0])
            .unwrap(),
        C: Array4::from_shape_vec((1, 4, 1, 2), vec![1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 2.0])
            .unwrap(),
        D: Some(ArrayD::from_shape_vec(IxDyn(&[2]), vec![1.0, 0.0]).unwrap()),
        z: None,
        dt_bias: None,
        initial_states: Some(
            Array4::from_shape_vec((1, 2, 1, 2), vec![2.0, 4.0, 1.0, 1.0]).unwrap(),
        ),
        seq_idx: Some(arr2(&[[0, 0, 1, 1]])),
    };
    let options = Options {
        dt_limit: (0.0, 1.0),
        ..Options::default()
    };
    (dims(4, 2, 1, 2), options, inputs)
}

#[test]
fn two_heads_with_reset_outputs() {
    let (d, o, i) = two_heads_with_reset();
    // out[0, t, h, 0]: (t0: 5, 3), (t1: 3, 2), (t2: 3, 1), (t3: 12, 5)
    let out = Array4::from_shape_vec((1, 4, 2, 1), vec![5.0, 3.0, 3.0, 2.0, 3.0, 1.0, 12.0, 5.0])
        .unwrap();
    let fin = Array4::from_shape_vec((1, 2, 1, 2), vec![8.0, 0.0, 3.0, 1.0]).unwrap();
    check_all(d, o, &i, &[1, 2, 4, 8], &out, &fin);
}

#[test]
fn two_heads_with_reset_intermediates() {
    let (d, o, i) = two_heads_with_reset();
    let p = Problem::new(d, Options { chunk_size: 2, ..o }, i).unwrap();
    let c = chunked::forward(&p, MatmulPrecision::Native);
    // chunk_states [batch, nchunks, nheads, headdim, dstate]
    let want_states = [
        2.0, 4.0, 1.0, 1.0, // chunk 0: the initial states
        1.0, 3.0, 2.0, 2.0, // chunk 1: after token 1
    ];
    for (got, want) in c.chunk_states.iter().zip(want_states) {
        close(*got, want, "chunk_states");
    }
    // dA_cumsum [batch, nheads, nchunks, chunk_size]
    let want_cs = [-LN2, -2.0 * LN2, 0.0, -LN2, 0.0, 0.0, 0.0, 0.0];
    for (got, want) in c.dA_cumsum.iter().zip(want_cs) {
        close(*got, want, "dA_cumsum");
    }
}

/// softplus with a bias (and its threshold), the z gate, and a row starting at seq_idx 1, so
/// the initial state (5) is ignored.
///
/// ```text
/// dt + dt_bias = [-0.5 + 0.5, 24.5 + 0.5] = [0, 25] -> softplus -> [ln 2, 25] (25 > 20: identity)
/// A = -1, x = [2, 1], B = [3, 1], C = [0.5, 1], D = 1, z = [ln 3, -ln 3], seq_idx = [1, 1]
/// t0: reset (1 != 0): s = ln2 * 2 * 3 = 6 ln2         y = 0.5 * 6 ln2 + 2 = 3 ln2 + 2
///     sigmoid(ln 3) = 1 / (1 + 1/3) = 3/4             out = (3 ln2 + 2) * (3/4) ln 3
/// t1: s = exp(-25) 6 ln2 + 25 * 1 * 1 = 25 + 6 ln2 e^-25
///     y = s * 1 + 1 * 1 = 26 + 6 ln2 e^-25
///     sigmoid(-ln 3) = 1 / (1 + 3) = 1/4              out = y * (-ln 3) / 4
/// ```
#[test]
fn softplus_bias_gate_and_ignored_initial_state() {
    let ln3 = 3f64.ln();
    let inputs = Inputs {
        x: Array4::from_shape_vec((1, 2, 1, 1), vec![2.0, 1.0]).unwrap(),
        dt: Array3::from_shape_vec((1, 2, 1), vec![-0.5, 24.5]).unwrap(),
        A: arr1(&[-1.0]),
        B: Array4::from_shape_vec((1, 2, 1, 1), vec![3.0, 1.0]).unwrap(),
        C: Array4::from_shape_vec((1, 2, 1, 1), vec![0.5, 1.0]).unwrap(),
        D: Some(ArrayD::from_shape_vec(IxDyn(&[1, 1]), vec![1.0]).unwrap()),
        z: Some(Array4::from_shape_vec((1, 2, 1, 1), vec![ln3, -ln3]).unwrap()),
        dt_bias: Some(Array1::from_elem(1, 0.5)),
        initial_states: Some(Array4::from_elem((1, 1, 1, 1), 5.0)),
        seq_idx: Some(arr2(&[[1, 1]])),
    };
    let options = Options {
        dt_softplus: true,
        ..Options::default()
    };
    let s1 = 25.0 + 6.0 * LN2 * (-25f64).exp();
    let out = Array4::from_shape_vec(
        (1, 2, 1, 1),
        vec![(3.0 * LN2 + 2.0) * 0.75 * ln3, (s1 + 1.0) * (-ln3) / 4.0],
    )
    .unwrap();
    let fin = Array4::from_elem((1, 1, 1, 1), s1);
    check_all(dims(2, 1, 1, 1), options, &inputs, &[1, 2, 4], &out, &fin);
}

/// `dt_processed` at and around the softplus threshold and with a finite upper clamp.
#[test]
fn softplus_threshold_and_clamp() {
    let inputs = Inputs {
        x: Array4::zeros((1, 4, 1, 1)),
        dt: Array3::from_shape_vec((1, 4, 1), vec![20.0, 20.5, -30.0, 0.0]).unwrap(),
        A: arr1(&[-1.0]),
        B: Array4::zeros((1, 4, 1, 1)),
        C: Array4::zeros((1, 4, 1, 1)),
        D: None,
        z: None,
        dt_bias: None,
        initial_states: None,
        seq_idx: None,
    };
    let mut options = Options {
        dt_softplus: true,
        ..Options::default()
    };
    let p = Problem::new(dims(4, 1, 1, 1), options, inputs.clone()).unwrap();
    // 20 is not above the threshold: log(1 + e^20) = 20 + log(1 + e^-20) = 20 + 2.0611536e-9
    close(
        p.dt_processed(0, 0, 0),
        20.0 + (-20f64).exp().ln_1p(),
        "softplus(20)",
    );
    assert!(p.dt_processed(0, 0, 0) > 20.0);
    // 20.5 is above it: exactly 20.5
    assert_eq!(p.dt_processed(0, 1, 0), 20.5);
    // softplus(-30) = log(1 + e^-30) = 9.357622968839e-14 > 0
    close(
        p.dt_processed(0, 2, 0),
        9.357_622_968_840_175e-14,
        "softplus(-30)",
    );
    close(p.dt_processed(0, 3, 0), LN2, "softplus(0)");
    // a finite clamp [0.1, 1]: 20 -> 1, softplus(-30) -> 0.1
    options.dt_limit = (0.1, 1.0);
    let p = Problem::new(dims(4, 1, 1, 1), options, inputs).unwrap();
    assert_eq!(p.dt_processed(0, 0, 0), 1.0);
    assert_eq!(p.dt_processed(0, 2, 0), 0.1);
}
