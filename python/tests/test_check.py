"""The checker: verdicts, the report object, the assertion message, agreement with the CLI."""

import json

import numpy as np
import pytest

import ssd_oracle
from conftest import FIXTURES, random_inputs, run_oracle, write_safetensors

FULL = next(p for p in FIXTURES if p.stem == "full")


def test_the_truth_passes_at_every_precision():
    kw = random_inputs(seed=5)
    out, final = ssd_oracle.mamba_chunk_scan_combined(**kw, return_final_states=True)
    for precision in ("f64", "f32", "tf32", "bf16"):
        ssd_oracle.assert_close((out, final), **kw, precision=precision)
        r = ssd_oracle.check((out, final), **kw, precision=precision)
        assert r.passed and bool(r) and r.worst_ratio == 0.0
        assert [t.name for t in r.tensors] == ["out", "final_states"]


def test_a_wrong_element_is_named_with_its_index_error_and_bound():
    kw = random_inputs(seed=6)
    out = ssd_oracle.mamba_chunk_scan_combined(**kw).astype(np.float32)
    out[1, 17, 2, 5] += 0.05
    with pytest.raises(AssertionError) as e:
        ssd_oracle.assert_close(out, **kw, precision="tf32")
    msg = str(e.value)
    assert "FAIL out: 1 element(s) over the bound" in msg
    assert "(batch 1, token 17, head 2, channel 5)" in msg
    for word in ("candidate", "expected", "error", "bound", "tf32"):
        assert word in msg, word
    r = ssd_oracle.check(out, **kw, precision="tf32")
    assert not r.passed and r.worst_ratio > 1
    t = r.tensor("out")
    assert t.exceeding == 1 and t.dtype == "F32" and t.worst.index == [1, 17, 2, 5]
    assert t.worst.error == pytest.approx(0.05, rel=1e-3)
    assert t.worst.ratio == pytest.approx(t.worst.error / t.worst.bound)
    assert r.tensor("final_states") is None


def test_a_nan_is_reported_where_it_is():
    kw = random_inputs(seed=6)
    out = ssd_oracle.mamba_chunk_scan_combined(**kw)
    out[0, 3, 1, 0] = np.nan
    r = ssd_oracle.check(out, **kw)
    assert not r.passed
    assert r.tensors[0].non_finite == 1 and r.tensors[0].first_non_finite == [0, 3, 1, 0]
    with pytest.raises(AssertionError, match="non-finite"):
        ssd_oracle.assert_close(out, **kw)


def test_a_tf32_result_fails_at_f32_with_the_precision_hint():
    case = ssd_oracle.load_case(FULL)
    tf32 = ssd_oracle.intermediates(**case.kwargs, precision="tf32")
    cand = {k: tf32[k].astype(np.float32) for k in ("out", "final_states")}
    ssd_oracle.assert_close(cand, **case.kwargs, precision="tf32")
    with pytest.raises(AssertionError, match="hint: .*--precision tf32"):
        ssd_oracle.assert_close(cand, **case.kwargs, precision="f32")


def test_the_bf16_emulation_passes_at_bf16_and_fails_at_tf32():
    case = ssd_oracle.load_case(FULL)
    bf16 = ssd_oracle.intermediates(**case.kwargs, precision="bf16")
    cand = {k: bf16[k].astype(np.float32) for k in ("out", "final_states")}
    ssd_oracle.assert_close(cand, **case.kwargs, precision="bf16")
    assert not ssd_oracle.check(cand, **case.kwargs, precision="tf32").passed


def test_storage_dtype_is_taken_from_the_tensor():
    kw = random_inputs(seed=7)
    out = ssd_oracle.mamba_chunk_scan_combined(**kw)
    as_f16 = out.astype(np.float16)
    r = ssd_oracle.check(as_f16, **kw, precision="f32")
    assert r.passed and r.tensors[0].dtype == "F16"
    # the same values claimed as float64 storage are far outside the f32 bound
    assert not ssd_oracle.check(as_f16.astype(np.float64), **kw, precision="f32").passed


@pytest.mark.parametrize("precision", ["f32", "tf32"])
def test_the_report_has_the_fields_and_values_of_check_json(precision, tmp_path):
    case = ssd_oracle.load_case(FULL)
    tf32 = ssd_oracle.intermediates(**case.kwargs, precision="tf32")
    cand = {k: tf32[k].astype(np.float32) for k in ssd_oracle.OUTPUT_NAMES}
    path = tmp_path / "cand.safetensors"
    write_safetensors(path, cand)
    r = run_oracle("check", "--case", FULL, "--candidate", path, "--precision", precision,
                   "--json")
    assert r.returncode in (0, 1), r.stderr
    cli = json.loads(r.stdout)
    mine = ssd_oracle.check(cand, **case.kwargs, precision=precision).to_dict()
    assert set(mine) == set(cli)
    for key in set(cli) - {"case", "candidate"}:
        assert mine[key] == cli[key], key


def test_a_dict_may_hold_every_output_and_nothing_else():
    kw = random_inputs(seed=8)
    full = ssd_oracle.intermediates(**kw)
    ok = {k: full[k] for k in ssd_oracle.OUTPUT_NAMES}
    r = ssd_oracle.check(ok, **kw, precision="f64")
    assert r.passed and len(r.tensors) == 4
    with pytest.raises(ValueError, match="`states` is not an output"):
        ssd_oracle.check({**ok, "states": full["states"]}, **kw)
    with pytest.raises(ValueError, match="must hold `out`"):
        ssd_oracle.check({"final_states": full["final_states"]}, **kw)
