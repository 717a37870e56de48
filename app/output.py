"""From emitted token ids to the text a client sees: incremental detokenization and stop strings.

Detokenization decodes a short window of recent tokens (TGI/vLLM's prefix/read offsets) so each
round costs O(new tokens), and holds text back while the last token ends in an incomplete UTF-8
sequence. Stop strings are matched on the decoded text: the output is cut before the first match,
and while the text ends in a prefix of a stop string that suffix is held back (it may turn out to
be the start of the stop string).

With tools, stop strings apply to the content only, never inside tool calls: matching ends at the
first `<tool_call>` (content is the text before it, app/tools.py), and the characters that may be
the start of that opener are held from the stop matchers until it is clear they are not, so
`stop: ["\\n"]` still lets `<tool_call>\\n{...}` through.
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


class StopMatcher:
    """Where one stop string stands at the end of a growing text, one character at a time (the
    Knuth-Morris-Pratt automaton): `matched` is the length of the longest prefix of the stop
    string that the text ends with. Each character costs O(1) amortized, so checking and holding
    back a stop string is linear in the output, whatever the stop string's length."""

    def __init__(self, stop: str):
        self.stop = stop
        self.matched = 0
        # fail[i]: the longest proper prefix of stop[:i + 1] that is also a suffix of it
        self._fail = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self._fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self._fail[i] = k

    def feed(self, c: str) -> bool:
        """Advance by one character; True when the text now ends with the whole stop string."""
        stop, k = self.stop, self.matched
        if k == len(stop):
            k = self._fail[k - 1]
        while k and c != stop[k]:
            k = self._fail[k - 1]
        if c == stop[k]:
            k += 1
        self.matched = k
        return k == len(stop)


class TextAccumulator:
    """The output text so far, cut at the first stop string (before the first tool call, when
    `tool_opener` is given)."""

    def __init__(self, tokenizer, stop: list[str] | None = None, tool_opener: str | None = None):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = [StopMatcher(s) for s in (stop or []) if s]
        self.text = ""          # decoded text, cut at a stop string once one is found
        self.stopped = False    # a stop string was found
        self.num_tokens = 0     # tokens consumed (the one completing a stop string included)
        self._opener = StopMatcher(tool_opener) if tool_opener and self.stops else None
        self._matched_to = 0    # text[:_matched_to] has gone through the stop matchers
        self._in_call = False   # the first tool call has begun: stop strings no longer apply

    def add(self, ids: list[int]) -> None:
        for tok in ids:  # token by token, so num_tokens stops at the token that completed a stop
            if self.stopped:
                return
            self.num_tokens += 1
            self._append(self.detok.add([tok]))

    def finish(self) -> None:
        if not self.stopped:
            self._append(self.detok.flush(), final=True)

    def _append(self, new: str, final: bool = False) -> None:
        if not new and not final:
            return
        self.text += new
        if self._in_call or not self.stops:
            return
        # the characters to match now: all new ones, less a suffix that may begin the tool-call opener;
        # from the opener on, nothing is matched any more
        end = len(self.text)
        if self._opener is not None:
            base = end - len(new)
            for j, c in enumerate(new):
                if self._opener.feed(c):
                    end = base + j + 1 - len(self._opener.stop)  # where the opener starts
                    self._in_call = True
                    break
            else:
                if not final:
                    end -= self._opener.matched
        # the earliest-starting stop string completed by these characters (all of them are fed, so
        # a long stop string that began earlier wins over a short one inside it)
        cut = None
        for i in range(self._matched_to, end):
            c = self.text[i]
            for m in self.stops:
                if m.feed(c):
                    start = i + 1 - len(m.stop)
                    cut = start if cut is None else min(cut, start)
        self._matched_to = end
        if cut is not None:
            self.text = self.text[:cut]
            self.stopped = True

    def visible(self, final: bool = False) -> str:
        """Text that can be sent now: everything but a suffix that may begin a stop string."""
        if final or self.stopped or not self.stops:
            return self.text
        if self._in_call:
            return self.text
        # what the stop matchers have not seen yet (a possible opener), and what may begin a stop string
        hold = len(self.text) - self._matched_to + max(m.matched for m in self.stops)
        return self.text[: len(self.text) - hold]
