"""DecoderConfig: one set of fields describing every decoder octlm builds."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from omegaconf import OmegaConf

CHOICES = {
    "position": ("rope", "learned"),
    "norm": ("rmsnorm", "layernorm"),
    "feed_forward": ("swiglu", "gelu"),
    "attention": ("sdpa", "manual"),
    "kernels": ("fast", "reference"),
}


@dataclass
class DecoderConfig:
    """Shape and layer choices of a decoder-only transformer.

    The last five fields are the switches that turn the TinyStories layout into Qwen3's; at their
    defaults (None, 10,000, False) they change nothing.
    """

    vocab_size: int = 8192
    context_length: int = 512
    d_model: int = 512
    n_heads: int = 8
    n_layers: int = 8
    kv_heads: int | None = None  # None: as many as n_heads (plain multi-head attention)
    dropout: float = 0.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    position: str = "rope"
    norm: str = "rmsnorm"
    feed_forward: str = "swiglu"
    attention: str = "sdpa"
    # fast: oneDNN for products of a few float32 rows on the CPU at inference (decode steps), which
    # reads weights about twice as fast as torch's default, and single-token attention that reads
    # each K/V head once; reference: the kernels transformers runs, so logits match it bit for bit.
    # Rounding differs, not math.
    kernels: str = "fast"
    head_dim: int | None = None  # None: d_model // n_heads
    ff_hidden: int | None = None  # None: 2/3 * 4 * d_model rounded up to 8 (SwiGLU), 4 * d_model (GELU)
    rope_base: float = 10000.0
    rope_split: bool = False  # False: rotate adjacent pairs (0,1), (2,3); True: halves (0,hd/2), as HF Qwen
    qk_norm: bool = False

    @property
    def n_kv_heads(self) -> int:
        return self.n_heads if self.kv_heads is None else self.kv_heads

    @property
    def dim_per_head(self) -> int:
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def ff_dim(self) -> int:
        if self.ff_hidden is not None:
            return self.ff_hidden
        if self.feed_forward == "gelu":
            return 4 * self.d_model
        return 8 * math.ceil(2 * 4 * self.d_model / 3 / 8)

    def validate(self) -> DecoderConfig:
        """Raise ValueError naming the field of the first impossible setting; return self."""
        for name in ("vocab_size", "context_length", "d_model", "n_heads", "n_layers"):
            _require(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        for name in ("kv_heads", "head_dim", "ff_hidden"):
            value = getattr(self, name)
            _require(value is None or value > 0, name, f"must be positive, got {value}")
        for name, allowed in CHOICES.items():
            value = getattr(self, name)
            _require(value in allowed, name, f"must be one of {allowed}, got {value!r}")
        _require(0.0 <= self.dropout < 1.0, "dropout", f"must be in [0, 1), got {self.dropout}")
        _require(self.norm_eps > 0, "norm_eps", f"must be positive, got {self.norm_eps}")
        _require(self.rope_base > 1, "rope_base", f"must be above 1, got {self.rope_base}")
        _require(
            self.head_dim is not None or self.d_model % self.n_heads == 0,
            "n_heads",
            f"{self.n_heads} heads do not divide d_model={self.d_model}; set head_dim explicitly",
        )
        _require(
            self.n_heads % self.n_kv_heads == 0,
            "kv_heads",
            f"{self.n_kv_heads} KV heads do not divide n_heads={self.n_heads}",
        )
        _require(
            self.position != "rope" or self.dim_per_head % 2 == 0,
            "head_dim",
            f"RoPE rotates pairs, so the head dimension must be even, got {self.dim_per_head}",
        )
        return self

    def resolved(self) -> DecoderConfig:
        """The same config with kv_heads, head_dim and ff_hidden filled in."""
        return replace(self, kv_heads=self.n_kv_heads, head_dim=self.dim_per_head, ff_hidden=self.ff_dim)

    def canonical(self) -> dict:
        """Resolved fields that differ from what the defaults resolve to, in a JSON-stable form.

        Leaving defaults out is what lets a new switch be added at its default without changing the
        fingerprint of any existing config.
        """
        mine = asdict(self.resolved())
        defaults = {f.name: f.default for f in fields(self)}
        derived = replace(self, kv_heads=None, head_dim=None, ff_hidden=None)
        defaults.update(kv_heads=derived.n_kv_heads, head_dim=derived.dim_per_head, ff_hidden=derived.ff_dim)
        return {k: _stable(v) for k, v in mine.items() if _stable(v) != _stable(defaults[k])}

    def fingerprint(self) -> str:
        """SHA-256 of the canonical form: equal for configs that build the same model."""
        text = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def num_parameters(self) -> int:
        """Unique parameter count, computed from the config alone."""
        d, hd, ff = self.d_model, self.dim_per_head, self.ff_dim
        norm = d if self.norm == "rmsnorm" else 2 * d  # LayerNorm has a bias
        attention = d * hd * (2 * self.n_heads + 2 * self.n_kv_heads) + (2 * hd if self.qk_norm else 0)
        feed_forward = (3 if self.feed_forward == "swiglu" else 2) * d * ff
        layer = attention + feed_forward + 2 * norm
        total = self.vocab_size * d + self.n_layers * layer + norm
        if self.position == "learned":
            total += self.context_length * d
        if not self.tie_embeddings:
            total += self.vocab_size * d
        return total

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        """Bytes one token adds to the KV cache: keys and values of every layer, before head repetition."""
        return 2 * self.n_layers * self.n_kv_heads * self.dim_per_head * bytes_per_element

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, values: dict) -> DecoderConfig:
        """Build and validate from a mapping; an unknown key is an error naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"DecoderConfig has no field {unknown[0]!r} (known: {sorted(known)})")
        return cls(**values).validate()


def _require(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"DecoderConfig.{field_name}: {message}")


def _stable(value):
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


@dataclass
class ModelSpec:
    """A model choice in conf/model/: its architecture and where its weights come from."""

    name: str = "custom"
    arch: DecoderConfig = field(default_factory=DecoderConfig)
    repo: str | None = None  # Hugging Face repository of a pretrained snapshot
    revision: str | None = None  # pinned commit of that repository
    path: str | None = None  # a local snapshot directory, used instead of downloading


def decoder_config(arch: Any) -> DecoderConfig:
    """A validated DecoderConfig from a Hydra node or a plain mapping."""
    if isinstance(arch, DecoderConfig):
        return arch.validate()
    values = OmegaConf.to_container(arch, resolve=True) if OmegaConf.is_config(arch) else dict(arch)
    return DecoderConfig.from_dict(values)


@dataclass
class InspectSettings:
    model: ModelSpec = field(default_factory=ModelSpec)
    kv_dtype: str = "bfloat16"


def register_configs() -> None:
    """Put the schemas into Hydra's ConfigStore so a typo in YAML or on the command line fails."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(group="model", name="model_schema", node=ModelSpec)
    store.store(name="inspect_model_schema", node=InspectSettings)

    from octlm.data import DataSpec, PrepareDataSettings

    store.store(group="data", name="data_schema", node=DataSpec)
    store.store(name="prepare_data_schema", node=PrepareDataSettings)

    from octlm.train import TrainSettings

    store.store(name="train_schema", node=TrainSettings)

    from octlm.bench import BenchSettings

    store.store(name="bench_schema", node=BenchSettings)

    from octlm.chat import ChatSettings
    from octlm.generation import GenerateSettings

    store.store(name="generate_schema", node=GenerateSettings)
    store.store(name="chat_schema", node=ChatSettings)

    from octlm.evaluate import EvaluateSettings
    from octlm.qwen import LoadSettings

    store.store(name="load_schema", node=LoadSettings)
    store.store(name="evaluate_schema", node=EvaluateSettings)
