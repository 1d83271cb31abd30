"""bench/python/deepspeed_compare.py's own parts, without DeepSpeed: arguments, the table and JSON writers, the
model shapes, the alternation, the GPU mode's config (tierzero must read DeepSpeed's config as it is) and its
refusal without a GPU."""

import importlib
import json
import math
import pathlib
import sys

import pytest
import torch

import tierzero

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "python"


@pytest.fixture(scope="module")
def dc():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("deepspeed_compare")
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def gpu(dc):
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("deepspeed_compare_gpu")
    finally:
        sys.path.remove(str(BENCH))


def test_arguments_parse_sizes_counts_and_lists(dc):
    args = dc.parse_args(["--mode", "adam,aio", "--params", "120M", "--threads", "1,2", "--block-sizes", "128K,1MiB",
                          "--queue-depths", "8,32", "--aio-size", "1GiB", "--cases", "fp32,bf16 moments"])
    assert args.mode == ["adam", "aio"]
    assert args.params == 120_000_000
    assert args.threads == [1, 2]
    assert args.block_sizes == [128 << 10, 1 << 20]
    assert args.queue_depths == [8, 32]
    assert args.aio_size == 1 << 30
    assert args.cases == ["fp32", "bf16 moments"]
    defaults = dc.parse_args([])
    assert defaults.mode == ["adam", "aio"] and defaults.params == 100_000_000 and defaults.threads == [1, 2]
    assert dc.parse_count("1.5B") == 1_500_000_000 and dc.parse_bytes("4096") == 4096


@pytest.mark.parametrize("argv, message", [
    (["--mode", "adam,train"], "subset of adam, aio, gpu"),
    (["--cases", "fp32,fp8"], "unknown fp8"),
    (["--offloads", "disk"], "unknown disk"),
    (["--threads", "1,0"], ">= 1"),
    (["--block-sizes", "1X"], "a size such as"),
    (["--params", "lots"], "a count such as"),
    (["--warmup", "-1"], ">= 0"),
])
def test_bad_arguments_are_refused_by_name(dc, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        dc.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_table_aligns_columns_and_rounds_to_three_places(dc):
    text = dc.format_table(["case", "ms", "ratio"], [["fp32", 123.456, 1.0], ["bf16 moments", 0.012345, None]])
    lines = text.splitlines()
    assert lines[0].split() == ["case", "ms", "ratio"]
    assert set(lines[1]) <= {"-", " "}
    assert lines[2].split() == ["fp32", "123", "1.00"]
    assert lines[3].split() == ["bf16", "moments", "0.0123", "-"]
    assert len({len(ln) for ln in lines}) == 1, "every line as wide as the header"
    with pytest.raises(ValueError, match="has 2 cells; the table has 3 columns"):
        dc.format_table(["a", "b", "c"], [[1, 2]])


def test_json_is_written_whole_or_not_at_all(dc, tmp_path):
    path = tmp_path / "out.json"
    dc.write_json(str(path), {"rows": [{"gb_per_s": 1.25}], "machine": dc.machine_info()})
    back = json.loads(path.read_text())
    assert back["rows"][0]["gb_per_s"] == 1.25 and back["machine"]["cpus"] >= 1
    with pytest.raises(ValueError):
        dc.write_json(str(tmp_path / "nan.json"), {"x": math.nan})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"], "no partial file left"


def test_model_shapes_are_gpt2s(dc, gpu):
    # Hugging Face's GPT-2 small has 124,439,808 parameters (the tied head counted once).
    assert gpu.approx_params("gpt2") == 124_439_808
    sizes = dc.gpt2_shapes(124_439_808, 768)
    assert sum(sizes) == 124_439_808 and len(sizes) == 2 + 12 * 12 + 2
    big = dc.gpt2_shapes(100_000_000, 1024)
    assert sum(big) >= 100_000_000 and sum(big) - 12 * 1024 * 1024 - 13 * 1024 < 100_000_000
    assert gpu.model_shape("gpt2-xl") == (48, 1600, 25) and gpu.model_shape("8x512") == (8, 512, 8)
    with pytest.raises(ValueError, match="multiple of 64"):
        gpu.model_shape("4x100")


def test_alternate_rotates_the_order_and_keeps_only_timed_samples(dc):
    calls = []
    ticks = iter(range(1000))
    samples = dc.alternate({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, warmup=1, repeats=3,
                           timer=lambda: float(next(ticks)))
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert len(samples["a"]) == 3 and len(samples["b"]) == 3 and all(s == 1.0 for s in samples["a"])
    checked = []
    ticks = iter(range(1000))
    samples = dc.alternate({"a": lambda: None}, warmup=0, repeats=2, timer=lambda: float(next(ticks)),
                           after={"a": lambda: checked.append(next(ticks))})
    assert samples["a"] == [1.0, 1.0], "the check after a call is not timed"
    assert checked == [2, 5]


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_the_gpu_modes_deepspeed_config_loads_in_tierzero(gpu, offload, tmp_path):
    cfg = gpu.config(offload, str(tmp_path), batch=4)
    report = tierzero.check_config(cfg)
    assert report["zero_stage"] == 3
    assert report["optimizer"] == "AdamW"
    assert not report["unresolved_auto"]


def test_gpu_mode_refuses_without_a_gpu(dc, gpu, monkeypatch, capsys):
    reason = gpu.unavailable_reason()
    if not torch.cuda.is_available():
        assert "no CUDA device" in reason
    else:
        assert reason is None or "transformers" in reason
    monkeypatch.setattr(gpu, "unavailable_reason", lambda: "torch sees no CUDA device")
    assert dc.main(["--mode", "gpu"]) == 2
    assert "--mode gpu needs a CUDA GPU: torch sees no CUDA device" in capsys.readouterr().err


def test_missing_deepspeed_is_named_with_how_to_install(dc, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.raises(SystemExit, match="DeepSpeed is not installed.*pip install --no-deps deepspeed"):
        dc.require_deepspeed()
