#!/usr/bin/env python3
"""Where one kernel's warps wait, instruction by instruction: Nsight Compute's stall samples per
SASS instruction, summed by region of the code (e.g. a warp-specialized kernel's producer and
consumer paths) and listed for the instructions that hold most of them.

Usage (on the GPU machine, from the bundle, which carries this script):
  python3 ncu_stalls.py --kernel ssd_compute_out_wg --split USETMAXREG.DEALLOC \\
      --csv stalls.csv -- bin/bench-forward --only 1 --dtype bf16 --reps 2
  python3 ncu_stalls.py --from stalls.csv --split USETMAXREG.DEALLOC   (an earlier run's CSV)

It runs `ncu --clock-control none --set full --import-source no -k regex:KERNEL -c 1 --page
source --print-source sass --csv COMMAND` (the first launch whose name matches), keeps the CSV
(`--csv`), and prints:
- the samples of every region: `--split MARKER` (repeatable) starts a new region at the first
  instruction whose SASS contains MARKER, in address order (in ssd_compute_out_wg_bf16 the
  producer's code follows its `setmaxnreg.dec`, USETMAXREG.DEALLOC in SASS, so `--split
  USETMAXREG.DEALLOC` separates the consumers, region 0, from the producer, region 1);
- per region, every column whose header names a stall (the all-samples and not-issued totals,
  and per-reason columns where this ncu version prints them), summed;
- the `--top` instructions (default 25) by all samples, with their region, address and SASS.
Columns are found by their header's words, not their position, as ncu versions name and order
them differently. Measures only: the exit status is ncu's, or 1 when the CSV has no stall column.
"""

import argparse
import csv
import io
import subprocess
import sys

ALL = "Warp Stall Sampling (All Samples)"


def run_ncu(kernel, command):
    cmd = [
        "ncu", "--clock-control", "none", "--set", "full", "--import-source", "no",
        "-k", f"regex:{kernel}", "-c", "1", "--page", "source", "--print-source", "sass", "--csv",
    ] + command
    print("running:", " ".join(cmd), file=sys.stderr)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
    return done.returncode, done.stdout


def table(text):
    """The source page's rows as dicts: the header is the first CSV row with an address column
    and a source column; ncu's own messages (==PROF==, ==WARNING==) are skipped."""
    lines = [line for line in text.splitlines() if line and not line.startswith("==")]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    for i, row in enumerate(rows):
        names = [c.strip() for c in row]
        if any("Address" in c for c in names) and any(c == "Source" for c in names):
            body = [r for r in rows[i + 1:] if len(r) == len(names)]
            return names, [dict(zip(names, r)) for r in body]
    return None, []


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", help="regex of the kernel's name (with a command to run)")
    ap.add_argument("--from", dest="src", help="an earlier run's CSV instead of running ncu")
    ap.add_argument("--csv", help="where to keep the CSV that ncu printed")
    ap.add_argument("--split", action="append", default=[], help="SASS text that starts a region")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- the program ncu runs")
    a = ap.parse_args()
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if a.src:
        with open(a.src) as f:
            text = f.read()
        rc = 0
    elif a.kernel and command:
        rc, text = run_ncu(a.kernel, command)
        if a.csv:
            with open(a.csv, "w") as f:
                f.write(text)
    else:
        ap.error("give --from CSV, or --kernel REGEX -- COMMAND")
    names, rows = table(text)
    stall_cols = [c for c in (names or []) if "stall" in c.lower()]
    if not rows or ALL not in stall_cols:
        print(f"no source table with a '{ALL}' column in ncu's output", file=sys.stderr)
        return rc or 1
    src = "Source"
    addr = next(c for c in names if "Address" in c)
    region, markers = 0, list(a.split)
    sums = {}
    for r in rows:
        while markers and markers[0] in r[src]:
            markers.pop(0)
            region += 1
        r["_region"] = region
        acc = sums.setdefault(region, {c: 0.0 for c in stall_cols} | {"_instructions": 0})
        acc["_instructions"] += 1
        for c in stall_cols:
            acc[c] += number(r[c])
    total = sum(s[ALL] for s in sums.values()) or 1.0
    print(f"{len(rows)} SASS instructions, {total:.0f} stall samples (all)")
    for reg, s in sorted(sums.items()):
        print(f"region {reg}: {s['_instructions']} instructions, {s[ALL]:.0f} samples ({100 * s[ALL] / total:.1f}%)")
        for c in stall_cols:
            if c != ALL and s[c]:
                print(f"    {c}: {s[c]:.0f}")
    print(f"top {a.top} instructions by all samples:")
    for r in sorted(rows, key=lambda r: -number(r[ALL]))[: a.top]:
        n = number(r[ALL])
        print(f"  {100 * n / total:5.1f}%  region {r['_region']}  {r[addr]:>8}  {r[src].strip()}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
