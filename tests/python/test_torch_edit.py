"""Reading and editing weights between steps (Note [Editing weights] in bindings/tierzero/torch/edit.py):
tierzero.torch.GatheredParameters, safe_get_full_fp32_param and safe_set_full_fp32_param, as DeepSpeed's."""

import copy

import pytest
import torch
import torch.nn.functional as F

import tierzero.torch as tzt
from conftest import host_config
from test_torch import TOL, _mlp_batches, largest_error, mlp, mlp_and_reference


def _step_both(engine, ref, opt, pairs):
    """One optimizer step per (x, y) on the engine and on the plain-PyTorch copy."""
    for x, y in pairs:
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
        F.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()


def test_gathered_parameters_hand_out_copies_and_drop_edits_without_modifier_rank(nvme_dir):
    torch.manual_seed(0)
    model = mlp()
    engine, *_ = tzt.initialize(model, host_config(nvme_dir))
    batches = _mlp_batches(1, 2)
    for x, y in batches:
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    masters = engine.master_state_dict()
    untrained = torch.ones(3)
    named = dict(model.named_parameters())
    assert all(p.numel() == 0 for p in named.values()), "outside a forward a parameter is a placeholder"
    with tzt.GatheredParameters([*model.parameters(), untrained]):
        for n, p in named.items():
            assert torch.equal(p, masters[n]), n
            p.data.add_(1.0)  # dropped on leaving: no modifier_rank
        untrained.mul_(2)
    assert all(p.numel() == 0 for p in named.values())
    assert torch.equal(untrained, torch.full((3,), 2.0)), "a tensor no engine trains is left to the caller"
    after = engine.master_state_dict()
    assert all(torch.equal(after[n], masters[n]) for n in masters)
    # and training goes on from the untouched weights: the same loss as an engine that never gathered
    torch.manual_seed(0)
    twin, *_ = tzt.initialize(mlp(), host_config(nvme_dir))
    for x, y in batches:
        twin.backward(F.mse_loss(twin(x), y))
        twin.step()
    x, y = _mlp_batches(2, 1)[0]
    assert F.mse_loss(engine(x), y).item() == F.mse_loss(twin(x), y).item()
    with tzt.GatheredParameters(model[0].weight, enabled=False):
        assert model[0].weight.numel() == 0


def test_an_edit_with_modifier_rank_holds_and_training_goes_on_like_plain_pytorch(nvme_dir):
    # The reference edits its weights in place under torch.no_grad(), keeping AdamW's moments: the engine
    # must do the same (an edit that reset the moments, or that the next step undid, would be off by ~lr).
    model, engine, ref, opt = mlp_and_reference(nvme_dir)
    _step_both(engine, ref, opt, _mlp_batches(3, 3))
    with torch.no_grad(), tzt.GatheredParameters(model[0].weight, modifier_rank=0):  # as editing a torch weight
        model[0].weight[3].zero_()
        model[0].weight[5, 7] = 2.5
    with torch.no_grad():
        ref[0].weight[3].zero_()
        ref[0].weight[5, 7] = 2.5
    edited = engine.master_state_dict()["0.weight"]
    assert bool((edited[3] == 0).all()) and edited[5, 7].item() == 2.5
    _step_both(engine, ref, opt, _mlp_batches(4, 4))
    err = largest_error(engine, ref)
    print(f"mlp, edited after 3 steps then 4 more: largest master error vs plain PyTorch {err:.3g}")
    assert err <= TOL


def test_a_16_bit_edit_keeps_the_full_precision_of_the_weights_it_did_not_touch(nvme_dir):
    torch.manual_seed(0)
    model = mlp()
    config = host_config(nvme_dir, lr=3e-3)
    config["bf16"] = {"enabled": True}
    engine, *_ = tzt.initialize(model, config)
    for x, y in _mlp_batches(5, 3):
        engine.backward(F.mse_loss(engine(x.bfloat16()), y.bfloat16()).float())
        engine.step()
    before = engine.master_state_dict()["2.weight"]
    assert not torch.equal(before, before.bfloat16().float()), "the masters should carry more than bf16 holds"
    w = model[2].weight
    with torch.no_grad(), tzt.GatheredParameters(w, modifier_rank=0):
        assert w.dtype == torch.bfloat16 and torch.equal(w, before.bfloat16()), "handed out: the masters rounded"
        w[1, 2] = 0.75
    after = engine.master_state_dict()["2.weight"]
    assert after[1, 2].item() == 0.75
    untouched = torch.ones_like(after, dtype=torch.bool)
    untouched[1, 2] = False
    assert torch.equal(after[untouched], before[untouched]), "an untouched master lost its precision"
    with tzt.GatheredParameters(w):  # and the 16-bit weights the model computes with are the new masters rounded
        assert torch.equal(w, after.bfloat16())


def test_safe_get_and_set_full_fp32_param(nvme_dir):
    torch.manual_seed(0)
    model = mlp()
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    engine, *_ = tzt.initialize(model, host_config(nvme_dir))
    w, name = model[5].weight, "5.weight"
    got = tzt.safe_get_full_fp32_param(w)
    assert got.dtype == torch.float32 and torch.equal(got, engine.master_state_dict()[name])
    value = torch.randn(got.shape)
    tzt.safe_set_full_fp32_param(w, value.double())  # any float dtype: taken as fp32
    assert torch.equal(engine.master_state_dict()[name], value)
    with pytest.raises(ValueError, match=rf"safe_set_full_fp32_param: {name} has shape \(4, 48\); the value has \(48, 4\)"):
        tzt.safe_set_full_fp32_param(w, value.t())
    assert torch.equal(engine.master_state_dict()[name], value), "a refused set must change nothing"
    assert tzt.safe_get_full_fp32_param(frozen) is None
    with pytest.raises(ValueError, match="not one a tierzero.torch engine trains"):
        tzt.safe_set_full_fp32_param(frozen, torch.zeros(2))
    x, y = _mlp_batches(6, 1)[0]
    engine.backward(F.mse_loss(engine(x), y))  # the engine trains on from the set weight
    engine.step()
    assert (engine.master_state_dict()[name] - value).abs().max().item() <= 1.1e-2  # lr 1e-2: one Adam step


class _EditsInForward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)  # fetched the block: the micro-batch is under way
        with tzt.GatheredParameters(self.lin.weight, modifier_rank=0):
            self.lin.weight.data.zero_()
        return y


def _refused_leaves_the_weights(model, nvme_dir, error, match, act):
    """Runs act(engine) on a fresh engine of `model`, which must raise `error` matching `match` and leave every
    master weight as it was. Returns the engine."""
    torch.manual_seed(0)
    engine, *_ = tzt.initialize(model, host_config(nvme_dir))
    before = engine.master_state_dict()
    with pytest.raises(error, match=match):
        act(engine)
    assert all(torch.equal(v, before[n]) for n, v in engine.master_state_dict().items())
    return engine


def test_an_edit_inside_a_forward_is_refused_and_the_engine_trains_on(nvme_dir):
    model = _EditsInForward()
    engine = _refused_leaves_the_weights(model, nvme_dir, ValueError,
                                         r"GatheredParameters\(modifier_rank=0\): a forward ran with gradients "
                                         r"enabled and its backward has not", lambda e: e(torch.ones(2, 4)))
    model.forward = lambda x: model.lin(x)  # the same model without the edit
    engine.backward(engine(torch.ones(2, 4)).square().sum())
    assert engine.step()["stepped"]


def test_a_wrong_shape_is_refused_on_leaving(nvme_dir):
    torch.manual_seed(0)
    model = mlp()

    def transpose(engine):
        with tzt.GatheredParameters(model[0].weight, modifier_rank=0):
            model[0].weight.data = model[0].weight.data.t().contiguous()
    _refused_leaves_the_weights(model, nvme_dir, ValueError,
                                r"0.weight was handed out with shape \(48, 16\) and now has shape \(16, 48\)", transpose)
    assert model[0].weight.numel() == 0


def test_edits_nest_survive_a_step_inside_and_may_follow_an_evaluation(nvme_dir):
    torch.manual_seed(0)
    model = mlp()
    engine, *_ = tzt.initialize(model, host_config(nvme_dir))
    x, y = _mlp_batches(7, 1)[0]
    with torch.no_grad():
        engine(x)  # an evaluation forward: no backward pending, so edits may follow without a step
    lin = model[2]
    with torch.no_grad(), tzt.GatheredParameters(lin.weight, modifier_rank=0):
        with tzt.GatheredParameters(lin.bias, modifier_rank=0):  # the same block, nested
            lin.bias.fill_(7.0)
        lin.weight[0, 0] = 3.0
    m = engine.master_state_dict()
    assert bool((m["2.bias"] == 7.0).all()), "the outer write-back undid the inner edit"
    assert m["2.weight"][0, 0].item() == 3.0
    # A step inside the context: the elements not edited keep what the step made of them.
    with tzt.GatheredParameters(lin.weight, modifier_rank=0):
        engine.backward(F.mse_loss(engine(x), y))  # computes with the context's copy, which stays
        assert lin.weight.shape == (48, 48)
        engine.step()
        stepped = engine.master_state_dict()["2.weight"]
        with torch.no_grad():
            lin.weight[1, 1] = -2.0
    after = engine.master_state_dict()["2.weight"]
    assert after[1, 1].item() == -2.0
    keep = torch.ones_like(after, dtype=torch.bool)
    keep[1, 1] = False
    assert torch.equal(after[keep], stepped[keep]), "the write-back reverted the step"
    assert not torch.equal(stepped, m["2.weight"])


def test_a_forward_inside_the_context_computes_with_the_copy(nvme_dir):
    torch.manual_seed(0)
    model = mlp()
    engine, *_ = tzt.initialize(model, host_config(nvme_dir))
    x = _mlp_batches(8, 1)[0][0]
    with torch.no_grad():
        out = engine(x)
        with tzt.GatheredParameters(model[0].weight):
            model[0].weight.zero_()
            inside = engine(x)
            assert model[0].weight.shape == (48, 16) and not bool(model[0].weight.any())
        assert torch.equal(engine(x), out), "the copy's edit was dropped, and the engine's weights computed again"
    zeroed = copy.deepcopy(engine.detach_module())
    with torch.no_grad():
        zeroed[0].weight.zero_()
        torch.testing.assert_close(inside, zeroed(x), rtol=0, atol=1e-6)


def test_a_refused_edit_of_two_blocks_writes_neither_and_parameters_still_pickle(nvme_dir, tmp_path):
    torch.manual_seed(0)
    model = mlp()
    engine, *_ = tzt.initialize(model, host_config(nvme_dir))
    before = engine.master_state_dict()
    with pytest.raises(ValueError, match=r"2.weight was handed out with shape \(48, 48\) and now has shape \(24, 96\)"):
        with torch.no_grad(), tzt.GatheredParameters([model[0].weight, model[2].weight], modifier_rank=0):
            model[0].weight.fill_(1.0)
            model[2].weight.data = model[2].weight.data.reshape(24, 96)
    after = engine.master_state_dict()
    assert all(torch.equal(after[n], before[n]) for n in before), "a refused edit wrote a block"
    torch.save(model.state_dict(keep_vars=True), tmp_path / "params.pt")  # nothing unpicklable on the parameters


def test_a_pending_backward_is_seen_through_reentrant_checkpointing(nvme_dir):
    # The trained modules all run inside torch.utils.checkpoint(use_reentrant=True), whose first forward runs
    # under no_grad: the model's own forward hook still sees an output that needs a backward.
    class Checkpointed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self.lin, x, use_reentrant=True)
    torch.manual_seed(0)
    model = Checkpointed()
    engine, *_ = tzt.initialize(model, host_config(nvme_dir))
    out = engine(torch.ones(2, 4, requires_grad=True))
    with pytest.raises(ValueError, match="a forward ran with gradients enabled and its backward has not"):
        tzt.safe_set_full_fp32_param(model.lin.weight, torch.zeros(4, 4))
    engine.backward(out.sum())
    tzt.safe_set_full_fp32_param(model.lin.weight, torch.zeros(4, 4))  # after backward: fine
    assert not bool(engine.master_state_dict()["lin.weight"].any())


def test_a_context_that_outlives_its_blocks_gathering_leaves_nothing_gathered(nvme_dir):
    # Entered in a module's forward pre-hook (the block gathered) and left in its forward hook (the block
    # released): on leaving, the parameter goes to what it is now, the placeholder, not back to the view it
    # had on entering, which would hold the gathered buffer.
    torch.manual_seed(0)
    model = mlp()
    engine, *_ = tzt.initialize(model, host_config(nvme_dir))
    contexts = []

    def enter(module, args):
        contexts.append(tzt.GatheredParameters(module.weight))
        contexts[-1].__enter__()

    def leave(module, args, output):
        contexts.pop().__exit__(None, None, None)
    model[0].register_forward_pre_hook(enter)
    model[0].register_forward_hook(leave)
    with torch.no_grad():
        engine(torch.ones(2, 16))
    assert model[0].weight.numel() == 0
    assert tzt._live_gathered(engine) == 0, "the context put back a view that keeps the block gathered"
