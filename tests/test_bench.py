"""The benchmark suite on tiny models: it runs, writes JSONL and a PNG, and prints every ratio.

No timing is asserted anywhere: speed is judged by `make bench`, not by tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from octlm.bench import BenchSettings, Row, check_settings, format_table, spread, summary_rows
from octlm.config import decoder_config, register_configs

ROOT = Path(__file__).resolve().parent.parent

# A Qwen3-shaped model small enough to build, save and load in a moment; the vocabulary is Qwen3's so
# the real tokenizer's ids fit.
TINY_QWEN = {
    "vocab_size": 151936,
    "context_length": 512,
    "d_model": 32,
    "n_heads": 4,
    "kv_heads": 2,
    "head_dim": 8,
    "n_layers": 2,
    "ff_hidden": 64,
}
TINY_TRAIN = {
    "vocab_size": 256,
    "d_model": 32,
    "n_heads": 4,
    "kv_heads": 2,
    "n_layers": 2,
    "context_length": 64,
}


def tiny_overrides(tmp_path: Path, tokenizer_dir: Path) -> list[str]:
    """Every benchmark at its smallest: a few tokens, one repeat."""
    arch = [f"model.arch.{k}={v}" for k, v in TINY_QWEN.items()]
    train = [f"train.model.arch.{k}={v}" for k, v in TINY_TRAIN.items()]
    return (
        arch
        + train
        + [
            f"snapshot_cache={tmp_path / 'snapshots'}",
            f"out_dir={tmp_path / 'out'}",
            "decode.contexts=[8,16]",
            "decode.new_tokens=2",
            "decode.repeats=2",
            "prefill.lengths=[16]",
            "prefill.repeats=1",
            "load.repeats=1",
            "cache.contexts=[8,16]",
            "cache.cached_steps=2",
            "chat.turns=2",
            "chat.reply_tokens=2",
            "chat.max_context=256",
            f"chat.tokenizer_dir={tokenizer_dir}",
            "train.batch_size=2",
            "train.seq_len=16",
            "train.steps=1",
            "train.matmul_size=64",
        ]
    )


def compose_settings(overrides: list[str]) -> BenchSettings:
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="bench", overrides=overrides)
    return OmegaConf.to_object(cfg)


def test_make_bench_runs_all_six_and_writes_results(tmp_path: Path, qwen_files: Path) -> None:
    overrides = tiny_overrides(tmp_path, qwen_files)
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), *overrides],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    table = done.stdout
    for figure in (
        "decode tok/s, ctx 16",
        "prefill tok/s, 16 tokens",
        "load wall s",
        "load peak RSS",
        "ms/token with cache, ctx 16",
        "chat TTFT ms, turn 2",
        "train tok/s",
        "train MFU",
    ):
        assert figure in table, f"{figure!r} missing from the table:\n{table}"
    assert "transformers" in table and "ceiling" in table

    records = [
        json.loads(line) for line in (tmp_path / "out" / "bench-cpu-float32.jsonl").read_text().splitlines()
    ]
    assert {r["bench"] for r in records} == {"decode", "prefill", "load", "cache", "chat", "train"}
    for entry in records:
        for key in (
            "machine",
            "cpu_count",
            "torch",
            "transformers",
            "device",
            "dtype",
            "threads",
            "git_commit",
        ):
            assert key in entry, key
        assert entry["min"] <= entry["median"] <= entry["max"]
    decode = [r for r in records if r["bench"] == "decode"]
    assert {(r["side"], r["context"]) for r in decode} == {
        (side, context)
        for side in ("octlm", "transformers", "ceiling", "reference ceiling")
        for context in (8, 16)
    }
    assert all(r["n"] == 2 for r in decode)
    png = (tmp_path / "out" / "bench-cpu-float32.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    snapshots = list((tmp_path / "snapshots").iterdir())
    assert len(snapshots) == 1 and (snapshots[0] / "model.safetensors").is_file()


def test_config_composes_with_defaults_of_the_issue() -> None:
    settings = compose_settings([])
    assert settings.benchmarks == ["decode", "prefill", "load", "cache", "chat", "train"]
    assert settings.decode.contexts == [128, 512, 2048]
    assert settings.prefill.lengths == [512, 2048]
    assert settings.cache.contexts == [256, 512, 1024, 2048, 4096]
    assert settings.chat.turns == 8
    assert settings.model.name == "qwen3" and settings.train.model.name == "tinystories"
    check_settings(settings, decoder_config(settings.model.arch))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("benchmarks=[decode,speed]", "bench.benchmarks"),
        ("dtype=float64", "dtype"),
        ("decode.contexts=[128,0]", "bench.decode.contexts[1]"),
        ("cache.contexts=[256,40960]", "bench.cache.contexts needs 40969 positions"),
        ("train.steps=0", "bench.train.steps"),
    ],
)
def test_bad_settings_fail_before_work_naming_the_setting(override: str, message: str) -> None:
    settings = compose_settings([override])
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_settings(settings, decoder_config(settings.model.arch))


def test_unknown_setting_is_rejected_by_the_schema() -> None:
    with pytest.raises(Exception, match="decode.repeat"):
        compose_settings(["decode.repeat=3"])


def test_spread_reports_median_quartiles_and_extremes() -> None:
    stats = spread([4.0, 1.0, 3.0, 2.0, 100.0])
    assert stats["median"] == 3.0 and stats["min"] == 1.0 and stats["max"] == 100.0
    assert stats["q1"] == 2.0 and stats["q3"] == 4.0 and stats["n"] == 5
    assert spread([5.0])["q1"] == spread([5.0])["q3"] == 5.0


def fake(bench: str, side: str, median: float, **extra) -> dict:
    return {"bench": bench, "side": side, "median": median, **extra}


def test_gain_is_octlm_advantage_whichever_way_the_unit_points() -> None:
    records = [
        fake("decode", "octlm", 6.0, context=512),
        fake("decode", "transformers", 4.0, context=512),
        fake("decode", "ceiling", 8.0, context=512),
        fake("decode", "reference ceiling", 4.0, context=512),
        fake("cache", "cached", 0.1, context=4096),
        fake("cache", "uncached", 5.0, context=4096),
        fake("load", "octlm", 2.0, figure="wall"),
        fake("load", "transformers", 7.0, figure="wall"),
        fake("load", "octlm", 1.2, figure="peak_rss"),
        fake("load", "transformers", 1.65, figure="peak_rss"),
        fake("load", "octlm", 1.0, figure="peak_rss_above_torch"),
        fake("load", "transformers", 1.5, figure="peak_rss_above_torch"),
    ]
    rows = {row.figure: row for row in summary_rows(records)}
    versus = [r for r in summary_rows(records) if r.figure == "decode tok/s, ctx 512"]
    assert [round(r.ratio, 2) for r in versus] == [1.5, 0.75]
    assert [r.met for r in versus] == [True, False]  # 1.5 >= 1.25; 0.75 < 0.85 of the ceiling
    assert rows["decode ceiling tok/s"].ratio == pytest.approx(2.0)  # fast kernel 8.0 over default 4.0
    assert rows["decode ceiling tok/s"].met is None
    assert rows["ms/token with cache, ctx 4096"].ratio == pytest.approx(50.0)
    assert rows["ms/token with cache, ctx 4096"].met is True
    assert rows["load wall s"].ratio == pytest.approx(3.5)
    assert rows["load peak RSS / fp32 params"].met is False  # 1.2 > 1.15, whatever transformers does


def test_table_lists_every_row_with_its_gain() -> None:
    rows = [Row("decode tok/s, ctx 512", "6.00", "transformers 4.00", 1.5, "gain >= 1.25", True)]
    table = format_table(rows).splitlines()
    assert table[0].split() == ["figure", "octlm", "reference", "gain", "target", "met"]
    assert "1.50x" in table[2] and table[2].endswith("yes")
