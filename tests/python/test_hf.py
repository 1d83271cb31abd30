"""tierzero.hf (bindings/tierzero/hf.py, Note [The Trainer on the engine]): the Hugging Face Trainer on the
engine with NVMe offload against the plain Trainer (examples/hf_trainer_nvme.py), "auto" filled from the
TrainingArguments, full weights saved and loaded back, and a resumed run continuing the loss curve."""

import importlib.util
import pathlib

import pytest
import torch
import transformers

import tierzero.hf

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
