"""Names and partition values reach SQL only as bound parameters: a model folder whose name holds
a quote is read like any other (it aborted ``report`` with a parser error and the advice to
recapture)."""

from helpers import capture_model_folder

from moe_spec.analysis import coactivation, frames, report
from moe_spec.analysis.sql import connect
from moe_spec.catalog import partition_value

MODEL = "m/it's o'lmoe"  # a local model folder


def test_a_model_folder_with_a_quote_is_reported(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # (restored afterwards)
    capture_model_folder(tmp_path, MODEL)
    assert report.main(["--traces", "traces", "--out", "r", "--threads", "1"]) == 0
    assert [p.suffix for p in (tmp_path / "r").iterdir()].count(".html") == 1
    con = connect(tmp_path / "traces")
    stats = frames.routing_statistics(con, MODEL, "mbpp")
    assert stats is not None and stats["trees"] > 0
    c = coactivation.coactivation(con, 1, stats["num_experts"], "all_pairs",
                                  dict(model=partition_value(MODEL), bench="mbpp"))
    assert c.tokens > 0
