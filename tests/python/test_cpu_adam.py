"""bindings/cpu_adam.cpp: the CPU optimizer kernels on caller arrays, against a float64 reference."""

import threading
import time

import numpy as np
import pytest
import torch

from tierzero import _core

A = _core.Algorithm


def reference(alg, p, g, m, v, t, lr, b1, b2, eps, wd, lr_decay=0.0):
    """One step in float64 (the formulas of tierzero/cpu_adam.h)."""
    p, g, m, v = (x.astype(np.float64) for x in (p, g, m, v))
    if alg == A.Adam:
        g = g + wd * p
    if alg == A.AdamW:
        p = p * (1 - lr * wd)
    if alg in (A.Adam, A.AdamW):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr / (1 - b1 ** t) * m / (np.sqrt(v) / np.sqrt(1 - b2 ** t) + eps)
    elif alg == A.Adagrad:
        g = g + wd * p
        v = v + g * g
        p = p - lr / (1 + (t - 1) * lr_decay) * g / (np.sqrt(v) + eps)
    else:  # Lion
        p = p * (1 - lr * wd)
        p = p - lr * np.sign(b1 * m + (1 - b1) * g)
        m = b2 * m + (1 - b2) * g
    return p, m, v


@pytest.mark.parametrize("alg", [A.Adam, A.AdamW, A.Adagrad, A.Lion])
def test_step_matches_float64_reference(alg):
    rng = np.random.default_rng(int(alg.value))
    n = 10_007  # not a multiple of any vector width: the tail is covered
    p = rng.standard_normal(n).astype(np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    m = (0.1 * rng.standard_normal(n)).astype(np.float32)
    v = np.abs(0.1 * rng.standard_normal(n)).astype(np.float32)
    want_p, want_m, want_v = reference(alg, p, g, m, v, 3, 1e-2, 0.9, 0.99, 1e-8, 0.1, 0.01)
    hyper = _core.Hyper(algorithm=alg, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, lr_decay=0.01)
    opt = _core.CpuOptimizer(threads=2)
    states = {"exp_avg": m, "exp_avg_sq": v} if alg in (A.Adam, A.AdamW) else (
        {"exp_avg_sq": v} if alg == A.Adagrad else {"exp_avg": m})
    opt.step(hyper, 3, 1.0, p, g, **states)
    err = np.abs(p - want_p).max()
    print(f"{alg.name}: largest |param - float64 reference| = {err:.3g}")
    assert err <= 1e-6 * max(1.0, np.abs(want_p).max())
    if alg in (A.Adam, A.AdamW, A.Lion):
        assert np.abs(m - want_m).max() <= 1e-6
    if alg in (A.Adam, A.AdamW, A.Adagrad):
        assert np.abs(v - want_v).max() <= 1e-6 * max(1.0, np.abs(want_v).max())


def test_weight_decay_segments_step_like_one_call_per_run():
    rng = np.random.default_rng(21)
    n = 1001
    p = rng.standard_normal(n).astype(np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    m = (0.1 * rng.standard_normal(n)).astype(np.float32)
    v = np.abs(0.1 * rng.standard_normal(n)).astype(np.float32)
    segments = [(0, 37, 0.0), (100, 517, 0.3)]  # [37, 100) and [517, n) keep hyper's 0.1
    opt = _core.CpuOptimizer(threads=2)
    whole = [x.copy() for x in (p, g, m, v)]
    opt.step(_core.Hyper(algorithm=A.AdamW, weight_decay=0.1), 2, 1.0, *whole, weight_decay_segments=segments)
    runs = [x.copy() for x in (p, g, m, v)]
    for b, e, wd in [(0, 37, 0.0), (37, 100, 0.1), (100, 517, 0.3), (517, n, 0.1)]:
        part = [x[b:e].copy() for x in runs]
        opt.step(_core.Hyper(algorithm=A.AdamW, weight_decay=wd), 2, 1.0, *part)
        for x, y in zip(runs, part):
            x[b:e] = y
    for x, y in zip(whole, runs):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match=r"weight_decay_segments\[1\] = \[30, 40\)"):
        opt.step(_core.Hyper(), 1, 1.0, *whole, weight_decay_segments=[(0, 37, 0.0), (30, 40, 0.1)])


def test_fused_bf16_copy_out_is_the_new_param_rounded():
    n = 4096
    p = torch.randn(n)
    g, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    _core.CpuOptimizer(threads=1).step(_core.Hyper(lr=1e-3), 1, 1.0, p, g, m, v, param16=out)
    assert torch.equal(out, p.to(torch.bfloat16))  # round-to-nearest-even, as torch's cast


def test_grad_scale_divides_the_gradient():
    a = [np.full(256, x, np.float32) for x in (1.0, 4.0, 0.0, 0.0)]
    b = [np.full(256, x, np.float32) for x in (1.0, 1.0, 0.0, 0.0)]
    opt = _core.CpuOptimizer(threads=1)
    opt.step(_core.Hyper(algorithm=A.Adam), 1, 0.25, *a)
    opt.step(_core.Hyper(algorithm=A.Adam), 1, 1.0, *b)
    np.testing.assert_array_equal(a[0], b[0])


def test_accumulate_grad_returns_the_norm():
    acc = np.ones(1000, np.float32)
    grad = torch.full((1000,), 2.0, dtype=torch.float16)
    sumsq, non_finite = _core.CpuOptimizer(threads=1).accumulate_grad(acc, grad, overwrite=False, scale=0.5)
    assert (acc == 2.0).all() and sumsq == pytest.approx(4000.0) and non_finite is False
    grad[3] = float("inf")
    _, non_finite = _core.CpuOptimizer(threads=1).accumulate_grad(acc, grad, overwrite=True)
    assert non_finite is True


def test_bad_hyperparameters_are_value_errors_with_the_value():
    p, g, m, v = (np.zeros(16, np.float32) for _ in range(4))
    with pytest.raises(ValueError, match="beta1"):
        _core.CpuOptimizer(threads=1).step(_core.Hyper(beta1=1.0), 1, 1.0, p, g, m, v)
    with pytest.raises(ValueError, match="lr"):
        _core.CpuOptimizer(threads=1).step(_core.Hyper(lr=float("nan")), 1, 1.0, p, g, m, v)
    with pytest.raises(ValueError, match="unknown SIMD variant \"avx9000\""):
        _core.CpuOptimizer(simd="avx9000")


def test_overlapping_spans_are_refused():
    buf = np.zeros(64, np.float32)
    with pytest.raises(ValueError, match="overlap"):
        _core.CpuOptimizer(threads=1).step(_core.Hyper(), 1, 1.0, buf, np.zeros(64, np.float32), buf, buf)


def test_every_supported_simd_variant_agrees():
    rng = np.random.default_rng(7)
    base = [rng.standard_normal(5000).astype(np.float32) for _ in range(2)] + [np.zeros(5000, np.float32)] * 2
    results = []
    for simd in _core.simd_variants():
        arrs = [a.copy() for a in base]
        _core.CpuOptimizer(threads=1, simd=simd).step(_core.Hyper(), 1, 1.0, *arrs)
        results.append(arrs[0])
    # Variants differ in FMA contraction: they agree to fp32 rounding, not bit for bit.
    for r in results[1:]:
        np.testing.assert_allclose(r, results[0], rtol=2e-6, atol=1e-9)


def test_step_releases_the_gil():
    n = 20_000_000
    arrs = [np.ones(n, np.float32) for _ in range(4)]
    opt = _core.CpuOptimizer(threads=1)
    done = threading.Event()
    ticks = 0

    def run():
        for t in range(1, 4):
            opt.step(_core.Hyper(), t, 1.0, *arrs)
        done.set()

    th = threading.Thread(target=run)
    start = time.perf_counter()
    th.start()
    while not done.is_set():
        ticks += 1
        time.sleep(0.001)
    th.join()
    elapsed = time.perf_counter() - start
    print(f"3 steps of {n} params: {elapsed * 1e3:.0f} ms; the main thread ran {ticks} times meanwhile")
    assert ticks >= max(3, int(elapsed / 0.001) // 4)
