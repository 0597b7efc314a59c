"""Kaggle jobs: metadata the CLI accepts, bootstraps that compile, steps that compose against conf/."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from octlm.config import register_configs
from octlm.kaggle import Step, run_step, validate_metadata

ROOT = Path(__file__).resolve().parents[1]
JOBS = sorted(path.parent for path in (ROOT / "kaggle").glob("*/kernel-metadata.json"))
register_configs()


def load_job(job: Path):
    """Import a job's run.py as a module (its bootstrap only runs under __main__)."""
    code_file = job / json.loads((job / "kernel-metadata.json").read_text())["code_file"]
    spec = importlib.util.spec_from_file_location(f"kaggle_job_{job.name}", code_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def config_name(script: Path) -> str:
    """The config_name of the script's @hydra.main."""
    match = re.search(r'config_name="([^"]+)"', script.read_text())
    assert match, f"{script}: no @hydra.main(config_name=...)"
    return match.group(1)


def test_both_jobs_exist():
    assert {job.name for job in JOBS} >= {"train", "qwen3"}


@pytest.mark.parametrize("job", JOBS, ids=lambda job: job.name)
def test_metadata_validates_and_run_py_compiles(job):
    metadata = validate_metadata(job / "kernel-metadata.json")
    code_file = job / metadata["code_file"]
    compile(code_file.read_text(), str(code_file), "exec")
    assert "__main__" in code_file.read_text()  # importing it (as the tests do) must not bootstrap


@pytest.mark.parametrize("job", JOBS, ids=lambda job: job.name)
def test_steps_name_existing_scripts_and_compose_against_conf(job):
    steps = load_job(job).job_steps()
    assert steps and all(isinstance(step, Step) for step in steps)
    for step in steps:
        script = ROOT / step.script
        assert script.is_file(), f"{job.name}/{step.name}: {step.script} does not exist"
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            compose(config_name=config_name(script), overrides=list(step.overrides))


def test_qwen3_job_runs_the_promised_steps_in_order():
    steps = {step.name: step for step in load_job(ROOT / "kaggle" / "qwen3").job_steps()}
    assert [step.script for step in steps.values()] == [
        "scripts/load.py", "scripts/evaluate.py", "scripts/generate.py", "scripts/generate.py",
        "scripts/chat.py", "scripts/bench.py",
    ]  # fmt: skip
    assert {"dtype=float16", "device=cuda"} <= set(steps["load"].overrides)
    assert {"task=parity", "dtype=float32", "device=cuda"} <= set(steps["parity"].overrides)
    assert {"thinking=true", "thinking=false"} <= {o for s in steps.values() for o in s.overrides}
    assert steps["chat"].stdin.endswith("/exit\n")
    assert {"device=cuda", "dtype=float16"} <= set(steps["bench"].overrides)


def test_a_renamed_option_fails_to_compose():
    with (
        initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"),
        pytest.raises(Exception, match="no_such_option"),
    ):
        compose(config_name="generate", overrides=["no_such_option=1"])


def write_metadata(directory: Path, **changes) -> Path:
    """The qwen3 job's metadata with `changes` applied (None deletes a field), beside a run.py."""
    metadata = json.loads((ROOT / "kaggle" / "qwen3" / "kernel-metadata.json").read_text())
    metadata.update(changes)
    metadata = {key: value for key, value in metadata.items() if value is not None}
    (directory / "run.py").write_text("print('hi')\n")
    path = directory / "kernel-metadata.json"
    path.write_text(json.dumps(metadata))
    return path


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("id", "no-owner-slug"),
        ("id", "me/abc"),  # slug shorter than 5 characters
        ("id", "me/octlm-qwen3-t4/3"),  # a version
        ("title", "octlm qwen3 other"),  # does not slugify to the id's slug
        ("code_file", "missing.py"),
        ("language", "r"),
        ("kernel_type", "notebook"),
        ("enable_gpu", "true"),  # a string, not a JSON boolean
        ("enable_gpu", None),
        ("enable_internet", False),
        ("enable_tpu", True),
        ("is_private", "yes"),
        ("machine_shape", "GpuT4x2"),  # unknown names silently fall back to another GPU on Kaggle
        ("machine_shape", None),
        ("dataset_sources", "me/octlm"),  # not a list
        ("dataset_sources", ["octlm"]),  # no owner
        ("model_sources", ["me/model/pytorch/default"]),  # no version
        ("docker_image_pinning_type", "newest"),
    ],
)
def test_validate_metadata_names_the_bad_field(tmp_path, field, value):
    path = write_metadata(tmp_path, **{field: value})
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: field '{field}'"):
        validate_metadata(path)


def test_validate_metadata_rejects_unknown_fields_and_bad_json(tmp_path):
    path = write_metadata(tmp_path, accelerator="NvidiaTeslaT4")  # the CLI would ignore it silently
    with pytest.raises(ValueError, match="unknown field 'accelerator'"):
        validate_metadata(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="not a readable JSON file"):
        validate_metadata(path)


def test_validate_metadata_accepts_the_clis_optional_fields(tmp_path):
    path = write_metadata(
        tmp_path, dataset_sources=["me/octlm"], model_sources=["me/m/pytorch/default/1"], keywords=["gpu"]
    )
    assert validate_metadata(path)["dataset_sources"] == ["me/octlm"]


def test_run_step_pipes_stdin_tees_output_and_fails_loudly(tmp_path, capsys):
    log = tmp_path / "step.log"
    echo = (
        "import sys; data = sys.stdin.read(); print(data.upper(), flush=True); print('err', file=sys.stderr)"
    )
    run_step([sys.executable, "-c", echo], tmp_path, stdin="hello\n", log=log)
    out = capsys.readouterr().out
    assert "HELLO" in out and "err" in out and out.startswith("+ ")
    assert log.read_text() == "HELLO\n\nerr\n"
    with pytest.raises(RuntimeError, match=r"exit 3\).*output in"):
        run_step([sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path, log=log)
