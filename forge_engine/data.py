"""The data pipeline: jsonl text -> Megatron indexed dataset (.bin/.idx) -> samples -> batches.

    preprocess(...)              jsonl -> PREFIX_<key>_document.bin/.idx, written by megatron-core's
                                 IndexedDatasetBuilder (tools/preprocess_data.py is its CLI), so
                                 data preprocessed by Megatron-LM trains here unchanged and back
    IndexedGPTDataset            one split (--split "969,30,1") of an indexed dataset, cut into
                                 samples of seq_length + 1 tokens
    MockGPTDataset               learnable synthetic tokens (a sparse Markov chain) for --mock-data
    SampleStream                 infinite, resumable micro-batches [b, seq_length + 1] over
                                 per-epoch shuffles of a dataset
    padded_vocab_size            the embedding rows the model needs (Megatron's vocab padding)
    prepare_default_data         the default corpus, no download: this Python's stdlib sources

A sample is seq_length + 1 consecutive tokens: tokens = sample[:-1], labels = sample[1:], both
[seq_length]. Samples are cut from one token stream without overlap except that the last token
of sample i is the first of sample i + 1 (Megatron's GPTDataset with add_extra_token_to_sequence),
so a stream of T tokens gives (T - 1) // seq_length samples. Documents are separated in the
stream by the eod token that `--append-eod` wrote; no attention mask is built here.

As in Megatron's GPTDataset, the unit that --split divides is a sequence of the indexed dataset;
for document-level data (what preprocess writes from string values) that is one document.

megatron-core is imported lazily (its import takes seconds and warns about Transformer Engine
and Apex, which only its model code uses), so importing this module is cheap.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import multiprocessing
import os
import random
import re
import struct
import sys
import sysconfig
import time
import warnings
from typing import Iterator

import numpy as np
import torch

from forge_engine.tokenizer import (Tokenizer, build_tokenizer, check_input_file, read_json_line,
                                    train_tokenizer)

SPLITS = ("train", "valid", "test")


class DataError(ValueError):
    """Data that cannot be trained on as it is; the message is one line naming the file."""


def _indexed_dataset_module():
    """megatron.core.datasets.indexed_dataset, imported without the warnings that importing
    megatron.core prints (Transformer Engine / Apex fallbacks, deprecations: its model code)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def _mix64(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 finalizer over each), for torch.Generator seeds
    that depend on (seed, index) or (seed, epoch) without collisions between nearby pairs."""
    x = 0x9E3779B97F4A7C15
    for v in values:
        x = (x ^ (int(v) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 29
    return x >> 1


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron's --make-vocab-size-divisible-by: round vocab_size up to a multiple of
    divisible_by * tp, so every tensor-parallel rank holds an equal, aligned shard [V / tp, h]."""
    if vocab_size < 1 or divisible_by < 1 or tp < 1:
        raise ValueError(f"padded_vocab_size needs positive sizes, got vocab_size={vocab_size}, "
                         f"divisible_by={divisible_by}, tp={tp}")
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


# ---------------------------------------------------------------------------------------------
# splits

def parse_split(split: str) -> list[float]:
    """Megatron's --split string ("969,30,1", "99,1", "1/0/0") -> normalized [train, valid, test]
    weights; missing trailing weights are 0."""
    weights = [float(w) for w in re.findall(r"[.0-9]+", split)]
    if not weights or len(weights) > 3 or sum(weights) <= 0:
        raise ValueError(f"--split {split!r}: expected up to 3 non-negative weights with a "
                         "positive sum, e.g. 969,30,1")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return [w / total for w in weights]


def split_ranges(split: str, num_docs: int) -> dict[str, tuple[int, int]]:
    """Contiguous document ranges [begin, end) of train, valid, test: the cumulative normalized
    weights times num_docs, rounded (as Megatron's BlendedMegatronDatasetBuilder does)."""
    weights = parse_split(split)
    bounds = [0.0]
    for w in weights:
        bounds.append(bounds[-1] + w)
    edges = [int(round(b * num_docs)) for b in bounds]
    edges[-1] = num_docs
    return {name: (edges[i], edges[i + 1]) for i, name in enumerate(SPLITS)}


# ---------------------------------------------------------------------------------------------
# preprocessing: jsonl -> indexed dataset

_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _encode_line(job: tuple[int, str, list[str], str, bool]
                 ) -> dict[str, tuple[list[int], list[int]]] | None:
    """One jsonl line -> {key: (token ids, sequence lengths)}; None for a blank line. As in
    Megatron's Encoder: each sentence of a list is encoded alone and is one sequence, empty ones
    are dropped, and eod extends the last sequence (an empty document gets no eod)."""
    lineno, line, keys, path, append_eod = job
    record = read_json_line(line, lineno, keys, path)
    if record is None:
        return None
    out = {}
    for key, sentences in record.items():
        ids, lengths = [], []
        for sentence in sentences:
            sentence_ids = _worker_tokenizer.encode(sentence)
            if sentence_ids:
                ids.extend(sentence_ids)
                lengths.append(len(sentence_ids))
        if append_eod and ids:
            ids.append(_worker_tokenizer.eod)
            lengths[-1] += 1
        out[key] = (ids, lengths)
    return out


@contextlib.contextmanager
def indexed_writers(prefixes: list[str], dtypes: list):
    """IndexedDatasetBuilders, one per PREFIX, writing under temporary names. When the block
    ends normally each is finalized and its .bin/.idx renamed into place; on any exception the
    partial files are removed, so a failed run leaves no dataset that looks complete."""
    idx_mod = _indexed_dataset_module()
    tmp = [p + f".tmp{os.getpid()}" for p in prefixes]
    builders = [idx_mod.IndexedDatasetBuilder(t + ".bin", dtype=d) for t, d in zip(tmp, dtypes)]
    try:
        yield builders
        for t, p, builder in zip(tmp, prefixes, builders):
            builder.finalize(t + ".idx")
            os.replace(t + ".bin", p + ".bin")
            os.replace(t + ".idx", p + ".idx")
    except BaseException:
        for t, builder in zip(tmp, builders):
            builder.data_file.close()
            for ext in (".bin", ".idx"):
                if os.path.exists(t + ext):
                    os.remove(t + ext)
        raise


def preprocess(input: str, json_keys: list[str], output_prefix: str, tokenizer: Tokenizer,
               append_eod: bool = False, workers: int = 1, log_interval: int = 0) -> list[str]:
    """Tokenize the `json_keys` texts of a jsonl file into one indexed dataset per key, named as
    Megatron-LM's tools/preprocess_data.py names them: {output_prefix}_{key}_document.bin/.idx.
    One document per line (token dtype: uint16 below 65500 ids, else int32). workers > 1 encodes
    in a multiprocessing.Pool; results are written in input order, so the files do not depend
    on workers. Files are written under temporary names and renamed at the end, so an error
    leaves no partial dataset. Returns the prefixes, in json_keys order."""
    check_input_file(input)
    idx_mod = _indexed_dataset_module()
    if not json_keys:
        raise ValueError("--json-keys needs at least one key")
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--output-prefix {output_prefix}: cannot create the directory "
                         f"{out_dir} ({e.strerror})") from None
    prefixes = [f"{output_prefix}_{key}_document" for key in json_keys]
    dtype = idx_mod.DType.optimal_dtype(tokenizer.vocab_size)

    def jobs() -> Iterator[tuple]:
        with open(input, "rb") as f:  # decoded line by line, so an error can name its line
            for lineno, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{input}:{lineno}: not UTF-8 text ({e.reason} at byte "
                                     f"{e.start} of the line)") from None
                yield (lineno, line, list(json_keys), input, append_eod)

    pool = None
    try:
        with indexed_writers(prefixes, [dtype] * len(prefixes)) as builders:
            if workers == 1:
                _init_worker(tokenizer)
                results = map(_encode_line, jobs())
            else:
                pool = multiprocessing.Pool(workers, initializer=_init_worker,
                                            initargs=(tokenizer,))
                results = pool.imap(_encode_line, jobs(), chunksize=16)
            t0, ndocs, ntokens = time.time(), 0, 0
            for rec in results:
                if rec is None:
                    continue
                for key, builder in zip(json_keys, builders):
                    ids, lengths = rec[key]
                    builder.add_document(ids, lengths)
                    ntokens += len(ids)
                ndocs += 1
                if log_interval and ndocs % log_interval == 0:
                    print(f"[preprocess] {ndocs} documents, {ntokens} tokens, "
                          f"{ntokens / max(time.time() - t0, 1e-9):.0f} tokens/s", flush=True)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    return prefixes


# ---------------------------------------------------------------------------------------------
# checks of an indexed dataset's files, before any sample is read

_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEADER = 34  # magic 9, version 8, dtype code 1, sequence count 8, document count 8
_IDX_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
               7: np.float32, 8: np.uint16}  # megatron-core's DType codes
FULL_SCAN_BYTES = 256 << 20  # .bin files up to this size get one pass over every token id


def check_indexed_dataset(prefix: str, vocab_size: int | None = None,
                          full_scan_bytes: int | None = None) -> dict:
    """Check PREFIX.idx against itself and against PREFIX.bin, on the host and cheaply, before
    megatron-core's reader maps them: the header (magic, version, an integer token dtype), the
    index's size for its counts, sequence pointers that follow from the lengths, a document
    index from 0 to the sequence count, and a .bin of exactly the bytes the index describes (a
    .bin of another dtype than the index names fails here, so no sample is ever read with the
    wrong dtype). With vocab_size, a .bin of at most full_scan_bytes (default FULL_SCAN_BYTES)
    is read once for its smallest and largest id; larger ones are checked sample by sample as
    they are read (IndexedGPTDataset). Raises DataError (one line: the flag, the file, the problem).
    Returns {"dtype", "num_sequences", "num_tokens", "scanned"}."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    if full_scan_bytes is None:
        full_scan_bytes = FULL_SCAN_BYTES

    def bad(path: str, what: str):
        raise DataError(f"--data-path {prefix}: {path} {what}")

    size = os.path.getsize(idx)
    with open(idx, "rb") as f:
        head = f.read(_IDX_HEADER)
    if len(head) < _IDX_HEADER or head[:9] != _IDX_MAGIC:
        bad(idx, f"is not a Megatron index: it does not start with the header "
                 f"{_IDX_MAGIC!r} (corrupt, or not written by preprocess_data.py)")
    version, code, num_seq, num_doc = struct.unpack("<QBQQ", head[9:])
    if version != 1:
        bad(idx, f"has index version {version}; this reader knows version 1")
    dtype = _IDX_DTYPES.get(code)
    if dtype is None or np.dtype(dtype).kind == "f":
        bad(idx, f"names token dtype code {code} "
                 f"({np.dtype(dtype).name if dtype else 'unknown'}); token ids need an integer "
                 f"dtype, codes 1-5 and 8")
    want = _IDX_HEADER + num_seq * 4 + num_seq * 8 + num_doc * 8
    if size not in (want, want + num_seq):  # + one mode byte per sequence: multimodal
        bad(idx, f"is {size} bytes, but its header's {num_seq} sequences and {num_doc} "
                 f"document entries need {want}: truncated or corrupt")
    with open(idx, "rb") as f:
        f.seek(_IDX_HEADER)
        lengths = np.fromfile(f, np.int32, num_seq)
        pointers = np.fromfile(f, np.int64, num_seq)
        docs = np.fromfile(f, np.int64, num_doc)
    itemsize = np.dtype(dtype).itemsize
    if num_seq and lengths.min() < 0:
        bad(idx, f"holds a negative sequence length (sequence {int(np.argmax(lengths < 0))}): "
                 f"corrupt")
    starts = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]) * itemsize
    if not np.array_equal(pointers, starts):
        first = int(np.argmax(pointers != starts))
        bad(idx, f"is corrupt: sequence {first} starts at byte {int(pointers[first])}, its "
                 f"lengths put it at {int(starts[first])}")
    if num_doc < 1 or docs[0] != 0 or docs[-1] != num_seq or np.any(np.diff(docs) < 0):
        bad(idx, f"is corrupt: its document index does not run from 0 to the sequence count "
                 f"{num_seq} in order")
    num_tokens = int(lengths.sum(dtype=np.int64))
    need, have = num_tokens * itemsize, os.path.getsize(bin_)
    if have != need:
        fits = [np.dtype(t).name for t in _IDX_DTYPES.values() if np.dtype(t).kind != "f"
                and np.dtype(t).itemsize != itemsize and have == num_tokens * np.dtype(t).itemsize]
        why = (f"; that is {num_tokens} tokens of {fits[0]}: the index does not belong to this "
               f"data (another dtype)" if fits else
               ": truncated" if have < need else ": the index does not belong to this data")
        bad(bin_, f"holds {have} bytes, but {idx} describes {num_tokens} tokens of "
                  f"{np.dtype(dtype).name}, {need} bytes{why}")
    scanned = False
    if vocab_size is not None and num_tokens and have <= full_scan_bytes:
        ids = np.memmap(bin_, dtype=dtype, mode="r")
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            at = int(np.argmax((ids < 0) | (ids >= vocab_size)))
            seq = int(np.searchsorted(starts // itemsize, at, side="right")) - 1
            del ids
            bad(bin_, _id_problem(high if high >= vocab_size else low, vocab_size,
                                  f"sequence {seq}"))
        del ids
        scanned = True
    return {"dtype": dtype, "num_sequences": num_seq, "num_tokens": num_tokens,
            "scanned": scanned}


def _id_problem(token: int, vocab_size: int, where: str) -> str:
    return (f"holds token id {token} ({where}), outside the tokenizer's vocabulary "
            f"[0, {vocab_size}): the data was made with another tokenizer (or --vocab-size)")


# ---------------------------------------------------------------------------------------------
# datasets: index -> sample [seq_length + 1]

class MockGPTDataset(torch.utils.data.Dataset):
    """Synthetic samples that a model can learn: each is a walk of a sparse Markov chain.

    The chain gives every token `branching` successors drawn uniformly from the vocabulary; it
    depends on (vocab_size, branching, chain_seed) only, so datasets with different seeds (train
    and validation) speak the same "language". Sample i starts at a random token and picks one
    of the current token's successors uniformly at each step, with a generator seeded by
    (seed, i) only. The loss therefore falls from ln(vocab_size) (uniform guess) towards
    ln(branching) as a model learns the successor table (a bigram); 1.39 nats for branching 4.

    sample(i): LongTensor [seq_length + 1], ids in [0, vocab_size).
    """

    def __init__(self, vocab_size: int, seq_length: int, seed: int, num_samples: int,
                 branching: int = 4, chain_seed: int = 0):
        if vocab_size < 2 or seq_length < 1 or num_samples < 1 or not 1 <= branching <= vocab_size:
            raise ValueError(f"MockGPTDataset needs vocab_size >= 2, seq_length >= 1, "
                             f"num_samples >= 1, 1 <= branching <= vocab_size; got {vocab_size}, "
                             f"{seq_length}, {num_samples}, {branching}")
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed
        self.num_samples, self.branching = num_samples, branching
        g = torch.Generator().manual_seed(_mix64(chain_seed, 0x4D6F636B))
        self.successors = torch.randint(vocab_size, (vocab_size, branching), generator=g)  # [V, k]
        self._table = self.successors.tolist()

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} outside [0, {self.num_samples})")
        g = torch.Generator().manual_seed(_mix64(self.seed, i, 0x53616D70))
        tok = int(torch.randint(self.vocab_size, (1,), generator=g))
        choices = torch.randint(self.branching, (self.seq_length,), generator=g).tolist()
        out = [tok]
        table = self._table
        for c in choices:
            tok = table[tok][c]
            out.append(tok)
        return torch.tensor(out, dtype=torch.long)


class IndexedGPTDataset(torch.utils.data.Dataset):
    """One split of a Megatron indexed dataset (PREFIX.bin/.idx), cut into samples.

    The split's documents are the contiguous range split_ranges(split, num_docs)[which]; their
    tokens are concatenated, in an order shuffled once by `seed` (Megatron shuffles its document
    index too; samples are reshuffled every epoch by SampleStream), into one stream of T tokens,
    and sample i is stream[i * seq_length : i * seq_length + seq_length + 1].

    sample(i): LongTensor [seq_length + 1].
    """

    def __init__(self, prefix: str, seq_length: int, split: str = "969,30,1",
                 which: str = "train", seed: int = 1234, vocab_size: int | None = None):
        if which not in SPLITS:
            raise ValueError(f"which must be one of {', '.join(SPLITS)}, got {which!r}")
        if seq_length < 1:
            raise ValueError(f"--seq-length must be >= 1, got {seq_length}")
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                raise FileNotFoundError(f"--data-path {prefix}: {prefix + ext} not found (write "
                                        "PREFIX.bin/.idx with tools/preprocess_data.py)")
        self.prefix, self.seq_length, self.split, self.which = prefix, seq_length, split, which
        info = check_indexed_dataset(prefix, vocab_size)
        # ids of a .bin too large for the pass at open are checked in each sample read
        self.vocab_size = None if info["scanned"] else vocab_size
        try:
            self.indexed = _indexed_dataset_module().IndexedDataset(prefix)
        except Exception as e:  # what the checks above do not foresee, still one line
            raise DataError(f"--data-path {prefix}: megatron-core cannot read it "
                            f"({type(e).__name__}: {(str(e).splitlines() or [''])[0]})") from None
        num_docs = len(self.indexed)
        begin, end = split_ranges(split, num_docs)[which]
        g = torch.Generator().manual_seed(_mix64(seed, 1))
        order = torch.randperm(end - begin, generator=g)
        self.doc_ids = (begin + order).numpy()  # [D] documents of the split, in stream order
        lengths = self.indexed.sequence_lengths[self.doc_ids].astype(np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])  # [D + 1] stream start of each
        self.num_tokens = int(self.offsets[-1])
        if self.num_tokens < seq_length + 1:
            raise ValueError(f"{prefix}: the {which} split of --split {split} has "
                             f"{self.num_tokens} tokens in {end - begin} documents; one sample "
                             f"needs seq_length + 1 = {seq_length + 1}")
        self.num_samples = (self.num_tokens - 1) // seq_length

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} outside [0, {self.num_samples})")
        pos = i * self.seq_length
        stop = pos + self.seq_length + 1
        k = int(np.searchsorted(self.offsets, pos, side="right")) - 1
        pieces = []
        while pos < stop:
            take = min(stop, int(self.offsets[k + 1])) - pos
            if take > 0:
                doc, offset = int(self.doc_ids[k]), pos - int(self.offsets[k])
                pieces.append(self.indexed.get(doc, offset=offset, length=take))
                pos += take
            k += 1
        sample = np.concatenate(pieces).astype(np.int64)
        if self.vocab_size is not None and (sample.min() < 0 or sample.max() >= self.vocab_size):
            token = int(sample.max() if sample.max() >= self.vocab_size else sample.min())
            raise DataError(f"--data-path {self.prefix}: {self.prefix}.bin "
                            + _id_problem(token, self.vocab_size, f"{self.which} sample {i}"))
        return torch.from_numpy(sample)


# ---------------------------------------------------------------------------------------------
# batches

class SampleStream:
    """Infinite micro-batches [micro_batch_size, seq_length + 1] (int64) of a dataset (of a
    dataset of dicts, such as sft.SFTDataset: a dict of [micro_batch_size, ...] tensors).

    Epoch e visits every sample once in the order torch.randperm(N) drawn from a generator seeded
    by (seed, e); batches run on across epoch ends. Global position g = consumed samples is all
    the state: sample g is perm_{g // N}[g % N], so a stream built from state_dict() (or with
    start=consumed) yields exactly the batches an uninterrupted stream would. All ranks of a
    tensor-parallel group read the same batches. With data parallelism (dp_size > 1) each
    __next__ takes the next micro_batch_size x dp_size samples of the global order and returns
    replica dp_rank's slice of them (as Megatron's sampler), so D replicas with one micro-batch
    each see what one process sees over D micro-batches; `consumed` counts global samples.
    """

    def __init__(self, dataset: torch.utils.data.Dataset, micro_batch_size: int, seed: int,
                 start: int = 0, dp_rank: int = 0, dp_size: int = 1):
        if len(dataset) < 1:
            raise ValueError("SampleStream needs a dataset with at least one sample")
        if micro_batch_size < 1 or start < 0:
            raise ValueError(f"micro_batch_size must be >= 1 and start >= 0, got "
                             f"{micro_batch_size}, {start}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"need 0 <= dp_rank < dp_size, got {dp_rank}, {dp_size}")
        self.dataset, self.micro_batch_size = dataset, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.consumed = int(seed), int(start)
        self._perm_epoch, self._perm = -1, None

    @property
    def epoch(self) -> int:
        return self.consumed // len(self.dataset)

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(_mix64(self.seed, epoch))
            self._perm, self._perm_epoch = torch.randperm(len(self.dataset), generator=g), epoch
        return self._perm

    def __iter__(self) -> "SampleStream":
        return self

    def __next__(self) -> torch.Tensor:
        n = len(self.dataset)
        rows = []
        first = self.consumed + self.dp_rank * self.micro_batch_size
        for g in range(first, first + self.micro_batch_size):
            epoch, pos = divmod(g, n)
            rows.append(self.dataset[int(self._order(epoch)[pos])])
        self.consumed += self.micro_batch_size * self.dp_size
        if isinstance(rows[0], dict):  # packed SFT rows (forge_engine/sft.py): each [b, s]
            return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        return torch.stack(rows)  # [b, seq_length + 1]

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        missing = {"consumed", "seed"} - set(state)
        if missing:
            raise ValueError(f"SampleStream state lacks {', '.join(sorted(missing))}")
        self.consumed, self.seed = int(state["consumed"]), int(state["seed"])
        self._perm_epoch, self._perm = -1, None


# ---------------------------------------------------------------------------------------------
# the default corpus: this Python's standard library

_RECIPE = 1  # bump when the corpus, tokenizer or preprocessing recipe changes
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def _stdlib_sources() -> tuple[str, list[tuple[str, int]]]:
    """(stdlib root, sorted [(relative path, size)] of its .py files outside test directories
    and site-packages)."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in _SKIP_DIRS]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(d, name)
                rel = os.path.relpath(path, root).replace(os.sep, "/")
                found.append((rel, os.path.getsize(path)))
    return root, sorted(found)


def prepare_default_data(data_dir: str = "data", vocab_size: int = 512,
                         max_bytes: int = 16_000_000, tokenizer_train_bytes: int = 4_000_000,
                         workers: int = 1, verbose: bool = True) -> dict:
    """Build (or find cached) the default corpus under data_dir, no download needed:

        stdlib.jsonl                        one document per stdlib .py file: {"text", "path"}
        stdlib_tokenizer.model / .vocab     byte-fallback BPE, vocab_size pieces, eod = </s>
        stdlib_text_document.bin / .idx     the indexed dataset, --append-eod
        stdlib_manifest.json                what was built from what (the cache key)

    Files are taken in sorted path order while they fit in max_bytes of text (the stdlib's
    ~12 MB all fit under the default); empty files and files that do not decode as UTF-8 are
    skipped. The documents are written in an order shuffled by a fixed seed, so that the
    contiguous --split ranges are random samples of the stdlib rather than its alphabetical
    tail. The tokenizer trains on about tokenizer_train_bytes of evenly spaced documents.

    Cached: if the manifest matches (recipe, Python version, stdlib file list and sizes, the
    parameters) and the outputs have the recorded sizes, nothing is done. A lock file
    (data_dir/.stdlib.lock) serializes concurrent callers, e.g. several ranks on one host.

    Returns {"prefix", "tokenizer_model", "vocab_size", "num_docs", "num_tokens", "cached"}.
    """
    def say(msg: str) -> None:
        if verbose:
            print(f"[prepare_default_data] {msg}", flush=True)

    os.makedirs(data_dir, exist_ok=True)
    jsonl = os.path.join(data_dir, "stdlib.jsonl")
    model_prefix = os.path.join(data_dir, "stdlib_tokenizer")
    prefix = os.path.join(data_dir, "stdlib_text_document")
    manifest_path = os.path.join(data_dir, "stdlib_manifest.json")
    outputs = [jsonl, model_prefix + ".model", prefix + ".bin", prefix + ".idx"]

    t0 = time.time()
    root, sources = _stdlib_sources()
    listing = "".join(f"{rel}\t{size}\n" for rel, size in sources).encode()
    key = {"recipe": _RECIPE, "python": sys.version, "stdlib": root,
           "sources_sha256": hashlib.sha256(listing).hexdigest(), "vocab_size": vocab_size,
           "max_bytes": max_bytes, "tokenizer_train_bytes": tokenizer_train_bytes}

    with open(os.path.join(data_dir, ".stdlib.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        manifest = None
        if os.path.isfile(manifest_path):
            with open(manifest_path) as f:
                try:
                    manifest = json.load(f)
                except json.JSONDecodeError:
                    manifest = None
        sizes = manifest.get("sizes", {}) if isinstance(manifest, dict) else {}
        if (manifest is not None and manifest.get("key") == key
                and all(os.path.isfile(p) and os.path.getsize(p) == sizes.get(os.path.basename(p))
                        for p in outputs)):
            say(f"up to date: {prefix} ({manifest['num_docs']} docs, {manifest['num_tokens']} "
                f"tokens, vocab {vocab_size}); nothing to do")
            return {"prefix": prefix, "tokenizer_model": model_prefix + ".model",
                    "vocab_size": vocab_size, "num_docs": manifest["num_docs"],
                    "num_tokens": manifest["num_tokens"], "cached": True}
        if os.path.exists(manifest_path):
            os.remove(manifest_path)

        # 1. corpus
        docs, total, skipped = [], 0, 0
        for rel, size in sources:
            if total + size > max_bytes:  # does not fit: a smaller file further on may
                continue
            with open(os.path.join(root, rel), "rb") as f:
                raw = f.read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                skipped += 1
                continue
            if not text.strip():  # empty __init__.py files: no document, no bytes
                continue
            docs.append({"text": text, "path": rel})
            total += len(raw)
        if not docs:
            raise ValueError(f"max_bytes={max_bytes} admits no stdlib file (the first is "
                             f"{sources[0][1] if sources else 0} bytes)")
        random.Random(1234).shuffle(docs)
        with open(jsonl + ".tmp", "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps(d) + "\n")
        os.replace(jsonl + ".tmp", jsonl)
        say(f"corpus: {len(docs)} non-empty stdlib files of {len(sources)}, {total / 1e6:.1f} MB "
            f"({skipped} not UTF-8) from {root} -> {jsonl} ({time.time() - t0:.1f} s)")

        # 2. tokenizer
        t1 = time.time()
        model = train_tokenizer(jsonl, "text", vocab_size, model_prefix, "bpe",
                                tokenizer_train_bytes)
        tokenizer = build_tokenizer("SentencePieceTokenizer", model)
        sample_mb = min(total, tokenizer_train_bytes) / 1e6
        say(f"tokenizer: BPE, {tokenizer.vocab_size} pieces, trained on ~{sample_mb:.1f} MB -> "
            f"{model} ({time.time() - t1:.1f} s)")

        # 3. indexed dataset
        t1 = time.time()
        (out,) = preprocess(jsonl, ["text"], os.path.join(data_dir, "stdlib"), tokenizer,
                            append_eod=True, workers=workers)
        assert out == prefix
        written = _indexed_dataset_module().IndexedDataset(prefix)  # alive while read (mmap)
        num_tokens = int(written.sequence_lengths.sum())
        del written
        say(f"dataset: {num_tokens} tokens ({total / num_tokens:.2f} bytes/token) -> "
            f"{prefix}.bin/.idx ({time.time() - t1:.1f} s)")

        manifest = {"key": key, "num_docs": len(docs), "num_bytes": total, "skipped": skipped,
                    "num_tokens": num_tokens,
                    "sizes": {os.path.basename(p): os.path.getsize(p) for p in outputs}}
        with open(manifest_path + ".tmp", "w") as f:
            json.dump(manifest, f, indent=1)
        os.replace(manifest_path + ".tmp", manifest_path)
        say(f"done in {time.time() - t0:.1f} s")
    return {"prefix": prefix, "tokenizer_model": model, "vocab_size": tokenizer.vocab_size,
            "num_docs": len(docs), "num_tokens": num_tokens, "cached": False}
