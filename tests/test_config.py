"""DecoderConfig: exact parameter counts, validation, fingerprints, and every shipped config composing."""

from dataclasses import dataclass, fields
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from octlm.config import DecoderConfig, decoder_config, register_configs
from octlm.model import Decoder

CONF = Path(__file__).resolve().parents[1] / "conf"
register_configs()

EXPECTED_PARAMETERS = {"tinystories": 26_255_872, "qwen3": 596_049_920, "qwen3-1.7b": 1_720_574_976}
PINNED_FINGERPRINTS = {
    "tinystories": "3cc616eff54c191cccbd0accbca005142b545e2cc976ecca7470c03871b3053b",
    "qwen3": "d2fbc3ef88119a31d475ea807c290eb43c826a902abe2029714e90c4a547abca",
    "qwen3-1.7b": "df74fa0b7c923d11500b15326dc872ef0df47d81b7e0b92a027eaee8bd6156d6",
}
# A changed default would silently change every config that relies on it without changing its
# fingerprint, so the defaults themselves are pinned.
PINNED_DEFAULTS = {
    "vocab_size": 8192, "context_length": 512, "d_model": 512, "n_heads": 8, "n_layers": 8, "kv_heads": None,
    "dropout": 0.0, "norm_eps": 1e-5, "tie_embeddings": True, "position": "rope", "norm": "rmsnorm",
    "feed_forward": "swiglu", "attention": "sdpa", "head_dim": None, "ff_hidden": None, "rope_base": 10000.0,
    "rope_split": False, "qk_norm": False, "kernels": "fast",
}  # fmt: skip


def model_config(name: str) -> DecoderConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="inspect_model", overrides=[f"model={name}"])
    return decoder_config(cfg.model.arch)


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMETERS))
def test_parameter_count_from_config_and_from_meta_model(name):
    config = model_config(name)
    with torch.device("meta"):
        model = Decoder(config)
    assert config.num_parameters() == EXPECTED_PARAMETERS[name]
    assert sum(p.numel() for p in model.parameters()) == EXPECTED_PARAMETERS[name]


@pytest.mark.parametrize(
    "overrides",
    [
        {"position": "learned"},
        {"norm": "layernorm"},
        {"feed_forward": "gelu"},
        {"tie_embeddings": False},
        {"qk_norm": True, "head_dim": 96, "kv_heads": 4},
    ],
)
def test_parameter_count_matches_built_model_for_every_switch(overrides):
    config = DecoderConfig(vocab_size=97, context_length=32, d_model=64, n_heads=4, n_layers=2, **overrides)
    assert config.num_parameters() == sum(p.numel() for p in Decoder(config).parameters())


@pytest.mark.parametrize(
    "overrides, field_name",
    [
        ({"d_model": 100, "n_heads": 8}, "n_heads"),
        ({"kv_heads": 3}, "kv_heads"),
        ({"head_dim": 33}, "head_dim"),
        ({"n_layers": 0}, "n_layers"),
        ({"vocab_size": -1}, "vocab_size"),
        ({"ff_hidden": 0}, "ff_hidden"),
        ({"position": "alibi"}, "position"),
        ({"norm": "batchnorm"}, "norm"),
        ({"feed_forward": "relu"}, "feed_forward"),
        ({"attention": "flash"}, "attention"),
        ({"dropout": 1.0}, "dropout"),
    ],
)
def test_validate_names_the_field(overrides, field_name):
    with pytest.raises(ValueError, match=rf"DecoderConfig\.{field_name}:"):
        DecoderConfig(**overrides).validate()


def test_unknown_field_is_named():
    with pytest.raises(ValueError, match="n_haeds"):
        DecoderConfig.from_dict({"n_haeds": 4})


def test_odd_head_dim_is_fine_without_rope():
    DecoderConfig(d_model=66, n_heads=2, position="learned").validate()


def test_ff_hidden_default_is_the_swiglu_rule():
    assert DecoderConfig(d_model=512).ff_dim == 1368  # 2/3 * 4 * 512 = 1365.3, up to a multiple of 8
    assert DecoderConfig(d_model=512, feed_forward="gelu").ff_dim == 2048


@pytest.mark.parametrize("name", sorted(PINNED_FINGERPRINTS))
def test_shipped_fingerprints_are_pinned(name):
    assert model_config(name).fingerprint() == PINNED_FINGERPRINTS[name]


def test_defaults_are_pinned():
    assert {f.name: f.default for f in fields(DecoderConfig)} == PINNED_DEFAULTS


def test_new_switch_at_its_default_keeps_the_fingerprint():
    @dataclass
    class Extended(DecoderConfig):
        sliding_window: int | None = None

    base = model_config("qwen3")
    extended = Extended(**{f.name: getattr(base, f.name) for f in fields(DecoderConfig)})
    assert extended.fingerprint() == base.fingerprint()
    extended.sliding_window = 4096
    assert extended.fingerprint() != base.fingerprint()


def test_fingerprint_ignores_spelling_of_the_same_model():
    implicit = DecoderConfig(d_model=256, n_heads=4)
    explicit = DecoderConfig(d_model=256, n_heads=4, head_dim=64, kv_heads=4, ff_hidden=688, rope_base=10_000)
    assert implicit.fingerprint() == explicit.fingerprint()
    assert implicit.fingerprint() != DecoderConfig(d_model=256, n_heads=4, rope_split=True).fingerprint()


def primary_configs() -> list[str]:
    return sorted(p.stem for p in CONF.glob("*.yaml"))


def compose_primary(primary: str, overrides: list[str] | None = None):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=primary, overrides=overrides or [])


@pytest.mark.parametrize("primary", primary_configs())
def test_every_config_composes_with_every_model(primary):
    cfg = compose_primary(primary)
    if "model" not in cfg:
        return
    for model in sorted(EXPECTED_PARAMETERS):
        decoder_config(compose_primary(primary, [f"model={model}"]).model.arch)
