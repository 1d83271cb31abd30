"""Reading and editing weights between steps, as DeepSpeed's ZeRO-3 users do: GatheredParameters,
safe_get_full_fp32_param and safe_set_full_fp32_param (Note [Editing weights])."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from .engine import TorchEngine
    from .hooks import _Block

# Note [Editing weights]
# Outside its module's forward a trained parameter is an empty placeholder
# (Note [Parameters live in the engine]), so code that reads or edits weights
# between steps (a norm to log, an embedding row to reset, weights tied by
# hand) asks for them, as with DeepSpeed's ZeRO-3. GatheredParameters and
# safe_get_full_fp32_param gather the fp32 masters (gather_master, a
# collective) and hand out copies, so an edit never reaches memory the engine
# computes with; a forward inside the context computes with the copy. An edit
# is written back only when asked (modifier_rank, or
# safe_set_full_fp32_param): the masters are gathered again, the elements the
# editing rank changed replace theirs (the rest keep their full precision, and
# whatever a step inside the context did to them), the 16-bit parameters
# follow, and Adam's moments and step count stay. Unlike DeepSpeed's ZeRO-3,
# whose GatheredParameters edits the 16-bit partitions and leaves the fp32
# optimizer copy as it was (the next step then undoes the edit), the edit
# holds.
#
# Writing back is a sequence of collectives (per block: gather, then
# set_master), and every rank runs the same sequence whatever happened on it:
# a reason not to write (the with-block raised here, a weight's shape
# changed, a backward is pending) goes into the first set_master as a
# refusal, which fails it on every rank before anything is written. Engines
# are found through a weak set, so nothing keeps a model alive and the
# parameters carry nothing that stops them pickling.

_ENGINES: "weakref.WeakSet[TorchEngine]" = weakref.WeakSet()


def _engine_of(p: Any) -> Optional[TorchEngine]:
    if not isinstance(p, torch.Tensor):
        return None
    return next((e for e in list(_ENGINES) if p in e._slot), None)


def _by_block(params: list) -> list:
    """[(engine, block, [(slot, parameter)])] for the parameters an engine trains, in block order (the same
    on every rank given the same parameters, as the collectives need)."""
    engines: list = []  # in the order the parameters name them
    groups: dict = {}
    for p in params:
        engine = _engine_of(p)
        if engine is None:
            continue
        if all(e is not engine for e in engines):
            engines.append(engine)
        b, i = engine._slot[p]
        entry = groups.setdefault((id(engine), b.index), (engine, b, []))
        if all(q is not p for _, q in entry[2]):
            entry[2].append((i, p))
    rank = {id(e): n for n, e in enumerate(engines)}
    return [groups[k] for k in sorted(groups, key=lambda k: (rank[k[0]], k[1]))]


def _write_blocks(writes: list, root: int, refusal: Optional[str]) -> None:
    """Note [Editing weights]: for each (engine, block, fill), gathers the block's fp32 masters, lets
    fill(flat) write the edits into them (unless refused), and makes rank `root`'s result the block's
    weights. `refusal` goes into the first set_master, which then fails on every rank with nothing written."""
    for k, (engine, b, fill) in enumerate(writes):
        flat = torch.from_numpy(engine.gather_master(b.index))
        mine = refusal if k == 0 else None
        if refusal is None:
            try:
                fill(flat)
            except Exception as e:  # noqa: BLE001 - into the collective: no rank is left waiting
                mine = f"writing {b.name} failed on this rank ({e!r})"
        engine._core.set_master(b.index, flat, root=root, refusal=mine)


class GatheredParameters:
    """DeepSpeed's deepspeed.zero.GatheredParameters for a model trained through tierzero.torch.

        with torch.no_grad(), tierzero.torch.GatheredParameters(model.embed.weight, modifier_rank=0):
            if engine.rank == 0:
                model.embed.weight[pad_id].zero_()

    Inside, each given parameter (one, or an iterable) that an engine trains holds its full current value:
    a tensor of the model's dtype on the engine's device, a copy of the engine's weights (a forward inside
    the context computes with it). Other parameters (frozen ones, another model's) are left as they are.
    On leaving with modifier_rank=None the copies are dropped; with modifier_rank=r, the elements rank r
    changed become the weights on every rank (Note [Editing weights]: their fp32 masters, then the 16-bit
    parameters; Adam's state stays). Every rank must take part, with the same parameters: gathering and
    writing back are collectives. Writing back is refused on every rank (ValueError on the rank with the
    reason, OSError on the others; nothing written) when the block raised on some rank (that exception
    goes on), a weight's shape changed, or a forward's backward is pending. fwd_module is taken for
    compatibility; enabled=False does nothing.
    """

    def __init__(self, params: Any, modifier_rank: Optional[int] = None, fwd_module: Any = None,
                 enabled: bool = True):
        if params is None:
            params = []
        elif isinstance(params, torch.Tensor):
            params = [params]
        self._params = list(params)
        self._root, self._enabled = modifier_rank, enabled
        self._held: list = []  # (engine, block, [(slot, parameter, value given, .data before)])

    def __enter__(self) -> None:
        if not self._enabled:
            return
        try:
            for engine, b, slots in _by_block(self._params):
                values = engine._full_values(b, [i for i, _ in slots])
                entries = []
                for (i, p), value in zip(slots, values):
                    entries.append((i, p, value.clone() if self._root is not None else None, p.data))
                    p.data = value
                    engine._held_params[p] = engine._held_params.get(p, 0) + 1
                self._held.append((engine, b, entries))
        except BaseException:
            self._restore()
            raise

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if not self._enabled:
            return False
        try:
            if self._root is not None:
                self._write_back(exc)
        finally:
            self._restore()
        return False

    def _write_back(self, exc: Optional[BaseException]) -> None:
        refusal = f"GatheredParameters: the with-block raised on this rank ({exc!r})" if exc is not None else None
        for engine, b, entries in self._held:
            for i, p, given, _ in entries:
                if refusal is None and tuple(p.data.shape) != tuple(given.shape):
                    refusal = (f"GatheredParameters: {b.names[i]} was handed out with shape {tuple(given.shape)} "
                               f"and now has shape {tuple(p.data.shape)}; a weight's shape cannot change")
            why = engine._write_refusal() if refusal is None else None
            if why is not None:
                refusal = f"GatheredParameters(modifier_rank={self._root}): {why}"

        def fill(b: _Block, entries: list):
            def write(flat: torch.Tensor) -> None:
                for i, p, given, _ in entries:
                    now = p.data.detach().to(device=given.device, dtype=given.dtype)
                    bits = {2: torch.int16, 4: torch.int32}[given.element_size()]
                    changed = (now.view(bits) != given.view(bits)).cpu()  # bitwise: a NaN written is a change too
                    flat.as_strided(*b.views[i])[changed] = now.cpu().float()[changed]
            return write
        try:
            _write_blocks([(engine, b, fill(b, entries)) for engine, b, entries in self._held], self._root, refusal)
        except Exception:
            if exc is None:
                raise  # otherwise the with-block's own exception goes on

    def _restore(self) -> None:
        for engine, _, entries in self._held:
            for _, p, _, before in entries:
                count = engine._held_params.pop(p, 1) - 1
                if count:
                    engine._held_params[p] = count
                    p.data = before  # an enclosing context's copy
                else:
                    engine._settle(p)  # the block's view if it is gathered now, else the placeholder
        self._held = []


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """DeepSpeed's deepspeed.utils.safe_get_full_fp32_param: the parameter's fp32 master weight, whole, on
    the engine's device; None for a parameter no engine trains. A collective: call it on every rank."""
    engine = _engine_of(param)
    if engine is None:
        return None
    b, i = engine._slot[param]
    flat = torch.from_numpy(engine.gather_master(b.index))
    return flat.as_strided(*b.views[i]).to(engine._torch_device, copy=True)


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: Optional[torch.Tensor]) -> None:
    """DeepSpeed's deepspeed.utils.safe_set_full_fp32_param: makes rank 0's `value` (the parameter's shape,
    any float dtype and device) the parameter's fp32 master weight on every rank, and its 16-bit copy that
    rounded; Adam's state stays. A collective: every rank calls it (the other ranks' values are not used,
    and may be None). Refused on every rank, with nothing written, for a value of another shape or while a
    forward's backward is pending."""
    engine = _engine_of(param)
    if engine is None:
        raise ValueError("safe_set_full_fp32_param: the parameter is not one a tierzero.torch engine trains")
    b, i = engine._slot[param]
    refusal = engine._write_refusal()
    if refusal is None and engine.rank == 0:
        try:
            value = value.detach().to("cpu", torch.float32)
            if tuple(value.shape) != b.views[i][0]:
                refusal = f"{b.names[i]} has shape {b.views[i][0]}; the value has {tuple(value.shape)}"
        except Exception as e:  # refused through the collective, not raised before it
            refusal = f"the value for {b.names[i]} cannot be read as a tensor ({e!r})"

    def fill(flat: torch.Tensor) -> None:
        if engine.rank == 0:
            flat.as_strided(*b.views[i]).copy_(value)
    _write_blocks([(engine, b, fill)], 0, None if refusal is None else f"safe_set_full_fp32_param: {refusal}")
