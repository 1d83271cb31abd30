"""NVMe bytes per parameter per step (mean over the steady-state steps) and the validation
losses of tierzero-train summaries, before and after: python3 compare.py rem_int8 fp32
(reads <format>_before_summary.json and <format>_after_summary.json beside this file)."""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def steady(js):
    return [r for i, r in enumerate(js["step_records"]) if i > 0 and not r["after_eval"]]


for fmt in sys.argv[1:]:
    runs = {w: json.load(open(os.path.join(HERE, f"{fmt}_{w}_summary.json"))) for w in ("before", "after")}
    for when, js in runs.items():
        st, p = steady(js), js["params"]
        mean = lambda key: sum(r.get(key, 0) for r in st) / len(st) / p
        read, write = mean("nvme_read_bytes"), mean("nvme_write_bytes")
        print(f"{fmt} {when}: {len(st)} steady steps, NVMe read {read:.4f} + write {write:.4f} = {read + write:.4f} "
              f"B/param/step, kept {mean('kept_param_bytes'):.4f}; validation "
              f"{[(e['step'], repr(e['val_loss'])) for e in js['evals']]}")
    same = lambda key, sub: [e[key] for e in runs["before"][sub]] == [e[key] for e in runs["after"][sub]]
    print(f"  the same validation losses: {same('val_loss', 'evals')}, training losses: {same('loss', 'step_records')}")
