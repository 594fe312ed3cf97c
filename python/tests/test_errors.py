"""Bad inputs raise ValueError or TypeError naming the tensor; nothing crashes."""

import numpy as np
import pytest

import ssd_oracle
from conftest import random_inputs


@pytest.fixture
def kw():
    return random_inputs(seed=9)


@pytest.mark.parametrize("name,shape,match", [
    ("x", (2, 40, 4), r"`x` has 3 dimension\(s\)"),
    ("dt", (2, 40, 5), r"`dt`"),
    ("A", (3,), r"`A`"),
    ("B", (2, 40, 3, 6), r"`B`|ngroups"),
    ("C", (2, 40, 2, 5), r"`C`"),
    ("D", (4, 8, 1), r"`D` has 3 dimension"),
    ("z", (2, 41, 4, 8), r"`z`"),
    ("dt_bias", (4, 1), r"`dt_bias`"),
    ("initial_states", (2, 4, 8, 7), r"`initial_states`"),
])
def test_a_wrong_shape_names_the_tensor(kw, name, shape, match):
    kw[name] = np.zeros(shape, dtype=np.float32)
    with pytest.raises(ValueError, match=match):
        ssd_oracle.mamba_chunk_scan_combined(**kw)
    out = np.zeros((2, 40, 4, 8))
    with pytest.raises(ValueError, match=match):
        ssd_oracle.check(out, **kw)


@pytest.mark.parametrize("name", ["x", "dt", "A", "B", "C", "D", "z", "dt_bias",
                                  "initial_states"])
def test_a_non_float_input_is_a_type_error_naming_it(kw, name):
    kw[name] = kw[name].astype(np.int32)
    with pytest.raises(TypeError, match=f"`{name}` must hold floats"):
        ssd_oracle.mamba_chunk_scan_combined(**kw)


def test_other_bad_values(kw):
    with pytest.raises(TypeError, match="`x` must be an array"):
        ssd_oracle.mamba_chunk_scan_combined(**{**kw, "x": "not a tensor"})
    with pytest.raises(TypeError, match="`seq_idx` must hold integers"):
        ssd_oracle.mamba_chunk_scan_combined(**kw, seq_idx=np.zeros((2, 40)))
    with pytest.raises(ValueError, match="seq_idx"):
        ssd_oracle.mamba_chunk_scan_combined(**kw, seq_idx=np.tile(np.arange(40)[::-1], (2, 1)))
    with pytest.raises(ValueError, match="power of two"):
        ssd_oracle.mamba_chunk_scan_combined(**{**kw, "chunk_size": 12})
    with pytest.raises(TypeError, match="chunk_size"):
        ssd_oracle.mamba_chunk_scan_combined(**{**kw, "chunk_size": 16.0})
    with pytest.raises(TypeError, match="dt_limit"):
        ssd_oracle.mamba_chunk_scan_combined(**kw, dt_limit=0.1)
    with pytest.raises(ValueError, match="dt_limit"):
        ssd_oracle.mamba_chunk_scan_combined(**kw, dt_limit=(1.0, 0.5))
    bad_a = -kw["A"]
    with pytest.raises(ValueError, match="`A`"):
        ssd_oracle.mamba_chunk_scan_combined(**{**kw, "A": bad_a})
    nan_x = kw["x"].copy()
    nan_x[0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="`x`"):
        ssd_oracle.mamba_chunk_scan_combined(**{**kw, "x": nan_x})
    out = ssd_oracle.mamba_chunk_scan_combined(**kw)
    with pytest.raises(ValueError, match="unknown precision `fp8`"):
        ssd_oracle.check(out, **kw, precision="fp8")
    with pytest.raises(ValueError, match=r"`out` has shape \[2, 40, 4, 7\]"):
        ssd_oracle.check(out[..., :7], **kw)
    with pytest.raises(TypeError, match="`out` must hold floats"):
        ssd_oracle.check(out.astype(np.int64), **kw)
    with pytest.raises(ValueError, match="sequence of 3"):
        ssd_oracle.check((out, out, out), **kw)
    with pytest.raises(ValueError, match="unknown precision `fp8`.*f64, f32, tf32 or bf16"):
        ssd_oracle.intermediates(**kw, precision="fp8")


def test_missing_and_malformed_case_files(tmp_path):
    with pytest.raises(OSError, match="cannot read"):
        ssd_oracle.load_case(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ssd_oracle.load_case(bad)
