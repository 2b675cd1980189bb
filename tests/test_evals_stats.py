"""Statistics of evaluations against values computed by hand (worked in the comments)."""

from __future__ import annotations

import math

import pytest

from treadle.evals import SampleRecord, pass_at_k, summarize, t_interval, wilson_interval
from treadle.evals.stats import percentile, t_quantile
from treadle.evals.summary import pass_at_k_values


def test_wilson_interval_by_hand() -> None:
    # 8 of 10, z = 1.959964: centre = (0.8 + z^2/20) / (1 + z^2/10) = 0.99207 / 1.38415 = 0.716732
    # half = z * sqrt(0.8*0.2/10 + z^2/400) / 1.38415 = 1.959964 * 0.160012 / 1.38415 = 0.226578
    interval = wilson_interval(8, 10)
    assert interval.method == "wilson" and interval.estimate == 0.8
    assert interval.low == pytest.approx(0.490154, abs=1e-5)
    assert interval.high == pytest.approx(0.943310, abs=1e-5)
    # 0 of 10: the interval starts at 0 and ends at z^2/10 / (1 + z^2/10) = 0.277533
    zero = wilson_interval(0, 10)
    assert zero.low == 0.0 and zero.high == pytest.approx(0.277533, abs=1e-5)


def test_t_quantiles_match_the_tables() -> None:
    for df, table in ((1, 12.7062), (2, 4.3027), (3, 3.1824), (10, 2.2281), (30, 2.0423)):
        assert t_quantile(0.975, df) == pytest.approx(table, abs=1e-4)


def test_t_interval_by_hand() -> None:
    # [1, 2, 3, 4]: mean 2.5, s = sqrt(5/3) = 1.290994, se = 0.645497, t(0.975, 3) = 3.182446
    interval = t_interval([1.0, 2.0, 3.0, 4.0])
    assert interval.method == "t" and interval.estimate == 2.5
    half = 3.182446 * 0.645497
    assert interval.low == pytest.approx(2.5 - half, abs=1e-5)
    assert interval.high == pytest.approx(2.5 + half, abs=1e-5)
    single = t_interval([0.7])
    assert (single.low, single.high) == (0.7, 0.7)


def test_pass_at_k_by_hand() -> None:
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # 1 - C(7,5)/C(10,5)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is c/n
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 3, 2) == 1.0
    # no overflow where the binomials would be astronomically large
    assert pass_at_k(2000, 1000, 100) == pytest.approx(1.0)
    assert math.isfinite(pass_at_k(2000, 1, 1000))
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_percentile_interpolates_like_numpy() -> None:
    values = [float(v) for v in range(1, 11)]
    assert percentile(values, 50) == 5.5
    assert percentile(values, 95) == pytest.approx(9.55)
    assert percentile([3.0], 99) == 3.0


def _record(item: str, sample: int, score: float, **fields: object) -> SampleRecord:
    return SampleRecord(item, sample, score, score == 1.0, **fields)  # type: ignore[arg-type]


def test_summary_with_several_samples_uses_items_as_the_unit() -> None:
    # A passes 1 of 2, B 0 of 2, C 2 of 2.
    records = [
        _record("A", 0, 1.0, latency_s=0.1, tags=("x",)),
        _record("A", 1, 0.0, latency_s=0.2, tags=("x",)),
        _record("B", 0, 0.0, latency_s=0.3, error_kind="bad_request"),
        _record("B", 1, 0.0, latency_s=0.4, retries=2),
        _record("C", 0, 1.0, latency_s=0.5, usage={"total_tokens": 7, "requests": 1}),
        _record("C", 1, 1.0, latency_s=0.6, usage={"total_tokens": 5, "requests": 1}),
    ]
    summary = summarize(records)
    assert summary.samples_per_item == 2 and summary.items == 3
    # pass@1 = mean(c/n) = (0.5 + 0 + 1) / 3; pass@2 = (1 + 0 + 1) / 3
    assert summary.pass_at_k == pytest.approx({1: 0.5, 2: 2 / 3})
    # binary scores, item means [0.5, 0, 1]: Wilson over 1.5 "successes" of 3 items, where a t
    # interval (0.5 +/- 4.302653 * 0.288675) would reach [-0.74, 1.74]
    assert summary.score.method == "wilson" and summary.score.n == 3
    assert summary.score.estimate == 0.5
    assert summary.score.low == pytest.approx(0.125334, abs=1e-5)  # by hand, z = 1.959964
    assert summary.score.high == pytest.approx(0.874666, abs=1e-5)
    assert summary.latency["p50"] == pytest.approx(0.35)
    assert summary.errors == {"bad_request": 1} and summary.retries == 2
    assert summary.tokens["total_tokens"] == 12 and summary.tokens["requests"] == 2
    assert summary.by_tag["x"].mean_score == 0.5 and summary.by_tag["(untagged)"].samples == 4
    # the order samples finished in does not matter
    assert summarize(list(reversed(records))).to_json() == summary.to_json()


def test_summary_binary_single_sample_uses_wilson() -> None:
    records = [_record(f"i{i}", 0, 1.0 if i < 8 else 0.0) for i in range(10)]
    summary = summarize(records)
    assert summary.score.method == "wilson"
    assert summary.score.low == pytest.approx(0.490154, abs=1e-5)
    assert summary.pass_at_k == {1: 0.8}


def test_continuous_scores_get_a_t_interval_inside_0_and_1() -> None:
    records = [_record(f"i{i}", 0, score) for i, score in enumerate([0.9, 1.0, 0.95, 0.2])]
    summary = summarize(records)
    assert summary.score.method == "t"
    assert 0.0 <= summary.score.low < summary.score.estimate < summary.score.high == 1.0


def test_the_docs_example_interval_stays_in_0_and_1() -> None:
    # docs/evals.md's example: 3 items x 2 samples, 0/1 scores, items pass 2, 2 and 0 times;
    # it printed "0.67 [-0.77, 2.10] (t)" before the interval was Wilson's
    records = [_record(i, j, 1.0 if i != "q3" else 0.0) for i in ("q1", "q2", "q3") for j in (0, 1)]
    score = summarize(records).score
    assert score.method == "wilson" and 0.0 <= score.low < score.estimate < score.high <= 1.0
    assert score.estimate == pytest.approx(2 / 3)


def test_summary_pass_at_k_ladder() -> None:
    per_item = [(8, 1), (8, 4)]
    values = pass_at_k_values(per_item, [1, 2, 4, 8])
    assert values[1] == pytest.approx((1 / 8 + 4 / 8) / 2)
    assert values[8] == 1.0
    assert values[2] == pytest.approx(((1 - 21 / 28) + (1 - 6 / 28)) / 2)  # C(7,2)=21, C(4,2)=6


def test_summary_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match="no samples"):
        summarize([])
