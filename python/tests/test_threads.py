"""The GIL is released while the reference computes, and the realistic layer's check time."""

import threading
import time

import numpy as np

import ssd_oracle
from conftest import random_inputs


def test_other_python_threads_run_while_the_oracle_computes():
    kw = random_inputs(seed=19, batch=1, seqlen=1024, nheads=16, headdim=32, ngroups=1,
                       dstate=64)
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    th = threading.Thread(target=ticker)
    th.start()
    time.sleep(0.01)
    t0 = time.perf_counter()
    out = ssd_oracle.mamba_chunk_scan_combined(**kw)
    ssd_oracle.check(out, **kw)
    t1 = time.perf_counter()
    stop.set()
    th.join()
    during = [t for t in ticks if t0 < t < t1]
    # With the GIL held the ticker could not run at all between t0 and t1 (beyond the
    # Python glue); released, it ticks about every millisecond.
    assert len(during) >= max(5, 0.2 * (t1 - t0) / 0.001), (len(during), t1 - t0)


def test_realistic_layer_checks_in_seconds():
    """Batch 1, 4,096 tokens, the 2.7B layer's 80 heads (headdim 64, dstate 128, chunk 256).
    The time is printed, not asserted (`pytest -s` shows it)."""
    rng = np.random.default_rng(20)
    b, s, h, p, g, n = 1, 4096, 80, 64, 1, 128
    f = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
    kw = dict(x=f(b, s, h, p), dt=f(b, s, h), A=-np.exp(f(h)), B=f(b, s, g, n),
              C=f(b, s, g, n), chunk_size=256, D=f(h), dt_bias=f(h), dt_softplus=True)
    cand = ssd_oracle.intermediates(**kw, precision="tf32")
    cand = {k: cand[k].astype(np.float32) for k in ("out", "final_states")}
    t0 = time.perf_counter()
    r = ssd_oracle.check(cand, **kw, precision="tf32")
    elapsed = time.perf_counter() - t0
    print(f"\nrealistic layer (1, 4096, 80, 64, 128): check {elapsed:.1f} s, "
          f"worst error/bound {r.worst_ratio:.3f}")
    assert r.passed, r.text
