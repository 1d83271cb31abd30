#!/usr/bin/env python3
"""tierzero against the real DeepSpeed package, side by side in one process (issue #24, item 5).

Three modes (--mode, comma-separated; default "adam,aio"):

  adam  deepspeed.ops.adam.DeepSpeedCPUAdam against tierzero.optim.AdamW on the
        same GPT-2-shaped set of tensors (--params, default 100M: the embedding,
        then 12 tensors a layer of width --hidden, as a model has), both AdamW
        (decoupled weight decay). One child process a thread count (--threads,
        default "1,2"), started with OMP_NUM_THREADS=N (DeepSpeed's kernel is an
        OpenMP loop; torch.set_num_threads(N) too) and tierzero's threads=N.
        In a child the two optimizers step alternately (DeepSpeed first on even
        repetitions, tierzero first on odd ones), median of --repeats. Cases:

          fp32            fp32 parameters, gradients and moments (both: 28 B/param moved).
          fp32+bf16 out   ZeRO-Offload's CPU step: fp32 master, fp32 gradient, then the
                          new parameter rounded to bf16 for the model. DeepSpeed's op
                          has no copy-out (0.19: adam_update only), so DeepSpeed's
                          ZeRO copies afterwards (bit16.copy_(fp32), a second pass; done
                          here on the CPU, on a GPU machine it is the H2D copy);
                          tierzero writes the bf16 copy in the same pass (param16_dtype).
          bf16 params     bf16 parameters and gradients, fp32 moments. DeepSpeed steps the
                          bf16 parameters themselves: no master, each step rounded to bf16
                          (updates under half a bf16 ulp are lost). tierzero keeps the
                          fp32 master exactly as a bf16 parameter plus a 16-bit remainder
                          (master="remainder", +2.125 B/param each way): not the same
                          arithmetic, the nearest tierzero has.
          bf16 moments    as "bf16 params" with bf16 moments (DeepSpeed
                          fp32_optimizer_states=False; tierzero moments="bf16").

        Before timing, both take --check-steps steps and are checked against a
        float64 reference of AdamW (torch.optim's formula) on the same inputs:
        fp32 results within fp32 rounding, bf16 results within the bf16 rounding
        each design implies. A disagreement stops the run (exit 1): it is a bug,
        not a figure.

  aio   DeepSpeed's async I/O op (deepspeed.ops.op_builder.AsyncIOBuilder, libaio)
        against tierzero's I/O engine (tierzero.nvme.IoEngine, io_uring) on the
        same file (--aio-size in --aio-dir), the same page-locked buffer
        (DeepSpeed's new_cpu_locked_tensor), O_DIRECT, for each --block-sizes x
        --queue-depths, --aio-threads threads/rings each (DeepSpeed's
        intra_op_parallelism, tierzero's rings). Whole-file writes then reads,
        alternating who goes first, median GB/s of --repeats. Every read's
        bytes are checksummed against what was written. Reads are the figures to
        trust: a write returns when the host (or a VM's host) holds the data,
        which may be its cache.

  gpu   the same Hugging Face GPT-2-family model through deepspeed.initialize and
        through tierzero.torch.initialize with the same JSON config (ZeRO-3,
        optimizer and parameters offloaded to CPU, then to NVMe): tokens/s,
        peak GPU and host memory, and with --largest the largest model each
        trains. Needs a CUDA GPU (refuses without one, exit 2);
        bench/python/deepspeed_compare_gpu.py has the details and what the GPU
        machine must be given.

DeepSpeed is not a dependency of tierzero; this program needs it installed
beside tierzero (scripts/fetch_wheels.sh has the exact steps):

    pip install --no-deps deepspeed hjson ninja py-cpuinfo msgpack einops   # keeps your torch
    apt-get install -y libaio-dev                                           # for the aio mode

The ops are built on first use (just in time, with ninja and the host C++
compiler, -march=native; cpu_adam took 10 min, async_io 30 min on the 2-core machine
under heavy load, bench/RESULTS.md) into ~/.cache/torch_extensions.

    python3 bench/python/deepspeed_compare.py --mode adam,aio --json ds.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional, Sequence

INSTALL_HINT = ("install DeepSpeed beside tierzero without letting pip touch torch: pip install --no-deps deepspeed "
                "hjson ninja py-cpuinfo msgpack einops (and apt-get install libaio-dev for --mode aio); "
                "scripts/fetch_wheels.sh lists the exact files")

MODES = ("adam", "aio", "gpu")
ADAM_CASES = ("fp32", "fp32+bf16 out", "bf16 params", "bf16 moments")
UNITS = {"": 1, "K": 1 << 10, "KI": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MI": 1 << 20, "MIB": 1 << 20,
         "G": 1 << 30, "GI": 1 << 30, "GIB": 1 << 30}


# ---------------------------------------------------------------------------------------------------------------
# Pure-Python parts (tests/python/test_deepspeed_compare.py runs these without DeepSpeed)
# ---------------------------------------------------------------------------------------------------------------

def parse_bytes(text: str) -> int:
    """'4K', '1M', '1GiB', '4096' -> bytes (binary units)."""
    t = str(text).strip().upper().replace(" ", "")
    num = t.rstrip("KMGIB")
    unit = t[len(num):]
    try:
        value = float(num) * UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 4096, 128K, 1M or 1GiB") from None
    if value <= 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive whole number of bytes")
    return int(value)


def parse_count(text: str) -> int:
    """'100M', '1.5B', '120000000' -> a parameter count (decimal units)."""
    t = str(text).strip().upper()
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale != 1 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a count such as 100M or 1.5B") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive count")
    return int(value)


def parse_list(convert: Callable[[str], Any]) -> Callable[[str], list]:
    def parse(text: str) -> list:
        items = [s for s in str(text).split(",") if s.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list")
        return [convert(s.strip()) for s in items]
    return parse


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number >= 1")
    return value


def parse_modes(text: str) -> list:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"--mode {text!r}: expected a comma-separated subset of {', '.join(MODES)}")
    return modes


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", type=parse_modes, default=["adam", "aio"], help="adam, aio, gpu (comma-separated)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--repeats", type=positive_int, default=7, help="timed repetitions a row (median)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed repetitions before them")
    adam = ap.add_argument_group("adam")
    adam.add_argument("--params", type=parse_count, default=parse_count("100M"), help="parameters (at least)")
    adam.add_argument("--hidden", type=positive_int, default=1024, help="model width for the tensor shapes")
    adam.add_argument("--threads", type=parse_list(positive_int), default=[1, 2], help="thread counts, e.g. 1,2")
    adam.add_argument("--cases", type=parse_list(str), default=list(ADAM_CASES), help=", ".join(ADAM_CASES))
    adam.add_argument("--check-steps", type=positive_int, default=2, help="steps checked against float64")
    aio = ap.add_argument_group("aio")
    aio.add_argument("--aio-dir", default=os.environ.get("TIERZERO_TEST_NVME_DIR", "/var/tmp"),
                     help="a directory on the drive to test (O_DIRECT)")
    aio.add_argument("--aio-size", type=parse_bytes, default=parse_bytes("1GiB"), help="file size")
    aio.add_argument("--block-sizes", type=parse_list(parse_bytes), default=[128 << 10, 1 << 20])
    aio.add_argument("--queue-depths", type=parse_list(positive_int), default=[8, 32])
    aio.add_argument("--aio-threads", type=positive_int, default=1,
                     help="DeepSpeed intra_op_parallelism = tierzero rings")
    gpu = ap.add_argument_group("gpu (see deepspeed_compare_gpu.py)")
    gpu.add_argument("--model", default="gpt2", help="gpt2, gpt2-medium, gpt2-large, gpt2-xl, or LAYERSxHIDDEN")
    gpu.add_argument("--offloads", type=parse_list(str), default=["cpu", "nvme"], help="cpu, nvme")
    gpu.add_argument("--seq", type=positive_int, default=1024)
    gpu.add_argument("--batch", type=positive_int, default=4)
    gpu.add_argument("--steps", type=positive_int, default=8)
    gpu.add_argument("--nvme-path", default=os.environ.get("TMPDIR", "/var/tmp"))
    gpu.add_argument("--largest", action="store_true", help="also find the largest model each trains")
    gpu.add_argument("--child-timeout", type=positive_int, default=900, help="seconds a GPU child may run")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    return ap


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    bad = [c for c in args.cases if c not in ADAM_CASES]
    if bad:
        ap.error(f"--cases: unknown {', '.join(bad)}; expected some of {', '.join(ADAM_CASES)}")
    bad = [o for o in args.offloads if o not in ("cpu", "nvme")]
    if bad:
        ap.error(f"--offloads: unknown {', '.join(bad)}; expected cpu, nvme")
    if args.warmup < 0:
        ap.error("--warmup: expected a number >= 0")
    return args


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain text table: the first column left-aligned, the others right-aligned; floats to 3 significant places."""
    def cell(v: Any) -> str:
        if isinstance(v, float):
            if v == 0 or not math.isfinite(v):
                return f"{v:g}"
            digits = max(0, 2 - int(math.floor(math.log10(abs(v)))))
            return f"{v:.{digits}f}"
        return "-" if v is None else str(v)
    text = [[str(h) for h in headers]] + [[cell(v) for v in r] for r in rows]
    for r in text:
        if len(r) != len(headers):
            raise ValueError(f"row {r} has {len(r)} cells; the table has {len(headers)} columns")
    widths = [max(len(r[i]) for r in text) for i in range(len(headers))]
    lines = []
    for n, r in enumerate(text):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str, payload: dict) -> None:
    """Writes payload as JSON to a temporary name, then renames it (no half-written file on error)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=1, sort_keys=True, allow_nan=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def machine_info() -> dict:
    model = "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        pass
    isa = "avx512" if " avx512f" in flags else "avx2" if " avx2" in flags else "other"
    return {"cpu": model, "isa": isa, "cpus": os.cpu_count(), "loadavg": list(os.getloadavg()),
            "python": platform.python_version(), "when_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def gpt2_shapes(total: int, hidden: int, vocab: int = 50257, positions: int = 1024) -> list:
    """Element counts of a GPT-2-shaped model's tensors, layers added until the total reaches `total`."""
    h = hidden
    sizes = [vocab * h, positions * h]
    layer = [h, h, 3 * h * h, 3 * h, h * h, h, h, h, 4 * h * h, 4 * h, 4 * h * h, h]
    while sum(sizes) + 2 * h < total:
        sizes += layer
    return sizes + [h, h]  # the final layer norm


def alternate(fns: dict, warmup: int, repeats: int, timer: Callable[[], float] = time.perf_counter,
              after: Optional[dict] = None) -> dict:
    """Runs each fn warmup + repeats times, the order rotated every repetition; returns name -> timed samples.

    after[name], if given, runs untimed right after each call of fns[name] (a check of what it did)."""
    names = list(fns)
    after = after or {}
    samples: dict = {n: [] for n in names}
    for rep in range(warmup + repeats):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            start = timer()
            fns[name]()
            elapsed = timer() - start
            if rep >= warmup:
                samples[name].append(elapsed)
            if name in after:
                after[name]()
    return samples


def require_deepspeed() -> Any:
    try:
        import deepspeed  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"deepspeed_compare: DeepSpeed is not installed ({e}); {INSTALL_HINT}") from None
    return deepspeed


# ---------------------------------------------------------------------------------------------------------------
# adam
# ---------------------------------------------------------------------------------------------------------------

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01


def _adamw_reference(p0, g, steps: int):
    """(param, exp_avg, exp_avg_sq) after `steps` AdamW steps with the same gradient, in float64 (torch's formula)."""
    import torch
    p, g = p0.double(), g.double()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t in range(1, steps + 1):
        p.mul_(1 - LR * WD)
        m.mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])
        v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
        denom = (v.sqrt() / math.sqrt(1 - BETAS[1] ** t)).add_(EPS)
        p.addcdiv_(m, denom, value=-LR / (1 - BETAS[0] ** t))
    return p, m, v


def _ulp(x, mantissa_bits: int):
    import torch
    _, e = torch.frexp(x.abs().float().clamp_min(1e-30))
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), (e - mantissa_bits).to(torch.int64))


class CheckFailed(AssertionError):
    pass


def _check_case(case: str, steps: int, p0, grads, ds_params, tz_params, tz_opt, ds_p16) -> dict:
    """Both optimizers' results against the float64 reference; raises CheckFailed past the tolerance."""
    import torch
    worst = {"ds_over_tol": 0.0, "tz_over_tol": 0.0, "ds_vs_tz_max_abs": 0.0, "ds_bf16_unchanged": 0, "should_change": 0,
             "tz16_not_nearest": 0, "elements": 0}
    for i, (a0, g, pd, pt) in enumerate(zip(p0, grads, ds_params, tz_params)):
        ref, _, _ = _adamw_reference(a0, g, steps)
        delta = (ref - a0.double()).abs()
        # An fp32 result: each step rounds the parameter once (1/2 ulp) and computes the update to ~1e-6 relative.
        tol32 = steps * _ulp(ref, 24) + 1e-5 * delta
        half_bf16 = 0.5 * _ulp(ref, 8)
        outs = {"ds": pd.detach().double(), "tz": pt.detach().double()}
        if case in ("fp32", "fp32+bf16 out"):
            tols = {"ds": tol32, "tz": tol32}
        else:
            # bf16 parameters. DeepSpeed rounds to bf16 every step (no master): within steps x 1/2 bf16 ulp of the
            # values on the way (one gradient every step: the way is monotone, bounded by the start and the end).
            # tierzero's bf16 is the round-to-nearest of an exact fp32 master: within 1/2 bf16 ulp of it (the
            # moments' bf16 rounding, in "bf16 moments", moves the update by ~0.4 %: 1e-2 of it allowed).
            rel = 1e-2 * delta if case == "bf16 moments" else 0
            half_bf16_way = 0.5 * _ulp(torch.maximum(ref.abs(), a0.double().abs()), 8)
            tols = {"ds": steps * half_bf16_way + tol32 + rel, "tz": half_bf16 + tol32 + rel}
            changed = ref.to(torch.bfloat16) != a0
            worst["should_change"] += int(changed.sum())
            worst["ds_bf16_unchanged"] += int((changed & (pd.detach() == a0)).sum())
        for who, out in outs.items():
            ratio = (out - ref).abs() / tols[who]
            over = float(ratio.max())
            worst[f"{who}_over_tol"] = max(worst[f"{who}_over_tol"], over)
            if over > 1.0:
                j = int(ratio.argmax())
                raise CheckFailed(f"{case}: {'DeepSpeed' if who == 'ds' else 'tierzero'} tensor {i} element {j}: "
                                  f"{float(out[j])!r} vs float64 reference {float(ref[j])!r} (start {float(a0[j])!r}, "
                                  f"tolerance {float(tols[who][j]):.3g}) after {steps} steps")
        worst["ds_vs_tz_max_abs"] = max(worst["ds_vs_tz_max_abs"], float((outs["ds"] - outs["tz"]).abs().max()))
        if case == "fp32+bf16 out":
            p16 = tz_opt.param16(pt)
            worst["tz16_not_nearest"] += int((p16 != pt.detach().to(torch.bfloat16)).sum())
            ratio = (p16.double() - ref).abs() / (half_bf16 + tol32)
            worst["tz16_over_tol"] = max(worst.get("tz16_over_tol", 0.0), float(ratio.max()))
            if float(ratio.max()) > 1.0:
                j = int(ratio.argmax())
                raise CheckFailed(f"fp32+bf16 out: tierzero's bf16 copy of tensor {i} element {j} is {float(p16[j])!r}, "
                                  f"reference {float(ref[j])!r}")
            if not torch.equal(ds_p16[i], pd.detach().to(torch.bfloat16)):
                raise CheckFailed(f"fp32+bf16 out: DeepSpeed's bf16 copy of tensor {i} differs from its fp32 master")
        worst["elements"] += a0.numel()
    return worst


def _adam_case(case: str, sizes: list, threads: int, args) -> dict:
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    import tierzero.optim as tzo

    gen = torch.Generator().manual_seed(1234)
    bf16 = case in ("bf16 params", "bf16 moments")
    pdtype = torch.bfloat16 if bf16 else torch.float32
    p0 = [torch.randn(n, generator=gen).to(pdtype) for n in sizes]
    grads = [torch.randn(n, generator=gen).mul_(1e-3).to(pdtype) for n in sizes]
    ds_params = [torch.nn.Parameter(p.clone()) for p in p0]
    tz_params = [torch.nn.Parameter(p.clone()) for p in p0]
    for a, b, g in zip(ds_params, tz_params, grads):
        a.grad, b.grad = g, g  # read-only in both: one gradient tensor shared
    hyper = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    ds = DeepSpeedCPUAdam(ds_params, adamw_mode=True, fp32_optimizer_states=(case != "bf16 moments"), **hyper)
    tz_kw: dict = {"threads": threads}
    if case == "fp32+bf16 out":
        tz_kw["param16_dtype"] = torch.bfloat16
    if bf16:
        tz_kw["master"] = "remainder"
        tz_kw["moments"] = "bf16" if case == "bf16 moments" else "fp32"
    tz = tzo.AdamW(tz_params, **hyper, **tz_kw)
    ds_p16 = [torch.empty(p.shape, dtype=torch.bfloat16) for p in ds_params] if case == "fp32+bf16 out" else []

    def ds_step():
        ds.step()
        for p16, p in zip(ds_p16, ds_params):  # DeepSpeed ZeRO's bit16 <- fp32 copy after the step
            p16.copy_(p.detach())

    for _ in range(args.check_steps):
        ds_step()
        tz.step()
    check = _check_case(case, args.check_steps, p0, grads, ds_params, tz_params, tz, ds_p16)
    del p0
    samples = alternate({"deepspeed": ds_step, "tierzero": tz.step}, args.warmup, args.repeats)
    n = sum(sizes)
    # Bytes each step must move at least (reads + writes), per parameter.
    moved = {"fp32": (28, 28), "fp32+bf16 out": (30, 30), "bf16 params": (22, 22 + 2 * 2.125),
             "bf16 moments": (14, 14 + 2 * 2.125)}[case]
    out = {"case": case, "threads": threads, "params": n, "tensors": len(sizes), "check": check,
           "tierzero_simd": tz.simd, "torch_threads": torch.get_num_threads()}
    for who, b in zip(("deepspeed", "tierzero"), moved):
        med = statistics.median(samples[who])
        out[who] = {"samples_s": samples[who], "median_s": med, "ns_per_param": med / n * 1e9,
                    "bytes_per_param": b, "gb_per_s": b * n / med / 1e9}
    out["ratio_ds_over_tz"] = out["deepspeed"]["median_s"] / out["tierzero"]["median_s"]
    return out


def adam_child(args) -> None:
    """One thread count, every case, in this process (OMP_NUM_THREADS was set by the parent)."""
    import torch
    threads = int(args.child.split(":")[1])
    torch.set_num_threads(threads)
    sizes = gpt2_shapes(args.params, args.hidden)
    results = []
    for case in args.cases:
        try:
            results.append(_adam_case(case, sizes, threads, args))
        except CheckFailed as e:
            print(f"deepspeed_compare: NUMERICAL DISAGREEMENT (a bug, not a figure): {e}", file=sys.stderr)
            raise SystemExit(1) from None
    print(json.dumps({"rows": results, "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}))


def run_adam(args) -> dict:
    require_deepspeed()
    from deepspeed.ops.op_builder import CPUAdamBuilder
    start = time.perf_counter()
    CPUAdamBuilder().load(verbose=False)  # built (or found) once, before the children time anything
    build_s = time.perf_counter() - start
    rows = []
    for threads in args.threads:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", f"adam:{threads}"]
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise SystemExit(proc.returncode)
        rows += json.loads(proc.stdout.strip().splitlines()[-1])["rows"]
    sizes = gpt2_shapes(args.params, args.hidden)
    print(f"\nCPU Adam(W): {sum(sizes) / 1e6:.1f}M parameters in {len(sizes)} tensors (GPT-2 shapes, width "
          f"{args.hidden}); median of {args.repeats}, alternating; DeepSpeed {_ds_version()}")
    table = [[r["case"], r["threads"], r["deepspeed"]["median_s"] * 1e3, r["tierzero"]["median_s"] * 1e3,
              r["ratio_ds_over_tz"], r["deepspeed"]["gb_per_s"], r["tierzero"]["gb_per_s"],
              max(r["check"]["ds_over_tol"], r["check"]["tz_over_tol"])] for r in rows]
    print(format_table(["case", "threads", "DS ms", "tz ms", "DS/tz", "DS GB/s", "tz GB/s", "err/tol"], table))
    for r in rows:
        c = r["check"]
        if c["should_change"]:
            print(f"  {r['case']} ({r['threads']} thr): of {c['should_change']} bf16 parameters whose nearest bf16 "
                  f"changed after {args.check_steps} steps, DeepSpeed (no master) left {c['ds_bf16_unchanged']} "
                  "unchanged; tierzero's are the nearest bf16 of its exact master")
    return {"build_or_load_s": build_s, "rows": rows}


def _ds_version() -> str:
    import deepspeed
    return deepspeed.__version__


# ---------------------------------------------------------------------------------------------------------------
# aio
# ---------------------------------------------------------------------------------------------------------------

def run_aio(args) -> dict:
    require_deepspeed()
    import torch
    from deepspeed.ops.op_builder import AsyncIOBuilder
    import tierzero.nvme as tzn

    builder = AsyncIOBuilder()
    if not builder.is_compatible(verbose=False):
        raise SystemExit("deepspeed_compare: DeepSpeed's async I/O op cannot be built here (libaio missing?): "
                         "apt-get install -y libaio-dev")
    start = time.perf_counter()
    aio = builder.load(verbose=False)
    build_s = time.perf_counter() - start
    size = args.aio_size
    workdir = tempfile.mkdtemp(prefix="ds-compare-aio-", dir=args.aio_dir)
    path = os.path.join(workdir, "data.bin")
    rows = []
    try:
        for bs in args.block_sizes:
            for qd in args.queue_depths:
                rows.append(_aio_config(aio, tzn, torch, path, size, bs, qd, args))
    finally:
        if os.path.exists(path):
            os.unlink(path)
        os.rmdir(workdir)
    print(f"\nO_DIRECT whole-file I/O, {size / 2**30:.2f} GiB file in {args.aio_dir}, {args.aio_threads} thread(s) "
          f"each; median GB/s of {args.repeats}, alternating; DeepSpeed aio (libaio) vs tierzero IoEngine "
          f"({rows[0]['tierzero_backend'] if rows else '?'})")
    table = []
    for r in rows:
        for op in ("read", "write"):
            d, t = r[op]["deepspeed"]["median_gb_s"], r[op]["tierzero"]["median_gb_s"]
            table.append([op, f"{r['block_size'] >> 10} KiB", r["queue_depth"], d, t, t / d])
    print(format_table(["op", "block", "QD", "DS GB/s", "tz GB/s", "tz/DS"], table))
    print("  reads are the figures to trust; a write completes once the host holds the data (maybe in its cache)")
    return {"build_or_load_s": build_s, "file_bytes": size, "dir": args.aio_dir, "rows": rows}


def _aio_config(aio, tzn, torch, path: str, size: int, bs: int, qd: int, args) -> dict:
    handle = aio.aio_handle(bs, qd, False, False, args.aio_threads)
    buf = handle.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
    try:
        if buf.data_ptr() % 4096 or buf.numel() != size:
            raise SystemExit(f"deepspeed_compare: DeepSpeed's locked buffer is not 4 KiB aligned ({buf.data_ptr():#x})")
        buf.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(bs + qd)))
        want = tzn.checksum(buf.numpy())
        eng = tzn.IoEngine(block_size=bs, queue_depth=qd, rings=args.aio_threads)
        f = eng.open(path, create=True, size_bytes=size)
        # tierzero's own pinned pools are registered with the ring (fixed-buffer I/O); DeepSpeed's page-locked buffer
        # is registered here the same way, where the kernel allows it (a buffer of at most 1 GiB).
        try:
            eng.register_buffer(buf)
            registered = True
        except (OSError, ValueError, RuntimeError, MemoryError):
            registered = False
        try:
            def ds_write():
                if handle.sync_pwrite(buf, path) < 0:
                    raise OSError(f"DeepSpeed aio write of {path} failed")

            def ds_read():
                if handle.sync_pread(buf, path) < 0:
                    raise OSError(f"DeepSpeed aio read of {path} failed")

            def tz_write():
                eng.write(f, 0, buf).wait()

            def tz_read():
                eng.read(f, 0, buf).wait()

            def spoil():  # a read that read nothing must not find the right bytes already there
                buf[::4096] ^= 0xFF

            def check(who):  # untimed, after each read
                _same(tzn.checksum(buf.numpy()), want, f"{who} read")
                spoil()

            out: dict = {"block_size": bs, "queue_depth": qd, "threads": args.aio_threads,
                         "tierzero_backend": eng.backend, "tierzero_fixed_buffer": registered}
            phases = (("write", {"deepspeed": ds_write, "tierzero": tz_write}, None),
                      ("read", {"deepspeed": ds_read, "tierzero": tz_read},
                       {"deepspeed": lambda: check("DeepSpeed"), "tierzero": lambda: check("tierzero")}))
            for op, fns, after in phases:
                if op == "read":
                    spoil()
                samples = alternate(fns, args.warmup, args.repeats, after=after)
                out[op] = {who: {"samples_s": s, "median_gb_s": size / statistics.median(s) / 1e9}
                           for who, s in samples.items()}
            return out
        finally:
            if registered:
                eng.unregister_buffer(buf)
            eng.close(f)
    finally:
        handle.free_cpu_locked_tensor(buf)


def _same(got: int, want: int, what: str) -> None:
    if got != want:
        raise SystemExit(f"deepspeed_compare: {what} returned different bytes than were written (checksum "
                         f"{got:#x} != {want:#x}): a bug, not a figure")


# ---------------------------------------------------------------------------------------------------------------

def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.child:
        if args.child.startswith("adam:"):
            adam_child(args)
        else:
            import deepspeed_compare_gpu as gpu
            gpu.child(args)
        return 0
    result: dict = {"machine": machine_info(), "args": {k: v for k, v in vars(args).items() if k != "child"},
                    "command": " ".join([os.path.basename(sys.executable), *sys.argv])}
    if "gpu" in args.mode:
        import deepspeed_compare_gpu as gpu
        reason = gpu.unavailable_reason()
        if reason:
            print(f"deepspeed_compare: --mode gpu needs a CUDA GPU: {reason}", file=sys.stderr)
            return 2
    if "adam" in args.mode or "aio" in args.mode or "gpu" in args.mode:
        require_deepspeed()
        result["deepspeed"] = _ds_version()
    if "adam" in args.mode:
        result["adam"] = run_adam(args)
    if "aio" in args.mode:
        result["aio"] = run_aio(args)
    if "gpu" in args.mode:
        result["gpu"] = gpu.run(args)
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    if args.json:
        write_json(args.json, result)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
