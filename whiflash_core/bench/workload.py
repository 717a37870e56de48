"""Benchmark prompts.

Two JSONL shapes are accepted, one record per line:

    Spec-Bench:  {"question_id": 81, "category": "writing", "turns": ["...", "..."]}
                 -> the first turn becomes a single user message (later turns would need the
                    model's own first answer, which differs per dtype, so they are skipped)
    chat:        {"category": "agentic", "messages": [...], "tools": [...]}   (tools optional)
                 -> rendered with the server's chat/tool template (whiflash_core.chat)
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class BenchPrompt:
    id: str
    category: str
    messages: list[dict]
    tools: list[dict] | None = None
    ids: list[int] | None = field(default=None, repr=False)  # token ids, filled by the in-process runner


def parse_record(item: dict, line_no: int) -> BenchPrompt:
    category = str(item.get("category") or "default")
    if "turns" in item:
        turns = item["turns"]
        if not turns:
            raise ValueError(f"line {line_no}: empty 'turns'")
        pid = str(item.get("question_id", item.get("id", line_no)))
        return BenchPrompt(pid, category, [{"role": "user", "content": turns[0]}])
    if "messages" in item:
        if not item["messages"]:
            raise ValueError(f"line {line_no}: empty 'messages'")
        pid = str(item.get("id", item.get("question_id", line_no)))
        return BenchPrompt(pid, category, item["messages"], item.get("tools") or None)
    raise ValueError(f"line {line_no}: a record needs 'turns' (Spec-Bench) or 'messages' (chat)")


def load_workload(path: str, categories: list[str] | None = None, limit: int | None = None) -> list[BenchPrompt]:
    """Prompts in file order, keeping the first `limit` of each category (all when None)."""
    prompts: list[BenchPrompt] = []
    taken: Counter = Counter()
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                prompt = parse_record(json.loads(line), line_no)
            except (ValueError, json.JSONDecodeError) as exc:
                raise ValueError(f"{path}: {exc}") from exc
            if categories and prompt.category not in categories:
                continue
            if limit is not None and taken[prompt.category] >= limit:
                continue
            taken[prompt.category] += 1
            prompts.append(prompt)
    if categories:
        missing = [c for c in categories if c not in taken]
        if missing:
            raise ValueError(f"{path}: no prompts in categories {missing}")
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def categories_in_order(prompts: list[BenchPrompt]) -> list[str]:
    return list(dict.fromkeys(p.category for p in prompts))
