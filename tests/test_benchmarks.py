import pytest

from tasks import benchmarks

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
