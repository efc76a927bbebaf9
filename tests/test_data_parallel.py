"""FORGE-DP (parallel/data_parallel.py): data parallelism without a gradient all-reduce.

The reference is what ordinary data parallelism computes: one process steps torch.optim on the
GLOBAL batch (the replicas' batches concatenated, loss = their mean), in fp32 and in float64.
Tolerance: tests/closeness.py, each run's distance to the float64 one (FORGE-DP differs from
torch.optim by the order of the token-axis sum, and by which replica's sum a row shard takes).
GPT-level runs use test_gpt_parallel.compare's criteria.
"""
import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import forge_engine
from forge_engine.engine import Engine
from forge_engine.model import GPT, preset
from forge_engine.parallel.data_parallel import RowShard
from forge_engine.parallel.state import init_parallel
from closeness import assert_fp32_close, reversed_rows
from dist import run_ranks
from test_gpt_parallel import KW, TINY, compare


def cpu_only(backend):
    """These ranks are CPU processes (gloo); the Triton kernel runs on CPU tensors only under
    the interpreter, which conftest turns on where there is no GPU. On a GPU machine the
    DP path runs through pretrain.py on GPUs (benchmarks/bench_dp.py)."""
    if backend == "triton" and torch.cuda.is_available():
        pytest.skip("CPU ranks: the Triton interpreter is off on a GPU machine")


def small_model(conv1d=False):
    """Row counts 36 (divides among 2 replicas), 29 and 5 (do not: padded shards), and for 3
    replicas a shard of 1 row next to shards of 2. conv1d: the first two layers are
    transformers' Conv1D, W [in, out], whose rows are the input's features (13 and 36)."""
    torch.manual_seed(0)
    if conv1d:
        from transformers.pytorch_utils import Conv1D
        return nn.Sequential(Conv1D(36, 13), nn.LayerNorm(36), nn.GELU(), Conv1D(29, 36),
                             nn.Tanh(), nn.Linear(29, 5))
    return nn.Sequential(nn.Linear(13, 36), nn.LayerNorm(36), nn.GELU(),
                         nn.Linear(36, 29, bias=False), nn.Tanh(), nn.Linear(29, 5))


def global_batches(steps, micro, world, tokens):
    g = torch.Generator().manual_seed(7)
    return [[(torch.randn(world * tokens, 13, generator=g),
              torch.randn(world * tokens, 5, generator=g)) for _ in range(micro)]
            for _ in range(steps)]


def reference(model, name, kw, data, clip, dtype, scale=None):
    """Ordinary (single-process) training on the global batches: torch.optim. Each step's
    norm: clip_grad_norm_'s (before clipping), else that of the gradients step() applies
    (scale: every gradient multiplied by it first)."""
    model = copy.deepcopy(model).to(dtype)
    opt = getattr(torch.optim, name)(model.parameters(), **kw)
    norms = []
    for micro in data:
        for x, y in micro:
            (((model(x.to(dtype)) - y.to(dtype)) ** 2).mean() / len(micro)).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        else:
            if scale is not None:
                for p in model.parameters():
                    p.grad.mul_(scale)
            norms.append(float(torch.nn.utils.get_total_norm(
                [p.grad for p in model.parameters()])))
        opt.step()
        opt.zero_grad()
    return model, norms


def _dp_small(rank, world, name, kw, micro, clip, tokens, state_dtype, conv1d=False,
              scale=None):
    group = dist.group.WORLD
    base = small_model(conv1d)
    data = global_batches(3, micro, world, tokens)
    ref, n_ref = reference(base, name, kw, data, clip, torch.float32, scale)
    ref64, _ = reference(base, name, kw, data, clip, torch.float64, scale)
    ref_r, _ = reference(base, name, kw, reversed_rows(data), clip, torch.float32, scale)
    ours = copy.deepcopy(base)
    opt = getattr(forge_engine.optim, name)(ours, dp_group=group, state_dtype=state_dtype, **kw)
    norms = []
    sl = slice(rank * tokens, (rank + 1) * tokens)  # this replica's part of the global batch
    for step in data:
        if micro > 1 or clip is not None or scale is not None:
            opt.defer_updates()
        for x, y in step:
            (((ours(x[sl]) - y[sl]) ** 2).mean() / len(step)).backward()
        if clip is not None:
            norms.append(float(opt.clip_grad_norm_(clip)))
        if scale is not None:  # (the Engine's clipping: one factor for every gradient)
            opt.scale_gradients(scale)
        opt.step()
        opt.zero_grad()
        if clip is None:  # the norm of the gradients the step applied
            norms.append(float(opt.grad_norm))
    opt.synchronize()
    assert_fp32_close(ours, ref, ref64, also=[ref_r])
    assert norms == pytest.approx(n_ref, rel=1e-5)
    if clip is not None:
        assert n_ref[0] > clip  # clipping was active
    # optimizer state only for this replica's rows (ZeRO-1's division), none of a gradient
    for p in opt._fused:
        sh = opt._shards[p]
        for key, t in opt.state[p].items():
            if torch.is_tensor(t) and t.dim() == 2 and not key.endswith("_scale"):
                assert t.shape == (sh.rows, p.shape[1]), (key, t.shape)
        assert p.grad is None
    return {opt._fused[p]: opt._shards[p].mode for p in opt._fused}, norms


@pytest.mark.parametrize("world,name,kw,micro,clip,state_dtype,conv1d,scale", [
    (2, "AdamW", dict(lr=1e-2, weight_decay=0.1), 1, None, None, False, None),
    (2, "SGD", dict(lr=0.1, momentum=0.9), 2, 0.05, None, False, None),  # accumulate + clip
    (3, "AdamW", dict(lr=1e-2), 2, None, None, False, 0.5),
    (2, "Adagrad", dict(lr=0.1), 1, None, None, False, None),
    (2, "AdamW", dict(lr=1e-2, weight_decay=0.1), 1, None, None, True, None),
    (3, "SGD", dict(lr=0.1, momentum=0.9), 2, 0.05, None, True, None),
])
def test_forge_dp_matches_single_process_on_the_global_batch(world, name, kw, micro, clip,
                                                             state_dtype, conv1d, scale,
                                                             backend):
    """6 tokens per replica: [36, 13] (tokens: 1 x 6 x (13 + 18) x 4 B = 744 B < rs 936 B) and
    [29, 36] (tokens) gather tokens; [5, 29] reduce-scatters (6 x (29 + 3) x 4 = 768 B > 348 B):
    both paths run in one model. With Conv1D layers the shards are rows of W [in, out] (13
    and 36 rows), exchanged as the input's columns."""
    cpu_only(backend)
    if conv1d:
        pytest.importorskip("transformers")
    out = run_ranks(_dp_small, world, name, kw, micro, clip, 6, state_dtype, conv1d, scale)
    modes = out[0][0]
    if micro == 1 and world == 2:  # (Conv1D [13, 36]: 6 x (36 + 7) x 4 B = 1032 B > 1008 B)
        assert modes == {"0.weight": "reduce-scatter" if conv1d else "tokens",
                         "3.weight": "tokens", "5.weight": "reduce-scatter"}
    for r in out[1:]:
        assert r[1] == pytest.approx(out[0][1], rel=1e-6)  # every replica reports one norm


def test_choice_is_by_bytes_moved():
    sh = RowShard(None, 4, 1, n=4096, k=1024, per=1024, r0=1024, r1=2048)
    # tokens: 3 T (1024 e + 1024 e); reduce-scatter: 3 x 1024 x 1024 x 4
    assert sh.choose(1024, 0, 2, 2, 2)[0] == "tokens"  # 12 MiB vs 12 MiB: tie -> tokens
    assert sh.choose(1025, 0, 2, 2, 2)[0] == "reduce-scatter"
    assert sh.choose(2048, 0, 1, 1, 1)[0] == "tokens"


def _gpt_dp(rank, world, tp, micro, clip):
    """TP x DP GPT (tiny, tied embeddings) with the Engine: FORGE-DP vs torch.optim with
    ordinary DP (averaged gradients) vs float64 on the global batch at TP = DP = 1."""
    g = init_parallel(tp)
    cfg = preset("tiny", **TINY)
    gen = torch.Generator().manual_seed(99)
    dp, b, s = g.dp_size, 1, 16
    data = [[torch.randint(0, cfg.vocab_size, (dp * b, s + 1), generator=gen)
             for _ in range(micro)] for _ in range(4)]
    kw = dict(KW["adamw"], clip_grad=clip)
    r64 = GPT(cfg, seed=1).double()
    init = [p.detach().clone() for p in r64.parameters()]
    runs = [(r64, Engine(r64, "adamw", forge=False, **kw), slice(None))]
    mine = slice(g.dp_rank * b, (g.dp_rank + 1) * b)
    for forge in (False, True):
        m = GPT(cfg, tp_group=g.tp_group, sequence_parallel=tp > 1, seed=1)
        runs.append((m, Engine(m, "adamw", forge=forge, tp_group=g.tp_group,
                               dp_group=g.dp_group, **kw), mine))
    losses, norms = [], []
    for model, eng, sl in runs:
        ls, ns = [], []
        for step in data:
            fns = [lambda ids=ids[sl], m=model: m(ids[:, :-1], labels=ids[:, 1:]).mean()
                   for ids in step]
            st = eng.train_step(fns)
            ls.append(st.loss)
            ns.append(st.grad_norm)
        eng.synchronize()
        losses.append(ls)
        norms.append(ns)
    assert losses[0][0] == pytest.approx(math.log(cfg.vocab_size), rel=0.05)
    for i in (1, 2):
        assert losses[i] == pytest.approx(losses[0], rel=1e-5), losses
        assert norms[i] == pytest.approx(norms[0], rel=1e-5), norms
    compare(runs[2][0], runs[1][0], r64, init, g.tp_group, f"rank {rank} tp={tp} dp={dp}")
    return runs[2][1].summary


@pytest.mark.parametrize("world,tp,micro,clip", [(2, 1, 1, 0.0), (4, 2, 1, 0.0),
                                                 (4, 2, 2, 0.3)],
                         ids=["dp2", "tp2xdp2", "tp2xdp2-accumulate-clip"])
def test_gpt_forge_dp_matches_ordinary_dp(world, tp, micro, clip, monkeypatch):
    monkeypatch.setenv("FORGE_BACKEND", "torch")
    summaries = run_ranks(_gpt_dp, world, tp, micro, clip)
    assert "data-parallel x2" in summaries[0] and "no gradient all-reduce" in summaries[0]


def _state_dict_round_trip(rank, world):
    group = dist.group.WORLD
    a, b = small_model(), small_model()
    oa = forge_engine.optim.AdamW(a, dp_group=group, lr=1e-2)
    ob = forge_engine.optim.AdamW(b, dp_group=group, lr=1e-2)
    x = torch.randn(4, 13)
    for model, opt in ((a, oa), (b, ob)):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    b.load_state_dict(a.state_dict())  # waits for a's rows (state_dict pre-hook)
    ob.load_state_dict(oa.state_dict())
    for model, opt in ((a, oa), (b, ob)):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    oa.synchronize()
    ob.synchronize()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    bad = oa.state_dict()
    bad["forge"]["dp_rank"] = 1 - rank
    with pytest.raises(ValueError, match="data-parallel rank"):
        ob.load_state_dict(bad)
    return True


def test_sharded_state_dict_restores_exactly(backend):
    cpu_only(backend)
    assert all(run_ranks(_state_dict_round_trip, 2))


def _nonfinite_named(rank, world):
    """A non-finite gradient is reported by name (agreed over the ranks), its tiles are not
    written, and the loss stays finite: NaN injected into dY of layer 3 on ONE replica only."""
    group = dist.group.WORLD if world > 1 else None
    model = small_model()
    eng = Engine(model, "adamw", dp_group=group, lr=1e-2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randn(4, 13)

    def loss():
        h = model[:4](x)
        if rank == world - 1:
            h.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("nan")))
        return model[4:](h).pow(2).mean()
    st = eng.train_step(loss)
    eng.synchronize()
    assert math.isfinite(st.loss) and not math.isfinite(st.grad_norm)
    for n, p in model.named_parameters():
        if n.startswith("5."):  # after the NaN: finite and updated
            assert torch.isfinite(p).all() and not torch.equal(p, before[n]), n
        else:  # 0.weight, 0.bias, 1.*, 3.weight: NaN gradient, never written
            assert torch.equal(p, before[n]), n
    return st.nonfinite


@pytest.mark.parametrize("world", [1, 2])
def test_nonfinite_gradient_is_named(world, monkeypatch):
    monkeypatch.setenv("FORGE_BACKEND", "torch")
    if world == 1:
        dist_names = [_nonfinite_named(0, 1)]
    else:
        dist_names = run_ranks(_nonfinite_named, world)
    for names in dist_names:
        assert names == ["0.weight", "3.weight", "0.bias", "1.weight", "1.bias"], names
