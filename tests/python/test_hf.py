"""tierzero.hf (bindings/tierzero/hf.py, Note [The Trainer on the engine]): the Hugging Face Trainer on the
engine with NVMe offload against the plain Trainer (examples/hf_trainer_nvme.py), "auto" filled from the
TrainingArguments, full weights saved and loaded back, and a resumed run continuing the loss curve."""

import importlib.util
import pathlib

import pytest
import torch
import transformers

import tierzero.hf
import tierzero.torch as tzt
from conftest import host_config
from test_torch import mlp

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "hf_trainer_nvme.py"
spec = importlib.util.spec_from_file_location("hf_trainer_nvme", EXAMPLE)
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)


def test_the_trainer_on_nvme_matches_the_plain_trainer_for_20_steps(nvme_dir, tmp_path):
    plain, trainer = example.both_runs(nvme_dir, 20, str(tmp_path))
    theirs, mine = example.losses(plain), example.losses(trainer)
    worst = max(abs(t - m) / abs(t) for t, m in zip(theirs, mine))
    print(f"20 Trainer steps on NVMe: losses {mine[0]:.4f} -> {mine[-1]:.4f}, largest relative difference "
          f"from the plain Trainer {worst:.3g}")
    assert len(mine) == len(theirs) == 20
    assert mine[-1] < 0.8 * mine[0], "the model did not learn: the comparison would show nothing"
    assert worst <= example.TOLERANCE
    norms = [(h["grad_norm"], g["grad_norm"]) for h, g in zip(trainer.state.log_history, plain.state.log_history)
             if "grad_norm" in h]  # the engine's norm, which the Trainer logs, against torch's
    assert len(norms) == 20 and all(m == pytest.approx(t, rel=1e-3) for m, t in norms), norms
    placed = trainer.engine.describe()
    assert "nvme" in placed.lower(), placed
    # Every tensor round-trips through save_model and from_pretrained, the tied lm_head included.
    trainer.save_model(str(tmp_path / "saved"))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "saved"))
    master = trainer.engine.master_state_dict()
    assert master, "no weights"
    for name, value in master.items():
        assert torch.equal(loaded.state_dict()[name], value), name
    assert torch.equal(loaded.lm_head.weight, master["transformer.wte.weight"])
    assert all(t.numel() > 0 for t in loaded.state_dict().values())
    trainer.engine.close()


def test_auto_values_are_filled_from_the_training_arguments(tmp_path):
    args = example.training_args(str(tmp_path), 10, weight_decay=0.0, adam_beta2=0.95)
    config = tierzero.hf.fill_auto(example.ds_config("/nvme"), args, model=example.gpt2(), num_training_steps=10)
    assert config["train_micro_batch_size_per_gpu"] == 4 and config["gradient_accumulation_steps"] == 2
    assert config["train_batch_size"] == 8 and config["gradient_clipping"] == 1.0
    assert config["optimizer"]["params"] == {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}
    assert config["fp16"]["enabled"] is False and config["bf16"]["enabled"] is False
    assert config["zero_optimization"]["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64)
    assert "auto" not in str(config)
    assert tierzero.check_config(config)["unresolved_auto"] == []
    contradicting = example.ds_config("/nvme")
    contradicting["optimizer"]["params"]["lr"] = 1e-4
    with pytest.raises(ValueError, match=r"optimizer.params.lr = 0.0001 but TrainingArguments' learning_rate = "
                                         r"0.003"):
        tierzero.hf.fill_auto(contradicting, args)


def test_a_run_resumed_from_a_trainer_checkpoint_continues_the_loss_curve(nvme_dir, tmp_path):
    config = example.ds_config(nvme_dir)
    whole = tierzero.hf.Trainer(model=example.gpt2(), args=example.training_args(str(tmp_path / "whole"), 8),
                                train_dataset=example.Text(), tierzero_config=config)
    whole.train()
    first = tierzero.hf.Trainer(model=example.gpt2(), train_dataset=example.Text(), tierzero_config=config,
                                args=example.training_args(str(tmp_path / "half"), 8, save_strategy="steps",
                                                           save_steps=4))
    first.train()
    again = tierzero.hf.Trainer(model=example.gpt2(), train_dataset=example.Text(), tierzero_config=config,
                                args=example.training_args(str(tmp_path / "half"), 8))
    again.train(resume_from_checkpoint=str(tmp_path / "half" / "checkpoint-4"))
    resumed = [h["loss"] for h in again.state.log_history if "loss" in h and h["step"] > 4]  # (1-4: the checkpoint's)
    wanted = [h["loss"] for h in whole.state.log_history if "loss" in h and h["step"] > 4]
    print(f"resumed at step 4: losses {resumed}, the unbroken run's {wanted}")
    assert len(resumed) == 4 and resumed == pytest.approx(wanted, rel=1e-5)
    for t in (whole, first, again):
        t.engine.close()


def _trained_gpt2_through_initialize(nvme_dir, steps=2):
    """example.gpt2() trained a few steps through plain tierzero.torch.initialize (not the Trainer)."""
    model = example.gpt2()
    engine, *_ = tzt.initialize(model=model, config=host_config(nvme_dir, lr=1e-3))
    data = example.Text(8)
    for i in range(steps):
        batch = torch.stack([data[i * 2 + j]["input_ids"] for j in range(2)])
        engine.backward(engine(input_ids=batch, labels=batch).loss)
        engine.step()
    return model, engine


def test_save_pretrained_after_initialize_writes_the_full_weights(nvme_dir, tmp_path):
    # Note [State dicts after initialize] (bindings/tierzero/torch/checkpoint.py): save_pretrained() on the model
    # trained through tierzero.torch.initialize alone once wrote every tensor empty.
    model, engine = _trained_gpt2_through_initialize(nvme_dir)
    master = engine.master_state_dict()
    model.save_pretrained(str(tmp_path / "saved"))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "saved"))
    state = loaded.state_dict()
    assert all(t.numel() > 0 for t in state.values())
    for name, value in master.items():
        assert torch.equal(state[name], value), name
    assert torch.equal(loaded.lm_head.weight, master["transformer.wte.weight"]), "the tied head"
    # and torch.save of the state dict, as scripts save it
    torch.save(model.state_dict(), tmp_path / "model.pt")
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.equal(saved[n], v) for n, v in master.items())
    engine.close()


@pytest.fixture
def fresh_accelerate():
    """accelerate's process-wide state (its accumulation steps) made anew, and forgotten after the test."""
    import accelerate.state
    for state in (accelerate.state.AcceleratorState, accelerate.state.GradientState):
        state._reset_state()
    yield
    for state in (accelerate.state.AcceleratorState, accelerate.state.GradientState):
        state._reset_state()


def _mse_data():
    gen = torch.Generator().manual_seed(21)
    return torch.utils.data.TensorDataset(torch.randn(64, 16, generator=gen), torch.randn(64, 4, generator=gen))


def _engine_loop_reference(nvme_dir, gas):
    """The plain engine loop over _mse_data() in batches of 8: its master weights."""
    torch.manual_seed(0)
    engine, *_ = tzt.initialize(model=mlp(), config=host_config(nvme_dir, gas=gas))
    for x, y in torch.utils.data.DataLoader(_mse_data(), batch_size=8):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    return engine.master_state_dict()


@pytest.mark.parametrize("counted_by", ["the engine", "accelerate"])
def test_accelerate_prepares_the_engine_its_optimizer_and_a_dataloader(nvme_dir, fresh_accelerate, counted_by):
    # Note [accelerate] (bindings/tierzero/torch/optimizer.py): accelerate's own loop, not the Trainer's, trains
    # bit for bit as the engine's loop, the accumulation over 2 micro-batches counted by either.
    import accelerate
    want = _engine_loop_reference(nvme_dir, gas=2)
    torch.manual_seed(0)
    engine, optimizer, _, _ = tzt.initialize(model=mlp(), config=host_config(nvme_dir,
                                                                           gas=2 if counted_by == "the engine" else 1))
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=1 if counted_by == "the engine" else 2)
    model, opt, loader = accelerator.prepare(engine, optimizer, torch.utils.data.DataLoader(_mse_data(), batch_size=8))
    assert model is engine
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    assert engine.global_steps == 4
    got = engine.master_state_dict()
    assert all(torch.equal(got[n], want[n]) for n in want), "not bit for bit the engine's own loop"


def test_accelerate_and_the_engine_both_accumulating_is_refused_naming_both(nvme_dir, fresh_accelerate):
    import accelerate
    engine, optimizer, _, _ = tzt.initialize(model=mlp(), config=host_config(nvme_dir, gas=2))
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=4)
    model, opt = accelerator.prepare(engine, optimizer)
    x, y = _mse_data()[:8]
    with pytest.raises(ValueError, match=r"accelerate accumulates gradients over 4 micro-batches.*the engine over 2 "
                                         r"\(the config's gradient_accumulation_steps\).*set one of them to 1"):
        for _ in range(4):
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                opt.step()


def test_fp16_refuses_a_backward_that_skips_the_loss_scale(nvme_dir):
    model = mlp()
    config = host_config(nvme_dir)
    config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    engine, *_ = tzt.initialize(model=model, config=config)
    x, y = _mse_data()[:8]
    with pytest.raises(RuntimeError, match=r"with fp16 the loss must be multiplied by the engine's loss scale: call "
                                           r"engine.backward\(loss\), not loss.backward\(\)"):
        torch.nn.functional.mse_loss(engine(x.half()).float(), y).backward()
    engine.step()
    engine.backward(torch.nn.functional.mse_loss(engine(x.half()).float(), y))
    assert engine.step()["stepped"]


LOADER = """
import json, sys
import torch, transformers, safetensors.torch
import tierzero.hf
path, config, mode = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
def status_mib(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024
def start():  # the peak (VmHWM) reset to the current resident size: Linux's clear_refs 5
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_mib("VmRSS")
index = tierzero.hf._checkpoint_files(path)
if mode == "whole":  # the measure sees a whole model: every shard read at once, as a plain load holds them
    before = start()
    whole = {}
    for file in sorted(set(index.values())):
        whole.update({k: v.clone() for k, v in safetensors.torch.load_file(file).items()})  # (not a lazy map)
    print(json.dumps({"growth_mib": status_mib("VmHWM") - before}))
    sys.exit(0)
before = start()
engine, *_ = tierzero.hf.from_pretrained(transformers.GPT2LMHeadModel, path, config)
growth = status_mib("VmHWM") - before
# every tensor is the checkpoint's, bit for bit (read one block at a time: still no whole model in memory)
checked = 0
for b in engine._blocks:
    flat = torch.from_numpy(engine.gather_master(b.index))
    for view, name in zip(b.views, b.names):
        want = tierzero.hf._read_tensor(index[name], name)
        assert torch.equal(flat.as_strided(*view), want), name
        checked += 1
model = engine.module
assert model.lm_head.weight is model.transformer.wte.weight
print(json.dumps({"growth_mib": growth, "checked": checked, "tensors": len(index)}))
"""


def test_from_pretrained_streams_the_weights_one_module_at_a_time(nvme_dir, tmp_path):
    # Note [Pretrained weights one module at a time] (bindings/tierzero/hf.py): a GPT-2 of 151 MB (fp32) in
    # 40 MB safetensors shards, loaded straight into the engine (parameters and optimizer on NVMe): the
    # process's peak resident memory grows by less than half the model (the largest module is 4 MiB; the rest
    # is the engine's own staging), while reading the shards whole grows it by the model.
    import json
    import subprocess
    import sys
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=512, n_layer=12, n_head=8,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    model_mib = sum(p.numel() * 4 for p in model.parameters()) / 2**20
    model.save_pretrained(str(tmp_path / "gpt2"), max_shard_size="40MB")
    del model
    assert (tmp_path / "gpt2" / "model.safetensors.index.json").exists(), "sharded"
    engine_config = host_config(nvme_dir)
    def run(mode):
        out = subprocess.run([sys.executable, "-c", LOADER, str(tmp_path / "gpt2"), json.dumps(engine_config), mode],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout + out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])
    result = run("engine")
    result["whole_mib"] = run("whole")["growth_mib"]
    print(f"from_pretrained of a {model_mib:.0f} MiB model: peak resident memory grew {result['growth_mib']:.0f} "
          f"MiB (the whole checkpoint read at once: {result['whole_mib']:.0f} MiB); {result['checked']} tensors bit "
          "for bit")
    assert result["checked"] == result["tensors"]
    assert result["whole_mib"] > 0.9 * model_mib, "the measure would see a whole model"
    assert result["growth_mib"] < 0.5 * model_mib
