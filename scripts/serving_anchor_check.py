#!/usr/bin/env python3
"""Serving kernels of mamba_ssm 2.3.2.post1 and vLLM 0.33.0 checked by `ssd-oracle check` on
packed cases, on a CUDA machine with torch, safetensors, and both packages' Triton kernels
importable (their source folders on PYTHONPATH):

    python3 scripts/serving_anchor_check.py --oracle path/to/ssd-oracle --out DIR

1. mamba_ssm `mamba_chunk_scan_combined(..., seq_idx, cu_seqlens, return_final_states=True,
   return_varlen_states=True)` (its convention: `initial_states` for the first sequence), fp32
   inputs, TF32 dots: passes at tf32; fails with softplus flipped or `seq_idx` dropped.
2. vLLM `mamba_chunk_scan_combined_varlen` (one initial state per sequence): fp32 inputs pass at
   tf32, bf16 inputs (`x`, `B`, `C`, `z`, `dt`) at bf16, an fp16 state buffer (states read and
   written in fp16) at tf32; one sequence's initial state withheld fails.
3. mamba_ssm `selective_state_update` decode steps (one token per sequence) with fp32, fp16 and
   bf16 states: pass at f32.
4. Prefill/decode consistency: mamba_ssm's prefill over all but the last 3 tokens of each
   sequence, its final states carried into 3 `selective_state_update` steps, against the case
   of the whole sequences: with the default `dt_limit` it passes; with `dt_limit = (0.01, 0.1)`
   the prefill clamps and the decode cannot (it has no `dt_limit` argument), so it fails.

Each line says the verdict and whether it was the expected one; exits 1 when one was not.
"""
import argparse
import json
import math
import os
import subprocess
import sys

import numpy as np
import torch
from safetensors.numpy import save_file
from safetensors.torch import save_file as save_tensors

from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
from mamba_ssm.ops.triton.selective_state_update import selective_state_update
from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen

ORACLE = None
OUT = None
BAD = []


def bf16(a):
    return torch.from_numpy(a.astype(np.float32)).bfloat16().float().numpy()


def f16(a):
    return a.astype(np.float16).astype(np.float32)


def write_case(name, lens, h, p, g, n, chunk, softplus, limit, rng, convention,
               round_inputs=None, round_states=None, dt_bf16=False):
    """A packed case; `convention` is "mamba" (initial_states for sequence 0), "serving" (one
    per sequence) or None. Returns (manifest path, tensors)."""
    L = int(sum(lens))
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    t = {
        "x": f(1, L, h, p), "B": f(1, L, g, n), "C": f(1, L, g, n), "z": f(1, L, h, p),
        "dt": (f(1, L, h) * 0.5 - 1.0).astype(np.float32),
        "A": (-rng.uniform(0.5, 4.0, h)).astype(np.float32),
        "D": f(h), "dt_bias": (f(h) * 0.3).astype(np.float32),
        "cu_seqlens": np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
    }
    if not softplus:
        t["dt"] = np.abs(t["dt"]) * 0.1
    if round_inputs is not None:
        for k in ("x", "B", "C", "z"):
            t[k] = round_inputs(t[k])
    if dt_bf16:
        t["dt"] = bf16(t["dt"])
    if convention == "mamba":
        t["initial_states"] = f(1, h, p, n)
    elif convention == "serving":
        s0 = f(len(lens), h, p, n)
        t["seq_initial_states"] = round_states(s0) if round_states else s0
    t["seq_idx"] = np.repeat(np.arange(len(lens)), lens).astype(np.int32)[None, :]
    save_file(t, os.path.join(OUT, name + ".safetensors"))
    m = {"format": "ssd-fixture/1", "name": name,
         "dims": {"batch": 1, "seqlen": L, "nheads": h, "headdim": p, "ngroups": g, "dstate": n},
         "chunk_size": chunk, "dt_softplus": softplus,
         "dt_limit": [limit[0], None if math.isinf(limit[1]) else limit[1]],
         "tensors": name + ".safetensors"}
    path = os.path.join(OUT, name + ".json")
    with open(path, "w") as fh:
        json.dump(m, fh)
    return path, t, m


def check(case, cand, precision, expect, label):
    r = subprocess.run([ORACLE, "check", "--case", case, "--candidate", cand, "--precision",
                        precision, "--json"], capture_output=True, text=True)
    if r.returncode not in (0, 1):
        print(f"{label}: ssd-oracle check could not run: {r.stderr.strip()}", flush=True)
        BAD.append(label)
        return
    rep = json.loads(r.stdout)
    worst = max(rep["tensors"], key=lambda x: x["worst"]["ratio"] if x["worst"] else 0)
    ok = rep["passed"]
    mark = "as expected" if ok == expect else "UNEXPECTED"
    names = ",".join(x["name"] for x in rep["tensors"])
    print(f"{label:<58} at {precision:<5} {'PASS' if ok else 'FAIL'} worst {rep['worst_ratio']:.3g} "
          f"({worst['name']}; checked {names})  {mark}", flush=True)
    if ok != expect:
        BAD.append(label)


def cuda(a, dtype=torch.float32):
    return torch.from_numpy(np.ascontiguousarray(a)).to(dtype).cuda()


def mamba_varlen(case, t, m, label, softplus=None, seq=True):
    lim = tuple(math.inf if v is None else v for v in m["dt_limit"])
    out, fin, var = mamba_chunk_scan_combined(
        cuda(t["x"]), cuda(t["dt"]), cuda(t["A"]), cuda(t["B"]), cuda(t["C"]), m["chunk_size"],
        D=cuda(t["D"]), z=cuda(t["z"]), dt_bias=cuda(t["dt_bias"]),
        initial_states=cuda(t["initial_states"]) if "initial_states" in t else None,
        seq_idx=cuda(t["seq_idx"], torch.int32) if seq else None,
        cu_seqlens=cuda(t["cu_seqlens"], torch.int32),
        dt_softplus=m["dt_softplus"] if softplus is None else softplus, dt_limit=lim,
        return_final_states=True, return_varlen_states=True)
    cand = os.path.join(OUT, label.replace(" ", "-") + ".safetensors")
    save_file({"out": out.float().cpu().numpy(), "final_states": fin.float().cpu().numpy(),
               "varlen_states": var.float().cpu().numpy()}, cand)
    return cand


def vllm_varlen(case, t, m, label, dtype=torch.float32, state_dtype=torch.float32, withhold=None):
    lens = np.diff(t["cu_seqlens"])
    chunk = m["chunk_size"]
    cu_chunks, chunk_seq, last = [0], [], []
    for i, l in enumerate(lens):
        start = cu_chunks[-1]
        k = 0
        while k < l:
            step = min(chunk, l - k)
            cu_chunks.append(cu_chunks[-1] + step)
            chunk_seq.append(i)
            k += step
        last.append(len(chunk_seq) - 1)
    L = int(lens.sum())
    h, p = t["x"].shape[2], t["x"].shape[3]
    s0 = t["seq_initial_states"].copy()
    if withhold is not None:
        s0[withhold] = 0.0
    lim = tuple(math.inf if v is None else v for v in m["dt_limit"])
    out = torch.empty(L, h, p, dtype=dtype, device="cuda")
    nseq = len(lens)
    buf = torch.zeros(nseq, h, p, s0.shape[-1], dtype=state_dtype, device="cuda")
    mamba_chunk_scan_combined_varlen(
        cuda(t["x"][0], dtype), cuda(t["dt"][0], dtype), cuda(t["A"]), cuda(t["B"][0], dtype),
        cuda(t["C"][0], dtype), chunk, cuda(t["cu_seqlens"], torch.int32),
        cuda(np.array(cu_chunks), torch.int32), cuda(np.array(last), torch.int32),
        cuda(np.array(chunk_seq), torch.int32), out, D=cuda(t["D"]), z=cuda(t["z"][0], dtype),
        dt_bias=cuda(t["dt_bias"]), initial_states=cuda(s0, state_dtype),
        dt_softplus=m["dt_softplus"], dt_limit=lim, state_dtype=state_dtype,
        final_states_out=buf, final_state_indices=torch.arange(nseq, device="cuda", dtype=torch.int32))
    torch.cuda.synchronize()
    cand = os.path.join(OUT, label.replace(" ", "-") + ".safetensors")
    # Stored as the kernel stores them: out in the inputs' dtype, the states in state_dtype.
    save_tensors({"out": out.cpu()[None].contiguous(), "varlen_states": buf.cpu().contiguous()},
                 cand)
    return cand


def decode(t, m, states, state_dtype, dt_limit_free=True):
    """One selective_state_update step per sequence (cu_seqlens = 0..N): (out, new states)."""
    nseq = states.shape[0]
    h, p = t["x"].shape[2], t["x"].shape[3]
    n = states.shape[-1]
    st = cuda(states, state_dtype)
    x = cuda(t["x"][0])
    dt = cuda(t["dt"][0])[:, :, None].expand(nseq, h, p)
    A = cuda(t["A"])[:, None, None].expand(h, p, n)
    D = cuda(t["D"])[:, None].expand(h, p)
    bias = cuda(t["dt_bias"])[:, None].expand(h, p)
    y = selective_state_update(st, x, dt, A, cuda(t["B"][0]), cuda(t["C"][0]), D=D,
                               z=cuda(t["z"][0]), dt_bias=bias, dt_softplus=m["dt_softplus"])
    torch.cuda.synchronize()
    return y, st


def main():
    global ORACLE, OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--oracle", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    ORACLE, OUT = a.oracle, a.out
    os.makedirs(OUT, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    rng = np.random.default_rng(20261201)
    h, p, g, n = 8, 64, 2, 64

    # 1. mamba_ssm varlen.
    for k, (lens, chunk, limit) in enumerate([([37, 200, 5, 120], 64, (0.0, math.inf)),
                                              ([300, 64, 150], 256, (0.001, 0.5))]):
        case, t, m = write_case(f"mamba-varlen-{k}", lens, h, p, g, n, chunk, True, limit, rng, "mamba")
        check(case, mamba_varlen(case, t, m, f"mamba varlen {k} correct"), "tf32", True, f"mamba varlen {k} correct")
        check(case, mamba_varlen(case, t, m, f"mamba varlen {k} softplus flipped", softplus=False), "tf32", False, f"mamba varlen {k} softplus flipped")
        check(case, mamba_varlen(case, t, m, f"mamba varlen {k} seq_idx dropped", seq=False), "tf32", False, f"mamba varlen {k} seq_idx dropped")

    # 2. vLLM varlen, one initial state per sequence.
    for k, (lens, chunk, limit) in enumerate([([37, 200, 5, 120], 64, (0.0, math.inf)),
                                              ([300, 64, 150, 1], 256, (0.001, 0.5))]):
        case, t, m = write_case(f"vllm-{k}", lens, h, p, g, n, chunk, True, limit, rng, "serving")
        check(case, vllm_varlen(case, t, m, f"vllm {k} fp32"), "tf32", True, f"vllm {k} fp32")
        check(case, vllm_varlen(case, t, m, f"vllm {k} fp32 one state withheld", withhold=2), "tf32", False, f"vllm {k} fp32 one state withheld")
        case, t, m = write_case(f"vllm-bf16-{k}", lens, h, p, g, n, chunk, True, limit, rng, "serving",
                                round_inputs=bf16, dt_bf16=True)
        check(case, vllm_varlen(case, t, m, f"vllm {k} bf16 inputs", dtype=torch.bfloat16), "bf16", True, f"vllm {k} bf16 inputs")
        check(case, vllm_varlen(case, t, m, f"vllm {k} bf16 one state withheld", dtype=torch.bfloat16, withhold=1), "bf16", False, f"vllm {k} bf16 one state withheld")
        case, t, m = write_case(f"vllm-f16state-{k}", lens, h, p, g, n, chunk, True, limit, rng, "serving",
                                round_states=f16)
        check(case, vllm_varlen(case, t, m, f"vllm {k} fp16 state buffer", state_dtype=torch.float16), "tf32", True, f"vllm {k} fp16 state buffer")

    # 3. selective_state_update decode steps, default dt_limit.
    for sd, rnd, name in [(torch.float32, None, "fp32"), (torch.float16, f16, "fp16"),
                          (torch.bfloat16, bf16, "bf16")]:
        case, t, m = write_case(f"decode-{name}", [1] * 16, h, p, g, n, 64, True, (0.0, math.inf),
                                rng, "serving", round_states=rnd)
        y, st = decode(t, m, t["seq_initial_states"], sd)
        cand = os.path.join(OUT, f"decode-{name}-cand.safetensors")
        save_tensors({"out": y.cpu()[None].contiguous(), "varlen_states": st.cpu().contiguous()},
                     cand)
        check(case, cand, "f32", True, f"selective_state_update, {name} state")

    # 4. Prefill (mamba_ssm, batch of 4 rows) + 3 decode steps, against the whole sequences.
    for limit, expect in [((0.0, math.inf), True), ((0.01, 0.1), False)]:
        nseq, L, T = 4, 96, 3
        case, t, m = write_case(f"prefill-decode-{limit[1]}", [L] * nseq, h, p, g, n, 64, True, limit,
                                rng, None)
        rows = lambda a: a[0].reshape(nseq, L, *a.shape[2:])
        x, dt, B, C, z = (rows(t[k]) for k in ("x", "dt", "B", "C", "z"))
        out, fin = mamba_chunk_scan_combined(
            cuda(x[:, :L - T]), cuda(dt[:, :L - T]), cuda(t["A"]), cuda(B[:, :L - T]), cuda(C[:, :L - T]),
            64, D=cuda(t["D"]), z=cuda(z[:, :L - T]), dt_bias=cuda(t["dt_bias"]), dt_softplus=True,
            dt_limit=limit, return_final_states=True)
        full = np.zeros((nseq, L, h, p), dtype=np.float32)
        full[:, :L - T] = out.float().cpu().numpy()
        states = fin.float().cpu().numpy()
        for s in range(L - T, L):
            tok = {"x": x[:, s][None], "dt": dt[:, s][None], "A": t["A"], "B": B[:, s][None],
                   "C": C[:, s][None], "z": z[:, s][None], "D": t["D"], "dt_bias": t["dt_bias"]}
            y, st = decode(tok, m, states, torch.float32)
            full[:, s] = y.float().cpu().numpy()
            states = st.float().cpu().numpy()
        cand = os.path.join(OUT, f"prefill-decode-{limit[1]}-cand.safetensors")
        save_file({"out": full.reshape(1, nseq * L, h, p), "varlen_states": states}, cand)
        check(case, cand, "tf32", expect, f"mamba prefill + 3 decode steps, dt_limit {limit}")

    print(f"\n{len(BAD)} unexpected verdicts" + (f": {BAD}" if BAD else ""))
    sys.exit(1 if BAD else 0)


if __name__ == "__main__":
    main()
