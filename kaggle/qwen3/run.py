"""Kaggle job: Qwen3-0.6B from its official weights on a real T4 in fp16 (the proof that fp16 works).

Runs, in order, from the repository root: scripts/load.py (download, verify and load in float16),
scripts/evaluate.py task=parity (octlm against transformers on the same weights, float32 on the GPU),
scripts/generate.py with thinking on and off, a scripted scripts/chat.py conversation piped on stdin,
and scripts/bench.py on cuda/float16. Everything lands in /kaggle/working (the saved output): one log
per step in logs/, the benchmark's table, JSONL and plot in bench/.

Push with `kaggle kernels push -p kaggle/qwen3`. The repository comes from the dataset attached at
/kaggle/input/octlm, else from OCTLM_GIT_URL below.
"""

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

OCTLM_GIT_URL = os.environ.get("OCTLM_GIT_URL", "")  # e.g. https://github.com/YOU/octlm.git
REPO_DATASET = Path("/kaggle/input/octlm")  # the repository uploaded as a Kaggle dataset, if attached
WORK = Path("/kaggle/working")  # Kaggle saves this folder as the job's output
SOURCE = WORK / "octlm"
HF_CACHE = Path("/tmp/hf")  # the 1.5 GB snapshot, kept out of the saved output (/kaggle/working)


def bootstrap() -> None:
    """Fetch the repository and pip-install it without replacing Kaggle's CUDA build of torch."""
    import torch

    if not SOURCE.exists() and REPO_DATASET.is_dir():
        shutil.copytree(REPO_DATASET, SOURCE)
    elif not SOURCE.exists() and OCTLM_GIT_URL:
        subprocess.run(["git", "clone", "--depth", "1", OCTLM_GIT_URL, str(SOURCE)], check=True)
    elif not SOURCE.exists():
        sys.exit(f"no repository: attach it as the dataset {REPO_DATASET} or set OCTLM_GIT_URL in run.py")
    constraints = WORK / "constraints.txt"
    constraints.write_text(f"torch=={torch.__version__}\n")
    pip = [sys.executable, "-m", "pip", "install", "-q", "-c", str(constraints), "-e", str(SOURCE)]
    subprocess.run(pip, check=True)
    sys.path.insert(0, str(SOURCE))  # the editable install's .pth file is only read by new interpreters
    importlib.invalidate_caches()  # see the packages pip just put into site-packages


def job_steps() -> list:
    """The job: plain script invocations with Hydra overrides, run from the repository root."""
    from octlm.kaggle import Step, hub_snapshot_dir, model_spec

    spec = model_spec("qwen3")
    qwen3 = ("model=qwen3", f"cache_dir={HF_CACHE}", "device=cuda")
    conversation = "My name is Ada and I grow tomatoes.\nWhat is my name, and what do I grow?\n/think on\n"
    conversation += "How many letters are in my name?\n/exit\n"
    return [
        Step("load", "scripts/load.py", (*qwen3, "dtype=float16")),
        Step("parity", "scripts/evaluate.py", ("task=parity", *qwen3, "dtype=float32")),
        Step("generate-thinking", "scripts/generate.py", (*qwen3, "dtype=float16", "thinking=true",
             "prompt='What is 17 * 23? Answer with the number.'", "sampling.max_new_tokens=1024")),
        Step("generate-direct", "scripts/generate.py", (*qwen3, "dtype=float16", "thinking=false",
             "prompt='Name the three primary colours of paint.'")),
        Step("chat", "scripts/chat.py", (*qwen3, "dtype=float16", "thinking=false"), stdin=conversation),
        Step("bench", "scripts/bench.py", ("device=cuda", "dtype=float16", f"out_dir={WORK / 'bench'}",
             f"chat.tokenizer_dir={hub_snapshot_dir(HF_CACHE, spec.repo, spec.revision)}")),
    ]  # fmt: skip


if __name__ == "__main__":
    bootstrap()
    from octlm.kaggle import run_job

    run_job(job_steps(), SOURCE, WORK / "logs")
