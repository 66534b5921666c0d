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
* ``top_k``, ``min_p``, ``vllm_xargs`` — as in vLLM's server.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from qmc_sampler.designs import METHODS

__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "RequestError", "error_body"]

XArgValue = str | int | float | list[str | int | float]


class RequestError(ValueError):
    """A request the server refuses (HTTP 400), naming the offending field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


def error_body(message: str, param: str | None, kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    """Fields shared by both endpoints (OpenAI names and defaults, plus the extensions)."""

    model_config = ConfigDict(extra="ignore")  # like OpenAI and vLLM: unknown fields are ignored

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
    user: str | None = None
    sampler: str | None = None
    sampler_seed: StrictInt | None = None
    sampler_offset: StrictInt = 0
    sampler_group_size: StrictInt | None = None
    vllm_xargs: dict[str, XArgValue] | None = None

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


class CompletionRequest(_Sampling):
    """``POST /v1/completions`` (OpenAI's legacy completions)."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= 20:
            raise ValueError(f"logprobs={value} must be in [0, 20]")
        return value


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
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

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= 20:
            raise ValueError(f"top_logprobs={value} must be in [0, 20]")
        return value
