"""Token log-probabilities in the OpenAI shapes: chat's `logprobs.content` and legacy completions'
`tokens` / `token_logprobs` / `top_logprobs` / `text_offset`.

The numbers come from the engine (`whiflash_core.logits.token_logprobs`: the verifying forward's
rows, penalties and logit_bias applied). Here they only get their token strings and bytes. A
byte-level BPE token (GPT-2 style, SmolLM2's) can hold part of a UTF-8 character: its `bytes` are
the exact bytes (clients join them), its `token` the lossy text, as OpenAI does.
"""
from __future__ import annotations

from functools import lru_cache

from whiflash_core.logits import TokenLogprob

from .schemas import ChoiceLogprobs, TokenLogprobOut, TopLogprob


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


class LogprobFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @lru_cache(maxsize=65536)  # noqa: B019 (one formatter per server, bounded)
    def token(self, token_id: int) -> tuple[str, list[int]]:
        """(text, bytes) of one token."""
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        decoder = _byte_decoder()
        if isinstance(piece, str) and piece and all(c in decoder for c in piece):
            return text, [decoder[c] for c in piece]  # byte-level BPE: the token's own bytes
        return text, list(text.encode("utf-8"))

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text, raw = self.token(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=raw)

    def chat(self, entries: list[TokenLogprob]) -> ChoiceLogprobs:
        content = []
        for e in entries:
            text, raw = self.token(e.token)
            content.append(TokenLogprobOut(token=text, logprob=e.logprob, bytes=raw,
                                           top_logprobs=[self._top(t, v) for t, v in e.top]))
        return ChoiceLogprobs(content=content)

    def legacy(self, entries: list[TokenLogprob], offset: int = 0) -> dict:
        """Legacy completions' form; `offset`: where the first token starts in the choice's text."""
        tokens, offsets = [], []
        for e in entries:
            offsets.append(offset)
            text = self.token(e.token)[0]
            tokens.append(text)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.token(t)[0]: v for t, v in e.top} for e in entries],
                "text_offset": offsets}
