"""`whiflash train derive --step magpie`: user requests written by the target itself.

Magpie (Xu et al. 2024, "Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with
Nothing"): give an instruction-tuned model its chat template up to the start of a user turn and
sample. What it writes is a user request drawn from the instructions it was tuned on: for
SmolLM2-Instruct advice, planning, writing, rewriting, explaining, the everyday chat of
Spec-Bench's writing, roleplay, reasoning, stem and humanities categories. Those are the
categories where EAGLE-3 accepts least, and the sets that have such prompts are CC BY-NC (Alpaca);
these are the target's own text (its licence, Apache-2.0 for SmolLM2), and `whiflash train distill`
then answers them like any prompt set.

    whiflash train derive --step magpie --out datasets/prompts-magpie/magpie_smollm2.jsonl --count 2000
    whiflash train distill --prompts datasets/prompts-magpie/magpie_smollm2.jsonl --out datasets/smollm2-distill-r9

Sampling is plain (temperature 1, no top-k / top-p, as the paper does), seeded per batch, so a
rerun writes the same file, and a run stopped midway continues after the last batch it wrote.
Kept: a request that ended its turn (the end-of-turn token) within MAX_NEW_TOKENS, of MIN_WORDS
to MAX_WORDS words, not a repeat (case and spacing folded) and sharing no SHINGLE-word run with a
Spec-Bench prompt (a model tuned on public chat data may have seen MT-Bench's questions; those
must not come back as training prompts).

Measured before training on them (README, "Training the drafters"; 2026-12-07): the shipped
EAGLE-3 already reads the target's answers to these requests at val tau 3.20, as well as the
sources it was trained on (3.27) and far above the never-trained alpaca sets (1.9-2.0, Spec-Bench's
level). What the target finds typical to ask, it also answers predictably: this source adds little.
"""
from __future__ import annotations

import json
import os
import re
from typing import Iterable

SOURCE = "magpie_smollm2"
MAX_NEW_TOKENS = 128
MIN_WORDS, MAX_WORDS = 3, 200
SHINGLE = 8          # words in a run shared with a benchmark prompt that drops a request
PLACEHOLDER = "\x00USER\x00"


def _rendered(tokenizer) -> tuple[str, str]:
    """The chat template around one user turn: (the text before its content, the text after it)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": PLACEHOLDER}], tokenize=False)
    before, after = text.split(PLACEHOLDER)
    return before, after


def user_prefix(tokenizer) -> str:
    """The chat template's text up to where a user turn's content starts (with the template's
    default system prompt, as the server renders a request without one)."""
    return _rendered(tokenizer)[0]


def end_of_turn(tokenizer) -> int:
    """The token that closes a user turn in the template (SmolLM2: <|im_end|>)."""
    return tokenizer(_rendered(tokenizer)[1], add_special_tokens=False).input_ids[0]


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def shingles(text: str, n: int = SHINGLE) -> set[tuple[str, ...]]:
    words = _words(text)
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def benchmark_shingles(path: str | None) -> set[tuple[str, ...]]:
    """Every SHINGLE-word run of every user turn of a Spec-Bench-style JSONL (`turns` or
    `messages`); empty when there is no such file (then nothing is checked: say so)."""
    out: set[tuple[str, ...]] = set()
    if not path or not os.path.exists(path):
        return out
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            turns = record.get("turns") or [m.get("content") or "" for m in record.get("messages", [])
                                            if m.get("role") == "user"]
            for turn in turns:
                out |= shingles(turn)
    return out


def clean_request(text: str) -> str | None:
    """A sampled user turn as a prompt, or None when it is too short or too long."""
    text = text.strip()
    return text if MIN_WORDS <= len(text.split()) <= MAX_WORDS else None


def keep(requests: Iterable[str], seen: set[str], banned: set[tuple[str, ...]]) -> list[str]:
    """The requests that are new (not in `seen`, which grows) and share no run with `banned`."""
    out = []
    for text in requests:
        key = " ".join(_words(text))
        if key in seen or (banned and shingles(text) & banned):
            continue
        seen.add(key)
        out.append(text)
    return out


def sample_batch(model, tokenizer, prefix_ids: list[int], size: int, seed: int, batch: int,
                 max_new_tokens: int = MAX_NEW_TOKENS) -> list[str]:
    """`size` user turns sampled after the prefix; those that did not end their turn are dropped."""
    import torch
    from transformers import GenerationConfig

    eos = end_of_turn(tokenizer)
    ids = torch.tensor([prefix_ids] * size)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(seed * 1_000_003 + batch)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    texts = []
    for row in out[:, len(prefix_ids):].tolist():
        if eos in row:
            cleaned = clean_request(tokenizer.decode(row[: row.index(eos)], skip_special_tokens=True))
            if cleaned is not None:
                texts.append(cleaned)
    return texts


def write_magpie(out: str, count: int, seed: int = 0, batch_size: int = 64, bench: str | None = None,
                 threads: int = 1, max_new_tokens: int = MAX_NEW_TOKENS, target=None) -> int:
    """Append prompt records ({id, messages}) to `out` until it holds `count`; returns how many it
    holds. `target`: (model, tokenizer) already loaded (default: the embedded target in float32)."""
    import torch

    from whiflash_core.loading import load_hf_model

    torch.set_num_threads(threads)
    records = []
    if os.path.exists(out):
        with open(out, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    seen = {" ".join(_words(r["messages"][0]["content"])) for r in records}
    tag = f"magpie-s{seed}-b"   # this seed's batches: "magpie-s{seed}-b{batch}-{i}"
    done = max((int(r["id"][len(tag):].split("-")[0]) for r in records if r["id"].startswith(tag)), default=-1)
    banned = benchmark_shingles(bench)
    if not banned:
        print(f"no benchmark file at {bench!r}: requests are not checked against one")
    model, tokenizer = target if target is not None else load_hf_model(None)   # the distiller's target
    model = model.float().eval()
    prefix = tokenizer(user_prefix(tokenizer), add_special_tokens=False).input_ids
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    batch = done + 1
    while len(records) < count:
        kept = keep(sample_batch(model, tokenizer, prefix, batch_size, seed, batch, max_new_tokens), seen, banned)
        new = [{"id": f"{tag}{batch}-{i}", "messages": [{"role": "user", "content": text}]}
               for i, text in enumerate(kept[: count - len(records)])]
        with open(out, "a", encoding="utf-8") as f:   # one batch at a time: a stopped run continues here
            for r in new:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        records += new
        print(f"batch {batch}: kept {len(new)} of {batch_size}, {len(records)} / {count}", flush=True)
        batch += 1
    return len(records)
