"""Every rank starts from rank 0's model (Note [Rank 0's model]): the values of each block and of the frozen
parameters and buffers, once the ranks have agreed on what they hold."""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Optional

import torch

from .errors import _refusal_text
from .model import _own_tensors, _post_order, _qualified

# Note [Rank 0's model]
# Ranks seeded apart (torch.manual_seed(seed + rank), for dropout or data
# order) build different initial models. DeepSpeed broadcasts rank 0's
# model at start, and so does initialize(): the engine is created with no
# weights (initial_values="later", Note [Initial values] in
# tierzero/engine/zero.h) once every rank has agreed on what it holds, and
# each block is set from rank 0's values (set_master, root 0); the frozen
# parameters and buffers are broadcast from rank 0 here, after the same
# agreement covered them (names, dtypes, shapes: _kept_digest). Without it
# each rank would train a patchwork of the ranks' initial weights, and run
# its forward with its own frozen weights and buffers, so the ranks'
# gradients would come from different models. One copy of each tensor
# through host memory; nothing on a single rank. A tensor that cannot be
# written in place element by element (an expanded one, whose elements
# share memory: Hugging Face's position_ids; a sparse one) is not
# broadcast: the agreement covers its values instead, so ranks holding
# different ones are refused rather than left apart.
def _frozen(model: torch.nn.Module, trained: set) -> list:
    """[(qualified name, tensor)]: the model's parameters not trained and its buffers, each once, children
    first."""
    out, seen = [], set()
    for name, module in _post_order(model):
        for key, t in _own_tensors(module):
            if id(t) not in trained and id(t) not in seen:
                seen.add(id(t))
                out.append((_qualified(name, key), t))
    return out


def _broadcastable(t: torch.Tensor) -> bool:
    """Whether rank 0's values can be copied into `t` in place: a strided tensor whose elements do not share
    memory (an expanded one's do)."""
    if t.layout != torch.strided:
        return False
    overlap = getattr(torch, "_debug_has_internal_overlap", None)
    if overlap is not None:
        return overlap(t) != 1  # 1: certainly overlapping; 2: too hard to tell, which copy_ accepts
    return not any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape))


def _kept_digest(named: list) -> str:
    """What the ranks agree on before taking rank 0's frozen tensors: their names, dtypes and shapes, and the
    values of those that cannot be broadcast (Note [Rank 0's model])."""
    h = hashlib.sha256(repr([(n, t.dtype, tuple(t.shape), t.layout) for n, t in named]).encode())
    for _, t in named:
        if not _broadcastable(t):
            dense = t.detach().to_dense() if t.layout != torch.strided else t.detach()
            h.update(dense.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return f"{len(named)} frozen parameters and buffers, digest {h.hexdigest()[:16]}"


def _set_block(core: Any, b: int, layout: dict, values: Callable[[], list],
               failure: Optional[BaseException]) -> Optional[BaseException]:
    """Block b's values (values(): one tensor per parameter, any device and float dtype) into the engine
    through set_master, rank 0's kept; a failure on this rank (earlier, or making them) goes in as its
    refusal, so every rank fails there. The failure, if any."""
    whole = torch.zeros(0)  # with a refusal set_master reads nothing
    try:
        if failure is None:
            whole = torch.zeros(layout["whole_numel"], dtype=torch.float32)
            for v, spec in zip(values(), layout["params"]):
                whole[spec["offset"]:spec["offset"] + spec["numel"]] = v.detach().reshape(-1)
    except BaseException as e:  # noqa: BLE001 - into the collective, then re-raised by the caller
        failure, whole = failure or e, torch.zeros(0)
    core.set_master(b, whole, root=0, refusal=_refusal_text(failure))
    return failure


def _take_rank0s_model(core: Any, blocks: list, layout: list, kept: list) -> None:
    """Note [Rank 0's model] for a model in memory: each block's values, and the frozen tensors `kept`."""
    failure: Optional[BaseException] = None
    try:
        for b, (_, params, _) in enumerate(blocks):
            failure = _set_block(core, b, layout[b], lambda params=params: params, failure)
    except ValueError as e:
        if failure is not None and _refusal_text(failure) in str(e):
            raise failure from None  # this rank's own error, not the refusal the engine echoed
        raise
    _take_rank0s(core, [t for _, t in kept])


def _take_rank0s(core: Any, tensors: list) -> None:
    """Rank 0's values into every rank's `tensors` (the same on every rank: agreed by _kept_digest, which
    covers the values of those this cannot copy into)."""
    if core.world_size == 1:
        return
    for t in tensors:
        if t.numel() == 0 or not _broadcastable(t):  # the agreement covered the values of the latter
            continue
        host = t.detach().to("cpu", copy=True).contiguous()
        core.broadcast(host.reshape(-1).view(torch.uint8), root=0)
        if core.rank != 0:  # rank 0's are the values
            with torch.no_grad():
                t.copy_(host)
