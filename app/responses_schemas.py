"""Request and response models of the OpenAI Responses API: the subset `/v1/responses` serves (what
the OpenAI Agents SDK's default model class, OpenAIResponsesModel, and `client.responses.create`
send and read).

Requests are lenient about fields that change nothing here (unknown fields are ignored like in
chat), strict about the types of the fields they serve (`temperature: "0.5"` is a 400 naming the
field), and refuse the fields that would change the answer but are not served (app/responses.py
lists them): a 400 naming the field, never silently ignored.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from .schemas import MAX_TOP_LOGPROBS, SpeculationParams, _OmitNone, _Lenient

# --- request -------------------------------------------------------------------------------------

# the text a content part holds, by part type (other parts, e.g. input_image, are refused)
TEXT_PART_FIELDS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}


class ContentPart(_Lenient):
    type: str
    text: str | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type not in TEXT_PART_FIELDS:
            raise ValueError(f"content part type {self.type!r} is not supported (text only: "
                             f"{', '.join(TEXT_PART_FIELDS)})")
        return self

    @property
    def value(self) -> str:
        return getattr(self, TEXT_PART_FIELDS[self.type]) or ""


def _str_or_list(kind):
    """`str | list[kind]`, validated as the one its value is: an error then names the list's item
    (`input[2].call_id`), not the string branch."""
    return Annotated[Annotated[str, Tag("str")] | Annotated[list[kind], Tag("list")],
                     Discriminator(lambda v: "str" if isinstance(v, str) else "list")]


Content = _str_or_list(ContentPart)


def parts_text(content: str | list[ContentPart]) -> str:
    return content if isinstance(content, str) else "".join(p.value for p in content)


class MessageItem(_Lenient):
    """An input message (`type` may be left out: EasyInputMessage) or an earlier output message."""
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content


class FunctionCallItem(_Lenient):
    """A call the model made in an earlier turn (as this server returned it)."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Lenient):
    """The result of a call, for the model to read."""
    type: Literal["function_call_output"]
    call_id: str
    output: Content


class ReasoningItem(_Lenient):
    """Another model's reasoning, replayed by a client: skipped (this model does not reason)."""
    type: Literal["reasoning"]


INPUT_ITEM_TYPES = {"message": "Message", "function_call": "FunctionCall",
                    "function_call_output": "FunctionCallOutput", "reasoning": "Reasoning"}


def _item_tag(item: Any) -> str | None:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)
    # a `type` that is not a string (an object, a list: unhashable) is just another unsupported item
    return INPUT_ITEM_TYPES.get(kind) if isinstance(kind, str) else None


# tags are capitalised so that error params read `input[2].call_id` (errors._loc_to_param skips them)
InputItem = Annotated[
    Annotated[MessageItem, Tag("Message")] | Annotated[FunctionCallItem, Tag("FunctionCall")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")] | Annotated[ReasoningItem, Tag("Reasoning")],
    Discriminator(_item_tag, custom_error_type="unsupported_item",
                  custom_error_message="input item type must be one of " + ", ".join(INPUT_ITEM_TYPES))]


class FunctionTool(_Lenient):
    """The Responses API's flat function tool (chat nests the same fields under `function`)."""
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, strict=True)


class FunctionToolChoice(_Lenient):
    type: Literal["function"]
    name: str


class TextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = Field(None, strict=True)


class TextConfig(_Lenient):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint for OpenAI's models; no effect here


class Reasoning(_Lenient):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(_Lenient):
    model: str | None = None
    input: _str_or_list(InputItem)
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = Field(None, strict=True)
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, strict=True)
    temperature: float | None = Field(None, ge=0.0, le=2.0, strict=True)
    top_p: float | None = Field(None, gt=0.0, le=1.0, strict=True)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, strict=True)
    include: list[str] | None = None
    stream: bool | None = Field(False, strict=True)
    metadata: dict[str, str] | None = None
    user: str | None = None
    # accepted, and nothing is stored: a later request cannot name this one (previous_response_id is refused)
    store: bool | None = Field(None, strict=True)
    # refused unless off (app/responses.py): they would change the answer
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = Field(None, strict=True)
    prompt: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: Reasoning | None = None
    context_management: list[Any] | None = None
    # extensions, as in chat
    seed: int | None = Field(None, ge=-(2**63), lt=2**64, strict=True)
    top_k: int | None = Field(None, ge=0, strict=True)
    speculation: SpeculationParams | None = None


# --- response ------------------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0      # prompt tokens whose K/V came from the prefix cache
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseError(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class Response(_OmitNone):
    model_config = ConfigDict(populate_by_name=True)
    omit_if_none = ("speculation",)
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool
    previous_response_id: None = None
    reasoning: None = None
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    speculation: dict[str, Any] | None = None  # the per-request speculation stats, as in chat
