"""Kaggle jobs: the logic shared by kaggle/*/run.py once octlm is installed on the Kaggle machine.

A job is a list of `Step`s, each a plain script invocation with Hydra overrides (`scripts/X.py a=b`).
`run_job` runs them in order from the repository root, streams every line to the notebook log and to
one log file per step, and stops at the first failure. `validate_metadata` checks a job's
kernel-metadata.json against the fields the Kaggle CLI (`kaggle kernels push`, kaggle 2.2.5) reads,
plus what every octlm job needs: a Python script on a T4 machine with internet access.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"  # the repository's (editable install)
T4_MACHINE_SHAPE = "NvidiaTeslaT4"  # the CLI's name for "GPU T4 x2"; an unknown name falls back silently
METADATA_FIELDS = {
    "id", "id_no", "title", "code_file", "language", "kernel_type", "is_private", "enable_gpu",
    "enable_tpu", "enable_internet", "machine_shape", "dataset_sources", "competition_sources",
    "kernel_sources", "model_sources", "keywords", "docker_image", "docker_image_pinning_type",
}  # fmt: skip
# Parts of each `*_sources` entry ("owner/slug" ...), as the CLI's validate_*_string functions accept them.
SOURCE_PARTS = {"dataset_sources": (2, 3), "kernel_sources": (2, 3), "model_sources": (5, 5)}


@dataclass(frozen=True)
class Step:
    """One job step: `python script overrides...` (or under `launcher`), `stdin` piped in."""

    name: str  # the log file's stem
    script: str  # relative to the repository root, e.g. scripts/load.py
    overrides: tuple[str, ...] = ()
    stdin: str | None = None
    launcher: tuple[str, ...] = ()  # e.g. ("torchrun", "--standalone", "--nproc_per_node=2"); empty: python

    def command(self) -> list[str]:
        """The argv this step runs."""
        return [*(self.launcher or (sys.executable,)), self.script, *self.overrides]


def kaggle_env() -> dict[str, str]:
    """This environment, unbuffered, plus WANDB_API_KEY from the Kaggle secrets when the notebook has one."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # steps' output reaches the log as it is printed
    try:
        from kaggle_secrets import UserSecretsClient

        env["WANDB_API_KEY"] = UserSecretsClient().get_secret("WANDB_API_KEY")
        print("wandb: online (WANDB_API_KEY from Kaggle secrets)", flush=True)
    except Exception as error:  # not on Kaggle, or no secret attached: wandb_mode=auto logs offline
        print(f"wandb: no WANDB_API_KEY secret ({error.__class__.__name__})", flush=True)
    return env


def run_step(
    command: Sequence[str],
    cwd: str | Path,
    env: dict[str, str] | None = None,
    stdin: str | None = None,
    log: str | Path | None = None,
) -> None:
    """Run `command` in `cwd`, echoing it and teeing stdout+stderr to `log`; a non-zero exit raises."""
    print("+", " ".join(command), flush=True)
    log_file = open(log, "w", encoding="utf-8") if log else None  # noqa: SIM115 (closed in finally)
    try:
        with subprocess.Popen(
            list(command), cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL, bufsize=1,
        ) as process:  # fmt: skip
            if stdin is not None:
                with contextlib.suppress(BrokenPipeError):  # a child that exits early: its exit code tells
                    process.stdin.write(stdin)
                    process.stdin.close()
            for line in process.stdout:
                sys.stdout.write(line)
                if log_file:
                    log_file.write(line)
                    log_file.flush()
        if process.returncode != 0:
            where = f"; output in {log}" if log else ""
            raise RuntimeError(f"step failed (exit {process.returncode}): {' '.join(command)}{where}")
    finally:
        if log_file:
            log_file.close()


def run_job(steps: Sequence[Step], repo: str | Path, logs_dir: str | Path) -> None:
    """Run every step in order from the repository root; logs_dir/NN-name.log keeps each step's output."""
    logs = Path(logs_dir)
    logs.mkdir(parents=True, exist_ok=True)
    env = kaggle_env()
    describe_devices()
    for index, step in enumerate(steps, start=1):
        print(f"\n=== step {index}/{len(steps)}: {step.name}", flush=True)
        run_step(step.command(), repo, env=env, stdin=step.stdin, log=logs / f"{index:02d}-{step.name}.log")


def describe_devices() -> None:
    """Print torch's version and each CUDA device with its compute capability (T4: sm_75)."""
    import torch

    print(f"torch {torch.__version__}, CUDA devices: {torch.cuda.device_count()}", flush=True)
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        print(f"  cuda:{index} {torch.cuda.get_device_name(index)} (sm_{major}{minor})", flush=True)


def hub_snapshot_dir(cache_dir: str | Path, repo: str, revision: str) -> Path:
    """Where huggingface_hub keeps `repo` at a commit inside `cache_dir` (its documented cache layout)."""
    return Path(cache_dir) / f"models--{repo.replace('/', '--')}" / "snapshots" / revision


def model_spec(model: str, conf_dir: str | Path = CONF_DIR) -> Any:
    """conf/model/<model>.yaml composed as the scripts compose it (repo, revision, arch ...)."""
    from hydra import compose, initialize_config_dir

    from octlm.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(Path(conf_dir).resolve()), version_base="1.3"):
        return compose(config_name="load", overrides=[f"model={model}"]).model


def validate_metadata(path: str | Path) -> dict[str, Any]:
    """Read a kernel-metadata.json and check it as `kaggle kernels push` would, and stricter; return it.

    Each problem raises ValueError naming the file and the field.
    """
    path = Path(path)
    try:
        metadata = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not a readable JSON file ({error})") from error
    if not isinstance(metadata, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(metadata).__name__}")
    unknown = sorted(set(metadata) - METADATA_FIELDS)
    if unknown:  # the CLI would ignore it, so a misspelt field fails silently on Kaggle
        raise ValueError(
            f"{path}: unknown field {unknown[0]!r}; the Kaggle CLI reads {sorted(METADATA_FIELDS)}"
        )
    require = partial(_require, path, metadata)
    _check_identity(metadata, require)
    _check_machine(metadata, require)
    _check_sources(metadata, require)
    code_file = metadata.get("code_file")
    require(
        "code_file", isinstance(code_file, str) and (path.parent / code_file).is_file(), "a file beside it"
    )
    pinning = metadata.get("docker_image_pinning_type")
    require("docker_image_pinning_type", pinning in (None, "original", "latest"), "'original' or 'latest'")
    return metadata


def _require(path: Path, metadata: dict[str, Any], field: str, ok: bool, expected: str) -> None:
    """Raise ValueError naming the file, the field, its value and what was expected, unless `ok`."""
    if not ok:
        raise ValueError(f"{path}: field {field!r} is {metadata.get(field)!r}, expected {expected}")


def _check_identity(metadata: dict[str, Any], require: Callable[..., None]) -> None:
    """id is "owner/slug" (slug of 5+ characters, no version) and the title slugifies to the slug."""
    kernel_id, title = metadata.get("id"), metadata.get("title")
    parts = kernel_id.split("/") if isinstance(kernel_id, str) else []
    valid_id = len(parts) == 2 and all(parts) and len(parts[1]) >= 5
    require("id", valid_id, '"owner/slug" with a slug of 5+ characters')
    require("title", isinstance(title, str) and len(title) >= 5, "a string of 5+ characters")
    slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
    require("title", slug == parts[1].lower(), f"a title whose slug is the id's {parts[1]!r}")


def _check_machine(metadata: dict[str, Any], require: Callable[..., None]) -> None:
    """A Python script on the T4 machine with internet: the CLI reads "true" strings, we want booleans."""
    require("language", metadata.get("language") == "python", "'python'")
    require("kernel_type", metadata.get("kernel_type") == "script", "'script'")
    for field, expected in [("enable_gpu", True), ("enable_internet", True), ("enable_tpu", False)]:
        require(field, metadata.get(field, False) is expected, f"{str(expected).lower()} (a JSON boolean)")
    require("is_private", isinstance(metadata.get("is_private", True), bool), "a JSON boolean")
    require("machine_shape", metadata.get("machine_shape") == T4_MACHINE_SHAPE, repr(T4_MACHINE_SHAPE))


def _check_sources(metadata: dict[str, Any], require: Callable[..., None]) -> None:
    """Every *_sources field is a list of strings with as many non-empty "/" parts as the CLI accepts."""
    for field in ("dataset_sources", "competition_sources", "kernel_sources", "model_sources"):
        entries = metadata.get(field, [])
        least, most = SOURCE_PARTS.get(field, (1, 1))
        ok = isinstance(entries, list) and all(
            isinstance(entry, str) and least <= len(entry.split("/")) <= most and all(entry.split("/"))
            for entry in entries
        )
        require(field, ok, f"a list of strings of {least} to {most} '/'-separated parts")
