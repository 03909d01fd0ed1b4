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

A chat job's text then goes through :class:`ChatStream`, which splits it into the answer, the
reasoning (``<think>``...``</think>``) and the tool calls, with mlx-lm's ``TextStateMachine`` (the
markers are matched in the text, as mlx-lm's server does) and mlx-lm's tool parser for the model's
family.  A call in JSON (the families whose calls mlxq constrains) ends at its end marker outside the
JSON's strings: a string argument may hold the marker's text.  Once such a call's head
(``{"name": "f", "arguments": ``) has come, its arguments stream as they are written
(:meth:`ChatStream.partial_call`), as OpenAI streams ``tool_calls[].function.arguments``; the call
when it ends carries exactly the text that streamed.
"""

from __future__ import annotations

import json
import logging
import re
import weakref
from typing import Callable, Optional

from mlx_lm.generate import TextStateMachine

from ..shared.constraints import ModelFormat
from ..shared.tools import CONSTRAINABLE as JSON_CALLS

log = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"
# Tokens held for an incomplete character at most: a UTF-8 character is 4 bytes, so a tail that
# still ends in U+FFFD after this many is invalid bytes, not a character to come, and goes out as
# it decodes. Without the cap, a model made to write such bytes (a logit_bias on a byte-fallback
# token) decoded its whole tail again at every token: quadratic work on the host thread.
MAX_HELD = 8


def vocab_size(tokenizer) -> int:
    """The tokenizer's vocabulary size, added tokens included (of the HF tokenizer that mlx-lm's
    TokenizerWrapper wraps)."""
    return len(getattr(tokenizer, "_tokenizer", tokenizer))


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
        if len(text) <= len(self._prefix_text):
            return ""  # nothing new yet
        if text.endswith(REPLACEMENT):  # an incomplete multi-byte character, or invalid bytes
            if len(self.ids) - self._read <= MAX_HELD:
                return ""
            return self._emit(*self._boundary())
        return self._emit(text, len(self.ids))

    def _emit(self, text: str, upto: int) -> str:
        """``text`` (the decode of ids[_prefix:upto]) past what was emitted; ids before ``upto`` are done."""
        new = text[len(self._prefix_text):]
        self._prefix, self._read = self._read, upto
        self._prefix_text = self._decode(self.ids[self._prefix:self._read])
        return new

    def _boundary(self) -> tuple[str, int]:
        """Past MAX_HELD: the longest held run that decodes without a trailing U+FFFD (it ends on a
        character's boundary, so what follows decodes the same on its own), else all but the last 4
        tokens (a run of invalid bytes: an incomplete character at its end is at most 3 bytes)."""
        for upto in range(len(self.ids) - 1, self._read, -1):
            text = self._decode(self.ids[self._prefix:upto])
            if len(text) > len(self._prefix_text) and not text.endswith(REPLACEMENT):
                return text, upto
        upto = len(self.ids) - 4
        return self._decode(self.ids[self._prefix:upto]), upto

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
        self.stop_string: Optional[str] = None  # the one found (the first in the text)
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
            cut, first = min(((i, s) for s in self._stop if (i := text.find(s)) >= 0), default=(-1, None))
            if cut >= 0:
                self.stopped, self.stop_string = True, first
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


# -- chat output: content, reasoning and tool calls ----------------------------------------------

CONTENT, REASONING, TOOL = "normal", "reasoning", "tool"  # mlx-lm's TextStateMachine state names
_formats: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def chat_format(tokenizer) -> ModelFormat:
    """The markers mlx-lm inferred for this tokenizer (thinking, tool calls, the family's parser)."""
    try:
        return _formats[tokenizer]
    except (KeyError, TypeError):
        pass
    fmt = ModelFormat.from_tokenizer(tokenizer)
    try:
        _formats[tokenizer] = fmt
    except TypeError:  # not weak-referenceable: read each time (cheap)
        pass
    return fmt


class ChatStream:
    """A job's text split into its answer (``add``/``finish`` return it, as :class:`TextStream` does),
    its ``reasoning`` (between the think markers) and its ``calls`` (tool-call blocks, parsed by
    mlx-lm's parser for the model's family).  Markers never reach the answer.  A call that does not
    parse goes to the answer as the model wrote it, markers and all, so nothing is lost.

    With neither thinking nor tools it is the :class:`TextStream` itself, piece for piece.
    """

    def __init__(self, text: TextStream, fmt: ModelFormat, *, tools: bool = False, parse=None,
                 tool_defs: Optional[list] = None, in_thinking: bool = False):
        self._text = text
        self._fmt = fmt
        self._parse = parse
        self._tool_defs = tool_defs
        transitions = {}
        if fmt.think_start and fmt.think_end:
            transitions[CONTENT] = [(fmt.think_start, REASONING)]
            transitions[REASONING] = [(fmt.think_end, CONTENT)]
        # a call in JSON ends at its end marker outside the JSON's strings (CallEnd), not at the first
        # text that spells it: an argument may hold that text
        self._call_end = CallEnd(fmt.tool_call_end) if fmt.tool_parser in JSON_CALLS and fmt.tool_call_end else None
        if tools and parse is not None and fmt.tool_call_start:
            transitions.setdefault(CONTENT, []).append((fmt.tool_call_start, TOOL))
            if REASONING in transitions:
                transitions[REASONING].append((fmt.tool_call_start, TOOL))
            ends = fmt.tool_call_end and self._call_end is None
            transitions[TOOL] = [(fmt.tool_call_end, CONTENT)] if ends else []
        self._machine = TextStateMachine(transitions) if transitions else None
        self._state = self._machine.make_state(REASONING if in_thinking else CONTENT) if self._machine else None
        self._where = REASONING if in_thinking else CONTENT
        self._call_text = ""
        self._args = CallArgs() if self._call_end is not None else None
        self.reasoning = ""
        self.calls: list[dict] = []  # {"name": ..., "arguments": "<JSON>"}

    def partial_call(self) -> Optional[tuple[str, str]]:
        """The call being written, as (name, its arguments so far), once its head has come; None
        outside a call, or for a call that does not open with mlxq's JSON head (it goes out whole
        when it ends)."""
        if self._where != TOOL or self._args is None:
            return None
        return self._args.read(self._call_text)

    @property
    def stopped(self) -> bool:
        return self._text.stopped

    @property
    def stop_string(self) -> Optional[str]:
        return self._text.stop_string

    def add(self, token: int) -> str:
        """Feed one token; return the answer text that is now safe to emit."""
        piece = self._text.add(token)
        if self._machine is None:
            return piece
        self._state, segments = TextStateMachine.split(self._state, piece)
        return self._route(segments)

    def finish(self) -> str:
        """The sequence ended: flush what is held; a call left open is parsed (or kept as text)."""
        piece = self._text.finish()
        if self._machine is None:
            return piece
        self._state, segments = TextStateMachine.split(self._state, piece)
        self._state, held, where = TextStateMachine.flush(self._state)
        segments.append((where, held))
        answer = self._route(segments)
        if self._where == TOOL:
            answer += self._close_call(complete=False)
        return answer

    def _route(self, segments) -> str:
        answer = []
        for where, text in segments:
            if self._where == TOOL and where != TOOL:
                answer.append(self._close_call(complete=True))
            self._where = where
            if where == REASONING:
                self.reasoning += text
            elif where == TOOL:
                self._call_text += text
                answer.append(self._json_call_end())
            else:
                answer.append(text)
        return "".join(answer)

    def _json_call_end(self) -> str:
        """A JSON call whose end marker has come (outside its strings): the call closed, and the answer
        the text after the marker makes (fed back to the machine, from the answer state)."""
        at = self._call_end.find(self._call_text) if self._call_end is not None else None
        if at is None:
            return ""
        rest = self._call_text[at + len(self._fmt.tool_call_end):]
        self._call_text = self._call_text[:at]
        answer = self._close_call(complete=True)
        self._where, self._state = CONTENT, self._machine.make_state(CONTENT)
        self._state, segments = TextStateMachine.split(self._state, rest)
        return answer + self._route(segments)

    def _close_call(self, complete: bool) -> str:
        """A call block ended: its calls, or (when it does not parse) its text back in the answer."""
        text, self._call_text = self._call_text, ""
        streamed = self._args.complete(text) if self._args is not None else None
        if self._call_end is not None:
            self._call_end, self._args = CallEnd(self._call_end.marker), CallArgs()
        calls = parse_calls(self._parse, text, self._tool_defs)
        if calls is not None:
            if streamed is not None and len(calls) == 1 and _same_json(streamed, calls[0]["arguments"]):
                calls[0]["arguments"] = streamed  # what streamed, so the pieces add up to the call
            self.calls.extend(calls)
            return ""
        log.warning("a tool call that does not parse was kept as text: %.200r", text)
        end = (self._fmt.tool_call_end or "") if complete else ""
        return self._fmt.tool_call_start + text + end


class JsonStrings:
    """Where JSON text's strings are, one character at a time (a string's quotes count as inside)."""

    def __init__(self):
        self._in_string = self._escaped = False

    def outside(self, ch: str) -> bool:
        """Whether ``ch``, the next character, lies outside every string."""
        if self._escaped:
            self._escaped = False
        elif self._in_string:
            self._escaped, self._in_string = ch == "\\", ch != '"'
        elif ch == '"':
            self._in_string = True
        else:
            return True
        return False


# the head of a call in mlxq's JSON: its name, then where its arguments start
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=[{\[])')


class CallArgs:
    """A JSON call's arguments as they arrive: its name once the head has come, then the arguments'
    text up to where their JSON value ends (each character read once)."""

    def __init__(self):
        self.name: Optional[str] = None
        self._start = self._read = self._depth = 0
        self._end: Optional[int] = None
        self._strings = JsonStrings()

    def read(self, text: str) -> Optional[tuple[str, str]]:
        """(name, arguments so far) of the call whose text so far is ``text``; None before its head."""
        if self.name is None:
            m = _CALL_HEAD.match(text)
            try:
                name = json.loads(m.group(1)) if m else None
            except ValueError:
                name = None
            if not isinstance(name, str):
                return None
            self.name, self._start = name, m.end()
            self._read = self._start
        for i in range(self._read, len(text) if self._end is None else self._read):
            ch = text[i]
            if not self._strings.outside(ch):
                continue
            if ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._end = i + 1
                    break
        self._read = self._end if self._end is not None else len(text)
        return self.name, text[self._start:self._read]

    def complete(self, text: str) -> Optional[str]:
        """The arguments' whole text when the call ``text`` opened with the head and they ended."""
        got = self.read(text)
        return got[1] if got is not None and self._end is not None else None


def _same_json(a: str, b: str) -> bool:
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return False


class CallEnd:
    """Where a call in JSON ends: the first end marker outside a JSON string, found as the call's text
    grows (each character read once)."""

    def __init__(self, marker: str):
        self.marker = marker
        self._read = 0
        self._strings = JsonStrings()

    def find(self, text: str) -> Optional[int]:
        """Where the end marker starts in ``text`` (the call's text so far, grown since the last
        call), or None when it has not come."""
        for i in range(self._read, len(text)):
            if not self._strings.outside(text[i]):
                continue
            if i + 1 >= len(self.marker) and text.startswith(self.marker, i + 1 - len(self.marker)):
                self._read = i + 1
                return i + 1 - len(self.marker)
        self._read = len(text)
        return None


def parse_calls(parse, text: str, tool_defs: Optional[list]) -> Optional[list[dict]]:
    """``text`` (a call block's inside) as calls ``{"name", "arguments": "<JSON>"}``, or None."""
    try:
        parsed = parse(text, tool_defs)
    except Exception:  # a parser is model-family code: whatever it raises, the text stays text
        return None
    calls = []
    for call in parsed if isinstance(parsed, list) else [parsed]:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        args = call.get("arguments", {})
        if not isinstance(args, str):
            args = _json_text(args)
            if args is None:
                return None
        calls.append({"name": call["name"], "arguments": args})
    return calls


def _json_text(value) -> Optional[str]:
    """A parsed call's arguments as strict JSON text, or None when they have none: a literal_eval
    parser (pythonic, ...) may give a set, bytes or a complex, and a NaN or an infinity (a number past
    a double, 1e400) has no JSON (json.dumps wrote NaN and Infinity, which strict parsers refuse).
    A lone surrogate (a "\\ud800" escape the model wrote) stays escaped: unescaped, the text could not
    be encoded as UTF-8, and the job failed when its result was packed."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(value, ensure_ascii=True, allow_nan=False)
    return text
