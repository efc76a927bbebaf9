"""Train a SentencePiece tokenizer on the texts of a jsonl file (byte-fallback BPE or unigram,
</s> as end-of-document, deterministic: one training thread). The model is what
`--tokenizer-type SentencePieceTokenizer --tokenizer-model PATH.model` loads.

    python tools/train_tokenizer.py --input corpus.jsonl [--json-key text] --vocab-size 512 \\
        --model-prefix data/my_tokenizer [--model-type bpe|unigram] [--max-train-bytes N]

writes PREFIX.model and PREFIX.vocab. The implementation is forge_engine.tokenizer.train_tokenizer
(re-exported here).
"""
from __future__ import annotations

import argparse
import sys
import time

from forge_engine.tokenizer import build_tokenizer, train_tokenizer

__all__ = ["train_tokenizer", "main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="jsonl file, one JSON object per line")
    p.add_argument("--json-key", default="text", help="the key holding the text (default: text)")
    p.add_argument("--vocab-size", type=int, required=True, help="number of pieces (>= 300)")
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
    p.add_argument("--max-train-bytes", type=int, default=None,
                   help="train on evenly spaced documents totalling about this many bytes")
    args = p.parse_args(argv)
    t0 = time.time()
    try:
        path = train_tokenizer(args.input, args.json_key, args.vocab_size, args.model_prefix,
                               args.model_type, args.max_train_bytes)
        tok = build_tokenizer("SentencePieceTokenizer", path)
    except (ValueError, OSError) as e:
        print(f"train_tokenizer.py: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} and {args.model_prefix}.vocab: {args.model_type}, vocab_size "
          f"{tok.vocab_size}, eod {tok.eod} ({time.time() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
