"""Tool calls under `tool_choice: auto` (issue 17): the lazy grammar, and response_format with tools.

Grammar level (the real tokenizer, no model): text is free, a call once opened must be one of the
tools with schema-valid arguments, tool markup is not free text, and "tool calls or the structured
answer" admits exactly those two. Server level (conftest's float32 live server, official client):
what the model answers under auto is a parseable call or clean text, the same streamed or not and
for every method."""
from __future__ import annotations

import json

import pytest
import torch

from test_gateway import MODEL, TOOLS, WEATHER_Q, check_args, collect_stream

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ADD_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def grammars():
    from transformers import AutoTokenizer

    from whiflash_core.constraints import GrammarFactory
    from whiflash_core.loading import model_location

    path, gguf = model_location(None)
    tok = AutoTokenizer.from_pretrained(path, **({"gguf_file": gguf} if gguf else {}))
    eos = [tok.eos_token_id]
    return tok, GrammarFactory(tok, len(tok), eos), eos[0]


def accepts(tok, constraint, text: str) -> bool:
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return constraint.masks(ids).shape[0] == len(ids) + 1  # a row per accepted token, plus the next


def may_end(tok, constraint, text: str, eos: int) -> bool:
    ids = tok(text, add_special_tokens=False)["input_ids"]
    masks = constraint.masks(ids)
    return masks.shape[0] == len(ids) + 1 and bool(masks[-1, eos])


def test_lazy_grammar_leaves_text_free_and_constrains_a_call_once_opened(grammars):
    tok, g, eos = grammars
    lazy = g.lazy_tool_calls(TOOLS, parallel=False)
    assert may_end(tok, lazy, "The weather in Paris is sunny, 22 °C. {json: [not checked]}", eos)
    assert may_end(tok, lazy, "Let me check.\n" + CALL, eos)
    assert accepts(tok, lazy, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert not accepts(tok, lazy, '<tool_call>\n{"name": "get_time", ')               # not a tool
    assert not accepts(tok, lazy, '<tool_call>\n{"name": "add", "arguments": {"a": "one"')  # not its schema
    assert not accepts(tok, lazy, '<tool_call>\nSure, the weather')                    # not a call body
    assert not may_end(tok, lazy, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}', eos)  # unclosed
    for markup in ("<tool_response>\n{}", "<tool_response_json>", "done </tool_call>", "ok </tool_response>",
                   "<tools>"):  # echoed prompt markup
        assert not accepts(tok, lazy, markup), markup
    # parallel false: one call ends the turn
    assert not accepts(tok, lazy, CALL + "\n<tool_call>")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_packed_masks_forbid_exactly_what_the_unpacked_ones_do(grammars, dtype):
    """The engine's grammar masks stay packed (GrammarConstraint.bitmasks): mask_logits (xgrammar's
    CPU kernel; its plain-torch one for float64) sets -inf exactly where the bool masks forbid, on
    a copy, and ids past the tokenizer's (a padded LM head) too; the greedy verify reading the
    packed rows in place (float32: the C argmax) chooses what argmax of the masked copy chooses."""
    from whiflash_core.sampling import mask_logits, verify_greedy

    tok, g, eos = grammars
    lazy = g.lazy_tool_calls(TOOLS, parallel=False)
    ids = tok("Let me check.\n" + CALL, add_special_tokens=False)["input_ids"]
    forbidden = 0
    for draft in (ids[:0], ids[:4], ids[:16], ids):   # free text, the trigger, inside the call
        packed, masks = lazy.bitmasks(draft), lazy.masks(draft)
        m = len(draft) + 1
        assert packed.shape[0] == masks.shape[0] == m
        logits = torch.randn(m, masks.shape[1] + 64, generator=torch.Generator().manual_seed(m)).to(dtype)
        before = logits.clone()
        out = mask_logits(logits, packed)
        expected = logits[:, : masks.shape[1]].masked_fill(~masks, float("-inf"))
        assert torch.equal(out[:, : masks.shape[1]], expected)
        assert torch.isneginf(out[:, masks.shape[1]:]).all()
        assert torch.equal(logits, before)   # the engine's logits stay as the target gave them
        assert masks.any(dim=1).all()
        forbidden += int((~masks).sum())
        d = torch.tensor(draft[: m - 1], dtype=torch.long)
        assert verify_greedy(d, logits, packed) == verify_greedy(d, out)
    assert forbidden > 0   # inside the call most tokens are forbidden: the comparison bites


@pytest.mark.parametrize("kind", ["lazy", "forced"])
def test_parallel_calls_are_each_tool_at_most_once(grammars, kind):
    """parallel_tool_calls (the default): further calls may follow, of other tools, in any order; so
    a model cannot keep appending calls until max_tokens (issue 17, finding 5)."""
    tok, g, eos = grammars
    make = g.lazy_tool_calls if kind == "lazy" else g.tool_calls
    assert may_end(tok, make(TOOLS, True), CALL, eos)
    assert may_end(tok, make(TOOLS, True), CALL + "\n" + ADD_CALL, eos)
    assert may_end(tok, make(TOOLS, True), ADD_CALL + "\n" + CALL, eos)
    assert not accepts(tok, make(TOOLS, True), CALL + "\n" + CALL)                       # the same tool again
    assert not accepts(tok, make(TOOLS, True), CALL + "\n" + ADD_CALL + "\n<tool_call>")  # a third call
    assert not accepts(tok, make(TOOLS, True), CALL + "\nDone.")                         # the turn ends with its calls
    assert not accepts(tok, make(TOOLS, False), CALL + "\n<tool_call>")


def test_free_text_after_tool_results_does_not_write_tool_markup(grammars):
    tok, g, eos = grammars
    assert may_end(tok, g.free_text(), "It is sunny and 22 degrees in Paris.", eos)
    for markup in ("<tool_response>\nSunny", "<tool_call>\n{", "Sunny.\n</tool_response>", "<tools>"):
        assert not accepts(tok, g.free_text(), markup), markup


def test_tools_or_structured_answer(grammars):
    tok, g, eos = grammars
    either = g.tool_calls_or_json(TOOLS, False, SCHEMA)
    assert may_end(tok, either, '{"city": "Paris", "sunny": true}', eos)
    assert may_end(tok, either, CALL, eos)
    assert not accepts(tok, either, "The weather is")
    assert not accepts(tok, either, '{"city": "Paris", "rain": ')


# --- against the live server -------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(live_server):
    return live_server.client()


def ask(client, messages, method="whiflash", stream=False, **kw):
    kw = {"model": MODEL, "messages": messages, "max_tokens": 48, "temperature": 0, "tools": TOOLS,
          "extra_body": {"speculation": {"method": method}}, **kw}
    if not stream:
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        return m.content, [(c.function.name, c.function.arguments) for c in m.tool_calls or []], r.choices[0].finish_reason
    with client.chat.completions.stream(**kw) as s:
        final = s.get_final_completion()
    m = final.choices[0].message
    # the stream's first chunk carries content "" with the role, so the helper's message has "" for None
    return m.content or None, [(c.function.name, c.function.arguments) for c in m.tool_calls or []], \
        final.choices[0].finish_reason


AFTER_RESULT = WEATHER_Q + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 22 degrees Celsius."}]


@pytest.mark.parametrize("messages", [WEATHER_Q, AFTER_RESULT], ids=["question", "after-result"])
def test_auto_gives_a_valid_call_or_clean_text_streamed_or_not_for_every_method(client, messages):
    expected = ask(client, messages, "none")
    content, calls, reason = expected
    for name, arguments in calls:
        check_args(name, arguments)
    assert reason == ("tool_calls" if calls else reason)
    if not calls:
        assert content and not any(m in content for m in ("<tool_response", "</tool_", "<tools>")), content
    assert ask(client, messages, "whiflash") == expected
    assert ask(client, messages, "whiflash", stream=True) == expected


def test_response_format_with_tools(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    content, calls, reason = ask(client, WEATHER_Q, response_format=fmt)
    if calls:
        assert reason == "tool_calls"
        for name, arguments in calls:
            check_args(name, arguments)
    else:
        answer = json.loads(content)
        assert set(answer) == {"city", "sunny"} and isinstance(answer["sunny"], bool)
    # a required call together with response_format: the call now, the structured answer in a later turn
    content, calls, reason = ask(client, WEATHER_Q, response_format=fmt, tool_choice="required")
    assert reason == "tool_calls" and calls and calls[0][0] in {"get_weather", "add"}
    # after the tool result, the structured answer (or another call) under auto
    content, calls, _ = ask(client, AFTER_RESULT, response_format=fmt)
    assert calls or set(json.loads(content)) == {"city", "sunny"}


def test_stop_strings_leave_a_required_call_whole_and_a_cut_off_call_is_text(client):
    """Issue 17, findings 3 and 4, with the model: `stop: ["\\n"]` does not cut into the call, and
    a call cut off by max_tokens is the text with finish `length`, streamed or not (never a call
    with `{}` arguments)."""
    for stream in (False, True):
        content, calls, reason = ask(client, WEATHER_Q, stream=stream, tool_choice="required", stop=["\n"])
        assert reason == "tool_calls" and not content and [name for name, _ in calls] == ["get_weather"]
        check_args(*calls[0])
    kw = dict(model=MODEL, messages=WEATHER_Q, tools=TOOLS, tool_choice="required", max_tokens=14, temperature=0)
    r = client.chat.completions.create(**kw)  # (the stream helper refuses finish `length`: a raw stream)
    streamed = collect_stream(client.chat.completions.create(stream=True, **kw))
    assert r.choices[0].finish_reason == streamed["finish_reason"] == "length"
    assert r.choices[0].message.tool_calls is None and streamed["calls"] == []
    assert r.choices[0].message.content == streamed["content"] and streamed["content"].startswith("<tool_call>")
