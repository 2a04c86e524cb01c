"""The report's key numbers say how they are aggregated: the gap a ranking closes is one budget's,
never an average over budgets."""

import polars as pl
import pytest


@pytest.mark.parametrize("replayed", ["sketch-gated", "coact-prior"])
def test_report_key_number_says_it_is_one_budget(monkeypatch, replayed):
    """The featured ranking is policy.index's recommendation (its choice without a surrogate
    where only that one was replayed), never a name of the report's own (was: coact)."""
    from types import SimpleNamespace

    import duckdb

    from moe_spec.analysis import report
    from moe_spec.policy import index
    assert replayed in (index.RECOMMENDED, index.RECOMMENDED_WITHOUT_SURROGATE)
    con = duckdb.connect()
    con.execute("CREATE TABLE trees AS SELECT 'm' AS model, 'mbpp' AS bench, 'r' AS run, "
                "NULL AS budget, "
                "4.0 AS accepted_length, [30, 32] AS unique_experts")
    errors = pl.DataFrame([dict(model="m", bench="mbpp", ranking=r, budget=b,
                                coverage="truncation", rse=v / b)
                           for b in (8, 16, 24) for r, v in (("router", 3.0), ("oracle", 1.0),
                                                             (replayed, 1.5),
                                                             ("coact", 2.5))])
    monkeypatch.setattr(report, "headline_projection", lambda *a: None)
    runs = [SimpleNamespace(manifest=dict(num_experts=64))]
    numbers = dict(report.key_numbers(con, {"errors": errors}, "m", "mbpp", runs))
    (label,) = [k for k in numbers if f"gap {replayed} closes" in k]
    assert "at one budget, B = 16" in label and "not averaged over budgets" in label
    assert numbers[label] == "75%"  # (3 − 1.5) / (3 − 1) at B = 16
