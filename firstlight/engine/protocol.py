"""OpenAI API request schemas (pydantic), validated before anything reaches the engine.

Only what the engine implements is accepted; other OpenAI fields that would change results
(n > 1, best_of, echo, logit_bias, suffix, tools) are rejected with a 400 instead of ignored.
Unknown keys are rejected too. vLLM's extensions (top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids, skip_special_tokens, prompt_logprobs) are accepted, and so is
firstlight's `num_speculative_tokens` (per-request speculation; the server checks it against its
configured k, see `OpenAIServing.check_speculation`).

Types are strict, as the schema says: `"max_tokens": "2"`, `"stream": "yes"` and `prompt: [[false]]`
are 400s, not coerced; NaN and infinities are rejected. Every string a client sends must be valid
Unicode text (no lone UTF-16 surrogates such as `"\\ud800"`, which JSON allows but no tokenizer
can encode): a 400 that names the field, never a 500 from inside the tokenizer. Limits that
depend on the server (prompts per request, max_tokens, context length) are checked by the server.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from firstlight.engine.request import SamplingParams


def _valid_text(v: str) -> str:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode text (a lone surrogate at character {e.start}); "
                         "send UTF-8 text") from None
    return v


Text = Annotated[str, AfterValidator(_valid_text)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_valid_text)]
NoLogitBias = Annotated[dict[str, float], Field(max_length=0)]  # accepted only empty (the schema says so)
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    model_config = STRICT

    model: Text | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=16)] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: Text | None = None
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(max_length=256)] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    # firstlight extension: tokens to propose per step for this request when the server speculates
    # (None: the server's --num-spec-tokens, 0: off); the server checks it against its own k
    num_speculative_tokens: int | None = Field(None, ge=0)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v == "" or (isinstance(v, list) and any(s == "" for s in v)):
            raise ValueError("stop strings must be non-empty")
        return v

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min(self.min_tokens, max_tokens),
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            num_speculative_tokens=self.num_speculative_tokens,
        )


class CompletionRequest(_SamplingFields):
    prompt: NonEmptyText | list[NonEmptyText] | list[Annotated[int, Field(ge=0, lt=2**31)]] | list[
        Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(min_length=1)]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    # not Literal[False] / Literal[1]: a Literal compares equal, so it would take 0 for False and true for 1
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=1)
    logit_bias: NoLogitBias | None = None
    suffix: None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        """One clear message for a wrong shape (the union's own errors list every member)."""
        def is_id(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if isinstance(v, str):
            if not v:
                raise ValueError("prompt must not be empty")
            return v
        if not isinstance(v, list) or not v:
            raise ValueError("prompt must be a non-empty string, list of strings, list of token ids (integers) "
                             "or list of token-id lists")
        if all(isinstance(x, str) for x in v) or all(is_id(x) for x in v):
            if any(x == "" for x in v):
                raise ValueError("prompt strings must not be empty")
            return v
        if all(isinstance(x, list) and x and all(is_id(t) for t in x) for x in v):
            return v
        raise ValueError("prompt must be a string, a list of strings, a list of token ids (integers) or a list "
                         "of non-empty token-id lists; not a mix, and no booleans, floats or nulls")

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _no_logit_bias(cls, v: Any) -> Any:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant", "developer"]
    content: Text | list[TextPart]
    name: Text | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    logit_bias: NoLogitBias | None = None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _no_logit_bias(cls, v: Any) -> Any:
        if v:
            raise ValueError("logit_bias is not supported")
        return v


class ResetPrefixCacheRequest(BaseModel):
    """POST /reset_prefix_cache takes an empty JSON object (a JSON body keeps browsers from sending it
    cross-site without a CORS preflight)."""

    model_config = STRICT
