"""Sampling and generation: prefill, a decode step with no host sync, and a streaming generate loop.

The decode loop keeps the device busy. Each step's sampled ids (with a non-finite flag) are copied
to the host asynchronously; on CUDA and mps the next step is launched first and only then does the
host wait for that copy, check for stops and decode text, so the host handles token t while the
device runs step t + 1 (one step is computed past a stop and thrown away). Nothing else in the loop
reads device memory. On the CPU, where every op is synchronous, the loop reads token t before
computing step t + 1; both orders give the same tokens (tested).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Protocol, TextIO

import torch

from octlm.cache import KVCache
from octlm.config import DecoderConfig, ModelSpec, decoder_config
from octlm.model import Decoder
from octlm.tokenizer import Tokenizer

OVERFLOW_POLICIES = ("error", "truncate_left")
# Devices that queue work asynchronously, where launching step t + 1 before reading token t overlaps
# the two. On the CPU every op runs to completion when called, so running ahead would only delay
# each token (and the time to first token) by one decode step.
RUN_AHEAD_DEVICES = ("cuda", "mps")


class GenerationError(ValueError):
    """A request that cannot be served as asked (context overflow, bad settings, non-finite logits)."""


@dataclass
class SamplingConfig:
    """How tokens are picked and when generation stops; None takes the model's default."""

    temperature: float | None = None  # 0 is greedy
    top_k: int | None = None  # 0 keeps every token
    top_p: float | None = None  # 1.0 keeps every token
    seed: int | None = None  # None: a fresh random seed
    max_new_tokens: int = 256
    stop: list[str] = field(default_factory=list)  # stop strings, cut from the returned text
    overflow: str = "error"  # prompt + max_new_tokens past the context: "error" or "truncate_left"

    def resolved(self, defaults: SamplingDefaults) -> SamplingConfig:
        """Fill every None sampling field from `defaults`, then validate."""
        filled = {
            name: getattr(defaults, name) if getattr(self, name) is None else getattr(self, name)
            for name in ("temperature", "top_k", "top_p")
        }
        return replace(self, **filled).validate()

    def describe(self) -> str:
        """One line with every sampling value, for logs."""
        return " ".join(f"{name}={value}" for name, value in asdict(self).items() if value != [])

    def validate(self) -> SamplingConfig:
        """Raise GenerationError naming the first bad field; return self."""
        checks = {
            "temperature": self.temperature is not None and self.temperature >= 0,
            "top_k": self.top_k is not None and self.top_k >= 0,
            "top_p": self.top_p is not None and 0 < self.top_p <= 1,
            "max_new_tokens": self.max_new_tokens > 0,
            "overflow": self.overflow in OVERFLOW_POLICIES,
        }
        for name, ok in checks.items():
            if not ok:
                raise GenerationError(f"sampling.{name}: invalid value {getattr(self, name)!r}")
        return self


@dataclass
class SamplingDefaults:
    """Sampling values a model ships with; these are for models without generation_config.json."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 1.0


def read_generation_defaults(path: Path, fallback: SamplingDefaults) -> SamplingDefaults:
    """Sampling defaults from a snapshot's generation_config.json, `fallback` where it is silent."""
    values = json.loads(path.read_text()) if path.is_file() else {}
    temperature = values.get("temperature", fallback.temperature)
    if values.get("do_sample") is False:
        temperature = 0.0
    return SamplingDefaults(
        temperature=temperature,
        top_k=values.get("top_k", fallback.top_k),
        top_p=values.get("top_p", fallback.top_p),
    )


def sample(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token per row: logits (B, V) float32 -> ids (B,) int64, without a host sync."""
    if temperature == 0:
        return logits.argmax(-1)
    values, ids = candidates(logits, temperature, top_k, top_p)
    probs = values.softmax(-1)
    # argmax(p / E) with E ~ Exp(1) draws from p exactly like torch.multinomial, but is one fused
    # elementwise op and an argmax, with no validity check that waits for the device.
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    choice = (probs / noise).argmax(-1, keepdim=True)
    return choice[:, 0] if ids is None else ids.gather(-1, choice)[:, 0]


def candidates(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tempered logits of the tokens top-k and top-p keep, (B, K), -inf where top-p cuts, and their ids
    (B, K); ids None when every token is a candidate (K = V, no cut).

    Top-k runs first and top-p only sorts its k survivors: sorting Qwen3's 151,936 logits costs
    ~50 ms on a CPU core, torch.topk(20) under 1 ms.
    """
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        values, ids = torch.topk(logits, top_k, dim=-1)  # sorted, largest first
    elif top_p < 1.0:
        values, ids = logits.sort(-1, descending=True)
    else:
        return logits, None
    if top_p < 1.0:
        probs = values.softmax(-1)
        mass_before = probs.cumsum(-1) - probs  # the first token has 0 before it: always kept
        values = values.masked_fill(mass_before >= top_p, float("-inf"))
    return values, ids


def prefill(
    model: Decoder, tokens: torch.Tensor, cache: KVCache, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Run prompt tokens (B, T) through the model on top of `cache`; last position's logits (B, V)."""
    return model(tokens, cache=cache, valid=valid, last_only=True)[:, -1]


def decode_one_token(
    model: Decoder, tokens: torch.Tensor, cache: KVCache, sampling: SamplingConfig, generator=None
) -> torch.Tensor:
    """Feed ids (B,) and pick the next ones; returns (2, B): ids, and 1 where logits were not finite."""
    return pick(prefill(model, tokens[:, None], cache), sampling, generator)


def pick(logits: torch.Tensor, sampling: SamplingConfig, generator=None) -> torch.Tensor:
    """Sample from logits (B, V) -> (2, B): the ids and a non-finite flag, both on the device."""
    ids = sample(logits, sampling.temperature, sampling.top_k, sampling.top_p, generator)
    bad = ~logits.sum(-1).isfinite()  # any inf or NaN makes the sum non-finite; 400x cheaper than .all
    return torch.stack((ids, bad.long()))


class _HostCopy:
    """A device-to-host copy started now and awaited later, so the device can run ahead meanwhile."""

    def __init__(self, values: torch.Tensor) -> None:
        self.event = None
        if values.device.type == "cuda":
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = values

    def wait(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class TextDecoder(Protocol):
    """Incremental detokeniser, such as octlm.tokenizer.Tokenizer.stream()."""

    def step(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class TextStream:
    """One row's printable text: a TextDecoder's output with partial stop-string matches held back."""

    def __init__(self, decoder: TextDecoder, stop: Sequence[str] = ()) -> None:
        self.decoder = decoder
        self.stop = [s for s in stop if s]
        self.held = ""  # decoded text that might be the beginning of a stop string
        self.stopped = False

    def push(self, token: int) -> str:
        """Add one id; return the text that became safe to print ('' while incomplete or held)."""
        return "" if self.stopped else self._release(self.decoder.step(token))

    def flush(self) -> str:
        """Everything still held, at the end of the row (nothing once a stop string matched)."""
        text = "" if self.stopped else self._release(self.decoder.flush())
        text, self.held = text + self.held, ""
        return text

    def _release(self, new: str) -> str:
        text = self.held + new
        hits = [text.find(s) for s in self.stop if s in text]
        if hits:
            self.stopped, self.held = True, ""
            return text[: min(hits)]
        keep = max((n for s in self.stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep]


@dataclass
class TokenEvent:
    """One generated token of one row; `finish` is set on the row's last event."""

    row: int
    token: int
    text: str  # text that became printable with this token ('' while held back or with no decoder)
    finish: str | None = None  # "eos", "stop" (a stop string), "length" (max_new_tokens)


@dataclass
class GenerationStats:
    """Token counts and timings of one generate call (host clock; every read is a device sync)."""

    rows: int = 0
    prompt_tokens: int = 0  # real prompt tokens prefilled, padding excluded
    new_tokens: int = 0  # tokens generated over all rows
    first_token_seconds: float = 0.0  # prompt prefill plus the first sample: time to first token
    decode_seconds: float = 0.0  # from the first token to the last

    def as_dict(self) -> dict:
        decode_tokens = max(self.new_tokens - self.rows, 0)
        return {
            **asdict(self),
            "prefill_tokens_per_second": _rate(self.prompt_tokens, self.first_token_seconds),
            "decode_tokens_per_second": _rate(decode_tokens, self.decode_seconds),
        }

    def summary(self) -> str:
        d = self.as_dict()
        return (
            f"{self.new_tokens} tokens | prefill {d['prefill_tokens_per_second']:.1f} tok/s "
            f"({self.prompt_tokens} prompt tokens) | decode {d['decode_tokens_per_second']:.1f} tok/s | "
            f"time to first token {self.first_token_seconds * 1000:.0f} ms"
        )


def _rate(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


def fit_prompts(prompts: list[list[int]], max_new_tokens: int, room: int, overflow: str) -> list[list[int]]:
    """Check that each prompt plus max_new_tokens fits in `room` positions, before any compute.

    With overflow="truncate_left" a prompt that is too long loses its oldest tokens instead.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise GenerationError("every prompt needs at least one token")
    if max_new_tokens >= room:
        raise GenerationError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt in {room} positions"
        )
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens <= room:
        return prompts
    if overflow == "truncate_left":
        keep = room - max_new_tokens
        return [p[-keep:] for p in prompts]
    raise GenerationError(
        f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} needs {longest + max_new_tokens} "
        f"positions but only {room} are available (the model's context or cache); shorten the prompt, "
        "lower max_new_tokens, or set sampling.overflow=truncate_left"
    )


def left_pad(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token ids (B, T) with rows padded on the left, and valid (B, T) marking real ids (None if no pad)."""
    width = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), width, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, ids in enumerate(prompts):
        tokens[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        valid[row, width - len(ids) :] = True
    return tokens.to(device), (None if bool(valid.all()) else valid.to(device))


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A torch.Generator on `device`, seeded when a seed is given."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


@torch.inference_mode()
def generate(
    model: Decoder,
    prompts: list[list[int]],
    sampling: SamplingConfig,
    eos_ids: Sequence[int],
    decoder: Callable[[], TextDecoder] | None = None,
    cache: KVCache | None = None,
    stats: GenerationStats | None = None,
) -> Iterator[TokenEvent]:
    """Continue each prompt; yield TokenEvents as tokens arrive, every row stopping on its own.

    A row ends at any of `eos_ids`, at a stop string (needs `decoder`, such as tokenizer.stream), or
    after max_new_tokens. With `cache` the prompts continue what it holds (chat); otherwise a cache
    just large enough is made. `sampling` must be resolved (no None); `stats` is filled in when given.
    """
    sampling.validate()
    room = model.config.context_length if cache is None else cache.max_len - cache.length
    prompts = fit_prompts(prompts, sampling.max_new_tokens, room, sampling.overflow)
    tokens, valid = left_pad(prompts, model.device)
    if cache is None:
        cache = model.new_cache(len(prompts), tokens.shape[1] + sampling.max_new_tokens)
    stats = stats if stats is not None else GenerationStats()
    stats.rows, stats.prompt_tokens = len(prompts), sum(len(p) for p in prompts)
    streams = [TextStream(decoder(), sampling.stop) if decoder else None for _ in prompts]
    generator = make_generator(sampling.seed, model.device) if sampling.temperature > 0 else None
    started = time.perf_counter()
    picks = pick(prefill(model, tokens, cache, valid), sampling, generator)
    active = set(range(len(prompts)))
    run_ahead = model.device.type in RUN_AHEAD_DEVICES
    for step in range(sampling.max_new_tokens):
        ready = _HostCopy(picks)
        more = step + 1 < sampling.max_new_tokens
        if more and run_ahead:  # launch step t + 1 before the host looks at token t
            picks = decode_one_token(model, picks[0], cache, sampling, generator)
        ids, bad = ready.wait()
        _record_time(stats, step, started)
        _check_finite(bad, active, step, model.dtype)
        for row in sorted(active):
            event = _row_event(row, ids[row], streams[row], eos_ids, last=not more)
            stats.new_tokens += 1
            if event.finish:
                active.discard(row)
            yield event
        if not active:
            return
        if more and not run_ahead:
            picks = decode_one_token(model, picks[0], cache, sampling, generator)


def _record_time(stats: GenerationStats, step: int, started: float) -> None:
    elapsed = time.perf_counter() - started
    if step == 0:
        stats.first_token_seconds = elapsed
    else:
        stats.decode_seconds = elapsed - stats.first_token_seconds


def _check_finite(bad: list[int], active: set[int], step: int, dtype: torch.dtype) -> None:
    rows = [row for row in sorted(active) if bad[row]]
    if rows:
        raise GenerationError(
            f"non-finite logits (inf/NaN) at generated token {step} in row {rows[0]} with {dtype}: the "
            "model overflowed; run with dtype=bfloat16 or dtype=float32"
        )


def _row_event(
    row: int, token: int, stream: TextStream | None, eos_ids: Sequence[int], last: bool
) -> TokenEvent:
    if token in eos_ids:
        return TokenEvent(row, token, stream.flush() if stream else "", "eos")
    text = stream.push(token) if stream else ""
    if stream is not None and stream.stopped:
        return TokenEvent(row, token, text, "stop")
    if last:
        return TokenEvent(row, token, text + (stream.flush() if stream else ""), "length")
    return TokenEvent(row, token, text)


@dataclass
class Completion:
    """A finished row: its generated ids (the stop id included), text and why it ended."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish: str | None = None


def complete(events: Iterator[TokenEvent], rows: int) -> list[Completion]:
    """Collect a generate() stream into one Completion per row."""
    done = [Completion() for _ in range(rows)]
    for event in events:
        done[event.row].tokens.append(event.token)
        done[event.row].text += event.text
        done[event.row].finish = event.finish
    return done


def pick_device(name: str = "auto") -> torch.device:
    """`auto`: CUDA if present, then Apple's mps, else the CPU; any other name is used as given."""
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: float32 on the CPU, bfloat16 where the GPU has it, float16 otherwise (a T4)."""
    if name != "auto":
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise GenerationError(f"dtype={name!r} is not a torch floating-point dtype")
        return dtype
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    if device.type == "mps":
        return torch.bfloat16 if torch.backends.mps.is_macos_or_newer(14, 0) else torch.float16
    return torch.float32


@dataclass
class ModelSettings:
    """What scripts/generate.py and scripts/chat.py share: the model, its device and how to sample."""

    model: ModelSpec = field(default_factory=ModelSpec)
    checkpoint: str | None = None  # an octlm checkpoint (step directory or run folder) instead of a snapshot
    cache_dir: str | None = None  # where snapshots are downloaded; None: the Hugging Face cache (HF_HOME)
    device: str = "auto"  # auto: cuda, then mps, then cpu
    dtype: str = "auto"  # auto: float32 on the CPU, bfloat16 on GPUs that have it, else float16
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    fallback_sampling: SamplingDefaults = field(default_factory=SamplingDefaults)  # models with none
    system: str | None = None  # a system message (chat template only)
    thinking: bool | None = None  # enable_thinking for Qwen3's template; None: the template's default


@dataclass
class LoadedModel:
    """A model ready to generate: weights, tokenizer, its stop ids and sampling defaults."""

    model: Decoder
    tokenizer: Tokenizer
    eos_ids: list[int]
    defaults: SamplingDefaults
    source: str  # where the weights came from, for the log line


def load_model(settings: ModelSettings) -> LoadedModel:
    """Open the snapshot (or octlm checkpoint) named by `settings` on its device, in its dtype."""
    device = pick_device(settings.device)
    dtype = pick_dtype(settings.dtype, device)
    if settings.checkpoint is not None:
        return load_checkpoint_model(
            settings.checkpoint, settings.model, settings.fallback_sampling, dtype, device
        )
    from octlm.qwen import load_pretrained  # qwen imports pick_device and pick_dtype from here

    model, snapshot, _ = load_pretrained(settings.model, dtype, device, cache_dir=settings.cache_dir)
    tokenizer = Tokenizer.from_dir(snapshot)
    defaults = read_generation_defaults(snapshot / "generation_config.json", settings.fallback_sampling)
    return LoadedModel(model, tokenizer, tokenizer.eos_ids, defaults, str(snapshot))


def load_checkpoint_model(
    path: str, spec: ModelSpec, defaults: SamplingDefaults, dtype: torch.dtype, device: torch.device
) -> LoadedModel:
    """A Decoder and tokenizer from a verified octlm training checkpoint (its newest under a run folder).

    The checkpoint's own config builds the model; it must match the chosen model's architecture.
    Generation stops at the tokenizer's special tokens (TinyStories: <|endoftext|>).
    """
    from octlm.checkpoint import CheckpointError, latest_checkpoint, open_checkpoint

    folder = Path(path)
    found = open_checkpoint(folder) if (folder / "manifest.json").is_file() else latest_checkpoint(folder)
    if found is None:
        raise CheckpointError(f"checkpoint={path}: no checkpoint directory (step_NNNNNN) there")
    config = DecoderConfig.from_dict(found.json("state.json")["config"])
    expected = decoder_config(spec.arch)
    if config.fingerprint() != expected.fingerprint():
        raise CheckpointError(
            f"checkpoint={found.path} holds a model unlike model={spec.name}: {config.canonical()} "
            f"against {expected.canonical()}; choose the model config it was trained with"
        )
    model = Decoder(config)
    model.load_state_dict(found.tensors("model.safetensors"), strict=True)
    tokenizer = Tokenizer.from_files(found.path / "tokenizer.json")
    special = sorted(i for i, token in tokenizer.backend.get_added_tokens_decoder().items() if token.special)
    return LoadedModel(
        model.to(device=device, dtype=dtype).eval(), tokenizer, special, defaults, str(found.path)
    )


@dataclass
class GenerateSettings(ModelSettings):
    """scripts/generate.py: prompts in, streamed text out."""

    prompt: str | None = None
    prompts: list[str] = field(default_factory=list)  # a batch, left-padded and generated together
    prompts_file: str | None = None  # one prompt per non-empty line
    chat: bool | None = None  # wrap prompts in the chat template; None: when the tokenizer has one
    output: str = "text"  # text: stream to stdout; json: one JSON object per prompt


def read_prompts(settings: GenerateSettings) -> list[str]:
    """Every prompt from prompt=, prompts=[...] and prompts_file=, in that order."""
    texts = ([settings.prompt] if settings.prompt is not None else []) + list(settings.prompts)
    if settings.prompts_file is not None:
        path = Path(settings.prompts_file)
        if not path.is_file():
            raise GenerationError(f"prompts_file={path}: no such file")
        texts += [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not texts:
        raise GenerationError("no prompt given: set prompt=TEXT, prompts=[A,B] or prompts_file=PATH")
    return texts


def encode_prompt(tokenizer: Tokenizer, text: str, chat: bool, settings: ModelSettings) -> list[int]:
    """Prompt ids: the text alone, or a one-turn conversation through the chat template."""
    if not chat:
        return tokenizer.encode(text)
    system = [{"role": "system", "content": settings.system}] if settings.system else []
    thinking = {} if settings.thinking is None else {"enable_thinking": settings.thinking}
    return tokenizer.encode_chat([*system, {"role": "user", "content": text}], **thinking)


def run_generate(settings: GenerateSettings, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> None:
    """Load, generate every prompt, print text (streamed for one prompt) or JSON, stats to `err`."""
    if settings.output not in ("text", "json"):
        raise GenerationError(f"output={settings.output!r}: use text or json")
    texts = read_prompts(settings)
    settings.sampling.resolved(SamplingDefaults())  # a bad value fails before the model loads
    loaded = load_model(settings)
    chat = settings.chat if settings.chat is not None else bool(loaded.tokenizer.chat_templates)
    prompts = [encode_prompt(loaded.tokenizer, text, chat, settings) for text in texts]
    sampling = settings.sampling.resolved(loaded.defaults)
    print(f"{loaded.source} | {loaded.model.device} {loaded.model.dtype} | {sampling.describe()}", file=err)
    stats = GenerationStats()
    events = generate(loaded.model, prompts, sampling, loaded.eos_ids, loaded.tokenizer.stream, stats=stats)
    if settings.output == "json":
        for text, done in zip(texts, complete(events, len(prompts)), strict=True):
            record = {"prompt": text, "text": done.text, "tokens": len(done.tokens), "finish": done.finish}
            print(json.dumps({**record, "stats": stats.as_dict()}, ensure_ascii=False), file=out)
    elif len(prompts) == 1:
        print("" if chat else texts[0], end="", file=out, flush=True)
        for event in events:
            print(event.text, end="", file=out, flush=True)
        print(file=out)
    else:
        for index, done in enumerate(complete(events, len(prompts))):
            print(("" if index == 0 else "\n") + ("" if chat else texts[index]) + done.text, file=out)
    print(stats.summary(), file=err)


@contextmanager
def exit_on_user_error() -> Iterator[None]:
    """Turn a problem the user can fix (bad input, missing snapshot) into one message and exit code 2."""
    from octlm.checkpoint import CheckpointError

    try:
        yield
    except (ValueError, OSError, CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print(file=sys.stderr)
        raise SystemExit(130) from None
