"""torch.compile on models whose weights FORGE updates: the fused modules trace as the custom
ops of forge_engine/custom_ops.py, so a compiled model keeps one graph, and it trains as the
same eager loop with torch.optim does.

Each test compiles fresh modules after torch._dynamo.reset() and counts what Dynamo captured
(CompileCounterWithBackend): a model that silently ran eager would fail the counts. Weights are
compared by tests/closeness.py's rule (each run's distance to the same loop in float64). The
loops run on the torch backend (the kernel itself is tests/test_kernel.py's)."""
import copy
import os

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import forge_engine
from closeness import assert_fp32_close, reversed_rows
from nets import Net, next_token_loss, tiny_gpt2

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def fresh_dynamo(monkeypatch):
    monkeypatch.setenv("FORGE_BACKEND", "torch")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def rng():
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(2), "little"))


def lm_loss(model, ids):
    """a transformers causal LM's own loss"""
    return model(input_ids=ids, labels=ids).loss


def train(model, opt, data, clip=None, loss_of=next_token_loss):
    losses = []
    for ids in data:
        loss = loss_of(model, ids)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def torch_runs(base, data, clip=None, loss_of=next_token_loss, **kw):
    """torch.optim.AdamW(**kw)'s eager loop on copies of base: fp32, float64, and fp32 on the
    batches' rows reversed (tests/closeness.py). The fp32 run's losses and the three models."""
    ref, ref64, ref_r = copy.deepcopy(base), copy.deepcopy(base).double(), copy.deepcopy(base)
    losses = train(ref, torch.optim.AdamW(ref.parameters(), **kw), data, clip, loss_of=loss_of)
    train(ref64, torch.optim.AdamW(ref64.parameters(), **kw), data, clip, loss_of=loss_of)
    train(ref_r, torch.optim.AdamW(ref_r.parameters(), **kw), reversed_rows(data), clip,
          loss_of=loss_of)
    return losses, ref, ref64, ref_r


def forge_ops(counter) -> dict:
    """FORGE op name -> how many calls the captured graphs hold, the backward bodies that
    Dynamo traced for the fused linears' autograd.Function (custom_ops.CompiledLinear)
    included."""
    found = {}
    for g in counter.graphs:
        for sub in g.modules():
            if not isinstance(sub, torch.fx.GraphModule):
                continue
            for node in sub.graph.nodes:
                name = str(node.target)
                if name.startswith("forge_engine."):
                    found[name] = found.get(name, 0) + 1
    return found


@pytest.mark.parametrize("updates,clip", [("auto", None), ("auto", 0.5), ("backward", None),
                                          ("step", 0.5)])
def test_compiled_model_trains_like_torch_optim(updates, clip):
    """One captured graph holding every fused module as a FORGE op, and the weights of
    torch.optim's eager loop, with and without clip_grad_norm_ (which clips every step)."""
    torch.manual_seed(0)
    base = Net(norm=True)
    ours = copy.deepcopy(base)
    g = rng()
    data = [torch.randint(0, 37, (4, 6), generator=g) for _ in range(4)]
    kw = dict(lr=1e-2, weight_decay=0.1)
    l_ref, ref, ref64, ref_r = torch_runs(base, data, clip, **kw)
    opt = forge_engine.optim.AdamW(ours, updates=updates, **kw)
    counter = CompileCounterWithBackend("aot_eager")
    l_ours = train(torch.compile(ours, backend=counter), opt, data, clip)
    assert counter.frame_count == 1  # one graph: no break anywhere
    assert forge_ops(counter) == {"forge_engine.linear_update.default": 3,
                                  "forge_engine.embedding": 1}
    assert l_ours == pytest.approx(l_ref, rel=1e-5)
    assert_fp32_close(ours, ref, ref64, also=[ref_r])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_inductor_compiled_model_trains_like_torch_optim(device, monkeypatch):
    """Through Inductor (buffer reuse, fused kernels; on CUDA with the Triton update kernel):
    the weights stay as close to eager torch.optim as an Inductor-compiled model with
    torch.optim does (plus the fp32 rule)."""
    if device == "cuda":
        monkeypatch.setenv("FORGE_BACKEND", "triton")
    torch.manual_seed(0)
    base = Net(norm=True).to(device)
    ours, ref_c = copy.deepcopy(base), copy.deepcopy(base)
    g = rng()
    data = [torch.randint(0, 37, (4, 6), generator=g).to(device) for _ in range(3)]
    _, ref, ref64, ref_r = torch_runs(base, data, 0.5, lr=1e-2)
    train(torch.compile(ref_c), torch.optim.AdamW(ref_c.parameters(), lr=1e-2), data, 0.5)
    counter = CompileCounterWithBackend("inductor")
    train(torch.compile(ours, backend=counter), forge_engine.optim.AdamW(ours, lr=1e-2), data,
          0.5)
    assert counter.frame_count == 1
    assert_fp32_close(ours, ref, ref64, also=[ref_r, ref_c])


def tiny_llama(layers=2, **config):
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=56,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="sdpa", **config)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).train()


# per model: the graphs Dynamo captures without FORGE (GPT-2's own code breaks once), and
# the FORGE ops in them. Llama: seven linears a layer and the head, the embedding; GPT-2:
# four Conv1D a layer (W [in, out], traced as the linear of W's transpose) and the tied
# head, the token and position embeddings
COMPILED_OPS = {"llama": (tiny_llama, 1, {"forge_engine.linear_update.default": 2 * 7 + 1,
                                          "forge_engine.embedding": 1}),
                "gpt2": (tiny_gpt2, 2, {"forge_engine.linear_update.default": 2 * 4 + 1,
                                        "forge_engine.embedding": 2})}


@pytest.mark.parametrize("name", list(COMPILED_OPS))
def test_compiled_hf_model_has_no_graph_break_and_trains_like_torch_optim(name):
    """transformers' LlamaForCausalLM and GPT2LMHeadModel: with FORGE each compiles to as many
    graphs as without it, every fused module inside as a FORGE op, and trains with the
    Trainer's clipping (max_grad_norm 1.0) as torch.optim does."""
    make, graphs, ops = COMPILED_OPS[name]
    base = make()
    plain = CompileCounterWithBackend("aot_eager")
    ids = torch.randint(0, 97, (2, 9))
    torch.compile(copy.deepcopy(base), backend=plain)(input_ids=ids, labels=ids).loss.backward()
    torch._dynamo.reset()
    ours = copy.deepcopy(base)
    opt = forge_engine.optim.AdamW(ours, lr=1e-3)
    assert opt.forge_summary().endswith("standard path: none")
    g = rng()
    data = [torch.randint(0, 97, (2, 9), generator=g) for _ in range(3)]
    l_ref, ref, ref64, ref_r = torch_runs(base, data, 1.0, lm_loss, lr=1e-3)
    counter = CompileCounterWithBackend("aot_eager")
    l_ours = train(torch.compile(ours, backend=counter), opt, data, clip=1.0, loss_of=lm_loss)
    assert counter.frame_count == plain.frame_count == graphs
    assert forge_ops(counter) == ops
    assert l_ours == pytest.approx(l_ref, rel=1e-5)
    assert_fp32_close(ours, ref, ref64, also=[ref_r])


def test_regionally_compiled_layers_share_one_graph_and_train_like_torch_optim():
    """transformers' regional compilation (layer.compile() on every decoder layer, the same
    code): ten layers, more than torch's recompile limit of 8, compile to one graph as they do
    without FORGE, so no layer falls back to eager; the weights train as torch.optim's."""
    base = tiny_llama(layers=10, use_cache=False)
    ours = copy.deepcopy(base)
    opt = forge_engine.optim.AdamW(ours, lr=1e-3)
    counter = CompileCounterWithBackend("aot_eager")
    for layer in ours.model.layers:
        layer.compile(backend=counter)
    g = rng()
    data = [torch.randint(0, 97, (2, 9), generator=g) for _ in range(3)]
    l_ref, ref, ref64, ref_r = torch_runs(base, data, loss_of=lm_loss, lr=1e-3)
    l_ours = train(ours, opt, data, loss_of=lm_loss)
    assert counter.frame_count == 1  # one graph for all ten layers, none left eager
    assert forge_ops(counter) == {"forge_engine.linear_update.default": 7}
    assert l_ours == pytest.approx(l_ref, rel=1e-5)
    assert_fp32_close(ours, ref, ref64, also=[ref_r])


@pytest.mark.parametrize("batch_first", [True, False])
def test_compiled_multihead_attention_self_and_cross_like_torch(batch_first):
    """nn.MultiheadAttention compiled, self-attention (nn.TransformerEncoderLayer) and cross
    attention (query unlike key and value, which the compiled path projects as one stacked
    segment): one graph each, SGD updates as torch's."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(12, 3, 20, dropout=0.0, batch_first=batch_first)
    mha = nn.MultiheadAttention(12, 3, batch_first=batch_first)
    refs = (layer, mha)
    ours = copy.deepcopy(refs)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in refs] + \
        [forge_engine.optim.SGD(m, lr=0.1) for m in ours]
    counters = [CompileCounterWithBackend("aot_eager") for _ in ours]
    compiled = [torch.compile(m, backend=c) for m, c in zip(ours, counters)]
    g = rng()
    shape = (2, 5, 12) if batch_first else (5, 2, 12)
    x, kv = torch.randn(shape, generator=g), torch.randn((2, 7, 12) if batch_first
                                                         else (7, 2, 12), generator=g)
    outs = []
    for run in (refs, compiled):
        y = run[0](x)
        z, _ = run[1](x, kv, kv, need_weights=False)
        (y.square().sum() + z.square().sum()).backward()
        outs.append((y.detach(), z.detach()))
    for o in opts:
        o.step()
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert [c.frame_count for c in counters] == [1, 1]
    # in, out, two feed-forward
    assert forge_ops(counters[0]) == {"forge_engine.linear_update.default": 4}
    assert forge_ops(counters[1]) == {"forge_engine.linear_update.default": 2}
    for a, b in zip(ours, refs):
        for (n, p), q in zip(a.named_parameters(), b.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_compiled_second_backward_is_refused_naming_the_fix():
    """updates='backward' and a second backward before step(): the compiled backward raises
    the eager error."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    forge_engine.optim.AdamW(model, lr=1e-3, updates="backward")
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(3, 4)
    compiled(x).sum().backward()
    with pytest.raises(RuntimeError, match="second backward.*updates='step'"):
        compiled(x).sum().backward()
