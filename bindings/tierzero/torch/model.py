"""The model as the engine sees it: which parameters make which block, which modules use a block they do not
own, and the order modules are visited in (children first, as their constructors ran)."""

from __future__ import annotations

from typing import Iterator

import torch


def _collect_blocks(model: torch.nn.Module) -> tuple[list, dict]:
    """[(block name, params, qualified names)] and {module: [block ids it uses]}.

    A module's block is its own trainable parameters (recurse=False). A
    parameter shared by several modules (tied embeddings) belongs to the
    first module that owns it; the others fetch that block too.
    """
    blocks: list = []
    owner: dict = {}
    uses: dict = {}
    for mod_name, module in model.named_modules():
        mine, names = [], []
        for p_name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            qualified = f"{mod_name}.{p_name}" if mod_name else p_name
            if p in owner:
                uses.setdefault(module, []).append(owner[p])
                continue
            if p.numel() == 0:
                raise ValueError(f"tierzero.torch.initialize: parameter '{qualified}' has no elements")
            mine.append(p)
            names.append(qualified)
        if mine:
            index = len(blocks)
            blocks.append((mod_name or "model", mine, names))
            for p in mine:
                owner[p] = index
            uses.setdefault(module, []).append(index)
    return blocks, {m: sorted(set(ids)) for m, ids in uses.items()}


_NOT_TRAINED = "register_external_parameter: the parameter is not one the engine trains (frozen, or not in the model)"


def _check_external(model: torch.nn.Module, trained: set) -> None:
    """The parameters register_external_parameter() queued before initialize() (ids in `trained`), or
    ValueError."""
    for module in model.modules():
        if any(id(p) not in trained for p in module.__dict__.get("_tierzero_external", [])):
            raise ValueError(_NOT_TRAINED)


def _post_order(model: torch.nn.Module) -> list:
    """[(qualified name, module)], children before their parent; a module reached twice (shared) once, at its
    first place."""
    out: list = []
    seen: set = set()

    def visit(name: str, module: torch.nn.Module) -> None:
        seen.add(id(module))
        for child_name, child in module.named_children():
            if id(child) not in seen:
                visit(_qualified(name, child_name), child)
        out.append((name, module))

    visit("", model)
    return out


def _qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _own_tensors(module: torch.nn.Module) -> Iterator:
    """(key, tensor) for the module's own parameters and buffers."""
    for table in (module._parameters, module._buffers):
        for key, t in table.items():
            if t is not None:
                yield key, t
