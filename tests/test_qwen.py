"""Qwen3 loading: config mapping, name map, error cases, and parity with transformers on the same weights."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from qwen_snapshots import TINY, add_duplicate_head, random_qwen, rewrite_weights, save_snapshot

from octlm import qwen
from octlm.config import decoder_config, register_configs
from octlm.evaluate import chunked_logits, greedy_continuation, reference_chunked_logits
from octlm.qwen import HF_TO_OCTLM, check_arch, decoder_config_from_hf, load_qwen, octlm_name, read_hf_config

ROOT = Path(__file__).resolve().parents[1]
REAL_CONFIG = ROOT / "tests" / "data" / "qwen3-0.6b" / "config.json"  # a copy of the real file
NEW_TOKENS = 64


@pytest.fixture(scope="session")
def snapshots(tmp_path_factory) -> dict[str, Path]:
    """Tiny random Qwen3 snapshots written by transformers, each built once per session."""
    root = tmp_path_factory.mktemp("qwen")
    tied, untied = random_qwen(seed=0), random_qwen(seed=1, tie_word_embeddings=False)
    built = {
        "plain": save_snapshot(tied, root / "plain"),
        "duplicate_head": add_duplicate_head(save_snapshot(tied, root / "duplicate_head")),
        "sharded": save_snapshot(tied, root / "sharded", max_shard_size="150KB"),
        "untied": save_snapshot(untied, root / "untied"),
        "bf16": save_snapshot(random_qwen(seed=2).to(torch.bfloat16), root / "bf16"),
    }
    assert len(list(built["sharded"].glob("model-*.safetensors"))) > 1
    return built


@pytest.fixture(scope="session")
def prompt() -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (1, 21), generator=torch.Generator().manual_seed(7))


def hf_model(directory: Path, attn: str):
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation=attn)
    model.generation_config.eos_token_id = None  # run the full 64 tokens whatever comes out
    return model.eval()


# --- config.json mapping ---------------------------------------------------------------------------


def real_config() -> dict:
    return json.loads(REAL_CONFIG.read_text())


def five_layout(config: dict) -> dict:
    """The same config as transformers 5.x saves it (rope_parameters, dtype, layer_types)."""
    new = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    new["rope_parameters"] = {"rope_theta": config["rope_theta"], "rope_type": "default"}
    new["dtype"] = config["torch_dtype"]
    new["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    return new


def qwen3_yaml_arch():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        register_configs()
        return decoder_config(compose(config_name="inspect_model", overrides=["model=qwen3"]).model.arch)


def test_real_config_maps_to_the_shipped_qwen3_arch():
    mapped = decoder_config_from_hf(real_config(), "config.json")
    assert mapped == qwen3_yaml_arch()
    assert mapped.num_parameters() == 596_049_920


def test_transformers_5_layout_maps_the_same():
    four = real_config()
    assert decoder_config_from_hf(five_layout(four), "5.x") == decoder_config_from_hf(four, "4.x")


def test_config_written_by_transformers_5_is_accepted(snapshots):
    saved = json.loads((snapshots["plain"] / "config.json").read_text())
    assert "rope_parameters" in saved and "layer_types" in saved  # really the 5.x layout
    config = read_hf_config(snapshots["plain"])
    assert (config.d_model, config.n_heads, config.kv_heads, config.head_dim) == (64, 4, 2, 32)
    assert (config.rope_base, config.rope_split, config.qk_norm) == (1e6, True, True)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"model_type": "llama"}, "model_type"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.type"),
        ({"rope_scaling": {"factor": 2.0}}, "rope_scaling.factor"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"quantization_config": {"bits": 4}}, "quantization_config"),
        ({"rope_theta": None}, "rope_theta"),
        ({"head_dim": None}, "head_dim"),
        ({"layer_types": ["full_attention"] * 27 + ["sliding_attention"]}, "layer_types[27]"),
        ({"layer_types": ["full_attention"]}, "layer_types"),
        ({"num_key_value_heads": 5}, "kv_heads"),
        ({"hidden_size": "1024"}, "hidden_size must be an integer"),
        ({"tie_word_embeddings": 1}, "tie_word_embeddings must be true or false"),
        ({"rope_theta": "1e6"}, "rope_theta must be a number"),
    ],
)
def test_unsupported_config_is_rejected_naming_the_key(change, named):
    config = real_config() | change
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        decoder_config_from_hf(config, "config.json")


def test_optional_keys_take_transformers_defaults():
    config = {
        k: v for k, v in real_config().items() if k not in ("num_key_value_heads", "tie_word_embeddings")
    }
    mapped = decoder_config_from_hf(config, "config.json")
    assert (mapped.n_kv_heads, mapped.tie_embeddings) == (16, False)  # Qwen3Config: kv = heads, untied


def test_five_layout_rejects_rope_scaling_and_disagreeing_bases():
    five = five_layout(real_config())
    with pytest.raises(ValueError, match="rope_parameters.rope_type"):
        decoder_config_from_hf(five | {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "c")
    with pytest.raises(ValueError, match="disagree"):
        decoder_config_from_hf(five | {"rope_theta": 10000.0}, "c")


def test_arch_check_names_every_differing_field():
    mapped = decoder_config_from_hf(real_config(), "config.json")
    other = replace(mapped, d_model=2048, ff_hidden=6144)
    with pytest.raises(ValueError, match=r"d_model: config 2048 vs snapshot 1024; ff_hidden"):
        check_arch(other, mapped, "config.json")
    runtime_only = replace(mapped, attention="manual")
    assert check_arch(runtime_only, mapped, "config.json").attention == "manual"


# --- the name map ----------------------------------------------------------------------------------


def test_every_transformers_parameter_maps_to_a_distinct_octlm_parameter():
    from octlm.model import Decoder

    for tied in (True, False):
        reference = random_qwen(tie_word_embeddings=tied)
        with torch.device("meta"):
            ours = Decoder(read_config_of(reference))
        names = {octlm_name(name) for name in reference.state_dict()}
        if tied:
            names.discard("lm_head.weight")  # transformers' state_dict lists the tied head; files may not
        assert names == set(qwen.load_targets(ours))


def read_config_of(reference):
    return decoder_config_from_hf(json.loads(reference.config.to_json_string()), "reference")


def test_name_map_is_one_to_one_and_layer_indices_survive():
    assert len(set(HF_TO_OCTLM.values())) == len(HF_TO_OCTLM)
    assert octlm_name("model.layers.17.self_attn.q_norm.weight") == "blocks.17.attn.q_norm.weight"
    assert octlm_name("model.layers.3.mlp.rotary.weight") is None
    assert octlm_name("model.embed_tokens.bias") is None


# --- loading ---------------------------------------------------------------------------------------


def weight_pairs(reference, model) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Each transformers weight next to the octlm tensor holding it, paired by hand (not through
    HF_TO_OCTLM, so a wrong entry in the map cannot hide here); stacked matrices are split by hand."""
    pairs = [
        ("embed", reference.model.embed_tokens.weight, model.embed.weight),
        ("norm", reference.model.norm.weight, model.final_norm.weight),
    ]
    if model.lm_head is not None:
        pairs.append(("lm_head", reference.lm_head.weight, model.lm_head.weight))
    config = model.config
    q_rows, kv_rows = config.n_heads * config.dim_per_head, config.n_kv_heads * config.dim_per_head
    for index, (theirs, ours) in enumerate(zip(reference.model.layers, model.blocks, strict=True)):
        attn, mine = theirs.self_attn, ours.attn
        q, k, v = mine.qkv.weight[:q_rows], mine.qkv.weight[q_rows:-kv_rows], mine.qkv.weight[-kv_rows:]
        gate, up = ours.ff.gate_up.weight[: config.ff_dim], ours.ff.gate_up.weight[config.ff_dim :]
        pairs += [
            (f"{index}.input_layernorm", theirs.input_layernorm.weight, ours.attn_norm.weight),
            (f"{index}.post_attn_norm", theirs.post_attention_layernorm.weight, ours.ff_norm.weight),
            (f"{index}.q_proj", attn.q_proj.weight, q),
            (f"{index}.k_proj", attn.k_proj.weight, k),
            (f"{index}.v_proj", attn.v_proj.weight, v),
            (f"{index}.o_proj", attn.o_proj.weight, mine.o_proj.weight),
            (f"{index}.q_norm", attn.q_norm.weight, mine.q_norm.weight),
            (f"{index}.k_norm", attn.k_norm.weight, mine.k_norm.weight),
            (f"{index}.gate_proj", theirs.mlp.gate_proj.weight, gate),
            (f"{index}.up_proj", theirs.mlp.up_proj.weight, up),
            (f"{index}.down_proj", theirs.mlp.down_proj.weight, ours.ff.down_proj.weight),
        ]
    return pairs


@pytest.mark.parametrize("variant", ["plain", "duplicate_head", "sharded", "untied", "bf16"])
def test_loaded_weights_equal_transformers_weights(snapshots, variant):
    """Every octlm weight equals its transformers tensor: none left uninitialised, none swapped."""
    reference, model = hf_model(snapshots[variant], "sdpa"), load_qwen(snapshots[variant])
    pairs = weight_pairs(reference, model)
    for name, theirs, ours in pairs:
        assert torch.equal(ours, theirs), name
    stored = sum(ours.numel() for _, _, ours in pairs)
    assert stored == sum(p.numel() for p in model.parameters()) and list(model.buffers()) == []


def test_every_parameter_is_written_exactly_once(snapshots, monkeypatch):
    written: list[str] = []
    original = qwen.SafetensorsFile.read_into

    def spy(self, name, out):
        written.append(name)
        return original(self, name, out)

    monkeypatch.setattr(qwen.SafetensorsFile, "read_into", spy)
    for variant in ("duplicate_head", "untied", "sharded"):
        written.clear()
        model = load_qwen(snapshots[variant])
        targets = [octlm_name(name) for name in written]
        assert sorted(targets) == sorted(qwen.load_targets(model)), variant


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_loads_in_any_dtype(snapshots, dtype):
    model = load_qwen(snapshots["plain"], dtype=dtype)
    reference = load_qwen(snapshots["plain"])
    assert all(p.dtype == dtype for p in model.parameters())
    assert torch.equal(model.embed.weight, reference.embed.weight.to(dtype))


def copy_snapshot(snapshots, variant: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(snapshots[variant], tmp_path / variant))


def test_missing_tensor_is_named(snapshots, tmp_path):
    directory = copy_snapshot(snapshots, "plain", tmp_path)
    rewrite_weights(directory, lambda t: {k: v for k, v in t.items() if "layers.1.self_attn.k_norm" not in k})
    with pytest.raises(ValueError, match=r"missing tensor for blocks\.1\.attn\.k_norm\.weight"):
        load_qwen(directory)


def test_unexpected_tensor_is_named(snapshots, tmp_path):
    directory = copy_snapshot(snapshots, "plain", tmp_path)
    rewrite_weights(directory, lambda t: t | {"model.layers.2.mlp.up_proj.weight": torch.zeros(96, 64)})
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.2\.mlp\.up_proj\.weight'"):
        load_qwen(directory)


def test_wrong_shape_is_named(snapshots, tmp_path):
    directory = copy_snapshot(snapshots, "plain", tmp_path)
    name = "model.layers.0.self_attn.o_proj.weight"
    rewrite_weights(directory, lambda t: t | {name: t[name].t().contiguous()})
    with pytest.raises(ValueError, match=r"o_proj\.weight' has shape \[128, 64\], expected \[64, 128\]"):
        load_qwen(directory)


def test_untied_head_in_a_tied_config_must_equal_the_embeddings(snapshots, tmp_path):
    directory = add_duplicate_head(copy_snapshot(snapshots, "plain", tmp_path), change=True)
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        load_qwen(directory)


def test_untied_config_without_head_is_missing_lm_head(snapshots, tmp_path):
    directory = copy_snapshot(snapshots, "untied", tmp_path)
    rewrite_weights(directory, lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"})
    with pytest.raises(ValueError, match=r"missing tensor for lm_head\.weight"):
        load_qwen(directory)


def test_problems_are_found_before_anything_is_allocated(snapshots, tmp_path, monkeypatch):
    directory = copy_snapshot(snapshots, "plain", tmp_path)
    rewrite_weights(directory, lambda t: t | {"extra.weight": torch.zeros(2)})
    monkeypatch.setattr(qwen.Decoder, "to_empty", lambda *a, **k: pytest.fail("allocated before checking"))
    with pytest.raises(ValueError, match="unexpected tensor 'extra.weight'"):
        load_qwen(directory)


# --- parity with transformers ----------------------------------------------------------------------

# octlm's attention path paired with the transformers implementation that does the same arithmetic.
PAIRS = [("sdpa", "sdpa"), ("manual", "eager")]


def octlm_model(directory: Path, attention: str, kernels: str = "reference"):
    """The reference kernels are the ones transformers runs, so the logits can be equal bit for bit."""
    return load_qwen(directory, arch=replace(read_hf_config(directory), attention=attention, kernels=kernels))


@pytest.mark.parametrize("variant", ["plain", "duplicate_head", "sharded", "untied", "bf16"])
@pytest.mark.parametrize(("attention", "attn"), PAIRS)
def test_logits_equal_transformers(snapshots, prompt, variant, attention, attn):
    model, reference = octlm_model(snapshots[variant], attention), hf_model(snapshots[variant], attn)
    with torch.no_grad():
        error = (model(prompt) - reference(prompt).logits).abs().max().item()
    print(f"{variant} octlm {attention} vs transformers {attn}: max abs logit diff {error:.3g}")
    assert error < 1e-5


@pytest.mark.parametrize(
    ("variant", "attention", "attn"),
    [("plain", "sdpa", "sdpa"), ("plain", "manual", "eager"), ("untied", "sdpa", "sdpa")],
)
def test_greedy_tokens_equal_transformers_generate(snapshots, prompt, variant, attention, attn):
    """64 greedy tokens: transformers' generate against a plain loop over octlm's KV cache."""
    model, reference = octlm_model(snapshots[variant], attention), hf_model(snapshots[variant], attn)
    with torch.no_grad():
        theirs = reference.generate(prompt, do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0)
        ours = greedy_continuation(model, prompt, NEW_TOKENS)
    assert theirs.shape[1] == prompt.shape[1] + NEW_TOKENS
    assert torch.equal(ours, theirs[:, prompt.shape[1] :])
    assert len(set(ours[0].tolist())) > 16  # a model echoing one token would prove nothing


@pytest.mark.parametrize(("attention", "attn"), PAIRS)
def test_chunked_prefill_on_the_cache_equals_transformers(snapshots, prompt, attention, attn):
    """Prefill in chunks of 3: equal to transformers doing the same on its cache, close to one full pass."""
    model, reference = octlm_model(snapshots["plain"], attention), hf_model(snapshots["plain"], attn)
    with torch.no_grad():
        ours = chunked_logits(model, prompt, 3)
        theirs = reference_chunked_logits(reference, prompt, 3)
        full_pass = reference(prompt).logits
    error, off_full, their_off_full = (
        (ours - theirs).abs().max().item(),
        (ours - full_pass).abs().max().item(),
        (theirs - full_pass).abs().max().item(),
    )
    print(
        f"chunked {attention}/{attn}: {error:.3g}; "
        f"vs full pass {off_full:.3g} (transformers {their_off_full:.3g})"
    )
    assert error < 1e-5
    # Chunks run other matmul shapes than one pass, so float32 rounding differs; transformers' own
    # chunked logits are off its full pass by the same ~1e-5.
    assert off_full < 1e-4


def test_fast_kernels_round_differently_but_decode_the_same_tokens(snapshots, prompt):
    """The default kernels (oneDNN for a few rows): same greedy tokens as transformers' generate, and
    chunked logits off transformers' by float32 rounding only."""
    model, reference = octlm_model(snapshots["plain"], "sdpa", "fast"), hf_model(snapshots["plain"], "sdpa")
    with torch.no_grad():
        theirs = reference.generate(prompt, do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0)
        ours = greedy_continuation(model, prompt, NEW_TOKENS)
        chunked = chunked_logits(model, prompt, 3)
        error = (chunked - reference_chunked_logits(reference, prompt, 3)).abs().max()
    print(f"fast kernels chunked vs transformers: {error:.3g}")
    assert torch.equal(ours, theirs[:, prompt.shape[1] :])
    assert error < 1e-4


# --- scripts ---------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def script_snapshot(tmp_path_factory, qwen_files) -> Path:
    """A tiny snapshot with the full Qwen3 vocabulary and the real tokenizer files, as the scripts need."""
    root = tmp_path_factory.mktemp("script")
    return save_snapshot(random_qwen(seed=3, vocab_size=151_936), root / "tiny", tokenizer_dir=qwen_files)


def run_script(name: str, *overrides: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = os.environ | {
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "OCTLM_CACHE": str(tmp_path / "octlm"),
    }
    command = [sys.executable, str(ROOT / "scripts" / name), f"hydra.run.dir={tmp_path / 'run'}", *overrides]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)


def test_load_script_prints_the_check_and_the_model(script_snapshot, tmp_path):
    done = run_script("load.py", "model=hf", f"model.path={script_snapshot}", "device=cpu", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    expected = decoder_config_from_hf(json.loads((script_snapshot / "config.json").read_text()), "x")
    assert f"parameters:  {expected.num_parameters():,}" in done.stdout
    for line in (
        "dtype:       float32",
        "device:      cpu",
        "verified against",
        "peak memory:",
        "load time:",
    ):
        assert line in done.stdout


def test_load_script_names_arch_differences(script_snapshot, tmp_path):
    done = run_script(
        "load.py", "model=qwen3", f"model.path={script_snapshot}", "model.revision=null", tmp_path=tmp_path
    )
    assert done.returncode == 2
    assert "model.arch does not match" in done.stderr and "d_model: config 1024 vs snapshot 64" in done.stderr
    assert "Traceback" not in done.stderr


def test_load_script_offline_without_snapshot_says_how_to_provide_one(tmp_path):
    done = run_script("load.py", "model=qwen3", tmp_path=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith("error: cannot load Qwen/Qwen3-0.6B@c1899de")
    assert "model.path=" in done.stderr and "Traceback" not in done.stderr


def test_evaluate_parity_script_passes_on_a_tiny_snapshot(script_snapshot, tmp_path):
    done = run_script(
        "evaluate.py", "task=parity", "model=hf", f"model.path={script_snapshot}", "parity.new_tokens=16",
        tmp_path=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for line in ("max abs logit error:", "mean abs logit error:", "argmax agreement:", "greedy match:"):
        assert line in done.stdout
    printed = " ".join(done.stdout.split())
    assert "max abs logit error: 0 " in printed and "chunked max abs logit error: 0 " in printed
    assert "greedy match: 16/16 tokens" in printed and "fast kernels, greedy match: 16/16 tokens" in printed
    assert "passed: True" in printed


def test_evaluate_rejects_an_unknown_task(script_snapshot, tmp_path):
    done = run_script(
        "evaluate.py", "task=nope", "model=hf", f"model.path={script_snapshot}", tmp_path=tmp_path
    )
    assert done.returncode == 2 and "task='nope' is unknown" in done.stderr
