"""tierzero.torch.initialize as deepspeed.initialize is called (bindings/tierzero/torch/initialize.py, Note
[DeepSpeed's initialize]): the four values it returns, args / config_params / training_data / lr_scheduler,
param groups, DeepSpeed's "Adam", "auto" values, the optimizer's state_dict, clipping and the engine's queries."""

import argparse
import copy
import json
import warnings

import pytest
import torch
import torch.nn.functional as F

import tierzero.torch as tzt
from conftest import host_config
from test_torch import TOL, _mlp_batches, largest_error, mlp


def _train(engine, batches):
    for x, y in batches:
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()


def _train_reference(ref, opt, batches):
    for x, y in batches:
        F.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()


def test_initialize_returns_deepspeeds_four_values(nvme_dir):
    engine, optimizer, loader, sched = tzt.initialize(model=mlp(), config=host_config(nvme_dir))
    assert isinstance(engine, tzt.TorchEngine) and optimizer is engine.optimizer
    assert loader is None and sched is None  # no training_data, no scheduler: None, as DeepSpeed returns them
    config = host_config(nvme_dir)
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2,
                                                          "warmup_num_steps": 4, "warmup_type": "linear"}}
    engine, optimizer, _, sched = tzt.initialize(model=mlp(), config=config)
    assert isinstance(sched, tzt.EngineLRScheduler) and engine.lr_scheduler is sched
    assert sched.get_lr() == engine.get_lr() == [0.0]
    _train(engine, _mlp_batches(3, 1))
    assert sched.get_last_lr() == [0.0] and sched.get_lr() == [pytest.approx(2.5e-3)]
    with pytest.warns(RuntimeWarning, match="does nothing"):
        sched.step()
    assert sched.get_lr() == [pytest.approx(2.5e-3)], "the schedule follows the engine's optimizer steps only"


def test_the_config_comes_from_config_config_params_or_args(tmp_path, nvme_dir):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(host_config(nvme_dir, lr=3e-3)))
    for kwargs in ({"args": argparse.Namespace(deepspeed_config=str(path), local_rank=0)},
                   {"config_params": str(path)}, {"config": str(path)}):
        engine, *_ = tzt.initialize(model=mlp(), **kwargs)
        assert engine.learning_rate == 3e-3, kwargs
    with pytest.raises(ValueError, match="both in args.deepspeed_config and as config="):
        tzt.initialize(argparse.Namespace(deepspeed_config=str(path)), mlp(), config=str(path))
    with pytest.raises(ValueError, match="mpu= asks for model parallelism.*DeepSpeed feature tierzero does not"):
        tzt.initialize(model=mlp(), config=str(path), mpu=object())


def test_training_data_becomes_deepspeeds_data_loader(nvme_dir):
    data = torch.utils.data.TensorDataset(torch.arange(20.0).unsqueeze(1).repeat(1, 16), torch.zeros(20, 4))
    config = host_config(nvme_dir)  # train_micro_batch_size_per_gpu 8
    engine, _, loader, _ = tzt.initialize(model=mlp(), config=config, training_data=data)
    assert engine.training_dataloader is loader and len(loader) == 3
    assert isinstance(loader.sampler, torch.utils.data.DistributedSampler)
    batches = list(loader)
    assert [len(x) for x, _ in batches] == [8, 8, 4]
    assert sorted(int(v) for x, _ in batches for v in x[:, 0]) == list(range(20)), "every sample once, shuffled"
    config["dataloader_drop_last"] = True
    _, _, loader, _ = tzt.initialize(model=mlp(), config=config, training_data=data,
                                     collate_fn=lambda items: torch.stack([x for x, _ in items]))
    assert [len(x) for x in loader] == [8, 8]
    del config["train_micro_batch_size_per_gpu"]
    with pytest.raises(ValueError, match="training_data= needs the batch size"):
        tzt.initialize(model=mlp(), config=config, training_data=data)


def _two_groups(model, decay, no_decay):
    """Hugging Face's and nanoGPT's split: matrices decay, biases and norms do not."""
    params = [p for p in model.parameters()]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": no_decay}]


def test_param_groups_that_agree_train_with_their_weight_decay(nvme_dir):
    torch.manual_seed(0)
    model = mlp()
    ref = copy.deepcopy(model)
    config = host_config(nvme_dir, weight_decay=0.01)
    engine, optimizer, _, _ = tzt.initialize(model=model, config=config,
                                             model_parameters=_two_groups(model, 0.2, 0.2))
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.2, 0.2], "the groups' value, as in torch"
    assert all(isinstance(g[k], (float, tuple)) for g in optimizer.param_groups for k in ("lr", "betas", "eps"))
    batches = _mlp_batches(7, 6)
    _train(engine, batches)
    _train_reference(ref, torch.optim.AdamW(_two_groups(ref, 0.2, 0.2), lr=1e-2), batches)
    err = largest_error(engine, ref)
    print(f"two param groups, weight_decay 0.2: largest error against torch.optim.AdamW {err:.3g}")
    assert err <= TOL


def test_param_groups_that_differ_are_refused_by_name(nvme_dir):
    model = mlp()
    with pytest.raises(ValueError, match=r"the param groups differ in weight_decay \(group 0 \(3 tensors\): 0.1, "
                                         r"group 1 \(5 tensors\): 0.0.*runs one weight_decay for every parameter"):
        tzt.initialize(model=model, config=host_config(nvme_dir), model_parameters=_two_groups(model, 0.1, 0.0))
    with pytest.raises(ValueError, match="lists a parameter twice"):
        tzt.initialize(model=model, config=host_config(nvme_dir),
                       model_parameters=[{"params": list(model.parameters())}, {"params": [model[0].weight]}])


@pytest.mark.parametrize("adam_w_mode", [None, False])
def test_deepspeeds_adam_runs_adamw_unless_adam_w_mode_is_false(nvme_dir, adam_w_mode):
    torch.manual_seed(0)
    model = mlp()
    ref = copy.deepcopy(model)
    config = host_config(nvme_dir, optimizer="Adam", weight_decay=0.5)
    if adam_w_mode is not None:
        config["optimizer"]["params"]["adam_w_mode"] = adam_w_mode
    engine, optimizer, _, _ = tzt.initialize(model=model, config=config)
    batches = _mlp_batches(8, 5)
    _train(engine, batches)
    adamw = adam_w_mode is None  # DeepSpeed's default
    assert optimizer.param_groups[0]["type"] == ("AdamW" if adamw else "Adam")
    torch_opt, other_opt = (torch.optim.AdamW, torch.optim.Adam) if adamw else (torch.optim.Adam, torch.optim.AdamW)
    other = copy.deepcopy(ref)  # the other meaning: it must train visibly differently here, or the test shows nothing
    _train_reference(ref, torch_opt(ref.parameters(), lr=1e-2, weight_decay=0.5), batches)
    _train_reference(other, other_opt(other.parameters(), lr=1e-2, weight_decay=0.5), batches)
    err, apart = largest_error(engine, ref), largest_error(engine, other)
    print(f"\"Adam\", adam_w_mode {adam_w_mode}: largest error against {torch_opt.__name__} {err:.3g}, "
          f"against {other_opt.__name__} {apart:.3g}")
    assert err <= TOL < apart / 100


def test_hf_auto_values_are_refused_by_name(nvme_dir):
    config = host_config(nvme_dir)
    config["optimizer"]["params"]["lr"] = "auto"
    config["bf16"] = {"enabled": "auto"}
    config["gradient_accumulation_steps"] = "auto"
    with pytest.raises(ValueError, match=r'optimizer.params.lr = "auto", bf16.enabled = "auto", '
                                         r'gradient_accumulation_steps = "auto": nothing resolves it here'):
        tzt.initialize(model=mlp(), config=config)
    # A param group's value resolves the config's "auto", as a torch group's value overrides its optimizer's.
    config = host_config(nvme_dir)
    config["optimizer"]["params"]["lr"] = "auto"
    model = mlp()
    engine, optimizer, _, _ = tzt.initialize(model=model, config=config,
                                             model_parameters=[{"params": list(model.parameters()), "lr": 4e-3}])
    assert engine.learning_rate == 4e-3 == optimizer.param_groups[0]["lr"]


def test_the_optimizers_state_dict_round_trips_through_engine_checkpoints(nvme_dir, tmp_path):
    engine, optimizer, _, _ = tzt.initialize(model=mlp(), config=host_config(nvme_dir))
    _train(engine, _mlp_batches(9, 2))
    engine.save_checkpoint(tmp_path / "ckpt")
    sd = optimizer.state_dict()
    assert sd["tierzero"]["optimizer_steps"] == 2 and sd["state"] == {}
    assert sd["param_groups"][0]["params"] == list(range(len(list(engine.parameters()))))
    torch.save(sd, tmp_path / "optimizer.pt")  # what transformers.Trainer does with it
    sd = torch.load(tmp_path / "optimizer.pt", weights_only=True)
    other, other_opt, _, _ = tzt.initialize(model=mlp(), config=host_config(nvme_dir))
    with pytest.raises(ValueError, match="taken at optimizer step 2, the engine is at step 0.*engine.load_checkpoint"):
        other_opt.load_state_dict(sd)
    other.load_checkpoint(tmp_path / "ckpt")
    sd["param_groups"][0]["lr"] = 5e-3
    other_opt.load_state_dict(sd)
    assert other.learning_rate == 5e-3 == other_opt.param_groups[0]["lr"]


def test_torch_clip_grad_norm_warns_that_the_engine_clips(nvme_dir):
    model = mlp()
    engine, *_ = tzt.initialize(model=model, config=host_config(nvme_dir))
    x, y = _mlp_batches(10, 1)[0]
    engine.backward(F.mse_loss(engine(x), y))
    with pytest.warns(RuntimeWarning, match=r'clip_grad_norm_\(max_norm=1.0\) sees no gradients.*"gradient_clipping" '
                                            r'\(now off\)'):
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item() == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per engine
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        plain = torch.nn.Linear(2, 2)  # parameters no engine trains: torch's own function, no warning
        plain(torch.ones(1, 2)).sum().backward()
        assert torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e-3).item() > 0
    engine.step()


def test_a_client_lr_scheduler_is_built_on_the_optimizer_and_stepped_by_the_engine(nvme_dir):
    def factor(t):
        return 0.5 ** t

    engine, optimizer, _, sched = tzt.initialize(
        model=mlp(), config=host_config(nvme_dir),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor))
    assert isinstance(sched, torch.optim.lr_scheduler.LambdaLR) and sched.optimizer is optimizer
    used = []
    for x, y in _mlp_batches(11, 4):
        engine.backward(F.mse_loss(engine(x), y))
        used.append(engine.step()["lr"])
    assert used == pytest.approx([1e-2 * factor(t) for t in range(4)], rel=1e-12)
    with pytest.raises(ValueError, match="a scheduler already built on another optimizer"):
        opt = torch.optim.SGD(mlp().parameters(), lr=0.1)
        tzt.initialize(model=mlp(), config=host_config(nvme_dir),
                       lr_scheduler=torch.optim.lr_scheduler.LambdaLR(opt, factor))


def test_the_engine_answers_deepspeeds_engine_queries(nvme_dir):
    model = mlp()
    engine, *_ = tzt.initialize(model=model, config=host_config(nvme_dir, stage=3))
    assert engine.zero_optimization_stage() == 3 and engine.zero_optimization()
    assert not engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert engine.gradient_clipping() == 0.0
    assert (engine.global_rank, engine.local_rank, engine.dp_world_size) == (0, 0, 1)
    assert [id(p) for p in engine.parameters()] == [id(p) for p in model.parameters()]
    assert [n for n, _ in engine.named_parameters()] == [n for n, _ in model.named_parameters()]
    with engine.no_sync():
        x, y = _mlp_batches(12, 1)[0]
        engine.backward(F.mse_loss(engine(x), y))
    assert engine.zero_grad() is None
    assert engine.step()["stepped"]
