"""Data preparation and loading: stories -> byte-level BPE tokenizer -> uint16 token files + manifest.

Output directory layout (written by `prepare`, read by `load_manifest`, `open_split`, `load_tokenizer`):
  tokenizer.json   byte-level BPE, no normaliser, `<|endoftext|>` (EOT) special token
  train.bin        uint16 little-endian token ids, every story followed by one EOT
  validation.bin   same layout
  manifest.json    counts and hashes, written last: its presence means the other files are complete
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

FORMAT = 1
SPLITS = ("train", "validation")
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
TOKEN_DTYPE = np.dtype("<u2")  # uint16 little-endian, whatever the machine's byte order
MAX_VOCAB = 2**16
SUFFIXES = (".txt", ".jsonl", ".parquet")
BLANK_LINE = "blank_line"


@dataclass
class TokenizerSpec:
    """How the byte-level BPE tokenizer is made (or which existing one is reused)."""

    vocab_size: int = 8192
    eot: str = "<|endoftext|>"
    sample_stories: int = 100_000  # train-split stories the BPE merges are learned from
    seed: int = 0
    min_frequency: int = 2
    path: str | None = None  # an existing tokenizer.json to use instead of training one


@dataclass
class DataSpec:
    """Where stories come from (a hub dataset or local files) and where the prepared data goes."""

    name: str = "custom"
    dataset: str | None = None  # Hugging Face dataset repository, used when no local files are given
    revision: str | None = None  # branch, tag or commit of that repository; a commit makes reuse exact
    text_field: str = "text"  # column of the hub dataset / parquet files, key of the JSONL records
    files: list[str] = field(default_factory=list)  # local files (globs allowed); validation held out
    split_files: dict[str, list[str]] = field(default_factory=dict)  # {train: [...], validation: [...]}
    validation_fraction: float = 0.01  # share of `files` stories held out (seeded by tokenizer.seed)
    separator: str = BLANK_LINE  # .txt stories: split at blank lines, or at lines equal to this text
    out_dir: str = "data/custom"
    tokenizer: TokenizerSpec = field(default_factory=TokenizerSpec)


@dataclass
class PrepareDataSettings:
    """Primary config of scripts/prepare_data.py."""

    data: DataSpec = field(default_factory=DataSpec)
    batch_size: int = 1024  # stories per encode_batch call
    force: bool = False  # rebuild even when the manifest says the output is up to date
    progress: bool = True


# ---------------------------------------------------------------------------------------------------
# Reading stories


def _clean(text: str) -> str | None:
    """A story without surrounding whitespace, or None when nothing is left."""
    text = text.strip()
    return text or None


def read_txt(path: Path, separator: str) -> list[str]:
    """Stories of a UTF-8 text file, split at blank lines or at lines equal to `separator`."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not valid UTF-8 at byte {err.start} ({err.reason})") from None
    if separator == BLANK_LINE:
        lines = [line if line.strip() else "\x00SEP" for line in text.split("\n")]
        separator = "\x00SEP"
    else:
        lines = text.split("\n")
    stories, current = [], []
    for line in lines:
        if line.strip() == separator:
            stories.append("\n".join(current))
            current = []
        else:
            current.append(line)
    stories.append("\n".join(current))
    return [s for s in map(_clean, stories) if s is not None]


def read_jsonl(path: Path, text_field: str) -> list[str]:
    """The `text_field` string of every JSON object line; a line without it is an error naming it."""
    stories = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from None
            if not isinstance(record, dict) or text_field not in record:
                raise ValueError(f"{path}:{number}: record has no {text_field!r} field")
            if not isinstance(record[text_field], str):
                kind = type(record[text_field]).__name__
                raise ValueError(f"{path}:{number}: field {text_field!r} is {kind}, not a string")
            story = _clean(record[text_field])
            if story is not None:
                stories.append(story)
    return stories


def read_parquet(path: Path, text_field: str) -> list[str]:
    """The `text_field` column of a parquet file; a missing column or a null is an error naming it."""
    import pyarrow.parquet as pq

    names = pq.read_schema(path).names
    if text_field not in names:
        raise ValueError(f"{path}: no column {text_field!r} (columns: {names})")
    column = pq.read_table(path, columns=[text_field]).column(text_field).to_pylist()
    for row, value in enumerate(column):
        if not isinstance(value, str):
            raise ValueError(f"{path}: row {row} of column {text_field!r} is {type(value).__name__}")
    return [s for s in map(_clean, column) if s is not None]


def read_stories(path: Path, spec: DataSpec) -> list[str]:
    """Stories of one local .txt, .jsonl or .parquet file."""
    if path.suffix == ".txt":
        return read_txt(path, spec.separator)
    if path.suffix == ".jsonl":
        return read_jsonl(path, spec.text_field)
    return read_parquet(path, spec.text_field)


def _expand(pattern: str) -> list[Path]:
    if glob.has_magic(pattern):
        matches = sorted(glob.glob(pattern, recursive=True))
        if not matches:
            raise FileNotFoundError(f"no data file matches {pattern!r}")
        return [Path(p) for p in matches]
    return [Path(pattern)]


def _check_file(path: Path) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    if path.suffix not in SUFFIXES:
        raise ValueError(f"{path}: unknown file type {path.suffix!r} (expected one of {SUFFIXES})")
    return path


def local_files(spec: DataSpec) -> dict[str, list[Path]]:
    """Checked local input files, keyed by split ("all" when validation is held out of `files`)."""
    if spec.files and spec.split_files:
        raise ValueError("data.files and data.split_files are both set; use one")
    groups = {"all": list(spec.files)} if spec.files else dict(spec.split_files)
    if not spec.files and set(groups) != set(SPLITS):
        raise ValueError(f"data.split_files needs exactly the splits {SPLITS}, got {sorted(groups)}")
    found = {}
    for split, patterns in groups.items():
        if not patterns:
            raise ValueError(f"data.split_files.{split} lists no files")
        found[split] = [_check_file(p) for pattern in patterns for p in _expand(pattern)]
    return found


def hold_out(stories: list[str], fraction: float, seed: int) -> dict[str, list[str]]:
    """Split stories into train and validation, drawing validation stories with a seeded generator."""
    if not 0 < fraction < 1:
        raise ValueError(f"data.validation_fraction must be in (0, 1), got {fraction}")
    if len(stories) < 2:
        raise ValueError(f"{len(stories)} stories cannot be split into train and validation")
    count = min(len(stories) - 1, max(1, round(len(stories) * fraction)))
    chosen = np.zeros(len(stories), dtype=bool)
    chosen[np.random.default_rng(seed).choice(len(stories), count, replace=False)] = True
    return {
        "train": [s for s, held in zip(stories, chosen, strict=True) if not held],
        "validation": [s for s, held in zip(stories, chosen, strict=True) if held],
    }


def load_local(spec: DataSpec, files: dict[str, list[Path]]) -> dict[str, list[str]]:
    """Stories of every split from local files; an empty split is an error naming its files."""
    stories = {
        split: [s for path in paths for s in read_stories(path, spec)] for split, paths in files.items()
    }
    for split, items in stories.items():
        if not items:
            raise ValueError(f"no stories in split {split!r} (files: {[str(p) for p in files[split]]})")
    if "all" in stories:
        return hold_out(stories["all"], spec.validation_fraction, spec.tokenizer.seed)
    return stories


class HubColumn(Sequence):
    """The text column of a `datasets.Dataset`, read lazily (memory-mapped Arrow) and cleaned per story."""

    def __init__(self, dataset, text_field: str, where: str):
        if text_field not in dataset.column_names:
            raise ValueError(f"{where}: no column {text_field!r} (columns: {dataset.column_names})")
        self.dataset, self.text_field, self.where = dataset, text_field, where

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        if isinstance(index, slice):
            values = self.dataset[index][self.text_field]
            return [self._check(v, index.start or 0) for v in values]
        return self._check(self.dataset[index][self.text_field], index)

    def _check(self, value, row: int) -> str:
        if not isinstance(value, str):
            raise ValueError(f"{self.where}: a value of {self.text_field!r} near row {row} is not a string")
        return value.strip()


def load_hub(spec: DataSpec) -> dict[str, HubColumn]:
    """Train and validation text columns of a Hugging Face dataset."""
    import datasets

    loaded = {}
    for split in SPLITS:
        dataset = datasets.load_dataset(spec.dataset, split=split, revision=spec.revision)
        where = f"{spec.dataset}@{spec.revision or 'main'}[{split}]"
        if len(dataset) == 0:
            raise ValueError(f"{where}: the split is empty")
        loaded[split] = HubColumn(dataset, spec.text_field, where)
    return loaded


# ---------------------------------------------------------------------------------------------------
# Identity, tokenizer, encoding


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes, read in 8 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while block := stream.read(1 << 23):
            digest.update(block)
    return digest.hexdigest()


def inputs_identity(spec: DataSpec, files: dict[str, list[Path]] | None) -> dict:
    """Everything that decides the prepared bytes: input contents (or hub name and revision), settings."""
    if files is None:
        source = {"dataset": spec.dataset, "revision": spec.revision, "text_field": spec.text_field}
    else:
        source = {
            split: [{"path": str(p), "sha256": file_sha256(p)} for p in paths]
            for split, paths in files.items()
        }
        source.update(text_field=spec.text_field, separator=spec.separator)
        if "all" in files:
            source["validation_fraction"] = spec.validation_fraction
    tokenizer = asdict(spec.tokenizer)
    if spec.tokenizer.path is not None:
        tokenizer["path_sha256"] = file_sha256(_check_tokenizer_path(spec.tokenizer.path))
    return {"format": FORMAT, "source": source, "tokenizer": tokenizer}


def _check_tokenizer_path(path: str) -> Path:
    if not Path(path).is_file():
        raise FileNotFoundError(f"data.tokenizer.path: tokenizer file not found: {path}")
    return Path(path)


def check_tokenizer_spec(spec: TokenizerSpec) -> None:
    """Raise before any work when the tokenizer settings cannot give uint16 token files."""
    if spec.vocab_size > MAX_VOCAB:
        raise ValueError(f"data.tokenizer.vocab_size={spec.vocab_size} does not fit uint16 (max {MAX_VOCAB})")
    if spec.vocab_size < 257:
        raise ValueError(f"data.tokenizer.vocab_size={spec.vocab_size} is below 256 bytes + the EOT token")
    if spec.sample_stories < 1:
        raise ValueError(f"data.tokenizer.sample_stories must be positive, got {spec.sample_stories}")


def new_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE: no normaliser, no prefix space, so every byte round-trips."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_tokenizer(stories: Sequence[str], spec: TokenizerSpec, progress: bool = False) -> Tokenizer:
    """Learn BPE merges on a seeded sample of `stories`; EOT is the special token with id 0."""
    count = min(spec.sample_stories, len(stories))
    picked = np.sort(np.random.default_rng(spec.seed).choice(len(stories), count, replace=False))
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        min_frequency=spec.min_frequency,
        special_tokens=[spec.eot],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tokenizer = new_tokenizer()
    tokenizer.train_from_iterator((stories[int(i)] for i in picked), trainer, length=count)
    tokenizer.encode_special_tokens = True
    return tokenizer


def _configure(tokenizer: Tokenizer, eot: str, where: str) -> Tokenizer:
    """Check a loaded tokenizer fits uint16 and has the EOT token; make special-token text plain text."""
    if tokenizer.get_vocab_size() > MAX_VOCAB:
        raise ValueError(f"{where}: vocabulary of {tokenizer.get_vocab_size()} does not fit uint16")
    if tokenizer.token_to_id(eot) is None:
        raise ValueError(f"{where}: no end-of-text token {eot!r}")
    # A story that contains the literal text "<|endoftext|>" must stay text, not become an EOT id.
    tokenizer.encode_special_tokens = True
    return tokenizer


def encode_split(
    tokenizer: Tokenizer, stories: Sequence[str], eot_id: int, out: Path, batch_size: int, progress: bool
) -> dict:
    """Write every story's ids plus one EOT to `out` as uint16; return tokens, bytes, stories, sha256."""
    digest, tokens, text_bytes, count = hashlib.sha256(), 0, 0, 0
    started = time.perf_counter()
    bar = tqdm(
        total=len(stories), desc=f"encode {out.name.split('.')[1]}", unit="story", disable=not progress
    )
    with open(out, "wb") as stream:
        for start in range(0, len(stories), batch_size):
            batch = [s for s in stories[start : start + batch_size] if s]
            encodings = tokenizer.encode_batch_fast(batch, add_special_tokens=False)
            ids = np.fromiter(_with_eot(encodings, eot_id), dtype=np.int64)
            chunk = ids.astype(TOKEN_DTYPE).tobytes()
            stream.write(chunk)
            digest.update(chunk)
            tokens, count = tokens + ids.size, count + len(batch)
            text_bytes += sum(len(s.encode()) for s in batch)
            bar.update(min(batch_size, len(stories) - start))
            bar.set_postfix(tok_per_s=f"{tokens / (time.perf_counter() - started):,.0f}", refresh=False)
        stream.flush()
        os.fsync(stream.fileno())
    bar.close()
    seconds = time.perf_counter() - started
    return {
        "tokens": tokens,
        "bytes": text_bytes,
        "stories": count,
        "sha256": digest.hexdigest(),
        "seconds": seconds,
    }


def _with_eot(encodings, eot_id: int) -> Iterator[int]:
    for encoding in encodings:
        yield from encoding.ids
        yield eot_id
