#!/usr/bin/env python3
"""mamba_ssm 2.3.2.post1's Triton backward (autograd through `mamba_chunk_scan_combined`, fp32
inputs, TF32 dots) checked by `ssd-oracle check` on gradient candidates, on a CUDA machine with
torch, safetensors and mamba_ssm's Triton kernels importable:

    python3 scripts/mamba_backward_oracle.py --oracle path/to/ssd-oracle --out DIR \
        [--cases fixtures/backward] [--random 6] [--seed S] [--no-committed]

For every committed backward case (and `--random` more drawn here and written under DIR), runs
the forward and backward with the case's options and upstream gradients (`dout`,
`dfinal_states`), writes the gradients of every input the case has (`dx`, `ddt`, ...) as an f32
candidate, and checks it at `--precision tf32` (must pass) and `f32` (a TF32 kernel must fail);
then once per option the case uses, with that option wrong in the kernel's run (softplus
flipped, `dt_limit` dropped or imposed, `seq_idx` dropped), at tf32 (must fail). Prints one line
per check and a summary; exits 1 when a verdict is not the expected one.
"""
import argparse
import json
import math
import os
import subprocess
import sys

import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

INPUTS = ["x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states"]


def load_case(path):
    with open(path) as f:
        m = json.load(f)
    t = load_file(os.path.join(os.path.dirname(path), m["tensors"]))
    lo, hi = m.get("dt_limit", [0.0, None])
    m["limit"] = (float(lo), math.inf if hi is None else float(hi))
    return m, t


def write_random_case(out_dir, k, rng):
    """A random case with every option drawn, inputs stored in f32."""
    b = int(rng.integers(1, 3))
    g = int(rng.integers(1, 3))
    h = g * int(rng.integers(1, 3))
    p = int(rng.choice([16, 32, 64]))
    n = int(rng.choice([16, 32, 64, 128]))
    L = int(rng.integers(65, 700))
    chunk = int(rng.choice([32, 64, 128, 256]))
    softplus = bool(rng.integers(0, 2))
    limit = [[0.0, None], [0.001, 0.5], [0.01, 0.1]][int(rng.integers(0, 3))]
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    t = {
        "x": f(b, L, h, p),
        "dt": (f(b, L, h) * 0.5 - (1.0 if softplus else -0.1)).astype(np.float32),
        "A": (-rng.uniform(0.5, 8.0, h)).astype(np.float32),
        "B": f(b, L, g, n),
        "C": f(b, L, g, n),
        "dout": f(b, L, h, p),
    }
    if not softplus:
        t["dt"] = np.abs(t["dt"]) * 0.2
    if rng.integers(0, 2):
        t["D"] = f(h, p) if rng.integers(0, 2) else f(h)
    if rng.integers(0, 2):
        t["z"] = f(b, L, h, p)
    if rng.integers(0, 2):
        t["dt_bias"] = (f(h) * 0.3).astype(np.float32)
    if rng.integers(0, 2):
        t["initial_states"] = f(b, h, p, n)
    if rng.integers(0, 2):
        t["dfinal_states"] = f(b, h, p, n)
    if rng.integers(0, 2):
        cuts = np.sort(rng.integers(1, L, 2))
        s = np.zeros((b, L), dtype=np.int32)
        s[:, cuts[0]:] = 1
        s[:, cuts[1]:] = 2
        t["seq_idx"] = s
    name = f"random-{k}"
    save_file(t, os.path.join(out_dir, name + ".safetensors"))
    m = {
        "format": "ssd-fixture/1",
        "name": name,
        "dims": {"batch": b, "seqlen": L, "nheads": h, "headdim": p, "ngroups": g, "dstate": n},
        "chunk_size": chunk,
        "dt_softplus": softplus,
        "dt_limit": limit,
        "tensors": name + ".safetensors",
    }
    path = os.path.join(out_dir, name + ".json")
    with open(path, "w") as fh:
        json.dump(m, fh)
    return path


def kernel_grads(m, t, softplus, limit, seq_idx):
    """The Triton backward's gradients of every input the case has, as f32 numpy arrays."""
    cu = {k: torch.from_numpy(t[k].astype(np.float32)).cuda().requires_grad_(True)
          for k in INPUTS if k in t}
    out, fin = mamba_chunk_scan_combined(
        cu["x"], cu["dt"], cu["A"], cu["B"], cu["C"], m["chunk_size"], D=cu.get("D"),
        z=cu.get("z"), dt_bias=cu.get("dt_bias"), initial_states=cu.get("initial_states"),
        seq_idx=None if seq_idx is None else torch.from_numpy(seq_idx.astype(np.int32)).cuda(),
        dt_softplus=softplus, dt_limit=limit, return_final_states=True)
    grads = [torch.from_numpy(t["dout"].astype(np.float32)).cuda()]
    outs = [out]
    if "dfinal_states" in t:
        outs.append(fin)
        grads.append(torch.from_numpy(t["dfinal_states"].astype(np.float32)).cuda())
    torch.autograd.backward(outs, grads)
    torch.cuda.synchronize()
    return {"d" + k: v.grad.float().cpu().numpy() for k, v in cu.items()}


def check(oracle, case, cand, precision):
    r = subprocess.run([oracle, "check", "--case", case, "--candidate", cand, "--precision",
                        precision, "--json"], capture_output=True, text=True)
    if r.returncode not in (0, 1):
        raise SystemExit(f"ssd-oracle check failed on {case}: {r.stderr.strip()}")
    rep = json.loads(r.stdout)
    worst = max(rep["tensors"], key=lambda x: x["worst"]["ratio"] if x["worst"] else 0)
    return rep["passed"], rep["worst_ratio"], worst["name"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--oracle", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="fixtures/backward")
    ap.add_argument("--random", type=int, default=6)
    ap.add_argument("--seed", type=int, default=20261201, help="of the random cases")
    ap.add_argument("--no-committed", action="store_true", help="random cases only")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    cases = [] if a.no_committed else sorted(
        os.path.join(a.cases, f) for f in os.listdir(a.cases) if f.endswith(".json"))
    rng = np.random.default_rng(a.seed)
    cases += [write_random_case(a.out, k, rng) for k in range(a.random)]
    bad = []
    rows = {"correct tf32": [], "correct f32": [], "wrong tf32": []}
    for case in cases:
        m, t = load_case(case)
        base = os.path.splitext(os.path.basename(case))[0]
        seq = t.get("seq_idx")
        runs = [("correct", m["dt_softplus"], m["limit"], seq)]
        runs.append(("softplus flipped", not m["dt_softplus"], m["limit"], seq))
        if m["limit"] != (0.0, math.inf):
            runs.append(("dt_limit dropped", m["dt_softplus"], (0.0, math.inf), seq))
        else:
            runs.append(("dt_limit imposed", m["dt_softplus"], (0.01, 0.1), seq))
        if seq is not None:
            runs.append(("seq_idx dropped", m["dt_softplus"], m["limit"], None))
        for label, sp, lim, s in runs:
            g = kernel_grads(m, t, sp, lim, s)
            cand = os.path.join(a.out, f"{base}-{label.replace(' ', '-')}.safetensors")
            save_file(g, cand)
            precisions = ["tf32", "f32"] if label == "correct" else ["tf32"]
            for pr in precisions:
                ok, ratio, name = check(a.oracle, case, cand, pr)
                expect = label == "correct" and pr == "tf32"
                key = f"{'correct' if label == 'correct' else 'wrong'} {pr}"
                rows[key].append(ratio)
                mark = "as expected" if ok == expect else "UNEXPECTED"
                print(f"{base:<22} {label:<18} at {pr:<5} {'PASS' if ok else 'FAIL'} "
                      f"worst ratio {ratio:.3g} ({name})  {mark}", flush=True)
                if ok != expect:
                    bad.append(f"{base} {label} {pr}")
    print(f"\n{len(cases)} cases: correct at tf32 worst ratio {max(rows['correct tf32']):.3g} "
          f"(all must pass); correct at f32 least ratio {min(rows['correct f32']):.3g} "
          f"(all must fail); option wrong at tf32 least ratio {min(rows['wrong tf32']):.3g} "
          f"over {len(rows['wrong tf32'])} runs (all must fail)")
    if bad:
        print("unexpected verdicts:", bad)
        sys.exit(1)


if __name__ == "__main__":
    main()
