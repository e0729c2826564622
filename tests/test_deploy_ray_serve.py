"""Data-parallel replicas behind one OpenAI endpoint with Ray Serve
(nanovllm/deploy/ray_serve.py, chapter 17 §5), on one local Ray cluster for the module (two
replicas of a tiny random Llama with SmolLM2's tokenizer, one CPU each): greedy completions
equal LLM.generate's, requests land on both replicas, a stream works, and stopping leaves
none of the cluster's processes behind."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import httpx
import pytest
from ray_helpers import start_local_ray
from test_scheduler import make_tiny_llama, one_torch_thread  # noqa: F401

from nanovllm import LLM, SamplingParams
from nanovllm.engine.executor import free_port
from nanovllm.serve import ServeConfig

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")
ray_serve = pytest.importorskip("nanovllm.deploy.ray_serve")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3,"]
MAX_TOKENS = 6
OPTIONS = {"num_kv_blocks": 64, "dtype": "float32", "max_num_seqs": 8}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_dir) -> str:
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-ray-serve"),
                               tokenizer_dir=smollm2_dir))


@pytest.fixture(scope="module")
def reference(tiny) -> list:
    with LLM(tiny, **OPTIONS) as llm:
        return llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                            use_tqdm=False)


@pytest.fixture(scope="module")
def endpoint(tiny):
    """Two replicas behind Serve's proxy; yields the URL and, after the module's other tests,
    stops everything and checks that the cluster's processes are gone. Started once: a Ray
    cluster and its replicas take seconds."""
    before = set(psutil.Process().children(recursive=True))
    start_local_ray(num_cpus=2)
    try:
        config = ServeConfig(model=tiny, served_model_name="tiny", port=free_port(),
                             engine_process=False, engine=OPTIONS)
        url = ray_serve.start(config, num_replicas=2, num_cpus=1)
        # the cluster's processes: raylet, GCS, Serve's controller and proxy, the replicas
        ours = [p for p in psutil.Process().children(recursive=True) if p not in before]
        yield url, ours
    finally:
        ray_serve.stop()
        ray.shutdown()


async def complete(client: httpx.AsyncClient, prompt: str) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}
    return await client.post("/v1/completions", json=body)


def test_replicas_answer_as_llm_generate_does(endpoint, reference):
    url, _ = endpoint

    async def send_all() -> list[httpx.Response]:  # at once: the router spreads the load
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(*(complete(client, p) for p in PROMPTS * 2))

    answers = asyncio.run(send_all())
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    for answer, ref in zip(answers, reference * 2):
        (choice,) = answer.json()["choices"]
        assert choice["token_ids"] == ref.token_ids and choice["text"] == ref.text
    per_replica = Counter(a.headers[ray_serve.REPLICA_HEADER] for a in answers)
    assert len(per_replica) == 2, per_replica  # both replicas served some


def test_a_streamed_completion_through_the_proxy(endpoint, reference):
    url, _ = endpoint
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in response.iter_lines()
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in chunks) == reference[0].text
    assert chunks[-1]["finish_reason"] == "length"


def test_stopping_leaves_no_ray_process(endpoint):
    """Runs last (pytest keeps file order): stops the fixture's cluster early and checks."""
    url, ours = endpoint
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    assert any("raylet" in " ".join(p.cmdline()) for p in ours if p.is_running())
    ray_serve.stop()
    ray.shutdown()
    _, alive = psutil.wait_procs(ours, timeout=60)  # a loaded 2-core machine: slow exits
    assert not alive, [(p.pid, p.name()) for p in alive]
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=5)
