#!/usr/bin/env python3
"""Times kernel forms against each other in one call, in alternating rounds, with the forward
benchmark that scripts/gpu-bundle.sh put in the bundle (bin/bench-forward beside this script).

Usage (on the GPU machine, from the bundle):
  python3 gpu_ab.py [--shapes 1,0,2,3] [--reps 20] [--rounds 2] [--dtype bf16] FORM [FORM ...]
A FORM is `label` or `label:VAR=VALUE VAR=VALUE ...`: the environment of that form's runs, e.g.
  'base'  'v2:SSD_GPU_CHAINED=0'  'form:SSD_NVRTC_OPTIONS=-DNAME=1'
(`SSD_NVRTC_OPTIONS` takes the rest of its form, spaces included: `-DA=1 -DB=1`). Each round runs
every form once, in the order given, each run one bench process over every shape (`--shapes` are
the bench's `--only` indices: 0 to 4 the speed issue's shapes, in gpu/benches/forward.rs's
order; one compilation of the kernels a run): per shape the bench's own median of `--reps`
CUDA-event timings. The compilation (NVRTC) and the input sets' generation stay out of the
timings.

Prints one line per shape of each run as the run ends, then per shape a table of each form's
medians over the rounds (forward, stage 2, output stage, ms) and the output stage's change
against the first form; writes every run's log to --log (default ab.log). Speed is measured here, never asserted:
the exit status is 0 unless a run failed.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def parse_form(text):
    label, _, rest = text.partition(":")
    env = {}
    rest = rest.strip()
    if rest:
        # SSD_NVRTC_OPTIONS takes everything after its '=' (its options hold spaces).
        key = "SSD_NVRTC_OPTIONS="
        if key in rest:
            head, _, opts = rest.partition(key)
            env["SSD_NVRTC_OPTIONS"] = opts.strip()
            rest = head.strip()
        for word in rest.split():
            name, eq, value = word.partition("=")
            if not eq:
                raise SystemExit(f"form {text!r}: {word!r} is not VAR=VALUE")
            env[name] = value
    if not label:
        raise SystemExit(f"form {text!r} has no label")
    return label, env


def run(bench, shapes, reps, env, dtype, log):
    """One bench process over `shapes`: its BENCH_JSON lines of `dtype`, in shape order (None
    for a shape without one), the exit status and the seconds it took."""
    t0 = time.time()
    proc = subprocess.run(
        [bench, "--only", ",".join(map(str, shapes)), "--reps", str(reps), "--dtype", dtype],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )
    log.write(f"=== shapes {shapes} env {env} rc {proc.returncode}\n{proc.stdout}{proc.stderr}\n")
    log.flush()
    found = [
        json.loads(line[len("BENCH_JSON ") :])
        for line in proc.stdout.splitlines()
        if line.startswith("BENCH_JSON ")
    ]
    found = [j for j in found if j.get("dtype", "f32") == dtype]
    # The bench prints its shapes in its own order (ascending index).
    by_index = dict(zip(sorted(shapes), found)) if len(found) == len(shapes) else {}
    return [by_index.get(s) for s in shapes], proc.returncode, time.time() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("forms", nargs="+")
    ap.add_argument("--shapes", default="1,0,2,3")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--bench", default=os.path.join(here, "bin", "bench-forward"))
    ap.add_argument("--log", default="ab.log")
    a = ap.parse_args()
    forms = [parse_form(f) for f in a.forms]
    labels = [label for label, _ in forms]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"each form needs its own label: {labels}")
    # Each shape once, in the order given.
    shapes = list(dict.fromkeys(int(s) for s in a.shapes.split(",") if s.strip()))
    # 5, the serving shape, prints no BENCH_JSON line: every run would read as failed.
    if not shapes or any(not 0 <= s <= 4 for s in shapes):
        raise SystemExit(f"--shapes: indices 0 to 4 expected, got {a.shapes!r}")
    got = {}  # (shape, label) -> list of json
    failed = 0
    with open(a.log, "w") as log:
        for rnd in range(a.rounds):
            for label, env in forms:
                js, rc, secs = run(a.bench, shapes, a.reps, env, a.dtype, log)
                for shape, j in zip(shapes, js):
                    if j is None or rc != 0:
                        failed += 1
                        print(f"round {rnd} shape {shape} {label}: FAILED (rc {rc}, {secs:.0f} s)", flush=True)
                        continue
                    got.setdefault((shape, label), []).append(j)
                    print(
                        f"round {rnd} shape {shape} {label:12s} fwd {j['ours_ms']:.4f} state {j['state_ms']:.4f} "
                        f"out {j['out_ms']:.4f} ({j['out_kernel']}, {secs:.0f} s for the process)",
                        flush=True,
                    )
    print()
    for shape in shapes:
        first = got.get((shape, labels[0]))
        base = statistics.median(r["out_ms"] for r in first) if first else None
        dims = next((got[(shape, lb)][0]["shape"] for lb, _ in forms if got.get((shape, lb))), None)
        print(f"shape {shape} {dims}: medians over {a.rounds} rounds, {a.dtype}, ms")
        print(f"  {'form':12s} {'forward':>8s} {'stage 2':>8s} {'output':>8s}  output vs first")
        for label, _ in forms:
            runs = got.get((shape, label))
            if not runs:
                print(f"  {label:12s} (no result)")
                continue
            med = {k: statistics.median(r[k] for r in runs) for k in ("ours_ms", "state_ms", "out_ms")}
            rel = "" if base is None or label == labels[0] else f"{100 * (med['out_ms'] / base - 1):+.1f}%"
            print(f"  {label:12s} {med['ours_ms']:8.4f} {med['state_ms']:8.4f} {med['out_ms']:8.4f}  {rel}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
