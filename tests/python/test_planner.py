"""bindings/planner.cpp: tierzero.estimate(), the placement planner."""

import json

import pytest

import tierzero
from tierzero import _core


def test_estimate_returns_the_plan_and_the_report():
    plan, report = tierzero.estimate("1.3B", gpu="80GB", cpu="120GB", nvme="2TB")
    assert plan["fits"] is True
    assert plan["layout"]["model_numel"] == 1_300_000_000
    assert plan["layout"]["blocks"] == 32
    assert set(plan["states"]) == {"param16", "grad", "master", "moments"}
    assert plan["budgets"]["gpu"] == (80_000_000_000, "config")
    for tier in ("gpu", "cpu", "nvme"):
        t = plan["tiers"][tier]
        assert t["headroom_bytes"] == t["budget_bytes"] - t["need_bytes"]
    assert "1.3B" in report and "estimated data movement" in report


def test_deepspeed_placement_follows_the_offload_devices():
    plan, _ = tierzero.estimate(20e9, gpu="80GB", cpu="1TB", nvme="4TB", offload_param="nvme",
                                offload_optimizer="nvme")
    assert plan["placement"] == "deepspeed"
    assert plan["states"]["param16"]["tier"] == "nvme"
    assert plan["states"]["master"]["tier"] == "nvme"
    assert plan["traffic"]["nvme_read_bytes"] > 0


def test_blocks_from_largest_block():
    plan, _ = tierzero.estimate(1000_000, largest_block=300_000, gpu="1GB", cpu="1GB", nvme="1GB")
    assert plan["layout"]["blocks"] == 4 and plan["layout"]["largest_block_numel"] == 300_000


def test_no_fit_is_a_memory_error_naming_the_tier_and_keys():
    with pytest.raises(MemoryError) as info:
        tierzero.estimate("20B", gpu="1GB", cpu="1GB", nvme="1GB")
    msg = str(info.value)
    assert "20.0B parameters" in msg and "tierzero.tiers.gpu_bytes is 953.67 MiB" in msg, msg


def test_config_as_dict_and_file_give_the_same_plan(tmp_path):
    config = {"zero_optimization": {"stage": 2},
              "tierzero": {"tiers": {"gpu_bytes": "80GB", "cpu_bytes": "200GB", "nvme_bytes": "1TB"}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    a, _ = tierzero.estimate(7e9, config=config)
    b, _ = tierzero.estimate(7e9, config=path)
    assert a == b and a["stage"] == 2
    c, _ = tierzero.estimate(7e9, config=config, stage=3)
    assert c["stage"] == 3


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="params"):
        tierzero.estimate(0)
    with pytest.raises(ValueError, match="gpu"):
        tierzero.estimate(1e9, gpu="lots")
    with pytest.raises(ValueError, match="offload device 'disk'"):
        tierzero.estimate(1e9, gpu="1GB", cpu="1GB", nvme="1GB", offload_param="disk")
    with pytest.raises(ValueError, match="links_gbps"):
        tierzero.estimate(1e9, links_gbps={"warp": 1.0})


def test_link_speeds_change_the_time_estimate():
    fast, _ = tierzero.estimate(7e9, gpu="8GB", cpu="200GB", nvme="1TB", links_gbps={"nvme_read": 20, "nvme_write": 20})
    slow, _ = tierzero.estimate(7e9, gpu="8GB", cpu="200GB", nvme="1TB", links_gbps={"nvme_read": 1, "nvme_write": 1})
    if slow["traffic"]["nvme_read_bytes"]:
        assert slow["traffic"]["estimated_seconds"] > fast["traffic"]["estimated_seconds"]


def test_units():
    assert _core.parse_count("1.3B") == 1.3e9
    assert _core.parse_bytes("64GiB") == 64 << 30
    with pytest.raises(ValueError, match="abc"):
        _core.parse_count("abc")


def test_the_batch_keys_resolve_for_the_ranks_as_deepspeeds_do():
    # Note [Batch keys]: 64 = 8 per micro-batch x 4 accumulation steps x 2 ranks, so the traffic per step is
    # that of 4 accumulation steps; on 3 ranks 64 does not divide, and the error says so.
    budgets = dict(gpu="8GB", cpu="64GB", nvme="1TB")
    derived, _ = tierzero.estimate("1B", ranks=2, config={"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8},
                                   **budgets)
    explicit, _ = tierzero.estimate("1B", ranks=2, config={"gradient_accumulation_steps": 4}, **budgets)
    one_step, _ = tierzero.estimate("1B", ranks=2, config={}, **budgets)
    assert derived["traffic"] == explicit["traffic"] != one_step["traffic"]
    with pytest.raises(ValueError, match=r"train_batch_size = 64 is not a multiple of train_micro_batch_size_per_gpu x "
                                         r"ranks = 24"):
        tierzero.estimate("1B", ranks=3, config={"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8},
                          **budgets)


def test_the_training_precision_sets_the_bytes_of_a_parameter():
    # Without a config an estimate is for 16-bit params; a config with neither bf16 nor fp16 trains fp32 params,
    # which the engine stores at 4 B (and moves at 4 B); precision= overrides either.
    budgets = dict(gpu="80GB", cpu="120GB", nvme="2TB")
    fp32_config = {"zero_optimization": {"stage": 3}}
    default, report16 = tierzero.estimate("1B", **budgets)
    from_config, report32 = tierzero.estimate("1B", config=fp32_config, **budgets)
    flagged, _ = tierzero.estimate("1B", precision="fp32", **budgets)
    back, _ = tierzero.estimate("1B", config=fp32_config, precision="bf16", **budgets)
    bf16_config, _ = tierzero.estimate("1B", config={"bf16": {"enabled": True}}, **budgets)
    assert [p["param_bytes"] for p in (default, from_config, flagged, back, bf16_config)] == [2, 4, 4, 2, 2]
    assert from_config["states"]["param16"]["bytes_per_elem"] == 4
    assert from_config["states"]["param16"]["bytes_per_rank"] == 2 * default["states"]["param16"]["bytes_per_rank"]
    assert "precision  16-bit params" in report16 and "precision  fp32 params (4 B" in report32
    with pytest.raises(ValueError, match="precision 'fp8'"):
        tierzero.estimate("1B", precision="fp8", **budgets)
    # The optimizer offloaded: 16-bit params of 1B fit 4 GB of GPU, fp32 ones do not, and the error says bf16.
    tierzero.estimate("1B", gpu="4GB", cpu="120GB", nvme="2TB", offload_optimizer="cpu")
    with pytest.raises(MemoryError, match="enable the config's \"bf16\" block"):
        tierzero.estimate("1B", gpu="4GB", cpu="120GB", nvme="2TB", offload_optimizer="cpu", precision="fp32")


def test_the_state_formats_set_the_bytes_of_master_and_moments():
    # tierzero.states in the config, or master=/moments= (which override it): each format's bytes per
    # element, and the NVMe and PCIe bytes per parameter per step.
    budgets = dict(gpu="80GB", cpu="120GB", nvme="2TB")
    compact_config = {"bf16": {"enabled": True}, "tierzero": {"states": {"master": "remainder", "moments": "int8"}}}
    default, _ = tierzero.estimate("8B", **budgets)
    from_config, report = tierzero.estimate("8B", config=compact_config, **budgets)
    flagged, _ = tierzero.estimate("8B", master="remainder", moments="bf16", **budgets)
    override, _ = tierzero.estimate("8B", config=compact_config, moments="fp32", **budgets)
    formats = [(p["states"]["master"]["format"], p["states"]["master"]["bytes_per_elem"],
                p["states"]["moments"]["format"], p["states"]["moments"]["bytes_per_elem"])
               for p in (default, from_config, flagged, override)]
    assert formats == [("fp32", 4, "fp32", 8), ("remainder", 2.125, "int8", 2.03125), ("remainder", 2.125, "bf16", 4),
                       ("remainder", 2.125, "fp32", 8)]
    assert "master remainder (2.125 B), moments int8 (2.03125 B)" in report
    # 8B of fp32 states (144 GB) spill to NVMe; the compact ones (81 GB) fit in CPU memory.
    assert from_config["traffic"]["nvme_bytes_per_param"] == 0 < default["traffic"]["nvme_bytes_per_param"]
    assert default["traffic"]["pcie_bytes_per_param"] > 0
    with pytest.raises(ValueError, match="needs bf16 parameters, but fp16.enabled is true"):
        tierzero.estimate("8B", master="remainder", precision="fp16", **budgets)
    with pytest.raises(ValueError, match="no 16-bit parameter"):
        tierzero.estimate("8B", config=compact_config, precision="fp32", **budgets)
    with pytest.raises(ValueError, match="tierzero.states.moments 'int4'"):
        tierzero.estimate("8B", moments="int4", **budgets)
