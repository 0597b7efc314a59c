"""Model snapshots: a pinned Hugging Face download or a local directory, verified before any tensor is read.

Every file the loader reads (config.json, generation_config.json, tokenizer.json, tokenizer_config.json and
the weights: model.safetensors, or model.safetensors.index.json and its shards) is checked for size and
SHA-256 against, in order of preference:

1. a pinned manifest shipped in octlm/manifests/ for the spec's repo@revision (official files only);
2. the Hub's own metadata (LFS SHA-256, or git blob id for small files) right after a download;
3. the directory's stored manifest, `octlm-manifest.json` beside the files (or, where the directory is
   read-only, in octlm's cache: $OCTLM_CACHE or ~/.cache/octlm, under manifests/).

A local directory with none of these is trusted on first use: the required files must exist, JSON files
must parse and every weight file must pass the safetensors header validation; then their hashes are
recorded in a new manifest that later loads are checked against. Hash results are cached by (path, size,
mtime, ctime, inode) in octlm's cache, so a repeated load does not re-read 1.5 GB.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from octlm.files import atomic_write
from octlm.safetensors import SafetensorsFile

REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
OPTIONAL_FILES = ("generation_config.json",)
SINGLE_WEIGHTS = "model.safetensors"
WEIGHT_INDEX = "model.safetensors.index.json"
MANIFEST_NAME = "octlm-manifest.json"
MANIFEST_FORMAT = "octlm-snapshot-manifest/1"
PINNED_DIR = Path(__file__).parent / "manifests"
HASH_CHUNK = 8 * 1024 * 1024
RACY_NS = 2_000_000_000  # a cached hash counts only for files last changed this long before hashing


class SnapshotError(ValueError):
    """A snapshot that cannot be found, downloaded or verified; the message says what to do."""


@dataclass(frozen=True)
class Expected:
    """What one file must be: its size and a SHA-256, or the git blob id the Hub reports for small files."""

    size: int
    sha256: str | None = None
    git_sha1: str | None = None


def resolve_snapshot(spec: Any, cache_dir: str | None = None) -> Path:
    """The verified snapshot directory of a model spec (fields repo, revision, path): local or downloaded."""
    repo, revision, path = (getattr(spec, name, None) for name in ("repo", "revision", "path"))
    if path:
        directory = Path(path).expanduser()
        if not directory.is_dir():
            raise SnapshotError(f"model.path={path}: no such directory")
    elif repo:
        directory = _fetch(repo, revision, cache_dir)
    else:
        raise SnapshotError("the model spec has neither model.path nor model.repo: there is nothing to load")
    verify_snapshot(directory, repo, revision)
    return directory


def verify_snapshot(directory: str | Path, repo: str | None = None, revision: str | None = None) -> dict:
    """Check every file against the best manifest available (see module doc); return a summary.

    The summary has directory, manifest (where the expected hashes came from), files (name, size,
    sha256, ok) and ok. Any problem raises SnapshotError listing every bad file and what to do.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise SnapshotError(f"{directory}: snapshot directory does not exist")
    expected, origin = _expected_files(directory, repo, revision)
    if expected is None:
        return _record_first_use(directory, repo, revision)
    actual = _check_against(directory, expected, origin)
    _require_covered(directory, expected, origin)
    weight_files(directory)  # index structure and shard contents, now that the bytes are the expected ones
    if origin.startswith("pinned") and not any(path.is_file() for path in _manifest_locations(directory)):
        _write_manifest(directory, repo, revision, origin, actual)  # later checks without repo@revision
    return _summary(directory, origin, expected, actual)


def weight_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a snapshot: the index's shards (validated) or [model.safetensors]."""
    directory = Path(directory)
    index = directory / WEIGHT_INDEX
    if index.is_file():
        return _check_shards(directory, index, read_weight_map(index))
    single = directory / SINGLE_WEIGHTS
    if single.is_file():
        return [single]
    raise SnapshotError(
        f"{directory}: no {SINGLE_WEIGHTS} and no {WEIGHT_INDEX}; this is not a weights snapshot"
    )


def read_weight_map(index: Path) -> dict[str, str]:
    """The weight_map of a model.safetensors.index.json: tensor name -> shard file name."""
    data = _read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise SnapshotError(f"{index}: needs a non-empty 'weight_map' object of tensor name -> shard file")
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or not _is_plain_name(shard):
            raise SnapshotError(
                f"{index}: weight_map[{tensor!r}] must be a file name in the snapshot, got {shard!r}"
            )
    return weight_map


def describe_check(summary: dict) -> list[str]:
    """Printable lines for a verify_snapshot summary: one per file, then where the hashes came from."""
    lines = [
        f"  {item['name']:<34} {item['size']:>15,} B  sha256 {item['sha256'][:16]}  "
        + ("ok" if item["ok"] else "BAD")
        for item in summary["files"]
    ]
    return [*lines, f"verified against {summary['manifest']}"]


def _check_shards(directory: Path, index: Path, weight_map: dict[str, str]) -> list[Path]:
    """Every shard exists and holds exactly the tensors the index assigns to it."""
    listed: dict[str, set[str]] = {}
    for tensor, shard in weight_map.items():
        listed.setdefault(shard, set()).add(tensor)
    shards = []
    for shard in sorted(listed):
        path = directory / shard
        if not path.is_file():
            raise SnapshotError(f"{index}: shard {shard} is missing from {directory}; download it again")
        try:
            with SafetensorsFile(path) as file:
                stored = set(file.entries)
        except ValueError as error:
            raise SnapshotError(f"{error}; delete {path} and download it again") from None
        _require_same_tensors(index, path, listed[shard], stored)
        shards.append(path)
    return shards


def _require_same_tensors(index: Path, shard: Path, listed: set[str], stored: set[str]) -> None:
    missing, unlisted = sorted(listed - stored), sorted(stored - listed)
    if missing:
        raise SnapshotError(f"{index}: lists {missing[0]!r} in {shard.name}, which does not contain it")
    if unlisted:
        raise SnapshotError(f"{shard}: holds {unlisted[0]!r}, which {index.name} does not list for it")


def _is_plain_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and Path(name).name == name and "\\" not in name


# ---- downloading ----------------------------------------------------------------------------------


def _fetch(repo: str, revision: str | None, cache_dir: str | None) -> Path:
    """Download repo@revision's needed files (progress bar by huggingface_hub) and check them vs the Hub."""
    import huggingface_hub as hub
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    if _offline():
        return _cached_snapshot(repo, revision, cache_dir, "HF_HUB_OFFLINE is set")
    try:
        remote = _remote_files(hub, repo, revision, cache_dir)
        directory = Path(
            hub.snapshot_download(repo, revision=revision, cache_dir=cache_dir, allow_patterns=sorted(remote))
        )
    except (RepositoryNotFoundError, RevisionNotFoundError) as error:
        first_line = str(error).splitlines()[0]
        raise SnapshotError(f"{repo}@{revision}: {first_line}; check model.repo and model.revision") from None
    except _network_errors() as error:
        reason = f"the Hub is unreachable ({type(error).__name__}: {error})"
    else:
        actual = _check_against(directory, remote, f"the Hub's metadata for {repo}@{revision}")
        _write_manifest(directory, repo, revision, "hub", actual)
        return directory
    return _cached_snapshot(repo, revision, cache_dir, reason)  # outside the handler: no chained traceback


def _remote_files(hub, repo: str, revision: str | None, cache_dir: str | None) -> dict[str, Expected]:
    """Size and hash of every needed file, from the Hub's file metadata."""
    api = hub.HfApi()
    wanted = [*REQUIRED_FILES, *OPTIONAL_FILES, SINGLE_WEIGHTS, WEIGHT_INDEX]
    infos = _expected_from_infos(api.get_paths_info(repo, wanted, revision=revision))
    missing = [name for name in REQUIRED_FILES if name not in infos]
    if missing:
        raise SnapshotError(
            f"{repo}@{revision} has no {missing[0]}; it is not a model snapshot octlm can load"
        )
    if WEIGHT_INDEX in infos:
        infos.pop(SINGLE_WEIGHTS, None)  # the index wins, as in transformers
        index = Path(hub.hf_hub_download(repo, WEIGHT_INDEX, revision=revision, cache_dir=cache_dir))
        shards = sorted(set(read_weight_map(index).values()))
        infos.update(_expected_from_infos(api.get_paths_info(repo, shards, revision=revision)))
        absent = [shard for shard in shards if shard not in infos]
        if absent:
            raise SnapshotError(f"{repo}@{revision}: {WEIGHT_INDEX} names {absent[0]}, which the repo lacks")
    elif SINGLE_WEIGHTS not in infos:
        raise SnapshotError(f"{repo}@{revision} has neither {SINGLE_WEIGHTS} nor {WEIGHT_INDEX}")
    return infos


def _expected_from_infos(infos) -> dict[str, Expected]:
    """Expected entries from huggingface_hub RepoFile objects (folders have no size and are skipped)."""
    result = {}
    for info in infos:
        size = getattr(info, "size", None)
        if size is None:
            continue
        lfs = getattr(info, "lfs", None)
        sha256 = lfs.sha256 if lfs is not None else None
        result[info.path] = Expected(size=size, sha256=sha256, git_sha1=None if sha256 else info.blob_id)
    return result


def _cached_snapshot(repo: str, revision: str | None, cache_dir: str | None, reason: str) -> Path:
    """The snapshot already in the Hugging Face cache, or one SnapshotError saying how to provide one."""
    import huggingface_hub as hub

    try:
        return Path(
            hub.snapshot_download(repo, revision=revision, cache_dir=cache_dir, local_files_only=True)
        )
    except (OSError, ValueError):
        pass
    where = cache_dir or "the Hugging Face cache (HF_HOME)"
    raise SnapshotError(
        f"cannot load {repo}@{revision}: {reason}, and {where} holds no copy of it.\n"
        "Provide the snapshot one of two ways:\n"
        "  - point at a directory holding config.json, tokenizer.json, tokenizer_config.json and\n"
        "    model.safetensors (or model.safetensors.index.json and its shards):\n"
        "    model.path=/dir/with/config.json\n"
        "  - or run once with network access (HF_HUB_OFFLINE unset) to download it."
    )


def _offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE", "")
    return bool(constants.HF_HUB_OFFLINE) or flag.upper() in {"1", "ON", "YES", "TRUE"}


def _network_errors() -> tuple[type[BaseException], ...]:
    """Exception types a failed connection raises, whichever HTTP client this huggingface_hub uses."""
    errors: list[type[BaseException]] = [OSError]  # requests' errors and OfflineModeIsEnabled are OSErrors
    for module in ("httpx2", "httpx"):
        try:
            errors.append(importlib.import_module(module).HTTPError)
        except (ImportError, AttributeError):
            continue
    return tuple(errors)


# ---- manifests ------------------------------------------------------------------------------------


def _expected_files(directory: Path, repo: str | None, revision: str | None) -> tuple[dict | None, str]:
    """(expected files, where they came from): the pinned manifest, the stored one, or (None, '')."""
    pinned = _pinned_manifest_path(repo, revision)
    if pinned is not None:
        return _read_manifest(pinned), f"pinned {repo}@{revision} ({pinned.name})"
    for path in _manifest_locations(directory):
        if path.is_file():
            return _read_manifest(path), str(path)
    return None, ""


def _pinned_manifest_path(repo: str | None, revision: str | None) -> Path | None:
    if not repo or not revision:
        return None
    path = PINNED_DIR / f"{repo.replace('/', '__')}__{revision}.json"
    return path if path.is_file() else None


def _manifest_locations(directory: Path) -> list[Path]:
    """Beside the files first; octlm's cache for directories that cannot be written (Kaggle inputs)."""
    key = hashlib.sha256(str(directory.resolve()).encode()).hexdigest()[:24]
    return [directory / MANIFEST_NAME, cache_root() / "manifests" / f"{key}.json"]


def _read_manifest(path: Path) -> dict[str, Expected]:
    """The files of a manifest, validated; a damaged manifest says to delete it."""
    data = _read_json(path)
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
        raise SnapshotError(f"{path}: not an {MANIFEST_FORMAT} manifest; delete it to record a new one")
    expected = {}
    for name, item in files.items():
        size, sha256 = (item.get("size"), item.get("sha256")) if isinstance(item, dict) else (None, None)
        if not _is_plain_name(name) or not isinstance(size, int) or not _is_sha256(sha256):
            raise SnapshotError(f"{path}: entry {name!r} needs a size and a sha256; delete the manifest")
        expected[name] = Expected(size=size, sha256=sha256)
    return expected


def _write_manifest(
    directory: Path, repo: str | None, revision: str | None, source: str, files: dict
) -> Path:
    """Record {name: {size, sha256}} beside the files, or in octlm's cache when that is read-only."""
    manifest = {
        "format": MANIFEST_FORMAT,
        "repo": repo,
        "revision": revision,
        "source": source,
        "recorded": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "files": {name: files[name] for name in sorted(files)},
    }
    text = json.dumps(manifest, indent=2) + "\n"
    beside, in_cache = _manifest_locations(directory)
    try:
        atomic_write(beside, text)
        return beside
    except OSError:
        atomic_write(in_cache, text)
        return in_cache


def _record_first_use(directory: Path, repo: str | None, revision: str | None) -> dict:
    """Structural checks of a directory with no manifest, then hash its files and record a manifest."""
    names = _needed_files(directory)
    for name in names:
        if name.endswith(".json"):
            _read_json(directory / name)
    for path in weight_files(directory):
        try:
            SafetensorsFile(path).close()
        except ValueError as error:
            raise SnapshotError(f"{error}; replace {path} with an intact copy") from None
    actual = _hash_all(directory, names, git=set())
    files = {name: {"size": item["size"], "sha256": item["sha256"]} for name, item in actual.items()}
    where = _write_manifest(directory, repo, revision, "local (recorded on first use)", files)
    expected = {name: Expected(**files[name]) for name in files}
    return _summary(directory, f"{where} (recorded now)", expected, actual)


def _needed_files(directory: Path) -> list[str]:
    """Names of every file the loader reads from this directory; missing required ones are an error."""
    missing = [name for name in REQUIRED_FILES if not (directory / name).is_file()]
    if missing:
        raise SnapshotError(f"{directory}: {missing[0]} is missing; copy the complete snapshot into it")
    names = [*REQUIRED_FILES, *(name for name in OPTIONAL_FILES if (directory / name).is_file())]
    if (directory / WEIGHT_INDEX).is_file():
        names.append(WEIGHT_INDEX)
        names += sorted(set(read_weight_map(directory / WEIGHT_INDEX).values()))
    elif (directory / SINGLE_WEIGHTS).is_file():
        names.append(SINGLE_WEIGHTS)
    else:
        raise SnapshotError(
            f"{directory}: no {SINGLE_WEIGHTS} and no {WEIGHT_INDEX}; copy the weights into it"
        )
    return names


def _require_covered(directory: Path, expected: dict[str, Expected], origin: str) -> None:
    """Every file the loader will read must be one the manifest vouches for."""
    unlisted = [name for name in _needed_files(directory) if name not in expected]
    if unlisted:
        raise SnapshotError(
            f"{directory / unlisted[0]}: not recorded in {origin}; remove the file, or delete the manifest "
            "to record the directory as it is now"
        )


def _check_against(directory: Path, expected: dict[str, Expected], origin: str) -> dict[str, dict]:
    """Size then hash of every expected file; raise one SnapshotError listing every bad file."""
    problems = []
    for name, want in expected.items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{path}: missing; {_advice(path)}")
        elif path.stat().st_size != want.size:
            got = path.stat().st_size
            hint = " (truncated?)" if got < want.size else ""
            problems.append(f"{path}: {got:,} bytes, expected {want.size:,}{hint}; {_advice(path)}")
    if problems:
        raise _mismatch(origin, problems)
    actual = _hash_all(directory, list(expected), git={n for n, e in expected.items() if e.sha256 is None})
    for name, want in expected.items():
        got, path = actual[name], directory / name
        if want.sha256 is not None and got["sha256"] != want.sha256:
            problems.append(f"{path}: sha256 {got['sha256']}, expected {want.sha256}; {_advice(path)}")
        if want.git_sha1 is not None and got["git_sha1"] != want.git_sha1:
            problems.append(f"{path}: git blob {got['git_sha1']}, expected {want.git_sha1}; {_advice(path)}")
    if problems:
        raise _mismatch(origin, problems)
    return {name: {"size": item["size"], "sha256": item["sha256"]} for name, item in actual.items()}


def _mismatch(origin: str, problems: list[str]) -> SnapshotError:
    message = f"snapshot does not match {origin}:\n  " + "\n  ".join(problems)
    if origin.startswith("pinned"):
        message += (
            "\nIf this directory holds other weights on purpose, set model.revision=null: its own manifest"
            " is then recorded and checked instead."
        )
    return SnapshotError(message)


def _advice(path: Path) -> str:
    real = path.resolve()
    if real != path.absolute():  # a Hugging Face cache link: the blob it points to must go too
        return f"delete {path} and the blob it links to ({real}) and run again to download it"
    return f"delete {path} and download or copy it again (or set model.path to an intact snapshot)"


def _summary(directory: Path, origin: str, expected: dict[str, Expected], actual: dict[str, dict]) -> dict:
    files = [
        {"name": name, "size": actual[name]["size"], "sha256": actual[name]["sha256"], "ok": True}
        for name in sorted(expected)
    ]
    return {"directory": str(directory), "manifest": origin, "files": files, "ok": True}


# ---- hashing with a cache -------------------------------------------------------------------------


def cache_root() -> Path:
    """octlm's own cache directory: $OCTLM_CACHE, else $XDG_CACHE_HOME/octlm, else ~/.cache/octlm."""
    if os.environ.get("OCTLM_CACHE"):
        return Path(os.environ["OCTLM_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")).expanduser() / "octlm"


def _hash_all(directory: Path, names: list[str], git: set[str]) -> dict[str, dict]:
    """{name: {size, sha256, git_sha1}}: cached SHA-256s reused, the rest hashed under one progress bar."""
    cache_path = cache_root() / "hashes.json"
    cache = _load_hash_cache(cache_path)
    results, todo = {}, []
    for name in names:
        path = directory / name
        stamp = _stamp(path)
        sha256 = None if name in git else _trusted_hash(cache.get(str(path.resolve())), stamp)
        if sha256 is None:
            todo.append(name)
        else:
            results[name] = {"size": stamp[0], "sha256": sha256, "git_sha1": None}
    total = sum((directory / name).stat().st_size for name in todo)
    with tqdm(total=total, unit="B", unit_scale=True, desc="sha256", disable=None if total else True) as bar:
        for name in todo:
            path = directory / name
            stamp, started = _stamp(path), time.time_ns()
            results[name] = _hash_file(path, bar, name in git)
            entry = {"stamp": stamp, "hashed_at": started, "sha256": results[name]["sha256"]}
            cache[str(path.resolve())] = entry
    if todo:
        _save_hash_cache(cache_path, cache)
    return {name: results[name] for name in names}


def _trusted_hash(entry: object, stamp: list[int]) -> str | None:
    """The cached SHA-256 if the file is unchanged since hashing, else None.

    As in git's "racy" check, a file changed less than RACY_NS before it was hashed could change again
    within the file system's timestamp granularity without changing its stamp, so it is not trusted.
    """
    if not isinstance(entry, dict) or entry.get("stamp") != stamp or not _is_sha256(entry.get("sha256")):
        return None
    last_change = max(stamp[1], stamp[2])
    hashed_at = entry.get("hashed_at")
    return entry["sha256"] if isinstance(hashed_at, int) and last_change + RACY_NS < hashed_at else None


def _hash_file(path: Path, bar: tqdm, git: bool) -> dict:
    size = path.stat().st_size
    sha256 = hashlib.sha256()
    blob = hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False) if git else None
    with open(path, "rb") as file:
        while chunk := file.read(HASH_CHUNK):
            sha256.update(chunk)
            if blob is not None:
                blob.update(chunk)
            bar.update(len(chunk))
    return {"size": size, "sha256": sha256.hexdigest(), "git_sha1": blob.hexdigest() if blob else None}


def _stamp(path: Path) -> list[int]:
    """What must be unchanged for a cached hash to stand: size, mtime, ctime and inode."""
    info = path.stat()
    return [info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino]


def _load_hash_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # a missing or damaged cache only costs a re-hash
    return data if isinstance(data, dict) else {}


def _save_hash_cache(path: Path, cache: dict) -> None:
    with contextlib.suppress(OSError):  # an unwritable cache only costs a re-hash next time
        atomic_write(path, json.dumps(cache, indent=1))


# ---- small file helpers ---------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    """Parse a JSON file, rejecting duplicate keys; any problem is a SnapshotError naming the file."""

    def unique(pairs: list) -> dict:
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise SnapshotError(f"{path}: duplicate key {key!r}")
            seen.add(key)
        return dict(pairs)

    try:
        return json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=unique)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise SnapshotError(f"{path}: not readable JSON ({error}); {_advice(path)}") from None


def _is_sha256(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
