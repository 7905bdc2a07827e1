"""Deployment artifacts, validated offline (no cluster here; scripts/image-check runs the image
and the compose file for real).

- helm/dedupworker is rendered with helm-python-sdk (the Helm Go SDK, no helm binary) with the
  default values and with every optional part on; every manifest is checked against the
  Kubernetes API schemas by kubernetes-validate in strict mode (only the CRDs ServiceMonitor,
  PrometheusRule and ScaledObject have no schema there); the chart lints clean and
  values.schema.json accepts the values and rejects typos; templates name only values that
  values.yaml defines.
- docker-compose.yml is validated with compose-spec, and every dedupworker command in it is
  parsed by the real CLI parser with the service's environment, its handlers imported.
- The Grafana dashboard and the Prometheus alert rules are parsed (PromQL by promql-parser) and
  every metric they name must be in docs/metrics.md and exported by a real worker: the
  compose file's postgres worker command, run by the real entrypoint against a real PostgreSQL
  and fed by the compose producer, is scraped; it also answers the Dockerfile's HEALTHCHECK
  and drains on SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import compose_spec
import helm_python
import kubernetes_validate
import promql_parser
import psycopg
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, latest_version
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from dedupworker.handler import Handler, validate_handler
from dedupworker.loading import load_class
from dedupworker.observe import metrics
from dedupworker.ops.cli import main as cli
from dedupworker.process.singleton import Singleton
from tests.conftest import ROOT, clean_env

CHART = ROOT / "helm" / "dedupworker"
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "dedupworker.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
PRODUCER = ROOT / "deploy" / "producer" / "produce.py"
ELASTICMQ = ROOT / "deploy" / "elasticmq" / "elasticmq.conf"
METRICS_DOC = ROOT / "docs" / "metrics.md"

# The chart's oldest supported Kubernetes (Chart.yaml kubeVersion) and the newest schemas.
KUBE_VERSIONS = ("1.25.0", latest_version())
CRD_KINDS = {"ServiceMonitor", "PrometheusRule", "ScaledObject"}
RELEASE, NAMESPACE = "rel", "apps"
IMAGE = "dedupworker:local"  # the compose services that run the repository's image

EVERYTHING: dict[str, Any] = {
    "image": {"repository": "registry.example.com/team/dedupworker", "tag": "0.1.0"},
    "imagePullSecrets": [{"name": "registry"}],
    "database": {"existingSecret": "app-db", "existingSecretKey": "url"},
    "config": {
        "logLevel": "DEBUG",
        "pgbouncer": True,
        "extra": {"DEDUPWORKER_LEDGER_RETENTION": "86400"},
    },
    "extraEnv": [{"name": "AWS_REGION", "value": "eu-west-1"}],
    "extraEnvFrom": [{"secretRef": {"name": "aws-credentials"}}],
    "serviceAccount": {
        "annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/worker"}
    },
    "metrics": {
        "service": {"annotations": {"prometheus.io/scrape": "true"}},
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}},
    },
    "dashboard": {"enabled": True, "annotations": {"grafana_folder": "dedupworker"}},
    "workers": [
        {
            "name": "payments",
            "handlers": ["examples.balances:ApplyPayment"],
            "queue": "payments",
            "concurrency": 8,
            "shutdownTimeout": 42.5,
            "extraArgs": ["--poll-interval", "2"],
            "autoscaling": {"enabled": True, "maxReplicas": 6},
            "podDisruptionBudget": {"maxUnavailable": "25%"},
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "tolerations": [{"key": "workers", "operator": "Exists", "effect": "NoSchedule"}],
            "topologySpreadConstraints": [
                {
                    "maxSkew": 1,
                    "topologyKey": "topology.kubernetes.io/zone",
                    "whenUnsatisfiable": "ScheduleAnyway",
                    "labelSelector": {"matchLabels": {"dedupworker/worker": "payments"}},
                }
            ],
            "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}},
        },
        {
            "name": "recorder",
            "handlers": ["examples.recorder:RecordCalls"],
            "queue": "recorder",
            "keda": {"enabled": True, "minReplicaCount": 0, "target": 50},
            "env": {"DEDUPWORKER_POLL_INTERVAL": "5"},
        },
        {
            "name": "events",
            "handlers": ["examples.recorder:RecordCalls"],
            "transport": "kafka",
            "queue": "events",
            "kafka": {
                "bootstrapServers": "kafka-0.kafka:9092,kafka-1.kafka:9092",
                "options": {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN"},
                "deadLetter": "events.dead",
            },
            "keda": {"enabled": True, "authenticationRef": "kafka-auth"},
            "podDisruptionBudget": {"enabled": False},
        },
        {
            "name": "orders",
            "handlers": ["examples.sqs_fifo:RecordByGroup"],
            "transport": "sqs",
            "queue": "https://sqs.eu-west-1.amazonaws.com/123456789012/orders.fifo",
            "replicas": 0,
            "sqs": {
                "visibilityTimeout": 120,
                "deadLetter": "https://sqs.eu-west-1.amazonaws.com/123456789012/orders-dlq.fifo",
            },
            "keda": {"enabled": True, "awsRegion": "eu-west-1"},
        },
    ],
}
CASES = {"defaults": None, "dsn": {"database": {"dsn": "postgresql://app:pw@db/app"}}}
CASES["everything"] = EVERYTHING


# --- helpers ---------------------------------------------------------------------------------


def load_chart() -> helm_python.Chart:
    return helm_python.Chart.load(CHART)


def render(values: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The chart's manifests (NOTES.txt aside) as dicts, each with its template in `_source`."""
    with load_chart() as chart:
        out = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    manifests = []
    for source, text in sorted(out.items()):
        if source.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                manifests.append({**doc, "_source": source})
    return manifests


def notes(values: dict[str, Any] | None) -> str:
    with load_chart() as chart:
        out = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return next(text for source, text in out.items() if source.endswith("NOTES.txt"))


def of_kind(manifests: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [m for m in manifests if m["kind"] == kind]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container["env"]}


def lookup(tree: Any, path: list[str]) -> bool:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return False
        tree = tree[key]
    return True


VALUES_REF = re.compile(r"\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
WORKER_REF = re.compile(r"\$w((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


def undefined_values(template: str, values: dict[str, Any]) -> list[str]:
    """`.Values.a.b` paths, and `$w.a.b` worker settings, that values.yaml does not define.

    `$w` is a worker: workerDefaults overridden by one entry of `workers`, so its keys are
    workerDefaults' or those every entry of `workers` has (name, handlers).
    """
    missing = []
    for match in VALUES_REF.finditer(template):
        path = match.group(1).strip(".").split(".")
        if not lookup(values, path):
            missing.append(".Values." + ".".join(path))
    for match in WORKER_REF.finditer(template):
        path = match.group(1).strip(".").split(".")
        in_every_entry = all(lookup(entry, path) for entry in values["workers"])
        if not (lookup(values["workerDefaults"], path) or in_every_entry):
            missing.append("$w." + ".".join(path))
    return missing


def cli_parsers() -> dict[str, argparse.ArgumentParser]:
    """The top-level parser ("") and each (sub)command's, e.g. "run", "dead list"."""
    found: dict[str, argparse.ArgumentParser] = {}

    def visit(prefix: str, parser: argparse.ArgumentParser) -> None:
        found[prefix] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    visit(f"{prefix} {name}".strip(), sub)

    visit("", cli.build_parser())
    return found


ENV_IN_HELP = re.compile(r"\[env:\s+(DEDUPWORKER_[A-Z_]+)")


def cli_env_names(command: list[str]) -> set[str]:
    """The DEDUPWORKER_* variables that `dedupworker COMMAND --help` names (and global ones)."""
    parsers = cli_parsers()
    names = set(ENV_IN_HELP.findall(parsers[""].format_help()))
    words = [word for word in command if not word.startswith("-")]
    for depth in (2, 1):
        key = " ".join(words[:depth])
        if key in parsers and key:
            names |= set(ENV_IN_HELP.findall(parsers[key].format_help()))
            break
    return names


def parse_cli(argv: list[str], env: dict[str, str]) -> argparse.Namespace:
    """Parse a dedupworker command line the way the CLI would with this environment."""
    stderr = io.StringIO()
    with mock.patch.dict(os.environ, env, clear=True), contextlib.redirect_stderr(stderr):
        try:
            args = cli.build_parser().parse_args(argv)
            if args.command == "run":
                args.config = cli._config(args)  # the CLI's own validation
        except SystemExit:
            pytest.fail(f"dedupworker {shlex.join(argv)} is refused: {stderr.getvalue()}")
    return args


def check_handlers(paths: list[str]) -> None:
    for path in paths:
        loaded = load_class(path, (Handler, Singleton))
        if isinstance(loaded, Handler):
            validate_handler(loaded)


def check_run_command(argv: list[str], env: dict[str, str], where: str) -> argparse.Namespace:
    unknown = {name for name in env if name.startswith("DEDUPWORKER_")} - cli_env_names(argv)
    assert not unknown, f"{where}: the CLI does not read {sorted(unknown)}"
    args = parse_cli(argv, env)
    if args.command == "run":
        assert args.transport in ("postgres", "sqs", "kafka")
        check_handlers(args.handlers)
    return args


# --- the helm chart --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def values_yaml() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    return values


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    name: str = request.param
    return name, render(CASES[name])


def test_every_manifest_validates_against_the_kubernetes_schemas(
    case: tuple[str, list[dict[str, Any]]],
) -> None:
    _, manifests = case
    assert manifests
    for manifest in manifests:
        resource = {k: v for k, v in manifest.items() if k != "_source"}
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(resource, version, strict=True)
            except SchemaNotFoundError:
                # Only CRDs may lack a schema (kubernetes-validate warns for them).
                assert manifest["kind"] in CRD_KINDS, manifest["_source"]
            except kubernetes_validate.ValidationError as exc:
                path = ".".join(str(part) for part in exc.path)
                pytest.fail(f"{manifest['_source']} ({version}): {path}: {exc.message}")
        assert manifest["metadata"]["namespace"] == NAMESPACE, manifest["_source"]


def test_default_and_every_optional_part_render() -> None:
    kinds = sorted(m["kind"] for m in render(None))
    assert kinds == sorted(
        [
            "ConfigMap",  # DEDUPWORKER_* settings
            "ConfigMap",  # the dashboard
            "Deployment",
            "Job",  # migrate hook
            "PodDisruptionBudget",
            "Secret",  # the DSN
            "Secret",  # the DSN for the hook
            "Service",
            "ServiceAccount",
        ]
    )
    everything = render(EVERYTHING)
    count = {kind: len(of_kind(everything, kind)) for kind in {m["kind"] for m in everything}}
    assert count == {
        "ConfigMap": 2,
        "Deployment": 4,
        "HorizontalPodAutoscaler": 1,
        "Job": 1,
        "PodDisruptionBudget": 3,
        "PrometheusRule": 1,
        "ScaledObject": 3,
        "Service": 1,
        "ServiceAccount": 1,
        "ServiceMonitor": 1,
    }, "existingSecret: the chart makes no Secret"


def test_deployments_run_the_cli_with_probes_drain_and_a_locked_down_pod(
    case: tuple[str, list[dict[str, Any]]],
) -> None:
    name, manifests = case
    (config,) = [m for m in of_kind(manifests, "ConfigMap") if "dashboard" not in m["_source"]]
    port = int(config["data"]["DEDUPWORKER_METRICS_PORT"])
    workers = (CASES[name] or {}).get("workers") or [{"name": "recorder"}]
    deployments = of_kind(manifests, "Deployment")
    assert len(deployments) == len(workers)
    for deployment in deployments:
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        env = env_of(container)
        # The drain deadline fits in the grace period, with a margin for closing up.
        shutdown = float(env["DEDUPWORKER_SHUTDOWN_TIMEOUT"])
        assert pod["terminationGracePeriodSeconds"] >= shutdown + 5
        # Probes on the worker's endpoints, on the port the worker serves them on.
        (metrics_port,) = container["ports"]
        assert (metrics_port["name"], metrics_port["containerPort"]) == ("metrics", port)
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert container["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
        # Non-root, read-only root filesystem, nothing to escalate; /tmp is writable.
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] is True
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"]["drop"] == ["ALL"]
        assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
        assert pod["automountServiceAccountToken"] is False
        # The DSN only ever comes from a Secret.
        secret_ref = env["DEDUPWORKER_DSN"]["secretKeyRef"]
        if name == "everything":
            assert secret_ref == {"name": "app-db", "key": "url"}
        else:
            secret = of_kind(manifests, "Secret")
            assert secret_ref["name"] in {s["metadata"]["name"] for s in secret}
        # The command line and its DEDUPWORKER_* environment are the CLI's.
        plain = {k: str(v) for k, v in env.items() if isinstance(v, str)}
        cli_env = {**config["data"], **plain, "DEDUPWORKER_DSN": "postgresql://placeholder/db"}
        args = check_run_command(container["args"], cli_env, deployment["metadata"]["name"])
        assert args.metrics_port == port
        labels = deployment["spec"]["selector"]["matchLabels"]
        assert labels.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_every_worker_setting_reaches_the_worker() -> None:
    deployments = {d["metadata"]["name"]: d for d in of_kind(render(EVERYTHING), "Deployment")}
    pods = {name: d["spec"]["template"]["spec"] for name, d in deployments.items()}
    env = {name: env_of(pod["containers"][0]) for name, pod in pods.items()}

    payments = env["rel-dedupworker-payments"]
    assert payments["DEDUPWORKER_CONCURRENCY"] == "8"
    assert payments["DEDUPWORKER_SHUTDOWN_TIMEOUT"] == "42.5"
    assert pods["rel-dedupworker-payments"]["terminationGracePeriodSeconds"] == 43 + 15
    assert "replicas" not in deployments["rel-dedupworker-payments"]["spec"], "the HPA owns it"
    assert pods["rel-dedupworker-payments"]["containers"][0]["args"] == [
        "run",
        "examples.balances:ApplyPayment",
        "--poll-interval",
        "2",
    ]
    assert env["rel-dedupworker-recorder"]["DEDUPWORKER_POLL_INTERVAL"] == "5"
    events = env["rel-dedupworker-events"]
    assert events["DEDUPWORKER_TRANSPORT"] == "kafka"
    assert events["DEDUPWORKER_GROUP_ID"] == "rel-dedupworker-events"
    assert events["DEDUPWORKER_DEAD_LETTER"] == "events.dead"
    parsed = parse_cli(
        ["run", "examples.recorder:RecordCalls"],
        {k: v for k, v in events.items() if isinstance(v, str)} | {"DEDUPWORKER_DSN": "x"},
    )
    assert parsed.config.options.kafka_options == {
        "sasl.mechanism": "PLAIN",
        "security.protocol": "SASL_SSL",
    }
    orders = env["rel-dedupworker-orders"]
    assert orders["DEDUPWORKER_VISIBILITY_TIMEOUT"] == "120"
    assert orders["DEDUPWORKER_DEAD_LETTER"].endswith("orders-dlq.fifo")
    assert orders["AWS_REGION"] == "eu-west-1"
    assert pods["rel-dedupworker-orders"]["containers"][0]["envFrom"][1] == {
        "secretRef": {"name": "aws-credentials"}
    }


def test_migration_runs_as_a_pre_install_and_pre_upgrade_hook(
    case: tuple[str, list[dict[str, Any]]],
) -> None:
    name, manifests = case
    (job,) = of_kind(manifests, "Job")
    hook = job["metadata"]["annotations"]
    assert hook["helm.sh/hook"] == "pre-install,pre-upgrade"
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["migrate"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    env = env_of(container)
    secret_ref = env["DEDUPWORKER_DSN"]["secretKeyRef"]
    if name == "everything":
        assert secret_ref == {"name": "app-db", "key": "url"}
    else:
        # Hooks run before the release's resources exist: the DSN comes from a hook Secret
        # created just before the Job.
        (secret,) = [s for s in of_kind(manifests, "Secret") if s["_source"] == job["_source"]]
        assert secret["metadata"]["name"] == secret_ref["name"]
        weights = (secret["metadata"]["annotations"], hook)
        assert int(weights[0]["helm.sh/hook-weight"]) < int(weights[1]["helm.sh/hook-weight"])
        assert weights[0]["helm.sh/hook"] == hook["helm.sh/hook"]
    plain = {k: v for k, v in env.items() if isinstance(v, str)}
    check_run_command(["migrate"], {**plain, "DEDUPWORKER_DSN": "x"}, "migrate job")


def test_chart_ships_the_dashboard_and_alert_rules_of_deploy() -> None:
    # Copies (not symlinks) so that the packaged chart is self-contained; kept identical.
    assert (CHART / "files" / "dedupworker.json").read_bytes() == DASHBOARD.read_bytes()
    assert (CHART / "files" / "alerts.yml").read_bytes() == ALERTS.read_bytes()
    manifests = render(EVERYTHING)
    (dashboard,) = [m for m in of_kind(manifests, "ConfigMap") if "dashboard" in m["_source"]]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["dedupworker.json"]) == json.loads(DASHBOARD.read_text())
    (rule,) = of_kind(manifests, "PrometheusRule")
    assert rule["spec"] == yaml.safe_load(ALERTS.read_text())
    (monitor,) = of_kind(manifests, "ServiceMonitor")
    (service,) = of_kind(manifests, "Service")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]


def test_keda_triggers_follow_each_transport() -> None:
    triggers = {
        so["metadata"]["name"]: so["spec"]["triggers"][0]
        for so in of_kind(render(EVERYTHING), "ScaledObject")
    }
    recorder = triggers["rel-dedupworker-recorder"]
    assert recorder["type"] == "postgresql"
    assert recorder["metadata"]["connectionFromEnv"] == "DEDUPWORKER_DSN"
    assert recorder["metadata"]["targetQueryValue"] == "50"
    kafka = triggers["rel-dedupworker-events"]
    assert kafka["type"] == "kafka"
    assert kafka["metadata"]["consumerGroup"] == "rel-dedupworker-events"
    assert kafka["metadata"]["topic"] == "events"
    assert kafka["authenticationRef"] == {"name": "kafka-auth"}
    sqs = triggers["rel-dedupworker-orders"]
    assert sqs["type"] == "aws-sqs-queue"
    assert sqs["metadata"]["awsRegion"] == "eu-west-1"


@pytest.mark.postgres
def test_keda_postgres_query_counts_ready_jobs(conn: psycopg.Connection[Any]) -> None:
    from dedupworker import enqueue

    (scaled,) = [
        so
        for so in of_kind(render(EVERYTHING), "ScaledObject")
        if so["spec"]["triggers"][0]["type"] == "postgresql"
    ]
    query = scaled["spec"]["triggers"][0]["metadata"]["query"]
    assert conn.execute(query).fetchone() == (0,)
    enqueue(conn, "recorder", [{"entity": 1}, {"entity": 2}, {"entity": 3}])
    enqueue(conn, "recorder", [{"entity": 4}], delay=3600)  # not ready yet
    enqueue(conn, "other", [{"entity": 5}])
    assert conn.execute(query).fetchone() == (3,)


def test_templates_name_only_values_that_values_yaml_defines(
    values_yaml: dict[str, Any],
) -> None:
    # The check itself catches a typo.
    assert undefined_values("{{ .Values.metrics.prot }} {{ $w.concurency }}", values_yaml) == [
        ".Values.metrics.prot",
        "$w.concurency",
    ]
    sources = sorted((CHART / "templates").iterdir())
    assert len(sources) >= 12
    referenced = 0
    for source in sources:
        text = source.read_text()
        referenced += len(VALUES_REF.findall(text)) + len(WORKER_REF.findall(text))
        assert undefined_values(text, values_yaml) == [], source.name
    assert referenced > 50


def test_values_schema_accepts_the_values_and_lint_is_clean() -> None:
    with load_chart() as chart:
        assert chart.schema is not None
        chart.validate_schema(None)
        chart.validate_schema(EVERYTHING)
    for values in (None, EVERYTHING):
        for version in KUBE_VERSIONS:
            report = helm_python.lint(CHART, values, strict=True, kube_version=f"v{version}")
            problems = [m for m in report["messages"] if m["severity"] >= 2]
            assert not report["errors"] and not problems, report


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"workers": [{"name": "a", "handlers": ["m:C"], "transport": "redis"}]}, "transport"),
        ({"workers": [{"name": "a", "handlers": ["m:C"], "concurency": 2}]}, "concurency"),
        ({"workers": [{"name": "a", "handlers": ["m:C"], "concurrency": 0}]}, "concurrency"),
        ({"workers": [{"name": "A b", "handlers": ["m:C"]}]}, "name"),
        ({"workers": [{"name": "a", "handlers": ["not a class"]}]}, "handlers"),
        ({"workers": [{"name": "a"}]}, "handlers"),
        ({"workers": []}, "workers"),
        ({"databse": {"dsn": "x"}}, "databse"),
        ({"config": {"extra": {"LOG_LEVEL": "x"}}}, "LOG_LEVEL"),
        ({"config": {"logFormat": "xml"}}, "logFormat"),
        ({"metrics": {"port": 0}}, "port"),
    ],
)
def test_values_schema_rejects_mistakes(values: dict[str, Any], named: str) -> None:
    with load_chart() as chart, pytest.raises(helm_python.HelmValuesError) as error:
        chart.validate_schema(values)
    assert named in str(error.value)


@pytest.mark.parametrize(
    ("worker", "message"),
    [
        (
            {"autoscaling": {"enabled": True}, "keda": {"enabled": True}},
            "autoscaling.enabled and keda.enabled",
        ),
        ({"transport": "kafka"}, "kafka.bootstrapServers"),
        ({}, 'the name "a" is used twice'),
    ],
)
def test_contradicting_values_fail_with_a_message(worker: dict[str, Any], message: str) -> None:
    handlers = ["examples.recorder:RecordCalls"]
    values = {"workers": [{"name": "a", "handlers": handlers, **worker}]}
    if not worker:
        values["workers"].append({"name": "a", "handlers": handlers})
    with pytest.raises(helm_python.HelmError) as error:
        render(values)
    assert message in str(error.value)


def test_notes_say_what_to_set() -> None:
    assert "no database is configured" in notes(None)
    text = notes(EVERYTHING)
    assert "no database" not in text
    assert "rel-dedupworker-events: examples.recorder:RecordCalls on kafka" in text


# --- docker-compose --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    parsed = compose_spec.PyOptions(apply_merge=True).from_yaml(COMPOSE.read_text())
    parsed.validate()  # the Compose spec: unknown keys, wrong types, bad references
    spec: dict[str, Any] = parsed.to_dict()
    return spec


def dedupworker_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: service
        for name, service in compose["services"].items()
        if service.get("image") == IMAGE
    }


def producer_parser() -> argparse.ArgumentParser:
    import importlib.util

    spec = importlib.util.spec_from_file_location("produce", PRODUCER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parser: argparse.ArgumentParser = module.build_parser()
    return parser


def shell_commands(script: str) -> list[list[str]]:
    """The simple commands of a `sh -c` script (split on pipes, && and ;)."""
    commands: list[list[str]] = [[]]
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    for token in lexer:
        if token in {"|", "&&", ";", "||"}:
            commands.append([])
        else:
            commands[-1].append(token)
    return [command for command in commands if command]


def service_commands(service: dict[str, Any]) -> list[list[str]]:
    """Every command line a service runs, its entrypoint resolved."""
    entrypoint = service.get("entrypoint") or ["dedupworker"]
    command = service.get("command") or []
    if entrypoint[:2] == ["/bin/sh", "-c"]:
        (script,) = command
        return shell_commands(script)
    return [list(entrypoint) + list(command)]


def test_compose_file_follows_the_compose_spec(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"postgres", "kafka", "elasticmq", "prometheus", "grafana", "migrate"} <= set(services)
    assert services["kafka"]["image"].startswith("apache/kafka:")
    assert services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"
    # Every file the stack mounts is in the repository.
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0] if isinstance(volume, str) else volume["source"]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name} mounts {source}"
    for name, service in dedupworker_services(compose).items():
        assert service["build"]["context"] == "."
        assert service["read_only"] is True, name


def test_compose_commands_are_the_real_cli(compose: dict[str, Any]) -> None:
    seen = set()
    consumed, produced = set(), set()  # (transport, queue)
    for name, service in dedupworker_services(compose).items():
        env = {k: str(v) for k, v in (service.get("environment") or {}).items()}
        for argv in service_commands(service):
            if argv[0] == "dedupworker":
                args = check_run_command(argv[1:], env, name)
                seen.add(args.command)
                if args.command == "run":
                    consumed.add((args.transport, args.queue))
                if args.command == "enqueue":
                    produced.add(("postgres", args.queue))
            else:
                assert argv[:2] == ["python", "/producer/produce.py"], f"{name}: {argv}"
                options = producer_parser().parse_args(argv[2:])
                seen.add("produce " + options.target)
                if options.target == "sqs":
                    produced.add(("sqs", options.queue_url))
                if options.target == "kafka":
                    produced.add(("kafka", options.topic))
    assert seen >= {"run", "migrate", "enqueue", "produce lines", "produce sqs", "produce kafka"}
    assert produced == consumed, "the producers fill the queues that the workers consume"


def test_compose_workers_one_per_transport_wired_to_the_stack(compose: dict[str, Any]) -> None:
    services = compose["services"]
    workers = {}
    for name, service in dedupworker_services(compose).items():
        if service["command"][0] != "run":
            continue
        env = {k: str(v) for k, v in service["environment"].items()}
        args = parse_cli(service["command"], env)
        workers[args.transport] = name
        # docker stop waits stop_grace_period before SIGKILL: the drain must fit in it.
        grace = compose_spec.parse_duration(service["stop_grace_period"])
        assert grace >= args.shutdown_timeout + 5, name
        assert args.metrics_port == 9100
        assert service["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        # The hosts the worker talks to are services of the stack.
        hosts = [psycopg.conninfo.conninfo_to_dict(args.dsn)["host"]]
        if args.transport == "kafka":
            hosts.append(args.bootstrap_servers.split(":")[0])
            # the topic and its dead-letter topic are created with partitions up front
            (topics,) = services["kafka-topics"]["command"]
            assert f"for topic in {args.queue} {args.queue}.dlq;" in topics
        if args.transport == "sqs":
            hosts.append(urllib.parse.urlsplit(args.queue).hostname)
            hosts.append(urllib.parse.urlsplit(env["AWS_ENDPOINT_URL_SQS"]).hostname)
            # both queues are declared in ElasticMQ's configuration
            declared = re.findall(r"^  ([\w.-]+) \{", ELASTICMQ.read_text(), re.M)
            for url in (args.queue, args.dead_letter):
                assert url.rsplit("/", 1)[1] in declared, url
        assert set(hosts) <= set(services), name
    assert set(workers) == {"postgres", "sqs", "kafka"}
    prometheus = yaml.safe_load(PROMETHEUS.read_text())
    (job,) = prometheus["scrape_configs"]
    (dns,) = job["dns_sd_configs"]
    assert sorted(dns["names"]) == sorted(workers.values())
    assert dns["port"] == 9100
    assert prometheus["rule_files"] == ["/etc/prometheus/alerts.yml"]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in services["prometheus"]["volumes"]}
    assert ROOT / mounted["/etc/prometheus/alerts.yml"] == ALERTS
    grafana = {v.split(":")[1]: v.split(":")[0] for v in services["grafana"]["volumes"]}
    provider = yaml.safe_load(
        (ROOT / grafana["/etc/grafana/provisioning"] / "dashboards" / "dedupworker.yml").read_text()
    )
    dashboards_in = provider["providers"][0]["options"]["path"]
    assert ROOT / grafana[dashboards_in] / DASHBOARD.name == DASHBOARD


# --- Dockerfile ------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


def test_dockerfile_builds_a_slim_non_root_image_without_secrets() -> None:
    instructions = dockerfile_instructions()
    stages = [arg for op, arg in instructions if op == "FROM"]
    assert len(stages) == 2 and all("-slim" in stage for stage in stages)
    (user,) = [arg for op, arg in instructions if op == "USER"]
    assert user.split(":")[0].isdigit() and int(user.split(":")[0]) != 0
    (entrypoint,) = [json.loads(arg) for op, arg in instructions if op == "ENTRYPOINT"]
    assert entrypoint == ["dedupworker"]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["dedupworker"] == "dedupworker.ops.cli.main:main"
    installs = [arg for op, arg in instructions if op == "RUN" and "pip install" in arg]
    assert any('".[sqs,kafka]"' in arg for arg in installs)
    assert {"sqs", "kafka"} <= set(pyproject["project"]["optional-dependencies"])
    secretish = re.compile(r"PASSWORD|SECRET|TOKEN|DSN|CREDENTIAL|_KEY", re.IGNORECASE)
    for op, arg in instructions:
        if op in {"ENV", "ARG", "LABEL"}:
            assert not secretish.search(arg), f"{op} {arg}"
    # .dockerignore lets in only what COPY needs.
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    ignore = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*"
    for op, arg in instructions:
        if op == "COPY" and not arg.startswith("--from"):
            for source in arg.split()[:-1]:
                assert f"!{source.rstrip('/')}" in {i.rstrip("/") for i in ignore}, source
                assert (ROOT / source).exists()


def test_image_entrypoint_runs() -> None:
    instructions = dict(dockerfile_instructions())
    entrypoint, command = json.loads(instructions["ENTRYPOINT"]), json.loads(instructions["CMD"])
    executable = shutil.which(entrypoint[0])
    assert executable is not None, "the dedupworker console script is not installed"
    done = subprocess.run(
        [executable, *entrypoint[1:], *command],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "run" in done.stdout and "migrate" in done.stdout


def healthcheck_argv() -> list[str]:
    instructions = dockerfile_instructions()
    (healthcheck,) = [arg for op, arg in instructions if op == "HEALTHCHECK"]
    argv: list[str] = json.loads(healthcheck.split(" CMD ", 1)[1])
    assert argv[0] == "python", "slim images have no curl: python asks /healthz"
    return [sys.executable, *argv[1:]]


# --- dashboard and alert rules ---------------------------------------------------------------

GRAFANA_VARIABLES = [
    (re.compile(r"\$__(rate_)?interval|\$__range"), "5m"),
    (re.compile(r"\$\{?[A-Za-z_]\w*\}?"), "x"),
]
LABEL_VALUES = re.compile(r"^label_values\((.*),\s*\w+\)$", re.DOTALL)


def metric_names(expr: str) -> set[str]:
    """The metric names that a PromQL expression selects (Grafana variables substituted)."""
    for pattern, value in GRAFANA_VARIABLES:
        expr = pattern.sub(value, expr)
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr}"
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = []

    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(dashboard["panels"]):
        exprs += [target["expr"] for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            query = query["query"] if isinstance(query, dict) else query
            match = LABEL_VALUES.match(query)
            exprs.append(match.group(1) if match else query)
    return exprs


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def documented_series() -> dict[str, str]:
    """Series names a worker exports per docs/metrics.md (histograms: _bucket/_sum/_count)."""
    rows = re.findall(r"^\| `(dedupworker_\w+)` \| ([a-z]+)", METRICS_DOC.read_text(), re.M)
    assert len(rows) >= 15
    series = {}
    for name, kind in rows:
        suffixes = ("_bucket", "_sum", "_count") if kind == "histogram" else ("",)
        for suffix in suffixes:
            series[name + suffix] = name
    return series


def used_metric_names() -> set[str]:
    names: set[str] = set()
    for expr in dashboard_expressions():
        names |= metric_names(expr)
    for rule in alert_rules():
        names |= metric_names(rule["expr"])
    return names


def exported_series(families: list[Any]) -> set[str]:
    series = set()
    for family in families:
        if family.type == "counter":
            series.add(family.name + "_total")
        elif family.type == "histogram":
            series |= {family.name + suffix for suffix in ("_bucket", "_sum", "_count")}
        else:
            series.add(family.name)
        series |= {sample.name for sample in family.samples}
    return series


# Families only a transport that is not running here exports.
TRANSPORT_SPECIFIC = {"dedupworker_kafka_lag"}


def test_dashboard_is_importable_and_has_the_panels() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "dedupworker" and "id" not in dashboard
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = []
    for panel in dashboard["panels"]:
        ids.append(panel["id"])
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"], panel["title"]
    assert len(ids) == len(set(ids))
    titles = " | ".join(p["title"] for p in dashboard["panels"]).lower()
    for words in (
        "throughput by outcome",
        "contention rate",
        "contention ratio",
        "handler latency",
        "retries, dead letters",
        "in flight",
        "pool saturation",
        "queue depth",
        "kafka lag",
        "lock wait",
        "singleton runs",
    ):
        assert words in titles
    used = set().union(*(metric_names(expr) for expr in dashboard_expressions()))
    assert {
        "dedupworker_handler_duration_seconds_bucket",
        "dedupworker_lock_wait_seconds_bucket",
    } <= used, "latency quantiles come from the histograms"


def test_alert_rules_cover_contention_dead_letters_and_stalls() -> None:
    rules = {rule["alert"]: rule for rule in alert_rules()}
    for rule in rules.values():
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        assert compose_spec.parse_duration(rule["for"]) > 0
    storm = rules["DedupworkerContentionStorm"]["expr"]
    assert 'outcome="contended"' in storm
    assert 'outcome="dead_lettered"' in rules["DedupworkerDeadLettersGrowing"]["expr"]
    assert metric_names(rules["DedupworkerWorkerStalled"]["expr"]) == {
        "dedupworker_seconds_since_progress"
    }
    assert "dedupworker_queue_depth" in metric_names(rules["DedupworkerNoProgress"]["expr"])


def test_alert_rules_pass_promtool() -> None:
    """promtool checks the rules and the scrape config and runs deploy/prometheus/alerts_test.yml:
    each alert fires on the series it is about, and not on the calm ones next to them."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is missing: apt-get install prometheus (scripts/test does)")
    for args in (
        ["check", "rules", ALERTS.name],
        ["check", "config", "--syntax-only", PROMETHEUS.name],
        ["test", "rules", "alerts_test.yml"],
    ):
        done = subprocess.run(
            [promtool, *args],
            cwd=ALERTS.parent,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr


def test_dashboard_and_alerts_name_only_documented_metrics() -> None:
    documented = documented_series()
    used = used_metric_names()
    unknown = sorted(used - set(documented))
    assert not unknown, f"not in docs/metrics.md: {unknown}"
    # Each documented family shows somewhere (pool counters of requests count too).
    shown = {documented[name] for name in used}
    assert len(shown) >= 15


class ComposeWorker:
    """The compose file's postgres worker command, run by the real entrypoint."""

    def __init__(self, process: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.process, self.port, self.log = process, port, log

    def alive(self) -> None:
        assert self.process.poll() is None, "the worker exited:\n" + self.log.read_text()


@pytest.fixture
def compose_worker(dsn: str, compose: dict[str, Any], tmp_path: Path) -> Iterator[ComposeWorker]:
    service = compose["services"]["worker-postgres"]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {
        **clean_env(),
        **{k: str(v) for k, v in service["environment"].items()},
        "DEDUPWORKER_DSN": dsn,
        "DEDUPWORKER_METRICS_PORT": str(port),
    }
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "dedupworker", *service["command"]],
            cwd=ROOT,  # like the image's WORKDIR, where examples/ is importable
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    worker = ComposeWorker(process, port, log)
    try:
        deadline = time.monotonic() + 30
        while get(port, "/readyz")[0] != 200:
            worker.alive()
            assert time.monotonic() < deadline, "the worker never became ready"
            time.sleep(0.1)
        yield worker
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def run_compose_producer(compose: dict[str, Any], dsn: str, count: int) -> None:
    """produce-postgres's pipeline, its /producer mount mapped back to the repository."""
    service = compose["services"]["produce-postgres"]
    mounts = {v.split(":")[1]: ROOT / v.split(":")[0] for v in service["volumes"]}
    produce, enqueue = service_commands(service)
    assert produce[:2] == ["python", "/producer/produce.py"]
    script = mounts["/producer"] / Path(produce[1]).name
    options = producer_parser().parse_args(produce[2:])
    produce = [sys.executable, str(script), options.target, "--count", str(count)]
    assert enqueue[0] == "dedupworker"
    enqueue = [sys.executable, "-m", "dedupworker", *enqueue[1:]]
    env = {**clean_env(), **service["environment"], "DEDUPWORKER_DSN": dsn}
    with subprocess.Popen(produce, stdout=subprocess.PIPE, cwd=ROOT) as producer:
        done = subprocess.run(
            enqueue, stdin=producer.stdout, capture_output=True, text=True, env=env, check=False
        )
    assert producer.returncode == 0
    assert done.returncode == 0, done.stderr
    assert f"enqueued {count} message(s)" in done.stdout


@pytest.mark.postgres
def test_compose_worker_exports_every_metric_of_the_dashboard_and_alerts(
    dsn: str,
    compose: dict[str, Any],
    compose_worker: ComposeWorker,
) -> None:
    worker, port = compose_worker, compose_worker.port
    count = 60
    run_compose_producer(compose, dsn, count)
    with psycopg.connect(dsn, autocommit=True) as conn:
        deadline = time.monotonic() + 40
        while conn.execute(
            "SELECT count(*) FROM dedupworker.jobs WHERE status = 'ready'"
        ).fetchone() != (0,):
            worker.alive()
            assert time.monotonic() < deadline, "the worker did not drain the queue"
            time.sleep(0.1)
        calls = conn.execute("SELECT count(*) FROM example_calls").fetchone()
        dead = conn.execute("SELECT count(*) FROM dedupworker.jobs WHERE status = 'dead'")
        assert calls is not None and dead.fetchone() == (1,)  # one malformed message
        assert calls[0] == count - 1

    # The Dockerfile's HEALTHCHECK, run as docker would, against the worker; then a dead port.
    env = {**clean_env(), "DEDUPWORKER_METRICS_PORT": str(port)}
    check = subprocess.run(
        healthcheck_argv(), env=env, capture_output=True, timeout=30, check=False
    )
    assert check.returncode == 0, check.stderr
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        env["DEDUPWORKER_METRICS_PORT"] = str(sock.getsockname()[1])
    dead = subprocess.run(healthcheck_argv(), env=env, capture_output=True, timeout=30, check=False)
    assert dead.returncode != 0

    status, body = get(port, "/metrics")
    assert status == 200
    families = list(text_string_to_metric_families(body))
    scraped = exported_series(families)
    defined = exported_series(REGISTRY.collect()) & documented_series().keys()
    assert metrics.MESSAGES is not None  # dedupworker.observe.metrics registers into REGISTRY
    accepted = scraped | {
        name for name in defined if documented_series()[name] in TRANSPORT_SPECIFIC
    }
    missing = sorted(used_metric_names() - accepted)
    assert not missing, f"the dashboard or alerts name metrics no worker exports: {missing}"

    # SIGTERM drains: exit 0 within the drain deadline (docker's stop_grace_period).
    worker.process.send_signal(signal.SIGTERM)
    shutdown = float(
        compose["services"]["worker-postgres"]["environment"]["DEDUPWORKER_SHUTDOWN_TIMEOUT"]
    )
    assert worker.process.wait(timeout=shutdown) == 0, worker.log.read_text()
