"""The drop-in reference and the intermediates against the command line, bit for bit."""

import numpy as np
import pytest

import ssd_oracle
from conftest import FIXTURES, random_inputs, read_safetensors, run_oracle


def test_every_fixture_is_found():
    assert len(FIXTURES) >= 20


@pytest.mark.parametrize("manifest", FIXTURES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_drop_in_equals_the_cli_naive_bit_for_bit(manifest, tmp_path):
    case = ssd_oracle.load_case(manifest)
    out, final = ssd_oracle.mamba_chunk_scan_combined(**case.kwargs, return_final_states=True)
    cli_out = tmp_path / "naive.safetensors"
    r = run_oracle("run", "--case", manifest, "--impl", "naive", "--out", cli_out)
    assert r.returncode == 0, r.stderr
    cli = read_safetensors(cli_out)
    assert cli["out"].dtype == np.float64
    assert np.array_equal(out, cli["out"])
    assert np.array_equal(final, cli["final_states"])
    # the committed expected outputs are the same truth
    assert np.array_equal(out, case.expected["out"])
    assert np.array_equal(final, case.expected["final_states"])


@pytest.mark.parametrize("manifest", FIXTURES[:6], ids=lambda p: p.stem)
def test_intermediates_equal_the_cli_chunked_bit_for_bit(manifest, tmp_path):
    case = ssd_oracle.load_case(manifest)
    mine = ssd_oracle.intermediates(**case.kwargs)
    cli_out = tmp_path / "chunked.safetensors"
    r = run_oracle("run", "--case", manifest, "--impl", "chunked", "--precision", "f64",
                   "--out", cli_out)
    assert r.returncode == 0, r.stderr
    cli = read_safetensors(cli_out)
    for name in ("out", "final_states", "dA_cumsum", "chunk_states"):
        assert np.array_equal(mine[name], cli[name]), name
    assert np.array_equal(mine["dA_cumsum"], case.expected["dA_cumsum"])
    assert np.array_equal(ssd_oracle.chunk_states(**case.kwargs), case.expected["chunk_states"])


def test_chunk_cumsum_matches_its_definition():
    kw = random_inputs(seed=3)
    da, dt_out = ssd_oracle.chunk_cumsum(kw["dt"], kw["A"], kw["chunk_size"],
                                         dt_bias=kw["dt_bias"], dt_softplus=True,
                                         dt_limit=(0.01, 2.0))
    b, s, h = kw["dt"].shape
    L = kw["chunk_size"]
    v = kw["dt"].astype(np.float64) + kw["dt_bias"].astype(np.float64)
    sp = np.where(v <= 20.0, np.log1p(np.exp(v)), v)
    dtp = np.clip(sp, 0.01, 2.0)
    nchunks = -(-s // L)
    want_dt = np.zeros((b, h, nchunks, L))
    padded = np.zeros((b, nchunks * L, h))
    padded[:, :s] = dtp
    want_dt[:] = padded.reshape(b, nchunks, L, h).transpose(0, 3, 1, 2)
    np.testing.assert_allclose(dt_out, want_dt, rtol=1e-14, atol=0)
    want_da = np.cumsum(want_dt * kw["A"].astype(np.float64)[None, :, None, None], axis=-1)
    np.testing.assert_allclose(da, want_da, rtol=1e-12, atol=1e-14)
    # the same values as the full chunked path's stage 1
    full = ssd_oracle.intermediates(**{**kw, "dt_limit": (0.01, 2.0)})
    assert np.array_equal(full["dA_cumsum"], da)
    assert np.array_equal(full["dt"], dt_out)


def test_return_values_follow_mamba_ssm():
    kw = random_inputs(seed=1)
    out = ssd_oracle.mamba_chunk_scan_combined(**kw)
    assert isinstance(out, np.ndarray) and out.shape == kw["x"].shape
    pair = ssd_oracle.mamba_chunk_scan_combined(**kw, return_final_states=True)
    assert isinstance(pair, tuple) and len(pair) == 2
    assert np.array_equal(pair[0], out)
    assert pair[1].shape == kw["initial_states"].shape
    # cu_seqlens without return_varlen_states changes nothing, as in mamba_ssm
    same = ssd_oracle.mamba_chunk_scan_combined(**kw, cu_seqlens=np.array([0, 40]))
    assert np.array_equal(same, out)
    with pytest.raises(ValueError, match="cu_seqlens must be provided"):
        ssd_oracle.mamba_chunk_scan_combined(**kw, return_varlen_states=True)
    with pytest.raises(ValueError, match="batch must be 1"):
        ssd_oracle.mamba_chunk_scan_combined(**kw, cu_seqlens=np.array([0, 40]),
                                             return_varlen_states=True)


def test_varlen_states_follow_mamba_ssm():
    # Three packed sequences in one row: mamba_ssm's varlen convention, initial_states for the
    # first. Each sequence's final state is the final state of that sequence computed alone.
    kw = random_inputs(seed=4, batch=1, seqlen=40)
    cu = np.array([0, 9, 9, 40])
    out, fin, var = ssd_oracle.mamba_chunk_scan_combined(
        **kw, cu_seqlens=cu, return_final_states=True, return_varlen_states=True)
    assert var.shape == (3,) + kw["initial_states"].shape[1:]
    assert np.array_equal(var[2], fin[0])
    # The empty sequence keeps its (zero) state; the first started from initial_states.
    assert not var[1].any()
    first = {k: (v[:, :9] if k in ("x", "dt", "B", "C", "z") else v) for k, v in kw.items()}
    _, alone = ssd_oracle.mamba_chunk_scan_combined(**first, return_final_states=True)
    np.testing.assert_allclose(var[0], alone[0], rtol=1e-12, atol=1e-12)
    last = {k: (v[:, 9:] if k in ("x", "dt", "B", "C", "z") else v) for k, v in kw.items()}
    last["initial_states"] = None
    out_last = ssd_oracle.mamba_chunk_scan_combined(**last)
    np.testing.assert_allclose(out[:, 9:], out_last, rtol=1e-12, atol=1e-12)
    # The checker takes them: the truth passes, a varlen state of the wrong sequence fails.
    args = dict(kw, cu_seqlens=cu, return_final_states=True, return_varlen_states=True)
    assert ssd_oracle.check((out, fin, var), **args).passed
    swapped = var[[0, 2, 1]]
    report = ssd_oracle.check((out, fin, swapped), **args)
    assert not report.passed and "varlen_states" in report.text


def test_options_change_the_result():
    kw = random_inputs(seed=2)
    base = ssd_oracle.mamba_chunk_scan_combined(**kw)
    for change in (dict(D=None), dict(z=None), dict(dt_bias=None), dict(initial_states=None),
                   dict(dt_softplus=False), dict(dt_limit=(0.0, 0.5)),
                   dict(seq_idx=np.repeat([[0, 1]], 2, axis=0).repeat(20, axis=1))):
        other = ssd_oracle.mamba_chunk_scan_combined(**{**kw, **change})
        assert not np.allclose(other, base), change


def test_the_chunked_precisions_are_emulated():
    kw = random_inputs(seed=4)
    f64 = ssd_oracle.intermediates(**kw)["out"]
    f32 = ssd_oracle.intermediates(**kw, precision="f32")["out"]
    tf32 = ssd_oracle.intermediates(**kw, precision="tf32")["out"]
    assert np.array_equal(f32, f32.astype(np.float32))  # computed in f32
    assert not np.array_equal(f32, tf32)
    truth = ssd_oracle.mamba_chunk_scan_combined(**kw)
    assert np.abs(f64 - truth).max() < np.abs(tf32 - truth).max()
    for p in ("f32", "tf32", "f64"):
        out = ssd_oracle.intermediates(**kw, precision=p)
        ssd_oracle.assert_close({k: out[k] for k in ssd_oracle.OUTPUT_NAMES}, **kw,
                                precision="tf32" if p == "tf32" else "f32")
