#!/usr/bin/env python3
"""Which 8-bit code for Adam's second moment? (Note [Int8 second moment], cpu_adam/src/int8_codes.cpp)

The first moment uses the signed dynamic code of Note [Int8 moments] in every
case. For exp_avg_sq (v >= 0, many decades inside a 256-element block) three
codes are compared, each with one fp32 scale per 256 elements:
  v        the unsigned dynamic code (0 and 254 levels over 8 decades) on v / max v,
           a positive v never coded 0
  v_zero   the same, but nearest rounding may code a small positive v as 0
  sqrt_v   the same code on sqrt(v) / sqrt(max v), decoded squared (16 decades of v)
Two measurements, in float64 arithmetic so only the codes differ:
  1. error against float64 Adam with fp32 moments' worth of precision (no
     quantization) over 1000 steps of synthetic gradients (per-parameter
     scales over 4 decades, noise plus a drifting signal): the relative error
     of each step's update, and of the parameters at the end;
  2. a small training run: an MLP (2 hidden layers of 256) fitting a fixed
     random teacher, 1500 AdamW steps, the final loss of each code against
     unquantized AdamW (same seed, same batches).
Writes a table and --json (bench/results/int8_moment_codes.json).
"""
import argparse
import json
import time

import numpy as np
import torch

BLOCK = 256


def dynamic_magnitudes(decades, top_levels):
    out = [0.0]
    for d in range(decades):
        levels = top_levels if d == decades - 1 else 1 << d
        top = 10.0 ** (d - (decades - 1))
        out += [top * (0.1 + 0.9 * j / levels) for j in range(1, levels + 1)]
    return np.array(out, dtype=np.float32).astype(np.float64)


SIGNED = dynamic_magnitudes(7, 64)      # 128 magnitudes
UNSIGNED = dynamic_magnitudes(8, 127)   # 255 levels


def nearest(levels, y):
    mids = (levels[:-1] + levels[1:]) / 2
    return np.searchsorted(mids, y, side="left")  # ties to the lower


def quantize(x, kind):
    """x (flat float64) -> decoded values after one encode/decode, per 256-block."""
    n = x.size
    pad = (-n) % BLOCK
    xb = np.concatenate([x, np.zeros(pad)]).reshape(-1, BLOCK)
    if kind == "m":
        s = np.abs(xb).max(axis=1, keepdims=True)
        d = np.where(s > 0, s, 1.0)
        k = nearest(SIGNED, np.abs(xb) / d)
        out = np.sign(xb) * SIGNED[k] * s
    else:
        on_sqrt = kind == "sqrt_v"
        y0 = np.sqrt(xb) if on_sqrt else xb
        s = y0.max(axis=1, keepdims=True)
        d = np.where(s > 0, s, 1.0)
        y = y0 / d
        k = nearest(UNSIGNED, y)
        if kind != "v_zero":
            k = np.where((k == 0) & (y > 0), 1, k)
        out = UNSIGNED[k] * s
        if on_sqrt:
            out = out * out
    return out.reshape(-1)[:n]


def adam_error(kinds, steps, n, seed):
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.uniform(-4, 0, n)
    signal = rng.standard_normal(n)
    b1, b2, eps, lr = 0.9, 0.999, 1e-8, 1e-3
    state = {k: dict(p=np.zeros(n), m=np.zeros(n), v=np.zeros(n)) for k in ["ref"] + kinds}
    rel = {k: [] for k in kinds}
    for t in range(1, steps + 1):
        signal = 0.99 * signal + 0.1 * rng.standard_normal(n)
        g = scale * (0.3 * signal + rng.standard_normal(n))
        updates = {}
        for k, s in state.items():
            s["m"] = b1 * s["m"] + (1 - b1) * g
            s["v"] = b2 * s["v"] + (1 - b2) * g * g
            u = -lr / (1 - b1 ** t) * s["m"] / (np.sqrt(s["v"]) / np.sqrt(1 - b2 ** t) + eps)
            s["p"] += u
            updates[k] = u
            if k != "ref":
                s["m"] = quantize(s["m"], "m")
                s["v"] = quantize(s["v"], k)
        for k in kinds:
            rel[k].append(np.linalg.norm(updates[k] - updates["ref"]) / np.linalg.norm(updates["ref"]))
    out = {}
    for k in kinds:
        r = np.array(rel[k])
        p_err = np.linalg.norm(state[k]["p"] - state["ref"]["p"]) / np.linalg.norm(state["ref"]["p"])
        out[k] = dict(update_rel_err_median=float(np.median(r)), update_rel_err_p99=float(np.quantile(r, 0.99)),
                      update_rel_err_max=float(r.max()), param_rel_err_final=float(p_err))
    return out


class QuantAdamW(torch.optim.Optimizer):
    """AdamW (float64 moments) whose moments are encoded and decoded after every step."""

    def __init__(self, params, kind, lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.kind = kind

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st["t"] = 0
                    st["m"] = np.zeros(p.numel())
                    st["v"] = np.zeros(p.numel())
                st["t"] += 1
                t = st["t"]
                g = p.grad.detach().double().numpy().reshape(-1)
                st["m"] = b1 * st["m"] + (1 - b1) * g
                st["v"] = b2 * st["v"] + (1 - b2) * g * g
                w = p.detach().double().numpy().reshape(-1) * (1 - group["lr"] * group["weight_decay"])
                w = w - group["lr"] / (1 - b1 ** t) * st["m"] / (np.sqrt(st["v"]) / np.sqrt(1 - b2 ** t) + group["eps"])
                p.copy_(torch.from_numpy(w).view_as(p).to(p.dtype))
                if self.kind != "fp64":
                    st["m"] = quantize(st["m"], "m")
                    st["v"] = quantize(st["v"], self.kind)


def train(kind, steps, seed):
    torch.manual_seed(seed)
    teacher = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 16))
    torch.manual_seed(seed + 1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 16))
    opt = QuantAdamW(model.parameters(), kind)
    gen = torch.Generator().manual_seed(seed + 2)
    losses = []
    for _ in range(steps):
        x = torch.randn(128, 64, generator=gen)
        with torch.no_grad():
            y = teacher(x)
        loss = torch.nn.functional.mse_loss(model(x), y)
        model.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return float(np.mean(losses[-50:]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--train-steps", type=int, default=1500)
    ap.add_argument("--json")
    a = ap.parse_args()
    kinds = ["v", "v_zero", "sqrt_v"]
    t0 = time.time()
    err = adam_error(kinds, a.steps, a.n, 21)
    losses = {k: train(k, a.train_steps, 7) for k in ["fp64"] + kinds}
    print(f"second-moment codes, {a.steps} Adam steps on {a.n} parameters (error vs float64 Adam, no quantization)")
    print(f"{'code':8} {'update err median':>18} {'p99':>8} {'max':>8} {'params at end':>14} {'MLP loss':>10} {'vs fp64':>8}")
    for k in kinds:
        e = err[k]
        print(f"{k:8} {e['update_rel_err_median']:18.4f} {e['update_rel_err_p99']:8.4f} {e['update_rel_err_max']:8.4f} "
              f"{e['param_rel_err_final']:14.4f} {losses[k]:10.5f} {losses[k] / losses['fp64'] - 1:+8.2%}")
    print(f"{'fp64':8} {'':18} {'':8} {'':8} {'':14} {losses['fp64']:10.5f}")
    print(f"({time.time() - t0:.0f} s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(adam_error=err, mlp_final_loss=losses, steps=a.steps, n=a.n, train_steps=a.train_steps),
                      f, indent=1)


if __name__ == "__main__":
    main()
