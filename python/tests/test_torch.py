"""torch tensors in, torch tensors out; any float dtype, bf16 included. Skips without torch."""

import numpy as np
import pytest

import ssd_oracle
from conftest import random_inputs

torch = pytest.importorskip("torch", reason="skipped: torch is not installed")


def as_torch(kw, dtype=torch.float32):
    return {k: torch.from_numpy(np.asarray(v)).to(dtype) if isinstance(v, np.ndarray) else v
            for k, v in kw.items()}


def test_torch_in_torch_out_same_values_as_numpy():
    kw = random_inputs(seed=13)
    ref = ssd_oracle.mamba_chunk_scan_combined(**kw, return_final_states=True)
    out, final = ssd_oracle.mamba_chunk_scan_combined(**as_torch(kw), return_final_states=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float64
    assert out.device == torch.device("cpu")
    assert np.array_equal(out.numpy(), ref[0]) and np.array_equal(final.numpy(), ref[1])


def test_bf16_inputs_are_widened_exactly():
    kw = random_inputs(seed=14)
    t = as_torch(kw)
    for name in ("x", "B", "C", "z"):
        t[name] = t[name].to(torch.bfloat16)
    out = ssd_oracle.mamba_chunk_scan_combined(**t)
    widened = {k: (v.to(torch.float64).numpy() if isinstance(v, torch.Tensor) else v)
               for k, v in t.items()}
    assert np.array_equal(out.numpy(), ssd_oracle.mamba_chunk_scan_combined(**widened))


def test_a_bf16_kernel_output_is_checked_in_bf16():
    kw = random_inputs(seed=15)
    t = as_torch(kw)
    for name in ("x", "B", "C", "z"):
        t[name] = t[name].to(torch.bfloat16)
    out = ssd_oracle.mamba_chunk_scan_combined(**t).to(torch.bfloat16)
    r = ssd_oracle.check(out, **t, precision="bf16")
    assert r.passed and r.tensors[0].dtype == "BF16"
    wrong = out.clone()
    wrong[0, 5, 1, 3] += 1.0
    with pytest.raises(AssertionError, match=r"\(batch 0, token 5, head 1, channel 3\)"):
        ssd_oracle.assert_close(wrong, **t, precision="bf16")


def test_tensors_that_need_grad_and_non_contiguous_views_are_accepted():
    kw = random_inputs(seed=16)
    t = as_torch(kw)
    t["x"] = t["x"].clone().requires_grad_(True)
    t["B"] = t["B"].transpose(0, 1).contiguous().transpose(0, 1)  # same values, strided
    out = ssd_oracle.mamba_chunk_scan_combined(**t)
    assert np.array_equal(out.numpy(), ssd_oracle.mamba_chunk_scan_combined(**kw))


def test_wrong_torch_dtypes_name_the_tensor():
    kw = as_torch(random_inputs(seed=17))
    with pytest.raises(TypeError, match="`B` must be a floating-point tensor"):
        ssd_oracle.mamba_chunk_scan_combined(**{**kw, "B": kw["B"].to(torch.int32)})
    with pytest.raises(TypeError, match="`seq_idx` must be an integer tensor"):
        ssd_oracle.mamba_chunk_scan_combined(**kw, seq_idx=torch.zeros(2, 40))
    seq = torch.zeros(2, 40, dtype=torch.int32)
    seq[:, 20:] = 1
    ssd_oracle.mamba_chunk_scan_combined(**kw, seq_idx=seq)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="skipped: no CUDA device")
def test_cuda_tensors_come_back_on_their_device():
    kw = as_torch(random_inputs(seed=18))
    cuda = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    out = ssd_oracle.mamba_chunk_scan_combined(**cuda)
    assert out.is_cuda and out.dtype == torch.float64
    assert torch.equal(out.cpu(), ssd_oracle.mamba_chunk_scan_combined(**kw))
