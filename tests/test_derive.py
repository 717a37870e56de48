"""`whiflash train derive`: passages -> topic prompts -> writing/explaining prompts (training/derive.py)."""
from __future__ import annotations

import json

import pytest

from whiflash_core.training import derive
from whiflash_core.training.prompts import load_prompts, source_info


@pytest.fixture()
def data_dir(tmp_path):
    """A miniature of the shared prompt sets: the three files derive reads, in their own formats."""
    para = " ".join(["Oxygen was discovered independently by Scheele and Priestley in the 1770s."] * 4)
    other = " ".join(["The Rhine flows from the Swiss Alps to the North Sea through six countries."] * 4)
    abstract = " ".join(["We study working memory models built from recurrent networks of neurons."] * 4)
    files = {
        "multiturn/xquad_passage_multiturn.jsonl": [
            {"id": "xquad-conv-en-a1", "messages": [{"role": "user", "content": f"{para}\n\nWho found it?"}]},
            {"id": "xquad-conv-de-a1", "messages": [{"role": "user", "content": "Sauerstoff wurde ... " * 20}]},
        ],
        "rag_qa/xquad_rag_qa.jsonl": [
            {"id": "xquad-rag-en-1", "messages": [{"role": "user", "content":
                f"Use the passages.\n\nPassage 1: {para}\n\nPassage 2: {other}\n\nQuestion: who?"}]},
        ],
        "summarization/scitldr_abstract_summarization.jsonl": [
            {"id": "scitldr-1", "messages": [{"role": "user", "content": f"Abstract:\n{abstract}\n\nSummarize it."}]},
            {"id": "scitldr-2", "messages": [{"role": "user", "content": "Abstract:\nToo short to ask about."}]},
            {"id": "scitldr-3", "messages": [{"role": "user", "content": f"Summarize this for anyone.\n\n{other} More."}]},
        ],
        "rag_qa/pubmedqa_rag_qa.jsonl": [
            {"id": "pubmedqa-1", "messages": [{"role": "user", "content":
                f"Answer.\n\nPassage 1 (Objective): {abstract}\n\nPassage 2 (Methods): {other}\n\nQuestion: does it?"}]},
        ],
    }
    for name, records in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return tmp_path, para, other, abstract


def test_passages_are_the_distinct_english_ones(data_dir):
    path, para, other, abstract = data_dir
    found = [(p.origin, p.text) for p in derive.passages(str(path))]
    # XQuAD: the chat's opening paragraph once (the RAG record repeats it), the RAG's second
    # passage, no German; SciTLDR: the long abstracts, with the instruction after or before them;
    # PubMedQA: its sections as one passage
    assert found == [("xquad", para), ("xquad", other), ("scitldr", abstract), ("scitldr", f"{other} More."),
                     ("pubmedqa", f"{abstract} {other}")]
    prompts = derive.topic_prompts(str(path))
    assert len(prompts) == 5 and all(p["id"].startswith(("xquad-", "scitldr-", "pubmedqa-")) for p in prompts)
    assert para in prompts[0]["messages"][0]["content"]


@pytest.mark.parametrize("answer, topic", [
    ("Climate change", "climate change"),
    ("The subject of this passage is the history of oxygen.", "the history of oxygen"),
    ("Topic: NASA missions\nMore text here", "NASA missions"),
    ('"Paris"', "Paris"),
    ("", None),
    ("This passage talks about many different things that happen in the world every day", None),
    ("1234", None),
    ('Fort Duquesne" and it is a fictional story', None),
])
def test_clean_topic(answer, topic):
    assert derive.clean_topic(answer) == topic


def test_task_prompts_two_distinct_templates_per_topic_the_same_every_run():
    answers = [(f"xquad-{i:03d}", "photosynthesis") for i in range(40)] + [("scitldr-x", "working memory"),
                                                                            ("pubmedqa-y", ""), ("other-z", "a")]
    out = derive.task_prompts(answers)
    assert len(out["xquad"]) == 80 and len(out["scitldr"]) == 2 and out["pubmedqa"] == []
    texts = [r["messages"][0]["content"] for r in out["xquad"]]
    assert all(texts[i] != texts[i + 1] for i in range(0, 80, 2))
    assert len(set(texts)) == len(derive.TEMPLATES)   # 40 topics reach every template
    assert all("photosynthesis" in t for t in texts)
    assert derive.task_prompts(answers) == out


def test_task_files_load_as_licensed_sources(tmp_path):
    out = derive.task_prompts([("xquad-1", "rivers"), ("pubmedqa-2", "hearing loss")])
    for origin, records in out.items():
        derive.write_jsonl(str(tmp_path / f"topic_tasks_{origin}.jsonl"), records)
    loaded = load_prompts([str(tmp_path)])
    assert {c["source"] for c in loaded} == {"topic_tasks_xquad", "topic_tasks_pubmedqa"}
    assert source_info("topic_tasks_xquad").licence == "CC BY-SA 4.0"
    assert source_info("topic_tasks_pubmedqa").licence == "MIT"
    assert source_info("topic_tasks_scitldr").licence.startswith("Apache-2.0")
