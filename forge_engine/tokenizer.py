"""Tokenizers, by Megatron-LM's `--tokenizer-type` names, and training a SentencePiece model.

    build_tokenizer("SentencePieceTokenizer", "data/stdlib_tokenizer.model")  # a trained .model
    build_tokenizer("NullTokenizer", None, vocab_size=512)                     # mock data

Every tokenizer has `.name`, `.vocab_size` (ids are 0 .. vocab_size - 1, before the model pads
its embedding with `forge_engine.data.padded_vocab_size`), `.eod` (the id appended after every
document by `tools/preprocess_data.py --append-eod`), `.encode(text) -> list[int]` and
`.decode(ids) -> str`. encode adds no BOS/EOS; documents are separated by `eod` only, as in
Megatron's GPT pretraining data.

`train_tokenizer` trains the byte-fallback BPE model that `tools/train_tokenizer.py` and
`forge_engine.data.prepare_default_data` use: identity normalization (no NFKC, spaces, tabs and
newlines are kept, so decode(encode(text)) == text for any UTF-8 text), `</s>` as eos = eod,
and one training thread, which makes the model a function of the input bytes (SentencePiece's
multi-threaded trainer is not deterministic).

The jsonl format both tools read (`read_json_line`): one JSON object per line, text under the
`--json-keys` keys (a string, or as in Megatron a list of sentence strings); blank lines skipped.
"""
from __future__ import annotations

import io
import json
import math
import os
import re
from typing import Iterator, Protocol

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "NullTokenizer",
                   "HuggingFaceTokenizer")


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    name: str
    vocab_size: int
    eod: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class SentencePieceTokenizer:
    """A SentencePiece `.model` file; eod is the model's eos piece (`</s>`)."""

    def __init__(self, model_path: str, name: str = "SentencePieceTokenizer"):
        import sentencepiece as spm

        if not model_path:
            raise ValueError(f"--tokenizer-model is required for --tokenizer-type {name} (a "
                             "SentencePiece .model file; train one with tools/train_tokenizer.py)")
        if not os.path.isfile(model_path):
            raise ValueError(f"--tokenizer-model {model_path}: no such file")
        self.model_path = model_path
        self.name = name
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(model_path)
        except (OSError, RuntimeError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"--tokenizer-model {model_path}: not a SentencePiece model ({why})"
                             ) from None
        self.vocab_size: int = self._sp.GetPieceSize()
        eos = self._sp.eos_id()
        if eos < 0:
            raise ValueError(f"--tokenizer-model {model_path} has no eos piece, so no "
                             "end-of-document id; retrain it with tools/train_tokenizer.py "
                             "(which defines </s>)")
        self.eod: int = eos

    def encode(self, text: str) -> list[int]:
        return self._sp.EncodeAsIds(text)

    def decode(self, ids: list[int]) -> str:
        return self._sp.DecodeIds([int(i) for i in ids])

    def __reduce__(self):  # pickled by path, for multiprocessing workers
        return (SentencePieceTokenizer, (self.model_path, self.name))

    def __repr__(self) -> str:
        return f"{self.name}({self.model_path!r}, vocab_size={self.vocab_size}, eod={self.eod})"


class NullTokenizer:
    """Text is whitespace-separated integer ids ("5 17 3"); eod = vocab_size - 1. For mock data
    and tests (Megatron's NullTokenizer puts eod at vocab_size instead and reports vocab_size + 1;
    here the given vocab_size is the total and eod is its last id)."""

    def __init__(self, vocab_size: int | None):
        if vocab_size is None or int(vocab_size) < 2:
            raise ValueError("--vocab-size must be an integer >= 2 for --tokenizer-type "
                             f"NullTokenizer, got {vocab_size}")
        self.name = "NullTokenizer"
        self.vocab_size: int = int(vocab_size)
        self.eod: int = self.vocab_size - 1

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            try:
                i = int(word)
            except ValueError:
                raise ValueError("NullTokenizer encodes whitespace-separated integers, got "
                                 f"{word[:40]!r}") from None
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"NullTokenizer: id {i} outside [0, {self.vocab_size}) "
                                 "(--vocab-size)")
            ids.append(i)
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def __reduce__(self):
        return (NullTokenizer, (self.vocab_size,))

    def __repr__(self) -> str:
        return f"NullTokenizer(vocab_size={self.vocab_size}, eod={self.eod})"


class HuggingFaceTokenizer:
    """A Hugging Face tokenizer directory (tokenizer.json, read by the `tokenizers` library;
    tokenizer_config.json names the eos token): eod is the tokenizer's EOS. encode adds no
    special tokens (documents are separated by eod only). render_chat(messages) renders a
    conversation with the directory's chat template (through transformers' fast tokenizer,
    imported on first use) for fine-tuning data (forge_engine/sft.py)."""

    def __init__(self, path: str, name: str = "HuggingFaceTokenizer"):
        if not path:
            raise ValueError(f"--tokenizer-model is required for --tokenizer-type {name} (a "
                             "Hugging Face directory with tokenizer.json)")
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise ValueError(f"--tokenizer-model {path}: no tokenizer.json there")
        from tokenizers import Tokenizer as _Tok
        try:
            self._tok = _Tok.from_file(file)
        except Exception as e:
            why = (str(e).splitlines() or [type(e).__name__])[0][:200]
            raise ValueError(f"--tokenizer-model {path}: not a tokenizer.json ({why})") from None
        self.path, self.name = path, name
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        eos = self._eos_token(os.path.dirname(file))
        eid = self._tok.token_to_id(eos) if eos is not None else None
        if eid is None:
            raise ValueError(f"--tokenizer-model {path}: no EOS token (tokenizer_config.json's "
                             f"eos_token {eos!r} is not in the vocabulary), so no "
                             "end-of-document id")
        self.eod: int = eid
        self._fast = None

    @staticmethod
    def _eos_token(d: str) -> str | None:
        cfg = os.path.join(d, "tokenizer_config.json")
        if not os.path.isfile(cfg):
            return None
        with open(cfg, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
        return eos.get("content") if isinstance(eos, dict) else eos

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def has_chat_template(self) -> bool:
        """Whether the directory carries a chat template (tokenizer_config.json's
        chat_template, or a chat_template.jinja file beside it), read without transformers."""
        d = self.path if os.path.isdir(self.path) else os.path.dirname(self.path)
        if os.path.isfile(os.path.join(d, "chat_template.jinja")):
            return True
        cfg = os.path.join(d, "tokenizer_config.json")
        if not os.path.isfile(cfg):
            return False
        with open(cfg, encoding="utf-8") as f:
            return bool(json.load(f).get("chat_template"))

    def _chat(self):
        if self._fast is None:  # transformers renders the template exactly as at inference
            from transformers import PreTrainedTokenizerFast
            self._fast = PreTrainedTokenizerFast.from_pretrained(
                self.path if os.path.isdir(self.path) else os.path.dirname(self.path))
        if not getattr(self._fast, "chat_template", None):
            raise ValueError(f"--tokenizer-model {self.path} has no chat_template")
        return self._fast

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The text of `messages` ([{"role": ..., "content": ...}, ...]) rendered with the
        directory's chat template; add_generation_prompt appends the opening of an assistant
        turn (what a model is given before it answers)."""
        return self._chat().apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=add_generation_prompt)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """(ids, start character of each token in text): encode(text) and where each token
        begins, so a span of the text (an assistant turn) can be mapped to its tokens."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, [a for a, _ in enc.offsets]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False
                            ) -> list[int]:
        """Token ids of `messages` rendered with the directory's chat template
        (render_chat, then encode)."""
        return self.encode(self.render_chat(messages, add_generation_prompt))

    def __reduce__(self):
        return (HuggingFaceTokenizer, (self.path, self.name))

    def __repr__(self) -> str:
        return f"{self.name}({self.path!r}, vocab_size={self.vocab_size}, eod={self.eod})"


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None,
                    vocab_size: int | None = None) -> Tokenizer:
    """The tokenizer named by Megatron's --tokenizer-type. SentencePieceTokenizer and
    GPTSentencePieceTokenizer (the same here: encode adds no BOS/EOS) read --tokenizer-model;
    NullTokenizer needs --vocab-size."""
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer"):
        return SentencePieceTokenizer(tokenizer_model, name=tokenizer_type)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    raise ValueError(f"--tokenizer-type {tokenizer_type!r} is not supported; choose one of "
                     f"{', '.join(TOKENIZER_TYPES)}")


# ---------------------------------------------------------------------------------------------
# jsonl input (shared by tools/train_tokenizer.py and tools/preprocess_data.py)

def json_object(line: str, where: str) -> dict:
    """One jsonl line parsed as a JSON object; anything else is one line naming `where`."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def read_json_line(line: str, lineno: int, keys: list[str],
                   path: str) -> dict[str, list[str]] | None:
    """The texts under `keys` of one jsonl line as lists of sentences (a string is one sentence;
    None for a blank line). Errors name the file and line."""
    if not line.strip():
        return None
    obj = json_object(line, f"{path}:{lineno}")
    out = {}
    for key in keys:
        if key not in obj:
            raise ValueError(f"{path}:{lineno}: no key {key!r} (--json-keys); keys present: "
                             f"{', '.join(map(repr, obj)) or 'none'}")
        value = obj[key]
        if isinstance(value, str):
            value = [value]
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise ValueError(f"{path}:{lineno}: key {key!r} holds {type(obj[key]).__name__}, "
                             "expected a string or a list of strings")
        out[key] = value
    return out


def check_input_file(path: str) -> None:
    """One-line error for a missing --input file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--input {path}: no such file")


def iter_jsonl_texts(path: str, key: str, every: int = 1) -> Iterator[str]:
    """Texts under `key`, from every `every`-th non-blank line of a jsonl file."""
    check_input_file(path)
    n = 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            rec = read_json_line(line, lineno, [key], path)
            if rec is None:
                continue
            if n % every == 0:
                yield "".join(rec[key])
            n += 1


# ---------------------------------------------------------------------------------------------
# training a SentencePiece model

_MAX_SENTENCE_BYTES = 4000  # SentencePiece drops training "sentences" over 4192 bytes


def _training_chunks(texts: Iterator[str]) -> Iterator[str]:
    """Documents cut at line ends into pieces under SentencePiece's sentence limit, newlines kept
    (so "\\n" and indentation become pieces); a longer single line is cut every 1000 chars."""
    for text in texts:
        buf, nbytes = [], 0
        for line in text.splitlines(keepends=True):
            size = len(line.encode("utf-8"))
            if size > _MAX_SENTENCE_BYTES:
                if buf:
                    yield "".join(buf)
                    buf, nbytes = [], 0
                for i in range(0, len(line), 1000):  # 1000 chars <= 4000 UTF-8 bytes
                    yield line[i:i + 1000]
                continue
            if nbytes + size > _MAX_SENTENCE_BYTES and buf:
                yield "".join(buf)
                buf, nbytes = [], 0
            buf.append(line)
            nbytes += size
        if buf:
            yield "".join(buf)


def train_tokenizer(jsonl_path: str, json_key: str, vocab_size: int, model_prefix: str,
                    model_type: str = "bpe", max_train_bytes: int | None = None) -> str:
    """Train a byte-fallback SentencePiece model on the `json_key` texts of a jsonl file and
    write MODEL_PREFIX.model and MODEL_PREFIX.vocab; returns the .model path.

    Pieces: 0 <unk>, 1 <s>, 2 </s> (eos = eod), 3..258 the 256 byte pieces, then learned ones,
    so vocab_size must exceed 259 plus the distinct characters kept. max_train_bytes: train on
    evenly spaced documents (every k-th line) totalling about that many bytes of the file."""
    import sentencepiece as spm

    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"--model-type must be bpe or unigram, got {model_type!r}")
    if vocab_size < 260:
        raise ValueError(f"--vocab-size {vocab_size} is too small: byte fallback needs 256 byte "
                         "pieces + <unk>, <s>, </s> + learned pieces (use >= 300)")
    check_input_file(jsonl_path)
    every = 1
    if max_train_bytes:
        every = max(1, math.ceil(os.path.getsize(jsonl_path) / max_train_bytes))
    chunks = _training_chunks(iter_jsonl_texts(jsonl_path, json_key, every))
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.Train(
            sentence_iterator=chunks, model_writer=model, vocab_size=vocab_size,
            model_type=model_type, normalization_rule_name="identity",
            remove_extra_whitespaces=False, add_dummy_prefix=False,
            allow_whitespace_only_pieces=True, split_digits=True, byte_fallback=True,
            character_coverage=0.9999, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            num_threads=1, max_sentence_length=4192, minloglevel=2)
    except RuntimeError as e:
        msg = " ".join(str(e).split()) or "RuntimeError"
        need = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", msg)
        if need:
            msg = (f"--vocab-size {vocab_size} is too small: the byte, special and character "
                   f"pieces of this text alone take {need.group(2)}")
        raise ValueError(f"SentencePiece training on {jsonl_path} failed: {msg}") from None
    model_path = model_prefix + ".model"
    os.makedirs(os.path.dirname(os.path.abspath(model_path)), exist_ok=True)
    with open(model_path, "wb") as f:
        f.write(model.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    with open(model_prefix + ".vocab", "w", encoding="utf-8") as f:
        for i in range(sp.GetPieceSize()):
            f.write(f"{sp.IdToPiece(i)}\t{sp.GetScore(i)}\n")
    return model_path
