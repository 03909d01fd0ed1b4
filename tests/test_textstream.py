"""Streaming detokenization: multi-byte characters never split, stop strings cut and held back."""

from __future__ import annotations

from mlxq.worker.textstream import TextStream


def stream_all(tokenizer, text, stop=None):
    ids = tokenizer.encode(text)
    ts = TextStream(tokenizer.detokenizer, stop)
    pieces = [ts.add(t) for t in ids]
    pieces.append(ts.finish())
    return pieces, ts


def test_multibyte_characters_never_split(tiny_model):
    tok = tiny_model.tokenizer
    text = "café naïve 日本語 🙂 ünïcode ok"
    pieces, _ = stream_all(tok, text)
    assert "".join(pieces) == tok.decode(tok.encode(text))
    for p in pieces:
        assert "\ufffd" not in p


def test_stop_string_is_cut_and_never_leaks(tiny_model):
    tok = tiny_model.tokenizer
    pieces, ts = stream_all(tok, "hello world. The END is near", stop=["END", "zzz"])
    assert "".join(pieces) == "hello world. The "
    assert ts.stopped


def test_partial_stop_prefix_is_released_when_it_is_not_a_stop(tiny_model):
    tok = tiny_model.tokenizer
    pieces, ts = stream_all(tok, "an ENDing without the word", stop=["END."])
    assert "".join(pieces) == tok.decode(tok.encode("an ENDing without the word"))
    assert not ts.stopped
