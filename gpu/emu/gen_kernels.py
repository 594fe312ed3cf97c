"""Writes the CUDA kernels of gpu/kernels/ as C++ for the CPU emulation (gpu/emu/): the inline-PTX
helpers of common.cuh (TF32 rounding, mma, cp.async) are dropped, emu.h provides their emulation.
Usage: python3 gen_kernels.py KERNELS_DIR OUT_CPP"""
import sys

kdir, out = sys.argv[1], sys.argv[2]
common = open(f"{kdir}/common.cuh").read()


def strip(src, name):
    i = src.index(name + "(")
    s = src.rfind("\n", 0, i) + 1
    prev = src.rfind("\n", 0, s - 1) + 1
    if src[prev:s].startswith("template"):
        s = prev
    j = src.index("{", i)
    depth = 0
    for p in range(j, len(src)):
        if src[p] == "{":
            depth += 1
        elif src[p] == "}":
            depth -= 1
            if depth == 0:
                return src[:s] + src[p + 1:]
    raise SystemExit(f"unbalanced braces after {name}")


for n in ["tf32_round", "mma_tf32", "smem_addr", "cp_async16", "cp_async16_all", "cp_async4", "cp_async_commit", "cp_async_wait", "ldmatrix_x4", "ex2_approx"]:
    common = strip(common, n)
common = common.replace("typedef long long i64;", "")
src = '#include "emu.h"\ntypedef long long i64;\n' + common
for f in ["chunk_cumsum.cu", "fwd_pass_state.cu", "compute_out.cu"]:
    src += open(f"{kdir}/{f}").read() + "\n"
src = src.replace("extern __shared__ __align__(16) float smem[];", "float* smem = g_dyn;")
if "asm" in src.replace("#pragma", ""):
    raise SystemExit("inline PTX left in the emulated source: emulate it in emu.h")
open(out, "w").write(src)
