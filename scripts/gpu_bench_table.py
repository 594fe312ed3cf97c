#!/usr/bin/env python3
"""Times the anchors on the speed issue's five shapes, in fp32 (TF32 dots) and in bf16, measures
the ceilings of this GPU (device-to-device copy bandwidth, TF32 and bf16 matrix rates), and prints
one table per dtype next to our forward's timings.

Usage: gpu_bench_table.py OUR_BENCH_LOG [--rounds N] [--dtypes fp32,bf16] [--no-serving]   (the log of `cargo bench -p ssd-gpu
--bench forward`, which holds one `BENCH_JSON {...}` line per shape and dtype: lines with
`"dtype": "bf16"` are our bf16 path, lines without the field or with `"dtype": "f32"` our fp32
inputs with TF32 products). Needs torch and triton, and mamba_ssm's Triton kernels on PYTHONPATH
(the repository's `.anchors/` laid out by fetch-mamba-ssm, or `pip install mamba-ssm`). Without
them it prints our timings alone, per dtype. vLLM's kernels are found as the package `vllm`
(`.anchors/vllm_pkg` laid out by fetch-vllm-ssd, on PYTHONPATH); without them vLLM's columns read
n/a and the fastest anchor is taken among the others.

The anchors, each timed on each shape in both dtypes (inputs as in the anchors README: dt already
activated, D per head, one initial state per sequence in fp32, final states returned; fp32 rows:
x, B, C, dt in fp32; bf16 rows: x, B, C and dt in bf16, states fp32):
  - mamba_ssm 2.3.2.post1's `mamba_chunk_scan_combined`;
  - vLLM 0.33.0's varlen prefill `mamba_chunk_scan_combined_varlen`, the batch's rows concatenated
    into one packed row (cu_seqlens = 0, L, 2L, ...; chunk metadata built outside the timed
    region), final states written into a preallocated fp32 buffer;
  - vLLM's unmerged `ssd_fused5` (bf16 only, at the two 80-head shapes only): it cannot be run,
    so it is derived from its recorded ratio to mamba_ssm (FUSED5_BF16_RECORDED) times this run's
    mamba_ssm bf16 time, and counts in the fastest-anchor choice only where it beats every
    runnable anchor timed in this run.
Each table row: ours, every anchor, the fastest anchor, our speedup over it, our GB/s of minimal
bytes, our % of the floor (the larger of minimal bytes over the copy bandwidth and the causal
matrix work over the dtype's matrix rate; bf16 counts 2 bytes for x, B, C and out, 4 for dt and
the states; z is not counted; computed here, not read from the log) and our stage split when the
log has it; a dtype without lines in our log still gets its table, ours n/a. One line per dtype then
gives the worst speedup over the five shapes and the % of floor at FLOOR_SHAPE, and one
`TABLE_JSON {...}` line per shape and dtype holds every number for the docs.

Ours is the log's `ours_ms`: the forward into outputs that do not keep `chunk_states`; where the
log also has `kept_ms` (the forward with them kept) the cell gives it in brackets.

The serving shape (SERVING_JSON lines, fp32: 64 requests packed into one row) is timed against
mamba_ssm's forward with cu_seqlens, seq_idx and return_varlen_states (no per-request initial
states: mamba_ssm has none) and, with one initial state per request, against vLLM's
mamba_chunk_scan_combined_varlen (when importable), in this process; `--no-serving` skips it (so
that both dtypes' anchors in one process fit a 10-minute call).

The anchors are timed in N separate processes (default 3), one after the other, each timing every
anchor on every shape in both dtypes: the Triton kernels pick their launch configurations by
autotuning once per process (one process of three took 0.893 ms where the other two took 0.690 ms
at (4, 16384, 8)). The tables take each anchor's fastest process median (the harder anchor) and
print the slowest beside it. On the H200 one round of the bf16 anchors alone took 74 s and of the
fp32 ones 51 s (`--dtypes` times one dtype's anchors alone); with both dtypes and the serving rows
a single run may outlast a 10-minute call, so split it. Between runs on freshly started machines
the spread is larger still (0.404 to 0.923 ms at (8, 2048, 24) on the H200s seen so far): compare
only inside one run.
"""
import itertools
import json
import os
import subprocess
import sys

SHAPES = [(4, 4096, 80, 64, 128, 1, 256), (8, 8192, 80, 64, 128, 1, 256), (8, 2048, 24, 64, 128, 1, 256),
          (4, 16384, 8, 64, 128, 1, 128), (4, 65536, 8, 64, 256, 1, 128)]
# The shape whose % of floor the summary line quotes.
FLOOR_SHAPE = (8, 8192, 80, 64, 128, 1, 256)
DTYPES = ("fp32", "bf16")
DTYPE_TITLE = {"fp32": "fp32 inputs (TF32 dots)", "bf16": "bf16 inputs (fp32 states)"}
RUNNABLE = ("mamba_ssm", "vLLM")  # the anchors timed here, in this order
FUSED5 = "fused5 (derived)"
# vLLM's ssd_fused5 (unmerged vLLM pull request #27299) at bf16: (its ms, mamba_ssm bf16 ms) as
# recorded in the same run, from the table of the anchors README's section "GPU: vLLM 0.33.0's
# Mamba-2 prefill Triton kernels". Only these two shapes, where it beats both runnable anchors there.
FUSED5_BF16_RECORDED = {
    (4, 4096, 80, 64, 128, 1, 256): (0.631, 0.692),
    (8, 8192, 80, 64, 128, 1, 256): (2.363, 3.262),
}

args = sys.argv[1:]
triton_round = "--triton-round" in args
rounds = 3
if "--rounds" in args:
    rounds = int(args[args.index("--rounds") + 1])
    if rounds < 1:
        sys.exit("--rounds must be at least 1")
if "--dtypes" in args:  # e.g. --dtypes bf16: time those anchors alone (a shorter run)
    DTYPES = tuple(d for d in args[args.index("--dtypes") + 1].split(",") if d in DTYPES)
    if not DTYPES:
        sys.exit("--dtypes takes fp32, bf16 or fp32,bf16")
no_serving = "--no-serving" in args
positional = [a for i, a in enumerate(args)
              if not a.startswith("--") and (i == 0 or args[i - 1] not in ("--rounds", "--dtypes"))]


def log_dtype(j):
    """Our dtype of a BENCH_JSON / SERVING_JSON line: "fp32" (no field, "f32"), "bf16", or None."""
    return {"f32": "fp32", "fp32": "fp32", "bf16": "bf16"}.get(j.get("dtype", "f32"))


ours = {}  # (shape, dtype) -> our BENCH_JSON line
serving = []  # the serving shape's fp32 lines (SERVING_JSON), without and with per-request states
if positional:
    for line in open(positional[0]):
        for tag in ("BENCH_JSON ", "SERVING_JSON "):
            if not line.startswith(tag):
                continue
            j = json.loads(line[len(tag):])
            d = log_dtype(j)
            if d is None:
                print(f"skipped a {tag.strip()} line of dtype {j.get('dtype')!r}")
            elif tag == "BENCH_JSON ":
                ours[(tuple(j["shape"]), d)] = j
            elif d == "fp32":
                serving.append(j)


def min_bytes(shape, dtype):
    """Read x, dt, B, C and the initial states once, write out and the final states once: x, B, C
    and out in the dtype, dt and the states in fp32."""
    bs, L, H, P, N, G, _ = shape
    e = 2 if dtype == "bf16" else 4
    return e * (2 * bs * L * H * P + 2 * bs * L * G * N) + 4 * (bs * L * H + 2 * bs * H * P * N)


def matrix_flops(bs, L, H, P, N, Q):
    """Causal C B^T and scores x (lower triangles), x^T B per chunk, C S per token."""
    nc = -(-L // Q)
    return bs * H * nc * (Q * Q * (N + P)) + bs * H * L * 4 * P * N


def fmt(v, spec=".3f", none="-"):
    return none if v is None else format(v, spec)


def table_row(shape, dtype, anchors, ceilings):
    """Every number of one row (the TABLE_JSON object). anchors: {name: one entry per round, its
    median ms or a string saying why there is none}; ceilings: (copy bytes/s, matrix flop/s of the
    dtype) or None."""
    bs, L, H, P, N, G, Q = shape
    o = ours.get((shape, dtype))
    r = {"shape": list(shape), "dtype": dtype, "ours_ms": o["ours_ms"] if o else None}
    for k in ("kept_ms", "cumsum_ms", "state_ms", "out_ms"):
        if o and k in o:
            r[k] = o[k]
    ms = {}  # name -> (fastest process, slowest process)
    for name in RUNNABLE:
        per_round = anchors.get(name, [])
        times = [v for v in per_round if not isinstance(v, str)]
        key = name.lower()
        r[key + "_rounds_ms"] = [None if isinstance(v, str) else v for v in per_round]
        if times:
            ms[name] = (min(times), max(times))
        else:
            r[key + "_missing"] = next((v for v in per_round if isinstance(v, str)), "unavailable")
        r[key + "_ms"], r[key + "_slowest_ms"] = ms.get(name, (None, None))
    r["fused5_derived_ms"] = None
    fastest = min(ms, key=lambda n: ms[n][0]) if ms else None
    if dtype == "bf16" and shape in FUSED5_BF16_RECORDED and "mamba_ssm" in ms:
        f5, m = FUSED5_BF16_RECORDED[shape]
        derived = tuple(f5 / m * t for t in ms["mamba_ssm"])
        r["fused5_derived_ms"], r["fused5_derived_slowest_ms"] = derived
        r["fused5_ratio"] = f5 / m
        if all(derived[0] < t[0] for t in ms.values()):  # it beats every runnable anchor of this run
            ms[FUSED5], fastest = derived, FUSED5
    r["fastest_anchor"] = fastest
    r["fastest_anchor_ms"], r["fastest_anchor_slowest_ms"] = ms[fastest] if fastest else (None, None)
    t = r["ours_ms"]
    r["speedup"] = r["fastest_anchor_ms"] / t if t and fastest else None
    r["speedup_vs_slowest"] = r["fastest_anchor_slowest_ms"] / t if t and fastest else None
    r["min_bytes"] = min_bytes(shape, dtype)
    r["matrix_flops"] = matrix_flops(bs, L, H, P, N, Q)
    r["gbs"] = r["min_bytes"] / (t * 1e-3) / 1e9 if t else None
    r["floor_ms"] = r["pct_of_floor"] = None
    if ceilings:
        r["copy_bytes_per_s"], r["matrix_flops_per_s"] = ceilings
        r["floor_ms"] = max(r["min_bytes"] / ceilings[0], r["matrix_flops"] / ceilings[1]) * 1e3
        r["pct_of_floor"] = 100 * r["floor_ms"] / t if t else None
    r["rounds"] = rounds
    return r


def print_table(dtype, rows, note=""):
    """One dtype's table, its summary line and its TABLE_JSON lines."""
    anchors = list(RUNNABLE) + ([FUSED5] if dtype == "bf16" else [])
    print()
    print(f"Triton anchors, {DTYPE_TITLE[dtype]}: {note}")
    cols = ["shape (b, L, H, P, N, G, Q)", "ours ms (in brackets: chunk_states kept)"] + [a + " ms" for a in anchors] + [
        "fastest anchor", "speedup vs fastest", "GB/s (minimal bytes)", "% of floor", "cumsum / state / out"]
    print("| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for r in rows:
        cells = [str(tuple(r["shape"])), fmt(r["ours_ms"], none="n/a") + (f" ({r['kept_ms']:.3f})" if r.get("kept_ms") else "")]
        for a in anchors:
            key = "fused5_derived" if a == FUSED5 else a.lower()
            if r.get(key + "_ms") is not None:
                cells.append(f"{r[key + '_ms']:.3f} ({r[key + '_slowest_ms']:.3f})")
            else:
                cells.append("-" if a == FUSED5 else ("n/a" if r.get(key + "_missing") == "unavailable" else "failed"))
        cells.append(r["fastest_anchor"] or "-")
        cells.append(f"{r['speedup']:.2f}x ({r['speedup_vs_slowest']:.2f}x)" if r["speedup"] else "-")
        cells.append(fmt(r["gbs"], ".0f"))
        cells.append(fmt(r["pct_of_floor"], ".0f") + ("%" if r["pct_of_floor"] is not None else ""))
        parts = [r.get(k) for k in ("cumsum_ms", "state_ms", "out_ms")]
        if None in parts or not sum(parts):
            cells.append("-")
        else:
            cells.append("/".join(f"{100 * p / sum(parts):.0f}%" for p in parts))
        print("| " + " | ".join(cells) + " |")
    timed = [r for r in rows if r["speedup"] is not None]
    if timed:
        w = min(timed, key=lambda r: r["speedup"])
        worst = f"{w['speedup']:.2f}x (vs {w['fastest_anchor']} at {tuple(w['shape'])}, {len(timed)} of {len(rows)} shapes)"
    else:
        worst = "n/a"
    at = [r for r in rows if tuple(r["shape"]) == FLOOR_SHAPE]
    pct = fmt(at[0]["pct_of_floor"] if at else None, ".0f", "n/a") + ("%" if at and at[0]["pct_of_floor"] is not None else "")
    print(f"Triton anchors, {DTYPE_TITLE[dtype]}: worst speedup vs the fastest anchor {worst}; "
          f"% of floor at {FLOOR_SHAPE}: {pct}")
    for r in rows:
        print("TABLE_JSON " + json.dumps(r))


try:
    import torch
    import triton.testing
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
except Exception as e:  # noqa: BLE001
    print(f"Triton anchors unavailable ({e}); our timings only")
    for d in DTYPES:
        if not any(k[1] == d for k in ours):
            print()
            print(f"our timings only, {DTYPE_TITLE[d]}: none in the log")
            continue
        print_table(d, [table_row(s, d, {}, None) for s in SHAPES], "our timings only")
    sys.exit(0)

try:
    from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen
except Exception as e:  # noqa: BLE001
    mamba_chunk_scan_combined_varlen = None
    if not triton_round:
        print(f"vLLM unavailable ({type(e).__name__}: {e}); its columns read n/a")

dev = "cuda"
torch.backends.cuda.matmul.allow_tf32 = True


def inputs(bs, L, H, P, N, G, dtype="fp32"):
    """The same random values for both dtypes: bf16 rounds x, dt, B and C; A, D and the initial
    states stay fp32."""
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.rand(bs, L, H, P, device=dev, generator=gen) * 2 - 1
    dt = torch.rand(bs, L, H, device=dev, generator=gen) * 0.099 + 0.001
    A = -(torch.rand(H, device=dev, generator=gen) * 7.5 + 0.5)
    B = torch.rand(bs, L, G, N, device=dev, generator=gen) * 2 - 1
    C = torch.rand(bs, L, G, N, device=dev, generator=gen) * 2 - 1
    D = torch.rand(H, device=dev, generator=gen) * 2 - 1
    init = torch.rand(bs, H, P, N, device=dev, generator=gen) * 2 - 1
    if dtype == "bf16":
        x, dt, B, C = (t.to(torch.bfloat16) for t in (x, dt, B, C))
    return x, dt, A, B, C, D, init


def varlen_metadata(lens, Q):
    """vLLM's chunk metadata for sequences of lengths `lens` packed into one row, chunks of at most
    Q tokens that never hold two sequences: cu_seqlens [nseq + 1], cu_chunk_seqlens [nchunks + 1],
    last_chunk_indices [nseq], seq_idx [nchunks] (the sequence of each chunk), int32 on the GPU."""
    cu_chunks, chunk_seq, last = [0], [], []
    for i, ln in enumerate(lens):
        k = 0
        while k < ln:
            step = min(Q, ln - k)
            cu_chunks.append(cu_chunks[-1] + step)
            chunk_seq.append(i)
            k += step
        last.append(len(chunk_seq) - 1)
    t32 = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    return t32([0] + list(itertools.accumulate(lens))), t32(cu_chunks), t32(last), t32(chunk_seq)


def vllm_runner(x, dt, A, B, C, D, init, Q, lens):
    """A closure running vLLM's varlen forward on one packed row (x [tokens, H, P], dt [tokens, H],
    B, C [tokens, G, N]) of sequences of lengths `lens`, one initial state each (init [nseq, H, P,
    N]); out and the final states (fp32) go to buffers allocated here, with the metadata, outside
    the timed closure."""
    cu, cu_c, last_c, seq_c = varlen_metadata(lens, Q)
    out = torch.empty_like(x)
    buf = torch.empty(init.shape, dtype=torch.float32, device=dev)
    idx = torch.arange(len(lens), device=dev, dtype=torch.int32)

    def run():
        mamba_chunk_scan_combined_varlen(
            x, dt, A, B, C, Q, cu, cu_c, last_c, seq_c, out, D=D, initial_states=init,
            state_dtype=torch.float32, final_states_out=buf, final_state_indices=idx)
    return run


def bench(run):
    with torch.no_grad():
        return triton.testing.do_bench(run, warmup=50, rep=200, return_mode="median")


def time_anchors(shape, dtype):
    """{anchor: ms, or a string saying why not} for one shape and dtype, in this process."""
    bs, L, H, P, N, G, Q = shape
    x, dt, A, B, C, D, init = inputs(bs, L, H, P, N, G, dtype)
    runs = {"mamba_ssm": lambda: mamba_chunk_scan_combined(x, dt, A, B, C, Q, D=D, initial_states=init,
                                                           return_final_states=True)}
    if mamba_chunk_scan_combined_varlen is not None:
        # The batch as one packed row of bs sequences of L tokens (views, no copies).
        runs["vLLM"] = vllm_runner(x.reshape(bs * L, H, P), dt.reshape(bs * L, H), A, B.reshape(bs * L, G, N),
                                   C.reshape(bs * L, G, N), D, init, Q, [L] * bs)
    res = {name: "unavailable" for name in RUNNABLE}
    for name, run in runs.items():
        try:
            res[name] = bench(run)
        except Exception as e:  # noqa: BLE001
            res[name] = f"failed: {type(e).__name__}: {str(e)[:300]}"
    del runs, x, dt, B, C, init
    torch.cuda.empty_cache()
    return res


def time_round():
    """{(shape, dtype): {anchor: ms or why not}}, every shape and dtype, in this process."""
    return {(s, d): time_anchors(s, d) for s in SHAPES for d in DTYPES}


if triton_round:  # one process's timings, read by the parent
    for (s, d), res in time_round().items():
        print("TRITON_JSON " + json.dumps({"shape": list(s), "dtype": d, "ms": res}), flush=True)
    sys.exit(0)


def matmul_rate(dtype):
    """flop/s of an 8192^3 torch.matmul: fp32 operands in TF32, or bf16 operands."""
    n = 8192
    kind = torch.bfloat16 if dtype == "bf16" else torch.float32
    a = torch.randn(n, n, device=dev).to(kind)
    b = torch.randn(n, n, device=dev).to(kind)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    del a, b
    torch.cuda.empty_cache()
    return 2 * n ** 3 / (ms * 1e-3)


# Ceilings: a large device-to-device copy (bytes read + written) and the matmul rate per dtype.
src = torch.randn(1 << 30, device=dev)  # 4 GiB
dst = torch.empty_like(src)
copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
copy_bw = 2 * src.numel() * 4 / (copy_ms * 1e-3)
del src, dst
torch.cuda.empty_cache()
rate = {d: matmul_rate(d) for d in ("fp32", "bf16")}
print(f"ceilings: copy {copy_bw / 1e12:.2f} TB/s (read + write), TF32 matmul {rate['fp32'] / 1e12:.0f} TFLOP/s, "
      f"bf16 matmul {rate['bf16'] / 1e12:.0f} TFLOP/s")

tri = {(s, d): {} for s in SHAPES for d in DTYPES}  # -> {anchor: [ms, or why not, per round]}


def collect(key, res):
    for name, v in res.items():
        tri[key].setdefault(name, []).append(v)
        if isinstance(v, str) and v != "unavailable":
            print(f"{name} at {key[0]}, {key[1]}: {v}", flush=True)


def last_ms(s, d, a):
    v = tri[(s, d)].get(a, ["unavailable"])[-1]
    return ("n/a" if v == "unavailable" else "failed") if isinstance(v, str) else f"{v:.3f}"


for r in range(rounds):
    if rounds == 1:
        for key, res in time_round().items():
            collect(key, res)
        continue
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--triton-round", "--dtypes", ",".join(DTYPES)], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"Triton round {r + 1} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    for line in p.stdout.splitlines():
        if line.startswith("TRITON_JSON "):
            j = json.loads(line[len("TRITON_JSON "):])
            collect((tuple(j["shape"]), j["dtype"]), j["ms"])
    print(f"Triton round {r + 1}/{rounds}: " + "; ".join(
        f"{d} {a} " + ", ".join(last_ms(s, d, a) for s in SHAPES) for d in DTYPES for a in RUNNABLE) + " ms", flush=True)

for d in DTYPES:
    rows = [table_row(s, d, tri[(s, d)], (copy_bw, rate[d])) for s in SHAPES]
    note = f"each anchor the fastest of {rounds} processes' medians (the slowest in brackets)"
    if d == "bf16":
        note += (f"; {FUSED5}: vLLM's ssd_fused5, recorded ratio to mamba_ssm bf16 x this run's mamba_ssm, "
                 "counted only where it beats every runnable anchor")
    if not any(k[1] == d for k in ours):
        note += f"; no {d} lines in our log (ours n/a)"
    print_table(d, rows, note)


def time_serving(j):
    """(anchor name, ms) for the serving line j: mamba_ssm without per-request states, vLLM's
    varlen kernel with them."""
    lens = j["lens"]
    _, L, H, P, N, G, Q = j["shape"]
    x, dt, A, B, C, D, _ = inputs(1, L, H, P, N, G)
    if not j["per_request_states"]:
        cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=dev)
        seq_idx = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32, device=dev),
                                          torch.tensor(lens, device=dev))[None]

        def run():
            return mamba_chunk_scan_combined(x, dt, A, B, C, Q, D=D, seq_idx=seq_idx, cu_seqlens=cu,
                                             return_final_states=True, return_varlen_states=True)
        name = "mamba_ssm"
    else:
        if mamba_chunk_scan_combined_varlen is None:
            return "vLLM unavailable", None
        gen = torch.Generator(device=dev).manual_seed(1)
        s0 = torch.rand(len(lens), H, P, N, device=dev, generator=gen) * 2 - 1
        run = vllm_runner(x[0], dt[0], A, B[0], C[0], D, s0, Q, lens)
        name = "vLLM varlen"
    ms = bench(run)
    del run, x, dt, B, C
    torch.cuda.empty_cache()
    return name, ms


if serving and no_serving:
    print()
    print("Serving shape: anchors not timed (--no-serving); ours: " + "; ".join(
        f"{j['ours_ms']:.3f} ms ({j['stages_ms']:.3f} the three stages alone), per-request states {'yes' if j['per_request_states'] else 'no'}"
        for j in serving))
elif serving:
    print()
    print("Serving shape: 64 requests packed into one row, fp32 (one process's median each)")
    print("| requests, tokens (H, P, N, Q) | initial state per request | ours ms (three stages alone) | anchor | anchor ms | speedup | GB/s (minimal bytes) | % of floor |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for j in serving:
        _, L, H, P, N, G, Q = j["shape"]
        floor_ms = max(j["min_bytes"] / copy_bw, matrix_flops(1, L, H, P, N, Q) / rate["fp32"]) * 1e3
        t = j["ours_ms"]
        name, ms = time_serving(j)
        gbs = j["min_bytes"] / (t * 1e-3) / 1e9
        anchor = f"{ms:.3f} | {ms / t:.2f}x" if ms is not None else "- | -"
        print(f"| {len(j['lens'])}, {L} ({H}, {P}, {N}, {Q}) | {'yes' if j['per_request_states'] else 'no'} | {t:.3f} ({j['stages_ms']:.3f}) "
              f"| {name} | {anchor} | {gbs:.0f} | {100 * floor_ms / t:.0f}% |")
