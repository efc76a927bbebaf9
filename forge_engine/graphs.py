"""A whole training step captured as one CUDA graph and replayed (`pretrain.py
--enable-cuda-graph`, as Megatron-LM's flag of that name; one GPU).

Why: at small batches the GPU finishes a step's kernels before Python has launched them
(benchmarks/bench_step.py measures eager against graphed steps). A replay launches the forward, the backward with FORGE's fused updates, the
norm and the optimizer step in one call, so the step costs its kernels.

How FORGE fits in a graph: a graph replays its launches with the arguments they had at capture.
Everything that changes from step to step must therefore live in device memory, written before
each replay. For FORGE that is each parameter's hyperparameter vector (lr, bias corrections) and
the step's part of the stochastic-rounding seed (rules.HP_SEED): ForgeOptimizer's
capture_static_step() gives each parameter a persistent row, and advance_static_step() does a
step's host bookkeeping (step counts, NAdam's mu_product) and copies the new rows to the device,
before every replay. An eager step of the same optimizer after the capture is refused (it would
read used rows and count no step). With FORGE off, torch's AdamW(fused=True, capturable=True)
keeps its step counts on the device; a scheduled lr becomes a device tensor that is filled
before each replay.

The contract, checked with a one-line error before any work: parameters on CUDA, no tensor or
data parallelism (their collectives are not captured), one micro-batch per step, and the
batch's shape, dtype and device fixed. Global-norm clipping (Engine(clip_grad=...)) works: the
norm and the clip factor are computed on the device (device_step).
The first `warmup` steps run eagerly (they compile the kernels and create the optimizer state);
the graph is captured at the next step and replayed from then on. The returned StepStats read
the loss and the norm back, one synchronization per step.
"""
from __future__ import annotations

import contextlib
import math
import re
import time

import torch

from forge_engine.engine import Engine, StepStats
from forge_engine.optim import ForgeOptimizer
from forge_engine.optim.clipping import scale_grads_
from forge_engine.parallel.mappings import world


class CudaGraphStep:
    """step(batch) -> StepStats: Engine.train_step(lambda: loss_of(batch)), captured once and
    replayed. loss_of(batch) runs the forward and returns the scalar loss; batch is a tensor on
    the model's device, of one shape and dtype in every call."""

    def __init__(self, engine: Engine, loss_of, warmup: int = 3):
        opt, model = engine.optimizer, engine.model
        dev = next(model.parameters()).device
        if dev.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, it is on {dev}")
        if world(engine.tp_group) > 1 or world(engine.dp_group) > 1:
            raise ValueError("CUDA graph steps support one GPU (tensor and data parallel "
                             "size 1): their collectives are not captured")
        if int(warmup) < 1:
            raise ValueError(f"warmup must be at least 1 eager step (it compiles the kernels "
                             f"and creates the optimizer state), got {warmup}")
        self.forge = isinstance(opt, ForgeOptimizer)
        if not self.forge and not opt.defaults.get("capturable"):
            raise ValueError(f"CUDA graph steps with FORGE off need a capturable optimizer "
                             f"(torch.optim.AdamW(fused=True, capturable=True)), got "
                             f"{type(opt).__name__} without capturable=True")
        self.engine, self.loss_of, self.warmup = engine, loss_of, int(warmup)
        self.device = dev
        self.graph = None
        self.capture_s = None  # seconds the capture took
        self.steps = 0
        self._side = torch.cuda.Stream(dev)

    def _set_lr(self):
        eng = self.engine
        if eng.lr_schedule is None:
            return
        lr = float(eng.lr_schedule(eng.iteration))
        for g in eng.optimizer.param_groups:
            if torch.is_tensor(g["lr"]):  # a captured torch optimizer reads it on the device
                g["lr"].fill_(lr)
            else:
                g["lr"] = lr

    def _check(self, batch: torch.Tensor):
        want = self._static
        if (batch.shape, batch.dtype, batch.device) != (want.shape, want.dtype, want.device):
            raise ValueError(f"a captured step replays one batch layout: shape "
                             f"{tuple(want.shape)} {want.dtype} on {want.device}, got "
                             f"{tuple(batch.shape)} {batch.dtype} on {batch.device}")
        if self.engine.optimizer.state is not self._state:
            raise RuntimeError("the optimizer state was replaced (load_state_dict) after the "
                               "step was captured; load checkpoints before the first step")

    def __call__(self, batch: torch.Tensor) -> StepStats:
        if self.steps < self.warmup:  # eager, on a side stream (as torch's capture advises)
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._side):
                stats = self.engine.train_step(lambda: self.loss_of(batch))
            torch.cuda.current_stream(self.device).wait_stream(self._side)
            self.steps += 1
            return stats
        if self.graph is None:
            self._capture(batch)
        self._check(batch)
        eng = self.engine
        self._set_lr()
        if self.forge:
            eng.optimizer.advance_static_step()
        self._static.copy_(batch)
        self.graph.replay()
        if self.forge:
            eng.optimizer.replayed_static_step()
        eng.iteration += 1
        self.steps += 1
        loss = float(self._loss)
        norm = math.sqrt(float(self._norm_sq))
        bad = [] if math.isfinite(norm) else eng._nonfinite_names(self._sums)
        return StepStats(loss, norm, float(eng.lr()), bad)

    def _capture(self, batch: torch.Tensor):
        eng, opt = self.engine, self.engine.optimizer
        if not self.forge and eng.lr_schedule is not None:
            for g in opt.param_groups:  # a scheduled lr the captured kernels read on the device
                if not torch.is_tensor(g["lr"]):
                    g["lr"] = torch.tensor(float(g["lr"]), dtype=torch.float32,
                                           device=self.device)
        self._static = batch.detach().clone()
        opt.zero_grad(set_to_none=True)  # gradients are allocated in the graph's memory pool
        if self.forge:
            opt.capture_static_step()
        self._state = opt.state
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        recording = opt.recording_static_step() if self.forge else contextlib.nullcontext()
        try:
            # a torch.compile'd region must not compile while the stream captures (the
            # compiler runs CUDA work of its own there): one whose guards fail on the
            # capture's inputs raises here, before it compiles
            with recording, torch._dynamo.config.patch(error_on_recompile=True), \
                    torch.cuda.graph(graph):
                self._record(eng, opt)
        except Exception as e:
            raise RuntimeError(_capture_failure(e)) from e
        self.graph = graph
        self.capture_s = time.perf_counter() - t0

    def _record(self, eng, opt):
        self._loss, self._norm_sq, self._sums = device_step(
            eng, lambda: self.loss_of(self._static))


def _capture_failure(e: BaseException) -> str:
    """The one-line reason a capture failed, from the exception it raised (a compiled
    region's recompilation is found in the exception's chain: the capture's own end fails
    after it)."""
    recompile, seen, todo = None, set(), [e]
    while todo and recompile is None:
        x = todo.pop()
        if x is not None and id(x) not in seen:
            seen.add(id(x))
            todo += [x.__cause__, x.__context__]
            if isinstance(x, torch._dynamo.exc.RecompileError):
                recompile = x
    if recompile is not None:
        # Dynamo's text: "Recompiling function NAME in FILE:LINE", then "- N/M: GUARD  # ..."
        text = str(recompile)
        where = re.search(r"Recompiling function (\S+) in (\S+)", text)
        guard = re.search(r"^\s*- \d+/\d+: ([^#\n]*)", text, re.M)
        what = (f"{where.group(1)} ({where.group(2)})" if where else "a region") + \
            (f", guard failed: {guard.group(1).strip()}" if guard else "")
        return (f"forge_engine: capturing the training step as a CUDA graph failed: a "
                f"torch.compile'd region would compile again during the capture ({what}); "
                f"the capture must call compiled regions as the warmup "
                f"steps did. transformers' models build an explicit attention mask while a "
                f"stream captures and none in eager steps: pass the model a 4-D "
                f"attention_mask, or compile nothing inside the graphed step")
    return (f"forge_engine: capturing the training step as a CUDA graph failed "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); an "
            f"operation in the step waits for the device or is not capturable; run without "
            f"--enable-cuda-graph")


def device_step(engine: Engine, loss_fn):
    """One step as Engine.train_step runs it for one micro-batch, without a host
    synchronization: what CudaGraphStep captures. Returns, on the device, the loss (0-d
    float64), the squared global gradient norm before clipping (0-d fp32) and, with FORGE,
    copies of the fused weights' squared norms by device (to name non-finite ones). With FORGE
    the optimizer must be in capture_static_step() mode: a capture records this under
    recording_static_step(); run directly, advance_static_step() comes first. With
    engine.clip_grad > 0 the clip factor is computed and applied on the device (in float64,
    as Engine does on the host): FORGE reads it from the fused weights' hp rows."""
    opt = engine.optimizer
    forge = isinstance(opt, ForgeOptimizer)
    clip = engine.clip_grad
    if forge and clip > 0:
        opt.defer_updates()  # every fused update waits for the norm
    loss = loss_fn()
    loss.backward()
    if clip > 0:
        norm_sq = engine._grad_norm_sq(deferred=True)
        factor = (clip / (norm_sq.double().sqrt() + 1e-6)).float()
        if forge:
            opt.scale_gradients(factor)
            opt.flush()
        else:
            # in fp32, as Engine's float factor (scale_grad_)
            scale_grads_(engine.model.parameters(), factor.clamp(max=1.0))
    else:
        if forge:
            opt.flush()  # weights with several consumers (tied embedding and LM head)
        norm_sq = engine._grad_norm_sq()
    sums = {k: v.clone() for k, v in opt._sumsq.items()} if forge else None
    opt.step()
    return loss.detach().double(), norm_sq, sums
