"""How `dtrain eval` shows an evaluation in the terminal: a headline and details (rich renderables), from the
record dtrain.evaluate wrote. A built-in names its view in its registry entry (workloads.Builtin.eval_view);
one without a view gets `figures`, a table of whatever its evaluator returned."""

from __future__ import annotations

from typing import Any


def figures(record: dict[str, Any]) -> tuple[str, list[Any]]:
    """Any workload's figures: the numbers in the headline, everything else as a table."""
    from rich.table import Table

    m = record.get("metrics") or {}
    numbers = {k: v for k, v in m.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    headline = ", ".join(f"{k} [bold]{v:.4g}[/]" for k, v in numbers.items()) or "no figures"
    rest = {k: v for k, v in m.items() if k not in numbers}
    if not rest:
        return headline, []
    table = Table(show_header=False)
    for k, v in rest.items():
        table.add_row(k, str(v))
    return headline, [table]


def _logged(record: dict[str, Any], key: str, digits: int = 4) -> str:
    """What the run itself logged for these weights, to read beside the evaluation's figure."""
    value = (record.get("logged") or {}).get(key)
    return f" (the run logged {value:.{digits}f})" if isinstance(value, (int, float)) else ""


def mnist(record: dict[str, Any]) -> tuple[str, list[Any]]:
    """The headline and the confusion matrix, with each class's images and accuracy."""
    from rich.table import Table

    m = record["metrics"]
    headline = (
        f"accuracy [bold]{m['accuracy']:.4f}[/]{_logged(record, 'eval_accuracy')}, loss {m['loss']:.4f} "
        f"on {m['images']} images of {m['dataset']} {m['split']}"
    )
    table = Table(title="confusion matrix (rows: true class, columns: predicted)", title_justify="left")
    for name in ["class", *map(str, range(len(m["confusion_matrix"]))), "images", "accuracy"]:
        table.add_column(name, justify="right")
    for c, row in enumerate(m["confusion_matrix"]):
        acc = m["per_class_accuracy"][c]
        cells = [f"[bold]{v}[/]" if i == c else (str(v) if v else "[dim]0[/]") for i, v in enumerate(row)]
        table.add_row(str(c), *cells, str(m["class_counts"][c]), f"{acc:.3f}" if acc is not None else "-")
    return headline, [table]


def lora(record: dict[str, Any]) -> tuple[str, list[Any]]:
    """The headline and the sampled continuations."""
    from rich.text import Text

    m = record["metrics"]
    headline = (
        f"held-out loss [bold]{m['loss']:.4f}[/]{_logged(record, 'eval_loss')}, perplexity "
        f"[bold]{m['perplexity']:.3f}[/]{_logged(record, 'eval_perplexity', 3)} over {m['blocks']} blocks "
        f"({m['tokens']:,} tokens)"
    )
    samples = [
        Text.assemble(("prompt: ", "dim"), s["prompt"], "\n", ("   ->   ", "dim"), (s["continuation"], "cyan"))
        for s in m["samples"]
    ]
    return headline, samples
