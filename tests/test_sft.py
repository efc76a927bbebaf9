"""Supervised fine-tuning (forge_engine/sft.py, model.packed_attention_inputs, pretrain.py --sft):
the loss mask of chat and instruction data, its storage, packing, the masked token mean, and
the bad inputs of preprocessing and training.

Tolerances (fp32): a packed row computes each sample's activations with the same weights as a
row holding that sample alone, but its attention softmax spans a longer, masked row (exact
zeros added), its RoPE angles come from gathered table rows, and its weight gradients sum the
samples' token contributions in another order. That is fp32 rounding: measured per-token loss
differences up to 8e-8 relative, gradients up to 5e-7 of their largest element. rtol 1e-5,
with an atol of 1e-5 times the tensor's largest element for gradients (elements near zero have
no meaningful relative error). A sample that sees another (no block mask) moves losses by
1e-2 or more. Positions that do not restart are invisible there (RoPE is translation
invariant), so they are checked directly.
"""
import json
import os
import random
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

from forge_engine.data import SampleStream, _indexed_dataset_module
from forge_engine.engine import Engine
from forge_engine.model import GPT, preset
from forge_engine.parallel.layers import shard_of
from forge_engine.sft import (SFTDataset, encode_record, masked_loss, parse_record,
                              sft_loss_fns, sft_prefixes)
from forge_engine.tokenizer import NullTokenizer, build_tokenizer
from dist import run_ranks
from test_data import load_tool
from test_gpt_parallel import shard_map

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")  # renders the chat template

S = 40  # row positions; divisible by TP=2 for sequence parallelism
LENGTHS = (11, 17, 9)  # samples of one packed row: 10 + 16 + 8 = 34 positions, 6 padding


# ---------------------------------------------------------------------------------------------
# fixtures: a tiny tokenizer with a chat template, a small chat file, its preprocessed data

@pytest.fixture(scope="module")
def tools():
    return {n: load_tool(n) for n in ("make_tiny_hf_model", "make_tiny_chat_data",
                                      "preprocess_data", "export_hf")}


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory, tools):
    rng = random.Random(3)
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    lines = [json.dumps(tools["make_tiny_chat_data"].conversation(rng)) for _ in range(150)]
    lines.insert(7, "")  # blank lines are skipped
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, tools, chat_file):
    """A tiny Llama directory (random weights) whose tokenizer carries the ChatML template."""
    out = str(tmp_path_factory.mktemp("tiny"))
    assert tools["make_tiny_hf_model"].main(["--input", str(chat_file), "--out", out,
                                             "--vocab-size", "300"]) == 0
    return out


@pytest.fixture(scope="module")
def tok(hf_dir):
    return build_tokenizer("HuggingFaceTokenizer", hf_dir)


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory, tools, chat_file, hf_dir):
    prefix = str(tmp_path_factory.mktemp("data") / "chat")
    assert tools["preprocess_data"].main(["--input", str(chat_file), "--output-prefix", prefix,
                                          "--sft", "--tokenizer-type", "HuggingFaceTokenizer",
                                          "--tokenizer-model", hf_dir]) == 0
    return prefix


def records(path):
    return [r for i, line in enumerate(open(path), 1) if (r := parse_record(line, i, "f"))]


# ---------------------------------------------------------------------------------------------
# the mask and its storage

def test_mask_counts_the_assistant_turns_of_the_template(tok):
    msgs = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is 2 plus 3?"},
            {"role": "assistant", "content": "2 plus 3 is 5."},
            {"role": "user", "content": "Reverse the word chat."},
            {"role": "assistant", "content": "tahc"}]
    ids, mask = encode_record({"messages": msgs}, tok, "t")
    assert ids == tok.encode(tok.render_chat(msgs))  # the whole conversation, tokenized once
    counted = tok.decode([i for i, m in zip(ids, mask) if m])
    assert counted == "2 plus 3 is 5.<|im_end|>\ntahc<|im_end|>\n"
    # prompt/response with a template: a user turn and an assistant turn
    ids, mask = encode_record({"prompt": "Write chat in capitals.", "response": "CHAT"}, tok, "t")
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "CHAT<|im_end|>\n"
    assert tok.decode(ids).startswith("<|im_start|>user\nWrite chat in capitals.")
    # and without one: prompt, response, eod; the response and eod counted
    null = NullTokenizer(50)
    ids, mask = encode_record({"prompt": "1 2 3", "response": "4 5"}, null, "t")
    assert ids == [1, 2, 3, 4, 5, 49] and mask == [0, 0, 0, 1, 1, 1]


def test_preprocess_writes_what_megatron_core_reads_and_rows_hold_it(sft_data, chat_file, tok,
                                                                     capsys):
    idx = _indexed_dataset_module()
    tokens, mask = (idx.IndexedDataset(p) for p in sft_prefixes(sft_data))
    recs = records(chat_file)
    assert len(tokens) == len(mask) == len(recs) == 150
    assert mask.index.dtype == np.uint8
    assert np.array_equal(tokens.sequence_lengths, mask.sequence_lengths)
    for i in (0, 1, 77, 149):
        ids, m = encode_record(recs[i], tok, "t")
        assert list(map(int, tokens[i])) == ids and list(map(int, mask[i])) == m
    # the packed rows of the train split hold exactly its samples, shifted, from position 0
    ds = SFTDataset(sft_data, 192, "80,20,0", "train", 5, vocab_size=tok.vocab_size)
    assert ds.num_samples == 120 and "120 samples packed into" in ds.report
    seen = []
    for r in range(len(ds)):
        row = ds[r]
        seg = row["segment_ids"]
        for k, doc in enumerate(ds.rows[r]):
            at = (seg == k).nonzero()[:, 0]
            ids = tokens[doc].astype(np.int64)
            assert at.tolist() == list(range(int(at[0]), int(at[0]) + len(ids) - 1))
            assert row["tokens"][at].tolist() == ids[:-1].tolist()
            assert row["labels"][at].tolist() == ids[1:].tolist()
            assert row["loss_mask"][at].tolist() == mask[doc][1:].tolist()
            seen.append(doc)
        pad = seg == len(ds.rows[r])
        assert pad.sum() == 192 - int((seg < len(ds.rows[r])).sum())
        assert pad[-int(pad.sum()):].all() if pad.any() else True  # padding only at the end
        assert row["loss_mask"][pad].sum() == 0
    assert sorted(seen) == list(range(120))  # the train split: samples 0..119, each once


def test_overlong_samples_are_refused_truncated_or_dropped_and_counted(tools, chat_file, hf_dir,
                                                                       tmp_path, capsys):
    prep = tools["preprocess_data"].main
    lengths = [len(encode_record(r, build_tokenizer("HuggingFaceTokenizer", hf_dir), "t")[0])
               for r in records(chat_file)]
    seq = 96
    n_long = sum(n > seq + 1 for n in lengths)
    assert 0 < n_long < len(lengths)
    base = ["--input", str(chat_file), "--sft", "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", hf_dir, "--seq-length", str(seq)]
    capsys.readouterr()
    assert prep([*base, "--output-prefix", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{n_long} of 150 samples are longer than" in err[0]
    assert "--sft-overlong truncate" in err[0] and not list(tmp_path.iterdir())
    assert prep([*base, "--output-prefix", str(tmp_path / "t"), "--sft-overlong",
                 "truncate"]) == 0
    assert f"{n_long} truncated, 0 dropped" in capsys.readouterr().out
    t = _indexed_dataset_module().IndexedDataset(sft_prefixes(str(tmp_path / "t"))[0])
    assert len(t) == 150 and t.sequence_lengths.max() == seq + 1
    assert prep([*base, "--output-prefix", str(tmp_path / "d"), "--sft-overlong", "drop"]) == 0
    assert f"0 truncated, {n_long} dropped" in capsys.readouterr().out
    d = _indexed_dataset_module().IndexedDataset(sft_prefixes(str(tmp_path / "d"))[0])
    assert len(d) == 150 - n_long
    # the same policy at training time, on data preprocessed without --seq-length
    full = str(tmp_path / "f")
    assert prep([a for a in base if a not in ("--seq-length", str(seq))]
                + ["--output-prefix", full]) == 0
    with pytest.raises(ValueError, match=f"{n_long} of 150 samples are longer than"):
        SFTDataset(full, seq, "1,0,0", "train", 1)
    cut = SFTDataset(full, seq, "1,0,0", "train", 1, overlong="truncate")
    drop = SFTDataset(full, seq, "1,0,0", "train", 1, overlong="drop")
    assert (cut.num_samples, cut.truncated) == (150, n_long)
    assert (drop.num_samples, drop.dropped) == (150 - n_long, n_long)
    assert f"{n_long} dropped as longer than {seq + 1} tokens" in drop.report


@pytest.mark.parametrize("line,needle", [
    ({"text": "hello"}, "neither 'messages' nor 'prompt'/'response'"),
    ({"prompt": "hi"}, "'response' is missing"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]},
     "role 'bot'; the roles are system, user, assistant"),
    ({"messages": [{"role": "user", "content": "a"}]}, "no assistant message"),
    ({"messages": [{"role": "user"}]}, "must be an object with 'role' and 'content'"),
    ("template", "'messages' need a chat template"),
])
def test_bad_input_is_one_line_before_any_file(tools, hf_dir, tmp_path, capsys, line, needle):
    tokdir = hf_dir
    if line == "template":  # the same tokenizer without its chat template
        tokdir = str(tmp_path / "notemplate")
        os.makedirs(tokdir)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            text = open(os.path.join(hf_dir, name)).read()
            if name == "tokenizer_config.json":
                cfg = json.loads(text)
                del cfg["chat_template"]
                text = json.dumps(cfg)
            open(os.path.join(tokdir, name), "w").write(text)
        line = {"messages": [{"role": "user", "content": "a"},
                             {"role": "assistant", "content": "b"}]}
    good = json.dumps({"prompt": "a", "response": "b"})
    src = tmp_path / "in.jsonl"
    src.write_text(f"{good}\n{json.dumps(line)}\n{good}\n")
    capsys.readouterr()
    rc = tools["preprocess_data"].main(["--input", str(src), "--output-prefix",
                                        str(tmp_path / "out" / "x"), "--sft", "--tokenizer-type",
                                        "HuggingFaceTokenizer", "--tokenizer-model", tokdir])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("preprocess_data.py: error: ") and needle in err[0], err[0]
    assert ":2:" in err[0] and not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# packing is exact; masked tokens count for nothing; the loss is one large batch's token mean

def samples(vocab, seed=0, lengths=LENGTHS):
    """(ids, mask) pairs: random tokens; the mask counts the second half of each sample."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=g)
        mask = torch.zeros(n)
        mask[n // 2:] = 1
        out.append((ids, mask))
    return out


def pack(smps, s=S):
    """One row as SFTDataset lays it out: samples back to back, then padding."""
    tokens, labels, mask = torch.zeros(s, dtype=torch.long), torch.zeros(s, dtype=torch.long), \
        torch.zeros(s)
    seg = torch.full((s,), len(smps), dtype=torch.long)
    at = 0
    for k, (ids, m) in enumerate(smps):
        n = len(ids) - 1
        tokens[at:at + n], labels[at:at + n], mask[at:at + n] = ids[:-1], ids[1:], m[1:]
        seg[at:at + n] = k
        at += n
    return {"tokens": tokens[None], "labels": labels[None], "loss_mask": mask[None],
            "segment_ids": seg[None]}


def one_at_a_time(model, smps):
    """Per-token losses of each sample run alone (its own row, no packing), and the gradient
    of the sum of their counted losses."""
    model.zero_grad()
    per = []
    for ids, m in smps:
        loss = model(ids[None, :-1], labels=ids[None, 1:])[0]
        (loss * m[1:]).sum().backward()
        per.append(loss.detach())
    return per, {n: p.grad.clone() for n, p in model.named_parameters()}


def packed_run(model, row):
    model.zero_grad()
    loss = model(row["tokens"], labels=row["labels"], segment_ids=row["segment_ids"])[0]
    (loss * row["loss_mask"][0]).sum().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def close_grad(got, want, name=""):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()),
                               msg=lambda m: f"{name}: {m}")


def check_packed_losses(loss, per):
    at = 0
    for p in per:
        torch.testing.assert_close(loss[at:at + len(p)], p, rtol=1e-5, atol=0)
        at += len(p)


def test_packed_row_equals_samples_one_at_a_time():
    cfg = preset("tiny", seq_length=S)
    model = GPT(cfg, seed=0)
    with torch.no_grad():  # norm weights away from 1, so that every path shows in the grads
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.2 * torch.randn_like(p))
    smps = samples(cfg.vocab_size)
    per, want = one_at_a_time(model, smps)
    loss, got = packed_run(model, pack(smps))
    check_packed_losses(loss, per)
    for n in want:
        close_grad(got[n], want[n], n)


def test_positions_restart_per_sample_and_attention_stays_inside_it():
    """RoPE scores depend on position differences only, so a sample shifted along the row
    attends as it would at 0 and the comparisons with samples run alone cannot see a
    missing restart (only rounding at long offsets would): the positions are checked here."""
    from forge_engine.model import packed_attention_inputs
    seg = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3], [0] * 10])
    pos, mask = packed_attention_inputs(seg)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 0], list(range(10))]
    want = torch.zeros(10, 10, dtype=torch.bool)
    for a, b in ((0, 3), (3, 5), (5, 9), (9, 10)):
        want[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    assert mask.shape == (2, 1, 10, 10) and torch.equal(mask[0, 0], want)
    assert torch.equal(mask[1, 0], torch.ones(10, 10, dtype=torch.bool).tril())


def test_packed_row_through_the_triton_layer_kernels(monkeypatch):
    """The Triton RMSNorm, SwiGLU and RoPE kernels (interpreted here): a packed row of one
    micro-batch row feeds the RoPE kernel the table rows of its own positions. Forward only
    and one layer (the interpreter is slow); the kernel's backward is the same rotation.
    Arbitrary positions (not a shift of 0..s-1, which RoPE cannot tell apart) must rotate as
    the torch path rotates them."""
    cfg = preset("tiny", seq_length=S, num_layers=1)
    model = GPT(cfg, seed=0)
    attn = model.layers[0].attn
    x = torch.randn(S, 1, cfg.hidden_size, generator=torch.Generator().manual_seed(8))
    pos = torch.randint(0, S, (1, S), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want = attn(x, pos)
        monkeypatch.setenv("FORGE_BACKEND", "triton")
        torch.testing.assert_close(attn(x, pos), want, rtol=1e-5, atol=1e-6)
        smps = samples(cfg.vocab_size, seed=4)
        row = pack(smps)
        per = [model(ids[None, :-1], labels=ids[None, 1:])[0] for ids, _ in smps]
        loss = model(row["tokens"], labels=row["labels"], segment_ids=row["segment_ids"])[0]
    check_packed_losses(loss, per)


def test_masked_tokens_change_neither_loss_nor_gradient_nor_update():
    cfg = preset("tiny", seq_length=S)
    smps = samples(cfg.vocab_size, seed=1)
    row = pack(smps)
    other = {k: v.clone() for k, v in row.items()}
    masked = other["loss_mask"] == 0
    g = torch.Generator().manual_seed(9)
    other["labels"][masked] = torch.randint(0, cfg.vocab_size, (int(masked.sum()),), generator=g)
    pad = other["segment_ids"] == len(smps)
    other["tokens"][pad] = torch.randint(0, cfg.vocab_size, (int(pad.sum()),), generator=g)
    assert not torch.equal(other["labels"], row["labels"])
    results = []
    for batch in (row, other):
        model = GPT(cfg, seed=0)
        s, c = masked_loss(model, batch, "cpu")
        s.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model = GPT(cfg, seed=0)  # and through FORGE: the weights after one step
        engine = Engine(model, "adamw", lr=1e-2)
        stats = engine.train_step(sft_loss_fns(model, [batch], "cpu"))
        results.append((s.detach(), c, grads, stats.loss,
                        [p.detach().clone() for p in model.parameters()]))
    (s0, c0, g0, l0, w0), (s1, c1, g1, l1, w1) = results
    assert torch.equal(s0, s1) and torch.equal(c0, c1) and l0 == l1
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))


def step_sgd(batches, dp_group=None):
    """One FORGE SGD step (lr 1: the weights move by minus the gradient) of a fresh tiny model
    over `batches` (this replica's micro-batches); (reported loss, weight deltas)."""
    cfg = preset("tiny", seq_length=S)
    model = GPT(cfg, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    engine = Engine(model, "sgd", dp_group=dp_group, lr=1.0, momentum=0.0, weight_decay=0.0)
    stats = engine.train_step(sft_loss_fns(model, batches, "cpu", dp_group))
    engine.synchronize()
    return stats.loss, [(p.detach() - b, b) for p, b in zip(model.parameters(), before)]


def close_delta(got, want):
    """Weight deltas of two SGD steps: a delta is the difference of two weights of about
    |w|, so it carries their fp32 rounding (2 ulps of the largest weight) besides the
    gradient's own (close_grad)."""
    (a, w), (b, _) = got, want
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max())
                               + 2 * 2.0 ** -23 * float(w.abs().max()))


def four_rows():
    """Four packed rows with 8, 3x8, 2x8 + 4, 6 counted tokens: unequal, so that a mean of
    micro-batch means would differ from the token mean."""
    vocab = preset("tiny").vocab_size
    shapes = [(17,), (17, 17, 5), (17, 9, 9), (13,)]
    return [pack(samples(vocab, seed=10 + i, lengths=ls)) for i, ls in enumerate(shapes)]


def cat(rows):
    return {k: torch.cat([r[k] for r in rows]) for k in rows[0]}


def token_mean(rows):
    """The reference: one large batch's loss, every counted token weighed once."""
    model = GPT(preset("tiny", seq_length=S), seed=0)
    with torch.no_grad():
        s, c = masked_loss(model, cat(rows), "cpu")
    return float(s / c)


def test_loss_is_the_token_mean_over_micro_batches():
    rows = four_rows()
    counts = [int(r["loss_mask"].sum()) for r in rows]
    assert len(set(counts)) == 4, counts
    loss_big, delta_big = step_sgd([cat(rows)])
    loss_acc, delta_acc = step_sgd([rows[0], cat(rows[1:3]), rows[3]])  # 3 micro-batches
    want = token_mean(rows)
    assert loss_big == pytest.approx(want, rel=1e-6)
    assert loss_acc == pytest.approx(want, rel=1e-6)
    for a, b in zip(delta_acc, delta_big):
        close_delta(a, b)


def _ranks(rank, world):
    """TP=2 with sequence parallelism: a packed row against its samples one at a time at TP=1;
    then data parallelism over 2 replicas (2 micro-batches each) against one large batch."""
    g = dist.new_group(list(range(world)))
    cfg = preset("tiny", seq_length=S)
    smps = samples(cfg.vocab_size, seed=2)
    ref = GPT(cfg, seed=0)
    per, want = one_at_a_time(ref, smps)
    par = GPT(cfg, tp_group=g, sequence_parallel=True, seed=0)
    loss, got = packed_run(par, pack(smps))
    for p in par.tp_grad_sum_parameters():  # what the Engine reduces before a step
        dist.all_reduce(p.grad, group=g)
    got = {n: p.grad for n, p in par.named_parameters()}
    check_packed_losses(loss, per)
    sm = shard_map(par)
    for n, t in got.items():
        dim, chunks = sm.get(n, (None, 1))
        close_grad(t, want[n] if dim is None else shard_of(want[n], dim, g, chunks), n)

    rows = four_rows()
    mine = [rows[rank], rows[rank + 2]]  # replica r: rows r and r + 2
    loss_dp, delta_dp = step_sgd(mine, dp_group=g)
    loss_big, delta_big = step_sgd([cat(rows)])
    assert loss_dp == pytest.approx(token_mean(rows), rel=1e-6)
    assert loss_dp == pytest.approx(loss_big, rel=1e-6)
    for a, b in zip(delta_dp, delta_big):
        close_delta(a, b)
    return True


def test_tp2_sequence_parallel_packing_and_dp2_token_mean():
    assert run_ranks(_ranks, 2) == [True, True]


# ---------------------------------------------------------------------------------------------
# pretrain.py --sft

@pytest.fixture
def pretrain_main(monkeypatch):
    import importlib.util
    from test_pretrain import ROOT
    spec = importlib.util.spec_from_file_location("pretrain_sft", os.path.join(ROOT, "pretrain.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setenv("FORGE_BACKEND", "torch")

    def go(*args):
        saved = dict(os.environ)  # init_parallel sets RANK, MASTER_PORT, ...
        try:
            return mod.main([str(a) for a in args])
        finally:
            os.environ.clear()
            os.environ.update(saved)
    return go


def test_pretrain_sft_validates_the_held_out_split_and_exports(pretrain_main, hf_dir, sft_data,
                                                                tok, tools, tmp_path, capsys):
    """lr 0 keeps the weights, so each validation line must be the token mean of the valid
    rows the evaluation reads, computed here from the checkpoint's weights."""
    from test_pretrain import LINE, VALID
    from forge_engine.hf import load_pretrained
    ck = str(tmp_path / "ck")
    capsys.readouterr()
    rc = pretrain_main("--hf-checkpoint", hf_dir, "--sft", "--data-path", sft_data,
                       "--seq-length", 192, "--micro-batch-size", 2, "--global-batch-size", 4,
                       "--lr", 0.0, "--train-iters", 2, "--log-interval", 1, "--split",
                       "80,20,0", "--eval-interval", 2, "--eval-iters", 3, "--save", ck)
    out = capsys.readouterr().out
    assert rc == 0, out[-2000:]
    assert "sft train split: 120 samples packed into" in out
    assert "sft valid split: 30 samples packed into" in out
    assert len(LINE.findall(out)) == 2
    (v,) = [float(m.group(2)) for m in VALID.finditer(out)]
    valid = SFTDataset(sft_data, 192, "80,20,0", "valid", 1234, vocab_size=tok.vocab_size)
    model = load_pretrained(hf_dir, vocab_size=384, seq_length=192)
    stream = SampleStream(valid, 2, 1234)
    with torch.no_grad():
        sums = [masked_loss(model, next(stream), "cpu") for _ in range(3)]
    assert v == pytest.approx(sum(float(s) for s, _ in sums) / sum(float(c) for _, c in sums),
                              rel=2e-6)  # the line prints 7 digits
    out_dir = str(tmp_path / "hf")
    assert tools["export_hf"].main(["--load", ck, "--out", out_dir]) == 0
    back = load_pretrained(out_dir)
    assert back.config.vocab_size == 300 and os.path.isfile(os.path.join(out_dir,
                                                                          "tokenizer.json"))


def test_pretrain_sft_bad_inputs_are_one_line(pretrain_main, hf_dir, sft_data, tmp_path,
                                              tools, capsys):
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"text": "hello world"}) + "\n")
    assert tools["preprocess_data"].main(["--input", str(plain), "--output-prefix",
                                          str(tmp_path / "p"), "--tokenizer-type",
                                          "HuggingFaceTokenizer", "--tokenizer-model",
                                          hf_dir]) == 0
    tokens_only = str(tmp_path / "q")  # SFT tokens whose mask is missing
    for ext in (".bin", ".idx"):
        with open(sft_prefixes(sft_data)[0] + ext, "rb") as f:
            open(sft_prefixes(tokens_only)[0] + ext, "wb").write(f.read())
    common = ["--hf-checkpoint", hf_dir, "--train-iters", 1, "--seq-length", 32]
    cases = [
        (["--sft", "--data-path", tokens_only], "no loss mask file"),
        (["--sft", "--data-path", str(tmp_path / "p_text_document")], "no tokens file"),
        (["--sft", "--data-path", sft_data], "samples are longer than --seq-length 32"),
        (["--sft", "--mock-data"], "--sft trains on --data-path"),
        (["--sft-overlong", "drop", "--data-path", sft_data], "--sft-overlong applies to --sft"),
    ]
    for args, needle in cases:
        capsys.readouterr()
        rc = pretrain_main(*common, *args)
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), (args, err)
        assert needle in err[0], err[0]


def test_benchmark_runs_on_the_cpu(tmp_path, monkeypatch, capsys):
    """benchmarks/bench_sft.py --tiny: both layouts train on the same samples and objective
    (equal first losses), and the CSVs it writes hold every mode and step."""
    import csv
    import runpy
    from test_pretrain import ROOT
    monkeypatch.setattr(sys, "argv", ["bench_sft.py", "--tiny", "--modes",
                                      "packed-forge,padded-noforge", "--steps", "2", "--warmup",
                                      "1", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(os.path.join(ROOT, "benchmarks", "bench_sft.py"), run_name="__main__")
    assert done.value.code == 0
    modes = list(csv.DictReader(open(tmp_path / "sft_modes.csv")))
    assert [m["mode"] for m in modes] == ["packed-forge", "padded-noforge"]
    assert float(modes[0]["positions_per_sample_token"]) >= 1.0
    assert float(modes[0]["first_loss"]) == pytest.approx(float(modes[1]["first_loss"]),
                                                          rel=1e-5)
    assert len(list(csv.DictReader(open(tmp_path / "sft_losses.csv")))) == 4
