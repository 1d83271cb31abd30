"""bindings/engine_bindings.cpp and tierzero.Engine: the ZeRO engine, zero-copy gathered blocks, their lifetime."""

import gc
import json
import threading
import weakref

import numpy as np
import pytest
import torch

import tierzero
from conftest import host_config, swap_files, swap_files_while_a_script_runs

BLOCKS = [("layer0", [("w", (8, 16)), ("b", (8,))]), ("layer1", [("w", (4, 8))])]


def make(nvme_dir, **kw):
    rng = np.random.default_rng(0)
    init = [[rng.standard_normal((8, 16)).astype(np.float32), None], [torch.randn(4, 8)]]
    return tierzero.Engine(host_config(nvme_dir, **kw), BLOCKS, init=init), init


def test_fetch_gives_the_initial_values_and_the_layout(nvme_dir):
    eng, init = make(nvme_dir)
    assert eng.blocks == 2 and eng.param_dtype == "float32" and eng.device == "cpu"
    assert eng.rank == 0 and eng.world_size == 1 and eng.loss_scale == 1.0
    lay = eng.layout
    assert [p["name"] for p in lay[0]["params"]] == ["w", "b"] and lay[0]["params"][1]["shape"] == (8,)
    g = eng.fetch(0)
    assert g.index == 0 and g.name == "layer0"
    np.testing.assert_array_equal(np.from_dlpack(g.param(0)), init[0][0])
    np.testing.assert_array_equal(np.from_dlpack(g.param(1)), np.zeros(8, np.float32))
    assert np.from_dlpack(g.data).shape == (lay[0]["whole_numel"],)
    # Two small blocks: each rank's shard is padded to whole 2048-element runs, and the text says so.
    assert "ZeRO stage 3" in eng.describe() and "with padding: a block's shard is whole runs of 2048" in eng.describe()


def test_zero_copy_the_same_memory_from_both_sides(nvme_dir):
    eng, _ = make(nvme_dir)
    g = eng.fetch(1)
    t = torch.from_dlpack(g.param(0))       # torch's view
    a = np.from_dlpack(g.param(0))          # numpy's view
    whole = torch.from_dlpack(g.data)
    assert t.data_ptr() == a.ctypes.data == whole.data_ptr() + 4 * eng.layout[1]["params"][0]["offset"]
    t[2, 3] = 123.0                         # write through torch ...
    assert a[2, 3] == 123.0                 # ... read through numpy
    a[0, 0] = -5.0                          # and back
    assert t[0, 0].item() == -5.0 and whole[0].item() == -5.0


def test_a_view_keeps_its_block_alive_after_everything_else_is_gone(nvme_dir):
    eng, init = make(nvme_dir)
    g = eng.fetch(0)
    ref = weakref.ref(g)
    t = torch.from_dlpack(g.param(0))
    del g
    gc.collect()
    assert ref() is not None, "the gathered block died while a tensor viewed it"
    del eng  # the engine too: the view holds its core
    gc.collect()
    torch.testing.assert_close(t, torch.from_numpy(init[0][0]))
    del t
    gc.collect()
    assert ref() is None, "the gathered block outlived its last view"


def test_rewind_fetches_forgets_an_abandoned_forward(nvme_dir):
    # tierzero.Engine.fetch_mark / rewind_fetches: the fetches of a forward that raised are forgotten, so the
    # order recorded in the first micro-batch goes on being prefetched.
    eng, _ = make(nvme_dir)

    def micro_batch(abandon=False):
        if abandon:
            mark = eng.fetch_mark()
            assert isinstance(mark, tierzero._core.FetchMark) and mark.fetches == 0  # nothing fetched yet
            assert repr(mark) == f"FetchMark(micro_batch={mark.micro_batch}, fetches=0)"
            eng.fetch(0)  # the forward that raised got this far
            eng.rewind_fetches(mark)
        for b in (0, 1, 1, 0):  # forward, backward
            eng.fetch(b)
        eng.reduce_grads(0, [torch.ones(8, 16), None])
        eng.reduce_grads(1, [torch.ones(4, 8)])
        return eng.step()

    reports = [micro_batch(), micro_batch(), micro_batch(abandon=True), micro_batch()]
    assert [(r["fetches"], r["prefetched"]) for r in reports] == [(4, 0), (4, 4), (5, 5), (4, 4)]
    start = eng.fetch_mark()
    assert (start.micro_batch, start.fetches) == (4, 0)  # four micro-batches ended
    eng.fetch(0)
    one = eng.fetch_mark()
    assert (one.micro_batch, one.fetches) == (4, 1)
    eng.step()
    eng.fetch(0)
    eng.fetch(1)
    with pytest.raises(ValueError, match="rewind: the mark is from micro-batch 4, and this is micro-batch 5"):
        eng.rewind_fetches(one)
    with pytest.raises(TypeError):
        eng.rewind_fetches(1)  # a FetchMark, not a count


def test_reduce_grads_and_step_train(nvme_dir):
    eng, _ = make(nvme_dir, lr=0.1, weight_decay=0.0)
    before = eng.master_params(0)[0].copy()
    eng.reduce_grads(0, [torch.ones(8, 16), None])
    eng.reduce_grads(1, [np.ones((4, 8), np.float32)])
    report = eng.step()
    assert report["stepped"] and report["step"] == 1
    assert report["grad_norm"] == pytest.approx(np.sqrt(8 * 16 + 4 * 8), rel=1e-6)
    assert report["nvme_write_bytes"] > 0, "offloaded states should stream through NVMe"
    # The time a read (write) was in flight, for the rates (Note [Busy time]).
    assert report["nvme_read_busy_seconds"] > 0 and report["nvme_write_busy_seconds"] > 0
    after = eng.master_params(0)
    np.testing.assert_allclose(after[0], before - 0.1, rtol=0, atol=1e-6)  # Adam's first step moves by lr
    np.testing.assert_array_equal(after[1], np.zeros(8, np.float32))       # zero gradient, no decay: unchanged
    g = eng.fetch(0)
    np.testing.assert_array_equal(np.from_dlpack(g.param(0)), after[0])    # the new params are what fetch gives


def test_the_step_report_counts_the_parameter_shards_kept_from_the_fetch(nvme_dir):
    """Note [The step keeps backward's parameter shards]: with a remainder master and the parameters on NVMe,
    the step takes each 16-bit shard from the copy the last fetch read; the report says how many and their bytes."""
    cfg = host_config(nvme_dir, lr=0.1)
    cfg["bf16"] = {"enabled": True}
    cfg["tierzero"]["states"] = {"master": "remainder"}
    init = [[np.ones((8, 16), np.float32), None], [np.ones((4, 8), np.float32)]]
    eng = tierzero.Engine(cfg, BLOCKS, init=init)
    for _ in range(2):
        for b in (0, 1):
            eng.fetch(b)  # the forward's fetch, given back at once
        eng.reduce_grads(0, [torch.ones(8, 16, dtype=torch.bfloat16), None])  # bf16: the parameters' type
        eng.reduce_grads(1, [torch.ones(4, 8, dtype=torch.bfloat16)])
        report = eng.step()
    assert report["kept_param_blocks"] == 2 and report["reread_param_blocks"] == 0, report
    assert report["kept_param_bytes"] == 2 * 2 * 2048  # each block's shard: one 2048-element run of bf16


def test_the_step_report_counts_the_next_forwards_fetches_issued_under_the_optimizer(nvme_dir):
    """Note [The next forward's fetches under the optimizer]: with one block a sub-group and the parameters in
    CPU memory (stepped in place: written as soon as stepped), the next forward's first block is fetched while
    the optimizer still steps the second; the report counts it."""
    cfg = host_config(nvme_dir, lr=0.1)
    cfg["zero_optimization"]["sub_group_size"] = 1  # each block its own sub-group
    cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    eng = tierzero.Engine(cfg, BLOCKS, init=[[np.ones((8, 16), np.float32), None], [np.ones((4, 8), np.float32)]])
    counts = []
    for _ in range(3):
        for b in (0, 1):
            eng.fetch(b)  # the forward's fetch, given back at once
        eng.reduce_grads(0, [torch.ones(8, 16), None])
        eng.reduce_grads(1, [torch.ones(4, 8)])
        counts.append(eng.step()["next_fetches_under_step"])
    # The first forward's fetch order is closed before the first step's pass, so from the first step on block 0
    # is fetched under block 1's step (and block 1 only after the pass: nothing is left to step).
    assert counts == [1, 1, 1], counts


def test_a_none_gradient_is_zero_in_a_reused_buffer(nvme_dir):
    """reduce_grads writes each gradient into an unzeroed pool buffer and zeroes
    the rest: a None after a step that filled the same buffer must still be 0."""
    eng, _ = make(nvme_dir, lr=0.1, weight_decay=0.0)
    for _ in range(2):  # the second reduce of block 0 reuses the first one's buffer
        eng.reduce_grads(0, [torch.full((8, 16), 1000.0), torch.full((8,), 1000.0)])
        eng.reduce_grads(1, [np.ones((4, 8), np.float32)])
        eng.step()
    eng.reduce_grads(0, [torch.ones(8, 16), None])
    eng.reduce_grads(1, [None])
    report = eng.step()
    assert report["grad_norm"] == pytest.approx(np.sqrt(8 * 16), rel=1e-6)
    assert report["blocks_reduced"] == 2
    assert report["host_waits"] >= 0


def test_reduce_grads_refuses_what_does_not_fit(nvme_dir):
    eng, _ = make(nvme_dir)
    with pytest.raises(ValueError, match=r"argument 'grads\[0\] \(layer0.w\)' has 100 elements; the parameter has 128"):
        eng.reduce_grads(0, [torch.ones(100), None])
    with pytest.raises(TypeError, match=r"argument 'grads\[0\] \(layer1.w\)' must be float32; got float64"):
        eng.reduce_grads(1, [np.ones((4, 8))])
    with pytest.raises(ValueError, match=r"argument 'grads\[0\] \(layer1.w\)' must be C-contiguous"):
        eng.reduce_grads(1, [torch.ones(8, 4).t()])
    with pytest.raises(ValueError, match="1 gradients for block 'layer0', which has 2 parameters"):
        eng.reduce_grads(0, [torch.ones(8, 16)])
    with pytest.raises(ValueError, match="block 7 does not exist"):
        eng.reduce_grads(7, [])
    with pytest.raises(ValueError, match="fetch: block 9 does not exist"):
        eng.fetch(9)


def test_reduce_grads_stream_is_for_cuda_engines(nvme_dir):
    # The stream argument names the CUDA stream that wrote the gradients
    # (bindings/engine_bindings.cpp, Note [Gradients from another library's stream]).
    eng, _ = make(nvme_dir)
    with pytest.raises(ValueError, match=r"stream=7 is a CUDA stream; this engine is on cpu"):
        eng.reduce_grads(1, [torch.ones(4, 8)], stream=7)
    eng.reduce_grads(1, [torch.ones(4, 8)], stream=-1)  # "already synchronised" is fine anywhere
    eng.reduce_grads(0, [None, None], stream=None)
    assert eng.step()["grad_norm"] == pytest.approx(np.sqrt(4 * 8), rel=1e-6)


def test_fetch_stream_is_for_cuda_engines(nvme_dir):
    # fetch(stream=) names the CUDA stream whose kernels read the block (Note [Stream-ordered release]).
    eng, init = make(nvme_dir)
    with pytest.raises(ValueError, match=r"Engine.fetch\(\): stream=7 is a CUDA stream; this engine is on cpu"):
        eng.fetch(0, stream=7)
    assert eng.fetch(0).stream is None and eng.fetch(0, stream=-1).stream is None
    np.testing.assert_array_equal(np.from_dlpack(eng.fetch(0, stream=-1).param(0)), init[0][0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("how", ["control", "stream", "default stream"])
def test_a_cuda_block_is_not_regathered_under_kernels_still_reading_it(how):
    # Block 0's last view goes while a copy of it is queued behind ~tens of ms of matrix products on the
    # reader's stream; then every other block is gathered and held, more blocks than the pool has cached
    # buffers of that size, so a buffer back in the pool at once is taken (the control shows it is). With
    # the release ordered after the reader, the copy sees block 0's values.
    n, count = 1 << 18, 16
    blocks = [(f"b{i}", [("w", (n,))]) for i in range(count)]
    init = [[np.full(n, float(i + 1), np.float32)] for i in range(count)]
    eng = tierzero.Engine(host_config(None, backend="cuda"), blocks, init=init)
    reader = torch.cuda.current_stream() if how == "default stream" else torch.cuda.Stream()
    slow = torch.ones(4096, 4096, device="cuda")
    with torch.cuda.stream(reader):
        stream = {"control": -1, "stream": reader.cuda_stream, "default stream": None}[how]
        g = eng.fetch(0, stream=stream)
        assert g.stream == (None if how == "control" else 0 if how == "default stream" else reader.cuda_stream)
        w = torch.from_dlpack(g.param(0))
        first = w.data_ptr()
        for _ in range(8):
            slow = slow @ slow / 4096
        if how != "control":
            copy = w.clone()  # queued behind the products
        del w, g
        held = [eng.fetch(i) for i in range(1, count)]
    reader.synchronize()
    reused = [torch.from_dlpack(h.data).data_ptr() == first for h in held]
    if how == "control":
        assert any(reused), "a plain release should leave block 0's buffer to the next gathers at once"
    else:
        assert not any(reused), "block 0's buffer was gathered into while its reader was still queued"
        assert bool((copy == 1.0).all()), f"the reader saw {int((copy != 1.0).sum())} elements of other blocks"
    # The per-thread default stream names another stream on each thread, and views may die on any.
    with pytest.raises(ValueError, match=r"stream=2 is the per-thread default stream"):
        eng.fetch(0, stream=2)


def test_set_master_params_replaces_weights_between_steps(nvme_dir):
    eng, init = make(nvme_dir, lr=0.1, weight_decay=0.0)
    eng.reduce_grads(0, [torch.ones(8, 16), None])
    eng.step()  # moments that the replacement keeps
    w = np.arange(128, dtype=np.float32).reshape(8, 16) / 7
    eng.set_master_params(0, [torch.from_numpy(w).double(), None])  # any float dtype; None keeps that one
    got = eng.master_params(0)
    np.testing.assert_array_equal(got[0], w)
    np.testing.assert_array_equal(got[1], np.zeros(8, np.float32))
    np.testing.assert_array_equal(np.from_dlpack(eng.fetch(0).param(0)), w)  # the parameters fetch gives
    eng.step()  # ends the micro-batch that fetch began (and steps: Adam's momentum moves w again)
    stepped = eng.master_params(0)[0]
    assert not np.array_equal(stepped, w)
    with pytest.raises(ValueError, match=r"set_master_params: layer0.w has shape \(8, 16\); the value given has \(16, 8\)"):
        eng.set_master_params(0, [w.T, None])
    with pytest.raises(ValueError, match=r"set_master_params: 1 values for block 'layer0', which has 2 parameters"):
        eng.set_master_params(0, [w])
    np.testing.assert_array_equal(eng.master_params(0)[0], stepped)  # refusals changed nothing
    with pytest.raises(TypeError, match=r"Engine.set_master\(\): argument 'whole' must be float32; got float64"):
        eng._core.set_master(0, np.zeros(eng.layout[0]["whole_numel"]))
    with pytest.raises(ValueError, match=r"set_master: 5 values for block 'layer0', which has"):
        eng._core.set_master(0, np.zeros(5, np.float32))
    held = eng.fetch(1)
    with pytest.raises(RuntimeError, match=r"set_master\(layer0\): 1 gathered block\(s\) still out"):
        eng.set_master_params(0, [w, None])
    del held
    eng.set_master_params(0, [w, None])  # once the block is back
    np.testing.assert_array_equal(eng.master_params(0)[0], w)


def test_initial_values_later_refuses_unset_blocks_until_set(nvme_dir, tmp_path):
    # Note [Initial values]: "later" writes no weights; every read of an unset block is refused, naming it.
    eng = tierzero.Engine(host_config(nvme_dir), BLOCKS, initial_values="later")
    assert not eng.has_values(0) and not eng.has_values(1) and not eng.has_values(7)
    unset = r"block 'layer0' has no values yet \(the engine was made with initial_values = kSetLater, and 2 of its 2"
    with pytest.raises(RuntimeError, match=r"fetch: " + unset):
        eng.fetch(0)
    with pytest.raises(RuntimeError, match=r"gather_master: " + unset):
        eng.master_params(0)
    with pytest.raises(RuntimeError, match=r"step: " + unset):
        eng.step()
    with pytest.raises(RuntimeError, match=r"save_checkpoint: " + unset):
        eng.save_checkpoint(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(ValueError, match=r"block 'layer0' has no values yet \(initial_values='later'\), so every "
                                         r"parameter needs one; 'b' is None"):
        eng.set_master_params(0, [np.ones((8, 16), np.float32), None])
    assert not eng.has_values(0)
    w, b = np.arange(128, dtype=np.float32).reshape(8, 16), np.full(8, 0.5, np.float32)
    eng.set_master_params(0, [w, b])
    assert eng.has_values(0) and not eng.has_values(1)
    np.testing.assert_array_equal(np.from_dlpack(eng.fetch(0).param(1)), b)
    with pytest.raises(RuntimeError, match=r"fetch: block 'layer1' has no values yet .* 1 of its 2 blocks"):
        eng.fetch(1)
    eng.set_master_params(1, [torch.full((4, 8), 2.0)])
    np.testing.assert_array_equal(eng.master_params(0)[0], w)
    np.testing.assert_array_equal(np.from_dlpack(eng.fetch(1).param(0)), np.full((4, 8), 2.0, np.float32))
    eng.step()  # a whole engine now: it steps (the fetches' micro-batch)


def test_initial_values_are_checked(nvme_dir):
    with pytest.raises(ValueError, match=r"initial_values='first' is not one of 'rank0' .*, 'same' .* or 'later'"):
        tierzero.Engine(host_config(nvme_dir), BLOCKS, initial_values="first")
    with pytest.raises(ValueError, match=r"initial_values='later' writes no initial values, and 'init' gives some"):
        tierzero.Engine(host_config(nvme_dir), BLOCKS, init=[[None, None], [None]], initial_values="later")
    w = np.ones((8, 16), np.float32)
    same = tierzero.Engine(host_config(nvme_dir), BLOCKS, init=[[w, None], [None]], initial_values="same")
    np.testing.assert_array_equal(same.master_params(0)[0], w)


def test_learning_rate_set_by_hand_or_by_the_configs_scheduler(nvme_dir):
    eng, _ = make(nvme_dir, lr=0.1, weight_decay=0.0)
    assert eng.learning_rate == 0.1
    eng.set_learning_rate(0.05)
    eng.reduce_grads(1, [torch.ones(4, 8)])
    assert eng.step()["lr"] == 0.05 and eng.learning_rate == 0.05
    with pytest.raises(ValueError, match=r"learning rate = -1 must be finite and >= 0"):
        eng.set_learning_rate(-1)
    cfg = host_config(nvme_dir, lr=0.1)
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.02,
                                                       "warmup_num_steps": 4, "warmup_type": "linear"}}
    sched = tierzero.Engine(cfg, BLOCKS)
    seen = []
    for _ in range(6):
        sched.reduce_grads(1, [torch.ones(4, 8)])
        seen.append(sched.step()["lr"])
    assert seen == pytest.approx([0.01, 0.0125, 0.015, 0.0175, 0.02, 0.02], rel=1e-12)
    with pytest.raises(ValueError, match=r"the config's scheduler \(WarmupLR\) sets the learning rate"):
        sched.set_learning_rate(0.1)
    cfg["scheduler"]["params"]["warmup_num_steps"] = "auto"
    with pytest.raises(ValueError, match=r'scheduler.params.warmup_num_steps = "auto"'):
        tierzero.Engine(cfg, BLOCKS)


@pytest.mark.fault
def test_a_number_beyond_a_double_or_a_key_given_twice_names_the_file_and_key(nvme_dir, tmp_path):
    # Issue #23: a bare RuntimeError naming neither the file nor the key.
    config = json.dumps(host_config(nvme_dir))
    overflow = tmp_path / "overflow.json"
    overflow.write_text(config.replace('"lr": 0.01', '"lr": 1e400'))
    with pytest.raises(ValueError, match=r"overflow\.json: optimizer\.params\.lr: number overflow"):
        tierzero.Engine(str(overflow), BLOCKS)
    twice = tmp_path / "twice.json"
    twice.write_text(config.replace('"gradient_accumulation_steps": 1', '"gradient_accumulation_steps": 1, '
                                    '"gradient_accumulation_steps": 2'))
    with pytest.raises(ValueError, match="gradient_accumulation_steps is given twice"):
        tierzero.Engine(str(twice), BLOCKS)
    assert swap_files(nvme_dir) == []


@pytest.mark.fault
def test_bad_config_and_init_are_refused_with_the_engine_message(nvme_dir):
    with pytest.raises(ValueError, match="zero_optimisation"):
        tierzero.Engine({"zero_optimisation": {}}, BLOCKS)
    with pytest.raises(ValueError, match=r"argument 'init\[1\]\[0\]' \(layer1.w\) has 3 elements"):
        tierzero.Engine(host_config(nvme_dir), BLOCKS, init=[[None, None], [np.zeros(3, np.float32)]])
    with pytest.raises(FileNotFoundError):
        tierzero.Engine("/nonexistent/ds_config.json", BLOCKS)


def test_checkpoint_round_trip_and_safetensors(nvme_dir, tmp_path):
    eng, _ = make(nvme_dir)
    eng.reduce_grads(0, [torch.ones(8, 16), torch.ones(8)])
    eng.step()
    eng.save_checkpoint(tmp_path / "ckpt")
    saved = [eng.gather_master(b).copy() for b in range(2)]
    eng.reduce_grads(0, [torch.full((8, 16), 3.0), None])
    eng.step()
    assert not np.array_equal(eng.gather_master(0), saved[0])
    eng.load_checkpoint(tmp_path / "ckpt")
    for b in range(2):
        np.testing.assert_array_equal(eng.gather_master(b), saved[b])
    from safetensors.numpy import load_file
    eng.export_safetensors(tmp_path / "model.safetensors")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    np.testing.assert_array_equal(tensors["layer0.w"], eng.master_params(0)[0])
    names = [["encoder.weight", "encoder.bias"], ["decoder.weight"]]
    eng.export_safetensors(tmp_path / "named.safetensors", names=names)
    named = load_file(str(tmp_path / "named.safetensors"))
    assert set(named) == {"encoder.weight", "encoder.bias", "decoder.weight"}
    np.testing.assert_array_equal(named["encoder.weight"], eng.master_params(0)[0])
    with pytest.raises(ValueError, match="two tensors are named 'encoder.weight'"):
        eng.export_safetensors(tmp_path / "bad.safetensors", names=[names[0], ["encoder.weight"]])
    with pytest.raises(ValueError, match=r"names\[1\] has 2 names, but block 'layer1' has 1 parameters"):
        eng.export_safetensors(tmp_path / "bad.safetensors", names=[names[0], ["a", "b"]])
    assert not (tmp_path / "bad.safetensors").exists()
    with pytest.raises(OSError):
        eng.load_checkpoint(tmp_path / "missing")


def test_checkpoint_tags_and_client_state_bytes(nvme_dir, tmp_path):
    eng, _ = make(nvme_dir)
    eng.reduce_grads(0, [torch.ones(8, 16), torch.ones(8)])
    eng.step()
    blob = bytes(range(256)) * 3
    assert eng.save_checkpoint(tmp_path, "a", client_state=blob) == str(tmp_path / "a")
    assert eng.load_checkpoint(tmp_path) == (str(tmp_path / "a"), blob) and eng.optimizer_steps == 1
    assert eng.save_checkpoint(tmp_path, save_latest=False) == str(tmp_path / "step-1")
    assert eng.load_checkpoint(tmp_path, "step-1") == (str(tmp_path / "step-1"), None)
    with pytest.raises(ValueError, match="tag is empty"):
        eng.save_checkpoint(tmp_path, "")
    with pytest.raises(ValueError, match="checkpoint tag 'latest' is a name the checkpoint directory uses itself"):
        eng.save_checkpoint(tmp_path, "latest")
    data = bytearray((tmp_path / "a" / "client_state.bin").read_bytes())
    data[100] ^= 1
    (tmp_path / "a" / "client_state.bin").write_bytes(bytes(data))
    with pytest.raises(OSError, match="checksum mismatch in .*client_state.bin"):
        eng.load_checkpoint(tmp_path, "a")


@pytest.mark.fault
def test_keep_last_keeps_the_newest_checkpoints(nvme_dir, tmp_path):
    eng, _ = make(nvme_dir)
    for _ in range(3):
        eng.reduce_grads(0, [torch.ones(8, 16), torch.ones(8)])
        eng.reduce_grads(1, [torch.ones(4, 8)])
        eng.step()
        eng.save_checkpoint(tmp_path / "ckpt", keep_last=2)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".tierzero-save.lock", "latest", "step-2", "step-3"]
    assert eng.load_checkpoint(tmp_path / "ckpt")[0] == str(tmp_path / "ckpt" / "step-3")


def test_timeline(nvme_dir, tmp_path):
    eng, _ = make(nvme_dir)
    eng.record_timeline(True)
    eng.fetch(0)  # fetched and released at once: one compute span on the timeline
    eng.write_timeline(tmp_path / "t.json")
    assert (tmp_path / "t.json").read_text().startswith(("{", "["))


def test_fetch_releases_the_gil(nvme_dir):
    eng, _ = make(nvme_dir)
    stop = threading.Event()
    ticks = [0]

    def spin():
        while not stop.is_set():
            ticks[0] += 1

    th = threading.Thread(target=spin)
    th.start()
    for _ in range(50):
        eng.fetch(0)
        eng.fetch(1)
    stop.set()
    th.join()
    assert ticks[0] > 0


@pytest.mark.fault
def test_another_optimizers_checkpoint_is_refused_or_loads_its_weights_alone(nvme_dir, tmp_path):
    lion = tierzero.Engine(host_config(nvme_dir, optimizer="Lion"), BLOCKS)
    lion.reduce_grads(0, [torch.ones(8, 16), torch.ones(8)])
    lion.step()
    lion.save_checkpoint(tmp_path)
    adamw, _ = make(nvme_dir)
    before = adamw.gather_master(0).copy()
    with pytest.raises(ValueError, match="saved by the Lion optimizer; this engine's AdamW cannot continue"):
        adamw.load_checkpoint(tmp_path)  # it once read moments the checkpoint does not have, and crashed
    np.testing.assert_array_equal(adamw.gather_master(0), before)
    adamw.load_checkpoint(tmp_path, weights_only=True)
    np.testing.assert_array_equal(adamw.gather_master(0), lion.gather_master(0))
    assert adamw.optimizer_steps == 0


# ---------------------------------------------------------------- close() (Note [Closing an engine])

@pytest.mark.fault
def test_close_removes_the_swap_file_while_references_to_the_engine_live(nvme_dir):
    eng, _ = make(nvme_dir)
    holders = [eng, {"engine": eng}]  # references close() must not wait for
    assert len(swap_files(nvme_dir)) == 1
    eng.close()
    assert swap_files(nvme_dir) == [] and eng.closed
    for call in (lambda: eng.step(), lambda: eng.fetch(0), lambda: eng.gather_master(0), lambda: eng.describe(),
                 lambda: eng.rank, lambda: eng.save_checkpoint(nvme_dir)):
        with pytest.raises(RuntimeError, match="the engine is closed"):
            call()
    eng.close()  # again: nothing to do
    assert holders[1]["engine"].closed


@pytest.mark.fault
def test_a_with_block_closes_the_engine(nvme_dir):
    with tierzero.Engine(host_config(nvme_dir), BLOCKS) as eng:
        eng.reduce_grads(0, [torch.ones(8, 16), torch.ones(8)])
        eng.step()
        assert swap_files(nvme_dir)
    assert eng.closed and swap_files(nvme_dir) == []
    with pytest.raises(ValueError, match="raised inside"):  # the block's own error goes through, closed all the same
        with tierzero.Engine(host_config(nvme_dir), BLOCKS) as other:
            raise ValueError("raised inside")
    assert other.closed and swap_files(nvme_dir) == []


@pytest.mark.fault
def test_close_with_a_view_alive_removes_the_swap_file_and_keeps_the_views_memory(nvme_dir):
    eng, init = make(nvme_dir)
    g = eng.fetch(0)
    t = torch.from_dlpack(g.param(0))
    del g
    eng.close()
    assert swap_files(nvme_dir) == [], "removed at once, though the view keeps the rest of the engine"
    np.testing.assert_array_equal(t.numpy(), init[0][0])  # the view's memory is still the engine's, still there
    with pytest.raises(RuntimeError, match="the engine is closed"):
        eng.fetch(1)
    del t
    gc.collect()  # the last view goes, and the engine with it


@pytest.mark.fault
def test_an_engine_left_in_a_module_global_is_closed_at_exit(nvme_dir):
    code = ("import sys, json, tierzero\n"
            "engine = tierzero.Engine(json.loads(sys.argv[1]), [('l', [('w', (64, 64))])])\n"
            "engine.step()\n"
            "g = engine.fetch(0)\n"
            "view = memoryview(g.param(0))  # a view of the engine's memory, alive at exit\n"
            "keep = [engine]; keep.append(keep)  # a cycle too\n")
    assert swap_files_while_a_script_runs(code, host_config(nvme_dir), nvme_dir) == 1, "it had one while it ran"
    assert swap_files(nvme_dir) == []
