"""bindings/nvme.cpp and tierzero.nvme: the I/O engine, the swap store and the benchmark over caller buffers."""

import gc
import os
import threading
import time

import numpy as np
import pytest
import torch

import tierzero.nvme as tzn

MiB = 1 << 20


def test_write_then_read_round_trips_through_numpy_and_torch(nvme_dir):
    eng = tzn.IoEngine(queue_depth=8)
    f = eng.open(os.path.join(nvme_dir, "x.bin"), create=True, size_bytes=4 * MiB)
    info = eng.file_info(f)
    assert info["direct"] is True and info["mem_align"] >= 1
    src = tzn.aligned_empty(2 * MiB)
    src[:] = np.random.default_rng(0).integers(0, 256, src.size, dtype=np.uint8)
    eng.write(f, MiB, src).wait()
    dst = tzn.aligned_empty(2 * MiB, torch=True)  # a torch tensor: read in place through DLPack
    eng.read(f, MiB, dst).wait()
    assert np.array_equal(dst.numpy(), src)
    stats = eng.stats()
    assert stats["bytes_written"] == 2 * MiB and stats["bytes_read"] == 2 * MiB
    eng.close(f)
    assert eng.backend in ("io_uring", "threads") and eng.describe()


def test_segments_stripe_one_buffer_over_files(nvme_dir):
    eng = tzn.IoEngine()
    files = [eng.open(os.path.join(nvme_dir, f"s{i}.bin"), create=True, size_bytes=MiB) for i in range(2)]
    buf = tzn.aligned_empty(2 * MiB)
    buf[:MiB], buf[MiB:] = 1, 2
    eng.submit("write", buf, [(files[0], 0, MiB), (files[1], 0, MiB)]).wait()
    back = tzn.aligned_empty(MiB)
    eng.read(files[1], 0, back).wait()
    assert (back == 2).all()


def test_misaligned_o_direct_request_is_a_value_error(nvme_dir):
    eng = tzn.IoEngine()
    f = eng.open(os.path.join(nvme_dir, "m.bin"), create=True, size_bytes=MiB)
    buf = tzn.aligned_empty(4096 + 1)[1:]
    with pytest.raises(ValueError, match="align"):
        eng.write(f, 0, buf).wait()
    with pytest.raises(ValueError, match="segments cover 4096 bytes; 'buffer' has 8192"):
        eng.submit("write", tzn.aligned_empty(8192), [(f, 0, 4096)])
    with pytest.raises(ValueError, match=r"segment 0 \(length 8192\) runs past the end of 'buffer' \(4096 bytes\)"):
        eng.submit("write", tzn.aligned_empty(4096), [(f, 0, 8192)])


def test_missing_file_is_file_not_found(nvme_dir):
    eng = tzn.IoEngine()
    missing = os.path.join(nvme_dir, "nope", "x.bin")
    with pytest.raises(FileNotFoundError, match="nope"):
        eng.open(missing)


def test_future_keeps_its_buffer_alive_and_waits_when_dropped(nvme_dir):
    eng = tzn.IoEngine()
    f = eng.open(os.path.join(nvme_dir, "k.bin"), create=True, size_bytes=8 * MiB)
    buf = tzn.aligned_empty(8 * MiB)
    buf[:] = 7
    fut = eng.write(f, 0, buf)
    del buf
    gc.collect()
    fut.wait()  # the write finished from memory the future kept alive
    back = tzn.aligned_empty(8 * MiB)
    eng.read(f, 0, back)  # dropped at once: its destructor waits for the read
    gc.collect()
    assert (back == 7).all()


def test_wait_releases_the_gil(nvme_dir):
    eng = tzn.IoEngine(queue_depth=4)
    f = eng.open(os.path.join(nvme_dir, "g.bin"), create=True, size_bytes=256 * MiB)
    buf = tzn.aligned_empty(256 * MiB)
    buf[:] = 1
    ticks, done = 0, threading.Event()
    th = threading.Thread(target=lambda: (eng.write(f, 0, buf).wait(), done.set()))
    th.start()
    while not done.is_set():
        ticks += 1
        time.sleep(0.0005)
    th.join()
    assert ticks >= 2


def test_swap_store_round_trip_and_placement(nvme_dir):
    store = tzn.SwapStore([nvme_dir], capacity_bytes=64 * MiB)
    n = 3 * MiB + 100
    e = store.allocate(n)
    assert store.extent_bytes(e) == n and store.padded_bytes(n) % 4096 == 0
    buf = tzn.aligned_empty(store.padded_bytes(n), store.buffer_alignment)
    buf[:] = np.arange(buf.size, dtype=np.uint64).astype(np.uint8)
    store.write(e, buf).wait()
    back = tzn.aligned_empty(buf.size, store.buffer_alignment, torch=True)
    store.read(e, back).wait()
    assert np.array_equal(back.numpy(), buf)
    (path, offset, nbytes), = store.placement(e)
    assert path in store.file_paths() and nbytes == buf.size
    assert store.stats()["bytes_written"] == buf.size
    store.free(e)
    assert store.stats()["extents"] == 0


def test_swap_store_detects_a_flipped_byte(nvme_dir):
    store = tzn.SwapStore([nvme_dir], capacity_bytes=16 * MiB)
    e = store.allocate(MiB)
    buf = tzn.aligned_empty(MiB)
    buf[:] = 3
    store.write(e, buf).wait()
    (path, offset, _), = store.placement(e)
    with open(path, "r+b") as f:
        f.seek(offset + 12345)
        f.write(b"\x99")
    os.sync()
    with pytest.raises(OSError) as info:
        store.read(e, buf).wait()
    assert info.value.code == "DataCorruption" and path in str(info.value)


def test_swap_store_full_and_wrong_buffer_size(nvme_dir):
    store = tzn.SwapStore([nvme_dir], capacity_bytes=4 * MiB)
    store.allocate(3 * MiB)
    with pytest.raises(OSError) as info:
        store.allocate(2 * MiB)
    assert info.value.code == "NoSpace"
    e = store.allocate(4096)
    with pytest.raises(ValueError, match=r"'buffer' has 100 bytes; extent \d+ needs padded_bytes = 4096"):
        store.write(e, tzn.aligned_empty(100))


def test_checksum_is_xxh3_of_the_bytes():
    a = np.arange(1000, dtype=np.float32)
    assert tzn.checksum(a) == tzn.checksum(torch.arange(1000, dtype=torch.float32))
    assert tzn.checksum(a) != tzn.checksum(a[::-1].copy())


def test_benchmark_runs_the_program_and_returns_its_json(nvme_dir):
    result = tzn.benchmark([nvme_dir], size="64MiB", ops="write,read", args=["--repeats", "1"], timeout=300)
    assert result["command"][0] == tzn.find_benchmark()
    assert result["benchmark"] == "tierzero-nvme-bench" and result["config"]["size"] == "64MiB"
    assert result["paths"][0]["path"] == nvme_dir and result["fill"]["gbps"] > 0
    assert {r["workload"] for r in result["plain"]} >= {"write", "read"} and result["stdout"]
    assert not [f for f in os.listdir(nvme_dir) if f.startswith("tierzero-nvme-bench")], "scratch files left behind"


def test_benchmark_missing_program_is_file_not_found():
    with pytest.raises(FileNotFoundError, match="tierzero-nvme-bench not found"):
        tzn.benchmark(["/tmp"], executable="/nonexistent/tierzero-nvme-bench")
