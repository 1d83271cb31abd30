"""deepspeed_compare.py --mode gpu: one Hugging Face GPT-2-family model through deepspeed.initialize and through
tierzero.torch.initialize, with the same JSON config, on one CUDA GPU.

For each offload (--offloads cpu,nvme) and each framework a child process
(so peaks are its own, and a failure is a row, not the end of the run):

  - builds transformers.GPT2LMHeadModel from a config (random init, nothing
    downloaded): for DeepSpeed as Hugging Face does under ZeRO-3
    (HfDeepSpeedConfig, then _from_config: zero.Init, partitioned as it is
    made, weights initialised gathered), tierzero under torch.device("meta") with init_fn=model._init_weights
    (made one module at a time into the engine); bf16 either way;
  - initialize()s it with config(): ZeRO-3, bf16, AdamW (lr 1e-4, wd 0.01),
    gradient clipping 1.0, optimizer states offloaded to "cpu" (ZeRO-Offload)
    or optimizer states and parameters to "nvme" under --nvme-path
    (ZeRO-Infinity), DeepSpeed's aio block (1 MiB blocks, queue depth 8);
    the identical dict goes to both;
  - trains --steps steps on random tokens (--batch x --seq) after 2 warm-up
    steps and reports tokens/s (median step), peak GPU memory (the CUDA
    caching allocator's peak and the device's used memory sampled every
    20 ms, less what was used before: tierzero's engine allocates outside
    torch's allocator too), peak host memory (the child's peak RSS, pinned
    buffers included) and the first and last loss.

--largest then walks --largest-models (smallest first) for each framework and
offload until one fails (out of memory, or past --child-timeout), and reports
the largest that trained. It can take long: one child a size.

    python3 bench/python/deepspeed_compare.py --mode gpu --model gpt2-medium --nvme-path /var/tmp --json gpu.json

What the GPU machine needs (it reaches no package registry; scripts/fetch_wheels.sh
downloads these into a folder to carry, e.g. shared/ds-wheels/):

  - the deepspeed sdist (0.19.8 here) and its pure-Python dependencies not
    already present (hjson, ninja, py-cpuinfo, msgpack, einops) as wheels;
    installed with pip install --no-index --find-links DIR --no-deps ...,
    never replacing the machine's torch;
  - libaio1 and libaio-dev as .deb files (dpkg -i) for DeepSpeed's NVMe
    offload (its aio op is built on first use);
  - transformers (already beside torch on the project's machines; carry its
    wheel too if it is not);
  - a C++ compiler and the CUDA toolkit (nvcc), which DeepSpeed's ops build
    with on first use (~2-4 minutes): the GPU machine has them, as tierzero's
    own CUDA build does.

A run without a CUDA GPU is refused before anything is built (exit 2).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

# name -> (layers, hidden); heads = hidden / 64 (GPT-2's). The first four are Hugging Face's GPT-2 sizes.
MODELS = {"gpt2": (12, 768), "gpt2-medium": (24, 1024), "gpt2-large": (36, 1280), "gpt2-xl": (48, 1600),
          "2.7b": (32, 2560), "6.7b": (32, 4096), "13b": (40, 5120), "20b": (44, 6144), "30b": (48, 7168)}
LARGEST_ORDER = ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "2.7b", "6.7b", "13b", "20b", "30b"]
VOCAB = 50257
_HF_DS_CONFIG = None


def model_shape(name: str) -> tuple:
    """(layers, hidden, heads) for a name in MODELS or 'LAYERSxHIDDEN'."""
    if name in MODELS:
        layers, hidden = MODELS[name]
    else:
        try:
            layers, hidden = (int(v) for v in name.lower().split("x"))
        except ValueError:
            raise ValueError(f"model {name!r}: expected one of {', '.join(MODELS)} or LAYERSxHIDDEN") from None
    if hidden % 64:
        raise ValueError(f"model {name!r}: the width must be a multiple of 64 (GPT-2's head size)")
    return layers, hidden, hidden // 64


def approx_params(name: str) -> int:
    layers, h, _ = model_shape(name)
    return VOCAB * h + 1024 * h + layers * (12 * h * h + 13 * h) + 2 * h


def config(offload: str, nvme_path: str, batch: int) -> dict:
    """The one config both frameworks get (DeepSpeed's keys; tierzero reads the same)."""
    zero: dict = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 100_000_000,
                  "stage3_prefetch_bucket_size": 50_000_000, "stage3_max_live_parameters": 1_000_000_000,
                  "stage3_param_persistence_threshold": 100_000}
    if offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    elif offload == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True, "buffer_count": 4,
                                     "fast_init": False}
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True, "buffer_count": 5,
                                 "buffer_size": 100_000_000, "max_in_cpu": 1_000_000_000}
    else:
        raise ValueError(f"offload {offload!r}: expected cpu or nvme")
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.01}},
        "zero_optimization": zero,
        "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                "overlap_events": True},
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }


def unavailable_reason() -> Optional[str]:
    """Why this machine cannot run --mode gpu, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)"
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers is not installed (carry its wheel)"
    return None


# ---------------------------------------------------------------------------------------------------------------
# parent
# ---------------------------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_child(framework: str, offload: str, model: str, args) -> dict:
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_compare.py")
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    # The swap directory is the parent's to make and remove: a child that fails or is killed leaves nothing.
    nvme = tempfile.mkdtemp(prefix=f"dscmp-{framework}-", dir=args.nvme_path)
    env["DSCMP_NVME_DIR"] = nvme
    cmd = [sys.executable, script, *sys.argv[1:], "--model", model, "--child", f"gpu:{framework}:{offload}"]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              timeout=args.child_timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "framework": framework, "offload": offload, "model": model,
                "error": f"still running after {args.child_timeout} s (--child-timeout)"}
    finally:
        shutil.rmtree(nvme, ignore_errors=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
        return {"ok": False, "framework": framework, "offload": offload, "model": model,
                "error": f"exit {proc.returncode}: " + " | ".join(tail), "wall_s": time.perf_counter() - start}
    return json.loads(lines[-1])


def run(args) -> dict:
    from deepspeed_compare import format_table
    rows = [_run_child(fw, off, args.model, args) for off in args.offloads for fw in ("deepspeed", "tierzero")]
    print(f"\nGPT-2 family '{args.model}' (~{approx_params(args.model) / 1e6:.0f}M parameters), ZeRO-3, bf16, "
          f"batch {args.batch} x seq {args.seq}, median of {args.steps} steps, one GPU")
    table = [[f"{r['framework']} {r['offload']}", r.get("tokens_per_s"), _gib(r.get("peak_gpu_allocated_bytes")),
              _gib(r.get("peak_gpu_used_bytes")), _gib(r.get("peak_host_rss_bytes")),
              f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}" if r.get("ok") else r.get("error", "")[:60]]
             for r in rows]
    print(format_table(["run", "tokens/s", "GPU alloc GiB", "GPU used GiB", "host peak GiB", "loss / error"], table))
    out: dict = {"model": args.model, "rows": rows}
    if args.largest:
        out["largest"] = _largest(args)
    return out


def _largest(args) -> list:
    from deepspeed_compare import format_table
    results = []
    for offload in args.offloads:
        for fw in ("deepspeed", "tierzero"):
            best, tried = None, []
            for name in LARGEST_ORDER:
                r = _run_child(fw, offload, name, args)
                tried.append(r)
                if not r.get("ok"):
                    break
                best = name
            results.append({"framework": fw, "offload": offload, "largest": best,
                            "largest_params": approx_params(best) if best else 0, "tried": tried})
    print("\nLargest GPT-2-family model trained (sizes tried smallest first, stopped at the first failure)")
    print(format_table(["run", "largest", "params (M)", "failed at"],
                       [[f"{r['framework']} {r['offload']}", r["largest"] or "none", r["largest_params"] / 1e6,
                         (r["tried"][-1]["model"] + ": " + r["tried"][-1].get("error", "")[:50])
                         if not r["tried"][-1].get("ok") else "-"] for r in results]))
    return results


def _gib(v: Optional[int]) -> Optional[float]:
    return None if v is None else v / 2**30


# ---------------------------------------------------------------------------------------------------------------
# child
# ---------------------------------------------------------------------------------------------------------------

class _GpuSampler:
    """Peak device memory in use (all allocators), sampled every 20 ms, less the use at start."""

    def __init__(self):
        import torch
        self._torch = torch
        free, total = torch.cuda.mem_get_info()
        self.base = total - free
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self):
        while not self._stop.wait(0.02):
            free, total = self._torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free - self.base)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _build(framework: str, name: str, cfg: dict, seq: int):
    import torch
    import transformers
    layers, hidden, heads = model_shape(name)
    hf = transformers.GPT2Config(vocab_size=VOCAB, n_positions=max(seq, 1024), n_embd=hidden, n_layer=layers,
                                 n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    # Resolved before zero.Init: transformers imports the model's module lazily, and that import (torch._dynamo's
    # polyfills) fails inside zero.Init, which has replaced torch's tensor constructors (DeepSpeed 0.19.8, torch 2.15).
    model_class = transformers.GPT2LMHeadModel
    torch.manual_seed(0)
    if framework == "deepspeed":
        # As Hugging Face builds a model for DeepSpeed ZeRO-3: with HfDeepSpeedConfig alive, _from_config runs
        # under zero.Init and then initialises each module's weights gathered (initialize_weights_zero3). A bare
        # zero.Init around the constructor leaves GPT-2's Conv1D weights uninitialised (first loss ~90, not ~10.8).
        from transformers.integrations import HfDeepSpeedConfig
        global _HF_DS_CONFIG
        _HF_DS_CONFIG = HfDeepSpeedConfig(cfg)  # transformers holds it weakly: keep it alive
        return model_class._from_config(hf, dtype=torch.bfloat16)
    with torch.device("meta"):
        model = model_class(hf)
    return model.to(torch.bfloat16)


def child(args) -> None:
    import torch
    _, framework, offload = args.child.split(":")
    cfg = config(offload, os.environ["DSCMP_NVME_DIR"], args.batch)
    sampler = _GpuSampler()
    torch.cuda.reset_peak_memory_stats()
    if framework == "deepspeed":
        import deepspeed
        deepspeed.init_distributed(dist_backend="nccl")
        model = _build(framework, args.model, cfg, args.seq)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    else:
        import tierzero
        import tierzero.torch as tzt
        tierzero.set_log_level("warn")
        model = _build(framework, args.model, cfg, args.seq)
        engine, _, _, _ = tzt.initialize(model=model, config=cfg, init_fn=model._init_weights)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (args.batch, args.seq), generator=gen).cuda() for _ in range(4)]
    times, losses = [], []
    warmup = 2
    for i in range(warmup + args.steps):
        x = batches[i % len(batches)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        losses.append(float(loss.float().item()))
        if i >= warmup:
            times.append(time.perf_counter() - start)
    med = statistics.median(times)
    out = {"ok": True, "framework": framework, "offload": offload, "model": args.model,
           "params": approx_params(args.model), "step_s": times, "median_step_s": med,
           "tokens_per_s": args.batch * args.seq / med, "losses": losses,
           "peak_gpu_allocated_bytes": torch.cuda.max_memory_allocated(),
           "peak_gpu_reserved_bytes": torch.cuda.max_memory_reserved(),
           "peak_gpu_used_bytes": sampler.stop(),
           "peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "gpu": torch.cuda.get_device_name(), "config": cfg}
    print(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)  # skip teardown (NCCL, aio threads): the figures are out; the parent removes the swap files
