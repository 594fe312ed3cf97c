#!/usr/bin/env bash
# Which kernels two builds compile differently, without a GPU: each build's PTX (the kernels as
# the crate compiles them, through scripts/kernel-resources.sh, with SSD_NVRTC_OPTIONS set to
# the build's options) compared kernel by kernel, with ptxas's registers and spills beside.
#   bash scripts/ptx-diff.sh "OPTIONS_A" "OPTIONS_B" [TARGET] [N]
#   e.g.  bash scripts/ptx-diff.sh "" "-DWALK_NST=2" sm_90a 3
# A_ROOT / B_ROOT: another checkout for that side (e.g. a `git worktree add` of an earlier
# commit), to compare two trees' code; default this one.
# NVRTC 12.9 does not always give one source the same text (docs/gpu.md, "NVRTC's PTX"), so
# each build is compiled N times (default 3) and a kernel counts as the same where some
# compilation of A equals some compilation of B. Compared: each .entry's body with its virtual
# registers and labels renumbered in order of first use, the register declarations' counts,
# the used_bytes_mask pragmas and the dynamic shared memory symbol's numeric suffix left out (the
# names and counts move with unrelated code).
# Exit status 0 whether or not kernels differ (the report says which); 1 on a failed build.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[ $# -ge 2 ] || { echo "usage: $0 OPTIONS_A OPTIONS_B [TARGET] [N]" >&2; exit 2; }
opts_a=$1 opts_b=$2 target=${3:-sm_90a} n=${4:-3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for side in a b; do
  opts=$opts_a tree=${A_ROOT:-$root}
  [ "$side" = b ] && opts=$opts_b tree=${B_ROOT:-$root}
  for i in $(seq "$n"); do
    echo "build $side ($i of $n): $tree, SSD_NVRTC_OPTIONS='$opts'" >&2
    SSD_NVRTC_OPTIONS="$opts" SSD_PTX_OUT="$work/$side$i.ptx" \
      bash "$tree/scripts/kernel-resources.sh" "$target" >"$work/$side$i.res" 2>"$work/$side$i.err" ||
      { cat "$work/$side$i.err" >&2; exit 1; }
    [ -s "$work/$side$i.ptx" ] ||
      { echo "$tree: its kernel_resources example wrote no PTX (it predates SSD_PTX_OUT)" >&2; exit 1; }
  done
done
python3 - "$work" "$n" <<'EOF'
import re, sys
work, n = sys.argv[1], int(sys.argv[2])
ENTRY = re.compile(r'^\.(?:visible |weak )*\.entry (\w+)\(', re.M)
REG = re.compile(r'%(r|rd|rs|f|fd|p|h|hh|b)(\d+)\b')
LABEL = re.compile(r'\$L__\w+')
# The dynamic shared memory's symbol (`smem_raw$11`): NVRTC numbers each function's extern
# declaration in order, so the suffix moves when kernels are added before it.
SHARED = re.compile(r'\b([A-Za-z_]\w*)\$\d+\b')

def kernels(path):
    text = open(path).read()
    out = {}
    starts = [(m.start(), m.group(1)) for m in ENTRY.finditer(text)]
    for k, (pos, name) in enumerate(starts):
        end = starts[k + 1][0] if k + 1 < len(starts) else len(text)
        body = text[pos:end]
        body = body[: body.find('\n}\n') + 3] if '\n}\n' in body else body
        regs, labels, lines = {}, {}, []
        for line in body.splitlines():
            if 'used_bytes_mask' in line:
                continue
            line = re.sub(r'<\d+>', '<N>', line) if line.lstrip().startswith('.reg') else line
            line = REG.sub(lambda m: '%' + m.group(1) + str(regs.setdefault(m.group(0), len(regs))), line)
            line = LABEL.sub(lambda m: 'L' + str(labels.setdefault(m.group(0), len(labels))), line)
            line = SHARED.sub(r'\1$N', line)
            lines.append(line)
        out[name] = '\n'.join(lines)
    return out

def resources(path):
    res = {}
    for line in open(path):
        parts = line.split()
        if len(parts) > 2 and parts[1].isdigit() and parts[2] == 'regs':
            res[parts[0]] = ' '.join(parts[1:])
    return res

sides = {s: [kernels(f'{work}/{s}{i}.ptx') for i in range(1, n + 1)] for s in 'ab'}
res = {s: resources(f'{work}/{s}1.res') for s in 'ab'}
names = sorted(set().union(*[set(k) for s in 'ab' for k in sides[s]]))
same, differ = [], []
for name in names:
    ta = {k.get(name) for k in sides['a']}
    tb = {k.get(name) for k in sides['b']}
    (same if ta & tb and None not in ta | tb else differ).append(name)
print(f'{len(names)} kernels: {len(same)} the same, {len(differ)} differ')
for name in differ:
    print(f'  differs: {name}')
    print(f'    a: {res["a"].get(name, "absent")}')
    print(f'    b: {res["b"].get(name, "absent")}')
EOF
