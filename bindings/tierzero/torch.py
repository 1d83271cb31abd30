"""tierzero.torch: train a torch model through tierzero's engine, as DeepSpeed users write it.

    engine, optimizer = tierzero.torch.initialize(model, config="ds_config.json")
    for x, y in data:
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint("ckpt/")

Every submodule that owns parameters becomes one engine block (its own
parameters only); the engine partitions their states over ranks and places
them on GPU, pinned CPU memory or NVMe as the config says (a DeepSpeed
`zero_optimization` block works unchanged), and its optimizer (the config's
"optimizer" block) steps them on its tiers. Frozen parameters
(requires_grad=False) and buffers stay with torch.

Note [Parameters live in the engine]
After initialize(), a parameter's .data is an empty placeholder except while
its module computes. A forward pre-hook fetches the module's block and points
each parameter's .data at a zero-copy view of the gathered buffer (DLPack:
the engine's memory, seen by torch); a forward hook sets .data back to the
placeholder. The gathered buffer returns to the engine when no tensor views
it any more (Note [Gathered block lifetime] in bindings/engine.cpp): torch's
own reference counting decides, so no tensor can point at memory the engine
has reused. On CUDA the module's kernels may not have run yet by then: the
block is fetched naming torch's current stream, and the engine reuses the
buffer only once that stream has passed the point it had reached (Note
[Stream-ordered release] in tierzero/engine/zero.h). Between steps,
master_state_dict() gives the fp32 weights and detach_module() puts them back
into the model.

Note [Saved tensors]
Autograd saves tensors in forward for backward: a Linear saves its weight,
or a transposed view of it. Such a view would keep the whole gathered buffer
alive from forward until backward, and so every block of the model at once.
While engine(...) runs the model, a saved-tensors pack hook replaces each
saved tensor that views a gathered buffer by (block, offset, size, stride);
the unpack hook rebuilds the view from the block's buffer as gathered again
for backward (or fetches it then, held until backward ends). The memory
between a block's forward and its backward is the engine's, not torch's.
Calling the model directly (model(x)) also works; it only keeps those
buffers alive longer.

Note [Gradients]
The forward hook routes each module's outputs through an identity autograd
function whose backward fetches the module's block again before the module's
backward runs (the backward pre-hook). After each parameter's gradient is
accumulated (a post-accumulate-grad hook), it is taken from .grad (which is
set to None); when every parameter of a block has its gradient, they are
copied into the engine's gradient buffer (reduce_grads: reduce-scattered over
ranks, accumulated in fp32 on the gradient tier) and the block is released.
At the end of backward any block still missing gradients is reduced with
zeros for them. Gradients are averaged over ranks and over the config's
gradient_accumulation_steps by the engine: engine.backward(loss) does not
divide the loss, and engine.step() is called after every micro-batch (it runs
the optimizer at the accumulation boundary).

Note [A forward that raised]
A forward that raises half-way (a batch the loop then skips, an interrupt)
never runs the forward hooks of the modules it was in. engine(x) releases
their gathered blocks, and rewinds the engine's record of this micro-batch's
fetches to where the forward began (ZeroEngine::rewind_fetches), so the next
forward follows the order the engine prefetches by and prefetching goes on
as before. Without the rewind the next forward breaks that order, and
prefetching pauses for two micro-batches while it is recorded again (Note [A
trace that stops holding] in engine/src/prefetch.h). The rewind is for one
rank only: with several, the rank that raised cannot know whether the others
raised at the same point (a bad label on one rank's data raises on that rank
alone), and rewinding alone would make it post the prefetch window's
all-gathers where the others post other collectives. There every rank, having
fetched alike, leaves the order at the same point of the next forward, and
records it again together. (A rank that raises before its forward's last
fetch leaves the others in that fetch's all-gather until the timeout, as in
any data-parallel training.) model(x) called directly is not rewound either:
its blocks go back at engine.step(), and the order is recorded again. A
backward that raises is not rewound: the blocks it had finished keep the
gradients they handed to the engine, as torch's .grad keeps them.

Note [Model dtype]
With the config's "bf16" or "fp16" block enabled, the engine trains 16-bit
parameters against fp32 master weights, and initialize() casts the model to
that dtype as DeepSpeed's does (model.to(dtype): frozen parameters and
floating-point buffers too), so an fp32 model and a DeepSpeed config work
unchanged. The masters start from the parameters' values before the cast: an
fp32 model's exact weights, not their 16-bit rounding. The model's inputs are
the caller's to cast, as with DeepSpeed. Without either block the engine
trains fp32 parameters, and a trainable parameter of another dtype is refused
by name (the engine would otherwise round or widen it silently).

Note [Client state]
The engine checkpoints what it holds; the rest of a model's state_dict()
(buffers such as a norm's running statistics, frozen parameters) and a dict
of the caller's (client_state, as DeepSpeed's save_checkpoint takes it) go in
the checkpoint's client state: torch.save's bytes, which rank 0 writes into
the checkpoint directory with a checksum before it is published, so they and
the weights are saved, replaced and verified together. They are read back
with torch.load(weights_only=True), which runs no code from the file;
save_checkpoint tries that read first and refuses a dict it could not read
back (an arbitrary object, say), on every rank, before anything is written.
load_checkpoint reads them first (files only, checksum verified), decodes
them and checks the buffers' names and shapes against the model, then loads:
a rank's refusal goes into the collective load, which fails on every rank
before anything is replaced, and the load checks it finds the same bytes. No
Python runs inside the engine's call (Note [Engine calls and the GIL]).
Tensors come back on the CPU, and are copied into the model's own.

Note [Capsules, not tensors]
The tensors handed to _core on hot paths (gradients to reduce_grads, the
optimizer's arrays in tierzero.optim) go as DLPack capsules made by
torch.utils.dlpack.to_dlpack (a C call, ~0.4 us), not as tensors: given a
tensor, nanobind calls Tensor.__dlpack__, which is Python and costs ~3 us per
array, more than the rest of a small block's reduce_grads. The capsule
carries no stream, which is right here: CUDA gradients are synchronised
before reduce_grads (stream=-1), and tierzero.optim is CPU only. Arrays are
checked the same way (dtype, device, order, size, by argument name).

Note [Learning rate]
The engine's learning rate comes from the config's "scheduler" block
(DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR, computed by the engine
from its optimizer step count, so a loaded checkpoint resumes the schedule),
or from optimizer.param_groups[0]["lr"]: the returned optimizer is a
torch.optim.Optimizer, and engine.step() hands a changed "lr" to the engine
before the step, so a torch scheduler built on it (LambdaLR, CosineAnnealingLR,
...) and stepped after engine.step() works as with any torch optimizer. After
each engine.step() "lr" shows the learning rate of the next step. Changing
"lr" while the config has a scheduler is a ValueError; a torch scheduler's
own state is saved by its owner (scheduler.state_dict()), as in plain torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import io
import math
import os
import warnings
import weakref
from collections import defaultdict, namedtuple
from typing import Any, Callable, Iterator, Optional, Union

import torch
from torch.utils.dlpack import to_dlpack

from . import _core, config_args

__all__ = ["initialize", "register_external_parameter", "GatheredParameters", "safe_get_full_fp32_param",
           "safe_set_full_fp32_param", "TorchEngine", "EngineOptimizer"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_Saved = namedtuple("_Saved", "block offset size stride")


class _Block:
    """One module's parameters in the engine, and their gathered state."""

    def __init__(self, index: int, name: str, params: list, names: list, layout: dict):
        self.index, self.name, self.params, self.names = index, name, params, names
        # (shape, stride, offset) of each parameter's view of a gathered buffer: one as_strided call each
        self.views = [(tuple(p["shape"]), torch.empty(p["shape"], device="meta").stride(), p["offset"])
                      for p in layout["params"]]
        self.flat: Optional[torch.Tensor] = None   # (whole_numel,) view of the gathered buffer, while gathered
        self.users = 0                             # acquisitions holding it (forward calls, backward)
        self.grads: list = [None] * len(params)    # gradients arrived in this backward
        self.arrived = 0
        self.backward_held = False                 # fetched for this backward, released at its flush


class _PreBackward(torch.autograd.Function):
    """Identity on a module's outputs; its backward fetches the module's blocks (Note [Gradients])."""

    @staticmethod
    def forward(ctx, callback, *tensors):  # noqa: D102
        ctx.callback = callback
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):  # noqa: D102
        ctx.callback()
        return (None, *grads)


def _add_note(e: BaseException, text: str) -> None:
    """Adds `text` to the exception's message (Python 3.11's add_note; before it, a warning)."""
    if hasattr(e, "add_note"):
        e.add_note(text)
    else:
        warnings.warn(text, RuntimeWarning, stacklevel=3)


def _flatten(obj: Any, out: list) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad:
            out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            _flatten(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _flatten(x, out)


def _replace(obj: Any, it: Iterator[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return next(it) if obj.requires_grad else obj
    if isinstance(obj, tuple):
        items = [_replace(x, it) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return [_replace(x, it) for x in obj]
    if isinstance(obj, dict):
        if type(obj) is dict:
            return {k: _replace(v, it) for k, v in obj.items()}
        for k in list(obj.keys()):  # dict subclasses (a Hugging Face ModelOutput): in place
            obj[k] = _replace(obj[k], it)
        return obj
    return obj


class EngineOptimizer(torch.optim.Optimizer):
    """What initialize() returns as the optimizer: the engine steps its own (the config's "optimizer" block).

    A torch.optim.Optimizer, so torch's learning-rate schedulers take it
    (Note [Learning rate]). step() is engine.step(); zero_grad() does nothing
    (the engine takes every gradient out of .grad as it arrives). One param
    group: every trainable parameter, the config's hyperparameters, and "lr",
    the learning rate of the next optimizer step. Only "lr" may be changed.
    """

    def __init__(self, engine: "TorchEngine", hyper: dict):
        params = [p for b in engine._blocks for p in b.params]
        defaults = {k: v for k, v in hyper.items() if k != "params"}
        defaults["lr"] = engine._core.learning_rate
        super().__init__(params, defaults)
        self._engine_ref = weakref.ref(engine)
        self._fixed = {k: v for k, v in self.param_groups[0].items() if k not in ("params", "lr", "initial_lr")}

    def _engine(self) -> "TorchEngine":
        engine = self._engine_ref()
        if engine is None:
            raise ValueError("EngineOptimizer: its engine is gone (keep the engine initialize() returned)")
        return engine

    def step(self, closure: Any = None) -> dict:
        if closure is not None:
            raise ValueError("EngineOptimizer.step(): closures are not supported; call engine.backward, engine.step")
        return self._engine().step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def add_param_group(self, param_group: dict) -> None:
        if self.param_groups:
            raise ValueError("EngineOptimizer: the engine trains every parameter in one group; add_param_group is "
                             "not supported")
        super().add_param_group(param_group)

    def state_dict(self) -> dict:
        raise NotImplementedError("the optimizer's states live in the engine's tiers: use engine.save_checkpoint")

    def load_state_dict(self, state_dict: dict) -> None:
        raise NotImplementedError("the optimizer's states live in the engine's tiers: use engine.load_checkpoint")

    def _take_lr(self) -> None:
        """Hands a changed param_groups[0]['lr'] to the engine; any other change is refused."""
        group = self.param_groups[0]
        for k, v in self._fixed.items():
            if group.get(k) != v:
                raise ValueError(f"EngineOptimizer: param_groups[0]['{k}'] changed from {v!r} to {group.get(k)!r}; "
                                 "only 'lr' can change after initialize (the rest is the config's optimizer block)")
        lr = self._group_lr()
        core = self._engine()._core
        if lr != core.learning_rate:
            core.set_learning_rate(lr)

    def _group_lr(self) -> float:
        lr = self.param_groups[0]["lr"]
        return float(lr.item() if isinstance(lr, torch.Tensor) else lr)  # torch allows a tensor lr

    def _show_lr(self) -> None:
        self.param_groups[0]["lr"] = self._engine()._core.learning_rate


class TorchEngine:
    """A torch module trained through tierzero's ZeRO engine. Made by initialize()."""

    def __init__(self, model: torch.nn.Module, config: Any, init_fn: Any = None):
        self.module = model
        blocks, self._module_blocks = _collect_blocks(model)
        if not blocks:
            raise ValueError("tierzero.torch.initialize: the model has no parameters that require grad")
        # In the engine a parameter is named within its block (the module): "h.0.attn" + "weight", as its
        # messages and describe() show them; export_safetensors writes the qualified names.
        specs = [(name, [(n.rpartition(".")[2], tuple(p.shape)) for n, p in zip(names, params)])
                 for name, params, names in blocks]
        # Everything that can be refused before the model changes is, on every rank alike (after the engine
        # exists, through it): a refusal on one rank, or ranks that differ on whether the model is on the
        # meta device, must not leave the others waiting in a collective it never starts.
        on_meta, refusal, kept, held = False, None, [], "a model on the meta device"
        try:
            on_meta = _check_meta(model, init_fn)  # Note [Models on the meta device]
            trained = {id(p) for _, params, _ in blocks for p in params}
            _check_external(model, trained)
            if not on_meta:
                kept = _frozen(model, trained)
                held = f"a model in memory, {_kept_digest(kept)}"  # Note [Rank 0's model]
        except BaseException as e:  # noqa: BLE001 - an interrupt too; re-raised after the agreement
            refusal, held = e, "refused"
        # No values at creation: every rank learns first whether the others are on the meta device or
        # refuse, then each block is set (rank 0's values) from the model, or as _MetaMaker makes it.
        self._core = _core.Engine(blocks=specs, initial_values="later", **config_args(config))
        self._dtype = _DTYPES[self._core.param_dtype]
        try:
            if refusal is None and self._dtype == torch.float32:
                self._check_dtypes(blocks)
        except ValueError as e:
            refusal = e
        try:
            self._core.agree(held, refusal=_refusal_text(refusal), what="tierzero.torch.initialize")
        except ValueError:
            if refusal is not None:
                raise refusal from None
            raise
        layout = self._core.layout()
        if on_meta:
            _MetaMaker(self._core, model, blocks, layout, init_fn, self._dtype).run()
        else:
            _take_rank0s_model(self._core, blocks, layout, kept)
        self._blocks = [_Block(i, name, params, names, layout[i]) for i, (name, params, names) in enumerate(blocks)]
        self._cuda = self._core.device.startswith("cuda")
        self._torch_device = torch.device(self._core.device)
        self._slot = {p: (b, i) for b in self._blocks for i, p in enumerate(b.params)}
        self._live: dict[int, _Block] = {}        # gathered buffer address -> block (Note [Saved tensors])
        self._held_for_unpack: list[_Block] = []  # fetched by the unpack hook, released when backward ends
        self._gathered = weakref.WeakSet()        # gathered blocks handed out and alive (tests: none outlive use)
        self._callback_queued = False
        self._backward_pending = False            # a grad-enabled forward ran; its backward has not (Note [Editing weights])
        self._evaluating = False                  # the model runs under torch.no_grad() (Note [Evaluation fetches])
        self._depth = 0                           # calls of the root module under way
        self._held_params: dict = {}              # parameter -> GatheredParameters contexts holding it
        self._placeholder = torch.empty(0, dtype=self._dtype, device=self._core.device)
        self._hooks: list = []
        self.last_report: dict = {}
        self.global_steps = 0
        self.micro_steps = 0  # engine.step() calls, as DeepSpeed's engine counts them
        self._last_grad_norm: Optional[float] = None
        self.optimizer: Optional[EngineOptimizer] = None  # set by initialize()
        # A tensor's hooks are held on the C++ side, out of the garbage collector's sight: a hook that
        # referenced the engine would make model -> parameter -> hook -> engine -> model a cycle nothing frees.
        engine_ref = weakref.ref(self)
        _ENGINES.add(self)  # Note [Editing weights]

        def on_grad(p: torch.Tensor) -> None:
            engine = engine_ref()
            if engine is not None:
                engine._on_grad(p)

        for b in self._blocks:
            for p in b.params:
                p.data = self._placeholder
                self._hooks.append(p.register_post_accumulate_grad_hook(on_grad))
        for module, block_ids in self._module_blocks.items():
            self._hooks.append(module.register_forward_pre_hook(self._make_pre_forward(block_ids)))
            self._hooks.append(module.register_forward_hook(self._make_post_forward(block_ids)))
        self._hooks.append(model.register_forward_pre_hook(self._enter_model, prepend=True))
        self._hooks.append(model.register_forward_hook(self._leave_model, always_call=True))
        for module in model.modules():
            module.__dict__["_tierzero_engine"] = engine_ref  # register_external_parameter() after initialize()
            for p in module.__dict__.pop("_tierzero_external", []):
                self.register_external_parameter(module, p)
        if self._dtype != torch.float32:
            model.to(self._dtype)  # Note [Model dtype]: frozen parameters and floating buffers

    # Note [Evaluation fetches]
    # A forward of the model under torch.no_grad() (a validation pass, or
    # generate()) has no backward, and its fetches are not training's: marked
    # as evaluation, they go beside the order the engine prefetches by, which
    # they would otherwise break (pausing prefetching while it is recorded again).
    # Decided when the model itself is called, engine(x) or model(x), not per
    # module: a no_grad region inside a training forward (reentrant activation
    # checkpointing) stays traced, and so do backward's fetches, which run with
    # grad mode off. The same hooks note a forward whose output needs a
    # backward (Note [Editing weights]).
    def _enter_model(self, module: torch.nn.Module, args: Any) -> None:
        if self._depth == 0:
            self._evaluating = not torch.is_grad_enabled()
        self._depth += 1

    def _leave_model(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._evaluating = False
        if output is not None and torch.is_grad_enabled():
            tensors: list = []
            _flatten(output, tensors)
            if any(t.requires_grad for t in tensors):
                self._backward_pending = True

    def _check_dtypes(self, blocks: list) -> None:
        """Note [Model dtype]: an fp32 config trains fp32 parameters; any other trainable dtype is refused."""
        for _, params, names in blocks:
            for n, p in zip(names, params):
                if p.dtype != torch.float32:
                    raise ValueError(f"tierzero.torch.initialize: parameter '{n}' is {p.dtype}, but the config trains "
                                     "float32 parameters; enable the config's \"bf16\" (or \"fp16\") block to train "
                                     "16-bit parameters with fp32 master weights, or convert the model (model.float())")

    def register_external_parameter(self, module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
        """`module`'s forward uses `parameter`, which another module owns (a shared embedding read as
        self.emb.weight without calling self.emb): gather it with `module`'s own, as DeepSpeed's
        deepspeed.zero.register_external_parameter says. Without it the parameter is an empty placeholder
        there (Note [Parameters live in the engine]), and torch reports a shape mismatch."""
        if parameter not in self._slot:
            raise ValueError(_NOT_TRAINED)
        block, _ = self._slot[parameter]
        if block.index in self._module_blocks.get(module, []):
            return  # gathered with it already
        self._module_blocks.setdefault(module, []).append(block.index)
        self._hooks.append(module.register_forward_pre_hook(self._make_pre_forward([block.index])))
        self._hooks.append(module.register_forward_hook(self._make_post_forward([block.index])))

    # ------------------------------------------------------------ gathering
    def _acquire(self, b: _Block) -> None:
        if b.users == 0:
            # On CUDA the module's kernels read the block on the current stream, and may still be queued when
            # its last view goes: the engine waits for that stream before reusing the buffer.
            stream = torch.cuda.current_stream(self._torch_device).cuda_stream if self._cuda else None
            gathered = self._core.fetch(b.index, stream=stream, evaluation=self._evaluating)
            self._gathered.add(gathered)
            flat = torch.from_dlpack(gathered.data)  # zero-copy; flat's storage keeps `gathered` alive
            b.flat = flat
            self._live[flat.data_ptr()] = b
            # as_strided, not a slice then view(): a quarter of the cost, which is most of the cost of a
            # tiny module's hooks
            held = self._held_params  # a parameter a GatheredParameters context holds keeps its value there
            for p, (shape, stride, offset) in zip(b.params, b.views):
                if p not in held:
                    p.data = flat.as_strided(shape, stride, offset)
        b.users += 1

    def _release(self, b: _Block) -> None:
        b.users -= 1
        if b.users == 0:
            for p in b.params:
                if p not in self._held_params:
                    p.data = self._placeholder
            del self._live[b.flat.data_ptr()]
            b.flat = None  # the engine gets the buffer back once autograd holds no view of it either

    def _make_pre_forward(self, block_ids: list):
        blocks = [self._blocks[i] for i in block_ids]

        def pre_forward(module: torch.nn.Module, args: Any) -> None:
            for b in blocks:
                self._acquire(b)
        return pre_forward

    def _make_post_forward(self, block_ids: list):
        blocks = [self._blocks[i] for i in block_ids]

        def fetch_for_backward() -> None:
            self._queue_end_of_backward()
            for b in blocks:
                if not b.backward_held:
                    b.backward_held = True
                    self._acquire(b)

        def post_forward(module: torch.nn.Module, args: Any, output: Any) -> Any:
            for b in blocks:
                self._release(b)
            if not torch.is_grad_enabled():
                return output
            tensors: list = []
            _flatten(output, tensors)
            if not tensors:
                return output
            self._backward_pending = True
            return _replace(output, iter(_PreBackward.apply(fetch_for_backward, *tensors)))
        return post_forward

    # ------------------------------------------------------------ saved tensors
    def _pack(self, t: torch.Tensor) -> Any:
        if not self._live or t.layout != torch.strided:
            return t
        b = self._live.get(t.untyped_storage().data_ptr())
        if b is None or t.dtype != self._dtype:
            return t
        return _Saved(b.index, t.storage_offset(), tuple(t.shape), t.stride())

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved
        b = self._blocks[saved.block]
        if b.flat is None:
            # Used by backward outside its module's backward: fetch now, hold until backward ends.
            self._queue_end_of_backward()
            self._acquire(b)
            self._held_for_unpack.append(b)
        return b.flat.as_strided(saved.size, saved.stride, saved.offset)

    # ------------------------------------------------------------ gradients
    def _on_grad(self, p: torch.Tensor) -> None:
        b, i = self._slot[p]
        self._queue_end_of_backward()
        grad = p.grad
        p.grad = None
        if b.grads[i] is None:
            b.arrived += 1
            b.grads[i] = grad
        else:  # a second backward through the same graph before the block was flushed
            b.grads[i] = b.grads[i] + grad
        if b.arrived == len(b.params):
            self._flush(b)

    def _flush(self, b: _Block) -> None:
        grads = [None if g is None else to_dlpack(g.detach().contiguous()) for g in b.grads]  # Note [Capsules, not tensors]
        if self._cuda:
            # The gradients were written on the current stream: synchronise it and tell
            # reduce_grads not to wait (its copies go on the engine's own stream).
            torch.cuda.current_stream(self._torch_device).synchronize()
            self._core.reduce_grads(b.index, grads, stream=-1)
        else:
            self._core.reduce_grads(b.index, grads)
        b.grads = [None] * len(b.params)
        b.arrived = 0
        if b.backward_held:
            b.backward_held = False
            self._release(b)

    def _queue_end_of_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._backward_pending = False
        for b in self._blocks:
            if b.arrived > 0:
                self._flush(b)  # missing gradients go in as zeros
            if b.backward_held:
                b.backward_held = False
                self._release(b)
        while self._held_for_unpack:
            self._release(self._held_for_unpack.pop())

    # ------------------------------------------------------------ the training loop
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the model (with the saved-tensor hooks of Note [Saved tensors])."""
        # Note [A forward that raised]: one rank only, where no other rank's collectives can be left unmatched
        mark = self._core.fetch_mark() if self._core.world_size == 1 else None
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return self.module(*args, **kwargs)
        except BaseException as e:
            self._release_all()  # a forward that raised never ran the forward hooks of the modules it was in
            if mark is not None:
                try:
                    self._core.rewind_fetches(mark)
                except Exception as r:  # the forward's own error is the one to see
                    _add_note(e, f"tierzero.torch: rewinding the engine's fetches after it failed too: {r}")
            raise

    def _release_all(self) -> None:
        """Drops every gathered view, so the next fetch gets current parameters."""
        for b in self._blocks:
            if b.users:
                for p in b.params:
                    if p not in self._held_params:
                        p.data = self._placeholder
                self._live.pop(b.flat.data_ptr(), None)
                b.flat, b.users, b.backward_held = None, 0, False
        self._held_for_unpack.clear()

    __call__ = forward

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), scaled by the engine's loss scale (fp16). Do not divide by the accumulation steps."""
        scale = self._core.loss_scale
        (loss * scale if scale != 1.0 else loss).backward()
        if self._callback_queued or any(b.arrived or b.backward_held for b in self._blocks):
            self._end_of_backward()

    def step(self) -> dict:
        """Ends the micro-batch; the optimizer runs at the accumulation boundary. Returns the step report."""
        # Blocks still gathered here (a forward without its backward) would keep showing the old
        # parameters after the optimizer runs: let go of them first.
        self._release_all()
        self._backward_pending = False
        if self.optimizer is not None:
            self.optimizer._take_lr()  # Note [Learning rate]
        self.last_report = self._core.step()
        self.global_steps = self.last_report["step"]
        self.micro_steps += 1
        if self.last_report["stepped"] or self.last_report["overflow"]:
            self._last_grad_norm = self.last_report["grad_norm"]
        if self.optimizer is not None:
            self.optimizer._show_lr()
            if self.last_report["stepped"]:
                self.optimizer._opt_called = True  # what torch's schedulers check: the optimizer stepped
        return self.last_report

    # DeepSpeed's engine queries, for scripts and trainers that call them.
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (derived from train_batch_size and the ranks where the config
        gives that instead, as DeepSpeed does)."""
        return self._core.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._core.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int:
        """train_micro_batch_size_per_gpu x gradient_accumulation_steps x ranks."""
        return self._core.train_batch_size

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the coming engine.step() runs the optimizer (the micro-batch in progress is the last of
        its accumulation)."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def was_step_applied(self) -> bool:
        """Whether the last engine.step() updated the weights (False between boundaries and when fp16
        overflowed)."""
        return bool(self.last_report.get("stepped", False))

    def get_global_grad_norm(self) -> Optional[float]:
        """The gradient norm of the last accumulation boundary (before clipping; inf or nan where fp16
        overflowed), None before the first."""
        return self._last_grad_norm

    def get_lr(self) -> list:
        """[the learning rate the next optimizer step will use], as DeepSpeed's engine.get_lr() gives it
        (optimizer.param_groups[0]["lr"]: a torch scheduler's new rate counts from the next step)."""
        if self.optimizer is not None:
            return [self.optimizer._group_lr()]
        return [self._core.learning_rate]

    def train(self, mode: bool = True) -> "TorchEngine":
        self.module.train(mode)
        return self

    def eval(self) -> "TorchEngine":
        return self.train(False)

    # ------------------------------------------------------------ state
    def save_checkpoint(self, save_dir: Union[str, os.PathLike], tag: Any = None, client_state: Optional[dict] = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Every rank's master weights, optimizer moments, step, learning rate and loss scale under
        save_dir/<tag> (default "step-<N>"), as DeepSpeed's save_checkpoint: saving under an existing tag
        replaces that checkpoint atomically, and save_dir/latest points at it unless save_latest is False.
        Rank 0 adds the model's buffers and frozen parameters (those too unless exclude_frozen_parameters)
        and client_state, a dict of yours (an epoch, a data loader's position) that load_checkpoint
        returns (Note [Client state]). A collective: every rank calls it."""
        blob, refusal = None, None
        if self.rank == 0:  # the other ranks' client_state is not saved, as in DeepSpeed
            try:
                blob = _pack_client_state(client_state, self._module_state(exclude_frozen_parameters)[0],
                                          bool(exclude_frozen_parameters))
            except Exception as e:  # noqa: BLE001 - a pickling error too: refused on every rank, nothing written
                refusal = str(e) if isinstance(e, ValueError) else \
                    f"save_checkpoint: client_state does not save ({type(e).__name__}: {e})"
        self._core.save_checkpoint(os.fspath(save_dir), tag=None if tag is None else str(tag), client_state=blob,
                                   save_latest=save_latest, refusal=refusal)
        return True

    def load_checkpoint(self, load_dir: Union[str, os.PathLike], tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple:
        """Loads load_dir/<tag>, or load_dir/latest (or load_dir itself when it is a checkpoint): the
        engine's states, and the model's buffers and frozen parameters saved with them; training resumes
        bit for bit. Returns (the checkpoint's directory, the client_state saved with it, {} if none), as
        DeepSpeed's does, and, as DeepSpeed's, (None, None) with a warning when load_dir holds no
        checkpoint and no tag is given. A corrupt checkpoint, a missing tag, or one saved from another
        model or optimizer raises, and nothing is replaced. load_module_only=True loads the weights (and
        buffers) alone: this engine's optimizer state (moments, step count) stays as it is, fresh on a
        new engine, and the checkpoint's optimizer may differ (fine-tuning). Otherwise the weights,
        optimizer states and schedule come together: the partial flags must keep their defaults."""
        flags = [("load_module_strict", load_module_strict, True), ("custom_load_fn", custom_load_fn is not None, False)]
        if not load_module_only:  # DeepSpeed ignores these with load_module_only
            flags += [("load_optimizer_states", load_optimizer_states, True),
                      ("load_lr_scheduler_states", load_lr_scheduler_states, True)]
        for flag, value, default in flags:
            if bool(value) != default:
                raise ValueError(f"load_checkpoint: {flag}={value} is not supported: a tierzero checkpoint restores "
                                 "the weights, optimizer states and schedule together, into a model whose "
                                 "parameters match it (for the weights alone: load_module_only=True)")
        load_dir = os.fspath(load_dir)
        if tag is None and not any(os.path.exists(os.path.join(load_dir, f)) for f in ("latest", "manifest.json")):
            warnings.warn(f"load_checkpoint: {load_dir} holds no checkpoint (no 'latest' file, no manifest.json); "
                          "nothing was loaded", stacklevel=2)
            return None, None
        tag = None if tag is None else str(tag)
        # The client state is read and checked first (files only), and a refusal goes into the load, so every
        # rank fails before anything is replaced (Note [Client state]).
        blob, refusal, decoded = _core.read_checkpoint_client_state(load_dir, tag), None, {}
        try:
            decoded = _unpack_client_state(blob)
            self._check_module_state(decoded.get("module"), bool(decoded.get("exclude_frozen", False)))
        except ValueError as e:
            refusal = f"load_checkpoint: {e}"
        path, _ = self._core.load_checkpoint(load_dir, tag=tag, weights_only=bool(load_module_only), refusal=refusal,
                                             checked=True, client_state=blob)
        self._restore_module_state(decoded.get("module"))
        self.global_steps = self._core.optimizer_steps
        self.micro_steps = self.global_steps * self.gradient_accumulation_steps()  # checkpoints are at a boundary
        if self.optimizer is not None:
            self.optimizer._show_lr()  # the restored schedule's (or saved) rate for the next step
        return path, decoded.get("client_state", {})

    def _module_state(self, exclude_frozen: bool) -> tuple:
        """(the model's state_dict() less what the engine holds: buffers and frozen parameters, the names of
        the frozen parameters). Tensors only: a module's non-tensor extra state is its own to save."""
        engine_owned, frozen = set(), set()
        for n, p in self.module.named_parameters(remove_duplicate=False):
            (engine_owned if p in self._slot else frozen).add(n)
        state = {n: t for n, t in self.module.state_dict().items()
                 if isinstance(t, torch.Tensor) and n not in engine_owned and not (exclude_frozen and n in frozen)}
        return state, frozen

    def _check_module_state(self, saved: Optional[dict], exclude_frozen: bool) -> None:
        """As load_state_dict(strict=True) would: the same names (less the frozen parameters when the save
        excluded them), the same shapes."""
        if saved is None:
            return
        have, frozen = self._module_state(exclude_frozen=False)
        unexpected = sorted(set(saved) - set(have))
        missing = sorted(set(have) - set(saved) - (frozen if exclude_frozen else set()))
        wrong = [f"'{n}' {tuple(t.shape)} (the model's: {tuple(have[n].shape)})" for n, t in saved.items()
                 if n in have and t.shape != have[n].shape]
        if unexpected or missing or wrong:
            raise ValueError("the checkpoint's buffers and frozen parameters are not the model's: "
                             + "; ".join(([f"not in the model: {unexpected}"] if unexpected else [])
                                         + ([f"not in the checkpoint: {missing}"] if missing else []) + wrong))

    def _restore_module_state(self, saved: Optional[dict]) -> None:
        if not saved:
            return
        targets = self.module.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, value in saved.items():
                targets[name].copy_(value)

    def export_safetensors(self, path: Union[str, os.PathLike]) -> None:
        """The fp32 weights as one safetensors file, each tensor under its name in model.state_dict()
        (a tied parameter under its first owner's name); rank 0 writes it."""
        self._core.export_safetensors(os.fspath(path), [b.names for b in self._blocks])

    def master_state_dict(self) -> dict:
        """{qualified parameter name: fp32 CPU tensor}: the engine's master weights (a collective over ranks)."""
        out = {}
        for b in self._blocks:
            flat = torch.from_numpy(self._core.gather_master(b.index))
            for view, name in zip(b.views, b.names):
                out[name] = flat.as_strided(*view).clone()
        return out

    def _full_values(self, b: _Block, slots: list) -> list:
        """The given parameters' current values in the model's dtype on its device, each a fresh tensor.
        A collective (Note [Editing weights])."""
        flat = torch.from_numpy(self._core.gather_master(b.index))
        return [flat.as_strided(*b.views[i]).to(device=self._torch_device, dtype=self._dtype, copy=True)
                for i in slots]

    def _settle(self, p: torch.Tensor) -> None:
        """Points a parameter no context holds any more at what it is now: its block's view while the block is
        gathered, else the placeholder."""
        b, i = self._slot[p]
        p.data = b.flat.as_strided(*b.views[i]) if b.users and b.flat is not None else self._placeholder

    def _write_refusal(self) -> Optional[str]:
        """Why weights cannot be written now, or None (Note [Editing weights])."""
        if self._backward_pending:
            return ("a forward ran with gradients enabled and its backward has not: the backward would gather "
                    "other weights than the forward computed with; edit after backward, or run the forward under "
                    "torch.no_grad()")
        return None

    def detach_module(self) -> torch.nn.Module:
        """Removes the hooks and puts the master weights back into the parameters; the engine is done after it."""
        weights = self.master_state_dict()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for module in self.module.modules():
            module.__dict__.pop("_tierzero_engine", None)
        _ENGINES.discard(self)
        for b in self._blocks:
            for p, name in zip(b.params, b.names):
                p.data = weights[name].to(device=self._placeholder.device, dtype=self._dtype)
        return self.module

    # ------------------------------------------------------------ facts
    @property
    def loss_scale(self) -> float:
        return self._core.loss_scale

    @property
    def device(self) -> torch.device:
        return self._placeholder.device

    @property
    def rank(self) -> int:
        return self._core.rank

    @property
    def world_size(self) -> int:
        return self._core.world_size

    @property
    def block_names(self) -> list:
        return [b.name for b in self._blocks]

    def describe(self) -> str:
        return self._core.describe()


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


def _refusal_text(failure: Optional[BaseException]) -> Optional[str]:
    return None if failure is None else f"{type(failure).__name__}: {failure}"


_NOT_TRAINED = "register_external_parameter: the parameter is not one the engine trains (frozen, or not in the model)"


def _check_external(model: torch.nn.Module, trained: set) -> None:
    """The parameters register_external_parameter() queued before initialize() (ids in `trained`), or
    ValueError."""
    for module in model.modules():
        if any(id(p) not in trained for p in module.__dict__.get("_tierzero_external", [])):
            raise ValueError(_NOT_TRAINED)


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


_STATE_FORMAT = "tierzero.torch checkpoint state 1"


def _load_blob(blob: bytes) -> Any:
    """Note [Client state]: torch.load with weights_only=True (no code from the file runs), tensors on the CPU."""
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)


def _pack_client_state(client_state: Optional[dict], module_state: dict, exclude_frozen: bool) -> bytes:
    """Note [Client state]: torch.save's bytes, refused here if _load_blob could not read them back."""
    if client_state is not None and not isinstance(client_state, dict):
        raise ValueError(f"save_checkpoint: client_state must be a dict (as DeepSpeed's), not "
                         f"{type(client_state).__name__}")
    buf = io.BytesIO()
    torch.save({"format": _STATE_FORMAT, "client_state": client_state or {}, "module": module_state,
                "exclude_frozen": exclude_frozen}, buf)
    blob = buf.getvalue()
    try:
        _load_blob(blob)
    except Exception as e:  # noqa: BLE001 - whatever the unpickler refuses, named in the message
        raise ValueError("save_checkpoint: client_state holds something load_checkpoint could not read back "
                         f"safely (torch.load with weights_only=True: {e}); keep it to tensors, numbers, strings, "
                         "lists, tuples and dicts") from None
    return blob


def _unpack_client_state(blob: Optional[bytes]) -> dict:
    """{"client_state": ..., "module": ...} as _pack_client_state saved them; {} for a checkpoint saved
    without (by the C++ engine or tierzero.Engine, or before tierzero.torch saved any)."""
    if blob is None:
        return {}
    try:
        state = _load_blob(blob)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"the client state was not saved by tierzero.torch (torch.load: {e})") from None
    if isinstance(state, dict) and "format" not in state:
        # The first format (the caller's dict alone): no buffers or frozen parameters to restore.
        warnings.warn("load_checkpoint: this checkpoint holds no buffers or frozen parameters (saved before "
                      "tierzero.torch kept them); the model's own stay", stacklevel=3)
        return {"client_state": state}
    if not isinstance(state, dict) or state.get("format") != _STATE_FORMAT:
        raise ValueError(f"the client state was not saved by tierzero.torch (format {state.get('format')!r})"
                         if isinstance(state, dict) else "the client state was not saved by tierzero.torch")
    return state


def _hyper_from_config(config: Any) -> dict:
    import json

    if config is None:
        return {}
    if not isinstance(config, dict):
        with open(config, encoding="utf-8") as f:
            config = json.load(f)
    opt = config.get("optimizer", {})
    return dict(type=opt.get("type", "AdamW"), **opt.get("params", {}))


def initialize(model: torch.nn.Module, config: Any = None, *, optimizer: Any = None,
               model_parameters: Any = None, lr_scheduler: Any = None,
               init_fn: Any = None) -> tuple[TorchEngine, EngineOptimizer]:
    """(engine, optimizer) for `model`, as deepspeed.initialize returns them.

    config: a path to a DeepSpeed-style JSON file, or a dict. The engine's
    optimizer is the config's "optimizer" block (Adam, AdamW, Adagrad, Lion);
    passing a torch optimizer is refused, since its states would live outside
    the engine's tiers. model_parameters is accepted for DeepSpeed
    compatibility and must be None or the model's parameters. Learning-rate
    schedules: the config's "scheduler" block, or a torch scheduler built on
    the returned optimizer (Note [Learning rate]); lr_scheduler= is refused.
    A model built on the meta device (with torch.device("meta")) is made one
    module at a time, straight into the engine, never whole in memory (Note
    [Models on the meta device]); init_fn(module) initialises each module's
    tensors, in place of its reset_parameters().
    """
    if config is None:
        raise ValueError("tierzero.torch.initialize: config= is required (a path or a dict)")
    if optimizer is not None:
        raise ValueError("tierzero.torch.initialize: the engine steps its own optimizer (the config's \"optimizer\" "
                         "block, on its tiers); pass optimizer=None")
    if lr_scheduler is not None:
        raise ValueError("tierzero.torch.initialize: lr_scheduler= is not taken; use the config's \"scheduler\" block "
                         "(WarmupLR, WarmupDecayLR, WarmupCosineLR), or build a torch scheduler on the returned "
                         "optimizer and call its step() after engine.step()")
    if model_parameters is not None:
        given = {id(p) for p in model_parameters}
        if given != {id(p) for p in model.parameters() if p.requires_grad}:
            raise ValueError("tierzero.torch.initialize: model_parameters must be the model's trainable parameters")
    if isinstance(config, (str, os.PathLike)):
        config = os.fspath(config)
    engine = TorchEngine(model, config, init_fn)
    engine.optimizer = EngineOptimizer(engine, _hyper_from_config(config))
    return engine, engine.optimizer


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """DeepSpeed's deepspeed.zero.register_external_parameter, before or after initialize(): `module`'s
    forward uses `parameter`, which another module owns; it is gathered with `module`'s own parameters."""
    engine_ref = getattr(module, "_tierzero_engine", None)
    engine = engine_ref() if engine_ref is not None else None
    if engine is not None:
        engine.register_external_parameter(module, parameter)
    else:  # initialize() reads these
        module.__dict__.setdefault("_tierzero_external", []).append(parameter)


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
        flat = torch.from_numpy(engine._core.gather_master(b.index))
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
    flat = torch.from_numpy(engine._core.gather_master(b.index))
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


def _live_gathered(engine: TorchEngine) -> int:
    """How many gathered blocks are alive (held by parameters, autograd or user views). For tests."""
    return len(engine._gathered)
