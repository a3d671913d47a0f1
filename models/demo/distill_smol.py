"""Self-distillation for the SmolLM2 demo's drafters: the frozen target's own answers, and a
small text drafter trained on them.

    python -m models.demo.distill_smol data --out DIR [--text N] [--pictures N]   # resumable
    python -m models.demo.distill_smol text-drafter --data DIR --out DIR [--layers 4] [--steps N]

`data` asks the target (default: the assembled SmolLM2 demo, `models.demo.smol.assemble()`)
for its greedy answer to N text prompts the repo generates (`text_prompts`: forms x topics,
none of them among measure/smol_text.py's 50 evaluation prompts) and to N picture conversations
of the world (`world.train_examples`, first turn), and appends one JSON line each to
DIR/answers.jsonl (the conversation, the answer's token ids); run again to continue (only the
missing records are asked).

`text-drafter` trains a Llama with --layers of SmolLM2's 30 decoder layers (evenly spaced,
the last included, copied as the start) and SmolLM2's embeddings and output head (frozen,
tied), on the text-only view of those conversations (pictures dropped, as the engine's text
drafter sees them), cross-entropy on the target's answer tokens. It writes a
`LlamaForCausalLM` folder with the demo's tokenizer (same ids as the target), usable as
`--drafter DIR`. The MTP head and the block drafter train with
`python -m models.demo.train_drafters --target $(python -m models.demo.smol) --block-layers 10,20,30`.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from models.demo.drafter_data import conversation

FORMS = ("What is {}?", "Explain {} in two sentences.", "Give me three facts about {}.", "Write a short poem about {}.",
         "Why is {} important?", "Describe {} to a child.", "What are the main uses of {}?", "Tell me a story about {}.",
         "What is the history of {}?", "List some interesting questions about {}.", "How does {} work?",
         "Write a short paragraph about {}.", "What are the pros and cons of {}?", "Hi! Can you tell me about {}?",
         "What should a beginner know about {}?", "Compare {} with something similar.",
         # 8 more (the third round: 24 forms x 150 topics)
         "Write a haiku about {}.", "Give me a one-sentence summary of {}.", "What are three tips about {}?",
         "Can you explain {} in simple words?", "Write a short thank-you note that mentions {}.",
         "What is a fun fact about {}?", "How would you teach someone about {}?", "Answer in one sentence: what is {}?")
TOPICS = ("the moon", "volcanoes", "bicycles", "coffee", "the ocean", "electricity", "friendship", "music", "trees",
          "the Roman Empire", "computers", "dogs", "cats", "rain", "mathematics", "chess", "gardening", "the desert",
          "bread", "trains", "snow", "the brain", "football", "honey", "libraries", "bridges", "clocks", "birds",
          "the alphabet", "magnets", "paper", "glass", "rivers", "the wind", "robots", "stars", "soap", "maps",
          "pizza", "the piano", "dinosaurs", "recycling", "the telephone", "mountains", "vaccines", "money",
          "the seasons", "forests", "cooking", "painting",
          # 50 more (the data of the second round: 1,600 prompts)
          "the sun", "earthquakes", "cars", "tea", "lakes", "batteries", "kindness", "dancing", "flowers",
          "ancient Egypt", "the internet", "horses", "rabbits", "thunderstorms", "geometry", "puzzles", "farming",
          "the jungle", "cheese", "airplanes", "ice", "the heart", "basketball", "sugar", "museums", "tunnels",
          "calendars", "insects", "languages", "kites", "ink", "plastic", "waterfalls", "clouds", "satellites",
          "planets", "shampoo", "compasses", "soup", "the guitar", "whales", "composting", "radio", "islands",
          "antibiotics", "banks", "holidays", "deserts at night", "baking", "sculpture",
          # 50 more (the third round)
          "owls", "the printing press", "photography", "fire", "salt", "umbrellas", "submarines", "glaciers",
          "the camera", "lighthouses", "penguins", "origami", "the violin", "tomatoes", "skiing", "swimming",
          "the microscope", "spiders", "deserts in winter", "rice", "the calendar year", "windmills", "pottery",
          "sharks", "the eye", "running", "wool", "candles", "the Olympic Games", "coral reefs", "apples",
          "the metro", "tigers", "theatre", "yoga", "wheat", "the Great Wall of China", "oxygen", "bees",
          "thermometers", "elephants", "podcasts", "castles", "frogs", "hiking", "chocolate", "the keyboard",
          "camping", "the solar system", "video games")


def text_prompts() -> list[str]:
    """Every form x topic, in a fixed shuffled order (seed 0)."""
    prompts = [form.format(topic) for topic in TOPICS for form in FORMS]
    random.Random(0).shuffle(prompts)
    return prompts


def generate_data(target_folder: str, out: Path, n_text: int, n_pictures: int, max_new_tokens: int,
                  batch_size: int = 16, device: str = "cpu") -> None:
    from transformers import AutoModelForImageTextToText

    from models.processors import load_processor

    out.mkdir(parents=True, exist_ok=True)
    path = out / "answers.jsonl"
    key = lambda r: (r["kind"], r.get("prompt", r.get("example")))  # noqa: E731
    done = {key(json.loads(line)) for line in open(path)} if path.exists() else set()
    prompts = text_prompts()[:n_text]
    records = [{"kind": "text", "prompt": p} for p in prompts] + [{"kind": "picture", "example": i} for i in range(n_pictures)]
    records = [r for r in records if key(r) not in done]  # a second run adds only what is missing
    from models.picture_weights import for_pictures

    text_model = AutoModelForImageTextToText.from_pretrained(target_folder, dtype=torch.float32).eval()
    picture_model = for_pictures(target_folder, text_model)  # the weights the engine answers pictures with
    text_model.to(device), picture_model.to(device)
    processor = load_processor(target_folder)
    tokenizer = processor.tokenizer
    tokenizer.padding_side = "left"  # batched greedy generation: every answer starts at the same column
    ends = {tokenizer.pad_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
    started = time.time()
    kinds = [[r for r in records if r["kind"] == kind] for kind in ("text", "picture")]
    batches = [same[first: first + batch_size] for same in kinds for first in range(0, len(same), batch_size)]
    answered = 0
    for batch in batches:  # one kind a batch: the kinds run on different weights
        model = picture_model if batch[0]["kind"] == "picture" else text_model
        conversations = [conversation(r) for r in batch]
        texts = [processor.apply_chat_template(m, add_generation_prompt=True) for m, _ in conversations]
        images = [image for _, shown in conversations for image in shown]
        inputs = processor(text=texts, images=images or None, padding=True, return_tensors="pt").to(device)
        with torch.inference_mode():
            output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                    pad_token_id=tokenizer.pad_token_id)
        with open(path, "a") as f:
            for record, row in zip(batch, output[:, inputs["input_ids"].shape[1]:].tolist()):
                stop = next((i for i, t in enumerate(row) if t in ends), len(row))
                record["answer_ids"] = row[: stop + 1] if stop < len(row) else row  # the stop token kept
                f.write(json.dumps(record) + "\n")
        answered += len(batch)
        print(f"{answered}/{len(records)} answers, {time.time() - started:.0f} s", flush=True)


def text_view(processor, record: dict) -> tuple[list[int], list[int]]:
    """(input ids, labels) of a record for a text-only drafter: the conversation without its
    pictures, then the target's answer; labels -100 outside the answer."""
    messages, _ = conversation(record)
    bare = [{"role": m["role"], "content": [c for c in m["content"] if c["type"] == "text"]} for m in messages]
    prompt = processor.tokenizer(processor.apply_chat_template(bare, add_generation_prompt=True))["input_ids"]
    answer = record["answer_ids"]
    return prompt + answer, [-100] * len(prompt) + answer


def build_text_drafter(target, layers: int):
    """A LlamaForCausalLM with `layers` of the target's decoder layers (evenly spaced, the last
    included) and its embeddings (tied, frozen)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    text = target.config.text_config
    total = text.num_hidden_layers
    picks = [round(i * (total - 1) / max(1, layers - 1)) for i in range(layers)] if layers > 1 else [total - 1]
    config = LlamaConfig(vocab_size=text.vocab_size, hidden_size=text.hidden_size, intermediate_size=text.intermediate_size,
                         num_hidden_layers=layers, num_attention_heads=text.num_attention_heads,
                         num_key_value_heads=text.num_key_value_heads, rms_norm_eps=text.rms_norm_eps,
                         max_position_embeddings=text.max_position_embeddings,
                         rope_parameters={"rope_type": "default", "rope_theta": text.rope_parameters["rope_theta"]},
                         bos_token_id=text.bos_token_id, eos_token_id=text.eos_token_id, pad_token_id=text.pad_token_id,
                         tie_word_embeddings=True)
    drafter = LlamaForCausalLM(config)
    source = target.model.language_model
    state = {"model.embed_tokens.weight": source.embed_tokens.weight, "model.norm.weight": source.norm.weight}
    for new, old in enumerate(picks):
        for key, value in source.layers[old].state_dict().items():
            if not key.endswith("_proj.bias"):  # Qwen2's zero q/k/v biases; Llama has none
                state[f"model.layers.{new}.{key}"] = value
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    drafter.tie_weights()
    drafter.model.embed_tokens.weight.requires_grad_(False)
    return drafter, picks


def train_text_drafter(data: Path, target_folder: str, out: Path, layers: int, steps: int, batch_size: int,
                       lr: float, seed: int) -> dict:
    from transformers import AutoModelForImageTextToText

    from models.demo.training import learning_rate
    from models.processors import load_processor

    torch.manual_seed(seed)
    target = AutoModelForImageTextToText.from_pretrained(target_folder, dtype=torch.float32)
    processor = load_processor(target_folder)
    drafter, picks = build_text_drafter(target, layers)
    del target
    records = [json.loads(line) for line in open(data / "answers.jsonl")]
    views = [text_view(processor, r) for r in records]
    trained = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    rng, pad, log, started = random.Random(seed), processor.tokenizer.pad_token_id, [], time.time()
    for step in range(steps):
        chosen = [views[rng.randrange(len(views))] for _ in range(batch_size)]
        width = max(len(ids) for ids, _ in chosen)
        ids = torch.full((batch_size, width), pad)
        labels = torch.full((batch_size, width), -100)
        mask = torch.zeros((batch_size, width), dtype=torch.long)
        for row, (i, lab) in enumerate(chosen):
            ids[row, : len(i)], labels[row, : len(i)], mask[row, : len(i)] = torch.tensor(i), torch.tensor(lab), 1
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, lr, warmup=20)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = drafter(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % 10 == 0 or step + 1 == steps:
            log.append({"step": step + 1, "loss": round(loss.item(), 4), "seconds": round(time.time() - started)})
            print(json.dumps(log[-1]), flush=True)
    drafter.save_pretrained(out)
    processor.tokenizer.save_pretrained(out)
    report = {"layers_from_target": picks, "records": len(records), "steps": steps, "batch_size": batch_size, "lr": lr,
              "seed": seed, "parameters": sum(p.numel() for p in drafter.parameters()), "log": log}
    (out / "distill_training.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    data = commands.add_parser("data")
    data.add_argument("--out", type=Path, required=True)
    data.add_argument("--target", help="target folder (default: the assembled SmolLM2 demo)")
    data.add_argument("--text", type=int, default=800)
    data.add_argument("--pictures", type=int, default=400)
    data.add_argument("--max-new-tokens", type=int, default=128)
    data.add_argument("--batch-size", type=int, default=16, help="conversations per batched generate")
    drafter = commands.add_parser("text-drafter")
    drafter.add_argument("--data", type=Path, required=True)
    drafter.add_argument("--out", type=Path, required=True)
    drafter.add_argument("--target", help="target folder (default: the assembled SmolLM2 demo)")
    drafter.add_argument("--layers", type=int, default=4)
    drafter.add_argument("--steps", type=int, default=1000)
    drafter.add_argument("--batch-size", type=int, default=8)
    drafter.add_argument("--lr", type=float, default=3e-4)
    drafter.add_argument("--seed", type=int, default=0)
    data.add_argument("--device", default="cpu", help="cpu, or cuda")
    for sub in (data, drafter):
        sub.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.target is None:
        from models.demo import smol

        args.target = str(smol.assemble())
    if args.command == "data":
        generate_data(args.target, args.out, args.text, args.pictures, args.max_new_tokens, args.batch_size, args.device)
    else:
        train_text_drafter(args.data, args.target, args.out, args.layers, args.steps, args.batch_size, args.lr, args.seed)


if __name__ == "__main__":
    main()
