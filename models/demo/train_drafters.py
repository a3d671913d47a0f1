"""Train the demo's own drafter modules (models/drafter_heads.py) on the frozen bundled target.

    python -m models.demo.train_drafters --out DIR [--target assets/demo/target] [--steps N]

writes DIR/mtp_drafter and DIR/block_drafter (config.json + model.safetensors each) and
DIR/drafters_training.json (settings, time, losses). Copy the two folders into assets/demo/.

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
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForImageTextToText, DynamicCache

from models import drafter_heads
from models.demo import world
from models.demo.processor import load_processor
from models.demo.train import assistant_labels, learning_rate

DEFAULT_TARGET = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "assets", "demo", "target"))
MTP_LAYERS = 1  # as Qwen3.5's mtp_num_hidden_layers
BLOCK_LAYERS = 2
BLOCK_SIZE = 5  # the anchor and 4 draft tokens (the engine's default k)
BLOCK_TARGET_LAYERS = (2, 4, 6)  # hidden_states indices of the 6-layer target: after layers 2 and 4, and the last


def target_answers(target, processor, examples: list[world.Example], max_new_tokens: int) -> list[world.Example]:
    """`examples` with each assistant turn replaced by the target's greedy answer to the
    conversation so far (its own earlier answers included). One batched `generate` per turn."""
    examples = [world.Example(e.images, list(e.messages), e.kind, e.pictures) for e in examples]
    tokenizer = processor.tokenizer
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        slots = [[i for i, m in enumerate(e.messages) if m["role"] == "assistant"] for e in examples]
        for turn in range(max(map(len, slots))):
            asks = [(e, at[turn]) for e, at in zip(examples, slots) if turn < len(at)]  # (example, message index)
            history = [e.messages[:i] for e, i in asks]
            texts = [processor.apply_chat_template(h, add_generation_prompt=True) for h in history]
            shown = [sum(c.get("type") == "image" for m in h for c in m["content"]) for h in history]
            images = [image for (e, _), n in zip(asks, shown) for image in e.images[:n]]
            enc = processor(text=texts, images=images or None, padding=True, return_tensors="pt")
            with torch.inference_mode():
                out = target.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                      pad_token_id=tokenizer.pad_token_id)
            answers = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            for (example, index), answer in zip(asks, answers):
                example.messages[index] = world.assistant_turn(answer.strip())
    finally:
        tokenizer.padding_side = side
    return examples


class TargetPass:
    """What one frozen target forward gives the drafters for a batch (B conversations, S tokens)."""

    def __init__(self, target, processor, examples: list[world.Example], layers: tuple[int, ...], top_k: int = 0):
        texts = [processor.apply_chat_template(e.messages) for e in examples]
        images = [image for e in examples for image in e.images]
        enc = processor(text=texts, images=images or None, padding=True, return_tensors="pt")
        inputs = {k: v for k, v in enc.items() if isinstance(v, torch.Tensor)}
        with torch.inference_mode():
            out = target(**inputs, output_hidden_states=True)
            self.positions, _ = target.model.get_rope_index(  # (3, B, S): the target's own positions
                inputs["input_ids"], inputs["mm_token_type_ids"], inputs.get("image_grid_thw"), inputs["attention_mask"])
        self.hidden = {layer: out.hidden_states[layer].clone() for layer in set(layers)}  # (B, S, H)
        self.greedy = out.logits.argmax(-1)  # (B, S): the target's next token after each prefix
        # (B, S, top_k) each: the target's top_k logits and their token ids (soft labels), or None
        self.top_logits, self.top_ids = out.logits.topk(top_k, dim=-1) if top_k else (None, None)
        self.input_ids = inputs["input_ids"]  # (B, S), right-padded
        self.valid = inputs["attention_mask"].bool()  # (B, S)
        self.answer = assistant_labels(inputs["input_ids"], processor.tokenizer) != -100  # (B, S)


def answer_chains(batch: TargetPass) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unrolled draft chains of a batch: chain c starts at entry c when token c + 1 is in an
    answer. Returns chains (B, A) (entry indices, padded), used (B, A), and the masks of steps
    2..: sees (B, 1, A, n), a chain's step sees the step-1 entries <= c, and eye (B, 1, A, A),
    each chain sees its own earlier steps."""
    starts = batch.answer[:, 1:]  # (B, n): chains that draft inside an answer
    bsz, n = starts.shape
    width = int(starts.sum(1).max())
    chains = torch.zeros(bsz, width, dtype=torch.long)
    used = torch.zeros(bsz, width, dtype=torch.bool)
    for row in range(bsz):
        found = starts[row].nonzero()[:, 0]
        chains[row, :len(found)], used[row, :len(found)] = found, True
    sees = (torch.arange(n)[None, None, :] <= chains[:, :, None])[:, None]
    eye = torch.eye(width, dtype=torch.bool).expand(bsz, 1, width, width)
    return chains, used, sees, eye


def mtp_loss(head, batch: TargetPass, lm_head: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Cross-entropy of each unrolled step (see the module docstring). Step 1 runs every entry
    c = 0 .. S - 2 (the cache the later steps attend to); steps 2.. run only the chains that
    start in an answer (x_{c+1} an answer token), as drafting does."""
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
        valid = used & (chains + step + 1 < seq) & torch.gather(batch.answer, 1, (chains + step + 1).clamp(max=seq - 1))
        logits = rows[valid] @ lm_head.T
        losses.append(F.cross_entropy(logits, torch.gather(batch.greedy, 1, at)[valid]))
        hidden = rows
    return losses


def block_loss(drafter, batch: TargetPass, lm_head: torch.Tensor, embed: torch.nn.Embedding,
               anchors: int, rng: random.Random) -> tuple[torch.Tensor, list[float]]:
    """Cross-entropy over the draft rows of sampled blocks; also the accuracy of each block row
    (how often it names the target's token), a first sign of acceptance."""
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
    labels = torch.gather(batch.greedy, 1, label_at.reshape(bsz, -1)).reshape(label_at.shape)
    valid = used[..., None] & torch.gather(batch.answer, 1, (label_at + 1).clamp(max=seq - 1).reshape(bsz, -1)
                                           ).reshape(label_at.shape) & (label_at + 1 < seq)
    logits = out[valid] @ lm_head.T
    loss = F.cross_entropy(logits, labels[valid])
    with torch.no_grad():
        right = (out @ lm_head.T).argmax(-1) == labels
        accuracy = [(right[..., i] & valid[..., i]).sum().item() / max(1, valid[..., i].sum().item())
                    for i in range(size - 1)]
    return loss, accuracy


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


def save(args, argv, mtp, block, log: list[dict], seconds: float) -> None:
    """Both folders and drafters_training.json (settings, time, parameter counts, the loss log)."""
    for name, module in (("mtp_drafter", mtp), ("block_drafter", block)):
        drafter_heads.save(module, os.path.join(args.out, name))
    with open(os.path.join(args.out, "drafters_training.json"), "w") as file:
        json.dump({"command": " ".join(["python -m models.demo.train_drafters", *(argv or sys.argv[1:])]),
                   "settings": vars(args), "train_seconds": round(seconds), "steps_done": log[-1]["step"] if log else 0,
                   "parameters": {"mtp_drafter": sum(p.numel() for p in mtp.parameters()),
                                  "block_drafter": sum(p.numel() for p in block.parameters())},
                   "log": log}, file, indent=1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m models.demo.train_drafters", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    add_training_flags(parser, steps=3000, save_every=0)
    parser.add_argument("--mtp-steps", type=int, default=6, help="unrolled MTP steps (the draft length it learns)")
    parser.add_argument("--anchors", type=int, default=16, help="blocks per conversation")
    parser.add_argument("--first-example", type=int, default=0, help="index of the first training conversation")
    parser.add_argument("--reference-answers", action="store_true",
                        help="train on the world's reference answers instead of the target's own")
    parser.add_argument("--block-layers", default=",".join(map(str, BLOCK_TARGET_LAYERS)),
                        help="hidden_states indices the block drafter reads (e.g. 10,20,30 for the 30-layer "
                             "SmolLM2 demo: --target $(python -m models.demo.smol))")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    block_layers = tuple(int(n) for n in args.block_layers.split(","))

    target = AutoModelForImageTextToText.from_pretrained(args.target, dtype=torch.float32).eval().requires_grad_(False)
    processor = load_processor(args.target)
    lm_head = target.get_output_embeddings().weight.detach()  # (V, H), shared, frozen
    embed = target.get_input_embeddings()
    mtp = drafter_heads.MtpHead(drafter_heads.MtpHeadConfig.for_target(target.config, num_hidden_layers=MTP_LAYERS))
    block = drafter_heads.BlockDrafter(drafter_heads.BlockDrafterConfig.for_target(
        target.config, num_hidden_layers=BLOCK_LAYERS, target_hidden_layers=block_layers, block_size=BLOCK_SIZE))
    layers = (0, -1) + block_layers
    optimizers = {name: torch.optim.AdamW(module.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
                  for name, module in (("mtp", mtp), ("block", block))}

    def train_step(step: int) -> dict[str, float]:
        first = args.first_example + step * args.batch_size
        examples = list(world.train_examples(first, args.batch_size))
        if not args.reference_answers:
            examples = target_answers(target, processor, examples, args.max_answer_tokens)
        batch = TargetPass(target, processor, examples, layers)
        lr = learning_rate(step, args.steps, args.lr, warmup=20)
        mtp_losses = mtp_loss(mtp, batch, lm_head, args.mtp_steps)
        blk, accuracy = block_loss(block, batch, lm_head, embed, args.anchors, rng)
        optimizer_step(optimizers["mtp"], mtp, sum(mtp_losses) / len(mtp_losses), lr)
        optimizer_step(optimizers["block"], block, blk, lr)
        return ({f"mtp_step{i + 1}": loss.item() for i, loss in enumerate(mtp_losses)} |
                {"block": blk.item()} | {f"block_acc{i + 1}": a for i, a in enumerate(accuracy)})

    seconds = run_training(args.steps, args.save_every, train_step,
                           lambda entries, seconds: save(args, argv, mtp, block, entries, seconds))
    print(f"saved {args.out}/mtp_drafter and {args.out}/block_drafter ({seconds:.0f} s)")


if __name__ == "__main__":
    main()
