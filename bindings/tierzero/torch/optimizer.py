"""The optimizer initialize() returns: a torch.optim.Optimizer over the engine's own (the config's
"optimizer" block), so torch's learning-rate schedulers take it.

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

import weakref
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .engine import TorchEngine


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
        defaults["lr"] = engine.learning_rate
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
        engine = self._engine()
        if lr != engine.learning_rate:
            engine.set_learning_rate(lr)

    def _group_lr(self) -> float:
        lr = self.param_groups[0]["lr"]
        return float(lr.item() if isinstance(lr, torch.Tensor) else lr)  # torch allows a tensor lr

    def _show_lr(self) -> None:
        self.param_groups[0]["lr"] = self._engine().learning_rate


def _hyper_from_config(config: Any) -> dict:
    import json

    if config is None:
        return {}
    if not isinstance(config, dict):
        with open(config, encoding="utf-8") as f:
            config = json.load(f)
    opt = config.get("optimizer", {})
    return dict(type=opt.get("type", "AdamW"), **opt.get("params", {}))
