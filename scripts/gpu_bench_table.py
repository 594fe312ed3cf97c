#!/usr/bin/env python3
"""Times mamba_ssm's Triton forward (mamba_chunk_scan_combined, fp32 inputs, TF32 dots) on the
speed issue's shapes, measures the two ceilings of this GPU (device-to-device copy bandwidth,
TF32 matrix rate), and prints one table next to our forward's timings.

Usage: gpu_bench_table.py OUR_BENCH_LOG [--rounds N]   (the log of `cargo bench -p ssd-gpu
--bench forward`, which holds one `BENCH_JSON {...}` line per shape). Needs torch and triton, and
mamba_ssm's Triton kernels on PYTHONPATH (the repository's `.anchors/` laid out by
fetch-mamba-ssm, or `pip install mamba-ssm`). Without them it prints our timings alone.

The serving shape (SERVING_JSON lines: 64 requests packed into one row) is timed against
mamba_ssm's forward with cu_seqlens, seq_idx and return_varlen_states (no per-request initial
states: mamba_ssm has none) and, with one initial state per request, against vLLM's
mamba_chunk_scan_combined_varlen (when importable), in this process.

Triton is timed in N separate processes (default 3), one after the other: mamba_ssm's kernels
pick their launch configurations by autotuning once per process (one process of three took
0.893 ms where the other two took 0.690 ms at (4, 16384, 8)). The table takes the fastest
process's median (the harder anchor) and prints the slowest beside it. Between runs on freshly
started machines the spread is larger still (0.404 to 0.923 ms at (8, 2048, 24) on the H200s
seen so far): compare only inside one run.
"""
import json
import os
import subprocess
import sys

args = sys.argv[1:]
triton_round = "--triton-round" in args
rounds = 3
if "--rounds" in args:
    rounds = int(args[args.index("--rounds") + 1])
    if rounds < 1:
        sys.exit("--rounds must be at least 1")
positional = [a for i, a in enumerate(args) if not a.startswith("--") and (i == 0 or args[i - 1] != "--rounds")]

ours = {}
serving = []  # the serving shape's lines (SERVING_JSON), without and with per-request states
if positional:
    for line in open(positional[0]):
        if line.startswith("BENCH_JSON "):
            j = json.loads(line[len("BENCH_JSON "):])
            ours[tuple(j["shape"])] = j
        if line.startswith("SERVING_JSON "):
            serving.append(json.loads(line[len("SERVING_JSON "):]))

SHAPES = [(4, 4096, 80, 64, 128, 1, 256), (8, 8192, 80, 64, 128, 1, 256), (8, 2048, 24, 64, 128, 1, 256),
          (4, 16384, 8, 64, 128, 1, 128), (4, 65536, 8, 64, 256, 1, 128)]

try:
    import torch
    import triton.testing
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
except Exception as e:  # noqa: BLE001
    print(f"Triton anchor unavailable ({e}); our timings only")
    for s, j in ours.items():
        print(s, j["ours_ms"], "ms")
    sys.exit(0)

dev = "cuda"
torch.backends.cuda.matmul.allow_tf32 = True


def inputs(bs, L, H, P, N, G):
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.rand(bs, L, H, P, device=dev, generator=gen) * 2 - 1
    dt = torch.rand(bs, L, H, device=dev, generator=gen) * 0.099 + 0.001
    A = -(torch.rand(H, device=dev, generator=gen) * 7.5 + 0.5)
    B = torch.rand(bs, L, G, N, device=dev, generator=gen) * 2 - 1
    C = torch.rand(bs, L, G, N, device=dev, generator=gen) * 2 - 1
    D = torch.rand(H, device=dev, generator=gen) * 2 - 1
    init = torch.rand(bs, H, P, N, device=dev, generator=gen) * 2 - 1
    return x, dt, A, B, C, D, init


def time_triton(shape):
    bs, L, H, P, N, G, Q = shape
    x, dt, A, B, C, D, init = inputs(bs, L, H, P, N, G)

    def run():
        return mamba_chunk_scan_combined(x, dt, A, B, C, Q, D=D, initial_states=init, return_final_states=True)

    with torch.no_grad():
        ms = triton.testing.do_bench(run, warmup=50, rep=200, return_mode="median")
    del x, dt, B, C, init
    torch.cuda.empty_cache()
    return ms


if triton_round:  # one process's timings, read by the parent
    for shape in SHAPES:
        print("TRITON_JSON " + json.dumps({"shape": list(shape), "ms": time_triton(shape)}), flush=True)
    sys.exit(0)

# Ceilings: a large device-to-device copy (bytes read + written) and an fp32 matmul in TF32.
src = torch.randn(1 << 30, device=dev)  # 4 GiB
dst = torch.empty_like(src)
copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
copy_bw = 2 * src.numel() * 4 / (copy_ms * 1e-3)
del src, dst
n = 8192
a = torch.randn(n, n, device=dev)
b = torch.randn(n, n, device=dev)
mm_ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
tf32_rate = 2 * n ** 3 / (mm_ms * 1e-3)
del a, b
print(f"ceilings: copy {copy_bw / 1e12:.2f} TB/s (read + write), TF32 matmul {tf32_rate / 1e12:.0f} TFLOP/s")

tri = {shape: [] for shape in SHAPES}
for r in range(rounds):
    if rounds == 1:
        for shape in SHAPES:
            tri[shape].append(time_triton(shape))
        continue
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--triton-round"], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"Triton round {r + 1} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    for line in p.stdout.splitlines():
        if line.startswith("TRITON_JSON "):
            j = json.loads(line[len("TRITON_JSON "):])
            tri[tuple(j["shape"])].append(j["ms"])
    print(f"Triton round {r + 1}/{rounds}: " + ", ".join(f"{tri[s][-1]:.3f}" for s in SHAPES) + " ms", flush=True)

rows = []
for (bs, L, H, P, N, G, Q) in SHAPES:
    nc = -(-L // Q)
    min_bytes = 4 * (2 * bs * L * H * P + bs * L * H + 2 * bs * L * G * N + 2 * bs * H * P * N)
    # matrix flops: causal C B^T and scores x (lower triangles), x^T B per chunk, C S per token
    flops = bs * H * nc * (Q * Q * (N + P)) + bs * H * L * 4 * P * N
    floor_ms = max(min_bytes / copy_bw, flops / tf32_rate) * 1e3
    o = ours.get((bs, L, H, P, N, G, Q))
    rows.append(((bs, L, H, P, N, G, Q), tri[(bs, L, H, P, N, G, Q)], o, floor_ms))

print()
print(f"Triton: the fastest of {rounds} processes' medians (the slowest in brackets)")
print("| shape (b, L, H, P, N, G, Q) | dtype | ours ms | Triton ms | speedup | GB/s (minimal bytes) | % of floor | cumsum / state / out |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for shape, tris, o, floor in rows:
    best, worst = min(tris), max(tris)
    if o is None:
        print(f"| {shape} | fp32 | - | {best:.3f} ({worst:.3f}) | - | - | - | - |")
        continue
    t = o["ours_ms"]
    parts = o["cumsum_ms"] + o["state_ms"] + o["out_ms"]
    share = "/".join(f"{100 * o[k] / parts:.0f}%" for k in ("cumsum_ms", "state_ms", "out_ms"))
    gbs = o["min_bytes"] / (t * 1e-3) / 1e9
    print(f"| {shape} | fp32 | {t:.3f} | {best:.3f} ({worst:.3f}) | {best / t:.2f}x ({worst / t:.2f}x) | {gbs:.0f} "
          f"| {100 * floor / t:.0f}% | {share} |")


def time_serving(j):
    """(anchor name, ms) for the serving line j: mamba_ssm without per-request states, vLLM's
    varlen kernel with them."""
    lens = j["lens"]
    _, L, H, P, N, G, Q = j["shape"]
    x, dt, A, B, C, D, _ = inputs(1, L, H, P, N, G)
    cu = torch.tensor([0] + list(__import__("itertools").accumulate(lens)), dtype=torch.int32, device=dev)
    seq_idx = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32, device=dev),
                                      torch.tensor(lens, device=dev))[None]
    if not j["per_request_states"]:
        def run():
            return mamba_chunk_scan_combined(x, dt, A, B, C, Q, D=D, seq_idx=seq_idx, cu_seqlens=cu,
                                             return_final_states=True, return_varlen_states=True)
        name = "mamba_ssm"
    else:
        try:
            from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen
        except Exception as e:  # noqa: BLE001
            return f"vLLM unavailable ({type(e).__name__})", None
        cu_chunks, chunk_seq, last = [0], [], []
        for i, ln in enumerate(lens):
            k = 0
            while k < ln:
                step = min(Q, ln - k)
                cu_chunks.append(cu_chunks[-1] + step)
                chunk_seq.append(i)
                k += step
            last.append(len(chunk_seq) - 1)
        gen = torch.Generator(device=dev).manual_seed(1)
        s0 = torch.rand(len(lens), H, P, N, device=dev, generator=gen) * 2 - 1
        out = torch.empty(L, H, P, device=dev)
        buf = torch.empty(len(lens), H, P, N, device=dev)
        t32 = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
        cu_c, last_c, seq_c = t32(cu_chunks), t32(last), t32(chunk_seq)
        idx = torch.arange(len(lens), device=dev, dtype=torch.int32)

        def run():
            mamba_chunk_scan_combined_varlen(
                x[0], dt[0], A, B[0], C[0], Q, cu, cu_c, last_c, seq_c, out, D=D, initial_states=s0,
                state_dtype=torch.float32, final_states_out=buf, final_state_indices=idx)
        name = "vLLM varlen"
    with torch.no_grad():
        ms = triton.testing.do_bench(run, warmup=50, rep=200, return_mode="median")
    torch.cuda.empty_cache()
    return name, ms


if serving:
    print()
    print("Serving shape: 64 requests packed into one row (one process's median each)")
    print("| requests, tokens (H, P, N, Q) | initial state per request | ours ms (three stages alone) | anchor | anchor ms | speedup | GB/s (minimal bytes) | % of floor |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for j in serving:
        _, L, H, P, N, G, Q = j["shape"]
        nc = -(-L // Q)
        flops = H * nc * (Q * Q * (N + P)) + H * L * 4 * P * N
        floor_ms = max(j["min_bytes"] / copy_bw, flops / tf32_rate) * 1e3
        t = j["ours_ms"]
        name, ms = time_serving(j)
        gbs = j["min_bytes"] / (t * 1e-3) / 1e9
        anchor = f"{ms:.3f} | {ms / t:.2f}x" if ms is not None else "- | -"
        print(f"| {len(j['lens'])}, {L} ({H}, {P}, {N}, {Q}) | {'yes' if j['per_request_states'] else 'no'} | {t:.3f} ({j['stages_ms']:.3f}) "
              f"| {name} | {anchor} | {gbs:.0f} | {100 * floor_ms / t:.0f}% |")
