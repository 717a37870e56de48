"""Render chat conversations (with optional tools) into prompt text.

One renderer for every caller (server, distillation, bench) so that drafters are trained
on exactly the prompts they will serve.

Models whose chat template understands `tools` get them through their own template. Others
(SmolLM2 among them) get a Hermes-style system block listing the tools in `<tools>` and
asking for `<tool_call>{"name": ..., "arguments": ...}</tool_call>` output; assistant tool calls
and tool results in the history are rendered in the same Hermes form.
"""
from __future__ import annotations

import json
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

HERMES_TOOL_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
    "Don't make assumptions about what values to plug into functions. Here are the available tools: "
    "<tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags as follows:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>'
)


def content_text(content: Any) -> str:
    """OpenAI content may be a string, None, or a list of parts ({"type": "text", "text": ...})."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
            parts.append(str(part.get("text", "")))
        elif isinstance(part, str):
            parts.append(part)
    return "".join(parts)


def template_supports_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in template


def _hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Rewrite OpenAI messages into plain role/content messages in Hermes tool format."""
    out: list[dict] = []
    if tools:
        tool_lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        tool_block = HERMES_TOOL_PROMPT.format(tools=tool_lines)
        if messages and messages[0].get("role") in ("system", "developer"):
            tool_block = content_text(messages[0].get("content")) + "\n\n" + tool_block
            messages = messages[1:]
        out.append({"role": "system", "content": tool_block})
    for m in messages:
        role = m.get("role")
        text = content_text(m.get("content"))
        if role == "developer":
            role = "system"
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = call.get("function", call)
                args = fn.get("arguments", {})
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except json.JSONDecodeError:
                        pass
                calls.append(
                    f"{TOOL_CALL_OPEN}\n"
                    + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
                    + f"\n{TOOL_CALL_CLOSE}"
                )
            text = (text + "\n" if text else "") + "\n".join(calls)
        elif role == "tool":
            text = f"<tool_response>\n{text}\n</tool_response>"
        out.append({"role": role, "content": text})
    return out


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True) -> str:
    """Prompt text for `messages` (OpenAI shape), ready to tokenize without special-token insertion."""
    if tools and template_supports_tools(tokenizer):
        plain = [dict(m, content=content_text(m.get("content"))) for m in messages]
        return tokenizer.apply_chat_template(plain, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    plain = _hermes_messages(messages, tools)
    return tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=add_generation_prompt)


def encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    text = render_chat(tokenizer, messages, tools)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
