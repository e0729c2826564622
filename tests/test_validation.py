"""Validation at construction (issue 9: one bad request never hurts another).

A bad ``SamplingParams``, ``EngineConfig``, model folder or checkpoint raises ``ValueError``
naming the field (or file), the value and what is allowed; never a ``TypeError``, never
accepted silently. The hypothesis fuzz at the end checks the promise behind the rules:
whatever values are passed, construction either raises ``ValueError`` or the engine
generates well-formed output.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler import one_torch_thread  # noqa: F401 -- autouse: one thread per module

from nanovllm import LLM, EngineConfig, SamplingParams
from nanovllm.engine.policies import FairPolicy, PriorityPolicy, get_policy
from nanovllm.models import ModelConfig, get_model_class
from nanovllm.validation import SEED_RANGE
from nanovllm.weights.loader import load_safetensors

VOCAB, HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, MAX_POS = 64, 32, 64, 2, 1, 16, 64
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": INTER,
    "num_hidden_layers": 1,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "max_position_embeddings": MAX_POS,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
}


def write_config(folder: Path, config: dict | None = None, **changes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {k: v for k, v in {**(config or TINY), **changes}.items() if v is not ...}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_config(tmp_path_factory.mktemp("tiny"))


# -- SamplingParams ----------------------------------------------------------------------

BAD_SAMPLING = [
    ("temperature", [-0.5, float("nan"), float("inf"), 10**400, "1", True, None]),
    ("top_k", [0, -2, 2.5, True, "5", 2**31, None]),
    ("top_p", [0, 0.0, 1.5, float("nan"), "0.9", True, None]),
    ("min_p", [-0.1, 1.01, float("nan"), "0", True, None]),
    ("seed", [1.5, "x", 2**70, SEED_RANGE[1] + 1, SEED_RANGE[0] - 1, True, [1]]),
    ("max_tokens", [0, -3, 2.5, True, "8", None, float("inf")]),
    ("ignore_eos", [1, "no", None]),
    ("stop_token_ids", [[-1], [True], [1.0], ["3"], True, "3", {1, 2}, None]),
    ("stop", ["", [""], [1], 5, None, [None]]),
    ("include_stop_str_in_output", [1, "yes", None]),
    ("skip_special_tokens", [0, "no", None]),
    ("deadline", [0, -1.0, float("nan"), "1", True, 10**400]),
    ("user", [5, ["a"]]),
    ("request_class", [["batch"], 1]),
]

GOOD_SAMPLING = [
    ("temperature", [0, 0.0, 1e-5, 0.7, 2, 1e308]),
    ("top_k", [-1, 1, 50, MAX_POS, 2**31 - 1, np.int64(7)]),
    ("top_p", [1e-300, 0.5, 1, 1.0]),
    ("min_p", [0, 0.0, 0.1, 1]),
    ("seed", [None, 0, -1, *SEED_RANGE, np.int64(3)]),
    ("max_tokens", [1, 10**9, np.int32(4)]),
    ("ignore_eos", [True, False]),
    ("stop_token_ids", [[], [0, 5], (1, 2), 7, [np.int64(3)]]),
    ("stop", [[], "x", ["a", "bc"], ("a",)]),
    ("include_stop_str_in_output", [True, False]),
    ("skip_special_tokens", [True, False]),
    ("deadline", [None, 0.5, 3, float("inf")]),
    ("user", [None, "alice", ""]),
    ("request_class", [None, "batch"]),
]


def _cases(table):
    return [pytest.param(name, v, id=f"{name}={v!r}"[:40]) for name, vs in table for v in vs]


@pytest.mark.parametrize("name, value", _cases(BAD_SAMPLING))
def test_bad_sampling_value_names_field_and_value(name, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{name} must be .*, got "):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("name, value", _cases(GOOD_SAMPLING))
def test_good_sampling_value_is_accepted_as_a_plain_python_value(name, value):
    params = SamplingParams(**{name: value})
    stored = getattr(params, name)
    if isinstance(value, np.integer):  # numpy scalars become plain ints
        assert type(stored) is int and stored == value
    if name in ("stop", "stop_token_ids"):
        assert isinstance(stored, list)


def test_named_cases():
    for kwargs in ({"seed": 1.5}, {"seed": "x"}, {"seed": 2**70}, {"max_tokens": 2.5},
                   {"top_k": 2.5}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            SamplingParams(**kwargs)


def test_tiny_temperature_is_greedy_not_nan():
    # 1e-38 used to divide the logits into inf, then NaN, then token 0 forever.
    params = SamplingParams(temperature=1e-38)
    assert params.temperature == 0 and params.greedy
    assert SamplingParams(temperature=1e-5).temperature == 1e-5
    assert not SamplingParams(temperature=1e-5).greedy


def test_tiny_top_p_survives_float32():
    params = SamplingParams(top_p=1e-300)
    assert 0 < params.top_p < 1e-30
    assert torch.tensor([params.top_p], dtype=torch.float32).item() > 0


def test_lone_stop_values_become_lists_and_are_copied():
    assert SamplingParams(stop="###", stop_token_ids=5).stop == ["###"]
    assert SamplingParams(stop_token_ids=5).stop_token_ids == [5]
    ids = [1, 2]
    params = SamplingParams(stop_token_ids=ids)
    ids.append(3)
    assert params.stop_token_ids == [1, 2]


def test_new_vllm_fields_default_like_vllm():
    params = SamplingParams()
    assert params.include_stop_str_in_output is False
    assert params.skip_special_tokens is True


@pytest.mark.parametrize("seed", [SEED_RANGE[0], SEED_RANGE[1], SEED_RANGE[0] - 1,
                                  SEED_RANGE[1] + 1])
def test_seed_range_is_exactly_what_torch_accepts(seed):
    try:
        torch.Generator().manual_seed(seed)
        torch_ok = True
    except (RuntimeError, ValueError, OverflowError):
        torch_ok = False
    try:
        SamplingParams(seed=seed)
        ours_ok = True
    except ValueError:
        ours_ok = False
    assert ours_ok == torch_ok


# -- EngineConfig ------------------------------------------------------------------------

BAD_ENGINE = [
    ("model", [5, None]),
    ("device", ["gpu", "cuda:x", "CPU", 0, None]),
    ("dtype", ["fp32", torch.float32, [], None]),
    ("load_format", ["pt", None]),
    ("max_model_len", ["4096", 0, -1, True, 16.0]),
    ("max_num_seqs", [0, True, 2.0, None]),
    ("max_num_batched_tokens", [0, "4096", 1e3]),
    ("block_size", [16.0, 12, 0, -16, True, "16", None]),
    ("enable_prefix_caching", ["no", 1, None]),
    ("enable_chunked_prefill", ["yes", 0]),
    ("enforce_eager", ["no", 1]),
    ("async_scheduling", ["auto", 0]),
    ("attention_backend", ["flash", None]),
    ("gpu_memory_utilization", [0, 1.5, float("nan"), "0.9", True, None]),
    ("num_kv_blocks", [0, 2.0, True, "8"]),
    ("kv_cache_memory", [0, 1e9, True]),
    ("tensor_parallel_size", ["1", True, 1.0]),
    ("seed", [2**64, -(2**63) - 1, 1.5, True, None]),
    ("quantization", ["int4", "awq", "", "INT8", 8, True]),
    ("kv_cache_dtype", ["fp16", "fp8_e5m2", "int8", None, 8]),
]

GOOD_ENGINE = [
    ("device", ["auto", "cpu"]),
    ("dtype", ["auto", "float32", "bfloat16", "float16"]),
    ("load_format", ["auto", "safetensors", "dummy"]),
    ("max_model_len", [None, 1, 64, np.int64(32)]),
    ("block_size", [1, 8, 16, 256]),
    ("async_scheduling", [None, True, False]),
    ("attention_backend", ["auto", "torch"]),
    ("gpu_memory_utilization", [1, 0.5, 1e-9]),
    ("num_kv_blocks", [None, 1, 10**6]),
    ("kv_cache_memory", [None, 1, 2**30]),
    ("scheduler_policy", ["fcfs", "priority", "fair", "mixed", PriorityPolicy(),
                          lambda seqs, now: seqs]),
    ("seed", [0, -1, *SEED_RANGE]),
    ("quantization", [None, "int8", "fp8"]),  # (fp8 on a CPU: the emulated path)
    ("kv_cache_dtype", ["auto", "fp8"]),
]


@pytest.mark.parametrize("name, value", _cases(BAD_ENGINE))
def test_bad_engine_value_names_field_and_value(tiny_dir, name, value):
    kwargs = {"model": str(tiny_dir), name: value}
    with pytest.raises(ValueError, match=rf"EngineConfig\.{name} must be .*, got "):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("name, value", _cases(GOOD_ENGINE))
def test_good_engine_value_is_accepted(tiny_dir, name, value):
    kwargs = {"device": "cpu", name: value}  # on a GPU "auto" would need blocks of 16
    config = EngineConfig(model=str(tiny_dir), **kwargs)
    assert config.device in ("cpu", "cuda") or config.device.startswith("cuda:")
    assert config.dtype in ("float32", "bfloat16", "float16")
    assert isinstance(config.async_scheduling, bool)


def test_model_may_be_a_path(tiny_dir):
    assert EngineConfig(model=tiny_dir).model == tiny_dir


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an int >= 1"),
        ({"tensor_parallel_size": 2, "device": "cuda:0"}, "CUDA is not available|pass device"),
        ({"attention_backend": "flash_attn"}, "flash-attn"),
        ({"scheduler_policy": "lottery"}, "unknown scheduler_policy"),
        ({"scheduler_policy": 3}, "scheduler_policy must be"),
        ({"scheduler_policy": PriorityPolicy}, r"pass an instance, e\.g\. PriorityPolicy\(\)"),
        ({"scheduler_policy": FairPolicy}, r"FairPolicy\(\)"),
    ],
)
def test_engine_combinations(tiny_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=str(tiny_dir), **kwargs)


def test_model_folder_without_config_json(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        EngineConfig(model=str(tmp_path))


def test_cuda_without_cuda(tiny_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:0"):
        with pytest.raises(ValueError, match="CUDA is not available"):
            EngineConfig(model=str(tiny_dir), device=device)
    assert EngineConfig(model=str(tiny_dir)).device == "cpu"


def test_cuda_index_beyond_the_gpus(tiny_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="there are 1 GPUs"):
        EngineConfig(model=str(tiny_dir), device="cuda:1")


triton_installed = pytest.mark.skipif(
    not __import__("importlib").util.find_spec("triton"), reason="needs triton"
)


@triton_installed
def test_triton_needs_blocks_of_16(tiny_dir, monkeypatch):
    with pytest.raises(ValueError, match="block_size 8 is too small"):
        EngineConfig(model=str(tiny_dir), attention_backend="triton", block_size=8)
    EngineConfig(model=str(tiny_dir), attention_backend="triton", block_size=16)
    # "auto" is the torch backend on a CPU (any block size), Triton on a GPU
    EngineConfig(model=str(tiny_dir), device="cpu", block_size=8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(ValueError, match="attention_backend='torch'"):
        EngineConfig(model=str(tiny_dir), device="cuda", block_size=8)
    EngineConfig(model=str(tiny_dir), device="cuda", block_size=8, attention_backend="torch")


def test_unknown_option_is_still_named(tiny_dir):
    with pytest.raises(ValueError, match="unknown engine option"):
        EngineConfig.from_kwargs(str(tiny_dir), max_num_seq=4)


def test_get_policy_takes_instances_not_classes():
    policy = FairPolicy()
    assert get_policy(policy) is policy
    with pytest.raises(ValueError, match=r"PriorityPolicy\(\)"):
        get_policy(PriorityPolicy)


# -- model folders -----------------------------------------------------------------------


def test_corrupt_config_json(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 64,')
    with pytest.raises(ValueError, match=r"config\.json is not a readable JSON file"):
        ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"config\.json"):
        LLM(tmp_path, load_format="dummy")


def test_config_json_that_is_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        ModelConfig.from_pretrained(tmp_path)


def test_missing_config_json(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("field", ["architectures", "vocab_size", "hidden_size",
                                   "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads"])
def test_missing_required_field(tmp_path, field):
    write_config(tmp_path, **{field: ...})
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path}") + rf".*lacks .*'{field}'"):
        ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "field, value",
    [
        ("architectures", "LlamaForCausalLM"),  # a string is not a list of names
        ("architectures", []),
        ("architectures", [""]),
        ("vocab_size", "64"),
        ("hidden_size", 32.0),
        ("num_hidden_layers", 0),
        ("num_attention_heads", True),
        ("num_key_value_heads", -1),
        ("head_dim", "16"),
        ("max_position_embeddings", 1.5),
        ("rms_norm_eps", "1e-6"),
        ("rms_norm_eps", 0),
        ("rope_theta", -1),
        ("rope_parameters", "default"),
        ("rope_scaling", 2.0),
        ("tie_word_embeddings", "false"),
        ("attention_bias", 0),
        ("eos_token_id", "2"),
        ("eos_token_id", [2, -1]),
        ("eos_token_id", [True]),
    ],
)
def test_wrongly_typed_field(tmp_path, field, value):
    write_config(tmp_path, **{field: value})
    with pytest.raises(ValueError, match=rf"config\.json: field '{field}' must be"):
        ModelConfig.from_pretrained(tmp_path)


def test_shape_fields_must_agree(tmp_path):
    write_config(tmp_path, num_attention_heads=3, num_key_value_heads=2)
    with pytest.raises(ValueError, match="'num_key_value_heads' .* must divide"):
        ModelConfig.from_pretrained(tmp_path)
    write_config(tmp_path, hidden_size=30, num_attention_heads=4, num_key_value_heads=4,
                 head_dim=None)
    with pytest.raises(ValueError, match="'hidden_size' .* multiple"):
        ModelConfig.from_pretrained(tmp_path)
    write_config(tmp_path, rope_parameters={"rope_theta": "big"})
    with pytest.raises(ValueError, match="rope_parameters.rope_theta"):
        ModelConfig.from_pretrained(tmp_path)


def test_optional_fields_may_be_null(tmp_path):
    write_config(tmp_path, head_dim=None, rope_scaling=None, eos_token_id=None, rope_theta=1000)
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.head_dim == HIDDEN // HEADS and cfg.eos_token_ids == ()
    assert cfg.rope_theta == 1000.0 and isinstance(cfg.rope_theta, float)


def test_from_dict_names_its_source():
    with pytest.raises(ValueError, match="my-dict: field 'vocab_size'"):
        ModelConfig.from_dict({**TINY, "vocab_size": "x"}, source="my-dict")


@pytest.mark.parametrize(
    "config_eos, generation_eos, expected",
    [
        (2, [3, 2, 4], (2, 3, 4)),  # Qwen-style list, merged in order without repeats
        ([2, 5], 5, (2, 5)),
        (None, [7, 7], (7,)),
        (2, None, (2,)),
    ],
)
def test_generation_config_eos_ids_are_merged(tmp_path, config_eos, generation_eos, expected):
    write_config(tmp_path, eos_token_id=config_eos)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", r"generation_config\.json is not a readable JSON file"),
        ('"text"', r"generation_config\.json must hold a JSON object"),
        ('{"eos_token_id": "2"}', r"generation_config\.json: field 'eos_token_id'"),
        ('{"eos_token_id": [1.5]}', r"generation_config\.json: field 'eos_token_id'"),
    ],
)
def test_bad_generation_config(tmp_path, text, message):
    write_config(tmp_path)
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_pretrained(tmp_path)


# -- checkpoints -------------------------------------------------------------------------


def checkpoint_tensors() -> dict[str, torch.Tensor]:
    """The tiny model's tensors under Hugging Face's names (q/k/v, gate/up unpacked)."""
    p = "model.layers.0."
    shapes = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.norm.weight": (HIDDEN,),
        "lm_head.weight": (VOCAB, HIDDEN),
        p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
        p + "mlp.gate_proj.weight": (INTER, HIDDEN),
        p + "mlp.up_proj.weight": (INTER, HIDDEN),
        p + "mlp.down_proj.weight": (HIDDEN, INTER),
        p + "input_layernorm.weight": (HIDDEN,),
        p + "post_attention_layernorm.weight": (HIDDEN,),
    }
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=gen) * 0.1 for name, shape in shapes.items()}


def save_checkpoint(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    write_config(folder)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def tiny_model() -> torch.nn.Module:
    cfg = ModelConfig.from_dict(TINY)
    return get_model_class(cfg.architecture)(cfg)


def test_complete_checkpoint_loads(tmp_path):
    tensors = checkpoint_tensors()
    model = tiny_model()
    load_safetensors(model, save_checkpoint(tmp_path, tensors))
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    v_proj = tensors["model.layers.0.self_attn.v_proj.weight"]
    assert torch.equal(qkv[-KV_HEADS * HEAD_DIM :], v_proj)


@pytest.mark.parametrize("dropped", [
    "model.norm.weight",
    "model.layers.0.mlp.up_proj.weight",  # half of a packed parameter is still missing
    "model.layers.0.self_attn.v_proj.weight",
])
def test_missing_tensor_is_named_and_counted(tmp_path, dropped):
    tensors = checkpoint_tensors()
    del tensors[dropped]
    folder = save_checkpoint(tmp_path, tensors)
    message = re.escape(f"{folder} lacks 1 of the ") + r"\d+ tensors .*: " + re.escape(dropped)
    with pytest.raises(ValueError, match=message + "$"):
        load_safetensors(tiny_model(), folder)


@pytest.mark.parametrize("name, shape", [
    ("model.layers.0.self_attn.k_proj.weight", (2 * KV_HEADS * HEAD_DIM, HIDDEN)),  # too big
    ("model.layers.0.self_attn.q_proj.weight", (HEADS * HEAD_DIM, 1)),  # would broadcast
    ("model.layers.0.mlp.gate_proj.weight", (INTER // 2, HIDDEN)),
    ("model.layers.0.self_attn.o_proj.weight", (HIDDEN, HIDDEN + 1)),
    ("model.embed_tokens.weight", (VOCAB - 1, HIDDEN)),
    ("lm_head.weight", (VOCAB + 1, HIDDEN)),
    ("model.norm.weight", (1,)),
])
def test_wrong_shape_names_file_tensor_and_both_shapes(tmp_path, name, shape):
    tensors = checkpoint_tensors()
    expected = tuple(tensors[name].shape)
    tensors[name] = torch.zeros(shape)
    folder = save_checkpoint(tmp_path, tensors)
    message = re.escape(f"model.safetensors: tensor '{name}'") + ".*" + re.escape(
        f"expected shape {expected}, got {shape}"
    )
    with pytest.raises(ValueError, match=message):
        load_safetensors(tiny_model(), folder)


def test_extra_or_unreadable_checkpoint(tmp_path):
    tensors = checkpoint_tensors()
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match="'model.layers.0.mlp.extra.weight' has no place"):
        load_safetensors(tiny_model(), save_checkpoint(tmp_path / "extra", tensors))
    (tmp_path / "extra" / "model.safetensors").write_bytes(b"not a checkpoint" * 4)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_safetensors(tiny_model(), tmp_path / "extra")


# -- fuzz: ValueError at construction, or a well-formed generation ------------------------

MAX_MODEL_LEN = 24
PROMPT = [5, 6, 7]
# Values of every type, the edge cases of floats (nan, inf, 1e308, 5e-324) included.
anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=70),
    st.integers(),
    st.floats(),
    st.text(max_size=3),
    st.lists(st.integers(min_value=-2, max_value=VOCAB + 2), max_size=3),
    st.lists(st.text(max_size=2), max_size=2),
)
edge_floats = st.sampled_from([0.0, 5e-324, 1e-300, 1e-38, 1e-5, 1.0, 1e308])


def mixed(plausible: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly values of the field's own kind (so that many requests get to run), sometimes
    anything at all."""
    return st.one_of(plausible, plausible, anything)


SAMPLING_VALUES = {
    "temperature": mixed(st.one_of(st.floats(0, 5), edge_floats)),
    "top_k": mixed(st.one_of(st.integers(-1, VOCAB + 5), st.just(2**31 - 1))),
    "top_p": mixed(st.one_of(st.floats(0, 1), edge_floats)),
    "min_p": mixed(st.one_of(st.floats(0, 1), edge_floats)),
    "seed": mixed(st.one_of(st.none(), st.integers(*SEED_RANGE))),
    "max_tokens": mixed(st.one_of(st.integers(1, 30), st.integers(min_value=1))),
    "ignore_eos": mixed(st.booleans()),
    "stop_token_ids": mixed(st.one_of(st.integers(0, VOCAB), st.lists(st.integers(0, 10**6)))),
    "stop": mixed(st.one_of(st.text(min_size=1), st.lists(st.text(min_size=1), max_size=2))),
    "include_stop_str_in_output": mixed(st.booleans()),
    "skip_special_tokens": mixed(st.booleans()),
    "deadline": mixed(st.one_of(st.none(), st.floats(min_value=0, exclude_min=True))),
    "user": mixed(st.one_of(st.none(), st.text(max_size=2))),
    "request_class": mixed(st.one_of(st.none(), st.text(max_size=2))),
}


def some_fields(values: dict[str, st.SearchStrategy], max_size: int) -> st.SearchStrategy:
    """A dict of up to ``max_size`` of the fields, each with a value from its strategy."""
    names = st.lists(st.sampled_from(sorted(values)), max_size=max_size, unique=True)
    return names.flatmap(lambda ns: st.fixed_dictionaries({n: values[n] for n in ns}))


def assert_well_formed(outputs, max_tokens: int) -> None:
    assert len(outputs) == 1 and len(outputs[0].outputs) == 1
    completion = outputs[0].outputs[0]
    assert completion.finish_reason in ("stop", "length")
    assert len(completion.token_ids) <= max_tokens
    assert all(type(t) is int and 0 <= t < VOCAB for t in completion.token_ids)


@pytest.fixture(scope="module")
def fuzz_llm(tiny_dir):
    return LLM(tiny_dir, load_format="dummy", device="cpu", dtype="float32",
               max_model_len=MAX_MODEL_LEN, num_kv_blocks=4, block_size=8,
               scheduler_policy="priority")  # so deadlines reach its arithmetic


def test_edge_values_sample_as_they_mean(fuzz_llm):
    """Values at the edge of each range keep their meaning through float32 on the device:
    a NaN distribution would show as token 0 forever (argmax picks the first NaN)."""
    run = lambda **kw: fuzz_llm.generate(  # noqa: E731
        [PROMPT], SamplingParams(max_tokens=12, ignore_eos=True, **kw), use_tqdm=False
    )[0].token_ids
    greedy = run(temperature=0)
    assert set(greedy) != {0}  # else the comparisons below could not see NaN
    for kwargs in ({"temperature": 1e-38}, {"top_p": 1e-300}, {"top_p": 5e-324},
                   {"top_k": 1}, {"min_p": 1.0}):
        assert run(seed=1, **kwargs) == greedy, kwargs
    assert len(set(run(temperature=1e308, seed=0))) > 3  # uniform, not stuck on one token


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(kwargs=some_fields(SAMPLING_VALUES, max_size=5))
def test_fuzz_sampling_params(fuzz_llm, kwargs):
    # generate() validates each request against the model (e.g. stop ids within the
    # vocabulary) before submitting any: a ValueError there is a rejection too
    try:
        params = SamplingParams(**kwargs)
        outputs = fuzz_llm.generate([PROMPT], params, use_tqdm=False)
    except ValueError:
        return
    assert_well_formed(outputs, params.max_tokens)


ENGINE_FIELDS = [
    "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
    "enable_prefix_caching", "enable_chunked_prefill", "enforce_eager", "async_scheduling",
    "gpu_memory_utilization", "num_kv_blocks", "kv_cache_memory", "seed", "device", "dtype",
    "attention_backend", "scheduler_policy", "tensor_parallel_size", "load_format",
]
INT_FIELDS = ["max_num_seqs", "max_num_batched_tokens", "block_size", "seed",
              "tensor_parallel_size"]


@settings(max_examples=60, deadline=None, database=None)
@given(kwargs=some_fields({name: anything for name in ENGINE_FIELDS}, max_size=4))
def test_fuzz_engine_config(tiny_dir, kwargs):
    try:
        config = EngineConfig(model=str(tiny_dir), **kwargs)
    except ValueError:
        return
    # what was accepted is what the rules promise, in plain Python types
    for name in INT_FIELDS:
        assert type(getattr(config, name)) is int
    for name in ("max_model_len", "num_kv_blocks", "kv_cache_memory"):
        assert getattr(config, name) is None or type(getattr(config, name)) is int
    for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager",
                 "async_scheduling"):
        assert type(getattr(config, name)) is bool
    assert math.isfinite(config.gpu_memory_utilization)
    assert 0 < config.gpu_memory_utilization <= 1


odd = st.sampled_from([None, True, 16.0, "8", float("nan"), 0, -1])
ENGINE_VALUES = {  # num_kv_blocks is always given: its CPU default would allocate 1 GiB
    "max_model_len": st.one_of(st.integers(1, MAX_POS + 2), odd),
    "max_num_seqs": st.one_of(st.integers(1, 4), odd),
    "max_num_batched_tokens": st.one_of(st.integers(1, 64), odd),
    "block_size": st.one_of(st.sampled_from([1, 2, 4, 8, 16, 32, 64]), odd),
    "enable_prefix_caching": st.one_of(st.booleans(), odd),
    "enable_chunked_prefill": st.one_of(st.booleans(), odd),
}


@settings(max_examples=20, deadline=None, database=None)
@given(
    kwargs=some_fields(ENGINE_VALUES, max_size=4),
    num_kv_blocks=st.one_of(st.integers(1, 12), st.sampled_from([0, 4.0, "4"])),
    max_tokens=st.integers(min_value=1, max_value=8),
)
def test_fuzz_engine_config_then_generate(tiny_dir, kwargs, num_kv_blocks, max_tokens):
    # a ValueError may come from the config, the engine (e.g. max_model_len above the
    # model's limit) or the request (it cannot fit the KV cache): all before any work
    try:
        llm = LLM(tiny_dir, load_format="dummy", device="cpu", dtype="float32",
                  num_kv_blocks=num_kv_blocks, **kwargs)
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        outputs = llm.generate([PROMPT], params, use_tqdm=False)
    except ValueError:
        return
    assert_well_formed(outputs, max_tokens)


def test_the_step_budget_defaults_by_device(tiny_dir, monkeypatch):
    """None: 4096 on a CPU (the chapters' numbers), vLLM's offline defaults on a GPU."""
    from types import SimpleNamespace

    from nanovllm.config import default_max_num_batched_tokens

    assert EngineConfig(model=str(tiny_dir), device="cpu").max_num_batched_tokens == 4096
    assert EngineConfig(model=str(tiny_dir), max_num_batched_tokens=96).max_num_batched_tokens == 96
    for gib, budget in [(141, 16384), (80, 16384), (40, 8192), (24, 8192)]:
        props = SimpleNamespace(total_memory=gib * 2**30)
        monkeypatch.setattr("torch.cuda.get_device_properties", lambda device, p=props: p)
        assert default_max_num_batched_tokens("cuda") == budget
        assert default_max_num_batched_tokens("cuda:1") == budget

    def unreadable(device):
        raise RuntimeError("no device")

    monkeypatch.setattr("torch.cuda.get_device_properties", unreadable)
    assert default_max_num_batched_tokens("cuda") == 8192  # the smaller one
