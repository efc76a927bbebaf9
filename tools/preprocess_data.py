"""Tokenize a jsonl corpus into Megatron indexed datasets (.bin/.idx), flag- and file-compatible
with Megatron-LM's tools/preprocess_data.py (document level; no --split-sentences):

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \\
        --output-prefix data/corpus --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model data/tok.model --append-eod --workers 2

writes data/corpus_text_document.bin/.idx (one pair per --json-keys key), which
`--data-path data/corpus_text_document` reads. The files are written by megatron-core's
IndexedDatasetBuilder, so Megatron-LM reads ours and we read its. --workers encodes in a
process pool; the output does not depend on it. The implementation is
forge_engine.data.preprocess (re-exported here).

Fine-tuning data (chat or instruction jsonl, forge_engine/sft.py):

    python tools/preprocess_data.py --input chat.jsonl --output-prefix data/chat --sft \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model hf_dir [--seq-length 2048 \
        --sft-overlong truncate]

writes data/chat_tokens_document.bin/.idx and data/chat_loss_mask_document.bin/.idx (uint8,
1 where the loss counts the token), which `pretrain.py --sft --data-path data/chat` reads, and
prints how many samples, tokens and counted tokens there are and what happened to samples
longer than --seq-length + 1 tokens.
"""
from __future__ import annotations

import argparse
import sys
import time

from forge_engine.data import preprocess
from forge_engine.sft import OVERLONG, describe_preprocessing, preprocess_sft
from forge_engine.tokenizer import TOKENIZER_TYPES, build_tokenizer

__all__ = ["preprocess", "main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="jsonl file, one document per line")
    p.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys to tokenize, one output dataset each (default: text)")
    p.add_argument("--output-prefix", required=True,
                   help="writes PREFIX_<key>_document.bin/.idx")
    p.add_argument("--tokenizer-type", required=True, help=f"one of {', '.join(TOKENIZER_TYPES)}")
    p.add_argument("--tokenizer-model", default=None,
                   help="SentencePiece .model file, or HF directory (tokenizer.json)")
    p.add_argument("--vocab-size", type=int, default=None, help="for NullTokenizer")
    p.add_argument("--append-eod", action="store_true", help="end every document with eod")
    p.add_argument("--workers", type=int, default=1, help="encoding processes (default: 1)")
    p.add_argument("--log-interval", type=int, default=10000, help="print every N documents")
    p.add_argument("--sft", action="store_true",
                   help="fine-tuning data: lines with 'messages' or 'prompt'/'response'; writes "
                        "PREFIX_tokens_document and PREFIX_loss_mask_document")
    p.add_argument("--seq-length", type=int, default=None,
                   help="--sft: the training row length; longer samples need --sft-overlong")
    p.add_argument("--sft-overlong", choices=OVERLONG, default=None,
                   help="--sft: samples over --seq-length + 1 tokens are cut to it (truncate) "
                        "or left out (drop); no default: a long sample without it is an error")
    args = p.parse_args(argv)
    t0 = time.time()
    try:
        if not args.sft:
            for flag, value in (("--seq-length", args.seq_length),
                                ("--sft-overlong", args.sft_overlong)):
                if value is not None:
                    raise ValueError(f"{flag} applies to --sft data")
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
        if args.sft:
            stats = preprocess_sft(args.input, args.output_prefix, tokenizer, args.seq_length,
                                   args.sft_overlong, args.workers, args.log_interval)
            print(describe_preprocessing(stats, args.seq_length, args.sft_overlong))
            prefixes = stats["prefixes"]
        else:
            prefixes = preprocess(args.input, args.json_keys, args.output_prefix, tokenizer,
                                  args.append_eod, args.workers, args.log_interval)
    except (ValueError, OSError) as e:
        print(f"preprocess_data.py: error: {e}", file=sys.stderr)
        return 2
    for prefix in prefixes:
        print(f"wrote {prefix}.bin and {prefix}.idx")
    print(f"done in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
