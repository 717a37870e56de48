"""Request and response models of the OpenAI Chat Completions API (the subset served here).

Requests are lenient like OpenAI's: unknown top-level fields are ignored (logged at debug level),
`max_tokens` and `max_completion_tokens` are both accepted, `stream_options` without `stream` is
ignored. Known scalar fields are strictly typed (`temperature: "0.5"` is a 400, not 0.5). Our own extension, `speculation`, is strict: a typo there is a 400 naming the field.

Responses serialize like vLLM's: optional delta fields that are unset are omitted (a tool call's
`id`, `type` and `name` appear only in its first delta, since clients concatenate repeats).
"""
from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_serializer

from whiflash_core.config import SpeculationConfig, api_fields, speculation_field

from .limits import stop_error

# --- request -----------------------------------------------------------------------------------

MAX_CHOICES = 16        # `n`: each choice is a generation of its own
MAX_TOP_LOGPROBS = 20   # OpenAI's bound on `top_logprobs`


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


TEXT_PARTS = ("text", "input_text", "output_text", "refusal")


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: FunctionCall | None = None  # legacy: an assistant's call of `functions`

    @field_validator("content")
    @classmethod
    def _text_only(cls, content):
        if isinstance(content, list):
            for part in content:
                if part.type not in TEXT_PARTS:
                    raise ValueError(f"content part type {part.type!r} is not supported (text only)")
        return content

    def as_dict(self) -> dict[str, Any]:
        """The plain-dict form `whiflash_core.chat.render_chat` takes."""
        out: dict[str, Any] = {"role": "tool" if self.role == "function" else self.role}
        if isinstance(self.content, list):
            out["content"] = [{"type": "text", "text": p.text or ""} for p in self.content]
        else:
            out["content"] = self.content
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        elif self.function_call is not None:
            out["tool_calls"] = [{"type": "function", "function": self.function_call.model_dump()}]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionDefinition(_Lenient):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, strict=True)


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaSpec(_Lenient):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = Field(None, strict=True)


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # llama.cpp / SGLang bare form


class StreamOptions(_Lenient):
    include_usage: bool | None = Field(None, strict=True)


def _speculation_params() -> type[BaseModel]:
    """The request's `speculation` object: every API field of SpeculationConfig, optional (None =
    the server's default), with the config's bounds and help; strict, so a typo is a 400."""
    hints = get_type_hints(SpeculationConfig)
    spec = {name: (hints[name] | None, Field(**{**speculation_field(name), "default": None})) for name in api_fields()}
    return create_model("SpeculationParams", __config__=ConfigDict(extra="forbid", strict=True),
                        __doc__="Per-request speculative decoding knobs (`extra_body={\"speculation\": {...}}`).",
                        **spec)


SpeculationParams = _speculation_params()


class SamplingRequest(_Lenient):
    """The fields chat completions and legacy completions share."""
    model: str | None = None
    # scalars are strict, as OpenAI's are: "0.5", "yes", 5.0 for an int are 400s naming the field
    # (an int for a float, e.g. temperature 1, is fine)
    max_tokens: int | None = Field(None, ge=1, strict=True)
    temperature: float | None = Field(None, ge=0.0, le=2.0, strict=True)
    top_p: float | None = Field(None, gt=0.0, le=1.0, strict=True)
    top_k: int | None = Field(None, ge=0, strict=True)  # vLLM/SGLang extension
    n: int | None = Field(None, ge=1, le=MAX_CHOICES, strict=True)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64, strict=True)
    stream: bool | None = Field(False, strict=True)
    stream_options: StreamOptions | None = None
    # applied to the target's logits before verification (whiflash_core/logits.py)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, strict=True)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, strict=True)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0, strict=True)]] | None = None
    user: str | None = None
    speculation: SpeculationParams | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if (error := stop_error(stops)) is not None:
            raise ValueError(error)
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias):
        for key in bias or {}:
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {key!r}")
        return bias

    @property
    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(None, strict=True)
    response_format: ResponseFormat | None = None
    logprobs: bool | None = Field(None, strict=True)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, strict=True)
    # the deprecated function-calling fields, served as tools / tool_choice (serving._map_legacy_functions)
    functions: list[FunctionDefinition] | None = None
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    # output other than text is refused (a 400), not ignored
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None


# --- response ----------------------------------------------------------------------------------


class _OmitNone(BaseModel):
    """Drops the listed keys when they are None (everything else serializes as usual)."""

    omit_if_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit(self, handler):
        data = handler(self)
        for key in self.omit_if_none:
            if data.get(key) is None:
                data.pop(key, None)
        return data


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0
    accepted_prediction_tokens: int = 0  # draft tokens the target accepted (speculation)
    rejected_prediction_tokens: int = 0  # draft tokens it rejected


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = Field(default_factory=CompletionTokensDetails)


class ResponseFunction(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunction


class ResponseMessage(_OmitNone):
    omit_if_none = ("tool_calls", "function_call")
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None
    function_call: ResponseFunction | None = None  # legacy `functions` requests


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None = None
    refusal: list[TokenLogprobOut] | None = None


class Choice(BaseModel):
    index: int = 0
    message: ResponseMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


def _created() -> int:
    return int(time.time())


class ChatCompletionResponse(_OmitNone):
    omit_if_none = ("speculation",)
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_created)
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None
    speculation: dict[str, Any] | None = None


class DeltaFunction(_OmitNone):
    omit_if_none = ("name", "arguments")
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_OmitNone):
    omit_if_none = ("id", "type", "function")
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction | None = None


class DeltaMessage(_OmitNone):
    omit_if_none = ("role", "content", "tool_calls", "function_call")
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    function_call: DeltaFunction | None = None  # legacy `functions` requests


class ChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_OmitNone):
    omit_if_none = ("usage", "speculation")
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    speculation: dict[str, Any] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_created)
    owned_by: str = "whiflash"
    root: str  # the served model an alias names (vLLM's field)
    max_model_len: int
    speculation_methods: list[str]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
