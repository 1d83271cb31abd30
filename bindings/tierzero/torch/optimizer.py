"""The optimizer initialize() returns: a torch.optim.Optimizer over the engine's own (the config's
"optimizer" block), so torch's learning-rate schedulers take it.

Note [Learning rate]
The engine's learning rate comes from the config's "scheduler" block
(DeepSpeed's WarmupLR, WarmupDecayLR, WarmupCosineLR, computed by the engine
from its optimizer step count, so a loaded checkpoint resumes the schedule),
or from optimizer.param_groups[0]["lr"]: the returned optimizer is a
torch.optim.Optimizer, and engine.step() hands a changed "lr" to the engine
before the step, so a torch scheduler built on it (LambdaLR, CosineAnnealingLR,
...) and stepped after engine.step() works as with any torch optimizer. The
engine's forward (in training) and backward hand it over too, before any
gradient reaches the engine: the steps the engine takes under backward use the
step's rate, and a rate first seen at step() would undo them all (Note
[Stepping under backward], engine/src/step_ahead.h; a warm-up or decay changes
it every step). After
each engine.step() "lr" shows the learning rate of the next step. Changing
"lr" while the config has a scheduler is a ValueError; a torch scheduler's
own state is saved by its owner (scheduler.state_dict()), as in plain torch.
With several param groups (initialize(model_parameters=[{...}, {...}])) every
group's "lr" must be the same: the engine runs one rate. Their "weight_decay"
may differ (each group shows the one its parameters step with), but is fixed
after initialize().

Note [accelerate]
accelerate.Accelerator().prepare(engine, optimizer, dataloader) takes the
engine as any nn.Module (Note [The engine as a module]): its to(device) is
the engine itself, the optimizer is wrapped in accelerate's, whose step() is
this one's (engine.step()), and accelerator.backward(loss) is loss.backward(),
which hands the gradients to the engine as engine.backward does (refused with
fp16, whose loss must be scaled: call engine.backward there). Accumulation is
counted in one place: either accelerate's (Accelerator(gradient_accumulation_steps=N)
divides each loss by N and steps the optimizer every N micro-batches; the
engine, with the config's gradient_accumulation_steps 1, sums the N
backwards into one step) or the engine's (the config's, with accelerate's 1:
every micro-batch's optimizer.step() is engine.step(), which steps at the
boundary). Both at once would divide twice and step every N x M
micro-batches; step() refuses it, naming both.

Note [Optimizer state_dict]
transformers.Trainer and accelerate save and load the optimizer through
state_dict() and load_state_dict(). The moments live in the engine's tiers,
possibly larger than host memory, and are saved by engine.save_checkpoint, so
state_dict() holds torch's layout (param_groups with the parameters' indices,
an empty "state") and the engine's optimizer step count, and
load_state_dict() takes the param groups' "lr" and checks that count against
the engine's: a dict taken at another step would otherwise be loaded as if
the moments came with it (a fresh engine's are zero), so it is refused,
naming engine.load_checkpoint, which restores them.
"""

from __future__ import annotations

import sys
import weakref
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from .engine import TorchEngine


class EngineOptimizer(torch.optim.Optimizer):
    """What initialize() returns as the optimizer: the engine steps its own (the config's "optimizer" block).

    A torch.optim.Optimizer, so torch's learning-rate schedulers take it
    (Note [Learning rate]). step() is engine.step(); zero_grad() does nothing
    (the engine takes every gradient out of .grad as it arrives). Its param
    groups are the groups initialize() was given (one group of every trainable
    parameter by default), each with the hyperparameters the engine runs (the
    config's, as numbers: "type" is the optimizer that runs, DeepSpeed's
    "Adam" with adam_w_mode being "AdamW") and "lr", the learning rate of the
    next optimizer step. Only "lr" may be changed, alike in every group.
    state_dict() and load_state_dict() as Note [Optimizer state_dict] says.
    """

    def __init__(self, engine: "TorchEngine", groups: Optional[list] = None):
        hyper = dict(engine._core.optimizer)
        hyper["betas"] = tuple(hyper["betas"])
        hyper["lr"] = engine.learning_rate
        if groups is None:
            groups = [{"params": [p for b in engine._blocks for p in b.params]}]
        super().__init__([{**g, **{k: v for k, v in hyper.items() if k != "lr"}, "lr": hyper["lr"]} for g in groups],
                         hyper)
        for group in self.param_groups:  # each group's own, where the groups differ in it (initialize())
            if group["params"]:
                block, i = engine._slot[group["params"][0]]
                group["weight_decay"] = engine.weight_decay(block.index, i)
        self._engine_ref = weakref.ref(engine)
        self._stepped_by_engine = False  # set by tierzero.hf.Trainer, whose training_step() calls engine.step()
        self._fixed = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")}
                       for g in self.param_groups]

    def _engine(self) -> "TorchEngine":
        engine = self._engine_ref()
        if engine is None:
            raise ValueError("EngineOptimizer: its engine is gone (keep the engine initialize() returned)")
        return engine

    def step(self, closure: Any = None) -> dict:
        if closure is not None:
            raise ValueError("EngineOptimizer.step(): closures are not supported; call engine.backward, engine.step")
        engine = self._engine()
        if self._stepped_by_engine:  # tierzero.hf: the trainer's step() after engine.step() has stepped
            return engine.last_report
        _check_accelerate_accumulation(engine)
        return engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_engine_ref", None) is not None:
            raise ValueError("EngineOptimizer: the engine's parameters are fixed at initialize(); add_param_group "
                             "is not supported (pass the groups as initialize(model_parameters=[...]))")
        super().add_param_group(param_group)

    def state_dict(self) -> dict:
        """torch's layout with an empty "state" and the engine's optimizer step count (Note [Optimizer
        state_dict]): the moments are saved by engine.save_checkpoint."""
        out = super().state_dict()
        out["tierzero"] = {"optimizer_steps": self._engine().optimizer_steps,
                           "moments": "in the engine's tiers: engine.save_checkpoint saves them"}
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Takes the groups' "lr" from a state_dict() of this engine's optimizer, taken at the engine's
        current optimizer step (after engine.load_checkpoint); anything else is refused (Note [Optimizer
        state_dict])."""
        engine = self._engine()
        ours = state_dict.get("tierzero") if isinstance(state_dict, dict) else None
        if ours is None:
            raise ValueError("EngineOptimizer.load_state_dict: not a state_dict() of a tierzero engine's optimizer; "
                             "its moments live in the engine's tiers: load them with engine.load_checkpoint")
        if ours.get("optimizer_steps") != engine.optimizer_steps:
            raise ValueError(f"EngineOptimizer.load_state_dict: the state_dict was taken at optimizer step "
                             f"{ours.get('optimizer_steps')}, the engine is at step {engine.optimizer_steps}; the "
                             "moments are not in it: load the engine's checkpoint of that step first "
                             "(engine.load_checkpoint), which restores them")
        groups = state_dict.get("param_groups", [])
        if len(groups) != len(self.param_groups):
            raise ValueError(f"EngineOptimizer.load_state_dict: {len(groups)} param groups; this optimizer has "
                             f"{len(self.param_groups)}")
        for mine, theirs in zip(self.param_groups, groups):
            mine["lr"] = theirs["lr"]
        self._take_lr()

    def _take_lr(self) -> None:
        """Hands a changed param_groups[*]['lr'] to the engine; any other change is refused."""
        for i, (group, fixed) in enumerate(zip(self.param_groups, self._fixed)):
            for k, v in fixed.items():
                if group.get(k) != v:
                    raise ValueError(f"EngineOptimizer: param_groups[{i}]['{k}'] changed from {v!r} to "
                                     f"{group.get(k)!r}; only 'lr' can change after initialize (the rest is the "
                                     "config's optimizer block)")
        lr = self._group_lr()
        for i in range(1, len(self.param_groups)):
            if self._group_lr(i) != lr:
                raise ValueError(f"EngineOptimizer: param_groups[{i}]['lr'] = {self._group_lr(i)} differs from "
                                 f"param_groups[0]['lr'] = {lr}; the engine runs one learning rate for every "
                                 "parameter")
        engine = self._engine()
        if lr != engine.learning_rate:
            engine.set_learning_rate(lr)

    def _group_lr(self, i: int = 0) -> float:
        lr = self.param_groups[i]["lr"]
        return float(lr.item() if isinstance(lr, torch.Tensor) else lr)  # torch allows a tensor lr

    def _show_lr(self) -> None:
        lr = self._engine().learning_rate
        for group in self.param_groups:
            group["lr"] = lr


def _check_accelerate_accumulation(engine: "TorchEngine") -> None:
    """Note [accelerate]: accumulation counted by accelerate and by the engine at once is refused."""
    state = sys.modules.get("accelerate.state")
    if state is None or engine.gradient_accumulation_steps() == 1:
        return
    try:
        shared = state.GradientState._shared_state
        steps = int((shared.get("plugin_kwargs") or {}).get("num_steps", 1))
    except Exception:  # noqa: BLE001 - another accelerate's internals: nothing to check against
        return
    if steps > 1:
        raise ValueError(f"EngineOptimizer.step(): accelerate accumulates gradients over {steps} micro-batches "
                         f"(Accelerator(gradient_accumulation_steps={steps})) and the engine over "
                         f"{engine.gradient_accumulation_steps()} (the config's gradient_accumulation_steps): each "
                         "loss would be divided twice and the optimizer step every "
                         f"{steps * engine.gradient_accumulation_steps()} micro-batches; set one of them to 1")
