"""A small real training job with FORGE: a byte-level MLP language model on Python's own sources.

`make train` runs this until pretrain.py (the Megatron-style program, issue 4) lands. The corpus
is the running interpreter's standard library (.py files: real text nobody here wrote, present
on every machine). The model predicts the next byte from the previous CONTEXT bytes:

    ids [B, C] -> embedding [B, C, E] -> flatten [B, C*E] -> Linear -> GELU -> Linear -> GELU
    -> Linear -> logits [B, 256]

The three Linear weights are updated inside backward by the fused kernel; the embedding and the
biases take the standard path (opt.step()). CPU by default; CUDA (bf16 weights) when present.
"""
from __future__ import annotations

import argparse
import pathlib
import sysconfig
import time

import torch
from torch import nn

import forge_engine


def load_corpus(max_bytes: int) -> torch.Tensor:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total == 0:
        raise SystemExit(f"error: no .py files under {root} to train on")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


class ByteMLP(nn.Module):
    def __init__(self, context: int, emb: int, hidden: int, dtype):
        super().__init__()
        self.embed = nn.Embedding(256, emb, dtype=dtype)
        self.fc1 = nn.Linear(context * emb, hidden, dtype=dtype)
        self.fc2 = nn.Linear(hidden, hidden, dtype=dtype)
        self.head = nn.Linear(hidden, 256, dtype=dtype)

    def forward(self, ids):  # ids [B, C] -> logits [B, 256]
        h = self.embed(ids).flatten(1)
        h = nn.functional.gelu(self.fc1(h))
        h = nn.functional.gelu(self.fc2(h))
        return self.head(h)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--state-dtype", choices=["fp32", "bf16", "int8"], default=None)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-interval", type=int, default=25)
    a = p.parse_args(argv)
    if a.steps <= 0 or a.batch <= 0 or a.context <= 0:
        p.error("--steps, --batch and --context must be positive")

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(a.seed)
    data = load_corpus(4 << 20)
    split = int(0.95 * len(data))
    train, valid = data[:split], data[split:]
    model = ByteMLP(a.context, 32, 512, dtype).to(dev)
    opt = forge_engine.optim.AdamW(model, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                   state_dtype=a.state_dtype, seed=a.seed)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / a.steps))
    print(f"device {dev}, weights {dtype}, corpus {len(data) / 1e6:.1f} MB of Python stdlib")
    print(opt.forge_summary())
    g = torch.Generator().manual_seed(a.seed)

    def sample(src):
        i = torch.randint(0, len(src) - a.context - 1, (a.batch,), generator=g)
        idx = i[:, None] + torch.arange(a.context + 1)
        chunk = src[idx].to(dev)
        return chunk[:, :-1], chunk[:, -1]

    t0, tokens = time.time(), 0
    for step in range(1, a.steps + 1):
        x, y = sample(train)
        loss = nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        tokens += a.batch
        if step % a.log_interval == 0 or step == a.steps:
            with torch.no_grad():
                vx, vy = sample(valid)
                vloss = nn.functional.cross_entropy(model(vx).float(), vy).item()
            dt = time.time() - t0
            print(f" iteration {step:6d}/{a.steps:6d} | lm loss: {loss.item():.4f} | "
                  f"validation loss: {vloss:.4f} | grad norm: {opt.grad_norm.item():.3f} | "
                  f"learning rate: {opt.param_groups[0]['lr']:.3E} | "
                  f"tokens/s: {tokens / dt:.0f}", flush=True)
    print("done: the loss above fell from ln(256) = 5.55 (uniform bytes)")


if __name__ == "__main__":
    main()
