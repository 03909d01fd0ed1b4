"""Streaming detokenization: the pieces are exactly ``decode(ids)`` (leading space kept), multi-byte
characters never split, stop strings cut and held back."""

from __future__ import annotations

import json
import random

from mlxq.worker.textstream import MAX_HELD, IncrementalDecoder, TextStream, decode_fn, parse_calls


def stream_all(tokenizer, text, stop=None):
    ids = tokenizer.encode(text)
    ts = TextStream.for_tokenizer(tokenizer, stop)
    pieces = [ts.add(t) for t in ids]
    pieces.append(ts.finish())
    return pieces, ts


def test_multibyte_characters_never_split(tiny_model):
    tok = tiny_model.tokenizer
    text = "café naïve 日本語 🙂 ünïcode ok"
    pieces, _ = stream_all(tok, text)
    assert "".join(pieces) == tok.decode(tok.encode(text)) == text
    for p in pieces:
        assert "\ufffd" not in p


def test_leading_space_is_kept_as_decoding_gives_it(tiny_model):
    """OpenAI and vLLM return " the town." for a completion whose first token is " the";
    mlx-lm's streaming detokenizer would give "the town."."""
    tok = tiny_model.tokenizer
    pieces, _ = stream_all(tok, " the town.")
    assert "".join(pieces) == " the town."
    assert pieces[0] == tok.decode(tok.encode(" the town.")[:1]) and pieces[0].startswith(" ")
    pieces, _ = stream_all(tok, "  two spaces")
    assert "".join(pieces) == "  two spaces"


def test_pieces_concatenate_to_the_decoded_tokens_for_any_ids(tiny_model):
    """Random ids, byte-level pieces of multi-byte characters included: the concatenation is always
    the tokenizer's decode of all ids, and no piece but the last ends inside a character."""
    tok = tiny_model.tokenizer
    decode = decode_fn(tok)
    rng = random.Random(0)
    vocab = len(tok._tokenizer)
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 24))]
        dec = IncrementalDecoder(decode)
        pieces = [dec.add(t) for t in ids] + [dec.finish()]
        assert "".join(pieces) == decode(ids), ids
        assert not any(p.endswith("\ufffd") for p in pieces[:-1]), ids


def test_runs_of_invalid_bytes_are_decoded_in_linear_work(tiny_model):
    """Tokens that decode to U+FFFD alone (invalid or lone UTF-8 bytes; a logit_bias can make a model
    write nothing else) are held at most MAX_HELD at a time: the work per token stays bounded (the
    whole held tail was decoded again at every token before, quadratic on the worker's host thread),
    and the pieces still concatenate to the decode of all ids, mixed with other tokens too."""
    tok = tiny_model.tokenizer
    decode = decode_fn(tok)
    vocab = len(tok._tokenizer)
    bad = [i for i in range(vocab) if decode([i]) == "\ufffd"]
    assert bad, "the test tokenizer has byte tokens that are no character alone"
    decoded = 0

    def counting(ids):
        nonlocal decoded
        decoded += len(ids)
        return decode(ids)

    rng = random.Random(1)
    lone = next(b for b in bad if decode([b] * 3) == "\ufffd" * 3)  # e.g. a byte 0xff: never valid
    ids = [lone] * 3000
    dec = IncrementalDecoder(counting)
    pieces = [dec.add(t) for t in ids] + [dec.finish()]
    assert "".join(pieces) == decode(ids)
    assert decoded < 8 * MAX_HELD * len(ids)  # quadratic: ~4.5 million
    for _ in range(200):
        ids = [rng.choice(bad) if rng.random() < 0.5 else rng.randrange(vocab) for _ in range(rng.randrange(1, 200))]
        dec = IncrementalDecoder(decode)
        assert "".join([dec.add(t) for t in ids] + [dec.finish()]) == decode(ids), ids


def test_a_parsed_call_whose_arguments_are_no_json_stays_text():
    """A literal_eval parser (pythonic, ...) can give arguments JSON cannot write (a set, bytes): the
    block stays text, as for any call that does not parse (json.dumps raised out of the worker's
    host step before, and the worker stopped)."""
    assert parse_calls(lambda text, tools: {"name": "f", "arguments": {1, 2}}, "f(a={1, 2})", None) is None
    assert parse_calls(lambda text, tools: [{"name": "f", "arguments": b"x"}], "f(b'x')", None) is None
    assert parse_calls(lambda text, tools: {"name": "f", "arguments": {"a": [1, 2]}}, "f(a=[1, 2])", None) == [
        {"name": "f", "arguments": '{"a": [1, 2]}'}]
    # NaN and infinities (1e400 parses as one) have no JSON: json.dumps wrote NaN / Infinity, which
    # strict parsers refuse; such a call stays text too
    for bad in (float("nan"), float("inf")):
        assert parse_calls(lambda text, tools: {"name": "f", "arguments": {"x": bad}}, "x", None) is None
    # a lone surrogate ("\\ud800" in the model's JSON) stays escaped: the arguments must encode as UTF-8
    [call] = parse_calls(lambda text, tools: {"name": "f", "arguments": json.loads('{"s": "a\\ud800b", "t": "é"}')},
                         "x", None)
    call["arguments"].encode("utf-8")
    assert json.loads(call["arguments"]) == {"s": "a\ud800b", "t": "é"}
    from mlxq.shared import codec
    codec.pack(call)


def test_stop_string_is_cut_and_never_leaks(tiny_model):
    tok = tiny_model.tokenizer
    pieces, ts = stream_all(tok, "hello world. The END is near", stop=["END", "zzz"])
    assert "".join(pieces) == "hello world. The "
    assert ts.stopped and ts.stop_string == "END"  # which one: the result's ``stop``
    pieces, ts = stream_all(tok, " a stop at the start", stop=["stop"])
    assert "".join(pieces) == " a "  # the leading space survives a stop string too


def test_partial_stop_prefix_is_released_when_it_is_not_a_stop(tiny_model):
    tok = tiny_model.tokenizer
    pieces, ts = stream_all(tok, "an ENDing without the word", stop=["END."])
    assert "".join(pieces) == tok.decode(tok.encode("an ENDing without the word"))
    assert not ts.stopped and ts.stop_string is None
