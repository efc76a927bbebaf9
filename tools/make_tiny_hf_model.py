"""Build a tiny Hugging Face Llama directory (random weights, a small byte-level BPE
tokenizer.json trained on a local corpus) for the README's worked example on the CPU:

    python tools/make_tiny_hf_model.py --input data/stdlib_text.jsonl --out tiny-llama

writes tiny-llama/{config.json, model.safetensors, tokenizer.json, tokenizer_config.json}: a
LlamaForCausalLM of 2 layers, width 64, llama3 rope scaling, tied embeddings (Llama-3.2's
form), and a tokenizer whose EOS `<|end_of_text|>` is the end-of-document id. Written by
forge_engine/hf.py (safetensors directly), so transformers is not needed here.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

EOS = "<|end_of_text|>"
BOS = "<|begin_of_text|>"


def train_tokenizer_dir(texts, out: str, vocab_size: int = 512) -> int:
    """Train a byte-level BPE on the texts (an iterable of str), write tokenizer.json and
    tokenizer_config.json into `out`; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS,
                   "eos_token": EOS, "model_max_length": 4096}, f, indent=2)
    return tok.get_vocab_size(with_added_tokens=True)


def main(argv=None) -> int:
    from forge_engine.hf import config_to_hf, save_pretrained
    from forge_engine.model import GPT, ModelConfig
    from forge_engine.tokenizer import iter_jsonl_texts
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="jsonl corpus to train the tokenizer on")
    p.add_argument("--json-key", default="text")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        vocab = train_tokenizer_dir(iter_jsonl_texts(a.input, a.json_key), a.out, a.vocab_size)
    except (ValueError, OSError) as e:
        print(f"make_tiny_hf_model.py: error: {e}", file=sys.stderr)
        return 2
    cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
                      num_query_groups=2, vocab_size=vocab, seq_length=512,
                      rope_theta=500000.0, norm_eps=1e-5, rope_scaling_factor=32.0,
                      rope_original_max_position=128)
    model = GPT(cfg, seed=a.seed)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(a.out, "tokenizer.json"))
    model.hf_config = dict(config_to_hf(cfg), bos_token_id=tok.token_to_id(BOS),
                           eos_token_id=tok.token_to_id(EOS))
    save_pretrained(model, a.out)
    print(f"wrote {a.out}: LlamaForCausalLM, {model.num_parameters()} parameters, vocab {vocab}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
