"""Qwen3 from a Hugging Face snapshot: config.json to DecoderConfig, and weights streamed into a Decoder."""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from octlm.config import DecoderConfig, ModelSpec, decoder_config
from octlm.generation import pick_device, pick_dtype
from octlm.model import Decoder
from octlm.safetensors import SafetensorsFile
from octlm.snapshot import describe_check, resolve_snapshot, verify_snapshot, weight_files

# Keys of a Qwen3 config.json that do not change what the network computes at inference. Anything
# not listed here and not read by decoder_config_from_hf is rejected: octlm would not know whether it
# changes the math.
HARMLESS_KEYS = frozenset(
    {
        "_name_or_path",
        "architectures",
        "attention_dropout",  # training only
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "initializer_range",
        "max_window_layers",  # only read when use_sliding_window is true, which is rejected
        "sliding_window",  # likewise
        "torch_dtype",  # storage dtype (4.x name)
        "dtype",  # storage dtype (5.x name)
        "transformers_version",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)
# config.json key -> DecoderConfig field, for the values copied as they are.
COPIED_KEYS = {
    "vocab_size": "vocab_size",
    "max_position_embeddings": "context_length",
    "hidden_size": "d_model",
    "num_attention_heads": "n_heads",
    "num_hidden_layers": "n_layers",
    "num_key_value_heads": "kv_heads",
    "head_dim": "head_dim",
    "intermediate_size": "ff_hidden",
    "rms_norm_eps": "norm_eps",
    "tie_word_embeddings": "tie_embeddings",
}
# Keys that must hold exactly this value, because octlm implements nothing else.
REQUIRED_VALUES = {
    "model_type": "qwen3",
    "hidden_act": "silu",
    "attention_bias": False,
    "use_sliding_window": False,
}
# Qwen3Config's own defaults for keys a config.json may leave out.
OPTIONAL_DEFAULTS = {
    "hidden_act": "silu",
    "attention_bias": False,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
}
ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "layer_types")
# Fields that choose how the same math runs, not what it is: a model config may set them freely.
RUNTIME_FIELDS = ("attention", "kernels", "dropout")

# The one Hugging Face -> octlm parameter name map; {} stands for the layer index, and #i for the
# i-th matrix stacked in one octlm weight (see `load_targets`).
HF_TO_OCTLM = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "final_norm.weight",
    "lm_head.weight": "lm_head.weight",
    "model.layers.{}.input_layernorm.weight": "blocks.{}.attn_norm.weight",
    "model.layers.{}.self_attn.q_proj.weight": "blocks.{}.attn.qkv.weight#0",
    "model.layers.{}.self_attn.k_proj.weight": "blocks.{}.attn.qkv.weight#1",
    "model.layers.{}.self_attn.v_proj.weight": "blocks.{}.attn.qkv.weight#2",
    "model.layers.{}.self_attn.o_proj.weight": "blocks.{}.attn.o_proj.weight",
    "model.layers.{}.self_attn.q_norm.weight": "blocks.{}.attn.q_norm.weight",
    "model.layers.{}.self_attn.k_norm.weight": "blocks.{}.attn.k_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "blocks.{}.ff_norm.weight",
    "model.layers.{}.mlp.gate_proj.weight": "blocks.{}.ff.gate_up.weight#0",
    "model.layers.{}.mlp.up_proj.weight": "blocks.{}.ff.gate_up.weight#1",
    "model.layers.{}.mlp.down_proj.weight": "blocks.{}.ff.down_proj.weight",
}
LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
TIED_HEAD, EMBEDDINGS = "lm_head.weight", "model.embed_tokens.weight"
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def decoder_config_from_hf(config: dict, source: str) -> DecoderConfig:
    """Map a Qwen3 config.json (transformers 4.x or 5.x layout) to a validated DecoderConfig.

    Every setting octlm does not implement, and every key it does not know, raises a ValueError
    naming `source` and the key.
    """
    if not isinstance(config, dict):
        raise ValueError(f"{source}: config must be a JSON object, got {type(config).__name__}")
    unknown = sorted(set(config) - HARMLESS_KEYS - set(COPIED_KEYS) - set(REQUIRED_VALUES) - set(ROPE_KEYS))
    if unknown:
        raise ValueError(
            f"{source}: unknown key {unknown[0]!r}; octlm cannot tell whether it changes the model"
        )
    for key, wanted in REQUIRED_VALUES.items():
        value = config.get(key, OPTIONAL_DEFAULTS.get(key))
        if value != wanted:
            raise ValueError(
                f"{source}: {key}={value!r} is not supported (octlm implements {key}={wanted!r})"
            )
    values = {field: _required(config, key, source) for key, field in COPIED_KEYS.items() if key in config}
    for key in ("vocab_size", "max_position_embeddings", "hidden_size", "num_attention_heads"):
        _required(config, key, source)
    for key in ("num_hidden_layers", "head_dim", "intermediate_size", "rms_norm_eps"):
        _required(config, key, source)
    values.setdefault("tie_embeddings", OPTIONAL_DEFAULTS["tie_word_embeddings"])
    _check_layer_types(config, source)
    values.update(rope_base=_rope_theta(config, source), rope_split=True, qk_norm=True)
    values.update(position="rope", norm="rmsnorm", feed_forward="swiglu", dropout=0.0)
    try:
        return DecoderConfig.from_dict(values)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{source}: {error}") from None


def _required(config: dict, key: str, source: str):
    if key not in config or config[key] is None:
        raise ValueError(f"{source}: required key {key!r} is missing")
    return _typed(config[key], key, source)


def _typed(value, key: str, source: str):
    """`value` if it has the JSON type `key` needs; a string where a number belongs is an error."""
    if key == "tie_word_embeddings":
        ok, wanted = isinstance(value, bool), "true or false"
    elif key in ("rms_norm_eps", "rope_theta"):
        ok, wanted = isinstance(value, int | float) and not isinstance(value, bool), "a number"
    else:
        ok, wanted = isinstance(value, int) and not isinstance(value, bool), "an integer"
    if not ok:
        raise ValueError(f"{source}: {key} must be {wanted}, got {value!r}")
    return value


def _check_layer_types(config: dict, source: str) -> None:
    """5.x lists each layer's attention kind; octlm has only full attention."""
    layer_types = config.get("layer_types")
    if layer_types is None:
        return
    if not isinstance(layer_types, list) or len(layer_types) != config["num_hidden_layers"]:
        raise ValueError(
            f"{source}: layer_types must list one entry per layer ({config['num_hidden_layers']})"
        )
    for index, kind in enumerate(layer_types):
        if kind != "full_attention":
            raise ValueError(
                f"{source}: layer_types[{index}]={kind!r} is not supported (octlm has only full_attention)"
            )


def _rope_theta(config: dict, source: str) -> float:
    """The RoPE base from rope_theta (4.x) or rope_parameters (5.x); any rope scaling is rejected."""
    thetas = {}
    if config.get("rope_theta") is not None:
        thetas["rope_theta"] = _typed(config["rope_theta"], "rope_theta", source)
    for key in ("rope_scaling", "rope_parameters"):
        params = config.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise ValueError(f"{source}: {key} must be an object or null, got {params!r}")
        for name, value in params.items():
            if name in ("rope_type", "type") and value != "default":
                raise ValueError(f"{source}: {key}.{name}={value!r} is not supported (only 'default' RoPE)")
            if name not in ("rope_type", "type", "rope_theta"):
                raise ValueError(f"{source}: {key}.{name} is not supported (only plain RoPE)")
        if params.get("rope_theta") is not None:
            thetas[f"{key}.rope_theta"] = _typed(params["rope_theta"], "rope_theta", source)
    if not thetas:
        raise ValueError(f"{source}: required key 'rope_theta' (or rope_parameters.rope_theta) is missing")
    if len({float(value) for value in thetas.values()}) > 1:
        raise ValueError(f"{source}: RoPE bases disagree: {thetas}")
    return float(next(iter(thetas.values())))


def read_hf_config(snapshot_dir: str | Path) -> DecoderConfig:
    """The DecoderConfig of a snapshot directory, read from its config.json."""
    path = Path(snapshot_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: missing; a Hugging Face snapshot needs its config.json") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON: {error}") from None
    return decoder_config_from_hf(config, str(path))


def check_arch(expected: DecoderConfig, found: DecoderConfig, source: str) -> DecoderConfig:
    """`found` with expected's runtime choices, after checking every other resolved field is equal."""
    mine, theirs = asdict(expected.resolved()), asdict(found.resolved())
    differing = [
        f"{name}: config {mine[name]!r} vs snapshot {theirs[name]!r}"
        for name in mine
        if name not in RUNTIME_FIELDS and mine[name] != theirs[name]
    ]
    if differing:
        raise ValueError(
            f"model.arch does not match {source}: " + "; ".join(differing) + ". To take the architecture "
            "from the snapshot itself, use model=hf model.path=DIR"
        )
    return with_runtime_fields(found, expected)


def octlm_name(hf_name: str) -> str | None:
    """The octlm parameter name for a Hugging Face tensor name, or None when the map has none."""
    match = LAYER_NAME.match(hf_name)
    if match is None:
        return HF_TO_OCTLM.get(hf_name)
    template = HF_TO_OCTLM.get(f"model.layers.{{}}.{match.group(2)}")
    return None if template is None else template.format(match.group(1))


@dataclass(frozen=True)
class Copy:
    """One tensor to stream: from `hf_name` in `path` into the model's `target`."""

    path: Path
    hf_name: str
    target: str


def plan_copies(files: list[Path], model: Decoder) -> tuple[list[Copy], Copy | None]:
    """Check every header against the (meta) model before any copy; return copies and the tied duplicate.

    Raises one ValueError naming every unexpected, mis-shaped, non-float, doubly stored and missing
    tensor. The second value is the stored lm_head.weight of a tied model, to compare, not to load.
    """
    targets = load_targets(model)
    copies, problems, duplicate, seen = [], [], None, {}
    for path in files:
        with SafetensorsFile(path) as file:
            for entry in file.entries.values():
                if entry.name == TIED_HEAD and model.lm_head is None:
                    duplicate = Copy(path, entry.name, "embed.weight")
                    continue
                target = octlm_name(entry.name)
                problem = _entry_problem(entry, target, targets, seen)
                if problem:
                    problems.append(f"{path.name}: {problem}")
                    continue
                seen[target] = entry.name
                copies.append(Copy(path, entry.name, target))
    problems += [f"missing tensor for {name}" for name in targets if name not in seen]
    if problems:
        shown = "; ".join(problems[:10]) + (f"; ... {len(problems) - 10} more" if len(problems) > 10 else "")
        raise ValueError(f"snapshot weights do not fit the model ({len(problems)} problems): {shown}")
    return copies, duplicate


def load_targets(model: Decoder) -> dict[str, torch.Tensor]:
    """Every tensor a snapshot fills, by name: the parameters, except that a weight stacking several
    matrices (Linear.parts) is listed as the rows of each, named weight#0, weight#1, ..."""
    targets = {}
    for name, param in model.named_parameters():
        parts = getattr(model.get_submodule(name.rpartition(".")[0]), "parts", (len(param),))
        if len(parts) == 1:
            targets[name] = param.data
        else:
            targets |= {f"{name}#{i}": rows for i, rows in enumerate(param.data.split(parts))}
    return targets


def _entry_problem(entry, target: str | None, targets: dict, seen: dict) -> str | None:
    """Why one header entry cannot be loaded, or None."""
    if target is None or target not in targets:
        return f"unexpected tensor {entry.name!r}"
    if target in seen:
        return f"tensor {entry.name!r} is stored twice"
    if entry.dtype not in FLOAT_DTYPES:
        return f"tensor {entry.name!r} has dtype {entry.dtype}, expected a float type"
    want = tuple(targets[target].shape)
    if entry.shape != want:
        return f"tensor {entry.name!r} has shape {list(entry.shape)}, expected {list(want)} for {target}"
    return None


def check_tied_duplicate(duplicate: Copy, embeddings: Copy) -> None:
    """Fail unless a stored lm_head.weight equals the embeddings it is tied to."""
    with SafetensorsFile(duplicate.path) as head_file, SafetensorsFile(embeddings.path) as embed_file:
        head, embed = head_file.get(duplicate.hf_name), embed_file.get(embeddings.hf_name)
    if head.shape != embed.shape or not torch.equal(head.to(embed.dtype), embed):
        raise ValueError(
            f"{duplicate.path.name}: {TIED_HEAD} differs from {EMBEDDINGS}, but tie_word_embeddings is true; "
            "octlm's tied model cannot hold both"
        )


def load_qwen(
    snapshot_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    arch: DecoderConfig | None = None,
) -> Decoder:
    """A Decoder holding a Qwen3 snapshot's weights in `dtype` on `device`, streamed one tensor at a time.

    With `arch`, the snapshot's config.json must describe the same model (runtime fields aside).
    """
    snapshot_dir = Path(snapshot_dir)
    config = read_hf_config(snapshot_dir)
    if arch is not None:
        config = check_arch(arch, config, str(snapshot_dir / "config.json"))
    with torch.device("meta"):
        model = Decoder(config).to(dtype)  # a cast on the meta device allocates nothing
    copies, duplicate = plan_copies(weight_files(snapshot_dir), model)
    if duplicate is not None:
        check_tied_duplicate(duplicate, next(copy for copy in copies if copy.hf_name == EMBEDDINGS))
    model = model.to_empty(device=device)  # the one allocation; every entry of `state` is written below
    state = load_targets(model)
    for path, group in _by_file(copies).items():
        with SafetensorsFile(path) as file:
            for copy in group:
                file.read_into(copy.hf_name, state[copy.target].data)
    return model.eval()


def _by_file(copies: list[Copy]) -> dict[Path, list[Copy]]:
    grouped: dict[Path, list[Copy]] = {}
    for copy in copies:
        grouped.setdefault(copy.path, []).append(copy)
    return grouped


@dataclass
class LoadSettings:
    """scripts/load.py: which snapshot to load, in which dtype, on which device."""

    model: ModelSpec = field(default_factory=ModelSpec)
    dtype: str = "float32"  # float32, float16, bfloat16, or auto (see octlm.generation.pick_dtype)
    device: str = "auto"  # auto: cuda, then mps, then cpu
    cache_dir: str | None = None  # where pinned snapshots are downloaded; None: the Hugging Face cache


def load_pretrained(
    spec: ModelSpec, dtype: torch.dtype, device: str | torch.device, cache_dir: str | None = None
) -> tuple[Decoder, Path, dict]:
    """(model, snapshot directory, report) for a model config with a repo or a local path.

    The snapshot is resolved and its hashes verified before any tensor is read. A spec with a repo
    (model=qwen3) must describe the snapshot's config.json; a spec without one (model=hf) takes its
    architecture from config.json (and only the runtime choices, attention and dropout, from
    spec.arch). Raises SnapshotError or ValueError with a message for the user.
    """
    started = time.perf_counter()
    # A local path is verified once, here, for the summary (resolve_snapshot returns only the path);
    # after a download the second check reads cached hashes.
    local = Path(spec.path).expanduser() if spec.path else None
    snapshot_dir = local or resolve_snapshot(spec, cache_dir=cache_dir)
    check = verify_snapshot(snapshot_dir, spec.repo, spec.revision)
    verified = time.perf_counter()
    wanted, found = decoder_config(spec.arch), read_hf_config(snapshot_dir)
    source = str(snapshot_dir / "config.json")
    arch = check_arch(wanted, found, source) if spec.repo is not None else with_runtime_fields(found, wanted)
    model = load_qwen(snapshot_dir, dtype=dtype, device=device, arch=arch)
    report = {
        "snapshot": str(snapshot_dir),
        "check": check,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(model.dtype).removeprefix("torch."),
        "device": str(model.device),
        "verify_seconds": verified - started,
        "load_seconds": time.perf_counter() - verified,
        "peak_rss_bytes": peak_rss_bytes(),
    }
    return model, snapshot_dir, report


def with_runtime_fields(found: DecoderConfig, chosen: DecoderConfig) -> DecoderConfig:
    """`found` (from config.json) with the runtime choices (attention, kernels, dropout) of `chosen`."""
    return DecoderConfig.from_dict(
        {**asdict(found), **{name: getattr(chosen, name) for name in RUNTIME_FIELDS}}
    )


def peak_rss_bytes() -> int | None:
    """The process's peak resident memory so far, or None where the platform does not say."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def load_report_lines(report: dict) -> list[str]:
    """What scripts/load.py prints for a load_pretrained report."""
    param_bytes = report["parameters"] * torch.empty(0, dtype=getattr(torch, report["dtype"])).element_size()
    peak = report["peak_rss_bytes"]
    memory = "unknown on this platform"
    if peak is not None:
        ratio = peak / param_bytes
        memory = f"{peak / 2**30:.2f} GiB RSS ({ratio:.2f} x the {param_bytes / 2**30:.2f} GiB of parameters)"
    return [
        f"snapshot:    {report['snapshot']}",
        "manifest check:",
        *describe_check(report["check"]),
        f"parameters:  {report['parameters']:,}",
        f"dtype:       {report['dtype']}",
        f"device:      {report['device']}",
        f"peak memory: {memory}",
        f"load time:   {report['load_seconds']:.2f} s (+ {report['verify_seconds']:.2f} s verifying hashes)",
    ]


def run_load(settings: LoadSettings) -> list[str]:
    """scripts/load.py: resolve, verify and load the snapshot; return the lines to print."""
    device = pick_device(settings.device)
    dtype = pick_dtype(settings.dtype, device)
    _, _, report = load_pretrained(settings.model, dtype, device, cache_dir=settings.cache_dir)
    return load_report_lines(report)
