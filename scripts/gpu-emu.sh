#!/usr/bin/env bash
# Runs the CUDA kernels of gpu/kernels/ on the CPU (no GPU needed): gpu/emu/ emulates a block as
# host threads (barriers, warp-level mma, deferred cp.async copies, shared memory poisoned with
# NaN) and compares version 2 (the default) with version 1 (Variant::V1) on small
# problems over every option: dA_cumsum/dt' the same bits; chunk/final states and `out` within
# 5e-3 of their largest magnitude, the kernels over pairs of units (2a, output) too where they apply (version 2 feeds the tensor cores raw f32 operands and uses
# 2^x); the 16-byte and 4-byte copy paths of the output and scores kernels the same bits; no
# NaN anywhere. Cases ending in `packed` (batch 1) also split the row into random sequences and run
# the packed path (stage 2 with per-sequence initial states in both versions, ssd_seq_init_out,
# ssd_states_at), compared with a float64 recurrence sequence by sequence within 5e-3 of the
# largest magnitude (a decay of the initial state's share of `out` from the chunk start instead
# of the sequence start exceeds that by 14x to 100x on these cases).
# Where the chained stage 2 applies (pair 2a shapes, dstate <= 128) its kernels give pair 2a and
# the pass's chunk and final states bit for bit, in f32 and bf16, and in bf16 the same bf16 copy
# of the states as the pass, which must be chunk_states rounded to nearest even; in bf16 also
# without chunk_states (outputs that do not keep it): the same bf16 copy and final states, from
# the chained kernels and from the pass (2b).
# A second build (-DSSD_EMU_SM90) takes the kernels' sm_90a paths, emu.h emulating TMA copies,
# mbarriers and wgmma as the hardware lays out their operands, on the cases below its list:
# the walking stage 2's warpgroup-product form against pair 2a and the pass as above, and the
# Hopper output kernel (ssd_compute_out_wg_bf16, or _n256 at dstate 256; 3 persistent blocks)
# against the pair kernel's
# bf16 out within 1e-2 of the largest magnitude (2.5 bf16 units: the two compute the scores in
# different f32 orders, so a rounding may land one unit apart). A causal mask shifted by one
# column or the carried state's decay halved (in log2) exceed it 22x and 18x, the walker's
# dstate halves swapped its 1e-4 16,000x.
# The segmented walk (ssd_state_walk_seg_1 / _bf16_1: phase 0, the combination, phase 1; dstate up
# to 256 in two 128-column units) runs on every case without seq_idx and with 2 chunks or more, in
# segments of 1 and 2 chunks, in both builds (the sm_90a one on wgmma): its chunk and final states
# within 1e-4 of the pass's, f32 and bf16, its bf16 copy that of its own states rounded to nearest
# even, the same bits without chunk_states. The combination without the segments' decay exceeds
# that 2,700x (slow decay, dstate 256), the two column units' B tiles swapped 3,100x.
# The kernel sources are compiled as they are (gpu/emu/kernels.h), emu.h standing in for
# kernels/ptx.cuh. Needs g++ with C++20. Slow (threads): keep the problems small.
# `bash scripts/gpu-emu.sh sm90` runs only the sm_90a build's cases. SSD_EMU_OPTIONS adds
# defines to both builds, as SSD_NVRTC_OPTIONS does on the GPU (e.g. "-DWGO_PREG=40 -DWGO_CREG=232").
set -euo pipefail
only=${1:-}
case "$only" in "" | sm90) ;; *) echo "usage: $0 [sm90]" >&2; exit 2 ;; esac
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
read -r -a extra <<<"${SSD_EMU_OPTIONS:-}"
flags=(-std=c++20 -O2 -ffp-contract=off -fno-strict-aliasing -Wno-unknown-pragmas -Wno-psabi -pthread "${extra[@]}")
g++ "${flags[@]}" "$root/gpu/emu/main.cpp" -o "$work/emu" &
build1=$!
g++ "${flags[@]}" -DSSD_EMU_SM90 "$root/gpu/emu/main.cpp" -o "$work/emu90" &
build2=$!
wait "$build1"
wait "$build2"
fail=0
# Runs binary $1 on each case of standard input.
# batch seqlen nheads headdim ngroups dstate chunk opts seed [packed]
# opts bits: 1 seq_idx, 2 initial states, 4 z, 8 D per channel, 16 dt_bias + softplus, 32 slow
# decay (A 100 times smaller: states outlive their chunks)
run_cases() {
  local bin=$1 tag=$2 args out verdict bad
  while read -r args; do
    [ -z "$args" ] && continue
    out=$("$bin" $args)
    verdict=$(grep -E '^RESULT' <<<"$out")
    bad=$(grep -E 'cumsum mismatches vs old loop: [1-9]|out 16-byte vs 4-byte.*differing=[1-9]|scores 16-byte vs 4-byte.*differing=[1-9]|chained.*differing=[1-9]' <<<"$out" || true)
    echo "$tag$args: $verdict ${bad:+BITWISE MISMATCH}"
    [ "$verdict" = "RESULT ok" ] && [ -z "$bad" ] || { fail=1; echo "$out"; }
  done
}
[ "$only" = sm90 ] || run_cases "$work/emu" "" <<'CASES'
1 200 2 40 1 72 64 0 1
1 200 2 40 1 72 64 31 2
2 300 4 65 2 17 128 15 3
1 600 3 64 3 256 256 11 4
1 700 2 64 1 128 512 30 5
2 100 2 24 2 8 16 6 6
1 37 2 8 1 4 1 3 7
1 70 1 16 1 16 1024 7 8
2 260 2 64 1 64 128 2 9
1 150 4 65 2 130 64 27 10
1 90 40 8 4 8 32 17 11
1 300 2 64 1 72 128 0 12
1 520 2 64 1 128 256 31 13
2 260 2 96 1 40 128 10 14
1 200 4 20 2 36 128 27 15
1 330 2 128 2 64 256 1 16
2 200 2 64 1 256 128 3 17
1 330 2 128 2 68 256 21 18
2 600 4 64 2 128 256 3 19
2 400 2 64 1 96 128 31 20
1 150 2 40 1 24 32 30 3 packed
1 200 2 16 1 16 64 30 4 packed
1 260 2 64 1 72 128 12 7 packed
1 300 10 64 1 72 128 31 21
1 200 5 128 1 128 256 3 22
2 260 10 72 2 80 128 1 23
1 600 10 64 1 72 128 62 24
2 300 10 72 2 80 128 33 25
1 300 2 64 1 256 64 34 31
1 400 2 64 1 256 128 34 32
CASES
# sm_90a paths: the Hopper output kernel (T = 1 to 4 token tiles, the two-pass form, batch 2 and
# two groups, every option but seq_idx, which it does not serve; dstate 256 on
# ssd_compute_out_wg_bf16_n256 in the last two) and the walking stage 2's warpgroup products (1, 2
# and 5 units a block, and the segmented walk, dstate 256 in the last two).
run_cases "$work/emu90" "sm_90a: " <<'CASES'
1 300 2 64 1 128 128 62 26
1 300 2 64 1 128 256 14 27
2 200 4 64 2 128 128 16 28
1 140 10 64 1 80 128 34 30
1 400 2 64 1 256 128 2 33
2 300 4 64 2 256 128 62 34
CASES
[ $fail = 0 ] && echo "emulation: all cases pass" || { echo "emulation: FAILURES"; exit 1; }
