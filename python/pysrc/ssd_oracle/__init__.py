"""The Mamba-2 SSD oracle inside your tests.

The float64 truth of mamba_ssm 2.3.2.post1's ``mamba_chunk_scan_combined`` (every option), and
a checker whose per-element bound is the error a correct kernel can make in the arithmetic it
claims (f64, f32, TF32 tensor cores, bf16). Computed in Rust on the CPU, with the GIL released.

Two lines in a kernel's test::

    out = my_kernel(x, dt, A, B, C, chunk_size, D=D, dt_softplus=True)
    ssd_oracle.assert_close(out, x, dt, A, B, C, chunk_size, D=D, dt_softplus=True,
                            precision="tf32")

Inputs may be numpy arrays or torch tensors, on any device, of any float dtype (bf16 and fp16
included): they are copied to the host and widened to float64 exactly. Results are numpy
arrays, or float64 torch tensors on ``x``'s device when ``x`` is a torch tensor.

- :func:`mamba_chunk_scan_combined`: the drop-in reference (the naive recurrence in float64).
- :func:`chunk_cumsum`, :func:`chunk_states`, :func:`intermediates`: the chunked algorithm's
  intermediates, as mamba_ssm's stages compute them.
- :func:`assert_close`, :func:`check`: the checker (:class:`Report` is what ``check`` returns).
- :func:`load_case`, :func:`save_case`: ``ssd-fixture/1`` cases, the same files as the
  ``ssd-oracle`` command line reads and writes.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

from . import _native

__all__ = [
    "Case",
    "Report",
    "assert_close",
    "assert_gradients_close",
    "check",
    "check_gradients",
    "chunk_cumsum",
    "chunk_states",
    "gradients",
    "intermediates",
    "load_case",
    "mamba_chunk_scan_combined",
    "save_case",
]

INF = float("inf")

# The storage dtypes the checker knows, by numpy / torch dtype name.
_FLOAT_NAMES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16"}

OUTPUT_NAMES = ("out", "final_states", "dA_cumsum", "chunk_states")
GRADIENT_NAMES = ("dx", "ddt", "dA", "dB", "dC", "dD", "dz", "ddt_bias", "dinitial_states")


def _torch_tensor_type():
    torch = sys.modules.get("torch")  # never import torch ourselves: it is optional
    return getattr(torch, "Tensor", None)


def _is_torch(value) -> bool:
    t = _torch_tensor_type()
    return t is not None and isinstance(value, t)


def _as_float64(name: str, value) -> tuple[np.ndarray, str]:
    """``value`` as a C-contiguous float64 array (exact widening) and its storage dtype name."""
    if _is_torch(value):
        import torch

        dtype = str(value.dtype).removeprefix("torch.")
        if dtype not in _FLOAT_NAMES:
            raise TypeError(
                f"`{name}` must be a floating-point tensor (float64, float32, float16 or "
                f"bfloat16), got {value.dtype}"
            )
        host = value.detach().to(device="cpu", dtype=torch.float64).contiguous()
        return np.ascontiguousarray(host.numpy()), _FLOAT_NAMES[dtype]
    if isinstance(value, (str, bytes, dict)) or value is None:
        raise TypeError(f"`{name}` must be an array or a tensor, got {type(value).__name__}")
    try:
        arr = np.asarray(value)
    except Exception as e:  # an object numpy cannot make an array of
        raise TypeError(f"`{name}` must be an array or a tensor: {e}") from None
    dtype = arr.dtype.name
    if dtype not in _FLOAT_NAMES:
        raise TypeError(
            f"`{name}` must hold floats (float64, float32, float16 or bfloat16), got {arr.dtype}"
        )
    return np.ascontiguousarray(arr, dtype=np.float64), _FLOAT_NAMES[dtype]


def _as_index(name: str, value) -> np.ndarray:
    if _is_torch(value):
        if value.is_floating_point() or value.is_complex() or str(value.dtype) == "torch.bool":
            raise TypeError(f"`{name}` must be an integer tensor, got {value.dtype}")
        import torch

        return np.ascontiguousarray(value.detach().to("cpu", torch.int64).numpy())
    if isinstance(value, (str, bytes, dict)):
        raise TypeError(f"`{name}` must be an array or a tensor, got {type(value).__name__}")
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"`{name}` must hold integers (int32 or int64), got {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"`{name}` holds a value beyond int64")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _chunk_size(value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"`chunk_size` must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"`chunk_size` must be a positive power of two, got {value}")
    return int(value)


def _dt_limit(value) -> tuple[float, float]:
    try:
        lo, hi = value
        lo, hi = float(lo), float(hi)
    except (TypeError, ValueError):
        raise TypeError(f"`dt_limit` must be a pair (lo, hi), got {value!r}") from None
    return lo, hi


def _native_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                   dt_softplus, dt_limit) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    for name, value, required in (
        ("x", x, True), ("dt", dt, True), ("A", A, True), ("B", B, True), ("C", C, True),
        ("D", D, False), ("z", z, False), ("dt_bias", dt_bias, False),
        ("initial_states", initial_states, False),
    ):
        if value is None:
            if required:
                raise TypeError(f"`{name}` is required")
            continue
        kw[name] = _as_float64(name, value)[0]
    if seq_idx is not None:
        kw["seq_idx"] = _as_index("seq_idx", seq_idx)
    kw["chunk_size"] = _chunk_size(chunk_size)
    kw["dt_softplus"] = bool(dt_softplus)
    kw["dt_limit"] = _dt_limit(dt_limit)
    return kw


def _packed(cu_seqlens, return_varlen_states):
    """``cu_seqlens`` as int64 numpy when the call returns varlen states (mamba_ssm uses it only
    then), else ``None``."""
    if not return_varlen_states:
        return None
    if cu_seqlens is None:
        raise ValueError("cu_seqlens must be provided if return_varlen_states is True")
    if _is_torch(cu_seqlens):
        cu_seqlens = cu_seqlens.detach().cpu().numpy()
    return np.ascontiguousarray(np.asarray(cu_seqlens), dtype=np.int64)


def _like(result: np.ndarray, x):
    """``result`` as ``x`` came in: a float64 torch tensor on ``x``'s device, or numpy."""
    if _is_torch(x):
        import torch

        return torch.from_numpy(result).to(x.device)
    return result


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, cu_seqlens=None,
                              dt_softplus=False, dt_limit=(0.0, INF), return_final_states=False,
                              return_varlen_states=False):
    """The float64 truth of mamba_ssm's ``mamba_chunk_scan_combined``, same signature.

    Computed by the naive recurrence in float64 (the ground truth) from the inputs widened
    exactly. Returns ``out`` (``[batch, seqlen, nheads, headdim]``), or ``(out,
    final_states)`` with ``return_final_states``. As in mamba_ssm, ``cu_seqlens`` is used only
    with ``return_varlen_states``: then the batch must be 1, the state restarts at every
    sequence start (``seq_idx`` is implied when not given), ``initial_states`` seeds the first
    sequence, and the states after each sequence come last in the returned tuple (``(out,
    varlen_states)`` or ``(out, final_states, varlen_states)``).

    >>> import numpy as np, ssd_oracle
    >>> rng = np.random.default_rng(0)
    >>> x, dt = rng.standard_normal((1, 8, 2, 4)), rng.random((1, 8, 2))
    >>> A, B, C = -rng.random(2), rng.standard_normal((1, 8, 1, 3)), rng.standard_normal((1, 8, 1, 3))
    >>> out, final = ssd_oracle.mamba_chunk_scan_combined(x, dt, A, B, C, 4, return_final_states=True)
    >>> out.shape, final.shape, out.dtype
    ((1, 8, 2, 4), (1, 2, 4, 3), dtype('float64'))
    """
    cu = _packed(cu_seqlens, return_varlen_states)
    kw = _native_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                        dt_softplus, dt_limit)
    r = _native.forward(**kw, algorithm="naive", precision="f64", cu_seqlens=cu)
    out = _like(r["out"], x)
    result = [out]
    if return_final_states:
        result.append(_like(r["final_states"], x))
    if cu is not None:
        result.append(_like(r["varlen_states"], x))
    return out if len(result) == 1 else tuple(result)


def gradients(dout, x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
              initial_states=None, seq_idx=None, dt_softplus=False, dt_limit=(0.0, INF),
              dfinal_states=None):
    """The float64 gradients of ``mamba_chunk_scan_combined``, by the adjoint recurrence.

    The vector-Jacobian product of the forward (same arguments) with the upstream gradients
    ``dout`` (``[batch, seqlen, nheads, headdim]``) and ``dfinal_states`` (``[batch, nheads,
    headdim, dstate]``, optional): what ``torch.autograd`` gives for ``x.grad``, ... after
    ``out.backward(dout)`` (or ``torch.autograd.backward([out, final_states], [dout,
    dfinal_states])``). Returns a dict in mamba_ssm's names: ``dx``, ``ddt`` (with respect to
    the raw ``dt``), ``dA``, ``dB``, ``dC``, and ``dD``, ``dz``, ``ddt_bias``,
    ``dinitial_states`` when those inputs are given; numpy arrays, or float64 torch tensors on
    ``x``'s device when ``x`` is a torch tensor.

    >>> import numpy as np, ssd_oracle
    >>> rng = np.random.default_rng(0)
    >>> x, dt = rng.standard_normal((1, 8, 2, 4)), rng.random((1, 8, 2))
    >>> A, B, C = -rng.random(2), rng.standard_normal((1, 8, 1, 3)), rng.standard_normal((1, 8, 1, 3))
    >>> g = ssd_oracle.gradients(np.ones((1, 8, 2, 4)), x, dt, A, B, C, 4)
    >>> sorted(g), g["dB"].shape
    (['dA', 'dB', 'dC', 'ddt', 'dx'], (1, 8, 1, 3))
    """
    kw = _native_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                        dt_softplus, dt_limit)
    up = {"dout": _as_float64("dout", dout)[0]}
    if dfinal_states is not None:
        up["dfinal_states"] = _as_float64("dfinal_states", dfinal_states)[0]
    r = _native.backward(**up, **kw)
    return {name: _like(value, x) for name, value in r.items()}


def intermediates(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                  initial_states=None, seq_idx=None, dt_softplus=False, dt_limit=(0.0, INF),
                  precision="f64"):
    """Every stage of the chunked algorithm, as the GPU kernels compute it.

    Returns a dict: ``dt`` (processed: bias, softplus, clamp; ``[batch, nheads, nchunks,
    chunk_size]``, 0 past seqlen), ``dA_cumsum`` (same layout), ``states`` (each chunk's own
    state, before the state pass: ``[batch, nchunks, nheads, headdim, dstate]``),
    ``chunk_states`` (the state entering each chunk, same layout), ``final_states`` and ``out``.
    ``precision``: ``"f64"`` (the reference of the intermediates), ``"f32"``, ``"tf32"``
    (f32 with every matrix-product operand rounded to TF32: what a correct TF32 kernel gives),
    or ``"bf16"`` (``x``, ``B``, ``C``, ``z`` rounded to bfloat16, then every matrix-product
    operand rounded to bfloat16: what a correct bf16 tensor-core kernel gives).
    """
    kw = _native_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                        dt_softplus, dt_limit)
    r = _native.forward(**kw, algorithm="chunked", precision=str(precision))
    return {k: _like(v, x) for k, v in r.items()}


def chunk_cumsum(dt, A, chunk_size, dt_bias=None, dt_softplus=False, dt_limit=(0.0, INF)):
    """Stage 1 (mamba_ssm's ``_chunk_cumsum_fwd``): returns ``(dA_cumsum, dt_out)``, both
    ``[batch, nheads, nchunks, chunk_size]`` in float64."""
    dt64, _ = _as_float64("dt", dt)
    if dt64.ndim != 3:
        raise ValueError(f"`dt` has {dt64.ndim} dimension(s), expected [batch, seqlen, nheads]")
    b, s, h = dt64.shape
    zeros_x = np.zeros((b, s, h, 1))
    zeros_bc = np.zeros((b, s, 1, 1))
    r = _native.forward(**_native_inputs(zeros_x, dt64, A, zeros_bc, zeros_bc, chunk_size, None,
                                         None, dt_bias, None, None, dt_softplus, dt_limit),
                        algorithm="chunked", precision="f64")
    return _like(r["dA_cumsum"], dt), _like(r["dt"], dt)


def chunk_states(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                 seq_idx=None, dt_softplus=False, dt_limit=(0.0, INF)):
    """The state entering each chunk, ``[batch, nchunks, nheads, headdim, dstate]`` in float64
    (the ``states`` that mamba_ssm's ``_mamba_chunk_scan_combined_fwd`` returns)."""
    return intermediates(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                         initial_states=initial_states, seq_idx=seq_idx,
                         dt_softplus=dt_softplus, dt_limit=dt_limit)["chunk_states"]


class _Record:
    """A read-only view of a JSON object: keys as attributes, nested objects as records."""

    def __init__(self, data: dict):
        self._data = data

    def __getattr__(self, key):
        try:
            return _wrap(self._data[key])
        except KeyError:
            raise AttributeError(key) from None

    def __getitem__(self, key):
        return _wrap(self._data[key])

    def __contains__(self, key):
        return key in self._data

    def keys(self):
        return self._data.keys()

    def to_dict(self) -> dict:
        """The plain JSON object (what ``ssd-oracle check --json`` prints)."""
        return self._data

    def __repr__(self):
        return f"{type(self).__name__}({self._data!r})"


def _wrap(v):
    if isinstance(v, dict):
        return _Record(v)
    if isinstance(v, list):
        return [_wrap(i) for i in v]
    return v


class Report(_Record):
    """What :func:`check` returns: the fields of ``ssd-oracle check --json`` as attributes.

    ``passed``, ``worst_ratio`` (the worst error/bound ratio, above 1 fails), ``precision``,
    ``unit_roundoff``, ``tensors`` (one entry per checked tensor: ``name``, ``shape``,
    ``dtype``, ``elements``, ``max_abs_error``, ``rel_l2``, ``exceeding``, ``non_finite``,
    ``first_non_finite``, ``worst`` with ``index``, ``candidate``, ``expected``, ``error``,
    ``bound``, ``ratio``, ``magnitude``), ``hint``; every other field of the JSON report as
    well. ``str(report)`` is the table ``ssd-oracle check`` prints.
    """

    def __init__(self, data: dict, text: str):
        super().__init__(data)
        self.text = text

    def tensor(self, name: str):
        """The entry of one tensor, or None when it was not checked."""
        for t in self._data["tensors"]:
            if t["name"] == name:
                return _Record(t)
        return None

    def __str__(self):
        return self.text

    def __bool__(self):
        return bool(self._data["passed"])


def _candidates(actual, return_final_states, return_varlen_states=False):
    if isinstance(actual, dict):
        items = list(actual.items())
        for name, _ in items:
            if name not in OUTPUT_NAMES + ("varlen_states",):
                raise ValueError(
                    f"`{name}` is not an output of mamba_chunk_scan_combined's contract: "
                    f"expected one of {', '.join(OUTPUT_NAMES + ('varlen_states',))}"
                )
        if "out" not in actual:
            raise ValueError("the outputs must hold `out`")
        return items
    names = ["out"] + (["final_states"] if return_final_states else []) + (
        ["varlen_states"] if return_varlen_states else [])
    if isinstance(actual, (tuple, list)):
        if len(actual) == len(names):
            return list(zip(names, actual))
        if len(actual) == 2 and not return_varlen_states:
            return [("out", actual[0]), ("final_states", actual[1])]
        if len(actual) == 1:
            return [("out", actual[0])]
        raise ValueError(
            f"expected {', '.join(names)} as mamba_chunk_scan_combined returns them, "
            f"got a sequence of {len(actual)}"
        )
    if len(names) > 1:
        raise ValueError(f"expected {', '.join(names)} but `actual` is a single tensor")
    return [("out", actual)]


def check(actual, x, dt, A, B, C, chunk_size, *, precision="f32", D=None, z=None, dt_bias=None,
          initial_states=None, seq_idx=None, cu_seqlens=None, dt_softplus=False,
          dt_limit=(0.0, INF), return_final_states=False, return_varlen_states=False) -> Report:
    """Checks a kernel's outputs against the float64 truth; returns a :class:`Report`.

    ``actual`` is what ``mamba_chunk_scan_combined`` returns (``out`` or ``(out,
    final_states)``) or a dict of output names (``out``, ``final_states``, ``dA_cumsum``,
    ``chunk_states``) to tensors; every tensor is checked in the dtype it is stored in (a
    bf16 ``out`` gets the bf16 storage rounding in its bound). The other arguments are those of
    ``mamba_chunk_scan_combined``; ``precision`` is the arithmetic the kernel claims: ``"f64"``,
    ``"f32"``, ``"tf32"`` (TF32 tensor cores, Triton's default for f32 dots) or ``"bf16"``.
    """
    cu = _packed(cu_seqlens, return_varlen_states or (
        isinstance(actual, dict) and "varlen_states" in actual))
    kw = _native_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                        dt_softplus, dt_limit)
    cands = []
    for name, value in _candidates(actual, return_final_states, return_varlen_states):
        arr, dtype = _as_float64(name, value)
        cands.append((name, arr, dtype))
    data, text = _native.check(cands, **kw, precision=str(precision), cu_seqlens=cu)
    return Report(json.loads(data), text)


def assert_close(actual, x, dt, A, B, C, chunk_size, *, precision="f32", D=None, z=None,
                 dt_bias=None, initial_states=None, seq_idx=None, cu_seqlens=None,
                 dt_softplus=False, dt_limit=(0.0, INF), return_final_states=False,
                 return_varlen_states=False) -> None:
    """Raises ``AssertionError`` unless every element of ``actual`` is within its bound.

    Same arguments as :func:`check`. The message is the report of ``ssd-oracle check``: per
    failing tensor, how many elements exceed, the worst element with its full index, the
    candidate and expected values, the error and the bound, and a hint when one is clear.
    """
    report = check(actual, x, dt, A, B, C, chunk_size, precision=precision, D=D, z=z,
                   dt_bias=dt_bias, initial_states=initial_states, seq_idx=seq_idx,
                   cu_seqlens=cu_seqlens, dt_softplus=dt_softplus, dt_limit=dt_limit,
                   return_final_states=return_final_states,
                   return_varlen_states=return_varlen_states)
    if not report.passed:
        raise AssertionError(
            f"the outputs are not within the {report.precision} error bound "
            f"(worst error/bound {report.worst_ratio})\n{report.text}"
        )


def check_gradients(grads, dout, x, dt, A, B, C, chunk_size, *, precision="f32", D=None,
                    z=None, dt_bias=None, initial_states=None, seq_idx=None, dt_softplus=False,
                    dt_limit=(0.0, INF), dfinal_states=None) -> Report:
    """Checks a backward kernel's gradients against the float64 truth; returns a :class:`Report`.

    ``grads`` maps gradient names (mamba_ssm's: ``dx``, ``ddt``, ``dA``, ``dB``, ``dC``, ``dD``,
    ``dz``, ``ddt_bias``, ``dinitial_states``; any subset) to tensors, e.g. ``{"dx": x.grad,
    "ddt": dt.grad}``, each checked in the dtype it is stored in. ``dout`` and
    ``dfinal_states`` are the upstream gradients the kernel's gradients were pulled back from
    (``torch.autograd.backward([out, final_states], [dout, dfinal_states])``); the other
    arguments are those of ``mamba_chunk_scan_combined``. The truth is the adjoint recurrence
    in float64 (:func:`gradients`) and the bound that of ``docs/tolerances.md`` ("Gradients").

    >>> import numpy as np, ssd_oracle
    >>> rng = np.random.default_rng(0)
    >>> x, dt = rng.standard_normal((1, 8, 2, 4)), rng.random((1, 8, 2))
    >>> A, B, C = -rng.random(2), rng.standard_normal((1, 8, 1, 3)), rng.standard_normal((1, 8, 1, 3))
    >>> dout = rng.standard_normal((1, 8, 2, 4))
    >>> g = ssd_oracle.gradients(dout, x, dt, A, B, C, 4)
    >>> ssd_oracle.check_gradients({"dx": g["dx"].astype(np.float32)}, dout, x, dt, A, B, C, 4).passed
    True
    """
    if not isinstance(grads, dict) or not grads:
        raise ValueError("`grads` must be a non-empty dict of gradient names to tensors")
    for name in grads:
        if name not in GRADIENT_NAMES:
            raise ValueError(
                f"`{name}` is not a gradient of mamba_chunk_scan_combined: expected one of "
                f"{', '.join(GRADIENT_NAMES)}"
            )
    kw = _native_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                        dt_softplus, dt_limit)
    cands = []
    for name, value in grads.items():
        arr, dtype = _as_float64(name, value)
        cands.append((name, arr, dtype))
    up = {"dout": _as_float64("dout", dout)[0]}
    if dfinal_states is not None:
        up["dfinal_states"] = _as_float64("dfinal_states", dfinal_states)[0]
    data, text = _native.check(cands, **kw, **up, precision=str(precision))
    return Report(json.loads(data), text)


def assert_gradients_close(grads, dout, x, dt, A, B, C, chunk_size, *, precision="f32", D=None,
                           z=None, dt_bias=None, initial_states=None, seq_idx=None,
                           dt_softplus=False, dt_limit=(0.0, INF), dfinal_states=None) -> None:
    """Raises ``AssertionError`` unless every element of every gradient is within its bound.

    Same arguments as :func:`check_gradients`; the message is the report's table.
    """
    report = check_gradients(grads, dout, x, dt, A, B, C, chunk_size, precision=precision, D=D,
                             z=z, dt_bias=dt_bias, initial_states=initial_states,
                             seq_idx=seq_idx, dt_softplus=dt_softplus, dt_limit=dt_limit,
                             dfinal_states=dfinal_states)
    if not report.passed:
        raise AssertionError(
            f"the gradients are not within the {report.precision} error bound "
            f"(worst error/bound {report.worst_ratio})\n{report.text}"
        )


class Case:
    """An ``ssd-fixture/1`` case read by :func:`load_case`.

    ``inputs`` (float64 numpy arrays in the contract's names; ``seq_idx`` int64),
    ``chunk_size``, ``dt_softplus``, ``dt_limit``, ``expected`` (the expected outputs and
    magnitudes the case carries), ``dtypes`` (each stored tensor's dtype), ``name``, ``seed``,
    ``description``. ``kwargs`` is the inputs and options as keyword arguments of
    :func:`mamba_chunk_scan_combined` (and of :func:`assert_close`).
    """

    def __init__(self, d: dict):
        self.inputs: dict[str, np.ndarray] = d["inputs"]
        self.chunk_size: int = d["chunk_size"]
        self.dt_softplus: bool = d["dt_softplus"]
        lo, hi = d["dt_limit"]
        self.dt_limit: tuple[float, float] = (lo, hi)
        self.expected: dict[str, np.ndarray] = d["expected"]
        self.dtypes: dict[str, str] = d["dtypes"]
        self.name = d["name"]
        self.seed = d["seed"]
        self.description = d["description"]

    @property
    def kwargs(self) -> dict[str, Any]:
        kw = dict(self.inputs)
        kw.update(chunk_size=self.chunk_size, dt_softplus=self.dt_softplus,
                  dt_limit=self.dt_limit)
        return kw

    def __repr__(self):
        x = self.inputs["x"].shape
        return f"Case(name={self.name!r}, x={x}, chunk_size={self.chunk_size})"


def load_case(path) -> Case:
    """Reads an ``ssd-fixture/1`` case (its JSON manifest; the tensors beside it)."""
    return Case(_native.load_case(str(path)))


def save_case(path, x, dt, A, B, C, chunk_size, *, D=None, z=None, dt_bias=None,
              initial_states=None, seq_idx=None, dt_softplus=False, dt_limit=(0.0, INF),
              name=None, description=None, seed=None, input_dtype="f64",
              with_expected=True) -> None:
    """Writes an ``ssd-fixture/1`` case: the manifest at ``path`` (``STEM.json``) and
    ``STEM.safetensors`` beside it, atomically (nothing is left behind on error).

    Inputs are stored as ``input_dtype``: ``"f64"`` (exact for any float input), ``"f32"``, or
    ``"bf16"``/``"f16"`` for ``x``, ``z``, ``B``, ``C`` with the rest in f32. With
    ``with_expected`` the case carries its float64 expected outputs and magnitudes, computed
    from the inputs as stored, as ``ssd-oracle gen`` writes them.
    """
    kw = _native_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx,
                        dt_softplus, dt_limit)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
                             or seed < 0):
        raise TypeError(f"`seed` must be a non-negative int, got {seed!r}")
    _native.save_case(str(path), **kw, name=name, description=description,
                      seed=None if seed is None else int(seed), input_dtype=str(input_dtype),
                      with_expected=bool(with_expected))

