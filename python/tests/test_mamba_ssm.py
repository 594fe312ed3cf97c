"""mamba_ssm 2.3.2.post1's Triton forward, checked in-process the way a kernel author would.

Needs a CUDA device, torch, triton and mamba_ssm's Triton kernels on PYTHONPATH; skips, saying
which is missing, otherwise. Run with ``-s`` for one line per check (the transcript).
"""

import numpy as np
import pytest

import ssd_oracle
from conftest import FIXTURES

torch = pytest.importorskip("torch", reason="skipped: torch is not installed")
if not torch.cuda.is_available():
    pytest.skip("skipped: no CUDA device", allow_module_level=True)
ssd = pytest.importorskip("mamba_ssm.ops.triton.ssd_combined",
                          reason="skipped: mamba_ssm's Triton kernels are not importable")


def on_cuda(kwargs):
    """A case's arguments as mamba_ssm takes them: float32 CUDA tensors, int32 seq_idx."""
    out = {}
    for k, v in kwargs.items():
        if isinstance(v, np.ndarray):
            dtype = torch.int32 if k == "seq_idx" else torch.float32
            out[k] = torch.from_numpy(v).to("cuda", dtype).contiguous()
        else:
            out[k] = v
    return out


def triton_outputs(kw):
    args = [kw[k] for k in ("x", "dt", "A", "B", "C", "chunk_size")]
    rest = {k: v for k, v in kw.items() if k not in ("x", "dt", "A", "B", "C", "chunk_size")}
    out, _out_x, _dt, dA_cumsum, states, final_states = ssd._mamba_chunk_scan_combined_fwd(
        *args, **rest)
    return dict(out=out, final_states=final_states, dA_cumsum=dA_cumsum, chunk_states=states)


@pytest.mark.parametrize("manifest", FIXTURES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_committed_fixtures_pass_at_tf32(manifest):
    kw = on_cuda(ssd_oracle.load_case(manifest).kwargs)
    # the kernel's test, as its author writes it: call, then assert_close
    out, final = ssd.mamba_chunk_scan_combined(**kw, return_final_states=True)
    ssd_oracle.assert_close((out, final), **kw, precision="tf32")
    # and every intermediate the oracle knows
    r = ssd_oracle.check(triton_outputs(kw), **kw, precision="tf32")
    worst = {t.name: round(t.worst.ratio, 3) for t in r.tensors}
    print(f"\n{manifest.parent.name}/{manifest.stem}: tf32 {'PASS' if r.passed else 'FAIL'} "
          f"worst error/bound {worst}")
    assert r.passed, r.text


def random_case(seed):
    rng = np.random.default_rng(seed)
    batch = int(rng.integers(1, 4))
    seqlen = int(rng.integers(1, 700))
    ngroups = int(rng.choice([1, 2, 4]))
    nheads = ngroups * int(rng.integers(1, 4))
    # Few (headdim, dstate, chunk) triples: Triton autotunes each new one, for seconds.
    headdim = 64
    dstate = int(rng.choice([64, 128]))
    chunk = int(rng.choice([64, 256]))
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    kw = dict(x=f(batch, seqlen, nheads, headdim), dt=f(batch, seqlen, nheads) - 1.0,
              A=-np.exp(f(nheads)), B=f(batch, seqlen, ngroups, dstate),
              C=f(batch, seqlen, ngroups, dstate), chunk_size=chunk,
              dt_softplus=bool(rng.integers(2)))
    if rng.integers(2):
        kw["D"] = f(nheads) if rng.integers(2) else f(nheads, headdim)
    if rng.integers(2):
        kw["z"] = f(batch, seqlen, nheads, headdim)
    if rng.integers(2):
        kw["dt_bias"] = f(nheads)
    if rng.integers(2):
        kw["initial_states"] = f(batch, nheads, headdim, dstate)
    if rng.integers(2):
        kw["dt_limit"] = (float(rng.uniform(0, 0.05)), float(rng.uniform(0.2, 2.0)))
    if not kw["dt_softplus"]:
        kw["dt"] = np.abs(kw["dt"])
    if rng.integers(2) and seqlen > 1:
        cuts = np.sort(rng.choice(np.arange(1, seqlen), size=min(3, seqlen - 1), replace=False))
        kw["seq_idx"] = np.repeat(np.searchsorted(cuts, np.arange(seqlen), side="right")[None],
                                  batch, axis=0).astype(np.int64)
    return kw


@pytest.mark.parametrize("seed", range(24))
def test_random_cases_pass_at_tf32(seed):
    kw = on_cuda(random_case(seed))
    r = ssd_oracle.check(triton_outputs(kw), **kw, precision="tf32")
    shape = tuple(kw["x"].shape) + (kw["B"].shape[2], kw["B"].shape[3], kw["chunk_size"])
    opts = sorted(k for k in kw if k in ("D", "z", "dt_bias", "initial_states", "seq_idx",
                                         "dt_limit")) + (["softplus"] if kw["dt_softplus"] else [])
    print(f"\nrandom {seed} {shape} {','.join(opts)}: worst error/bound {r.worst_ratio:.3f}")
    assert r.passed, r.text


WRONG = {
    "D": dict(D=None), "z": dict(z=None), "dt_bias": dict(dt_bias=None),
    "initial_states": dict(initial_states=None), "seq_idx": dict(seq_idx=None),
    "dt_softplus": "flip", "dt_limit": dict(dt_limit=(0.0, float("inf"))),
}


@pytest.mark.parametrize("option", list(WRONG))
def test_one_option_wrong_raises_naming_the_worst_element(option):
    rng = np.random.default_rng(99)
    b, s, h, p, g, n = 2, 300, 4, 32, 2, 64
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    seq = np.zeros((b, s), dtype=np.int64)
    seq[:, 120:] = 1
    seq[:, 250:] = 2
    kw = on_cuda(dict(x=f(b, s, h, p), dt=f(b, s, h), A=-np.exp(f(h)), B=f(b, s, g, n),
                      C=f(b, s, g, n), chunk_size=64, D=f(h), z=f(b, s, h, p), dt_bias=f(h),
                      initial_states=f(b, h, p, n), seq_idx=seq, dt_softplus=True,
                      dt_limit=(0.05, 0.6)))
    wrong = dict(kw, dt_softplus=not kw["dt_softplus"]) if WRONG[option] == "flip" \
        else dict(kw, **WRONG[option])
    actual = ssd.mamba_chunk_scan_combined(**wrong, return_final_states=True)
    ssd_oracle.assert_close(ssd.mamba_chunk_scan_combined(**kw, return_final_states=True),
                            **kw, precision="tf32")
    with pytest.raises(AssertionError) as e:
        ssd_oracle.assert_close(actual, **kw, precision="tf32")
    msg = str(e.value)
    assert "element(s) over the bound; worst at (batch " in msg, msg
    first_fail = next(line for line in msg.splitlines() if line.startswith("FAIL"))
    print(f"\n{option} wrong: raises: {first_fail[:160]}")


@pytest.mark.parametrize("seqlen", [1, 100, 4096])
def test_the_example_of_docs_pytorch_md(seqlen):
    """docs/pytorch.md's example, as written there."""
    mamba_chunk_scan_combined = ssd.mamba_chunk_scan_combined
    torch.manual_seed(seqlen)
    b, h, p, n, chunk = 2, 8, 64, 128, 256
    x, dt = torch.randn(b, seqlen, h, p, device="cuda"), torch.randn(b, seqlen, h, device="cuda")
    B, C = torch.randn(2, b, seqlen, 1, n, device="cuda")
    A = -torch.rand(h, device="cuda")
    kw = dict(D=torch.randn(h, device="cuda"), dt_bias=torch.randn(h, device="cuda"), dt_softplus=True)
    out, final = mamba_chunk_scan_combined(x, dt, A, B, C, chunk, **kw, return_final_states=True)
    ssd_oracle.assert_close((out, final), x, dt, A, B, C, chunk, **kw, precision="tf32")
