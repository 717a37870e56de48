"""From emitted token ids to the text a client sees: incremental detokenization and stop strings.

Detokenization decodes a short window of recent tokens (TGI/vLLM's prefix/read offsets) so each
round costs O(new tokens), and holds text back while the last token ends in an incomplete UTF-8
sequence. Stop strings are matched on the decoded text: the output is cut before the first match,
and while the text ends in a prefix of a stop string that suffix is held back (it may turn out to
be the start of the stop string).
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, ids: list[int]) -> str:
        """New text from `ids` (possibly '' while a multi-byte character is incomplete)."""
        self.ids.extend(ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            new = text[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return new
        return ""

    def flush(self) -> str:
        """Whatever is still pending at the end (an incomplete character decodes as U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):]


class TextAccumulator:
    """The output text so far, cut at the first stop string."""

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = [s for s in (stop or []) if s]
        self.text = ""          # decoded text, cut at a stop string once one is found
        self.stopped = False    # a stop string was found
        self.num_tokens = 0     # tokens consumed (the one completing a stop string included)
        self._searched = 0      # text before this index contains no complete stop string

    def add(self, ids: list[int]) -> None:
        for tok in ids:  # token by token, so num_tokens stops at the token that completed a stop
            if self.stopped:
                return
            self.num_tokens += 1
            self._append(self.detok.add([tok]))

    def finish(self) -> None:
        if not self.stopped:
            self._append(self.detok.flush())

    def _append(self, new: str) -> None:
        if not new:
            return
        self.text += new
        if not self.stop:
            return
        longest = max(len(s) for s in self.stop)
        begin = max(0, self._searched - longest + 1)
        hits = [i for i in (self.text.find(s, begin) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
        self._searched = len(self.text)

    def visible(self, final: bool = False) -> str:
        """Text that can be sent now: everything but a suffix that may begin a stop string."""
        if final or self.stopped or not self.stop:
            return self.text
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return self.text[: len(self.text) - hold]
