"""Text turns of the SmolLM2 demo against SmolLM2-135M-Instruct itself, token for token.

    python -m measure.smol_text [--limit N] [--max-new-tokens 64] [--json OUT]
                                [--drafter NAME ...] [--draft-tokens K]

The reference is transformers' LlamaForCausalLM loaded from the GGUF file of the registry
package (`models.demo.smol.load_smollm2`), prompted with SmolLM2's own chat template and its
tokenizer, greedy `generate`, float32. The candidate is the assembled Qwen2-VL demo
(`models.demo.smol.assemble`) through this project's engine (`engine.engine.Engine`, plain
decoding, float32; the fast compiled decode path when it covers the model, as the app runs it).
The prompts (`PROMPTS`, 50) are general chat requests: none is from the synthetic world the
vision part is trained on. A prompt agrees when the generated token ids are identical (the
stop token, which only the engine returns, dropped).

With `--drafter` (a folder such as the smol preset's EAGLE-3 drafter, or `ngram`; repeatable),
each prompt is also answered with speculative decoding by each drafter (k chosen from cost, or
`--draft-tokens K`): its acceptance (accepted / drafted over all prompts), tokens per target
pass and on how many prompts its answer is the plain one, token for token: the drafters on real text.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine.ab import first_difference_index

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Hello! What can you do?",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis to a ten-year-old.",
    "What is 12 times 7?",
    "Give me three tips for better sleep.",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Fahrenheit?",
    "Summarize the plot of Cinderella in two sentences.",
    "Write a Python function that reverses a string.",
    "What are the primary colors?",
    "Why is the sky blue?",
    "Name five animals that live in the ocean.",
    "How do I make a cup of tea?",
    "What is the difference between weather and climate?",
    "Tell me a short joke.",
    "What does a CPU do in a computer?",
    "List the planets of the solar system in order.",
    "What is the largest mammal on Earth?",
    "Suggest a name for a pet goldfish.",
    "How many days are there in a leap year?",
    "What is gravity?",
    "Write a two-line poem about the sea.",
    "What is the opposite of 'ancient'?",
    "Explain what a noun is, with an example.",
    "How can I stay motivated while studying?",
    "What causes rain?",
    "Describe a sunset in one sentence.",
    "What is the square root of 81?",
    "Give me a recipe idea for dinner with rice and beans.",
    "What language is spoken in Brazil?",
    "Why do we need to drink water?",
    "What is an atom?",
    "How do airplanes stay in the air?",
    "Write a short thank-you note to a teacher.",
    "What is the main function of the heart?",
    "Name three famous painters.",
    "What is a prime number? Give two examples.",
    "How do bees make honey?",
    "What should I pack for a beach holiday?",
    "Explain what the internet is in simple words.",
    "What is the freezing point of water in Celsius?",
    "Can you recommend a good habit to start in the morning?",
    "What is the tallest mountain in the world?",
    "How does a rainbow form?",
    "What are the three states of matter?",
    "Write one sentence using the word 'curious'.",
    "What is the meaning of the word 'generous'?",
    "Why do leaves change colour in the fall?",
]


def reference_ids(llama, tokenizer, prompt: str, max_new_tokens: int) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=2, pad_token_id=2)
    return [t for t in out[0, ids.shape[1]:].tolist() if t != 2]


def top1_agreement(engine, messages, want: list[int]) -> int:
    """How many of the reference answer's tokens are the engine's own top-1 choice after the prompt and
    the reference's tokens before it (teacher-forced: one pass over the whole answer)."""
    runner = engine.target.runner
    prompt = engine.prepare(messages)
    first, state = runner.prefill(prompt.target_inputs)
    logits = first.reshape(-1, first.shape[-1])[-1:]
    if len(want) > 1:
        logits = torch.cat([logits, runner.extend(state, want[:-1])])
    return int((logits.argmax(-1) == torch.tensor(want)).sum()) if want else 0


def main(argv=None) -> int:
    from engine.engine import Engine
    from engine.loop import DecodeSettings, Done
    from engine.target import load_target
    from models.demo import smol
    from models.loading import LoadOptions

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=len(PROMPTS))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--model", help="an assembled folder (default: models.demo.smol.assemble())")
    parser.add_argument("--json", help="write the per-prompt results here")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--drafter", action="append", default=[], help="also speculative with this drafter")
    parser.add_argument("--draft-tokens", type=int, default=None, help="fixed k (default: chosen from cost)")
    parser.add_argument("--weight-arithmetic", choices=("float", "integer"), default=None,
                        help="the engine's products over the GGUF blocks (default: the smol preset's)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    folder = args.model or str(smol.assemble())
    llama, tokenizer = smol.load_smollm2(smol.fetch_gguf())
    from models.presets import PRESETS

    arithmetic = args.weight_arithmetic or PRESETS["smol"].weight_arithmetic
    target = load_target(folder, LoadOptions(dtype="float32", device="cpu", weight_arithmetic=arithmetic))
    print(f"engine decode path: {'fast' if target.runner.fast is not None else target.runner.fast_fallback}, "
          f"{arithmetic} arithmetic")
    from engine.build import drafter_key
    from engine.drafters.registry import load_drafter

    drafters = {}
    for name in args.drafter:
        drafter = load_drafter(name, target, LoadOptions(dtype="float32", device="cpu"))
        drafters[drafter_key(drafter, drafters)] = drafter
    engine = Engine(target, drafters)
    decode = DecodeSettings(max_new_tokens=args.max_new_tokens)
    speculative = DecodeSettings(max_new_tokens=args.max_new_tokens, draft_tokens=args.draft_tokens)
    totals = {key: {"drafted": 0, "accepted": 0, "tokens": 0, "target_forwards": 0, "identical": 0} for key in drafters}
    rows, started = [], time.time()
    for number, prompt in enumerate(PROMPTS[: args.limit]):
        want = reference_ids(llama, tokenizer, prompt, args.max_new_tokens)
        messages = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
        done = [e for e in engine.stream(messages, drafter=None, decode=decode) if isinstance(e, Done)][0]
        got = [t for t in done.token_ids if t != 2]
        same = got == want
        first = first_difference_index(got, want)
        agree = top1_agreement(engine, messages, want)
        row = {"prompt": prompt, "identical": same, "tokens": len(want), "first_difference": first,
               "top1_agreement": agree, "answer": tokenizer.decode(want)}
        for key in drafters:
            answer = [e for e in engine.stream(messages, drafter=key, decode=speculative) if isinstance(e, Done)][0]
            stats, total, same_answer = answer.stats, totals[key], answer.token_ids == done.token_ids
            counts = {field: getattr(stats, field) for field in ("drafted", "accepted", "target_forwards")}
            for field, count in counts.items():
                total[field] += count
            total["identical"] += same_answer
            total["tokens"] += len(answer.token_ids)
            row[key] = {"identical_to_plain": same_answer, **counts}
        rows.append(row)
        print(f"{number + 1:2d} {'same' if same else f'DIFFERS at {first}'} ({len(want)} tokens): "
              f"{tokenizer.decode(want)[:70]!r}", flush=True)
    identical = sum(r["identical"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    summary = {"identical": identical, "prompts": len(rows), "max_new_tokens": args.max_new_tokens,
               "weight_arithmetic": arithmetic, "tokens": tokens,
               "top1_agreement": round(sum(r["top1_agreement"] for r in rows) / max(1, tokens), 4),
               "seconds": round(time.time() - started)}
    for key, total in totals.items():
        summary[key] = {"identical_to_plain": total["identical"], "draft_tokens": args.draft_tokens or "cost",
                        "acceptance": round(total["accepted"] / max(1, total["drafted"]), 3),
                        "tokens_per_target_pass": round(total["tokens"] / max(1, total["target_forwards"]), 2)}
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=1)
    exact = all(total["identical"] == len(rows) for total in totals.values())
    return 0 if identical == len(rows) and exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
