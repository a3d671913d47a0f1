"""Low-rank updates of the SmolLM2 demo's language model, trained on picture turns.

A frozen SmolLM2-135M reads the pictures only through its input embeddings, and trained that
way (vision tower + connector alone) it stopped at 27 % on the world's held-out questions. These
adapters let the language model itself learn to read the vision tokens: each projection of each
decoder layer becomes W + B @ A (rank r, B zero at the start, so training starts from SmolLM2
exactly). The assembled demo carries them as its picture weights (models/picture_weights.py):
the engine adds them to the weights only for conversations that hold a picture, so text turns
are SmolLM2's by construction (`python -m measure.smol_text` checks it).

Training also keeps the adapted model close to SmolLM2 on text, by a distillation term (the KL
divergence from the same model with the adapters off, on its own answers to text prompts,
`models.demo.distill_smol`): a text question asked after a picture, in the same conversation,
is answered by the adapted weights.
"""

from __future__ import annotations

import itertools
import random

import torch
import torch.nn.functional as F

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
PREFIX = "model.language_model."  # the adapters' keys name the weight they update, under this prefix


class PictureAdapters(torch.nn.Module):
    """Rank-`rank` updates on every projection of `language_model`'s layers, applied by forward
    hooks (the model's own modules and weights are untouched); `enabled = False` turns them off,
    which gives the frozen SmolLM2 back (the distillation teacher)."""

    def __init__(self, language_model, rank: int, alpha: float, seed: int = 0):
        super().__init__()
        self.scale, self.enabled = alpha / rank, True
        generator = torch.Generator().manual_seed(seed)
        self.down, self.up = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        self.paths: dict[str, str] = {}
        self._hooks = []
        for i, layer in enumerate(language_model.layers):
            for projection in PROJECTIONS:
                linear = layer.get_submodule(projection)
                key = f"{i}_{projection.replace('.', '_')}"
                self.paths[key] = f"layers.{i}.{projection}"
                a = torch.randn(rank, linear.in_features, generator=generator) * linear.in_features ** -0.5
                self.down[key] = torch.nn.Parameter(a)  # A: (rank, in)
                self.up[key] = torch.nn.Parameter(torch.zeros(linear.out_features, rank))  # B: (out, rank)
                self._hooks.append(linear.register_forward_hook(self._update(key)))

    def _update(self, key: str):
        def hook(module, inputs, output):
            if not self.enabled:
                return output
            return output + self.scale * F.linear(F.linear(inputs[0], self.down[key]), self.up[key])
        return hook

    def merged_deltas(self) -> dict[str, torch.Tensor]:
        """{"model.language_model.layers.i.<projection>.lora_A": A, ".lora_B": scale * B}: the
        update of weight W is lora_B @ lora_A, (out, rank) @ (rank, in)."""
        deltas = {}
        for key, path in self.paths.items():
            deltas[f"{PREFIX}{path}.lora_A"] = self.down[key].detach().float().contiguous()
            deltas[f"{PREFIX}{path}.lora_B"] = (self.scale * self.up[key].detach().float()).contiguous()
        return deltas


def text_distillation(model, adapters: PictureAdapters, batch: dict, bf16: bool) -> torch.Tensor:
    """KL(frozen SmolLM2 || adapted model) at the answer positions of a text batch
    ({input_ids, attention_mask, labels}: labels -100 outside the answers, on the model's
    device), per answer token."""
    rows = batch["labels"][:, 1:] != -100
    with torch.autocast(batch["input_ids"].device.type, dtype=torch.bfloat16, enabled=bf16):
        with torch.no_grad():
            adapters.enabled = False
            try:
                hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
                teacher = F.log_softmax(model.lm_head(hidden[:, :-1][rows]).float(), -1)
            finally:
                adapters.enabled = True
        hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        student = F.log_softmax(model.lm_head(hidden[:, :-1][rows]).float(), -1)
    return F.kl_div(student, teacher, log_target=True, reduction="batchmean")


def text_batches(records: list[dict], tokenizer, render, batch_size: int, seed: int):
    """Endless batches of text turns with the frozen target's answers (answers.jsonl records of
    kind "text"), shuffled per epoch with (seed, epoch): right-padded input ids, the mask, and
    labels at the answer tokens. `render(prompt)` is the prompt's text with the generation prompt."""
    pad = tokenizer.pad_token_id
    for epoch in itertools.count():
        order = list(range(len(records)))
        random.Random(f"text:{seed}:{epoch}").shuffle(order)
        for first in range(0, len(order) - batch_size + 1, batch_size):
            rows = []
            for i in order[first: first + batch_size]:
                prompt = tokenizer(render(records[i]["prompt"]))["input_ids"]
                rows.append((prompt + records[i]["answer_ids"], len(prompt)))
            width = max(len(ids) for ids, _ in rows)
            ids = torch.full((len(rows), width), pad)
            mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
            for r, (row, start) in enumerate(rows):
                ids[r, : len(row)], mask[r, : len(row)] = torch.tensor(row), 1
                labels[r, start: len(row)] = torch.tensor(row[start:])
            yield {"input_ids": ids, "attention_mask": mask, "labels": labels}
