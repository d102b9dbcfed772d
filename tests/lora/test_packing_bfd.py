"""Best-fit-decreasing packing (sft.pack_rows): rows as full as TRL's, each example whole and apart,
the same rows from the same examples on every rank and every run."""

from __future__ import annotations

import random

import torch

from dtrain.lora import sft


def examples(n: int, seed: int = 0) -> list[sft.Example]:
    rng = random.Random(seed)
    out = []
    for k in range(n):
        length = min(512, int(rng.lognormvariate(4.6, 0.8)) + 2)  # long-tailed, like chat data
        ids = [rng.randrange(2, 1000) for _ in range(length)]
        out.append(sft.Example(ids, [sft.IGNORE] + ids[1:], f"r:{k}"))
    return out


def next_fit_rows(lengths: list[int], seq_len: int) -> int:
    """The rows of the packing before this one: in data order, a new row when the next does not fit."""
    rows, used = 0, seq_len + 1
    for n in lengths:
        if used + n <= seq_len:
            used += n
        else:
            rows, used = rows + 1, n
    return rows


def test_best_fit_decreasing_packs_tighter_than_data_order_and_keeps_every_example_whole():
    exs = examples(600)
    rows = sft.pack_rows(exs, 512, 0, packing=True)
    lengths = [len(e.ids) for e in exs]
    fill = sum(lengths) / rows[:, 0].numel()
    next_fit_fill = sum(lengths) / (next_fit_rows(lengths, 512) * 512)
    assert fill > 0.97 and fill > next_fit_fill + 0.1, (fill, next_fit_fill)
    # Every example appears once, whole, with positions restarting at 0 and its own labels.
    seen = []
    for r in range(rows.shape[0]):
        pos = rows[r, 2]
        starts = (pos == 0).nonzero().flatten().tolist()
        ends = starts[1:] + [int((pos >= 0).sum())]
        for s, e in zip(starts, ends, strict=True):
            assert pos[s:e].tolist() == list(range(e - s))
            seen.append((tuple(rows[r, 0, s:e].tolist()), tuple(rows[r, 1, s:e].tolist())))
        assert (rows[r, 2, ends[-1] :] == -1).all() and (rows[r, 1, ends[-1] :] == sft.IGNORE).all()
    assert sorted(seen) == sorted((tuple(e.ids), tuple(e.labels)) for e in exs)


def test_best_fit_rule_and_ties():
    # Longest first: 7 and 6 open two rows (3 and 4 left); 4 goes to the row it fills exactly (6's), not
    # the first with room; 3 fills 7's; 2 finds no room and opens a third row.
    assert sft._best_fit_decreasing([3, 7, 2, 6, 4], 10) == [[1, 0], [3, 4], [2]]
    # Equal lengths keep data order (a stable sort), and a tie in free space goes to the older row.
    assert sft._best_fit_decreasing([5, 5, 5, 5], 10) == [[0, 1], [2, 3]]
    assert sft._best_fit_decreasing([4, 4, 2, 2], 6) == [[0, 2], [1, 3]]
    assert sft._best_fit_decreasing([], 10) == []


def test_rows_are_a_function_of_the_examples_alone():
    """Every rank packs the same rows, and a resumed run the same ones again (the data position in a
    checkpoint is the step, over a permutation of these rows)."""
    a = sft.pack_rows(examples(300, seed=3), 512, 0, packing=True)
    b = sft.pack_rows(examples(300, seed=3), 512, 0, packing=True)
    assert torch.equal(a, b)
