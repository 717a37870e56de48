"""Prompt sources for self-distillation, turned into OpenAI-shaped conversations.

Every loader returns a list of `Conversation` dicts:

    {"id": "gsm8k/17", "source": "gsm8k", "messages": [{"role": "user", "content": ...}],
     "tools": [{"type": "function", "function": {...}}] or None}

Only the prompt is kept: reference answers in the files are the original datasets' and are
ignored (the target model writes its own answers). `SOURCES` names each known source with its
licence (from /work/shared/data/SOURCES.md) so a model card can list what a drafter was trained on,
and a priority: sources with permissive data licences are distilled first, so a run stopped early
still holds them complete, and CC BY-NC sets come last.

Besides the known files, any JSON/JSONL of `{"messages": [...], "tools"?: [...]}` records is
accepted as a generic source named after the file.
"""
from __future__ import annotations

import fnmatch
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, TypedDict


class Conversation(TypedDict):
    id: str
    source: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None


@dataclass(frozen=True)
class SourceInfo:
    name: str
    licence: str
    origin: str  # upstream repository : path
    priority: int  # lower is distilled first


_BFCL_LICENCE = "Apache-2.0"
_BFCL_ORIGIN = "ShishirPatil/gorilla : berkeley-function-call-leaderboard/bfcl_eval/data/{file}"
_BFCL_FILES = (
    "simple_python", "simple_java", "simple_javascript", "multiple",
    "live_simple", "irrelevance", "live_irrelevance", "live_relevance",
)
_CC_BY_NC = "code Apache-2.0; data CC BY-NC 4.0 (repo DATA_LICENSE)"
_CC_BY_SA = "CC BY-SA 4.0"

# the English passages `whiflash train derive` makes prompts from: (origin, licence, where from)
_DERIVE_PASSAGES = [
    ("xquad", _CC_BY_SA, "google-deepmind/xquad : xquad.en.json paragraphs"),
    ("scitldr", "Apache-2.0 (repo; no separate data licence)", "allenai/scitldr : SciTLDR-A abstracts"),
    ("pubmedqa", "MIT", "pubmedqa/pubmedqa : data/ori_pqal.json contexts"),
]
SOURCES: dict[str, SourceInfo] = {
    info.name: info
    for info in [
        SourceInfo("gsm8k", "MIT", "openai/grade-school-math : train.jsonl", 0),
        SourceInfo("gpteacher_roleplay", "MIT",
                   "teknium1/GPTeacher : Roleplay/roleplay-simple-deduped-roleplay-instruct.json", 1),
        *[
            SourceInfo(f"bfcl_{name}", _BFCL_LICENCE, _BFCL_ORIGIN.format(file=f"BFCL_v4_{name}.json"), 2)
            for name in _BFCL_FILES
        ],
        SourceInfo("glaive_toolcall", "repo Apache-2.0; upstream glaiveai/glaive-function-calling-v2 Apache-2.0",
                   "hiyouga/LLaMA-Factory : data/glaive_toolcall_en_demo.json", 3),
        SourceInfo("reason_tool_use", "repo Apache-2.0 (upstream of the 50 samples not stated)",
                   "hiyouga/LLaMA-Factory : data/reason_tool_use_demo_50.jsonl", 3),
        SourceInfo("gpteacher_toolformer", "MIT",
                   "teknium1/GPTeacher : Toolformer/toolformer-dedupe-only-dataset.json", 4),
        # prompt sets built for the kinds of text Spec-Bench has and the first sets lacked
        # (translation, summarization, passage QA, multi-turn chat, turns right after a tool
        # result); one `{id, source, messages, tools?}` JSONL schema, read by `load_generic`
        *[
            SourceInfo(name, licence, origin, 1)
            for name, licence, origin in [
                ("ntrex128_translation", _CC_BY_SA, "MicrosoftTranslator/NTREX : NTREX-128/newstest2019-*"),
                ("xquad_paragraph_translation", _CC_BY_SA, "google-deepmind/xquad : xquad.*.json"),
                ("ntrex128_news_summarization", _CC_BY_SA, "MicrosoftTranslator/NTREX : NTREX-128/newstest2019-*"),
                ("qmsum_meeting_summarization",
                 "repo MIT; AMI / ICSI transcripts CC BY 4.0; Welsh Parliament committee records",
                 "Yale-LILY/QMSum : data/ALL/{train,val}/*.json"),
                ("scitldr_abstract_summarization", "Apache-2.0 (repo; no separate data licence)",
                 "allenai/scitldr : SciTLDR-Data/SciTLDR-A/train.jsonl"),
                ("xquad_wiki_summarization", _CC_BY_SA, "google-deepmind/xquad : xquad.*.json"),
                ("xquad_rag_qa", _CC_BY_SA, "google-deepmind/xquad : xquad.*.json"),
                ("pubmedqa_rag_qa", "MIT", "pubmedqa/pubmedqa : data/ori_pqal.json"),
                ("cmrc2018_rag_qa", _CC_BY_SA, "ymcui/cmrc2018 : squad-style-data/cmrc2018_dev.json"),
                ("oasst_en100_multiturn", "Apache-2.0",
                 "LAION-AI/Open-Assistant : model/model_eval/manual/data/en_100_tree.jsonl"),
                ("xquad_passage_multiturn", _CC_BY_SA, "google-deepmind/xquad : xquad.en.json"),
                ("sgd_task_multiturn", _CC_BY_SA,
                 "google-research-datasets/dstc8-schema-guided-dialogue : train/dialogues_*.json"),
                ("sgd_tool_results", _CC_BY_SA,
                 "google-research-datasets/dstc8-schema-guided-dialogue : train/dialogues_*.json, train/schema.json"),
            ]
        ],
        # prompts made from licensed English passages by `whiflash train derive` (training/derive.py):
        # writing/explaining tasks on the subjects the target named (two template sets), summaries
        # of the passages, and questions the target wrote on their subjects; each carries its
        # passages' licence
        *[
            SourceInfo(f"{kind}_{origin}", licence, f"whiflash train derive, {what} {passages}", 1)
            for kind, what in [("topic_tasks", "subjects of"), ("topic_tasks2", "subjects of"),
                               ("summaries", "summaries of"), ("trivia", "questions on the subjects of")]
            for origin, licence, passages in _DERIVE_PASSAGES
        ],
        # closed-book questions and code-writing tasks (training/derive.py), with their sets' licences
        *[
            SourceInfo(name, licence, f"whiflash train derive, {origin}", 1)
            for name, licence, origin in [
                ("closed_book_xquad", _CC_BY_SA, "the English questions of google-deepmind/xquad : xquad.en.json"),
                ("closed_book_pubmedqa", "MIT", "the questions of pubmedqa/pubmedqa : data/ori_pqal.json"),
                ("code_tasks_bfcl", "Apache-2.0",
                 "the function specs of ShishirPatil/gorilla : berkeley-function-call-leaderboard BFCL_v4_*.json"),
            ]
        ],
        # user requests the target wrote itself (training/magpie.py): its own text, its licence
        SourceInfo("magpie_smollm2", "Apache-2.0 (written by SmolLM2-135M-Instruct, Apache-2.0)",
                   "whiflash train derive --step magpie: sampled after the chat template's user-turn prefix", 1),
        SourceInfo("alpaca_en_demo",
                   "repo Apache-2.0; content appears to be Alpaca-GPT4 data (upstream CC BY-NC 4.0)",
                   "hiyouga/LLaMA-Factory : data/alpaca_en_demo.json", 5),
        SourceInfo("alpaca_seed_tasks", _CC_BY_NC, "tatsu-lab/stanford_alpaca : seed_tasks.jsonl", 8),
        SourceInfo("code_alpaca_2k", _CC_BY_NC, "sahil280114/codealpaca : code_alpaca_2k.json", 9),
        SourceInfo("new_codealpaca", _CC_BY_NC, "sahil280114/codealpaca : new_codealpaca.json", 9),
    ]
}

GENERIC_PRIORITY = 6  # user-supplied sets: after the permissive ones, before CC BY-NC
GENERIC_LICENCE = "unknown (user-supplied file)"


def source_info(name: str) -> SourceInfo:
    """Licence and priority of a source; generic files get an 'unknown' licence."""
    return SOURCES.get(name) or SourceInfo(name, GENERIC_LICENCE, "user-supplied", GENERIC_PRIORITY)


# --------------------------------------------------------------------------- file reading

def read_records(path: str) -> list[dict[str, Any]]:
    """A JSON array, a single JSON object, or JSON lines (BFCL files are JSONL despite `.json`)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return data if isinstance(data, list) else [data]


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _instruction_text(instruction: str, extra: str | None) -> str:
    """Alpaca convention: the optional input follows the instruction after a blank line."""
    instruction = instruction.strip()
    extra = (extra or "").strip()
    return f"{instruction}\n\n{extra}" if extra else instruction


# --------------------------------------------------------------------------- tool schemas

# BFCL writes parameter types in Python/Java/JS terms; OpenAI tools use JSON Schema. Same table
# as BFCL's own OpenAI handler, plus the Python spellings used by the reason_tool_use set.
_JSON_SCHEMA_TYPES = {
    "dict": "object", "HashMap": "object", "Hashtable": "object",
    "float": "number", "double": "number",
    "int": "integer", "byte": "integer", "short": "integer", "long": "integer", "Bigint": "integer",
    "str": "string", "String": "string", "char": "string", "any": "string", "Any": "string",
    "bool": "boolean", "Boolean": "boolean",
    "list": "array", "tuple": "array", "ArrayList": "array", "Array": "array",
    "Queue": "array", "Stack": "array",
}


def normalize_schema(node: Any) -> Any:
    """Copy of a JSON-schema-like tree with non-JSON-Schema `type` names mapped (dict -> object)."""
    if isinstance(node, list):
        return [normalize_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "type" and isinstance(value, str):
            out[key] = _JSON_SCHEMA_TYPES.get(value, value)
        else:
            out[key] = normalize_schema(value)
    return out


def openai_tool(fn: dict[str, Any]) -> dict[str, Any]:
    """A bare function description or an OpenAI tool, as an OpenAI tool with a JSON-Schema body."""
    if fn.get("type") == "function" and "function" in fn:
        fn = fn["function"]
    fn = dict(fn)
    if "parameters" in fn:
        fn["parameters"] = normalize_schema(fn["parameters"])
    return {"type": "function", "function": fn}


def _tools(raw: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    return [openai_tool(t) for t in raw] if raw else None


def _prompt_prefix(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation before the first assistant turn (the target writes that turn itself)."""
    for i, m in enumerate(messages):
        if m.get("role") == "assistant":
            return messages[:i]
    return messages


# --------------------------------------------------------------------------- per-format loaders

Loader = Callable[[str, str], Iterator[Conversation]]


def _conv(source: str, key: Any, messages: list[dict[str, Any]],
          tools: list[dict[str, Any]] | None = None) -> Conversation:
    return {"id": f"{source}/{key}", "source": source, "messages": messages, "tools": tools}


def load_alpaca(path: str, source: str) -> Iterator[Conversation]:
    """Alpaca-style `{instruction, input, output|response}` (alpaca, code alpaca, GPTeacher)."""
    for i, r in enumerate(read_records(path)):
        text = _instruction_text(r.get("instruction", ""), r.get("input"))
        if text:
            yield _conv(source, i, _user(text))


def load_seed_tasks(path: str, source: str) -> Iterator[Conversation]:
    """Self-instruct seed tasks: instruction plus the input of the first instance."""
    for r in read_records(path):
        instances = r.get("instances") or [{}]
        yield _conv(source, r["id"], _user(_instruction_text(r["instruction"], instances[0].get("input"))))


def load_gsm8k(path: str, source: str) -> Iterator[Conversation]:
    for i, r in enumerate(read_records(path)):
        yield _conv(source, i, _user(r["question"].strip()))


def load_bfcl(path: str, source: str) -> Iterator[Conversation]:
    """BFCL question files: `question` is a list of turns; only the first turn is a prompt
    we can answer without the model's earlier replies."""
    for r in read_records(path):
        turns = r.get("question") or []
        if turns and turns[0]:
            yield _conv(source, r["id"], list(turns[0]), _tools(r.get("function")))


def load_openai_first_turn(path: str, source: str) -> Iterator[Conversation]:
    """OpenAI-shaped tool-calling conversations, cut before the first assistant turn."""
    for i, r in enumerate(read_records(path)):
        messages = _prompt_prefix(r["messages"])
        if messages:
            yield _conv(source, r.get("id", i), messages, _tools(r.get("tools")))


def load_generic(path: str, source: str) -> Iterator[Conversation]:
    """`{"messages": [...], "tools"?: [...], "id"?: ...}` records; trailing assistant turns are
    dropped so the prompt ends where the model should answer."""
    for i, r in enumerate(read_records(path)):
        if "messages" not in r:
            raise ValueError(f"{path}: record {i} has no 'messages'")
        messages = list(r["messages"])
        while messages and messages[-1].get("role") == "assistant":
            messages.pop()
        if messages:
            yield _conv(source, r.get("id", i), messages, _tools(r.get("tools")))


# file name pattern -> (source name or None to derive it, loader)
_KNOWN_FILES: list[tuple[str, str | None, Loader]] = [
    ("alpaca_en_demo_1k.json", "alpaca_en_demo", load_alpaca),
    ("alpaca_seed_tasks.jsonl", "alpaca_seed_tasks", load_seed_tasks),
    ("code_alpaca_2k.json", "code_alpaca_2k", load_alpaca),
    ("new_codealpaca.json", "new_codealpaca", load_alpaca),
    ("gpteacher_roleplay.json", "gpteacher_roleplay", load_alpaca),
    ("gpteacher_toolformer.json", "gpteacher_toolformer", load_alpaca),
    ("gsm8k_train.jsonl", "gsm8k", load_gsm8k),
    ("glaive_toolcall_en_demo.openai.jsonl", "glaive_toolcall", load_openai_first_turn),
    ("reason_tool_use_demo_50.openai.jsonl", "reason_tool_use", load_openai_first_turn),
    ("BFCL_v4_*.json", None, load_bfcl),
]


def _resolve(path: str) -> tuple[str, Loader]:
    base = os.path.basename(path)
    for pattern, source, loader in _KNOWN_FILES:
        if fnmatch.fnmatchcase(base, pattern):
            if source is None:  # BFCL_v4_simple_python.json -> bfcl_simple_python
                source = "bfcl_" + base[len("BFCL_v4_"):].rsplit(".", 1)[0].lower()
            return source, loader
    stem = base.split(".", 1)[0]
    return stem, load_generic


def _expand(paths: Iterable[str]) -> Iterator[tuple[str, bool]]:
    """Files under `paths` as (file, named_explicitly); BFCL `possible_answer/` folders hold
    answers, not prompts, and are skipped."""
    for path in paths:
        if os.path.isdir(path):
            for root, dirs, files in os.walk(path):
                dirs[:] = sorted(d for d in dirs if d != "possible_answer" and not d.startswith("."))
                for name in sorted(files):
                    if name.endswith((".json", ".jsonl")):
                        yield os.path.join(root, name), False
        elif os.path.exists(path):
            yield path, True
        else:
            raise FileNotFoundError(path)


def load_file(path: str) -> list[Conversation]:
    source, loader = _resolve(path)
    return list(loader(path, source))


def load_prompts(paths: Iterable[str]) -> list[Conversation]:
    """All conversations from files and directories (recursively), ordered by source priority.

    Unrecognised files found inside a directory are skipped with a warning when they are not
    generic `messages` records; a file named explicitly must load.
    """
    conversations: list[Conversation] = []
    seen_files: set[str] = set()
    for path, explicit in _expand(paths):
        real = os.path.realpath(path)
        if real in seen_files:
            continue
        seen_files.add(real)
        try:
            conversations.extend(load_file(path))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            if explicit:
                raise
            print(f"skipping {path}: not a known prompt source ({exc})", file=sys.stderr)
    # stable sort: file order is kept inside a priority level
    conversations.sort(key=lambda c: source_info(c["source"]).priority)
    return conversations
