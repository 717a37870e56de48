"""`whiflash train derive`: prompts for kinds of text no prompt set has, made in two steps from
English passages of the licensed sets, by the target itself.

Why: the prompt sets cover maths, tools, translation, summaries, passage QA and chat, but not
open-ended writing and explanations (Spec-Bench's writing, stem and humanities categories, where
EAGLE-3 accepts least), and the sets that have them are CC BY-NC (Alpaca). Their subjects can
still come from licensed text:

    1. `derive --step topics`: one prompt per distinct English passage (XQuAD paragraphs, SciTLDR
       abstracts, PubMedQA contexts) asking the target for the passage's subject in a few words;
       `whiflash train distill` answers them (greedy: --sample-frac 0).
    2. `derive --step tasks`: each answered subject, cleaned (`clean_topic`), goes into TASKS_PER_TOPIC
       of the TEMPLATES (writing: a blog post, a story, a letter...; explaining: simple terms,
       history, arguments for and against...), chosen by a hash of the passage id, so a rerun
       writes the same file. `whiflash train distill` answers those: the training data.
       `derive --step tasks2` does the same with TEMPLATES_2 (emails, outlines, dialogues, role-play,
       lists, reports...): topic_tasks2_xquad, topic_tasks2_scitldr, topic_tasks2_pubmedqa.

    whiflash train derive --step topics --data ../shared/data/train --out datasets/prompts/passage_topics.jsonl
    whiflash train distill --prompts datasets/prompts/passage_topics.jsonl --out datasets/smollm2-topics \\
        --sample-frac 0 --val-per-source 0 --max-new-tokens 24 --max-prompt-tokens 1024
    whiflash train derive --step tasks --topics datasets/smollm2-topics --out datasets/prompts
    whiflash train distill --prompts datasets/prompts/topic_tasks_xquad.jsonl ... --out datasets/smollm2-distill-r3

The task files are named per passage origin (topic_tasks_xquad, topic_tasks_scitldr,
topic_tasks_pubmedqa): each is a source of its own with its origin's licence (prompts.SOURCES).
No prompt of Spec-Bench is read; the templates are this file's own wording.

Two more kinds, in one step each, straight from the prompt sets (no target answer needed first):

    `derive --step questions`: closed-book questions (Spec-Bench's qa is Natural Questions asked
       without a passage), the English questions of the passage-QA sets without their passages:
       closed_book_xquad (CC BY-SA 4.0), closed_book_pubmedqa (MIT).
    `derive --step code`: code-writing tasks (Spec-Bench's coding asks for programs; the code sets
       are CC BY-NC), one per distinct function the BFCL files specify, in the file's language, in
       one of CODE_TEMPLATES: code_tasks_bfcl (Apache-2.0).

    whiflash train derive --step questions --out datasets/prompts
    whiflash train derive --step code --out datasets/prompts
    whiflash train distill --prompts datasets/prompts/closed_book_xquad.jsonl ... --out datasets/smollm2-distill-r4

    `derive --step summaries`: English-to-English summaries of whole passages (Spec-Bench's
       summarization, where EAGLE-3 accepts least, asks for them; the summary sets mostly summarize
       from another language or ask for a headline), one per distinct English passage (the passages
       of step 1) in one of SUMMARY_TEMPLATES: summaries_xquad, summaries_scitldr, summaries_pubmedqa.

    whiflash train derive --step summaries --out datasets/prompts

And short general-knowledge questions (Spec-Bench's qa asks search-engine questions; the
closed-book sets' questions are about details of their passages), in two steps like the tasks:

    1. `derive --step asks`: per distinct English passage, the target is asked for one question
       about the passage's subject that needs no passage (ASK_QUESTION); distill answers them.
    2. `derive --step trivia --topics DISTILLED`: each answer that is one question (`clean_question`)
       becomes a prompt of its own: trivia_xquad, trivia_scitldr, trivia_pubmedqa.

    whiflash train derive --step asks --out datasets/prompts/passage_asks.jsonl
    whiflash train distill --prompts datasets/prompts/passage_asks.jsonl --out datasets/smollm2-asks \
        --sample-frac 0 --val-per-source 0 --max-new-tokens 40 --max-prompt-tokens 1024
    whiflash train derive --step trivia --topics datasets/smollm2-asks --out datasets/prompts
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Iterator

from whiflash_core.cli_args import add_arguments, from_args, setting
from whiflash_core.training.prompts import read_records

# passage origin -> the prompt-set files under --data that hold its English passages
ORIGINS = {
    "xquad": ("multiturn/xquad_passage_multiturn.jsonl", "rag_qa/xquad_rag_qa.jsonl"),
    "scitldr": ("summarization/scitldr_abstract_summarization.jsonl",),
    "pubmedqa": ("rag_qa/pubmedqa_rag_qa.jsonl",),
}
TOPIC_QUESTION = ("Here is a passage.\n\n{passage}\n\nWhat is the general subject of this passage, in at most "
                  "six words? Reply with the subject only.")
TEMPLATES = (
    "Write a blog post about {topic}.",
    "Write a short story that involves {topic}.",
    "Write a persuasive essay about {topic}.",
    "Write a letter to a friend about {topic}.",
    "Write a poem about {topic}.",
    "Explain {topic} in simple terms.",
    "What should everyone know about {topic}? Answer in a few paragraphs.",
    "Describe the history and the importance of {topic}.",
    "What are the main arguments for and against {topic}?",
    "How does {topic} affect everyday life? Give examples.",
)
# `derive --step tasks2`: a second set on the same subjects (topic_tasks2_*), the kinds of request
# the first set lacks: emails, outlines, dialogues, role-play, lists, comparisons, reports, advice
TEMPLATES_2 = (
    "Write a professional email to a colleague about {topic}.",
    "Write an outline for a presentation on {topic}, with headings and key points.",
    "Imagine you are an expert on {topic}. Answer a curious student's questions about it, in character.",
    "Write a short dialogue between two friends who disagree about {topic}.",
    "List five interesting facts about {topic}, with a sentence on each.",
    "Compare two different views on {topic} and say which one you find more convincing.",
    "Write an advertisement for a product or service related to {topic}.",
    "Explain {topic} to a ten-year-old.",
    "Write a news report about a recent development in {topic}.",
    "Give step-by-step advice to someone who wants to learn about {topic}.",
)
TASKS_PER_TOPIC = 2   # pick_templates keeps two distinct; more would need a step coprime with len(templates)
MAX_TOPIC_WORDS = 8


@dataclass
class Passage:
    origin: str
    key: str
    text: str


def _other_language(origin: str, record: dict) -> bool:
    """An XQuAD record in a language other than English (its id names the language)."""
    return origin == "xquad" and "-en-" not in record.get("id", "")


_PASSAGE = re.compile(r"^Passage \d+( \([^)]*\))?:\s*")


def _passages_of(origin: str, record: dict) -> list[str]:
    """The English passage(s) of one prompt record of `origin`."""
    text = record["messages"][0]["content"]
    if origin == "scitldr":
        # the instruction comes before or after the abstract: the abstract is the longest block
        blocks = [re.sub(r"^Abstract:\s*", "", b.strip()) for b in text.split("\n\n")]
        return [max(blocks, key=len)]
    if _other_language(origin, record):
        return []
    blocks = [b.strip() for b in text.split("\n\n")]
    passages = [_PASSAGE.sub("", b) for b in blocks if _PASSAGE.match(b)]
    if origin == "pubmedqa":   # the sections of one abstract: one passage
        return [" ".join(passages)] if passages else []
    return passages or [blocks[0]]   # XQuAD: "Passage N:" paragraphs, or the paragraph a chat opens with


def passages(data_dir: str) -> Iterator[Passage]:
    """Every distinct English passage of the ORIGINS sets under `data_dir` (30 words or more), in
    file order, keyed by a hash of its text."""
    seen: set[str] = set()
    for origin, paths in ORIGINS.items():
        for path in paths:
            for record in read_records(os.path.join(data_dir, path)):
                for text in _passages_of(origin, record):
                    digest = hashlib.sha1(text.encode()).hexdigest()[:12]
                    if len(text.split()) >= 30 and digest not in seen:
                        seen.add(digest)
                        yield Passage(origin, digest, text)


def topic_prompts(data_dir: str) -> list[dict]:
    """Step 1's prompt records ({id, messages}); the id keeps the passage's origin."""
    return [{"id": f"{p.origin}-{p.key}", "messages": [{"role": "user", "content": TOPIC_QUESTION.format(passage=p.text)}]}
            for p in passages(data_dir)]


def clean_topic(answer: str) -> str | None:
    """The target's answer to TOPIC_QUESTION as a noun phrase to put in a template, or None when
    it is not one (empty, too long, a sentence of its own)."""
    line = answer.strip().split("\n")[0].strip()
    line = re.sub(r"^(the )?(general )?(subject|topic)( of (this|the) passage)?( is|:)\s*", "", line, flags=re.I)
    line = line.strip(" \"'*.:").strip()
    words = line.split()
    if not 1 <= len(words) <= MAX_TOPIC_WORDS or not re.search(r"[A-Za-z]", line) or '"' in line:
        # a quote left inside: several quoted phrases or a sentence after one (`X" and it is ...`)
        return None
    if len(words) > 1 and words[0][:1].isupper() and not words[0].isupper() and not words[1][:1].isupper():
        line = line[0].lower() + line[1:]   # "Climate change" -> "climate change"; "NASA", "Paris" stay
    return line


def pick_templates(key: str, n: int = TASKS_PER_TOPIC, templates: tuple[str, ...] = TEMPLATES) -> list[str]:
    """n distinct templates for a passage id, the same on every run (a hash, not a random draw)."""
    h = int(hashlib.sha1(key.encode()).hexdigest(), 16)
    first = h % len(templates)
    step = 1 + (h // len(templates)) % (len(templates) - 1)   # 1..9: the first two always differ
    return [templates[(first + i * step) % len(templates)] for i in range(n)]


def task_prompts(topics: list[tuple[str, str]], templates: tuple[str, ...] = TEMPLATES,
                 tag: str = "") -> dict[str, list[dict]]:
    """Step 2's prompt records per origin from (passage id, target's answer) pairs; answers that
    are no topic are left out. `tag` goes into the ids (another template set's ids must differ)."""
    out: dict[str, list[dict]] = {origin: [] for origin in ORIGINS}
    for key, answer in topics:
        topic = clean_topic(answer)
        origin = key.split("-", 1)[0]
        if topic is None or origin not in out:
            continue
        for i, template in enumerate(pick_templates(key, templates=templates)):
            out[origin].append({"id": f"{key}-{tag}{i}", "messages": [{"role": "user", "content": template.format(topic=topic)}]})
    return out


ASK_QUESTION = ("Here is a passage.\n\n{passage}\n\nWrite one short general-knowledge question about the subject "
                "of this passage that someone could ask a search engine, answerable without the passage. "
                "Reply with the question only.")
MAX_QUESTION_WORDS = 25


def ask_prompts(data_dir: str) -> list[dict]:
    """Step 1 of the trivia questions: one ASK_QUESTION prompt per distinct English passage."""
    return [{"id": f"{p.origin}-a-{p.key}", "messages": [{"role": "user", "content": ASK_QUESTION.format(passage=p.text)}]}
            for p in passages(data_dir)]


def clean_question(answer: str) -> str | None:
    """The target's answer to ASK_QUESTION as one question, or None when it is not one (no question
    mark on its first line, too short or too long, or no referent without the passage: _NO_REFERENT)."""
    line = answer.strip().split("\n")[0].strip()
    line = re.sub(r"^(question:\s*|\*\*question:?\*\*:?\s*|q:\s*)", "", line, flags=re.I).strip(" \"'*")
    words = line.split()
    if not line.endswith("?") or not 3 <= len(words) <= MAX_QUESTION_WORDS or _NO_REFERENT.search(line):
        return None
    return line


# a question about the prompt itself ("What is the answer to this question?", "... a search engine
# could answer?") or about a text the asker no longer has ("the passage", "this study")
_NO_REFERENT = re.compile(r"\b(passage|text|article|search engine|general.knowledge)\b|"
                          r"\b(this|the) (question|study|paper|abstract)\b", re.I)


def trivia_prompts(asked: list[tuple[str, str]]) -> dict[str, list[dict]]:
    """Step 2's prompt records per origin from (passage id, target's answer) pairs: the question
    alone; answers that are no question, and repeated questions, are left out."""
    out: dict[str, list[dict]] = {f"trivia_{origin}": [] for origin in ORIGINS}
    seen: set[str] = set()
    for key, answer in asked:
        question = clean_question(answer)
        source = f"trivia_{key.split('-', 1)[0]}"
        if question is None or source not in out or question.lower() in seen:
            continue
        seen.add(question.lower())
        out[source].append({"id": f"{key}-t", "messages": [{"role": "user", "content": question}]})
    return out


def answered_topics(distilled_dir: str) -> list[tuple[str, str]]:
    """(passage id, decoded answer) of every prompt of a distilled step-1 directory (both splits)."""
    from whiflash_core.loading import load_hf_model
    from whiflash_core.training.distill import load_distilled

    tokenizer = load_hf_model(None)[1]   # the embedded target's (the distiller's) tokenizer
    out = []
    for split in ("train", "val"):
        for s in load_distilled(distilled_dir, split):
            out.append((s["id"].split("/", 1)[1], tokenizer.decode(s["response_ids"].tolist(), skip_special_tokens=True)))
    return out


# --------------------------------------------------------------------------- closed-book questions

# passage-QA set -> (its prompt file under --data, the closed-book source it becomes)
QUESTION_SETS = {"xquad": ("rag_qa/xquad_rag_qa.jsonl", "closed_book_xquad"),
                 "pubmedqa": ("rag_qa/pubmedqa_rag_qa.jsonl", "closed_book_pubmedqa")}
_QUESTION = re.compile(r"\n\nQuestion:\s*(.+?)\s*$", re.S)


def question_prompts(data_dir: str) -> dict[str, list[dict]]:
    """Per closed-book source, one prompt per distinct English question of its passage-QA set: the
    question alone (its first line: the sets add an instruction after it), in file order."""
    out: dict[str, list[dict]] = {}
    for origin, (path, source) in QUESTION_SETS.items():
        seen: set[str] = set()
        out[source] = []
        for record in read_records(os.path.join(data_dir, path)):
            if _other_language(origin, record):
                continue
            m = _QUESTION.search(record["messages"][0]["content"])
            question = m.group(1).split("\n")[0].strip() if m else ""
            if len(question.split()) >= 3 and question not in seen:
                seen.add(question)
                key = hashlib.sha1(question.encode()).hexdigest()[:12]
                out[source].append({"id": f"{origin}-q-{key}", "messages": [{"role": "user", "content": question}]})
    return out


# --------------------------------------------------------------------------- code-writing tasks

BFCL_LANGUAGES = {"java": "Java", "javascript": "JavaScript"}   # any other BFCL file: Python
CODE_TEMPLATES = (
    "Write a {language} function named `{name}` that does the following: {description}\nParameters:\n{params}",
    "Implement `{name}` in {language}. {description}\nParameters:\n{params}\nExplain briefly how your code works.",
    "Write {language} code for a function `{name}`. {description}\nParameters:\n{params}\n"
    "Include an example of calling it.",
)


def _param_lines(parameters: dict) -> str:
    props = (parameters or {}).get("properties") or {}
    required = set((parameters or {}).get("required") or [])
    lines = []
    for pname, spec in props.items():
        spec = spec if isinstance(spec, dict) else {}
        kind = spec.get("type", "any")
        note = "" if pname in required else ", optional"
        lines.append(f"- {pname} ({kind}{note}): {str(spec.get('description', '')).strip()}".rstrip(": "))
    return "\n".join(lines) or "- none"


def code_prompts(data_dir: str) -> list[dict]:
    """One code-writing prompt per distinct (language, function name) of the BFCL question files
    under data_dir/bfcl, in file order; the template is chosen by a hash of the name."""
    out, seen = [], set()
    bfcl = os.path.join(data_dir, "bfcl")
    for file in sorted(os.listdir(bfcl)):
        if not (file.startswith("BFCL_v4_") and file.endswith(".json")):
            continue
        category = file[len("BFCL_v4_"):-len(".json")]
        language = next((v for k, v in BFCL_LANGUAGES.items() if category.endswith(k)), "Python")
        for record in read_records(os.path.join(bfcl, file)):
            for fn in record.get("function") or []:
                name = re.sub(r"\W", "_", str(fn.get("name", "")).split(".")[-1])
                description = str(fn.get("description", "")).strip()
                if not name or len(description.split()) < 3 or (language, name) in seen:
                    continue
                seen.add((language, name))
                key = hashlib.sha1(f"{language}/{name}".encode()).hexdigest()[:12]
                template = CODE_TEMPLATES[int(key, 16) % len(CODE_TEMPLATES)]
                text = template.format(language=language, name=name, description=description,
                                       params=_param_lines(fn.get("parameters")))
                out.append({"id": f"bfcl-code-{key}", "messages": [{"role": "user", "content": text}]})
    return out


# --------------------------------------------------------------------------- summaries

SUMMARY_TEMPLATES = (
    "Summarize the following text.\n\n{text}",
    "{text}\n\nSummarize the passage above in a few sentences.",
    "Write a concise summary of this passage:\n\n{text}",
    "Read the text below and sum up its main points.\n\n{text}",
    "Give a two- or three-sentence summary of the following.\n\n{text}",
    "{text}\n\nWhat is this passage about? Summarize it briefly.",
)


def summary_prompts(data_dir: str) -> dict[str, list[dict]]:
    """Per origin, one summarization prompt per distinct English passage (`passages`), the template
    chosen by a hash of the passage id, so a rerun writes the same files."""
    out: dict[str, list[dict]] = {f"summaries_{origin}": [] for origin in ORIGINS}
    for p in passages(data_dir):
        template = SUMMARY_TEMPLATES[int(p.key, 16) % len(SUMMARY_TEMPLATES)]
        out[f"summaries_{p.origin}"].append({"id": f"{p.origin}-s-{p.key}",
                                             "messages": [{"role": "user", "content": template.format(text=p.text)}]})
    return out


def write_sources(out_dir: str, files: dict[str, list[dict]]) -> None:
    """Each source's prompt records to out_dir/<source>.jsonl (the file name is the source name)."""
    for source, records in files.items():
        path = os.path.join(out_dir, f"{source}.jsonl")
        write_jsonl(path, records)
        print(f"wrote {len(records)} prompts to {path}")


def write_jsonl(path: str, records: list[dict]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------- CLI

@dataclass
class DeriveSettings:
    step: str = setting(help="topics: step 1's prompts from passages; tasks: step 2's from answered topics; "
                             "questions: closed-book questions; code: code-writing tasks from BFCL functions; "
                             "summaries: summaries of the English passages; asks: step 1 of trivia questions (the target "
                             "writes them); trivia: step 2, the questions from the answered asks; tasks2: step 2 "
                             "of the topics with the second template set; magpie: user requests the target writes itself "
                             "(training/magpie.py)",
                        choices=["topics", "tasks", "tasks2", "questions", "code", "summaries", "asks", "trivia", "magpie"])
    out: str = setting(help="topics, asks, magpie: the JSONL to write (magpie: appended to, and its name is the "
                            "source's: magpie_smollm2.jsonl); the other steps: the directory for their JSONL files")
    data: str = setting("../shared/data/train", "topics, asks, questions, code, summaries: the prompt sets' directory")
    topics: str | None = setting(None, "tasks, tasks2, trivia: the distilled directory of step 1's answers")
    count: int = setting(2000, "magpie: requests the file should hold")
    seed: int = setting(0, "magpie: sampling seed (per batch)")
    bench: str = setting("../shared/data/bench/spec_bench.jsonl",
                         "magpie: benchmark prompts no request may share a run of words with")
    threads: int = setting(1, "magpie: torch threads")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("derive", help="prompts for open-ended writing, derived from licensed passages",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, DeriveSettings)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    s = from_args(DeriveSettings, args)
    if s.step == "magpie":
        from whiflash_core.training.magpie import write_magpie

        print(f"{s.out} holds {write_magpie(s.out, s.count, s.seed, bench=s.bench, threads=s.threads)} requests")
        return 0
    if s.step in ("topics", "asks"):
        records = topic_prompts(s.data) if s.step == "topics" else ask_prompts(s.data)
        write_jsonl(s.out, records)
        print(f"wrote {len(records)} {s.step} prompts to {s.out}")
        return 0
    if s.step in ("questions", "code", "summaries"):
        files = {"questions": lambda: question_prompts(s.data), "summaries": lambda: summary_prompts(s.data),
                 "code": lambda: {"code_tasks_bfcl": code_prompts(s.data)}}[s.step]()
        write_sources(s.out, files)
        return 0
    if not s.topics:
        raise SystemExit(f"derive {s.step} needs --topics (the distilled answers of step 1)")
    if s.step == "trivia":
        write_sources(s.out, trivia_prompts(answered_topics(s.topics)))
        return 0
    templates, tag, kind = (TEMPLATES_2, "t2-", "topic_tasks2") if s.step == "tasks2" else (TEMPLATES, "", "topic_tasks")
    write_sources(s.out, {f"{kind}_{origin}": records
                          for origin, records in task_prompts(answered_topics(s.topics), templates, tag).items()})
    return 0
