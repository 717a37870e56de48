"""Grammar constraints on the output, backed by xgrammar.

`GrammarConstraint` satisfies the engine's `Constraint` protocol. Speculative verification needs
the allowed-token mask at every row of a draft, *before* any draft token is known to be accepted,
so `bitmasks(draft)` walks the matcher along the draft and rolls it back afterwards (xgrammar's
matcher keeps a rollback history); only `advance()` commits.

Grammars (compiled once per distinct schema, cached by xgrammar's compiler up to
GRAMMAR_CACHE_BYTES; `check_schema` bounds what one request may ask to compile):

* tool calls in the Hermes format that `chat.render_chat` asks the model for:
  `<tool_call>\\n{"name": "<name>", "arguments": <json matching the tool's parameters>}\\n</tool_call>`,
  one call (a named `tool_choice`, or `parallel_tool_calls=false`) or several separated by a newline,
  each tool at most once per turn (so a small model cannot keep appending calls until max_tokens);
* lazily constrained tool calls (`tool_choice: auto`, llama.cpp's lazy grammars, xgrammar's
  triggered tags): text is free until the model writes `<tool_call>`, then the call must be one of
  the tools with arguments matching its schema; free text may not write tool markup of its own
  (`</tool_call>`, `<tool_response>`), which a small model otherwise echoes from the prompt;
* "tool calls or the structured answer" (`response_format` together with tools under `auto`);
* free text without that tool markup (an answer after tool results, with no tools offered);
* any JSON object (`response_format: json_object`);
* a JSON schema (`response_format: json_schema`).

The grammar ends where the format ends; the mask then allows only the stop token (EOS), so the
target itself emits EOS and the generation finishes with reason "stop".
"""
from __future__ import annotations

import json
from typing import Any

import torch
import xgrammar as xgr
from xgrammar.structural_tag import (AnyTextFormat, ConstStringFormat, JSONSchemaFormat, OptionalFormat, OrFormat, SequenceFormat,
                                     StructuralTag, TagFormat, TriggeredTagsFormat)

from .chat import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

# Parallel tool calls: each tool at most once per turn, in any order. The grammar spells out every
# order (n + n(n-1) + ... + n! alternatives for n tools), which compiled in 0.03 s for 5 tools and
# 1.8 s for 7, so with more tools than this a turn makes one call (the next turn may make another).
MAX_PARALLEL_TOOLS = 5

# Whitespace between JSON tokens is free in JSON, and a small model left unconstrained there can
# emit newlines until max_tokens. A few characters are plenty for pretty-printed output.
MAX_JSON_WHITESPACE = 4


# Bounds on what one request may ask to compile. Compilation time grows with the schema: an enum of
# 10,000 strings took 7 s, nested `anyOf` 14 levels deep over 45 s. Real tool and response schemas
# stay far below these; a deadline on compilation (app/grammar_jobs.py) catches the rest.
MAX_SCHEMA_BYTES = 64 * 1024    # the schema as compact JSON
MAX_ENUM_VALUES = 1000          # `enum` values (and `const`s) in the whole schema
MAX_SCHEMA_DEPTH = 10           # subschemas inside one another (properties, items, anyOf, ...)
# xgrammar caches compiled grammars; unbounded by default, so distinct schemas would grow it forever
GRAMMAR_CACHE_BYTES = 64 * 1024 * 1024

# keywords whose value is one subschema, or a list or a name -> subschema map of them
_SUBSCHEMA = {"items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
              "unevaluatedItems", "unevaluatedProperties", "additionalItems"}
_SUBSCHEMA_LISTS = {"anyOf", "oneOf", "allOf", "prefixItems"}
_SUBSCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}


class SchemaTooComplex(ValueError):
    """A schema past one of the bounds above; the message names the bound."""


def check_schema(schema: Any) -> None:
    """Raise SchemaTooComplex if `schema` is larger, has more enum values or nests deeper than the
    bounds allow. Iterative and linear in the schema's size, so it is safe on any input."""
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > MAX_SCHEMA_BYTES:
        raise SchemaTooComplex(f"schema of {size} bytes; at most {MAX_SCHEMA_BYTES} bytes are accepted")
    values, stack = 0, [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, dict):
            continue
        if depth > MAX_SCHEMA_DEPTH:
            raise SchemaTooComplex(f"subschemas nested more than {MAX_SCHEMA_DEPTH} levels deep")
        if isinstance(node.get("enum"), list):
            values += len(node["enum"])
        values += "const" in node
        if values > MAX_ENUM_VALUES:
            raise SchemaTooComplex(f"more than {MAX_ENUM_VALUES} enum values; at most {MAX_ENUM_VALUES} are accepted")
        for key, value in node.items():
            if key in _SUBSCHEMA:
                stack.append((value, depth + 1))
            elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
                stack.extend((v, depth + 1) for v in value)
            elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
                stack.extend((v, depth + 1) for v in value.values())


class GrammarConstraint:
    """One request's grammar state. Not thread-safe: the engine worker owns it."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int, stop_token_ids: list[int]):
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids)
        self.vocab_size = vocab_size
        self.stop_ids = set(stop_token_ids)

    def bitmasks(self, draft: list[int]) -> torch.Tensor:
        """The engine's Constraint.bitmasks (rows 0..m-1 of a verification, packed as xgrammar packs
        them) from xgrammar's matcher, walked along the draft and rolled back. Packed because unpacking to a bool [V] row
        and masking a copy of the logits with it took ~0.4 ms a row on an AMD EPYC (Zen 3) in a
        round; the greedy verify reads the packed rows in place (sampling.verify_greedy), and
        agent requests with tools carry a grammar every round."""
        packed = xgr.allocate_token_bitmask(len(draft) + 1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(packed, 0)
        walked = 0
        for tok in draft:
            # a stop token ends the output: the row after it is never used, so stop the walk there
            if tok in self.stop_ids or not self.matcher.accept_token(tok):
                break
            walked += 1
            self.matcher.fill_next_token_bitmask(packed, walked)
        if walked:
            self.matcher.rollback(walked)
        return packed[: walked + 1]

    def masks(self, draft: list[int]) -> torch.Tensor:
        """`bitmasks` unpacked: bool [m, V], True where a token is allowed."""
        packed = self.bitmasks(draft)
        bits = (packed.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        return bits.view(packed.shape[0], -1)[:, : self.vocab_size].bool()

    def advance(self, tokens: list[int]) -> None:
        for tok in tokens:
            if not self.matcher.accept_token(tok):
                raise RuntimeError(f"token {tok} violates the grammar (the mask should have prevented it)")

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


# markup the model must not write as free text under `auto`: the prompt shows it tool results in
# <tool_response> and the tools in <tools>, and a small model echoes them (also as "<tool_response_json>").
# Excluding all of "<tool_" would exclude the trigger "<tool_call>" too.
FREE_TEXT_EXCLUDES = ["<tool_response", "<tool_result", "</tool_", "<tools>", "</tools>"]


def _tool_tags(tools: list[dict]) -> list[TagFormat]:
    """One Hermes call per tool (OpenAI `{"type": "function", "function": {...}}`), arguments per its schema."""
    tags = []
    for tool in tools:
        fn = tool.get("function", tool)
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        tags.append(TagFormat(
            begin=f'{TOOL_CALL_OPEN}\n{{"name": "{fn["name"]}", "arguments": ',
            content=JSONSchemaFormat(json_schema=params, max_whitespace_cnt=MAX_JSON_WHITESPACE),
            end=f"}}\n{TOOL_CALL_CLOSE}",
        ))
    return tags


CALL_SEPARATOR = "\n"  # between parallel calls, as the Hermes prompt shows them


def _distinct_calls(tags: list[TagFormat]):
    """One or more calls, each of a different tool, in any order."""
    options = []
    for i, tag in enumerate(tags):
        rest = tags[:i] + tags[i + 1:]
        options.append(_then_more(tag, rest) if rest else tag)
    return options[0] if len(options) == 1 else OrFormat(elements=options)


def _then_more(first, rest: list[TagFormat]) -> SequenceFormat:
    """`first`, then optionally further calls of the tools in `rest`, each at most once."""
    more = SequenceFormat(elements=[ConstStringFormat(value=CALL_SEPARATOR), _distinct_calls(rest)])
    return SequenceFormat(elements=[first, OptionalFormat(content=more)])


def _parallel(tools: list[dict], parallel: bool) -> bool:
    return parallel and 1 < len(tools) <= MAX_PARALLEL_TOOLS


def _forced_calls(tools: list[dict], parallel: bool):
    """At least one call: exactly one unless `parallel`, else each tool at most once."""
    tags = _tool_tags(tools)
    if _parallel(tools, parallel):
        return _distinct_calls(tags)
    return tags[0] if len(tags) == 1 else OrFormat(elements=tags)


def tool_call_structural_tag(tools: list[dict], parallel: bool = True) -> StructuralTag:
    """Hermes tool calls restricted to `tools`: at least one (required / named tool_choice)."""
    return StructuralTag(format=_forced_calls(tools, parallel))


def lazy_tool_call_structural_tag(tools: list[dict], parallel: bool = True) -> StructuralTag:
    """Free text in which a call, once opened with `<tool_call>`, must be a valid call (tool_choice auto).
    The first call's tag carries the further calls of the turn (each other tool at most once), and the
    output ends after them."""
    tags = _tool_tags(tools)
    if _parallel(tools, parallel):
        tags = [TagFormat(begin=tag.begin, end="", content=_then_more(
                    SequenceFormat(elements=[tag.content, ConstStringFormat(value=tag.end)]), tags[:i] + tags[i + 1:]))
                for i, tag in enumerate(tags)]
    return StructuralTag(format=TriggeredTagsFormat(
        triggers=[TOOL_CALL_OPEN], tags=tags, at_least_one=False, stop_after_first=True,
        excludes=FREE_TEXT_EXCLUDES))


def tools_or_json_structural_tag(tools: list[dict], parallel: bool, schema: dict | bool) -> StructuralTag:
    """Either tool calls or the structured answer (response_format with tools under auto)."""
    answer = JSONSchemaFormat(json_schema=schema, max_whitespace_cnt=MAX_JSON_WHITESPACE)
    return StructuralTag(format=OrFormat(elements=[_forced_calls(tools, parallel), answer]))


def free_text_structural_tag() -> StructuralTag:
    """Any text but the prompt's tool markup, calls included: the answer after tool results when no
    tools are offered (with no call to trigger, all of "<tool_" can be excluded)."""
    return StructuralTag(format=AnyTextFormat(excludes=["<tool_", "</tool_", "<tools>", "</tools>"]))


class GrammarFactory:
    """Compiles grammars for one tokenizer and hands out fresh constraints for each request."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int],
                 cache_limit_bytes: int = GRAMMAR_CACHE_BYTES):
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # one compile thread per grammar: the caller decides how many grammars compile at once
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=cache_limit_bytes)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)

    def _new(self, compiled: xgr.CompiledGrammar) -> GrammarConstraint:
        return GrammarConstraint(compiled, self.vocab_size, self.stop_token_ids)

    def tool_calls(self, tools: list[dict], parallel: bool = True) -> GrammarConstraint:
        compiled = self.compiler.compile_structural_tag(tool_call_structural_tag(tools, parallel))
        return self._new(compiled)

    def lazy_tool_calls(self, tools: list[dict], parallel: bool = True) -> GrammarConstraint:
        compiled = self.compiler.compile_structural_tag(lazy_tool_call_structural_tag(tools, parallel))
        return self._new(compiled)

    def tool_calls_or_json(self, tools: list[dict], parallel: bool, schema: dict | bool) -> GrammarConstraint:
        compiled = self.compiler.compile_structural_tag(tools_or_json_structural_tag(tools, parallel, schema))
        return self._new(compiled)

    def free_text(self) -> GrammarConstraint:
        return self._new(self.compiler.compile_structural_tag(free_text_structural_tag()))

    def json_object(self) -> GrammarConstraint:
        return self.json_schema({"type": "object"})

    def json_schema(self, schema: dict[str, Any] | bool, strict: bool = True) -> GrammarConstraint:
        compiled = self.compiler.compile_json_schema(
            schema, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE, strict_mode=strict)
        return self._new(compiled)
