"""Train the bundled demo models from scratch, reproducibly, on a CPU.

    python -m models.demo.train --out assets/demo

writes three Hugging Face folders:
    target/        Qwen2VLForConditionalGeneration + processor (tokenizer, chat template)
    vlm_drafter/   a smaller Qwen2VLForConditionalGeneration + the same processor
    text_drafter/  Qwen2ForCausalLM + the same tokenizer; it never sees pictures
and training.json (settings, parameter counts, time, held-out accuracy).

The three models learn from the same batches in one loop: the two vision-language models on
the full conversations, the text drafter on their text-only view (the
<|vision_start|><|image_pad|>...<|vision_end|> runs removed, positions consecutive). The loss
covers assistant tokens only, each answer's <|im_end|> included. The vision-language models
also get a cell loss (see `cell_words`): each vision token, read through the tied output
embedding, should name what its cell shows; and a picture loss (see `picture_loss`): the
language model's output at each vision token should name the cell, which picture of its turn
it belongs to, how many shapes that picture holds and how many of its colour the turn has shown
so far; and a count probe (see `probe_loss`): a linear head on a middle layer's output at each
vision token should tell the picture's and the turn's counts (see `probe_rows`), where the layers
above can still read them when answering. All three only speed up learning; the probe head is
thrown away and the saved models are plain Qwen2-VL models.
The task's targets and losses (`cell_words`, `picture_loss`, `probe_loss`, `probe_rows`, the
batches) are in models/demo/picture_task.py, which models/demo/train_smol.py trains on too.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    GenerationConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)

from models.demo import world
from models.demo.picture_task import (PROBE_CLASSES, PROBE_GROUPS, Batch, accuracy, batches, cell_loss, picture_loss,
                                      probe_layer, probe_loss, text_only)
from models.demo.processor import build_processor, build_tokenizer
from models.demo.training import learning_rate

VOCAB_SIZE = 640
TOKENIZER_EXAMPLES = 4000  # training conversations whose text the BPE is trained on

# Sizes. The target must be right; the drafters must be cheap per token (1-2 layers).
TARGET = dict(hidden=192, layers=6, heads=4, kv_heads=2, mlp=576, vision_dim=128, vision_depth=2, vision_heads=4)
VLM_DRAFTER = dict(hidden=128, layers=2, heads=4, kv_heads=2, mlp=384, vision_dim=96, vision_depth=2, vision_heads=4)
TEXT_DRAFTER = dict(hidden=128, layers=2, heads=4, kv_heads=2, mlp=384)


# ---------------------------------------------------------------- models


def _text_settings(size: dict, tokenizer) -> dict:
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=size["hidden"],
        intermediate_size=size["mlp"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"],
        max_position_embeddings=2048,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def vlm_config(size: dict, tokenizer) -> Qwen2VLConfig:
    """A Qwen2-VL config of the given size, patch 14 and merge 2 like the image processor."""
    head_dim = size["hidden"] // size["heads"]
    # M-RoPE splits head_dim / 2 rotary frequencies into (time, height, width) sections.
    t = head_dim // 2 // 4
    mrope_section = [t, (head_dim // 2 - t) // 2, head_dim // 2 - t - (head_dim // 2 - t) // 2]
    text = _text_settings(size, tokenizer) | dict(
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section},
    )
    vision = dict(
        depth=size["vision_depth"],
        embed_dim=size["vision_dim"],
        hidden_size=size["hidden"],
        num_heads=size["vision_heads"],
        mlp_ratio=2,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
    )}
    return Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)


def text_config(size: dict, tokenizer) -> Qwen2Config:
    return Qwen2Config(**_text_settings(size, tokenizer), rope_theta=10000.0, tie_word_embeddings=True)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- training


@dataclass
class Trainee:
    name: str
    model: PreTrainedModel
    optimizer: torch.optim.Optimizer
    sees_images: bool
    probe: torch.nn.Linear | None = None  # training-only head of `probe_loss` (VLMs); never saved
    loss_sum: float = 0.0


def train_step(trainee: Trainee, batch: Batch, tokenizer, lr: float, bf16: bool, cell_weight: float,
               picture_weight: float = 0.0, probe_weight: float = 0.0) -> float:
    """One optimiser step; returns the language-model loss (for VLMs the cell loss, and the
    picture and probe losses when their weights are > 0, are added)."""
    inputs = batch.vlm_inputs() if trainee.sees_images else text_only(batch, tokenizer)
    for group in trainee.optimizer.param_groups:
        group["lr"] = lr
    captured = []
    hook = trainee.model.model.visual.register_forward_hook(lambda m, i, out: captured.append(out.pooler_output)) if trainee.sees_images else None
    probing = trainee.probe is not None and probe_weight > 0
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        outputs = trainee.model(**inputs, output_hidden_states=probing)
    loss = total = outputs.loss
    if hook is not None:
        hook.remove()
        vision_tokens = torch.cat(list(captured[0])) if isinstance(captured[0], (list, tuple)) else captured[0]
        image_token_id = trainee.model.config.image_token_id
        total = loss + cell_weight * cell_loss(trainee.model, vision_tokens, batch.cell_targets)
        if picture_weight > 0:
            total = total + picture_weight * picture_loss(outputs.logits, batch.input_ids, image_token_id, batch.picture_targets)
        if probing:
            hidden = outputs.hidden_states[probe_layer(trainee.model)]
            total = total + probe_weight * probe_loss(trainee.probe, hidden, batch.input_ids, image_token_id, batch.probe_targets)
    total.backward()
    torch.nn.utils.clip_grad_norm_(trainee.model.parameters(), 1.0)
    trainee.optimizer.step()
    trainee.optimizer.zero_grad(set_to_none=True)
    return loss.item()


def make_trainee(name: str, model: PreTrainedModel, sees_images: bool, lr: float) -> Trainee:
    """A model, its AdamW and, for a VLM, the training-only head of `probe_loss`."""
    probe = torch.nn.Linear(model.config.text_config.hidden_size, len(PROBE_GROUPS) * PROBE_CLASSES) if sees_images else None
    named = list(model.named_parameters()) + (list(probe.named_parameters()) if probe is not None else [])
    decay = [p for n, p in named if p.ndim >= 2]
    no_decay = [p for n, p in named if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    return Trainee(name, model, torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98)), sees_images, probe)


def build_models(tokenizer, seed: int) -> list[Trainee]:
    torch.manual_seed(seed)
    target = Qwen2VLForConditionalGeneration(vlm_config(TARGET, tokenizer))
    torch.manual_seed(seed + 1)
    vlm_drafter = Qwen2VLForConditionalGeneration(vlm_config(VLM_DRAFTER, tokenizer))
    torch.manual_seed(seed + 2)
    text_drafter = Qwen2ForCausalLM(text_config(TEXT_DRAFTER, tokenizer))
    return [
        make_trainee("target", target, True, 0.0),
        make_trainee("vlm_drafter", vlm_drafter, True, 0.0),
        make_trainee("text_drafter", text_drafter, False, 0.0),
    ]


def load_models(folder: Path) -> list[Trainee]:
    """The three models of an earlier run, in float32, to continue training them."""
    return [
        make_trainee("target", Qwen2VLForConditionalGeneration.from_pretrained(folder / "target", dtype=torch.float32), True, 0.0),
        make_trainee("vlm_drafter", Qwen2VLForConditionalGeneration.from_pretrained(folder / "vlm_drafter", dtype=torch.float32), True, 0.0),
        make_trainee("text_drafter", Qwen2ForCausalLM.from_pretrained(folder / "text_drafter", dtype=torch.float32), False, 0.0),
    ]


def world_tokenizer():
    """The BPE, trained on the text of the first TOKENIZER_EXAMPLES training conversations."""
    texts = ["user\n", "assistant\n", "system\n"] * 100 + [f"Picture {i}: " for i in range(1, 9)] * 100
    texts += list(world.WORDS) + list(world.SYSTEM_PROMPTS) * 10
    for example in world.train_examples(0, TOKENIZER_EXAMPLES):
        texts += [c["text"] for m in example.messages for c in m["content"] if c["type"] == "text"]
    return build_tokenizer(texts, VOCAB_SIZE)


# ---------------------------------------------------------------- evaluation


@torch.no_grad()
def ms_per_token(model, inputs: dict, new_tokens: int = 48, repeats: int = 3) -> float:
    """Milliseconds per token of plain greedy decoding with a KV cache, prefill excluded: the
    time of `new_tokens` tokens less the time of one, over `new_tokens - 1` (best of `repeats`)."""

    def seconds(n: int) -> float:
        start = time.perf_counter()
        model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - start

    seconds(2)  # warm-up
    return min(1000 * (seconds(new_tokens) - seconds(1)) / (new_tokens - 1) for _ in range(repeats))


def decoding_costs(trainees: list[Trainee], processor, question: world.Question) -> dict[str, float]:
    """`ms_per_token` of each model on one held-out question (the text drafter without its images)."""
    content = [{"type": "image"} for _ in question.images] + [{"type": "text", "text": question.prompt}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    vlm_inputs = processor(text=[text], images=question.images, return_tensors="pt")
    plain = processor.apply_chat_template([{"role": "user", "content": content[-1:]}], add_generation_prompt=True)
    text_inputs = processor.tokenizer([plain], return_tensors="pt")
    return {
        t.name: round(ms_per_token(t.model.eval(), vlm_inputs if t.sees_images else text_inputs), 2) for t in trainees
    }


# ---------------------------------------------------------------- saving


def save(trainee: Trainee, processor, out: Path) -> None:
    folder = out / trainee.name
    model = trainee.model
    model.generation_config = GenerationConfig(
        eos_token_id=processor.tokenizer.eos_token_id, pad_token_id=processor.tokenizer.pad_token_id,
        do_sample=False, max_new_tokens=120,
    )
    model.save_pretrained(folder)
    if trainee.sees_images:
        processor.save_pretrained(folder)
        # The folder should name the stock class, so that standard loaders recognise it.
        config_path = folder / "processor_config.json"
        config = json.loads(config_path.read_text())
        config["processor_class"] = "Qwen2VLProcessor"
        config_path.write_text(json.dumps(config, indent=2) + "\n")
    else:
        processor.tokenizer.save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("assets/demo"))
    parser.add_argument("--steps", type=int, default=3100)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate of the target")
    parser.add_argument("--drafter-lr", type=float, default=3e-3, help="peak learning rate of the two drafters")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cell-weight", type=float, default=1.0, help="weight of the vision-token word loss")
    parser.add_argument("--picture-weight", type=float, default=1.0,
                        help="weight of the loss on the language model's output at vision tokens (see picture_loss)")
    parser.add_argument("--probe-weight", type=float, default=1.0,
                        help="weight of the count probe on a middle layer at vision tokens (see probe_loss)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (bitwise results can depend on it)")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast (no faster on this CPU; float32 by default)")
    parser.add_argument("--eval-questions", type=int, default=100, help="held-out questions to score at the end")
    parser.add_argument("--eval-seed", type=int, default=0)
    parser.add_argument("--init", type=Path, help="continue training the three models saved in this folder "
                        "(a run of this command) instead of starting from random weights")
    args = parser.parse_args()

    # 1. Seeds, threads, tokenizer and processor.
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.time()
    tokenizer = world_tokenizer()
    processor = build_processor(tokenizer)

    # 2. Three fresh models (or the three of an earlier run, to continue it).
    trainees = build_models(tokenizer, args.seed) if args.init is None else load_models(args.init)
    for t in trainees:
        print(f"{t.name}: {count_parameters(t.model):,} parameters", flush=True)

    # 3. One loop: every model takes a step on every batch.
    for step, batch in enumerate(batches(processor, args.steps, args.batch_size, args.seed)):
        if step == args.steps:
            break
        for t in trainees:
            lr = learning_rate(step, args.steps, args.lr if t.name == "target" else args.drafter_lr)
            t.loss_sum += train_step(t, batch, tokenizer, lr, args.bf16, args.cell_weight, args.picture_weight,
                                    args.probe_weight)
        if (step + 1) % 25 == 0:
            losses = "  ".join(f"{t.name} {t.loss_sum / 25:.3f}" for t in trainees)
            print(f"step {step + 1}/{args.steps}  {time.time() - started:.0f}s  lr {learning_rate(step, args.steps, args.lr):.2e}  {losses}", flush=True)
            for t in trainees:
                t.loss_sum = 0.0
    train_seconds = time.time() - started

    # 4. Save, then score the two vision-language models on held-out questions.
    args.out.mkdir(parents=True, exist_ok=True)
    for t in trainees:
        save(t, processor, args.out)
    questions = world.eval_questions(args.eval_seed, args.eval_questions)
    report = {
        "command": f"python -m models.demo.train --out {args.out} --steps {args.steps} --seed {args.seed} "
                   f"--lr {args.lr} --drafter-lr {args.drafter_lr}" + (f" --init {args.init}" if args.init else ""),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "train_seconds": round(train_seconds),
        "parameters": {t.name: count_parameters(t.model) for t in trainees},
    }
    for t in trainees[:2]:
        total, per_kind = accuracy(t.model, processor, questions)
        report[f"{t.name}_accuracy"] = {"eval_seed": args.eval_seed, "questions": len(questions), "overall": total, "per_kind": per_kind}
        print(f"{t.name} held-out accuracy: {total:.3f}", flush=True)
    report["ms_per_token_float32"] = decoding_costs(trainees, processor, questions[0])
    print(f"ms per token: {report['ms_per_token_float32']}", flush=True)
    (args.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"done in {time.time() - started:.0f}s", flush=True)


if __name__ == "__main__":
    main()
