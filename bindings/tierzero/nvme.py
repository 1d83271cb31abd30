"""tierzero.nvme: the NVMe tier from Python, and its benchmark.

    eng = tierzero.nvme.IoEngine(queue_depth=32)
    f = eng.open("/nvme0/x.bin", create=True, size_bytes=1 << 30)
    buf = tierzero.nvme.aligned_empty(1 << 20)           # numpy uint8, 4 KiB aligned (O_DIRECT)
    eng.write(f, 0, buf).wait()

    store = tierzero.nvme.SwapStore(["/nvme0/tz", "/nvme1/tz"], capacity_bytes=64 << 30)
    e = store.allocate(n); store.write(e, buf).wait(); store.read(e, buf).wait()

    result = tierzero.nvme.benchmark(["/nvme0/tz"], size="4GiB")   # tierzero-nvme-bench --json

Buffers are any contiguous CPU array (numpy, torch, anything with
__dlpack__), used in place; an IoFuture keeps its buffer alive until the
request completes. O_DIRECT wants buffers, offsets and lengths aligned to the
file's alignment (file_info()["mem_align"], 4 KiB on most drives):
aligned_empty() makes such buffers.

The benchmark runs the `tierzero-nvme-bench` program and returns its JSON
rather than binding its code: it is a program by design (it installs
SIGINT/SIGTERM handlers that remove its scratch files and exit, runs fio as a
child process, and can run for minutes), none of which belongs inside the
caller's interpreter; a child process can be timed out and killed cleanly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from typing import Any, Optional, Sequence, Union

import numpy as np

from . import _core

__all__ = ["IoEngine", "IoFuture", "SwapStore", "aligned_empty", "benchmark", "find_benchmark", "checksum"]

IoFuture = _core.IoFuture
SwapStore = _core.SwapStore
checksum = _core.checksum


def aligned_empty(nbytes: int, alignment: int = 4096, *, torch: bool = False) -> Any:
    """An uninitialised uint8 array of nbytes whose first byte is aligned (numpy, or a torch tensor sharing it)."""
    if nbytes < 0 or alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"aligned_empty(nbytes={nbytes}, alignment={alignment}): need nbytes >= 0 and a power-of-two "
                         "alignment")
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = (-raw.ctypes.data) % alignment
    out = raw[start:start + nbytes]  # a view: keeps `raw` alive
    if torch:
        import torch as _torch
        return _torch.from_numpy(out)
    return out


class IoEngine(_core.IoEngine):
    """Asynchronous file I/O (io_uring with O_DIRECT, or a pread/pwrite pool where io_uring is refused)."""

    def read(self, file: int, offset: int, buffer: Any) -> IoFuture:
        """Queues a read of buffer.nbytes bytes at offset into buffer."""
        return self.submit("read", buffer, [(file, offset, _nbytes(buffer))])

    def write(self, file: int, offset: int, buffer: Any) -> IoFuture:
        """Queues a write of the buffer's bytes at offset."""
        return self.submit("write", buffer, [(file, offset, _nbytes(buffer))])


def _nbytes(buffer: Any) -> int:
    if hasattr(buffer, "nbytes"):
        return int(buffer.nbytes)
    if hasattr(buffer, "element_size"):  # torch.Tensor
        return int(buffer.numel() * buffer.element_size())
    raise TypeError(f"buffer: expected an array (numpy, torch, ...); got {type(buffer).__name__}")


def find_benchmark(executable: Optional[str] = None) -> str:
    """The tierzero-nvme-bench to run: `executable`, else $TIERZERO_NVME_BENCH, else the one on PATH."""
    candidate = executable or os.environ.get("TIERZERO_NVME_BENCH") or shutil.which("tierzero-nvme-bench")
    if not candidate or not os.path.isfile(candidate) or not os.access(candidate, os.X_OK):
        where = f"'{candidate}'" if candidate else "on PATH"
        raise FileNotFoundError(
            f"tierzero-nvme-bench not found ({where}): build it (cmake --build build --target tierzero-nvme-bench), "
            "install it (cmake --install build), or pass executable= / set TIERZERO_NVME_BENCH")
    return candidate


def benchmark(paths: Sequence[Union[str, os.PathLike]], size: str = "1GiB", *, ops: str = "write,read",
              args: Sequence[str] = (), executable: Optional[str] = None, timeout: Optional[float] = None) -> dict:
    """Runs tierzero-nvme-bench on `paths` and returns its JSON report as a dict.

    ops: the workloads (write, read, randwrite, randread, swap); args: any
    other flags of the program (e.g. ["--compare-fio"], ["--tune"],
    ["--repeats", "1"]). The table the program prints is in result["stdout"].
    Raises FileNotFoundError when the program is missing, TimeoutError past
    `timeout` seconds (the program is killed and removes its scratch files),
    and RuntimeError with its stderr when it fails.
    """
    exe = find_benchmark(executable)
    with tempfile.TemporaryDirectory(prefix="tierzero-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [exe, "--size", str(size), "--ops", ops, "--json", out, *map(str, args)]
        for p in paths:
            cmd += ["--path", os.fspath(p)]
        stdout, stderr, code = _run(cmd, timeout)
        if code != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited with {code}: {stderr.strip()[-2000:]}")
        with open(out, encoding="utf-8") as f:
            result = json.load(f)
    result["stdout"] = stdout
    result["command"] = cmd
    return result


def _run(cmd: list, timeout: Optional[float]) -> tuple[str, str, int]:
    # SIGTERM on timeout, not SIGKILL: the program's handler removes its scratch files.
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            proc.terminate()
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            raise TimeoutError(f"{' '.join(cmd)}: still running after {timeout} s; stopped") from e
        return stdout, stderr, proc.returncode
