"""The streamed chunk's fast path (a preformatted template, ``serve/formats.py``) writes the
same bytes as the pydantic models it stands in for, on random chunks."""

from __future__ import annotations

import json
import random

import pytest

from nanovllm.outputs import StreamChunk
from nanovllm.serve.formats import ChatFormat, CompletionFormat

TEXTS = ["", "Hello", ' "quoted" ', "line\nbreak\ttab", "naïve café ☕", "\\back\\slash",
         "\x00\x1f"]


def random_chunk(rng: random.Random) -> StreamChunk:
    finish = rng.choice([None, None, "stop", "length"])
    stop = rng.choice([None, "END", 2]) if finish == "stop" else None
    ids = [rng.randrange(50_000) for _ in range(rng.randrange(0, 4))]
    text = "".join(rng.choice(TEXTS) for _ in range(rng.randrange(1, 3)))
    return StreamChunk("r", ids, text, finish_reason=finish, stop_reason=stop,
                       index=rng.randrange(2))


@pytest.mark.parametrize("token_ids", [False, True])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_the_template_writes_what_the_models_write(kind: str, token_ids: bool) -> None:
    rng = random.Random(f"{kind}-{token_ids}")
    fmt = (CompletionFormat('cmpl-"x"', "my/model", logprobs=False, token_ids=token_ids)
           if kind == "completion" else
           ChatFormat("chatcmpl-x", "my/model", n=2, top_logprobs=None, token_ids=token_ids))
    checked = 0
    for _ in range(200):
        chunk = random_chunk(rng)
        choice = rng.randrange(4)
        fast = fmt.chunk(choice, chunk, None)
        if fast is None:  # nothing to send: no tokens, no text, no finish
            assert not (chunk.token_ids or chunk.text or chunk.finish_reason)
            continue
        assert fast == fmt.model_chunk(choice, chunk, None)
        assert fast.startswith("data: ") and fast.endswith("\n\n")
        event = json.loads(fast[len("data: "):])
        assert event["choices"][0]["index"] == choice
        checked += 1
    assert checked > 150


def test_running_usage_and_logprobs_take_the_models_path() -> None:
    fmt = CompletionFormat("cmpl-x", "m", logprobs=False, token_ids=False)
    chunk = StreamChunk("r", [5], "hi")
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    event = json.loads(fmt.chunk(0, chunk, usage)[len("data: "):])
    assert event["usage"] == usage and event["choices"][0]["text"] == "hi"
