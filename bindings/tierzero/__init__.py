"""tierzero: train models larger than GPU memory.

ZeRO-partitioned model states tiered over GPU memory, pinned CPU memory and
NVMe, as DeepSpeed ZeRO-Infinity does, in C++ (the extension tierzero._core).

    import tierzero
    tierzero.info()                                  # what this machine can do
    plan, report = tierzero.estimate(params="20B", gpu="80GB", cpu="120GB", nvme="2TB")
    opt = tierzero.optim.AdamW(model.parameters())   # SIMD CPU AdamW, torch.optim interface
    engine, opt = tierzero.torch.initialize(model, config="ds_config.json")

Submodules: tierzero.optim (torch.optim optimizers), tierzero.torch (the
DeepSpeed-style engine for torch models), tierzero.hf (Hugging Face's Trainer
on that engine), tierzero.nvme (the NVMe tier and its benchmark). torch is imported only by the submodules that need it.
docs/python.md describes the package.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Any, Mapping, Sequence, Union

from . import _core
from .engine import Engine

__version__: str = _core.__version__
__all__ = ["info", "describe", "estimate", "check_config", "Engine", "set_log_level", "optim", "nvme", "torch", "hf",
           "__version__"]

ConfigLike = Union[str, os.PathLike, Mapping[str, Any]]


def info(paths: Sequence[Union[str, os.PathLike]] = (), refresh: bool = False) -> dict:
    """The capability probe as a dict (what `tierzero-info --json` prints).

    Keys: version, build, kernel_release, io_uring, cpu, numa_nodes,
    numa_error, memory, cuda; with `paths`, also "paths": one dict per
    directory (file system, device, free space, whether O_DIRECT really works
    there and with what alignment). A path that cannot be probed raises
    (FileNotFoundError / PermissionError / OSError naming it).
    """
    out = {"version": __version__, "build": _core.build_summary()}
    out.update(_core.capabilities(refresh))
    if paths:
        out["paths"] = [_core.probe_path(os.fspath(p)) for p in paths]
    return out


def describe() -> str:
    """The probe as text, as `tierzero-info` prints it."""
    return _core.describe_capabilities()


def set_log_level(spec: str) -> None:
    """Sets tierzero's log levels, as TIERZERO_LOG does ("debug", "warn,nvme=trace"). Logs go to stderr."""
    _core.set_log_level(spec)


def _count(value: Union[int, float, str], what: str) -> int:
    if isinstance(value, str):
        return int(round(_core.parse_count(value)))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1:
        raise ValueError(f"{what} = {value!r}: expected a positive count such as 350e6 or '1.3B'")
    return int(round(value))


def _blocks(params: int, layers: int, largest_block: Union[int, float, str, None]) -> list:
    if largest_block is not None:
        largest = min(_count(largest_block, "largest_block"), params)
        blocks = [largest] * (params // largest)
        if params % largest:
            blocks.append(params % largest)
        return blocks
    if layers < 1 or layers > params:
        raise ValueError(f"layers = {layers}: expected 1 .. params ({params})")
    blocks = [params // layers] * layers
    for i in range(params % layers):
        blocks[i] += 1
    return blocks


def config_args(config: ConfigLike | None) -> dict:
    """A config as the keyword arguments _core takes: a path, or a dict (sent as JSON)."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return {"config_json": json.dumps(config)}
    return {"config_path": os.fspath(config)}


def check_config(config: ConfigLike) -> dict:
    """A config (a path or a dict) as the engine reads it, without touching its NVMe paths (`tierzero-info
    --config` as a call).

    Returns {"source", "ignored_keys" (DeepSpeed keys accepted and unused, dotted), "unresolved_auto" ("auto"
    values nothing in the file resolves: the engine refuses to train with them), "zero_stage", "optimizer" (the
    one that runs: DeepSpeed's "Adam" with its default adam_w_mode is "AdamW"), "precision"}. A key tierzero
    does not know, a DeepSpeed feature it does not support, or a bad value raises ValueError naming the key.
    """
    return _core.check_config(**config_args(config))


def estimate(params: Union[int, float, str], *, ranks: int = 1, ranks_per_node: int = 0, layers: int = 32,
             largest_block: Union[int, float, str, None] = None, config: ConfigLike | None = None,
             stage: int | None = None, grad_accum: int | None = None, gpu: str | None = None,
             cpu: str | None = None, nvme: str | None = None, nvme_paths: Sequence[str] = (),
             offload_param: str | None = None, offload_optimizer: str | None = None,
             placement: str | None = None, precision: str | None = None, master: str | None = None,
             moments: str | None = None, links_gbps: Mapping[str, float] | None = None) -> tuple[dict, str]:
    """Where a model's states would live, and what each step would move: `tierzero-estimate` as a call.

    Returns (plan, report): the plan as a dict (states -> tier and bytes,
    tiers -> need, budget, headroom and breakdown, traffic per step, layout,
    budgets with their sources) and the text report the tool prints.

    params: e.g. 20e9 or "1.3B"; the model is `layers` equal blocks, or blocks
    of `largest_block`. Budgets are bytes or strings ("80GB", "64GiB", "auto");
    explicit arguments override `config` (a path or a dict). precision: "bf16"
    or "fp16" (2-byte parameters) or "fp32" (4-byte); by default the config's,
    or "bf16" without a config. master ("fp32" or "remainder", which needs
    bf16) and moments ("fp32", "bf16" or "int8"): the states' formats, by
    default the config's tierzero.states (fp32). links_gbps: any of
    nvme_read, nvme_write, pcie, cpu_mem in GB/s. Raises MemoryError naming the
    tier, its need and budget, and the config keys to change when no placement
    fits; ValueError for bad input.
    """
    n = _count(params, "params")
    budget = {k: (None if v is None else str(v)) for k, v in (("gpu", gpu), ("cpu", cpu), ("nvme", nvme))}
    links = {f"{k}_gbps": float(v) for k, v in (links_gbps or {}).items()}
    unknown = set(links) - {"nvme_read_gbps", "nvme_write_gbps", "pcie_gbps", "cpu_mem_gbps"}
    if unknown:
        raise ValueError(f"links_gbps: unknown link(s) {sorted(unknown)}; known: nvme_read, nvme_write, pcie, cpu_mem")
    for key, value in links.items():
        if not (0 < value < float("inf")):  # 0 and below (and nan) would silently mean "the default"
            raise ValueError(f"links_gbps: {key[:-5]} = {value} GB/s must be a finite number > 0")
    return _core.plan_placement(_blocks(n, layers, largest_block), ranks=ranks, ranks_per_node=ranks_per_node,
                                stage=stage, grad_accum=grad_accum, nvme_paths=[os.fspath(p) for p in nvme_paths],
                                offload_param=offload_param, offload_optimizer=offload_optimizer,
                                placement=placement, precision=precision, master=master, moments=moments,
                                **budget, **links,
                                **config_args(config))


def __getattr__(name: str) -> Any:
    # Submodules on first use: tierzero.optim and tierzero.torch import torch, tierzero.hf transformers.
    if name in ("optim", "nvme", "torch", "hf"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'tierzero' has no attribute {name!r}")
