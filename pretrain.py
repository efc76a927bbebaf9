"""Train a GPT with FORGE, the way a Megatron-LM user expects.

    python pretrain.py --model tiny --mock-data --train-iters 100
    torchrun --nproc-per-node 2 pretrain.py --tensor-parallel 2 --sequence-parallel ...

Flags are Megatron-LM's (forge_engine/config.py lists them; --help prints them). One rank prints
Megatron's log and validation lines and writes TensorBoard events; checkpoints use Megatron's
layout (forge_engine/checkpoint.py) and hold everything needed to resume bit for bit on the same
tensor-parallel layout: model shard, every optimizer state (FORGE moments, int8 codes and scales),
iteration, data position and RNG states.
"""
from __future__ import annotations

import logging
import math
import resource
import sys
import time

import torch
import torch.distributed as dist

from forge_engine.config import ConfigError, TrainConfig, parse_config


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


class Trainer:
    def __init__(self, cfg: TrainConfig):
        from forge_engine.data import (IndexedGPTDataset, MockGPTDataset, SampleStream,
                                       padded_vocab_size)
        from forge_engine.engine import Engine
        from forge_engine.model import GPT, preset
        from forge_engine.parallel.state import init_parallel
        from forge_engine.tokenizer import build_tokenizer

        self.cfg = cfg
        self.groups = g = init_parallel(cfg.tensor_model_parallel_size)
        self.rank0 = dist.get_rank() == 0
        if self.rank0:  # forge_engine's own notes (e.g. the accumulation choice per weight)
            log = logging.getLogger("forge_engine")
            log.setLevel(logging.INFO)
            handler = logging.StreamHandler(sys.stdout)
            handler.setFormatter(logging.Formatter("%(message)s"))
            log.addHandler(handler)
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
        self.device = torch.device(f"cuda:{torch.cuda.current_device()}"
                                   if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if cfg.bf16 else torch.float32
        if cfg.hf_checkpoint:
            from forge_engine.hf import load_pretrained
            self.model = load_pretrained(cfg.hf_checkpoint, dtype=dtype, tp_group=g.tp_group,
                                         sequence_parallel=cfg.sequence_parallel
                                         and g.tp_size > 1, vocab_size=vocab,
                                         seq_length=self.seq).to(self.device)
        else:
            self.model = GPT(self.mcfg, tp_group=g.tp_group,
                             sequence_parallel=cfg.sequence_parallel and g.tp_size > 1,
                             params_dtype=dtype, seed=cfg.seed,
                             init_device="cpu" if cfg.use_cpu_initialization
                             else self.device.type).to(self.device)
        if cfg.enable_cuda_graph and cfg.no_forge and cfg.optimizer != "adamw":
            raise ConfigError(f"--enable-cuda-graph with --no-forge supports --optimizer adamw "
                              f"(torch's capturable fused AdamW), got {cfg.optimizer}")
        self.engine = Engine(self.model, cfg.optimizer, forge=not cfg.no_forge,
                             tp_group=g.tp_group, dp_group=g.dp_group,
                             lr_schedule=lambda n: lr_at(cfg, n),
                             clip_grad=cfg.clip_grad, **optimizer_kwargs(cfg))
        if cfg.mock_data:
            n = max(1024, 4 * cfg.train_iters * self.global_batch)
            train = MockGPTDataset(tok_vocab, self.seq, cfg.seed, n)
            valid = MockGPTDataset(tok_vocab, self.seq, cfg.seed + 1, 256)
        else:
            train = IndexedGPTDataset(cfg.data_path, self.seq, cfg.split, "train", cfg.seed)
            valid = IndexedGPTDataset(cfg.data_path, self.seq, cfg.split, "valid", cfg.seed)
        self.train_stream = SampleStream(train, self.micro, cfg.seed, dp_rank=g.dp_rank,
                                         dp_size=g.dp_size)
        self.graph_step = None
        if cfg.enable_cuda_graph:
            from forge_engine.graphs import CudaGraphStep
            if self.num_micro > 1:
                raise ConfigError(f"--enable-cuda-graph needs one micro-batch per step; "
                                  f"--global-batch-size {self.global_batch} makes "
                                  f"{self.num_micro}")
            try:
                self.graph_step = CudaGraphStep(
                    self.engine, lambda b: self.model(b[:, :-1], labels=b[:, 1:]).mean(),
                    warmup=cfg.cuda_graph_warmup_steps)
            except ValueError as e:
                raise ConfigError(f"--enable-cuda-graph: {e}") from None
        self.valid_data = valid
        self.iteration = 0
        self.writer = None
        if cfg.tensorboard_dir and self.rank0:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(cfg.tensorboard_dir)

    def log(self, msg: str):
        if self.rank0:
            print(msg, flush=True)

    # ---------------------------------------------------------------- checkpoints
    def save(self):
        from forge_engine.checkpoint import rng_state, save_checkpoint
        g = self.groups
        self.engine.synchronize()
        state = {"optimizer": self.engine.optimizer.state_dict()}
        if g.dp_rank == 0:  # replicas hold equal weights: one copy, beside replica 0's shard
            from dataclasses import asdict  # model_config, hf_config: tools/export_hf.py
            state.update(model_config=asdict(self.mcfg), vocab_unpadded=self.tok_vocab,
                         hf_config=getattr(self.model, "hf_config", None))
            state.update(model=self.model.state_dict(), iteration=self.iteration,
                         engine_iteration=self.engine.iteration,
                         data=self.train_stream.state_dict(), rng=rng_state(),
                         args=vars(self.cfg))
        path = save_checkpoint(self.cfg.save, self.iteration, state, tp_rank=g.tp_rank,
                               tp_size=g.tp_size, barrier=dist.barrier, dp_rank=g.dp_rank,
                               dp_size=g.dp_size)
        self.log(f"saved checkpoint at iteration {self.iteration:8d} to {self.cfg.save}")
        return path

    def load(self):
        from forge_engine.checkpoint import load_checkpoint, set_rng_state
        g = self.groups
        it, state = load_checkpoint(self.cfg.load, tp_rank=g.tp_rank, tp_size=g.tp_size,
                                    dp_size=g.dp_size)
        if g.dp_rank > 0:  # this replica's optimizer shard; the rest is replica 0's
            _, own = load_checkpoint(self.cfg.load, tp_rank=g.tp_rank, tp_size=g.tp_size,
                                     iteration=it, dp_rank=g.dp_rank, dp_size=g.dp_size)
            state["optimizer"] = own["optimizer"]
        saved = state.get("args", {})
        for key in ("model", "optimizer", "state_dtype", "bf16", "no_forge", "main_params_dtype"):
            was = saved.get(key)  # None: a checkpoint from before the flag (its default)
            if was != getattr(self.cfg, key):
                raise ConfigError(f"--load {self.cfg.load}: the checkpoint was trained with "
                                  f"--{key.replace('_', '-')} {was!r}, this run asks "
                                  f"for {getattr(self.cfg, key)!r}")
        self.model.load_state_dict(state["model"])
        self.engine.optimizer.load_state_dict(state["optimizer"])
        self.engine.iteration = state["engine_iteration"]
        self.train_stream.load_state_dict(state["data"])
        set_rng_state(state["rng"])
        self.iteration = it
        self.log(f"loaded checkpoint from {self.cfg.load} at iteration {it}")

    # ---------------------------------------------------------------- loop
    def loss_fn(self, batch):
        b = batch.to(self.device)
        return lambda: self.model(b[:, :-1], labels=b[:, 1:]).mean()

    @torch.no_grad()
    def evaluate(self):
        from forge_engine.data import SampleStream
        if self.cfg.eval_iters == 0:
            return
        g = self.groups
        stream = SampleStream(self.valid_data, self.micro, self.cfg.seed, dp_rank=g.dp_rank,
                              dp_size=g.dp_size)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
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

    def train(self) -> int:
        from forge_engine.model import norm_implementation
        cfg = self.cfg
        if cfg.load:
            self.load()
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
                stats = self.engine.train_step([self.loss_fn(b) for b in batches])
            self.iteration += 1
            if before is not None and self.iteration == first:  # the run's first step
                after = self.engine.comm_bytes()
                moved = {k: after[k] - before.get(k, 0) for k in after}
                self.log("data-parallel bytes received per replica in iteration "
                         f"{self.iteration}: " + ", ".join(f"{k} {v / 2 ** 20:.2f} MiB"
                                                          for k, v in moved.items())
                         + f" (total {sum(moved.values()) / 2 ** 20:.2f} MiB)")
            if not (math.isfinite(stats.loss) and math.isfinite(stats.grad_norm)):
                last = f"the last checkpoint in {cfg.save} is intact" if cfg.save else \
                    "no checkpoint was being saved"
                what = "lm loss" if not math.isfinite(stats.loss) else "gradient norm"
                where = ""
                if stats.nonfinite:
                    more = len(stats.nonfinite) - 3
                    where = ("; non-finite gradient in " + ", ".join(stats.nonfinite[:3])
                             + (f" and {more} more" if more > 0 else ""))
                    if math.isfinite(stats.loss) and not cfg.no_forge:
                        where += ("; FORGE_DEBUG_NONFINITE=1 tells a fault of the kernel "
                                  "launch from non-finite inputs")
                self.log(f"error: non-finite {what} at iteration {self.iteration} (lm loss "
                         f"{stats.loss}, grad norm {stats.grad_norm}{where}); stopping without "
                         f"saving; {last}")
                return 1
            if self.iteration % cfg.log_interval == 0 or self.iteration == cfg.train_iters:
                now = time.perf_counter()
                dt = (now - t_last) / max(1, self.iteration - it_last)
                t_last, it_last = now, self.iteration
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
                    w.add_scalar("lm loss", stats.loss, i)
                    w.add_scalar("learning-rate", stats.lr, i)
                    w.add_scalar("grad-norm", stats.grad_norm, i)
                    w.add_scalar("batch-size", self.global_batch, i)
                    w.add_scalar("iteration-time", dt, i)
                    w.add_scalar("tokens-per-second", tokens, i)
                    w.add_scalar("mem-max-allocated-gigabytes", mem, i)
            if self.iteration % cfg.eval_interval == 0:
                self.evaluate()
                t_last = time.perf_counter()  # iteration time excludes evaluation and saving
            if cfg.save and cfg.save_interval and self.iteration % cfg.save_interval == 0:
                self.save()
                t_last = time.perf_counter()
            if cfg.exit_interval and self.iteration % cfg.exit_interval == 0:
                self.log(f"exiting at iteration {self.iteration} (--exit-interval "
                         f"{cfg.exit_interval})")
                break
        if cfg.save and not (cfg.save_interval and self.iteration % cfg.save_interval == 0):
            self.save()
        self.engine.synchronize()
        if self.writer:
            self.writer.close()
        return 0


def main(argv=None) -> int:
    try:
        cfg = parse_config(argv)
        trainer = Trainer(cfg)
        return trainer.train()
    except (ConfigError, ValueError, FileNotFoundError) as e:  # bad input: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        from forge_engine.parallel.state import destroy_parallel
        destroy_parallel()


if __name__ == "__main__":
    sys.exit(main())
