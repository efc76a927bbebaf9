"""Supervised fine-tuning data: chat and instruction jsonl -> tokens and loss mask -> packed
rows -> a loss that is the mean over the counted (assistant) tokens (docs/design.md, "Fine-tuning
data").

    preprocess_sft(input, prefix, tokenizer)  jsonl -> PREFIX_tokens_document.bin/.idx (ids)
                                 and PREFIX_loss_mask_document.bin/.idx (uint8, 1 = in the loss):
                                 two megatron-core indexed datasets, one sequence per sample
    SFTDataset                   one --split of them, packed into rows of seq_length positions
    pack_next_fit, pack_row      the packing itself (shared with benchmarks/bench_sft.py)
    sft_loss_fns, masked_loss    a step's loss functions and an evaluation's sums

Input lines: {"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}
(rendered with the tokenizer's chat template; the loss counts each assistant turn, from its
first content token through the template's end-of-turn tokens), or {"prompt": str, "response":
str} (with a chat template: a user turn and an assistant turn; without one: prompt tokens,
response tokens, eod, the loss counting the response and eod).

A sample of L tokens fills L - 1 positions of a row: inputs ids[:-1], labels ids[1:], counted
where mask[1:] is 1. A row holds samples one after another (segment ids 0, 1, ...), then
padding (its own segment, never counted); the model restarts RoPE positions at each segment
and attends only inside it (model.packed_attention_inputs).
"""
from __future__ import annotations

import multiprocessing
import os
import time
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist

from forge_engine.data import (DataError, _indexed_dataset_module, _mix64, check_indexed_dataset,
                               indexed_writers, split_ranges)
from forge_engine.tokenizer import Tokenizer, check_input_file, json_object

ROLES = ("system", "user", "assistant")
OVERLONG = ("truncate", "drop")


def sft_prefixes(prefix: str) -> tuple[str, str]:
    """(tokens prefix, loss-mask prefix) of the SFT data at PREFIX: Megatron's naming,
    {prefix}_{key}_document, with the keys "tokens" and "loss_mask"."""
    return f"{prefix}_tokens_document", f"{prefix}_loss_mask_document"


# ---------------------------------------------------------------------------------------------
# one jsonl line -> (ids, mask)

def parse_record(line: str, lineno: int, path: str) -> dict | None:
    """A validated record of one jsonl line: {"messages": [...]} or {"prompt", "response"};
    None for a blank line. Every problem is one line naming the file and line."""
    if not line.strip():
        return None
    where = f"{path}:{lineno}"
    obj = json_object(line, where)
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError(f"{where}: 'messages' must be a non-empty list of "
                             f"{{\"role\", \"content\"}} objects")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"{where}: message {i} must be an object with 'role' and "
                                 f"'content'")
            if m["role"] not in ROLES:
                raise ValueError(f"{where}: message {i} has role {m['role']!r}; the roles are "
                                 f"{', '.join(ROLES)}")
            if not isinstance(m["content"], str):
                raise ValueError(f"{where}: message {i}'s content is a "
                                 f"{type(m['content']).__name__}, expected a string")
        if not any(m["role"] == "assistant" for m in msgs):
            raise ValueError(f"{where}: no assistant message, so nothing for the loss to count")
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in msgs]}
    if "prompt" in obj or "response" in obj:
        for key in ("prompt", "response"):
            if key not in obj:
                raise ValueError(f"{where}: a 'prompt' line needs a 'response' too (and the "
                                 f"other way round); {key!r} is missing")
            if not isinstance(obj[key], str):
                raise ValueError(f"{where}: {key!r} is a {type(obj[key]).__name__}, expected "
                                 f"a string")
        return {"prompt": obj["prompt"], "response": obj["response"]}
    raise ValueError(f"{where}: neither 'messages' nor 'prompt'/'response'; keys present: "
                     f"{', '.join(map(repr, obj)) or 'none'}")


def has_chat_template(tokenizer: Tokenizer) -> bool:
    return bool(getattr(tokenizer, "has_chat_template", False))


def encode_record(rec: dict, tokenizer: Tokenizer, where: str) -> tuple[list[int], list[int]]:
    """(ids, mask) of one parsed record; mask[i] = 1 where token i is a target the loss
    counts. With a chat template the conversation is rendered once and tokenized once (the
    tokens a model sees at inference); an assistant turn's text span is the difference between
    the rendering through it and the rendering before it with a generation prompt, and a token
    is counted when it starts inside such a span."""
    if "prompt" in rec and not has_chat_template(tokenizer):
        p, r = tokenizer.encode(rec["prompt"]), tokenizer.encode(rec["response"])
        return p + r + [tokenizer.eod], [0] * len(p) + [1] * (len(r) + 1)
    msgs = rec.get("messages") or [{"role": "user", "content": rec["prompt"]},
                                   {"role": "assistant", "content": rec["response"]}]
    text = tokenizer.render_chat(msgs)
    ids, starts = tokenizer.encode_with_offsets(text)
    spans = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before = tokenizer.render_chat(msgs[:i], add_generation_prompt=True)
        through = tokenizer.render_chat(msgs[:i + 1])
        if not (text.startswith(through) and through.startswith(before)):
            raise ValueError(f"{where}: the chat template does not render this conversation "
                             f"as a growing prefix at message {i} (it rewrites earlier turns), "
                             f"so its assistant tokens cannot be located")
        spans.append((len(before), len(through)))
    mask = [int(any(a <= s < b for a, b in spans)) for s in starts]
    return ids, mask


def fit(ids, mask, seq_length: int, policy: str | None):
    """A sample for rows of seq_length positions: (ids, mask, what) with what one of "kept",
    "truncated", or (None, None, "dropped" | "empty"). A sample fits when it has at most
    seq_length + 1 tokens; a longer one is cut to that (truncate) or left out (drop); one with
    no counted target left ("empty") is left out either way. policy None with a long sample
    raises: callers count first (overlong_count) and ask for the flag."""
    what = "kept"
    if len(ids) > seq_length + 1:
        if policy == "drop":
            return None, None, "dropped"
        if policy != "truncate":
            raise ValueError(f"a sample of {len(ids)} tokens does not fit --seq-length "
                             f"{seq_length}; choose --sft-overlong truncate or drop")
        ids, mask, what = ids[:seq_length + 1], mask[:seq_length + 1], "truncated"
    if len(ids) < 2 or not np.any(np.asarray(mask[1:])):
        return None, None, "empty"
    return ids, mask, what


def overlong_message(flag: str, n_long: int, n: int, seq_length: int, longest: int) -> str:
    return (f"{flag}: {n_long} of {n} samples are longer than --seq-length {seq_length} + 1 = "
            f"{seq_length + 1} tokens (the longest: {longest}); choose --sft-overlong truncate "
            f"(keep the first {seq_length + 1} tokens) or drop (leave them out)")


# ---------------------------------------------------------------------------------------------
# preprocessing

_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _encode_job(job: tuple[int, dict, str]) -> tuple[list[int], list[int]]:
    lineno, rec, path = job
    return encode_record(rec, _worker_tokenizer, f"{path}:{lineno}")


def _records(path: str) -> Iterator[tuple[int, dict]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte "
                                 f"{e.start} of the line)") from None
            rec = parse_record(line, lineno, path)
            if rec is not None:
                yield lineno, rec


def preprocess_sft(input: str, output_prefix: str, tokenizer: Tokenizer,
                   seq_length: int | None = None, overlong: str | None = None,
                   workers: int = 1, log_interval: int = 0) -> dict:
    """Tokenize a chat / instruction jsonl into the two indexed datasets of sft_prefixes
    (token dtype as preprocess chooses; mask uint8; equal sequence lengths, one sequence and
    one document per sample). Every line is checked first (keys, roles, content types, and a
    chat template where a line needs one), so bad input stops before any tokenizing. With
    seq_length, samples longer than seq_length + 1 tokens are truncated or dropped by
    `overlong` (None: an error naming how many, if there are any); samples with no counted
    token are left out. Written under temporary names, renamed at the end. Returns the
    counts: samples, chat, prompt, tokens, counted, longest, truncated, dropped, empty,
    prefixes."""
    check_input_file(input)
    if overlong not in (None, *OVERLONG):
        raise ValueError(f"--sft-overlong must be one of {', '.join(OVERLONG)}, got {overlong!r}")
    if overlong is not None and seq_length is None:
        raise ValueError("--sft-overlong needs --seq-length (the row length samples must fit)")
    if seq_length is not None and seq_length < 1:
        raise ValueError(f"--seq-length must be >= 1, got {seq_length}")
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    template = has_chat_template(tokenizer)
    n_chat = n_prompt = 0
    for lineno, rec in _records(input):  # the checking pass: JSON only, no tokenizer
        if "messages" in rec:
            n_chat += 1
            if not template:
                where = getattr(tokenizer, "path", None) or tokenizer.name
                raise ValueError(f"{input}:{lineno}: 'messages' need a chat template, and the "
                                 f"tokenizer {where} has none (tokenizer_config.json's "
                                 f"chat_template); use a tokenizer with one, or "
                                 f"prompt/response lines")
        else:
            n_prompt += 1
    if n_chat + n_prompt == 0:
        raise ValueError(f"--input {input}: no samples (every line is blank)")
    idx_mod = _indexed_dataset_module()
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--output-prefix {output_prefix}: cannot create the directory "
                         f"{out_dir} ({e.strerror})") from None
    prefixes = sft_prefixes(output_prefix)
    dtypes = [idx_mod.DType.optimal_dtype(tokenizer.vocab_size), np.uint8]
    stats = dict(samples=0, chat=n_chat, prompt=n_prompt, tokens=0, counted=0, longest=0,
                 truncated=0, dropped=0, empty=0, prefixes=list(prefixes))
    encoded = []  # (ids, mask): the whole file, so that an overlong count precedes writing
    pool = None
    try:
        jobs = ((lineno, rec, input) for lineno, rec in _records(input))
        if workers == 1:
            _init_worker(tokenizer)
            results = map(_encode_job, jobs)
        else:
            pool = multiprocessing.Pool(workers, initializer=_init_worker, initargs=(tokenizer,))
            results = pool.imap(_encode_job, jobs, chunksize=16)
        t0 = time.time()
        for n, item in enumerate(results, start=1):
            encoded.append(item)
            if log_interval and n % log_interval == 0:
                print(f"[preprocess --sft] {n} samples, {time.time() - t0:.1f} s", flush=True)
        lengths = [len(ids) for ids, _ in encoded]
        stats["longest"] = max(lengths)
        if seq_length is not None and overlong is None:
            n_long = sum(n > seq_length + 1 for n in lengths)
            if n_long:
                raise ValueError(overlong_message("--seq-length", n_long, len(lengths),
                                                  seq_length, stats["longest"]))
        with indexed_writers(prefixes, dtypes) as builders:
            for ids, mask in encoded:
                what = "kept"
                if seq_length is not None:
                    ids, mask, what = fit(ids, mask, seq_length, overlong)
                elif len(ids) < 2 or not any(mask[1:]):
                    ids, what = None, "empty"
                if what != "kept":
                    stats[what] += 1
                if ids is None:
                    continue
                builders[0].add_document(ids, [len(ids)])
                builders[1].add_document(mask, [len(mask)])
                stats["samples"] += 1
                stats["tokens"] += len(ids)
                stats["counted"] += int(sum(mask[1:]))
            if stats["samples"] == 0:
                raise ValueError(f"--input {input}: no sample is left to train on "
                                 f"({stats['dropped']} dropped as too long, {stats['empty']} "
                                 f"with no counted token)")
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    return stats


def describe_preprocessing(stats: dict, seq_length: int | None, overlong: str | None) -> str:
    """The report lines of preprocess_sft's counts."""
    lines = [f"sft: {stats['samples']} samples ({stats['chat']} conversations, "
             f"{stats['prompt']} prompt/response lines read), {stats['tokens']} tokens, "
             f"{stats['counted']} of them counted in the loss "
             f"({100 * stats['counted'] / max(1, stats['tokens']):.1f}%); longest sample "
             f"{stats['longest']} tokens"]
    if seq_length is None:
        lines.append("sft: no --seq-length: samples are kept whole; pretrain.py --sft "
                     "--sft-overlong truncates or drops those longer than its --seq-length + 1")
    else:
        long = stats["truncated"] + stats["dropped"]
        lines.append(f"sft: {long} samples longer than --seq-length {seq_length} + 1 tokens"
                     + (f": {stats['truncated']} truncated, {stats['dropped']} dropped "
                        f"(--sft-overlong {overlong})" if long else ""))
    if stats["empty"]:
        lines.append(f"sft: {stats['empty']} samples left out with no counted token "
                     f"(nothing after truncation, or an empty response)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# the packed dataset

class SFTDataset(torch.utils.data.Dataset):
    """One split of SFT data packed into rows of seq_length positions.

    The split is the contiguous sample range split_ranges(split, N)[which] (a sample is a
    document of the indexed datasets). Samples longer than seq_length + 1 tokens are handled
    by `overlong` ("truncate" | "drop"; None raises a DataError naming how many), then the
    kept samples, in an order shuffled once by `seed`, are packed next-fit: a sample joins the
    current row while the row's positions allow, else it opens the next row.

    row(i) = {"tokens", "labels", "segment_ids"} int64 [seq_length] and "loss_mask" fp32
    [seq_length]. `report` is a line for the log (samples, rows, fill, truncated/dropped).
    """

    def __init__(self, prefix: str, seq_length: int, split: str = "969,30,1",
                 which: str = "train", seed: int = 1234, vocab_size: int | None = None,
                 overlong: str | None = None):
        if seq_length < 1:
            raise ValueError(f"--seq-length must be >= 1, got {seq_length}")
        tok_prefix, mask_prefix = sft_prefixes(prefix)
        for p, what in ((tok_prefix, "tokens"), (mask_prefix, "loss mask")):
            for ext in (".bin", ".idx"):
                if not os.path.isfile(p + ext):
                    raise DataError(f"--data-path {prefix}: no {what} file {p + ext} (--sft "
                                    f"reads the PREFIX_tokens_document and "
                                    f"PREFIX_loss_mask_document that tools/preprocess_data.py "
                                    f"--sft writes)")
        check_indexed_dataset(tok_prefix, vocab_size)
        info = check_indexed_dataset(mask_prefix)
        if np.dtype(info["dtype"]) != np.uint8:
            raise DataError(f"--data-path {prefix}: {mask_prefix}.idx holds "
                            f"{np.dtype(info['dtype']).name}; a loss mask is uint8")
        idx_mod = _indexed_dataset_module()
        self.tokens = idx_mod.IndexedDataset(tok_prefix)
        self.mask = idx_mod.IndexedDataset(mask_prefix)
        lengths = self.tokens.sequence_lengths.astype(np.int64)
        if not np.array_equal(lengths, self.mask.sequence_lengths):
            raise DataError(f"--data-path {prefix}: {mask_prefix} and {tok_prefix} hold "
                            f"sequences of different lengths: the mask is not this data's")
        self.prefix, self.seq_length, self.which = prefix, seq_length, which
        n = len(lengths)
        begin, end = split_ranges(split, n)[which]
        ids = np.arange(begin, end)
        long = lengths[ids] > seq_length + 1
        if long.any() and overlong is None:
            raise DataError(overlong_message(f"--data-path {prefix} ({which} split)",
                                             int(long.sum()), len(ids), seq_length,
                                             int(lengths[ids].max())))
        self.truncated = int(long.sum()) if overlong == "truncate" else 0
        self.dropped = int(long.sum()) if overlong == "drop" else 0
        keep = []
        self.empty = 0
        for doc, is_long in zip(ids.tolist(), long.tolist()):
            if is_long and overlong == "drop":
                continue
            if is_long and not self.mask.get(doc, 0, seq_length + 1)[1:].any():
                self.empty += 1  # truncation left no counted target
                continue
            keep.append(doc)
        if not keep:
            raise DataError(f"--data-path {prefix}: the {which} split of --split {split} holds "
                            f"no sample to train on ({len(ids)} samples in the split)")
        g = torch.Generator().manual_seed(_mix64(seed, 0x534654))
        order = [keep[i] for i in torch.randperm(len(keep), generator=g).tolist()]
        self.rows: list[list[int]] = [
            [order[j] for j in row]
            for row in pack_next_fit([min(int(lengths[d]), seq_length + 1) for d in order],
                                     seq_length)]
        self.num_samples = len(keep)
        self.positions = sum(min(int(lengths[d]), seq_length + 1) - 1 for d in keep)
        fill = self.positions / (len(self.rows) * seq_length)
        self.report = (f"sft {which} split: {self.num_samples} samples packed into "
                       f"{len(self.rows)} rows of {seq_length} positions ({100 * fill:.1f}% "
                       f"filled); {self.truncated} truncated, {self.dropped} dropped as longer "
                       f"than {seq_length + 1} tokens, {self.empty} left with no counted token")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = self.seq_length
        pairs = []
        for doc in self.rows[i]:
            n = min(int(self.tokens.sequence_lengths[doc]), s + 1)
            pairs.append((self.tokens.get(doc, 0, n), self.mask.get(doc, 0, n)))
        return pack_row(pairs, s)


def pack_next_fit(lengths: list[int], seq_length: int) -> list[list[int]]:
    """Indices of `lengths` (tokens per sample, each at most seq_length + 1) grouped into rows
    in order: a sample of L tokens takes L - 1 positions and joins the current row while it
    fits in seq_length, else opens the next row."""
    rows: list[list[int]] = []
    used = seq_length  # positions taken in the current row (full: open one)
    for j, n in enumerate(lengths):
        if used + n - 1 > seq_length:
            rows.append([])
            used = 0
        rows[-1].append(j)
        used += n - 1
    return rows


def pack_row(pairs, seq_length: int) -> dict[str, torch.Tensor]:
    """One row from (ids, mask) pairs (array-likes of L tokens, sum of L - 1 <= seq_length):
    tokens, labels, segment_ids int64 and loss_mask fp32, each [seq_length]. Sample k takes
    the next L - 1 positions with inputs ids[:-1], labels ids[1:], mask mask[1:] and segment
    id k; the positions left are padding: token and label 0, mask 0, and a segment of their
    own (id len(pairs)), so no sample attends to them."""
    s = seq_length
    tokens, labels = np.zeros(s, np.int64), np.zeros(s, np.int64)
    mask = np.zeros(s, np.float32)
    segments = np.full(s, len(pairs), np.int64)
    at = 0
    for k, (ids, m) in enumerate(pairs):
        ids, m = np.asarray(ids, dtype=np.int64), np.asarray(m, dtype=np.float32)
        n = len(ids) - 1
        if at + n > s:
            raise ValueError(f"pack_row: the samples take more than {s} positions")
        tokens[at:at + n], labels[at:at + n] = ids[:-1], ids[1:]
        mask[at:at + n] = m[1:]
        segments[at:at + n] = k
        at += n
    return {"tokens": torch.from_numpy(tokens), "labels": torch.from_numpy(labels),
            "loss_mask": torch.from_numpy(mask), "segment_ids": torch.from_numpy(segments)}


# ---------------------------------------------------------------------------------------------
# the loss

def masked_loss(model, batch: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the counted tokens' losses, number of counted tokens) of one micro-batch, fp32
    0-d tensors. Masked positions are multiplied by 0: they add nothing to the loss and
    nothing to any gradient, whatever their labels."""
    b = {k: v.to(device) for k, v in batch.items()}
    per_token = model(b["tokens"], labels=b["labels"], segment_ids=b["segment_ids"])  # [b, s]
    return (per_token * b["loss_mask"]).sum(), b["loss_mask"].sum()


def global_count(batches: list[dict], dp_group=None, comm_device="cpu") -> float:
    """Counted tokens of a step: every micro-batch of this replica, summed over dp_group."""
    n = torch.tensor(float(sum(float(b["loss_mask"].sum()) for b in batches)),
                     dtype=torch.float64, device=comm_device)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(n, group=dp_group)
    return float(n)


def sft_loss_fns(model, batches: list[dict], device, dp_group=None, comm_device="cpu"):
    """The loss functions of one Engine.train_step over `batches` (this replica's
    micro-batches) whose reported loss and gradient are those of the mean over every counted
    token of the step, all micro-batches of all data-parallel replicas together (one large
    batch's token mean). The Engine divides each micro-batch's loss by the M micro-batches
    and data parallelism averages over the D replicas, so micro-batch j returns
    sum_j * M * D / N, with N the step's counted tokens (global_count: one all-reduce of a
    number before the forwards)."""
    world = dist.get_world_size(dp_group) if dp_group is not None else 1
    scale = len(batches) * world / max(global_count(batches, dp_group, comm_device), 1.0)
    return [lambda b=b: masked_loss(model, b, device)[0] * scale for b in batches]
