"""bindings/arrays.cpp: array arguments are refused, naming the argument, unless they fit; never copied."""

import numpy as np
import pytest
import torch

from tierzero import _core

HYPER = _core.Hyper(algorithm=_core.Algorithm.AdamW, lr=1e-3)


@pytest.fixture(scope="module")
def opt():
    return _core.CpuOptimizer(threads=1)


def arrays(n=64, dtype=np.float32):
    return [np.zeros(n, dtype=dtype) for _ in range(4)]


def test_wrong_dtype_names_the_argument(opt):
    p, g, m, v = arrays()
    with pytest.raises(TypeError, match=r"argument 'grad' must be float32, bfloat16 or float16; got float64"):
        opt.step(HYPER, 1, 1.0, p, g.astype(np.float64), m, v)
    with pytest.raises(TypeError, match=r"argument 'param' must be float32; got int32"):
        opt.step(HYPER, 1, 1.0, p.astype(np.int32), g, m, v)
    with pytest.raises(TypeError, match=r"argument 'exp_avg' must be float32, bfloat16 or uint8; got float16"):
        opt.step(HYPER, 1, 1.0, p, g, m.astype(np.float16), v)


def test_wrong_size_and_order_name_the_argument(opt):
    p, g, m, v = arrays()
    with pytest.raises(ValueError, match=r"argument 'exp_avg_sq' has 32 elements; 'param' has 64"):
        opt.step(HYPER, 1, 1.0, p, g, m, v[:32])
    with pytest.raises(ValueError, match=r"argument 'grad' must be C-contiguous"):
        opt.step(HYPER, 1, 1.0, p[:32], np.zeros(64, np.float32)[::2], m[:32], v[:32])
    with pytest.raises(ValueError, match=r"argument 'param' must be C-contiguous"):
        opt.step(HYPER, 1, 1.0, np.zeros((8, 8), np.float32).T, g, m, v)


def test_array_on_a_gpu_is_refused_by_a_cpu_kernel(opt):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
    p, g, m, v = arrays()
    with pytest.raises(TypeError, match=r"argument 'grad' must be on cpu; it is on cuda:0"):
        opt.step(HYPER, 1, 1.0, p, torch.zeros(64, device="cuda"), m, v)


def test_not_an_array_is_a_type_error():
    eng = _core.IoEngine()
    with pytest.raises(TypeError, match=r"IoEngine.submit\(\): argument 'buffer' must be a writable array"):
        eng.submit("write", "not an array", [])


def test_accepted_arrays_are_used_in_place_not_copied(opt):
    # numpy in, torch in, bf16 from torch: the update lands in the caller's memory.
    p = np.ones(64, np.float32)
    g = torch.full((64,), 0.5, dtype=torch.bfloat16)
    m, v = torch.zeros(64), torch.zeros(64)
    opt.step(HYPER, 1, 1.0, p, g, m, v)
    assert (p < 1).all(), "param was not updated in place"
    assert torch.allclose(m, torch.full((64,), 0.05)), "exp_avg was not updated in place"
    # Any shape with contiguous elements is fine: the kernel sees n elements.
    p2 = np.ones((8, 8), np.float32)
    opt.step(HYPER, 1, 1.0, p2, np.ones((8, 8), np.float32), np.zeros((8, 8), np.float32), np.zeros(64, np.float32))
    assert (p2 < 1).all()


class DLPackOnly:
    """An array known only by __dlpack__/__dlpack_device__ (no buffer protocol, not
    numpy or torch), as CuPy and JAX arrays present themselves."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_any_dlpack_producer_is_used_in_place(opt):
    p, g, m, v = np.ones(64, np.float32), np.full(64, 0.5, np.float32), np.zeros(64, np.float32), np.zeros(64, np.float32)
    opt.step(HYPER, 1, 1.0, DLPackOnly(p), DLPackOnly(g), DLPackOnly(m), DLPackOnly(v))
    assert (p < 1).all(), "param was not updated in place"
    np.testing.assert_allclose(m, np.full(64, 0.05, np.float32))
    with pytest.raises(TypeError, match=r"argument 'grad' must be float32, bfloat16 or float16; got float64"):
        opt.step(HYPER, 1, 1.0, DLPackOnly(p), DLPackOnly(g.astype(np.float64)), DLPackOnly(m), DLPackOnly(v))
