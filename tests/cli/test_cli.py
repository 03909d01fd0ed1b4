"""The command line as people type it: shared options before or after the command, key rules in --help."""

from __future__ import annotations

import io

import pytest
import redis

from mlxq.cli import build_parser, main
from mlxq.shared import apikeys
from mlxq.shared.keys import GlobalKeys

# every command with its required arguments, and which shared options it takes
COMMANDS = [
    (["worker", "--model", "/models/tiny"], ("redis_url",)),
    (["submit", "hello"], ("redis_url", "queue", "model", "api_key")),
    (["stats"], ("redis_url",)),
    (["keys", "add", "--tier", "low"], ("redis_url",)),
    (["keys", "create", "--name", "ci", "--tier", "low"], ("redis_url",)),
    (["keys", "revoke", "--name", "ci"], ("redis_url",)),
    (["keys", "list"], ("redis_url",)),
    (["make-model", "/tmp/m"], ()),
    (["demo"], ("redis_url", "model")),
    (["gateway"], ("redis_url",)),
    (["batch", "in.jsonl", "-o", "out.jsonl"], ("redis_url", "queue", "model", "api_key")),
    (["jobs", "list"], ("redis_url", "queue")),
    (["jobs", "show", "0" * 32], ("redis_url", "queue", "api_key")),
    (["build-ext"], ()),
    (["tiers"], ("redis_url",)),
    (["acl-producer", "u"], ()),
]
VALUES = {"redis_url": ("--redis-url", "redis://h:1/0"), "model": ("--model", "m1"), "api_key": ("--api-key", "k" * 9),
          "queue": ("--queue", "q1")}


@pytest.mark.parametrize("argv,shared", COMMANDS, ids=[" ".join(c[0][:2]) for c in COMMANDS])
def test_shared_options_work_before_or_after_every_command(argv, shared, monkeypatch):
    for var in ("MLXQ_REDIS_URL", "MLXQ_API_KEY", "MLXQ_LOG_LEVEL", "MLXQ_MODEL"):
        monkeypatch.delenv(var, raising=False)
    opts = ["--log-level", "DEBUG"]
    for name in shared:
        if not (argv[0] == "worker" and name == "model"):
            opts += list(VALUES[name])
    parser = build_parser()
    before, after = parser.parse_args(opts + argv), parser.parse_args(argv + opts)
    mixed = parser.parse_args(argv[:1] + opts + argv[1:]) if argv[0] not in ("keys", "jobs") else \
        parser.parse_args(argv[:2] + opts + argv[2:])  # `keys add --redis-url URL KEY ...`
    for ns in (before, after, mixed):
        assert ns.log_level == "DEBUG"
        for name in shared:
            expected = "/models/tiny" if (argv[0] == "worker" and name == "model") else VALUES[name][1]
            assert getattr(ns, name) == expected, (name, ns)
    # defaults when not given: the environment
    monkeypatch.setenv("MLXQ_REDIS_URL", "redis://env:2/0")
    ns = parser.parse_args(argv)
    assert ns.log_level == "INFO"
    if "redis_url" in shared:
        assert ns.redis_url == "redis://env:2/0"


def test_an_option_a_command_has_no_use_for_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--model", "m1", "keys", "list"])
    assert exc.value.code == 2
    assert "--model does not apply to `mlxq keys list`" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker"])
    assert "needs --model" in capsys.readouterr().err


def test_keys_add_with_the_url_after_the_command(redis_url, capsys, monkeypatch):
    """The report: `mlxq keys add KEY --tier low --redis-url URL` failed with "unrecognized arguments"
    (the key now comes on stdin)."""
    assert main(["keys", "list", "--redis-url", redis_url]) == 0
    assert "OPEN" in capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO("a-long-enough-key\n"))
    assert main(["keys", "add", "--tier", "low", "--redis-url", redis_url]) == 0
    assert main(["--redis-url", redis_url, "keys", "list"]) == 0
    assert "low" in capsys.readouterr().out
    r = redis.Redis.from_url(redis_url)
    assert apikeys.resolve_tier(r, GlobalKeys().api_keys, "a-long-enough-key") == "low"
    monkeypatch.setattr("sys.stdin", io.StringIO("a-long-enough-key\n"))
    assert main(["keys", "--redis-url", redis_url, "revoke"]) == 0
    assert "revoked" in capsys.readouterr().out
    monkeypatch.setenv("SHORT_KEY", "short")
    assert main(["keys", "add", "--key-env", "SHORT_KEY", "--tier", "low", "--redis-url", redis_url]) == 2
    assert "at least 8 characters" in capsys.readouterr().err
    r.close()


def test_admin_commands_follow_the_deployments_prefix(redis_url, capsys, monkeypatch):
    """keys, tiers, stats and acl-producer write and read under MLXQ_PREFIX, where the workers look."""
    monkeypatch.setenv("MLXQ_PREFIX", "acme")
    r = redis.Redis.from_url(redis_url)
    monkeypatch.setenv("ACME_KEY", "an-acme-prefixed-key")
    assert main(["keys", "add", "--key-env", "ACME_KEY", "--tier", "high", "--redis-url", redis_url]) == 0
    assert apikeys.resolve_tier(r, GlobalKeys("acme").api_keys, "an-acme-prefixed-key") == "high"
    assert not r.exists(GlobalKeys().api_keys)  # nothing under the default prefix
    assert main(["tiers", "--max-queued", "77", "--redis-url", redis_url]) == 0
    assert apikeys.get_policy(r, GlobalKeys("acme"))["max_queued"] == 77
    r.hset(GlobalKeys("acme").models, "acme-model", b"")
    capsys.readouterr()
    assert main(["stats", "--json", "--redis-url", redis_url]) == 0
    assert "acme-model" in capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO("a-long-password\n"))
    assert main(["acl-producer", "u"]) == 0
    assert "%R~acme:models" in capsys.readouterr().out
    r.close()


def test_key_rules_are_in_the_help(capsys):
    for argv in (["keys", "--help"], ["keys", "add", "--help"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        out = capsys.readouterr().out
        assert "at least 8 characters" in out and "open mode" in out and "revoked" in out.lower()
        assert "--anonymous" in out
