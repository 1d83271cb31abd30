"""The tools `pip install` puts in the environment's bin/ (cmake/TierzeroInstall.cmake, pyproject.toml): each
runs from the installed package, and tierzero-info --config says whether a config is valid."""

import json
import os
import pathlib
import subprocess
import sysconfig

import pytest

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"
TOOLS = ("tierzero-info", "tierzero-estimate", "tierzero-nvme-bench", "tierzero-train")


def installed(tool: str) -> str:
    path = os.path.join(sysconfig.get_path("scripts"), tool)
    assert os.access(path, os.X_OK), f"{tool} is not in the environment's bin/ ({path}): pip install . installs it"
    return path


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("tool", TOOLS)
def test_each_tool_is_installed_and_runs(tool):
    out = run(installed(tool), "--help")
    assert out.returncode == 0, out.stderr
    assert "--" in out.stdout and tool.split("-", 1)[1].split("-")[0] in out.stdout.lower()


def test_tierzero_info_says_whether_a_config_is_valid(tmp_path):
    info = installed("tierzero-info")
    good = run(info, "--config", str(FIXTURES / "configs" / "ds_zero_offload_cpu_fp16.json"))
    assert good.returncode == 0, good.stderr
    assert "ds_zero_offload_cpu_fp16.json is valid (ZeRO stage 2, optimizer AdamW;" in good.stdout
    auto = run(info, "--config", str(FIXTURES / "configs" / "hf_trainer_zero3_auto.json"), "--json", "-")
    assert auto.returncode == 1
    report = json.loads(auto.stdout)["config"]
    assert report["loaded"] and not report["valid"] and "optimizer.params.lr" in report["unresolved_auto"]
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": {"stage": 3, "offload_param": {"nvme_pth": "/x"}}}')
    refused = run(info, "--config", str(bad))
    assert refused.returncode == 1
    assert "offload_param.nvme_pth: unknown key; did you mean 'nvme_path'?" in refused.stderr


def test_tierzero_info_names_a_missing_cuda_driver():
    out = run(installed("tierzero-info"))
    assert out.returncode == 0, out.stderr
    cuda = next(line for line in out.stdout.splitlines() if line.startswith("CUDA:"))
    if "driver none" in cuda:  # no libcuda here: said as such, not as an "insufficient" driver
        assert "no CUDA driver" in cuda, cuda


def test_tierzero_train_finds_its_corpus_beside_the_installed_bin():
    corpus = pathlib.Path(installed("tierzero-train")).parent.parent / "share" / "tierzero" / "data" / "kjv.txt"
    assert corpus.read_bytes() == (FIXTURES.parents[1] / "data" / "kjv.txt").read_bytes(), corpus
