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


def _write(tmp_path, files: dict[str, list[dict]]) -> None:
    for name, records in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_question_prompts_are_the_english_questions_alone(tmp_path):
    ask = "Use the passages.\n\nPassage 1: Oxygen was found in the 1770s.\n\nQuestion: {}"
    _write(tmp_path, {
        "rag_qa/xquad_rag_qa.jsonl": [
            {"id": "xquad-rag-en-1", "messages": [{"role": "user", "content":
                ask.format("Who discovered oxygen first?\nAnswer concisely, using only the documents.")}]},
            {"id": "xquad-rag-en-2", "messages": [{"role": "user", "content": ask.format("Who discovered oxygen first?")}]},
            {"id": "xquad-rag-de-3", "messages": [{"role": "user", "content": ask.format("Wer entdeckte den Sauerstoff?")}]},
            {"id": "xquad-rag-en-4", "messages": [{"role": "user", "content": ask.format("When?")}]},
        ],
        "rag_qa/pubmedqa_rag_qa.jsonl": [
            {"id": "pubmedqa-1", "messages": [{"role": "user", "content":
                "Answer.\n\nPassage 1 (Objective): We study it.\n\nQuestion: Does vitamin C prevent pain?"}]},
        ],
    })
    out = derive.question_prompts(str(tmp_path))
    # one per distinct English question, without its passages or the instruction after it; a
    # one-word question is no question to answer from memory
    assert [r["messages"][0]["content"] for r in out["closed_book_xquad"]] == ["Who discovered oxygen first?"]
    assert [r["messages"][0]["content"] for r in out["closed_book_pubmedqa"]] == ["Does vitamin C prevent pain?"]
    for source, records in out.items():
        derive.write_jsonl(str(tmp_path / "out" / f"{source}.jsonl"), records)
    loaded = load_prompts([str(tmp_path / "out")])
    assert {c["source"] for c in loaded} == {"closed_book_xquad", "closed_book_pubmedqa"}
    assert source_info("closed_book_xquad").licence == "CC BY-SA 4.0"
    assert source_info("closed_book_pubmedqa").licence == "MIT"


def test_code_prompts_one_per_function_in_the_files_language(tmp_path):
    area = {"name": "geometry.triangle_area", "description": "Calculate the area of a triangle.",
            "parameters": {"type": "dict", "required": ["base"], "properties": {
                "base": {"type": "integer", "description": "The base."},
                "unit": {"type": "string", "description": "The unit."}}}}
    short = {"name": "f", "description": "Does it.", "parameters": {}}
    _write(tmp_path, {
        "bfcl/BFCL_v4_simple_python.json": [{"id": "p0", "question": [], "function": [area, short]},
                                            {"id": "p1", "question": [], "function": [area]}],
        "bfcl/BFCL_v4_simple_java.json": [{"id": "j0", "question": [], "function": [area]}],
        "bfcl/possible_answer/BFCL_v4_simple_python.json": [{"id": "p0", "ground_truth": []}],
    })
    out = derive.code_prompts(str(tmp_path))
    texts = [r["messages"][0]["content"] for r in out]
    # the Java file's function, then the Python one once (a repeat and a too-short description dropped)
    assert len(out) == 2
    assert "Java" in texts[0] and "Python" not in texts[0]
    assert "Python" in texts[1] and "`triangle_area`" in texts[1]
    assert "- base (integer): The base." in texts[1] and "- unit (string, optional): The unit." in texts[1]
    assert derive.code_prompts(str(tmp_path)) == out
    assert source_info("code_tasks_bfcl").licence == "Apache-2.0"


def test_summary_prompts_one_per_english_passage_as_licensed_sources(data_dir, tmp_path):
    path, para, other, abstract = data_dir
    out = derive.summary_prompts(str(path))
    # the passages of `passages` (no German, the short abstract left out), each whole in one template
    assert {s: len(r) for s, r in out.items()} == {"summaries_xquad": 2, "summaries_scitldr": 2, "summaries_pubmedqa": 1}
    texts = [r["messages"][0]["content"] for records in out.values() for r in records]
    for text, passage in zip(texts, [para, other, abstract, f"{other} More.", f"{abstract} {other}"]):
        assert passage in text and any(text == t.format(text=passage) for t in derive.SUMMARY_TEMPLATES)
    assert derive.summary_prompts(str(path)) == out   # a rerun writes the same files
    derive.write_sources(str(tmp_path / "out"), out)
    loaded = load_prompts([str(tmp_path / "out")])
    assert {c["source"] for c in loaded} == set(out)
    assert source_info("summaries_xquad").licence == "CC BY-SA 4.0"
    assert source_info("summaries_pubmedqa").licence == "MIT"
    assert source_info("summaries_scitldr").licence.startswith("Apache-2.0")


@pytest.mark.parametrize("answer, question", [
    ("What is the boiling point of water at sea level?", "What is the boiling point of water at sea level?"),
    ("Question: Who discovered oxygen?\nIt was Scheele.", "Who discovered oxygen?"),
    ('"When did the Rhine become a border?"', "When did the Rhine become a border?"),
    ("What does the passage say about oxygen?", None),   # needs the passage
    ("Oxygen was discovered in 1773.", None),            # no question
    ("Why?", None),                                      # too short to be one
    ("", None),
])
def test_clean_question(answer, question):
    assert derive.clean_question(answer) == question


def test_asks_then_trivia_prompts(data_dir, tmp_path):
    path, para, *_ = data_dir
    asks = derive.ask_prompts(str(path))
    assert len(asks) == 5 and para in asks[0]["messages"][0]["content"]
    keys = [a["id"] for a in asks]
    answers = ["Who discovered oxygen?", "Which sea does the Rhine flow into?", "who discovered oxygen?",
               "What is in this text?", "How does working memory work?"]
    out = derive.trivia_prompts(list(zip(keys, answers)))
    # the question alone, once (a repeat in other case is left out), none that needs the passage
    assert {s: [r["messages"][0]["content"] for r in records] for s, records in out.items()} == {
        "trivia_xquad": ["Who discovered oxygen?", "Which sea does the Rhine flow into?"],
        "trivia_scitldr": [], "trivia_pubmedqa": ["How does working memory work?"]}
    derive.write_sources(str(tmp_path / "out"), out)
    assert {c["source"] for c in load_prompts([str(tmp_path / "out")])} == {"trivia_xquad", "trivia_pubmedqa"}
    assert source_info("trivia_xquad").licence == "CC BY-SA 4.0"
    assert source_info("trivia_pubmedqa").licence == "MIT"


def test_second_template_set_gives_other_prompts_on_the_same_subjects():
    answers = [(f"xquad-{i:03d}", "photosynthesis") for i in range(40)]
    first, second = derive.task_prompts(answers), derive.task_prompts(answers, derive.TEMPLATES_2, "t2-")
    texts = {r["messages"][0]["content"] for r in second["xquad"]}
    assert len(second["xquad"]) == 80 and len(texts) == len(derive.TEMPLATES_2)
    assert not texts & {r["messages"][0]["content"] for r in first["xquad"]}
    assert not {r["id"] for r in second["xquad"]} & {r["id"] for r in first["xquad"]}
    assert source_info("topic_tasks2_xquad").licence == "CC BY-SA 4.0"


@pytest.mark.parametrize("answer", ["What is the answer to this question?", "What is the purpose of this study?",
                                    "What is the general-knowledge question that someone could ask a search engine?"])
def test_clean_question_drops_questions_without_a_referent(answer):
    assert derive.clean_question(answer) is None
