"""bindings/module.cpp: the module itself, the package's lazy submodules, import order."""

import subprocess
import sys

import pytest

import tierzero
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
    # Note [One libnccl per process]: a CUDA build links libnccl, and so does torch.
    subprocess.run([sys.executable, "-c", order + "; torch.zeros(1)"], check=True, timeout=120)


def test_unknown_attribute():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        tierzero.nope  # noqa: B018
