"""Phi-3 (fused ``qkv_proj`` and ``gate_up_proj`` checkpoint tensors) against transformers
(chapter 12 §6; assignment ``12.phi3_fused_weights``, ``Phi3ForCausalLM.split_fused_tensor``).

A tiny random Phi-3, fp32 on CPU: logits within 1e-4 of transformers' and greedy tokens equal
at one rank. At one rank a solution that copies the fused tensor whole would pass those, so the
split is also graded where it matters: the loader at two simulated ranks must give each rank
exactly its heads of q, of k and of v (and its rows of gate and of up), an engine at
``tensor_parallel_size=2`` (gloo) must produce transformers' tokens, and a unit test checks
the pieces and their names on hand-made tensors.
"""

from __future__ import annotations

import json

import pytest
import torch
from course_ids import ENGINE, MODEL
from test_tensor_parallel import TP
from test_tp_assignments import as_rank

from nanovllm import LLM, SamplingParams
from nanovllm.context import attention_metadata
from nanovllm.models import ModelConfig, get_model_class, supported_architectures
from nanovllm.models.phi3 import Phi3ForCausalLM
from nanovllm.weights.loader import load_safetensors

transformers = pytest.importorskip("transformers")

ID = "12.phi3_fused_weights"
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER = 4, 2, 32, 128, 192  # q 128 rows, k/v 64, gate/up 192
WINDOW = 12
# a window replaces the causal attention with the windowed one (assignment 12.sliding_window)
WINDOWED_MODEL = ("01.rmsnorm", "01.rope", "12.sliding_window")


def _tiny_hf_phi3(path, sliding_window: int | None = None):
    config = transformers.Phi3Config(
        vocab_size=256, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
        original_max_position_embeddings=256, sliding_window=sliding_window,
        eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config).eval()
    with torch.no_grad():  # randomise the norms, so a missing one cannot hide
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("phi3")
    return _tiny_hf_phi3(path), path


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def test_registered_and_configured(tiny):
    hf, path = tiny
    assert "Phi3ForCausalLM" in supported_architectures()
    assert json.loads((path / "config.json").read_text())["model_type"] == "phi3"
    cfg = ModelConfig.from_pretrained(path)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)
    assert cfg.rope_scaling is None and cfg.sliding_window is None
    assert isinstance(get_model_class(cfg.architecture)(cfg), Phi3ForCausalLM)
    names = set(hf.state_dict())  # what the checkpoint holds: fused, no q_proj
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert not any(".q_proj." in n or ".gate_proj." in n for n in names)


@pytest.mark.parametrize("change, match", [
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 16,
                       "long_factor": [2.0] * 16}}, "longrope"),
    ({"rope_scaling": {"type": "su", "short_factor": [1.0] * 16,
                       "long_factor": [2.0] * 16}}, "Phi-3's rope scaling 'su'"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "Phi-3's rope scaling 'yarn'"),
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                          "partial_rotary_factor": 0.5}}, "partial_rotary_factor 0.5"),
])
def test_unsupported_phi3_configs_are_refused(tmp_path, change, match):
    cfg = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 8,
           "hidden_size": 64, "intermediate_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 2, "max_position_embeddings": 4096,
           "original_max_position_embeddings": 4096, **change}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("window", [
    pytest.param(None, marks=pytest.mark.assignment(*MODEL, ID)),
    pytest.param(WINDOW, marks=pytest.mark.assignment(*WINDOWED_MODEL, ID)),
], ids=["causal", "window"])
def test_logits_match_transformers(tmp_path, window):
    hf = _tiny_hf_phi3(tmp_path, sliding_window=window)
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg.sliding_window == window
    ours = get_model_class(cfg.architecture)(cfg)
    load_safetensors(ours, tmp_path)
    n = 5 * WINDOW + 3  # longer than the window
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), attention_metadata(None):
        logits = ours.compute_logits(ours(ids, torch.arange(n)))
        expected = hf(ids[None]).logits[0]
    assert (logits - expected).abs().max() <= 1e-4


PROMPTS = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (5, 29, 41)]


@pytest.mark.assignment(*ENGINE, ID)
def test_engine_greedy_matches_transformers(tiny):
    hf, path = tiny
    llm = LLM(path, block_size=16, max_num_batched_tokens=16, num_kv_blocks=64)  # chunked
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert [o.token_ids for o in outs] == [_hf_greedy(hf, p, 12) for p in PROMPTS]


@pytest.mark.assignment(*TP, ID)
def test_engine_at_two_ranks_matches_transformers(tiny):
    """Two gloo workers, each loading its shards of the fused tensors."""
    hf, path = tiny
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(path, tensor_parallel_size=2, dtype="float32", num_kv_blocks=64) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [_hf_greedy(hf, p, 12) for p in PROMPTS]


@pytest.mark.assignment(ID, "09.row_shard")
def test_loader_gives_each_rank_its_slices_of_the_fused_tensors(tiny):
    hf, path = tiny
    n = 2
    cfg = ModelConfig.from_pretrained(path)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for layer in range(2):
        fused_qkv = hf.model.layers[layer].self_attn.qkv_proj.weight.detach()
        fused_gate_up = hf.model.layers[layer].mlp.gate_up_proj.weight.detach()
        wq, wk, wv = fused_qkv.split([q, kv, kv])
        gate, up = fused_gate_up.split([INTER, INTER])
        for rank in range(n):
            with as_rank(rank, n):
                model = Phi3ForCausalLM(cfg)
                load_safetensors(model, path)

            def mine(w: torch.Tensor, rank: int = rank) -> torch.Tensor:
                rows = w.shape[0] // n
                return w[rank * rows:(rank + 1) * rows]

            ours = model.model.layers[layer]
            expected_qkv = torch.cat([mine(wq), mine(wk), mine(wv)])
            assert torch.equal(ours.self_attn.qkv_proj.weight, expected_qkv), (layer, rank)
            expected_gate_up = torch.cat([mine(gate), mine(up)])
            assert torch.equal(ours.mlp.gate_up_proj.weight, expected_gate_up), (layer, rank)


def _unit_model() -> Phi3ForCausalLM:
    cfg = ModelConfig.from_dict({
        "architectures": ["Phi3ForCausalLM"], "vocab_size": 8, "hidden_size": 4,
        "intermediate_size": 3, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 2,
    })  # q: 8 rows, k and v: 4 rows each; gate and up: 3 rows each
    return Phi3ForCausalLM(cfg)


@pytest.mark.assignment(ID)
def test_split_fused_tensor_unit():
    model = _unit_model()
    qkv = torch.arange(16 * 4.0).reshape(16, 4)
    got = model.split_fused_tensor("model.layers.0.self_attn.qkv_proj.weight", qkv)
    assert [name for name, _ in got] == [f"model.layers.0.self_attn.{p}_proj.weight"
                                         for p in "qkv"]
    assert [piece.tolist() for _, piece in got] == [qkv[:8].tolist(), qkv[8:12].tolist(),
                                                    qkv[12:].tolist()]
    bias = torch.arange(16.0)  # a fused bias splits the same way
    got = model.split_fused_tensor("model.layers.3.self_attn.qkv_proj.bias", bias)
    assert [(name, piece.tolist()) for name, piece in got] == [
        ("model.layers.3.self_attn.q_proj.bias", list(range(8))),
        ("model.layers.3.self_attn.k_proj.bias", list(range(8, 12))),
        ("model.layers.3.self_attn.v_proj.bias", list(range(12, 16)))]
    gate_up = torch.arange(6 * 4.0).reshape(6, 4)
    got = model.split_fused_tensor("model.layers.0.mlp.gate_up_proj.weight", gate_up)
    assert [(name, piece.tolist()) for name, piece in got] == [
        ("model.layers.0.mlp.gate_proj.weight", gate_up[:3].tolist()),
        ("model.layers.0.mlp.up_proj.weight", gate_up[3:].tolist())]
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.weight",
                 "model.layers.0.mlp.down_proj.weight", "lm_head.weight"):
        tensor = torch.ones(3, 4)
        ((same_name, same),) = model.split_fused_tensor(name, tensor)
        assert same_name == name and same is tensor
    with pytest.raises(ValueError, match="rows"):
        model.split_fused_tensor("model.layers.0.self_attn.qkv_proj.weight", qkv[:15])
    with pytest.raises(ValueError, match="rows"):
        model.split_fused_tensor("model.layers.0.mlp.gate_up_proj.weight", gate_up[:5])


def _phi3(heads: int, kv_heads: int, head_dim: int, inter: int, hidden: int = 6):
    return Phi3ForCausalLM(ModelConfig.from_dict({
        "architectures": ["Phi3ForCausalLM"], "vocab_size": 8, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim,
    }))


def _rows(n: int, cols: int = 6) -> torch.Tensor:
    """Row r holds r everywhere (plus the column / 100), so a piece names its rows."""
    return torch.arange(n, dtype=torch.float32)[:, None] + torch.arange(cols) / 100


@pytest.mark.assignment(ID)
@pytest.mark.parametrize("heads, kv_heads, head_dim, inter", [(3, 3, 4, 5), (8, 1, 2, 7)],
                         ids=["mha", "mqa"])
def test_split_sizes_come_from_the_config(heads, kv_heads, head_dim, inter):
    """Other head layouts than the unit test's: q is heads * head_dim rows, k and v
    kv_heads * head_dim each, gate and up intermediate_size each, in that order."""
    model = _phi3(heads, kv_heads, head_dim, inter)
    q, kv = heads * head_dim, kv_heads * head_dim
    fused = _rows(q + 2 * kv)
    got = model.split_fused_tensor("model.layers.0.self_attn.qkv_proj.weight", fused)
    assert [name.split(".")[-2] for name, _ in got] == ["q_proj", "k_proj", "v_proj"]
    assert [piece.shape for _, piece in got] == [(q, 6), (kv, 6), (kv, 6)]
    assert torch.equal(torch.cat([piece for _, piece in got]), fused)  # in order, all rows
    assert torch.equal(got[1][1], fused[q : q + kv])
    got = model.split_fused_tensor("model.layers.0.mlp.gate_up_proj.weight", _rows(2 * inter))
    assert [(name, piece.shape[0]) for name, piece in got] == [
        ("model.layers.0.mlp.gate_proj.weight", inter),
        ("model.layers.0.mlp.up_proj.weight", inter),
    ]
    assert torch.equal(got[1][1], _rows(2 * inter)[inter:])


@pytest.mark.assignment(ID)
def test_split_uses_the_whole_models_sizes_at_every_rank():
    """At rank 1 of 2 the model's own qkv_proj holds half the rows, but the checkpoint tensor
    is whole: the split must use the config's sizes, not this rank's parameter shapes."""
    for rank in range(2):
        with as_rank(rank, 2):  # (the loader splits at its rank too)
            model = _phi3(4, 2, 2, 6)
            assert model.model.layers[0].self_attn.qkv_proj.weight.shape[0] == 8  # 16 / 2
            qkv = model.split_fused_tensor("model.layers.0.self_attn.qkv_proj.weight", _rows(16))
            gate_up = model.split_fused_tensor("model.layers.0.mlp.gate_up_proj.weight",
                                               _rows(12))
        assert [piece[:, 0].tolist() for _, piece in qkv] == [
            list(range(8)), list(range(8, 12)), list(range(12, 16))], rank
        assert [piece[:, 0].tolist() for _, piece in gate_up] == [list(range(6)),
                                                                   list(range(6, 12))], rank


@pytest.mark.assignment(ID)
def test_split_keeps_the_rest_of_the_name():
    """Only the fused fragment changes: the layer number and the weight/bias suffix stay."""
    model = _phi3(4, 2, 2, 3)
    got = model.split_fused_tensor("model.layers.27.self_attn.qkv_proj.weight", _rows(16))
    assert [name for name, _ in got] == ["model.layers.27.self_attn.q_proj.weight",
                                         "model.layers.27.self_attn.k_proj.weight",
                                         "model.layers.27.self_attn.v_proj.weight"]
    got = model.split_fused_tensor("model.layers.11.mlp.gate_up_proj.weight", _rows(6))
    assert [name for name, _ in got] == ["model.layers.11.mlp.gate_proj.weight",
                                         "model.layers.11.mlp.up_proj.weight"]
    for name in ("model.norm.weight", "model.layers.2.input_layernorm.weight",
                 "model.layers.2.post_attention_layernorm.weight"):
        tensor = torch.ones(6)
        assert model.split_fused_tensor(name, tensor) == [(name, tensor)]


@pytest.mark.assignment(ID)
def test_split_refuses_too_many_rows_as_well_as_too_few():
    model = _phi3(4, 2, 2, 3)
    for rows in (15, 17, 32, 8):
        with pytest.raises(ValueError, match="rows"):
            model.split_fused_tensor("model.layers.0.self_attn.qkv_proj.weight", _rows(rows))
    for rows in (5, 7, 3):
        with pytest.raises(ValueError, match="rows"):
            model.split_fused_tensor("model.layers.0.mlp.gate_up_proj.weight", _rows(rows))
    with pytest.raises(ValueError, match="rows"):  # a bias of the wrong length too
        model.split_fused_tensor("model.layers.0.self_attn.qkv_proj.bias", torch.zeros(12))


@pytest.mark.assignment(ID)
def test_a_fused_tensor_of_the_wrong_size_names_file_and_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    _tiny_hf_phi3(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.gate_up_proj.weight"
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"model.safetensors: tensor '{name}'.*rows"):
        load_safetensors(Phi3ForCausalLM(cfg), tmp_path)


def test_a_fused_tensor_in_a_llama_checkpoint_is_a_clear_error(tmp_path):
    """Llama's class splits nothing: a fused tensor must not reach the packed loader whole."""
    _tiny_hf_phi3(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="(qkv|gate_up)_proj.weight' does not fit .* shard ids"):
        load_safetensors(get_model_class(cfg.architecture)(cfg), tmp_path)
