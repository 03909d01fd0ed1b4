"""Embeddings through the queue: ``POST /v1/embeddings`` driven by the official ``openai`` client,
``Client.embed`` and ``AsyncClient.embed`` (the Batch API's lines: test_batch_api.py), on one
worker serving the tiny model and one gateway for the module.  The tiny model is no trained embedder:
its vectors are compared with the same pooling done on plain mlx-lm's hidden states in the same run,
and with each other (batched equals solo, float equals base64, a cut equals the renormalised prefix)."""

from __future__ import annotations

import asyncio
import base64

import mlx.core as mx
import numpy as np
import openai
import pytest

from mlxq import AsyncClient, Client
from mlxq.shared import codec
from mlxq.shared.keys import GlobalKeys
from mlxq.shared.schemas import new_job_id
from workerkit import fast_settings, raw_post, serving_gateway

K = GlobalKeys().model_keys("tiny")
TEXTS = ["The sea is calm tonight.", "Hi", "A much longer text about the tide, the moon, the wind and the "
         "boats that wait in the harbour for the morning, and the gulls."]


@pytest.fixture(scope="module")
def stack(redis_server, tiny_model):
    with serving_gateway(tiny_model, redis_server.url, max_batch=8) as (url, r):
        yield url, r


def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=120)


def reference(loaded, text: str) -> np.ndarray:
    """The tiny model's final hidden state at the text's last token (plain mlx-lm), normalised."""
    ids = loaded.tokenizer.encode(text)
    h = np.array(loaded.model.model(mx.array([ids]))[0, -1].astype(mx.float32))
    return h / np.linalg.norm(h)


def jobs(r) -> int:
    return len(r.keys(K.job_prefix + "*"))


def test_openai_sdk_float_base64_and_dimensions(stack, tiny_model):
    url, r = stack
    client = oai(url)
    resp = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert resp.object == "list" and resp.model == "tiny" and [d.index for d in resp.data] == [0, 1, 2]
    vecs = [np.array(d.embedding, dtype=np.float32) for d in resp.data]
    size = tiny_model.model.args.hidden_size
    assert all(v.shape == (size,) for v in vecs)
    for text, v in zip(TEXTS, vecs):
        np.testing.assert_allclose(v, reference(tiny_model, text), atol=1e-4)
    counted = sum(len(tiny_model.tokenizer.encode(t)) for t in TEXTS)
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == counted
    # each alone: the same bits as in the batch
    for text, v in zip(TEXTS, vecs):
        solo = client.embeddings.create(model="tiny", input=text, encoding_format="float").data[0].embedding
        assert np.array(solo, dtype=np.float32).tobytes() == v.tobytes()
    # base64: OpenAI's little-endian float32, the same values
    b64 = client.embeddings.create(model="tiny", input=TEXTS[0], encoding_format="base64").data[0].embedding
    assert np.frombuffer(base64.b64decode(b64), dtype="<f4").tobytes() == vecs[0].tobytes()
    # the SDK's default (it asks for base64 and decodes it itself)
    assert np.array(client.embeddings.create(model="tiny", input=TEXTS[0]).data[0].embedding,
                    dtype=np.float32).tobytes() == vecs[0].tobytes()
    # dimensions: the first 16 values, renormalised
    cut = np.array(client.embeddings.create(model="tiny", input=TEXTS[0], dimensions=16,
                                            encoding_format="float").data[0].embedding)
    np.testing.assert_allclose(cut, vecs[0][:16] / np.linalg.norm(vecs[0][:16]), atol=1e-6)
    # token ids in, and the mean pooling asked for by name
    ids = tiny_model.tokenizer.encode(TEXTS[2])
    by_ids = client.embeddings.create(model="tiny", input=[ids], encoding_format="float").data[0].embedding
    assert np.array(by_ids, dtype=np.float32).tobytes() == vecs[2].tobytes()
    mean = client.embeddings.create(model="tiny", input=TEXTS[2], encoding_format="float",
                                    extra_body={"pooling": "mean"}).data[0].embedding
    h = np.array(tiny_model.model.model(mx.array([ids]))[0].astype(mx.float32)).mean(axis=0)
    np.testing.assert_allclose(mean, h / np.linalg.norm(h), atol=1e-4)


@pytest.mark.parametrize("body, param", [
    ({"model": "tiny", "input": TEXTS[0], "dimensions": 100_000}, "dimensions"),
    ({"model": "tiny", "input": ["ok", ""]}, "input"),
    ({"model": "tiny", "input": []}, "input"),
    ({"model": "tiny", "input": [[1, 2], [1] * 5000]}, "input"),  # over the tiny model's context of 4096
    ({"model": "tiny", "input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"model": "tiny", "input": "x", "temperature": 0.5}, "temperature"),
], ids=["dimensions-over-model", "empty-string", "no-input", "too-long", "format", "sampling-param"])
def test_bad_input_is_400_and_nothing_queued(stack, body, param):
    url, r = stack
    before = jobs(r)
    status, out = raw_post(url, "/v1/embeddings", body)
    assert status == 400, out
    assert out["error"]["type"] == "invalid_request_error" and param in out["error"]["message"], out
    assert jobs(r) == before


def test_dimensions_over_the_model_through_the_sdk(stack, tiny_model):
    url, r = stack
    with pytest.raises(openai.BadRequestError, match="embedding size"):
        oai(url).embeddings.create(model="tiny", input=TEXTS[0], dimensions=tiny_model.model.args.hidden_size + 1)


def test_the_clients_give_the_same_vectors(stack, redis_server):
    url, r = stack
    want = [d.embedding for d in oai(url).embeddings.create(model="tiny", input=TEXTS,
                                                              encoding_format="float").data]
    settings = fast_settings(redis_server.url)
    with Client(redis_server.url, settings=settings) as client:
        assert client.embed(TEXTS, model="tiny") == want
        assert client.embed(TEXTS[1], model="tiny") == want[1]

    async def run():
        aclient = AsyncClient(redis_server.url, settings=settings)
        try:
            return await aclient.embed(TEXTS, model="tiny", timeout=60)
        finally:
            await aclient.aclose()

    assert asyncio.run(run()) == want


def test_the_worker_refuses_what_a_producer_should_have(stack, redis_server, tiny_model):
    """Requests that skip the producers' checks (written to the queue as they are) end with a clear
    error, and the worker serves on."""
    url, r = stack
    settings = fast_settings(redis_server.url)
    size = tiny_model.model.args.hidden_size
    bad = {"embed": {"dimensions": size + 1}, "prompt": "x"}
    with Client(redis_server.url, settings=settings) as client:
        with pytest.raises(ValueError, match="embedding size"):
            client.embed("x", model="tiny", dimensions=size + 1)
        with pytest.raises(ValueError, match="generates nothing: temperature"):
            client.submit("x", model="tiny", temperature=0.5, embed={})
        job_id = new_job_id()
        client.queue_for("tiny").enqueue(job_id, codec.pack({"id": job_id, "model": "tiny", **bad}), None, None, None)
        res = client.job(job_id, "tiny").result(timeout=60)
        assert res.finish_reason == "error" and res.error == f"dimensions {size + 1} exceeds this model's embedding " \
            f"size of {size}" and res.embedding is None
        assert len(client.embed(["still", "serving"], model="tiny")) == 2
