"""A real Valkey Cluster on loopback (3 masters, one replica each), formed by the test with
CLUSTER ADDSLOTSRANGE / MEET / REPLICATE: two models on different shards, two worker
processes each; a multiplexed client; Redis commands per token; a master killed mid-run.

The failover test runs last in this module: it leaves one shard without a replica."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from mlxq import Client
from mlxq.shared.connection import connect
from clusterkit import EmbeddedCluster
from mlxq.shared import apikeys
from mlxq.shared.keys import GlobalKeys, ModelKeys
from workerkit import wait_for
from faultkit import WorkerProc, detok_text, executions_by_job, record, reference_tokens, wait_registered

MODELS = ("tiny", "tiny-b")  # slots 11596 and 1452: the third and the first master
PROMPTS = [[4 + i, 20 + 3 * i, 7, 99 - i] for i in range(10)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster():
    c = EmbeddedCluster(masters=3, replicas=1, node_timeout_ms=1000).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def cluster_workers(cluster, tiny_model_dir, tmp_path_factory):
    """Two worker processes per model, each given the URL of a different node."""
    logs = tmp_path_factory.mktemp("cluster-workers")
    urls = [n.url for n in cluster.masters]
    procs = [WorkerProc(urls[i % 3], tiny_model_dir, logs, name=m, max_batch=32)
             for i, m in enumerate(MODELS * 2)]
    try:
        for m in MODELS:
            assert wait_registered(cluster.url, m, n=2, timeout=120), procs[0].log()
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def references(tiny_model):
    return {tuple(p): reference_tokens(tiny_model, p, MAX_TOKENS, ignore_eos=True) for p in PROMPTS}


def _commandstats(cluster) -> dict[str, int]:
    """Commands the masters ran (replicas re-run the writes: not counted)."""
    total: Counter = Counter()
    for n in cluster.masters:
        try:
            for k, v in cluster.client(n).info("commandstats").items():
                total[k.removeprefix("cmdstat_")] += int(v["calls"])
        except Exception:
            pass  # a killed node
    return dict(total)


def _shard_of(cluster, model: str) -> int:
    return cluster.masters.index(cluster.master_for(ModelKeys(model).queue))


def _stream_text(job) -> tuple[str, list[str]]:
    text, finishes = "", []
    for d in job.stream(timeout=120):
        text += d.text
        if d.finish_reason:
            finishes.append(d.finish_reason)
    return text, finishes


def test_two_models_on_two_shards_100_jobs_each_processed_once(cluster, cluster_workers, references, tiny_model):
    assert _shard_of(cluster, MODELS[0]) != _shard_of(cluster, MODELS[1])
    client = Client(cluster.masters[1].url)  # a node that serves neither model's slot
    rng = random.Random(11)
    before = _commandstats(cluster)
    jobs = []
    for i in range(100):
        prompt = rng.choice(PROMPTS)
        jobs.append((prompt, client.submit(prompt_tokens=prompt, model=MODELS[i % 2], max_tokens=MAX_TOKENS,
                                           ignore_eos=True)))
    streams = [_stream_text(j) for _, j in jobs]
    results = [j.result(timeout=120) for _, j in jobs]
    after = _commandstats(cluster)
    exact = sum(res.token_ids == references[tuple(p)] for (p, _), res in zip(jobs, results))
    streams_ok = sum(text == res.text and fin == [res.finish_reason]
                     for (text, fin), res in zip(streams, results))
    executions = {}
    for m in MODELS:
        executions.update(executions_by_job(client.redis, ModelKeys(m), [j.id for _, j in jobs if j._keys.model == m]))
    by_worker = Counter(res.stats.worker for res in results)
    attempts = Counter(res.stats.attempts for res in results)
    dup = sum(n - 1 for n in executions.values() if n > 1)
    counts = {m: client.queue_for(m).counts() for m in MODELS}
    tokens = sum(len(r.token_ids) for r in results)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) > before.get(k, 0)}
    delta.pop("info", None)
    record("cluster: 3 masters, 2 models x 2 workers, 100 jobs", 100, exact, 100 - exact, dup,
           streams_exact=streams_ok, workers=len(by_worker), tokens=tokens,
           redis_cmds_per_token=round(sum(delta.values()) / tokens, 2),
           redis_cmds_per_job=round(sum(delta.values()) / 100, 1))
    print("  top commands:", sorted(delta.items(), key=lambda kv: -kv[1])[:10])
    assert exact == 100 and streams_ok == 100 and dup == 0
    assert attempts == Counter({1: 100}) and all(n == 1 for n in executions.values())
    for m in MODELS:
        assert counts[m]["done"] == counts[m]["processed"] == counts[m]["submitted"] == 50
        assert counts[m]["running"] == 0
    assert len(by_worker) == 4  # both workers of both models took part
    assert detok_text(tiny_model.tokenizer, results[0].token_ids) == results[0].text
    client.close()


def _pubsub_links(cluster, name: str) -> dict[int, int]:
    """Per node: connections named ``name`` that hold a (sharded) subscription (CLIENT LIST)."""
    out = {}
    for n in cluster.nodes:
        try:
            rows = cluster.client(n).client_list()
        except Exception:
            continue
        out[n.port] = sum(1 for c in rows if c.get("name") == name
                          and (int(c.get("sub", 0)) > 0 or int(c.get("ssub", 0)) > 0 or int(c.get("psub", 0)) > 0))
    return out


def test_500_streamed_jobs_share_one_pubsub_connection_per_node(cluster, cluster_workers, references):
    client = Client(redis_client=connect(cluster.url, client_name="mlxq-mux-test"))
    jobs = [client.submit(prompt_tokens=PROMPTS[i % len(PROMPTS)], model=MODELS[i % 2], max_tokens=MAX_TOKENS,
                          ignore_eos=True) for i in range(500)]
    links = _pubsub_links(cluster, "mlxq-mux-test")  # all 500 are subscribed now (none streamed yet)
    held = client.subscriber.connections()
    streams = [_stream_text(j) for j in jobs]
    results = [j.result(timeout=120) for j in jobs]
    ok = sum(text == res.text and res.token_ids == references[tuple(PROMPTS[i % len(PROMPTS)])]
             for i, ((text, _), res) in enumerate(zip(streams, results)))
    record("cluster: 500 streamed jobs through one Client", 500, ok, 500 - ok, 0,
           pubsub_connections=sum(links.values()), nodes_with_jobs=2)
    print("  pub/sub connections per node port:", links)
    assert ok == 500
    assert max(links.values()) <= 1 and sum(links.values()) == held == 2  # the two shards serving the models
    client.close()


def test_async_client_stats_metrics_and_keys_from_any_node(cluster, cluster_workers, references, monkeypatch):
    """The AsyncClient (the gateway's client) streams over sharded pub/sub; `mlxq stats`, the
    metrics scrape and `mlxq keys` work from the URL of any node (the global keys live elsewhere)."""
    import asyncio

    from prometheus_client import generate_latest

    from mlxq import AsyncClient
    from mlxq.producer import stats
    from mlxq.cli import main as cli_main
    from mlxq.shared import apikeys
    from mlxq.shared.keys import GlobalKeys
    from mlxq.worker.metrics import WorkerMetrics

    url = cluster.masters[2].url
    apikeys.add_key(connect(url), GlobalKeys(), "cluster-high-key-01", "high")

    async def run():
        c = AsyncClient(url, api_key="cluster-high-key-01")
        jobs = [await c.submit(prompt_tokens=PROMPTS[i], model=MODELS[i % 2], max_tokens=MAX_TOKENS,
                               ignore_eos=True) for i in range(6)]
        texts = ["".join([d.text async for d in j.stream(timeout=120)]) for j in jobs]
        results = [await j.result(timeout=120) for j in jobs]
        links = c.subscriber.connections()
        await c.aclose()
        return texts, results, links

    texts, results, links = asyncio.run(run())
    assert [r.text for r in results] == texts and links == 2
    assert all(r.token_ids == references[tuple(PROMPTS[i])] and r.stats.tier == "high"
               for i, r in enumerate(results))
    data = stats.collect(connect(cluster.masters[0].url))
    assert set(MODELS) <= set(data) and all(len(data[m]["workers"]) == 2 for m in MODELS)
    m = WorkerMetrics(connect(url), ModelKeys(MODELS[1]), MODELS[1])
    assert b"mlxq_queue_jobs" in generate_latest(m.registry) or b"mlxq_" in generate_latest(m.registry)
    monkeypatch.setenv("CLUSTER_KEY", "cluster-high-key-01")  # a secret never goes on the command line
    assert cli_main(["keys", "--redis-url", cluster.masters[1].url, "revoke", "--key-env", "CLUSTER_KEY"]) == 0
    with pytest.raises(Exception, match="revoked"):
        Client(url, api_key="cluster-high-key-01").submit(prompt_tokens=[5], model=MODELS[0], max_tokens=1)


def test_gateway_over_http_on_the_cluster(cluster, cluster_workers):
    """`mlxq gateway` given one node's URL serves both models over HTTP (official openai client),
    streaming over sharded pub/sub, with the same text as the Python client."""
    import openai

    from mlxq.producer.gateway import ServerThread, create_app
    from mlxq.shared import apikeys
    from mlxq.shared.keys import GlobalKeys

    url = cluster.masters[1].url
    apikeys.add_key(connect(url), GlobalKeys(), "cluster-gateway-key", "normal")
    prompt = "The ship sailed across the sea"
    py = {m: Client(url, api_key="cluster-gateway-key").submit(prompt, model=m, max_tokens=8, ignore_eos=True)
          .result(timeout=120) for m in MODELS}
    with ServerThread(create_app(url)) as gw:
        oai = openai.OpenAI(base_url=f"{gw}/v1", api_key="cluster-gateway-key", max_retries=0, timeout=120)
        assert set(MODELS) <= {m.id for m in oai.models.list().data}
        for m in MODELS:
            kw = dict(model=m, prompt=prompt, max_tokens=8, extra_body={"ignore_eos": True})
            assert oai.completions.create(**kw).choices[0].text == py[m].text
            streamed = "".join(c.choices[0].text for c in oai.completions.create(stream=True, **kw))
            assert streamed == py[m].text


def test_acl_producer_user_on_the_cluster(cluster, cluster_workers):
    """The producer ACL recipe on every node; the URL says cluster=yes (the user may not run INFO)."""
    from redis.exceptions import NoPermissionError

    from mlxq.shared import apikeys
    from mlxq.shared.acl import producer_rules
    from mlxq.shared.keys import GlobalKeys

    for n in cluster.nodes:
        cluster.client(n).execute_command("ACL", "SETUSER", "producer", *producer_rules("pw-cluster"))
    apikeys.add_key(connect(cluster.url), GlobalKeys(), "cluster-low-key-001", "low")
    url = cluster.masters[0].url.replace("redis://", "redis://producer:pw-cluster@") + "?cluster=yes"
    client = Client(url, api_key="cluster-low-key-001")
    jobs = [client.submit(prompt_tokens=PROMPTS[i], model=MODELS[i % 2], max_tokens=MAX_TOKENS, ignore_eos=True)
            for i in range(4)]
    texts = [_stream_text(j)[0] for j in jobs]
    results = [j.result(timeout=120) for j in jobs]
    assert [r.text for r in results] == texts and all(r.stats.tier == "low" for r in results)
    assert client.queue_for(MODELS[0]).functions  # it runs mlxq's Functions, not scripts
    with pytest.raises(NoPermissionError):
        client.queue_for(MODELS[0]).redis.zadd(ModelKeys(MODELS[0]).queue, {"f" * 32: 0})
    with pytest.raises(NoPermissionError):
        client.queue_for(MODELS[1]).redis.eval("return 1", 0)
    # an idempotency key whose job's record is gone counts as absent (submit reads that record, in the slot)
    kw = dict(prompt_tokens=PROMPTS[0], model=MODELS[0], max_tokens=2, idempotency_key="cluster-once")
    first = client.submit(**kw)
    assert client.submit(**kw).duplicate and first.result(timeout=120).text
    connect(cluster.url).delete(ModelKeys(MODELS[0]).job(first.id))
    again = client.submit(**kw)
    assert not again.duplicate and again.id != first.id and again.result(timeout=120).text
    client.close()


def test_master_killed_mid_run_replica_promoted_no_job_lost(cluster, cluster_workers, references):
    """Kill -9 the master serving ``tiny``'s slot while its jobs run: the replica is promoted,
    the workers and the client follow it, and every job ends with a single result."""
    model = MODELS[0]
    keys = ModelKeys(model)
    victim = cluster.master_for(keys.queue)
    url = cluster.masters[(cluster.masters.index(victim) + 1) % 3].url
    # a key of its own: the module's other tests register keys, and then keys mean keys
    apikeys.add_key(connect(url), GlobalKeys(), "cluster-kill-key-01", "normal")
    client = Client(url, api_key="cluster-kill-key-01")
    done_at_start = int(client.queue_for(model).counts().get("done", 0))  # earlier tests' jobs
    n = 60
    jobs = [client.submit(prompt_tokens=PROMPTS[i % len(PROMPTS)], model=model, max_tokens=24, ignore_eos=True)
            for i in range(n)]
    r = client.queue_for(model).redis
    assert wait_for(lambda: int(r.hget(keys.counts, "done") or 0) >= done_at_start + 5, timeout=60)  # mid-run
    done_before = int(r.hget(keys.counts, "done") or 0) - done_at_start
    victim.kill()
    live = [x for x in cluster.nodes if x is not victim]
    cluster.wait_ok(60, nodes=live)
    promoted = cluster.master_for(keys.queue)
    results = [j.result(timeout=180) for j in jobs]
    completed = sum(len(res.token_ids) == 24 and res.finish_reason == "length" for res in results)
    lost = n - completed
    counts = client.queue_for(model).counts()
    reruns = sum(res.stats.attempts > 1 for res in results)
    done_count = int(counts.get("done", 0)) - done_at_start
    dup = max(0, done_count - n)  # a job counted done twice
    record("cluster failover: master of the model's slot killed mid-run", n, completed, lost, dup,
           done_before_kill=done_before, reruns=reruns, done_count=done_count)
    assert promoted is not victim
    assert lost == 0 and dup == 0
    # a single result per job: the job hash holds one final status; the counters saw each job end once
    # (an acknowledged write lost with the old master may re-run a job, never end it twice)
    assert all(client.job(j.id, model).status() == "done" for j in jobs)
    client.close()
