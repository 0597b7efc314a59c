"""Training: AdamW with warmup + cosine, mixed precision, DDP, exact resume and logging.

One optimizer step consumes one global batch of `batch_size` sequences, drawn by a single seeded
generator that every rank advances identically; rank r takes its slice of it, in micro-batches of
`micro_batch_size`. A run on one process with gradient accumulation and a run on W processes with
the same `batch_size` therefore see the same sequences in the same optimizer steps.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import math
import os
import random
import signal
import time
import uuid
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from omegaconf import OmegaConf
from tqdm import tqdm

from octlm import checkpoint as ckpt
from octlm.config import DecoderConfig, ModelSpec, decoder_config
from octlm.data import DataSpec, iter_eval_batches, load_manifest, load_tokenizer, open_split, sample_batch
from octlm.generation import GenerationError, SamplingConfig, complete, generate, pick_dtype
from octlm.model import Decoder

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OPTIMIZER_IMPLEMENTATIONS = ("auto", "fused", "foreach", "for_loop")
WANDB_MODES = ("auto", "online", "offline", "disabled")


@dataclass
class OptimSettings:
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_steps: int = 500
    weight_decay: float = 0.1  # matrices only (dim >= 2); norms get none
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm; 0 turns clipping off
    implementation: str = "auto"  # auto: fused on CUDA, foreach elsewhere


@dataclass
class EvalSettings:
    every: int = 1000  # steps between evaluations (also at the last step); 0: never
    batches: int | None = 40  # validation batches per evaluation; None: the whole split
    batch_size: int | None = None  # None: micro_batch_size
    prompts: list[str] = field(
        default_factory=lambda: ["Once upon a time", "Lily and Ben went to the park.", "The little dog"]
    )
    max_new_tokens: int = 96
    temperature: float = 0.8  # 0: greedy
    top_k: int = 40  # 0: every token
    sample_seed: int = 0  # sampling at evaluations uses its own generator, never the training RNG


@dataclass
class CheckpointSettings:
    every: int = 1000  # steps between checkpoints (one is also written at the end and on SIGTERM)
    keep: int = 3  # newest step directories kept


@dataclass
class LogSettings:
    every: int = 10  # steps between log records
    wandb_mode: str = "auto"  # auto: online when WANDB_API_KEY is set, else offline
    wandb_project: str = "octlm"
    wandb_entity: str | None = None
    peak_tflops: float | None = None  # per device, for MFU; None: look the device up below
    known_peak_tflops: dict[str, float] = field(
        default_factory=lambda: {"T4": 65.0, "A100": 312.0, "L4": 121.0, "H100": 989.0}
    )


@dataclass
class TrainSettings:
    """Primary config of scripts/train.py."""

    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    run_name: str = "tinystories"
    runs_dir: str = "runs"
    resume: bool = False  # continue from the newest checkpoint of runs_dir/run_name that verifies
    seed: int = 1337
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto: bfloat16 on CUDA that has it, float16 on CUDA without, float32 on CPU
    batch_size: int = 32  # sequences per optimizer step, all ranks together
    micro_batch_size: int = 32  # sequences per forward pass on one rank (accumulation fills the rest)
    max_steps: int = 24000  # length of the schedule
    stop_at: int | None = None  # stop (with a checkpoint) at this step; the schedule still ends at max_steps
    time_budget_s: float | None = None  # checkpoint and stop before this many seconds (Kaggle limit)
    optim: OptimSettings = field(default_factory=OptimSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    log: LogSettings = field(default_factory=LogSettings)


# ---------------------------------------------------------------------------------------------------
# Devices, precision, processes


@dataclass
class Distributed:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


def resolve_device(name: str, local_rank: int) -> torch.device:
    """auto -> this rank's CUDA device when there is one, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device=cuda but torch sees no CUDA device")
        return torch.device("cuda", local_rank)
    if name != "cpu":
        raise ValueError(f"device must be auto, cpu or cuda, got {name!r}")
    return torch.device("cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The autocast dtype: auto picks bf16 on CUDA that supports it, fp16 on other CUDA (T4), fp32 on CPU."""
    if name == "auto":
        return pick_dtype("auto", device)
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def init_distributed(device_name: str) -> tuple[Distributed, torch.device]:
    """Join the torchrun process group when WORLD_SIZE > 1 (nccl on CUDA, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dist = Distributed(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")))
    device = resolve_device(device_name, dist.local_rank)
    if dist.active and not torch_dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch_dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist, device


def all_reduce(values: list[float], device: torch.device, dist: Distributed, op=None) -> list[float]:
    """Sum (or `op`) a few floats over ranks; the identity on one process."""
    if not dist.active:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    torch_dist.all_reduce(tensor, op=op or torch_dist.ReduceOp.SUM)
    return tensor.tolist()


# ---------------------------------------------------------------------------------------------------
# Optimizer and schedule


def learning_rate(step: int, optim: OptimSettings, max_steps: int) -> float:
    """Linear warmup to lr over warmup_steps, then cosine decay to min_lr at max_steps."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    progress = min(1.0, (step - optim.warmup_steps) / max(1, max_steps - optim.warmup_steps))
    return optim.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (optim.lr - optim.min_lr)


def build_optimizer(model: torch.nn.Module, optim: OptimSettings, device: torch.device):
    """AdamW with weight decay on matrices (dim >= 2) only; returns (optimizer, parameter names).

    The names list the parameters in the optimizer's own index order, which is how checkpoints
    store optimizer state.
    """
    if optim.implementation not in OPTIMIZER_IMPLEMENTATIONS:
        raise ValueError(f"optim.implementation must be one of {OPTIMIZER_IMPLEMENTATIONS}")
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    decay = [(name, p) for name, p in named if p.dim() >= 2]
    no_decay = [(name, p) for name, p in named if p.dim() < 2]
    groups = [
        {"params": [p for _, p in decay], "weight_decay": optim.weight_decay},
        {"params": [p for _, p in no_decay], "weight_decay": 0.0},
    ]
    kind = optim.implementation
    if kind == "auto":
        kind = "fused" if device.type == "cuda" else "foreach"
    optimizer = torch.optim.AdamW(
        groups,
        lr=optim.lr,
        betas=(optim.beta1, optim.beta2),
        eps=optim.eps,
        fused=True if kind == "fused" else None,
        foreach={"foreach": True, "for_loop": False}.get(kind),
    )
    return optimizer, [name for name, _ in decay + no_decay]


# ---------------------------------------------------------------------------------------------------
# The run: everything a training step and a checkpoint touch


@dataclass
class Run:
    settings: TrainSettings
    arch: DecoderConfig
    dist: Distributed
    device: torch.device
    dtype: torch.dtype
    model: Decoder
    engine: torch.nn.Module  # the model, or its DDP wrapper
    optimizer: torch.optim.Optimizer
    param_names: list[str]
    scaler: torch.amp.GradScaler
    batch_generator: torch.Generator
    train_tokens: np.ndarray
    valid_tokens: np.ndarray
    manifest: dict
    tokenizer: Any
    data_dir: Path
    run_dir: Path
    step: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0
    wandb_id: str | None = None

    @property
    def accumulation(self) -> int:
        return self.settings.batch_size // (self.settings.micro_batch_size * self.dist.world)

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    def autocast(self):
        enabled = self.dtype != torch.float32
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=enabled)


def check_settings(settings: TrainSettings, world: int) -> None:
    """Raise before any work when the batch arithmetic or a choice cannot work."""
    per_step = settings.micro_batch_size * world
    if settings.micro_batch_size < 1 or settings.batch_size % per_step:
        raise ValueError(
            f"batch_size={settings.batch_size} must be a multiple of micro_batch_size "
            f"({settings.micro_batch_size}) x processes ({world})"
        )
    if settings.max_steps < 1:
        raise ValueError(f"max_steps must be positive, got {settings.max_steps}")
    if settings.log.wandb_mode not in WANDB_MODES:
        raise ValueError(f"log.wandb_mode must be one of {WANDB_MODES}, got {settings.log.wandb_mode!r}")


def data_identity(manifest: dict) -> str:
    """SHA-256 over the hashes of the prepared token files: what a resumed run must train on."""
    splits = {name: entry["sha256"] for name, entry in sorted(manifest["splits"].items())}
    return hashlib.sha256(json.dumps(splits, sort_keys=True).encode()).hexdigest()


def load_data(data_dir: Path, arch: DecoderConfig) -> tuple[dict, Any, np.ndarray, np.ndarray]:
    """Manifest, tokenizer and both token splits, after checking they fit the model."""
    manifest = load_manifest(data_dir)
    tokenizer = load_tokenizer(data_dir)
    if manifest["vocab_size"] != arch.vocab_size:
        raise ValueError(
            f"tokenizer vocabulary of {manifest['vocab_size']:,} ({data_dir / 'tokenizer.json'}) does not "
            f"match model.arch.vocab_size={arch.vocab_size:,}"
        )
    train = open_split(data_dir, "train", verify=True)
    valid = open_split(data_dir, "validation", verify=True)
    for split, tokens in (("train", train), ("validation", valid)):
        if len(tokens) <= arch.context_length:
            raise ValueError(
                f"{data_dir}: the {split} split holds {len(tokens):,} tokens, fewer than one window of "
                f"context {arch.context_length} + 1"
            )
    return manifest, tokenizer, train, valid


def build_run(settings: TrainSettings) -> Run:
    """Processes, data, model, optimizer and scaler for a fresh run (resume is applied afterwards)."""
    dist, device = init_distributed(settings.device)
    check_settings(settings, dist.world)
    arch = decoder_config(settings.model.arch)
    data_dir = Path(settings.data.out_dir)
    manifest, tokenizer, train_tokens, valid_tokens = load_data(data_dir, arch)
    dtype = resolve_dtype(settings.dtype, device)
    torch.manual_seed(settings.seed)  # the same initial weights on every rank
    model = Decoder(arch).to(device)
    engine = model
    if dist.active:
        ids = [device.index] if device.type == "cuda" else None
        engine = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    torch.manual_seed(settings.seed + 1 + dist.rank)  # dropout differs per rank, reproducibly
    optimizer, names = build_optimizer(model, settings.optim, device)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    return Run(
        settings=settings,
        arch=arch,
        dist=dist,
        device=device,
        dtype=dtype,
        model=model,
        engine=engine,
        optimizer=optimizer,
        param_names=names,
        scaler=scaler,
        batch_generator=torch.Generator().manual_seed(settings.seed),
        train_tokens=train_tokens,
        valid_tokens=valid_tokens,
        manifest=manifest,
        tokenizer=tokenizer,
        data_dir=data_dir,
        run_dir=Path(settings.runs_dir) / settings.run_name,
    )


# ---------------------------------------------------------------------------------------------------
# One optimizer step


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    skipped: bool


def rank_micro_batches(run: Run) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Draw the global batch (B, T) and return this rank's micro-batches, each (micro, T)."""
    settings = run.settings
    inputs, targets = sample_batch(
        run.train_tokens, settings.batch_size, run.arch.context_length, run.batch_generator
    )
    micro = settings.micro_batch_size
    first = run.dist.rank * run.accumulation
    return [
        (inputs[i * micro : (i + 1) * micro], targets[i * micro : (i + 1) * micro])
        for i in range(first, first + run.accumulation)
    ]


def lm_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats; logits (B, T, V) are float32."""
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def train_step(run: Run, batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> StepResult:
    """Accumulate gradients over the micro-batches, clip, step; an fp16 overflow skips the step."""
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    total = torch.zeros((), device=run.device)
    for index, (inputs, targets) in enumerate(batches):
        last = index == len(batches) - 1
        sync = nullcontext() if last or not run.dist.active else run.engine.no_sync()
        with sync:
            with run.autocast():
                loss = lm_loss(run.engine, inputs.to(run.device), targets.to(run.device)) / len(batches)
            run.scaler.scale(loss).backward()
        total += loss.detach()
    run.scaler.unscale_(run.optimizer)
    clip = run.settings.optim.grad_clip if run.settings.optim.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), clip)
    scale_before = run.scaler.get_scale()
    run.scaler.step(run.optimizer)
    run.scaler.update()
    skipped = run.scaler.is_enabled() and run.scaler.get_scale() < scale_before
    run.optimizer.zero_grad(set_to_none=True)
    return StepResult(total.item(), grad_norm.item(), skipped)


# ---------------------------------------------------------------------------------------------------
# Evaluation during training


@torch.no_grad()
def validation_loss(
    model: torch.nn.Module,
    tokens: np.ndarray,
    context: int,
    batch_size: int,
    max_batches: int | None,
    autocast=nullcontext,
    dist: Distributed | None = None,
) -> tuple[float, int]:
    """Mean next-token loss (nats) over up to max_batches consecutive validation windows, and the
    number of target tokens it covers; batches are shared out over ranks and the sums reduced."""
    dist = dist or Distributed()
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    nats, count = 0.0, 0
    for index, (inputs, targets) in enumerate(iter_eval_batches(tokens, batch_size, context)):
        if max_batches is not None and index >= max_batches:
            break
        if index % dist.world != dist.rank:
            continue
        with autocast():
            logits = model(inputs.to(device))
        nats += F.cross_entropy(logits.flatten(0, 1), targets.to(device).flatten(), reduction="sum").item()
        count += targets.numel()
    model.train(was_training)
    nats, count = all_reduce([nats, float(count)], device, dist)
    return nats / count, int(count)


def bits_per_byte(loss_nats: float, tokens: int, text_bytes: int) -> float:
    """Tokenizer-independent loss: nats per token times tokens per byte, in bits."""
    return loss_nats * tokens / (text_bytes * math.log(2))


def sample_stories(
    model: Decoder, tokenizer, prompts: list[str], eval_settings: EvalSettings, stop_id: int
) -> list[list[str]]:
    """[prompt, continuation] pairs, one batch through octlm.generation with the evaluation's own seed."""
    sampling = SamplingConfig(
        temperature=eval_settings.temperature,
        top_k=eval_settings.top_k,
        top_p=1.0,
        seed=eval_settings.sample_seed,
        max_new_tokens=eval_settings.max_new_tokens,
        overflow="truncate_left",
    )
    ids = [tokenizer.encode(prompt).ids for prompt in prompts]
    done = complete(generate(model, ids, sampling, [stop_id]), len(prompts))
    return [
        [prompt, tokenizer.decode([t for t in result.tokens if t != stop_id])]
        for prompt, result in zip(prompts, done, strict=True)
    ]


def evaluate(run: Run) -> dict:
    """Validation loss and bits per byte (all ranks), plus sample stories (rank 0 only)."""
    settings = run.settings.eval
    batch_size = settings.batch_size or run.settings.micro_batch_size
    loss, _ = validation_loss(
        run.model,
        run.valid_tokens,
        run.arch.context_length,
        batch_size,
        settings.batches,
        run.autocast,
        run.dist,
    )
    split = run.manifest["splits"]["validation"]
    record = {
        "step": run.step,
        "val_loss": loss,
        "val_bpb": bits_per_byte(loss, split["tokens"], split["bytes"]),
    }
    if run.dist.main and settings.prompts:
        run.model.eval()
        try:
            with run.autocast():
                record["samples"] = sample_stories(
                    run.model, run.tokenizer, settings.prompts, settings, run.manifest["eot_id"]
                )
        except GenerationError as error:  # e.g. non-finite logits: report it, keep training
            log.warning("step %d: sampling failed: %s", run.step, error)
        run.model.train()
    return record


# ---------------------------------------------------------------------------------------------------
# Checkpoints: what a run's state is, and how it comes back


def _encode_bytes(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode()


def _decode_bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rank_rng_state(device: torch.device) -> dict:
    """This process's torch CPU RNG state (and CUDA's on CUDA), as base64 bytes."""
    state = {"torch": _encode_bytes(torch.get_rng_state())}
    if device.type == "cuda":
        state["cuda"] = _encode_bytes(torch.cuda.get_rng_state(device))
    return state


def gather_rng_states(run: Run) -> list[dict]:
    """Every rank's RNG states, collected on all ranks (fixed-size byte tensors, no pickling)."""
    mine = rank_rng_state(run.device)
    if not run.dist.active:
        return [mine]
    raw = {key: _decode_bytes(value).to(run.device) for key, value in sorted(mine.items())}
    gathered = []
    for key, tensor in raw.items():
        parts = [torch.empty_like(tensor) for _ in range(run.dist.world)]
        torch_dist.all_gather(parts, tensor)
        gathered.append((key, parts))
    return [{key: _encode_bytes(parts[r]) for key, parts in gathered} for r in range(run.dist.world)]


def run_state(run: Run) -> dict:
    """Everything but tensors that a resumed run needs, as JSON-ready values."""
    optimizer_state = run.optimizer.state_dict()
    return {
        "step": run.step,
        "tokens_seen": run.tokens_seen,
        "skipped_steps": run.skipped_steps,
        "fingerprint": run.arch.fingerprint(),
        "config": asdict(run.arch),
        "tokenizer_sha256": run.manifest["tokenizer_sha256"],
        "data_sha256": data_identity(run.manifest),
        "scaler": run.scaler.state_dict(),
        "param_names": run.param_names,
        "param_groups": optimizer_state["param_groups"],
        "rng": {
            "ranks": gather_rng_states(run),
            "batch_generator": _encode_bytes(run.batch_generator.get_state()),
            "python": _python_rng_state(),
            "numpy": _numpy_rng_state(),
        },
        "wandb_id": run.wandb_id,
        "settings": settings_dict(run.settings),
    }


def settings_dict(settings: TrainSettings) -> dict:
    """The settings as plain JSON-ready containers."""
    return OmegaConf.to_container(OmegaConf.structured(settings), resolve=True)


def _python_rng_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _numpy_rng_state() -> list:
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return [name, keys.tolist(), pos, has_gauss, gauss]


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Optimizer state tensors named state.{index}.{key} (index: the optimizer's parameter order)."""
    return {
        f"state.{index}.{key}": value.detach().cpu() if value.dim() else value.detach().cpu().reshape(())
        for index, entry in optimizer.state_dict()["state"].items()
        for key, value in entry.items()
    }


def save_run(run: Run) -> Path | None:
    """Write a checkpoint of the current step from rank 0; every rank takes part and learns the result."""
    state = run_state(run)  # collective: all ranks gather RNG states
    path, error = None, None
    if run.dist.main:
        try:
            path = ckpt.save_checkpoint(
                run.checkpoint_dir,
                run.step,
                tensors={
                    "model.safetensors": run.model.state_dict(),
                    "optimizer.safetensors": optimizer_tensors(run.optimizer),
                },
                json_files={"state.json": state},
                copies={"tokenizer.json": run.data_dir / "tokenizer.json"},
                keep=run.settings.checkpoint.keep,
            )
        except ckpt.CheckpointError as caught:
            error = caught
    failed = all_reduce([1.0 if error else 0.0], run.device, run.dist)[0]
    if error:
        raise error
    if failed:
        raise ckpt.CheckpointError("rank 0 failed to write a checkpoint")
    return path


def check_compatible(state: dict, run: Run, where: Path) -> None:
    """Raise CheckpointMismatch naming the model config, tokenizer or data that differs."""
    if state["fingerprint"] != run.arch.fingerprint():
        saved = DecoderConfig(**state["config"]).canonical()
        current = run.arch.canonical()
        fields = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
        raise ckpt.CheckpointMismatch(
            f"{where}: model config differs from this run's (fields {fields}; fingerprint "
            f"{state['fingerprint'][:12]} vs {run.arch.fingerprint()[:12]})"
        )
    if state["tokenizer_sha256"] != run.manifest["tokenizer_sha256"]:
        raise ckpt.CheckpointMismatch(
            f"{where}: tokenizer differs (sha256 {state['tokenizer_sha256'][:12]} in the checkpoint, "
            f"{run.manifest['tokenizer_sha256'][:12]} in {run.data_dir})"
        )
    if state["data_sha256"] != data_identity(run.manifest):
        raise ckpt.CheckpointMismatch(
            f"{where}: training data differs (token-file hash {state['data_sha256'][:12]} in the "
            f"checkpoint, {data_identity(run.manifest)[:12]} in {run.data_dir})"
        )


def restore_run(run: Run, checkpoint: ckpt.Checkpoint) -> None:
    """Load weights, optimizer, scaler, counters and every RNG state from a verified checkpoint."""
    state = checkpoint.json("state.json")
    check_compatible(state, run, checkpoint.path)
    if state["param_names"] != run.param_names:
        raise ckpt.CheckpointMismatch(f"{checkpoint.path}: optimizer parameter order differs")
    run.model.load_state_dict(checkpoint.tensors("model.safetensors"), strict=True)
    run.optimizer.load_state_dict(_optimizer_state_dict(checkpoint.tensors("optimizer.safetensors"), state))
    if run.scaler.is_enabled() and state["scaler"]:
        run.scaler.load_state_dict(state["scaler"])
    restore_rng(state["rng"], run)
    run.step, run.tokens_seen = state["step"], state["tokens_seen"]
    run.skipped_steps, run.wandb_id = state["skipped_steps"], state["wandb_id"]


def _optimizer_state_dict(tensors: dict[str, torch.Tensor], state: dict) -> dict:
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        _, index, key = name.split(".", 2)
        per_param.setdefault(int(index), {})[key] = tensor
    groups = [dict(group, betas=tuple(group["betas"])) for group in state["param_groups"]]
    return {"state": per_param, "param_groups": groups}


def restore_rng(rng: dict, run: Run) -> None:
    """Put back the batch generator, python/numpy and this rank's torch (and CUDA) RNG states."""
    run.batch_generator.set_state(_decode_bytes(rng["batch_generator"]))
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, gauss = rng["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    ranks = rng["ranks"]
    if run.dist.rank >= len(ranks):
        log.warning("checkpoint has RNG states of %d ranks; rank %d reseeds", len(ranks), run.dist.rank)
        torch.manual_seed(run.settings.seed + 1 + run.dist.rank + run.step)
        return
    torch.set_rng_state(_decode_bytes(ranks[run.dist.rank]["torch"]))
    if run.device.type == "cuda" and "cuda" in ranks[run.dist.rank]:
        torch.cuda.set_rng_state(_decode_bytes(ranks[run.dist.rank]["cuda"]), run.device)


def maybe_resume(run: Run) -> None:
    """With resume=true, continue from the newest checkpoint that verifies (older ones as fallback)."""
    if run.dist.main:
        ckpt.clean_temporaries(run.checkpoint_dir)
    if not run.settings.resume:
        return
    found = ckpt.latest_checkpoint(run.checkpoint_dir)
    if found is None:
        _say(run, f"resume: no checkpoint under {run.checkpoint_dir}, starting at step 0")
        return
    restore_run(run, found)
    _say(run, f"resumed from {found.path} (step {run.step})")


# ---------------------------------------------------------------------------------------------------
# Logging


def flops_per_token(arch: DecoderConfig) -> float:
    """Training FLOPs per token: 6 N for the matmuls plus 12 L H d_head T for attention scores."""
    attention = 12 * arch.n_layers * arch.n_heads * arch.dim_per_head * arch.context_length
    return 6 * arch.num_parameters() + attention


def peak_flops(settings: LogSettings, device: torch.device) -> float | None:
    """Assumed peak FLOP/s of one device: the configured figure, else a known GPU's, else None."""
    if settings.peak_tflops is not None:
        return settings.peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in settings.known_peak_tflops.items():
        if key in name:
            return tflops * 1e12
    return None


class Logger:
    """Rank 0's metrics: a JSONL file in the run directory, wandb, and the progress bar's postfix."""

    def __init__(self, run: Run) -> None:
        self.enabled = run.dist.main
        self.wandb = None
        if not self.enabled:
            return
        run.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run.run_dir / "metrics.jsonl"
        self.wandb = _start_wandb(run)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as file:
            file.write(json.dumps({k: v for k, v in record.items() if k != "samples"}) + "\n")
        if self.wandb is not None:
            self.wandb.log(_wandb_record(record), step=record["step"])

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def _start_wandb(run: Run):
    """A wandb run: online with WANDB_API_KEY (mode auto), otherwise offline; None when disabled."""
    settings = run.settings.log
    mode = settings.wandb_mode
    if mode == "auto":
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    if mode == "disabled":
        return None
    import wandb  # slow to import; only when it is used

    run.wandb_id = run.wandb_id or uuid.uuid4().hex[:12]  # kept in checkpoints: a resume continues it
    return wandb.init(
        project=settings.wandb_project,
        entity=settings.wandb_entity,
        name=run.settings.run_name,
        id=run.wandb_id,
        resume="allow",
        mode=mode,
        dir=str(run.run_dir),
        config=settings_dict(run.settings),
    )


def _wandb_record(record: dict) -> dict:
    out = {k: v for k, v in record.items() if k not in ("step", "samples") and v is not None}
    if "samples" in record:
        import wandb

        out["samples"] = wandb.Table(columns=["prompt", "continuation"], data=record["samples"])
    return out


def eval_summary(record: dict) -> str:
    """Console lines for one evaluation: the figures and the first sample story."""
    line = f"step {record['step']}: val_loss {record['val_loss']:.4f}, val_bpb {record['val_bpb']:.4f}"
    if record.get("samples"):
        prompt, text = record["samples"][0]
        line += f"\n  sample: {prompt}{text}"
    return line


def _say(run: Run, message: str) -> None:
    if run.dist.main:
        tqdm.write(message)


# ---------------------------------------------------------------------------------------------------
# The loop


class StopRequest:
    """Set by SIGTERM (Kaggle's end of session) so the loop can checkpoint and leave cleanly."""

    def __init__(self) -> None:
        self.requested = False
        self.previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def close(self) -> None:
        signal.signal(signal.SIGTERM, self.previous)


def should_stop(run: Run, stop: StopRequest, started: float, step_seconds: float) -> str | None:
    """Why the loop must stop after this step (agreed over ranks), or None."""
    settings = run.settings
    reasons = [
        stop.requested,
        settings.time_budget_s is not None and time.time() - started + step_seconds > settings.time_budget_s,
        settings.stop_at is not None and run.step >= settings.stop_at,
    ]
    flags = all_reduce([float(r) for r in reasons], run.device, run.dist, torch_dist.ReduceOp.MAX)
    for name, flag in zip(("SIGTERM", "time budget", "stop_at"), flags, strict=True):
        if flag:
            return name
    return None


def step_record(run: Run, result: StepResult, lr: float, seconds: float, peak: float | None) -> dict:
    """One log record; loss is averaged over ranks, throughput counts every rank's tokens."""
    loss = all_reduce([result.loss], run.device, run.dist)[0] / run.dist.world
    tokens = run.settings.batch_size * run.arch.context_length
    rate = tokens / seconds
    mfu = flops_per_token(run.arch) * rate / (peak * run.dist.world) if peak else None
    return {
        "step": run.step,
        "loss": loss,
        "lr": lr,
        "grad_norm": result.grad_norm,
        "tokens_per_s": rate,
        "step_time_s": seconds,
        "mfu": mfu,
        "skipped_steps": run.skipped_steps,
        "scale": run.scaler.get_scale() if run.scaler.is_enabled() else None,
    }


def _due(step: int, every: int, last: int) -> bool:
    return bool(every) and (step % every == 0 or step == last)


def fit(run: Run) -> dict:
    """Train from run.step to max_steps (or an earlier stop); return a summary of the session."""
    settings, logger, stop = run.settings, Logger(run), StopRequest()
    peak, started = peak_flops(settings.log, run.device), time.time()
    bar = tqdm(total=settings.max_steps, initial=run.step, disable=not run.dist.main, unit="step")
    reason, last_eval = "max_steps", None
    try:
        while run.step < settings.max_steps:
            tick = time.perf_counter()
            lr = learning_rate(run.step, settings.optim, settings.max_steps)
            result = train_step(run, rank_micro_batches(run), lr)
            run.step += 1
            run.tokens_seen += settings.batch_size * run.arch.context_length
            run.skipped_steps += int(result.skipped)
            step_seconds = time.perf_counter() - tick
            bar.update(1)
            if _due(run.step, settings.log.every, settings.max_steps):
                record = step_record(run, result, lr, step_seconds, peak)
                logger.write(record)
                bar.set_postfix(
                    loss=f"{record['loss']:.3f}", lr=f"{lr:.2e}", tok_s=f"{record['tokens_per_s']:,.0f}"
                )
            if _due(run.step, settings.eval.every, settings.max_steps):
                last_eval = evaluate(run)
                logger.write(last_eval)
                _say(run, eval_summary(last_eval))
            reason = should_stop(run, stop, started, step_seconds) or reason
            if reason != "max_steps":
                break
            if run.step % settings.checkpoint.every == 0 and run.step < settings.max_steps:
                save_run(run)
        path = save_run(run)
    finally:
        bar.close()
        stop.close()
        logger.close()
    return session_summary(run, reason, path, last_eval)


def session_summary(run: Run, reason: str, path: Path | None, last_eval: dict | None) -> dict:
    """What the session did (step, why it stopped, last checkpoint, last evaluation), also printed."""
    summary = {
        "step": run.step,
        "stopped_by": reason,
        "skipped_steps": run.skipped_steps,
        "checkpoint": str(path),
    }
    if last_eval:
        summary.update(val_loss=last_eval["val_loss"], val_bpb=last_eval["val_bpb"])
    shown = (
        f"{key} {value:.4f}" if isinstance(value, float) else f"{key} {value}"
        for key, value in summary.items()
    )
    _say(run, f"stopped by {reason}: " + ", ".join(shown))
    return summary


def train(settings: TrainSettings) -> dict:
    """Build (or resume) a run and train it; the process group is torn down afterwards."""
    try:
        run = build_run(settings)
        maybe_resume(run)
        _say(run, describe_run(run))
        return fit(run)
    finally:
        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()


def describe_run(run: Run) -> str:
    """One line naming the model size, device, precision, batch layout and where the run lives."""
    settings = run.settings
    return (
        f"training {run.arch.num_parameters():,} parameters on {run.device} x{run.dist.world} "
        f"({str(run.dtype).removeprefix('torch.')}), batch {settings.batch_size} x {run.arch.context_length} "
        f"tokens = {run.dist.world} process(es) x {run.accumulation} micro-batch(es) of "
        f"{settings.micro_batch_size}; "
        f"run dir {run.run_dir}"
    )
