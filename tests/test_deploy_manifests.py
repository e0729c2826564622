"""The container image and the Kubernetes objects (nanovllm/deploy, chapter 17): linted by
hadolint and validated against Kubernetes' schemas offline (no container runtime or cluster
is needed), and consistent with the server they run: its command line, port, /health, drain
time and /metrics names."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from nanovllm.deploy import manifests
from nanovllm.deploy.manifests import DOCKERFILE, K8S, container_command

pytest.importorskip("fastapi")  # the serve extra: the server's CLI and metrics


def tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if path is None:
        pytest.skip(f"{name} is not installed (the dev extra installs it)")
    return path


def server_args(argv: list[str]):
    """``argv`` (the container's command) parsed by the server's own CLI, as a ServeConfig."""
    from nanovllm.serve.cli import add_serve_arguments, config_from_args

    assert argv[:2] == ["nanovllm", "serve"], argv
    parser = argparse.ArgumentParser(prog="nanovllm", exit_on_error=False)
    add_serve_arguments(parser)
    return config_from_args(parser.parse_args(argv[2:]))


def drain_seconds(grace_period: float) -> float:
    from nanovllm.serve.server import SHUTDOWN_MARGIN

    return grace_period + SHUTDOWN_MARGIN


# --- the Dockerfile ------------------------------------------------------------------------


def test_dockerfile_passes_hadolint():
    run = subprocess.run([tool("hadolint"), "--no-color", str(DOCKERFILE)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_hadolint_rejects_a_root_container(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text(DOCKERFILE.read_text() + "\nUSER root\n")
    run = subprocess.run([tool("hadolint"), "--no-color", str(bad)], capture_output=True,
                         text=True)
    assert run.returncode != 0 and "DL3002" in run.stdout


def test_the_container_command_parses_with_the_server_cli():
    argv = container_command()
    config = server_args(argv)
    assert config.model == "/models/model" and config.host == "0.0.0.0"
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        server_args([*argv, "--no-such-flag"])  # the check can fail


def test_dockerfile_serves_what_it_declares():
    steps = manifests.dockerfile_instructions()
    words = dict(steps)  # (the last of each instruction)
    config = server_args(container_command())
    assert re.match(r"nvidia/cuda:[\w.]+-runtime-", words["FROM"])
    assert words["USER"] not in ("root", "0") and not words["USER"].startswith("0:")
    assert any(w == "RUN" and "[triton,serve]" in a for w, a in steps)  # the serve extra
    assert "/models" in words["VOLUME"] and config.model.startswith("/models/")
    assert words["EXPOSE"] == str(config.port)
    assert f"127.0.0.1:{config.port}/health" in words["HEALTHCHECK"]
    assert words["STOPSIGNAL"] == "SIGTERM"
    assert manifests.stop_timeout() > drain_seconds(config.grace_period)


# --- Kubernetes ----------------------------------------------------------------------------


def test_manifests_validate_against_the_kubernetes_schemas(tmp_path):
    files = sorted(K8S.glob("*.yaml"))
    assert {f.stem for f in files} >= {"deployment", "service", "hpa", "pdb"}
    run = subprocess.run([tool("kubernetes-validate"), "--strict", *map(str, files)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    typo = tmp_path / "deployment.yaml"  # a misspelt field is caught
    text = (K8S / "deployment.yaml").read_text()
    typo.write_text(text.replace("readinessProbe", "readynessProbe"))
    run = subprocess.run([tool("kubernetes-validate"), "--strict", str(typo)],
                         capture_output=True, text=True)
    assert run.returncode != 0


def test_deployment_probes_and_drain_fit_the_server():
    objects = manifests.k8s_objects()
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    config = server_args(["nanovllm", "serve", *container["args"]])
    docker = server_args(container_command())
    assert config.grace_period == docker.grace_period  # one drain time everywhere
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == config.port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = pre_stop + drain_seconds(config.grace_period)
    assert pod["terminationGracePeriodSeconds"] > drain
    live = container["livenessProbe"]  # a draining server (503) is not restarted mid-drain
    assert live["periodSeconds"] * live["failureThreshold"] > drain
    service = objects["Service"]["spec"]
    labels = objects["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert service["selector"].items() <= labels.items()
    budget = objects["PodDisruptionBudget"]["spec"]
    assert budget["selector"]["matchLabels"].items() <= labels.items()
    assert service["ports"][0]["targetPort"] == "http"


def server_metric_names() -> set[str]:
    """The metric families the server's /metrics exports, read from a rendering."""
    from nanovllm.engine.metrics import EngineLoad, EngineStats
    from nanovllm.serve.metrics import ServerMetrics

    # what ServerMetrics reads of an engine (LLMEngine or EngineCoreClient)
    engine = SimpleNamespace(stats=EngineStats(), load=lambda: EngineLoad(0, 0, 0.0, 0.0))
    text = ServerMetrics(engine, "m").render().decode()
    return set(re.findall(r"^# TYPE (\S+) ", text, flags=re.M))


def test_autoscaler_metrics_are_exported_by_the_server():
    exported = server_metric_names()
    assert "nanovllm:num_requests_waiting" in exported
    objects = manifests.k8s_objects()
    hpa = objects["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == objects["Deployment"]["metadata"]["name"]
    names = [m["pods"]["metric"]["name"] for m in hpa["metrics"] if m["type"] == "Pods"]
    assert names
    import yaml

    rules = yaml.safe_load(objects["ConfigMap"]["data"]["config.yaml"])["rules"]
    for rule in rules:  # the adapter's series exist, and its renaming gives the HPA's names
        series = re.match(r"'?([\w:]+)", rule["seriesQuery"]).group(1)
        assert series in exported, series
    renamed = {re.sub(r["name"]["matches"], r["name"]["as"].replace("${1}", r"\1"),
                      re.match(r"'?([\w:]+)", r["seriesQuery"]).group(1)) for r in rules}
    assert set(names) <= renamed
