"""Write a small synthetic chat file for the README's fine-tuning example on the CPU:

    python tools/make_tiny_chat_data.py --out data/chat.jsonl [--num 2000] [--seed 0]

Each line is one conversation, in the two forms `tools/preprocess_data.py --sft` reads:
{"messages": [{"role": "system" | "user" | "assistant", "content": ...}, ...]} (one to three
user/assistant turns, some with a system message) and, for one line in five,
{"prompt": ..., "response": ...}. The tasks (add two numbers, reverse a word, spell a word in
capitals, count its letters) have answers that follow from the question, so the loss over the
answers falls in a few hundred steps of a tiny model. The file is a function of --num and
--seed.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

WORDS = ("forge", "tensor", "kernel", "gradient", "token", "matrix", "vector", "layer",
         "packing", "sample", "update", "weight", "python", "triton", "model", "chat")
SYSTEMS = ("You are a helpful assistant.", "Answer briefly.", "You answer in one line.")


def _task(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(4)
    word = rng.choice(WORDS)
    if kind == 0:
        a, b = rng.randrange(100), rng.randrange(100)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 1:
        return f"Reverse the word {word}.", f"The reverse of {word} is {word[::-1]}."
    if kind == 2:
        return f"Write {word} in capitals.", f"{word.upper()}"
    return f"How many letters are in {word}?", f"{word} has {len(word)} letters."


def conversation(rng: random.Random) -> dict:
    """One jsonl record: a prompt/response pair (one in five) or a chat of 1 to 3 turns."""
    if rng.random() < 0.2:
        prompt, response = _task(rng)
        return {"prompt": prompt, "response": response}
    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
    for _ in range(rng.randint(1, 3)):
        question, answer = _task(rng)
        messages += [{"role": "user", "content": question},
                     {"role": "assistant", "content": answer}]
    return {"messages": messages}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="jsonl file to write")
    p.add_argument("--num", type=int, default=2000, help="conversations (default: 2000)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.num < 1:
        print(f"make_tiny_chat_data.py: error: --num must be >= 1, got {a.num}", file=sys.stderr)
        return 2
    rng = random.Random(a.seed)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        for _ in range(a.num):
            f.write(json.dumps(conversation(rng)) + "\n")
    print(f"wrote {a.out}: {a.num} conversations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
