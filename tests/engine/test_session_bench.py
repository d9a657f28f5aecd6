"""benchmarks/session_bench.py on the tiny pair: AR's replay fixes the requests, each config runs them
with and without the prefix cache, and every turn equals AR's either way."""

from __future__ import annotations

import json

import pytest
from bench_modules import load_benchmark

sb = load_benchmark("session_bench")

SESSIONS = [
    {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi there"},
                  {"role": "assistant", "content": "x"}, {"role": "user", "content": "and then?"}]},
    {"messages": [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "z"},
                  {"role": "user", "content": "now subtract"}]},
]
TINY = ["--target", "tiny-dense", "--draft", "oracle:0.3", "--device", "cpu", "--dtype", "float32"]


def test_each_config_with_and_without_the_cache_equals_ar(tmp_path, capsys):
    f = tmp_path / "s.jsonl"
    f.write_text("".join(json.dumps(s) + "\n" for s in SESSIONS))
    out = tmp_path / "s.json"
    assert sb.main([*TINY, "--sessions", str(f), "--max-new-tokens", "6", "--repeats", "1", "--config",
                    "ar:verify=ar", "--config", "dd:verify=ddtree,budget=6,top_k=2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "exact_all: True" in text and "turns: 4" in text and "ttft_later_ratio_dd:" in text
    rows = json.loads(out.read_text())["rows"]
    assert [(r["name"], r["cache"]) for r in rows] == [("ar", "on"), ("ar", "off"), ("dd", "on"), ("dd", "off")]
    for r in rows:
        assert r["exact"] and r["ttft_later_ms"] > 0
        assert (r["cached_share_later"] > 0) == (r["cache"] == "on")


@pytest.mark.parametrize("argv,says", [(["--config", "x:budget=zero"], "budget"),
                                        (["--n", "0"], "--n must be >= 1"),
                                        (["--prefix-cache-mb", "0"], "--prefix-cache-mb must be a finite number > 0"),
                                        (["--config", "a:verify=ar", "--config", "a:verify=chain"], "must differ")])
def test_bad_arguments_exit_2_before_loading(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        sb.main([*TINY, *argv])
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_a_file_that_is_not_sessions_exits_2_naming_the_line(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hello"}\n')
    assert sb.main([*TINY, "--sessions", str(f)]) == 2
    assert "p.jsonl:1" in capsys.readouterr().err
