"""Data preparation: tokenizer round trip, token files, manifest, reuse by hash, bad input, batches."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hydra import compose, initialize_config_dir
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from octlm import data
from octlm.config import register_configs
from octlm.data import (
    DataSpec,
    PrepareDataSettings,
    TokenizerSpec,
    iter_eval_batches,
    load_manifest,
    load_tokenizer,
    open_split,
    prepare,
    sample_batch,
)

ROOT = Path(__file__).resolve().parents[1]
register_configs()

NAMES = ["Lily", "Tom", "Mia", "Ben", "Zoë", "Søren"]
WORDS = ["the", "a", "little", "big", "happy", "sad", "dog", "cat", "ball", "tree", "park", "sun", "ran"]
WORDS += ["jumped", "saw", "played", "found", "wanted"]


def make_stories(count: int, seed: int = 0) -> list[str]:
    """Short synthetic stories: a few sentences each, some with a second paragraph and non-ASCII names."""
    rng = random.Random(seed)
    stories = []
    for index in range(count):
        sentences = [
            f"{rng.choice(NAMES)} {' '.join(rng.choices(WORDS, k=rng.randint(3, 9)))}." for _ in range(3)
        ]
        story = " ".join(sentences) + f" The end {index}."
        if index % 7 == 0:
            story += '\n"Wow!" said Mum. 🌞'
        stories.append(story)
    return stories


def write_corpus(directory: Path, kind: str, stories: list[str]) -> Path:
    """Write stories as .txt (blank-line separated), .jsonl or .parquet; return the file."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"stories.{kind}"
    if kind == "txt":
        path.write_text("\n\n".join(stories) + "\n", encoding="utf-8")
    elif kind == "jsonl":
        path.write_text("".join(json.dumps({"text": s, "id": i}) + "\n" for i, s in enumerate(stories)))
    else:
        pq.write_table(pa.table({"text": stories}), path)
    return path


def settings_for(out_dir: Path, **data_fields) -> PrepareDataSettings:
    spec = DataSpec(out_dir=str(out_dir), tokenizer=TokenizerSpec(vocab_size=512, sample_stories=200))
    for key, value in data_fields.items():
        setattr(spec, key, value)
    return PrepareDataSettings(data=spec, batch_size=64, progress=False)


def split_stories(tokens: np.ndarray, eot_id: int) -> list[list[int]]:
    """Token lists of the stories in a token file: every story ends with EOT."""
    assert tokens[-1] == eot_id
    ends = np.flatnonzero(tokens == eot_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokens[a:b].tolist() for a, b in zip(starts, ends, strict=True)]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """One prepared directory from split .jsonl files, shared by the read-only tests."""
    root = tmp_path_factory.mktemp("prepared")
    stories = make_stories(300)
    split_files = {
        "train": [str(write_corpus(root / "train", "jsonl", stories[:270]))],
        "validation": [str(write_corpus(root / "validation", "jsonl", stories[270:]))],
    }
    prepare(settings_for(root / "out", split_files=split_files))
    return root / "out", stories


def test_token_files_decode_to_the_stories_and_manifest_counts_match(prepared):
    out, stories = prepared
    manifest = load_manifest(out)
    tokenizer = load_tokenizer(out)
    expected = {"train": stories[:270], "validation": stories[270:]}
    for split, texts in expected.items():
        tokens = open_split(out, split, verify=True)
        pieces = split_stories(np.asarray(tokens), manifest["eot_id"])
        assert [tokenizer.decode(p, skip_special_tokens=False) for p in pieces] == texts
        entry = manifest["splits"][split]
        assert entry["tokens"] == len(tokens) == sum(len(p) + 1 for p in pieces)
        assert entry["stories"] == len(texts)
        assert entry["bytes"] == sum(len(t.encode()) for t in texts)
    assert manifest["vocab_size"] == tokenizer.get_vocab_size() <= 512
    assert manifest["eot_id"] == tokenizer.token_to_id("<|endoftext|>")
    assert manifest["tokenizer_sha256"] == data.file_sha256(out / "tokenizer.json")
    assert 1.5 < data.bytes_per_token(out) < 10


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet"])
def test_every_file_type_gives_the_same_stories(tmp_path, kind):
    stories = make_stories(120, seed=1)
    path = write_corpus(tmp_path / "in", kind, stories)
    manifest = prepare(settings_for(tmp_path / "out", files=[str(path)], validation_fraction=0.1))
    tokenizer = load_tokenizer(tmp_path / "out")
    decoded = []
    for split in ("train", "validation"):
        pieces = split_stories(np.asarray(open_split(tmp_path / "out", split)), manifest["eot_id"])
        decoded += [tokenizer.decode(p, skip_special_tokens=False) for p in pieces]
    assert 0 < manifest["splits"]["validation"]["stories"] < 30
    assert sorted(decoded) == sorted(stories)


def test_hold_out_is_stable_when_stories_are_added_and_keeps_duplicates_together():
    stories = make_stories(2000)
    first = data.hold_out(stories, 0.1)
    more = data.hold_out(stories + make_stories(500, seed=9) + stories[:300], 0.1)
    assert set(first["validation"]) <= set(more["validation"])
    assert set(first["train"]) <= set(more["train"])
    assert not set(more["train"]) & set(more["validation"])
    assert 150 < len(first["validation"]) < 250


def test_a_hold_out_that_leaves_a_split_empty_is_an_error(tmp_path, monkeypatch):
    path = write_corpus(tmp_path / "in", "txt", make_stories(5))
    monkeypatch.setattr(data, "train_tokenizer", _never_train)
    with pytest.raises(
        ValueError, match=r"no validation stories left .* of 5 stories \(files: .*stories.txt"
    ):
        prepare(settings_for(tmp_path / "out", files=[str(path)], validation_fraction=1e-9))


def test_txt_separator_lines_split_stories(tmp_path):
    path = tmp_path / "stories.txt"
    path.write_text("One.\n\nStill one.\n<|endoftext|>\nTwo.\n  <|endoftext|>  \n\n<|endoftext|>\nThree.\n")
    assert data.read_txt(path, "<|endoftext|>") == ["One.\n\nStill one.", "Two.", "Three."]
    assert data.read_txt(path, data.BLANK_LINE)[0] == "One."


def test_same_inputs_are_reused_and_a_changed_file_rebuilds(tmp_path, capsys):
    path = write_corpus(tmp_path / "in", "txt", make_stories(200))
    config = settings_for(tmp_path / "out", files=[str(path)])
    first = prepare(config)
    train_bin = tmp_path / "out" / "train.bin"
    stamp = train_bin.stat().st_mtime_ns
    capsys.readouterr()
    assert prepare(config) == first
    assert "up to date" in capsys.readouterr().out
    assert train_bin.stat().st_mtime_ns == stamp

    text = path.read_text()
    path.write_text(text.replace("The end 5.", "The end 5!"))  # same size, one byte different
    second = prepare(config)
    assert "up to date" not in capsys.readouterr().out
    assert second["inputs_sha256"] != first["inputs_sha256"]
    assert second["splits"]["train"]["sha256"] != first["splits"]["train"]["sha256"]


def test_changed_tokenizer_file_or_settings_rebuild(tmp_path, capsys):
    path = write_corpus(tmp_path / "in", "jsonl", make_stories(200))
    config = settings_for(tmp_path / "out", files=[str(path)])
    first = prepare(config)
    tokenizer_file = tmp_path / "out" / "tokenizer.json"
    tokenizer_file.write_text(tokenizer_file.read_text() + "\n")  # same JSON, different bytes
    capsys.readouterr()
    assert prepare(config) == first  # rebuilt, and the build is deterministic
    assert "tokenizer.json is missing or changed" in capsys.readouterr().out
    config.data.tokenizer.vocab_size = 300
    assert prepare(config)["vocab_size"] == 300


ODD_TEXTS = [
    "",
    " leading and trailing spaces  ",
    "tabs\tand\r\nwindows\rline ends\x0b\x0c",
    "\x00\x01\x02\x1b[31m control characters \x7f",
    "ĠĊ Ġ these are byte-level alphabet characters, not spaces",
    "<|endoftext|> inside a story is text",
    "\ufeffBOM, zero\u200bwidth, e\u0301 combining, ﬁ ligature, Ｆｕｌｌ",
    "emoji 👩‍👩‍👧 🇫🇷 and CJK 你好 and RTL שלום",
    bytes(range(256)).decode("latin-1"),
    b"\xc3\x28 \xf0\x28\x8c\xbc \xed\xa0\x80".decode("utf-8", errors="replace"),
    b"\xff\xfe\x00\x01 caf\xe9".decode("cp1252", errors="replace"),
]


@pytest.fixture(scope="module")
def tokenizer(prepared):
    return load_tokenizer(prepared[0])


@pytest.mark.parametrize("text", ODD_TEXTS)
def test_every_byte_survives_a_round_trip(tokenizer, text):
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.token_to_id("<|endoftext|>") not in ids


@settings(max_examples=200, deadline=None)
@given(text=st.text())
def test_round_trip_of_arbitrary_unicode(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


def _never_train(*args, **kwargs):
    raise AssertionError("the tokenizer was trained before the bad input was found")


BAD_INPUTS = {
    "missing file": (lambda d: str(d / "nope.txt"), "data file not found: .*nope.txt"),
    "unknown type": (
        lambda d: _write(d / "stories.csv", "text\nhello\n"),
        r"stories.csv: unknown file type '.csv'",
    ),
    "empty dataset": (
        lambda d: _write(d / "empty.txt", "\n\n  \n"),
        r"no stories in split 'all' .*empty.txt",
    ),
    "no text field": (
        lambda d: _write(d / "s.jsonl", '{"text": "ok"}\n{"story": "x"}\n'),
        r"s.jsonl:2: record has no 'text' field",
    ),
    "text not a string": (
        lambda d: _write(d / "s.jsonl", '{"text": 3}\n'),
        r"s.jsonl:1: field 'text' is int",
    ),
    "broken json": (lambda d: _write(d / "s.jsonl", '{"text": "a"\n'), r"s.jsonl:1: not valid JSON"),
    "no parquet column": (lambda d: _parquet(d / "s.parquet"), r"s.parquet: no column 'text'"),
    "invalid utf-8": (lambda d: _write(d / "s.txt", b"ok\xff\xfe"), r"s.txt: not valid UTF-8 at byte 2"),
}


def _write(path: Path, content) -> str:
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


def _parquet(path: Path) -> str:
    pq.write_table(pa.table({"story": ["x"]}), path)
    return str(path)


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_fails_early_naming_the_file_and_writes_nothing(tmp_path, monkeypatch, case):
    make_file, message = BAD_INPUTS[case]
    monkeypatch.setattr(data, "train_tokenizer", _never_train)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        prepare(settings_for(tmp_path / "out", files=[make_file(tmp_path)]))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tokenizer": TokenizerSpec(vocab_size=70_000)}, "vocab_size=70000 does not fit uint16"),
        ({"split_files": {"train": ["a.txt"]}}, "needs exactly the splits"),
        ({"files": ["a.txt"], "split_files": {"train": ["a.txt"]}}, "both set"),
        ({}, "no input: set data.dataset"),
    ],
)
def test_bad_settings_fail_before_reading(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        prepare(settings_for(tmp_path / "out", **fields))
    assert not (tmp_path / "out").exists()


def test_empty_validation_split_names_its_files(tmp_path, monkeypatch):
    train = write_corpus(tmp_path / "train", "txt", make_stories(20))
    empty = _write(tmp_path / "validation.jsonl", "\n")
    monkeypatch.setattr(data, "train_tokenizer", _never_train)
    with pytest.raises(ValueError, match="no stories in split 'validation'.*validation.jsonl"):
        prepare(settings_for(tmp_path / "out", split_files={"train": [str(train)], "validation": [empty]}))


def test_failure_mid_build_keeps_the_previous_output(tmp_path, monkeypatch):
    path = write_corpus(tmp_path / "in", "txt", make_stories(200))
    config = settings_for(tmp_path / "out", files=[str(path)])
    before = prepare(config)
    listing = sorted(p.name for p in (tmp_path / "out").iterdir())
    path.write_text(path.read_text() + "\n\nOne more story.\n")
    real_encode = data.encode_split

    def fail_on_validation(tokenizer, stories, eot_id, out, *rest):
        if "validation" in out.name:
            raise OSError(28, "No space left on device")
        return real_encode(tokenizer, stories, eot_id, out, *rest)

    monkeypatch.setattr(data, "encode_split", fail_on_validation)
    with pytest.raises(OSError, match="No space left"):
        prepare(config)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == listing  # no temporary files left
    assert load_manifest(tmp_path / "out") == before
    for split in ("train", "validation"):
        open_split(tmp_path / "out", split, verify=True)
    load_tokenizer(tmp_path / "out")


def test_readers_reject_a_damaged_directory(prepared, tmp_path):
    out = tmp_path / "copy"
    out.mkdir()
    for name in ("manifest.json", "tokenizer.json", "train.bin", "validation.bin"):
        (out / name).write_bytes((prepared[0] / name).read_bytes())
    with (out / "train.bin").open("ab") as stream:
        stream.write(b"\x00\x00")
    with pytest.raises(ValueError, match=r"train.bin: .* bytes, but the manifest says"):
        open_split(out, "train")
    with open(out / "validation.bin", "r+b") as stream:
        stream.write(b"\x01\x00")
    with pytest.raises(ValueError, match="validation.bin: sha256 differs"):
        open_split(out, "validation", verify=True)
    (out / "tokenizer.json").write_text((out / "tokenizer.json").read_text() + " ")
    with pytest.raises(ValueError, match="tokenizer.json: sha256 differs"):
        load_tokenizer(out)
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["splits"]["validation"]["tokens"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"manifest.json: splits.validation.tokens missing"):
        load_manifest(out)
    (out / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="manifest.json not found: prepare the data"):
        open_split(out, "train")


def test_sample_batch_is_reproducible_and_targets_are_shifted_inputs():
    tokens = np.arange(1000, dtype=np.uint16)  # position == value, so each row shows its offset
    first = sample_batch(tokens, 8, 16, torch.Generator().manual_seed(1337))
    again = sample_batch(tokens, 8, 16, torch.Generator().manual_seed(1337))
    other = sample_batch(tokens, 8, 16, torch.Generator().manual_seed(1338))
    inputs, targets = first
    assert inputs.shape == targets.shape == (8, 16) and inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs, again[0]) and torch.equal(targets, again[1])
    assert not torch.equal(inputs, other[0])
    assert torch.equal(targets[:, :-1], inputs[:, 1:])
    assert torch.equal(inputs, inputs[:, :1] + torch.arange(16))  # contiguous windows
    assert torch.equal(targets, inputs + 1)


def test_sample_batch_resumes_from_a_saved_generator_state():
    tokens = np.arange(500, dtype=np.uint16)
    generator = torch.Generator().manual_seed(7)
    sample_batch(tokens, 4, 8, generator)
    state = generator.get_state()
    expected = sample_batch(tokens, 4, 8, generator)
    resumed = torch.Generator()
    resumed.set_state(state)
    assert torch.equal(sample_batch(tokens, 4, 8, resumed)[0], expected[0])


def test_sample_batch_reaches_the_last_token_and_rejects_short_splits():
    tokens = np.arange(10, dtype=np.uint16)
    seen = torch.cat([sample_batch(tokens, 64, 4, torch.Generator().manual_seed(s))[1] for s in range(5)])
    assert seen.max() == 9 and seen.min() >= 1
    with pytest.raises(ValueError, match="cannot fill a window"):
        sample_batch(tokens, 1, 10, torch.Generator())


@pytest.mark.parametrize("length", [2, 17, 33, 100, 101])
def test_eval_batches_cover_every_target_once_in_order(length):
    tokens = np.arange(length, dtype=np.uint16)
    batches = list(iter_eval_batches(tokens, batch_size=3, context=8))
    targets = torch.cat([y.flatten() for _, y in batches])
    assert torch.equal(targets, torch.arange(1, length))
    for inputs, y in batches:
        assert torch.equal(y, inputs + 1) and inputs.shape[0] <= 3 and inputs.shape[1] <= 8


@pytest.mark.parametrize("choice", ["tinystories", "local"])
def test_configs_compose_into_the_schema(choice):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="prepare_data", overrides=[f"data={choice}"])
    settings_object = OmegaConf.to_object(cfg)
    assert isinstance(settings_object, PrepareDataSettings)
    assert settings_object.data.tokenizer.vocab_size == 8192
    assert settings_object.data.out_dir == f"data/{choice}"


@pytest.mark.slow  # a subprocess that imports hydra, tokenizers and datasets
def test_script_prepares_and_its_config_then_reads_up_to_date(tmp_path, capsys):
    path = write_corpus(tmp_path / "in", "jsonl", make_stories(150))
    command = [
        sys.executable,
        str(ROOT / "scripts" / "prepare_data.py"),
        "data=local",
        f"data.files=[{path}]",
        f"data.out_dir={tmp_path / 'out'}",
        "data.tokenizer.vocab_size=300",
        "progress=false",
        f"hydra.run.dir={tmp_path / 'hydra'}",
    ]
    printed = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "bytes/token" in printed and "tokens/s" in printed
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="prepare_data", overrides=command[2:-1])
    capsys.readouterr()
    prepare(OmegaConf.to_object(cfg))
    assert "up to date" in capsys.readouterr().out


def test_hub_dataset_path_with_a_local_stand_in(tmp_path, monkeypatch, capsys):
    import datasets

    stories = make_stories(150, seed=3)
    tables = {"train": stories[:140] + ["  \n"], "validation": stories[140:]}
    requests = []

    def fake_load_dataset(name, split, revision):
        requests.append((name, split, revision))
        return datasets.Dataset.from_dict({"text": tables[split], "id": list(range(len(tables[split])))})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(data, "resolve_commit", lambda spec: "c0ffee" * 6 + "beef")
    config = settings_for(tmp_path / "out", dataset="someone/Stories", revision="abc123")
    manifest = prepare(config)
    assert requests == [("someone/Stories", "train", "abc123"), ("someone/Stories", "validation", "abc123")]
    assert manifest["source"]["dataset"] == "someone/Stories" and manifest["source"]["revision"] == "abc123"
    assert manifest["source"]["commit"] == "c0ffee" * 6 + "beef"
    assert manifest["splits"]["train"]["stories"] == 140  # the blank story is dropped
    tokenizer = load_tokenizer(tmp_path / "out")
    pieces = split_stories(np.asarray(open_split(tmp_path / "out", "validation")), manifest["eot_id"])
    assert [tokenizer.decode(p) for p in pieces] == stories[140:]
    capsys.readouterr()
    prepare(config)
    assert "up to date" in capsys.readouterr().out
    config.data.revision = "def456"
    assert prepare(config)["inputs_sha256"] != manifest["inputs_sha256"]


def test_crash_while_renaming_leaves_no_stale_manifest_and_rerun_rebuilds(tmp_path, monkeypatch):
    path = write_corpus(tmp_path / "in", "txt", make_stories(200))
    config = settings_for(tmp_path / "out", files=[str(path)])
    before = prepare(config)
    path.write_text(path.read_text() + "\n\nOne more story.\n")
    real_replace = os.replace

    def crash_before_validation(source, target):
        if Path(target).name == "validation.bin":
            raise KeyboardInterrupt  # killed after train.bin was renamed into place
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", crash_before_validation)
    with pytest.raises(KeyboardInterrupt):
        prepare(config)
    monkeypatch.setattr(os, "replace", real_replace)
    with pytest.raises(FileNotFoundError, match="manifest.json not found"):
        load_manifest(tmp_path / "out")  # the new train.bin is never paired with the old manifest
    after = prepare(config)
    assert after["splits"]["train"]["tokens"] > before["splits"]["train"]["tokens"]
    open_split(tmp_path / "out", "train", verify=True)
