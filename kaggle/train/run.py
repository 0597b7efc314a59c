"""Kaggle job: prepare TinyStories, train the tinystories model in fp16 on the T4(s), evaluate.

Pushed with `kaggle kernels push -p kaggle/train`; everything it writes lands in /kaggle/working
(the job's saved output): data/, runs/tinystories/ (checkpoints, metrics.jsonl, wandb), eval/.
Set OCTLM_GIT_URL below (or attach the repository as a dataset mounted at /kaggle/input/octlm) and,
for online wandb logging, add a Kaggle secret named WANDB_API_KEY.
"""

import os
import subprocess
import sys
from pathlib import Path

OCTLM_GIT_URL = os.environ.get("OCTLM_GIT_URL", "")  # e.g. https://github.com/YOU/octlm.git
OCTLM_DATASET = Path("/kaggle/input/octlm")  # the repository uploaded as a Kaggle dataset, if any
WORK = Path("/kaggle/working")
SOURCE = WORK / "octlm"
DATA = WORK / "data" / "tinystories"
RUNS = WORK / "runs"
GLOBAL_BATCH = 32  # sequences of 512 tokens per optimizer step, split over the GPUs


def sh(*command: str, cwd: Path = SOURCE, env: dict | None = None) -> None:
    """Run a command, echoing it; stop the job on failure."""
    print("+", " ".join(command), flush=True)
    subprocess.run(command, cwd=cwd, env=env, check=True)


def fetch_source() -> None:
    """Copy the repository from the attached dataset, or clone it from OCTLM_GIT_URL."""
    if SOURCE.exists():
        return
    if OCTLM_DATASET.is_dir():
        sh("cp", "-r", str(OCTLM_DATASET), str(SOURCE), cwd=WORK)
    elif OCTLM_GIT_URL:
        sh("git", "clone", "--depth", "1", OCTLM_GIT_URL, str(SOURCE), cwd=WORK)
    else:
        sys.exit("set OCTLM_GIT_URL in run.py or attach the repository as the dataset /kaggle/input/octlm")


def install() -> None:
    """Install octlm and its dependencies, pinning the preinstalled CUDA torch so pip keeps it."""
    import torch

    constraints = WORK / "constraints.txt"
    constraints.write_text(f"torch=={torch.__version__}\n")
    sh(sys.executable, "-m", "pip", "install", "-q", "-c", str(constraints), "-e", ".")


def environment() -> dict:
    """The job's environment plus WANDB_API_KEY from Kaggle secrets when one is set (else wandb offline)."""
    env = dict(os.environ)
    try:
        from kaggle_secrets import UserSecretsClient

        env["WANDB_API_KEY"] = UserSecretsClient().get_secret("WANDB_API_KEY")
    except Exception as error:  # no secret attached: wandb logs offline into the run directory
        print(f"wandb offline ({error.__class__.__name__})")
    return env


def main() -> None:
    fetch_source()
    install()
    import torch

    gpus = max(torch.cuda.device_count(), 1)
    env = environment()
    sh(sys.executable, "scripts/prepare_data.py", "data=tinystories", f"data.out_dir={DATA}", env=env)
    common = ["model=tinystories", "data=tinystories", f"data.out_dir={DATA}"]
    sh(
        "torchrun", "--standalone", f"--nproc_per_node={gpus}", "scripts/train.py", *common,
        "train=kaggle", f"runs_dir={RUNS}", "dtype=float16", f"batch_size={GLOBAL_BATCH}",
        f"micro_batch_size={GLOBAL_BATCH // gpus}",
        env=env,
    )  # fmt: skip
    checkpoint = f"checkpoint={RUNS / 'tinystories'}"
    evaluate = [sys.executable, "scripts/evaluate.py", "model=tinystories", checkpoint, "device=cuda"]
    sh(*evaluate, "task=lm", f"lm.data_dir={DATA}", env=env)
    sh(*evaluate, "task=samples", f"samples.out={WORK / 'eval' / 'samples.jsonl'}", env=env)


if __name__ == "__main__":
    main()
