"""Benchmarks: octlm against transformers on one snapshot, dtype, device, thread count and prompt.

Every figure is a ratio measured in the same run: the two sides' repeats are interleaved so that
noise from other work on the machine hits both alike. transformers is imported here only, as the
reference; the octlm side runs octlm's own loader, cache and generation code.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from octlm.chat import ChatSession
from octlm.config import DecoderConfig, ModelSpec, decoder_config
from octlm.files import atomic_write, atomic_writer, fsync_dir
from octlm.generation import LoadedModel, SamplingConfig, SamplingDefaults, decode_one_token, prefill
from octlm.model import Decoder, linear
from octlm.qwen import load_qwen
from octlm.tokenizer import Tokenizer
from octlm.train import OptimSettings, build_optimizer, flops_per_token

BENCHMARKS = ("decode", "prefill", "load", "cache", "chat", "train")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
GREEDY = SamplingConfig(temperature=0.0, top_k=0, top_p=1.0, max_new_tokens=1)


@dataclass
class DecodeBench:
    contexts: list[int] = field(default_factory=lambda: [128, 512, 2048])
    new_tokens: int = 8  # tokens decoded per timed repeat
    repeats: int = 3


@dataclass
class PrefillBench:
    lengths: list[int] = field(default_factory=lambda: [512, 2048])
    repeats: int = 3


@dataclass
class LoadBench:
    repeats: int = 2  # fresh processes per side


@dataclass
class CacheBench:
    contexts: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048, 4096])
    cached_steps: int = 8  # one-token steps timed with the cache at each context
    uncached_repeats: int = 1  # full forwards timed without it (each costs a prefill of the context)


@dataclass
class ChatBench:
    turns: int = 8
    reply_tokens: int = 16  # greedy tokens the model replies each turn
    max_context: int = 2048  # positions of the session's cache
    tokenizer_dir: str = ".fixtures/qwen3-0.6b"  # the real Qwen3 tokenizer files (make fixtures)


@dataclass
class TrainBench:
    model: ModelSpec = field(default_factory=ModelSpec)
    batch_size: int = 8
    seq_len: int = 256
    steps: int = 4  # timed steps per side, after one warm-up step each
    peak_tflops: float | None = None  # None: measure a matmul peak of this device in the same run
    matmul_size: int = 2048  # square matmul used to measure that peak


@dataclass
class Targets:
    """What each figure must reach (from the benchmark issue); "gain" is octlm's advantage."""

    decode_vs_transformers: float = 1.25
    decode_vs_ceiling: float = 0.85
    prefill_vs_transformers: float = 1.0
    load_wall_vs_transformers: float = 1.0
    load_peak_x_fp32_params: float = 1.15  # octlm's absolute peak RSS, in float32 parameter bytes
    cache_at_longest: float = 20.0  # no cache / cache, at the longest cache context
    chat_at_last_turn: float = 4.0  # rebuilt / kept time to first token, at the last turn
    train_vs_transformers: float = 1.0


@dataclass
class BenchSettings:
    """Which benchmarks run, on what, and where the results go."""

    model: ModelSpec = field(default_factory=ModelSpec)
    benchmarks: list[str] = field(default_factory=lambda: list(BENCHMARKS))
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 2  # torch intra-op threads, the same for both sides and every child process
    seed: int = 0
    snapshot_cache: str = "~/.cache/octlm/bench"  # random-weight snapshots are built here once
    out_dir: str = "outputs/bench"
    wandb_mode: str = "disabled"  # disabled, offline, online, or auto (online with WANDB_API_KEY)
    wandb_project: str = "octlm-bench"
    decode: DecodeBench = field(default_factory=DecodeBench)
    prefill: PrefillBench = field(default_factory=PrefillBench)
    load: LoadBench = field(default_factory=LoadBench)
    cache: CacheBench = field(default_factory=CacheBench)
    chat: ChatBench = field(default_factory=ChatBench)
    train: TrainBench = field(default_factory=TrainBench)
    targets: Targets = field(default_factory=Targets)


@dataclass
class Row:
    """One line of the summary table; `met` is None where there is no target."""

    figure: str
    octlm: str
    reference: str
    ratio: float
    target: str
    met: bool | None


# ---------------------------------------------------------------------------------------------------
# Timing and statistics


def torch_dtype(name: str) -> torch.dtype:
    """float32, float16 or bfloat16 by name; anything else is a ValueError naming the setting."""
    if name not in DTYPES:
        raise ValueError(f"bench.dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def sync(device: torch.device) -> None:
    """Wait for queued work, so a timer measures compute and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, work: Callable[[], Any]) -> float:
    """Seconds `work()` takes, synchronised with the device on both sides."""
    sync(device)
    started = time.perf_counter()
    work()
    sync(device)
    return time.perf_counter() - started


def spread(samples: list[float]) -> dict:
    """Median, quartiles, min and max of timing samples (quartiles need 2+ samples)."""
    ordered = sorted(samples)
    q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else ordered * 3
    return {
        "median": statistics.median(ordered),
        "q1": q1,
        "q3": q3,
        "min": ordered[0],
        "max": ordered[-1],
        "n": len(ordered),
    }


def interleaved(sides: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Run each side once per repeat, alternating which goes first; {side: samples}."""
    samples: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            samples[name].append(sides[name]())
    return samples


def random_tokens(count: int, vocab: int, seed: int, device: torch.device) -> torch.Tensor:
    """(1, count) token ids drawn with a fixed seed: the same prompt for both sides."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, count), generator=generator).to(device)


# ---------------------------------------------------------------------------------------------------
# The snapshot and the two models


def hf_qwen3_config(arch: DecoderConfig) -> dict:
    """transformers' Qwen3 config.json values for an octlm Qwen3 architecture."""
    if not (arch.qk_norm and arch.rope_split):
        raise ValueError("bench model must be Qwen3-shaped (qk_norm and rope_split true)")
    return {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": arch.vocab_size,
        "max_position_embeddings": arch.context_length,
        "hidden_size": arch.d_model,
        "intermediate_size": arch.ff_dim,
        "num_hidden_layers": arch.n_layers,
        "num_attention_heads": arch.n_heads,
        "num_key_value_heads": arch.n_kv_heads,
        "head_dim": arch.dim_per_head,
        "rms_norm_eps": arch.norm_eps,
        "rope_theta": arch.rope_base,
        "tie_word_embeddings": arch.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
    }


def build_snapshot(arch: DecoderConfig, cache_dir: str | Path, seed: int = 0) -> Path:
    """A random-weight BF16 snapshot written by transformers, built once per architecture and reused.

    Written under a temporary name and renamed when complete, so an interrupted build is never used.
    """
    target = Path(cache_dir).expanduser() / f"qwen3-random-{arch.fingerprint()[:12]}"
    if (target / "config.json").is_file():
        return target
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tqdm.write(f"building a random-weight snapshot in {target} (once)")
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**hf_qwen3_config(arch))).to(torch.bfloat16)
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    model.save_pretrained(partial)
    for path in partial.iterdir():
        with open(path, "rb") as file:
            os.fsync(file.fileno())
    partial.rename(target)
    fsync_dir(target.parent)
    return target


def load_transformers(snapshot: Path, dtype: torch.dtype, device: torch.device):
    """transformers' Qwen3ForCausalLM from the snapshot, with SDPA attention, in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(snapshot, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


@dataclass
class Models:
    octlm: Decoder
    hf: Any
    device: torch.device
    seed: int

    def prompt(self, count: int) -> torch.Tensor:
        return random_tokens(count, self.octlm.config.vocab_size, self.seed, self.device)


# ---------------------------------------------------------------------------------------------------
# 1. decode


def octlm_decoder(model: Decoder, cache) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """A greedy loop through octlm's generation step: ids (1,) -> last ids, after n tokens."""

    def run(ids: torch.Tensor, count: int) -> torch.Tensor:
        for _ in range(count):
            ids = decode_one_token(model, ids, cache, GREEDY)[0]
        return ids

    return run


def hf_decoder(model, cache) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """The same greedy loop through transformers with its own DynamicCache (what generate runs)."""

    def run(ids: torch.Tensor, count: int) -> torch.Tensor:
        for _ in range(count):
            logits = model(input_ids=ids[:, None], cache=cache, use_cache=True).logits
            ids = logits[:, -1].argmax(-1)
        return ids

    return run


def ceiling_weights(model: Decoder) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """The decoder's own weight matrices, per layer in the order a token meets them, and the head."""
    layers = []
    for block in model.blocks:
        attn, ff = block.attn, block.ff
        layers.append([attn.qkv.weight, attn.o_proj.weight, ff.gate_up.weight, ff.down_proj.weight])
    head = model.embed.weight if model.lm_head is None else model.lm_head.weight
    return layers, head


def matvec_chain(
    layers: list[list[torch.Tensor]], head: torch.Tensor, x: torch.Tensor, kernels: str
) -> torch.Tensor:
    """x (1, d) through every weight matrix as bare products with one row: no attention, no norms.

    The products go through octlm's `linear` with the given kernels choice, so the ceiling uses the
    kernel the decoder uses. The rescale per layer keeps values away from denormals (slow on CPUs).
    """
    for qkv, out, gate_up, down in layers:
        x = linear(linear(x, qkv, kernels)[:, : out.shape[1]], out, kernels)
        gate, up = linear(x, gate_up, kernels).chunk(2, -1)
        x = linear(gate * up, down, kernels)
        x = x * x.square().mean().add(1e-6).rsqrt()
    return linear(x, head, kernels)


@torch.inference_mode()
def bench_decode(models: Models, settings: DecodeBench) -> list[dict]:
    """Decode tok/s at each context for octlm, transformers and the matvec ceiling."""
    from transformers import DynamicCache

    longest, count, device = max(settings.contexts), settings.new_tokens, models.device
    prompt = models.prompt(longest + 1)
    cache = models.octlm.new_cache(1, longest + count + 1)
    prefill(models.octlm, prompt[:, :longest], cache)
    hf_cache = DynamicCache(config=models.hf.config)
    models.hf(input_ids=prompt[:, :longest], cache=hf_cache, logits_to_keep=1)
    ours, theirs = octlm_decoder(models.octlm, cache), hf_decoder(models.hf, hf_cache)
    layers, head = ceiling_weights(models.octlm)
    x = models.octlm.embed.weight[:1].clone()

    def octlm_side(context: int) -> float:
        cache.truncate(context)
        return timed(device, lambda: ours(prompt[:, context], count))

    def hf_side(context: int) -> float:
        hf_cache.crop(context - hf_cache.get_seq_length())
        return timed(device, lambda: theirs(prompt[:, context], count))

    def ceiling_side(kernels: str, context: int) -> float:
        return timed(device, lambda: [matvec_chain(layers, head, x, kernels) for _ in range(count)])

    records, ceilings = [], {"ceiling": models.octlm.config.kernels, "reference ceiling": "reference"}
    for context in tqdm(sorted(settings.contexts, reverse=True), desc="decode", leave=False):
        sides = {"octlm": partial(octlm_side, context), "transformers": partial(hf_side, context)}
        sides |= {name: partial(ceiling_side, kernels, context) for name, kernels in ceilings.items()}
        interleaved(sides, 1)  # warm-up at this context
        samples = interleaved(sides, settings.repeats)
        for side, seconds in samples.items():
            rates = [count / s for s in seconds]
            records.append(record("decode", side, "tok/s", rates, context=context, new_tokens=count))
    return records


def record(bench: str, side: str, unit: str, samples: list[float], **extra) -> dict:
    """One JSONL result: which benchmark, side and unit, the raw samples and their spread."""
    return {"bench": bench, "side": side, "unit": unit, **extra, **spread(samples), "samples": samples}


# ---------------------------------------------------------------------------------------------------
# 2. prefill


@torch.inference_mode()
def bench_prefill(models: Models, settings: PrefillBench) -> list[dict]:
    """Prefill tok/s into an empty cache, last-position logits only, for both sides."""
    from transformers import DynamicCache

    device, records = models.device, []
    for length in tqdm(settings.lengths, desc="prefill", leave=False):
        prompt = models.prompt(length)

        def octlm_side(tokens: torch.Tensor = prompt) -> float:
            cache = models.octlm.new_cache(1, tokens.shape[1])
            return timed(device, lambda: prefill(models.octlm, tokens, cache))

        def hf_side(tokens: torch.Tensor = prompt) -> float:
            cache = DynamicCache(config=models.hf.config)
            return timed(device, lambda: models.hf(input_ids=tokens, cache=cache, logits_to_keep=1))

        # The warm-up runs the full length: the first pass at a new size pays for fresh memory.
        sides = {"octlm": octlm_side, "transformers": hf_side}
        interleaved(sides, 1)
        samples = interleaved(sides, settings.repeats)
        for side, seconds in samples.items():
            records.append(record("prefill", side, "tok/s", [length / s for s in seconds], tokens=length))
    return records


# ---------------------------------------------------------------------------------------------------
# 3. load (each side in a fresh process)

LOAD_CHILD = "import sys; from octlm.bench import load_child; load_child(sys.argv[1])"


def current_rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def load_child(request_json: str) -> None:
    """Child process: load the snapshot with one side's loader; print wall time and memory as JSON."""
    request = json.loads(request_json)
    torch.set_num_threads(request["threads"])
    after_torch = current_rss()
    dtype, device = torch_dtype(request["dtype"]), torch.device(request["device"])
    if request["side"] == "octlm":
        loader = load_qwen
    else:
        import transformers  # noqa: F401  (imported before the clock starts, like octlm.qwen)

        loader = load_transformers
    started = time.perf_counter()
    model = loader(Path(request["snapshot"]), dtype, device)
    sync(device)
    seconds = time.perf_counter() - started
    from octlm.qwen import peak_rss_bytes

    parameters = sum(p.numel() for p in model.parameters())  # tied weights are counted once
    print(
        json.dumps(
            {
                "seconds": seconds,
                "peak_rss": peak_rss_bytes(),
                "after_torch_rss": after_torch,
                "parameters": parameters,
            }
        )
    )


def run_load_child(side: str, snapshot: Path, dtype: str, device: str, threads: int) -> dict:
    """Load in a fresh interpreter and return its measurements; a failure shows the child's stderr."""
    request = json.dumps(
        {"side": side, "snapshot": str(snapshot), "dtype": dtype, "device": device, "threads": threads}
    )
    done = subprocess.run([sys.executable, "-c", LOAD_CHILD, request], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"load benchmark ({side}) failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_load(snapshot: Path, settings: BenchSettings) -> list[dict]:
    """Wall time and peak RSS of loading the BF16 snapshot, as multiples of float32 parameter bytes."""

    def side(name: str) -> Callable[[], dict]:
        return lambda: run_load_child(name, snapshot, settings.dtype, settings.device, settings.threads)

    runs: dict[str, list[dict]] = {"octlm": [], "transformers": []}
    names = list(runs)
    for repeat in tqdm(range(settings.load.repeats), desc="load", leave=False):
        for name in names if repeat % 2 == 0 else names[::-1]:
            runs[name].append(side(name)())
    records = []
    for name, results in runs.items():
        fp32_bytes = 4 * results[0]["parameters"]
        peaks = [r["peak_rss"] / fp32_bytes for r in results]
        above = [(r["peak_rss"] - r["after_torch_rss"]) / fp32_bytes for r in results]
        extra = {"fp32_param_bytes": fp32_bytes}
        records.append(record("load", name, "s", [r["seconds"] for r in results], figure="wall", **extra))
        records.append(record("load", name, "x fp32 params", peaks, figure="peak_rss", **extra))
        records.append(record("load", name, "x fp32 params", above, figure="peak_rss_above_torch", **extra))
    return records


# ---------------------------------------------------------------------------------------------------
# 4. cache (octlm only)


@torch.inference_mode()
def bench_cache(models: Models, settings: CacheBench) -> list[dict]:
    """Seconds per new token at each context with the KV cache and with a full forward instead."""
    model, device, records = models.octlm, models.device, []
    contexts = sorted(settings.contexts)
    prompt = models.prompt(contexts[-1] + settings.cached_steps + 1)
    cache = model.new_cache(1, contexts[-1] + settings.cached_steps + 1)
    step = octlm_decoder(model, cache)
    for context in tqdm(contexts, desc="cache", leave=False):
        prefill(model, prompt[:, cache.length : context], cache)  # grow the cache up to this context
        cached = []
        for offset in range(settings.cached_steps):
            cache.truncate(context)
            cached.append(timed(device, partial(step, prompt[:, context + offset], 1)))
        cache.truncate(context)
        forward = partial(model, prompt[:, : context + 1], last_only=True)
        full = [timed(device, forward) for _ in range(settings.uncached_repeats)]
        records.append(record("cache", "cached", "s/token", cached, context=context))
        records.append(record("cache", "uncached", "s/token", full, context=context))
    return records


# ---------------------------------------------------------------------------------------------------
# 5. chat (octlm only)


CHAT_TURN = (
    "Turn {turn}: please summarise what we have said so far, then suggest three short names for a "
    "small bakery that sells bread, cakes and coffee near a train station."
)


def chat_model(models: Models, tokenizer_dir: str) -> LoadedModel:
    """The octlm model with the real Qwen3 tokenizer and chat template (the snapshot has random weights)."""
    directory = Path(tokenizer_dir)
    if not (directory / "tokenizer.json").is_file() or not (directory / "tokenizer_config.json").is_file():
        raise ValueError(
            f"bench.chat.tokenizer_dir: {directory} lacks tokenizer.json or tokenizer_config.json "
            "(run `make fixtures`, or point it at a Qwen3 snapshot)"
        )
    tokenizer = Tokenizer.from_dir(directory)
    return LoadedModel(models.octlm, tokenizer, tokenizer.eos_ids, SamplingDefaults(), str(directory))


def first_text_seconds(session: ChatSession, text: str, device: torch.device) -> tuple[float, Iterator[str]]:
    """Seconds from sending `text` to the first piece of the streamed reply, and the rest of the stream."""
    stream = session.say(text)
    return timed(device, lambda: next(stream)), stream


@torch.inference_mode()
def bench_chat(models: Models, settings: ChatBench) -> list[dict]:
    """Time to first token per turn of one ChatSession (cache kept) and of a fresh session per turn.

    The fresh session gets the same earlier messages, so it renders the same ids and prefills all of
    them; the kept one prefills only what its cache does not already hold.
    """
    loaded, device = chat_model(models, settings.tokenizer_dir), models.device
    sampling = replace(GREEDY, max_new_tokens=settings.reply_tokens)
    kept = ChatSession(loaded, sampling, max_context=settings.max_context)
    times: dict[str, list[float]] = {"kept": [], "rebuilt": []}
    for turn in tqdm(range(1, settings.turns + 1), desc="chat", leave=False):
        text = CHAT_TURN.format(turn=turn)
        fresh = ChatSession(loaded, sampling, max_context=settings.max_context)
        fresh.messages = list(kept.messages)
        seconds, _ = first_text_seconds(fresh, text, device)  # its reply is not needed
        times["rebuilt"].append(seconds)
        seconds, rest = first_text_seconds(kept, text, device)
        times["kept"].append(seconds)
        for _ in rest:  # the reply joins the conversation and the cache
            pass
    return [record("chat", name, "s", samples, per_turn=True) for name, samples in times.items()]


# ---------------------------------------------------------------------------------------------------
# 6. train


def hf_llama_config(arch: DecoderConfig) -> dict:
    """transformers' LlamaConfig values with the shape of an octlm RoPE/RMSNorm/SwiGLU decoder."""
    return {
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.d_model,
        "intermediate_size": arch.ff_dim,
        "num_hidden_layers": arch.n_layers,
        "num_attention_heads": arch.n_heads,
        "num_key_value_heads": arch.n_kv_heads,
        "head_dim": arch.dim_per_head,
        "max_position_embeddings": arch.context_length,
        "rms_norm_eps": arch.norm_eps,
        "rope_theta": arch.rope_base,
        "tie_word_embeddings": arch.tie_embeddings,
        "attention_dropout": arch.dropout,
    }


def train_step(
    model: torch.nn.Module, optimizer, inputs: torch.Tensor, targets: torch.Tensor, logits
) -> None:
    """One AdamW step on next-token cross-entropy with the gradient clipped to norm 1, as octlm trains."""
    loss = F.cross_entropy(logits(model, inputs).flatten(0, 1), targets.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def matmul_peak(device: torch.device, dtype: torch.dtype, size: int, repeats: int = 5) -> float:
    """The best FLOP/s of a square matmul on this device: the denominator of MFU when none is given."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # warm-up
    best = min(timed(device, lambda: a @ b) for _ in range(repeats))
    return 2 * size**3 / best


def bench_train(settings: TrainBench, device: torch.device, dtype: torch.dtype, seed: int) -> list[dict]:
    """Training tok/s of the octlm model against LlamaForCausalLM of the same shape, and MFU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    arch = replace(decoder_config(settings.model.arch), context_length=settings.seq_len)
    torch.manual_seed(seed)
    ours = Decoder(arch).to(device=device, dtype=dtype).train()
    config = LlamaConfig(**hf_llama_config(arch))
    config._attn_implementation = "sdpa"
    theirs = LlamaForCausalLM(config).to(device=device, dtype=dtype).train()
    generator = torch.Generator().manual_seed(seed)
    batch = torch.randint(
        0, arch.vocab_size, (settings.batch_size, settings.seq_len + 1), generator=generator
    )
    inputs, targets = batch[:, :-1].to(device), batch[:, 1:].to(device)
    sides = {}
    for name, model, logits in (
        ("octlm", ours, lambda m, x: m(x)),
        ("transformers", theirs, lambda m, x: m(input_ids=x).logits),
    ):
        optimizer, _ = build_optimizer(model, OptimSettings(), device)
        step = partial(train_step, model, optimizer, inputs, targets, logits)
        sides[name] = partial(timed, device, step)
    interleaved(sides, 1)  # warm-up: the optimizer allocates its state on the first step
    samples = interleaved(sides, settings.steps)
    tokens = settings.batch_size * settings.seq_len
    peak = (
        settings.peak_tflops * 1e12
        if settings.peak_tflops
        else matmul_peak(device, dtype, settings.matmul_size)
    )
    per_token = flops_per_token(arch)
    records = []
    for name, seconds in samples.items():
        rates = [tokens / s for s in seconds]
        mfu = statistics.median(rates) * per_token / peak
        records.append(
            record(
                "train",
                name,
                "tok/s",
                rates,
                mfu=mfu,
                peak_flops=peak,
                flops_per_token=per_token,
                peak_measured=not settings.peak_tflops,
                batch=settings.batch_size,
                seq_len=settings.seq_len,
            )
        )
    return records


# ---------------------------------------------------------------------------------------------------
# The summary table: one row per figure, "gain" is how many times better octlm is (higher is better)


def find(records: list[dict], bench: str, side: str, **match) -> dict:
    for entry in records:
        if (
            entry["bench"] == bench
            and entry["side"] == side
            and all(entry.get(k) == v for k, v in match.items())
        ):
            return entry
    raise KeyError(f"no {bench}/{side} record with {match}")


def at_least(gain: float, target: float | None) -> tuple[str, bool | None]:
    return ("", None) if target is None else (f"gain >= {target:g}", gain >= target)


def decode_rows(records: list[dict], targets: Targets) -> list[Row]:
    rows = []
    ours_by_context = sorted(
        (r for r in records if r["bench"] == "decode" and r["side"] == "octlm"), key=lambda r: r["context"]
    )
    for ours in ours_by_context:
        context, mine = ours["context"], ours["median"]
        for side, target in (
            ("transformers", targets.decode_vs_transformers),
            ("ceiling", targets.decode_vs_ceiling),
        ):
            other = find(records, "decode", side, context=context)["median"]
            rows.append(
                Row(
                    f"decode tok/s, ctx {context}",
                    f"{mine:.2f}",
                    f"{side} {other:.2f}",
                    mine / other,
                    *at_least(mine / other, target),
                )
            )
    if ours_by_context:  # the chains do not depend on the context: show them once, at the longest
        longest = ours_by_context[-1]["context"]
        fast = find(records, "decode", "ceiling", context=longest)["median"]
        default = find(records, "decode", "reference ceiling", context=longest)["median"]
        label, gain = f"reference ceiling {default:.2f}", fast / default
        rows.append(Row("decode ceiling tok/s", f"{fast:.2f}", label, gain, *at_least(gain, None)))
    return rows


def prefill_rows(records: list[dict], targets: Targets) -> list[Row]:
    rows = []
    for ours in (r for r in records if r["bench"] == "prefill" and r["side"] == "octlm"):
        other = find(records, "prefill", "transformers", tokens=ours["tokens"])["median"]
        gain = ours["median"] / other
        rows.append(
            Row(
                f"prefill tok/s, {ours['tokens']} tokens",
                f"{ours['median']:.1f}",
                f"transformers {other:.1f}",
                gain,
                *at_least(gain, targets.prefill_vs_transformers),
            )
        )
    return rows


def load_rows(records: list[dict], targets: Targets) -> list[Row]:
    if not any(r["bench"] == "load" for r in records):
        return []
    wall = [find(records, "load", side, figure="wall")["median"] for side in ("octlm", "transformers")]
    rows = [
        Row(
            "load wall s",
            f"{wall[0]:.2f}",
            f"transformers {wall[1]:.2f}",
            wall[1] / wall[0],
            *at_least(wall[1] / wall[0], targets.load_wall_vs_transformers),
        )
    ]
    limit = targets.load_peak_x_fp32_params
    for figure, label, target in (
        ("peak_rss", "load peak RSS / fp32 params", (f"octlm <= {limit:g}", None)),
        ("peak_rss_above_torch", "load peak RSS above torch / fp32 params", ("", None)),
    ):
        mine, other = (
            find(records, "load", side, figure=figure)["median"] for side in ("octlm", "transformers")
        )
        met = mine <= limit if target[0] else None
        rows.append(Row(label, f"{mine:.2f}", f"transformers {other:.2f}", other / mine, target[0], met))
    return rows


def cache_rows(records: list[dict], targets: Targets) -> list[Row]:
    rows = []
    cached_rows = [r for r in records if r["bench"] == "cache" and r["side"] == "cached"]
    longest = max((r["context"] for r in cached_rows), default=None)
    for cached in cached_rows:
        context = cached["context"]
        full = find(records, "cache", "uncached", context=context)["median"]
        gain = full / cached["median"]
        rows.append(
            Row(
                f"ms/token with cache, ctx {context}",
                f"{1000 * cached['median']:.1f}",
                f"no cache {1000 * full:.1f}",
                gain,
                *at_least(gain, targets.cache_at_longest if context == longest else None),
            )
        )
    return rows


def chat_rows(records: list[dict], targets: Targets) -> list[Row]:
    if not any(r["bench"] == "chat" for r in records):
        return []
    kept, rebuilt = find(records, "chat", "kept")["samples"], find(records, "chat", "rebuilt")["samples"]
    rows = []
    for turn in sorted({1, len(kept)}):
        gain = rebuilt[turn - 1] / kept[turn - 1]
        target = targets.chat_at_last_turn if turn == len(kept) else None
        rows.append(
            Row(
                f"chat TTFT ms, turn {turn}",
                f"{1000 * kept[turn - 1]:.0f} kept",
                f"rebuilt {1000 * rebuilt[turn - 1]:.0f}",
                gain,
                *at_least(gain, target),
            )
        )
    return rows


def train_rows(records: list[dict], targets: Targets) -> list[Row]:
    if not any(r["bench"] == "train" for r in records):
        return []
    ours, theirs = find(records, "train", "octlm"), find(records, "train", "transformers")
    gain = ours["median"] / theirs["median"]
    return [
        Row(
            "train tok/s",
            f"{ours['median']:.0f}",
            f"transformers {theirs['median']:.0f}",
            gain,
            *at_least(gain, targets.train_vs_transformers),
        ),
        Row(
            "train MFU",
            f"{100 * ours['mfu']:.1f}%",
            f"transformers {100 * theirs['mfu']:.1f}%",
            ours["mfu"] / theirs["mfu"],
            "",
            None,
        ),
    ]


def summary_rows(records: list[dict], targets: Targets | None = None) -> list[Row]:
    """The table's rows, in benchmark order, each judged against `targets`."""
    targets = targets or Targets()
    builders = (decode_rows, prefill_rows, load_rows, cache_rows, chat_rows, train_rows)
    return [row for build in builders for row in build(records, targets)]


def format_table(rows: list[Row]) -> str:
    """A fixed-width table: figure, octlm, reference, gain, target and whether it is met."""
    header = ("figure", "octlm", "reference", "gain", "target", "met")
    cells = [header] + [
        (
            r.figure,
            r.octlm,
            r.reference,
            f"{r.ratio:.2f}x",
            r.target,
            {True: "yes", False: "NO", None: ""}[r.met],
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in cells
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Results: machine description, JSONL, plots, wandb


def machine_info(settings: BenchSettings, device: torch.device) -> dict:
    """What the numbers were measured on, stored with every result."""
    import transformers

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True)
    return {
        "machine": platform.node(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "dtype": settings.dtype,
        "threads": settings.threads,
        "git_commit": commit.stdout.strip() or None,
        "git_dirty": bool(dirty.stdout.strip()),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_jsonl(path: Path, records: list[dict], machine: dict) -> None:
    lines = "".join(json.dumps(machine | entry) + "\n" for entry in records)
    atomic_write(path, lines)


def plot(path: Path, records: list[dict], title: str) -> None:
    """One PNG, a panel per benchmark that ran: medians with min-max error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [bench for bench in BENCHMARKS if any(r["bench"] == bench for r in records)]
    columns = min(3, len(panels))
    rows = -(-len(panels) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.6 * rows), squeeze=False)
    for axis in axes.flat[len(panels) :]:
        axis.set_visible(False)
    for axis, bench in zip(axes.flat, panels, strict=False):
        PANELS[bench](axis, [r for r in records if r["bench"] == bench])
        axis.set_title(bench)
        axis.grid(alpha=0.3)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    with atomic_writer(path) as file:
        figure.savefig(file, dpi=110, format="png")
    plt.close(figure)


def _lines(axis, records: list[dict], key: str, ylabel: str, scale: float = 1.0) -> None:
    for side in dict.fromkeys(r["side"] for r in records):
        rows = sorted((r for r in records if r["side"] == side), key=lambda r: r[key])
        xs, ys = [r[key] for r in rows], [scale * r["median"] for r in rows]
        low = [y - scale * r["min"] for y, r in zip(ys, rows, strict=True)]
        high = [scale * r["max"] - y for y, r in zip(ys, rows, strict=True)]
        axis.errorbar(xs, ys, yerr=[low, high], marker="o", capsize=3, label=side)
    axis.set_xlabel(key)
    axis.set_ylabel(ylabel)
    axis.legend(fontsize=8)


def _bars(axis, records: list[dict], label: Callable[[dict], str], ylabel: str) -> None:
    names = [label(r) for r in records]
    medians = [r["median"] for r in records]
    errors = [[r["median"] - r["min"] for r in records], [r["max"] - r["median"] for r in records]]
    axis.bar(
        names,
        medians,
        yerr=errors,
        capsize=3,
        color=["C0" if r["side"] == "octlm" else "C1" for r in records],
    )
    axis.set_ylabel(ylabel)
    axis.tick_params(axis="x", labelsize=7, rotation=30)


def _chat(axis, records: list[dict]) -> None:
    for entry in records:
        samples = entry["samples"]
        axis.plot(range(1, len(samples) + 1), [1000 * s for s in samples], marker="o", label=entry["side"])
    axis.set_xlabel("turn")
    axis.set_ylabel("time to first token, ms")
    axis.legend(fontsize=8)


def _cache(axis, records: list[dict]) -> None:
    _lines(axis, records, "context", "ms per new token", scale=1000.0)
    axis.set_yscale("log")


def _load(axis, records: list[dict]) -> None:
    peaks = [r for r in records if r["figure"] == "peak_rss"]
    _bars(axis, peaks, lambda r: r["side"], "peak RSS / fp32 parameter bytes")
    for bar, entry in zip(axis.patches, peaks, strict=True):
        wall = find(records, "load", entry["side"], figure="wall")["median"]
        axis.annotate(
            f"{wall:.1f} s", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom"
        )


PANELS = {
    "decode": lambda axis, records: _lines(axis, records, "context", "decode tok/s"),
    "prefill": lambda axis, records: _lines(axis, records, "tokens", "prefill tok/s"),
    "load": _load,
    "cache": _cache,
    "chat": _chat,
    "train": lambda axis, records: _bars(axis, records, lambda r: r["side"], "train tok/s"),
}


def log_wandb(
    settings: BenchSettings, records: list[dict], machine: dict, rows: list[Row], png: Path
) -> None:
    """Send the results to wandb: online with WANDB_API_KEY (mode auto), else offline; skip when disabled."""
    mode = settings.wandb_mode
    if mode == "auto":
        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    if mode == "disabled":
        return
    import wandb

    run = wandb.init(
        project=settings.wandb_project, mode=mode, config=machine, dir=settings.out_dir, job_type="bench"
    )
    table = wandb.Table(
        columns=["figure", "octlm", "reference", "gain", "target", "met"],
        data=[[r.figure, r.octlm, r.reference, r.ratio, r.target, r.met] for r in rows],
    )
    run.log({"summary": table, "plot": wandb.Image(str(png))})
    for entry in records:
        key = "/".join(str(entry[k]) for k in ("bench", "side", "figure", "context", "tokens") if k in entry)
        run.summary[key] = entry["median"]
    run.finish()


# ---------------------------------------------------------------------------------------------------
# The suite


def check_settings(settings: BenchSettings, arch: DecoderConfig) -> None:
    """Raise ValueError naming the first bad setting, before any model is built."""
    unknown = [name for name in settings.benchmarks if name not in BENCHMARKS]
    if unknown or not settings.benchmarks:
        raise ValueError(
            f"bench.benchmarks: unknown or empty {unknown or settings.benchmarks}; choose from {BENCHMARKS}"
        )
    torch_dtype(settings.dtype)
    positive = {
        "threads": settings.threads,
        "decode.new_tokens": settings.decode.new_tokens,
        "decode.repeats": settings.decode.repeats,
        "prefill.repeats": settings.prefill.repeats,
        "load.repeats": settings.load.repeats,
        "cache.cached_steps": settings.cache.cached_steps,
        "cache.uncached_repeats": settings.cache.uncached_repeats,
        "chat.turns": settings.chat.turns,
        "chat.reply_tokens": settings.chat.reply_tokens,
        "chat.max_context": settings.chat.max_context,
        "train.batch_size": settings.train.batch_size,
        "train.seq_len": settings.train.seq_len,
        "train.steps": settings.train.steps,
    }
    positive |= {f"decode.contexts[{i}]": c for i, c in enumerate(settings.decode.contexts)}
    positive |= {f"prefill.lengths[{i}]": n for i, n in enumerate(settings.prefill.lengths)}
    positive |= {f"cache.contexts[{i}]": c for i, c in enumerate(settings.cache.contexts)}
    for name, value in positive.items():
        if value <= 0:
            raise ValueError(f"bench.{name} must be positive, got {value}")
    longest = {
        "decode.contexts": max(settings.decode.contexts) + settings.decode.new_tokens + 1,
        "prefill.lengths": max(settings.prefill.lengths),
        "cache.contexts": max(settings.cache.contexts) + settings.cache.cached_steps + 1,
        "chat.max_context": settings.chat.max_context,
    }
    for name, needed in longest.items():
        if needed > arch.context_length:
            raise ValueError(
                f"bench.{name} needs {needed} positions; the model's context is {arch.context_length}"
            )


def run_benchmarks(settings: BenchSettings, device: torch.device, arch: DecoderConfig) -> list[dict]:
    """Every selected benchmark's records; the models are loaded once and shared."""
    chosen, records = set(settings.benchmarks), []
    dtype = torch_dtype(settings.dtype)
    snapshot = None
    if chosen - {"train"}:
        snapshot = build_snapshot(arch, settings.snapshot_cache, settings.seed)
    if "load" in chosen:  # first: the children then have the machine's memory to themselves
        records += bench_load(snapshot, settings)
    inference = [name for name in ("decode", "prefill", "cache", "chat") if name in chosen]
    if inference:
        hf = load_transformers(snapshot, dtype, device) if chosen & {"decode", "prefill"} else None
        models = Models(load_qwen(snapshot, dtype, device, arch=arch), hf, device, settings.seed)
        runners = {"decode": bench_decode, "prefill": bench_prefill, "cache": bench_cache, "chat": bench_chat}
        for name in inference:
            records += runners[name](models, getattr(settings, name))
        del models
    if "train" in chosen:
        records += bench_train(settings.train, device, dtype, settings.seed)
    return records


def run(settings: BenchSettings) -> tuple[list[dict], list[Row], Path]:
    """Run the suite; write JSONL and a PNG to out_dir; return (records, summary rows, output stem)."""
    arch = decoder_config(settings.model.arch)
    check_settings(settings, arch)
    torch.set_num_threads(settings.threads)
    device = torch.device(settings.device)
    machine = machine_info(settings, device)
    records = run_benchmarks(settings, device, arch)
    rows = summary_rows(records, settings.targets)
    stem = Path(settings.out_dir) / f"bench-{device.type}-{settings.dtype}"
    write_jsonl(stem.with_suffix(".jsonl"), records, machine)
    title = f"{settings.model.name}, {machine['device']}, {settings.dtype}, {settings.threads} threads"
    plot(stem.with_suffix(".png"), records, title)
    log_wandb(settings, records, machine, rows, stem.with_suffix(".png"))
    return records, rows, stem
