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

from octlm.files import fsync_dir, write_synced

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
    seed: int = 0  # draws the sample
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
    validation_fraction: float = 0.01  # share of `files` stories held out (chosen by a hash of the text)
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
    stories, current = [], []
    for line in text.split("\n"):
        if line.strip() == ("" if separator == BLANK_LINE else separator):
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


def hold_out(stories: list[str], fraction: float) -> dict[str, list[str]]:
    """Split stories into train and validation by a hash of each story's text.

    A story's split depends on its text alone, so adding files never moves old stories between
    splits, and duplicated stories never land on both sides.
    """
    if not 0 < fraction < 1:
        raise ValueError(f"data.validation_fraction must be in (0, 1), got {fraction}")
    threshold = fraction * 2**64
    held = [int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest()) < threshold for s in stories]
    return {
        "train": [s for s, h in zip(stories, held, strict=True) if not h],
        "validation": [s for s, h in zip(stories, held, strict=True) if h],
    }


def load_local(spec: DataSpec, files: dict[str, list[Path]]) -> dict[str, list[str]]:
    """Stories of every split from local files; an empty split is an error naming its files."""
    stories = {
        split: [s for path in paths for s in read_stories(path, spec)] for split, paths in files.items()
    }
    for split, items in stories.items():
        if not items:
            raise ValueError(f"no stories in split {split!r} (files: {[str(p) for p in files[split]]})")
    if "all" not in stories:
        return stories
    held = hold_out(stories["all"], spec.validation_fraction)
    for split, items in held.items():
        if not items:
            raise ValueError(
                f"no {split} stories left after holding out validation_fraction={spec.validation_fraction} "
                f"of {len(stories['all'])} stories (files: {[str(p) for p in files['all']]})"
            )
    return held


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


def resolve_commit(spec: DataSpec) -> str | None:
    """The commit `spec.revision` names on the hub now, or None when the hub cannot be asked."""
    from huggingface_hub import HfApi

    try:
        return HfApi().dataset_info(spec.dataset, revision=spec.revision).sha
    except Exception as err:  # offline, or a cached dataset: the configured revision is all we know
        where = f"{spec.dataset}@{spec.revision or 'main'}"
        print(f"note: could not resolve {where} to a commit ({type(err).__name__}); recording none")
        return None


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
    tokenizer: Tokenizer, stories: Sequence[str], eot_id: int, out: Path, batch_size: int, bar: tqdm
) -> dict:
    """Write every story's ids plus one EOT to `out` as uint16; return tokens, bytes, stories, sha256."""
    digest, tokens, text_bytes, count = hashlib.sha256(), 0, 0, 0
    started = time.perf_counter()
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


# ---------------------------------------------------------------------------------------------------
# Preparing an output directory


class _Staging:
    """Output files written under temporary names, renamed into place together, the manifest last."""

    def __init__(self, out_dir: Path):
        self.out_dir, self.pending = out_dir, {}
        out_dir.mkdir(parents=True, exist_ok=True)

    def path(self, name: str) -> Path:
        self.pending[name] = self.out_dir / f".{name}.tmp-{os.getpid()}"
        return self.pending[name]

    def commit(self, manifest: dict) -> None:
        # Without a manifest the directory reads as "not prepared", so no reader ever pairs the old
        # manifest with new token files while they are being renamed.
        (self.out_dir / MANIFEST).unlink(missing_ok=True)
        fsync_dir(self.out_dir)
        for name, temporary in self.pending.items():
            os.replace(temporary, self.out_dir / name)
        temporary = self.path(MANIFEST)
        write_synced(temporary, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        os.replace(temporary, self.out_dir / MANIFEST)
        fsync_dir(self.out_dir)

    def discard(self) -> None:
        for temporary in self.pending.values():
            temporary.unlink(missing_ok=True)


def _stale_reason(out_dir: Path, inputs_sha256: str) -> str | None:
    """Why `out_dir` must be rebuilt, or None when its manifest, tokenizer and token files all match."""
    if not (out_dir / MANIFEST).is_file():
        return "no manifest yet"
    try:
        manifest = load_manifest(out_dir)
    except ValueError as err:
        return str(err)
    if manifest["inputs_sha256"] != inputs_sha256:
        return "inputs or settings changed"
    tokenizer = out_dir / TOKENIZER
    if not tokenizer.is_file() or file_sha256(tokenizer) != manifest["tokenizer_sha256"]:
        return f"{tokenizer} is missing or changed"
    for entry in manifest["splits"].values():
        path = out_dir / entry["file"]
        if not path.is_file() or path.stat().st_size != entry["tokens"] * TOKEN_DTYPE.itemsize:
            return f"{path} is missing or has the wrong size"
    return None


def _source(spec: DataSpec) -> dict[str, list[Path]] | None:
    """Checked local files, or None for the hub dataset; raises when neither is configured."""
    if spec.files or spec.split_files:
        return local_files(spec)
    if not spec.dataset:
        raise ValueError("no input: set data.dataset (a hub dataset) or data.files / data.split_files")
    return None


def _get_tokenizer(spec: TokenizerSpec, stories: Sequence[str], progress: bool) -> Tokenizer:
    if spec.path is None:
        return train_tokenizer(stories, spec, progress)
    return _configure(Tokenizer.from_file(spec.path), spec.eot, spec.path)


def prepare(settings: PrepareDataSettings) -> dict:
    """Build (or reuse, when its inputs are unchanged) the prepared directory; return its manifest."""
    spec, out_dir = settings.data, Path(settings.data.out_dir)
    check_tokenizer_spec(spec.tokenizer)
    if settings.batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {settings.batch_size}")
    files = _source(spec)
    identity = inputs_identity(spec, files)
    inputs_sha256 = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    reason = "forced" if settings.force else _stale_reason(out_dir, inputs_sha256)
    if reason is None:
        print(f"up to date: {out_dir} (inputs sha256 {inputs_sha256[:12]})")
        return load_manifest(out_dir)
    print(f"building {out_dir}: {reason}")
    stories = load_hub(spec) if files is None else load_local(spec, files)
    staging = _Staging(out_dir)
    try:
        manifest = _build(settings, stories, staging)
        manifest.update(source=identity["source"], tokenizer_settings=identity["tokenizer"])
        if files is None:
            manifest["source"]["commit"] = resolve_commit(spec)
        manifest["inputs_sha256"] = inputs_sha256
        staging.commit(manifest)
    except BaseException:
        staging.discard()
        raise
    return manifest


def _build(settings: PrepareDataSettings, stories: dict[str, Sequence[str]], staging: _Staging) -> dict:
    """Tokenizer and token files under temporary names; the manifest fields describing them."""
    spec = settings.data.tokenizer
    started = time.perf_counter()
    tokenizer = _get_tokenizer(spec, stories["train"], settings.progress)
    print(f"tokenizer: {tokenizer.get_vocab_size():,} tokens ({time.perf_counter() - started:.1f} s)")
    write_synced(staging.path(TOKENIZER), tokenizer.to_str(pretty=True))
    eot_id = tokenizer.token_to_id(spec.eot)
    splits = {}
    for split in SPLITS:
        out = staging.path(f"{split}.bin")
        bar = tqdm(
            total=len(stories[split]), desc=f"encode {split}", unit="story", disable=not settings.progress
        )
        with bar:
            stats = encode_split(tokenizer, stories[split], eot_id, out, settings.batch_size, bar)
        seconds = stats.pop("seconds")
        rate = stats["tokens"] / seconds
        print(f"{split}: {stats['tokens']:,} tokens in {seconds:.2f} s ({rate:,.0f} tokens/s)")
        splits[split] = {"file": f"{split}.bin", **stats}
    return {
        "format": FORMAT,
        "tokenizer_sha256": file_sha256(staging.pending[TOKENIZER]),
        "vocab_size": tokenizer.get_vocab_size(),
        "eot": spec.eot,
        "eot_id": eot_id,
        "splits": splits,
    }


def format_table(manifest: dict) -> str:
    """A small table of stories, tokens, text bytes and bytes per token for each split."""
    rows = [f"{'split':<12}{'stories':>12}{'tokens':>15}{'text bytes':>16}{'bytes/token':>13}"]
    for split, entry in manifest["splits"].items():
        ratio = entry["bytes"] / entry["tokens"]
        rows.append(
            f"{split:<12}{entry['stories']:>12,}{entry['tokens']:>15,}{entry['bytes']:>16,}{ratio:>13.3f}"
        )
    rows.append(f"vocab {manifest['vocab_size']:,}, eot id {manifest['eot_id']}")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------------
# Reading a prepared directory (the training side)

_SPLIT_FIELDS = {"file": str, "tokens": int, "bytes": int, "stories": int, "sha256": str}
_TOP_FIELDS = {
    "tokenizer_sha256": str,
    "vocab_size": int,
    "eot_id": int,
    "splits": dict,
    "inputs_sha256": str,
}
_verified: set[tuple] = set()


def load_manifest(data_dir: str | Path) -> dict:
    """The validated manifest.json of a prepared directory; errors name the file and the field."""
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: prepare the data with scripts/prepare_data.py first")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    _validate_manifest(manifest, path)
    return manifest


def _validate_manifest(manifest, path: Path) -> None:
    def require(ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(f"{path}: {message}")

    require(isinstance(manifest, dict), "not a JSON object")
    require(manifest.get("format") == FORMAT, f"format {manifest.get('format')!r}, expected {FORMAT}")
    for key, kind in _TOP_FIELDS.items():
        require(isinstance(manifest.get(key), kind), f"field {key!r} missing or not {kind.__name__}")
    require(
        0 < manifest["vocab_size"] <= MAX_VOCAB, f"vocab_size {manifest['vocab_size']} does not fit uint16"
    )
    require(
        0 <= manifest["eot_id"] < manifest["vocab_size"], f"eot_id {manifest['eot_id']} outside the vocab"
    )
    for split in SPLITS:
        entry = manifest["splits"].get(split)
        require(isinstance(entry, dict), f"no split {split!r}")
        for key, kind in _SPLIT_FIELDS.items():
            require(isinstance(entry.get(key), kind), f"splits.{split}.{key} missing or not {kind.__name__}")
        require(entry["tokens"] > 0, f"splits.{split}.tokens is {entry['tokens']}")


def open_split(data_dir: str | Path, split: str, verify: bool = False) -> np.memmap:
    """The uint16 token ids (N,) of one split, memory-mapped read-only; `verify` also checks sha256."""
    manifest = load_manifest(data_dir)
    if split not in manifest["splits"]:
        raise ValueError(
            f"{Path(data_dir) / MANIFEST}: no split {split!r} (splits: {sorted(manifest['splits'])})"
        )
    entry = manifest["splits"][split]
    path = Path(data_dir) / entry["file"]
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (listed in {Path(data_dir) / MANIFEST})")
    size, expected = path.stat().st_size, entry["tokens"] * TOKEN_DTYPE.itemsize
    if size != expected:
        raise ValueError(
            f"{path}: {size:,} bytes, but the manifest says {entry['tokens']:,} tokens ({expected:,} bytes)"
        )
    if verify:
        _verify(path, entry["sha256"])
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r")


def _verify(path: Path, sha256: str) -> None:
    """Check a file's sha256 once per process for each (path, size, mtime)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, sha256)
    if key in _verified:
        return
    if file_sha256(path) != sha256:
        raise ValueError(f"{path}: sha256 differs from the manifest; the file changed since it was prepared")
    _verified.add(key)


def load_tokenizer(data_dir: str | Path) -> Tokenizer:
    """The prepared tokenizer.json, checked against the manifest's sha256, vocab size and EOT id."""
    manifest = load_manifest(data_dir)
    path = Path(data_dir) / TOKENIZER
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (listed in {Path(data_dir) / MANIFEST})")
    if file_sha256(path) != manifest["tokenizer_sha256"]:
        raise ValueError(f"{path}: sha256 differs from the manifest; re-run scripts/prepare_data.py")
    tokenizer = _configure(Tokenizer.from_file(str(path)), manifest.get("eot", "<|endoftext|>"), str(path))
    if tokenizer.get_vocab_size() != manifest["vocab_size"]:
        raise ValueError(
            f"{path}: vocab size {tokenizer.get_vocab_size()} != manifest {manifest['vocab_size']}"
        )
    if tokenizer.token_to_id(manifest.get("eot", "<|endoftext|>")) != manifest["eot_id"]:
        raise ValueError(f"{path}: end-of-text id differs from the manifest's eot_id {manifest['eot_id']}")
    return tokenizer


def bytes_per_token(data_dir: str | Path, split: str = "validation") -> float:
    """UTF-8 text bytes per token of a split (EOT tokens included in the token count)."""
    entry = load_manifest(data_dir)["splits"][split]
    return entry["bytes"] / entry["tokens"]


def sample_batch(
    tokens: np.ndarray, batch_size: int, context: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets (B, T) int64 from B random windows; targets are inputs shifted by one."""
    if len(tokens) < context + 1:
        raise ValueError(f"{len(tokens)} tokens cannot fill a window of context {context} plus one target")
    starts = torch.randint(len(tokens) - context, (batch_size,), generator=generator)
    rows = np.stack([tokens[start : start + context + 1] for start in starts.tolist()])
    window = torch.from_numpy(rows.astype(np.int64))  # (B, T + 1)
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def iter_eval_batches(
    tokens: np.ndarray, batch_size: int, context: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive windows (B, T) in order, so every token after the first is a target exactly once.

    Full windows come in batches of up to `batch_size`; a final (1, T') batch holds the remainder.
    """
    full = (len(tokens) - 1) // context
    for first in range(0, full, batch_size):
        starts = range(first * context, min(first + batch_size, full) * context, context)
        rows = np.stack([tokens[start : start + context + 1] for start in starts])
        window = torch.from_numpy(rows.astype(np.int64))
        yield window[:, :-1].contiguous(), window[:, 1:].contiguous()
    if full * context < len(tokens) - 1:
        window = torch.from_numpy(np.asarray(tokens[full * context :], dtype=np.int64))[None]
        yield window[:, :-1].contiguous(), window[:, 1:].contiguous()
