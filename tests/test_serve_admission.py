"""The server's admission control and deployment config, without a model: token buckets on
a fake clock, queue depth, API keys; every config field checked with a clear error."""

from __future__ import annotations

import pytest

from nanovllm.serve.admission import Admission, TokenBucket
from nanovllm.serve.config import ApiKey, ConfigError, Limits, ServeConfig, load_config
from nanovllm.serve.errors import APIError


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.assignment("10.token_bucket")
def test_token_bucket_refills_at_its_rate_and_caps_at_its_capacity():
    clock = Clock()
    bucket = TokenBucket(rate=2, capacity=4, clock=clock)
    assert bucket.wait_time(4) == 0
    bucket.take(4)
    assert bucket.wait_time(1) == pytest.approx(0.5)
    clock.now = 100  # a long idle time still leaves only `capacity`
    assert bucket.wait_time(4) == 0 and bucket.wait_time(5) == 0  # (asks above capacity: capped)
    bucket.take(10)  # debt: 6 below zero
    assert bucket.wait_time(1) == pytest.approx(3.5)
    clock.now += 3.5
    assert bucket.wait_time(1) == pytest.approx(0)


def admission(clock=None, **options) -> Admission:
    config = ServeConfig(model="m", **options)
    return Admission(config, max_num_seqs=2, clock=clock or Clock())


def test_queue_depth_counts_sequences():
    adm = admission(max_queue_depth=1)  # 2 running + 1 waiting
    tenant = adm.authenticate(None)
    tickets = [adm.admit(tenant, 1), adm.admit(tenant, 2)]
    with pytest.raises(APIError) as info:
        adm.admit(tenant, 1)
    assert info.value.status == 429 and info.value.code == "queue_full"
    assert info.value.response().headers["retry-after"] == "1"
    for t in tickets:
        adm.release(t)
        adm.release(t)  # twice is once
    assert adm.in_flight == 0
    with pytest.raises(APIError) as info:
        adm.admit(tenant, 4)  # n=4 could never enter
    assert info.value.status == 400 and info.value.param == "n"
    adm.release(adm.admit(tenant, 3))
    assert ServeConfig(model="m").max_queue_depth == 1024  # a queue is never unbounded


@pytest.mark.assignment("10.token_bucket")
def test_keys_classes_and_per_key_buckets():
    clock = Clock()
    keys = [ApiKey("k1", "alice", "gold"), ApiKey("k2", "bob")]
    adm = admission(clock, api_keys=keys, key_classes={"gold": Limits(priority=-5)},
                    limits=Limits(requests_per_second=1, burst=2, tokens_per_minute=600))
    with pytest.raises(APIError) as info:
        adm.authenticate(None)
    assert info.value.status == 401 and "didn't provide" in info.value.message
    for header in ("Bearer nope", "k1", "Basic k1"):
        with pytest.raises(APIError):
            adm.authenticate(header)
    alice, bob = adm.authenticate("Bearer k1"), adm.authenticate("bearer  k2")
    assert (alice.name, alice.key_class, alice.limits.priority) == ("alice", "gold", -5)
    assert (bob.name, bob.key_class, bob.limits.priority) == ("bob", "default", 0)
    assert alice.limits.requests_per_second is None  # a class sets every limit it names...
    assert bob.limits.requests_per_second == 1  # ...the default class takes `limits`
    for _ in range(2):
        adm.enter(bob)
        ticket = adm.admit(bob, 1)
        adm.charge(ticket, 10)
        adm.release(ticket)
    with pytest.raises(APIError) as info:
        adm.enter(bob)  # burst of 2 spent
    assert info.value.retry_after == pytest.approx(1.0)
    clock.now = 1.0
    adm.enter(bob)
    ticket = adm.admit(bob, 1)
    adm.charge(ticket, 10)
    adm.release(ticket, generated_tokens=600)  # 620 of 600 tokens: 20 in debt
    clock.now = 3.0
    with pytest.raises(APIError) as info:
        adm.enter(bob)  # the token bucket holds 0 after 2 s of refill: turned away at entry
    assert "tokens per minute" in info.value.message
    assert info.value.retry_after == pytest.approx(0.1)
    clock.now = 6.0  # 30 tokens: one request enters, but its prompt of 40 waits for 10 more
    adm.enter(bob)
    ticket = adm.admit(bob, 1)
    with pytest.raises(APIError) as info:
        adm.charge(ticket, 40)
    assert info.value.retry_after == pytest.approx(1.0)


def test_a_config_file_with_every_section(tmp_path, monkeypatch):
    monkeypatch.setenv("BOB_KEY", "sk-bob")
    path = tmp_path / "deploy.yaml"
    path.write_text("""
model: ~/models/smol
served_model_name: smol
host: 0.0.0.0
port: 9000
dtype: bfloat16
max_num_seqs: 64
max_model_len: 2048
policy: priority
engine: {enable_prefix_caching: false}
max_queue_depth: 32
limits: {requests_per_second: 5, burst: 10, tokens_per_minute: 50000}
key_classes:
  interactive: {priority: 0}
  batch: {priority: 10, requests_per_second: 1}
api_keys:
  - {key: sk-alice, name: alice, class: interactive}
  - {key_env: BOB_KEY, name: bob, class: batch}
grace_period: 10
max_body_bytes: 1048576
header_timeout: 5
""")
    config = load_config(path, port=9001, engine={"max_num_seqs": 8})
    assert config.model.endswith("models/smol") and "~" not in config.model
    assert config.port == 9001 and config.host == "0.0.0.0"
    assert (config.max_body_bytes, config.header_timeout) == (2**20, 5)
    assert config.engine_options() == {
        "enable_prefix_caching": False, "dtype": "bfloat16", "max_num_seqs": 8,
        "max_model_len": 2048, "scheduler_policy": "priority"}
    assert config.key_classes["batch"] == Limits(10, 1, 10, 50000)
    assert config.key_classes["default"] == Limits(0, 5, 10, 50000)
    assert [(k.key, k.name, k.key_class) for k in config.api_keys] == [
        ("sk-alice", "alice", "interactive"), ("sk-bob", "bob", "batch")]
    assert load_config(model="/m").served_model_name == "m"


BAD_CONFIGS = [
    ({}, "model is required"),
    ({"model": "m", "prot": 1}, "unknown field(s) ['prot']"),
    ({"model": "m", "port": "80"}, "port must be a port number"),
    ({"model": "m", "policy": "lottery"}, "policy must be one of"),
    ({"model": "m", "engine": {"max_num_seq": 4}}, "engine.max_num_seq"),
    ({"model": "m", "max_queue_depth": -1}, "max_queue_depth must be an int >= 0"),
    ({"model": "m", "limits": {"burst": 0}}, "limits.burst must be an int >= 1"),
    ({"model": "m", "limits": {"rps": 1}}, "limits.rps"),
    ({"model": "m", "key_classes": {"gold": {"priority": "high"}}}, "key_classes.gold.priority"),
    ({"model": "m", "api_keys": [{"key": "a", "class": "gold"}]}, "api_keys[0].class"),
    ({"model": "m", "api_keys": [{"key": ""}]}, "api_keys[0].key must be a non-empty"),
    ({"model": "m", "api_keys": ["a", "a"]}, "api_keys[1].key repeats"),
    ({"model": "m", "api_keys": [{"key_env": "NANOVLLM_NO_SUCH_VAR"}]}, "is not set"),
    ({"model": "m", "grace_period": -1}, "grace_period must be seconds >= 0"),
    ({"model": "m", "max_body_bytes": 10}, "max_body_bytes must be an int >= 1024"),
    ({"model": "m", "header_timeout": 0}, "header_timeout must be seconds > 0"),
    ({"model": "m", "log_level": "loud"}, "log_level must be one of"),
]


@pytest.mark.parametrize("data, message", BAD_CONFIGS)
def test_bad_config_fields_are_named(data, message):
    with pytest.raises(ConfigError) as info:
        ServeConfig.from_dict(data, "deploy.yaml")
    assert str(info.value).startswith("deploy.yaml: ") and message in str(info.value)


def test_a_bad_yaml_file(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(path)
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(path)


def test_an_engine_field_given_twice_is_refused():
    with pytest.raises(ConfigError, match="max_num_seqs is given twice"):
        ServeConfig.from_dict({"model": "m", "max_num_seqs": 4, "engine": {"max_num_seqs": 8}})


def test_the_command_line_wins_over_the_file(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text("model: m\nengine: {max_num_seqs: 8, scheduler_policy: fair}\npolicy: null\n")
    config = load_config(path, max_num_seqs=4, policy="priority")
    assert config.engine_options() == {"max_num_seqs": 4, "scheduler_policy": "priority"}
