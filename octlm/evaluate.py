"""Evaluation tasks run by scripts/evaluate.py, one function per `task=` value."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from octlm.config import DecoderConfig, ModelSpec, decoder_config
from octlm.files import atomic_write
from octlm.generation import pick_device, pick_dtype
from octlm.model import Decoder
from octlm.qwen import load_pretrained

# transformers' attention implementation -> octlm's path doing the same arithmetic.
PAIRED_ATTENTION = {"sdpa": "sdpa", "eager": "manual"}


@dataclass
class ParitySettings:
    """task=parity: octlm against transformers on the same snapshot, prompt, dtype and device."""

    prompt: str = "The three primary colours are red, yellow and"
    prompt_ids: list[int] | None = None  # token ids to use instead of encoding `prompt`
    new_tokens: int = 64  # greedy continuation compared token by token
    chunk: int = 3  # prefill chunk size for the cached path
    reference_attention: str = "sdpa"  # transformers' attn_implementation: sdpa or eager
    tolerance: float = 1e-5  # largest max-abs logit difference that passes


@dataclass
class LmSettings:
    """task=lm: next-token loss, perplexity and bits per byte on prepared token files or text files."""

    data_dir: str = "data/tinystories"  # a prepared data directory (scripts/prepare_data.py) ...
    split: str = "validation"  # ... and the split of it that is scored
    files: list[str] = field(default_factory=list)  # UTF-8 text files scored instead (any tokenizer)
    bos_token: str = "<|endoftext|>"  # put before each text file so its first token is predicted too
    context: int | None = None  # window length; None: the model's context_length
    batch_size: int = 8  # windows per forward pass
    max_batches: int | None = None  # None: every window


@dataclass
class SamplesSettings:
    """task=samples: a greedy and a sampled story for each fixed prompt, written as JSONL."""

    prompts: list[str] = field(default_factory=list)  # the ten fixed prompts live in conf/evaluate.yaml
    max_new_tokens: int = 200
    temperature: float = 0.8  # of the sampled stories (the greedy ones use 0)
    top_k: int = 40
    top_p: float = 1.0
    seed: int = 0
    out: str = "samples.jsonl"


@dataclass
class EvaluateSettings:
    """scripts/evaluate.py: the task, the model and where it runs."""

    task: str = "parity"
    model: ModelSpec = field(default_factory=ModelSpec)
    dtype: str = "float32"
    device: str = "cpu"
    cache_dir: str | None = None
    parity: ParitySettings = field(default_factory=ParitySettings)
    checkpoint: str | None = None  # lm/samples: an octlm checkpoint (step or run folder), not a snapshot
    lm: LmSettings = field(default_factory=LmSettings)
    samples: SamplesSettings = field(default_factory=SamplesSettings)


def run_task(settings: EvaluateSettings) -> dict:
    """Run settings.task; return its results (name -> value, with a boolean `passed`)."""
    if settings.task not in TASKS:
        raise ValueError(f"task={settings.task!r} is unknown; choose one of {sorted(TASKS)}")
    return TASKS[settings.task](settings)


def result_lines(results: dict) -> list[str]:
    """Printable `name: value` lines; floats in 3 significant digits, integers with separators."""
    width = max(len(name) for name in results) + 1
    return [f"{name + ':':<{width}} {_show(value)}" for name, value in results.items()]


def _show(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def parity(settings: EvaluateSettings) -> dict:
    """Logits, argmax, chunked cached prefill and greedy tokens of octlm against transformers."""
    options = settings.parity
    if options.reference_attention not in PAIRED_ATTENTION:
        raise ValueError(f"parity.reference_attention must be one of {sorted(PAIRED_ATTENTION)}")
    if options.new_tokens < 1 or options.chunk < 1:
        raise ValueError("parity.new_tokens and parity.chunk must be positive")
    device = pick_device(settings.device)
    dtype = pick_dtype(settings.dtype, device)
    # The exact comparison runs transformers' kernels; the fast ones (the default) are checked after.
    arch = replace(
        decoder_config(settings.model.arch),
        attention=PAIRED_ATTENTION[options.reference_attention],
        kernels="reference",
    )
    model, snapshot, _ = load_pretrained(
        replace(settings.model, arch=arch), dtype, device, settings.cache_dir
    )
    prompt = prompt_tokens(options, snapshot, model.config).to(device)
    reference = reference_model(snapshot, dtype, device, options.reference_attention)
    with torch.no_grad():
        ours, theirs = model(prompt), reference(prompt).logits.float()
        chunked = chunked_logits(model, prompt, options.chunk)
        their_chunked = reference_chunked_logits(reference, prompt, options.chunk)
        expected = reference.generate(
            prompt, do_sample=False, max_new_tokens=options.new_tokens, pad_token_id=0
        )[0, prompt.shape[1] :]
        greedy = greedy_continuation(model, prompt, options.new_tokens)[0]
        model.config.kernels = "fast"  # every Linear reads the model's config at each call
        fast_chunked = chunked_logits(model, prompt, options.chunk)
        fast_greedy = greedy_continuation(model, prompt, options.new_tokens)[0]
    logits = {
        "octlm": ours,
        "transformers": theirs,
        "octlm chunked": chunked,
        "transformers chunked": their_chunked,
        "octlm chunked, fast kernels": fast_chunked,
    }
    import transformers

    compared = (
        f"octlm {arch.attention} vs transformers {transformers.__version__} {options.reference_attention}"
    )
    heading = {"snapshot": str(snapshot), "compared": compared, "dtype": str(dtype).removeprefix("torch.")}
    return heading | parity_results(logits, greedy, fast_greedy, expected, options.tolerance)


def parity_results(
    logits: dict[str, torch.Tensor],
    greedy: torch.Tensor,
    fast_greedy: torch.Tensor,
    expected: torch.Tensor,
    tolerance: float,
) -> dict:
    """Figures from the five logits (1, T, vocab) and three continuations (N,) that `parity` computes.

    The exact figures must hold within `tolerance`; the fast kernels round differently from
    transformers' kernels, so its logit error is reported and its greedy tokens must match.
    """
    ours, theirs = logits["octlm"], logits["transformers"]
    error = (ours - theirs).abs()
    chunked_error = (logits["octlm chunked"] - logits["transformers chunked"]).abs().max().item()
    fast_error = (logits["octlm chunked, fast kernels"] - logits["transformers chunked"]).abs().max().item()
    argmax = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    match, fast_match = _matching(greedy, expected), _matching(fast_greedy, expected)
    exact = error.max().item() <= tolerance and chunked_error <= tolerance
    passed = exact and match == len(greedy) and fast_match == len(fast_greedy)
    return {
        "prompt tokens": ours.shape[1],
        "max abs logit error": error.max().item(),
        "mean abs logit error": error.mean().item(),
        "argmax agreement": f"{argmax:.2%}",
        "chunked max abs logit error": chunked_error,
        "chunked vs one full pass (octlm)": (logits["octlm chunked"] - ours).abs().max().item(),
        "greedy match": f"{match}/{len(greedy)} tokens (transformers generated {len(expected)})",
        "fast kernels, chunked max abs logit error": fast_error,
        "fast kernels, greedy match": f"{fast_match}/{len(fast_greedy)} tokens",
        "passed": passed,
    }


def _matching(tokens: torch.Tensor, expected: torch.Tensor) -> int:
    """How many leading tokens agree."""
    return int((tokens.cpu() == expected.cpu()).long().cumprod(0).sum().item()) if len(expected) else 0


def prompt_tokens(options: ParitySettings, snapshot: Path, config: DecoderConfig) -> torch.Tensor:
    """The prompt as ids (1, T): parity.prompt_ids, or parity.prompt through the snapshot's tokenizer."""
    if options.prompt_ids is not None:
        ids = list(options.prompt_ids)
    else:
        from octlm.tokenizer import Tokenizer

        ids = Tokenizer.from_dir(snapshot).encode(options.prompt)
    if not ids:
        raise ValueError("the parity prompt is empty")
    if max(ids) >= config.vocab_size or min(ids) < 0:
        raise ValueError(f"prompt ids must lie in [0, {config.vocab_size}), got {min(ids)}..{max(ids)}")
    if len(ids) + options.new_tokens > config.context_length:
        raise ValueError(f"{len(ids)} prompt + {options.new_tokens} new tokens exceed the context")
    return torch.tensor([ids])


def reference_model(snapshot: Path, dtype: torch.dtype, device: torch.device, attention: str):
    """transformers' own model for the snapshot: the reference, imported only here."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(snapshot, dtype=dtype, attn_implementation=attention)
    model.generation_config.eos_token_id = None  # compare every token, not up to the first EOS
    return model.to(device).eval()


def reference_chunked_logits(reference, tokens: torch.Tensor, chunk: int) -> torch.Tensor:
    """transformers' logits (1, T, vocab) for the same chunked prefill on its own cache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=reference.config)
    pieces = [reference(piece, cache=cache, use_cache=True).logits for piece in tokens.split(chunk, dim=1)]
    return torch.cat(pieces, dim=1).float()


def chunked_logits(model: Decoder, tokens: torch.Tensor, chunk: int) -> torch.Tensor:
    """Logits (1, T, vocab) from prefilling `tokens` (1, T) on a fresh KV cache `chunk` tokens at a time."""
    cache = model.new_cache(tokens.shape[0], tokens.shape[1])
    return torch.cat([model(piece, cache=cache) for piece in tokens.split(chunk, dim=1)], dim=1)


def greedy_continuation(model: Decoder, tokens: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The next `new_tokens` argmax ids (B, new_tokens) after `tokens` (B, T), through the KV cache."""
    cache = model.new_cache(tokens.shape[0], tokens.shape[1] + new_tokens)
    logits = model(tokens, cache=cache, last_only=True)
    picked = []
    for step in range(new_tokens):
        token = logits[:, -1].argmax(-1, keepdim=True)
        picked.append(token)
        if step + 1 < new_tokens:
            logits = model(token, cache=cache, last_only=True)
    return torch.cat(picked, dim=1)


TASKS: dict[str, Callable[[EvaluateSettings], dict]] = {"parity": parity}


# ---------------------------------------------------------------------------------------------------
# task=lm and task=samples: a trained checkpoint (or a pretrained snapshot) on text


def load_for_evaluation(settings: EvaluateSettings):
    """The model and tokenizer named by checkpoint= (an octlm run) or by the model's snapshot (Qwen3)."""
    from octlm.generation import ModelSettings, load_model

    chosen = ModelSettings(
        model=settings.model,
        checkpoint=settings.checkpoint,
        cache_dir=settings.cache_dir,
        device=settings.device,
        dtype=settings.dtype,
    )
    return load_model(chosen)


def language_model(settings: EvaluateSettings) -> dict:
    """Loss (nats per token), perplexity and bits per byte of the model on token or text files."""
    options = settings.lm
    loaded = load_for_evaluation(settings)
    context = min(options.context or loaded.model.config.context_length, loaded.model.config.context_length)
    if options.files:
        nats, tokens, text_bytes = score_text_files(loaded, options, context)
        scored = ", ".join(options.files)
    else:
        nats, tokens, text_bytes = score_token_split(loaded, options, context)
        scored = f"{options.data_dir} [{options.split}]"
    loss = nats / tokens
    return {
        "model": loaded.source,
        "scored": scored,
        "tokens": tokens,
        "bytes": text_bytes,
        "loss": loss,
        "perplexity": math.exp(loss),
        "bits per byte": nats / (text_bytes * math.log(2)),
    }


def score_token_split(loaded, options: LmSettings, context: int) -> tuple[float, int, int]:
    """(nats, tokens, bytes) on a prepared split; bytes scale with the share of the split scored."""
    from octlm.checkpoint import file_sha256
    from octlm.data import load_manifest, open_split
    from octlm.train import validation_loss

    manifest = load_manifest(options.data_dir)
    model_tokenizer = Path(loaded.source) / "tokenizer.json"
    if not model_tokenizer.is_file() or file_sha256(model_tokenizer) != manifest["tokenizer_sha256"]:
        raise ValueError(
            f"{options.data_dir} was tokenized with another tokenizer than {model_tokenizer}; "
            f"score text files (lm.files) instead"
        )
    split = manifest["splits"].get(options.split)
    if split is None:
        raise ValueError(
            f"{options.data_dir}: no split {options.split!r} (splits: {sorted(manifest['splits'])})"
        )
    tokens = open_split(options.data_dir, options.split, verify=True)
    loss, count = validation_loss(loaded.model, tokens, context, options.batch_size, options.max_batches)
    return loss * count, count, round(split["bytes"] * count / split["tokens"])


def score_text_files(loaded, options: LmSettings, context: int) -> tuple[float, int, int]:
    """(nats, tokens, bytes) over text files, each encoded after bos_token so every token is scored."""
    import numpy as np

    from octlm.train import validation_loss

    bos = loaded.tokenizer.token_id(options.bos_token)
    nats, tokens, text_bytes = 0.0, 0, 0
    for name in options.files:
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"lm.files: {path} not found")
        text = path.read_text(encoding="utf-8")
        ids = np.array([bos, *loaded.tokenizer.encode(text)], dtype=np.int64)
        if len(ids) < 2:
            raise ValueError(f"lm.files: {path} is empty")
        loss, count = validation_loss(loaded.model, ids, context, options.batch_size, options.max_batches)
        nats, tokens, text_bytes = nats + loss * count, tokens + count, text_bytes + len(text.encode())
    return nats, tokens, text_bytes


def samples(settings: EvaluateSettings) -> dict:
    """A greedy and a sampled story for each prompt of samples.prompts, written to samples.out (JSONL)."""
    from octlm.generation import SamplingConfig, complete, generate

    options = settings.samples
    if not options.prompts:
        raise ValueError("samples.prompts is empty")
    loaded = load_for_evaluation(settings)
    ids = [loaded.tokenizer.encode(prompt) for prompt in options.prompts]
    records = []
    for mode, temperature in (("greedy", 0.0), ("sampled", options.temperature)):
        sampling = SamplingConfig(
            temperature=temperature,
            top_k=options.top_k,
            top_p=options.top_p,
            seed=options.seed,
            max_new_tokens=options.max_new_tokens,
        )
        stream = generate(loaded.model, ids, sampling, loaded.eos_ids, decoder=loaded.tokenizer.stream)
        for prompt, done in zip(options.prompts, complete(stream, len(ids)), strict=True):
            records.append(
                {
                    "prompt": prompt,
                    "mode": mode,
                    "text": done.text,
                    "tokens": len(done.tokens),
                    "finish": done.finish,
                }
            )
    write_jsonl(Path(options.out), records)
    return {
        "model": loaded.source,
        "prompts": len(options.prompts),
        "stories": len(records),
        "written": options.out,
    }


def write_jsonl(path: Path, records: list[dict]) -> None:
    """One JSON object per line, replacing `path` atomically."""
    atomic_write(path, "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))


TASKS.update(lm=language_model, samples=samples)
