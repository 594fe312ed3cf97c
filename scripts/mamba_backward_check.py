#!/usr/bin/env python3
"""mamba_ssm 2.3.2.post1's Triton backward (autograd through `mamba_chunk_scan_combined`, fp32
inputs, TF32 dots) against the float64 adjoint (`ssd_oracle.gradients`), on a CUDA machine with
torch and mamba_ssm's Triton kernels importable and the `ssd_oracle` package installed:

    python3 scripts/mamba_backward_check.py

Prints, per gradient, the largest error, the largest true value and the relative L2 error, and
the relative L2 distance to the gradients of a forward with softplus off (an option wrong).
"""
import time
import numpy as np
import torch
import ssd_oracle
from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

NAMES = ["x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states"]


def inputs(seed, b, L, h, p, g, n, per_channel_D, with_z, with_seq, limit):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    kw = dict(x=r(b, L, h, p), dt=r(b, L, h) * 0.5 - 1.0, A=-torch.rand(h, generator=gen) * 4 - 0.5,
              B=r(b, L, g, n), C=r(b, L, g, n), D=r(h, p) if per_channel_D else r(h),
              dt_bias=r(h) * 0.5, initial_states=r(b, h, p, n))
    if with_z:
        kw["z"] = r(b, L, h, p)
    seq = None
    if with_seq:
        cuts = sorted(torch.randint(1, L, (2,), generator=gen).tolist())
        seq = torch.zeros(b, L, dtype=torch.int32)
        seq[:, cuts[0]:] = 1
        seq[:, cuts[1]:] = 2
    return kw, seq, dict(dt_softplus=True, dt_limit=limit)


def run(label, seed, dims, chunk, per_channel_D, with_z, with_seq, limit):
    b, L, h, p, g, n = dims
    kw, seq, opts = inputs(seed, b, L, h, p, g, n, per_channel_D, with_z, with_seq, limit)
    gen = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(b, L, h, p, generator=gen)
    dfin = torch.randn(b, h, p, n, generator=gen)
    cu = {k: v.cuda().requires_grad_(True) for k, v in kw.items()}
    t0 = time.time()
    out, fin = mamba_chunk_scan_combined(
        cu["x"], cu["dt"], cu["A"], cu["B"], cu["C"], chunk, D=cu["D"], z=cu.get("z"),
        dt_bias=cu["dt_bias"], initial_states=cu["initial_states"],
        seq_idx=None if seq is None else seq.cuda(), return_final_states=True, **opts)
    torch.autograd.backward([out, fin], [dout.cuda(), dfin.cuda()])
    torch.cuda.synchronize()
    took = time.time() - t0
    np64 = {k: v.double().numpy() for k, v in kw.items()}
    args = dict(np64)
    x, dt, A, B, C = (args.pop(k) for k in ("x", "dt", "A", "B", "C"))
    seq_np = None if seq is None else seq.numpy()
    truth = ssd_oracle.gradients(dout.double().numpy(), x, dt, A, B, C, chunk, seq_idx=seq_np,
                                 dfinal_states=dfin.double().numpy(), **args, **opts)
    wrong = ssd_oracle.gradients(dout.double().numpy(), x, dt, A, B, C, chunk, seq_idx=seq_np,
                                 dfinal_states=dfin.double().numpy(), **args,
                                 dt_softplus=False, dt_limit=opts["dt_limit"])
    print(f"{label} dims {dims} chunk {chunk} (mamba fwd+bwd {took:.1f} s incl. compile)")
    for name in NAMES:
        if name not in cu:
            continue
        g = cu[name].grad.double().cpu().numpy()
        t, w = truth["d" + name], wrong["d" + name]
        err = np.abs(g - t)
        rel = np.linalg.norm(g - t) / max(np.linalg.norm(t), 1e-300)
        relw = np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-300)
        print(f"  d{name:<15} max|err| {err.max():.3e}  max|truth| {np.abs(t).max():.3e}  "
              f"rel L2 {rel:.2e}   vs softplus-off truth rel L2 {relw:.2e}")


torch.backends.cuda.matmul.allow_tf32 = True
run("plain D/head, no z", 1, (2, 300, 4, 64, 2, 64), 64, False, False, False, (0.0, float("inf")))
run("every option", 2, (2, 300, 4, 64, 2, 64), 64, True, True, True, (0.001, 0.5))
