"""The Kubernetes manifests under deploy/kubernetes: valid against the Kubernetes schemas (strict: no unknown field),
their `spectrt` arguments parse with the CLI's own parser, and every probe and Service port names a port the
container opens with the number its arguments give."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit
MANIFESTS = sorted((Path(__file__).resolve().parent.parent / "deploy" / "kubernetes").glob("*.yaml"))
KUBERNETES = "1.31.0"


def _documents() -> list[dict]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_manifests_validate_against_the_kubernetes_schemas():
    import kubernetes_validate

    docs = _documents()
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "HorizontalPodAutoscaler"}
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)  # raises naming the field


def test_the_containers_arguments_are_spectrts_and_the_probes_reach_its_ports():
    from spectrt.cli import build_parser

    docs = _documents()
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    container, = deployment["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(container["args"])  # a flag the CLI does not know fails here
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": args.http_port, "grpc": args.grpc_port, "metrics": args.metrics_port,
                     "openai": args.openai_port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] in ports
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "openai"}
    service = next(d for d in docs if d["kind"] == "Service")
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    hpa = next(d for d in docs if d["kind"] == "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
