"""docker-compose.yml and the Dockerfile, checked without Docker (it cannot run here): the YAML
parses, the services are wired together, and every ``mlxq`` command line in it parses with the
real CLI parser, so a renamed flag breaks this test rather than the deployment."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from mlxq.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def mlxq_invocations(command) -> list[list[str]]:
    """Each ``mlxq ...`` argv in a service command (a list, or ``sh -c "a && exec b"``)."""
    if command[:2] == ["sh", "-c"]:
        out = []
        for part in command[2].split("&&"):
            argv = shlex.split(part)
            argv = argv[1:] if argv and argv[0] == "exec" else argv
            out.append(argv)
        return [a for a in out if a and a[0] == "mlxq"]
    return [command] if command[0] == "mlxq" else []


def test_services_and_wiring():
    c = compose()
    services = c["services"]
    assert set(services) == {"redis", "worker", "gateway", "prometheus"}
    assert services["redis"]["image"].startswith(("valkey/valkey", "redis"))
    for name in ("worker", "gateway"):
        svc = services[name]
        assert svc["build"] == "."
        assert svc["environment"]["MLXQ_REDIS_URL"] == "redis://redis:6379/0"
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["gateway"]["ports"] == ["8000:8000"]
    assert services["prometheus"]["profiles"] == ["metrics"]
    assert set(c["volumes"]) >= {"models"}


def test_every_mlxq_command_parses_with_the_cli():
    parser = build_parser()
    services = compose()["services"]
    worker_cmds = mlxq_invocations(services["worker"]["command"])
    assert [a[1] for a in worker_cmds] == ["make-model", "worker"]
    make, work = (parser.parse_args(a[1:]) for a in worker_cmds)
    assert make.dir == "/models/tiny" and work.model == "/models/tiny"
    assert work.rq_queues == "mlxq-high,mlxq-normal,mlxq-low" and work.metrics_port == 9100
    (gw_cmd,) = mlxq_invocations(services["gateway"]["command"])
    gw = parser.parse_args(gw_cmd[1:])
    assert gw.command == "gateway" and gw.host == "0.0.0.0" and gw.port == 8000


def test_prometheus_scrapes_the_ports_the_services_serve():
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {"worker:9100", "gateway:8000"}
    mount = compose()["services"]["prometheus"]["volumes"][0]
    assert mount.split(":")[0] == "./deploy/prometheus.yml"


def test_dockerfile_installs_the_package():
    lines = [ln.strip() for ln in (ROOT / "Dockerfile").read_text().splitlines()]
    assert "FROM python:3.11-slim" in lines
    assert any(ln.startswith("RUN pip install '.[worker,gateway]'") for ln in lines)  # both extras: one image
    workdirs = [ln.split()[1] for ln in lines if ln.startswith("WORKDIR")]
    assert workdirs and workdirs[-1] != workdirs[0], "the image runs from a directory without the sources"
    copied = {ln.split()[1] for ln in lines if ln.startswith("COPY")}
    assert {"pyproject.toml", "shared", "producer", "worker", "mlxq"} <= copied
