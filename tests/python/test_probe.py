"""bindings/probe.cpp: tierzero.info() and the path probe."""

import os

import tierzero
from tierzero import _core


def test_info_has_every_section_with_sane_values():
    info = tierzero.info()
    for key in ("version", "build", "kernel_release", "io_uring", "cpu", "numa_nodes", "memory", "cuda"):
        assert key in info, key
    assert info["cpu"]["logical_cpus"] >= 1
    assert info["cpu"]["best_simd"] in ("scalar", "sse4_2", "sse4.2", "avx2", "avx512f", "avx512bw") or info["cpu"]["best_simd"]
    assert 0 < info["memory"]["available_bytes"] <= info["memory"]["total_bytes"]
    assert isinstance(info["io_uring"]["available"], bool)
    if not info["io_uring"]["available"]:
        assert info["io_uring"]["unavailable_reason"]
    assert info["cuda"]["device_count"] == len(info["cuda"]["devices"])
    assert os.uname().release == info["kernel_release"]


def test_info_refresh_probes_again():
    a, b = tierzero.info(), tierzero.info(refresh=True)
    assert a["cpu"] == b["cpu"]


def test_info_with_paths_probes_each(nvme_dir):
    info = tierzero.info(paths=[nvme_dir])
    (p,) = info["paths"]
    assert p["path"] == nvme_dir
    assert p["o_direct"] is True and p["dio_mem_align"] >= 1
    assert 0 < p["free_bytes"] <= p["total_bytes"]


def test_describe_is_the_text_report():
    text = tierzero.describe()
    assert text == _core.describe_capabilities()
    assert "io_uring" in text
