"""TorchEngine: a torch model trained through tierzero's engine, and initialize(), which makes one.

TorchEngine puts the pieces together: the model's blocks (model.py) go to an engine created once every
rank agrees on what it holds, with rank 0's values (rank0.py) or made on the meta device (meta.py); the
module hooks (hooks.py) run the model on the engine's memory; checkpoints are checkpoint.py's, and the
optimizer initialize() (initialize.py) returns is optimizer.py's.

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

Note [The engine as a module]
DeepSpeed's engine is an nn.Module holding the model as `module`, and code
written for it (Hugging Face's, accelerate's, training scripts) calls
nn.Module's methods on it: parameters(), named_parameters(), modules(),
train(), eval(), register_forward_hook(), isinstance(engine, nn.Module). So
TorchEngine is one too, with nn.Module last in its bases (tierzero.Engine's
methods come first), and nn.Module's own answers where DeepSpeed's engine
gives nn.Module's: parameter names prefixed "module.", engine(x) through
nn.Module.__call__ (hooks on the engine run), train()/eval() setting the
model's mode. The parameters it yields are the model's, placeholders between
forwards (Note [Parameters live in the engine]); engine.state_dict() and
model.state_dict() hold the full weights (Note [State dicts after
initialize]). Moving or casting the engine (to(), cuda(), half()) would move
the placeholders, not the engine's memory: refused by name.

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
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Optional

import torch

from ..engine import Engine
from .checkpoint import _Checkpoints
from .edit import _ENGINES
from .errors import _add_note, _refusal_text
from .hooks import _Block, _Hooks
from .meta import _check_meta, _MetaMaker
from .model import _check_external, _collect_blocks
from .optimizer import EngineOptimizer
from .rank0 import _frozen, _kept_digest, _take_rank0s_model

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchEngine(_Hooks, _Checkpoints, Engine, torch.nn.Module):
    """A torch module trained through tierzero's ZeRO engine. Made by initialize().

    An nn.Module wrapping the model as DeepSpeed's engine does (Note [The engine as a module]): `module` is the
    model, a submodule, so parameters(), named_parameters() ("module."-prefixed names, as DeepSpeed's),
    modules(), train() and eval() are nn.Module's, and engine(x) runs forward through nn.Module's call (its
    hooks too).

    A tierzero.Engine whose blocks are the model's modules: its facts (rank, world_size, loss_scale,
    learning_rate, optimizer_steps, layout, describe(), the timeline) are tierzero.Engine's. What a torch
    training loop calls is this class's, as DeepSpeed's engine takes it: engine(x), backward, step,
    the checkpoints, device as a torch.device, and gradient_accumulation_steps() as a call. The block-level
    calls (fetch, reduce_grads, set_master_params) are the module hooks' to make; edit weights through
    GatheredParameters or safe_set_full_fp32_param.
    """

    def __init__(self, model: torch.nn.Module, config: Any, init_fn: Any = None, *, store: Any = None,
                 timeout: float = 300.0):
        torch.nn.Module.__init__(self)  # first: nn.Module's attribute tables (Engine.__init__ does not call it)
        self.module = model
        blocks, self._module_blocks = _collect_blocks(model)
        if not blocks:
            raise ValueError("tierzero.torch.initialize: the model has no parameters that require grad")
        on_meta, kept = self._create_agreed(model, config, init_fn, blocks, store, timeout)
        layout = self.layout
        if on_meta:
            _MetaMaker(self._core, model, blocks, layout, init_fn, self._dtype).run()
        else:
            _take_rank0s_model(self._core, blocks, layout, kept)
        self._start_gathering(blocks, layout)
        self.last_report: dict = {}
        self.global_steps = 0
        self.micro_steps = 0  # engine.step() calls, as DeepSpeed's engine counts them
        self._last_grad_norm: Optional[float] = None
        self.optimizer: Optional[EngineOptimizer] = None  # set by initialize(), with the three below
        self.lr_scheduler: Any = None
        self.training_dataloader: Any = None
        self._client_scheduler: Any = None  # initialize(lr_scheduler=f): f(optimizer), stepped after each step
        _ENGINES.add(self)  # Note [Editing weights]
        self._install_hooks(model)
        self._install_state_dict_hooks(model)  # Note [State dicts after initialize]
        if self._dtype != torch.float32:
            model.to(self._dtype)  # Note [Model dtype]: frozen parameters and floating buffers

    def _create_agreed(self, model: torch.nn.Module, config: Any, init_fn: Any, blocks: list, store: Any,
                       timeout: float) -> tuple[bool, list]:
        """Creates the engine, with no values, once every rank has agreed on what it holds. Returns (whether
        the model is on the meta device, the frozen parameters and buffers to take rank 0's values of)."""
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
        super().__init__(config, specs, initial_values="later", store=store, timeout=timeout)
        self._dtype = _DTYPES[self.param_dtype]
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
        return on_meta, kept

    def _check_dtypes(self, blocks: list) -> None:
        """Note [Model dtype]: an fp32 config trains fp32 parameters; any other trainable dtype is refused."""
        for _, params, names in blocks:
            for n, p in zip(names, params):
                if p.dtype != torch.float32:
                    raise ValueError(f"tierzero.torch.initialize: parameter '{n}' is {p.dtype}, but the config trains "
                                     "float32 parameters; enable the config's \"bf16\" (or \"fp16\") block to train "
                                     "16-bit parameters with fp32 master weights, or convert the model (model.float())")

    # ------------------------------------------------------------ the training loop
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the model (with the saved-tensor hooks of Note [Saved tensors])."""
        if self.optimizer is not None and self.training:
            self.optimizer._take_lr()  # before backward: Note [Learning rate]
        # Note [A forward that raised]: one rank only, where no other rank's collectives can be left unmatched
        mark = self.fetch_mark() if self.world_size == 1 else None
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return self.module(*args, **kwargs)
        except BaseException as e:
            self._release_all()  # a forward that raised never ran the forward hooks of the modules it was in
            if mark is not None:
                try:
                    self.rewind_fetches(mark)
                except Exception as r:  # the forward's own error is the one to see
                    _add_note(e, f"tierzero.torch: rewinding the engine's fetches after it failed too: {r}")
            raise

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """loss.backward(), scaled by the engine's loss scale (fp16); returns the loss, as DeepSpeed's. Do not
        divide by the accumulation steps (the engine averages over them, as DeepSpeed's scale_wrt_gas)."""
        if self.optimizer is not None:
            self.optimizer._take_lr()  # before the gradients: Note [Learning rate]
        scale = self.loss_scale
        self._engine_backward = True
        try:
            (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
        finally:
            self._engine_backward = False
        if self._callback_queued or any(b.arrived or b.backward_held for b in self._blocks):
            self._end_of_backward()
        return loss

    def set_learning_rate(self, lr: float) -> None:
        """The learning rate of the next steps, as tierzero.Engine's; the returned optimizer's
        param_groups[0]["lr"] follows it, so the next step() does not hand the old rate back
        (Note [Learning rate])."""
        super().set_learning_rate(lr)
        if self.optimizer is not None:
            self.optimizer._show_lr()

    def step(self) -> dict:
        """Ends the micro-batch; the optimizer runs at the accumulation boundary. Returns the step report."""
        # Blocks still gathered here (a forward without its backward) would keep showing the old
        # parameters after the optimizer runs: let go of them first.
        self._release_all()
        self._backward_pending = False
        if self.optimizer is not None:
            self.optimizer._take_lr()  # Note [Learning rate]
        self.last_report = super().step()
        self.global_steps = self.last_report["step"]
        self.micro_steps += 1
        if self.last_report["stepped"] or self.last_report["overflow"]:
            self._last_grad_norm = self.last_report["grad_norm"]
        if self.optimizer is not None:
            self.optimizer._show_lr()
            if self.last_report["stepped"]:
                self.optimizer._opt_called = True  # what torch's schedulers check: the optimizer stepped
        if self._client_scheduler is not None and self.last_report["stepped"]:
            self._client_scheduler.step()  # as DeepSpeed's engine steps a client scheduler; the next step's rate
            self.optimizer._take_lr()
            self.optimizer._show_lr()
        return self.last_report

    # DeepSpeed's engine queries, for scripts and trainers that call them.
    def gradient_accumulation_steps(self) -> int:  # a call here, as DeepSpeed's; tierzero.Engine's property
        """Micro-batches per optimizer step (derived from train_batch_size and the ranks where the config
        gives that instead, as DeepSpeed does)."""
        return super().gradient_accumulation_steps

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
        return [self.learning_rate]

    def zero_optimization_stage(self) -> int:
        """The config's zero_optimization.stage."""
        return self._core.zero_stage

    def zero_optimization(self) -> bool:
        return self._core.zero_stage > 0

    def fp16_enabled(self) -> bool:
        return self.param_dtype == "float16"

    def bfloat16_enabled(self) -> bool:
        return self.param_dtype == "bfloat16"

    def gradient_clipping(self) -> float:
        """The config's gradient_clipping (0: off); the engine clips at the step (Note [Clipping])."""
        return self._core.gradient_clipping

    @property
    def global_rank(self) -> int:
        return self.rank

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def dp_world_size(self) -> int:
        return self.world_size

    @contextlib.contextmanager
    def no_sync(self) -> Any:
        """Accepted for code written for DDP and DeepSpeed: the engine sums every micro-batch's gradients into its
        fp32 accumulators and averages over ranks once per accumulation boundary either way, so there is no
        per-micro-batch reduction to skip; the result is the same."""
        yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Does nothing: the engine takes every gradient out of .grad as it arrives."""
        return None

    def master_state_dict(self) -> dict:
        """{qualified parameter name: fp32 CPU tensor}: the engine's master weights (a collective over ranks)."""
        out = {}
        for b in self._blocks:
            flat = torch.from_numpy(self.gather_master(b.index))
            for view, name in zip(b.views, b.names):
                out[name] = flat.as_strided(*view).clone()
        return out

    def _full_values(self, b: _Block, slots: list) -> list:
        """The given parameters' current values in the model's dtype on its device, each a fresh tensor.
        A collective (Note [Editing weights])."""
        flat = torch.from_numpy(self.gather_master(b.index))
        return [flat.as_strided(*b.views[i]).to(device=self._torch_device, dtype=self._dtype, copy=True)
                for i in slots]

    def close(self) -> None:
        """Frees the engine now (its swap files, memory, threads, the ranks' communicator), though the model's
        hooks still refer to it: they raise RuntimeError ("the engine is closed") if the model is run again. The
        trained weights lived in the engine: save a checkpoint, export them, or detach_module() first to keep
        them. Closing again does nothing; engines still open at interpreter exit are closed then."""
        if self.closed:
            return
        self._release_all()  # the views this engine's hooks hold; views still held elsewhere keep its memory
        _ENGINES.discard(self)
        super().close()

    def __enter__(self) -> "TorchEngine":
        return self

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

    def to(self, *args: Any, **kwargs: Any) -> "TorchEngine":
        """Itself, where asked for the device it is on and no other dtype (accelerate's prepare() calls
        model.to(its device)); any real move or cast is refused (Note [The engine as a module])."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is None and (device is None or _same_device(device, self.device)):
            return self
        return self._apply(None)

    def _apply(self, fn: Any, recurse: bool = True) -> "TorchEngine":
        # nn.Module's to(), cuda(), cpu(), half(), float(), ... all come here (Note [The engine as a module]).
        raise ValueError("TorchEngine: moving or casting the engine (to(), cuda(), half(), ...) is not supported: "
                         "its parameters live in the engine's tiers, placed by the config (\"zero_optimization\" "
                         "offload, \"bf16\"/\"fp16\"); move or cast the model before initialize()")

    # ------------------------------------------------------------ facts (the rest are tierzero.Engine's)
    @property
    def device(self) -> torch.device:
        return self._placeholder.device

    @property
    def block_names(self) -> list:
        return [b.name for b in self._blocks]


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    index = lambda d: d.index if d.index is not None else (torch.cuda.current_device() if d.type == "cuda" else 0)  # noqa: E731
    return index(a) == index(b)


def _live_gathered(engine: TorchEngine) -> int:
    """How many gathered blocks are alive (held by parameters, autograd or user views). For tests."""
    return len(engine._gathered)
