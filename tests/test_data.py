"""The data pipeline (forge_engine/tokenizer.py, forge_engine/data.py, tools/): tokenizers,
jsonl -> indexed dataset round trips and their errors, --split arithmetic against megatron-core's
own dataset builder, sample cutting, the mock dataset's determinism and learnability, resumable
batch streams, and the cached default corpus. CPU only; everything is written under tmp_path."""
import importlib.util
import json
import math
import os
import sysconfig
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from forge_engine.data import (IndexedGPTDataset, MockGPTDataset, SampleStream,
                               _indexed_dataset_module, padded_vocab_size, parse_split,
                               prepare_default_data, preprocess, split_ranges)
from forge_engine.tokenizer import NullTokenizer, build_tokenizer, train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def load_tool(name: str) -> types.ModuleType:
    """tools/<name>.py as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_jsonl(path: Path, records: list, raw_lines: dict | None = None) -> Path:
    lines = [json.dumps(r) for r in records]
    for i, line in (raw_lines or {}).items():
        lines.insert(i, line)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# a few KB of real text: pieces of three stdlib modules, cut into documents of ~1 KB
DOCS = [text[i:i + 1000]
        for name in ("textwrap.py", "json/decoder.py", "bisect.py")
        for text in [(STDLIB / name).read_text(encoding="utf-8")[:4000]]
        for i in range(0, 4000, 1000)]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> str:
    """A tiny SentencePiece model: 400 pieces trained on ~12 KB."""
    d = tmp_path_factory.mktemp("sp")
    corpus = write_jsonl(d / "corpus.jsonl", [{"text": t} for t in DOCS])
    return train_tokenizer(str(corpus), "text", 400, str(d / "tiny"))


@pytest.fixture(scope="module")
def sp(sp_model):
    return build_tokenizer("SentencePieceTokenizer", sp_model)


# ---------------------------------------------------------------------------------------------
# tokenizers

def test_sentencepiece_round_trip(sp, sp_model):
    assert sp.vocab_size == 400 and sp.eod == 2 and sp.name == "SentencePieceTokenizer"
    assert os.path.isfile(sp_model[:-len(".model")] + ".vocab")
    # identity normalization + byte fallback: any text survives, unseen characters included
    for text in DOCS[:3] + ["héllo wörld \U0001F642\t x  =  1\r\n\n", "", "    \n"]:
        ids = sp.encode(text)
        assert all(0 <= i < sp.vocab_size for i in ids) and sp.eod not in ids
        assert sp.decode(ids) == text
    # BPE merged something: characters alone would give 1 token per byte of this ASCII text;
    # 400 pieces leave ~60 merges after the 259 fixed and ~80 character pieces (measured 0.73)
    assert DOCS[0].isascii() and len(sp.encode(DOCS[0])) < 0.85 * len(DOCS[0])


def test_train_tokenizer_is_deterministic(tmp_path, sp_model):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"text": t} for t in DOCS])
    again = train_tokenizer(str(corpus), "text", 400, str(tmp_path / "again"))
    assert Path(again).read_bytes() == Path(sp_model).read_bytes()


def test_train_tokenizer_cli(tmp_path, capsys):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"body": t} for t in DOCS])
    tool = load_tool("train_tokenizer")
    assert tool.main(["--input", str(corpus), "--json-key", "body", "--vocab-size", "400",
                      "--model-prefix", str(tmp_path / "m"), "--model-type", "unigram"]) == 0
    assert "wrote" in capsys.readouterr().out and (tmp_path / "m.model").is_file()
    assert tool.main(["--input", str(tmp_path / "nope.jsonl"), "--vocab-size", "400",
                      "--model-prefix", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--input" in err and "nope.jsonl: no such file" in err


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", None, vocab_size=100)
    assert (tok.vocab_size, tok.eod, tok.name) == (100, 99, "NullTokenizer")
    assert tok.encode(" 5 17\n3 ") == [5, 17, 3]
    assert tok.decode([5, 17, 3]) == "5 17 3"
    with pytest.raises(ValueError, match="whitespace-separated integers"):
        tok.encode("5 x")
    with pytest.raises(ValueError, match=r"id 100 outside \[0, 100\)"):
        tok.encode("100")
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer("NullTokenizer", None)


def test_build_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="--tokenizer-type 'GPT2BPETokenizer' is not supported"):
        build_tokenizer("GPT2BPETokenizer", None)
    with pytest.raises(ValueError, match="--tokenizer-model is required"):
        build_tokenizer("SentencePieceTokenizer", None)
    missing = tmp_path / "missing.model"
    with pytest.raises(ValueError, match=f"--tokenizer-model {missing}: no such file"):
        build_tokenizer("SentencePieceTokenizer", str(missing))
    junk = tmp_path / "junk.model"
    junk.write_text("not a model")
    with pytest.raises(ValueError, match="not a SentencePiece model"):
        build_tokenizer("SentencePieceTokenizer", str(junk))


# ---------------------------------------------------------------------------------------------
# preprocess: jsonl -> indexed dataset

RECORDS = [{"text": DOCS[0], "title": "a"},
           {"text": ["first sentence. ", "second one."], "title": "b"},  # Megatron's sentence list
           {"text": "", "title": "empty"},                               # no tokens, no eod
           {"text": DOCS[5], "title": "ü"}]


def test_preprocess_round_trip(tmp_path, sp):
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS, raw_lines={2: "   "})  # a blank line: skipped
    prefixes = preprocess(str(src), ["text", "title"], str(tmp_path / "out" / "corpus"), sp,
                          append_eod=True)
    assert prefixes == [str(tmp_path / "out" / "corpus_text_document"),
                        str(tmp_path / "out" / "corpus_title_document")]
    IndexedDataset = _indexed_dataset_module().IndexedDataset
    for key, prefix in zip(["text", "title"], prefixes):
        ds = IndexedDataset(prefix)
        assert ds.index.dtype == np.uint16  # Megatron's choice for vocab < 65500
        # Megatron's layout: a sentence list gives one sequence per sentence, eod closes the
        # document's last sequence, the empty document has no sequence (and no eod)
        if key == "text":
            want = [sp.encode(DOCS[0]) + [sp.eod], sp.encode("first sentence. "),
                    sp.encode("second one.") + [sp.eod], sp.encode(DOCS[5]) + [sp.eod]]
            want_docs = [0, 1, 3, 3, 4]
        else:
            want = [sp.encode(r["title"]) + [sp.eod] for r in RECORDS]
            want_docs = [0, 1, 2, 3, 4]
        assert [ds[i].tolist() for i in range(len(ds))] == want
        assert ds.document_indices.tolist() == want_docs
    # without --append-eod
    (prefix,) = preprocess(str(src), ["text"], str(tmp_path / "noeod"), sp, append_eod=False)
    ds = IndexedDataset(prefix)  # kept alive: what it returns views its mmap
    assert ds[0].tolist() == sp.encode(DOCS[0])


def test_preprocess_workers_do_not_change_the_files(tmp_path, sp):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in DOCS * 3])
    (one,) = preprocess(str(src), ["text"], str(tmp_path / "w1"), sp, True, workers=1)
    (two,) = preprocess(str(src), ["text"], str(tmp_path / "w2"), sp, True, workers=2)
    for ext in (".bin", ".idx"):
        assert Path(one + ext).read_bytes() == Path(two + ext).read_bytes()


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_errors(tmp_path, sp, workers):
    out = str(tmp_path / "out")
    with pytest.raises(FileNotFoundError, match=r"^--input .*missing\.jsonl: no such file$"):
        preprocess(str(tmp_path / "missing.jsonl"), ["text"], out, sp, workers=workers)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "a"}, {"text": "b"}],
                      raw_lines={2: '{"text": "unterminated'})
    with pytest.raises(ValueError, match=r"^.*bad\.jsonl:3: not valid JSON \(.*\)$"):
        preprocess(str(bad), ["text"], out, sp, workers=workers)
    nokey = write_jsonl(tmp_path / "nokey.jsonl", [{"text": "a"}, {"body": "b"}])
    with pytest.raises(ValueError, match=r"nokey\.jsonl:2: no key 'text' \(--json-keys\); keys "
                                         r"present: 'body'$"):
        preprocess(str(nokey), ["text"], out, sp, workers=workers)
    notstr = write_jsonl(tmp_path / "notstr.jsonl", [{"text": 5}])
    with pytest.raises(ValueError, match=r"notstr\.jsonl:1: key 'text' holds int"):
        preprocess(str(notstr), ["text"], out, sp, workers=workers)
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "nokey.jsonl", "notstr.jsonl"]  # no debris


def test_preprocess_cli(tmp_path, capsys, sp_model):
    tool = load_tool("preprocess_data")
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "a b"}], raw_lines={1: "[1, 2"})
    argv = ["--input", str(src), "--json-keys", "text", "--output-prefix", str(tmp_path / "o"),
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model]
    assert tool.main(argv + ["--append-eod"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("preprocess_data.py: error:")
    assert ":2: not valid JSON" in err
    src.write_text('{"text": "3 4 5"}\n')
    assert tool.main(argv[:-4] + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "10",
                                  "--append-eod", "--workers", "2"]) == 0
    assert f"wrote {tmp_path / 'o'}_text_document.bin" in capsys.readouterr().out
    ds = _indexed_dataset_module().IndexedDataset(str(tmp_path / "o_text_document"))
    assert ds[0].tolist() == [3, 4, 5, 9]
    assert tool.main(argv[:-4] + ["--tokenizer-type", "Nope"]) == 2
    assert "--tokenizer-type 'Nope' is not supported" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# splits and samples

def test_split_arithmetic():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("99,1") == [0.99, 0.01, 0.0]
    assert split_ranges("969,30,1", 1000) == {"train": (0, 969), "valid": (969, 999),
                                              "test": (999, 1000)}
    # 10 docs by thirds: edges round(3.33) = 3 and round(6.67) = 7
    assert split_ranges("1,1,1", 10) == {"train": (0, 3), "valid": (3, 7), "test": (7, 10)}
    assert split_ranges("1,0,0", 7) == {"train": (0, 7), "valid": (7, 7), "test": (7, 7)}
    for bad in ("", "0,0,0", "1,2,3,4"):
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad)


def make_dataset(tmp_path, doc_lengths, vocab=50) -> str:
    """An indexed dataset whose document d holds tokens (d + t) % vocab, t = 0 .. len - 1."""
    tok = NullTokenizer(vocab)
    docs = [" ".join(str((d + t) % vocab) for t in range(n)) for d, n in enumerate(doc_lengths)]
    src = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in docs])
    (prefix,) = preprocess(str(src), ["text"], str(tmp_path / "docs"), tok, append_eod=False)
    return prefix


def test_split_matches_megatron_builder(tmp_path):
    """Our document ranges and samples per epoch against megatron-core's own GPTDataset built by
    BlendedMegatronDatasetBuilder on the same files and --split."""
    _indexed_dataset_module()  # imports megatron.core without its Apex / TE warnings
    from megatron.core.datasets.blended_megatron_dataset_builder import \
        BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    lengths = [int(n) for n in np.random.default_rng(0).integers(5, 60, size=333)]
    prefix = make_dataset(tmp_path, lengths)
    split, seq = "90,7,3", 16  # every split non-empty (Megatron loops forever on an empty one)
    tok = types.SimpleNamespace(eod=49, pad=-1, vocab_size=50, unique_identifiers={"t": "null"})
    cfg = GPTDatasetConfig(random_seed=1, sequence_length=seq, blend=([prefix], None), split=split,
                           tokenizer=tok, reset_position_ids=False, reset_attention_mask=False,
                           eod_mask_loss=False, path_to_cache=str(tmp_path / "cache"),
                           mid_level_dataset_surplus=0.005)
    built = BlendedMegatronDatasetBuilder(GPTDataset, [10, 10, 10], lambda: True, cfg).build()
    for which, theirs in zip(("train", "valid", "test"), built):
        ours = IndexedGPTDataset(prefix, seq, split, which, seed=1)
        begin, end = split_ranges(split, len(lengths))[which]
        assert theirs.indices.tolist() == list(range(begin, end))
        assert sorted(ours.doc_ids.tolist()) == list(range(begin, end))
        # Megatron: (epochs * tokens - 1) // seq samples; one epoch here
        assert len(ours) == (sum(lengths[begin:end]) - 1) // seq


def test_indexed_dataset_samples(tmp_path):
    lengths = [7, 1, 12, 30, 5, 9, 3, 20]
    prefix = make_dataset(tmp_path, lengths)
    seq = 6
    ds = IndexedGPTDataset(prefix, seq, split="1", which="train", seed=3)
    stream = np.concatenate([[(d + t) % 50 for t in range(lengths[d])] for d in ds.doc_ids])
    assert sorted(ds.doc_ids.tolist()) == list(range(len(lengths)))
    assert ds.doc_ids.tolist() != list(range(len(lengths)))  # seed 3 does shuffle
    assert len(ds) == (sum(lengths) - 1) // seq == ds.num_samples
    for i in range(len(ds)):
        s = ds[i]
        assert s.dtype == torch.long and s.shape == (seq + 1,)
        assert s.tolist() == stream[i * seq:i * seq + seq + 1].tolist()
        if i + 1 < len(ds):
            assert s[-1] == ds[i + 1][0]  # consecutive samples share one token
    same = IndexedGPTDataset(prefix, seq, split="1", which="train", seed=3)
    assert all(torch.equal(ds[i], same[i]) for i in range(len(ds)))
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_indexed_dataset_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--data-path .*nothing: .*nothing\.bin not found"):
        IndexedGPTDataset(str(tmp_path / "nothing"), 8, "1", "train", 0)
    prefix = make_dataset(tmp_path, [10] * 10)
    os.rename(prefix + ".idx", prefix + ".idx.bak")
    with pytest.raises(FileNotFoundError, match=r"docs_text_document\.idx not found"):
        IndexedGPTDataset(prefix, 8, "1", "train", 0)
    os.rename(prefix + ".idx.bak", prefix + ".idx")
    # "8,1,1" of 10 docs of 10 tokens: valid is 1 document, 10 tokens; 16 + 1 needed
    with pytest.raises(ValueError, match=r"the valid split of --split 8,1,1 has 10 tokens in 1 "
                                         r"documents; one sample needs seq_length \+ 1 = 17"):
        IndexedGPTDataset(prefix, 16, "8,1,1", "valid", 0)
    with pytest.raises(ValueError, match="has 0 tokens in 0 documents"):
        IndexedGPTDataset(prefix, 4, "1,0,0", "test", 0)
    with pytest.raises(ValueError, match="which must be one of train, valid, test"):
        IndexedGPTDataset(prefix, 4, "1", "validation", 0)


# ---------------------------------------------------------------------------------------------
# mock data

def test_mock_dataset_is_deterministic():
    a = MockGPTDataset(vocab_size=97, seq_length=33, seed=5, num_samples=20)
    b = MockGPTDataset(vocab_size=97, seq_length=33, seed=5, num_samples=20)
    c = MockGPTDataset(vocab_size=97, seq_length=33, seed=6, num_samples=20)
    assert len(a) == 20 and a[0].shape == (34,) and a[0].dtype == torch.long
    assert all(torch.equal(a[i], b[i]) for i in range(20))
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[0], a[1])
    # the seed picks the walks, not the chain: a validation set (seed + 1) is the same language
    assert torch.equal(a.successors, c.successors)
    assert not torch.equal(a.successors, MockGPTDataset(97, 33, 5, 20, chain_seed=1).successors)
    assert torch.equal(a[7], b[7]) and torch.equal(a[7], a[7])  # random access, order-free
    # sample i depends only on (seed, i), not on num_samples
    assert torch.equal(MockGPTDataset(97, 33, 5, 1000)[3], a[3])
    assert int(torch.stack([a[i] for i in range(20)]).max()) < 97


def test_mock_dataset_is_learnable():
    """A bigram model fitted on 300 samples predicts 50 samples of another seed (a validation
    set) at a cross-entropy near the chain's entropy ln(branching) = 1.39, far below the
    uniform ln(V) = 4.16."""
    V, k, seq = 64, 4, 64
    ds = MockGPTDataset(vocab_size=V, seq_length=seq, seed=0, num_samples=300, branching=k)
    valid = MockGPTDataset(vocab_size=V, seq_length=seq, seed=1, num_samples=50, branching=k)
    samples = torch.stack([ds[i] for i in range(300)] + [valid[i] for i in range(50)])
    prev, nxt = samples[:, :-1], samples[:, 1:]
    # structure: every transition is one of the k successors of its token
    assert (ds.successors[prev] == nxt.unsqueeze(-1)).any(-1).all()
    counts = torch.zeros(V, V)
    counts.index_put_((prev[:300].flatten(), nxt[:300].flatten()), torch.ones(300 * seq),
                      accumulate=True)
    probs = (counts + 0.01) / (counts + 0.01).sum(1, keepdim=True)  # add-0.01 smoothing
    nll = -probs[prev[300:], nxt[300:]].log().mean().item()
    # 300 * 64 transitions over 256 (token, successor) pairs: ~75 counts each, so the fitted
    # probabilities are within ~0.05 of 1/4 and the NLL within ~0.05 of ln 4
    assert abs(nll - math.log(k)) < 0.1, nll
    assert nll < 0.4 * math.log(V)


# ---------------------------------------------------------------------------------------------
# batch streams

class Ids(torch.utils.data.Dataset):
    """Sample i = [i, i, i]: batches show which samples were drawn."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((3,), i, dtype=torch.long)


def test_sample_stream_epochs():
    stream = SampleStream(Ids(10), micro_batch_size=4, seed=7)
    batches = [next(stream) for _ in range(5)]  # 20 samples: two full epochs
    assert batches[0].shape == (4, 3) and batches[0].dtype == torch.long
    drawn = torch.cat(batches)[:, 0].tolist()
    assert sorted(drawn[:10]) == list(range(10)) and sorted(drawn[10:]) == list(range(10))
    assert drawn[:10] != drawn[10:] and drawn[:10] != list(range(10))  # reshuffled each epoch
    assert stream.consumed == 20 and stream.epoch == 2
    again = SampleStream(Ids(10), micro_batch_size=4, seed=7)
    assert all(torch.equal(next(again), b) for b in batches)
    other = torch.cat([next(SampleStream(Ids(10), 4, seed=8)) for _ in range(3)])
    assert other[:, 0].tolist() != drawn[:12]


@pytest.mark.parametrize("k", [0, 1, 3, 7])
def test_sample_stream_resumes_exactly(k):
    data = MockGPTDataset(vocab_size=50, seq_length=8, seed=1, num_samples=13)
    full = SampleStream(data, micro_batch_size=3, seed=11)
    reference = [next(full) for _ in range(12)]  # crosses epoch ends mid-batch
    interrupted = SampleStream(data, micro_batch_size=3, seed=11)
    for _ in range(k):
        next(interrupted)
    state = interrupted.state_dict()
    assert state == {"consumed": 3 * k, "seed": 11}
    resumed = SampleStream(data, micro_batch_size=3, seed=0)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a checkpoint's round trip
    from_start = SampleStream(data, micro_batch_size=3, seed=11, start=3 * k)
    for want in reference[k:]:
        assert torch.equal(next(resumed), want)
        assert torch.equal(next(from_start), want)


def test_sample_stream_errors():
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1"):
        SampleStream(Ids(3), 0, seed=0)
    with pytest.raises(ValueError, match="at least one sample"):
        SampleStream(Ids(0), 1, seed=0)
    with pytest.raises(ValueError, match="lacks seed"):
        SampleStream(Ids(3), 1, seed=0).load_state_dict({"consumed": 3})


def test_padded_vocab_size():
    assert padded_vocab_size(512) == 512
    assert padded_vocab_size(50257) == 50304                    # GPT-2, Megatron's default 128
    assert padded_vocab_size(50257, 128, tp=8) == 51200         # multiple of 128 * 8
    assert padded_vocab_size(151936, 128, tp=4) == 152064       # Qwen3's 151936 -> 297 * 512
    assert padded_vocab_size(1000, 1) == 1000
    with pytest.raises(ValueError):
        padded_vocab_size(0)


# ---------------------------------------------------------------------------------------------
# the default corpus

def test_prepare_default_data_small_and_cached(tmp_path, capsys):
    d = tmp_path / "data"
    out = prepare_default_data(str(d), vocab_size=384, max_bytes=300_000,
                               tokenizer_train_bytes=100_000)
    assert out["prefix"] == str(d / "stdlib_text_document") and not out["cached"]
    first = capsys.readouterr().out
    assert "[prepare_default_data] corpus:" in first and "done in" in first
    tok = build_tokenizer("SentencePieceTokenizer", out["tokenizer_model"])
    assert tok.vocab_size == out["vocab_size"] == 384
    ds = _indexed_dataset_module().IndexedDataset(out["prefix"])
    docs = [json.loads(line) for line in (d / "stdlib.jsonl").read_text().splitlines()]
    assert len(ds) == len(docs) == out["num_docs"] > 3
    assert 250_000 < sum(len(x["text"].encode()) for x in docs) <= 300_000
    assert int(ds.sequence_lengths.sum()) == out["num_tokens"]
    for i in (0, len(ds) - 1):  # each document is its file's source, then eod
        assert ds[i].tolist() == tok.encode(docs[i]["text"]) + [tok.eod]
        assert docs[i]["text"] == (STDLIB / docs[i]["path"]).read_text(encoding="utf-8")
    assert not any("/test/" in x["path"] or x["path"].startswith("test/") for x in docs)
    # the training view of it
    train = IndexedGPTDataset(out["prefix"], 128, "969,30,1", "train", seed=1234)
    assert len(train) > 100 and int(next(SampleStream(train, 2, seed=0)).max()) < 384

    mtimes = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
    again = prepare_default_data(str(d), vocab_size=384, max_bytes=300_000,
                                 tokenizer_train_bytes=100_000)
    assert again["cached"] and {k: again[k] for k in out if k != "cached"} == \
        {k: out[k] for k in out if k != "cached"}
    assert "nothing to do" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == mtimes
    # a changed parameter rebuilds
    assert not prepare_default_data(str(d), vocab_size=448, max_bytes=300_000,
                                    tokenizer_train_bytes=100_000, verbose=False)["cached"]
    with pytest.raises(ValueError, match=r"--vocab-size 300 is too small: the byte, special and "
                                         r"character pieces of this text alone take \d+$"):
        prepare_default_data(str(d), vocab_size=300, max_bytes=300_000, verbose=False)


def test_indexed_files_that_do_not_fit_are_refused_at_open(tmp_path, monkeypatch):
    """Each way .idx and .bin can disagree is one line naming the file, before megatron-core
    maps them; a .bin of another dtype is never read; ids outside the tokenizer's vocabulary
    are found by one pass at open, or per sample for data above FULL_SCAN_BYTES."""
    import struct
    from forge_engine import data
    prefix = make_dataset(tmp_path, [10, 20, 30], vocab=50)
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    good_idx, good_bin = idx.read_bytes(), bin_.read_bytes()
    assert data.check_indexed_dataset(prefix, 50)["scanned"]
    S = 3
    ptr = 34 + 4 * S  # the sequence pointers; the document index follows them
    ids = np.frombuffer(good_bin, np.uint16)
    cases = [
        (idx, b"NOTANIDX!" + good_idx[9:], "is not a Megatron index"),
        (idx, good_idx[:9] + struct.pack("<Q", 2) + good_idx[17:], "index version 2"),
        (idx, good_idx[:17] + bytes([7]) + good_idx[18:], "float32"),
        (idx, good_idx[:17] + bytes([99]) + good_idx[18:], "dtype code 99"),
        (idx, good_idx[:-5], "truncated or corrupt"),
        (idx, good_idx[:ptr + 8] + struct.pack("<q", 6) + good_idx[ptr + 16:],
         "sequence 1 starts at byte 6, its lengths put it at 20"),
        (idx, good_idx[:-8] + struct.pack("<q", 2), "document index"),
        (bin_, good_bin[:-4], "describes 60 tokens of uint16, 120 bytes: truncated"),
        (bin_, ids.astype(np.int32).tobytes(), "that is 60 tokens of int32: the index does not "
                                               "belong to this data"),
        (bin_, good_bin + b"\0\0", "does not belong to this data"),
    ]
    for path, content, needle in cases:
        path.write_bytes(content)
        with pytest.raises(data.DataError) as e:
            IndexedGPTDataset(prefix, 4, "1", "train", 0, vocab_size=50)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"--data-path {prefix}: {path} ") and \
            needle in msg, msg
        idx.write_bytes(good_idx)
        bin_.write_bytes(good_bin)
    # ids run to 31 (document 2); the first at or above 20 is in sequence 1
    with pytest.raises(data.DataError, match=r"holds token id 31 \(sequence 1\), outside the "
                                             r"tokenizer's vocabulary \[0, 20\)"):
        IndexedGPTDataset(prefix, 4, "1", "train", 0, vocab_size=20)
    monkeypatch.setattr(data, "FULL_SCAN_BYTES", 0)  # "large" data: checked per sample
    ds = IndexedGPTDataset(prefix, 4, "1", "train", 0, vocab_size=20)
    with pytest.raises(data.DataError, match=r"train sample \d+\), outside"):
        [ds[i] for i in range(len(ds))]
    assert len(IndexedGPTDataset(prefix, 4, "1", "train", 0, vocab_size=50)) == len(ds)


def test_preprocess_names_the_line_that_is_not_utf8(tmp_path, sp):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"text": "a"}\n{"text": "\xff"}\n')
    with pytest.raises(ValueError, match=r"in\.jsonl:2: not UTF-8 text"):
        preprocess(str(src), ["text"], str(tmp_path / "o"), sp)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=r"--output-prefix .*afile/o: cannot create the "
                                         r"directory"):
        preprocess(str(src), ["text"], str(tmp_path / "afile" / "o"), sp)
