"""`whiflash bench`: statistics, workload parsing, the HTTP client, and one fast end-to-end run."""
from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from whiflash_core.bench.report import category_rows, markdown_table, overall_rows, router_cell, text_table
from whiflash_core.bench.runners import HttpRunner, cut_at_stop
from whiflash_core.bench.stats import (ALL, PromptRecord, RunResult, agreement, collapse_repeats, matching_prefix,
                                       mismatches, summarize)
from whiflash_core.bench.workload import BenchPrompt, categories_in_order, load_workload

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(method, tokens, e2e, decode, rounds=None, times=None, switches=0, **extra) -> RunResult:
    return RunResult(method, len(tokens), e2e, decode, tokens=list(tokens), rounds=rounds,
                     times=times or {}, switches=switches, extra=extra)


# -- statistics -------------------------------------------------------------------------------


def test_matching_prefix_and_agreement():
    assert matching_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert matching_prefix([], [1]) == 0
    ref = run("none", [1, 2, 3, 4], 1, 1)
    assert agreement(run("eagle3", [1, 2, 3, 4], 1, 1), ref) == (True, 1.0, None, "tokens")
    assert agreement(run("eagle3", [1, 2, 9, 9], 1, 1), ref) == (False, 0.5, 2, "tokens")
    # a shorter output that is a prefix still differs; the fraction is over the longer one
    assert agreement(run("eagle3", [1, 2], 1, 1), ref) == (False, 0.5, 2, "tokens")
    # without token ids (HTTP without trace) the text is compared
    a = RunResult("dflash", 2, 1, 1, text="abcd")
    b = RunResult("none", 2, 1, 1, text="abXd")
    assert agreement(a, b) == (False, 0.5, 2, "chars")
    empty = RunResult("none", 0, 1, 1, text="")
    assert agreement(RunResult("x", 0, 1, 1, text=""), empty) == (True, 1.0, None, "chars")


def test_collapse_repeats_takes_medians_and_flags_nondeterminism():
    runs = [run("none", [1, 2], e, d, rounds=1, times={"verify": v}, gateway_overhead_s=g)
            for e, d, v, g in [(3.0, 2.0, 0.5, 0.1), (1.0, 0.5, 0.1, 0.3), (2.0, 1.0, 0.3, 0.2)]]
    c = collapse_repeats(runs)
    assert (c.e2e_s, c.decode_s, c.times["verify"], c.extra["gateway_overhead_s"]) == (2.0, 1.0, 0.3, 0.2)
    assert c.extra["repeats"] == 3 and c.extra["repeats_identical"] is True
    runs[1].tokens = [1, 3]
    assert collapse_repeats(runs).extra["repeats_identical"] is False
    assert collapse_repeats(runs[:1]) is runs[0]


def records() -> list[PromptRecord]:
    """Two categories; token counts and times chosen so every number is easy to check."""
    none_a = run("none", range(11), 2.0, 1.0, rounds=10, times={"verify": 1.0})          # 10 decode tokens / 1 s
    spec_a = run("eagle3", range(11), 1.5, 0.5, rounds=4,
                 times={"draft": 0.2, "verify": 0.3, "catch_up": 0.0, "router": 0.0})     # AL 10/4
    none_b = run("none", range(21), 3.0, 2.0, rounds=20, times={"verify": 2.0})          # 20 / 2 s
    spec_b = run("eagle3", [0, 1, 2, 3, 9, 9, 9, 9, 9, 9], 2.0, 1.5, rounds=6,
                 times={"draft": 0.5, "verify": 1.0, "catch_up": 0.1, "router": 0.0})    # 9 / 1.5 s, differs at 4
    return [PromptRecord("a", "chat", 5, {"none": none_a, "eagle3": spec_a}),
            PromptRecord("b", "code", 7, {"none": none_b, "eagle3": spec_b})]


def test_summarize_per_category_and_all():
    rows = {(s.category, s.method): s for s in summarize(records(), ["none", "eagle3"], ["chat", "code"])}
    assert set(rows) == {(c, m) for c in ("chat", "code", ALL) for m in ("none", "eagle3")}
    chat = rows[("chat", "eagle3")]
    assert chat.decode_tps == pytest.approx(20.0) and rows[("chat", "none")].decode_tps == pytest.approx(10.0)
    assert chat.ratio_decode == pytest.approx(2.0)
    assert chat.e2e_tps == pytest.approx(11 / 1.5) and chat.ratio_e2e == pytest.approx((11 / 1.5) / (11 / 2.0))
    assert chat.acceptance_length == pytest.approx(2.5)
    assert chat.ms_per_round == pytest.approx({"draft": 50.0, "verify": 75.0, "catch_up": 0.0, "router": 0.0})
    assert chat.identical_fraction == 1.0 and chat.prefix_agreement == 1.0
    assert rows[("chat", "none")].acceptance_length == 1.0 and rows[("chat", "none")].ratio_decode == 1.0
    code = rows[("code", "eagle3")]
    assert code.identical_fraction == 0.0 and code.prefix_agreement == pytest.approx(4 / 21)
    # "all" is token-weighted: total decode tokens over total decode time
    everything = rows[(ALL, "eagle3")]
    assert everything.prompts == 2 and everything.tokens == 21
    assert everything.decode_tps == pytest.approx((10 + 9) / (0.5 + 1.5))
    assert everything.ratio_decode == pytest.approx(((10 + 9) / 2.0) / ((10 + 20) / 3.0))
    assert everything.acceptance_length == pytest.approx(19 / 10)
    assert everything.identical_fraction == 0.5
    assert everything.prefix_agreement == pytest.approx((1.0 + 4 / 21) / 2)
    mm = mismatches(records(), ["eagle3"])
    assert [(m.prompt, m.method, m.first_diff, m.length, m.baseline_length) for m in mm] == [("b", "eagle3", 4, 10, 21)]


def test_acceptance_length_counts_a_stop_token_from_a_round():
    # plain decoding that stopped: 5 tokens kept, the 5th forward after prefill produced the stop token
    r = run("none", [1, 2, 3, 4, 5], 1.0, 0.5, rounds=5)
    r.finish_reason = "stop"
    (s, _all) = summarize([PromptRecord("x", "c", 3, {"none": r})], ["none"], ["c"])
    assert s.acceptance_length == 1.0 and s.decode_tps == pytest.approx(4 / 0.5)


def test_round_share_per_drafter_over_the_prompts_of_a_method():
    from whiflash_core.bench.report import round_share
    from whiflash_core.bench.runners import drafter_rounds

    stats = {"rounds": 10, "drafters": {"eagle3": {"rounds": 6}, "ngram": {"rounds": 3}, "dflash": {"rounds": 0}}}
    assert drafter_rounds(stats) == {"eagle3": 6, "ngram": 3, "dflash": 0, "plain": 1}
    a = run("whiflash", range(11), 1.0, 1.0, rounds=10, drafter_rounds=drafter_rounds(stats))
    b = run("whiflash", range(11), 1.0, 1.0, rounds=10, drafter_rounds={"eagle3": 10, "plain": 0})
    recs = [PromptRecord("a", "c", 3, {"whiflash": a}), PromptRecord("b", "c", 3, {"whiflash": b})]
    (s, _all) = summarize(recs, ["whiflash"], ["c"])
    assert s.round_share == pytest.approx({"eagle3": 0.8, "ngram": 0.15, "plain": 0.05})
    assert round_share(s.round_share) == "eagle3 80%, ngram 15%, plain 5%"


def test_the_router_cell_shows_its_share_of_the_round():
    assert router_cell({"router": 0.6, "catch_up": 1.0, "draft": 8.4, "verify": 30.0}) == "0.60 (1.5%)"
    assert router_cell({}) == "-"


def test_summary_without_rounds_or_decode_time():
    rec = PromptRecord("x", "c", None, {"none": run("none", [1, 2, 3], 1.0, None)})
    (s, _all) = summarize([rec], ["none"], ["c"])
    assert s.decode_tps is None and s.acceptance_length is None and s.e2e_tps == pytest.approx(3.0)


def test_tables_render_from_results_shape():
    summary = [s.as_dict() for s in summarize(records(), ["none", "eagle3"], ["chat", "code"])]
    results = {"summary": summary}
    headers, rows = overall_rows(results)
    assert [r[0] for r in rows] == ["none", "eagle3"] and rows[1][3] == f"{summary[-1]['ratio_decode']:.2f}x"
    headers, rows = category_rows(results, "decode_tps")
    assert headers == ["category", "prompts", "none", "eagle3"] and rows[0][3] == "20.0 (2.00x)"
    md = markdown_table(headers, rows)
    assert md.splitlines()[0] == "| category | prompts | none | eagle3 |" and md.count("\n") == 1 + len(rows)
    assert text_table(headers, rows).splitlines()[1].startswith("--------")


def test_cut_at_stop():
    assert cut_at_stop([5, 6, 2, 7], {2}, 10) == ([5, 6], "stop")
    assert cut_at_stop([5, 6, 7], {2}, 2) == ([5, 6], "length")


# -- workloads --------------------------------------------------------------------------------


def test_load_workload_both_shapes(tmp_path):
    path = tmp_path / "w.jsonl"
    lines = [{"question_id": 1, "category": "writing", "turns": ["first turn", "second turn"]},
             {"question_id": 2, "category": "writing", "turns": ["another"]},
             {"category": "agentic", "messages": [{"role": "user", "content": "hi"}],
              "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
             {"question_id": 4, "category": "math", "turns": ["1+1?"]}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    prompts = load_workload(str(path))
    assert [p.category for p in prompts] == ["writing", "writing", "agentic", "math"]
    assert prompts[0].messages == [{"role": "user", "content": "first turn"}] and prompts[0].id == "1"
    assert prompts[2].tools and prompts[2].id == "3"   # no id: the line number
    assert categories_in_order(prompts) == ["writing", "agentic", "math"]
    limited = load_workload(str(path), limit=1)
    assert [(p.category, p.id) for p in limited] == [("writing", "1"), ("agentic", "3"), ("math", "4")]
    assert [p.category for p in load_workload(str(path), categories=["math", "agentic"])] == ["agentic", "math"]
    with pytest.raises(ValueError, match="nope"):
        load_workload(str(path), categories=["nope"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"category": "x", "text": "?"}) + "\n")
    with pytest.raises(ValueError, match="turns"):
        load_workload(str(bad))


def test_shipped_small_workload():
    prompts = load_workload(os.path.join(REPO, "bench", "workload_small.jsonl"))
    cats = categories_in_order(prompts)
    assert len(cats) >= 4 and all(sum(p.category == c for p in prompts) >= 2 for c in cats)
    tool_convs = [p for p in prompts if p.tools]
    assert tool_convs and any(any(m.get("role") == "tool" for m in p.messages) for p in tool_convs)


# -- the HTTP client --------------------------------------------------------------------------


class _Gateway(BaseHTTPRequestHandler):
    """A stand-in for the gateway: records request bodies and answers with canned stats."""

    bodies: list = []
    reject_trace = False

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        if self.reject_trace and "trace" in body["speculation"]:
            self._send(400, {"error": {"message": "extra field", "param": "speculation.trace"}})
            return
        spec = {"method": body["speculation"]["method"], "rounds": 2, "acceptance_length": 1.5, "switches": 1,
                "timing": {"total_s": 0.05, "prefill": 0.01, "draft": 0.01, "verify": 0.03, "catch_up": 0.0,
                           "router": 0.0}}
        if body["speculation"].get("trace"):
            spec["tokens"] = [{"id": i, "text": "x", "source": "target", "round": 0} for i in (7, 8, 9, 10)]
        self._send(200, {"choices": [{"index": 0, "finish_reason": "length",
                                      "message": {"role": "assistant", "content": "abcd"}}],
                         "usage": {"prompt_tokens": 12, "completion_tokens": 4, "total_tokens": 16},
                         "speculation": spec})

    def _send(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def gateway():
    server = HTTPServer(("127.0.0.1", 0), _Gateway)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Gateway.bodies, _Gateway.reject_trace = [], False
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("reject_trace", [False, True])
def test_http_runner(gateway, reject_trace):
    _Gateway.reject_trace = reject_trace
    prompt = BenchPrompt("p", "agentic", [{"role": "user", "content": "hi"}],
                         tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    r = HttpRunner(gateway, "whiflash", "m", speculation={"alpha": 0.5}).run(prompt, 4)
    sent = _Gateway.bodies[-1]
    assert sent["speculation"]["method"] == "whiflash" and sent["speculation"]["alpha"] == 0.5
    assert sent["temperature"] == 0.0 and sent["stream"] is False and sent["tools"] == prompt.tools
    assert sent["max_tokens"] == 4
    assert r.n_tokens == 4 and r.rounds == 2 and r.switches == 1 and r.text == "abcd"
    assert r.decode_s == pytest.approx(0.04) and r.times["verify"] == 0.03
    assert r.extra["gateway_overhead_s"] == pytest.approx(r.e2e_s - 0.05) and r.extra["prompt_tokens"] == 12
    assert r.tokens == (None if reject_trace else [7, 8, 9, 10])


# -- one real run of the command --------------------------------------------------------------


@pytest.mark.numerics
def test_bench_command_smoke_float32(tmp_path, capsys):
    """Two short prompts, every method, float32: the JSON must say all methods agree with none."""
    import torch

    from whiflash_core.cli import main

    workload = tmp_path / "w.jsonl"
    workload.write_text("\n".join(json.dumps(x) for x in [
        {"question_id": 1, "category": "qa", "turns": ["What is the capital of France?"]},
        {"category": "agentic", "messages": [{"role": "user", "content": "Weather in Oslo?"}],
         "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                                     "parameters": {"type": "object",
                                                                    "properties": {"city": {"type": "string"}}}}}]},
    ]) + "\n")
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    threads = torch.get_num_threads()
    try:
        rc = main(["bench", "--workload", str(workload), "--methods", "none,eagle3,dflash,ngram,whiflash",
                   "--max-tokens", "8", "--threads", "1", "--dtype", "float32", "--no-warmup",
                   "--out", str(out), "--plot", str(png)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    results = json.loads(out.read_text())
    assert results["agreement"]["all_identical"] is True and results["agreement"]["strict"] is True
    assert results["agreement"]["identical_fraction"] == 1.0 and results["agreement"]["mismatches"] == []
    assert results["machine"]["threads"] == 1 and results["machine"]["dtype"] == "float32"
    assert results["config"]["drafters"] and results["command"].startswith("whiflash bench")
    rows = {(s["category"], s["method"]): s for s in results["summary"]}
    assert set(rows) == {(c, m) for c in ("qa", "agentic", "all") for m in ("none", "eagle3", "dflash", "ngram", "whiflash")}
    for s in rows.values():
        assert s["tokens"] > 0 and s["decode_tps"] > 0 and s["acceptance_length"] >= 1.0
    assert rows[("all", "none")]["ratio_decode"] == 1.0
    assert all(rows[(c, "none")]["acceptance_length"] == 1.0 for c in ("qa", "agentic", "all"))
    assert set(rows[("all", "whiflash")]["ms_per_round"]) == {"draft", "verify", "catch_up", "router"}
    # The JSON writes each share to 6 decimals (dump_json), so n shares sum to 1 within n * 0.5e-6:
    # 1/6 + 1/6 + 4/6 reads back as 0.166667 + 0.166667 + 0.666667 = 1.000001.
    shares = rows[("all", "whiflash")]["round_share"].values()
    assert sum(shares) == pytest.approx(1.0, abs=0.5e-6 * len(shares) + 1e-12)
    for p in results["prompts"]:
        assert len({tuple(r["tokens"]) for r in p["runs"].values()}) == 1
    assert png.stat().st_size > 10_000
    text = capsys.readouterr().out
    assert "All categories:" in text and "all methods identical" in text

    assert main(["bench", "--markdown", str(out)]) == 0
    md = capsys.readouterr().out
    assert "| method | tok/s decode |" in md and "| qa |" in md


class _FakeRunner:
    """Stands in for an engine method: fixed output per prompt, records the call order."""

    def __init__(self, name, calls, wrong_on=None):
        self.name, self.calls, self.wrong_on = name, calls, wrong_on

    def run(self, prompt, max_tokens):
        self.calls.append((prompt.id, self.name, max_tokens))
        tokens = [1, 2, 3, 4][:max_tokens]
        if prompt.id == self.wrong_on:
            tokens = [1, 2, 9, 9][:max_tokens]
        return RunResult(self.name, len(tokens), 0.2, 0.1, tokens=tokens, rounds=len(tokens) - 1,
                         times={"draft": 0.0, "verify": 0.1}, finish_reason="length")


@pytest.mark.parametrize("dtype, expected_rc", [("float32", 1), ("bfloat16", 0)])
def test_cli_interleaves_and_fails_on_mismatch_in_float32(tmp_path, monkeypatch, capsys, dtype, expected_rc):
    from whiflash_core.bench import cli
    from whiflash_core.cli import main

    workload = tmp_path / "w.jsonl"
    workload.write_text("\n".join(json.dumps({"question_id": i, "category": c, "turns": ["q"]})
                                  for i, c in [(1, "a"), (2, "a"), (3, "b")]) + "\n")
    calls: list = []
    monkeypatch.setattr(cli, "build_inprocess", lambda args, methods, prompts, notes: [
        _FakeRunner("none", calls), _FakeRunner("eagle3", calls, wrong_on="2"), _FakeRunner("dflash", calls)])
    out = tmp_path / "r.json"
    rc = main(["bench", "--workload", str(workload), "--methods", "none,eagle3,dflash", "--repeats", "2",
               "--max-tokens", "16", "--dtype", dtype, "--out", str(out), "--markdown", str(tmp_path / "r.md")])
    assert rc == expected_rc
    timed = [c for c in calls if c[2] == 16]
    assert [c[1] for c in timed[:6]] == ["none", "eagle3", "dflash", "eagle3", "dflash", "none"]   # rotated
    assert len([c for c in calls if c[2] == 8]) == 3   # one warm-up per method
    results = json.loads(out.read_text())
    agr = results["agreement"]
    assert agr["strict"] is (dtype == "float32") and not agr["all_identical"]
    assert [(m["prompt"], m["method"], m["first_diff"]) for m in agr["mismatches"]] == [("2", "eagle3", 2)]
    assert agr["per_method"]["eagle3"]["identical_fraction"] == pytest.approx(2 / 3)
    assert agr["per_method"]["dflash"]["identical_fraction"] == 1.0
    assert "MISMATCH" in capsys.readouterr().err
    assert "| method |" in (tmp_path / "r.md").read_text()


def test_peers_flag_takes_all_or_a_list():
    import argparse

    from whiflash_core.bench.cli import PEERS, add_parser

    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers(dest="command"))
    assert p.parse_args(["bench"]).peers is None
    assert p.parse_args(["bench", "--peers"]).peers.split(",") == list(PEERS)
    assert p.parse_args(["bench", "--peers", "llama_cpp"]).peers == "llama_cpp"
