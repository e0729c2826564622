"""A deployment in one YAML file, every field checked with a clear error (chapter 10).

    model: ~/.cache/nanovllm/SmolLM2-135M-Instruct
    served_model_name: smollm2       # what clients pass as "model" (default: the folder name)
    host: 0.0.0.0
    port: 8000
    # the engine: these are the usual knobs; `engine:` takes any other EngineConfig field
    dtype: bfloat16
    quantization: int8
    tensor_parallel_size: 1
    max_num_seqs: 64
    max_model_len: 4096
    policy: priority                 # fcfs | priority | fair | mixed (the scheduler's)
    engine: {enable_prefix_caching: true}
    speculative_config: {method: ngram, num_speculative_tokens: 4}   # vLLM's keys
    # admission
    max_queue_depth: 128             # sequences waiting beyond max_num_seqs, then 429 (1024)
    max_body_bytes: 16777216         # a larger request body is a 413, refused unread (16 MiB)
    header_timeout: 10               # seconds a connection gets to send a request's headers
    limits: {requests_per_second: 5, burst: 10, tokens_per_minute: 50000}  # every key's
    key_classes:                     # priority (lower first) and limits per class of key
      interactive: {priority: 0}
      batch: {priority: 10, requests_per_second: 1}
    api_keys:                        # none listed: no authentication
      - {key: sk-alice, name: alice, class: interactive}
      - {key_env: BOB_KEY, name: bob, class: batch}   # the secret from an environment variable
    grace_period: 30                 # seconds in-flight requests get after SIGTERM
    engine_process: true             # the engine core in a process of its own (false: a thread)

A wrong name or value raises ``ConfigError`` naming the field (``limits.burst must be an
int >= 1, got 0``); engine option names are checked here, their values by ``EngineConfig``,
except ``speculative_config``'s, checked here too (``nanovllm/speculative_config.py``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanovllm.config import EngineConfig
from nanovllm.engine.policies import POLICIES
from nanovllm.speculative_config import parse_speculative_config
from nanovllm.validation import is_int, is_number

ENGINE_SHORTCUTS = ("dtype", "quantization", "tensor_parallel_size", "max_num_seqs",
                    "max_model_len", "load_format", "speculative_config")
# top-level name -> EngineConfig field
SHORTCUT_FIELDS = {**{name: name for name in ENGINE_SHORTCUTS}, "policy": "scheduler_policy"}


class ConfigError(ValueError):
    pass


@dataclass
class Limits:
    """A key's rate limits (None: unlimited) and its scheduling priority (lower first)."""

    priority: int = 0
    requests_per_second: float | None = None
    burst: int | None = None  # requests a key may send at once (default: about one second's)
    tokens_per_minute: int | None = None  # prompt + generated tokens

    @property
    def request_burst(self) -> int:
        return self.burst or max(1, math.ceil(self.requests_per_second or 1))


@dataclass
class ApiKey:
    key: str
    name: str  # the tenant: the fair policy's user, the metrics' label
    key_class: str = "default"


@dataclass
class ServeConfig:
    model: str
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig options
    max_queue_depth: int | None = 1024  # sequences waiting beyond max_num_seqs (None, in
    # code only: no limit)
    max_body_bytes: int = 16 * 2**20
    header_timeout: float = 10.0  # seconds; then the connection is closed
    limits: Limits = field(default_factory=Limits)
    key_classes: dict[str, Limits] = field(default_factory=dict)
    api_keys: list[ApiKey] = field(default_factory=list)
    grace_period: float = 30.0
    log_level: str = "info"
    engine_process: bool = True  # the engine core in its own process (core_client.py)

    def __post_init__(self) -> None:
        self.model = os.path.expanduser(str(self.model))
        self.served_model_name = self.served_model_name or Path(self.model).name
        self.key_classes.setdefault("default", self.limits)

    def engine_options(self) -> dict[str, Any]:
        return dict(self.engine)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config") -> ServeConfig:
        """Check and build; ``where`` names the source in error messages."""
        _expect(where, "the config", data, lambda d: isinstance(d, dict), "a mapping")
        data = dict(data)
        known = {f.name for f in dataclasses.fields(cls)} | set(SHORTCUT_FIELDS)
        _no_unknown(where, "", data, known)
        if not data.get("model"):
            raise ConfigError(f"{where}: model is required (a model folder)")
        engine = dict(data.pop("engine", None) or {})
        _expect(where, "engine", engine, lambda d: isinstance(d, dict), "a mapping")
        for name, field_name in SHORTCUT_FIELDS.items():
            if name in data:
                if field_name in engine:
                    raise ConfigError(f"{where}: {name} is given twice (also as "
                                      f"engine.{field_name}); keep one")
                engine[field_name] = data.pop(name)
        engine_fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
        _no_unknown(where, "engine.", engine, engine_fields)
        policy = engine.get("scheduler_policy", "fcfs")
        _expect(where, "policy", policy, lambda p: p in POLICIES, f"one of {sorted(POLICIES)}")
        try:  # (its keys and values, so that a typo stops the server before the model loads)
            parse_speculative_config(engine.get("speculative_config"))
        except ValueError as err:
            raise ConfigError(f"{where}: {err}") from None
        check = lambda name, test, allowed: _expect(where, name, data.get(name), test, allowed)
        check("port", lambda p: p is None or (is_int(p) and 0 <= p < 65536), "a port number")
        check("host", lambda h: h is None or isinstance(h, str), "a host name or address")
        check("served_model_name", lambda s: s is None or isinstance(s, str), "a string")
        check("max_queue_depth", lambda d: d is None or (is_int(d) and d >= 0), "an int >= 0")
        check("max_body_bytes", lambda b: b is None or (is_int(b) and b >= 1024),
              "an int >= 1024 (bytes)")
        check("header_timeout", lambda t: t is None or (is_number(t) and t > 0), "seconds > 0")
        check("grace_period", lambda g: g is None or (is_number(g) and g >= 0), "seconds >= 0")
        check("log_level", lambda v: v is None or v in LOG_LEVELS, f"one of {LOG_LEVELS}")
        check("engine_process", lambda v: v is None or isinstance(v, bool), "true or false")
        limits = _limits(where, "limits", data.pop("limits", None) or {}, Limits())
        classes = data.pop("key_classes", None) or {}
        _expect(where, "key_classes", classes, lambda d: isinstance(d, dict), "a mapping")
        key_classes = {
            str(name): _limits(where, f"key_classes.{name}", spec or {}, limits)
            for name, spec in classes.items()
        }
        keys = _api_keys(where, data.pop("api_keys", None) or [], {"default", *key_classes})
        options = {k: v for k, v in data.items() if v is not None}
        return cls(engine=engine, limits=limits, key_classes=key_classes, api_keys=keys,
                   **options)


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def load_config(path: str | os.PathLike | None = None, **overrides: Any) -> ServeConfig:
    """A ``ServeConfig`` from a YAML file (optional) with ``overrides`` on top (the command
    line's flags; None values are ignored)."""
    data: dict[str, Any] = {}
    where = "config"
    if path is not None:
        import yaml

        where = str(path)
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise ConfigError(f"{where}: cannot read the config: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: the config must be a mapping, got {type(data).__name__}")
    for name, value in overrides.items():
        if value is None:
            continue
        if name in ("engine", "limits"):  # merged into the file's mapping
            data[name] = {**(data.get(name) or {}), **value}
            if name == "engine":  # the file's shortcut for the same field gives way
                for short, field_name in SHORTCUT_FIELDS.items():
                    if field_name in value:
                        data.pop(short, None)
        elif name == "api_keys":
            data["api_keys"] = [*(data.get("api_keys") or []), *value]
        else:
            data[name] = value
            if name in SHORTCUT_FIELDS and isinstance(data.get("engine"), dict):
                data["engine"] = dict(data["engine"])  # the file's engine entry gives way
                data["engine"].pop(SHORTCUT_FIELDS[name], None)
    return ServeConfig.from_dict(data, where)


def _expect(where: str, name: str, value: Any, test, allowed: str) -> None:
    if not test(value):
        raise ConfigError(f"{where}: {name} must be {allowed}, got {value!r}")


def _no_unknown(where: str, prefix: str, data: dict, known: set[str]) -> None:
    unknown = sorted(set(map(str, data)) - known)
    if unknown:
        raise ConfigError(
            f"{where}: unknown field(s) {[prefix + u for u in unknown]}; valid: {sorted(known)}"
        )


def _limits(where: str, name: str, spec: Any, base: Limits) -> Limits:
    """A ``Limits`` from a mapping; fields left out come from ``base``."""
    _expect(where, name, spec, lambda d: isinstance(d, dict), "a mapping")
    _no_unknown(where, f"{name}.", spec, {f.name for f in dataclasses.fields(Limits)})
    optional = lambda test: lambda x: x is None or test(x)
    rules = {
        "priority": (is_int, "an int (lower is served first)"),
        "requests_per_second": (optional(lambda x: is_number(x) and x > 0), "a number > 0"),
        "burst": (optional(lambda x: is_int(x) and x >= 1), "an int >= 1"),
        "tokens_per_minute": (optional(lambda x: is_int(x) and x >= 1), "an int >= 1"),
    }
    for key, (test, allowed) in rules.items():
        if key in spec:
            _expect(where, f"{name}.{key}", spec[key], test, allowed)
    return dataclasses.replace(base, **spec)


def _api_keys(where: str, entries: Any, classes: set[str]) -> list[ApiKey]:
    _expect(where, "api_keys", entries, lambda d: isinstance(d, list), "a list")
    keys: list[ApiKey] = []
    for i, entry in enumerate(entries):
        at = f"api_keys[{i}]"
        if isinstance(entry, str):  # a bare key (e.g. --api-key on the command line)
            entry = {"key": entry, "name": f"key{i}"}
        _expect(where, at, entry, lambda d: isinstance(d, dict), "a mapping or a key string")
        _no_unknown(where, f"{at}.", entry, {"key", "key_env", "name", "class"})
        key = entry.get("key")
        if "key_env" in entry:
            key = os.environ.get(str(entry["key_env"]))
            if not key:
                raise ConfigError(f"{where}: {at}.key_env: ${entry['key_env']} is not set")
        _expect(where, f"{at}.key", key, lambda k: isinstance(k, str) and k, "a non-empty string")
        name = entry.get("name", f"key{i}")
        _expect(where, f"{at}.name", name, lambda n: isinstance(n, str) and n, "a string")
        key_class = entry.get("class", "default")
        allowed = f"one of {sorted(classes)}"
        _expect(where, f"{at}.class", key_class, lambda c: c in classes, allowed)
        if key in {k.key for k in keys}:
            raise ConfigError(f"{where}: {at}.key repeats an earlier key")
        keys.append(ApiKey(key, name, key_class))
    return keys
