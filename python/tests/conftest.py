"""Shared helpers: the committed fixtures, the ssd-oracle binary, a safetensors reader."""

import json
import os
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
# The packed (serving) cases have their own tests on the Rust side.
FIXTURES = sorted(p for p in (REPO / "fixtures").glob("*/*.json") if p.parent.name != "serving")


def oracle_bin():
    """The ssd-oracle binary: $SSD_ORACLE_BIN (then it must exist), or the workspace's
    release build; tests that need it skip, saying so, when neither is there."""
    env = os.environ.get("SSD_ORACLE_BIN")
    if env:
        if not Path(env).is_file():
            pytest.fail(f"SSD_ORACLE_BIN={env} does not exist")
        return env
    default = REPO / "target" / "release" / "ssd-oracle"
    if not default.is_file():
        pytest.skip("skipped: no ssd-oracle binary (build it with cargo build --release, "
                    "or set SSD_ORACLE_BIN)")
    return str(default)


def run_oracle(*args):
    return subprocess.run([oracle_bin(), *map(str, args)], capture_output=True, text=True)


_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64,
           "I32": np.int32}


def read_safetensors(path):
    """A safetensors file's tensors as numpy arrays (BF16 widened to float32)."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        if info["dtype"] == "BF16":
            u16 = np.frombuffer(data[a:b], dtype="<u2").astype(np.uint32) << 16
            arr = u16.view(np.float32)
        else:
            arr = np.frombuffer(data[a:b], dtype=np.dtype(_DTYPES[info["dtype"]]).newbyteorder("<"))
        out[name] = arr.reshape(info["shape"])
    return out


def write_safetensors(path, tensors):
    """Writes float64/float32 numpy arrays as a safetensors file."""
    names = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32"}
    header, blobs, offset = {}, [], 0
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        blob = arr.astype(arr.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": names[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def random_inputs(seed=0, batch=2, seqlen=40, nheads=4, headdim=8, ngroups=2, dstate=6,
                  dtype=np.float32):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(dtype)
    return dict(
        x=f(batch, seqlen, nheads, headdim), dt=f(batch, seqlen, nheads),
        A=-np.exp(f(nheads)), B=f(batch, seqlen, ngroups, dstate),
        C=f(batch, seqlen, ngroups, dstate), chunk_size=16,
        D=f(nheads), z=f(batch, seqlen, nheads, headdim), dt_bias=f(nheads),
        initial_states=f(batch, nheads, headdim, dstate), dt_softplus=True,
    )
