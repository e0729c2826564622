"""Helpers for the server's tests (tests/test_serve*.py): a tiny chat model, a server on a
background thread, and waiting for the engine to go idle."""

from __future__ import annotations

import json
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

from test_scheduler import make_llm, make_tiny_llama

from nanovllm.engine.async_engine import AsyncEngine
from nanovllm.serve import ServeConfig, ServerThread, build_app


def make_tiny_chat_model(path: Path, smollm2_dir: Path, max_len: int = 512) -> Path:
    """The tiny random Llama of test_scheduler with SmolLM2's tokenizer and chat template
    (random tokens, but text in and text out, in milliseconds per step)."""
    make_tiny_llama(path, tokenizer_dir=smollm2_dir)
    shutil.copy(Path(smollm2_dir) / "chat_template.jinja", path / "chat_template.jinja")
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = max_len
    (path / "config.json").write_text(json.dumps(config))
    return path


@contextmanager
def running_server(model: Path, name: str = "tiny", engine_options: dict | None = None,
                   **serve_options):
    """An engine, its app and a server on 127.0.0.1 (a free port); yields the server, with
    ``server.engine`` the ``AsyncEngine``."""
    llm = make_llm(model, **(engine_options or {}))
    engine = AsyncEngine(llm.engine)
    config = ServeConfig(model=str(model), served_model_name=name, **serve_options)
    server = ServerThread(build_app(engine, config))
    server.engine = engine
    try:
        with server:
            yield server
    finally:
        engine.shutdown(wait=False)


def wait_until_idle(engine: AsyncEngine, timeout: float = 30.0) -> None:
    """Until the engine holds no request and every KV block is free (or fail); an engine core
    in another process is asked through the load it reports with each step."""
    core = engine.engine
    deadline = time.monotonic() + timeout
    while core.has_unfinished_requests() or core.load().kv_usage > 0:
        load = core.load()
        assert time.monotonic() < deadline, (
            f"still busy after {timeout} s: {load.num_running} running, {load.num_waiting} "
            f"waiting, {load.kv_usage:.0%} of the KV blocks held")
        time.sleep(0.02)
    if hasattr(core, "block_manager"):  # in this process: the exact count
        assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def wait_for_health(proc, url: str, timeout: float = 120.0) -> None:
    """Until the server process ``proc`` answers 200 on ``url``/health (or fail with its log)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
