"""Host time of advance_static_step(), the Python half of every replayed FORGE graph step: it
runs before the replay while the device waits, so it adds to the step's time one for one.

    python3 benchmarks/host_static_step.py                 # the model on the GPU if there is one
    python3 benchmarks/host_static_step.py --device cpu

The Llama-3.1-8B parameter layout (32 layers, untied head: 195 parameters, one param group)
at toy width, so that only the host work per parameter counts; one eager AdamW step creates
the optimizer state, then capture_static_step() and --calls timed advance_static_step()
calls (each followed by replayed_static_step(), as CudaGraphStep does; nothing is replayed).
Prints the median, min and max in ms.
"""
import argparse
import sys
import time

import torch

sys.path.insert(0, ".")
from forge_engine import optim as fopt  # noqa: E402
from forge_engine.model import GPT, preset  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--calls", type=int, default=30)
    a = ap.parse_args()
    if a.calls < 1 or a.layers < 1:
        raise SystemExit("error: --calls and --layers must be at least 1")
    dev = torch.device(a.device)
    cfg = preset("llama3.1-8b", num_layers=a.layers, hidden_size=64, ffn_hidden_size=128,
                 num_attention_heads=4, num_query_groups=2, vocab_size=256, seq_length=16,
                 untie_embeddings_and_output_weights=True)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = GPT(cfg, params_dtype=dtype).to(dev)
    opt = fopt.AdamW(model, lr=1e-3, weight_decay=0.1)
    ids = torch.randint(0, cfg.vocab_size, (1, 17), device=dev)
    model(ids[:, :-1], labels=ids[:, 1:]).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    opt.capture_static_step()
    times = []
    for i in range(a.calls + 3):  # 3 untimed
        t0 = time.perf_counter()
        opt.advance_static_step()
        dt = (time.perf_counter() - t0) * 1e3
        opt.replayed_static_step()
        if i >= 3:
            times.append(dt)
    times.sort()
    print(f"{dev.type}: {len(opt._static.params)} parameters, advance_static_step() median "
          f"{times[len(times) // 2]:.2f} ms (min {times[0]:.2f}, max {times[-1]:.2f}) over "
          f"{a.calls} calls")


if __name__ == "__main__":
    main()
