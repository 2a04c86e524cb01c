"""The benchmark prompt sets: every one loads with stable ids, and a missing or damaged file is
one line naming it (in capture and evaluate too)."""

import os
import shutil

import pytest
from helpers import CAP, call, one_line_error

from moe_spec.tasks import benchmarks

BENCHMARKS = os.environ.get(benchmarks.ENV_VAR) or str(benchmarks.DEFAULT_DIR)
EXPECTED = {"mbpp": 500, "humaneval": 164, "gsm8k": 1319, "math500": 500, "cnndm": 80,
            "specbench": 480}


@pytest.mark.parametrize("bench", benchmarks.BENCHMARKS)
def test_each_benchmark_loads_with_stable_unique_ids(bench):
    prompts = benchmarks.load(bench)
    assert len(prompts) == EXPECTED[bench]
    ids = [p.prompt_id for p in prompts]
    assert len(set(ids)) == len(ids)
    assert all(p.text.strip() for p in prompts)
    assert [p.prompt_id for p in benchmarks.load(bench, offset=3, limit=4)] == ids[3:7]


def test_mbpp_test_split_is_task_ids_11_to_510():
    ids = [int(p.prompt_id) for p in benchmarks.load("mbpp")]
    assert ids == list(range(11, 511))
    train = [int(p.prompt_id) for p in benchmarks.load_train("mbpp")]
    assert min(train) == 601 and max(train) == 974


def test_unknown_benchmark_names_the_known_ones():
    with pytest.raises(benchmarks.BenchmarkError, match="known: mbpp, humaneval"):
        benchmarks.load("mmlu")


def test_missing_folder_says_where_it_looked_and_how_to_fix(tmp_path, monkeypatch):
    missing = tmp_path / "nowhere"
    monkeypatch.setenv(benchmarks.ENV_VAR, str(missing))
    with pytest.raises(benchmarks.BenchmarkError) as exc:
        benchmarks.load("mbpp")
    assert str(missing) in str(exc.value) and benchmarks.ENV_VAR in str(exc.value)


def test_missing_file_inside_folder_is_one_clear_line(tmp_path):
    with pytest.raises(benchmarks.BenchmarkError, match="is missing"):
        benchmarks.load("gsm8k", root=tmp_path)


@pytest.mark.parametrize("content,words", [
    ("", ["holds no rows"]),
    ('{"text": "no task id"}\n', ["'task_id'", "line 1"]),
    ('{"task_id": 11,\n', ["not valid JSON", "line 1"]),
    (b'{"task_id": 11, "text": "\xff\xfe"}\n', ["not valid UTF-8"]),
    ("[1, 2]\n", ["not a JSON object"]),
])
def test_bad_benchmark_files_are_one_line_naming_the_file(replayed, tmp_path, content, words):
    bench = tmp_path / "benchmarks"
    shutil.copytree(BENCHMARKS, bench, ignore=shutil.ignore_patterns("*.gz"))
    target = bench / "mbpp" / "mbpp.jsonl"
    target.write_bytes(content if isinstance(content, bytes) else content.encode())
    one_line_error(call("moe_spec.capture.cli", *CAP, "--limit", "1", "--out", tmp_path / "x",
                        "--benchmarks", bench), "mbpp.jsonl", *words)
    one_line_error(call("moe_spec.analysis.evaluate_cli", "--traces", replayed[0], "--benchmarks", bench),
                   "mbpp.jsonl", *words)
