"""Tensor parallelism on CPU (gloo): the same greedy tokens at every size, and process
hygiene -- workers stop on every kind of exit, and a dead worker is an error, not a hang
(chapter 09)."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from course_ids import ENGINE
from test_scheduler import make_tiny_llama

from nanovllm import LLM, SamplingParams
from nanovllm.engine.executor import WorkerDiedError, free_port

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9] * 7, list(range(10, 60)), [5] * 3]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
REPO = Path(__file__).resolve().parents[1]
# An engine at TP>1 reaches the row-parallel loader (o_proj, down_proj) and the
# vocab-parallel lookup; no model uses the plain column-parallel loader (09.column_shard:
# graded in tests/test_tp_assignments.py), QKV and gate/up have their own.
TP = (*ENGINE, "09.row_shard", "09.vocab_embed")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-tp")))


def tokens(path: str, prompts=PROMPTS, params=GREEDY, **options) -> list[list[int]]:
    """Greedy tokens in float32 (so that they can equal transformers' on a GPU too)."""
    options = {"num_kv_blocks": 64, "dtype": "float32"} | options
    with LLM(path, **options) as llm:
        return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def hf_greedy(path: str, prompts, max_new_tokens: int) -> list[list[int]]:
    from transformers import LlamaForCausalLM  # (the tiny folder's config has no model_type)

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)
        outputs.append(out[0, ids.shape[1]:].tolist())
    return outputs


@contextmanager
def ranks_deadline(llm: LLM, seconds: float = 120.0) -> Iterator[None]:
    """Kill ``llm``'s workers if the block runs past ``seconds``: ranks that wait for each
    other forever (a pass that a worker did not follow) then fail the test with
    ``WorkerDiedError`` instead of hanging the suite (gloo gives up only after minutes). On
    any error the engine is shut down, so that the next test can start its own ranks."""
    workers = llm.engine.runner.executor.workers if llm.engine.runner.executor else []
    timer = threading.Timer(seconds, lambda: [w.kill() for w in workers])
    timer.start()
    try:
        yield
    except BaseException:
        llm.shutdown()
        raise
    finally:
        timer.cancel()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pids: list[int], timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


@pytest.mark.assignment(*TP)
def test_tp2_equals_tp1_and_transformers(tiny):
    one = tokens(tiny)
    two = tokens(tiny, tensor_parallel_size=2)
    assert two == one
    assert two == hf_greedy(tiny, PROMPTS, GREEDY.max_tokens)


@pytest.mark.assignment(*TP, "06.preempt")
def test_tp2_with_preemption_prefix_caching_and_async_scheduling(tiny):
    shared = list(range(100, 148))  # three full blocks every prompt shares
    prompts = [shared + [i, i + 1] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    options = dict(num_kv_blocks=14, block_size=16, enable_prefix_caching=True,
                   max_num_batched_tokens=64, async_scheduling=True)
    with LLM(tiny, tensor_parallel_size=2, dtype="float32", **options) as llm:
        two = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.scheduler.num_preemptions > 0  # the small cache forced some
        assert llm.engine.block_manager.prefix_hit_rate > 0
    assert two == tokens(tiny, prompts, params, **options)


@pytest.mark.assignment(*TP)
def test_dummy_weights_are_the_same_model_at_every_size(tiny):
    options = dict(load_format="dummy", seed=3)
    assert tokens(tiny, tensor_parallel_size=2, **options) == tokens(tiny, **options)


@pytest.mark.assignment(*TP, "08.channel_scales")
def test_int8_quantization_under_tp(tiny):
    """Scales are per output channel of each shard: column-parallel shards keep TP=1's
    scales exactly, row-parallel shards get their own (a slice's maximum), so the tokens
    may differ slightly from TP=1's; most must agree."""
    one = tokens(tiny, quantization="int8")
    two = tokens(tiny, quantization="int8", tensor_parallel_size=2)
    same = sum(a == b for x, y in zip(one, two) for a, b in zip(x, y))
    assert same >= 0.75 * sum(map(len, one)), (one, two)


@pytest.mark.assignment(*TP)
def test_smollm2_tp3_equals_transformers(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # Three ranks on the CPU (gloo), also where two GPUs would be fewer than the ranks.
    three = tokens(str(smollm2_dir), prompts, params, tensor_parallel_size=3, num_kv_blocks=32,
                   device="cpu")
    assert three == hf_greedy(str(smollm2_dir), prompts, 12)


def test_impossible_sizes_are_clear_errors(tiny):
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        LLM(tiny, tensor_parallel_size=3, device="cpu")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(tiny, tensor_parallel_size=0)


def test_a_killed_worker_is_an_error_not_a_hang(tiny):
    llm = LLM(tiny, num_kv_blocks=64, tensor_parallel_size=2)
    worker = llm.engine.runner.executor.workers[0]
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    worker.kill()
    worker.wait()
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="worker rank 1 .* signal 9"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 5
    llm.shutdown()


def test_a_worker_killed_mid_generation_fails_the_call_within_seconds(tiny):
    llm = LLM(tiny, num_kv_blocks=256, tensor_parallel_size=2)
    worker = llm.engine.runner.executor.workers[0]
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    killed_at = []

    def kill_soon() -> None:
        time.sleep(1.0)
        killed_at.append(time.monotonic())
        worker.kill()

    threading.Thread(target=kill_soon, daemon=True).start()
    with pytest.raises(WorkerDiedError):
        llm.generate([list(range(1, 40))] * 4, long, use_tqdm=False)
    assert killed_at and time.monotonic() - killed_at[0] < 10
    llm.shutdown()


def test_local_workers_receive_their_steps_through_shared_memory(tiny):
    with LLM(tiny, num_kv_blocks=64, tensor_parallel_size=2) as llm:
        queue = llm.engine.runner.executor.queue
        assert queue is not None and not os.path.exists(queue.path)  # mapped, name deleted
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert queue._count >= GREEDY.max_tokens  # at least a chunk per step went through it


def test_two_engines_one_after_another_in_one_process(tiny):
    first = tokens(tiny, tensor_parallel_size=2)
    assert tokens(tiny, tensor_parallel_size=2) == first


SCRIPT = """
import os, sys, time
from nanovllm import LLM, SamplingParams
llm = LLM({path!r}, num_kv_blocks=256, tensor_parallel_size=2)
print("WORKERS", *[p.pid for p in llm.engine.runner.executor.workers], flush=True)
ending = sys.argv[1]
if ending == "exception":
    raise RuntimeError("the user's script failed")
if ending == "ctrl-c":
    long = SamplingParams(temperature=0, max_tokens=100000, ignore_eos=True)
    llm.generate([[1, 2, 3]] * 4, long, use_tqdm=False)
if ending == "killed":
    time.sleep(600)
print("DONE", flush=True)
"""


@pytest.mark.parametrize("ending", ["normal", "exception", "ctrl-c", "killed"])
def test_no_orphaned_workers(tiny, tmp_path, ending):
    rings_before = set(glob.glob("/dev/shm/nanovllm-mq-*"))
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(SCRIPT.format(path=tiny)))
    proc = subprocess.Popen([sys.executable, str(script), ending], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    line = proc.stdout.readline()
    assert line.startswith("WORKERS"), line + proc.stderr.read()
    pids = [int(p) for p in line.split()[1:]]
    assert pids and all(alive(p) for p in pids)
    if ending == "ctrl-c":
        time.sleep(1.5)  # inside generate()
        proc.send_signal(signal.SIGINT)
    if ending == "killed":  # no Python cleanup at all: the workers notice by themselves
        proc.kill()
    proc.wait(60)
    assert wait_gone(pids) == [], f"workers left running after a {ending} exit"
    assert set(glob.glob("/dev/shm/nanovllm-mq-*")) <= rings_before  # no step ring left
    assert (proc.returncode == 0) == (ending == "normal"), proc.stderr.read()


def test_ranks_started_by_a_launcher_on_loopback(tiny, tmp_path):
    """Two "nodes" on 127.0.0.1: rank 1 started by hand with torch.distributed's variables,
    as it would be on another host; rank 0 starts no worker of its own."""
    port = free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    rank1 = subprocess.Popen([sys.executable, "-m", "nanovllm.engine.worker"],
                             env=dict(env, RANK="1"), cwd=REPO)
    script = tmp_path / "rank0.py"
    script.write_text(textwrap.dedent(f"""
        from nanovllm import LLM, SamplingParams
        with LLM({tiny!r}, num_kv_blocks=64, tensor_parallel_size=2, dtype="float32") as llm:
            assert llm.engine.runner.executor.workers == []
            assert llm.engine.runner.executor.queue is None  # steps over gloo: maybe remote
            outs = llm.generate({PROMPTS!r}, SamplingParams(temperature=0, max_tokens=16,
                                ignore_eos=True), use_tqdm=False)
        print([o.token_ids for o in outs])
    """))
    rank0 = subprocess.run([sys.executable, str(script)], env=dict(env, RANK="0"), cwd=REPO,
                           capture_output=True, text=True, timeout=180)
    assert rank0.returncode == 0, rank0.stderr
    assert rank1.wait(30) == 0
    assert eval(rank0.stdout.strip().splitlines()[-1]) == tokens(tiny)
