#!/usr/bin/env python3
"""Times the CPU reference against the PyTorch CPU anchors, in the same run, in alternating rounds.

At the issue's benchmark shape (batch 2, seqlen 2048, 8 heads of 64, dstate 64, 8 groups,
chunk 64, float64), each round times:
  - mamba_ssm's `ssd_minimal_discrete` (the chunked einsum listing) on PyTorch CPU,
  - a plain time-step recurrence in PyTorch,
  - `ssd-oracle run --impl chunked` and `--impl naive` (`compute_ms_median` of --repeat N),
and prints the ratios. PyTorch uses as many threads as the oracle (2 by default: the CI machine).

Needs torch, einops, safetensors and mamba_ssm's Python sources on PYTHONPATH (the anchors'
`fetch-mamba-ssm` lays them out; importing them also needs triton). Usage:
    cpu_anchor_bench.py --oracle target/release/ssd-oracle [--rounds 3] [--threads 2]
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

import torch
from safetensors.torch import load_file
from mamba_ssm.modules.ssd_minimal import ssd_minimal_discrete

CASE = "layer-2x2048-h8-p64-n64"


def median_ms(fn, repeat):
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def recurrence(x, dt, A, B, C, s):
    """s_t = exp(dt A) s_{t-1} + dt x B^T, y_t = s_t C (B, C per head: ngroups = nheads)."""
    L = x.shape[1]
    y = torch.empty_like(x)
    decay = torch.exp(dt * A)
    dx = x * dt[..., None]
    for t in range(L):
        s = decay[:, t, :, None, None] * s + dx[:, t, :, :, None] * B[:, t, :, None, :]
        y[:, t] = torch.einsum("bhpn,bhn->bhp", s, C[:, t])
    return y


def oracle_ms(oracle, case, impl, repeat, out):
    r = subprocess.run([oracle, "run", "--case", case, "--impl", impl, "--out", out,
                        "--repeat", str(repeat), "--json"], capture_output=True, text=True, check=True)
    return json.loads(r.stdout)["compute_ms_median"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--oracle", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=31, help="oracle computations per round")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))
    work = tempfile.mkdtemp(prefix="cpu-anchor-")
    subprocess.run([args.oracle, "gen", "--suite", "standard", "--out", work], check=True,
                   capture_output=True, env=env)
    case = os.path.join(work, CASE + ".json")
    with open(case) as f:
        manifest = json.load(f)
    t = load_file(case[:-5] + ".safetensors")
    x, dt, A, B, C, D, init = (t[k].double() for k in ("x", "dt", "A", "B", "C", "D", "initial_states"))
    # dt' = clamp(softplus(dt + dt_bias), 0, inf), as the case asks (done once, outside the timing:
    # the oracle's timing includes it)
    dt = dt + t["dt_bias"].double()
    if manifest.get("dt_softplus"):
        dt = torch.where(dt > 20.0, dt, torch.log1p(torch.exp(dt)))
    dt = dt.clamp(min=manifest["dt_limit"][0])
    chunk = manifest["chunk_size"]
    skip = D[None, None, :, None] * x
    minimal = lambda: ssd_minimal_discrete(x * dt[..., None], A * dt, B, C, chunk,
                                           initial_states=init[:, None])[0] + skip
    expected = t["out"].double()
    y_rec = recurrence(x, dt, A, B, C, init) + skip
    for name, y in (("ssd_minimal_discrete", minimal()), ("torch recurrence", y_rec)):
        rel = (y - expected).norm() / expected.norm()
        print(f"{name}: relative L2 difference from the case's expected out {rel:.1e}")
    out = os.path.join(work, "o.safetensors")
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    print(f"{'round':>5} {'minimal ms':>11} {'recur. ms':>10} {'chunked ms':>11} {'naive ms':>9}"
          f" {'minimal/chunked':>16} {'recur./naive':>13}")
    ratios_c, ratios_n = [], []
    for r in range(args.rounds):
        m = median_ms(minimal, 11)
        rec = median_ms(lambda: recurrence(x, dt, A, B, C, init) + skip, 3)
        c = oracle_ms(args.oracle, case, "chunked", args.repeat, out)
        n = oracle_ms(args.oracle, case, "naive", args.repeat, out)
        ratios_c.append(m / c)
        ratios_n.append(rec / n)
        print(f"{r + 1:>5} {m:>11.1f} {rec:>10.1f} {c:>11.1f} {n:>9.1f} {m / c:>15.1f}x {rec / n:>12.1f}x")
    print(f"median over rounds: chunked {statistics.median(ratios_c):.1f}x faster than ssd_minimal_discrete, "
          f"naive {statistics.median(ratios_n):.1f}x faster than the torch recurrence")


if __name__ == "__main__":
    main()
