"""The `dtrain` command. Thin: each command group lives in its own module and is joined here.

Nothing here imports torch, transformers, peft or a cloud SDK: `dtrain --help` stays fast on a
laptop with only the CLI installed. Commands import what they need inside their functions.
"""

import sys
from pathlib import Path
from typing import Annotated

import typer

try:  # typer >= 0.26 vendors click; older releases use the click package
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover
    from click.exceptions import ClickException

from dtrain.cli import console
from dtrain.common.errors import ExitCode, UserError

app = typer.Typer(
    name="dtrain",
    help="Distributed PyTorch training on Google Cloud, on your own machines, or on this one.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # Plain help (click's): rich's panels cost a third of `dtrain --help`'s time (docs/decisions.md).
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _global(
    config: Annotated[
        Path | None,
        typer.Option("--config", envvar="DTRAIN_CONFIG", help="config file (default: ./dtrain.toml if present)"),
    ] = None,
    debug: Annotated[bool, typer.Option("--debug", envvar="DTRAIN_DEBUG", help="show tracebacks")] = False,
) -> None:
    console.state.config_path = config
    console.state.debug = debug


def _register() -> None:
    # Imported here, not at module top, only to keep the list of groups in one place.
    from dtrain.cli import (
        build_cmd,
        cluster_cmd,
        config_cmd,
        dashboard_cmd,
        eval_cmd,
        gcp_cmd,
        jobs_cmd,
        plan_cmd,
        runs_cmd,
        train_cmd,
    )

    app.add_typer(config_cmd.app, name="config")
    app.add_typer(train_cmd.app, name="train")
    app.command("runs")(runs_cmd.runs)
    app.command("logs")(runs_cmd.logs)
    app.command("eval")(eval_cmd.eval_)
    app.command("export")(eval_cmd.export)
    app.command("plot")(eval_cmd.plot)
    app.command("doctor")(cluster_cmd.doctor)
    app.command("gpus")(cluster_cmd.gpus)
    app.command("exec")(cluster_cmd.exec_)
    app.command("ssh")(cluster_cmd.ssh_)
    app.command("build")(build_cmd.build)
    app.command("up")(gcp_cmd.up)
    app.command("down")(gcp_cmd.down)
    app.command("status")(gcp_cmd.status)
    app.command("preflight")(gcp_cmd.preflight_cmd)
    app.command("plan")(plan_cmd.plan)
    app.command("dashboard")(dashboard_cmd.dashboard)
    app.add_typer(jobs_cmd.submit_app, name="submit")
    app.command("jobs")(jobs_cmd.jobs)
    app.command("cancel")(jobs_cmd.cancel)
    app.add_typer(jobs_cmd.slurm_app, name="slurm")


_register()


def run(argv: list[str] | None = None) -> int:
    """Entry point: run the app and turn errors into one line and an exit code."""
    given = sys.argv[1:] if argv is None else argv
    if "train" in given:
        from dtrain.cli import train_cmd

        train_cmd.register_all()
    if "submit" in given:
        from dtrain.cli import jobs_cmd

        jobs_cmd.register_all()
    try:
        app(args=argv, prog_name="dtrain", standalone_mode=False)
    except UserError as e:
        if console.state.debug:
            console.err.print_exception()
        console.error(str(e))
        return int(e.exit_code)
    except typer.Exit as e:
        return int(e.exit_code)
    except typer.Abort:
        return int(ExitCode.INTERRUPTED)
    except ClickException as e:
        console.error(_one_line(e))
        return int(e.exit_code) if e.exit_code not in (0, 1) else int(ExitCode.USAGE)
    except KeyboardInterrupt:
        return int(ExitCode.INTERRUPTED)
    return int(console.state.exit_code)


def _one_line(e: ClickException) -> str:
    """A usage error as one line, like every other error (click's own is a boxed panel of three)."""
    # typer words some messages as "Value error, ..." (its validation library's prefix): not for people.
    message = " ".join(e.format_message().replace("Value error, ", "").split())
    ctx = getattr(e, "ctx", None)
    if ctx is not None:
        message += f" (see {ctx.command_path} --help)"
    return message


def main() -> None:
    sys.exit(run())
