"""tierzero.torch (bindings/tierzero/torch/): torch models trained through the engine, against plain PyTorch."""

import copy
import gc
import math
import os
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F

import tierzero.torch as tzt
from conftest import host_config, swap_files, swap_files_while_a_script_runs

# fp32 reordering: the engine sums gradients and computes AdamW in a
# different order than torch (reduce in fp32, SIMD kernels), so parameters
# after N steps agree to ~1e-7 x N relative; 2e-5 absolute bounds it for
# weights of magnitude ~1 over 10 steps with margin.
TOL = 2e-5


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Tanh(), torch.nn.Linear(48, 48),
                               torch.nn.LayerNorm(48), torch.nn.GELU(), torch.nn.Linear(48, 4))


class Attention(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        # No bias: the key bias's gradient is zero in exact arithmetic (softmax ignores a shift shared by all
        # keys), so it is pure rounding noise, which Adam's m / sqrt(v) scales up to whole lr-sized steps in
        # either implementation: a comparison of two correct trainings would then differ by ~lr.
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.proj = torch.nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1), float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(torch.nn.Module):
    """A GPT-shaped model: token embedding tied to the output head, a learned position parameter on the root."""

    def __init__(self, vocab=64, d=32, heads=4, layers=2, ctx=16):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, d)
        self.wpe = torch.nn.Parameter(0.02 * torch.randn(ctx, d))
        self.blocks = torch.nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx) + self.wpe[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def _entries(folder):
    """What a checkpoint folder holds, less the save lock's file (Note [One saver a folder])."""
    return sorted(n for n in os.listdir(folder) if n != ".tierzero-save.lock")


def _mlp_batches(seed, n):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(n)]


def _train_mse(engine, pairs):
    """One engine step per (x, y), on the mean squared error."""
    for x, y in pairs:
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()


def _adamw_like(config, params):
    hp = config["optimizer"]["params"]
    return torch.optim.AdamW(params, lr=hp["lr"], betas=tuple(hp["betas"]), eps=hp["eps"],
                             weight_decay=hp["weight_decay"])


def mlp_and_reference(nvme_dir):
    """A seeded MLP trained through the engine (NVMe offload), its plain-PyTorch copy, and AdamW on the copy:
    (model, engine, reference, optimizer)."""
    torch.manual_seed(0)
    model = mlp()
    ref = copy.deepcopy(model)
    config = host_config(nvme_dir)
    engine, *_ = tzt.initialize(model, config)
    return model, engine, ref, _adamw_like(config, ref.parameters())


def train_both(model, config, batches, loss_fn, gas, clip):
    """Trains `model` through the engine and a copy with torch.optim.AdamW; returns (engine, reference, losses)."""
    ref = copy.deepcopy(model)
    engine, *_ = tzt.initialize(model, config)
    opt = _adamw_like(config, ref.parameters())
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        (loss_fn(ref(x), y) / gas).backward()  # torch's accumulation: the mean over micro-batches
        if (i + 1) % gas == 0:
            if clip:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return engine, ref, losses


def largest_error(engine, ref):
    master = engine.master_state_dict()
    names = dict(ref.named_parameters())
    assert set(master) == set(names)
    return max((master[n] - p.detach().cpu()).abs().max().item() for n, p in names.items())


def test_mlp_on_nvme_matches_plain_pytorch(nvme_dir):
    torch.manual_seed(0)
    batches = _mlp_batches(1, 20)
    config = host_config(nvme_dir, gas=2, clip=1.0)
    engine, ref, losses = train_both(mlp(), config, batches, F.mse_loss, gas=2, clip=1.0)
    err = largest_error(engine, ref)
    print(f"MLP, params + optimizer on NVMe, 10 steps x 2 micro-batches: largest |tierzero - torch| = {err:.3g} "
          f"(tolerance {TOL}); loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    assert err <= TOL
    assert engine.global_steps == 10 and engine.last_report["nvme_read_bytes"] > 0
    assert engine.last_report["stepped"]


def test_tiny_transformer_with_tied_weights_matches_plain_pytorch(nvme_dir):
    torch.manual_seed(0)
    model = TinyGPT()
    gen = torch.Generator().manual_seed(2)
    batches = [(lambda t: (t[:, :-1], t[:, 1:]))(torch.randint(0, 64, (4, 17), generator=gen)) for _ in range(8)]
    loss_fn = lambda logits, y: F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))  # noqa: E731
    engine, ref, losses = train_both(model, host_config(nvme_dir, lr=3e-3), batches, loss_fn, gas=1, clip=0.0)
    err = largest_error(engine, ref)
    print(f"tiny GPT (tied embedding, {len(engine.block_names)} blocks), 8 steps: largest error {err:.3g}; "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert err <= TOL
    assert losses[-1] < losses[0]
    assert "wte" in engine.block_names and "head" not in engine.block_names  # the tied weight lives once


def _gpt_batches(seed, n, vocab=64):
    gen = torch.Generator().manual_seed(seed)
    return [(lambda t: (t[:, :-1], t[:, 1:]))(torch.randint(0, vocab, (4, 17), generator=gen)) for _ in range(n)]


def _next_token_loss(logits, y):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_an_fp32_model_trains_in_16_bit_as_mixed_precision_pytorch_does(nvme_dir, precision):
    # A DeepSpeed config with "bf16" (or "fp16") enabled and an fp32 model, unchanged: initialize() casts the
    # model (Note [Model dtype]). The reference is mixed precision written out in plain PyTorch: fp32 masters
    # from the fp32 weights, torch.optim.AdamW on them, gradients from the model in 16 bits; fp16 with a static
    # loss scale, undone in fp32. Each step is checked on its own: the 16-bit weights the engine computes with
    # must be its masters rounded, bit for bit, and the reference computes with those same weights. (A
    # reference that rounded its own masters would compute with other weights wherever fp32 reordering moved a
    # master across a rounding boundary, and those differences grow step by step.)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    torch.manual_seed(0)
    model = TinyGPT()
    ref = copy.deepcopy(model).to(dtype)
    masters = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    config = host_config(nvme_dir, lr=3e-3)
    config[precision] = {"enabled": True} if precision == "bf16" else {"enabled": True, "loss_scale": 256}
    engine, *_ = tzt.initialize(model, config)
    assert all(p.dtype == dtype for p in model.parameters()) and engine.loss_scale == (256 if precision == "fp16" else 1)
    computed_with = {}  # the weights each module computes with, seen after the engine's pre-hook gathered them

    def capture(prefix):
        def hook(module, args):
            computed_with.update({prefix + n: p.detach().clone() for n, p in module.named_parameters(recurse=False)})
        return hook
    for name, module in model.named_modules():
        module.register_forward_pre_hook(capture(f"{name}." if name else ""))
    opt = _adamw_like(config, masters.values())
    losses, err = [], 0.0
    for x, y in _gpt_batches(2, 6):
        before = engine.master_state_dict()
        if not losses:  # the masters start as the fp32 model's own weights, not their rounding
            assert all(torch.equal(before[n], m.detach()) for n, m in masters.items())
        loss = _next_token_loss(engine(x), y)
        assert all(torch.equal(computed_with[n], before[n].to(dtype)) for n in masters), "16-bit weights != masters rounded"
        engine.backward(loss)
        assert engine.step()["stepped"]
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p.copy_(computed_with[n])
        ref_loss = _next_token_loss(ref(x), y)
        assert ref_loss.item() == loss.item()
        (ref_loss * engine.loss_scale).backward()
        for n, p in ref.named_parameters():
            masters[n].grad = p.grad.float() / engine.loss_scale
            p.grad = None
        opt.step()
        after = engine.master_state_dict()
        err = max(err, max((after[n] - m).abs().max().item() for n, m in masters.items()))
        losses.append(loss.item())
    print(f"tiny GPT, fp32 model with {precision} enabled, 6 steps: largest master error {err:.3g}; "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert err <= TOL
    assert losses[-1] < losses[0]


def test_export_safetensors_loads_back_into_the_model_by_name(nvme_dir, tmp_path):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = TinyGPT()
    gen = torch.Generator().manual_seed(3)
    engine, *_ = tzt.initialize(model, host_config(nvme_dir, lr=3e-3))
    for _ in range(2):
        t = torch.randint(0, 64, (4, 17), generator=gen)
        logits = engine(t[:, :-1])
        engine.backward(F.cross_entropy(logits.reshape(-1, 64), t[:, 1:].reshape(-1)))
        engine.step()
    engine.export_safetensors(tmp_path / "model.safetensors")
    loaded = load_file(str(tmp_path / "model.safetensors"))
    # The names model.named_parameters() gives (a tied weight once, under its first owner), root ones included.
    assert set(loaded) == {n for n, _ in model.named_parameters()}
    assert "wpe" in loaded and "blocks.1.attn.qkv.weight" in loaded and "head.weight" not in loaded
    master = engine.master_state_dict()
    for name, t in loaded.items():
        assert torch.equal(t, master[name]), name
    fresh = TinyGPT()
    missing, unexpected = fresh.load_state_dict(loaded, strict=False)
    assert missing == ["head.weight"] and unexpected == []  # the tied head is the embedding just loaded
    assert torch.equal(fresh.head.weight, master["wte.weight"])


def test_a_modules_parameters_are_the_engines_memory_while_it_runs(nvme_dir):
    import numpy as np

    torch.manual_seed(0)
    model = mlp()
    engine, *_ = tzt.initialize(model, host_config(nvme_dir))
    block = engine.block_names.index("2")
    seen = []

    def check(module, args):  # runs after the engine's pre-hook gathered the block
        live = [g for g in engine._gathered if g.index == block]
        assert len(live) == 1
        for i, (name, p) in enumerate(module.named_parameters()):
            engine_view = np.asarray(live[0].param(i))  # the engine's buffer, as the engine lays it out
            assert p.data_ptr() == engine_view.__array_interface__["data"][0], name
            assert tuple(p.shape) == engine_view.shape
            before = engine_view.flat[0].copy()
            p.data.view(-1)[0] += 1.0  # a write from torch's side is seen from the engine's
            assert engine_view.flat[0] == before + np.float32(1.0)
            p.data.view(-1)[0] -= 1.0
        seen.append(True)

    model[2].register_forward_pre_hook(check)
    engine(torch.randn(8, 16))
    assert seen == [True]


@pytest.mark.parametrize("offload", ["nvme", "none"])
def test_cuda_tensors_train_like_plain_pytorch_on_the_gpu(nvme_dir, offload):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
    # The engine on CUDA: gathered blocks are device memory seen by torch through DLPack; with offload "none"
    # every state stays on the GPU and the engine's GPU optimizer steps them.
    torch.manual_seed(0)
    model = TinyGPT().cuda()
    gen = torch.Generator().manual_seed(2)
    batches = [(lambda t: (t[:, :-1].cuda(), t[:, 1:].cuda()))(torch.randint(0, 64, (4, 17), generator=gen))
               for _ in range(8)]
    loss_fn = lambda logits, y: F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))  # noqa: E731
    config = host_config(nvme_dir if offload == "nvme" else None, lr=3e-3, backend="cuda")
    engine, ref, losses = train_both(model, config, batches, loss_fn, gas=1, clip=0.0)
    assert engine.device.type == "cuda"
    err = largest_error(engine, ref)
    print(f"tiny GPT on CUDA, offload {offload}, 8 steps: largest error {err:.3g}; "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert err <= TOL
    assert losses[-1] < losses[0]


def test_an_evaluation_between_steps_leaves_prefetching_on_and_training_unchanged(nvme_dir):
    # engine(x) under torch.no_grad() fetches beside the recorded order (Note [Evaluation fetches]); before, the
    # first validation pass switched prefetching off for the rest of the run.
    _, engine, ref, opt = mlp_and_reference(nvme_dir)
    reports = []
    for i, (x, y) in enumerate(_mlp_batches(9, 6)):
        if i % 2 == 1:
            with torch.no_grad():  # through the engine, or the model called as it is (generate() does)
                model_out = engine(x) if i % 4 == 1 else engine.module(x)
                torch.testing.assert_close(model_out, ref(x), rtol=0, atol=1e-5)  # it sees the current weights
        engine.backward(F.mse_loss(engine(x), y))
        reports.append(engine.step())
        F.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    per_step = 2 * len(engine.block_names)  # every block fetched in forward and in backward
    print("fetches / prefetched per step:", [(r["fetches"], r["prefetched"]) for r in reports])
    assert all(r["prefetched"] == per_step for r in reports[1:]), "prefetching went off"
    assert largest_error(engine, ref) <= TOL


class _BadBatch(Exception):
    pass


def test_a_forward_that_raises_half_way_leaves_prefetching_on_and_training_unchanged(nvme_dir):
    # Note [A forward that raised]: a batch whose forward raises at the second Linear is skipped. engine(x)
    # rewinds the engine's fetches to where the forward began; before, the next forward broke the recorded
    # order and prefetching went off for the rest of the run.
    model, engine, ref, opt = mlp_and_reference(nvme_dir)
    second = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][1]
    reports = []
    for i, (x, y) in enumerate(_mlp_batches(7, 6)):
        if i in (2, 4):
            hook = second.register_forward_hook(lambda *_: (_ for _ in ()).throw(_BadBatch()))
            with pytest.raises(_BadBatch):
                engine(x)
            hook.remove()
        engine.backward(F.mse_loss(engine(x), y))
        reports.append(engine.step())
        F.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    per_step = 2 * len(engine.block_names)
    print("fetches / prefetched per step:", [(r["fetches"], r["prefetched"]) for r in reports])
    for i, r in enumerate(reports[1:], 1):
        # the failed forward's two fetches (prefetched too) count in its micro-batch
        extra = 2 if i in (2, 4) else 0
        assert (r["fetches"], r["prefetched"]) == (per_step + extra, per_step + extra), f"step {i}: {r}"
    assert largest_error(engine, ref) <= TOL


def test_an_fp32_model_of_some_size_trains_with_everything_on_nvme(nvme_dir):
    # 4.2M fp32 parameters: the swap store was sized for 2-byte parameters, and creation failed ("swap store full").
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
    engine, *_ = tzt.initialize(model, host_config(nvme_dir))
    engine.backward(engine(torch.randn(2, 1024)).square().mean())
    report = engine.step()
    assert report["stepped"] and report["nvme_write_bytes"] > 0


def test_gathered_blocks_are_released_between_forward_and_backward(nvme_dir):
    torch.manual_seed(0)
    model = TinyGPT()
    engine, *_ = tzt.initialize(model, host_config(nvme_dir))
    x = torch.randint(0, 64, (2, 8))
    loss = engine(x).sum()
    # Note [Saved tensors]: autograd holds (block, offset, stride) records, not the engine's buffers.
    assert tzt._live_gathered(engine) == 0
    assert all(p.numel() == 0 for p in model.parameters()), "parameters should be placeholders outside forward"
    engine.backward(loss)
    assert tzt._live_gathered(engine) == 0
    assert all(p.grad is None for p in model.parameters()), "gradients belong to the engine after backward"
    engine.step()
    # Without the hooks (the model called directly) saved views keep buffers alive until backward, still correct.
    loss = model(x).sum()
    held = tzt._live_gathered(engine)
    engine.backward(loss)
    assert held > 0 and tzt._live_gathered(engine) == 0


def test_checkpoint_resume_is_bit_for_bit(nvme_dir, tmp_path):
    torch.manual_seed(0)
    batches = _mlp_batches(3, 6)

    model = mlp()
    twin = copy.deepcopy(model)
    engine, *_ = tzt.initialize(model, host_config(nvme_dir))
    _train_mse(engine, batches[:3])
    engine.save_checkpoint(tmp_path / "ckpt")
    _train_mse(engine, batches[3:])
    want = engine.master_state_dict()
    other, *_ = tzt.initialize(twin, host_config(nvme_dir))
    other.load_checkpoint(tmp_path / "ckpt")
    _train_mse(other, batches[3:])
    got = other.master_state_dict()
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_train_batch_size_derives_the_accumulation_steps_and_the_engine_answers_deepspeeds_queries(nvme_dir):
    # Note [Batch keys]: train_batch_size 16 with micro-batches of 8 on one rank is 2 accumulation steps.
    torch.manual_seed(0)
    model = mlp()
    config = host_config(nvme_dir)
    del config["gradient_accumulation_steps"]
    config["train_batch_size"] = 16
    ref = copy.deepcopy(model)
    engine, *_ = tzt.initialize(model, config)
    assert (engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu(),
            engine.train_batch_size()) == (2, 8, 16)
    assert engine.get_global_grad_norm() is None
    opt = _adamw_like(config, ref.parameters())
    for i, (x, y) in enumerate(_mlp_batches(3, 6)):
        boundary = i % 2 == 1
        assert engine.is_gradient_accumulation_boundary() == boundary
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
        (F.mse_loss(ref(x), y) / 2).backward()
        assert engine.was_step_applied() == boundary
        if boundary:
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")).item()
            opt.step()
            opt.zero_grad()
            assert engine.get_global_grad_norm() == pytest.approx(norm, rel=1e-5)
    assert engine.global_steps == 3 and engine.micro_steps == 6
    assert largest_error(engine, ref) <= TOL
    config["train_batch_size"] = 24  # 8 x 2 accumulation steps x 1 rank is 16
    config["gradient_accumulation_steps"] = 2
    with pytest.raises(ValueError, match=r"train_batch_size = 24, but .* = 8 x 2 x 1 = 16"):
        tzt.initialize(mlp(), config)


def test_a_state_format_the_parameters_cannot_hold_is_refused_not_trained_in_fp32(nvme_dir):
    # tierzero.states reaches the engine through the config; a remainder master needs bf16 parameters, and says so.
    config = host_config(nvme_dir)
    config["tierzero"]["states"] = {"master": "remainder"}
    config["fp16"], config["bf16"] = {"enabled": True}, {"enabled": False}
    with pytest.raises(ValueError, match="needs bf16 parameters, but fp16.enabled is true"):
        tzt.initialize(mlp(), config)


def _train_tiny_gpt(nvme_dir, states, data_types=None):
    """Six steps of the tiny GPT in bf16 with these tierzero.states (and data_types): (losses, final masters)."""
    torch.manual_seed(0)
    config = host_config(nvme_dir, lr=3e-3)
    config["bf16"] = {"enabled": True}
    config["gradient_clipping"] = 0.1
    config["tierzero"]["states"] = states
    if data_types is not None:
        config["data_types"] = data_types
    engine, *_ = tzt.initialize(TinyGPT(), config)
    losses = []
    for x, y in _gpt_batches(5, 6):
        loss = _next_token_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    masters = engine.master_state_dict()
    engine.close()
    return losses, masters


def test_grad_accum_dtype_reaches_the_engine_or_is_refused_with_its_name(nvme_dir):
    # data_types.grad_accum_dtype is DeepSpeed's key: bf16 under bf16 training accumulates in bf16, which with one
    # micro-batch a step is bit for bit the fp32 accumulator (Note [16-bit gradient accumulators]); a dtype that is
    # not the training one is refused, naming the key.
    losses, masters = _train_tiny_gpt(nvme_dir, {"master": "fp32"})
    bf16_losses, bf16_masters = _train_tiny_gpt(nvme_dir, {"master": "fp32"}, {"grad_accum_dtype": "bf16"})
    assert bf16_losses == losses
    assert all(torch.equal(bf16_masters[n].view(torch.int32), m.view(torch.int32)) for n, m in masters.items())
    config = host_config(nvme_dir)
    config["bf16"] = {"enabled": True}
    config["data_types"] = {"grad_accum_dtype": "fp16"}
    with pytest.raises(ValueError, match=r'data_types.grad_accum_dtype: "fp16" with bf16 training is not supported'):
        tzt.initialize(mlp(), config)


def test_remainder_masters_train_through_tierzero_torch_exactly_as_fp32_masters(nvme_dir):
    losses, masters = _train_tiny_gpt(nvme_dir, {"master": "fp32"})
    rem_losses, rem_masters = _train_tiny_gpt(nvme_dir, {"master": "remainder"})
    assert rem_losses == losses
    assert all(torch.equal(rem_masters[n].view(torch.int32), m.view(torch.int32)) for n, m in masters.items())
    bf16_losses, bf16_masters = _train_tiny_gpt(nvme_dir, {"master": "remainder", "moments": "bf16"})
    assert bf16_losses[0] == losses[0]
    assert any(not torch.equal(bf16_masters[n], m) for n, m in masters.items())  # bf16 moments are in effect
    int8_losses, int8_masters = _train_tiny_gpt(nvme_dir, {"master": "remainder", "moments": "int8"})
    assert int8_losses[0] == losses[0]
    assert any(not torch.equal(int8_masters[n], m) for n, m in masters.items())  # int8 moments are in effect
    assert abs(int8_losses[-1] - losses[-1]) <= 0.02 * losses[-1]
    print(f"tiny GPT, 6 steps: loss {losses[0]:.4f} -> {losses[-1]:.4f} (fp32 and remainder masters, identical); "
          f"with bf16 moments -> {bf16_losses[-1]:.4f}, int8 moments -> {int8_losses[-1]:.4f}")


def test_deepspeed_style_checkpoints_take_a_tag_and_a_client_state(nvme_dir, tmp_path):
    # As DeepSpeed's save_checkpoint(save_dir, tag, client_state) and `_, client_sd = load_checkpoint(...)`.
    torch.manual_seed(0)
    engine, *_ = tzt.initialize(mlp(), host_config(nvme_dir))
    batches = _mlp_batches(1, 3)
    _train_mse(engine, batches[:2])
    ckpt = tmp_path / "ckpt"
    assert engine.save_checkpoint(ckpt, "epoch-end", client_state={"epoch": 1}) is True
    _train_mse(engine, batches[2:])
    state = {"epoch": 2, "order": torch.arange(5), "note": ("resume", 2.5)}
    engine.save_checkpoint(ckpt, "epoch-end", client_state=state)  # replaces the first
    engine.save_checkpoint(ckpt, "no-state", save_latest=False)
    assert _entries(ckpt) == ["epoch-end", "latest", "no-state"]

    other, *_ = tzt.initialize(mlp(), host_config(nvme_dir))
    path, client = other.load_checkpoint(ckpt)  # latest: still the tagged one
    assert path == str(ckpt / "epoch-end") and client["epoch"] == 2 and client["note"] == ("resume", 2.5)
    assert torch.equal(client["order"], torch.arange(5))
    assert other.global_steps == 3 == engine.global_steps  # as DeepSpeed's engine restores it
    assert other.load_checkpoint(ckpt, tag="no-state") == (str(ckpt / "no-state"), {})
    master, theirs = engine.master_state_dict(), other.master_state_dict()
    assert all(torch.equal(master[n], theirs[n]) for n in master)

    # Refused, naming the problem, with nothing written or replaced.
    with pytest.raises(ValueError, match="client_state must be a dict"):
        engine.save_checkpoint(ckpt, "x", client_state=[1, 2])
    with pytest.raises(ValueError, match="could not read back safely"):
        engine.save_checkpoint(ckpt, "x", client_state={"args": _Opaque()})
    with pytest.raises(ValueError, match="checkpoint tag 'a/b' is not a directory name"):
        engine.save_checkpoint(ckpt, "a/b")
    assert _entries(ckpt) == ["epoch-end", "latest", "no-state"]
    with pytest.raises(ValueError, match="load_optimizer_states=False is not supported"):
        other.load_checkpoint(ckpt, load_optimizer_states=False)

    # Fine-tuning: another optimizer starts afresh from the weights alone (load_module_only), as a fresh engine
    # given those weights does; loading all of the checkpoint into it is refused, naming both optimizers.
    def lion():
        m = mlp()
        return m, host_config(nvme_dir, optimizer="Lion", lr=1e-3)
    tuned, *_ = tzt.initialize(*lion())
    with pytest.raises(ValueError, match="saved by the AdamW optimizer; this engine's Lion cannot continue"):
        tuned.load_checkpoint(ckpt)
    tuned.load_checkpoint(ckpt, load_module_only=True, load_optimizer_states=False)
    assert tuned.global_steps == 0
    fresh_model, fresh_config = lion()
    with torch.no_grad():
        for n, p in fresh_model.named_parameters():
            p.copy_(master[n])
    fresh, *_ = tzt.initialize(fresh_model, fresh_config)
    for e in (tuned, fresh):
        _train_mse(e, batches)
    a, b = tuned.master_state_dict(), fresh.master_state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)
    with pytest.raises(FileNotFoundError, match="no checkpoint tagged 'epoch-9'"):
        other.load_checkpoint(ckpt, tag="epoch-9")
    (tmp_path / "mine").mkdir()
    with pytest.raises(FileExistsError, match="is not a tierzero checkpoint"):
        engine.save_checkpoint(tmp_path, "mine")
    # The first format (the caller's dict alone, no buffers) still loads, with a warning that says so.
    import io
    buf = io.BytesIO()
    torch.save({"epoch": 7}, buf)
    engine._core.save_checkpoint(str(ckpt), tag="old", client_state=buf.getvalue())
    with pytest.warns(UserWarning, match="holds no buffers or frozen parameters"):
        assert other.load_checkpoint(ckpt, tag="old") == (str(ckpt / "old"), {"epoch": 7})
    # A client state tierzero.torch did not write is refused before anything is replaced.
    engine._core.save_checkpoint(str(ckpt), tag="raw", client_state=b"not a pickle")
    before = other.master_state_dict()
    with pytest.raises(ValueError, match="load_checkpoint: the client state was not saved by tierzero.torch"):
        other.load_checkpoint(ckpt, tag="raw")
    assert all(torch.equal(before[n], t) for n, t in other.master_state_dict().items())


def test_a_checkpoint_carries_the_models_buffers_and_frozen_parameters(nvme_dir, tmp_path):
    # The engine holds the trainable parameters; the running statistics of a BatchNorm and a frozen layer go
    # in the checkpoint's client state (Note [Client state]), so resuming is bit for bit for such models too.
    def model():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 4))
        m[0].requires_grad_(False)
        return m
    batches = _mlp_batches(5, 5)
    a, *_ = tzt.initialize(model(), host_config(nvme_dir))
    _train_mse(a, batches[:2])
    a.save_checkpoint(tmp_path / "ckpt")
    _train_mse(a, batches[2:])
    b, *_ = tzt.initialize(model(), host_config(nvme_dir))
    with torch.no_grad():
        b.module[0].weight.mul_(2)  # a frozen weight that differs from the saved one
    b.load_checkpoint(tmp_path / "ckpt")
    assert int(b.module[1].num_batches_tracked) == 2
    _train_mse(b, batches[2:])
    for name, t in a.module.state_dict().items():
        if t.numel():  # the engine's parameters are empty placeholders between steps
            assert torch.equal(t, b.module.state_dict()[name]), name
    master, theirs = a.master_state_dict(), b.master_state_dict()
    assert all(torch.equal(master[n], theirs[n]) for n in master)

    # Saved buffers the model does not have: refused, naming them, and nothing is replaced.
    torch.manual_seed(1)
    other = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32, track_running_stats=False),
                                torch.nn.Tanh(), torch.nn.Linear(32, 4))
    other[0].requires_grad_(False)
    c, *_ = tzt.initialize(other, host_config(nvme_dir))
    before = c.master_state_dict()
    with pytest.raises(ValueError, match=r"not the model's: not in the model: \['1.num_batches_tracked', "
                                         r"'1.running_mean', '1.running_var'\]"):
        c.load_checkpoint(tmp_path / "ckpt")
    after = c.master_state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before) and c.global_steps == 0
    # A buffer the checkpoint lacks is refused too (load_module_strict), unless it is a frozen parameter the
    # save excluded; a directory without a checkpoint gives DeepSpeed's (None, None) and a warning.
    d, *_ = tzt.initialize(model(), host_config(nvme_dir))
    d.module.register_buffer("extra", torch.full((3,), 7.0))
    with pytest.raises(ValueError, match=r"not in the checkpoint: \['extra'\]"):
        d.load_checkpoint(tmp_path / "ckpt")
    a.save_checkpoint(tmp_path / "no-frozen", exclude_frozen_parameters=True)
    e, *_ = tzt.initialize(model(), host_config(nvme_dir))
    with torch.no_grad():
        e.module[0].weight.mul_(2)  # differs from the saved run's: an excluded frozen weight is not restored
    doubled = e.module[0].weight.clone()
    e.load_checkpoint(tmp_path / "no-frozen")
    assert torch.equal(e.module[0].weight, doubled) and e.global_steps == 5
    assert int(e.module[1].num_batches_tracked) == 5  # the buffers still are
    with pytest.warns(UserWarning, match="holds no checkpoint"):
        assert e.load_checkpoint(tmp_path / "empty") == (None, None)


class _Opaque:
    """An object torch.save pickles but torch.load(weights_only=True) refuses."""


def test_a_torch_scheduler_on_the_returned_optimizer_trains_like_plain_pytorch(nvme_dir):
    # Warm-up from 0 then cosine, as a LambdaLR factor (HF's get_cosine_schedule_with_warmup shape);
    # stepped after each optimizer step on both sides.
    def factor(t):
        return t / 3 if t < 3 else 0.5 * (1 + math.cos(math.pi * min(1.0, (t - 3) / 4)))

    torch.manual_seed(0)
    model = mlp()
    ref = copy.deepcopy(model)
    config = host_config(nvme_dir, gas=2, lr=1e-2)
    engine, optimizer, _, _ = tzt.initialize(model, config)
    assert isinstance(optimizer, torch.optim.Optimizer)
    opt = _adamw_like(config, ref.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when a scheduler steps before its optimizer has
        sched, ref_sched = (torch.optim.lr_scheduler.LambdaLR(o, factor) for o in (optimizer, opt))
        used = []
        for i, (x, y) in enumerate(_mlp_batches(4, 14)):
            engine.backward(F.mse_loss(engine(x), y))
            report = engine.step()
            if report["stepped"]:
                used.append(report["lr"])
                sched.step()
            (F.mse_loss(ref(x), y) / 2).backward()
            if i % 2 == 1:
                opt.step()
                opt.zero_grad()
                ref_sched.step()
    err = largest_error(engine, ref)
    print(f"LambdaLR (warm-up + cosine) on the returned optimizer, 7 steps: largest error {err:.3g}")
    assert err <= TOL
    assert used == pytest.approx([1e-2 * factor(t) for t in range(7)], rel=1e-12)
    assert engine.get_lr() == [optimizer.param_groups[0]["lr"]] == pytest.approx([1e-2 * factor(7)], rel=1e-12)


def test_the_configs_scheduler_trains_like_plain_pytorch_with_the_same_schedule(nvme_dir, tmp_path):
    # WarmupDecayLR, linear warm-up over 2 steps to 1e-2, then down to 0 at step 6 (tierzero/common/config.h).
    def lr_at(t):
        return 1e-2 * (t / 2 if t < 2 else max(0.0, (6 - t) / 4))

    torch.manual_seed(0)
    model = mlp()
    ref = copy.deepcopy(model)
    config = host_config(nvme_dir, lr=3e-4)  # WarmupDecayLR sets the rate itself, as in DeepSpeed
    config["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-2,
                                                               "warmup_num_steps": 2, "total_num_steps": 6,
                                                               "warmup_type": "linear"}}
    engine, optimizer, _, _ = tzt.initialize(model, config)
    assert optimizer.param_groups[0]["lr"] == 0.0 == lr_at(0)
    opt = _adamw_like(config, ref.parameters())
    for t, (x, y) in enumerate(_mlp_batches(5, 5)):
        engine.backward(F.mse_loss(engine(x), y))
        assert engine.step()["lr"] == pytest.approx(lr_at(t), rel=1e-12, abs=1e-15)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(lr_at(t + 1), rel=1e-12, abs=1e-15)
        for g in opt.param_groups:
            g["lr"] = lr_at(t)
        F.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
        if t == 2:
            engine.save_checkpoint(tmp_path / "ckpt")
    err = largest_error(engine, ref)
    print(f"config WarmupDecayLR, 5 steps: largest error {err:.3g}")
    assert err <= TOL
    # The schedule follows the optimizer step count, so a checkpoint resumes it.
    other, other_opt, _, _ = tzt.initialize(mlp(), config)
    other.load_checkpoint(tmp_path / "ckpt")
    assert other.get_lr() == [pytest.approx(lr_at(3), rel=1e-12)]
    # A rate of one's own beside the config's scheduler cannot take effect: refused, naming both.
    optimizer.param_groups[0]["lr"] = 1e-3
    with pytest.raises(ValueError, match=r"set_learning_rate\(0.001\): the config's scheduler \(WarmupDecayLR\)"):
        engine.step()


def test_only_the_learning_rate_of_the_returned_optimizer_can_change(nvme_dir, tmp_path):
    engine, optimizer, _, _ = tzt.initialize(mlp(), host_config(nvme_dir, lr=1e-2))
    optimizer.param_groups[0]["lr"] = 5e-3
    engine.backward(engine(torch.randn(2, 16)).sum())
    assert engine.step()["lr"] == 5e-3 and engine.get_lr() == [5e-3]
    engine.save_checkpoint(tmp_path / "ckpt")  # the rate is saved with it (a torch scheduler's resumes)
    other, other_opt, _, _ = tzt.initialize(mlp(), host_config(nvme_dir, lr=1e-2))
    other.load_checkpoint(tmp_path / "ckpt")
    assert other_opt.param_groups[0]["lr"] == 5e-3 and other.get_lr() == [5e-3]
    optimizer.param_groups[0]["weight_decay"] = 0.5
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['weight_decay'\] changed from 0.01 to 0.5; only 'lr'"):
        engine.step()
    with pytest.raises(ValueError, match="add_param_group is not supported"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})


def test_the_engines_set_learning_rate_holds_and_the_optimizer_shows_it(nvme_dir):
    # TorchEngine is a tierzero.Engine: its set_learning_rate must not be undone by the optimizer's old "lr".
    engine, optimizer, _, _ = tzt.initialize(mlp(), host_config(nvme_dir, lr=1e-2))
    engine.set_learning_rate(2e-3)
    assert optimizer.param_groups[0]["lr"] == 2e-3
    engine.backward(engine(torch.randn(2, 16)).sum())
    assert engine.step()["lr"] == 2e-3 and engine.get_lr() == [2e-3]


def test_a_torch_schedule_keeps_the_steps_taken_under_backward(nvme_dir):
    # Note [Learning rate]: the rate set in param_groups before forward reaches the engine before any
    # gradient does, so the steps under backward (tierzero.step_under_backward true) use it and are kept;
    # handed over only at step(), every one of them would be redone ("hyperparameters").
    torch.manual_seed(0)
    config = host_config(nvme_dir, lr=1e-2)
    config["tierzero"]["step_under_backward"] = True
    engine, optimizer, _, _ = tzt.initialize(mlp(), config)
    for t in range(4):
        optimizer.param_groups[0]["lr"] = 1e-2 * (t + 1) / 4
        engine.backward(engine(torch.randn(8, 16)).square().mean())
        report = engine.step()
        assert report["lr"] == 1e-2 * (t + 1) / 4
        assert report["ahead_off"] == "" and report["ahead_blocks"] > 0, report
        assert report["ahead_redone"] == 0 and report["ahead_redo_reason"] == "", report
        assert report["ahead_redone_read_bytes"] == report["ahead_redone_write_bytes"] == 0
        assert report["ahead_redone_seconds"] == 0.0
    # A rate changed after backward: the engine redoes the step, and says why and what it cost.
    engine.backward(engine(torch.randn(8, 16)).square().mean())
    optimizer.param_groups[0]["lr"] = 2e-3
    report = engine.step()
    assert report["ahead_blocks"] == 0 and report["ahead_redone"] > 0, report
    assert report["ahead_redo_reason"] == "hyperparameters"
    assert report["ahead_redone_read_bytes"] > 0 and report["ahead_redone_write_bytes"] > 0
    assert report["ahead_redone_seconds"] > 0.0


def test_eval_and_detach_module_give_the_trained_model(nvme_dir):
    torch.manual_seed(0)
    model = mlp()
    engine, optimizer, _, _ = tzt.initialize(model, host_config(nvme_dir))
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    engine.backward(F.mse_loss(engine(x), y))
    optimizer.step()  # the same as engine.step()
    optimizer.zero_grad()
    with torch.no_grad():
        out = engine.eval()(x)
    weights = engine.master_state_dict()
    plain = engine.detach_module()
    assert all(torch.equal(p, weights[n]) for n, p in plain.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(plain(x), out)


def test_a_dropped_engine_is_collected(nvme_dir):
    def make():
        model = mlp()
        engine, *_ = tzt.initialize(model, host_config(None))
        engine.backward(engine(torch.randn(2, 16)).sum())
        return weakref.ref(engine)

    ref = make()
    gc.collect()
    assert ref() is None, "engine still referenced after model and engine were dropped"


def test_refusals_name_the_problem(nvme_dir):
    with pytest.raises(ValueError, match="pass optimizer=None"):
        tzt.initialize(mlp(), host_config(nvme_dir), optimizer=torch.optim.SGD(mlp().parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"parameter '0.weight' is torch.float64, .* enable the config's \"bf16\""):
        tzt.initialize(mlp().double(), host_config(nvme_dir))
    with pytest.raises(ValueError, match="no parameters that require grad"):
        tzt.initialize(mlp().requires_grad_(False), host_config(nvme_dir))
    with pytest.raises(ValueError, match="config= is required"):
        tzt.initialize(mlp())


def test_fp16_steps_that_overflow_are_skipped_and_the_loss_scale_backs_off(nvme_dir):
    # Dynamic loss scaling from 2^24: the 16-bit gradients overflow, the engine skips those steps (weights,
    # moments and step count untouched) and halves the scale until one fits; then a step applies.
    torch.manual_seed(0)
    config = host_config(nvme_dir, lr=3e-3)
    config["fp16"] = {"enabled": True, "initial_scale_power": 24, "hysteresis": 1}
    engine, *_ = tzt.initialize(TinyGPT(), config)
    scales, applied = [], []
    for x, y in _gpt_batches(2, 12):
        before = engine.master_state_dict()
        scale = engine.loss_scale
        engine.backward(_next_token_loss(engine(x), y))
        report = engine.step()
        after = engine.master_state_dict()
        unchanged = all(torch.equal(before[n], after[n]) for n in before)
        assert report["overflow"] != report["stepped"] and engine.was_step_applied() == report["stepped"]
        assert unchanged == (not report["stepped"])
        if report["overflow"]:
            assert engine.loss_scale == scale / 2 and math.isinf(engine.get_global_grad_norm())
        scales.append(scale)
        applied.append(report["stepped"])
    first = applied.index(True)
    print(f"fp16 from 2^24: {first} steps skipped, stepping at scale 2^{int(math.log2(scales[first]))}")
    assert 0 < first < 12 and all(applied[first:]) and engine.global_steps == 12 - first
    assert math.isfinite(engine.get_global_grad_norm())


def test_a_16_bit_config_casts_frozen_parameters_and_buffers_too(nvme_dir):
    # As DeepSpeed's initialize does with "bf16" enabled: the whole model, so a frozen layer or a norm's running
    # statistics compute in the same dtype as the trained ones (Note [Model dtype]).
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    model[0].requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    config = host_config(nvme_dir)
    config["bf16"] = {"enabled": True}
    engine, *_ = tzt.initialize(model, config)
    assert model[0].weight.dtype == model[1].running_mean.dtype == torch.bfloat16
    assert model[1].num_batches_tracked.dtype == torch.int64  # not a floating-point buffer: left as it is
    assert torch.equal(model[0].weight, frozen.bfloat16())
    engine.backward(engine(torch.randn(8, 16).bfloat16()).float().square().mean())
    assert engine.step()["stepped"]
    master = engine.master_state_dict()
    assert set(master) == {"1.weight", "1.bias", "3.weight", "3.bias"} and master["3.weight"].dtype == torch.float32


def test_frozen_parameters_stay_with_torch(nvme_dir):
    model = mlp()
    model[0].requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    engine, *_ = tzt.initialize(model, host_config(nvme_dir))
    engine.backward(engine(torch.randn(4, 16)).sum())
    engine.step()
    assert "0" not in engine.block_names and torch.equal(model[0].weight, frozen)


@pytest.mark.parametrize("recompute", [None, "reentrant", "non-reentrant"])
def test_huggingface_gpt2_trains(nvme_dir, recompute):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.config.use_cache = False
    if recompute:
        # Activation checkpointing: each layer's forward runs again inside backward, so its blocks are gathered
        # a second time there, by the same hooks.
        model.train()
        kwargs = {"use_reentrant": recompute == "reentrant"}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5's name (the old one goes in 6)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    gen = torch.Generator().manual_seed(4)
    batches = [(lambda t: (t, t))(torch.randint(0, 128, (2, 16), generator=gen)) for _ in range(4)]
    ref = copy.deepcopy(model)
    config = host_config(nvme_dir, lr=1e-3)
    engine, *_ = tzt.initialize(model, config)
    forwards = []
    model.transformer.h[0].mlp.c_fc.register_forward_pre_hook(lambda m, a: forwards.append(m.weight.numel()))
    opt = _adamw_like(config, ref.parameters())
    for x, _ in batches:
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
        ref(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    # The key third of c_attn's bias has a zero gradient in exact arithmetic (see Attention above): compare the rest.
    master = engine.master_state_dict()
    keep = lambda n, t: torch.cat([t[:32], t[64:]]) if "c_attn.bias" in n else t  # noqa: E731
    err = max((keep(n, master[n]) - keep(n, p.detach())).abs().max().item() for n, p in ref.named_parameters())
    print(f"Hugging Face GPT-2 (2 layers, 32 wide, activation checkpointing {recompute or 'off'}), 4 steps: "
          f"largest error {err:.3g}")
    assert err <= TOL
    assert tzt._live_gathered(engine) == 0
    # Each forward saw the layer's gathered weights; with recomputation the layer ran twice per step.
    assert forwards == [32 * 128] * (len(batches) * (2 if recompute else 1))


class ReadsAChildsWeight(torch.nn.Module):
    """The output projection reads the embedding's weight without calling the embedding's module."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.mix = torch.nn.Linear(16, 16)

    def forward(self, idx):
        return torch.tanh(self.mix(self.emb(idx))) @ self.emb.weight.t()


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_parameter_used_outside_its_module_trains_once_registered(nvme_dir, when):
    # DeepSpeed's register_external_parameter: without it the weight is an empty placeholder in the root's
    # forward (torch's shape error); registered, before or after initialize(), it trains as plain PyTorch does.
    gen = torch.Generator().manual_seed(3)
    batches = [(lambda t: (t, t))(torch.randint(0, 32, (4, 6), generator=gen)) for _ in range(5)]
    loss_fn = lambda logits, y: F.cross_entropy(logits.reshape(-1, 32), y.reshape(-1))  # noqa: E731
    torch.manual_seed(0)
    unregistered, *_ = tzt.initialize(ReadsAChildsWeight(), host_config(nvme_dir))
    with pytest.raises(RuntimeError):
        unregistered(batches[0][0])
    torch.manual_seed(0)
    model = ReadsAChildsWeight()
    if when == "before":
        tzt.register_external_parameter(model, model.emb.weight)
    config = host_config(nvme_dir)
    ref = copy.deepcopy(model)
    engine, *_ = tzt.initialize(model, config)
    if when == "after":
        tzt.register_external_parameter(model, model.emb.weight)
    opt = _adamw_like(config, ref.parameters())
    for x, y in batches:
        engine.backward(loss_fn(engine(x), y))
        engine.step()
        loss_fn(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert largest_error(engine, ref) <= TOL and tzt._live_gathered(engine) == 0
    with pytest.raises(ValueError, match="not one the engine trains"):
        engine.register_external_parameter(model, torch.nn.Parameter(torch.zeros(3)))


def test_a_forward_that_raises_leaves_nothing_gathered(nvme_dir):
    model = mlp()
    engine, *_ = tzt.initialize(model, host_config(nvme_dir))
    with pytest.raises(RuntimeError):
        engine(torch.randn(4, 7))  # wrong width: the first Linear raises inside its forward
    assert tzt._live_gathered(engine) == 0 and all(b.users == 0 for b in engine._blocks)
    x = torch.randn(4, 16)
    engine.backward(engine(x).sum())  # and training goes on
    assert engine.step()["stepped"]


# ---------------------------------------------------------------- close() (Note [Closing an engine])

@pytest.mark.fault
def test_close_frees_the_engine_though_the_models_hooks_refer_to_it(nvme_dir):
    model = mlp()
    engine, optimizer, _, _ = tzt.initialize(model, host_config(nvme_dir))
    _train_mse(engine, _mlp_batches(3, 2))
    x, _ = _mlp_batches(4, 1)[0]
    out = model(x)  # a forward whose backward never comes: autograd holds its blocks
    assert swap_files(nvme_dir)
    engine.close()
    assert swap_files(nvme_dir) == [] and engine.closed
    del out
    with pytest.raises(RuntimeError, match="the engine is closed"):
        model(x)  # the hooks are still there, and say why they cannot run
    with pytest.raises(RuntimeError, match="the engine is closed"):
        optimizer.step()
    engine.close()
    with tzt.initialize(mlp(), host_config(nvme_dir))[0] as other:
        _train_mse(other, _mlp_batches(5, 1))
    assert other.closed and swap_files(nvme_dir) == []


@pytest.mark.fault
def test_a_module_global_torch_engine_and_model_leave_no_swap_file_at_exit(nvme_dir):
    code = ("import sys, json, torch, tierzero.torch as tzt\n"
            "model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))\n"
            "engine, optimizer, _, _ = tzt.initialize(model, json.loads(sys.argv[1]))\n"
            "loss = engine(torch.randn(8, 16)).square().mean()  # a global, as in any script's loop\n"
            "engine.backward(loss)\n"
            "engine.step()\n"
            "out = engine(torch.randn(8, 16))  # and a forward whose backward never came\n")
    assert swap_files_while_a_script_runs(code, host_config(nvme_dir), nvme_dir) == 1, "it had one while it ran"
    assert swap_files(nvme_dir) == [], "the hooks kept the engine alive past exit, and its swap file with it"
