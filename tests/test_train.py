"""Training on a shrunken config: loss falls, exact resume, DDP == one process, SIGTERM, bad input."""

import json
import logging
import math
import os
import pickle
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from octlm import checkpoint as ckpt
from octlm import train as training
from octlm.config import register_configs
from octlm.data import DataSpec, PrepareDataSettings, TokenizerSpec, prepare
from octlm.safetensors import SafetensorsFile

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 384
register_configs()

NAMES = ["Lily", "Tom", "Mia", "Ben", "Sue", "Max"]
ANIMALS = ["cat", "dog", "bird", "frog", "bunny"]
PLACES = ["park", "garden", "forest", "house"]
THINGS = ["ball", "box", "flower", "stick", "hat"]
FEELINGS = ["happy", "sad", "surprised", "sleepy"]


def make_stories(count: int, seed: int) -> list[str]:
    """Templated stories: easy to learn, so a few hundred steps must cut the loss a lot."""
    rng = random.Random(seed)
    stories = []
    for _ in range(count):
        name, animal, place = rng.choice(NAMES), rng.choice(ANIMALS), rng.choice(PLACES)
        thing, feeling = rng.choice(THINGS), rng.choice(FEELINGS)
        stories.append(
            f"Once upon a time, there was a little {animal} named {name}. {name} liked to play in the "
            f"{place}. One day, {name} found a {thing}. {name} was very {feeling}. The end."
        )
    return stories


def prepare_corpus(directory: Path, seed: int = 0, tokenizer: Path | None = None) -> Path:
    """A prepared data dir (tokenizer, train.bin, validation.bin, manifest) made by octlm.data.prepare."""
    directory.mkdir(parents=True, exist_ok=True)
    corpus = directory / "stories.txt"
    corpus.write_text("\n\n".join(make_stories(600, seed)) + "\n")
    spec = DataSpec(
        files=[str(corpus)],
        out_dir=str(directory / "prepared"),
        validation_fraction=0.1,
        tokenizer=TokenizerSpec(
            vocab_size=VOCAB, sample_stories=600, seed=seed, path=tokenizer and str(tokenizer)
        ),
    )
    prepare(PrepareDataSettings(data=spec, batch_size=256, progress=False))
    return Path(spec.out_dir)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: on a shared 2-core machine, thread contention makes tiny models crawl."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return prepare_corpus(tmp_path_factory.mktemp("corpus"))


def overrides(data_dir: Path, runs: Path, *extra: str) -> list[str]:
    """Command-line overrides of the smoke preset shared by in-process and subprocess runs."""
    return [
        "train=smoke",
        f"data.out_dir={data_dir}",
        f"runs_dir={runs}",
        f"model.arch.vocab_size={VOCAB}",
        "run_name=t",
        *extra,
    ]


def settings(data_dir: Path, runs: Path, *extra: str) -> training.TrainSettings:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides(data_dir, runs, *extra))
    return OmegaConf.to_object(cfg)


def final_tensors(runs: Path) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors of the newest checkpoint, names prefixed by their file."""
    found = ckpt.latest_checkpoint(runs / "t" / "checkpoints")
    out = {}
    for name in ("model.safetensors", "optimizer.safetensors"):
        with SafetensorsFile(found.path / name) as file:
            out.update({f"{name}:{key}": tensor for key, tensor in file.tensors()})
    return out


def test_schedule_warms_up_then_decays_to_min_lr():
    optim = training.OptimSettings(lr=1e-3, min_lr=1e-4, warmup_steps=10)
    assert training.learning_rate(0, optim, 100) == pytest.approx(1e-4)
    assert training.learning_rate(9, optim, 100) == pytest.approx(1e-3)
    assert training.learning_rate(55, optim, 100) == pytest.approx(5.5e-4)
    assert training.learning_rate(100, optim, 100) == pytest.approx(1e-4)


def test_weight_decay_only_on_matrices(data_dir, tmp_path):
    run = training.build_run(settings(data_dir, tmp_path))
    decay, no_decay = run.optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    names = set(run.param_names)
    assert len(names) == len(dict(run.model.named_parameters())) == len(run.param_names)


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory) -> dict:
    """One 150-step smoke run shared by the loss and evaluation tests: its run, summary, first loss."""
    runs = tmp_path_factory.mktemp("trained")
    run = training.build_run(settings(data_dir, runs, "max_steps=150", "eval.every=150"))
    initial, _ = training.validation_loss(run.model, run.valid_tokens, 64, 8, 8)
    return {"run": run, "summary": training.fit(run), "initial": initial, "runs": runs}


def test_loss_falls_and_metrics_are_logged(trained):
    run, summary = trained["run"], trained["summary"]
    assert summary["step"] == 150 and summary["stopped_by"] == "max_steps"
    assert summary["val_loss"] < 0.5 * trained["initial"], (trained["initial"], summary)
    records = [
        json.loads(line) for line in (trained["runs"] / "t" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(20, 141, 20)) + [150]
    assert {"lr", "grad_norm", "tokens_per_s", "step_time_s", "mfu", "skipped_steps"} <= set(steps[0])
    assert steps[0]["mfu"] is None  # no assumed CPU peak: MFU is not made up
    evaluation = records[-1]
    split = run.manifest["splits"]["validation"]
    expected_bpb = evaluation["val_loss"] * split["tokens"] / (split["bytes"] * math.log(2))
    assert evaluation["val_bpb"] == pytest.approx(expected_bpb)
    stories = training.evaluate(run)["samples"]
    assert [prompt for prompt, _ in stories] == run.settings.eval.prompts
    assert all(len(text) > 10 for _, text in stories), stories


def evaluate_settings(*extra: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return OmegaConf.to_object(compose("evaluate", overrides=list(extra)))


def smoke_model(run) -> list[str]:
    """Overrides that make model=tinystories describe the smoke run's architecture."""
    arch = run.arch
    fields = ("vocab_size", "context_length", "d_model", "n_heads", "n_layers", "kv_heads")
    return ["model=tinystories", *(f"model.arch.{name}={getattr(arch, name)}" for name in fields)]


def test_evaluate_lm_on_token_files_matches_training(trained, data_dir):
    from octlm.evaluate import run_task

    run, checkpoint = trained["run"], trained["summary"]["checkpoint"]
    options = ("task=lm", f"checkpoint={checkpoint}", f"lm.data_dir={data_dir}", "lm.max_batches=8")
    results = run_task(evaluate_settings(*options, *smoke_model(run)))
    assert results["loss"] == pytest.approx(trained["summary"]["val_loss"], rel=1e-6)
    assert results["bits per byte"] == pytest.approx(trained["summary"]["val_bpb"], rel=1e-4)
    assert results["perplexity"] == pytest.approx(math.exp(results["loss"]))
    with pytest.raises(ckpt.CheckpointError, match="unlike model=tinystories"):
        run_task(evaluate_settings(*options, "model=tinystories"))


def test_evaluate_lm_on_text_files_counts_bytes(trained, data_dir, tmp_path):
    from octlm.evaluate import run_task

    files = []
    for index, story in enumerate(make_stories(8, seed=5)):  # one story per file, as the model saw them
        files.append(tmp_path / f"{index}.txt")
        files[-1].write_text(story)
    options = (
        "task=lm",
        f"checkpoint={trained['summary']['checkpoint']}",
        f"lm.files=[{','.join(map(str, files))}]",
    )
    results = run_task(evaluate_settings(*options, *smoke_model(trained["run"])))
    text_bytes = sum(len(path.read_bytes()) for path in files)
    assert results["bytes"] == text_bytes
    nats = results["loss"] * results["tokens"]
    assert results["bits per byte"] == pytest.approx(nats / (text_bytes * math.log(2)))
    # The same kind of text as the validation split: bits per byte agree although windows differ.
    assert results["bits per byte"] == pytest.approx(trained["summary"]["val_bpb"], rel=0.25)


def test_evaluate_lm_on_qwen3_matches_transformers(qwen_files, tmp_path):
    from qwen_snapshots import random_qwen, save_snapshot

    from octlm.evaluate import run_task

    reference = random_qwen(vocab_size=151936)
    snapshot = save_snapshot(reference, tmp_path / "qwen", tokenizer_dir=qwen_files)
    text = "Once upon a time, a small robot learned to paint. Ça marche très bien! 🎨"
    (tmp_path / "t.txt").write_text(text)
    results = run_task(
        evaluate_settings("task=lm", "model=hf", f"model.path={snapshot}", f"lm.files=[{tmp_path / 't.txt'}]")
    )
    from octlm.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(snapshot)
    ids = torch.tensor([[tokenizer.token_id("<|endoftext|>"), *tokenizer.encode(text)]])
    with torch.no_grad():
        loss = reference(ids, labels=ids).loss.item()  # transformers' own shifted cross-entropy
    assert results["tokens"] == ids.shape[1] - 1
    assert results["loss"] == pytest.approx(loss, abs=1e-5)
    assert results["bits per byte"] == pytest.approx(
        loss * results["tokens"] / (len(text.encode()) * math.log(2)), abs=1e-5
    )


def test_evaluate_samples_writes_greedy_and_sampled_stories(trained, tmp_path):
    from octlm.evaluate import run_task

    out = tmp_path / "samples.jsonl"
    options = (
        "task=samples",
        f"checkpoint={trained['summary']['checkpoint']}",
        f"samples.out={out}",
        "samples.max_new_tokens=20",
    )
    results = run_task(evaluate_settings(*options, *smoke_model(trained["run"])))
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert results["stories"] == len(records) == 20
    prompts = evaluate_settings().samples.prompts
    assert len(prompts) == 10
    assert [r["prompt"] for r in records] == prompts * 2
    assert [r["mode"] for r in records] == ["greedy"] * 10 + ["sampled"] * 10
    assert all(r["text"] and r["finish"] in ("eos", "length") for r in records)
    again = run_task(evaluate_settings(*options, *smoke_model(trained["run"])))
    assert again["stories"] == 20 and [json.loads(line) for line in out.read_text().splitlines()] == records


def test_mfu_uses_the_configured_peak(data_dir, tmp_path):
    run = training.build_run(settings(data_dir, tmp_path, "log.peak_tflops=0.001"))
    peak = training.peak_flops(run.settings.log, run.device)
    record = training.step_record(run, training.StepResult(2.0, 1.0, False), 1e-3, 0.5, peak)
    tokens_per_s = 16 * 64 / 0.5
    assert record["mfu"] == pytest.approx(training.flops_per_token(run.arch) * tokens_per_s / 1e9)


def test_resume_is_bit_identical(data_dir, tmp_path, monkeypatch):
    # Dropout makes the torch RNG matter; evaluations with sampling run in between.
    common = ("max_steps=12", "model.arch.dropout=0.1", "eval.every=4", "checkpoint.every=100")
    training.train(settings(data_dir, tmp_path / "straight", *common))
    halted = training.train(settings(data_dir, tmp_path / "split", *common, "stop_at=6"))
    assert halted["step"] == 6 and halted["stopped_by"] == "stop_at"
    for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(module, name, None)  # resuming must not unpickle anything
    resumed = training.train(settings(data_dir, tmp_path / "split", *common, "resume=true"))
    assert resumed["step"] == 12
    straight, split = final_tensors(tmp_path / "straight"), final_tensors(tmp_path / "split")
    assert straight.keys() == split.keys() and len(straight) > 20
    different = [name for name in straight if not torch.equal(straight[name], split[name])]
    assert not different


def overflow_first(count: int):
    """A gradient hook that turns the first `count` gradients it sees into inf (an fp16 overflow)."""
    seen = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        seen.append(1)
        return grad * float("inf") if len(seen) <= count else grad

    return hook


def test_fp16_overflow_step_is_skipped(data_dir, tmp_path):
    run = training.build_run(settings(data_dir, tmp_path, "dtype=float16", "micro_batch_size=16"))
    assert run.scaler.is_enabled() and run.dtype == torch.float16
    weight = run.model.blocks[0].ff.down_proj.weight
    weight.register_hook(overflow_first(1))
    before, scale = weight.detach().clone(), run.scaler.get_scale()
    result = training.train_step(run, training.rank_micro_batches(run), 1e-3)
    assert result.skipped and not math.isfinite(result.grad_norm)
    assert torch.equal(weight, before) and run.scaler.get_scale() == scale / 2
    result = training.train_step(run, training.rank_micro_batches(run), 1e-3)
    assert not result.skipped and not torch.equal(weight, before)


def test_fit_counts_skipped_steps(data_dir, tmp_path):
    run = training.build_run(
        settings(data_dir, tmp_path, "dtype=float16", "micro_batch_size=16", "max_steps=4", "eval.every=0")
    )
    run.model.embed.weight.register_hook(overflow_first(2))
    summary = training.fit(run)
    assert summary["skipped_steps"] == 2
    state = json.loads((Path(summary["checkpoint"]) / "state.json").read_text())
    assert state["skipped_steps"] == 2 and state["scaler"]["scale"] == 65536.0 / 4


def test_time_budget_checkpoints_and_stops(data_dir, tmp_path):
    summary = training.train(settings(data_dir, tmp_path, "time_budget_s=0", "eval.every=0"))
    assert summary["stopped_by"] == "time budget" and summary["step"] == 1
    assert ckpt.open_checkpoint(summary["checkpoint"]).step == 1


def _environment() -> dict:
    return dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def test_sigterm_writes_a_checkpoint(data_dir, tmp_path):
    args = overrides(data_dir, tmp_path, "max_steps=100000", "log.every=1", "eval.every=0")
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "train.py"), *args],
        env=_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = tmp_path / "t" / "metrics.jsonl"
    deadline = time.time() + 60
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3) and time.time() < deadline:
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 0, output
    logged = json.loads(metrics.read_text().splitlines()[-1])["step"]
    found = ckpt.latest_checkpoint(tmp_path / "t" / "checkpoints")
    assert found.step == logged >= 3
    assert "stopped by SIGTERM" in output


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ddp_two_processes_match_one(data_dir, tmp_path):
    common = ("max_steps=6", "eval.every=3", "batch_size=16", "micro_batch_size=8")
    training.train(settings(data_dir, tmp_path / "single", *common))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={_free_port()}",
        str(ROOT / "scripts" / "train.py"),
        *overrides(data_dir, tmp_path / "ddp", *common),
    ]
    done = subprocess.run(command, env=_environment(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "x2 (float32)" in done.stdout + done.stderr
    single, ddp = final_tensors(tmp_path / "single"), final_tensors(tmp_path / "ddp")
    worst = max((single[name] - ddp[name]).abs().max().item() for name in single)
    # Each rank computes its micro-batch exactly as the single process does; the only difference is
    # how the two gradients are combined ((g0 + g1) / 2 by all-reduce vs g0 / 2 + g1 / 2 by
    # accumulation), which is exact for two terms. 1e-6 leaves room for a backend summing in
    # another order, while any batch or rank mix-up moves weights by ~1e-3 (lr 3e-3).
    assert worst <= 1e-6, worst
    single_log = (tmp_path / "single" / "t" / "metrics.jsonl").read_text().splitlines()
    ddp_log = (tmp_path / "ddp" / "t" / "metrics.jsonl").read_text().splitlines()
    val = [json.loads(line)["val_loss"] for line in single_log if "val_loss" in line]
    val_ddp = [json.loads(line)["val_loss"] for line in ddp_log if "val_loss" in line]
    assert val == pytest.approx(val_ddp, abs=1e-6)


def test_corrupt_or_truncated_newest_checkpoint_falls_back(data_dir, tmp_path, caplog):
    common = ("max_steps=8", "checkpoint.every=4", "eval.every=0")
    training.train(settings(data_dir, tmp_path, *common))
    steps = ckpt.list_checkpoints(tmp_path / "t" / "checkpoints")
    assert [path.name for path in steps] == ["step_000004", "step_000008"]
    weights = steps[-1] / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        run = training.build_run(settings(data_dir, tmp_path, *common, "resume=true"))
        training.maybe_resume(run)
    assert run.step == 4
    assert "step_000008" in caplog.text and "corrupt" in caplog.text
    (steps[-1] / "optimizer.safetensors").write_bytes(b"")  # truncated as well now
    (steps[0] / "state.json").write_text("{}")
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint .* verifies"):
        training.maybe_resume(training.build_run(settings(data_dir, tmp_path, *common, "resume=true")))


def test_resume_with_another_config_tokenizer_or_data_fails(data_dir, tmp_path_factory, tmp_path):
    training.train(settings(data_dir, tmp_path, "max_steps=2", "eval.every=0"))
    with pytest.raises(ckpt.CheckpointMismatch, match=r"model config differs .*n_layers"):
        training.maybe_resume(
            training.build_run(settings(data_dir, tmp_path, "resume=true", "model.arch.n_layers=3"))
        )
    other_tokenizer = prepare_corpus(tmp_path_factory.mktemp("other"), seed=1)
    with pytest.raises(ckpt.CheckpointMismatch, match="tokenizer differs"):
        training.maybe_resume(training.build_run(settings(other_tokenizer, tmp_path, "resume=true")))
    other_data = prepare_corpus(
        tmp_path_factory.mktemp("data"), seed=2, tokenizer=data_dir / "tokenizer.json"
    )
    with pytest.raises(ckpt.CheckpointMismatch, match="training data differs"):
        training.maybe_resume(training.build_run(settings(other_data, tmp_path, "resume=true")))


def test_vocab_mismatch_and_missing_data_are_clear_errors(data_dir, tmp_path):
    with pytest.raises(ValueError, match=rf"vocabulary of {VOCAB}.*model.arch.vocab_size=8,192"):
        training.build_run(settings(data_dir, tmp_path, "model.arch.vocab_size=8192"))
    with pytest.raises(FileNotFoundError, match="manifest.json not found"):
        training.build_run(settings(tmp_path / "nowhere", tmp_path))
    with pytest.raises(ValueError, match="multiple of micro_batch_size"):
        training.build_run(settings(data_dir, tmp_path, "batch_size=12"))


def test_wandb_offline_logs_metrics_and_a_sample_table(data_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    options = ("max_steps=2", "eval.every=2", "log.every=1", "log.wandb_mode=auto", "eval.max_new_tokens=8")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # auto without an API key: offline, no account needed
    training.train(settings(data_dir, tmp_path, *options))
    runs = list((tmp_path / "t" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    tables = list(runs[0].glob("files/media/table/samples_2_*.table.json"))
    assert len(tables) == 1
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["prompt", "continuation"] and len(table["data"]) == 3
