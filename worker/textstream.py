"""Token ids to text deltas for one job: an incremental decoder plus stop strings.

The text of a job is exactly what decoding its generated tokens gives
(``tokenizer.decode(ids)``), as OpenAI and vLLM return it: a completion that
starts with a space keeps it (" the town.").  mlx-lm's streaming detokenizer
trims the first token's leading space, so it is not used here.

``IncrementalDecoder`` is the offset scheme of TGI and vLLM: each new token
decodes a short window (the last emitted token or so, plus what is pending)
and emits the part past the window's already-emitted prefix.  Text that ends
in an incomplete UTF-8 sequence is held back, so a multi-byte character is
never split across deltas.  Stop strings are cut from the text; text that
might be the start of a stop string is held back until it is known not to be.
"""

from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"


def decode_fn(tokenizer) -> Callable[[list[int]], str]:
    """``ids -> text`` with no clean-up of spaces and special tokens kept: the Rust tokenizer's
    own decode when there is one (fast, exact), else the tokenizer's ``decode``."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper wraps the HF one
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=False)
    return lambda ids: hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


class IncrementalDecoder:
    """Feed token ids one at a time; the emitted pieces concatenate to ``decode(all ids)``."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # tokens before this index are emitted
        self._prefix_text = ""  # decode(ids[_prefix:_read])

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = self._decode(self.ids[self._prefix:])
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT):
            return ""  # nothing new yet, or an incomplete multi-byte character
        new = text[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(self.ids)
        self._prefix_text = self._decode(self.ids[self._prefix:self._read])
        return new

    def finish(self) -> str:
        """Whatever is still held (an incomplete character at the very end decodes as U+FFFD)."""
        text = self._decode(self.ids[self._prefix:])
        new = text[len(self._prefix_text):] if len(text) > len(self._prefix_text) else ""
        self._prefix = self._read = len(self.ids)
        self._prefix_text = ""
        return new


class TextStream:
    def __init__(self, decoder: IncrementalDecoder, stop: list[str] | None = None):
        self._decoder = decoder
        self._stop = [s for s in (stop or []) if s]
        self._pending = ""  # decoded but not yet emitted (a possible stop prefix)
        self.stopped = False  # a stop string was found; nothing more is emitted
        self.emitted_chars = 0

    @classmethod
    def for_tokenizer(cls, tokenizer, stop: list[str] | None = None) -> "TextStream":
        return cls(IncrementalDecoder(decode_fn(tokenizer)), stop)

    def add(self, token: int) -> str:
        """Feed one token; return the text that is now safe to emit."""
        if self.stopped:
            return ""
        return self._take(self._decoder.add(token))

    def finish(self) -> str:
        """The sequence ended (EOS or length): flush everything held."""
        if self.stopped:
            return ""
        return self._take(self._decoder.finish(), final=True)

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
