"""tierzero.torch.initialize as deepspeed.initialize is called (bindings/tierzero/torch/initialize.py, Note
[DeepSpeed's initialize]): the four values it returns, args / config_params / training_data / lr_scheduler,
param groups, DeepSpeed's "Adam", "auto" values, the optimizer's state_dict, clipping and the engine's queries."""

import argparse
import contextlib
import copy
import json
import warnings

import pytest
import torch
import torch.nn.functional as F

import tierzero.optim as tzo
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


def _train_groups_through_both(nvme_dir, make_reference, steps, adam="AdamW", stage=3):
    """An MLP trained through the engine with Hugging Face's two groups (weight decay 0.1 on matrices, 0 on
    biases and norms; the config's 0.01 applies to neither), and its copy trained by make_reference(groups)
    on the same batches: (engine, optimizer, reference model)."""
    torch.manual_seed(0)
    model = mlp()
    ref = copy.deepcopy(model)
    config = host_config(nvme_dir, weight_decay=0.01, optimizer=adam, stage=stage)
    if adam == "Adam":
        config["optimizer"]["params"]["adam_w_mode"] = False  # L2 Adam (DeepSpeed's "Adam" is AdamW by default)
    engine, optimizer, _, _ = tzt.initialize(model=model, config=config, model_parameters=_two_groups(model, 0.1, 0.0))
    batches = _mlp_batches(11, steps)
    _train(engine, batches)
    _train_reference(ref, make_reference(_two_groups(ref, 0.1, 0.0)), batches)
    return engine, optimizer, ref


@pytest.mark.parametrize("adam", ["AdamW", "Adam"])
def test_param_groups_that_differ_in_weight_decay_step_bit_for_bit_as_tierzero_optim(nvme_dir, adam):
    # tierzero.optim steps each parameter on its own with its group's weight decay, through the same cpu_adam:
    # the engine, stepping whole shards with weight-decay segments, must give the same bits (Note [Weight decay
    # per parameter] in engine/src/optimizer_step.cpp). Adam (L2) too: its weight decay enters the gradient.
    kind = getattr(tzo, adam)
    engine, optimizer, ref = _train_groups_through_both(
        nvme_dir, lambda groups: kind(groups, lr=1e-2, betas=(0.9, 0.999), eps=1e-8), 20, adam)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    master = engine.master_state_dict()
    differ = [n for n, p in ref.named_parameters() if not torch.equal(master[n], p.detach())]
    assert not differ, f"not bit for bit: {differ}"
    # The weight decay mattered: the same run with one group of the config's 0.01 ends elsewhere.
    torch.manual_seed(0)
    config = host_config(nvme_dir, weight_decay=0.01, optimizer=adam)
    config["optimizer"]["params"]["adam_w_mode"] = adam == "AdamW"
    one, *_ = tzt.initialize(model=mlp(), config=config)
    _train(one, _mlp_batches(11, 20))
    other = one.master_state_dict()
    assert not torch.equal(other["0.weight"], master["0.weight"]) and not torch.equal(other["0.bias"], master["0.bias"])


def test_param_groups_that_differ_in_weight_decay_train_as_torch_adamw_over_those_groups(nvme_dir):
    engine, _, ref = _train_groups_through_both(
        nvme_dir, lambda groups: torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.999), eps=1e-8), 20)
    err = largest_error(engine, ref)
    print(f"two param groups (weight_decay 0.1 / 0.0), 20 steps: largest error against torch.optim.AdamW {err:.3g}")
    assert err <= 2 * TOL  # TOL is for 10 steps (tests/python/test_torch.py); these are 20


def test_groups_that_each_give_a_weight_decay_resolve_the_configs_auto(nvme_dir):
    model = mlp()
    config = host_config(nvme_dir)
    config["optimizer"]["params"]["weight_decay"] = "auto"
    engine, optimizer, _, _ = tzt.initialize(model=model, config=config, model_parameters=_two_groups(model, 0.1, 0.0))
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert engine.weight_decay(0, 0) == 0.1 and engine.weight_decay(0, 1) == 0.0
    fresh = mlp()
    groups = _two_groups(fresh, 0.1, 0.0)
    del groups[1]["weight_decay"]  # this group would take the config's "auto": refused by name
    with pytest.raises(ValueError, match=r"optimizer.params.weight_decay = \"auto\""):
        tzt.initialize(model=fresh, config=config, model_parameters=groups)


def test_weight_decay_is_set_per_parameter_and_refused_when_out_of_range(nvme_dir):
    engine, *_ = tzt.initialize(model=mlp(), config=host_config(nvme_dir, weight_decay=0.01))
    assert engine.weight_decay(0, 1) == 0.01, "the config's until set"
    engine.set_weight_decay(0, 1, 0.5)
    assert engine.weight_decay(0, 1) == 0.5 and engine.weight_decay(0, 0) == 0.01
    with pytest.raises(ValueError, match=r"set_weight_decay: 0.bias weight_decay = -1 must be finite and >= 0"):
        engine.set_weight_decay(0, 1, -1.0)
    with pytest.raises(ValueError, match=r"set_weight_decay: 0 has 2 parameters, no parameter 2"):
        engine.set_weight_decay(0, 2, 0.1)
    with pytest.raises(ValueError, match=r"set_weight_decay: block 9 is out of range \(the model has 4 blocks\)"):
        engine.set_weight_decay(9, 0, 0.1)


def test_weight_decays_are_not_in_checkpoints_a_resume_takes_the_groups_it_is_given(nvme_dir, tmp_path):
    model = mlp()
    engine, *_ = tzt.initialize(model=model, config=host_config(nvme_dir), model_parameters=_two_groups(model, 0.1, 0.0))
    _train(engine, _mlp_batches(3, 2))
    engine.save_checkpoint(tmp_path / "ckpt")
    again = mlp()
    other, opt, _, _ = tzt.initialize(model=again, config=host_config(nvme_dir),
                                      model_parameters=_two_groups(again, 0.3, 0.0))
    other.load_checkpoint(tmp_path / "ckpt")
    assert [g["weight_decay"] for g in opt.param_groups] == [0.3, 0.0]
    assert other.weight_decay(0, 0) == 0.3 and other.weight_decay(0, 1) == 0.0
    plain, *_ = tzt.initialize(model=mlp(), config=host_config(nvme_dir))
    plain.load_checkpoint(tmp_path / "ckpt")
    assert plain.weight_decay(0, 0) == 0.01, "no groups given: the config's"


def test_param_groups_that_differ_in_lr_betas_or_eps_are_refused_by_name(nvme_dir):
    model = mlp()
    groups = _two_groups(model, 0.0, 0.0)
    groups[0]["lr"] = 1e-3
    with pytest.raises(ValueError, match=r"the param groups differ in lr \(group 0 \(3 tensors\): 0.001; "
                                         r"optimizer.params.lr = 0.01 for the rest\).*only weight_decay may differ"):
        tzt.initialize(model=model, config=host_config(nvme_dir), model_parameters=groups)
    groups = _two_groups(model, 0.0, 0.0)
    groups[1]["betas"] = (0.9, 0.95)
    with pytest.raises(ValueError, match=r"the param groups differ in betas"):
        tzt.initialize(model=model, config=host_config(nvme_dir), model_parameters=groups)
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
    engine, *_ = tzt.initialize(model=model, config=host_config(nvme_dir, stage=3, gas=2))
    assert engine.zero_optimization_stage() == 3 and engine.zero_optimization()
    assert not engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert engine.gradient_clipping() == 0.0
    assert (engine.global_rank, engine.local_rank, engine.dp_world_size) == (0, 0, 1)
    assert engine.gradient_accumulation_steps() == 2 and engine.train_micro_batch_size_per_gpu() == 8
    assert engine.zero_grad() is None
    x, y = _mlp_batches(12, 1)[0]
    loss = F.mse_loss(engine(x), y)
    assert engine.backward(loss) is loss, "DeepSpeed's backward returns the loss"
    assert not engine.step()["stepped"] and engine.global_steps == 0, "the first of two micro-batches"
    engine.backward(F.mse_loss(engine(x), y))
    assert engine.step()["stepped"] and engine.global_steps == 1


def test_the_engine_is_an_nn_module_holding_the_model_as_deepspeeds(nvme_dir):
    # Note [The engine as a module] (bindings/tierzero/torch/engine.py)
    model = mlp()
    engine, *_ = tzt.initialize(model=model, config=host_config(nvme_dir))
    assert isinstance(engine, torch.nn.Module) and engine.module is model
    assert dict(engine.named_children()) == {"module": model}
    assert [id(p) for p in engine.parameters()] == [id(p) for p in model.parameters()]
    assert [n for n, _ in engine.named_parameters()] == [f"module.{n}" for n, _ in model.named_parameters()], \
        "DeepSpeed's engine names them under its module"
    assert engine.eval() is engine and not engine.training and not model.training
    assert not any(m.training for m in model.modules())
    assert engine.train() is engine and engine.training and all(m.training for m in model.modules())
    seen = []
    handle = engine.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    x, y = _mlp_batches(13, 1)[0]
    out = engine(x)
    handle.remove()
    assert seen == [torch.Size([8, 4])], "engine(x) runs through nn.Module's call, with its hooks"
    assert torch.equal(out, engine.forward(x))
    with pytest.raises(ValueError, match=r"moving or casting the engine \(to\(\), cuda\(\), half\(\), ...\) is not "
                                         r"supported.*move or cast the model before initialize\(\)"):
        engine.to(torch.float64)
    with pytest.raises(ValueError, match="moving or casting the engine"):
        engine.half()
    # Its state dict holds the full weights under the module's names, as DeepSpeed's consolidated one.
    state = engine.state_dict()
    master = engine.master_state_dict()
    assert set(state) == {f"module.{n}" for n in master}
    assert all(torch.equal(state[f"module.{n}"], v) for n, v in master.items())


def test_no_sync_gives_the_same_training_as_without(nvme_dir):
    # DDP's and DeepSpeed's no_sync skips the per-micro-batch gradient reduction; the engine reduces once per
    # accumulation boundary either way, so accumulating under no_sync trains bit for bit as without it.
    batches = _mlp_batches(14, 8)
    runs = []
    for use in (False, True):
        torch.manual_seed(0)
        engine, *_ = tzt.initialize(model=mlp(), config=host_config(nvme_dir, gas=2))
        for i, (x, y) in enumerate(batches):
            with engine.no_sync() if use and i % 2 == 0 else contextlib.nullcontext():
                engine.backward(F.mse_loss(engine(x), y))
            engine.step()
        runs.append(engine.master_state_dict())
    assert runs[0].keys() == runs[1].keys()
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])


def test_state_dict_after_initialize_holds_the_full_weights_never_empty_tensors(nvme_dir, tmp_path):
    # Note [State dicts after initialize] (bindings/tierzero/torch/checkpoint.py)
    torch.manual_seed(0)
    model = torch.nn.Sequential(mlp(), torch.nn.BatchNorm1d(4))
    model[1].running_mean.fill_(0.25)
    tied = torch.nn.Linear(4, 4, bias=False)
    model.append(tied)
    model.append(torch.nn.Linear(4, 4, bias=False))
    model[3].weight = tied.weight  # tied: one parameter under two names
    engine, *_ = tzt.initialize(model=model, config=host_config(nvme_dir))
    _train(engine, [(x, torch.zeros(8, 4)) for x, _ in _mlp_batches(15, 3)])
    master = engine.master_state_dict()
    assert all(p.numel() == 0 for p in model.parameters() if p.requires_grad), "placeholders between forwards"
    state = model.state_dict()
    assert all(t.numel() > 0 for t in state.values())
    for name, value in master.items():
        assert torch.equal(state[name], value), name
    assert torch.equal(state["3.weight"], master["2.weight"]) and state["3.weight"] is not state["2.weight"]
    assert state["1.running_mean"].data_ptr() == model[1].running_mean.data_ptr(), "buffers as torch holds them"
    assert not torch.equal(model[1].running_mean, torch.full((4,), 0.25)), "trained: the running mean moved"
    assert torch.equal(model[0].state_dict()["0.weight"], master["0.0.weight"]), "a submodule's too"
    assert torch.equal(model.state_dict(keep_vars=True)["0.0.weight"], master["0.0.weight"])
    torch.save(model.state_dict(), tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    fresh = torch.nn.Sequential(mlp(), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 4, bias=False),
                                torch.nn.Linear(4, 4, bias=False))
    fresh.load_state_dict(loaded)
    assert all(torch.equal(fresh.state_dict()[n], v) for n, v in master.items())
    # Inside GatheredParameters the live (edited) value.
    w = model[0][0].weight
    with torch.no_grad(), tzt.GatheredParameters(w, modifier_rank=0):
        w.fill_(3.0)
        assert bool((model.state_dict()["0.0.weight"] == 3.0).all())
    # Loading into the engine's parameters is refused by name, never copied into a placeholder.
    with pytest.raises(ValueError, match=r"load_state_dict\(\) into '0.0.weight' \(and 1 more of this module\).*"
                                         r"GatheredParameters.*engine.load_checkpoint"):
        model.load_state_dict(loaded)
    # The engine's checkpoints still carry only the buffers beside its states, and load back.
    engine.save_checkpoint(tmp_path / "ckpt")
    engine.load_checkpoint(tmp_path / "ckpt")
    engine.close()
    with pytest.raises(RuntimeError, match="state_dict.. of a model whose engine is closed"):
        model.state_dict()


def test_a_detached_models_state_dict_is_torchs_own(nvme_dir):
    model = mlp()
    engine, *_ = tzt.initialize(model=model, config=host_config(nvme_dir))
    _train(engine, _mlp_batches(16, 2))
    master = engine.master_state_dict()
    plain = engine.detach_module()
    state = plain.state_dict()
    assert all(torch.equal(state[n], v) for n, v in master.items())
    assert all(state[n].data_ptr() == p.data_ptr() for n, p in plain.named_parameters()), "no hook left"
    plain.load_state_dict(state)
