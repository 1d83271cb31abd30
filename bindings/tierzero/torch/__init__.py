"""tierzero.torch: train a torch model through tierzero's engine, as DeepSpeed users write it.

    engine, optimizer, _, _ = tierzero.torch.initialize(model=model, config="ds_config.json")
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

The package, a module a concern (each module's Notes sit with its code):

- engine.py: TorchEngine; Notes [A forward that raised], [The engine as a module], [Model dtype].
- initialize.py: initialize(), as deepspeed.initialize takes and returns it, EngineLRScheduler; Notes
  [DeepSpeed's initialize], [Clipping].
- hooks.py: the module hooks that gather blocks for forward and backward and hand gradients
  to the engine; Notes [Parameters live in the engine], [Saved tensors], [Gradients],
  [Capsules, not tensors], [Evaluation fetches]; register_external_parameter().
- optimizer.py: EngineOptimizer, the config's optimizer block; Notes [Learning rate], [accelerate],
  [Optimizer state_dict].
- checkpoint.py: save_checkpoint, load_checkpoint, export_safetensors, the model's state_dict(); Notes
  [Client state], [State dicts after initialize].
- edit.py: GatheredParameters, safe_get_full_fp32_param, safe_set_full_fp32_param; Note
  [Editing weights].
- meta.py: models built on the meta device; Note [Models on the meta device].
- rank0.py: every rank starts from rank 0's model; Note [Rank 0's model].
- model.py: a model's parameters as engine blocks, and the order modules are visited in.
- errors.py: failures as exception notes and as refusals through collectives.
"""

from __future__ import annotations

from .edit import GatheredParameters, safe_get_full_fp32_param, safe_set_full_fp32_param
from .engine import TorchEngine
from .engine import _live_gathered  # noqa: F401 - for the tests
from .initialize import EngineLRScheduler, initialize
from .hooks import register_external_parameter
from .optimizer import EngineOptimizer

__all__ = ["initialize", "register_external_parameter", "GatheredParameters", "safe_get_full_fp32_param",
           "safe_set_full_fp32_param", "TorchEngine", "EngineOptimizer", "EngineLRScheduler"]
