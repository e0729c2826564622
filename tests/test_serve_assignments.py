"""The graded tests of chapter 10's assignment (nanovllm/course): ``10.token_bucket``, the
token bucket's refill (``TokenBucket._refill``), on a fake clock: no server, no model."""

from __future__ import annotations

import pytest

from nanovllm.serve.admission import Admission, TokenBucket
from nanovllm.serve.config import Limits, ServeConfig
from nanovllm.serve.errors import APIError


class Clock:
    """A clock that only moves when the test moves it."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.mark.assignment("10.token_bucket")
def test_refill_adds_rate_times_elapsed_and_caps_at_capacity():
    clock = Clock(1000.0)  # the clock need not start at zero
    bucket = TokenBucket(rate=4, capacity=10, clock=clock)
    assert bucket.wait_time(10) == 0  # starts full
    bucket.take(10)
    assert bucket.level == pytest.approx(0)
    clock.now += 0.5  # 2 tokens flow in
    assert bucket.wait_time(3) == pytest.approx(0.25)
    assert bucket.level == pytest.approx(2) and bucket.updated == 1000.5
    clock.now += 0.25
    bucket.take(3)  # exactly enough
    assert bucket.level == pytest.approx(0)
    clock.now += 3600  # an hour idle: still at most `capacity`
    bucket._refill()
    assert bucket.level == pytest.approx(10)


@pytest.mark.assignment("10.token_bucket")
def test_each_interval_counts_once_and_a_debt_refills():
    clock = Clock()
    bucket = TokenBucket(rate=2, capacity=4, clock=clock)
    bucket.take(10)  # 6 tokens of debt
    assert bucket.level == pytest.approx(-6)
    for _ in range(5):  # refilling again at the same instant adds nothing
        bucket._refill()
    assert bucket.level == pytest.approx(-6)
    assert bucket.wait_time(1) == pytest.approx(3.5)
    for _ in range(7):  # seven steps of 0.5 s: 7 tokens, one step at a time
        clock.now += 0.5
        bucket._refill()
    assert bucket.level == pytest.approx(1)
    assert bucket.wait_time(1) == 0


@pytest.mark.assignment("10.token_bucket")
def test_admission_turns_a_burst_away_until_the_bucket_refills():
    clock = Clock()
    config = ServeConfig(model="m", limits=Limits(requests_per_second=2, burst=3))
    adm = Admission(config, max_num_seqs=8, clock=clock)
    tenant = adm.authenticate(None)
    for _ in range(3):  # the burst
        adm.enter(tenant)
    with pytest.raises(APIError) as info:
        adm.enter(tenant)
    assert info.value.status == 429 and info.value.retry_after == pytest.approx(0.5)
    clock.now = 0.5
    adm.enter(tenant)
    with pytest.raises(APIError):
        adm.enter(tenant)
    clock.now = 10.0  # long idle: the burst again, not 20 requests
    for _ in range(3):
        adm.enter(tenant)
    with pytest.raises(APIError):
        adm.enter(tenant)
