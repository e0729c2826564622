"""The deployment files as data, for tests and chapter 17: the Dockerfile's instructions and
the Kubernetes objects under ``k8s/`` (both next to this module)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DOCKERFILE = HERE / "Dockerfile"
K8S = HERE / "k8s"


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` in order, continuation lines joined, comments dropped."""
    joined, pending = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1].rstrip() + " "
            continue
        joined.append(pending + stripped)
        pending = ""
    out = []
    for line in joined:
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def exec_form(path: Path = DOCKERFILE, instruction: str = "CMD") -> list[str]:
    """The last ``instruction`` (``ENTRYPOINT``, ``CMD``) in exec (JSON) form, as a list."""
    found = [args for word, args in dockerfile_instructions(path) if word == instruction]
    if not found:
        raise ValueError(f"{path.name} has no {instruction}")
    return json.loads(found[-1])


def container_command(path: Path = DOCKERFILE) -> list[str]:
    """What the container runs with no arguments: ENTRYPOINT followed by CMD."""
    return exec_form(path, "ENTRYPOINT") + exec_form(path, "CMD")


def stop_timeout(path: Path = DOCKERFILE) -> float:
    """Seconds ``docker stop`` should wait before its SIGKILL (the image's label)."""
    for word, args in dockerfile_instructions(path):
        match = re.search(r'org\.nanovllm\.stop-timeout="?([0-9.]+)', args)
        if word == "LABEL" and match:
            return float(match.group(1))
    raise ValueError(f"{path.name} has no org.nanovllm.stop-timeout label")


def k8s_objects(folder: Path = K8S) -> dict[str, dict[str, Any]]:
    """Every object in ``folder/*.yaml``, by kind (one object of each kind here)."""
    import yaml

    objects = {}
    for path in sorted(folder.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                objects[doc["kind"]] = doc
    return objects

