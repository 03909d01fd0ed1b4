"""One settings object: every engine parameter is a setting, every worker setting has an env var and a
flag that mean the same, bad values are refused at start with a message naming both, and the worker
prints its settings once (the Redis password masked)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxq.cli import build_parser
from mlxq.shared.settings import Settings, cache_dir, env_var, mask_url, worker_flags
from mlxq.cli.worker import settings_from_args
from workerkit import neutral_cwd


# A valid value other than the default for every `mlxq worker` setting, as written on a command line
# (a new setting needs one here: the test below fails until it has one).
SAMPLES = {
    "prefix": "other", "tier_offsets": "low=120", "max_queued_per_tier": "50", "lease_s": "12.5",
    "heartbeat_s": "0.5", "takeover_s": "6", "stall_s": "300", "max_attempts": "5", "result_ttl_s": "600", "gather_ms": "2.5", "idle_block_s": "0.25",
    "stats_interval_s": "0.5", "series_interval_s": "30", "max_new_tokens": "1000", "keep_dtype": True,
    "cpu_weights": "quantized", "grace_s": "4", "burst": True,
    "host_thread": False,
    "rq_queues": "mlxq-high,mlxq-low", "metrics_port": "9100", "metrics_host": "0.0.0.0", "max_batch": "6",
    "kv_memory_mb": "64", "kv_blocks": "40", "pressure": "0.5", "prefix_cache": False, "huge_pages": False, "chunked_prefill": False,
    "chunk_schedule": "256:64,*:32", "step_token_budget": "128", "decode_reserve_blocks": "2",
    "priority_gap": "2.5", "max_sequences": "32", "max_waiting": "3", "session_dir": "/tmp/mlxq-sessions",
    "attention": "gather", "matmul": "pool", "kv_bits": "8", "kv_group_size": "32",
    "speculate": "ngram", "speculate_k": "5", "draft_model": "/models/draft",
    "embed_pooling": "mean",
}
ONLY_DEFAULT = {"block_size"}  # one supported value: any other is refused (tested below)
WITH = {"draft_model": ("speculate", "draft")}  # a sample refused alone: set with this companion setting


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("MLXQ_") and name not in ("MLXQ_CACHE_DIR", "MLXQ_BLAS_THREADS"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_every_engine_field_is_a_setting_with_the_same_default():
    from mlxq.shared.engine_config import EngineConfig

    engine_fields = {f.metadata["engine"] for f in dataclasses.fields(Settings) if f.metadata["engine"]}
    assert engine_fields == {f.name for f in dataclasses.fields(EngineConfig)}, "EngineConfig's and Settings' differ"
    assert Settings().engine_config() == EngineConfig()  # the defaults agree


def test_every_worker_setting_has_a_sample():
    names = {f.name for f in worker_flags()}
    assert names == set(SAMPLES) | ONLY_DEFAULT


def _argv(f, value) -> list[str]:
    if f.is_bool:
        return [f.flag if value else "--no-" + f.flag[2:]]
    return [f.flag, value]


def _env_text(value) -> str:
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_env_var_and_flag_set_the_same_value(name, clean_env):
    f = next(f for f in worker_flags() if f.name == name)
    value = SAMPLES[name]
    env, argv = {env_var(name): _env_text(value)}, _argv(f, value)
    if name in WITH:
        other, other_value = WITH[name]
        env[env_var(other)] = other_value
        argv += ["--" + other.replace("_", "-"), other_value]
    from_env = getattr(Settings.from_env(env), name)
    args = build_parser().parse_args(["worker", "--model", "m", *argv])
    from_flag = getattr(settings_from_args(args), name)
    assert from_env == from_flag != getattr(Settings(), name)
    assert env_var(name) in f.help and "default" in f.help


def test_a_flag_wins_over_the_environment(clean_env):
    clean_env.setenv("MLXQ_MAX_BATCH", "3")
    clean_env.setenv("MLXQ_PRESSURE", "0.6")
    args = build_parser().parse_args(["worker", "--model", "m", "--max-batch", "5"])
    s = settings_from_args(args)
    assert (s.max_batch, s.pressure) == (5, 0.6)


def test_old_flags_and_env_vars_still_work(clean_env):
    clean_env.setenv("MLXQ_ATTENTION", "fused")
    args = build_parser().parse_args(["worker", "--model", "m", "--kv-memory-mb", "128", "--kv-blocks", "9",
                                      "--grace", "7", "--keep-dtype", "--burst", "--session-dir", "/s"])
    s = settings_from_args(args)
    assert (s.kv_memory_mb, s.kv_blocks, s.grace_s, s.keep_dtype, s.burst, s.session_dir, s.attention) == \
        (128.0, 9, 7.0, True, True, "/s", "fused")
    assert s.engine_config().memory_budget_bytes == 128 * 2**20


@pytest.mark.parametrize("env,words", [
    ({"MLXQ_MAX_BATCH": "lots"}, "MLXQ_MAX_BATCH='lots': expected an integer"),
    ({"MLXQ_PREFIX_CACHE": "maybe"}, "MLXQ_PREFIX_CACHE='maybe': expected on/off"),
    ({"MLXQ_PRESSURE": "1.5"}, "pressure=1.5 (MLXQ_PRESSURE / --pressure): must be a share of the pool"),
    ({"MLXQ_BLOCK_SIZE": "16"}, "only 32-token blocks are supported"),
    ({"MLXQ_ATTENTION": "fast"}, "must be one of auto, fused, gather"),
    ({"MLXQ_SPECULATE": "medusa"},
     "speculate='medusa' (MLXQ_SPECULATE / --speculate): must be one of auto, off, ngram, draft"),
    ({"MLXQ_SPECULATE": "draft"}, "draft needs a draft model (--draft-model PATH)"),
    ({"MLXQ_DRAFT_MODEL": "/models/draft"},
     "draft_model='/models/draft' (MLXQ_DRAFT_MODEL / --draft-model): is read by --speculate draft only (here: auto)"),
    ({"MLXQ_CHUNK_SCHEDULE": "*:64,512:128"}, "increasing positions"),
    ({"MLXQ_HEARTBEAT_S": "40"}, "heartbeat_s must be shorter than lease_s"),
    # each of these was accepted and then broke the worker or lost data
    ({"MLXQ_IDLE_BLOCK_S": "-1"}, "idle_block_s=-1.0 (MLXQ_IDLE_BLOCK_S / --idle-block-s): must be above 0"),
    ({"MLXQ_IDLE_BLOCK_S": "0"}, "must be above 0 and at most 10"),
    ({"MLXQ_COMPLETION_WINDOWS": "24h,1w"}, "completion_windows='24h,1w' (MLXQ_COMPLETION_WINDOWS / --completion-windows): must be comma-separated durations"),
    ({"MLXQ_FILES_DIR": "/nonexistent/mlxq-files"}, "files_dir='/nonexistent/mlxq-files' (MLXQ_FILES_DIR / --files-dir): must be an existing directory"),
    ({"MLXQ_IDLE_BLOCK_S": "30"}, "must be above 0 and at most 10"),
    ({"MLXQ_RESULT_TTL_S": "0"}, "result_ttl_s=0 (MLXQ_RESULT_TTL_S / --result-ttl-s): must be at least 1"),
    ({"MLXQ_IDEMPOTENCY_TTL_S": "0"}, "idempotency_ttl_s=0 (MLXQ_IDEMPOTENCY_TTL_S / --idempotency-ttl-s): must be at least 1"),
    ({"MLXQ_HEARTBEAT_S": "0"}, "heartbeat_s=0.0 (MLXQ_HEARTBEAT_S / --heartbeat-s): must be positive"),
    ({"MLXQ_STATS_INTERVAL_S": "-2"}, "stats_interval_s=-2.0 (MLXQ_STATS_INTERVAL_S / --stats-interval-s): must be"),
    ({"MLXQ_TIER_OFFSETS": "high=nan"}, "offsets must be finite numbers"),
    ({"MLXQ_METRICS_PORT": "0"}, "must be a port number, 1 to 65535"),
    ({"MLXQ_TAKEOVER_S": "1"}, "takeover_s=1.0 (MLXQ_TAKEOVER_S / --takeover-s): must be longer than heartbeat_s"),
    ({"MLXQ_STALL_S": "0"}, "stall_s=0.0 (MLXQ_STALL_S / --stall-s): must be a positive number of seconds"),
    ({"MLXQ_STALL_S": "-5"}, "stall_s=-5.0"),
    ({"MLXQ_STALL_S": "inf"}, "must be a positive number of seconds"),
])
def test_a_bad_value_is_refused_with_a_clear_message(env, words):
    with pytest.raises(ValueError) as err:
        Settings.from_env(env)
    assert words in str(err.value)


def test_a_misspelt_variable_is_reported(caplog):
    with caplog.at_level("WARNING", logger="mlxq.shared.settings"):
        s = Settings.from_env({"MLXQ_LEASE": "60", "MLXQ_LEASE_S": "60", "MLXQ_CACHE_DIR": "/c", "MLXQ_BLAS": "off"})
    assert s.lease_s == 60.0
    assert [r.getMessage() for r in caplog.records if "unknown MLXQ_" in r.getMessage()] == [
        "unknown MLXQ_ variables ignored: MLXQ_LEASE (the settings' variables are in `mlxq worker --help` "
        "and docs/reference/settings.md)"]


def _worker(env_extra: dict, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXQ_") or k == "MLXQ_CACHE_DIR"}
    env.update(env_extra)
    cmd = [sys.executable, "-m", "mlxq", "--log-level", "INFO", "worker", "--model", "/no/such/model", *argv]
    return subprocess.run(cmd, cwd=neutral_cwd(), env=env, capture_output=True, text=True, timeout=120)


def test_the_worker_refuses_a_bad_setting_before_it_loads_anything():
    out = _worker({"MLXQ_PRESSURE": "2"}, "--redis-url", "redis://127.0.0.1:1/0")
    assert out.returncode == 2, out.stderr
    assert "mlxq worker: pressure=2.0 (MLXQ_PRESSURE / --pressure)" in out.stderr
    assert "Traceback" not in out.stderr and "/no/such/model" not in out.stderr
    out = _worker({}, "--redis-url", "redis://127.0.0.1:1/0", "--max-batch", "none")
    assert out.returncode == 2 and "argument --max-batch: expected an integer, got 'none'" in out.stderr


def test_the_worker_logs_its_settings_once_with_the_password_masked():
    out = _worker({"MLXQ_MAX_BATCH": "3", "MLXQ_RQ_API_KEY": "rq-key-s3cret"},
                  "--redis-url", "redis://app:s3cret@127.0.0.1:1/0", "--kv-blocks", "50")
    lines = [line for line in out.stderr.splitlines() if "settings: " in line]
    assert len(lines) == 1, out.stderr
    assert "max_batch=3" in lines[0] and "kv_blocks=50" in lines[0] and "attention=auto" in lines[0]
    assert "s3cret" not in out.stderr and "redis://app:***@127.0.0.1:1/0" in lines[0]
    assert "rq_api_key=***" in lines[0]


def test_mask_url():
    assert mask_url("rediss://:pw@h:6380/1") == "rediss://:***@h:6380/1"
    assert mask_url("redis://h:6379/0") == "redis://h:6379/0"
    assert mask_url(None) is None


def test_cache_dir(monkeypatch):
    monkeypatch.setenv("MLXQ_CACHE_DIR", "/tmp/somewhere")
    assert cache_dir() == Path("/tmp/somewhere")
    monkeypatch.delenv("MLXQ_CACHE_DIR")
    assert cache_dir() == Path.home() / ".cache" / "mlxq"


def test_make_engine_follows_the_settings(tiny_model):
    from mlxq.worker.engine.engine import make_engine

    s = Settings(kv_blocks=20, max_batch=3, prefix_cache=False, step_token_budget=64, attention="gather")
    eng = make_engine(tiny_model, s)
    cfg = eng.scheduler.config
    assert eng.bm.num_blocks == 20 and eng.attention.name == "gather"
    assert (cfg.max_batch, cfg.prefix_cache, cfg.step_token_budget) == (3, False, 64)
    assert eng.scheduler.eos_token_ids == frozenset(tiny_model.eos_token_ids)
    eng2 = make_engine(tiny_model, dataclasses.replace(s, kv_blocks=None, kv_memory_mb=1))
    assert eng2.bm.num_blocks == 2**20 // eng2.kv_shape.bytes_per_block(32)


def test_importing_the_worker_loads_no_blas_and_no_mlx():
    """The fast BLAS is loaded by the worker's entry points (and the tests' conftest), not as a side
    effect of an import."""
    script = ("import sys\nimport mlxq.worker, mlxq.cli.worker, mlxq.cli\n"
              "from mlxq.worker import blas\nmlxq.cli.build_parser()\n"
              "assert blas.status() is None and 'mlx.core' not in sys.modules\nprint('ok')\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=neutral_cwd(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
