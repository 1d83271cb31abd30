"""tierzero.hf: Hugging Face transformers' Trainer on tierzero's engine.

    from tierzero.hf import Trainer
    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=data,
                      tierzero_config="ds_config.json")   # a DeepSpeed config, "auto" values and all
    trainer.train()
    trainer.save_model("out")                           # full weights, gathered from the engine

Note [The Trainer on the engine]
transformers.Trainer with `deepspeed=` hands its model to deepspeed.initialize
and lets the engine do the backward, the step, clipping and (with a
"scheduler" block) the schedule. tierzero.hf.Trainer does the same with
tierzero.torch.initialize:

- fill_auto() fills the config's "auto" values from the TrainingArguments as
  the Trainer fills DeepSpeed's (micro batch, accumulation steps, batch size,
  clipping from max_grad_norm, the optimizer's lr / betas / eps /
  weight_decay, fp16 / bf16, the scheduler's rates and step counts, the
  bucket sizes from the model's hidden_size), and refuses a number that
  contradicts the arguments, as the Trainer does. Where the config has no
  "optimizer" block the arguments' AdamW is used; where it has no
  "gradient_clipping" the arguments' max_grad_norm is (the plain Trainer
  clips by it; the engine clips at its step).
- The optimizer's param groups are the Trainer's (weight decay on all but
  biases and norms), each parameter stepping with its group's weight decay
  (Note [Weight decay per parameter] in engine/src/optimizer_step.cpp).
- training_step() forms the loss as the plain Trainer does (divided by the
  batch's token count where the model takes num_items_in_batch) and runs
  engine.backward and engine.step() on every micro-batch, as accelerate does
  for DeepSpeed: the engine divides by the accumulation steps (so a loss the
  Trainer has divided already is multiplied back) and runs its optimizer at
  the boundary, so the
  Trainer's optimizer.step() does nothing and its clipping call is the
  engine's (the config's gradient_clipping; the Trainer's clip call gets
  the engine's gradient norm, which it logs). The Trainer's schedule
  (lr_scheduler_type, warmup) runs on the returned optimizer, whose rate the
  engine takes at its next step; a config "scheduler" block is run by the
  engine instead.
- save_model() and checkpoints write the full weights gathered from the
  engine (tied weights under each name), never the empty placeholders the
  parameters hold between forwards; a checkpoint also holds the engine's own
  (moments, step count) under "tierzero/", which resume_from_checkpoint loads.

Note [Pretrained weights one module at a time]
from_pretrained() builds the transformers model on the meta device and lets
initialize() make it one module at a time (Note [Models on the meta device]
in tierzero/torch/meta.py) with an init_fn that reads each module's own
tensors from the checkpoint's safetensors files (one file, or the shards
model.safetensors.index.json lists), a tensor at a time: the file is opened
for that tensor and closed again, so neither the model nor a shard is ever
whole in host memory (opened once and kept, its memory map would hold every
page read so far in the process's resident set). A tied weight the
checkpoint holds under one name (GPT-2's lm_head under
transformer.wte.weight) is made at the holder whose name it has. A tensor
the checkpoint lacks is never set, so initialize() refuses the model naming
it (transformers' from_pretrained would initialise it at random with a
warning): the weights are the checkpoint's or there is an error.
"""
from __future__ import annotations

import copy
import json
import os
from typing import Any, Optional

import torch
import transformers

from .torch import initialize

__all__ = ["Trainer", "fill_auto", "from_pretrained"]


def fill_auto(config: Any, args: "transformers.TrainingArguments", *, model: Any = None,
              num_training_steps: Optional[int] = None) -> dict:
    """A copy of `config` (a path or a dict) with its "auto" values filled from `args` as transformers' Trainer
    fills a DeepSpeed config (Note [The Trainer on the engine]). ValueError naming each number that contradicts
    the arguments."""
    if not isinstance(config, dict):
        with open(config, encoding="utf-8") as f:
            config = json.load(f)
    config = copy.deepcopy(config)
    mismatches: list = []

    def fill(path: str, value: Any, source: str, add: bool = False) -> None:
        *parents, key = path.split(".")
        node = config
        for p in parents:
            if not isinstance(node.get(p), dict):
                if not add:
                    return
                node[p] = {}
            node = node[p]
        if key not in node:
            if add:
                node[key] = value
            return
        given = node[key]
        if given == "auto":
            node[key] = value
        elif source and _differs(given, value):
            mismatches.append(f"{path} = {given!r} but TrainingArguments' {source} = {value!r}")

    batch = args.per_device_train_batch_size
    fill("train_micro_batch_size_per_gpu", batch, "per_device_train_batch_size", add=True)
    fill("gradient_accumulation_steps", args.gradient_accumulation_steps, "gradient_accumulation_steps", add=True)
    fill("train_batch_size", args.world_size * batch * args.gradient_accumulation_steps, "train_batch_size (calculated)")
    fill("gradient_clipping", args.max_grad_norm or 0.0, "max_grad_norm", add=True)
    if "optimizer" not in config:
        config["optimizer"] = {"type": "AdamW", "params": {}}
    for key, value, source in (("lr", args.learning_rate, "learning_rate"),
                               ("betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2"),
                               ("eps", args.adam_epsilon, "adam_epsilon"),
                               ("weight_decay", args.weight_decay, "weight_decay")):
        fill(f"optimizer.params.{key}", value, source, add=True)
    fill("scheduler.params.warmup_min_lr", 0, "")
    fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    if num_training_steps is not None:
        fill("scheduler.params.total_num_steps", num_training_steps, "num_training_steps (calculated)")
        fill("scheduler.params.warmup_num_steps", args.get_warmup_steps(num_training_steps), "warmup_steps")
    fill("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16|fp16_full_eval")
    fill("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16|bf16_full_eval")
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if hidden is not None:
        fill("zero_optimization.reduce_bucket_size", hidden * hidden, "")
        fill("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden * hidden), "")
        fill("zero_optimization.stage3_param_persistence_threshold", 10 * hidden, "")
    if mismatches:
        raise ValueError("tierzero.hf: the config contradicts the TrainingArguments (use \"auto\" or the same "
                         "value): " + "; ".join(mismatches))
    return config


def _differs(given: Any, value: Any) -> bool:
    if isinstance(given, (list, tuple)) and isinstance(value, (list, tuple)):
        return [float(x) for x in given] != [float(x) for x in value]
    if isinstance(given, bool) or isinstance(value, bool):
        return bool(given) != bool(value)
    try:
        return float(given) != float(value)
    except (TypeError, ValueError):
        return given != value


class Trainer(transformers.Trainer):
    """transformers.Trainer training through tierzero's engine (Note [The Trainer on the engine]).

    tierzero_config: a DeepSpeed-style config (a path or a dict; "auto" values are filled from `args`); every
    other argument is transformers.Trainer's. After train(), `engine` is the TorchEngine."""

    def __init__(self, *args: Any, tierzero_config: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.tierzero_config = tierzero_config
        self.engine = None
        self._engine_schedule: Any = None  # the config's "scheduler" block, run by the engine
        self._engine_checkpoint: Optional[str] = None  # resume_from_checkpoint: loaded once the engine exists

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """Makes the engine (the Trainer asks for its optimizer once the number of steps is known)."""
        if self.engine is None:
            self._make_engine(self.state.max_steps)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """The Trainer's schedule on the engine's optimizer, or the config's "scheduler" block, which the engine
        runs."""
        if self._engine_schedule is not None:
            self.lr_scheduler = self._engine_schedule
            return self.lr_scheduler
        return super().create_scheduler(num_training_steps, optimizer)

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        if self.engine is None:
            self._make_engine(num_training_steps)
        self.create_scheduler(num_training_steps=num_training_steps, optimizer=self.optimizer)

    def _make_engine(self, num_training_steps: int) -> None:
        config = fill_auto(self.tierzero_config, self.args, model=self.model, num_training_steps=num_training_steps)
        decay = set(self.get_decay_parameter_names(self.model))
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [g for g in ({"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0})
                  if g["params"]]
        engine, optimizer, _, schedule = initialize(model=self.model, config=config, model_parameters=groups)
        # The Trainer's clip_grad_norm_ call comes after training_step() has stepped the engine, which clipped by
        # gradient_clipping: it gets the engine's norm of that step (before clipping, as torch's returns it).
        engine._clip_reports_norm = True
        optimizer._stepped_by_engine = True  # training_step() steps the engine; the Trainer's step() is a no-op
        self.engine, self.optimizer = engine, optimizer
        if self._engine_checkpoint is not None:
            engine.load_checkpoint(self._engine_checkpoint)
        if schedule is not None:
            schedule._warned = True  # the Trainer calls its step() after every optimizer step
        self._engine_schedule = schedule

    def training_step(self, model: torch.nn.Module, inputs: dict, num_items_in_batch: Any = None) -> torch.Tensor:
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        # The loss as the plain Trainer forms it: already divided for the accumulation (by the batch's
        # num_items_in_batch) where the model takes it, else this micro-batch's mean. The engine divides every
        # micro-batch's gradient by the accumulation steps itself, as DeepSpeed's does by default, so the first is
        # multiplied back (the Trainer turns DeepSpeed's division off instead: the same gradient).
        steps = getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or \
                self.compute_loss_func is not None
        self.engine.backward(loss * steps if scaled else loss)
        self.engine.step()
        return (loss if scaled else loss / steps).detach()  # what the plain Trainer returns for its logs

    def full_state_dict(self) -> dict:
        """The model's state dict with every trained parameter's full value from the engine (in the model's
        dtype), tied parameters under each of their names; buffers and frozen parameters as torch holds them:
        the model's own state_dict() once the engine exists (Note [State dicts after initialize] in
        tierzero/torch/checkpoint.py)."""
        return dict(self.model.state_dict())

    def _save(self, output_dir: Optional[str] = None, state_dict: Optional[dict] = None) -> None:
        super()._save(output_dir, state_dict=self.full_state_dict())

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.engine is not None:
            self.engine.save_checkpoint(os.path.join(output_dir, "tierzero"), tag="engine")
        super()._save_optimizer_and_scheduler(output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        # Called before the engine exists: the weights, moments and step count come from the engine's own
        # checkpoint once create_optimizer_and_scheduler() has made it.
        path = os.path.join(resume_from_checkpoint, "tierzero")
        if not os.path.isdir(path):
            raise ValueError(f"tierzero.hf: {resume_from_checkpoint} has no tierzero/ engine checkpoint (not saved by "
                             "tierzero.hf.Trainer)")
        self._engine_checkpoint = path


def from_pretrained(model_class: Any, path: Any, config: Any, *, model_config: Any = None, **kwargs: Any) -> tuple:
    """tierzero.torch.initialize(model=model_class(model_config) built on the meta device, config=config,
    **kwargs), its weights read from the Hugging Face checkpoint directory `path` (safetensors: one file or
    shards) one module at a time, never the whole model in host memory (Note [Pretrained weights one module
    at a time]). model_config: the transformers config (default: the one in `path`). Returns initialize()'s
    four values; the model is engine.module. A tensor the checkpoint lacks is refused, named."""
    from .torch import initialize as _initialize

    if "init_fn" in kwargs:
        raise ValueError("tierzero.hf.from_pretrained: init_fn= is its own (the checkpoint's tensors); use "
                         "tierzero.torch.initialize for an init_fn of yours")
    files = _checkpoint_files(os.fspath(path))
    if model_config is None:
        model_config = transformers.AutoConfig.from_pretrained(os.fspath(path))
    with torch.device("meta"):
        model = model_class(model_config)
    names: dict = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(name)

    def init_fn(module: torch.nn.Module) -> None:
        with torch.no_grad():
            for prefix in names.get(id(module), []):
                for table in (module._parameters, module._buffers):
                    for key, t in table.items():
                        full = f"{prefix}.{key}" if prefix else key
                        if t is not None and not t.is_meta and full in files:
                            t.copy_(_read_tensor(files[full], full))

    return _initialize(model=model, config=config, init_fn=init_fn, **kwargs)


def _checkpoint_files(path: str) -> dict:
    """{tensor name: the safetensors file holding it} for a checkpoint directory."""
    import safetensors

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"tierzero.hf.from_pretrained: {index} has no weight_map")
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise ValueError(f"tierzero.hf.from_pretrained: {path} holds neither model.safetensors nor "
                         "model.safetensors.index.json (only safetensors checkpoints are read one module at a time)")
    with safetensors.safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def _read_tensor(file: str, name: str) -> torch.Tensor:
    import safetensors

    with safetensors.safe_open(file, framework="pt") as f:  # opened per tensor: Note [Pretrained weights ...]
        return f.get_tensor(name)
