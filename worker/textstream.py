"""Token ids to text deltas for one job: streaming detokenizer plus stop strings.

mlx-lm's streaming detokenizer never splits a multi-byte character across
deltas.  Stop strings are cut from the text; text that might be the start of a
stop string is held back until it is known not to be.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, detokenizer, stop: list[str] | None = None):
        self._detok = detokenizer
        self._stop = [s for s in (stop or []) if s]
        self._pending = ""  # decoded but not yet emitted (a possible stop prefix)
        self.stopped = False  # a stop string was found; nothing more is emitted
        self.emitted_chars = 0

    def add(self, token: int) -> str:
        """Feed one token; return the text that is now safe to emit."""
        if self.stopped:
            return ""
        self._detok.add_token(token)
        return self._take(self._detok.last_segment)

    def finish(self) -> str:
        """The sequence ended (EOS or length): flush everything held."""
        if self.stopped:
            return ""
        self._detok.finalize()
        out = self._take(self._detok.last_segment, final=True)
        return out

    def _take(self, segment: str, final: bool = False) -> str:
        text = self._pending + segment
        if self._stop:
            cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
            if cut >= 0:
                self.stopped = True
                self._pending = ""
                return self._emit(text[:cut])
            if not final:
                hold = self._held_suffix(text)
                self._pending = text[len(text) - hold :] if hold else ""
                return self._emit(text[: len(text) - hold])
        self._pending = ""
        return self._emit(text)

    def _held_suffix(self, text: str) -> int:
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _emit(self, text: str) -> str:
        self.emitted_chars += len(text)
        return text
