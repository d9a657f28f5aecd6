"""Fixtures for the autotune tests (helpers live in autotune_helpers.py)."""

from pathlib import Path

import pytest


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in an empty folder, so default storages (autotune.db, mlflow.db) land there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
