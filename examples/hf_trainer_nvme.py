"""A Hugging Face Trainer run on tierzero's engine, parameters and optimizer states on NVMe, against the same
run with the plain Trainer (torch's AdamW, everything in memory): a small GPT-2-shaped transformers model,
the same data, seed and schedule. Prints both loss curves and their largest difference, and exits with 1 when
they differ by more than fp32 reordering explains.

    python examples/hf_trainer_nvme.py --nvme-path /var/tmp/tierzero-nvme --steps 20

The config is the Hugging Face ZeRO-3 template with NVMe offload: every "auto" is filled from the
TrainingArguments by tierzero.hf, as the Trainer fills DeepSpeed's.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile

import torch
import transformers

import tierzero.hf

TOLERANCE = 1e-4  # relative, on each logged loss


def ds_config(nvme_path: str) -> dict:
    return {
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW",
                      "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path},
            "offload_param": {"device": "nvme", "nvme_path": nvme_path},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "sub_group_size": 1e9,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": 0,
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "steps_per_print": 2000,
        "wall_clock_breakdown": False,
    }


def gpt2(seed: int = 0) -> transformers.GPT2LMHeadModel:
    """GPT-2's architecture, small: 2 layers of 64, a 256-token vocabulary (bytes), tied embeddings; no dropout,
    so both runs see the same function."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


class Text(torch.utils.data.Dataset):
    """Windows of 32 bytes of a fixed text (the model learns it), each its own label."""

    def __init__(self, n: int = 256, length: int = 32):
        text = (b"In the beginning God created the heaven and the earth. And the earth was without form, and void; "
                b"and darkness was upon the face of the deep. ") * 16
        assert (n - 1) * 7 + length <= len(text)
        self.items = [torch.tensor(list(text[i * 7:i * 7 + length])) for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.items[i], "labels": self.items[i]}


def training_args(out: str, steps: int, **overrides) -> transformers.TrainingArguments:
    kwargs = dict(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=steps,
                  learning_rate=3e-3, warmup_steps=4, lr_scheduler_type="linear", max_grad_norm=1.0,
                  weight_decay=0.1,  # the Trainer's two groups: decay on matrices, none on biases and norms
                  logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0,
                  dataloader_num_workers=0, disable_tqdm=True)
    kwargs.update(overrides)
    return transformers.TrainingArguments(**kwargs)


def losses(trainer: transformers.Trainer) -> list:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def both_runs(nvme_path: str, steps: int, out: str) -> tuple:
    """(the plain Trainer, the tierzero Trainer), both trained."""
    model = gpt2()
    plain = transformers.Trainer(model=copy.deepcopy(model), args=training_args(f"{out}/plain", steps),
                                 train_dataset=Text())
    plain.train()
    ours = tierzero.hf.Trainer(model=model, args=training_args(f"{out}/tierzero", steps), train_dataset=Text(),
                               tierzero_config=ds_config(nvme_path))
    ours.train()
    return plain, ours


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nvme-path", required=True, help="a directory on the NVMe drive (O_DIRECT)")
    parser.add_argument("--steps", type=int, default=20)
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        plain, trainer = both_runs(a.nvme_path, a.steps, out)
        theirs, mine = losses(plain), losses(trainer)
        print(f"tierzero: {trainer.engine.describe()}")
        print("step  loss: plain Trainer  tierzero.hf.Trainer   grad norm: plain  tierzero")
        norms = [(p.get("grad_norm", 0.0), m.get("grad_norm", 0.0)) for p, m in
                 zip(plain.state.log_history, trainer.state.log_history) if "loss" in m]
        for i, ((t, m), (tn, mn)) in enumerate(zip(zip(theirs, mine), norms)):
            print(f"{i + 1:4d}  {t:19.6f}  {m:19.6f}  {tn:17.6f}  {mn:8.6f}")
        worst = max(abs(t - m) / abs(t) for t, m in zip(theirs, mine))
        same = len(theirs) == len(mine) == a.steps and worst <= TOLERANCE
        print(f"largest relative difference {worst:.3g} over {len(mine)} steps: "
              f"{'the losses match' if same else 'THE LOSSES DIFFER'} (tolerance {TOLERANCE:g})")
        trainer.engine.close()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
