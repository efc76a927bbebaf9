"""Build the default training corpus, no download needed: this Python's standard library
sources as jsonl, a SentencePiece BPE tokenizer trained on them, and the indexed dataset
(--append-eod). Cached: a second run with the same Python, stdlib and parameters does nothing.

    python tools/prepare_default_data.py [--data-dir data] [--vocab-size 512] [--max-bytes N]

then train with --data-path data/stdlib_text_document --tokenizer-type SentencePieceTokenizer
--tokenizer-model data/stdlib_tokenizer.model. See forge_engine.data.prepare_default_data.
"""
from __future__ import annotations

import argparse
import sys

from forge_engine.data import prepare_default_data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default="data", help="output directory (default: data)")
    p.add_argument("--vocab-size", type=int, default=512, help="tokenizer pieces (default: 512)")
    p.add_argument("--max-bytes", type=int, default=16_000_000,
                   help="cap on the corpus text, in bytes (default: 16e6, the whole stdlib)")
    p.add_argument("--tokenizer-train-bytes", type=int, default=4_000_000,
                   help="text the tokenizer trains on (default: 4e6)")
    p.add_argument("--workers", type=int, default=1, help="encoding processes (default: 1)")
    args = p.parse_args(argv)
    try:
        out = prepare_default_data(args.data_dir, args.vocab_size, args.max_bytes,
                                   args.tokenizer_train_bytes, args.workers)
    except (ValueError, OSError) as e:
        print(f"prepare_default_data.py: error: {e}", file=sys.stderr)
        return 2
    print(f"--data-path {out['prefix']} --tokenizer-type SentencePieceTokenizer "
          f"--tokenizer-model {out['tokenizer_model']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
