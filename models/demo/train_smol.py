"""Train the SmolLM2 demo's vision tower and connector, the language model frozen, on a CPU.

    python -m models.demo.train_smol --ckpt /work/ckpt/smol      # resumes from its latest checkpoint
    python -m models.demo.train_smol --ckpt DIR --device cuda --batch-size 32 --workers 12 --minutes 5 ...

The model is `models.demo.smol`'s assembly (SmolLM2-135M-Instruct as the language model of a
Qwen2-VL model), started from the bundled 3.6 M demo's vision tower with a fresh connector
layer to 576. Only `model.visual` (vision tower + connector, 1.0 M parameters) is trained; the
language model's weights never change, so text-only turns answer as SmolLM2 does; with
`--adapters-rank R` low-rank adapters on the language model learn too (`picture_adapters.py`).

Data: the world's training conversations (`world.train_examples`), batch b of pool p drawn
from a fixed range of examples, so a resumed run sees exactly the batches it would have seen.
Losses, as in `models.demo.train` (each only speeds up learning): the answer tokens'
cross-entropy (lm_head applied at the answer positions only), the cell loss (each vision token
read through the tied output embedding names its cell's content), the picture loss (the
language model's output at each vision token names the picture's ordinal and counts) and the
count probe (a linear head, training only, on the middle layer at the vision tokens).

Every --log-every steps a line goes to `<ckpt>/log.jsonl` (losses, seconds, tokens a second);
every --eval-every steps plain greedy `generate` scores --eval-questions held-out questions
(eval seed 0); every --checkpoint-minutes the trained parts, the optimizer and the step go to
`<ckpt>/latest.pt` (and `<ckpt>/parts/`, the folder `models.demo.smol` reads; copy it to
assets/demo_smol to ship it).

On a GPU (`--device cuda`) the batches are built by `--workers` processes (the pictures and
the processor run on the CPU), and `--minutes M` sets the schedule's length from the measured
speed of the first `--warmup` steps, so that the run ends after about M minutes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import time
from pathlib import Path

import torch

from models.demo import smol, world
from models.demo.picture_adapters import PREFIX, PictureAdapters, text_batches, text_distillation
from models.demo.picture_task import PROBE_CLASSES, PROBE_GROUPS, accuracy, cell_loss, encode, probe_loss
from models.demo.training import learning_rate, write_record


def load_model(folder: Path):
    from transformers import Qwen2VLForConditionalGeneration

    from models.processors import load_processor

    model = Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("model.visual."))
    return model, load_processor(str(folder))


def batch_examples(step: int, batch_size: int, seed: int, pool: int = 8, first_example: int = 0) -> list[world.Example]:
    """The examples of training step `step`: pool `step // pool` holds examples
    first_example + pool * batch_size * (step // pool) onwards, sorted by length and cut into
    `pool` batches, shuffled with (seed, pool number)."""
    number, index = divmod(step, pool)
    group = list(world.train_examples(first_example + number * pool * batch_size, pool * batch_size))
    group.sort(key=lambda e: len(e.images) * 20 + sum(len(str(m["content"])) for m in e.messages) // 4)
    chunks = [group[i: i + batch_size] for i in range(0, len(group), batch_size)]
    random.Random(f"{seed}:{number}").shuffle(chunks)
    return chunks[index]


class StepBatches(torch.utils.data.Dataset):
    """The encoded batches of steps `first` .. `end` - 1 (`batch_examples`), for a DataLoader's workers."""

    def __init__(self, processor, first: int, end: int, batch_size: int, seed: int, first_example: int = 0):
        self.processor, self.first, self.end, self.batch_size, self.seed = processor, first, end, batch_size, seed
        self.first_example = first_example

    def __len__(self) -> int:
        return self.end - self.first

    def __getitem__(self, index: int):
        return encode(self.processor, batch_examples(self.first + index, self.batch_size, self.seed,
                                                      first_example=self.first_example))


def losses(model, probe, batch, weights: dict, bf16: bool) -> dict[str, torch.Tensor]:
    captured = []
    hook = model.model.visual.register_forward_hook(lambda m, i, out: captured.append(out.pooler_output))
    image_token_id = model.config.image_token_id
    with torch.autocast(batch.input_ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        out = model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                          mm_token_type_ids=batch.mm_token_type_ids, pixel_values=batch.pixel_values,
                          image_grid_thw=batch.image_grid_thw, output_hidden_states=weights["probe"] > 0)
        hidden = out.last_hidden_state
        labels = batch.labels[:, 1:]
        answer_rows = hidden[:, :-1][labels != -100]
        answer = torch.nn.functional.cross_entropy(model.lm_head(answer_rows).float(), labels[labels != -100])
        result = {"answer": answer}
        if weights["picture"] > 0:
            rows = model.lm_head(hidden[batch.input_ids == image_token_id])
            result["picture"] = torch.nn.functional.cross_entropy(rows.float(), batch.picture_targets)
    hook.remove()
    vision = torch.cat(list(captured[0])) if isinstance(captured[0], (list, tuple)) else captured[0]
    if weights["cell"] > 0:
        result["cell"] = cell_loss(model, vision, batch.cell_targets)
    if weights["probe"] > 0:
        middle = out.hidden_states[model.config.text_config.num_hidden_layers // 2]
        result["probe"] = probe_loss(probe, middle, batch.input_ids, image_token_id, batch.probe_targets)
    result["total"] = answer + sum(weights[k] * v for k, v in result.items() if k != "answer")
    return result


@torch.no_grad()
def batched_accuracy(model, processor, questions: list[world.Question], batch_size: int = 50,
                     max_new_tokens: int = 120) -> tuple[float, dict]:
    """`accuracy` with batched greedy `generate` (left padding) on the model's device: an
    estimate for a GPU run (padding can move a float here and there), not the engine's figure."""
    tokenizer, device = processor.tokenizer, next(model.parameters()).device
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    per_kind: dict[str, list[int]] = {}
    model.eval()
    try:
        for first in range(0, len(questions), batch_size):
            chunk = questions[first: first + batch_size]
            texts = [processor.apply_chat_template([{"role": "user", "content": [{"type": "image"} for _ in q.images]
                                                     + [{"type": "text", "text": q.prompt}]}], add_generation_prompt=True)
                     for q in chunk]
            inputs = processor(text=texts, images=[i for q in chunk for i in q.images], padding=True,
                               return_tensors="pt").to(device)
            output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                    pad_token_id=tokenizer.pad_token_id)
            answers = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
            for question, answer in zip(chunk, answers):
                per_kind.setdefault(question.kind, []).append(int(world.answer_matches(answer, question.answer)))
    finally:
        tokenizer.padding_side = side
    total = sum(sum(v) for v in per_kind.values()) / len(questions)
    return total, {kind: sum(v) / len(v) for kind, v in sorted(per_kind.items())}


def save_checkpoint(path: Path, model, probe, adapters, optimizer, step: int, info: dict) -> None:
    state = {"visual": {k: v.detach().clone() for k, v in model.model.visual.state_dict().items()},
             "probe": probe.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "info": info,
             "adapters": adapters.state_dict() if adapters is not None else None}
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    smol.save_parts(model, path.parent / "parts", {"step": step, **info}, adapters)


def text_data(args, processor):
    """Endless text batches of the frozen target's own answers (None without --text-data)."""
    if args.text_data is None or args.text_batch == 0:
        return None
    records = [r for r in map(json.loads, args.text_data.read_text().splitlines()) if r["kind"] == "text"]
    render = lambda prompt: processor.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": [{"type": "text", "text": prompt}]}], add_generation_prompt=True)
    return ({k: v.to(args.device) for k, v in batch.items()}
            for batch in text_batches(records, processor.tokenizer, render, args.text_batch, args.seed))


def load_parts_into(model, adapters, folder: Path) -> None:
    """Start from shipped parts (`models.demo.smol.save_parts`): the vision tower and connector,
    and the adapters when their rank is the parts' (a fresh probe either way)."""
    parts = smol.load_parts(folder)
    if parts is None:
        raise SystemExit(f"--init-parts {folder}: no vision.safetensors there")
    weights = parts[1]
    model.model.visual.load_state_dict({k.removeprefix("visual."): v for k, v in weights.items() if k.startswith("visual.")})
    deltas = smol.adapter_deltas(parts)
    if adapters is not None and deltas:
        rank = next(iter(adapters.down.values())).shape[0]
        if next(v for k, v in deltas.items() if k.endswith(".lora_A")).shape[0] == rank:
            with torch.no_grad():
                for key, path in adapters.paths.items():
                    adapters.down[key].copy_(deltas[f"{PREFIX}{path}.lora_A"])
                    adapters.up[key].copy_(deltas[f"{PREFIX}{path}.lora_B"] / adapters.scale)
            print(f"adapters from {folder}", flush=True)
    print(f"vision tower and connector from {folder}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", type=Path, default=Path("/work/ckpt/smol"), help="checkpoint and log folder")
    parser.add_argument("--steps", type=int, default=3000, help="length of the learning-rate schedule")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first-example", type=int, default=0,
                        help="draw the training conversations from this number on (a continuation that should see new ones)")
    parser.add_argument("--cell-weight", type=float, default=0.5)
    parser.add_argument("--picture-weight", type=float, default=0.0,
                        help="off by default (untested here): at the start it is 14 nats against an answer loss of 2-7")
    parser.add_argument("--probe-weight", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-bf16", action="store_true", help="float32 instead of bfloat16 autocast")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--eval-questions", type=int, default=40)
    parser.add_argument("--checkpoint-minutes", type=float, default=10.0)
    parser.add_argument("--max-steps", type=int, help="stop after this step (default: --steps)")
    parser.add_argument("--adapters-rank", type=int, default=0,
                        help="low-rank adapters on the language model (models.demo.picture_adapters); 0: frozen")
    parser.add_argument("--adapters-alpha", type=float, default=16.0)
    parser.add_argument("--adapters-lr", type=float, default=5e-4)
    parser.add_argument("--text-data", type=Path, help="answers.jsonl of models.demo.distill_smol: its text "
                        "records keep text turns close to SmolLM2 (KL to the adapters-off model)")
    parser.add_argument("--text-batch", type=int, default=2)
    parser.add_argument("--text-weight", type=float, default=1.0)
    parser.add_argument("--init-from", type=Path, help="a vision-only checkpoint (latest.pt) to start the "
                        "vision tower, connector and probe from, when --ckpt has none yet")
    parser.add_argument("--init-parts", type=Path, help="a parts folder (assets/demo_smol) to start the vision "
                        "tower, connector and (same rank) adapters from, when --ckpt has no checkpoint yet")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda")
    parser.add_argument("--final-eval", type=int, default=0,
                        help="at the end, score this many held-out questions (eval seed 0) with batched generate")
    parser.add_argument("--workers", type=int, default=0, help="processes that build the batches (0: this one)")
    parser.add_argument("--minutes", type=float, help="set --steps from the speed of the warm-up steps so that "
                        "the run ends after about this many minutes")
    args = parser.parse_args()
    if args.text_data and not args.adapters_rank:
        parser.error("--text-data keeps the adapters' text turns close to SmolLM2: it needs --adapters-rank")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.ckpt.mkdir(parents=True, exist_ok=True)
    log_path, latest = args.ckpt / "log.jsonl", args.ckpt / "latest.pt"
    folder = smol.assemble(parts=smol.load_parts(args.init_parts) if args.init_parts else smol.initial_parts(seed=args.seed))
    model, processor = load_model(folder)
    probe = torch.nn.Linear(model.config.text_config.hidden_size, len(PROBE_GROUPS) * PROBE_CLASSES)
    adapters = (PictureAdapters(model.model.language_model, args.adapters_rank, args.adapters_alpha, args.seed)
                if args.adapters_rank else None)
    if args.init_parts and not latest.exists():
        load_parts_into(model, adapters, args.init_parts)
    for module in (model, probe, adapters):
        if module is not None:
            module.to(args.device)
    trained = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trained if p.ndim >= 2] + [probe.weight]
    groups = [{"params": decay, "weight_decay": 0.01, "peak": args.lr},
              {"params": [p for p in trained if p.ndim < 2] + [probe.bias], "weight_decay": 0.0, "peak": args.lr}]
    if adapters is not None:
        groups.append({"params": list(adapters.parameters()), "weight_decay": 0.0, "peak": args.adapters_lr})
        trained += list(adapters.parameters())
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98))
    start = 0
    if latest.exists() or args.init_from:
        state = torch.load(latest if latest.exists() else args.init_from, weights_only=False, map_location=args.device)
        model.model.visual.load_state_dict(state["visual"])
        probe.load_state_dict(state["probe"])
        if latest.exists():
            optimizer.load_state_dict(state["optimizer"])
            if adapters is not None:
                adapters.load_state_dict(state["adapters"])
            start = state["step"]
            print(f"resumed from {latest} at step {start}", flush=True)
        else:
            print(f"vision tower, connector and probe from {args.init_from} (step {state['step']})", flush=True)
    print(f"trained parameters: {sum(p.numel() for p in trained):,} "
          f"({'adapters on the language model' if adapters else 'language model frozen'})", flush=True)
    texts = text_data(args, processor)
    if texts is not None and start:
        texts = itertools.islice(texts, start, None)  # a resumed run sees the text batches it would have
    weights = {"cell": args.cell_weight, "picture": args.picture_weight, "probe": args.probe_weight}
    settings = {k: str(v) for k, v in vars(args).items()}
    questions = world.eval_questions(0, args.eval_questions)
    last_save, window, counted, tokens, began = time.time(), {}, 0, 0, time.time()
    began_run = began
    end = min(args.max_steps or args.steps, args.steps)
    if args.minutes:
        end = start + 1_000_000  # until the warm-up steps have been timed
    batches = StepBatches(processor, start, end, args.batch_size, args.seed, first_example=args.first_example)
    loader = torch.utils.data.DataLoader(batches, batch_size=None,
                                         num_workers=args.workers, prefetch_factor=4 if args.workers else None)
    timed = None
    for step, batch in enumerate(loader, start):
        if step >= end:
            break
        if args.minutes and step == start + args.warmup // 2:
            timed = time.time()
        if args.minutes and step == start + args.warmup:
            seconds_a_step = (time.time() - timed) / (args.warmup - args.warmup // 2)
            args.steps = end = step + max(1, int((args.minutes * 60 - (time.time() - began_run)) / seconds_a_step))
            print(f"{seconds_a_step:.3f} s a step: the schedule ends at step {end}", flush=True)
        batch = batch.to(args.device)
        lr = learning_rate(step, args.steps, args.lr, args.warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr * group["peak"] / args.lr
        model.train()
        parts = losses(model, probe, batch, weights, not args.no_bf16)
        if texts is not None:
            parts["text_kl"] = text_distillation(model, adapters, next(texts), not args.no_bf16)
            parts["total"] = parts["total"] + args.text_weight * parts["text_kl"]
        parts["total"].backward()
        torch.nn.utils.clip_grad_norm_(trained + list(probe.parameters()), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += int(batch.attention_mask.sum())
        for k, v in parts.items():
            window[k] = window.get(k, 0.0) + v.item()
        counted += 1
        done = step + 1
        if done % args.log_every == 0 or done == end:
            seconds = time.time() - began
            line = {"step": done, "lr": round(lr, 6), **{k: round(v / counted, 4) for k, v in window.items()},
                    "seconds": round(seconds), "tokens_per_s": round(tokens / seconds, 1)}
            write_record(log_path, line)
            window, counted, tokens, began = {}, 0, 0, time.time()
        if args.eval_every and done % args.eval_every == 0:
            t0 = time.time()
            total, per_kind = accuracy(model, processor, questions)
            line = {"step": done, "heldout_accuracy": round(total, 3), "questions": len(questions),
                    "per_kind": {k: round(v, 2) for k, v in per_kind.items()}, "eval_seconds": round(time.time() - t0)}
            write_record(log_path, line)
            began = time.time()
        if time.time() - last_save > 60 * args.checkpoint_minutes or done in (start + 1, end):
            save_checkpoint(latest, model, probe, adapters, optimizer, done, {"settings": settings})
            print(f"checkpoint at step {done}: {latest}", flush=True)
            last_save = time.time()
    if args.final_eval:
        t0 = time.time()
        total, per_kind = batched_accuracy(model, processor, world.eval_questions(0, args.final_eval))
        line = {"step": end, "final_accuracy": round(total, 3), "questions": args.final_eval,
                "per_kind": {k: round(v, 2) for k, v in per_kind.items()}, "eval_seconds": round(time.time() - t0)}
        write_record(log_path, line)


if __name__ == "__main__":
    main()
