"""Kaggle job: prepare TinyStories, train the tinystories model in fp16 on the T4s, evaluate it.

Runs, in order, from the repository root: scripts/prepare_data.py, scripts/train.py under torchrun
(one process per GPU, train=kaggle: checkpoints and stops an hour before Kaggle's 12-hour limit,
resume=true continues from the newest checkpoint when the job is pushed again), then scripts/evaluate.py
task=lm and task=samples. Everything lands in /kaggle/working (the saved output): data/, runs/tinystories/
(checkpoints, metrics.jsonl, wandb), eval/, and one log per step in logs/. For online wandb logging add
a Kaggle secret named WANDB_API_KEY; without it wandb logs offline into the run folder.

Push with `kaggle kernels push -p kaggle/train`. The repository comes from the dataset attached at
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
    import torch

    from octlm.kaggle import Step

    gpus = max(torch.cuda.device_count(), 1)
    data_dir, runs_dir, batch = WORK / "data" / "tinystories", WORK / "runs", 32  # sequences per step
    data = ("data=tinystories", f"data.out_dir={data_dir}")
    evaluate = ("model=tinystories", f"checkpoint={runs_dir / 'tinystories'}", "device=cuda")
    torchrun = ("torchrun", "--standalone", f"--nproc_per_node={gpus}")
    return [
        Step("prepare-data", "scripts/prepare_data.py", data),
        Step("train", "scripts/train.py", ("model=tinystories", *data, "train=kaggle", f"runs_dir={runs_dir}",
             "dtype=float16", f"batch_size={batch}", f"micro_batch_size={batch // gpus}"), launcher=torchrun),
        Step("evaluate-lm", "scripts/evaluate.py", ("task=lm", *evaluate, f"lm.data_dir={data_dir}")),
        Step("evaluate-samples", "scripts/evaluate.py", ("task=samples", *evaluate,
             f"samples.out={WORK / 'eval' / 'samples.jsonl'}")),
    ]  # fmt: skip


if __name__ == "__main__":
    bootstrap()
    from octlm.kaggle import run_job

    run_job(job_steps(), SOURCE, WORK / "logs")
