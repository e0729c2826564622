"""Starting a local Ray cluster for the tests of chapter 17 (tests/test_deploy_ray*.py)."""

from __future__ import annotations

import pytest


def start_local_ray(num_cpus: int) -> None:
    """A local cluster of ``num_cpus``, no dashboard. Ray's raylet gives its dashboard agent a
    fixed 15 s to start (ray-project/ray#65983), which a badly overloaded machine can miss: one
    retry, then a skip that says so."""
    import psutil
    import ray

    for attempt in range(2):
        before = set(psutil.Process().children(recursive=True))
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
            return
        except Exception as err:  # (Ray raises a bare Exception for this)
            ray.shutdown()
            # A failed start leaves its GCS server, monitor and dashboard behind: end them.
            left = [p for p in psutil.Process().children(recursive=True) if p not in before]
            for process in left:
                process.kill()
            psutil.wait_procs(left, timeout=10)
            if attempt == 1:
                pytest.skip(f"a local Ray cluster did not start: {err}")
