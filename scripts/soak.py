#!/usr/bin/env python3
"""The kill-and-restart soak of tierzero-train (issue #23).

Runs the README's main job (examples/train_cpu_nvme.json, the `cpu` preset,
states on NVMe), kills it at --kills random moments with SIGKILL, SIGTERM and
SIGINT (some right after a save has started: its `.partial` folder is there),
and restarts it each time with `--resume DIR --resume-if-present` inside a
fresh PID namespace (`unshare --pid --fork --mount-proc`; without it where the
machine refuses, saying why), until a run finishes. Then it checks:

  - the final checkpoint's files equal an unbroken run's byte for byte;
  - while each restarted run trained, its NVMe folder held only that run's
    swap files (a killed run's were reclaimed), and after every exit and at
    the end, none;
  - the checkpoint folder holds no `.partial` or `latest.tmp`.

It prints a table (one row per run) and writes a JSON summary. Exit status 0
when every check passed.

  scripts/soak.py                                  # 20 kills, 60 steps, a save every 4
  scripts/soak.py --kills 5 --steps 20 --json soak.json
  scripts/soak.py --train build/train/tierzero-train --work /var/tmp/tz-soak -- --eval-every 0

Arguments after `--` go to every tierzero-train run (the unbroken one too).
"""
import argparse
import filecmp
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRESS = r"^step +\d+/"  # tierzero-train's progress line (--log-every 1)
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train", default=os.path.join(ROOT, "build/train/tierzero-train"))
    p.add_argument("--config", default=os.path.join(ROOT, "examples/train_cpu_nvme.json"))
    p.add_argument("--work", default="/var/tmp/tierzero-soak", help="scratch folder (emptied first)")
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--steps", type=int, default=60, help="the job's steps (the README's main job: 300)")
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--seed", type=int, default=23)
    p.add_argument("--in-save", type=float, default=0.35, help="share of kills right after a save starts")
    p.add_argument("--max-delay", type=float, default=20.0, help="latest timed kill, seconds after start-up")
    p.add_argument("--json", default=None, help="summary JSON (default: WORK/soak.json)")
    p.add_argument("extra", nargs="*", help="after --: more tierzero-train arguments")
    return p.parse_args()


def pid_namespace_prefix():
    """`unshare ...` when this machine lets us make a PID namespace, else [] and why not."""
    cmd = ["unshare", "--pid", "--fork", "--mount-proc", "true"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"unshare could not run: {e}"
    if r.returncode != 0:
        return [], f"unshare --pid refused: {r.stderr.strip() or r.returncode}"
    return ["unshare", "--pid", "--fork", "--mount-proc"], ""


def trainer_pid(outer):
    """The tierzero-train process under `outer` (unshare's child), or outer itself."""
    for _ in range(200):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[1]) == outer and "tierzero-train" in stat[: stat.rindex(")")]:
                return int(entry)
        if outer_is_trainer(outer):
            return outer
        time.sleep(0.01)
    return None


def outer_is_trainer(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip().startswith("tierzero-train")
    except OSError:
        return False


def ended_by(rc):
    """'SIGTERM' for a run a signal ended (killed by it, or PID 1's exit 128+N), else 'exit N'."""
    if rc < 0:
        return signal.Signals(-rc).name
    if rc > 128 and rc - 128 in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
        return signal.Signals(rc - 128).name
    return f"exit {rc}"


def listing(folder):
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def base_command(args, nvme, out):
    return [args.train, "--config", args.config, "--backend", "host", "--until-step", str(args.steps),
            "--nvme-path", nvme, "--out", out, "--log-every", "1"] + args.extra


class Run:
    """One tierzero-train process (under unshare when given), its output in a log file."""

    def __init__(self, cmd, prefix, log_path):
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(prefix + cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.pid = trainer_pid(self.proc.pid) if prefix else self.proc.pid

    def output(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_for(self, pattern, limit_s):
        """True once the output matches `pattern` (a regex); False when the run ends or the time is up first."""
        end = time.monotonic() + limit_s
        while time.monotonic() < end and self.proc.poll() is None:
            if re.search(pattern, self.output(), re.M):
                return True
            time.sleep(0.02)
        return bool(re.search(pattern, self.output(), re.M))

    def finish(self, limit_s):
        try:
            rc = self.proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
            self.log.close()
            return None
        self.log.close()
        return rc


def wait_for_partial(save_dir, run, limit_s):
    """True once a save's .partial folder shows in save_dir."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end and run.proc.poll() is None:
        if any(n.endswith(".partial") for n in listing(save_dir)):
            return True
        time.sleep(0.002)
    return False


def swap_files(nvme):
    return [n for n in listing(nvme) if n.startswith("tierzero-swap-")]


def unbroken_run(args, prefix, work):
    nvme, save = os.path.join(work, "nvme-ref"), os.path.join(work, "ckpt-ref")
    cmd = base_command(args, nvme, os.path.join(work, "out-ref")) + ["--save", save]
    start = time.monotonic()
    run = Run(cmd, prefix, os.path.join(work, "ref.log"))
    run.wait_for(PROGRESS, 600)
    live = swap_files(nvme)  # what one live run holds in its folder
    rc = run.finish(3600)
    if rc != 0:
        sys.exit(f"soak: the unbroken run failed ({rc}); see {run.log_path}")
    return save, len(live), time.monotonic() - start


def pick_moment(rng, args, kill_no):
    """(signal, whether right after a save starts, a share of the time left, ms after the save starts)."""
    sig = ["SIGKILL", "SIGTERM", "SIGINT"][kill_no % 3] if kill_no < 3 else rng.choice(list(SIGNALS))
    return sig, rng.random() < args.in_save, rng.uniform(0.05, 0.95), rng.uniform(0.0, 0.2)


def one_restart(args, prefix, work, n, plan, live_swaps, step_s, kills_left, failures):
    """Runs the job once; kills it as `plan` says (None: let it finish). A row for the table."""
    nvme, save = os.path.join(work, "nvme"), os.path.join(work, "ckpt")
    cmd = base_command(args, nvme, os.path.join(work, "out")) + [
        "--save", save, "--save-every", str(args.save_every), "--resume", save, "--resume-if-present",
        "--save-on-stop"]
    run = Run(cmd, prefix, os.path.join(work, f"run-{n:02d}.log"))
    row = {"run": n, "pid_in_namespace": 1 if prefix else run.pid, "signal": None, "moment": "finish"}
    started = run.wait_for(PROGRESS, 600)
    out = run.output()
    row["resumed_at"] = int(out.split("resumed from ")[1].split(" at step ")[1].split()[0]) \
        if "resumed from " in out else 0
    if started:
        swaps = swap_files(nvme)
        if len(swaps) != live_swaps:
            failures.append(f"run {n}: its NVMe folder held {swaps} while it trained (one run holds {live_swaps})")
    if plan is not None and started:
        sig, in_save, share, after_partial = plan
        # The kills left share the training left, so the job outlives them all
        # (the later ones land in start-up and loading as the end nears); a
        # kill waits for a save only where the next one is due within twice
        # its share.
        slot_s = step_s * max(1, args.steps - row["resumed_at"]) / (kills_left + 1)
        delay = min(args.max_delay, 2 * share * slot_s)
        next_save = (row["resumed_at"] // args.save_every + 1) * args.save_every
        due_s = (next_save - row["resumed_at"]) * step_s
        if in_save and due_s <= 2 * slot_s and wait_for_partial(save, run, due_s + 2 * slot_s + 60):
            time.sleep(after_partial)
            row["moment"] = f"in a save (+{after_partial * 1000:.0f} ms)"
        else:
            time.sleep(delay)
            row["moment"] = f"{delay:.1f} s into training"
        if run.proc.poll() is None and run.pid:
            os.kill(run.pid, SIGNALS[sig])
            row["signal"] = sig
    rc = run.finish(900)
    row["rc"] = rc
    row["ended"] = "hung" if rc is None else ended_by(rc)
    if row["signal"] == "SIGKILL" and rc not in (None, 0):
        # SIGKILL cannot be caught; unshare (util-linux 2.38) then fails to
        # re-raise it ("sigprocmask unblock failed") and exits 1.
        row["ended"] = "SIGKILL"
    out = run.output()
    steps = re.findall(r"^step +(\d+)/", out, re.M)
    row["last_step"] = steps[-1] if steps else "-"
    marker = "before stopping (--save-on-stop)"
    row["saved_on_stop"] = marker in out and "saved the checkpoint" in out.split(marker)[-1]
    left = listing(nvme)
    if left and row["signal"] != "SIGKILL":  # a killed run's swap file stays for the next to reclaim
        failures.append(f"run {n}: its NVMe folder holds {left} after it ended ({row['ended']})")
    if rc is None or (row["signal"] is None and rc != 0):
        failures.append(f"run {n} ended by {row['ended']} unasked; see {run.log_path}")
    if row["signal"] in ("SIGTERM", "SIGINT") and row["ended"] != row["signal"] and rc != 0:
        failures.append(f"run {n}: {row['signal']} ended it with {row['ended']}; see {run.log_path}")
    return row, rc == 0 and row["signal"] is None


def compare_checkpoints(ref_save, save, steps):
    """Byte-for-byte comparison of the final checkpoints' files; the differences."""
    a, b = os.path.join(ref_save, f"step-{steps}"), os.path.join(save, f"step-{steps}")
    if not os.path.isdir(b):
        return [f"{b} is missing"], []
    names = sorted(listing(a))
    diffs = [n for n in names if not filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False)]
    if names != sorted(listing(b)):
        diffs.append(f"file lists differ: {names} vs {sorted(listing(b))}")
    return diffs, names


def print_header():
    print(f"{'run':>3}  {'resumed at':>10}  {'signal':>7}  {'moment':<26}  {'last step':>9}  {'saved on stop':>13}  ended",
          flush=True)


def print_row(r):
    print(f"{r['run']:>3}  {r['resumed_at']:>10}  {r['signal'] or '-':>7}  {r['moment']:<26}  {r['last_step']:>9}  "
          f"{'yes' if r['saved_on_stop'] else '-':>13}  {r['ended']}", flush=True)


def main():
    args = parse_args()
    rng = random.Random(args.seed)
    work = os.path.abspath(args.work)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    prefix, why_not = pid_namespace_prefix()
    print(f"soak: {'each run in a fresh PID namespace (' + ' '.join(prefix) + ')' if prefix else 'no PID namespace: ' + why_not}")
    t0 = time.monotonic()
    ref_save, live_swaps, ref_seconds = unbroken_run(args, prefix, work)
    print(f"soak: unbroken run of {args.steps} steps: {ref_seconds:.0f} s; a live run holds {live_swaps} swap file(s)")
    rows, failures, kills, n = [], [], 0, 0
    soak_start = time.monotonic()
    print_header()
    while True:
        n += 1
        plan = pick_moment(rng, args, kills) if kills < args.kills else None
        row, finished = one_restart(args, prefix, work, n, plan, live_swaps, ref_seconds / args.steps,
                                    args.kills - kills, failures)
        rows.append(row)
        kills += row["signal"] is not None
        print_row(row)
        if finished:
            break
        if n > 4 * args.kills + 10:
            failures.append("the job did not finish")
            break
    if kills < args.kills:
        failures.append(f"the job finished after {kills} kills, before the {args.kills} asked")
    diffs, files = compare_checkpoints(ref_save, os.path.join(work, "ckpt"), args.steps)
    failures += [f"final checkpoint differs from the unbroken run's: {d}" for d in diffs]
    save_left = [x for x in listing(os.path.join(work, "ckpt")) if x.endswith(".partial") or x == "latest.tmp"]
    failures += [f"checkpoint folder holds {x}" for x in save_left]
    if listing(os.path.join(work, "nvme")):
        failures.append(f"NVMe folder not empty at the end: {listing(os.path.join(work, 'nvme'))}")
    by_signal = {s: sum(1 for r in rows if r["signal"] == s) for s in SIGNALS}
    summary = {
        "command": " ".join([sys.argv[0]] + sys.argv[1:]),
        "train_command": " ".join(base_command(args, "NVME", "OUT")),
        "pid_namespace": bool(prefix), "pid_namespace_refused": why_not,
        "steps": args.steps, "save_every": args.save_every, "seed": args.seed,
        "kills": kills, "kills_by_signal": by_signal,
        "kills_in_saves": sum(1 for r in rows if r["moment"].startswith("in a save")),
        "restarts": len(rows) - 1, "runs": rows,
        "unbroken_run_seconds": round(ref_seconds, 1),
        "soak_seconds": round(time.monotonic() - soak_start, 1),
        "wall_seconds": round(time.monotonic() - t0, 1),
        "compared_files": files, "bit_for_bit": not diffs,
        "failures": failures, "passed": not failures,
    }
    json_path = args.json or os.path.join(work, "soak.json")
    with open(json_path, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"soak: {kills} kills ({', '.join(f'{v} {k}' for k, v in by_signal.items())}; "
          f"{summary['kills_in_saves']} in saves), {summary['restarts']} restarts, {summary['wall_seconds']:.0f} s; "
          f"final checkpoint {'equals' if not diffs else 'DIFFERS from'} the unbroken run's "
          f"({len(files)} files compared byte for byte); wrote {json_path}")
    for f in failures:
        print(f"soak: FAILED: {f}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
