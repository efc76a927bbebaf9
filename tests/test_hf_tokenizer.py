"""HuggingFaceTokenizer: ids equal the tokenizers library's own encode, through
tools/preprocess_data.py and back out of the indexed dataset; the tiny HF model script."""
import json
import os

import pytest
import torch

from forge_engine.data import _indexed_dataset_module
from forge_engine.tokenizer import build_tokenizer
from test_data import load_tool

DOCS = ["def f(x):\n    return x + 1\n", "héllo wörld, ünïcode ✓", "print('done')\n" * 3]


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok"))
    load_tool("make_tiny_hf_model").train_tokenizer_dir(DOCS * 20, d, 300)
    return d


def test_preprocess_ids_equal_tokenizers_encode(tokdir, tmp_path):
    from tokenizers import Tokenizer
    ref = Tokenizer.from_file(os.path.join(tokdir, "tokenizer.json"))
    tok = build_tokenizer("HuggingFaceTokenizer", tokdir)
    assert tok.eod == ref.token_to_id("<|end_of_text|>")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    prep = load_tool("preprocess_data")
    assert prep.main(["--input", str(src), "--output-prefix", str(tmp_path / "o"),
                      "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokdir,
                      "--append-eod", "--workers", "2"]) == 0
    ds = _indexed_dataset_module().IndexedDataset(str(tmp_path / "o_text_document"))
    for i, text in enumerate(DOCS):
        want = ref.encode(text, add_special_tokens=False).ids + [tok.eod]
        assert list(map(int, ds[i])) == want
        assert tok.decode(want[:-1]) == text


def test_missing_tokenizer_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path))


def test_tiny_model_script_writes_what_transformers_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS * 20))
    out = str(tmp_path / "tiny")
    assert load_tool("make_tiny_hf_model").main(["--input", str(src), "--out", out,
                                                 "--vocab-size", "300"]) == 0
    m = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert m.config.tie_word_embeddings and m.config.vocab_size == 300
    from forge_engine.hf import load_pretrained
    g = load_pretrained(out)
    x = torch.randint(0, 300, (1, 17))
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(m(x[:, :-1]).logits[0], x[0, 1:],
                                                reduction="none")
        torch.testing.assert_close(g(x[:, :-1], labels=x[:, 1:])[0], ref, rtol=1e-5, atol=0)
