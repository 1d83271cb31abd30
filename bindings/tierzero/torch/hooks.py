"""The module hooks that run a torch model on the engine's memory: a module's block is gathered for its
forward and again for its backward, autograd saves block coordinates instead of views, and each block's
gradients go to the engine as they arrive.

Note [Parameters live in the engine]
After initialize(), a parameter's .data is an empty placeholder except while
its module computes. A forward pre-hook fetches the module's block and points
each parameter's .data at a zero-copy view of the gathered buffer (DLPack:
the engine's memory, seen by torch); a forward hook sets .data back to the
placeholder. The gathered buffer returns to the engine when no tensor views
it any more (Note [Gathered block lifetime] in bindings/engine_bindings.cpp): torch's
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

Note [Capsules, not tensors]
The tensors handed to _core on hot paths (gradients to reduce_grads, the
optimizer's arrays in tierzero.optim) go as DLPack capsules made by
torch.utils.dlpack.to_dlpack (a C call, ~0.4 us), not as tensors: given a
tensor, nanobind calls Tensor.__dlpack__, which is Python and costs ~3 us per
array, more than the rest of a small block's reduce_grads. The capsule
carries no stream, which is right here: CUDA gradients are synchronised
before reduce_grads (stream=-1), and tierzero.optim is CPU only. Arrays are
checked the same way (dtype, device, order, size, by argument name).
"""

from __future__ import annotations

import weakref
from collections import namedtuple
from typing import Any, Iterator, Optional

import torch
from torch.utils.dlpack import to_dlpack

from .model import _NOT_TRAINED

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


class _Hooks:
    """TorchEngine's gathering, saved-tensor and gradient hooks, and the state they keep. Uses the engine's
    _core, _dtype and _module_blocks ({module: [block ids it uses]})."""

    def _start_gathering(self, blocks: list, layout: list) -> None:
        """The hooks' state for `blocks` ([(name, params, qualified names)]), every block released."""
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
        self._engine_backward = False             # inside engine.backward (fp16: the loss was scaled)
        self._fp16 = self._core.param_dtype == "float16"
        self._hooks: list = []

    def _install_hooks(self, model: torch.nn.Module) -> None:
        """Points every trained parameter at the placeholder and hooks the model's modules and parameters."""
        # A tensor's hooks are held on the C++ side, out of the garbage collector's sight: a hook that
        # referenced the engine would make model -> parameter -> hook -> engine -> model a cycle nothing frees.
        engine_ref = weakref.ref(self)

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
            # _core itself on the hot paths (here and in _flush), not tierzero.Engine's wrappers of it
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
        grad = p.grad
        p.grad = None
        self._queue_end_of_backward()
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
            if not self._engine_backward and self._fp16 and self.loss_scale != 1.0:
                # loss.backward() (accelerate's backward, a plain loop's) would hand the engine gradients it then
                # divides by the loss scale: updates 2^16 times too small, without a word.
                raise RuntimeError("tierzero.torch: with fp16 the loss must be multiplied by the engine's loss scale: "
                                   "call engine.backward(loss), not loss.backward() (or accelerate's backward)")
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


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """DeepSpeed's deepspeed.zero.register_external_parameter, before or after initialize(): `module`'s
    forward uses `parameter`, which another module owns; it is gathered with `module`'s own parameters."""
    engine_ref = getattr(module, "_tierzero_engine", None)
    engine = engine_ref() if engine_ref is not None else None
    if engine is not None:
        engine.register_external_parameter(module, parameter)
    else:  # initialize() reads these
        module.__dict__.setdefault("_tierzero_external", []).append(parameter)
