"""`dtrain config show`: the resolved configuration and where each value came from."""

import json
from typing import Annotated

import typer

from dtrain.cli import console

app = typer.Typer(help="Show the resolved configuration.", no_args_is_help=True)


@app.command("show")
def show(
    workload: Annotated[
        str | None, typer.Option("--workload", help="show [run] and only this workload's section, e.g. mnist")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print a JSON list of {key, value, source}")] = False,
) -> None:
    """Print every setting, its value and its source: default, the config file, DTRAIN_* or a flag."""
    from dtrain.control.settings import describe, load_settings

    items = describe(load_settings(console.state.config_path), workload)
    if as_json:
        print(json.dumps([i.as_dict() for i in items], indent=2))
        return

    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for column, style in (("key", "bold"), ("value", ""), ("source", "cyan"), ("help", "dim")):
        table.add_column(column, style=style)
    for i in items:
        # JSON spelling is also TOML's for these values: a row can be pasted into dtrain.toml.
        value = "(not set)" if i.value is None else json.dumps(i.value)
        table.add_row(i.key, console.escape(value), console.escape(i.source), console.escape(i.help))
    console.out.print(table)
