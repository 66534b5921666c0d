"""Request models of the server (OpenAI's field names and defaults) and its errors.

Responses use the official ``openai`` package's models (``openai.types``), whose
extra-field support carries this server's extensions. Requests are validated
here, once, at the boundary; every rejection is an HTTP 400 in OpenAI's error
shape ``{"error": {"message", "type": "invalid_request_error", "param", "code"}}``.

Extensions to OpenAI's request body:

* ``sampler`` — group design (``qmc_sampler.METHODS``); default: the server's ``--sampler``;
* ``sampler_seed`` — group seed (default: ``seed``, else random; returned in the response);
* ``sampler_offset`` / ``sampler_group_size`` — this request's n choices are members
  offset..offset+n−1 of a group of that size (extends a group across calls);
* ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
  ``allowed_token_ids``, ``bad_words``, ``skip_special_tokens``, ``spaces_between_special_tokens``,
  ``include_stop_str_in_output``, ``return_token_ids``, ``structured_outputs`` (``json`` / ``regex`` /
  ``choice`` / ``grammar`` / ``json_object``), ``vllm_xargs``, and for chat
  ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs`` — as in vLLM's server.

vLLM's other request extensions that change the result (:data:`REFUSED_VLLM_FIELDS`:
beam search, prompt logprobs, prompt truncation, a request's own chat template, …) are refused with a 400 naming
the field when set, rather than ignored.

Every OpenAI field of both endpoints is either served or refused with a 400
naming it — never silently ignored where ignoring it would change the result:
``response_format`` (``text``, ``json_object``, ``json_schema``), ``logit_bias``
(token-id keys within the vocabulary, values in [-100, 100]), ``stop`` (a string
or at most 4), ``best_of`` (only = n: vLLM's V1 engine has no best-of), ``suffix``,
``echo``, ``tools`` / ``functions`` (refused), ``stream_options`` (only with
``stream``), ``top_logprobs`` (only with ``logprobs``). Unknown fields are ignored,
as OpenAI and vLLM do.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from qmc_sampler.designs import METHODS

__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "RequestError", "error_body"]

XArgValue = str | int | float | list[str | int | float]

#: vLLM request extensions this server does not serve, with the value that means "not used";
#: any other value is a 400 naming the field (ignoring it would change what the client gets).
REFUSED_VLLM_FIELDS: dict[str, Any] = {
    "use_beam_search": False,
    "length_penalty": 1.0,
    "truncate_prompt_tokens": None,
    "prompt_logprobs": None,
    "logprob_token_ids": None,
    "prompt_embeds": None,
    "watermarking": None,
    "repetition_detection": None,
    "thinking_token_budget": None,
}

#: The same for ``/v1/chat/completions`` only (a request-supplied template is code).
REFUSED_VLLM_CHAT_FIELDS: dict[str, Any] = {"echo": False, "chat_template": None, "tools_template": None}

#: ``chat_template_kwargs`` keys that are the server's to set.
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tokenize", "chat_template", "return_dict"})


class RequestError(ValueError):
    """A request the server refuses (HTTP 400 unless ``status`` says otherwise), naming the offending field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code


def error_body(
    message: str, param: str | None, kind: str = "invalid_request_error", code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = "schema"
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` (exactly one constraint)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None


class _Sampling(BaseModel):
    """Fields shared by both endpoints (OpenAI names and defaults, plus the extensions)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)  # like OpenAI and vLLM: unknown fields ignored

    model: str
    n: StrictInt = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    include_stop_str_in_output: StrictBool = False
    return_token_ids: StrictBool = False
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    user: str | None = None
    sampler: str | None = None
    sampler_seed: StrictInt | None = None
    sampler_offset: StrictInt = 0
    sampler_group_size: StrictInt | None = None
    vllm_xargs: dict[str, XArgValue] | None = None

    _refused: ClassVar[dict[str, Any]] = REFUSED_VLLM_FIELDS

    @model_validator(mode="before")
    @classmethod
    def _refused_vllm_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, unused in cls._refused.items():
                if name in data and data[name] != unused:
                    raise RequestError(f"{name} is a vLLM extension this server does not serve; omit it", name)
        return data

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens(cls, value: int) -> int:
        if value < 0:
            raise ValueError(f"min_tokens={value} must be >= 0")
        return value

    @field_validator("allowed_token_ids")
    @classmethod
    def _allowed_token_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and not value:
            raise ValueError("allowed_token_ids must name at least one token")
        return value

    @field_validator("sampler")
    @classmethod
    def _known_sampler(cls, value: str | None) -> str | None:
        if value is not None and value not in METHODS:
            raise ValueError(f"sampler={value!r} is not a design; use one of {list(METHODS)}")
        return value

    @field_validator("stop")
    @classmethod
    def _valid_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4:
            raise ValueError(f"stop has {len(stops)} sequences; at most 4 are allowed")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return value

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float | None) -> float | None:
        if value is not None and not 0.0 <= value <= 2.0:
            raise ValueError(f"temperature={value} must be in [0, 2]")
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, value: float | None) -> float | None:
        if value is not None and not 0.0 < value <= 1.0:
            raise ValueError(f"top_p={value} must be in (0, 1]")
        return value

    @field_validator("min_p")
    @classmethod
    def _min_p(cls, value: float | None) -> float | None:
        if value is not None and not 0.0 <= value <= 1.0:
            raise ValueError(f"min_p={value} must be in [0, 1]")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and value < -1:
            raise ValueError(f"top_k={value} must be -1 or 0 (disabled) or >= 1")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, value: float | None) -> float | None:
        if value is not None and not -2.0 <= value <= 2.0:
            raise ValueError(f"penalty {value} must be in [-2, 2]")
        return value

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition(cls, value: float | None) -> float | None:
        if value is not None and not 0.0 < value <= 2.0:
            raise ValueError(f"repetition_penalty={value} must be in (0, 2]")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"logit_bias key {key!r} is not a token id (a non-negative integer as a string)")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias[{key!r}]={bias} must be in [-100, 100]")
        return value

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise ValueError("tool and function calling is not supported by this server")
        return value

    @field_validator("structured_outputs")
    @classmethod
    def _one_constraint(cls, value: StructuredOutputs | None) -> StructuredOutputs | None:
        if value is not None:
            given = [k for k in ("json_", "regex", "choice", "grammar", "json_object") if getattr(value, k)]
            if len(given) != 1:
                raise ValueError("give exactly one of json, regex, choice, grammar, json_object")
        return value

    @model_validator(mode="after")
    def _combinations(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed when stream is true", "stream_options")
        if self.response_format is not None and self.structured_outputs is not None:
            if self.response_format.type != "text":
                raise RequestError("give response_format or structured_outputs, not both", "response_format")
        if self.response_format is not None and self.response_format.type == "json_schema":
            if self.response_format.json_schema is None:
                raise RequestError("response_format of type json_schema needs json_schema", "response_format")
        return self


class CompletionRequest(_Sampling):
    """``POST /v1/completions`` (OpenAI's legacy completions)."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = None

    @model_validator(mode="after")
    def _completion_combinations(self) -> CompletionRequest:
        if self.suffix:
            raise RequestError("suffix (insertion) is not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError(
                f"best_of={self.best_of} is not supported (vLLM V1 has no best-of); omit it or use best_of = n",
                "best_of",
            )
        return self

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= 20:
            raise ValueError(f"logprobs={value} must be in [0, 20]")
        return value


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]  # images and audio: a 400 naming the part's type
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    _refused: ClassVar[dict[str, Any]] = REFUSED_VLLM_FIELDS | REFUSED_VLLM_CHAT_FIELDS

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat_combinations(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise RequestError(
                    "continue_final_message=true needs add_generation_prompt=false", "continue_final_message"
                )
            if self.messages[-1].role != "assistant":
                raise RequestError(
                    "continue_final_message=true needs the last message to be the assistant's",
                    "continue_final_message",
                )
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or {}))
        if reserved:
            raise RequestError(
                f"chat_template_kwargs may not set {reserved} (the server sets them)", "chat_template_kwargs"
            )
        return self

    def template_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``apply_chat_template``; ``chat_template_kwargs`` win, as in vLLM."""
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            **(self.chat_template_kwargs or {}),
        }

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= 20:
            raise ValueError(f"top_logprobs={value} must be in [0, 20]")
        return value
