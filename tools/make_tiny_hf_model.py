"""Build a tiny Hugging Face Llama directory (random weights, a small byte-level BPE
tokenizer.json trained on a local corpus) for the README's worked example on the CPU:

    python tools/make_tiny_hf_model.py --input data/stdlib_text.jsonl --out tiny-llama

writes tiny-llama/{config.json, model.safetensors, tokenizer.json, tokenizer_config.json}: a
LlamaForCausalLM of 2 layers, width 64, llama3 rope scaling, tied embeddings (Llama-3.2's
form), and a tokenizer whose EOS `<|end_of_text|>` is the end-of-document id and whose
chat_template is ChatML (`<|im_start|>role ... <|im_end|>`), for `--sft` data. --input may be
a chat file (tools/make_tiny_chat_data.py): its messages' contents train the tokenizer. Written by
forge_engine/hf.py (safetensors directly), so transformers is not needed here.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

EOS = "<|end_of_text|>"
BOS = "<|begin_of_text|>"
TURN_START, TURN_END = "<|im_start|>", "<|im_end|>"
# ChatML turns: "<|im_start|>{role}\n{content}<|im_end|>\n"; a generation prompt opens an
# assistant turn. Fine-tuning masks everything but each assistant turn's content and its
# <|im_end|> (forge_engine/sft.py), so the model learns to answer and to stop.
CHAT_TEMPLATE = ("{% for message in messages %}{{ '" + TURN_START + "' + message['role'] + "
                 "'\\n' + message['content'] + '" + TURN_END + "' + '\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '" + TURN_START + "assistant\\n' }}"
                 "{% endif %}")


def train_tokenizer_dir(texts, out: str, vocab_size: int = 512) -> int:
    """Train a byte-level BPE on the texts (an iterable of str), write tokenizer.json and
    tokenizer_config.json into `out`; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=[BOS, EOS, TURN_START, TURN_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS,
                   "eos_token": EOS, "model_max_length": 4096,
                   "chat_template": CHAT_TEMPLATE}, f, indent=2)
    return tok.get_vocab_size(with_added_tokens=True)


def corpus_texts(path: str, key: str):
    """The texts of a jsonl file: each line's `key` string, or for chat data (no `key`) the
    contents of its messages, or its prompt and response."""
    from forge_engine.tokenizer import check_input_file
    check_input_file(path)
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if isinstance(obj.get(key), str):
                yield obj[key]
            elif isinstance(obj.get("messages"), list):
                yield "\n".join(str(m.get("content", "")) for m in obj["messages"]
                                if isinstance(m, dict))
            elif "prompt" in obj or "response" in obj:
                yield f"{obj.get('prompt', '')}\n{obj.get('response', '')}"
            else:
                raise ValueError(f"{path}:{lineno}: no {key!r} text, messages or "
                                 f"prompt/response")


def main(argv=None) -> int:
    from forge_engine.hf import config_to_hf, save_pretrained
    from forge_engine.model import GPT, ModelConfig
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="jsonl corpus to train the tokenizer on")
    p.add_argument("--json-key", default="text",
                   help="text key (chat lines: their messages or prompt/response)")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        vocab = train_tokenizer_dir(corpus_texts(a.input, a.json_key), a.out, a.vocab_size)
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
