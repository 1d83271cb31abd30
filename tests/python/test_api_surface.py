"""Every call the package exposes, beyond the paths the feature tests take.

_core's classes and functions, tierzero.nvme, tierzero.optim, tierzero.engine
and tierzero.torch: options and properties read back and used, every array
argument refused by name (dtype, order, size, read-only, device), error
messages that name the key, path or value. Inputs are fresh random data;
expected values are computed here from the inputs. The wrong-device section
needs a CUDA device and skips, saying so, without one.
"""

import gc
import json
import os
import shutil
import zlib

import numpy as np
import pytest
import torch

import tierzero
import tierzero.nvme as tzn
import tierzero.optim as tzo
import tierzero.torch as tzt
from tierzero import _core
from conftest import host_config

A = _core.Algorithm
MiB = 1 << 20


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))  # per test, the same in every process


# ---------------------------------------------------------------- _core.Hyper / CpuOptimizer

def test_hyper_fields_read_back_what_was_set(rng):
    h = _core.Hyper()
    assert (h.algorithm, h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.amsgrad, h.lr_decay) == \
        (A.AdamW, 1e-3, 0.9, 0.999, 1e-8, 0.0, False, 0.0)  # the documented defaults
    vals = {k: float(rng.uniform(0.01, 0.5)) for k in ("lr", "beta1", "beta2", "eps", "weight_decay", "lr_decay")}
    for k, v in vals.items():
        setattr(h, k, v)
    h.algorithm, h.amsgrad = A.Lion, True
    assert {k: getattr(h, k) for k in vals} == vals and h.algorithm == A.Lion and h.amsgrad is True
    # and the set values are what the kernel uses: lr changed on the object moves Lion's step by it
    n = 257
    p = rng.standard_normal(n).astype(np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    m = np.zeros(n, np.float32)
    with pytest.raises(ValueError, match="amsgrad is only for adam and adamw, not lion"):
        _core.CpuOptimizer(threads=1).step(h, 1, 1.0, p, g, exp_avg=m)
    h.weight_decay, h.amsgrad = 0.0, False
    want = p - h.lr * np.sign((1 - h.beta1) * g)
    _core.CpuOptimizer(threads=1).step(h, 1, 1.0, p, g, exp_avg=m)
    np.testing.assert_allclose(p, want, rtol=0, atol=1e-6)


def test_cpu_optimizer_properties_and_constructor_checks():
    variants = _core.simd_variants()
    assert variants and variants[0] == "scalar" and len(set(variants)) == len(variants)
    opt = _core.CpuOptimizer(threads=1)
    assert opt.threads == 1 and opt.simd == variants[-1]  # default: the widest this CPU runs
    for v in variants:
        assert _core.CpuOptimizer(threads=1, simd=v).simd == v
    assert _core.CpuOptimizer(threads=1, tile_elems=1024).threads == 1
    with pytest.raises(ValueError, match="tile_elems = 7"):
        _core.CpuOptimizer(threads=1, tile_elems=7)
    with pytest.raises(ValueError, match="threads = -1"):
        _core.CpuOptimizer(threads=-1)


def _arrs(rng, n, k=4):
    return [rng.standard_normal(n).astype(np.float32) for _ in range(k)]


def test_step_refuses_every_optional_array_by_name(rng):
    opt, h = _core.CpuOptimizer(threads=1), _core.Hyper()
    n = int(rng.integers(16, 200))
    p, g, m, v = _arrs(rng, n)
    v = np.abs(v)
    with pytest.raises(ValueError, match=rf"argument 'grad' has {n - 1} elements; 'param' has {n}"):
        opt.step(h, 1, 1.0, p, g[:-1], m, v)
    with pytest.raises(ValueError, match=rf"argument 'exp_avg' has {n - 1} elements"):
        opt.step(h, 1, 1.0, p, g, m[:-1], v)
    with pytest.raises(ValueError, match=r"argument 'exp_avg_sq' must be C-contiguous"):
        opt.step(h, 1, 1.0, p, g, m, np.repeat(v, 2)[::2])
    with pytest.raises(TypeError, match=r"'exp_avg' and 'exp_avg_sq' must have the same dtype"):
        opt.step(h, 1, 1.0, p, g, torch.zeros(n, dtype=torch.bfloat16), v)
    ams = _core.Hyper(amsgrad=True)
    with pytest.raises(TypeError, match=r"argument 'max_exp_avg_sq' must be float32; got float16"):
        opt.step(ams, 1, 1.0, p, g, m, v, np.zeros(n, np.float16))
    with pytest.raises(ValueError, match=rf"argument 'max_exp_avg_sq' has {n + 1} elements"):
        opt.step(ams, 1, 1.0, p, g, m, v, np.zeros(n + 1, np.float32))
    with pytest.raises(ValueError, match="max_exp_avg_sq"):
        opt.step(ams, 1, 1.0, p, g, m, v)  # amsgrad without the array
    with pytest.raises(TypeError, match=r"argument 'param16' must be bfloat16 or float16; got float32"):
        opt.step(h, 1, 1.0, p, g, m, v, param16=np.zeros(n, np.float32))
    with pytest.raises(ValueError, match=rf"argument 'param16' has {n // 2} elements"):
        opt.step(h, 1, 1.0, p, g, m, v, param16=torch.zeros(n // 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"argument 'param16' must be C-contiguous"):
        opt.step(h, 1, 1.0, p, g, m, v, param16=torch.zeros(2 * n, dtype=torch.float16)[::2])
    with pytest.raises(ValueError, match="exp_avg_sq"):
        opt.step(h, 1, 1.0, p, g, m)  # Adam(W) needs both moments
    with pytest.raises(ValueError, match="step = 0"):
        opt.step(h, 0, 1.0, p, g, m, v)
    with pytest.raises(ValueError, match="grad_scale = 0"):
        opt.step(h, 1, 0.0, p, g, m, v)


def test_refused_step_leaves_the_arrays_untouched(rng):
    p, g, m, v = _arrs(rng, 100)
    before = [a.copy() for a in (p, m, v)]
    with pytest.raises(TypeError):
        _core.CpuOptimizer(threads=1).step(_core.Hyper(), 1, 1.0, p, g, m, v, param16=np.zeros(100, np.float32))
    for a, b in zip((p, m, v), before):
        np.testing.assert_array_equal(a, b)


def test_amsgrad_keeps_the_running_max_in_place(rng):
    n = 1001
    p, g, m = _arrs(rng, n, 3)
    v = np.abs(rng.standard_normal(n)).astype(np.float32) * 0.1
    vmax = np.abs(rng.standard_normal(n)).astype(np.float32) * 0.1
    lr, b1, b2, eps, t = 1e-2, 0.9, 0.99, 1e-8, 2
    m64 = b1 * m.astype(np.float64) + (1 - b1) * g
    v64 = b2 * v.astype(np.float64) + (1 - b2) * g.astype(np.float64) ** 2
    vmax64 = np.maximum(vmax.astype(np.float64), v64)
    want = p - lr / (1 - b1 ** t) * m64 / (np.sqrt(vmax64) / np.sqrt(1 - b2 ** t) + eps)
    h = _core.Hyper(algorithm=A.Adam, lr=lr, beta1=b1, beta2=b2, eps=eps, amsgrad=True)
    _core.CpuOptimizer(threads=1).step(h, t, 1.0, p, g, m, v, max_exp_avg_sq=vmax)
    np.testing.assert_allclose(vmax, vmax64, rtol=1e-6)
    np.testing.assert_allclose(p, want, rtol=0, atol=1e-5)


def test_bf16_moments_and_fp16_copy_out(rng):
    n = 4099
    p32, g = torch.from_numpy(rng.standard_normal(n).astype(np.float32)), torch.randn(n)
    p16 = p32.clone()
    m32, v32 = torch.zeros(n), torch.zeros(n)
    mb, vb = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    out = torch.empty(n, dtype=torch.float16)
    opt, h = _core.CpuOptimizer(threads=1), _core.Hyper(lr=1e-2)
    opt.step(h, 1, 1.0, p32, g, m32, v32)
    opt.step(h, 1, 1.0, p16, g, mb, vb, param16=out)
    assert torch.equal(out, p16.to(torch.float16))                   # fused fp16 copy-out is the rounded param
    torch.testing.assert_close(mb.float(), m32, rtol=1e-2, atol=1e-3)  # bf16 state: the same step, rounded
    torch.testing.assert_close(p16, p32, rtol=0, atol=1e-4)


def test_accumulate_grad_values_in_place(rng):
    n = int(rng.integers(1000, 5000))
    acc0 = rng.standard_normal(n).astype(np.float32)
    acc = torch.from_numpy(acc0.copy())
    view = acc.numpy()  # numpy's view of the torch tensor: the same memory
    g = torch.randn(n, dtype=torch.bfloat16)
    scale = float(rng.uniform(0.1, 2.0))
    opt = _core.CpuOptimizer(threads=1)
    sumsq, bad = opt.accumulate_grad(acc, g, overwrite=False, scale=scale)
    want = acc0.astype(np.float64) + scale * g.float().numpy()
    np.testing.assert_allclose(view, want, rtol=1e-6, atol=1e-6)
    assert sumsq == pytest.approx(float((view.astype(np.float64) ** 2).sum()), rel=1e-5) and bad is False
    sumsq, _ = opt.accumulate_grad(view, g.float(), overwrite=True)
    torch.testing.assert_close(acc, g.float())
    assert sumsq == pytest.approx(float((g.double() ** 2).sum()), rel=1e-5)


def test_accumulate_grad_refuses_by_name(rng):
    opt = _core.CpuOptimizer(threads=1)
    n = int(rng.integers(8, 100))
    with pytest.raises(TypeError, match=r"accumulate_grad\(\): argument 'acc' must be float32; got float16"):
        opt.accumulate_grad(np.zeros(n, np.float16), np.zeros(n, np.float32))
    with pytest.raises(TypeError, match=r"argument 'grad' must be float32, bfloat16 or float16; got float64"):
        opt.accumulate_grad(np.zeros(n, np.float32), np.zeros(n))
    with pytest.raises(ValueError, match=rf"'grad' has {n + 1} elements; 'acc' has {n}"):
        opt.accumulate_grad(np.zeros(n, np.float32), np.zeros(n + 1, np.float32))
    with pytest.raises(ValueError, match=r"argument 'acc' must be C-contiguous"):
        opt.accumulate_grad(np.zeros(2 * n, np.float32)[::2], np.zeros(n, np.float32))
    with pytest.raises(ValueError, match=r"argument 'grad' must be C-contiguous"):
        opt.accumulate_grad(np.zeros(n, np.float32), np.zeros(2 * n, np.float32)[::2])


def test_read_only_grad_is_accepted(rng):
    p, g, m, v = _arrs(rng, 64)
    g.flags.writeable = False
    want = p.copy()
    _core.CpuOptimizer(threads=1).step(_core.Hyper(), 1, 1.0, p, g, m, v)
    assert not np.array_equal(p, want)


# ---------------------------------------------------------------- probe, planner, units, module

def test_probe_path_refuses_a_file_naming_it(tmp_path):
    f = tmp_path / "plain.txt"
    f.write_text("x")
    with pytest.raises(ValueError, match=str(f)):
        _core.probe_path(str(f))


def test_capabilities_refresh_keeps_the_shape():
    a, b = _core.capabilities(), _core.capabilities(refresh=True)
    assert set(a) == set(b) and a["cpu"]["logical_cpus"] == b["cpu"]["logical_cpus"]


def test_estimate_ranks_shard_the_states():
    one, _ = tierzero.estimate("7B", gpu="80GB", cpu="200GB", nvme="2TB")
    for r in (2, 4, 8):
        many, _ = tierzero.estimate("7B", ranks=r, gpu="80GB", cpu="200GB", nvme="2TB")
        assert many["ranks"] == r
        for s in ("master", "moments"):
            assert many["states"][s]["bytes_per_rank"] * r == pytest.approx(one["states"][s]["bytes_per_rank"],
                                                                            rel=1e-3)
    with pytest.raises(ValueError, match="ranks is 0"):
        tierzero.estimate("7B", ranks=0, gpu="80GB", cpu="200GB", nvme="2TB")


def test_estimate_grad_accum_and_placement_and_nvme_paths(nvme_dir):
    kw = dict(gpu="8GB", cpu="200GB", nvme="2TB")
    a, _ = tierzero.estimate("7B", grad_accum=1, **kw)
    b, _ = tierzero.estimate("7B", grad_accum=4, **kw)
    assert b["layout"] == a["layout"] and b["traffic"]["h2d_bytes"] > a["traffic"]["h2d_bytes"]
    with pytest.raises(ValueError, match="placement 'magic': expected auto or deepspeed"):
        tierzero.estimate("7B", placement="magic", **kw)
    c, _ = tierzero.estimate("1B", placement="deepspeed", gpu="80GB", cpu="200GB", nvme="2TB")
    assert c["placement"] == "deepspeed"
    d, _ = tierzero.estimate("1B", gpu="80GB", cpu="200GB", nvme_paths=[nvme_dir])
    nbytes, source = d["budgets"]["nvme"]
    assert nvme_dir in source and 0 < nbytes <= shutil.disk_usage(nvme_dir).total
    with pytest.raises(ValueError, match="layers = 0"):
        tierzero.estimate("7B", layers=0)


def test_parse_units_refuse_by_text(rng):
    k = int(rng.integers(1, 1000))
    assert _core.parse_bytes(f"{k}KiB") == k * 1024 and _core.parse_bytes(f"{k}GB") == k * 10 ** 9
    assert _core.parse_count(f"{k}M") == k * 1e6
    with pytest.raises(ValueError, match="'lots' is not a byte size"):
        _core.parse_bytes("lots")
    with pytest.raises(ValueError, match="'-1' is negative"):
        _core.parse_count("-1")


def test_config_args_and_describe_are_public():
    cfg = {"zero_optimization": {"stage": 2}}
    assert json.loads(tierzero.config_args(cfg)["config_json"]) == cfg
    assert tierzero.config_args("/x/ds.json") == {"config_path": "/x/ds.json"}
    assert tierzero.config_args(None) == {}
    assert tierzero.describe() == _core.describe_capabilities()


# ---------------------------------------------------------------- nvme

def test_future_ready_and_wait_with_timeout(nvme_dir, rng):
    eng = tzn.IoEngine()
    f = eng.open(os.path.join(nvme_dir, "r.bin"), create=True, size_bytes=MiB)
    buf = tzn.aligned_empty(MiB)
    buf[:] = rng.integers(0, 256, buf.size, dtype=np.uint8)
    fut = eng.write(f, 0, buf)
    fut.wait(timeout=60.0)
    assert fut.ready() is True
    fut.wait()  # a second wait on a completed request returns at once
    back = tzn.aligned_empty(MiB)
    eng.read(f, 0, back).wait(timeout=60.0)
    assert np.array_equal(back, buf)


def test_register_buffer_round_trip_and_refusals(nvme_dir, rng):
    eng = tzn.IoEngine()
    f = eng.open(os.path.join(nvme_dir, "fixed.bin"), create=True, size_bytes=MiB)
    buf = tzn.aligned_empty(MiB)
    buf[:] = rng.integers(0, 256, buf.size, dtype=np.uint8)
    eng.register_buffer(buf)
    eng.write(f, 0, buf).wait()
    back = tzn.aligned_empty(MiB)
    eng.read(f, 0, back).wait()
    assert np.array_equal(back, buf)
    eng.unregister_buffer(buf)
    eng.unregister_buffer(buf)  # a second time: nothing to undo, no error
    eng.write(f, 0, buf).wait()  # the buffer still does plain I/O
    with pytest.raises(ValueError, match=r"IoEngine.register_buffer\(\): argument 'buffer' must be C-contiguous"):
        eng.register_buffer(tzn.aligned_empty(2 * 4096)[::2])
    with pytest.raises(ValueError, match=r"IoEngine.unregister_buffer\(\): argument 'buffer' must be C-contiguous"):
        eng.unregister_buffer(tzn.aligned_empty(2 * 4096)[::2])
    if eng.backend == "io_uring":
        assert eng.stats()["fixed_buffer_pieces"] >= 1


def test_threads_backend_round_trip(nvme_dir, rng):
    eng = tzn.IoEngine(backend="threads", queue_depth=4, block_size=256 * 1024)
    assert eng.backend == "threads"
    f = eng.open(os.path.join(nvme_dir, "t.bin"), create=True, size_bytes=2 * MiB)
    buf = tzn.aligned_empty(2 * MiB)
    buf[:] = rng.integers(0, 256, buf.size, dtype=np.uint8)
    eng.write(f, 0, buf).wait()
    back = tzn.aligned_empty(2 * MiB, torch=True)
    eng.read(f, 0, back).wait()
    assert np.array_equal(back.numpy(), buf)
    assert eng.stats()["pieces"] >= 2 * 2 * MiB // (256 * 1024)  # split by block_size
    with pytest.raises(ValueError, match="backend 'spdk': expected auto, io_uring or threads"):
        tzn.IoEngine(backend="spdk")


def test_submit_and_open_refusals_name_the_problem(nvme_dir):
    eng = tzn.IoEngine()
    path = os.path.join(nvme_dir, "o.bin")
    f = eng.open(path, create=True, size_bytes=MiB)
    buf = tzn.aligned_empty(4096)
    with pytest.raises(ValueError, match="op 'append': expected read or write"):
        eng.submit("append", buf, [(f, 0, 4096)])
    with pytest.raises(ValueError, match=r"IoEngine.submit\(\): argument 'buffer' must be C-contiguous"):
        eng.submit("write", tzn.aligned_empty(8192)[::2], [(f, 0, 4096)])
    with pytest.raises(TypeError, match="buffer: expected an array"):
        eng.read(f, 0, [1, 2, 3])
    with pytest.raises(FileExistsError, match=path):
        eng.open(path, create=True, exclusive=True)
    ro = eng.open(path, writable=False)
    with pytest.raises(ValueError, match="opened read-only"):
        eng.write(ro, 0, buf).wait()
    assert eng.file_info(eng.open(path, direct=False))["direct"] is False
    eng.close(f)
    with pytest.raises(ValueError, match=rf"file id {f}: not open"):
        eng.file_info(f)
    with pytest.raises(ValueError, match="not open"):
        eng.close(f)


def test_tmpfs_is_refused_unless_allow_buffered():
    assert _core.probe_path("/dev/shm")["filesystem"] == "tmpfs"  # Linux's shared-memory tmpfs
    path = f"/dev/shm/tierzero-test-{os.getpid()}.bin"
    try:
        eng = tzn.IoEngine()
        with pytest.raises(ValueError, match=path):
            eng.open(path, create=True, size_bytes=4096)
        f = eng.open(path, create=True, size_bytes=4096, allow_buffered=True)
        assert eng.file_info(f)["direct"] is False
    finally:
        if os.path.exists(path):
            os.remove(path)


def test_checksum_refuses_and_depends_on_every_byte(rng):
    with pytest.raises(ValueError, match=r"checksum\(\): argument 'data' must be C-contiguous"):
        tzn.checksum(np.zeros(64, np.float32)[::2])
    a = rng.integers(0, 256, 10_000, dtype=np.uint8)
    b = a.copy()
    i = int(rng.integers(0, a.size))
    b[i] ^= 1 << int(rng.integers(0, 8))
    assert tzn.checksum(a) != tzn.checksum(b)
    assert tzn.checksum(a[:8000].view(np.float64)) == tzn.checksum(a[:8000])  # bytes, not elements
    ro = a.copy()
    ro.flags.writeable = False
    assert tzn.checksum(ro) == tzn.checksum(a)


def test_aligned_empty_alignment_and_torch_sharing(rng):
    for _ in range(5):
        align = 1 << int(rng.integers(0, 17))
        n = int(rng.integers(0, 100_000))
        a = tzn.aligned_empty(n, align)
        assert a.dtype == np.uint8 and a.size == n and a.ctypes.data % align == 0
    t = tzn.aligned_empty(4096, torch=True)
    t.numpy()[:] = 9
    assert isinstance(t, torch.Tensor) and t.data_ptr() % 4096 == 0 and bool((t == 9).all())
    with pytest.raises(ValueError, match="power-of-two"):
        tzn.aligned_empty(10, 3)
    with pytest.raises(ValueError, match="nbytes >= 0"):
        tzn.aligned_empty(-1)


def test_swap_store_striped_over_two_paths_with_a_shared_engine(tmp_path, nvme_dir, rng):
    d1, d2 = os.path.join(nvme_dir, "a"), os.path.join(nvme_dir, "b")
    os.makedirs(d1), os.makedirs(d2)
    eng = tzn.IoEngine()
    store = tzn.SwapStore([d1, d2], capacity_bytes=8 * MiB, stripe_bytes=64 * 1024, engine=eng)
    paths = store.file_paths()
    assert len(paths) == 2 and os.path.dirname(paths[0]) == d1 and os.path.dirname(paths[1]) == d2
    n = int(rng.integers(200_000, 1_000_000))
    e = store.allocate(n)
    buf = tzn.aligned_empty(store.padded_bytes(n), store.buffer_alignment)
    buf[:] = rng.integers(0, 256, buf.size, dtype=np.uint8)
    store.write(e, buf).wait()
    back = tzn.aligned_empty(buf.size, store.buffer_alignment)
    store.read(e, back).wait()
    assert np.array_equal(back, buf)
    place = store.placement(e)
    assert {p for p, _, _ in place} == set(paths) and sum(b for _, _, b in place) == buf.size
    assert eng.stats()["bytes_written"] >= buf.size  # the store's I/O went through the engine it was given
    del store
    gc.collect()
    assert not any(os.path.exists(p) for p in paths), "swap files outlived the store"


def test_swap_store_without_checksums_does_not_check(nvme_dir, rng):
    store = tzn.SwapStore([nvme_dir], capacity_bytes=4 * MiB, checksums=False)
    e = store.allocate(MiB)
    buf = tzn.aligned_empty(MiB)
    buf[:] = rng.integers(0, 255, buf.size, dtype=np.uint8)
    store.write(e, buf).wait()
    (path, offset, _), = store.placement(e)
    at = int(rng.integers(0, MiB))
    with open(path, "r+b") as f:
        f.seek(offset + at)
        f.write(bytes([int(buf[at]) ^ 0xFF]))
        os.fsync(f.fileno())
    back = tzn.aligned_empty(MiB)
    store.read(e, back).wait()  # no DataCorruption: checksums are off
    assert back[at] == buf[at] ^ 0xFF and store.stats()["corrupt_reads"] == 0


def test_swap_store_refusals_name_the_extent_or_path(nvme_dir):
    store = tzn.SwapStore([nvme_dir], capacity_bytes=4 * MiB)
    with pytest.raises(ValueError, match="extent 1234 does not exist"):
        store.extent_bytes(1234)
    e = store.allocate(5000)
    with pytest.raises(RuntimeError, match=f"extent {e}, which was never written"):
        store.read(e, tzn.aligned_empty(store.padded_bytes(5000))).wait()
    store.free(e)
    with pytest.raises(ValueError, match=f"extent {e}"):
        store.free(e)
    with pytest.raises(ValueError, match=f"extent {e} does not exist"):
        store.placement(e)
    with pytest.raises(ValueError, match=r"SwapStore.write\(\): argument 'buffer' must be C-contiguous"):
        store.write(store.allocate(4096), tzn.aligned_empty(2 * 4096)[::2])
    missing = os.path.join(nvme_dir, "missing", "dir")
    with pytest.raises(FileNotFoundError, match=missing):
        tzn.SwapStore([missing], capacity_bytes=MiB)
    with pytest.raises(OSError, match="free there"):
        tzn.SwapStore([nvme_dir], capacity_bytes=1 << 55)


# ---------------------------------------------------------------- engine

BLOCKS = [("layer0", [("w", (8, 16)), ("b", (8,))]), ("layer1", [("w", (4, 8))])]


def test_engine_init_arrays_are_refused_by_name(nvme_dir):
    cfg = host_config(nvme_dir)
    with pytest.raises(TypeError, match=r"Engine\(\): argument 'init\[0\]\[0\]' must be float32; got float64"):
        tierzero.Engine(cfg, BLOCKS, init=[[np.zeros((8, 16)), None], [None]])
    with pytest.raises(ValueError, match=r"argument 'init\[0\]\[0\]' must be C-contiguous"):
        tierzero.Engine(cfg, BLOCKS, init=[[np.zeros((16, 8), np.float32).T, None], [None]])
    with pytest.raises(ValueError, match="'init' has 1 blocks; 'blocks' has 2"):
        tierzero.Engine(cfg, BLOCKS, init=[[None, None]])
    with pytest.raises(ValueError, match=r"init\[0\] has 1 arrays; block 'layer0' has 2 parameters"):
        tierzero.Engine(cfg, BLOCKS, init=[[None], [None]])
    with pytest.raises(ValueError, match="exactly one of config_path and config_json"):
        _core.Engine(config_path="/x.json", config_json="{}", blocks=BLOCKS)
    with pytest.raises(ValueError, match="a config .* is required"):
        tierzero.Engine(None, BLOCKS)


def test_engine_init_takes_read_only_and_requires_grad_arrays(nvme_dir, rng):
    w = rng.standard_normal((8, 16)).astype(np.float32)
    w.flags.writeable = False
    b = torch.randn(8, requires_grad=True)
    w1 = torch.randn(4, 8)
    eng = tierzero.Engine(host_config(nvme_dir), BLOCKS, init=[[w, b], [w1]])
    got = eng.master_params(0)
    np.testing.assert_array_equal(got[0], w)
    np.testing.assert_array_equal(got[1], b.detach().numpy())
    np.testing.assert_array_equal(eng.master_params(1)[0], w1.numpy())


def test_engine_blocks_as_a_dict(nvme_dir, rng):
    shapes = {"enc": {"w": (int(rng.integers(1, 9)), 3), "b": (5,)}, "dec": {"v": [7]}}
    eng = tierzero.Engine(host_config(nvme_dir), shapes)
    assert [b["name"] for b in eng.layout] == ["enc", "dec"]
    assert [(p["name"], p["shape"]) for p in eng.layout[0]["params"]] == [("w", shapes["enc"]["w"]), ("b", (5,))]
    assert eng.blocks == 2


def test_gathered_block_param_out_of_range_and_gather_master_is_a_copy(nvme_dir, rng):
    w = rng.standard_normal((8, 16)).astype(np.float32)
    eng = tierzero.Engine(host_config(nvme_dir), BLOCKS, init=[[w, None], [None]])
    g = eng.fetch(0)
    with pytest.raises(ValueError, match=r"GatheredBlock.param\(2\): block 'layer0' has 2 parameters"):
        g.param(2)
    assert g.data.__dlpack_device__() == (1, 0)  # kDLCPU, device 0
    del g
    m = eng.gather_master(0)
    m[:] = rng.standard_normal(m.size)
    np.testing.assert_array_equal(eng.master_params(0)[0], w)  # the engine's copy is untouched
    with pytest.raises(ValueError, match="block 9 does not exist"):
        eng.gather_master(9)


def test_reduce_grads_accumulates_within_a_micro_batch(nvme_dir, rng):
    eng = tierzero.Engine(host_config(nvme_dir), BLOCKS)
    assert eng.grad_dtype == "float32"
    g1 = rng.standard_normal((4, 8)).astype(np.float32)
    g2 = rng.standard_normal((4, 8)).astype(np.float32)
    g2.flags.writeable = False  # gradients are only read
    eng.reduce_grads(1, [g1])
    eng.reduce_grads(1, [g2])
    report = eng.step()
    assert report["grad_norm"] == pytest.approx(float(np.linalg.norm((g1.astype(np.float64) + g2))), rel=1e-5)


def test_bf16_and_fp16_engines_name_their_dtypes(nvme_dir):
    cfg = host_config(None, offload="none")
    cfg["bf16"] = {"enabled": True}
    eng = tierzero.Engine(cfg, BLOCKS)
    assert (eng.param_dtype, eng.grad_dtype) == ("bfloat16", "bfloat16")
    assert torch.from_dlpack(eng.fetch(1).param(0)).dtype == torch.bfloat16
    with pytest.raises(TypeError, match=r"argument 'grads\[0\] \(layer1.w\)' must be bfloat16; got float32"):
        eng.reduce_grads(1, [torch.ones(4, 8)])
    cfg = host_config(None, offload="none")
    cfg["fp16"] = {"enabled": True}
    eng = tierzero.Engine(cfg, BLOCKS)
    assert (eng.param_dtype, eng.grad_dtype) == ("float16", "float16") and eng.loss_scale > 1.0


def test_engine_refusals_for_lr_and_paths(nvme_dir, tmp_path):
    eng = tierzero.Engine(host_config(nvme_dir), BLOCKS)
    with pytest.raises(ValueError, match="learning rate = nan"):
        eng.set_learning_rate(float("nan"))
    bad = tmp_path / "missing" / "m.safetensors"
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "missing")):
        eng.export_safetensors(bad)


# ---------------------------------------------------------------- tierzero.optim

def test_optim_simd_and_param16_before_a_step():
    p = torch.nn.Parameter(torch.randn(10))
    opt = tzo.Adagrad([p], param16_dtype=torch.float16)
    assert opt.simd in _core.simd_variants()
    with pytest.raises(KeyError, match="has not been stepped yet"):
        opt.param16(p)
    p.grad = torch.randn(10)
    opt.step()
    out = opt.param16(p)
    assert out.dtype == torch.float16 and torch.equal(out, p.detach().half())


@pytest.mark.parametrize("gdtype", [torch.bfloat16, torch.float16])
def test_optim_16_bit_gradients_step_like_torch_on_the_upcast_gradient(gdtype):
    torch.manual_seed(int(gdtype.itemsize) + 11)
    a = torch.nn.Parameter(torch.randn(300))
    b = torch.nn.Parameter(a.detach().clone())
    if hasattr(a, "grad_dtype"):
        a.grad_dtype = None  # torch >= 2.9 checks .grad's dtype against grad_dtype
    ours, theirs = tzo.AdamW([a], lr=1e-2), torch.optim.AdamW([b], lr=1e-2)
    for _ in range(3):
        g = torch.randn(300).to(gdtype)
        a.grad, b.grad = g, g.float()
        ours.step()
        theirs.step()
    torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=2e-6)


def test_optim_refuses_sparse_gradients_and_unsupported_flags():
    p = torch.nn.Parameter(torch.randn(5))
    p.grad = torch.randn(5).to_sparse()
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\]\[0\] has a sparse gradient"):
        tzo.AdamW([p]).step()
    q = torch.nn.Parameter(torch.ones(3))
    q.grad = torch.ones(3)
    for flag in ("capturable", "differentiable"):
        with pytest.raises(ValueError, match=rf"\['{flag}'\] = True is not supported"):
            tzo.Adam([{"params": [q], flag: True}]).step()


# ---------------------------------------------------------------- tierzero.torch

def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def test_torch_engine_facts_and_train_mode():
    model = _mlp()
    engine, *_ = tzt.initialize(model, host_config(None))
    assert engine.loss_scale == 1.0 == engine._core.loss_scale
    assert "ZeRO stage 3" in engine.describe()
    assert engine.device == torch.device("cpu") and (engine.rank, engine.world_size) == (0, 1)
    assert engine.eval() is engine and not model.training
    assert engine.train() is engine and model.training


def test_engine_optimizer_refusals():
    engine, opt, _, _ = tzt.initialize(_mlp(), host_config(None))
    with pytest.raises(ValueError, match="not a state_dict.. of a tierzero engine's optimizer.*engine.load_checkpoint"):
        opt.load_state_dict(torch.optim.AdamW(_mlp().parameters()).state_dict())
    with pytest.raises(ValueError, match="closures are not supported"):
        opt.step(lambda: 0.0)
    assert opt.zero_grad() is None
    del engine
    gc.collect()
    with pytest.raises(ValueError, match="its engine is gone"):
        opt.step()


def test_initialize_model_parameters():
    model = _mlp()
    engine, *_ = tzt.initialize(model, host_config(None), model_parameters=model.parameters())
    assert engine.block_names == ["0", "2"]
    with pytest.raises(ValueError, match="model_parameters must be the model's trainable parameters, each once"):
        tzt.initialize(_mlp(), host_config(None), model_parameters=_mlp().parameters())


# ---------------------------------------------------------------- empty and read-only arrays
# An array with no elements is contiguous (numpy and torch say so), and a
# read-only array where the call writes is refused by name.

@pytest.mark.parametrize("make", [lambda: np.zeros(0, np.uint8), lambda: np.zeros((3, 0), np.float32),
                                  lambda: torch.zeros(4, 0)])
def test_empty_arrays_are_contiguous(make):
    a = make()
    assert (a.flags["C_CONTIGUOUS"] if isinstance(a, np.ndarray) else a.is_contiguous())
    assert tzn.checksum(a) == tzn.checksum(np.zeros(0, np.uint8))  # no bytes: the checksum of nothing


def test_cpu_optimizer_steps_an_empty_array():
    z = lambda: np.zeros(0, np.float32)  # noqa: E731
    _core.CpuOptimizer(threads=1).step(_core.Hyper(), 1, 1.0, z(), z(), z(), z())


def test_tierzero_optim_takes_a_zero_size_parameter_as_torch_does():
    rng = np.random.default_rng()
    empty = torch.nn.Parameter(torch.zeros(int(rng.integers(1, 8)), 0))
    p = torch.nn.Parameter(torch.from_numpy(rng.standard_normal(5).astype(np.float32)))
    q = torch.nn.Parameter(p.detach().clone())
    ours, theirs = tzo.AdamW([empty, p], lr=1e-2), torch.optim.AdamW([q], lr=1e-2)
    empty.grad = torch.zeros_like(empty)
    p.grad = q.grad = torch.randn(5)
    theirs.step()
    ours.step()
    torch.testing.assert_close(p.detach(), q.detach())


def _ro(n, dtype=np.float32):
    a = np.zeros(n, dtype)
    a.flags.writeable = False
    return a


READ_ONLY = "is read-only, and the call writes it; pass a writable array"


def test_read_only_arrays_where_the_call_writes_are_refused_by_name():
    z = lambda: np.zeros(16, np.float32)  # noqa: E731
    opt, ams = _core.CpuOptimizer(threads=1), _core.Hyper(amsgrad=True)
    for i, arg in [(0, "param"), (2, "exp_avg"), (3, "exp_avg_sq"), (4, "max_exp_avg_sq")]:
        arrays = [z() for _ in range(5)]
        arrays[i] = _ro(16)
        with pytest.raises(TypeError, match=rf"CpuOptimizer.step\(\): argument '{arg}' {READ_ONLY}"):
            opt.step(ams, 1, 1.0, *arrays)
    with pytest.raises(TypeError, match=rf"argument 'param16' {READ_ONLY}"):
        opt.step(_core.Hyper(), 1, 1.0, z(), z(), z(), z(), param16=_ro(16, np.float16))
    with pytest.raises(TypeError, match=rf"accumulate_grad\(\): argument 'acc' {READ_ONLY}"):
        opt.accumulate_grad(_ro(16), z())
    eng = tzn.IoEngine()
    for call in (eng.register_buffer, eng.unregister_buffer):
        with pytest.raises(TypeError, match=rf"argument 'buffer' {READ_ONLY}"):
            call(_ro(4096, np.uint8))
    with pytest.raises(TypeError, match=r"argument 'param' must be a writable array .*; got list"):
        opt.step(_core.Hyper(), 1, 1.0, [0.0] * 16, z(), z(), z())


# ---------------------------------------------------------------- wrong device (CUDA)
# Every CPU-only array argument refuses GPU memory by name; pinned host memory
# is CPU memory.

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
ON_GPU = r"must be on cpu; it is on cuda:0"


def cuda(n, dtype=torch.float32):
    return torch.zeros(n, dtype=dtype, device="cuda")


@needs_cuda
def test_cpu_kernels_refuse_gpu_arrays_by_name():
    opt, h = _core.CpuOptimizer(threads=1), _core.Hyper(amsgrad=True)
    z = lambda: np.zeros(64, np.float32)  # noqa: E731
    for i, arg in enumerate(["param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"]):
        arrays = [z() for _ in range(5)]
        arrays[i] = cuda(64)
        with pytest.raises(TypeError, match=rf"argument '{arg}' {ON_GPU}"):
            opt.step(h, 1, 1.0, *arrays)
    with pytest.raises(TypeError, match=rf"argument 'param16' {ON_GPU}"):
        opt.step(_core.Hyper(), 1, 1.0, z(), z(), z(), z(), param16=cuda(64, torch.bfloat16))
    with pytest.raises(TypeError, match=rf"argument 'acc' {ON_GPU}"):
        opt.accumulate_grad(cuda(64), z())
    with pytest.raises(TypeError, match=rf"argument 'grad' {ON_GPU}"):
        opt.accumulate_grad(z(), cuda(64))


@needs_cuda
def test_nvme_calls_refuse_gpu_buffers_by_name(nvme_dir):
    eng = tzn.IoEngine()
    f = eng.open(f"{nvme_dir}/x.bin", create=True, size_bytes=1 << 20)
    with pytest.raises(TypeError, match=rf"IoEngine.submit\(\): argument 'buffer' {ON_GPU}"):
        eng.submit("write", cuda(4096, torch.uint8), [(f, 0, 4096)])
    with pytest.raises(TypeError, match=rf"argument 'buffer' {ON_GPU}"):
        eng.register_buffer(cuda(4096, torch.uint8))
    with pytest.raises(TypeError, match=rf"checksum\(\): argument 'data' {ON_GPU}"):
        tzn.checksum(cuda(16))
    store = tzn.SwapStore([nvme_dir], capacity_bytes=1 << 20)
    e = store.allocate(4096)
    with pytest.raises(TypeError, match=rf"SwapStore.write\(\): argument 'buffer' {ON_GPU}"):
        store.write(e, cuda(store.padded_bytes(4096), torch.uint8))


@needs_cuda
def test_engine_init_refuses_gpu_arrays_by_name(nvme_dir):
    blocks = [("l0", [("w", (4, 4))])]
    with pytest.raises(TypeError, match=rf"Engine\(\): argument 'init\[0\]\[0\]' {ON_GPU}"):
        tierzero.Engine(host_config(nvme_dir), blocks, init=[[cuda(16)]])


@needs_cuda
def test_pinned_host_memory_counts_as_cpu():
    p = torch.ones(64).pin_memory()
    g, m, v = torch.ones(64).pin_memory(), torch.zeros(64), torch.zeros(64)
    _core.CpuOptimizer(threads=1).step(_core.Hyper(), 1, 1.0, p, g, m, v)
    assert bool((p < 1).all())


# ---------------------------------------------------------------- array lifetime

class _OwnsItsMemory:
    """An array known only by __dlpack__, whose capsule owns the memory (a fresh array each call)."""

    def __init__(self, value, n):
        self.value, self.n = value, n

    def __dlpack__(self, stream=None, **kwargs):
        return np.full(self.n, self.value, np.float32).__dlpack__()

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU


def test_a_written_array_whose_capsule_owns_its_memory_lives_through_the_call(rng):
    # The imported array is held for the whole call (it was dropped before the kernel ran: a use-after-free).
    n = 1 << 22
    value = float(rng.uniform(0.5, 2.0))
    grad = rng.standard_normal(n).astype(np.float32)
    sumsq, bad = _core.CpuOptimizer(threads=1).accumulate_grad(_OwnsItsMemory(value, n), grad, scale=1.0)
    want = ((np.float32(value) + grad).astype(np.float64) ** 2).sum()
    assert sumsq == pytest.approx(want, rel=1e-5) and bad is False


def test_export_names_must_be_one_list_per_block(nvme_dir, tmp_path):
    eng = tierzero.Engine(host_config(nvme_dir), BLOCKS)
    with pytest.raises(TypeError, match=r"names\[1\] is the string 'w'"):
        eng.export_safetensors(tmp_path / "x.safetensors", names=[["w", "b"], "w"])
    with pytest.raises(TypeError, match="one list of names per block"):
        eng.export_safetensors(tmp_path / "x.safetensors", names=[])
    with pytest.raises(ValueError, match="names is empty"):
        eng._core.export_safetensors(str(tmp_path / "x.safetensors"), [])
    assert not (tmp_path / "x.safetensors").exists()
