"""bindings/module.cpp: the module itself, the package's lazy submodules, import order."""

import json
import subprocess
import sys

import pytest

import tierzero
from conftest import host_config
from tierzero import _core


def test_version_and_build_summary():
    assert tierzero.__version__ == _core.__version__
    assert tierzero.__version__.count(".") == 2
    summary = _core.build_summary()
    assert tierzero.__version__ in summary and "CUDA" in summary


def test_set_log_level_accepts_specs_and_refuses_garbage():
    tierzero.set_log_level("warn,nvme=error")
    with pytest.raises(ValueError, match="log spec 'loud'"):
        tierzero.set_log_level("loud")
    tierzero.set_log_level("warn")


def test_submodules_are_loaded_on_first_use():
    code = "import sys, tierzero; assert 'torch' not in sys.modules; tierzero.optim; assert 'torch' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("order", ["import tierzero, torch", "import torch, tierzero"])
def test_tierzero_and_torch_import_in_either_order(order):
    # Note [One libnccl per process]: a CUDA build loads libnccl, and torch links it.
    subprocess.run([sys.executable, "-c", order + "; torch.zeros(1)"], check=True, timeout=120)


def test_a_cpu_engine_maps_no_cuda_library():
    # Note [CUDA libraries load on first use]: cuBLAS and NCCL load when a CUDA
    # GPT or an NCCL communicator is made, never for the CPU. In a child, as
    # torch (imported by other tests) maps its own.
    code = """
import json, re, sys, tierzero
engine = tierzero.Engine(json.loads(sys.argv[1]), [("b", [("w", (64, 64))])])
maps = open("/proc/self/maps").read()
assert "_core" in maps, "the extension is not in /proc/self/maps"
print(sorted(set(re.findall(r"/(lib(?:cudart|cublas|cublasLt|nccl)[.]so[^/\\s]*)", maps))))
engine.close()
"""
    out = subprocess.run([sys.executable, "-c", code, json.dumps(host_config())], timeout=120, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_unknown_attribute():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        tierzero.nope  # noqa: B018
