"""Train a GPT with FORGE, the way a Megatron-LM user expects.

    python pretrain.py --model tiny --mock-data --train-iters 100
    torchrun --nproc-per-node 2 pretrain.py --tensor-parallel 2 --sequence-parallel ...
    python pretrain.py --hf-checkpoint hf_dir --sft --data-path data/chat ...   (fine-tuning)

Flags are Megatron-LM's (forge_engine/config.py lists them; --help prints them). One rank prints
Megatron's log and validation lines and writes TensorBoard events; checkpoints use Megatron's
layout (forge_engine/checkpoint.py) and hold everything needed to resume bit for bit on the same
tensor-parallel layout: model shard, every optimizer state (FORGE moments, int8 codes and scales),
iteration, data position and RNG states.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import random
import resource
import sys
import time

import torch
import torch.distributed as dist

from forge_engine.config import ConfigError, TrainConfig, apply_kernel_switches, parse_config


class SaveError(Exception):
    """A checkpoint save failed after training; the message is one line (path and cause)."""


def lr_at(cfg: TrainConfig, num_steps: int) -> float:
    """Megatron's schedule: linear warmup from 0, then constant / linear / cosine decay to
    min_lr at lr_decay_iters. num_steps = iterations completed before this one."""
    warmup, decay = cfg.lr_warmup_iters, cfg.lr_decay_iters or cfg.train_iters
    if warmup > 0 and num_steps <= warmup:
        return cfg.lr * num_steps / warmup
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    if num_steps > decay:
        return cfg.min_lr
    ratio = (num_steps - warmup) / max(1, decay - warmup)
    coeff = 1.0 - ratio if cfg.lr_decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1)
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)


def optimizer_kwargs(cfg: TrainConfig) -> dict:
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    kw = {"adamw": dict(betas=betas, eps=cfg.adam_eps),
          "nadam": dict(betas=betas, eps=cfg.adam_eps),
          "radam": dict(betas=betas, eps=cfg.adam_eps),
          "lion": dict(betas=betas),
          "rmsprop": dict(eps=cfg.adam_eps, momentum=cfg.sgd_momentum),
          "adagrad": dict(eps=cfg.adam_eps),
          "sgd": dict(momentum=cfg.sgd_momentum)}[cfg.optimizer]
    kw.update(lr=cfg.lr, weight_decay=cfg.weight_decay)
    if not cfg.no_forge:
        kw.update(seed=cfg.seed)
        if cfg.state_dtype is not None:
            kw.update(state_dtype=cfg.state_dtype)
    elif cfg.enable_cuda_graph:  # torch.optim's step inside the graph keeps its counts on
        kw.update(capturable=True)  # the device
    if cfg.main_params_dtype is not None:
        kw.update(main_params_dtype=cfg.main_params_dtype)
    return kw


def peak_memory_gib(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # Linux: KiB


def _forward_library_log():
    """forge_engine's own notes (e.g. the accumulation choice per weight) on stdout, once."""
    _stop_library_log()  # main() called again in one process
    log = logging.getLogger("forge_engine")
    log.setLevel(logging.INFO)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.pretrain = True
    log.addHandler(handler)


def _stop_library_log():
    """Detach the handler of _forward_library_log: when main() returns, the stream it holds
    (the sys.stdout of that moment) may be closed, and the library logs on without pretrain."""
    log = logging.getLogger("forge_engine")
    for old in [h for h in log.handlers if getattr(h, "pretrain", False)]:
        log.removeHandler(old)


def _state_mismatch(mine: dict, theirs) -> str | None:
    """Why the checkpoint's model entry `theirs` cannot load into a model whose state dict is
    `mine` (a missing or extra tensor, another shape), or None."""
    if not isinstance(theirs, dict):
        return f"its 'model' entry is a {type(theirs).__name__}, not a state dict"
    for k, v in mine.items():
        t = theirs.get(k)
        if not torch.is_tensor(t):
            return f"holds no tensor {k}, which this model has"
        if t.shape != v.shape:
            return (f"tensor {k} has shape {list(t.shape)} in the checkpoint, "
                    f"{list(v.shape)} in this model")
    extra = [k for k in theirs if k not in mine]
    return f"holds tensor {extra[0]}, which this model lacks" if extra else None


class Trainer:
    def __init__(self, cfg: TrainConfig):
        import numpy as np

        from forge_engine.checkpoint import check_writable_dir
        from forge_engine.data import SampleStream
        from forge_engine.engine import Engine
        from forge_engine.parallel.state import init_parallel

        self.cfg = cfg
        for flag, path in (("--save", cfg.save), ("--tensorboard-dir", cfg.tensorboard_dir)):
            if path:  # found now, not at the first save after the training it was to keep
                check_writable_dir(path, flag)
        self.groups = g = init_parallel(cfg.tensor_model_parallel_size)
        self.rank0 = dist.get_rank() == 0
        if self.rank0:
            _forward_library_log()
        random.seed(cfg.seed)  # every generator seeded as Megatron does (torch: by GPT below)
        np.random.seed(cfg.seed)
        vocab, tok_vocab = self._model_config()
        self._batch_sizes()
        self.device = torch.device(f"cuda:{torch.cuda.current_device()}"
                                   if torch.cuda.is_available() else "cpu")
        self.model = self._build_model(vocab)
        if cfg.enable_cuda_graph and cfg.no_forge and cfg.optimizer != "adamw":
            raise ConfigError(f"--enable-cuda-graph with --no-forge supports --optimizer adamw "
                              f"(torch's capturable fused AdamW), got {cfg.optimizer}")
        self.engine = Engine(self.model, cfg.optimizer, forge=not cfg.no_forge,
                             tp_group=g.tp_group, dp_group=g.dp_group,
                             lr_schedule=lambda n: lr_at(cfg, n),
                             clip_grad=cfg.clip_grad, **optimizer_kwargs(cfg))
        train, self.valid_data = self._datasets(tok_vocab)
        self.train_stream = SampleStream(train, self.micro, cfg.seed, dp_rank=g.dp_rank,
                                         dp_size=g.dp_size)
        self.graph_step = self._graph_step() if cfg.enable_cuda_graph else None
        self.iteration = 0
        self.writer = None
        if cfg.tensorboard_dir and self.rank0:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(cfg.tensorboard_dir)

    def _model_config(self) -> tuple[int, int]:
        """self.mcfg, the model's shape (a preset with the flags' overrides, or the
        --hf-checkpoint's config.json); returns (padded vocabulary, tokenizer's vocabulary)."""
        from forge_engine.data import padded_vocab_size
        from forge_engine.model import preset
        from forge_engine.tokenizer import build_tokenizer
        cfg, g = self.cfg, self.groups
        base = preset(cfg.model)
        if cfg.mock_data:
            vocab = cfg.vocab_size or base.vocab_size
            tok_vocab = vocab
        else:
            tok = build_tokenizer(cfg.tokenizer_type, cfg.tokenizer_model, cfg.vocab_size)
            tok_vocab = tok.vocab_size
            vocab = padded_vocab_size(tok.vocab_size, 128, g.tp_size)
        if cfg.hf_checkpoint:  # shape from its config.json; flags may only agree with it
            from forge_engine.hf import train_config
            self.mcfg = train_config(cfg.hf_checkpoint, cfg.model_overrides(),
                                     None if cfg.mock_data else tok_vocab, g.tp_size)
            tok_vocab = self.mcfg.vocab_size if cfg.mock_data else tok_vocab
            vocab = self.mcfg.vocab_size = padded_vocab_size(self.mcfg.vocab_size, 128,
                                                             g.tp_size)
        else:
            self.mcfg = preset(cfg.model, **cfg.model_overrides(), vocab_size=vocab)
        self.seq = self.mcfg.seq_length
        self.tok_vocab = tok_vocab
        return vocab, tok_vocab

    def _batch_sizes(self):
        """micro-batch, global batch and micro-batches per step, checked against the world."""
        cfg, g = self.cfg, self.groups
        self.micro = cfg.micro_batch_size
        self.global_batch = cfg.global_batch_size or self.micro * g.dp_size
        if self.global_batch % (self.micro * g.dp_size):
            raise ConfigError(f"--global-batch-size {self.global_batch} is not a multiple of "
                              f"--micro-batch-size {self.micro} x data-parallel size "
                              f"{g.dp_size}")
        self.num_micro = self.global_batch // (self.micro * g.dp_size)
        if cfg.sequence_parallel and self.seq % g.tp_size:
            raise ConfigError(f"--seq-length {self.seq} is not divisible by the "
                              f"tensor-parallel size {g.tp_size} (sequence parallelism)")

    def _build_model(self, vocab: int):
        """The GPT on self.device: the --hf-checkpoint's weights, or initialized from --seed."""
        from forge_engine.model import GPT
        cfg, g = self.cfg, self.groups
        dtype = torch.bfloat16 if cfg.bf16 else torch.float32
        if cfg.hf_checkpoint:
            from forge_engine.hf import load_pretrained
            return load_pretrained(cfg.hf_checkpoint, dtype=dtype, tp_group=g.tp_group,
                                         sequence_parallel=cfg.sequence_parallel
                                         and g.tp_size > 1, vocab_size=vocab,
                                         seq_length=self.seq).to(self.device)
        return GPT(self.mcfg, tp_group=g.tp_group,
                   sequence_parallel=cfg.sequence_parallel and g.tp_size > 1,
                   params_dtype=dtype, seed=cfg.seed,
                   init_device="cpu" if cfg.use_cpu_initialization
                   else self.device.type).to(self.device)

    def _datasets(self, tok_vocab: int):
        """(train, valid or None): mock tokens, packed SFT rows or an indexed dataset."""
        from forge_engine.data import IndexedGPTDataset, MockGPTDataset, parse_split
        cfg = self.cfg
        valid = None
        validate = cfg.eval_iters > 0 and cfg.eval_interval > 0
        if cfg.mock_data:
            n = max(1024, 4 * cfg.train_iters * self.global_batch)
            train = MockGPTDataset(tok_vocab, self.seq, cfg.seed, n)
            if validate:
                valid = MockGPTDataset(tok_vocab, self.seq, cfg.seed + 1, 256)
        elif cfg.sft:  # packed rows of tokens, labels, loss mask and segment ids
            from forge_engine.sft import SFTDataset
            train = SFTDataset(cfg.data_path, self.seq, cfg.split, "train", cfg.seed,
                               vocab_size=tok_vocab, overlong=cfg.sft_overlong)
            self.log(train.report)
            if validate and parse_split(cfg.split)[1] == 0:
                self.log(f"no validation: the valid split of --split {cfg.split} is empty")
            elif validate:
                valid = SFTDataset(cfg.data_path, self.seq, cfg.split, "valid", cfg.seed,
                                   vocab_size=tok_vocab, overlong=cfg.sft_overlong)
                self.log(valid.report)
        else:
            train = IndexedGPTDataset(cfg.data_path, self.seq, cfg.split, "train", cfg.seed,
                                      vocab_size=tok_vocab)
            if validate and parse_split(cfg.split)[1] == 0:  # Megatron-LM skips it too
                self.log(f"no validation: the valid split of --split {cfg.split} is empty")
            elif validate:
                valid = IndexedGPTDataset(cfg.data_path, self.seq, cfg.split, "valid", cfg.seed,
                                          vocab_size=tok_vocab)
        return train, valid

    def _graph_step(self):
        """--enable-cuda-graph: each step one replay of a captured graph (one micro-batch)."""
        from forge_engine.graphs import CudaGraphStep
        if self.num_micro > 1:
            raise ConfigError(f"--enable-cuda-graph needs one micro-batch per step; "
                              f"--global-batch-size {self.global_batch} makes "
                              f"{self.num_micro}")
        try:
            return CudaGraphStep(
                self.engine, lambda b: self.model(b[:, :-1], labels=b[:, 1:]).mean(),
                warmup=self.cfg.cuda_graph_warmup_steps)
        except ValueError as e:
            raise ConfigError(f"--enable-cuda-graph: {e}") from None

    def log(self, msg: str):
        if self.rank0:
            print(msg, flush=True)

    # ---------------------------------------------------------------- checkpoints
    def _agree(self, ok: bool) -> bool:
        """Whether every rank's part of a save succeeded (all ranks call it at the same point:
        a barrier that carries the answer, so no rank waits for one that failed)."""
        flag = torch.tensor([int(ok)], dtype=torch.int32,
                            device=self.device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def save(self):
        from forge_engine.checkpoint import (describe_os_error, latest_iteration, rng_state,
                                             save_checkpoint)
        g, cfg = self.groups, self.cfg
        self.engine.synchronize()
        state = {"optimizer": self.engine.optimizer.state_dict(), "rng": rng_state()}
        if g.dp_rank == 0:  # replicas hold equal weights: one copy, beside replica 0's shard
            from dataclasses import asdict  # model_config, hf_config: tools/export_hf.py
            state.update(model_config=asdict(self.mcfg), vocab_unpadded=self.tok_vocab,
                         hf_config=getattr(self.model, "hf_config", None))
            state.update(model=self.model.state_dict(), iteration=self.iteration,
                         engine_iteration=self.engine.iteration,
                         data=self.train_stream.state_dict(), args=vars(cfg))
        try:
            path = save_checkpoint(cfg.save, self.iteration, state, tp_rank=g.tp_rank,
                                   tp_size=g.tp_size, dp_rank=g.dp_rank, dp_size=g.dp_size,
                                   agree=self._agree if dist.get_world_size() > 1 else None)
        except Exception as e:  # the tracker still names the previous save, if any
            try:
                last = latest_iteration(cfg.save)
            except Exception:
                last = None
            kept = (f"the checkpoint of iteration {last} there is intact" if last is not None
                    else "no earlier checkpoint was saved there")
            if self.writer:
                self.writer.close()
            raise SaveError(f"cannot save the checkpoint of iteration {self.iteration} to "
                            f"{cfg.save}: {describe_os_error(e)}; {kept}") from None
        self.log(f"saved checkpoint at iteration {self.iteration:8d} to {cfg.save}")
        return path

    def _saved_with(self, saved: dict) -> str:
        """'; the checkpoint was saved with --hidden-size 128 (this run: default)': the model
        flags in which the checkpoint's run and this one differ (default: the preset's)."""
        keys = ["model", *(f.name for f in dataclasses.fields(TrainConfig)
                           if f.metadata.get("model")),
                "vocab_size", "untie_embeddings_and_output_weights", "tokenizer_type",
                "tokenizer_model"]
        def show(v):
            return "default" if v is None else repr(v)
        diffs = [f"--{k.replace('_', '-')} {show(saved[k])} (this run: "
                 f"{show(getattr(self.cfg, k))})"
                 for k in keys if k in saved and saved[k] != getattr(self.cfg, k)]
        return f"; the checkpoint was saved with {', '.join(diffs[:3])}" if diffs else ""

    def load(self):
        """Megatron's resume: everything (default), --ckpt-step N, --finetune (weights only),
        --no-load-optim, --no-load-rng. Every mismatch is one line naming the file, before any
        training; nothing on disk is changed."""
        from forge_engine.checkpoint import (TRACKER_NAME, checkpoint_path,
                                             iterations_with_files, latest_iteration,
                                             load_checkpoint, set_rng_state)
        cfg, g = self.cfg, self.groups
        if cfg.ckpt_step is None and latest_iteration(cfg.load, "--ckpt-step") is None:
            written = iterations_with_files(cfg.load)
            if written:  # a first save killed before its tracker: never trained over
                raise ConfigError(f"--load {cfg.load}: no {TRACKER_NAME}, but iteration(s) "
                                  f"{', '.join(map(str, written[-5:]))} hold checkpoint files "
                                  f"(a save that did not finish?); pass --ckpt-step N to load "
                                  f"one, or move them away to start from scratch")
            if cfg.load_is_save():
                self.log(f"no checkpoint in {cfg.load} yet (no {TRACKER_NAME}): starting from "
                         f"scratch; the same command resumes once one is saved")
                return
        load_optim = not (cfg.finetune or cfg.no_load_optim)
        load_rng = not (cfg.finetune or cfg.no_load_rng)
        kw = dict(tp_rank=g.tp_rank, tp_size=g.tp_size, step_flag="--ckpt-step")
        # the weights are replicated: without the optimizer shards any data-parallel size fits
        it, state = load_checkpoint(cfg.load, iteration=cfg.ckpt_step,
                                    dp_size=g.dp_size if load_optim else None, **kw)
        file = checkpoint_path(cfg.load, it, g.tp_rank)
        need = ["model", *(["optimizer"] if load_optim else []),
                *(["rng"] if load_rng else []), *([] if cfg.finetune else ["engine_iteration",
                                                                          "data"])]
        for key in need:
            if key not in state:
                raise ConfigError(f"--load {file}: no {key!r} entry (not a checkpoint that "
                                  f"pretrain.py saved)")
        own_file = file
        if g.dp_rank > 0 and (load_optim or (load_rng and state.get("dp_size", 1) == g.dp_size)):
            _, own = load_checkpoint(cfg.load, iteration=it, dp_rank=g.dp_rank,
                                     dp_size=g.dp_size, **kw)
            own_file = checkpoint_path(cfg.load, it, g.tp_rank, g.dp_rank)
            state["optimizer"] = own.get("optimizer")
            state["rng"] = own.get("rng", state.get("rng"))  # older files: replica 0's
        saved = state.get("args") or {}
        theirs = state["model"]
        problem = _state_mismatch(self.model.state_dict(), theirs)
        if problem:
            raise ConfigError(f"--load {file}: {problem}{self._saved_with(saved)}")
        self._check_saved_flags(file, saved, load_optim)
        try:
            self.model.load_state_dict(theirs)
        except Exception as e:
            raise ConfigError(f"--load {file}: the model state does not load "
                              f"({str(e).strip().splitlines()[0][:300]})") from None
        if load_optim:
            try:
                self.engine.optimizer.load_state_dict(state["optimizer"])
            except Exception as e:
                raise ConfigError(f"--load {own_file}: the optimizer state does not fit this "
                                  f"run ({type(e).__name__}: "
                                  f"{(str(e).strip().splitlines() or [''])[0][:300]}); "
                                  f"--no-load-optim starts a fresh optimizer") from None
        if cfg.finetune:
            self.log(f"loaded the model weights of iteration {it} from {cfg.load} "
                     f"(--finetune): starting at iteration 0 with a fresh optimizer, the data "
                     f"from its start and the RNG as --seed sets it")
            return
        try:
            self.train_stream.load_state_dict(state["data"])
            self.engine.iteration = int(state["engine_iteration"])
            if load_rng:
                set_rng_state(state["rng"])
        except (ValueError, TypeError, KeyError, RuntimeError) as e:
            raise ConfigError(f"--load {own_file}: {(str(e).strip().splitlines() or [''])[0]}") \
                from None
        self.iteration = it
        parts = ["model", "optimizer" if load_optim else "a fresh optimizer (--no-load-optim)",
                 f"data position ({self.train_stream.consumed} samples)",
                 "RNG" if load_rng else "RNG not restored (--no-load-rng)"]
        self.log(f"loaded checkpoint from {cfg.load} at iteration {it}: {', '.join(parts)}")

    def _check_saved_flags(self, file: str, saved: dict, load_optim: bool):
        """The flags a checkpoint's model (and optimizer state, when it is loaded) depend on
        must be this run's."""
        cfg = self.cfg
        keys = ([] if cfg.finetune else ["model"]) + (
            ["optimizer", "state_dtype", "bf16", "no_forge", "main_params_dtype"]
            if load_optim else [])
        for key in keys:
            was = saved.get(key)  # None: a checkpoint from before the flag (its default)
            if was != getattr(cfg, key):
                hint = "; --no-load-optim starts a fresh optimizer" if key != "model" else ""
                raise ConfigError(f"--load {file}: the checkpoint was trained with "
                                  f"--{key.replace('_', '-')} {was!r}, this run asks "
                                  f"for {getattr(cfg, key)!r}{hint}")

    # ---------------------------------------------------------------- loop
    def loss_fn(self, batch):
        b = batch.to(self.device)
        return lambda: self.model(b[:, :-1], labels=b[:, 1:]).mean()

    def _comm_device(self):
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def loss_fns(self, batches):
        """One step's loss functions: the token mean of each micro-batch (pretraining), or
        with --sft the mean over every counted token of the step's micro-batches on every
        replica (sft.sft_loss_fns)."""
        if self.cfg.sft:
            from forge_engine.sft import sft_loss_fns
            return sft_loss_fns(self.model, batches, self.device, self.groups.dp_group,
                                self._comm_device())
        return [self.loss_fn(b) for b in batches]

    @torch.no_grad()
    def evaluate(self):
        from forge_engine.data import SampleStream
        if self.valid_data is None:  # --eval-iters 0, --eval-interval 0, or no valid split
            return
        g = self.groups
        stream = SampleStream(self.valid_data, self.micro, self.cfg.seed, dp_rank=g.dp_rank,
                              dp_size=g.dp_size)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.cfg.sft:  # the mean over every counted token of the evaluation
            from forge_engine.sft import masked_loss
            sums = torch.zeros(2, dtype=torch.float64, device=self.device)
            for _ in range(self.cfg.eval_iters):
                sums += torch.stack(masked_loss(self.model, next(stream), self.device)).double()
            sums = sums.to(self._comm_device())
            if g.dp_size > 1:
                dist.all_reduce(sums, group=g.dp_group)
            loss = float(sums[0]) / max(float(sums[1]), 1.0)
        else:
            for _ in range(self.cfg.eval_iters):
                total += self.loss_fn(next(stream))().double()
            if g.dp_size > 1:  # every replica evaluated its own samples
                dist.all_reduce(total, group=g.dp_group)
            loss = float(total) / (self.cfg.eval_iters * g.dp_size)
        ppl = math.exp(min(20.0, loss))
        self.log(f" validation loss at iteration {self.iteration} | lm loss value: "
                 f"{loss:.6E} | lm loss PPL: {ppl:.6E} |")
        if self.writer:
            self.writer.add_scalar("lm loss validation", loss, self.iteration)
            self.writer.add_scalar("lm loss validation ppl", ppl, self.iteration)

    def _step(self, first: int):
        """One training step (graphed or not) on the next micro-batches; at the run's first
        step with data parallelism, the bytes the replicas exchanged."""
        batches = [next(self.train_stream) for _ in range(self.num_micro)]
        before = self.engine.comm_bytes() \
            if self.groups.dp_size > 1 and self.iteration + 1 == first else None
        if self.graph_step is not None:
            captured = self.graph_step.graph is not None
            stats = self.graph_step(batches[0].to(self.device))
            if not captured and self.graph_step.graph is not None:
                self.log(f"captured the training step as a CUDA graph at iteration "
                         f"{self.iteration + 1} ({self.graph_step.capture_s:.2f} s); "
                         f"every later step is one replay")
        else:
            stats = self.engine.train_step(self.loss_fns(batches))
        self.iteration += 1
        if before is not None:
            after = self.engine.comm_bytes()
            moved = {k: after[k] - before.get(k, 0) for k in after}
            self.log("data-parallel bytes received per replica in iteration "
                     f"{self.iteration}: " + ", ".join(f"{k} {v / 2 ** 20:.2f} MiB"
                                                      for k, v in moved.items())
                     + f" (total {sum(moved.values()) / 2 ** 20:.2f} MiB)")
        return stats

    def _nonfinite_line(self, stats) -> str:
        """The error line of a step whose loss or gradient norm is not finite."""
        cfg = self.cfg
        last = f"the last checkpoint in {cfg.save} is intact" if cfg.save else \
            "no checkpoint was being saved"
        what = "lm loss" if not math.isfinite(stats.loss) else "gradient norm"
        where = ""
        if stats.nonfinite:
            more = len(stats.nonfinite) - 3
            where = ("; non-finite gradient in " + ", ".join(stats.nonfinite[:3])
                     + (f" and {more} more" if more > 0 else ""))
            if math.isfinite(stats.loss) and not cfg.no_forge:
                where += ("; --debug-nonfinite tells a fault of the kernel "
                          "launch from non-finite inputs")
        return (f"error: non-finite {what} at iteration {self.iteration} (lm loss "
                f"{stats.loss}, grad norm {stats.grad_norm}{where}); stopping without "
                f"saving; {last}")

    def _log_iteration(self, stats, dt: float):
        """Megatron's iteration line and its TensorBoard scalars; dt: seconds per iteration
        since the last line."""
        cfg = self.cfg
        tokens = self.global_batch * self.seq / dt
        mem = peak_memory_gib(self.device)
        self.log(f" iteration {self.iteration:8d}/{cfg.train_iters:8d} | consumed "
                 f"samples: {self.train_stream.consumed:12d} | elapsed time per "
                 f"iteration (ms): {dt * 1e3:.1f} | learning rate: {stats.lr:.6E} | "
                 f"global batch size: {self.global_batch:5d} | lm loss: "
                 f"{stats.loss:.6E} | grad norm: {stats.grad_norm:.3f} | peak memory "
                 f"(GiB): {mem:.2f} | tokens/s: {tokens:.0f} |")
        if self.writer:
            w, i = self.writer, self.iteration
            for tag, value in (("lm loss", stats.loss), ("learning-rate", stats.lr),
                               ("grad-norm", stats.grad_norm),
                               ("batch-size", self.global_batch), ("iteration-time", dt),
                               ("tokens-per-second", tokens),
                               ("mem-max-allocated-gigabytes", mem)):
                w.add_scalar(tag, value, i)

    def train(self) -> int:
        from forge_engine.model import norm_implementation
        cfg = self.cfg
        if cfg.load:
            self.load()
        start = self.iteration
        if start >= cfg.train_iters:
            self.log(f"nothing to train: the run is at iteration {start}, --train-iters is "
                     f"{cfg.train_iters}")
        self.log(self.engine.summary)
        self.log(f"model {cfg.hf_checkpoint or cfg.model}: {self.mcfg.num_layers} layers, hidden "
                 f"{self.mcfg.hidden_size}, vocab {self.mcfg.vocab_size}, seq {self.seq}; "
                 f"TP {self.groups.tp_size}{' + SP' if cfg.sequence_parallel else ''} x DP "
                 f"{self.groups.dp_size}; "
                 f"{'bf16' if cfg.bf16 else 'fp32'} weights; device {self.device}; "
                 f"{norm_implementation()}")
        t_last, it_last = time.perf_counter(), self.iteration
        first = self.iteration + 1
        while self.iteration < cfg.train_iters:
            stats = self._step(first)
            if not (math.isfinite(stats.loss) and math.isfinite(stats.grad_norm)):
                self.log(self._nonfinite_line(stats))
                return 1
            if self.iteration % cfg.log_interval == 0 or self.iteration == cfg.train_iters:
                now = time.perf_counter()
                self._log_iteration(stats, (now - t_last) / max(1, self.iteration - it_last))
                t_last, it_last = now, self.iteration
            if cfg.eval_interval and self.iteration % cfg.eval_interval == 0:
                self.evaluate()
                t_last = time.perf_counter()  # iteration time excludes evaluation and saving
            if cfg.save and cfg.save_interval and self.iteration % cfg.save_interval == 0:
                self.save()
                t_last = time.perf_counter()
            if cfg.exit_interval and self.iteration % cfg.exit_interval == 0:
                self.log(f"exiting at iteration {self.iteration} (--exit-interval "
                         f"{cfg.exit_interval})")
                break
        if cfg.save and self.iteration > start and \
                not (cfg.save_interval and self.iteration % cfg.save_interval == 0):
            self.save()  # not when nothing was trained: the checkpoint loaded stays as it is
        self.engine.synchronize()
        if self.writer:
            self.writer.close()
        return 0


def main(argv=None) -> int:
    from forge_engine.checkpoint import CheckpointError, describe_os_error
    try:
        cfg = parse_config(argv)
        apply_kernel_switches(cfg)  # before the first kernel launch reads them
        trainer = Trainer(cfg)
        return trainer.train()
    except SaveError as e:  # the run trained, its save did not: the line says what is kept
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (ConfigError, ValueError, CheckpointError) as e:  # bad input: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file that cannot be read or written
        print(f"error: {describe_os_error(e)}", file=sys.stderr)
        return 2
    finally:
        from forge_engine.parallel.state import destroy_parallel
        _stop_library_log()
        destroy_parallel()


if __name__ == "__main__":
    sys.exit(main())
