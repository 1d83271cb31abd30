"""bindings/store.cpp: ranks meeting through a torch.distributed store (Note [Store rendezvous]).

Ranks here are processes on this machine meeting through a TCPStore and never through a directory; the same
across two hosts (network namespaces, torchrun --nnodes 2) is tests/multinode/torchrun_two_hosts.sh, run below.
"""

import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch.distributed as dist

import tierzero
from conftest import host_config

BLOCKS = [("b0", [("w", (64,))]), ("b1", [("w", (32, 2))])]

WORKER = textwrap.dedent("""
    import datetime, json, os, sys
    import torch.distributed as dist
    import tierzero
    rank, port = int(os.environ["RANK"]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    for attempt in range(2):  # two engines one after another: each takes a fresh namespace in the store
        engine = tierzero.Engine(json.loads(sys.argv[1]), {blocks!r}, store=store, timeout=60)
        assert (engine.rank, engine.world_size) == (rank, 2), (engine.rank, engine.world_size)
        whole = engine.gather_master(0)  # a collective between the two
        assert whole.shape[0] >= 64, whole.shape  # padded to whole runs
        engine.close()
    print("rank", rank, "ok")
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_meet_through_a_tcpstore_and_no_directory(tmp_path):
    port = free_port()
    never = tmp_path / "never-created"
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), TIERZERO_RENDEZVOUS_DIR=str(never),
                   TIERZERO_LOG="info")
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER.format(blocks=BLOCKS),
                                       json.dumps(host_config(None)), str(port)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=180)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank}:\n{out}"
        for n in (1, 2):
            assert f"meets the others through torch TCPStore at 127.0.0.1:{port} (communicator {n})" in out, out
    assert not never.exists(), "the ranks used the rendezvous directory"


def test_a_rank_that_never_arrives_times_out_naming_the_store_and_the_rank(monkeypatch):
    port = free_port()
    for k, v in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(k, v)
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    start = time.monotonic()
    with pytest.raises(TimeoutError) as e:
        tierzero.Engine(host_config(None), BLOCKS, store=store, timeout=2)
    took = time.monotonic() - start
    print(f"after {took:.1f} s: {e.value}")
    assert f"torch TCPStore at 127.0.0.1:{port}" in str(e.value)
    assert "rank 0 of 2" in str(e.value) and "rank(s) 1 to arrive" in str(e.value)
    assert 1.8 <= took <= 10, took


def test_a_store_without_the_store_methods_is_refused(monkeypatch):
    for k, v in dict(RANK="0", WORLD_SIZE="2").items():
        monkeypatch.setenv(k, v)
    with pytest.raises(TypeError, match=r"has no set\(\) method"):
        tierzero.Engine(host_config(None), BLOCKS, store=object(), timeout=2)


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan")])
def test_a_timeout_that_is_not_positive_is_refused(timeout):
    with pytest.raises(ValueError, match=r"timeout=.* must be positive"):
        tierzero.Engine(host_config(None), BLOCKS, timeout=timeout)


def test_torchrun_across_two_hosts_matches_one_host():
    """tests/multinode/torchrun_two_hosts.sh: tierzero.torch under torchrun --nnodes 2 in two network namespaces."""
    script = os.path.join(os.path.dirname(__file__), "..", "multinode", "torchrun_two_hosts.sh")
    # Not under /tmp: each host has its own.
    work = tempfile.mkdtemp(prefix="tz-multinode-", dir="/var/tmp" if os.path.isdir("/var/tmp") else os.getcwd())
    try:
        run = subprocess.run(["bash", script, sys.executable, work], capture_output=True, text=True, timeout=900)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(run.stdout, run.stderr)
    if run.returncode == 77:
        pytest.skip(run.stdout.strip().splitlines()[-1])
    assert run.returncode == 0, run.stdout + run.stderr
    assert "torchrun two hosts ok" in run.stdout
