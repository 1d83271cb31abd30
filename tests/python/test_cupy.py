"""CuPy arrays across the boundary (GPU only; CuPy needs one): zero-copy views both
ways, gradients taken after the CuPy stream that wrote them, wrong arrays refused.

The engine runs on the CUDA backend with every state in memory (no NVMe), so
what is checked is the array exchange itself; tests/python/test_torch.py and
the C++ tests cover the tiers.
"""

import numpy as np
import pytest
import torch

import tierzero
from tierzero import _core
from conftest import host_config

BLOCKS = [("layer0", [("w", (64, 128)), ("b", (64,))]), ("layer1", [("w", (32, 64))])]
LR, WD = 1e-2, 0.01


@pytest.fixture(scope="module")
def cp():
    cuda = tierzero.info()["cuda"]
    if cuda["device_count"] == 0:
        pytest.skip(f"needs a CUDA device ({cuda['status']})")
    return pytest.importorskip("cupy", reason="CuPy is not installed")


def make(seed):
    rng = np.random.default_rng(seed)
    init = [[rng.standard_normal(shape).astype(np.float32) for _, shape in params] for _, params in BLOCKS]
    eng = tierzero.Engine(host_config(None, backend="cuda", lr=LR, weight_decay=WD), BLOCKS, init=init)
    return eng, init


def test_views_are_the_same_gpu_memory_from_cupy_and_torch(cp):
    eng, init = make(1)
    assert eng.device == "cuda:0"
    g = eng.fetch(0)
    c = cp.from_dlpack(g.param(0))
    t = torch.from_dlpack(g.param(0))
    whole = cp.from_dlpack(g.data)
    assert c.shape == (64, 128) and c.dtype == cp.float32
    assert c.data.ptr == t.data_ptr() == whole.data.ptr + 4 * eng.layout[0]["params"][0]["offset"]
    np.testing.assert_array_equal(cp.asnumpy(c), init[0][0])
    c[3, 5] = 42.0                                  # written by a CuPy kernel ...
    cp.cuda.get_current_stream().synchronize()
    assert t[3, 5].item() == 42.0                   # ... read by torch
    t[0, 0] = -1.0
    torch.cuda.synchronize()
    assert float(c[0, 0]) == -1.0


def _slow_then(cp, host_grads):
    """The gradients on the current CuPy stream, written only after ~tens of ms of
    queued matrix products: a copy that does not wait for that stream reads them
    before they exist."""
    dev = [cp.asarray(h) for h in host_grads]
    slow = cp.ones((4096, 4096), cp.float32)
    for _ in range(8):
        slow = cp.tanh(slow @ slow)
    return [d + 0.0 * slow[0, 0] for d in dev]


def _adamw_first_step(p, g):
    """torch.optim.AdamW's first step in float64: decay, then lr * g / (|g| + eps)."""
    p, g = p.astype(np.float64), g.astype(np.float64)
    return p * (1 - LR * WD) - LR * g / (np.abs(g) + 1e-8)


@pytest.mark.parametrize("stream", ["legacy default", "default by .ptr", "own stream"])
def test_gradients_written_by_cupy_are_taken_after_its_stream(cp, stream):
    eng, init = make(2)
    rng = np.random.default_rng(3)
    host = [[rng.standard_normal(shape).astype(np.float32) for _, shape in params] for _, params in BLOCKS]
    if stream == "own stream":
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            grads = [_slow_then(cp, h) for h in host]
        for b, gs in enumerate(grads):
            eng.reduce_grads(b, gs, stream=s.ptr)   # no synchronisation by the caller
    else:
        grads = [_slow_then(cp, h) for h in host]   # CuPy's default: the legacy default stream
        ptr = cp.cuda.get_current_stream().ptr      # 0 for it, which reduce_grads reads as that stream
        for b, gs in enumerate(grads):
            if stream == "default by .ptr":
                eng.reduce_grads(b, gs, stream=ptr)
            else:
                eng.reduce_grads(b, gs)
    report = eng.step()
    norm = np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for h in host for g in h))
    assert report["grad_norm"] == pytest.approx(norm, rel=1e-5)
    for b in range(len(BLOCKS)):
        got = eng.master_params(b)
        for i, p0 in enumerate(init[b]):
            np.testing.assert_allclose(got[i].reshape(p0.shape), _adamw_first_step(p0, host[b][i]), rtol=0, atol=1e-6)


def test_wrong_cupy_arrays_are_refused_naming_the_argument(cp):
    eng, _ = make(4)
    with pytest.raises(TypeError, match=r"argument 'grads\[0\] \(layer1.w\)' must be float32; got float64"):
        eng.reduce_grads(1, [cp.ones((32, 64), cp.float64)])
    with pytest.raises(ValueError, match=r"argument 'grads\[0\] \(layer1.w\)' must be C-contiguous"):
        eng.reduce_grads(1, [cp.ones((64, 32), cp.float32).T])
    with pytest.raises(ValueError, match=r"argument 'grads\[0\] \(layer1.w\)' has 100 elements"):
        eng.reduce_grads(1, [cp.ones(100, cp.float32)])
    with pytest.raises(TypeError, match=r"argument 'grads\[0\] \(layer1.w\)' must be on cuda:0; it is on cpu"):
        eng.reduce_grads(1, [np.ones((32, 64), np.float32)])
    with pytest.raises(ValueError, match=r"stream=-5 is not a CUDA stream"):
        eng.reduce_grads(1, [cp.ones((32, 64), cp.float32)], stream=-5)
    opt = _core.CpuOptimizer(threads=1)
    hyper = _core.Hyper(algorithm=_core.Algorithm.AdamW, lr=1e-3)
    p, m, v = (np.zeros(64, np.float32) for _ in range(3))
    with pytest.raises(TypeError, match=r"argument 'grad' must be on cpu; it is on cuda:0"):
        opt.step(hyper, 1, 1.0, p, cp.zeros(64, cp.float32), m, v)
