"""Bad input found by hunting for it (helper-14): each once crashed, hung, or was taken silently; now each is
refused with a message that names the problem, and nothing is written."""

import math
import os

import numpy as np
import pytest
import torch

import tierzero
import tierzero.nvme as tzn
import tierzero.optim as tzo
from conftest import host_config

MiB = 1 << 20


def test_io_segments_past_the_buffer_are_refused(nvme_dir):
    eng = tzn.IoEngine()
    f = eng.open(os.path.join(nvme_dir, "x.bin"), create=True, size_bytes=MiB)
    buf = tzn.aligned_empty(4096)
    # The lengths summed past 2^64 to the buffer's size: a hang (threads) or std::bad_alloc (io_uring).
    with pytest.raises(ValueError, match=r"segment 0 \(length 18446744073709547520\) runs past the end of 'buffer'"):
        eng.submit("read", buf, [(f, 0, 2**64 - 4096), (f, 0, 8192)])
    fut = eng.submit("write", buf, [(f, 0, 4096)])
    fut.wait(timeout=math.inf)  # forever, not a TimeoutError after a negative number of milliseconds
    with pytest.raises(ValueError, match="timeout nan must be a number of seconds >= 0"):
        eng.submit("read", buf, [(f, 0, 4096)]).wait(timeout=math.nan)


def test_an_extent_larger_than_the_store_is_refused(nvme_dir):
    store = tzn.SwapStore([nvme_dir], capacity_bytes=4 * MiB)
    with pytest.raises(OSError, match="larger than the whole store"):  # it wrapped to a 0-byte extent
        store.allocate(2**64 - 1)


def test_paths_with_a_nul_character_are_refused(nvme_dir, tmp_path):
    eng = tierzero.Engine(host_config(nvme_dir), [("layer", [("w", (4, 4))])])
    out = tmp_path / "out"
    out.mkdir()
    for call in (lambda p: eng.export_safetensors(p), lambda p: eng.save_checkpoint(p), eng.write_timeline):
        with pytest.raises(ValueError, match="has a NUL character"):  # the path was cut short at the NUL
            call(str(out / "a\0b"))
    assert os.listdir(out) == []
    config = host_config(nvme_dir)
    config["zero_optimization"]["offload_param"]["nvme_path"] = nvme_dir + "\0x"
    with pytest.raises(ValueError, match="nvme_path.*NUL"):
        tierzero.Engine(config, [("layer", [("w", (4, 4))])])


def test_export_refuses_the_name_safetensors_reserves(nvme_dir, tmp_path):
    eng = tierzero.Engine(host_config(nvme_dir), [("layer", [("w", (4, 4))])])
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match="'__metadata__', which the safetensors format reserves"):
        eng.export_safetensors(out / "m.safetensors", names=[["__metadata__"]])
    assert os.listdir(out) == []


def test_shapes_that_are_not_whole_or_overflow_are_refused(nvme_dir):
    with pytest.raises(ValueError, match=r"layer.w has dimension 2.7, which is not a whole number"):
        tierzero.Engine(host_config(nvme_dir), [("layer", [("w", (4, 2.7))])])
    with pytest.raises(ValueError, match=r"has more than 2\^50 elements"):  # wrapped to 0 elements once
        tierzero.Engine(host_config(nvme_dir), [("a", [("w", (2**32, 2**32)), ("b", (4,))])])


def test_link_speeds_must_be_positive():
    for bad in (0, -5, math.nan):  # each once meant "use the default" without a word
        with pytest.raises(ValueError, match="pcie = .* GB/s must be a finite number > 0"):
            tierzero.estimate("1B", gpu="8GB", cpu="64GB", nvme="1TB", links_gbps={"pcie": bad})


def test_optimizer_hyperparameters_and_foreign_state_dicts_are_refused():
    p = torch.nn.Parameter(torch.randn(8))
    with pytest.raises(ValueError, match="initial_accumulator_value = -1 must be >= 0"):
        tzo.Adagrad([p], initial_accumulator_value=-1)  # stepped weights to ~-1e8
    p.grad = torch.randn(8)
    adam = torch.optim.Adam([p])
    adam.step()
    lion = tzo.Lion([p])
    with pytest.raises(ValueError, match=r"state\[0\] holds \['exp_avg', 'exp_avg_sq', 'step'\]; Lion keeps "
                                         r"\['exp_avg', 'step'\]"):
        lion.load_state_dict(adam.state_dict())  # once loaded silently, Adam's moment taken as Lion's
    adagrad = torch.optim.Adagrad([p])
    with pytest.raises(ValueError, match=r"param_groups\[0\] has no \['amsgrad', 'betas'\]"):
        tzo.AdamW([p]).load_state_dict(adagrad.state_dict())  # a bare KeyError 'betas' at the next step
    ours = tzo.AdamW([p])
    ours.load_state_dict(torch.optim.AdamW([p]).state_dict())  # torch's own AdamW still loads
    assert np.isfinite(p.detach().numpy()).all()
