"""initialize(): a TorchEngine, its optimizer, data loader and schedule, as deepspeed.initialize returns them.

Note [DeepSpeed's initialize]
deepspeed.initialize(args, model, optimizer, model_parameters, training_data,
lr_scheduler, ..., collate_fn, config, ..., config_params) returns (engine,
optimizer, training_dataloader, lr_scheduler), and so does this one, taking
the same arguments with the same meaning, or refusing by name what tierzero
cannot do the same way:

- the config comes from `config`, else `config_params` (DeepSpeed's older
  name), else `args.deepspeed_config`; given both in `args` and as `config`
  is an error, as in DeepSpeed;
- `model_parameters` may be parameters or param groups (dicts, the usual
  weight-decay split of Hugging Face and nanoGPT); a group's lr, betas, eps
  or weight_decay overrides the config's, as a torch group overrides its
  optimizer's defaults. Groups that differ in weight_decay train each
  parameter with its group's (engine.set_weight_decay, Note [Weight decay per
  parameter] in engine/src/optimizer_step.cpp; a group without one takes the
  config's), exactly as torch's optimizer over those groups. The engine runs
  one lr, one betas and one eps for all parameters, so groups that differ in
  one of those are refused, naming the groups and values (groups that agree
  train as one);
- `training_data` becomes a torch DataLoader as DeepSpeed builds it: batches
  of train_micro_batch_size_per_gpu, a DistributedSampler over the ranks
  (shuffled, seed 0), `collate_fn`, and the config's dataloader_drop_last;
- `lr_scheduler` may be a callable taking the optimizer (built on the returned
  one and stepped by the engine after each optimizer step, as DeepSpeed's
  engine steps a client scheduler); a scheduler object built on another
  optimizer cannot drive the engine and is refused. With the config's
  "scheduler" block the returned schedule is an EngineLRScheduler, which the
  engine runs from its optimizer step count;
- `mpu` and `mesh_param` (model and sequence parallelism) are refused;
  `distributed_port` and `dist_init_required` are not needed (the ranks come
  from the torchrun variables) and are ignored.

tierzero's older form, the model first (initialize(model, config)), is still
taken.
"""

from __future__ import annotations

import json
import os
import warnings
import weakref
from typing import Any, Callable, Optional

import torch

from .engine import TorchEngine
from .optimizer import EngineOptimizer

_GROUP_HYPER = ("lr", "betas", "eps", "weight_decay")


def initialize(args: Any = None, model: Optional[torch.nn.Module] = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: Any = None, mpu: Any = None, dist_init_required: Any = None,
               collate_fn: Optional[Callable] = None, config: Any = None, mesh_param: Any = None,
               config_params: Any = None, *, init_fn: Any = None, store: Any = None,
               timeout: float = 300.0) -> tuple:
    """(engine, optimizer, training_dataloader, lr_scheduler) for `model`, as deepspeed.initialize returns them.

    engine: a TorchEngine (engine(x), engine.backward(loss), engine.step(), checkpoints, DeepSpeed's engine
    queries). optimizer: an EngineOptimizer, the config's "optimizer" block as a torch.optim.Optimizer (torch's
    schedulers take it; its step() is engine.step()). training_dataloader: a torch DataLoader over
    `training_data` as DeepSpeed builds it, or None. lr_scheduler: the schedule the engine runs (the config's
    "scheduler" block as an EngineLRScheduler, or the one `lr_scheduler(optimizer)` built), or None.

    config: a path to a DeepSpeed-style JSON file, or a dict (or `config_params`, or `args.deepspeed_config`).
    The engine's optimizer is the config's "optimizer" block (Adam, AdamW, Adagrad, Lion); passing a torch
    optimizer is refused, since its states would live outside the engine's tiers. model_parameters: None, the
    model's trainable parameters, or param groups of them (Note [DeepSpeed's initialize]). A model built on the
    meta device (with torch.device("meta")) is made one module at a time, straight into the engine, never whole
    in memory (Note [Models on the meta device]); init_fn(module) initialises each module's tensors, in place
    of its reset_parameters(). The model may also come first, tierzero's older form: initialize(model, config).
    Ranks on several machines meet through `store` (a torch.distributed Store; by default torch's own: the
    initialised process group's, or torchrun's at MASTER_ADDR:MASTER_PORT), within `timeout` seconds, which
    also bounds each collective (tierzero.Engine; docs/engine.md, "Ranks on several machines").
    """
    if isinstance(args, torch.nn.Module):  # tierzero's older form: initialize(model, config)
        if model is not None and not isinstance(model, (str, os.PathLike, dict)):
            raise ValueError("tierzero.torch.initialize: the first argument is DeepSpeed's `args`; pass the model "
                             "as model=")
        if model is not None:
            if config is not None:
                raise ValueError("tierzero.torch.initialize: a config given twice (as the second argument and as "
                                 "config=)")
            config = model
        model, args = args, None
    if model is None:
        raise ValueError("tierzero.torch.initialize: model= is required")
    for name, value, what in (("mpu", mpu, "model parallelism (Megatron's mpu)"),
                              ("mesh_param", mesh_param, "a device mesh (sequence and data parallel sizes)")):
        if value is not None:
            raise ValueError(f"tierzero.torch.initialize: {name}= asks for {what}, a DeepSpeed feature tierzero does "
                             "not support; the ranks are all data-parallel (torchrun's variables)")
    config = _config_from(args, config, config_params)
    if optimizer is not None:
        raise ValueError("tierzero.torch.initialize: the engine steps its own optimizer (the config's \"optimizer\" "
                         "block, on its tiers); pass optimizer=None")
    raw = _load(config)
    if lr_scheduler is not None:
        _check_client_scheduler(lr_scheduler, raw)
    groups, config, decays = _groups(model, model_parameters, config, raw)
    if isinstance(config, (str, os.PathLike)):
        config = os.fspath(config)
    engine = TorchEngine(model, config, init_fn, store=store, timeout=timeout)
    for group, decay in zip(groups or [], decays):
        if decay is not None:  # Note [Weight decay per parameter] (engine/src/optimizer_step.cpp)
            for p in group["params"]:
                block, i = engine._slot[p]
                engine.set_weight_decay(block.index, i, decay)
    engine.optimizer = EngineOptimizer(engine, groups)
    _mark_parameters(engine)
    engine.training_dataloader = (None if training_data is None
                                  else _dataloader(engine, training_data, collate_fn, raw))
    if lr_scheduler is not None:
        engine.lr_scheduler = engine._client_scheduler = lr_scheduler(engine.optimizer)
    elif raw.get("scheduler") is not None:
        engine.lr_scheduler = EngineLRScheduler(engine)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _config_from(args: Any, config: Any, config_params: Any) -> Any:
    """The config as DeepSpeed picks it: config, else config_params, else args.deepspeed_config."""
    if config is None and config_params is not None:
        config = config_params
    from_args = None
    for name in ("deepspeed_config", "deepscale_config"):  # the second is DeepSpeed's deprecated spelling
        if getattr(args, name, None) is not None:
            from_args = getattr(args, name)
    if from_args is not None:
        if config is not None:
            raise ValueError("tierzero.torch.initialize: a config both in args.deepspeed_config and as config= "
                             "(or config_params=); give one, as DeepSpeed requires")
        config = from_args
    if config is None:
        raise ValueError("tierzero.torch.initialize: config= is required (a path or a dict), or "
                         "args.deepspeed_config")
    return config


def _load(config: Any) -> dict:
    """The config as a dict (a path is read; the engine reads it again and names it in errors)."""
    if isinstance(config, dict):
        return config
    with open(config, encoding="utf-8") as f:
        loaded = json.load(f)
    return loaded if isinstance(loaded, dict) else {}


def _groups(model: torch.nn.Module, model_parameters: Any, config: Any, raw: dict) -> tuple:
    """(the param groups for the optimizer, or None for one group of all; the config, with the groups'
    hyperparameters where they override it; each group's own weight decay where the groups differ in it, else
    None). Note [DeepSpeed's initialize]."""
    if model_parameters is None:
        return None, config, []
    items = list(model_parameters)
    if items and all(isinstance(g, dict) for g in items):
        groups = []
        for i, g in enumerate(items):
            if "params" not in g:
                raise ValueError(f"tierzero.torch.initialize: model_parameters[{i}] has no 'params'")
            params = g["params"]
            groups.append(dict(g, params=[params] if isinstance(params, torch.Tensor) else list(params)))
    elif any(isinstance(g, dict) for g in items):
        raise ValueError("tierzero.torch.initialize: model_parameters mixes param groups (dicts) and parameters")
    else:
        groups = [{"params": items}]
    given = [p for g in groups for p in g["params"]]
    trainable = [p for p in model.parameters() if p.requires_grad]
    if len({id(p) for p in given}) != len(given):
        raise ValueError("tierzero.torch.initialize: model_parameters lists a parameter twice")
    if {id(p) for p in given} != {id(p) for p in trainable}:
        raise ValueError("tierzero.torch.initialize: model_parameters must be the model's trainable parameters, each "
                         "once (the engine trains every parameter that requires grad)")
    params = dict((raw.get("optimizer") or {}).get("params") or {})
    changed = False
    decays: list = [None] * len(groups)
    for key in _GROUP_HYPER:
        explicit = [(i, _value(g[key])) for i, g in enumerate(groups) if key in g]
        if not explicit:
            continue
        values = {v for _, v in explicit}
        configured = params.get(key)
        if len(explicit) < len(groups):  # the other groups take the config's
            values.add(None if configured is None or configured == "auto" else _value(configured))
        if len(values) > 1 and key == "weight_decay":  # each parameter steps with its group's
            for i, v in explicit:
                decays[i] = float(v)
            if configured == "auto" and len(explicit) == len(groups):  # no parameter takes the config's
                params[key], changed = explicit[0][1], True
            continue
        if len(values) > 1:
            shown = ", ".join(f"group {i} ({len(groups[i]['params'])} tensors): {v}" for i, v in explicit)
            raise ValueError(f"tierzero.torch.initialize: the param groups differ in {key} ({shown}; "
                             f"optimizer.params.{key} = {configured!r} for the rest); tierzero's engine runs one {key} "
                             "for every parameter (only weight_decay may differ between groups), so these groups "
                             "cannot train as given: use one value (e.g. put every parameter in one group)")
        value = explicit[0][1]
        if configured != (list(value) if isinstance(value, tuple) else value):
            params[key] = list(value) if isinstance(value, tuple) else value
            changed = True
    if changed:  # the groups' values override the config's, as a torch group's override its optimizer's defaults
        config = dict(raw)
        config["optimizer"] = dict(raw.get("optimizer") or {}, params=params)
    return [{k: v for k, v in g.items() if k not in _GROUP_HYPER} for g in groups], config, decays


def _value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.item()
    return tuple(float(x) for x in v) if isinstance(v, (list, tuple)) else v


def _dataloader(engine: TorchEngine, dataset: Any, collate_fn: Optional[Callable], raw: dict) -> Any:
    """The training data loader DeepSpeed builds: micro batches, a DistributedSampler over the ranks."""
    if not any(k in raw and raw[k] != "auto" for k in ("train_micro_batch_size_per_gpu", "train_batch_size")):
        raise ValueError("tierzero.torch.initialize: training_data= needs the batch size: give "
                         "train_micro_batch_size_per_gpu (or train_batch_size) in the config")
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=engine.world_size, rank=engine.rank)
    return torch.utils.data.DataLoader(dataset, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler,
                                       collate_fn=collate_fn, drop_last=engine._core.dataloader_drop_last,
                                       pin_memory=engine.device.type == "cuda")


def _check_client_scheduler(lr_scheduler: Any, raw: dict) -> None:
    if not callable(lr_scheduler) or hasattr(lr_scheduler, "step"):
        raise ValueError("tierzero.torch.initialize: lr_scheduler= takes a callable that builds the scheduler on the "
                         "optimizer it is given (e.g. lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, f)); a "
                         "scheduler already built on another optimizer cannot drive the engine's")
    if raw.get("scheduler") is not None:
        raise ValueError("tierzero.torch.initialize: lr_scheduler= and the config's \"scheduler\" block both set the "
                         "learning rate; give one")


class EngineLRScheduler:
    """The config's "scheduler" block as initialize() returns it: the engine runs it from its optimizer step
    count (so a loaded checkpoint resumes it), as DeepSpeed's engine steps its own after each optimizer step.
    get_lr() is the rate of the next step, get_last_lr() the rate of the last one; step() does nothing (the
    engine has stepped it already: calling it again, as some loops do, would advance DeepSpeed's twice), and
    the schedule has no state of its own to save."""

    def __init__(self, engine: TorchEngine):
        self._engine_ref = weakref.ref(engine)
        self._warned = False

    def get_lr(self) -> list:
        return self._engine_ref().get_lr()

    def get_last_lr(self) -> list:
        engine = self._engine_ref()
        return [engine.last_report.get("lr", engine.learning_rate)]

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn("tierzero: the engine runs the config's scheduler from its optimizer step count; "
                          "lr_scheduler.step() does nothing", RuntimeWarning, stacklevel=2)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        return None


# ---------------------------------------------------------------- torch.nn.utils.clip_grad_norm_
# Note [Clipping]
# The engine takes every gradient out of .grad as it arrives, so
# torch.nn.utils.clip_grad_norm_ over the model's parameters sees none: it
# returns 0 and clips nothing (as it does under DeepSpeed's ZeRO-3). tierzero
# clips at the step, from the config's "gradient_clipping", over the whole
# gradient (engine.get_global_grad_norm() is its norm). So that a loop written
# for plain torch is not silently left unclipped, clip_grad_norm_ warns, once
# per engine, when it is given parameters an engine trains.
# {id(parameter): (the parameter, its engine)}, both weakly (a tensor's == is elementwise, so tensors cannot key a
# WeakKeyDictionary); an entry whose parameter is gone is stale.
_OWNERS: dict = {}
_ORIGINAL_CLIP = None


def _mark_parameters(engine: TorchEngine) -> None:
    global _ORIGINAL_CLIP
    ref = weakref.ref(engine)
    for key in [k for k, (param, _) in _OWNERS.items() if param() is None]:
        del _OWNERS[key]
    for b in engine._blocks:
        for p in b.params:
            _OWNERS[id(p)] = (weakref.ref(p), ref)
    if _ORIGINAL_CLIP is None:
        _ORIGINAL_CLIP = torch.nn.utils.clip_grad_norm_
        torch.nn.utils.clip_grad_norm_ = _clip_grad_norm_
        torch.nn.utils.clip_grad.clip_grad_norm_ = _clip_grad_norm_


def _clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> torch.Tensor:
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    for p in params:
        param, ref = _OWNERS.get(id(p), (None, None))
        engine = ref() if param is not None and param() is p else None
        if engine is not None and getattr(engine, "_clip_reports_norm", False):
            # tierzero.hf: the Trainer asks after the engine has stepped; its clipping was the engine's
            norm = engine.get_global_grad_norm()
            return torch.tensor(0.0 if norm is None else norm)
        if engine is not None and not engine.closed and not getattr(engine, "_clip_warned", False):
            engine._clip_warned = True
            clip = engine._core.gradient_clipping
            warnings.warn(f"torch.nn.utils.clip_grad_norm_(max_norm={max_norm}) sees no gradients: tierzero's engine "
                          "holds them, and clips at engine.step() by the config's \"gradient_clipping\" "
                          f"(now {clip or 'off'}); set it there (engine.get_global_grad_norm() is the norm)",
                          RuntimeWarning, stacklevel=2)
            break
    return _ORIGINAL_CLIP(params, max_norm, *args, **kwargs)
