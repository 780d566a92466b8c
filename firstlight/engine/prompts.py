"""Prompts to token ids for the HTTP server: text prompts, chat templates, stop strings.

The server calls these in a worker thread (a 1 MB prompt takes the tokenizer seconds; HF fast
tokenizers release the GIL while they encode), and every failure is the client's: text the tokenizer
rejects and a template that raises are `BadRequest`s (400) naming the field, never a 500.

Special tokens in chat messages: by default, text in a message that spells a special token
(`<|im_end|>`) becomes that token, as in vLLM and HF `apply_chat_template(tokenize=True)`, so a user
can close their own turn and write one for another role. With `escape_special_tokens` (serve
--chat-escape-special-tokens) each message's content is tokenized as plain text instead: the
template is rendered with a placeholder per message, the template's own text is tokenized with its
special tokens, and each content with `split_special_tokens=True`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

log = logging.getLogger("firstlight.server")


class BadRequest(Exception):
    """A client error: the server answers 400 with the OpenAI error object."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class Message(Protocol):
    role: str

    def text(self) -> str: ...


class PromptTokenizer:
    def __init__(self, tokenizer: Any, *, escape_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.escape_special_tokens = escape_special_tokens

    def encode(self, text: str, param: str, add_special_tokens: bool = True, split_special: bool = False) -> list[int]:
        """Token ids of `text`; text the tokenizer rejects is the client's error, not ours."""
        if self.tokenizer is None:
            raise BadRequest("this server has no tokenizer; send token ids", param=param)
        try:
            kw = {"split_special_tokens": True} if split_special else {}
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens, **kw))
        except (ValueError, TypeError, UnicodeError, OverflowError) as e:
            raise BadRequest(f"{param}: the tokenizer rejected this text ({type(e).__name__}); send valid UTF-8 "
                             "text", param=param) from None
        except Exception as e:  # the tokenizers library's own (Rust) error types
            log.warning("tokenizer failed on %s: %s", param, e)
            raise BadRequest(f"{param}: the tokenizer could not encode this text", param=param) from None

    def tokenize_prompts(self, prompts: Sequence[str | list[int]]) -> list[list[int]]:
        return [self.encode(p, "prompt") if isinstance(p, str) else list(p) for p in prompts]

    def check_stop(self, stop: str | list[str] | None) -> None:
        """The detokenizer matches stop strings as text, but one the tokenizer cannot encode is refused."""
        for s in [stop] if isinstance(stop, str) else (stop or []):
            self.encode(s, "stop", add_special_tokens=False)

    def chat_prompt(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the templated conversation (see the module docstring on special tokens)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise BadRequest("this model's tokenizer has no chat template; use /v1/completions", param="messages")
        contents = [m.text() for m in messages]
        if not self.escape_special_tokens:
            turns = [{"role": m.role, "content": c} for m, c in zip(messages, contents, strict=True)]
            return self.encode(self._template(turns, add_generation_prompt), "messages", add_special_tokens=False)
        marks = [f"\x00FLMSG{i}-{uuid.uuid4().hex[:8]}\x00" for i in range(len(contents))]
        turns = [{"role": m.role, "content": mk} for m, mk in zip(messages, marks, strict=True)]
        text = self._template(turns, add_generation_prompt)
        ids: list[int] = []
        for mark, content in zip(marks, contents, strict=True):
            head, found, text = text.partition(mark)
            if not found or mark in text:
                raise BadRequest("this model's chat template does not place each message's content verbatim, so "
                                 "special tokens in it cannot be escaped (--chat-escape-special-tokens)",
                                 param="messages")
            ids += self.encode(head, "messages", add_special_tokens=False) if head else []
            ids += self.encode(content, "messages", add_special_tokens=False, split_special=True) if content else []
        return ids + (self.encode(text, "messages", add_special_tokens=False) if text else [])

    def _template(self, turns: list[dict[str, str]], add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(turns, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False)
        except Exception as e:  # jinja2 errors raised by the template itself (e.g. "roles must alternate")
            raise BadRequest(f"messages: the chat template rejected this conversation ({e})"[:400],
                             param="messages") from None
