//! `Problem::new` refuses every invalid problem with a message that names the tensor (and the
//! index, for a bad value).
use ndarray::{Array1, Array2, Array4, ArrayD, IxDyn};
use ssd_reference::random::{random_problem, ProblemSpec};
use ssd_reference::{Dims, Inputs, Options, Problem, ReferenceError};

fn dims() -> Dims {
    Dims {
        batch: 2,
        seqlen: 10,
        nheads: 4,
        headdim: 3,
        ngroups: 2,
        dstate: 5,
    }
}

/// A valid problem with every optional tensor, to be broken one way at a time.
fn valid() -> (Dims, Options, Inputs<f64>) {
    let p = random_problem(&ProblemSpec::full(dims(), 4), 1).unwrap();
    (*p.dims(), *p.options(), p.into_inputs())
}

fn refused(d: Dims, o: Options, i: Inputs<f64>, needles: &[&str]) {
    match Problem::new(d, o, i) {
        Ok(_) => panic!("accepted, expected an error mentioning {needles:?}"),
        Err(ReferenceError::InvalidProblem(msg)) => {
            for n in needles {
                assert!(msg.contains(n), "message {msg:?} lacks {n:?}");
            }
        }
    }
}

#[test]
fn the_valid_problem_is_accepted() {
    let (d, o, i) = valid();
    assert!(Problem::new(d, o, i).is_ok());
}

#[test]
fn zero_sizes() {
    for (name, set) in [
        ("batch", (|d: &mut Dims| d.batch = 0) as fn(&mut Dims)),
        ("seqlen", |d| d.seqlen = 0),
        ("nheads", |d| d.nheads = 0),
        ("headdim", |d| d.headdim = 0),
        ("ngroups", |d| d.ngroups = 0),
        ("dstate", |d| d.dstate = 0),
    ] {
        let (mut d, o, i) = valid();
        set(&mut d);
        refused(d, o, i, &[&format!("dims.{name}")]);
    }
}

#[test]
fn sizes_and_options() {
    let (mut d, o, i) = valid();
    d.ngroups = 3;
    refused(d, o, i, &["nheads (4)", "ngroups (3)"]);
    for cs in [0, 3, 48] {
        let (d, mut o, i) = valid();
        o.chunk_size = cs;
        refused(d, o, i, &["chunk_size", &cs.to_string()]);
    }
    for limit in [
        (0.5, 0.1),
        (f64::NEG_INFINITY, 1.0),
        (f64::NAN, 1.0),
        (0.0, f64::NAN),
    ] {
        let (d, mut o, i) = valid();
        o.dt_limit = limit;
        refused(d, o, i, &["dt_limit"]);
    }
}

#[test]
fn shapes_name_the_tensor() {
    let (d, o, mut i) = valid();
    i.x = Array4::zeros((2, 10, 4, 4));
    refused(d, o, i, &["`x`", "[2, 10, 4, 4]", "[2, 10, 4, 3]"]);
    let (d, o, mut i) = valid();
    i.B = Array4::zeros((2, 10, 1, 5));
    refused(d, o, i, &["`B`"]);
    let (d, o, mut i) = valid();
    i.C = Array4::zeros((2, 9, 2, 5));
    refused(d, o, i, &["`C`"]);
    let (d, o, mut i) = valid();
    i.A = Array1::zeros(3);
    refused(d, o, i, &["`A`"]);
    let (d, o, mut i) = valid();
    i.D = Some(ArrayD::zeros(IxDyn(&[4, 2])));
    refused(d, o, i, &["`D`", "[4] or [4, 3]"]);
    let (d, o, mut i) = valid();
    i.z = Some(Array4::zeros((2, 10, 4, 2)));
    refused(d, o, i, &["`z`"]);
    let (d, o, mut i) = valid();
    i.dt_bias = Some(Array1::zeros(5));
    refused(d, o, i, &["`dt_bias`"]);
    let (d, o, mut i) = valid();
    i.initial_states = Some(Array4::zeros((2, 4, 5, 3)));
    refused(d, o, i, &["`initial_states`"]);
    let (d, o, mut i) = valid();
    i.seq_idx = Some(Array2::zeros((1, 10)));
    refused(d, o, i, &["`seq_idx`"]);
}

#[test]
fn bad_values_name_the_tensor_and_the_index() {
    let (d, o, mut i) = valid();
    i.x[[1, 7, 2, 0]] = f64::NAN;
    refused(d, o, i, &["`x`", "NaN", "[1, 7, 2, 0]"]);
    let (d, o, mut i) = valid();
    i.dt[[0, 3, 1]] = f64::INFINITY;
    refused(d, o, i, &["`dt`", "inf", "[0, 3, 1]"]);
    let (d, o, mut i) = valid();
    i.C[[1, 0, 1, 4]] = f64::NEG_INFINITY;
    refused(d, o, i, &["`C`", "[1, 0, 1, 4]"]);
    let (d, o, mut i) = valid();
    i.z.as_mut().unwrap()[[0, 9, 3, 2]] = f64::NAN;
    refused(d, o, i, &["`z`", "[0, 9, 3, 2]"]);
    let (d, o, mut i) = valid();
    i.initial_states.as_mut().unwrap()[[1, 2, 0, 3]] = f64::NAN;
    refused(d, o, i, &["`initial_states`", "[1, 2, 0, 3]"]);
    let (d, o, mut i) = valid();
    i.A[2] = 0.25;
    refused(d, o, i, &["`A`", "positive", "[2]"]);
    let (d, o, mut i) = valid();
    i.seq_idx.as_mut().unwrap()[[1, 4]] = -1;
    refused(d, o, i, &["`seq_idx`", "negative", "[1, 4]"]);
    let (d, o, mut i) = valid();
    let s = i.seq_idx.as_mut().unwrap();
    s.row_mut(0).fill(3);
    s[[0, 6]] = 2;
    refused(d, o, i, &["`seq_idx`", "decreases", "[0, 6]"]);
}

#[test]
fn prefixes() {
    let (d, o, i) = valid();
    let p = Problem::new(d, o, i).unwrap();
    assert!(p.prefix(0).is_err());
    assert!(p.prefix(11).is_err());
    let q = p.prefix(7).unwrap();
    assert_eq!(q.dims().seqlen, 7);
    assert_eq!(
        q.inputs().x,
        p.inputs().x.slice(ndarray::s![.., ..7, .., ..])
    );
    assert_eq!(
        q.inputs().seq_idx.as_ref().unwrap(),
        p.inputs()
            .seq_idx
            .as_ref()
            .unwrap()
            .slice(ndarray::s![.., ..7])
    );
}
