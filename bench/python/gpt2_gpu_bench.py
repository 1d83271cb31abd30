#!/usr/bin/env python3
"""GPT-2-shaped training on a GPU through tierzero.torch, against plain PyTorch, in tokens/s.

A Hugging Face GPT2LMHeadModel built from a config (random init, nothing
downloaded) trains on random tokens, --steps timed steps after --warmup, at
one size that fits on the GPU, four ways:

  torch            plain PyTorch: fp32 parameters on the GPU, bf16 autocast,
                   torch.optim.AdamW(fused=True) on the GPU (the usual recipe)
  tierzero gpu     tierzero.torch with bf16 parameters and every state on the
                   GPU (the engine's GPU optimizer), ZeRO stage 3 gathering
  tierzero cpu     the optimizer states in pinned CPU memory, stepped by the
                   CPU Adam (ZeRO-Offload)
  tierzero nvme    parameters and optimizer states on NVMe (ZeRO-Infinity)

A way may carry options after '+': `cpu+ahead` steps each block's optimizer
under backward in every window (tierzero.step_under_backward: true; the
default is "auto"), `cpu+compact` keeps remainder masters and int8 moments
(tierzero.states), `cpu+ahead+compact` both.

Prints a table and writes --json. Needs torch with CUDA and transformers.

    python3 bench/python/gpt2_gpu_bench.py --layers 12 --hidden 768 --seq 1024 --batch 8 --nvme-path /var/tmp/tz
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import transformers

import tierzero
import tierzero.torch as tzt


def make_model(args) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers,
                                  n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.config.use_cache = False
    return model


def tierzero_config(args, way: str, nvme: str) -> dict:
    offload, *options = way.split("+")
    unknown = set(options) - {"ahead", "compact"}
    if unknown or offload not in ("gpu", "cpu", "nvme"):
        raise SystemExit(f"--ways: {way!r}: a way is torch, gpu, cpu or nvme, optionally +ahead and +compact")
    zero: dict = {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 100_000_000}
    if offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme, "pin_memory": True}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "pin_memory": True}
    tz: dict = {"backend": "cuda"}
    if "ahead" in options:
        tz["step_under_backward"] = True
    if "compact" in options:
        tz["states"] = {"master": "remainder", "moments": "int8"}
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "tierzero": tz,
    }


def timed_steps(step, args) -> list[float]:
    times = []
    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(i)
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return times


def run_torch(args, batches) -> dict:
    model = make_model(args).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    losses = []

    def step(i):
        x = batches[i % len(batches)]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    times = timed_steps(step, args)
    peak = torch.cuda.max_memory_allocated()
    del model, opt
    torch.cuda.empty_cache()
    return {"times": times, "losses": losses, "peak_gpu_bytes": peak}


def run_tierzero(args, batches, way: str) -> dict:
    nvme = tempfile.mkdtemp(prefix="tz-gpt2-", dir=args.nvme_path)
    model = make_model(args).to(torch.bfloat16).cuda()
    torch.cuda.reset_peak_memory_stats()
    engine, *_ = tzt.initialize(model, tierzero_config(args, way, nvme))
    losses = []

    def step(i):
        x = batches[i % len(batches)]
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())

    times = timed_steps(step, args)
    out = {"times": times, "losses": losses, "peak_gpu_bytes": torch.cuda.max_memory_allocated(),
           "report": {k: v for k, v in engine.last_report.items() if isinstance(v, (int, float, bool))}}
    del engine, model
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ways", default="torch,gpu,cpu,nvme")
    ap.add_argument("--nvme-path", default=os.environ.get("TMPDIR", "/var/tmp"))
    ap.add_argument("--json")
    args = ap.parse_args()
    tierzero.set_log_level("warn")
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).cuda() for _ in range(4)]
    params = sum(p.numel() for p in make_model(args).parameters())
    rows = {}
    for way in args.ways.split(","):
        rows[way] = run_torch(args, batches) if way == "torch" else run_tierzero(args, batches, way)
    tokens = args.batch * args.seq
    print(f"\nGPT-2-shaped model: {params / 1e6:.1f}M parameters, {args.layers} x {args.hidden}, seq {args.seq}, "
          f"batch {args.batch}; GPU {torch.cuda.get_device_name()}; median of {args.steps} steps")
    print(f"{'way':<16}{'step s':>9}{'tokens/s':>12}{'vs torch':>10}{'peak GPU GiB':>14}{'loss first->last':>20}")
    base = None
    for way, r in rows.items():
        med = statistics.median(r["times"])
        tps = tokens / med
        r.update(median_s=med, tokens_per_s=tps)
        base = tps if way == "torch" else base
        ratio = f"{tps / base:.3f}" if base else "-"
        name = way if way == "torch" else f"tierzero {way}"
        print(f"{name:<16}{med:>9.3f}{tps:>12.0f}{ratio:>10}{r['peak_gpu_bytes'] / 2**30:>14.2f}"
              f"{r['losses'][0]:>10.3f} -> {r['losses'][-1]:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": params, "args": vars(args), "gpu": torch.cuda.get_device_name(), "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
