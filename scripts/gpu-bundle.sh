#!/usr/bin/env bash
# Builds, on this machine (release), everything the GPU machine needs and lays it out in the
# git-ignored folder gpu-bundle/: the GPU tests (ssd-gpu's `runtime`, ssd-verify's gpu_*) as a
# `cargo nextest archive` with the cargo-nextest binary that runs it (the GPU machine has no
# cargo and no network: nextest runs an archive without cargo, against the empty workspace
# skeleton the bundle carries), the forward benchmark, ssd-oracle, the Python package's wheel
# and tests, the fixtures, the Triton anchor (.anchors/, when fetched with the anchors'
# fetch-mamba-ssm) and run-all.sh. The benchmark has no test harness, so nextest does not
# archive it: it is found in cargo's JSON messages. Then, on the GPU machine:
#   bash gpu-bundle/run-all.sh [--quick]
# The binaries find their data through SSD_FIXTURES_DIR (set by run-all.sh), never through
# paths of this machine.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bundle=gpu-bundle
rm -rf "$bundle"
mkdir -p "$bundle/bin"

executables() { # cargo's JSON messages on stdin -> "name path" of each bench executable
  python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    kinds = m.get("target", {}).get("kind", [])
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "bench" in kinds:
        print(m["target"]["name"], m["executable"])
'
}

# The test binaries: one archive, and the list of binary ids run-all.sh runs one by one.
tests=(--test runtime)
ids=(ssd-gpu::runtime)
for f in verify/tests/gpu_*.rs; do
  tests+=(--test "$(basename "$f" .rs)")
  ids+=("ssd-verify::$(basename "$f" .rs)")
done
cargo nextest archive --release -p ssd-gpu -p ssd-verify "${tests[@]}" \
  --archive-file "$bundle/tests.tar.zst"
printf '%s\n' "${ids[@]}" >"$bundle/tests.txt"
cp "$(command -v cargo-nextest)" "$bundle/bin/"
# nextest runs the archive against a workspace root: the manifest and package folders suffice.
mkdir -p "$bundle/workspace/gpu" "$bundle/workspace/verify"
cp Cargo.toml "$bundle/workspace/"
cargo bench -p ssd-gpu --bench forward --no-run --message-format=json | executables |
  while read -r name path; do cp "$path" "$bundle/bin/bench-$name"; done
if cargo build --release -p ssd-verify --bin ssd-oracle; then
  cp "${CARGO_TARGET_DIR:-target}/release/ssd-oracle" "$bundle/bin/"
else
  echo "warning: ssd-oracle did not build; the bundle goes without it" >&2
fi

# The Python package as a wheel (abi3: any CPython >= 3.10 there), its tests, and pytest's own
# wheels (the GPU machine has no network).
if python3 -m pip wheel -q --no-deps -w "$bundle/wheels" ./python &&
  python3 -m pip download -q --only-binary=:all: -d "$bundle/wheels" pytest; then
  mkdir -p "$bundle/python" && cp -r python/tests "$bundle/python/tests"
  rm -rf "$bundle/python/tests/__pycache__"
else
  echo "warning: the Python package did not build; the bundle goes without it" >&2
  rm -rf "$bundle/wheels"
fi
[ -d fixtures ] && cp -r fixtures "$bundle/fixtures"
[ -d .anchors ] && cp -r .anchors "$bundle/anchors"
cp scripts/gpu_bench_table.py scripts/gpu_ab.py scripts/ncu_stalls.py "$bundle/"
cp scripts/gpu-run-all.sh "$bundle/run-all.sh"
chmod +x "$bundle/run-all.sh"
du -sh "$bundle"
ls "$bundle/bin"
cat "$bundle/tests.txt"
