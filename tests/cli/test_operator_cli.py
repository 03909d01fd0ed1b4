"""The operator's CLI against a real Valkey: --version and bare help, jobs (list, show, cancel, tail,
requeue), the dead-letter set (list, requeue, purge), stats --watch, keys create/list with names and the
admin role, no secret on argv, and keys that mean keys (401 without one once any is registered, anonymous
callers only by opt-in) for Client, AsyncClient and the gateway."""

from __future__ import annotations

import asyncio
import io
import json

import httpx
import pytest

from mlxq import AsyncClient, AuthError, Client
from mlxq.cli import main
from mlxq.shared import apikeys, codec
from mlxq.shared.keys import GlobalKeys
from mlxq.shared.protocol import Queue
from mlxq.shared.settings import Settings
from workerkit import model_without_worker

GK = GlobalKeys()
MODEL = "opq"


@pytest.fixture
def r(redis_url):
    with model_without_worker(redis_url, MODEL) as client:  # (its jobs wait: no worker runs them)
        yield client


def run(capsys, *argv, stdin: str | None = None, monkeypatch=None) -> tuple[int, str, str]:
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def submit(url, n=1, **kw) -> list[str]:
    with Client(url, model=MODEL, **kw) as c:
        return [c.submit(f"prompt {i}", max_tokens=3, subscribe=False).id for i in range(n)]


def dead_letter(r, job_ids: list[str]) -> None:
    """What a job that used every attempt goes through: a worker leases it, its lease runs out, the reaper
    dead-letters it (max_attempts 1)."""
    q = Queue(r, GK.model_keys(MODEL), Settings(max_attempts=1))
    assert {p.job_id for p in q.pull(10, "w1")} == set(job_ids)
    r.zadd(GK.model_keys(MODEL).inflight, {job_id: 0 for job_id in job_ids}, xx=True)  # the leases ran out
    assert q.reap().dead == len(job_ids)


def test_jobs_show_a_finished_job_reads_its_tier_and_times_from_its_result(redis_url, r, capsys):
    """Completion keeps the tier, attempts and times in the result's stats only (the record's own
    fields go): `jobs show` shows them all the same."""
    from mlxq.shared.schemas import Result

    (job_id,) = submit(redis_url)
    q = Queue(r, GK.model_keys(MODEL), Settings())
    (pulled,) = q.pull(1, "w1")
    result = Result(id=job_id, text="ok", token_ids=[5], finish_reason="stop",
                    stats={"queued_at": 10.0, "started_at": 11.0, "attempts": 1, "tier": "normal", "worker": "w1"})
    assert q.complete(job_id, f"w1:{pulled.attempt}", "done", result.record()) == 1
    assert not r.hexists(GK.model_keys(MODEL).job(job_id), "tier")
    rc, out, _ = run(capsys, "jobs", "show", job_id, "--redis-url", redis_url)
    shown = json.loads(out)
    assert rc == 0 and shown["status"] == "done" and shown["tier"] == "normal" and shown["attempts"] == "1"
    assert shown["queued_at"] == "10.0" and shown["result"]["text"] == "ok"


def test_version_and_bare_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("mlxq ")
    rc, out, _ = run(capsys)
    assert rc == 0 and "jobs" in out and "keys" in out and "usage: mlxq" in out


def test_jobs_list_show_cancel_tail(redis_url, r, capsys):
    a, b = submit(redis_url, 2)
    rc, out, _ = run(capsys, "jobs", "list", "--redis-url", redis_url)
    assert rc == 0 and a in out and b in out and "queued" in out
    rc, out, _ = run(capsys, "jobs", "show", a, "--redis-url", redis_url)
    shown = json.loads(out)
    assert rc == 0 and shown["status"] == "queued" and shown["queue"] == MODEL
    assert shown["request"]["prompt"] == "prompt 0"
    rc, out, _ = run(capsys, "jobs", "cancel", a, "--redis-url", redis_url)
    assert rc == 0 and out.strip() == "cancelled"
    rc, out, err = run(capsys, "jobs", "tail", a, "--redis-url", redis_url)  # ended: replayed from its record
    assert rc == 0 and "[cancelled]" in err
    rc, out, _ = run(capsys, "jobs", "list", "--status", "queued", "--json", "--redis-url", redis_url)
    assert [row["id"] for row in json.loads(out)] == [b]
    rc, _, err = run(capsys, "jobs", "show", "f" * 32, "--redis-url", redis_url)
    assert rc == 2 and "no job" in err


def test_failed_jobs_list_requeue_purge(redis_url, r, capsys):
    a, b, c = submit(redis_url, 3)
    dead_letter(r, [a, b, c])
    rc, out, _ = run(capsys, "jobs", "failed", "--redis-url", redis_url)
    assert rc == 0 and all(x in out for x in (a, b, c)) and "lease expired" in out
    rc, out, _ = run(capsys, "jobs", "requeue", a, "--redis-url", redis_url)
    new = out.strip()
    assert rc == 0 and new != a and r.hget(GK.model_keys(MODEL).job(new), "status") == b"queued"
    assert codec.unpack(r.hget(GK.model_keys(MODEL).job(new), "req"))["prompt"] == "prompt 0"
    rc, out, _ = run(capsys, "jobs", "failed", "requeue", b, "--redis-url", redis_url)
    assert rc == 0 and f"{b} -> " in out
    assert {m.decode() for m in r.zrange(GK.model_keys(MODEL).dead, 0, -1)} == {c}
    rc, _, err = run(capsys, "jobs", "requeue", new, "--redis-url", redis_url)  # still queued: refused
    assert rc == 2 and "only a finished job" in err
    rc, out, _ = run(capsys, "jobs", "failed", "purge", "--redis-url", redis_url)
    assert rc == 0 and "1 purged" in out and not r.exists(GK.model_keys(MODEL).dead)


def test_stats_watch_prints_and_stops_after_count(redis_url, r, capsys):
    submit(redis_url)
    rc, out, _ = run(capsys, "stats", "--watch", "0.01", "--count", "2", "--redis-url", redis_url)
    assert rc == 0 and out.count(f"model {MODEL}") == 2 and "every 0.01s" in out
    with pytest.raises(SystemExit):
        main(["stats", "--watch", "0"])
    assert "above 0" in capsys.readouterr().err


def test_keys_create_list_and_no_secret_on_argv(redis_url, r, capsys, monkeypatch):
    rc, out, err = run(capsys, "keys", "create", "--name", "ops", "--tier", "high", "--admin",
                       "--redis-url", redis_url)
    key = out.strip()
    assert rc == 0 and len(key) > 32 and "shown this once" in err
    assert apikeys.resolve_tier(r, GK.api_keys, key) == "high" and apikeys.is_admin(r, GK, key)
    rc, out, _ = run(capsys, "keys", "add", "--tier", "low", "--name", "batchjobs", "--redis-url", redis_url,
                     stdin="a-key-from-stdin\n", monkeypatch=monkeypatch)
    assert rc == 0 and apikeys.resolve_tier(r, GK.api_keys, "a-key-from-stdin") == "low"
    rc, out, _ = run(capsys, "keys", "list", "--redis-url", redis_url)
    assert "ops" in out and "admin" in out and "batchjobs" in out and "keys required" in out
    hashes = [h.decode() for h in r.hkeys(GK.api_keys)]
    assert key not in out and not any(h[:8] in out for h in hashes)  # never the key nor its hash
    rc, _, err = run(capsys, "keys", "create", "--name", "ops", "--tier", "low", "--redis-url", redis_url)
    assert rc == 2 and "exists already" in err
    # the old spellings: the secret as an argument is refused, and saying why
    for argv in (["keys", "add", "a-secret-on-argv", "--tier", "low"], ["keys", "revoke", "a-secret-on-argv"],
                 ["acl-producer", "user", "a-password-on-argv"]):
        rc, _, err = run(capsys, *argv, "--redis-url", redis_url) if argv[0] == "keys" else run(capsys, *argv)
        assert rc == 2 and "shell history" in err, argv
    assert not r.hexists(GK.api_keys, apikeys.key_hash("a-secret-on-argv"))
    monkeypatch.setenv("PRODUCER_PW", "pw-from-env")
    rc, out, _ = run(capsys, "acl-producer", "svc", "--password-env", "PRODUCER_PW")
    assert rc == 0 and ">pw-from-env" in out
    rc, out, _ = run(capsys, "keys", "revoke", "--name", "batchjobs", "--redis-url", redis_url)
    assert rc == 0 and "revoked" in out
    with pytest.raises(AuthError):
        apikeys.resolve_tier(r, GK.api_keys, "a-key-from-stdin")


def test_keys_limits_and_usage_by_key_name(redis_url, r, capsys):
    """`keys create/set` give a key a weight, a cap on jobs in flight and a daily token quota; `mlxq usage`
    reports the tokens each key's jobs used today, by name (never the key or its hash)."""
    rc, out, _ = run(capsys, "keys", "create", "--name", "ingest", "--tier", "low", "--weight", "2",
                     "--max-inflight", "4", "--redis-url", redis_url)
    key = out.strip()
    rc, out, _ = run(capsys, "keys", "set", "--name", "ingest", "--daily-tokens", "5000", "--redis-url", redis_url)
    assert rc == 0 and "weight 2, at most 4 jobs in flight, 5000 tokens a day" in out
    rc, out, _ = run(capsys, "keys", "list", "--redis-url", redis_url)
    assert "weight 2 at most 4 in flight 5000 tokens a day" in out
    (job,) = submit(redis_url, api_key=key)
    q = Queue(r, GK.model_keys(MODEL), Settings())
    assert [p.job_id for p in q.pull(1, "w")] == [job]
    assert q.complete(job, "w:1", "done", b"r", usage=(17, 3)) == 1
    rc, out, _ = run(capsys, "usage", "--redis-url", redis_url)
    [header, row] = out.strip().splitlines()
    assert header.split() == ["day", "model", "key", "prompt", "completion", "jobs"]
    assert row.split()[1:] == [MODEL, "ingest", "17", "3", "1"]
    assert key not in out and apikeys.key_hash(key)[:8] not in out
    rc, out, _ = run(capsys, "usage", "--days", "7", "--json", "--redis-url", redis_url)
    assert [(u["key"], u["prompt_tokens"]) for u in json.loads(out)] == [("ingest", 17)]


def test_operator_actions_need_an_admin_key_once_keys_exist(redis_url, r, capsys, monkeypatch):
    apikeys.add_key(r, GK, "ops-admin-key", "high", name="ops", admin=True)
    apikeys.add_key(r, GK, "producer-key", "normal", name="app")
    (job,) = submit(redis_url, api_key="producer-key")
    monkeypatch.setenv("MLXQ_API_KEY", "producer-key")
    rc, _, err = run(capsys, "jobs", "cancel", job, "--redis-url", redis_url)
    assert rc == 2 and "admin" in err
    rc, out, err = run(capsys, "jobs", "cancel", job, "--api-key", "ops-admin-key", "--redis-url", redis_url)
    assert rc == 0 and out.strip() == "cancelled"
    assert "--api-key puts the key in shell history" in err  # still taken, with a warning


def test_keys_mean_keys(redis_url, r, capsys):
    """Open mode serves callers with no key; once a key exists they get 401 (AuthError) unless the admin
    opted in with `mlxq tiers --anonymous`, and then at that tier. Client, AsyncClient, the enqueue script
    and the gateway agree."""
    from mlxq.producer.gateway import ServerThread, create_app

    assert submit(redis_url)  # open: no key registered, no key needed
    apikeys.add_key(r, GK, "a-registered-key", "normal", name="app")
    with pytest.raises(AuthError, match="API key is required"):
        submit(redis_url)
    with Client(redis_url, model=MODEL) as c, pytest.raises(AuthError):
        c.tier()

    async def async_tier():
        async with AsyncClient(redis_url, model=MODEL) as ac:
            return await ac.tier()

    with pytest.raises(AuthError):
        asyncio.run(async_tier())
    assert submit(redis_url, api_key="a-registered-key")
    settings = Settings(no_worker_wait_s=0.1)
    with ServerThread(create_app(redis_url, settings)) as base:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
        assert reply.status_code == 401 and "API key is required" in reply.text
        rc, out, _ = run(capsys, "tiers", "--anonymous", "low", "--redis-url", redis_url)
        assert rc == 0 and json.loads(out)["anonymous"] == "low"
        assert asyncio.run(async_tier()) == "low"
        (job,) = submit(redis_url)  # let in, at the low tier
        assert r.hget(GK.model_keys(MODEL).job(job), "tier") == b"low"
        models = httpx.get(f"{base}/v1/models", timeout=30)
        assert models.status_code == 200
    rc, out, _ = run(capsys, "tiers", "--anonymous", "default", "--redis-url", redis_url)
    assert json.loads(out)["anonymous"] == "default" and "401" in json.loads(out)["auth"]
    with pytest.raises(AuthError):
        submit(redis_url)


def test_gateway_logs_its_auth_mode(redis_url, r, caplog):
    from mlxq.producer.gateway import ServerThread, create_app

    apikeys.add_key(r, GK, "a-registered-key", "normal", name="app")
    with caplog.at_level("INFO", logger="mlxq.gateway"):
        with ServerThread(create_app(redis_url, Settings())):
            pass
    assert "keys required: a request without a key gets 401" in caplog.text


# -- flags: groups, one meaning each, the old spellings ------------------------------------------------------
def test_worker_flags_come_in_groups(capsys):
    from mlxq.cli.worker import group_of
    from mlxq.shared.settings import worker_flags

    assert [f.name for f in worker_flags() if group_of(f.name) == "other"] == []
    with pytest.raises(SystemExit):
        main(["worker", "--help"])
    out = capsys.readouterr().out
    out = out[out.index("\noptions:"):]  # past the usage line, which names every flag
    heads = [out.index(f"\n{g}:\n") for g in ("engine", "memory", "queue", "observability")]
    assert heads == sorted(heads)
    assert heads[1] < out.index("--kv-memory-mb") < heads[2] < out.index("--lease-s") < heads[3] \
        < out.index("--metrics-port")


def test_model_names_a_model_and_queue_names_a_queue(tmp_path, capsys):
    from mlxq.cli import build_parser
    from mlxq.cli.options import queue_of

    args = build_parser().parse_args(["worker", "--model", str(tmp_path), "--queue", "q1"])
    assert (args.model, args.queue) == (str(tmp_path), "q1")
    args = build_parser().parse_args(["worker", "--model", str(tmp_path), "--name", "q2"])  # the old spelling
    assert args.queue == "q2" and "--name is deprecated; use --queue" in capsys.readouterr().err
    assert queue_of(build_parser().parse_args(["submit", "hi", "--queue", "q3"])) == "q3"
    assert queue_of(build_parser().parse_args(["submit", "hi", "--model", str(tmp_path / "m.gguf")])) == "m"
    assert capsys.readouterr().err == ""
    assert queue_of(build_parser().parse_args(["submit", "hi", "--model", "q4"])) == "q4"  # a queue name: old
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model q4 is deprecated" in err and "--queue q4" in err


def test_gateway_flags_come_from_settings(capsys, monkeypatch):
    from mlxq.cli import build_parser
    from mlxq.cli.gateway import gateway_flags
    from mlxq.cli.options import settings_from

    monkeypatch.setenv("MLXQ_LIVE_WORKER_S", "7")
    args = build_parser().parse_args(["gateway", "--redis-outage-s", "5", "--no-worker-wait", "1.5"])
    s = settings_from(args, gateway_flags())
    assert (s.redis_outage_s, s.no_worker_wait_s, s.live_worker_s) == (5.0, 1.5, 7.0)
    assert "--no-worker-wait is deprecated; use --no-worker-wait-s" in capsys.readouterr().err


def test_one_max_tokens_default():
    from mlxq.cli import build_parser
    from mlxq.shared.schemas import DEFAULT_MAX_TOKENS, GenerateRequest

    assert GenerateRequest(model="m", prompt="x").max_tokens == DEFAULT_MAX_TOKENS
    # unsaid, it stays unsaid: the request's default, which the worker fits to the model's context
    assert build_parser().parse_args(["submit", "hi"]).max_tokens is None
    assert build_parser().parse_args(["batch", "in.jsonl", "-o", "o.jsonl"]).max_tokens is None


def test_only_the_face_parses_command_lines():
    """producer, worker and shared never import argparse: the CLI (mlxq/cli/) turns flags into values."""
    import ast
    from repokit import ROOT as root
    found = []
    for layer in ("producer", "worker", "shared"):
        for path in (root / layer).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                found += [f"{path.relative_to(root)}:{node.lineno}" for n in names if n.split(".")[0] == "argparse"]
    assert found == []


def test_dashboard_beyond_loopback_needs_a_registered_admin_key(redis_url, r, capsys):
    """Bound to another address, every page needs an admin login: with no admin key to log in with, it
    does not start (one line saying how to make one)."""
    from mlxq.cli.dashboard import loopback

    assert loopback("127.0.0.1") and loopback("::1") and loopback("localhost") and not loopback("0.0.0.0")
    apikeys.add_key(r, GK, "a-producer-key", "normal", name="producer")
    rc, _, err = run(capsys, "dashboard", "--host", "0.0.0.0", "--redis-url", redis_url)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "--admin" in err and "none is registered" in err


def test_the_admin_search_narrows_by_tier_key_name_and_text(redis_url, r):
    """What the dashboard's jobs page asks of the library (producer/admin.py): the CLI's listing, narrowed."""
    from mlxq.producer.admin import Admin

    apikeys.add_key(r, GK, "key-ingest-0001", "normal", name="ingest")
    apikeys.add_key(r, GK, "key-ops-00000001", "high", name="ops", admin=True)
    ingest = submit(redis_url, 2, api_key="key-ingest-0001")
    (ops,) = submit(redis_url, 1, api_key="key-ops-00000001")
    admin = Admin(r, Settings())
    assert {row["id"] for row in admin.search(key="ingest")} == set(ingest)
    assert [row["id"] for row in admin.search(tier="high")] == [ops]
    assert [row["key"] for row in admin.search(text=ops[:12])] == ["ops"]
    assert admin.search(statuses=("failed",)) == []
