"""What the demo's training scripts share: the learning-rate schedule, one optimizer step, the
loop with its running record (printed as JSON lines and kept for the script's report), the flags
of the drafter scripts, and the line writer of a log file. Each script (models/demo/train.py,
train_drafters.py, train_eagle3.py, train_smol.py, distill_smol.py) imports this module and the
demo's libraries (world, processor, picture_task, drafter_data, picture_adapters, smol), never
another script."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def learning_rate(step: int, steps: int, peak: float, warmup: int = 60) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(progress * torch.pi)).item()))


class LossLog:
    """Running means of named figures, printed and kept every `every` steps and at the last."""

    def __init__(self, every: int = 25):
        self.every, self.entries, self.sums, self.started = every, [], {}, time.perf_counter()

    def add(self, step: int, steps: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
        if (step + 1) % self.every == 0 or step + 1 == steps:
            count = self.every if (step + 1) % self.every == 0 else (step + 1) % self.every
            entry = {"step": step + 1, "seconds": round(self.seconds(), 1)} | \
                    {key: round(value / count, 4) for key, value in self.sums.items()}
            self.entries.append(entry)
            print(json.dumps(entry), flush=True)
            self.sums = {}

    def seconds(self) -> float:
        return time.perf_counter() - self.started


def optimizer_step(optimizer, module: torch.nn.Module, loss: torch.Tensor, lr: float) -> None:
    """One step of `module`: the learning rate set, the loss's gradients clipped to norm 1, applied, cleared."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def add_training_flags(parser: argparse.ArgumentParser, steps: int, save_every: int) -> None:
    """The flags both training scripts take (--steps, --batch-size, --lr, --seed, --threads, --save-every,
    --max-answer-tokens), with the script's own number of steps and saving interval."""
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=save_every,
                        help="also save every N steps (0: at the end only)")
    parser.add_argument("--max-answer-tokens", type=int, default=96, help="longest target answer generated")


def run_training(steps: int, save_every: int, train_step, save) -> float:
    """`train_step(step)` for each step (its figures kept by a LossLog), `save(entries, seconds)` every
    `save_every` steps (0: never) and at the end; the seconds it took. Both training scripts' loop."""
    log = LossLog()
    for step in range(steps):
        log.add(step, steps, train_step(step))
        if save_every and (step + 1) % save_every == 0 and step + 1 < steps:
            save(log.entries, log.seconds())
    seconds = log.seconds()
    save(log.entries, seconds)
    return seconds


def write_record(path: Path, record: dict) -> None:
    """`record` printed as one JSON line and appended to the log file `path`."""
    print(json.dumps(record), flush=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
