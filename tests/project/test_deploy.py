"""The deployment recipes under deploy/, checked offline: the systemd units with
``systemd-analyze verify`` (skipped where it is missing), the launchd plists as plists with the keys
launchd needs, the Kubernetes manifests against the Kubernetes API's own schemas (the ones the
kubernetes-validate package ships), and every ``mlxq`` command line in them with the real CLI parser."""

from __future__ import annotations

import configparser
import plistlib
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from composekit import mlxq_invocations, parse_mlxq

from repokit import ROOT
DEPLOY = ROOT / "deploy"
MLXQ_BIN = "/opt/mlxq/bin/mlxq"


# -- systemd -------------------------------------------------------------------------------------------------

def unit(name: str) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False)  # EnvironmentFile= repeats
    parser.optionxform = str
    parser.read_string((DEPLOY / "systemd" / name).read_text())
    return parser


def directives(path: Path, key: str) -> list[str]:
    """Every value of a directive that may repeat (configparser keeps the last)."""
    return [ln.split("=", 1)[1] for ln in path.read_text().splitlines() if ln.startswith(key + "=")]


def test_systemd_units_verify(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here")
    # verify checks that ExecStart's program exists: point it at a stand-in for the installed mlxq
    stand_in = tmp_path / "mlxq"
    stand_in.write_text("#!/bin/sh\n")
    stand_in.chmod(0o755)
    for path in (DEPLOY / "systemd").glob("*.service"):
        (tmp_path / path.name).write_text(path.read_text().replace(MLXQ_BIN, str(stand_in)))
    out = subprocess.run(["systemd-analyze", "verify", "--man=no", str(tmp_path / "mlxq-worker@smollm2.service"),
                          str(tmp_path / "mlxq-gateway.service")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr


def test_worker_unit_is_a_template_restarted_on_failure():
    worker = unit("mlxq-worker@.service")["Service"]
    assert worker["Restart"] == "on-failure"  # a stuck worker exits 70
    assert worker["KillMode"] == "mixed" and int(worker["TimeoutStopSec"]) > 30  # the warm shutdown's grace
    path = DEPLOY / "systemd" / "mlxq-worker@.service"
    assert directives(path, "Environment") == ["QUEUE=%i", "MLXQ_CACHE_DIR=/var/cache/mlxq"]
    # the queue: the instance's name, unless its file says otherwise (files win over Environment=)
    assert directives(path, "EnvironmentFile") == ["/etc/mlxq/mlxq.env", "/etc/mlxq/worker-%i.env"]
    argv = worker["ExecStart"].replace("${MODEL}", "/srv/models/smollm2").replace("${QUEUE}", "smollm2").split()
    assert argv[0] == MLXQ_BIN
    args = parse_mlxq(argv)
    assert (args.command, args.model, args.queue) == ("worker", "/srv/models/smollm2", "smollm2")
    gateway = unit("mlxq-gateway.service")["Service"]
    assert gateway["Restart"] == "on-failure"
    assert parse_mlxq(gateway["ExecStart"].split()).command == "gateway"


# -- launchd ---------------------------------------------------------------------------------------------------

# launchd.plist(5): the keys these files use, and their types
LAUNCHD_KEYS = {"Label": str, "ProgramArguments": list, "Program": str, "UserName": str, "RunAtLoad": bool,
                "KeepAlive": (bool, dict), "ThrottleInterval": int, "ExitTimeOut": int,
                "StandardOutPath": str, "StandardErrorPath": str, "EnvironmentVariables": dict,
                "WorkingDirectory": str}


@pytest.mark.parametrize("name", ["com.mlxq.worker.plist", "com.mlxq.gateway.plist"])
def test_launchd_plists(name):
    with open(DEPLOY / "launchd" / name, "rb") as f:
        plist = plistlib.load(f)
    assert plist["Label"] == name.removesuffix(".plist")  # the one key launchd requires, by convention the name
    assert "ProgramArguments" in plist or "Program" in plist  # and what to run
    assert set(plist) <= set(LAUNCHD_KEYS), set(plist) - set(LAUNCHD_KEYS)
    for key, value in plist.items():
        assert isinstance(value, LAUNCHD_KEYS[key]), key
    assert all(isinstance(a, str) for a in plist["ProgramArguments"])
    assert plist["KeepAlive"] == {"SuccessfulExit": False}  # restarted after a non-zero exit (70: stuck)
    (argv,) = mlxq_invocations(plist["ProgramArguments"])
    args = parse_mlxq([a.replace('"$MODEL"', "/m").replace('"$QUEUE"', "q") for a in argv])
    assert args.command == name.split(".")[2]


# -- Kubernetes ------------------------------------------------------------------------------------------------



def manifests() -> dict[tuple[str, str], dict]:
    out = {}
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            out[doc["kind"], doc["metadata"]["name"]] = doc
    return out


def test_manifests_validate_against_the_kubernetes_schemas():
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    docs = manifests()
    assert set(docs) == {("Deployment", "mlxq-worker-smollm2"), ("Deployment", "mlxq-gateway"),
                         ("Service", "mlxq-gateway"), ("HorizontalPodAutoscaler", "mlxq-worker-smollm2"),
                         ("ConfigMap", "adapter-config")}
    for doc in docs.values():
        # an old release still in common use, and the newest the package has schemas for; strict: an
        # unknown field (a misspelt key) fails too
        for version in ("1.29", latest_version()):
            kubernetes_validate.validate(doc, version, strict=True)


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def probe(c: dict, kind: str) -> tuple[str, int]:
    get = c[kind]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    return get["path"], ports[get["port"]]


def test_manifests_are_wired_together():
    docs = manifests()
    worker, gateway = docs["Deployment", "mlxq-worker-smollm2"], docs["Deployment", "mlxq-gateway"]
    for d in (worker, gateway):
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert d["spec"]["selector"]["matchLabels"].items() <= labels.items()
        env = {e["name"]: e for e in container(d)["env"]}
        assert env["MLXQ_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "mlxq-redis", "key": "url"}

    w = container(worker)
    args = parse_mlxq(w["command"])
    assert (args.command, args.metrics_host) == ("worker", "0.0.0.0")
    assert probe(w, "livenessProbe") == probe(w, "startupProbe") == ("/health", args.metrics_port)
    assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 30
    for var in ("MLXQ_BLAS_THREADS", "MLXQ_ATTN_THREADS"):
        ref = {e["name"]: e for e in w["env"]}[var]["valueFrom"]["resourceFieldRef"]
        assert ref["resource"] == "limits.cpu" and ref["containerName"] == w["name"]

    g = container(gateway)
    gw = parse_mlxq(g["command"])
    assert gw.command == "gateway" and gw.host == "0.0.0.0"
    assert probe(g, "livenessProbe") == ("/health", gw.port)
    assert probe(g, "readinessProbe") == ("/ready", gw.port)
    service = docs["Service", "mlxq-gateway"]
    assert service["spec"]["selector"].items() <= gateway["spec"]["template"]["metadata"]["labels"].items()
    assert {p["name"] for p in g["ports"]} >= {p["targetPort"] for p in service["spec"]["ports"]}


def test_autoscaling_follows_the_queue_depth_of_its_model():
    docs = manifests()
    hpa = docs["HorizontalPodAutoscaler", "mlxq-worker-smollm2"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "mlxq-worker-smollm2"}
    (metric,) = hpa["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"] == {"name": "mlxq_queue_depth", "selector": {"matchLabels": {"model": "smollm2"}}}
    worker = parse_mlxq(container(docs["Deployment", "mlxq-worker-smollm2"])["command"])
    assert worker.queue == "smollm2"  # the queue the metric's model label names
    rules = yaml.safe_load(docs["ConfigMap", "adapter-config"]["data"]["config.yaml"])
    (rule,) = rules["externalRules"]
    assert rule["name"]["as"] == "mlxq_queue_depth" and rule["seriesQuery"].startswith("mlxq_queue_depth{")
    assert "<<.Series>>{<<.LabelMatchers>>}" in rule["metricsQuery"]
