#!/usr/bin/env python3
"""A Hugging Face GPT-2-shaped model trained 200 steps in each optimizer-state format, against torch.optim.AdamW.

Issue #21's acceptance for compact states: the same model, data and
hyperparameters (AdamW, betas (0.9, 0.999) as torch and HF default them,
weight decay 0.01, gradient clipping 1.0, a warm-up then a cosine schedule)
trained

  torch            plain PyTorch: fp32 parameters, torch.optim.AdamW
  tierzero <fmt>   tierzero.torch on the Host backend (the CPU), bf16 parameters,
                   parameters and optimizer states on NVMe (ZeRO-Infinity), with
                   tierzero.states = <fmt>: "fp32" (fp32 master and moments),
                   "remainder" (remainder master, fp32 moments), "remainder+bf16",
                   "remainder+int8" (the latter only where the engine stores it)

on bytes of data/kjv.txt (a 256-symbol vocabulary), each from the same random
initialisation. It prints, per way, the final training loss (mean of the last
20 steps), the validation loss on held-out text, each against torch's, and the
engine's NVMe bytes per parameter per step from its step report; writes --json.
The bound the issue sets is 2% of the fp32 reference's final validation loss.

--step-under-backward off,on,auto runs each tierzero way once per value of
tierzero.step_under_backward (false, true, "auto"), in that order, and prints
what the steps under backward kept and redid (issue #22: Note [What a redo
costs] and Note [When to speculate] in engine/src/step_ahead.h). With
--interleave the arms run step by step in turn (off step 1, on step 1, ...),
each its own engine, so a loaded machine slows them alike and their step
times compare.

    python3 bench/python/compact_states_gpt2.py --steps 200 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time

import torch
import transformers

import tierzero
import tierzero.torch as tzt

FORMATS = {
    "fp32": {"master": "fp32", "moments": "fp32"},
    "remainder": {"master": "remainder", "moments": "fp32"},
    "remainder+bf16": {"master": "remainder", "moments": "bf16"},
    "remainder+int8": {"master": "remainder", "moments": "int8"},
}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def make_model(args) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers,
                                  n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM")
    model = transformers.GPT2LMHeadModel(cfg)
    model.config.use_cache = False
    return model


def batches(data: torch.Tensor, args, count: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - args.seq - 1, (count, args.batch), generator=gen)
    return [torch.stack([data[s:s + args.seq] for s in row.tolist()]).long() for row in starts]


def lr_at(step: int, args) -> float:
    """Linear warm-up over 10% of the steps, then cosine to 10% of the peak (step counts from 0)."""
    warm = max(1, args.steps // 10)
    if step < warm:
        return args.lr * (step + 1) / warm
    t = (step - warm) / max(1, args.steps - warm)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))


def evaluate(forward, val: list[torch.Tensor]) -> float:
    with torch.no_grad():
        return sum(float(forward(x).loss.float()) for x in val) / len(val)


def run_torch(args, train, val) -> dict:
    model = make_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    losses = []
    start = time.perf_counter()
    for i, x in enumerate(train):
        for g in opt.param_groups:
            g["lr"] = lr_at(i, args)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - start
    model.eval()
    return {"losses": losses, "val_loss": evaluate(lambda x: model(input_ids=x, labels=x), val), "seconds": seconds}


SWITCH = {"off": False, "on": True, "auto": "auto"}


def run_tierzero(args, train, val, fmt: str, ahead: str) -> dict:
    """One arm alone: runs tierzero_arm to its end."""
    arm = tierzero_arm(args, train, val, fmt, ahead)
    for _ in train:
        next(arm)
    return next(arm)


def interleaved(arms: list) -> list[dict]:
    """Arms (tierzero_arm generators) step by step in turn, so each arm's step times come from the same
    stretch of the machine's load (--interleave); each arm's result, in order."""
    while True:
        out = [next(arm) for arm in arms]
        if all(isinstance(o, dict) for o in out):
            return out


def tierzero_arm(args, train, val, fmt: str, ahead: str):
    """Yields None after each training step, then the arm's result (a dict)."""
    nvme = tempfile.mkdtemp(prefix="tz-compact-gpt2-", dir=args.nvme_path)
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 1_000_000,
                              "offload_param": {"device": "nvme", "nvme_path": nvme},
                              "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
        "tierzero": {"backend": "host", "states": FORMATS[fmt], "step_under_backward": SWITCH[ahead]},
    }
    model = make_model(args).to(torch.bfloat16)
    engine, optimizer, *_ = tzt.initialize(model, config)
    losses, nvme_bytes, params = [], [], sum(p.numel() for p in make_model(args).parameters())
    steps = []  # per step: what the report says of the optimizer under backward, and the step's seconds
    seconds = 0.0  # this arm's own (interleaved arms' steps in between are not counted)
    try:
        for i, x in enumerate(train):
            optimizer.param_groups[0]["lr"] = lr_at(i, args)
            began = time.perf_counter()
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach().float()))
            report = engine.last_report
            nvme_bytes.append(report.get("nvme_read_bytes", 0) + report.get("nvme_write_bytes", 0))
            steps.append({"seconds": time.perf_counter() - began,
                          **{k: report.get(k) for k in ("grad_norm", "clip_coef", "ahead_blocks", "ahead_redone",
                                                        "ahead_redone_read_bytes", "ahead_redone_write_bytes",
                                                        "ahead_redone_seconds", "ahead_redo_reason", "ahead_off")}})
            seconds += time.perf_counter() - began
            yield None
        engine.eval()
        val_loss = evaluate(lambda x: engine(input_ids=x, labels=x), val)
    finally:
        engine.close()
        shutil.rmtree(nvme, ignore_errors=True)  # the engine removed its swap files; the directory is the bench's
    steady = sorted(nvme_bytes[1:])[len(nvme_bytes[1:]) // 2] if len(nvme_bytes) > 1 else nvme_bytes[0]
    redone = [(s["ahead_redone_read_bytes"] or 0) + (s["ahead_redone_write_bytes"] or 0) for s in steps]
    reasons: dict = {}
    for s in steps:
        if s["ahead_redo_reason"]:
            reasons[s["ahead_redo_reason"]] = reasons.get(s["ahead_redo_reason"], 0) + 1
    times = sorted(s["seconds"] for s in steps[1:]) or [seconds]
    yield {"losses": losses, "val_loss": val_loss, "seconds": seconds, "nvme_bytes_per_param": steady / params,
           "nvme_bytes_per_param_mean": sum(nvme_bytes[1:]) / max(1, len(nvme_bytes) - 1) / params,
           "redone_bytes_per_param_mean": sum(redone) / len(redone) / params,
           "windows_kept": sum(1 for s in steps if (s["ahead_blocks"] or 0) > 0),
           "windows_redone": sum(1 for s in steps if (s["ahead_redone"] or 0) > 0),
           "redo_reasons": reasons, "step_seconds_median": times[len(times) // 2], "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--ways", default="torch,fp32,remainder,remainder+bf16",
                    help="comma-separated: torch and any of " + ", ".join(FORMATS))
    ap.add_argument("--step-under-backward", default="auto", metavar="off,on,auto",
                    help="tierzero.step_under_backward: off (false), on (true), auto (the engine's default); a "
                         "comma-separated list runs each tierzero way once per value")
    ap.add_argument("--nvme-path", default=os.environ.get("TMPDIR", "/var/tmp"))
    ap.add_argument("--interleave", action="store_true",
                    help="run a way's --step-under-backward arms step by step in turn (arm 1 step 1, arm 2 step 1, "
                         "...), so their step times are measured side by side under the same load")
    ap.add_argument("--json")
    args = ap.parse_args()
    tierzero.set_log_level("warn")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    with open(os.path.join(ROOT, "data", "kjv.txt"), "rb") as f:
        text = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
    split = int(text.numel() * 0.9)
    train = batches(text[:split], args, args.steps, seed=1)
    val = batches(text[split:], args, args.val_batches, seed=2)
    params = sum(p.numel() for p in make_model(args).parameters())
    rows = {}
    switches = args.step_under_backward.split(",")
    if any(v not in SWITCH for v in switches):
        raise SystemExit(f"--step-under-backward: expected off, on or auto (comma-separated), got {args.step_under_backward!r}")
    for way in args.ways.split(","):
        if way != "torch" and way not in FORMATS:
            raise SystemExit(f"--ways: unknown way {way!r}; expected torch or one of {', '.join(FORMATS)}")
        names = {ahead: way if way == "torch" or len(switches) == 1 else f"{way} ({ahead})" for ahead in switches}
        if way != "torch" and args.interleave:
            results = interleaved([tierzero_arm(args, train, val, way, ahead) for ahead in switches])
            rows.update({names[ahead]: r for ahead, r in zip(switches, results)})
            print(f"  {way}: {len(switches)} arms interleaved, done", flush=True)
            continue
        for ahead in ["-"] if way == "torch" else switches:
            name = way if way == "torch" else names[ahead]
            rows[name] = run_torch(args, train, val) if way == "torch" else run_tierzero(args, train, val, way, ahead)
            print(f"  {name}: done in {rows[name]['seconds']:.1f} s", flush=True)
    ref_name = "fp32" if "fp32" in rows else ("torch" if "torch" in rows else next(iter(rows)))
    ref = rows[ref_name]
    print(f"\nGPT-2-shaped model: {params / 1e6:.2f}M parameters ({args.layers} x {args.hidden}, seq {args.seq}, "
          f"batch {args.batch}), {args.steps} steps, AdamW betas (0.9, 0.999); host {cpu_name()}, {os.cpu_count()} CPUs")
    print(f"{'way':<22}{'train loss (last 20)':>22}{'val loss':>10}{'vs ' + ref_name:>10}{'vs torch':>10}"
          f"{'NVMe B/param/step':>19}")
    for way, r in rows.items():
        r["train_loss_last20"] = sum(r["losses"][-20:]) / len(r["losses"][-20:])
        r["val_vs_ref"] = r["val_loss"] / ref["val_loss"] - 1
        r["val_vs_torch"] = r["val_loss"] / rows["torch"]["val_loss"] - 1 if "torch" in rows else None
        nv = f"{r['nvme_bytes_per_param']:.2f}" if "nvme_bytes_per_param" in r else "-"
        vt = f"{100 * r['val_vs_torch']:+.2f}%" if r["val_vs_torch"] is not None else "-"
        print(f"{way:<22}{r['train_loss_last20']:>22.4f}{r['val_loss']:>10.4f}{100 * r['val_vs_ref']:>+9.2f}%"
              f"{vt:>10}{nv:>19}")
    print(f"\n{'way':<22}{'NVMe B/param/step (mean)':>26}{'redone B/param/step':>21}{'kept':>6}{'redone':>8}"
          f"{'step s (median)':>17}  redo reasons")
    for way, r in rows.items():
        if "windows_kept" in r:
            print(f"{way:<22}{r['nvme_bytes_per_param_mean']:>26.2f}{r['redone_bytes_per_param_mean']:>21.2f}"
                  f"{r['windows_kept']:>6}{r['windows_redone']:>8}{r['step_seconds_median']:>17.3f}  {r['redo_reasons']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": params, "args": vars(args), "host": cpu_name(), "reference": ref_name, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
