"""Train an EAGLE-3 drafter for the bundled target, written in SpecForge's format.

    python -m models.demo.train_eagle3 --out assets/demo/eagle3_drafter [--steps N] [--seed 0]
    python -m models.demo.train_eagle3 --out DIR --target-answers --conversations 3200 --steps 4000   # the shipped recipe
    python -m models.demo.train_eagle3 --target smol --data DIR --out assets/demo_smol/eagle3_drafter

`--conversations N` trains epoch after epoch on the first N world conversations (with
`--target-answers`, the target's own answers, each batch generated once), each batch's target
pass kept: after the first epoch a step costs only the drafter's forward and backward.

`--target smol` is the SmolLM2 demo (`models.demo.smol.assemble()`); `--data DIR` reads the
target's own answers written by `python -m models.demo.distill_smol data --out DIR` (text
prompts and picture turns) instead of the world's reference answers, in a seeded shuffled
order, epoch after epoch.

writes OUT/config.json + OUT/model.safetensors (SpecForge: `LlamaForCausalLMEagle3`, weights
`embed_tokens`, `fc`, `midlayer.*`, `norm`, `lm_head`, buffers `d2t` / `t2d`; models/eagle3.py)
and OUT/training.json (settings, time, losses). `python -m models.eagle3 OUT --to-speculators
DIR` exports it for vLLM.

Data and labels are models/demo/train_drafters.py's: the demo world's training conversations
(their reference answers, which the target mostly reproduces: 6 of the first 8; with
`--target-answers` each assistant turn is replaced by the target's own greedy answer, a
`generate` per batch), one frozen target pass per batch for the hidden states, and the target's
greedy next token at every answer position as the label, so it learns what the target says.

Training is SpecForge's test-time training (TTT), unrolled `--ttt-steps` steps the way the
engine drafts: step 1 runs every entry j (the merged input embedding of token j + 1, image
features at image positions, and g_j = fc of the target's layers `LAYERS` of token j, at the
target's position of token j); step s of the chain starting at entry c embeds token c + s, reads
step s - 1's pre-norm output at position p(c) + s - 1 and attends to the step-1 entries <= c and
its own earlier steps. Every step's loss is the cross-entropy against the target's next token
over the draft vocabulary (the `--draft-vocab` most frequent tokens of the reference answers,
end-of-turn included; a token outside it is not a label). The embedding table is the
target's, frozen, as SpecForge freezes it; lm_head starts from the target's rows of the draft
vocabulary.

`--soft-labels K` trains on SpecForge's soft targets instead: the target's distribution over the
draft vocabulary (its softmax there), truncated to the target's top K logits of each position
(kept with the batch's target pass; ids outside the draft vocabulary dropped, the rest
renormalised), and the loss -sum p log q.

`--feature-weight W` adds a loss that SpecForge does not have (the weights and format are
unchanged): step s's pre-norm h, which step s + 1 reads where step 1 reads g, is pulled towards
g of the token it stands for (EAGLE-1's feature regression, here only on the fed-back rows), so
the later steps read what the first was trained on. `--mixed-batches` cuts `--conversations` into
seeded random batches rather than batches of similar length (one kind of question each).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from transformers import AutoModelForImageTextToText

from models import eagle3, picture_weights
from models.demo import world
from models.processors import load_processor
from models.demo.drafter_data import (DEFAULT_TARGET, TargetPass, answer_chains, batches, distilled_examples,
                                      draft_index, draft_vocabulary, target_answers)
from models.demo.training import add_training_flags, learning_rate, optimizer_step, run_training



def layers_as_outputs(num_layers: int) -> list[int]:
    """The auxiliary layers (output of layer i, numbered from 0): SpecForge's default [1, N/2 - 1,
    N - 4] ([1, 14, 26] for SmolLM2's 30 layers); under 8 layers [1, N/2, N - 2] (the 6-layer demo
    target's [1, 3, 4]), kept inside 0 .. N - 2 (the last layer's output is read after the final
    norm) for the tiny test models."""
    picks = (1, num_layers // 2 - 1, num_layers - 4) if num_layers >= 8 else (1, num_layers // 2, num_layers - 2)
    return [min(max(i, 0), num_layers - 2) for i in picks]


def specforge_config(target_config, draft_vocab_size: int, target_name: str,
                     intermediate_size: int | None = None) -> dict:
    """The SpecForge config.json of a drafter for `target_config` (its text sizes and M-RoPE; the
    MLP's width the target's unless `intermediate_size`)."""
    text = target_config.get_text_config()
    rope = text.rope_parameters
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "target_model_type": target_config.model_type, "target_name_or_path": target_name,
        "target_architectures": list(target_config.architectures or []),
        "hidden_size": text.hidden_size, "intermediate_size": intermediate_size or text.intermediate_size,
        "num_attention_heads": text.num_attention_heads, "num_key_value_heads": text.num_key_value_heads,
        "head_dim": text.hidden_size // text.num_attention_heads, "num_hidden_layers": 1, "hidden_act": "silu",
        "rms_norm_eps": text.rms_norm_eps, "max_position_embeddings": text.max_position_embeddings,
        "rope_theta": rope["rope_theta"], "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]},
        "vocab_size": text.vocab_size, "draft_vocab_size": draft_vocab_size, "tie_word_embeddings": False,
        "attention_bias": False, "pretraining_tp": 1, "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": layers_as_outputs(text.num_hidden_layers)},
    }


def eagle3_losses(module: eagle3.Eagle3, batch: TargetPass, layers: list[int], steps: int,
                  draft_of: torch.Tensor, aligned: list[torch.Tensor] | None = None
                  ) -> tuple[list[torch.Tensor], list[float]]:
    """Cross-entropy and accuracy of each unrolled step (see the module docstring). Given a list
    `aligned`, also appends the feature loss of each step that feeds a next one: how far its
    pre-norm h, which step s + 1 reads where step 1 reads g, is from g of the token it stands for
    (chain c, step s: g_{c+s}, held fixed; squared error over g's mean square)."""
    embeds = batch.hidden[0]  # (B, S, H) merged input embeddings
    g = module.project(torch.cat([batch.hidden[layer] for layer in layers], dim=-1))
    bsz, seq, _ = embeds.shape
    n = seq - 1
    entries = torch.arange(n)
    causal = (entries[None, :] <= entries[:, None])[None] & batch.valid[:, None, :-1]
    causal = (causal | torch.eye(n, dtype=torch.bool))[:, None]
    cache = eagle3.KVCache()
    out = module(embeds[:, 1:], g[:, :-1], batch.positions[:, :, :-1], cache, causal)  # (B, n, H) entries j
    chains, used, sees, eye = answer_chains(batch)
    losses, accuracy, rows = [], [], None
    for step in range(1, steps + 1):
        at = (chains + step).clamp(max=seq - 1)  # step s of chain c embeds token c + s, predicts the one after it
        if step > 1:
            where = (chains + step - 1).clamp(max=seq - 1)
            inputs = torch.gather(embeds, 1, at[..., None].expand(-1, -1, embeds.shape[-1]))
            rows = module(inputs, module.feedback(rows), torch.gather(batch.positions, 2, where[None].expand(3, -1, -1)),
                          cache, torch.cat([sees] + [eye] * (step - 1), dim=-1))
        else:
            rows = torch.gather(out, 1, chains[..., None].expand(-1, -1, out.shape[-1]))
        labels = draft_of[torch.gather(batch.greedy, 1, at)]
        valid = used & (chains + step + 1 < seq) & (labels >= 0) & \
            torch.gather(batch.answer, 1, (chains + step + 1).clamp(max=seq - 1))
        if aligned is not None and step < steps:
            wanted = torch.gather(g, 1, at.clamp(max=n - 1)[..., None].expand(-1, -1, g.shape[-1])).detach()
            near = used & (at < n) & torch.gather(batch.answer, 1, at)
            aligned.append(((rows[near] - wanted[near]) ** 2).sum() / wanted[near].pow(2).sum().clamp(min=1e-6))
        logits = module.draft_logits(rows[valid])  # a batch without a label in the draft vocabulary adds 0
        if batch.top_logits is None:
            losses.append(F.cross_entropy(logits, labels[valid], reduction="sum") / max(1, int(valid.sum())))
        else:
            losses.append(soft_cross_entropy(logits, batch, at, draft_of, valid))
        accuracy.append((logits.argmax(-1) == labels[valid]).float().mean().item() if valid.any() else 0.0)
    return losses, accuracy


def soft_cross_entropy(logits: torch.Tensor, batch: TargetPass, at: torch.Tensor, draft_of: torch.Tensor,
                       valid: torch.Tensor) -> torch.Tensor:
    """SpecForge's loss, -sum p log q: p the target's distribution after token `at` over the
    draft vocabulary, truncated to its kept top-k logits (those outside the draft vocabulary
    dropped, the rest renormalised); q the drafter's. logits (V, D) of the rows `valid` (B, A)."""
    index = at[..., None].expand(-1, -1, batch.top_ids.shape[-1])
    ids = draft_of[torch.gather(batch.top_ids, 1, index)][valid]  # (V, K) draft ids, -1 outside
    target = torch.gather(batch.top_logits, 1, index)[valid].float().masked_fill(ids < 0, float("-inf"))
    wanted = target.softmax(-1)  # each valid row's greedy token is in the draft vocabulary, so no row is all -inf
    drafted = torch.gather(logits.float().log_softmax(-1), 1, ids.clamp(min=0))
    return -(wanted * drafted).sum() / max(1, int(valid.sum()))


def save(args, argv, module, config: dict, log: list[dict], seconds: float) -> None:
    eagle3.save_specforge(module, args.out, config, shared_embedding=args.shared_embedding)
    with open(os.path.join(args.out, "training.json"), "w") as file:
        json.dump({"command": " ".join(["python -m models.demo.train_eagle3", *(argv or sys.argv[1:])]),
                   "settings": vars(args), "train_seconds": round(seconds), "steps_done": log[-1]["step"] if log else 0,
                   "trained_parameters": sum(p.numel() for p in module.parameters() if p.requires_grad),
                   "log": log}, file, indent=1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m models.demo.train_eagle3", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--target", default=DEFAULT_TARGET, help="a VLM folder, or smol (the SmolLM2 demo)")
    parser.add_argument("--shared-embedding", action="store_true",
                        help="leave the (frozen, the target's) embedding table out of the checkpoint: the loader takes the target's")
    add_training_flags(parser, steps=220, save_every=50)
    parser.add_argument("--data", help="a models.demo.distill_smol data folder: train on the target's own answers")
    parser.add_argument("--ttt-steps", type=int, default=5, help="unrolled steps (the draft length it learns)")
    parser.add_argument("--draft-vocab", type=int, default=512, help="draft vocabulary size (d2t / t2d)")
    parser.add_argument("--target-answers", action="store_true",
                        help="replace each assistant turn by the target's greedy answer (slower: a generate per batch)")
    parser.add_argument("--conversations", type=int, default=0,
                        help="train epoch after epoch on the first N world conversations, each batch's answers "
                             "and target pass made once and kept (0: fresh conversations every step)")
    parser.add_argument("--feature-weight", type=float, default=0.0,
                        help="weight of the feature loss: each unrolled step's h, which the next step reads, "
                             "near g of the token it stands for (0: off, SpecForge's loss alone)")
    parser.add_argument("--soft-labels", type=int, default=0, metavar="K",
                        help="train on the target's distribution (its top K tokens in the draft vocabulary, "
                             "SpecForge's soft targets truncated) instead of its greedy token (0: greedy labels)")
    parser.add_argument("--intermediate-size", type=int, help="the drafter layer's MLP width (default: the target's)")
    parser.add_argument("--init", help="an EAGLE-3 checkpoint of this target to continue from (its draft vocabulary kept)")
    parser.add_argument("--mixed-batches", action="store_true",
                        help="with --conversations / --data: batches in a seeded random order (kinds mixed; "
                             "more padding, about 2x slower a step) rather than of similar length")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    if args.target == "smol":
        from models.demo import smol

        args.target = str(smol.assemble())
    target = AutoModelForImageTextToText.from_pretrained(args.target, dtype=torch.float32).eval().requires_grad_(False)
    pictures = picture_weights.for_pictures(args.target, target)  # what the engine runs conversations with a picture on
    processor = load_processor(args.target)
    distilled = distilled_examples(args.data, processor.tokenizer) if args.data else None
    if args.conversations and distilled is None:
        distilled = list(world.train_examples(0, args.conversations))
    start = eagle3.read_weights(args.init, eagle3.read_config(args.init)) if args.init else None
    vocabulary = (start["d2t"] + torch.arange(len(start["d2t"])) if start is not None
                  else draft_vocabulary(processor, args.draft_vocab, distilled))
    config = specforge_config(target.config, len(vocabulary), os.path.relpath(args.target), args.intermediate_size)
    module = eagle3.Eagle3(eagle3.read_config_dict(config))
    with torch.no_grad():
        module.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        module.lm_head.weight.copy_(target.get_output_embeddings().weight[vocabulary])
        module.d2t.copy_(vocabulary - torch.arange(len(vocabulary)))
        module.t2d.zero_()
        module.t2d[vocabulary] = True
    if start is not None:
        module.load_state_dict({k: v for k, v in start.items() if k != "embed_tokens.weight"}, strict=False)
    module.embed_tokens.requires_grad_(False)
    draft_of = draft_index(vocabulary, module.config.vocab_size)
    layers = [i + 1 for i in layers_as_outputs(target.config.get_text_config().num_hidden_layers)]  # hidden_states indices
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=args.lr,
                                  betas=(0.9, 0.98), weight_decay=0.01)
    stream, passes = batches(distilled, args.batch_size, args.seed, args.mixed_batches,
                             split_pictures=pictures is not target), {}
    keep = distilled is not None and args.steps * args.batch_size > len(distilled)  # only a second epoch reads them

    def train_step(step: int) -> dict[str, float]:
        key, examples = next(stream)
        batch = passes.get(key)
        if batch is None:
            model = pictures if any(e.images for e in examples) else target
            if args.target_answers:
                examples = target_answers(model, processor, examples, args.max_answer_tokens)
            batch = TargetPass(model, processor, examples, tuple([0] + layers), args.soft_labels)
        if key is not None and keep:  # --data / --conversations: the batch comes back each epoch; its pass is kept
            passes[key] = batch
        aligned = [] if args.feature_weight else None
        losses, accuracy = eagle3_losses(module, batch, layers, args.ttt_steps, draft_of, aligned)
        loss = sum(losses) / len(losses) + (args.feature_weight * sum(aligned) / len(aligned) if aligned else 0.0)
        lr = learning_rate(step, args.steps, args.lr, warmup=20)
        optimizer_step(optimizer, module, loss, lr)
        return {f"loss{i + 1}": loss.item() for i, loss in enumerate(losses)} | \
            {f"acc{i + 1}": a for i, a in enumerate(accuracy)} | \
            {f"feature{i + 1}": f.item() for i, f in enumerate(aligned or [])}

    seconds = run_training(args.steps, args.save_every, train_step,
                           lambda entries, seconds: save(args, argv, module, config, entries, seconds))
    print(f"saved {args.out} ({seconds:.0f} s)")


if __name__ == "__main__":
    main()
