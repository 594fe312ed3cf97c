#!/usr/bin/env python3
"""Runs mamba_ssm's Triton forward on every case of a fixture folder and checks it with ssd-oracle.

For each case it writes the Triton outputs (out, final_states, dA_cumsum, chunk_states) as a
candidate and runs `ssd-oracle check --precision tf32`: the correct call must pass. Then it
repeats the call with one option wrong (D, z, dt_bias, initial_states, seq_idx or dt_limit
dropped, softplus flipped), for each option the case uses: every such run must fail.

Needs a CUDA GPU, torch, triton, einops, safetensors, and mamba_ssm's Triton kernels on
PYTHONPATH. Usage:
    anchor_check.py --fixtures DIR --oracle PATH/TO/ssd-oracle [--work DIR] [--device cpu]
Without a GPU, `TRITON_INTERPRET=1 anchor_check.py --device cpu ...` runs the same Triton kernels
in Triton's interpreter (f32 products instead of TF32: it checks the semantics, not the rounding).
Prints one line per run and a summary; exits 1 if any verdict is not the expected one.
"""
import argparse
import contextlib
import glob
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file
from mamba_ssm.ops.triton.ssd_combined import _mamba_chunk_scan_combined_fwd


def load_case(path):
    with open(path) as f:
        manifest = json.load(f)
    tensors = load_file(os.path.join(os.path.dirname(path), manifest["tensors"]))
    return manifest, tensors


def run_triton(manifest, t, drop=None, dev="cuda"):
    f32 = lambda name: t[name].to(dev, torch.float32).contiguous() if name in t else None
    lo, hi = manifest.get("dt_limit", [0.0, None])
    dt_limit = (float(lo), float("inf") if hi is None else float(hi))
    softplus = bool(manifest.get("dt_softplus", False))
    kwargs = dict(
        D=f32("D"), z=f32("z"), dt_bias=f32("dt_bias"), initial_states=f32("initial_states"),
        seq_idx=t["seq_idx"].to(dev, torch.int32).contiguous() if "seq_idx" in t else None,
        dt_softplus=softplus, dt_limit=dt_limit,
    )
    if drop == "dt_limit":
        kwargs["dt_limit"] = (0.0, float("inf"))
    elif drop == "softplus":
        kwargs["dt_softplus"] = not softplus
    elif drop is not None:
        kwargs[drop] = None
    out, _out_x, _dt, dA_cumsum, states, final_states = _mamba_chunk_scan_combined_fwd(
        f32("x"), f32("dt"), f32("A"), f32("B"), f32("C"), manifest["chunk_size"], **kwargs)
    if dev == "cuda":
        torch.cuda.synchronize()
    return {
        "out": out.float().cpu().contiguous(),
        "final_states": final_states.float().cpu().contiguous(),
        "dA_cumsum": dA_cumsum.float().cpu().contiguous(),
        "chunk_states": states.float().cpu().contiguous(),
    }


def wrong_variants(manifest, t):
    """The options this case uses, each of which can be got wrong."""
    variants = [name for name in ("D", "z", "dt_bias", "initial_states", "seq_idx") if name in t]
    lo, hi = manifest.get("dt_limit", [0.0, None])
    if float(lo) != 0.0 or hi is not None:
        variants.append("dt_limit")
    variants.append("softplus")
    return variants


def check(oracle, case, candidate):
    r = subprocess.run([oracle, "check", "--case", case, "--candidate", candidate,
                        "--precision", "tf32", "--json"], capture_output=True, text=True)
    worst = None
    try:
        report = json.loads(r.stdout)
        worst = report.get("worst_ratio")
    except (json.JSONDecodeError, AttributeError):
        pass
    return r.returncode, worst, r.stderr.strip()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", required=True)
    ap.add_argument("--oracle", required=True)
    ap.add_argument("--work", default=None)
    ap.add_argument("--device", default="cuda",
                    help="cuda, or cpu with TRITON_INTERPRET=1 (Triton's interpreter: f32 dots, slow)")
    args = ap.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="anchor-check-")
    cases = sorted(glob.glob(os.path.join(args.fixtures, "*.json")))
    if not cases:
        print(f"no case (*.json) in {args.fixtures}", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    if args.device == "cpu":
        # the wrappers select the tensor's CUDA device around each launch: nothing to select here
        torch.cuda.device = lambda index: contextlib.nullcontext()
        # and no timer to pick among autotuning configurations: take each kernel's first one
        from triton.runtime.autotuner import Autotuner
        Autotuner.prune_configs = lambda self, kwargs, *rest: self.configs[:1]
    bad = 0
    runs = 0
    for case in cases:
        manifest, t = load_case(case)
        stem = os.path.splitext(os.path.basename(case))[0]
        correct = None
        for drop in [None] + wrong_variants(manifest, t):
            cand = os.path.join(work, f"{stem}.{drop or 'correct'}.safetensors")
            result = run_triton(manifest, t, drop, args.device)
            if drop is None:
                correct = result
            elif all(torch.allclose(result[k], correct[k], rtol=1e-6, atol=0.0)
                     for k in ("out", "final_states")):
                # The wrong option changes nothing beyond float32 rounding here: e.g.
                # initial_states dropped where seq_idx starts above 0, or softplus dropped where
                # every dt + dt_bias is far above 0 (softplus(v) = v to float32 precision).
                print(f"n/a  {stem:32s} {drop + ' wrong':22s} (no effect on this case)")
                continue
            save_file(result, cand)
            rc, worst, err = check(args.oracle, case, cand)
            want = 0 if drop is None else 1
            ok = rc == want
            runs += 1
            bad += not ok
            label = "correct call" if drop is None else f"{drop} wrong"
            print(f"{'ok  ' if ok else 'BAD '} {stem:32s} {label:22s} exit {rc} (want {want})"
                  f" worst error/bound {worst}" + (f"  [{err}]" if rc == 2 else ""))
    print(f"anchor check: {runs - bad} passed, {bad} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
