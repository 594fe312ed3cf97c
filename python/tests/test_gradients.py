"""The gradient oracle: against the command line bit for bit, against finite differences, and
its refusals."""

import json

import numpy as np
import pytest

import ssd_oracle
from conftest import random_inputs, read_safetensors, run_oracle, write_safetensors


def upstream(kw, seed=1):
    rng = np.random.default_rng(seed)
    x, init = kw["x"], kw["initial_states"]
    return rng.standard_normal(x.shape), rng.standard_normal(init.shape)


def backward_case(tmp_path, kw, dout, dfin):
    """The case for the command line: the inputs as float64, plus dout and dfinal_states."""
    case = tmp_path / "case.json"
    ssd_oracle.save_case(case, **kw)
    tensors = read_safetensors(tmp_path / "case.safetensors")
    tensors.update(dout=dout, dfinal_states=dfin)
    write_safetensors(tmp_path / "case.safetensors",
                      {k: v.astype(np.float64) for k, v in tensors.items()})
    return case


def test_gradients_equal_the_cli_grad_bit_for_bit(tmp_path):
    kw = random_inputs(seed=3)
    dout, dfin = upstream(kw)
    g = ssd_oracle.gradients(dout, **kw, dfinal_states=dfin)
    assert sorted(g) == sorted(["dx", "ddt", "dA", "dB", "dC", "dD", "dz", "ddt_bias",
                                "dinitial_states"])
    # The same case for the command line.
    case = backward_case(tmp_path, kw, dout, dfin)
    out = tmp_path / "grads.safetensors"
    r = run_oracle("grad", "--case", case, "--out", out)
    assert r.returncode == 0, r.stderr
    cli = read_safetensors(out)
    assert sorted(cli) == sorted(g)
    for name, value in g.items():
        assert value.dtype == np.float64
        assert np.array_equal(value, cli[name]), name


def loss(kw, dout):
    return float(np.sum(ssd_oracle.mamba_chunk_scan_combined(**kw) * dout))


@pytest.mark.parametrize("name,grad", [("x", "dx"), ("B", "dB"), ("C", "dC"), ("z", "dz"),
                                       ("A", "dA"), ("D", "dD"), ("dt", "ddt"),
                                       ("dt_bias", "ddt_bias"),
                                       ("initial_states", "dinitial_states")])
def test_gradients_agree_with_central_differences(name, grad):
    kw = {k: (v.astype(np.float64) if isinstance(v, np.ndarray) else v)
          for k, v in random_inputs(seed=5, batch=1, seqlen=6, nheads=2, headdim=3,
                                    ngroups=1, dstate=4).items()}
    kw["dt_limit"] = (0.0, 50.0)
    dout = upstream(kw)[0]
    g = ssd_oracle.gradients(dout, **kw)[grad]
    flat = kw[name].reshape(-1)
    for k in range(0, flat.size, max(1, flat.size // 5)):
        h = 1e-5 * max(1.0, abs(flat[k]))
        v0 = flat[k]
        flat[k] = v0 + h
        up = loss(kw, dout)
        flat[k] = v0 - h
        down = loss(kw, dout)
        flat[k] = v0
        fd = (up - down) / (2 * h)
        # central differences: O(h^2) truncation and ~1e-16 / h rounding, far below 1e-6
        assert abs(g.reshape(-1)[k] - fd) <= 1e-6 * max(1.0, abs(fd)), (name, k, g.reshape(-1)[k], fd)


def test_bad_upstream_gradients_raise_value_error_naming_the_tensor():
    kw = random_inputs(seed=2)
    with pytest.raises(ValueError, match="`dout`"):
        ssd_oracle.gradients(np.zeros((2, 40, 4, 7)), **kw)
    dout = np.zeros(kw["x"].shape)
    with pytest.raises(ValueError, match="`dfinal_states`"):
        ssd_oracle.gradients(dout, **kw, dfinal_states=np.zeros((2, 4, 8, 5)))


def test_check_gradients_matches_the_cli_and_refuses_a_wrong_gradient(tmp_path):
    kw = random_inputs(seed=5)
    dout, dfin = upstream(kw, seed=2)
    # What an f32 backward computes: the command line's f32 adjoint.
    case = backward_case(tmp_path, kw, dout, dfin)
    out = tmp_path / "grads.safetensors"
    r = run_oracle("grad", "--case", case, "--out", out, "--precision", "f32")
    assert r.returncode == 0, r.stderr
    g32 = read_safetensors(out)
    report = ssd_oracle.check_gradients(g32, dout, **kw, dfinal_states=dfin)
    assert report.passed, report.text
    cli = run_oracle("check", "--case", case, "--candidate", out, "--json")
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["worst_ratio"] == report.worst_ratio
    ssd_oracle.assert_gradients_close(g32, dout, **kw, dfinal_states=dfin)
    # Without dfinal_states the truth differs: refused.
    assert not ssd_oracle.check_gradients(g32, dout, **kw).passed
    # One element of dB wrong by 1%: refused, and the message names it.
    bad = dict(g32)
    bad["dB"] = g32["dB"].copy()
    bad["dB"][0, 3, 0, 1] *= 1.01
    with pytest.raises(AssertionError, match="dB"):
        ssd_oracle.assert_gradients_close(bad, dout, **kw, dfinal_states=dfin)


def test_check_gradients_refusals():
    kw = random_inputs(seed=6)
    dout, _ = upstream(kw)
    g = ssd_oracle.gradients(dout, **kw)
    with pytest.raises(ValueError, match="`dq` is not a gradient"):
        ssd_oracle.check_gradients({"dq": g["dx"]}, dout, **kw)
    with pytest.raises(ValueError, match="`dx` has shape"):
        ssd_oracle.check_gradients({"dx": g["dx"][:, :-1]}, dout, **kw)
    no_z = {k: v for k, v in kw.items() if k != "z"}
    with pytest.raises(ValueError, match="`dz` is the gradient of `z`"):
        ssd_oracle.check_gradients({"dz": g["dz"]}, dout, **no_z)
    with pytest.raises(ValueError, match="dout"):
        ssd_oracle.check_gradients({"dx": g["dx"]}, dout[:, :-1], **kw)
