"""Train the demo's own drafter modules (models/drafter_heads.py) on the frozen bundled target.

    python -m models.demo.train_drafters --out DIR [--target assets/demo/target] [--steps N]
    python -m models.demo.train_drafters --target smol --data DATA --draft-vocab 16384 --out DIR

writes DIR/mtp_drafter and DIR/block_drafter (config.json + model.safetensors each; `--drafters`
picks one) and DIR/drafters_training.json (settings, time, losses). Copy the two folders into
assets/demo/.

`--target smol` is the SmolLM2 demo (`models.demo.smol.assemble()`); `--data DATA` trains on the
target's own answers written by `python -m models.demo.distill_smol data --out DATA` (text
prompts and picture turns, conversations with a picture run on the target's picture weights) in
batches of similar length, epoch after epoch, each batch's target pass made once and kept.
`--draft-vocab N` gives both modules a reduced output vocabulary: the N most frequent tokens of
the answers (end of turn included, never another special token), kept as the modules'
`draft_ids`; a label outside it is not trained on.

Data: the demo world's training conversations (`world.train_examples`, images included), in
fresh batches of `--batch-size`, with every assistant turn replaced by the target's own greedy
answer (`target_answers`: batched generation, turn by turn, so a second turn follows the
target's first answer); `--reference-answers` keeps the world's reference answers instead.
The target then runs once per batch without gradients: its hidden states are the drafters'
inputs and its own greedy next token at every answer position (the argmax of its logits after
each prefix) is their label, so the drafters learn what the target says, mistakes included.

- MTP head: entry j reads the target's merged input embedding of token j + 1 and its last
  hidden state h_j and predicts the target's next token after token j + 1. Drafting k tokens
  applies the head k times, each step reading the previous step's output as its hidden state;
  training unrolls `--mtp-steps` such steps the way the engine runs them (step s of the chain
  that starts at entry c sits at entry c + s - 1 and attends to the target-fed entries 0 .. c
  and to its own chain's earlier steps), with a loss on every step.
- Block drafter: context rows from the target's layers `target_hidden_layers` for every token,
  and for up to `--anchors` answer positions a per conversation a block [x_a, mask, ...] that
  sees the context rows before a and its own block; block row i predicts the target's next
  token after x_{a+i-1}.
Every position runs at the target's own M-RoPE positions (`get_rope_index`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import torch
import torch.nn.functional as F
from transformers import AutoModelForImageTextToText, DynamicCache

from models import drafter_heads, picture_weights
from models.processors import load_processor
from models.demo.drafter_data import (DEFAULT_TARGET, TargetPass, answer_chains, batches, distilled_examples,
                                      draft_index, draft_vocabulary, target_answers)
from models.demo.training import add_training_flags, learning_rate, optimizer_step, run_training

MTP_LAYERS = 1  # as Qwen3.5's mtp_num_hidden_layers
BLOCK_LAYERS = 2
BLOCK_SIZE = 5  # the anchor and 4 draft tokens (the engine's default k)
BLOCK_TARGET_LAYERS = (2, 4, 6)  # hidden_states indices of the 6-layer target: after layers 2 and 4, and the last


def draft_labels(batch: TargetPass, draft_of: torch.Tensor | None) -> torch.Tensor:
    """(B, S) the target's greedy next tokens as indices of the drafters' output vocabulary:
    draft_of (V,) maps a target id to its draft index, -1 outside it (None: the whole vocabulary)."""
    return batch.greedy if draft_of is None else draft_of[batch.greedy]


def cross_entropy(rows: torch.Tensor, lm_head: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of output rows (n, H) through lm_head (D, H) against labels (n,);
    0 (with a gradient path) when there are none."""
    return F.cross_entropy(rows @ lm_head.T, labels) if len(labels) else rows.sum() * 0.0


def mtp_loss(head, batch: TargetPass, lm_head: torch.Tensor, steps: int, labels: torch.Tensor) -> list[torch.Tensor]:
    """Cross-entropy of each unrolled step (see the module docstring) against labels (B, S)
    (`draft_labels`; a label < 0 is outside the output vocabulary and not trained). Step 1 runs
    every entry c = 0 .. S - 2 (the cache the later steps attend to); steps 2.. run only the
    chains that start in an answer (x_{c+1} an answer token), as drafting does."""
    embeds, last = batch.hidden[0], batch.hidden[-1]
    bsz, seq, _ = embeds.shape
    n = seq - 1
    entries = torch.arange(n)
    causal = (entries[None, :] <= entries[:, None])[None] & batch.valid[:, None, 1:]  # (B, n, n): key j valid
    causal = (causal | torch.eye(n, dtype=torch.bool))[:, None]
    cache = DynamicCache()
    out = head(embeds[:, 1:], last[:, :-1], batch.positions[:, :, 1:], mask=causal, cache=cache)  # (B, n, H)
    chains, used, sees, eye = answer_chains(batch)
    losses, hidden = [], None
    for step in range(1, steps + 1):
        at = (chains + step).clamp(max=seq - 1)  # step s of chain c: embeds token c + s, predicts the one after it
        if step > 1:
            gather = lambda t: torch.gather(t, 1, at[..., None].expand(-1, -1, t.shape[-1]))  # noqa: E731
            out = head(gather(embeds), hidden, torch.gather(batch.positions, 2, at[None].expand(3, -1, -1)),
                       mask=torch.cat([sees] + [eye] * (step - 1), dim=-1), cache=cache)
            rows = out
        else:
            rows = torch.gather(out, 1, chains[..., None].expand(-1, -1, out.shape[-1]))
        target = torch.gather(labels, 1, at)
        valid = used & (chains + step + 1 < seq) & torch.gather(batch.answer, 1, (chains + step + 1).clamp(max=seq - 1))
        valid &= target >= 0
        losses.append(cross_entropy(rows[valid], lm_head, target[valid]))
        hidden = rows
    return losses


def block_loss(drafter, batch: TargetPass, lm_head: torch.Tensor, embed: torch.nn.Embedding,
               anchors: int, rng: random.Random, greedy: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    """Cross-entropy over the draft rows of sampled blocks against greedy (B, S) (`draft_labels`;
    < 0: not trained); also the accuracy of each block row (how often it names the target's
    token), a first sign of acceptance."""
    config = drafter.config
    size = config.block_size
    context = torch.cat([batch.hidden[layer] for layer in config.target_hidden_layers], dim=-1)  # (B, S, L * H)
    bsz, seq, _ = context.shape
    picks = torch.zeros(bsz, anchors, dtype=torch.long)
    used = torch.zeros(bsz, anchors, dtype=torch.bool)
    for row in range(bsz):
        where = [a for a in (batch.answer[row, :-1] & batch.answer[row, 1:]).nonzero()[:, 0].tolist()]
        chosen = sorted(rng.sample(where, min(anchors, len(where))))
        picks[row, :len(chosen)] = torch.tensor(chosen, dtype=torch.long)
        used[row, :len(chosen)] = True
    offsets = torch.arange(size)
    # block rows: anchor embedding, then the mask embedding; positions run on from the anchor's
    anchor_embeds = embed(torch.gather(batch.input_ids, 1, picks))  # (B, M, H)
    block = torch.cat([anchor_embeds[:, :, None], drafter.mask_embedding.expand(bsz, anchors, size - 1, -1)], 2)
    anchor_pos = torch.gather(batch.positions, 2, picks[None].expand(3, -1, -1))  # (3, B, M)
    block_pos = (anchor_pos[..., None] + offsets).reshape(3, bsz, anchors * size)
    positions = torch.cat([batch.positions, block_pos], dim=-1)
    # mask: context rows causal; block rows of anchor a see context rows < a and their own block
    keys = torch.arange(seq)
    ctx_mask = (keys[None, :] <= keys[:, None])[None] & batch.valid[:, None, :]  # (B, S, S)
    ctx_mask |= torch.eye(seq, dtype=torch.bool)
    sees_context = (keys[None, None, :] < picks[:, :, None]).repeat_interleave(size, 1)  # (B, M*size, S)
    own = torch.block_diag(*[torch.ones(size, size, dtype=torch.bool)] * anchors).expand(bsz, -1, -1)
    top = torch.cat([ctx_mask, torch.zeros(bsz, seq, anchors * size, dtype=torch.bool)], 2)
    mask = torch.cat([top, torch.cat([sees_context, own], 2)], 1)[:, None]
    out = drafter(context, block.reshape(bsz, anchors * size, -1), positions, mask)[:, seq:]
    out = out.reshape(bsz, anchors, size, -1)[:, :, 1:]  # (B, M, size - 1, H): rows after the anchor
    label_at = (picks[..., None] + offsets[1:] - 1).clamp(max=seq - 1)  # greedy after x_{a + i - 1}
    labels = torch.gather(greedy, 1, label_at.reshape(bsz, -1)).reshape(label_at.shape)
    valid = used[..., None] & torch.gather(batch.answer, 1, (label_at + 1).clamp(max=seq - 1).reshape(bsz, -1)
                                           ).reshape(label_at.shape) & (label_at + 1 < seq) & (labels >= 0)
    loss = cross_entropy(out[valid], lm_head, labels[valid])
    with torch.no_grad():
        right = (out @ lm_head.T).argmax(-1) == labels
        accuracy = [(right[..., i] & valid[..., i]).sum().item() / max(1, valid[..., i].sum().item())
                    for i in range(size - 1)]
    return loss, accuracy


def save(args, argv, modules: dict[str, torch.nn.Module], log: list[dict], seconds: float) -> None:
    """The drafters' folders (`mtp_drafter`, `block_drafter`) and drafters_training.json (settings,
    time, parameter counts, the loss log)."""
    for name, module in modules.items():
        drafter_heads.save(module, os.path.join(args.out, f"{name}_drafter"))
    with open(os.path.join(args.out, "drafters_training.json"), "w") as file:
        json.dump({"command": " ".join(["python -m models.demo.train_drafters", *(argv or sys.argv[1:])]),
                   "settings": vars(args), "train_seconds": round(seconds), "steps_done": log[-1]["step"] if log else 0,
                   "parameters": {f"{name}_drafter": sum(p.numel() for p in module.parameters())
                                  for name, module in modules.items()},
                   "log": log}, file, indent=1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m models.demo.train_drafters", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--target", default=DEFAULT_TARGET, help="a VLM folder, or smol (the SmolLM2 demo)")
    add_training_flags(parser, steps=3000, save_every=0)
    parser.add_argument("--drafters", default="mtp,block", help="which to train: mtp, block or both")
    parser.add_argument("--data", help="a models.demo.distill_smol data folder: train on the target's own answers "
                                       "there, epoch after epoch, each batch's target pass kept")
    parser.add_argument("--draft-vocab", type=int, default=0,
                        help="output vocabulary: the N most frequent tokens of the answers (draft_ids; 0: the whole)")
    parser.add_argument("--mtp-steps", type=int, default=6, help="unrolled MTP steps (the draft length it learns)")
    parser.add_argument("--anchors", type=int, default=16, help="blocks per conversation")
    parser.add_argument("--first-example", type=int, default=0, help="index of the first training conversation")
    parser.add_argument("--reference-answers", action="store_true",
                        help="train on the world's reference answers instead of the target's own")
    parser.add_argument("--block-layers", help="hidden_states indices the block drafter reads "
                                               "(default: a third, two thirds and all of the target's depth)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    which = args.drafters.split(",")

    if args.target == "smol":
        from models.demo import smol

        args.target = str(smol.assemble())
    target = AutoModelForImageTextToText.from_pretrained(args.target, dtype=torch.float32).eval().requires_grad_(False)
    pictures = picture_weights.for_pictures(args.target, target)  # what the engine runs conversations with a picture on
    processor = load_processor(args.target)
    depth = target.config.get_text_config().num_hidden_layers
    block_layers = (tuple(int(n) for n in args.block_layers.split(",")) if args.block_layers
                    else tuple(round(depth * i / 3) for i in (1, 2, 3)))
    distilled = distilled_examples(args.data, processor.tokenizer) if args.data else None
    sizes = {}
    if args.draft_vocab:
        sizes["draft_vocab_size"] = args.draft_vocab
        vocabulary = draft_vocabulary(processor, args.draft_vocab, distilled)  # (D,) target ids
        draft_of = draft_index(vocabulary, target.config.get_text_config().vocab_size)
    else:
        vocabulary, draft_of = None, None
    lm_head = target.get_output_embeddings().weight.detach()  # (V, H), shared, frozen
    lm_head = lm_head if vocabulary is None else lm_head[vocabulary]  # (D, H)
    embed = target.get_input_embeddings()
    modules = {}
    if "mtp" in which:
        modules["mtp"] = drafter_heads.MtpHead(drafter_heads.MtpHeadConfig.for_target(
            target.config, num_hidden_layers=MTP_LAYERS, **sizes))
    if "block" in which:
        modules["block"] = drafter_heads.BlockDrafter(drafter_heads.BlockDrafterConfig.for_target(
            target.config, num_hidden_layers=BLOCK_LAYERS, target_hidden_layers=block_layers, block_size=BLOCK_SIZE,
            **sizes))
    for module in modules.values() if vocabulary is not None else ():
        module.draft_ids.copy_(vocabulary)
    layers = (0, -1) + block_layers
    optimizers = {name: torch.optim.AdamW(module.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
                  for name, module in modules.items()}
    stream = batches(distilled, args.batch_size, args.seed, split_pictures=pictures is not target,
                     first=args.first_example)  # without --data: fresh world conversations every step
    passes = {}  # --data: batch key -> its TargetPass, made once

    def train_step(step: int) -> dict[str, float]:
        key, examples = next(stream)
        batch = passes.get(key)
        if batch is None:
            model = pictures if any(e.images for e in examples) else target
            if distilled is None and not args.reference_answers:
                examples = target_answers(model, processor, examples, args.max_answer_tokens)
            batch = TargetPass(model, processor, examples, layers)
            if key is not None:
                passes[key] = batch
        labels = draft_labels(batch, draft_of)
        lr = learning_rate(step, args.steps, args.lr, warmup=20)
        figures = {}
        if "mtp" in modules:
            mtp_losses = mtp_loss(modules["mtp"], batch, lm_head, args.mtp_steps, labels)
            optimizer_step(optimizers["mtp"], modules["mtp"], sum(mtp_losses) / len(mtp_losses), lr)
            figures |= {f"mtp_step{i + 1}": loss.item() for i, loss in enumerate(mtp_losses)}
        if "block" in modules:
            blk, accuracy = block_loss(modules["block"], batch, lm_head, embed, args.anchors, rng, labels)
            optimizer_step(optimizers["block"], modules["block"], blk, lr)
            figures |= {"block": blk.item()} | {f"block_acc{i + 1}": a for i, a in enumerate(accuracy)}
        return figures

    seconds = run_training(args.steps, args.save_every, train_step,
                           lambda entries, seconds: save(args, argv, modules, entries, seconds))
    print(f"saved {', '.join(f'{args.out}/{name}_drafter' for name in modules)} ({seconds:.0f} s)")


if __name__ == "__main__":
    main()
