"""Shared fixtures for the tierzero Python tests (pytest).

The tests import the installed package (scripts/test.sh runs `pip install .`
first). NVMe tests need a directory where O_DIRECT really works: pytest's
tmp_path when it does, else one under /var/tmp, else $TIERZERO_TEST_NVME_DIR.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

import tierzero

tierzero.set_log_level(os.environ.get("TIERZERO_LOG", "warn"))


def pytest_configure(config):
    # The fault suite's Python part (issue #23, docs/faults.md): pytest -m fault.
    config.addinivalue_line("markers", "fault: causes a fault and checks the error or the recovery, and that nothing "
                                       "is left behind (the fault suite, docs/faults.md)")


def _o_direct(path: str) -> bool:
    try:
        return bool(tierzero._core.probe_path(path)["o_direct"])
    except OSError:
        return False


@pytest.fixture
def nvme_dir(tmp_path):
    """A fresh directory on a file system with real O_DIRECT (the NVMe tier's requirement)."""
    if _o_direct(str(tmp_path)):
        yield str(tmp_path)
        return
    for base in (os.environ.get("TIERZERO_TEST_NVME_DIR"), "/var/tmp", os.getcwd()):
        if base and os.path.isdir(base) and _o_direct(base):
            d = tempfile.mkdtemp(prefix="tierzero-pytest-", dir=base)
            yield d
            shutil.rmtree(d, ignore_errors=True)
            return
    pytest.fail("no directory with working O_DIRECT found: set TIERZERO_TEST_NVME_DIR")


def host_config(nvme: str | None = None, *, stage: int = 3, gas: int = 1, offload: str = "nvme",
                lr: float = 1e-2, clip: float = 0.0, optimizer: str = "AdamW", weight_decay: float = 0.01,
                backend: str = "host") -> dict:
    """A DeepSpeed-style config on the Host backend (or `backend`); with `nvme`, params and optimizer offloaded there."""
    zero: dict = {"stage": stage, "stage3_param_persistence_threshold": 0, "sub_group_size": 50_000}
    if nvme is not None and offload == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": optimizer, "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                    "weight_decay": weight_decay}},
        "zero_optimization": zero,
        "tierzero": {"backend": backend, "tiers": {"gpu_bytes": "256MiB", "cpu_bytes": "512MiB", "nvme_bytes": "2GiB"}},
    }
    if clip:
        cfg["gradient_clipping"] = clip
    return cfg


@pytest.fixture
def config_factory():
    return host_config


def swap_files(folder: str) -> list:
    """The NVMe swap files in `folder` (tierzero-swap-*.bin: Note [Swap file ownership])."""
    return [f for f in os.listdir(folder) if f.startswith("tierzero-swap-")]


# Appended to a script: prints how many swap files sys.argv[2] holds when the script's own work is done.
_COUNT_SWAP_FILES = ("\nimport os as _os, sys as _sys\n"
                     "print(len([f for f in _os.listdir(_sys.argv[2]) if f.startswith('tierzero-swap-')]))\n")


def swap_files_while_a_script_runs(code: str, config: dict, nvme: str) -> int:
    """Runs `code` in a fresh interpreter (sys.argv[1]: `config` as JSON, sys.argv[2]: `nvme`), which exits
    as it likes; returns how many swap files `nvme` held just before it exited."""
    out = subprocess.run([sys.executable, "-c", code + _COUNT_SWAP_FILES, json.dumps(config), nvme], check=True,
                         timeout=120, capture_output=True, text=True).stdout
    return int(out.split()[-1])
