"""tierzero.torch over two ranks, launched as torchrun launches them (RANK, WORLD_SIZE, MASTER_ADDR, ...).

Two processes each train the same model through tierzero.torch.initialize on their own half of every batch, with
parameters and optimizer states partitioned between them (ZeRO stage 3, Gloo collectives, offloaded to NVMe); the
result must match one plain-PyTorch process training on the whole batches.
"""

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.nn.functional as F

from conftest import host_config
from test_torch import TOL, mlp

STEPS = 6

WORKER = textwrap.dedent("""
    import json, sys
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, {tests!r})
    import tierzero.torch as tzt
    from test_torch import mlp
    config, batches, out = json.loads(sys.argv[1]), torch.load(sys.argv[2]), sys.argv[3]
    torch.manual_seed(0)
    engine, *_ = tzt.initialize(mlp(), config)
    assert (engine.rank, engine.world_size) == ({rank}, 2), (engine.rank, engine.world_size)

    class Skipped(Exception):
        pass
    last = [m for m in engine.module.modules() if isinstance(m, torch.nn.Linear)][-1]
    for i, (x, y) in enumerate(batches):
        half = x.shape[0] // 2
        mine = slice({rank} * half, ({rank} + 1) * half)
        if i == 2:
            # A batch both ranks skip, whose forward raised on rank 0 alone after its last fetch (a bad label in
            # rank 0's half, say): rank 0 must not rewind the engine's fetches on its own (Note [A forward that
            # raised]), or it posts the prefetch window's all-gathers where rank 1 posts other collectives.
            hook = last.register_forward_hook(lambda *_: (_ for _ in ()).throw(Skipped())) if {rank} == 0 else None
            try:
                engine(x[mine] + 1)
                assert {rank} == 1
            except Skipped:
                assert {rank} == 0
            if hook is not None:
                hook.remove()
        engine.backward(F.mse_loss(engine(x[mine]), y[mine]))
        engine.step()
    master = engine.master_state_dict()  # a collective: both ranks call it
    if {rank} == 0:
        torch.save(master, out)

    # Checkpoints over two ranks: rank 0's client state is the one saved; a client state rank 0 refuses
    # fails the save on both ranks, before anything is written.
    class Opaque:
        pass
    ckpt = out + ".ckpt"
    for bad, reason in (({{"x": Opaque()}}, "could not read back safely"), ({{"f": lambda: 0}}, "does not save")):
        try:  # a pickling error too: rank 0 once raised before the collective, and rank 1 waited forever
            engine.save_checkpoint(ckpt, "t", client_state=bad if {rank} == 0 else {{}})
            raise SystemExit("the refused save went through")
        except (ValueError, OSError) as e:
            want = reason if {rank} == 0 else "1 other rank(s) failed"
            assert want in str(e), (type(e), str(e))
    engine.save_checkpoint(ckpt, "t", client_state={{"epoch": 3}} if {rank} == 0 else None)
    other, *_ = tzt.initialize(mlp(), config)
    path, client = other.load_checkpoint(ckpt, "t")
    assert client == {{"epoch": 3}} and other.global_steps == engine.global_steps, (client, other.global_steps)
    theirs = other.master_state_dict()
    assert all(torch.equal(master[n], theirs[n]) for n in master)
    print("rank {rank}: refused save and tagged checkpoint ok")

    # Editing weights (Note [Editing weights]): rank 1's edit is the one kept, on both ranks; each rank's
    # values differ, so a rank that kept its own would be seen.
    w = engine.module[0].weight
    with torch.no_grad(), tzt.GatheredParameters(w, modifier_rank=1):
        assert torch.equal(w, master["0.weight"])
        w[0].fill_({rank} + 7.0)
    edited = engine.master_state_dict()["0.weight"]
    assert bool((edited[0] == 8.0).all()) and torch.equal(edited[1:], master["0.weight"][1:]), edited[0]
    print("rank {rank}: rank 1's edit kept")

    # The with-block raising on one rank: every rank leaves the write-back (nothing written), the raising
    # rank with its own exception, the other with the refusal; neither waits for the other.
    try:
        with torch.no_grad(), tzt.GatheredParameters(w, modifier_rank=1):
            if {rank} == 0:
                raise KeyError("raised inside the block")
            w[0].fill_(99.0)
        raise SystemExit("the write-back went through though rank 0 raised")
    except (KeyError, OSError) as e:
        assert isinstance(e, KeyError if {rank} == 0 else OSError), (type(e), str(e))
    assert torch.equal(engine.master_state_dict()["0.weight"], edited)
    # safe_set_full_fp32_param takes rank 0's value; the other rank may pass None.
    tzt.safe_set_full_fp32_param(w, torch.full_like(edited, 0.5) if {rank} == 0 else None)
    assert bool((engine.master_state_dict()["0.weight"] == 0.5).all())
    print("rank {rank}: a raise on one rank refused the write-back on both")

    # A model on the meta device (Note [Models on the meta device]). An init_fn raising on rank 1 fails both
    # ranks at the same collective, rank 1 with its own error, and leaves the model on the meta device; so
    # does an interrupt (a BaseException).
    class Stop(BaseException):
        pass
    for error in (KeyError("rank 1 cannot make a LayerNorm"), Stop()):
        def init_fn(module):
            if {rank} == 1 and isinstance(module, torch.nn.LayerNorm):
                raise error
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        with torch.device("meta"):
            meta = mlp()
        try:
            tzt.initialize(meta, config, init_fn=init_fn)
            raise SystemExit(f"made though rank 1's init_fn raised {{error!r}}")
        except (type(error), OSError) as e:
            assert isinstance(e, type(error) if {rank} == 1 else OSError), (type(e), str(e))
        assert all(p.is_meta for p in meta.parameters())
    # Each rank draws other values; rank 0's are the ones kept, on both.
    torch.manual_seed(100 + {rank})
    made, *_ = tzt.initialize(meta, config)
    torch.manual_seed(100)
    want = dict(mlp().named_parameters())
    got = made.master_state_dict()
    assert all(torch.equal(got[n], want[n].detach()) for n in got), "rank 0's weights on both ranks"
    # On the meta device on one rank only: refused on both, neither left waiting for the other.
    with torch.device("meta"):
        half = mlp()
    try:
        tzt.initialize(half if {rank} == 1 else mlp(), config)
        raise SystemExit("made though only rank 1 is on the meta device")
    except ValueError as e:
        assert "the ranks name different values" in str(e), str(e)
    print("rank {rank}: models on the meta device made alike on both ranks, or refused on both")

    # Ranks that differ on whether the model is on the meta device, with init_fn (refused on the rank in
    # memory before any collective of the making): both refused, neither left waiting.
    with torch.device("meta") if {rank} == 0 else torch.device("cpu"):
        either = mlp()
    try:
        tzt.initialize(either, config, init_fn=lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
        raise SystemExit("made though one rank is not on the meta device")
    except (ValueError, OSError) as e:
        assert isinstance(e, OSError if {rank} == 0 else ValueError), (type(e), str(e))
    # Frozen parameters and buffers: rank 0's on both ranks, as the trained ones.
    def frozen_model():
        m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
        m[0].requires_grad_(False)
        return m
    with torch.device("meta"):
        meta = frozen_model()
    torch.manual_seed(200 + {rank})
    made, *_ = tzt.initialize(meta, config)
    torch.manual_seed(200)
    want = frozen_model()
    assert torch.equal(meta[0].weight, want[0].weight.detach()), "rank 0's frozen weight on both ranks"
    assert torch.equal(made.master_state_dict()["2.weight"], want[2].weight.detach())
    # Ranks whose frozen tensors differ (here a buffer more on rank 1): refused on both before any broadcast.
    with torch.device("meta"):
        odd = frozen_model()
        if {rank} == 1:
            odd[1].register_buffer("extra", torch.zeros(3))
    try:
        tzt.initialize(odd, config, init_fn=lambda m: (m.reset_parameters() if hasattr(m, "reset_parameters") else None,
                                                      m.extra.zero_() if hasattr(m, "extra") else None))
        raise SystemExit("made though the ranks keep different buffers")
    except ValueError as e:
        assert "the ranks name different values" in str(e), str(e)
    assert all(t.is_meta for t in [*odd.parameters(), *odd.buffers()])
    print("rank {rank}: refusals, interrupts and frozen tensors over two ranks")

    # A model in memory, the ranks seeded apart (Note [Rank 0's model]): every rank starts from rank 0's
    # trained and frozen parameters and buffers, as DeepSpeed broadcasts them.
    def drawn(seed, positions=4):
        torch.manual_seed(seed)
        m = frozen_model()
        m[1].running_mean.uniform_()
        m[1].num_batches_tracked.fill_(seed)
        # Expanded: its elements share memory, so it is not copied into but its values are agreed on.
        m[1].register_buffer("positions", torch.arange(positions).expand(3, positions))
        return m
    mem = drawn(300 + {rank})
    made, *_ = tzt.initialize(mem, config)
    want = drawn(300)
    got = made.master_state_dict()
    assert all(torch.equal(got[n], p.detach()) for n, p in want.named_parameters() if p.requires_grad), \
        "rank 0's trained weights on both ranks"
    assert torch.equal(mem[0].weight, want[0].weight.detach()), "rank 0's frozen weight on both ranks"
    assert all(torch.equal(a, b) for a, b in zip(mem.buffers(), want.buffers())), "rank 0's buffers on both ranks"
    # Ranks whose frozen tensors differ: refused on both, before anything is taken from rank 0.
    odd = drawn(400 + {rank})
    if {rank} == 1:
        odd[1].register_buffer("extra", torch.zeros(3))
    before = odd[0].weight.clone()
    try:
        tzt.initialize(odd, config)
        raise SystemExit("made though the ranks keep different buffers")
    except ValueError as e:
        assert "the ranks name different values" in str(e), str(e)
    assert torch.equal(odd[0].weight, before)
    try:  # an expanded buffer that differs: refused, since it cannot be made rank 0's
        tzt.initialize(drawn(500, positions=4 + {rank}), config)
        raise SystemExit("made though the ranks' expanded buffers differ")
    except ValueError as e:
        assert "the ranks name different values" in str(e), str(e)
    # Reading the frozen tensors failing on rank 1 (before any collective): refused on both, neither waits.
    real_digest = tzt.engine._kept_digest  # where initialize() looks it up
    def failing_digest(named):
        raise KeyError("rank 1 cannot read its buffers")
    if {rank} == 1:
        tzt.engine._kept_digest = failing_digest
    try:
        tzt.initialize(drawn(600), config)
        raise SystemExit("made though rank 1 failed")
    except (KeyError, OSError) as e:
        want = "cannot read its buffers" if {rank} == 1 else "tierzero.torch.initialize: 1 other rank(s) failed"
        assert isinstance(e, KeyError if {rank} == 1 else OSError) and want in str(e), (type(e), str(e))
    finally:
        tzt.engine._kept_digest = real_digest
    print("rank {rank}: a model in memory starts from rank 0's on both ranks")

    # tierzero.Engine made with no values: a block set from rank 0, the other rank passing None.
    import numpy as np
    import tierzero
    plain = tierzero.Engine(config, [("layer0", [("w", (4, 8)), ("b", (4,))])], initial_values="later")
    w, b = np.full((4, 8), 3.0, np.float32), np.arange(4, dtype=np.float32)
    plain.set_master_params(0, [w, b] if {rank} == 0 else [None, None])
    got = plain.master_params(0)
    assert plain.has_values(0) and np.array_equal(got[0], w) and np.array_equal(got[1], b), got
    print("rank {rank}: tierzero.Engine set from rank 0 alone")
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(tmp_path, nvme_dir, worker: str, config_of, out_name: str) -> None:
    """Runs `worker` (formatted with tests= and rank=) as ranks 0 and 1 of one Gloo job on this host, each with
    config_of(its NVMe folder), argv: the config, tmp_path/batches.pt, tmp_path/out_name. Fails the test with
    every failed rank's log; a rank that fails ends the run at once (the other would wait in its next collective
    until the timeout)."""
    port = free_port()
    procs = []
    for rank in (0, 1):
        nvme = os.path.join(nvme_dir, f"rank{rank}")
        os.makedirs(nvme)
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   TIERZERO_RENDEZVOUS_DIR=str(tmp_path / "rendezvous"))
        code = worker.format(tests=os.path.dirname(__file__), rank=rank)
        with open(tmp_path / f"rank{rank}.log", "w") as log:
            procs.append(subprocess.Popen([sys.executable, "-c", code, json.dumps(config_of(nvme)),
                                           str(tmp_path / "batches.pt"), str(tmp_path / out_name)],
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]  # every process, each pass
        if None not in codes or any(c not in (None, 0) for c in codes):
            break
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    failed = [f"rank {rank} {'killed' if p.returncode < 0 else f'failed ({p.returncode})'}:\n"
              f"{(tmp_path / f'rank{rank}.log').read_text()}" for rank, p in enumerate(procs) if p.returncode != 0]
    assert not failed, "\n".join(failed)


def test_two_ranks_match_one_plain_pytorch_process(tmp_path, nvme_dir):
    gen = torch.Generator().manual_seed(5)
    batches = [(torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(STEPS)]
    torch.save(batches, tmp_path / "batches.pt")
    run_two_ranks(tmp_path, nvme_dir, WORKER, lambda nvme: host_config(nvme, lr=1e-2, clip=1.0), "master.pt")

    # One process, the whole batch: the mean of the two halves' losses is the engine's mean over ranks.
    torch.manual_seed(0)
    ref = mlp()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    for x, y in batches:
        loss = (F.mse_loss(ref(x[:4]), y[:4]) + F.mse_loss(ref(x[4:]), y[4:])) / 2
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    master = torch.load(tmp_path / "master.pt")
    err = max((master[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    print(f"two ranks (Gloo, stage 3, params + optimizer on NVMe), {STEPS} steps: largest |tierzero - torch| = "
          f"{err:.3g} (tolerance {TOL})")
    assert err <= TOL


@pytest.mark.parametrize("bad, message", [({"RANK": "2", "WORLD_SIZE": "2"}, r"RANK=2 is out of range"),
                                          ({"RANK": "0"}, r"RANK=0 is set but WORLD_SIZE is not")])
def test_inconsistent_launcher_variables_are_refused_naming_them(tmp_path, nvme_dir, bad, message):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(bad)
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import tierzero.torch as tzt
        from test_torch import mlp
        try:
            tzt.initialize(mlp(), json.loads(sys.argv[1]))
        except ValueError as e:
            print("ValueError:", e)
    """)
    out = subprocess.run([sys.executable, "-c", code, json.dumps(host_config(nvme_dir))], env=env,
                         capture_output=True, text=True, timeout=120).stdout
    assert "ValueError:" in out, out
    assert re.search(message, out), out


GROUPS_WORKER = textwrap.dedent("""
    import json, sys
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, {tests!r})
    import tierzero.torch as tzt
    from test_torch import mlp
    config, batches, out = json.loads(sys.argv[1]), torch.load(sys.argv[2]), sys.argv[3]
    torch.manual_seed(0)
    model = mlp()
    params = list(model.parameters())
    groups = [{{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.3}},
              {{"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}}]
    engine, optimizer, _, _ = tzt.initialize(model=model, config=config, model_parameters=groups)
    for x, y in batches:
        half = x.shape[0] // 2
        mine = slice({rank} * half, ({rank} + 1) * half)
        engine.backward(F.mse_loss(engine(x[mine]), y[mine]))
        engine.step()
    # A collective: both ranks gather (Note [State dicts after initialize]); never empty tensors.
    state = model.state_dict()
    assert all(t.numel() > 0 for t in state.values()), [n for n, t in state.items() if t.numel() == 0]
    if {rank} == 0:
        torch.save(state, out)
""")


def test_two_ranks_train_weight_decay_groups_as_one_plain_pytorch_process(tmp_path, nvme_dir):
    # Note [Weight decay per parameter] (engine/src/optimizer_step.cpp): each rank's shard cuts the groups'
    # segments where its slice of the flat block begins and ends (a 48 x 48 weight straddles the two shards).
    gen = torch.Generator().manual_seed(6)
    batches = [(torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(STEPS)]
    torch.save(batches, tmp_path / "batches.pt")
    run_two_ranks(tmp_path, nvme_dir, GROUPS_WORKER, lambda nvme: host_config(nvme, lr=1e-2, weight_decay=0.01),
                  "state.pt")

    torch.manual_seed(0)
    ref = mlp()
    params = list(ref.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.3},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
    for x, y in batches:
        ((F.mse_loss(ref(x[:4]), y[:4]) + F.mse_loss(ref(x[4:]), y[4:])) / 2).backward()
        opt.step()
        opt.zero_grad()
    state = torch.load(tmp_path / "state.pt")
    err = max((state[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    print(f"two ranks, weight decay groups 0.3 / 0.0, {STEPS} steps: largest |tierzero - torch| = {err:.3g}")
    assert err <= TOL
    # The groups mattered: torch with the config's one weight decay ends further away than the tolerance.
    torch.manual_seed(0)
    one = mlp()
    opt = torch.optim.AdamW(one.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    for x, y in batches:
        ((F.mse_loss(one(x[:4]), y[:4]) + F.mse_loss(one(x[4:]), y[4:])) / 2).backward()
        opt.step()
        opt.zero_grad()
    assert max((state[n] - p.detach()).abs().max().item() for n, p in one.named_parameters()) > 10 * TOL
