"""Cases from Python are the files of the command line, both ways."""

import numpy as np
import pytest

import ssd_oracle
from conftest import FIXTURES, random_inputs, read_safetensors, run_oracle


def test_a_case_saved_in_python_is_read_and_checked_by_the_cli(tmp_path):
    kw = random_inputs(seed=10)
    path = tmp_path / "mine.json"
    ssd_oracle.save_case(path, **kw, name="mine", seed=10, description="from python")
    case = ssd_oracle.load_case(path)
    assert case.name == "mine" and case.seed == 10 and case.description == "from python"
    assert case.dtypes["x"] == "F64" and case.dtypes["out_mag"] == "F64"
    for name in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states"):
        assert np.array_equal(case.inputs[name], kw[name].astype(np.float64)), name
    truth = ssd_oracle.mamba_chunk_scan_combined(**kw)
    assert np.array_equal(case.expected["out"], truth)
    # the CLI reads it, and its naive run gives the same bits
    out = tmp_path / "n.safetensors"
    r = run_oracle("run", "--case", path, "--impl", "naive", "--out", out)
    assert r.returncode == 0, r.stderr
    assert np.array_equal(read_safetensors(out)["out"], truth)
    # the stored magnitudes are those the CLI computes (check refuses a stale case)
    r = run_oracle("check", "--case", path, "--candidate", out, "--precision", "f64")
    assert r.returncode == 0, r.stdout + r.stderr


def test_reduced_precision_inputs_round_trip(tmp_path):
    kw = random_inputs(seed=11)
    path = tmp_path / "bf16.json"
    ssd_oracle.save_case(path, **kw, input_dtype="bf16", with_expected=False)
    case = ssd_oracle.load_case(path)
    assert case.dtypes["x"] == "BF16" and case.dtypes["dt"] == "F32"
    assert "out" not in case.expected
    x = case.inputs["x"]
    assert np.array_equal(x, x.astype(np.float32).view(np.uint32).__and__(0xFFFF0000)
                          .view(np.float32).astype(np.float64))


@pytest.mark.parametrize("manifest", FIXTURES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_committed_case_saves_back_to_the_same_case(manifest, tmp_path):
    case = ssd_oracle.load_case(manifest)
    path = tmp_path / manifest.name
    ssd_oracle.save_case(path, **case.kwargs)
    again = ssd_oracle.load_case(path)
    for name, a in case.inputs.items():
        assert np.array_equal(again.inputs[name], a), name
    for name in ("out", "final_states", "dA_cumsum", "chunk_states"):
        assert np.array_equal(again.expected[name], case.expected[name]), name
    for name in ("out_mag", "final_states_mag"):
        np.testing.assert_allclose(again.expected[name], case.expected[name], rtol=1e-12)


def test_a_failed_save_leaves_nothing_behind(tmp_path):
    kw = random_inputs(seed=12)
    target = tmp_path / "missing-dir" / "case.json"
    with pytest.raises(OSError):
        ssd_oracle.save_case(target, **kw)
    assert not target.parent.exists()
    big = {**kw, "x": kw["x"] * 1e6}
    with pytest.raises(ValueError, match="F16|cannot be stored"):
        ssd_oracle.save_case(tmp_path / "f16.json", **big, input_dtype="f16")
    assert list(tmp_path.iterdir()) == []
