#!/usr/bin/env python3
"""Replays a run's per-step gradient norms through rules for when to step under backward (issue #22).

The weights are the same bits whatever the engine speculates (Note [Stepping under backward]), so a
run's sequence of global norms does not depend on the rule: one run's norms (the "steps" of a
bench/python/compact_states_gpt2.py --json row, or any JSON list of {"grad_norm": ...}) tell how
many windows each rule would have speculated, kept and redone for clipping. Rules:

  last-unclipped    speculate unless the last step clipped (the engine's rule before "auto")
  M x / W           the "auto" policy's calm rule (Note [When to speculate]): the last W steps each
                    had a norm <= M x max norm, with its back-off after a redone window

    python3 bench/python/ahead_policy_sim.py steps.json --max-norm 1.0
"""

from __future__ import annotations

import argparse
import json


def replay(norms: list[float], max_norm: float, margin: float | None, calm_needed: int) -> tuple[int, int, int]:
    calm = failures = skip = 0
    last_clipped = False
    speculated = kept = redone = 0
    for norm in norms:
        clips = norm > max_norm
        go = (not last_clipped) if margin is None else (skip == 0 and calm >= calm_needed)
        if go:
            speculated += 1
            redone += clips
            kept += not clips
        calm = calm + 1 if margin is not None and norm <= margin * max_norm else 0
        if margin is not None:
            if skip > 0 and not go:
                skip -= 1
            if go and clips:
                failures = min(failures + 1, 6)
                skip = (1 << failures) - 1
            elif go:
                failures = 0
        last_clipped = clips
    return speculated, kept, redone


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("steps", help="JSON: a list of step reports, or a compact_states_gpt2 --json file (its first "
                                  "tierzero row's steps)")
    ap.add_argument("--max-norm", type=float, default=1.0)
    args = ap.parse_args()
    with open(args.steps) as f:
        data = json.load(f)
    if isinstance(data, dict):
        data = next(r["steps"] for r in data["rows"].values() if "steps" in r)
    norms = [s["grad_norm"] for s in data]
    print(f"{len(norms)} steps, {sum(n > args.max_norm for n in norms)} clip (max norm {args.max_norm})")
    print(f"{'rule':<16}{'speculated':>11}{'kept':>6}{'redone':>8}")
    print(f"{'last-unclipped':<16}" + "".join(f"{v:>{w}}" for v, w in zip(replay(norms, args.max_norm, None, 0),
                                                                          (11, 6, 8))))
    for margin in (1.0, 0.95, 0.9, 0.85):
        for calm in (1, 2, 3):
            s, k, r = replay(norms, args.max_norm, margin, calm)
            print(f"{f'{margin:g} x / {calm}':<16}{s:>11}{k:>6}{r:>8}")


if __name__ == "__main__":
    main()
