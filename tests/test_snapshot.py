"""octlm.snapshot: manifests, hash checks, sharded indexes, and download/offline paths with a fake Hub."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError
from huggingface_hub.hf_api import RepoFile

import octlm.snapshot as snapshot
from octlm.safetensors import write_safetensors
from octlm.snapshot import SnapshotError, resolve_snapshot, verify_snapshot, weight_files

REPO, REVISION = "test-org/tiny", "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    """octlm's cache in a temporary folder, and the Hub unreachable unless a test fakes it."""
    monkeypatch.setenv("OCTLM_CACHE", str(tmp_path / "octlm-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    def no_network(*args, **kwargs):
        raise AssertionError("a test tried to reach the Hugging Face Hub")

    monkeypatch.setattr(huggingface_hub.HfApi, "get_paths_info", no_network)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_network)


def tensors(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=generator).bfloat16(),
        "model.norm.weight": torch.randn(8, generator=generator),
        "model.layers.0.mlp.up_proj.weight": torch.randn(12, 8, generator=generator).bfloat16(),
    }


def write_json_files(directory: Path) -> None:
    """Small stand-ins for the four JSON files (their content does not matter to snapshot checks)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 8}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    (directory / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE"}}))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))


def single_snapshot(directory: Path) -> Path:
    write_json_files(directory)
    write_safetensors(directory / "model.safetensors", tensors(0), {"format": "pt"})
    return directory


def sharded_snapshot(directory: Path) -> Path:
    """Two shards and an index, named and laid out as transformers writes them."""
    write_json_files(directory)
    weights = tensors(1)
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    weight_map = {}
    for shard, members in shards.items():
        write_safetensors(directory / shard, {name: weights[name] for name in members})
        weight_map.update(dict.fromkeys(members, shard))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def flip_byte(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- local directories and stored manifests -------------------------------------------------------


def test_first_use_records_a_manifest_then_verifies_against_it(tmp_path):
    directory = single_snapshot(tmp_path / "snap")
    summary = verify_snapshot(directory)
    assert "recorded now" in summary["manifest"] and summary["ok"]
    names = [item["name"] for item in summary["files"]]
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    manifest = json.loads((directory / snapshot.MANIFEST_NAME).read_text())
    assert manifest["files"]["model.safetensors"] == {
        "size": (directory / "model.safetensors").stat().st_size,
        "sha256": sha256(directory / "model.safetensors"),
    }
    again = verify_snapshot(directory)
    assert again["manifest"] == str(directory / snapshot.MANIFEST_NAME)
    assert [item["sha256"] for item in again["files"]] == [item["sha256"] for item in summary["files"]]
    lines = snapshot.describe_check(again)
    assert len(lines) == 6 and lines[0].split()[0] == "config.json" and lines[0].endswith("ok")
    assert lines[-1] == f"verified against {directory / snapshot.MANIFEST_NAME}"


def settle_hash_cache(cache_root: Path) -> None:
    """Pretend every cached hash was taken long after its file last changed (past the racy window)."""
    cache_file = cache_root / "hashes.json"
    cache = json.loads(cache_file.read_text())
    for entry in cache.values():
        entry["hashed_at"] += 10 * snapshot.RACY_NS
    cache_file.write_text(json.dumps(cache))


def test_changed_weights_with_the_same_size_and_mtime_fail_naming_the_file(tmp_path):
    directory = single_snapshot(tmp_path / "snap")
    verify_snapshot(directory)
    settle_hash_cache(tmp_path / "octlm-cache")
    weights = directory / "model.safetensors"
    before = weights.stat()
    flip_byte(weights)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))  # only ctime tells the cache
    with pytest.raises(SnapshotError, match=r"model\.safetensors: sha256 [0-9a-f]{64}, expected") as caught:
        verify_snapshot(directory)
    assert "delete" in str(caught.value)


def test_truncated_and_missing_files_fail_before_hashing(tmp_path, monkeypatch):
    directory = single_snapshot(tmp_path / "snap")
    verify_snapshot(directory)
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    (directory / "tokenizer.json").unlink()
    monkeypatch.setattr(snapshot, "_hash_file", lambda *a: pytest.fail("hashed a snapshot with bad sizes"))
    with pytest.raises(SnapshotError) as caught:
        verify_snapshot(directory)
    message = str(caught.value)
    assert "tokenizer.json: missing" in message
    assert "model.safetensors: " in message and "(truncated?)" in message


def test_repeated_verification_reuses_cached_hashes_of_settled_files(tmp_path, monkeypatch):
    directory = single_snapshot(tmp_path / "snap")
    verify_snapshot(directory)
    hashed = []
    real_hash_file = snapshot._hash_file
    monkeypatch.setattr(
        snapshot, "_hash_file", lambda path, *rest: hashed.append(path.name) or real_hash_file(path, *rest)
    )
    settle_hash_cache(tmp_path / "octlm-cache")
    verify_snapshot(directory)
    assert hashed == []


def test_cached_hash_of_a_file_changed_just_before_hashing_is_not_trusted():
    """git's "racy" rule: a change within the timestamp granularity could hide behind an equal stamp."""
    digest, stamp = "ab" * 32, [10, 5_000_000_000, 6_000_000_000, 42]  # size, mtime, ctime, inode
    settled = {"stamp": stamp, "sha256": digest, "hashed_at": 6_000_000_000 + 2 * snapshot.RACY_NS}
    assert snapshot._trusted_hash(settled, stamp) == digest
    assert (
        snapshot._trusted_hash({**settled, "hashed_at": 6_000_000_000 + snapshot.RACY_NS // 2}, stamp) is None
    )
    assert snapshot._trusted_hash(settled, [10, 5_000_000_000, 7_000_000_000, 42]) is None  # ctime moved
    assert snapshot._trusted_hash({**settled, "sha256": "x"}, stamp) is None


def test_first_use_rejects_damaged_weights_and_records_nothing(tmp_path):
    directory = single_snapshot(tmp_path / "snap")
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-3])
    with pytest.raises(SnapshotError, match="truncated"):
        verify_snapshot(directory)
    assert not (directory / snapshot.MANIFEST_NAME).exists()


@pytest.mark.parametrize(
    "missing", ["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"]
)
def test_first_use_requires_the_files_the_loader_reads(tmp_path, missing):
    directory = single_snapshot(tmp_path / "snap")
    (directory / missing).unlink()
    with pytest.raises(SnapshotError, match=missing.replace(".", r"\.")):
        verify_snapshot(directory)


def test_first_use_on_the_real_qwen3_json_files(tmp_path, qwen_files):
    """The real tokenizer.json (151,643 vocabulary keys in one object) is parsed and recorded."""
    directory = tmp_path / "snap"
    directory.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(qwen_files / name, directory / name)
    write_safetensors(directory / "model.safetensors", tensors(0))
    summary = verify_snapshot(directory)
    sizes = {item["name"]: item["size"] for item in summary["files"]}
    assert sizes["tokenizer.json"] == 11_422_654


def test_invalid_json_is_reported_with_its_file(tmp_path):
    directory = single_snapshot(tmp_path / "snap")
    (directory / "config.json").write_text('{"a": 1, "a": 2}')
    with pytest.raises(SnapshotError, match=r"config\.json: duplicate key 'a'"):
        verify_snapshot(directory)


def test_unlisted_weight_file_is_refused(tmp_path):
    directory = single_snapshot(tmp_path / "snap")
    verify_snapshot(directory)
    sharded_snapshot(directory)  # adds an index and shards the manifest does not vouch for
    with pytest.raises(SnapshotError, match="not recorded in"):
        verify_snapshot(directory)


def test_read_only_directory_keeps_its_manifest_in_the_octlm_cache(tmp_path, monkeypatch):
    directory = single_snapshot(tmp_path / "snap")
    original = snapshot.atomic_write

    def read_only(path, text):
        if path.parent == directory:
            raise PermissionError(f"{path}: read-only file system")
        original(path, text)

    monkeypatch.setattr(snapshot, "atomic_write", read_only)
    verify_snapshot(directory)
    stored = list((tmp_path / "octlm-cache" / "manifests").iterdir())
    assert len(stored) == 1 and not (directory / snapshot.MANIFEST_NAME).exists()
    assert verify_snapshot(directory)["manifest"] == str(stored[0])
    flip_byte(directory / "config.json", 2)
    with pytest.raises(SnapshotError, match=r"config\.json: sha256"):
        verify_snapshot(directory)


def test_damaged_manifest_says_to_delete_it(tmp_path):
    directory = single_snapshot(tmp_path / "snap")
    (directory / snapshot.MANIFEST_NAME).write_text(json.dumps({"format": "something else", "files": {}}))
    with pytest.raises(SnapshotError, match="delete it"):
        verify_snapshot(directory)


# ---- pinned manifests -----------------------------------------------------------------------------


def pin(pinned_dir: Path, directory: Path, repo: str = REPO, revision: str = REVISION) -> None:
    files = {}
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    ):
        files[name] = {"size": (directory / name).stat().st_size, "sha256": sha256(directory / name)}
    manifest = {"format": snapshot.MANIFEST_FORMAT, "repo": repo, "revision": revision, "files": files}
    pinned_dir.mkdir(exist_ok=True)
    (pinned_dir / f"{repo.replace('/', '__')}__{revision}.json").write_text(json.dumps(manifest))


def test_pinned_manifest_checks_a_local_copy_of_the_official_files(tmp_path, monkeypatch):
    official = single_snapshot(tmp_path / "official")
    monkeypatch.setattr(snapshot, "PINNED_DIR", tmp_path / "pins")
    pin(tmp_path / "pins", official)
    spec = SimpleNamespace(repo=REPO, revision=REVISION, path=str(official))
    assert resolve_snapshot(spec) == official
    assert "pinned" in verify_snapshot(official, REPO, REVISION)["manifest"]
    recorded = json.loads((official / snapshot.MANIFEST_NAME).read_text())  # for checks without repo@revision
    assert recorded["source"].startswith("pinned") and recorded["revision"] == REVISION
    assert verify_snapshot(official)["manifest"] == str(official / snapshot.MANIFEST_NAME)
    other = single_snapshot(tmp_path / "other")
    write_safetensors(other / "model.safetensors", tensors(5), {"format": "pt"})  # same size, other weights
    with pytest.raises(
        SnapshotError,
        match=r"(?s)does not match pinned test-org/tiny@.*model\.safetensors: sha256.*model\.revision=null",
    ):
        resolve_snapshot(SimpleNamespace(repo=REPO, revision=REVISION, path=str(other)))


def test_shipped_qwen3_manifest_is_well_formed():
    path = snapshot._pinned_manifest_path("Qwen/Qwen3-0.6B", "c1899de289a04d12100db370d81485cdf75e47ca")
    files = snapshot._read_manifest(path)
    assert set(files) == {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    }
    assert files["model.safetensors"].size == 1_503_300_328
    assert (
        files["tokenizer.json"].sha256 == "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
    )


def test_shipped_qwen3_manifest_matches_the_real_tokenizer_file(qwen_files):
    """tokenizer.json of the fixtures is byte-identical to the Hub's, so the pinned entry must match it."""
    path = snapshot._pinned_manifest_path("Qwen/Qwen3-0.6B", "c1899de289a04d12100db370d81485cdf75e47ca")
    expected = snapshot._read_manifest(path)["tokenizer.json"]
    actual = qwen_files / "tokenizer.json"
    assert (actual.stat().st_size, sha256(actual)) == (expected.size, expected.sha256)


# ---- sharded checkpoints --------------------------------------------------------------------------


def test_sharded_snapshot_lists_its_shards_and_verifies(tmp_path):
    directory = sharded_snapshot(tmp_path / "snap")
    assert [path.name for path in weight_files(directory)] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    names = [item["name"] for item in verify_snapshot(directory)["files"]]
    assert {"model.safetensors.index.json", "model-00001-of-00002.safetensors"} < set(names)
    assert "model-00002-of-00002.safetensors" in names
    flip_byte(directory / "model-00002-of-00002.safetensors")
    with pytest.raises(SnapshotError, match=r"model-00002-of-00002\.safetensors: sha256"):
        verify_snapshot(directory)


def test_single_file_snapshot_has_one_weight_file(tmp_path):
    directory = single_snapshot(tmp_path / "snap")
    assert weight_files(directory) == [directory / "model.safetensors"]
    (directory / "model.safetensors").unlink()
    with pytest.raises(SnapshotError, match="no model.safetensors and no model.safetensors.index.json"):
        weight_files(directory)


def edit_index(directory: Path, edit) -> None:
    path = directory / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    edit(index["weight_map"])
    path.write_text(json.dumps(index))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda m: m.update({"model.extra.weight": "model-00001-of-00002.safetensors"}),
            "lists 'model.extra.weight'",
        ),
        (
            lambda m: m.pop("model.layers.0.mlp.up_proj.weight"),
            "holds 'model.layers.0.mlp.up_proj.weight', which",
        ),
        (lambda m: m.update({"model.norm.weight": "model-00003-of-00003.safetensors"}), "shard model-00003"),
        (lambda m: m.update({"model.norm.weight": "../outside.safetensors"}), "must be a file name"),
        (lambda m: m.update({"model.norm.weight": 3}), "must be a file name"),
        (lambda m: m.clear(), "non-empty 'weight_map'"),
    ],
    ids=[
        "tensor missing from shard",
        "tensor not in index",
        "missing shard",
        "path escape",
        "not a string",
        "empty",
    ],
)
def test_inconsistent_index_fails_naming_tensor_or_shard(tmp_path, edit, message):
    directory = sharded_snapshot(tmp_path / "snap")
    edit_index(directory, edit)
    with pytest.raises(SnapshotError, match=message):
        weight_files(directory)


def test_damaged_shard_is_reported_with_advice(tmp_path):
    directory = sharded_snapshot(tmp_path / "snap")
    shard = directory / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(SnapshotError, match=r"model-00001-of-00002\.safetensors: .*download it again"):
        weight_files(directory)


# ---- resolve_snapshot: download, offline, errors --------------------------------------------------


class FakeHub:
    """Serves a 'remote' directory the way huggingface_hub does: metadata, then a snapshot download."""

    def __init__(self, remote: Path, cache: Path, corrupt: str | None = None) -> None:
        self.remote, self.cache, self.corrupt, self.downloads = remote, cache, corrupt, []

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(huggingface_hub.HfApi, "get_paths_info", self.get_paths_info)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", self.snapshot_download)
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", self.hf_hub_download)

    def get_paths_info(self, repo_id, paths, revision=None):
        assert (repo_id, revision) == (REPO, REVISION)
        return [self.info(name) for name in paths if (self.remote / name).is_file()]

    def info(self, name: str) -> RepoFile:
        data = (self.remote / name).read_bytes()
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        lfs = {"size": len(data), "oid": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
        return RepoFile(
            path=name, size=len(data), oid=blob, lfs=lfs if name.endswith(".safetensors") else None
        )

    def snapshot_download(
        self, repo_id, revision=None, cache_dir=None, allow_patterns=None, local_files_only=False
    ):
        target = self.cache / "snapshots" / revision
        if local_files_only:
            if not target.is_dir():
                raise LocalEntryNotFoundError("not in the cache")
            return str(target)
        target.mkdir(parents=True, exist_ok=True)
        for name in allow_patterns:
            shutil.copyfile(self.remote / name, target / name)
            self.downloads.append(name)
            if name == self.corrupt:
                flip_byte(target / name, 0)
        return str(target)

    def hf_hub_download(self, repo_id, filename, revision=None, cache_dir=None):
        return str(self.remote / filename)


def spec(path: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(repo=REPO, revision=REVISION, path=path)


def test_download_fetches_only_needed_files_and_checks_hub_metadata(tmp_path, monkeypatch):
    remote = single_snapshot(tmp_path / "remote")
    (remote / "README.md").write_text("not needed")
    (remote / "pytorch_model.bin").write_bytes(b"not needed either")
    hub = FakeHub(remote, tmp_path / "hf-cache")
    hub.install(monkeypatch)
    directory = resolve_snapshot(spec(), cache_dir=str(tmp_path / "hf-cache"))
    assert sorted(hub.downloads) == sorted(
        [
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "model.safetensors",
        ]
    )
    manifest = json.loads((directory / snapshot.MANIFEST_NAME).read_text())
    assert manifest["source"] == "hub" and manifest["revision"] == REVISION


@pytest.mark.parametrize("corrupt", ["model.safetensors", "config.json"])
def test_download_that_differs_from_hub_metadata_fails_naming_the_file(tmp_path, monkeypatch, corrupt):
    hub = FakeHub(single_snapshot(tmp_path / "remote"), tmp_path / "hf-cache", corrupt=corrupt)
    hub.install(monkeypatch)
    with pytest.raises(SnapshotError, match=f"(?s)Hub's metadata.*{corrupt.replace('.', '[.]')}: ") as caught:
        resolve_snapshot(spec())
    assert "delete" in str(caught.value)


def test_download_of_a_sharded_repo_uses_the_index(tmp_path, monkeypatch):
    hub = FakeHub(sharded_snapshot(tmp_path / "remote"), tmp_path / "hf-cache")
    hub.install(monkeypatch)
    directory = resolve_snapshot(spec())
    assert "model-00002-of-00002.safetensors" in hub.downloads
    assert len(weight_files(directory)) == 2


def test_offline_without_a_local_copy_says_how_to_provide_one(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub = FakeHub(tmp_path / "remote", tmp_path / "empty-cache")
    hub.install(monkeypatch)
    monkeypatch.setattr(huggingface_hub.HfApi, "get_paths_info", lambda *a, **k: pytest.fail("went online"))
    with pytest.raises(SnapshotError) as caught:
        resolve_snapshot(spec())
    message = str(caught.value)
    assert "HF_HUB_OFFLINE is set" in message and "model.path=/dir/with/config.json" in message
    assert caught.value.__cause__ is None and caught.value.__context__ is None  # no chained traceback


def test_network_error_falls_back_to_the_cached_snapshot_and_its_manifest(tmp_path, monkeypatch):
    hub = FakeHub(single_snapshot(tmp_path / "remote"), tmp_path / "hf-cache")
    hub.install(monkeypatch)
    directory = resolve_snapshot(spec())

    def unreachable(*args, **kwargs):
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub.HfApi, "get_paths_info", unreachable)
    assert resolve_snapshot(spec()) == directory
    flip_byte(directory / "tokenizer_config.json", 1)
    with pytest.raises(SnapshotError, match=r"tokenizer_config\.json: sha256"):
        resolve_snapshot(spec())


def test_network_error_without_a_cached_copy_is_one_clear_error(tmp_path, monkeypatch):
    hub = FakeHub(tmp_path / "remote", tmp_path / "empty-cache")
    hub.install(monkeypatch)

    def unreachable(*args, **kwargs):
        raise OSError("connection refused")

    monkeypatch.setattr(huggingface_hub.HfApi, "get_paths_info", unreachable)
    with pytest.raises(
        SnapshotError, match=r"(?s)the Hub is unreachable \(OSError: connection refused.*model.path="
    ) as caught:
        resolve_snapshot(spec())
    assert caught.value.__context__ is None


def test_unknown_repository_is_reported_as_such(tmp_path, monkeypatch):
    def not_found(*args, **kwargs):
        response = SimpleNamespace(headers={}, request=None)
        raise RepositoryNotFoundError("404 Client Error: Repository Not Found", response=response)

    monkeypatch.setattr(huggingface_hub.HfApi, "get_paths_info", not_found)
    with pytest.raises(SnapshotError, match="Repository Not Found; check model.repo"):
        resolve_snapshot(spec())


def test_repo_without_weights_is_refused_before_downloading(tmp_path, monkeypatch):
    remote = single_snapshot(tmp_path / "remote")
    (remote / "model.safetensors").unlink()
    FakeHub(remote, tmp_path / "hf-cache").install(monkeypatch)
    with pytest.raises(SnapshotError, match="neither model.safetensors nor"):
        resolve_snapshot(spec())


def test_spec_errors(tmp_path):
    with pytest.raises(SnapshotError, match="no such directory"):
        resolve_snapshot(spec(str(tmp_path / "absent")))
    with pytest.raises(SnapshotError, match="neither model.path nor model.repo"):
        resolve_snapshot(SimpleNamespace(repo=None, revision=None, path=None))
