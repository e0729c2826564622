"""One bad request never hurts another: fault isolation, engine deltas, prompt shapes,
interrupts and threads. Engine tests run with async scheduling off and on."""

from __future__ import annotations

import json
import shutil
import signal
import threading

import numpy as np
import pytest
import torch
from test_scheduler import PROMPTS, make_tiny_llama, one_torch_thread  # noqa: F401

from nanovllm import LLM, SamplingParams
from nanovllm.engine.output_processor import EngineCoreOutput
from nanovllm.engine.policies import FCFS
from nanovllm.engine.sequence import PLACEHOLDER

MODES = [False, True]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-isolation"))


def make_llm(path, **options) -> LLM:
    return LLM(path, num_kv_blocks=options.pop("num_kv_blocks", 64), **options)


def all_blocks_free(llm: LLM) -> bool:
    bm = llm.engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and not llm.engine.requests


def greedy(n: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kwargs)


class PoisonablePolicy(FCFS):
    """FCFS, except that it raises whenever a request of user "poison" is in the queue."""

    def order(self, seqs, now):
        if any(s.user == "poison" for s in seqs):
            raise ZeroDivisionError("this policy cannot rank poison")
        return super().order(seqs, now)


def run_in_threads(work, n: int, timeout: float = 120) -> list[BaseException]:
    """Run ``work(k)`` for k in range(n), each in its own thread; the errors they raised."""
    errors = []

    def guarded(k):
        try:
            work(k)
        except BaseException as err:  # noqa: BLE001 -- returned to the test
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return errors


def run_to_end(llm: LLM, reports: dict[str, list[EngineCoreOutput]], steps: int = 10_000) -> None:
    for _ in range(steps):
        if not llm.engine.has_unfinished_requests():
            return
        for out in llm.engine.step():
            reports.setdefault(out.request_id, []).append(out)
    raise AssertionError("the engine did not finish")


@pytest.mark.parametrize("async_scheduling", MODES)
def test_fault_injection_mixed_workload(tiny, async_scheduling, monkeypatch):
    """Twenty-two requests, more than one in five of them bad: an invalid value (refused
    at construction), one the policy fails on, or one whose sampling settings fail while
    its batch is launched. Every good request yields exactly the tokens of a clean run."""
    good = {f"g{i}": (PROMPTS[i % len(PROMPTS)], greedy(6 + i % 5)) for i in range(16)}
    good["seeded"] = (PROMPTS[3], SamplingParams(temperature=1.0, seed=7, max_tokens=9))
    clean = make_llm(tiny, async_scheduling=async_scheduling, num_kv_blocks=256)
    expected = {}
    for rid, (prompt, params) in good.items():
        [out] = clean.generate([prompt], params, use_tqdm=False)
        expected[rid] = out.token_ids

    llm = make_llm(
        tiny, async_scheduling=async_scheduling, num_kv_blocks=256,
        scheduler_policy=PoisonablePolicy(), max_num_batched_tokens=64,
    )
    runner = llm.engine.runner
    real_sampling_tensors = runner.sampling_inputs.build

    def sampling_tensors(seqs, in_flight):
        if any(s.user == "bomb" for s in seqs):
            raise RuntimeError("sampling settings exploded")
        return real_sampling_tensors(seqs, in_flight)

    monkeypatch.setattr(runner.sampling_inputs, "build", sampling_tensors)
    engine, reports, bad = llm.engine, {}, []
    items = list(good.items())
    for k, (rid, (prompt, params)) in enumerate(items):
        engine.add_request(rid, prompt, params)
        if k % 3 == 2:  # after every third good request, a bad one
            kind = ("value", "poison", "bomb")[k // 3 % 3]
            if kind == "value":
                with pytest.raises(ValueError, match="seed"):
                    engine.add_request(f"bad{k}", prompt, SamplingParams(seed=1.5))
            else:
                bad.append(engine.add_request(f"bad{k}", prompt, greedy(4, user=kind)))
        if k % 4 == 3:  # bad requests also arrive while good ones are running
            for out in engine.step() + engine.step():
                reports.setdefault(out.request_id, []).append(out)
    run_to_end(llm, reports)

    for rid in good:
        assert [t for o in reports[rid] for t in o.new_token_ids] == expected[rid], rid
        assert [o.finished for o in reports[rid]].count(True) == 1
        assert reports[rid][-1].finish_reason == "length"
    assert len(bad) == 3
    for rid in bad:
        last = reports[rid][-1]
        assert last.finish_reason == "error" and last.finished
        assert "ZeroDivisionError" in last.error or "exploded" in last.error
    assert all_blocks_free(llm)


@pytest.mark.parametrize("async_scheduling", MODES)
def test_step_returns_deltas_that_add_up_to_the_outputs(tiny, async_scheduling):
    llm = make_llm(tiny, async_scheduling=async_scheduling)
    expected = [o.token_ids for o in llm.generate(PROMPTS, greedy(7), use_tqdm=False)]
    ids = [llm.engine.add_request(None, p, greedy(7)) for p in PROMPTS]
    reports = {}
    run_to_end(llm, reports)
    for rid, tokens in zip(ids, expected):
        outs = reports[rid]
        assert all(isinstance(o, EngineCoreOutput) for o in outs)
        assert [t for o in outs for t in o.new_token_ids] == tokens
        assert PLACEHOLDER not in tokens
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert all_blocks_free(llm)


def test_stop_reason_of_a_stop_token(tiny):
    llm = make_llm(tiny)
    [free] = llm.generate(PROMPTS[4:5], greedy(8), use_tqdm=False)
    token = free.token_ids[3]
    [out] = llm.generate(PROMPTS[4:5], greedy(8, stop_token_ids=[token]), use_tqdm=False)
    assert out.token_ids == free.token_ids[: free.token_ids.index(token) + 1]
    assert (out.finish_reason, out.outputs[0].stop_reason) == ("stop", token)


def test_prompt_shapes(tiny):
    llm = make_llm(tiny)
    ids = PROMPTS[5]
    expected = llm.generate([ids], greedy(4), use_tqdm=False)[0].token_ids
    shapes = [
        {"prompt_token_ids": ids},
        np.array(ids, dtype=np.int64),
        np.array(ids, dtype=np.int32),
        torch.tensor(ids),
        torch.tensor(ids, dtype=torch.int32),
        tuple(ids),
        [np.int64(t) for t in ids],
    ]
    for prompt in shapes:
        outs = llm.generate(prompt, greedy(4), use_tqdm=False)  # one prompt, not a batch
        assert len(outs) == 1 and outs[0].token_ids == expected, type(prompt)
        assert outs[0].prompt_token_ids == ids
    outs = llm.generate([np.array(ids), {"prompt_token_ids": ids}], greedy(4), use_tqdm=False)
    assert [o.token_ids for o in outs] == [expected, expected]


@pytest.mark.parametrize(
    "prompt",
    [
        {"prompt_token_ids": [1, 2], "extra": 1},
        {"text": "hello"},
        {"prompt": 5},
        np.array([[1, 2], [3, 4]]),
        np.array([1.0, 2.0]),
        torch.tensor([True, False]),
        [True, False],
        [1, 2.5],
        [1, "2"],
        None,
        3.5,
        {"prompt_token_ids": "12"},
    ],
    ids=repr,
)
def test_bad_prompt_shapes_are_value_errors(tiny, prompt):
    llm = make_llm(tiny)
    with pytest.raises(ValueError):
        llm.generate(prompt, greedy(2), use_tqdm=False)
    assert all_blocks_free(llm)


@pytest.mark.parametrize("async_scheduling", MODES)
def test_an_interrupted_generate_returns_every_block(tiny, async_scheduling, monkeypatch):
    llm = make_llm(tiny, async_scheduling=async_scheduling)
    expected = [o.token_ids for o in llm.generate(PROMPTS, greedy(9), use_tqdm=False)]
    real_step, calls = llm.engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # as if Ctrl-C landed inside the third step
        return real_step()

    monkeypatch.setattr(llm.engine, "step", step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, greedy(9), use_tqdm=False)
    assert all_blocks_free(llm)
    monkeypatch.setattr(llm.engine, "step", real_step)
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(9), use_tqdm=False)] == expected


def test_ctrl_c_is_held_until_the_step_ends(tiny, monkeypatch):
    """A real SIGINT during a step: the step completes, then generate raises
    KeyboardInterrupt with every block returned."""
    llm = make_llm(tiny)
    real_step, finished_steps = llm.engine.step, []

    def step():
        if len(finished_steps) == 2:
            signal.raise_signal(signal.SIGINT)  # delivered now, in the middle of this step
        out = real_step()
        finished_steps.append(1)
        return out

    monkeypatch.setattr(llm.engine, "step", step)
    before = signal.getsignal(signal.SIGINT)  # (SIG_IGN where the shell started us in the back)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, greedy(9), use_tqdm=False)
    assert len(finished_steps) == 3  # the interrupted step ran to its end
    assert all_blocks_free(llm)
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_generate_from_four_threads_takes_turns(tiny):
    llm = make_llm(tiny, num_kv_blocks=128)
    jobs = [PROMPTS[i::4] for i in range(4)]
    expected = [[o.token_ids for o in llm.generate(j, greedy(6), use_tqdm=False)] for j in jobs]
    results = [None] * 4

    def work(i):
        results[i] = [o.token_ids for o in llm.generate(jobs[i], greedy(6), use_tqdm=False)]

    assert run_in_threads(work, 4) == [] and results == expected
    assert all_blocks_free(llm)


def test_generated_request_ids_never_collide_with_user_ids(tiny):
    llm = make_llm(tiny)
    engine = llm.engine
    user_ids = {engine.add_request(str(n), PROMPTS[0], greedy(2)) for n in range(200)}
    generated = [engine.add_request(None, PROMPTS[0], greedy(2)) for _ in range(200)]
    assert len(set(generated)) == 200 and user_ids.isdisjoint(generated)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("7", PROMPTS[0], greedy(2))
    run_to_end(llm, {})
    assert all_blocks_free(llm)


@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_failed_request_takes_no_shared_block_down(tiny, async_scheduling, monkeypatch):
    """Two equal prompts admitted in one step: the second adopts the prefix blocks the first
    is about to compute (hashes are registered when scheduled). The first then fails at
    launch, so those blocks are never written: the second is recomputed, not misled."""
    prompt = PROMPTS[-1]  # 64 tokens: four full blocks of 16
    llm = make_llm(tiny, async_scheduling=async_scheduling)
    [expected] = llm.generate([prompt], greedy(5), use_tqdm=False)
    llm = make_llm(tiny, async_scheduling=async_scheduling)
    real_sampling_tensors = llm.engine.runner.sampling_inputs.build

    def sampling_tensors(seqs, in_flight):
        if any(s.user == "bomb" for s in seqs):
            raise RuntimeError("sampling settings exploded")
        return real_sampling_tensors(seqs, in_flight)

    monkeypatch.setattr(llm.engine.runner.sampling_inputs, "build", sampling_tensors)
    engine, reports = llm.engine, {}
    engine.add_request("bomb", prompt, greedy(5, user="bomb"))
    engine.add_request("good", prompt, greedy(5))
    batch_sizes = []
    real_launch = engine.runner.launch
    monkeypatch.setattr(
        engine.runner, "launch", lambda b: batch_sizes.append(len(b)) or real_launch(b)
    )
    run_to_end(llm, reports)
    assert reports["bomb"][-1].finish_reason == "error"
    assert [t for o in reports["good"] for t in o.new_token_ids] == expected.token_ids
    assert batch_sizes[:2] == [2, 1]  # the failing launch, then the good one's recomputation
    assert engine.scheduler.num_preemptions == 1
    assert all_blocks_free(llm)


@pytest.mark.parametrize("priority", [[1.5], [True], ["1"], 3, [0, 1]], ids=repr)
def test_bad_priorities_are_value_errors(tiny, priority):
    llm = make_llm(tiny)
    with pytest.raises(ValueError, match="priority"):
        llm.generate([PROMPTS[0]], greedy(2), use_tqdm=False, priority=priority)
    assert all_blocks_free(llm)


# Questions whose greedy SmolLM2 answers hold characters made of several byte-level tokens.
UNICODE_QUESTIONS = [
    "Write the Chinese name of China in Chinese characters.",
    "Reply with three rocket emojis.",
    "Say hello in Japanese.",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    # (a fixed KV budget: on a GPU the default takes 90% of the memory, for one engine only)
    return {
        mode: LLM(smollm2_dir, max_model_len=256, async_scheduling=mode, num_kv_blocks=64)
        for mode in MODES
    }


def non_ascii_stop(text: str) -> str:
    """Two non-ASCII characters of ``text`` that do not start it: the stop string to find.
    (Taken from the answer itself, since bf16 on a GPU may answer differently from fp32.)"""
    i = next(i for i in range(1, len(text) - 1) if min(map(ord, text[i : i + 2])) > 127)
    return text[i : i + 2]


@pytest.mark.parametrize("async_scheduling", MODES)
@pytest.mark.parametrize("question", UNICODE_QUESTIONS)
def test_stop_strings_in_any_script(smollm2, async_scheduling, question):
    llm = smollm2[async_scheduling]
    chat = [{"role": "user", "content": question}]
    [free] = llm.chat(chat, greedy(40), use_tqdm=False)
    stop = non_ascii_stop(free.text)
    assert len(llm.tokenizer.encode(stop)) > 2  # several tokens per character
    cut = free.text.index(stop)
    for include in (False, True):
        params = greedy(40, stop=[stop, "never printed"], include_stop_str_in_output=include)
        [out] = llm.chat(chat, params, use_tqdm=False)
        completion = out.outputs[0]
        assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
        assert completion.text == free.text[: cut + (len(stop) if include else 0)]
        # the tokens end with the one that completed the stop string
        assert completion.token_ids == free.token_ids[: len(completion.token_ids)]
        assert stop in llm.tokenizer.decode(completion.token_ids)
        assert stop not in llm.tokenizer.decode(completion.token_ids[:-1])


def test_every_eos_id_of_generation_config_stops(tiny, tmp_path):
    """Qwen-family folders list several EOS ids in generation_config.json, not config.json."""
    [free] = make_llm(tiny).generate(PROMPTS[6:7], greedy(8), use_tqdm=False)
    eos = free.token_ids[2]
    folder = tmp_path / "model"
    shutil.copytree(tiny, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, eos]}))
    params = SamplingParams(temperature=0, max_tokens=8)
    [out] = make_llm(folder).generate(PROMPTS[6:7], params, use_tqdm=False)
    assert out.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]
    assert (out.finish_reason, out.outputs[0].stop_reason) == ("stop", None)


def test_priorities_may_be_numpy_integers(tiny):
    llm = make_llm(tiny, scheduler_policy="priority")
    outs = llm.generate(PROMPTS[:2], greedy(2), use_tqdm=False, priority=np.array([1, 0]))
    assert [o.finish_reason for o in outs] == ["length", "length"]
