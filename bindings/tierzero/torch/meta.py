"""A model built on the meta device, made one module at a time straight into the engine, never whole in
memory (Note [Models on the meta device])."""

from __future__ import annotations

import ctypes
import ctypes.util
import math
from collections import defaultdict
from typing import Any, Optional

import torch

from .errors import _add_note, _refusal_text
from .model import _own_tensors, _post_order, _qualified
from .rank0 import _kept_digest, _set_block, _take_rank0s

# Note [Models on the meta device]
# A model too large for host memory is built without memory, on the meta
# device (`with torch.device("meta"): model = Model()`), the need DeepSpeed's
# zero.Init meets. initialize() then makes its tensors one module at a time:
#
# - Modules are visited children first (post-order), the order their
#   constructors ran their own initialisation in: with reset_parameters()
#   and a model whose weights live in its leaves, the same seed gives the
#   same weights as the model built in memory.
# - At a module's visit its own meta tensors are swapped
#   (torch.utils.swap_tensors: the same Python objects, so tied weights and
#   references to them hold; the holder takes the tensor's class and shares
#   its attribute dict, which swap_tensors exchanges too) for CPU tensors
#   holding what no initialisation writes (NaN; the most negative integer;
#   for bool the byte 0xFF). nn.LSTM, GRU and RNN keep weak references to
#   their parameters, which swap_tensors refuses: refused, named. Its
#   initialisation runs, then that of the modules it sits in: with
#   reset_parameters() (or _reset_parameters(), as MultiheadAttention has
#   it), each such module once, nearest first; with init_fn, every call
#   model.apply(init_fn) makes that reaches it (a module shared by two
#   parents is called at both places). A parent may set its children's
#   tensors (Hugging Face GPT-2 scales its residual projections;
#   MultiheadAttention zeroes out_proj.bias; nn.Transformer re-draws every
#   matrix). Each call reaches a tensor once, in apply's order; the tensors
#   of the visit a call does not reach sit it out on the meta device. A
#   floating-point tensor still NaN anywhere, a bool one still 0xFF, or an
#   integer one still holding the fill that no operation wrote to, was set
#   by nothing, and is refused, named (an integer value equal to the fill,
#   written on purpose, stands; so does a partial integer write).
# - Then the module's tensors are parked: meta again in the model, their
#   made values aside. So between visits every tensor of the model is on
#   the meta device, and later visits' initialisations (which also call the
#   parents) write nothing of an earlier module's; writes to meta tensors
#   do nothing. An initialisation that reads another module's tensor (a
#   copy from it) or assigns .data across the meta boundary raises, with a
#   note saying where, and is refused as below; one that reads a 0-dim
#   tensor of another module as a scalar (w.mul_(gate.g)) is not caught:
#   torch reads a meta scalar without complaint, and the result is wrong.
# - A block goes to the engine (set_master, rank 0's values) once its
#   parameters are made (the engine was created with no weights,
#   initial_values="later", so each block is written once), and their
#   values are dropped and the heap trimmed (malloc_trim: glibc keeps
#   freed blocks under its adaptive mmap threshold of up to 32 MiB; 40
#   modules of 16 MiB peaked at 786-850 MiB without it, 734-736 with it:
#   bench/python/meta_trim_check.py). So host memory peaks near the
#   largest module plus the engine's own
#   (bench/python/meta_init_bench.py). A tied weight
#   (or a shared module's tensor) is made, with init_fn, at its last
#   holder's visit, with every call that reaches it from any holder, in
#   apply's order, so it ends as model.apply leaves it; with
#   reset_parameters(), at its first holder's, keeping its creator's
#   initialisation, as construction does (the other holders reset tensors
#   the tie dropped).
# - Frozen parameters and buffers stay parked until the whole model is
#   made (so a model that is mostly frozen saves little host memory); then
#   each rank puts them back, on the engine's device (16-bit under a 16-bit
#   config, as Note [Model dtype] casts them), all ranks check they hold the
#   same ones (names, dtypes, shapes), and take rank 0's values (broadcast),
#   as for the trained parameters.
# - Any failure on any rank (init_fn raising, an interrupt, a refusal, an
#   engine error) goes into the next collective as that rank's refusal, so
#   every rank fails together; each then puts every tensor back on the meta
#   device, leaving the model as it was, for a retry. The checks that need
#   no making (a module with meta tensors and no reset_parameters() without
#   init_fn, tensors both on the meta device and off it, the parameters'
#   dtype, register_external_parameter's) go through the engine's first
#   agreement the same way. Not covered: an interrupt that lands between a
#   collective's return and the next statement, or during the final
#   broadcasts, leaves the other ranks waiting for the communicator's
#   timeout, as an interrupted training step does.
def _check_meta(model: torch.nn.Module, init_fn: Any) -> bool:
    """Note [Models on the meta device]: whether `model` is on the meta device, refusing what cannot be made."""
    where = "tierzero.torch.initialize"
    order = _post_order(model)
    meta, real = [], []
    for name, module in order:
        for key, t in _own_tensors(module):
            (meta if t.is_meta else real).append(_qualified(name, key))
    if not meta:
        if init_fn is not None:
            raise ValueError(f"{where}: init_fn= makes a model built on the meta device, and this model has no "
                             "tensor there")
        return False
    if real:
        raise ValueError(f"{where}: the model has tensors both on the meta device ('{meta[0]}', {len(meta)} in all) "
                         f"and off it ('{real[0]}', {len(real)} in all); initialising it would overwrite the real ones: "
                         "build all of it on the meta device (with torch.device('meta')), or none")
    if init_fn is not None:
        if not callable(init_fn):
            raise TypeError(f"{where}: init_fn must be callable with a module, not {type(init_fn).__name__}")
        return True
    for name, module in order:
        if any(True for _ in _own_tensors(module)) and _reset_of(module) is None:
            raise ValueError(f"{where}: module '{name or 'model'}' ({type(module).__name__}) has tensors on the meta "
                             "device and no reset_parameters() to make them; pass init_fn=, called with each module "
                             "(a Hugging Face model's _init_weights, say)")
    return True


def _reset_of(module: torch.nn.Module) -> Any:
    for name in ("reset_parameters", "_reset_parameters"):
        fn = getattr(module, name, None)
        if callable(fn):
            return fn
    return None


class _MetaMaker:
    """Makes a model built on the meta device, one module at a time, into the engine (Note [Models on the
    meta device])."""

    def __init__(self, core: Any, model: torch.nn.Module, blocks: list, layout: list, init_fn: Any,
                 dtype: torch.dtype):
        self.core, self.blocks, self.layout, self.init_fn = core, blocks, layout, init_fn
        self.order = _post_order(model)
        self.device = torch.device(core.device)
        self.dtype = dtype  # a 16-bit dtype: what frozen floating-point tensors are kept in (Note [Model dtype])
        self.trained = {id(p) for _, params, _ in blocks for p in params}
        self.live: list = []      # [tensor, holder, name]: made and real in the model, the holder its meta original
        self.parked: dict = {}    # id -> [tensor, holder, name]: meta in the model, the holder its made data
        self.made: set = set()    # ids of the tensors made
        self.kept: list = []      # ids of frozen parameters and buffers, in the order made
        self._plan(model)
        self.done_at: dict = defaultdict(list)  # visit -> the blocks whose parameters are all made by its end
        for b, (_, params, _) in enumerate(blocks):
            self.done_at[max(self.make_at[id(p)] for p in params)].append(b)

    def _plan(self, model: torch.nn.Module) -> None:
        """When each tensor is made (make_at: tensor id -> visit) and which initialisation calls reach it
        (reach: tensor id -> [(position, module)] in order). With init_fn, every call model.apply(init_fn)
        makes on a module holding the tensor or one those sit in (a shared module at each of its places), and
        a tensor several modules hold (tied) is made at the last one's visit, so it has them all, in apply's
        order. With reset_parameters(), the first holder's and then each module it sits in once, nearest
        first, as construction runs them; a tied tensor is made by its first holder (the others reset tensors
        of their own, which the tie then replaced)."""
        calls: list = []  # model.apply's calls, in order, a shared module at each place

        def walk(module: torch.nn.Module) -> None:
            for child in module.children():
                walk(child)
            calls.append(module)

        walk(model)
        at: dict = defaultdict(list)  # module id -> its positions in calls
        for pos, m in enumerate(calls):
            at[id(m)].append(pos)
        parents: dict = defaultdict(dict)
        for m in calls:
            for child in m.children():
                parents[id(child)][id(m)] = m

        def above(m: torch.nn.Module) -> list:
            found, todo = {}, list(parents[id(m)].values())
            while todo:
                p = todo.pop()
                if id(p) not in found:
                    found[id(p)] = p
                    todo.extend(parents[id(p)].values())
            return list(found.values())

        self.make_at, self.reach = {}, {}
        for i, (_, m) in enumerate(self.order):
            if self.init_fn is not None:
                positions = {pos for x in (m, *above(m)) for pos in at[id(x)]}
            else:
                positions = {at[id(x)][0] for x in (m, *above(m))}
            for _, t in _own_tensors(m):
                if self.init_fn is not None:
                    self.make_at[id(t)] = i  # the last holder
                    self.reach[id(t)] = self.reach.get(id(t), set()) | positions
                elif id(t) not in self.make_at:
                    self.make_at[id(t)] = i  # the first holder
                    self.reach[id(t)] = positions
        self.calls = calls
        self.reach = {k: sorted(v) for k, v in self.reach.items()}

    def run(self) -> None:
        failure: Optional[BaseException] = None  # this rank's first; every rank learns of it at the next collective
        what = "tierzero.torch.initialize (making the model on the meta device)"
        try:
            for i, (name, module) in enumerate(self.order):
                try:
                    if failure is None:
                        self._visit(i, name, module)
                except BaseException as e:  # noqa: BLE001 - init_fn's, an interrupt: re-raised below
                    failure = failure or e
                for b in self.done_at[i]:
                    failure = self._hand_over(b, failure)
            kept, value = [], "failed"
            try:
                if failure is None:
                    kept = [self.parked[k] for k in self.kept]
                    value = _kept_digest([(n, t) for t, _, n in kept])
                    self._keep(kept)
            except BaseException as e:  # noqa: BLE001 - into the collective
                failure = failure or e
            # Every rank keeps the same frozen tensors, in place, before any takes rank 0's.
            self.core.agree(value, refusal=_refusal_text(failure), what=what)
            _take_rank0s(self.core, [t for t, _, _ in kept])
            self.live.clear()
        except BaseException as e:
            undone = self.undo(failure)
            if failure is not None and isinstance(e, ValueError) and _refusal_text(failure) in str(e):
                e = failure  # this rank's own error, not the refusal the engine echoed
            if undone:
                _add_note(e, undone)
            raise e from None
        for _, params, _ in self.blocks:  # empty CPU tensors, for TorchEngine to point at its placeholder
            for p in params:
                torch.utils.swap_tensors(p, _like(p, torch.empty(0, dtype=p.dtype)))

    def undo(self, failure: Optional[BaseException]) -> str:
        """Every tensor made back on the meta device (the parked ones are); what could not be, in words ("" when
        all were, or when `failure` names those already)."""
        stuck = []
        for entry in reversed(self.live):
            try:
                _swap(*entry)
            except ValueError as e:
                if f"'{entry[2]}' cannot be swapped" not in str(failure):  # said already
                    stuck.append(str(e))
        self.live.clear()
        self.parked.clear()
        _malloc_trim()
        return "; ".join(stuck)

    def _visit(self, i: int, name: str, module: torch.nn.Module) -> None:
        """Makes the module's meta tensors due at this visit and initialises them; between visits every tensor
        of the model is on the meta device, so no initialisation reaches a tensor but those in its reach."""
        made = []
        for key, t in _own_tensors(module):
            if self.make_at[id(t)] != i or id(t) in self.made:
                continue
            real = torch.empty(t.shape, dtype=t.dtype)
            _fill_unset(real)
            entry = [t, _like(t, real), _qualified(name, key)]
            _swap(*entry)
            self.live.append(entry)
            self.made.add(id(t))
            made.append((entry[2], t, t._version))
            if id(t) not in self.trained:
                self.kept.append(id(t))
        if not made:
            return
        with torch.no_grad():
            for pos in sorted({pos for _, t, _ in made for pos in self.reach[id(t)]}):
                # Tensors this call does not reach (a tied one's other holders' parents) sit it out on meta.
                out = [e for e in self.live if pos not in self.reach[id(e[0])]]
                for entry in out:
                    _swap(*entry)
                m = self.calls[pos]
                try:
                    if self.init_fn is not None:
                        self.init_fn(m)
                    elif (reset := _reset_of(m)) is not None:
                        reset()
                except BaseException as e:
                    hint = (" (an initialisation that reads another module's tensor cannot run there: that tensor "
                            "is on the meta device)") if "meta" in str(e) else ""
                    _add_note(e, f"tierzero.torch.initialize: raised by the initialisation of a {type(m).__name__} "
                                 f"while making '{name or 'model'}' on the meta device{hint}")
                    raise
                finally:
                    for entry in out:
                        _swap(*entry)
        how = "init_fn" if self.init_fn is not None else "reset_parameters() of its module and the modules it is in"
        for qualified, t, version in made:
            if _still_unset(t, written=t._version != version):
                raise ValueError(f"tierzero.torch.initialize: '{qualified}' (on the meta device) was not set "
                                 f"everywhere by {how} (a floating-point tensor still holds NaN, or another was "
                                 "never written); pass init_fn= that sets it")
        while self.live:  # parked: meta in the model, the made values in the holder
            entry = self.live[-1]
            _swap(*entry)
            self.live.pop()
            self.parked[id(entry[0])] = entry

    def _hand_over(self, b: int, failure: Optional[BaseException]) -> Optional[BaseException]:
        """Block b's values (rank 0's) into the engine, their memory freed; the failure, if any."""
        _, params, _ = self.blocks[b]
        failure = _set_block(self.core, b, self.layout[b], lambda: [self.parked[id(p)][1] for p in params], failure)
        try:  # an interrupt here still reaches the other ranks, at the next collective
            for p in params:
                self.parked.pop(id(p), None)  # the made values go with their holders
            _malloc_trim()
        except BaseException as e:  # noqa: BLE001 - into the next collective
            failure = failure or e
        return failure

    def _keep(self, kept: list) -> None:
        """Frozen parameters and buffers back in the model, on the engine's device (16-bit under a 16-bit
        config, as Note [Model dtype] casts them); run() then gives every rank rank 0's."""
        for entry in kept:
            del self.parked[id(entry[0])]
            self.live.append(entry)
            _swap(*entry)
            t = entry[0]
            cast = self.dtype != torch.float32 and t.dtype.is_floating_point
            t.data = t.data.to(self.device, dtype=self.dtype if cast else t.dtype)


def _fill_unset(t: torch.Tensor) -> None:
    """Fills `t` with what no initialisation writes: NaN, the most negative integer (the largest unsigned
    one), or for bool the byte 0xFF (neither False nor True)."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(math.nan)
    elif t.dtype == torch.bool:
        t.view(torch.uint8).fill_(0xFF)
    else:
        t.fill_(_int_fill(t.dtype))


def _still_unset(t: torch.Tensor, written: bool) -> bool:
    """Whether some element of `t` was never set: a floating-point one still NaN, a bool one still 0xFF; an
    integer one still holding _fill_unset's value when no operation wrote to `t` (`written`: its version counter
    moved; a write through .data does not move it, but leaves no fill behind), since that value may be meant
    (uint8 255, int8 -128): so a partial write of an integer tensor passes."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return bool(torch.isnan(t).any())
    if t.dtype == torch.bool:  # 0xFF is no bool value: left over wherever nothing wrote, written or not
        return bool((t.view(torch.uint8) == 0xFF).any())
    return not written and bool((t == _int_fill(t.dtype)).any())


def _int_fill(dtype: torch.dtype) -> int:
    """_fill_unset's value for an integer dtype: the most negative integer, or the largest unsigned one."""
    info = torch.iinfo(dtype)
    return info.min if info.min < 0 else info.max


def _swap(t: torch.Tensor, holder: torch.Tensor, qualified: str) -> None:
    """Swaps the model's tensor `t` with its holder (made <-> meta), or ValueError naming it."""
    try:
        torch.utils.swap_tensors(t, holder)
    except RuntimeError as e:
        raise ValueError(f"tierzero.torch.initialize: '{qualified}' cannot be swapped between the meta device and "
                         "memory: something else holds it, a view of it (an init_fn that kept one?) or a weak "
                         f"reference to it (nn.LSTM, GRU and RNN keep those: build them in memory): {e}") from None


def _like(t: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """`data` as a tensor of `t`'s class sharing its attribute dict: swap_tensors exchanges both, and a
    parameter's class (a Parameter subclass) and attributes (tags its optimizer or init reads, or that an
    initialisation adds) must stay with it."""
    out = torch.nn.Parameter(data, t.requires_grad) if isinstance(t, torch.nn.Parameter) else data
    if type(out) is not type(t):
        try:
            out.__class__ = type(t)
        except TypeError:
            pass  # a class with its own layout: swap_tensors then refuses, naming the tensor
    out.__dict__ = t.__dict__
    return out


def _malloc_trim() -> None:
    """Hands the heap's free memory back to the system (glibc's malloc_trim); nothing on other C libraries."""
    global _TRIM
    if _TRIM is None:
        name = ctypes.util.find_library("c")
        _TRIM = getattr(ctypes.CDLL(name), "malloc_trim", False) if name else False
    if _TRIM:
        _TRIM(0)


_TRIM: Any = None
