"""lora_throughput.py --rounds: each pipeline's median round is the one reported, and each ratio is
the median of the per-round ratios (neighbours in time), not a ratio of two unrelated medians."""

from __future__ import annotations

import benchmark_scripts
import pytest

pytest.importorskip("peft", reason="needs the lora extra: pip install -e .[lora]")


def load_script():
    return benchmark_scripts.load_script("lora_throughput")


def result(m, name: str, tokens_per_s: float):
    return m.Result(
        name=name,
        command=[],
        tokens_per_s=tokens_per_s,
        real_fraction=1.0,
        timed_steps=1,
        timed_s=1.0,
        real_tokens=int(tokens_per_s),
        peak_rss_mib=1.0,
        peak_gpu_mib=None,
        mfu=None,
        wall_s=1.0,
        threads=2,
        first_loss=None,
        last_loss=None,
        load_average={},
    )


def test_median_round_and_median_of_round_ratios():
    m = load_script()
    # A machine that slows down in round 2 and speeds up in round 3: the per-round ratios are 1.5, 1.2, 1.1,
    # while the two pipelines' median runs (6,000 and 4,000) would give 1.5.
    rounds = [
        [result(m, "ours", 6000), result(m, "trainer-packed", 4000)],
        [result(m, "trainer-packed", 2500), result(m, "ours", 3000)],  # the reversed round
        [result(m, "ours", 7700), result(m, "trainer-packed", 7000)],
    ]
    chosen, medians, per_round = m.summarise(rounds)
    assert [r.name for r in chosen] == ["ours", "trainer-packed"]
    assert [r.tokens_per_s for r in chosen] == [6000, 4000]
    assert chosen[0].extra["tokens_per_s_by_round"] == [6000, 3000, 7700]
    assert [pr["ours_over_packed"] for pr in per_round] == pytest.approx([1.5, 1.2, 1.1])
    assert medians["ours_over_packed"] == pytest.approx(1.2)
    assert medians["packed_over_padded"] is None  # a pipeline not run gives no ratio
    two = m.summarise(rounds[:2])
    assert two[1]["ours_over_packed"] == pytest.approx(1.35)  # even count: the mean of the middle two
    assert [r.tokens_per_s for r in two[0]] == [3000, 2500]  # and the lower median run per pipeline


def test_rounds_below_one_is_refused_with_its_message(capsys):
    m = load_script()
    with pytest.raises(SystemExit) as e:
        m.main(["--rounds", "0"])
    assert e.value.code == 2
    assert "--rounds must be >= 1" in capsys.readouterr().err
