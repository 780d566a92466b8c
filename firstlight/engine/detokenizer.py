"""Incremental detokenization and stop strings.

Byte-level BPE tokens can split a UTF-8 character (an emoji is often 2-4 tokens), and a
SentencePiece-style tokenizer decides a token's leading space from its neighbours, so decoding
tokens one by one gives wrong text. As vLLM's detokenizer does, we decode a short window
`ids[prefix_offset:]` and compare with `ids[prefix_offset:read_offset]`; new text is emitted only
when it decodes cleanly (no trailing U+FFFD replacement character), then the window slides.
"""

from __future__ import annotations

from typing import Any

# tokens of prompt context used to decode the first output tokens correctly (vLLM uses 5)
INITIAL_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas; finds stop strings."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = prompt_token_ids[-INITIAL_CONTEXT_TOKENS:]
        self.ids: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.output_text = ""
        self.stop = stop
        self.include_stop_str_in_output = include_stop_str_in_output
        # a stop string may span deltas: hold back this many chars until it can be ruled out
        self.stop_buffer = max((len(s) for s in stop), default=1) - 1
        self.num_sent_chars = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append sampled tokens; returns the stop string if one now appears in the text."""
        for t in token_ids:
            self.ids.append(t)
            prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
            new_text = self._decode(self.ids[self.prefix_offset :])
            if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
                delta = new_text[len(prefix_text) :]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
                stop = self._append_and_check_stop(delta)
                if stop is not None:
                    return stop
        return None

    def _append_and_check_stop(self, delta: str) -> str | None:
        start = max(0, len(self.output_text) - self.stop_buffer)
        self.output_text += delta
        for s in self.stop:
            idx = self.output_text.find(s, start)
            if idx != -1:
                end = idx + len(s) if self.include_stop_str_in_output else idx
                self.output_text = self.output_text[:end]
                return s
        return None


    def take_delta(self, finished: bool) -> str:
        """Text not yet sent; while running, keeps back what could still be the start of a stop string."""
        limit = len(self.output_text) if finished or not self.stop else len(self.output_text) - self.stop_buffer
        if limit <= self.num_sent_chars:
            return ""
        delta = self.output_text[self.num_sent_chars : limit]
        self.num_sent_chars = limit
        return delta
