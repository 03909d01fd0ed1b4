"""A background response survives its worker's kill -9: the official ``openai`` client creates it
through the real gateway, the worker process is killed mid-generation, a restarted worker takes the
job over, and the polled response's text equals the same request's answer without a crash (computed
in the same run); a stream resumed with ``starting_after`` across the crash is exact too, and a
background response created while no worker is live is queued and answered once one starts."""

from __future__ import annotations

import openai
import pytest
import redis

from faultkit import WorkerProc, _xlen, wait_registered
from mlxq.producer.gateway import ServerThread, create_app
from mlxq.shared import codec
from mlxq.shared.keys import ModelKeys
from workerkit import fast_settings, wait_for

K = ModelKeys("tiny")
REQUEST = dict(model="tiny", input="Tell me a long story about the sea.", temperature=0, max_output_tokens=200,
               extra_body={"ignore_eos": True})


def test_background_response_survives_a_worker_kill9(tiny_model_dir, redis_url, tmp_path):
    lease = dict(lease_s=2, heartbeat_s=0.5)
    a = WorkerProc(redis_url, tiny_model_dir, tmp_path, max_batch=4, **lease)
    b = None
    r = redis.Redis.from_url(redis_url)
    try:
        assert wait_registered(redis_url), a.log()
        # live_worker_s: the killed worker stops counting as live soon (a background response is queued then)
        settings = fast_settings(redis_url, live_worker_s=2, no_worker_wait_s=0.5, **lease)
        with ServerThread(create_app(redis_url, settings)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=120)
            want = client.responses.create(**REQUEST).output_text
            assert want
            a.freeze()  # while the job goes in: it runs in slices from the first look
            resp = client.responses.create(background=True, **REQUEST)
            job_id = resp.id.removeprefix("resp_")
            # kill -9 once the job has streamed a while: the worker runs in short slices from here and
            # is frozen when it has, so the kill surely finds the job mid-generation
            assert a.run_until(lambda: _xlen(r, job_id) >= 8), a.log()
            assert client.responses.retrieve(resp.id).status == "in_progress"
            # a stream of it, read up to a few text deltas, dropped, and resumed after the crash
            stream = client.responses.retrieve(resp.id, stream=True)
            seen = []
            for ev in stream:
                seen.append(ev)
                if sum(e.type == "response.output_text.delta" for e in seen) == 3:
                    break
            stream.close()
            a.kill9()
            # with no live worker, a background response is queued all the same (an interactive one is a 503)
            assert wait_for(lambda: not client.models.list().data, timeout=60)
            with pytest.raises(openai.InternalServerError):
                client.responses.create(**REQUEST)
            queued = client.responses.create(background=True, **REQUEST)
            assert queued.status == "queued"
            b = WorkerProc(redis_url, tiny_model_dir, tmp_path, max_batch=4, **lease)

            def done() -> bool:
                return all(client.responses.retrieve(x.id).status in ("completed", "incomplete")
                           for x in (resp, queued))

            assert wait_for(done, timeout=120, interval=0.2), b.log()
            final = client.responses.retrieve(resp.id)
            assert final.output_text == want and final.status == "incomplete"  # cut at max_output_tokens
            assert client.responses.retrieve(queued.id).output_text == want
            rest = list(client.responses.retrieve(resp.id, stream=True, starting_after=seen[-1].sequence_number))
            events = seen + rest
            assert [e.sequence_number for e in events] == list(range(len(events)))
            assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
            assert rest[-1].response.output_text == want
            assert codec.unpack(r.hget(K.job(job_id), "result"))["stats"]["attempts"] >= 2  # it was taken over
    finally:
        a.stop()
        if b is not None:
            b.stop()
        r.close()

