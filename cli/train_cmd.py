"""`dtrain train <workload>`: one command per registered workload, its options generated from the
workload's config dataclass and the [run] settings (name, type, help, choices), so that adding an
option is adding a field. The command parses, calls dtrain.control.launch, and reports."""

import dataclasses
import enum
import inspect
import sys
import typing
from collections.abc import Callable
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from dtrain.cli import console
from dtrain.cli import options as o

PROGRAM_ARGV = "dtrain.program.argv"  # ctx.meta: the line ProgramGroup routed to its `program` command


class ProgramGroup(TyperGroup):
    """A group whose commands are the built-ins (`dtrain train NAME`, `dtrain submit NAME`), with anything
    else (a script, -m module, job table, or -- command) routed to its hidden `program` command, which parses
    its own line (dtrain.control.program)."""

    submit = False  # `dtrain submit`'s group: its own options besides dtrain train's

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            ctx.meta[PROGRAM_ARGV] = list(args)
            args = ["program"]
        return super().parse_args(ctx, args)

    def format_options(self, ctx: Any, formatter: Any) -> None:
        """--help lists the options the program line takes (dtrain.control.program parses them, not click),
        one row each with its meaning, as every other command's --help does; then the built-ins."""
        from dtrain.control.program import OPTIONS, SUBMIT_OPTIONS

        given = [*OPTIONS, *(SUBMIT_OPTIONS if self.submit else [])]
        rows = [(f"{o.name} {o.metavar}" if o.takes_value else o.name, o.help) for o in given]
        with formatter.section("Options"):
            formatter.write_dl([*rows, ("-h, --help", "Show this message and exit.")])
        self.format_commands(ctx, formatter)


class SubmitGroup(ProgramGroup):
    submit = True


app = typer.Typer(
    cls=ProgramGroup,
    help=(
        "Train: your own script (dtrain train train.py [ARGS]), a module (-m pkg.train), a [jobs.NAME] table "
        "(dtrain train NAME), any command once per node (dtrain train -- CMD ...), or a built-in example below "
        "(its own options: dtrain train mnist --help). The options below are dtrain's wherever they stand; any "
        "other argument, and everything after --, is the program's (docs/user-code.md)."
    ),
    no_args_is_help=True,
)

# Options of the launch itself, not settings: they never reach the workload or dtrain.toml.
LAUNCH_ONLY = {
    "accept_new_host_keys": (o.AcceptNewHostKeys, False),
    "image": (o.Image, None),
    "oversubscribe": (o.Oversubscribe, False),
    "time": (
        Annotated[str | None, typer.Option("--time", help="a Slurm job's time limit (minutes, HH:MM:SS, "
                  "D-HH:MM:SS): at it the job checkpoints and continues (Slurm clusters)", show_default=False)],
        None,
    ),
}  # fmt: skip


def _option(key: Any) -> Any:
    """The typer option for one settings key (a dtrain.control.settings key: name, type, help, default).
    Its value is None when not given, so the config file and the environment keep their say."""
    from dtrain.common.config import flag

    help_text = key.help
    if key.default is dataclasses.MISSING:
        help_text += " (required)"
    elif key.default not in ("", []):
        help_text += f" (default: {key.default.value if isinstance(key.default, enum.Enum) else key.default})"
    tp = key.type
    if tp is bool:
        name = flag(key.name)
        return Annotated[bool | None, typer.Option(f"{name}/--no-{name[2:]}", help=help_text, show_default=False)]
    if typing.get_origin(tp) is list:  # comma-separated on the command line, as in DTRAIN_* variables
        help_text, tp = f"{help_text} (comma-separated)", str
    return Annotated[tp | None, typer.Option(flag(key.name), help=help_text, show_default=False)]


def workload_command(
    workload: str, run: Callable[[str, dict[str, Any], dict[str, Any]], None], extra: dict[str, tuple[Any, Any]]
) -> Callable[..., None]:
    """A command taking the workload's options (its config and [run]), the launch-only options and `extra`
    (name -> (annotation, default)); it calls run(workload, settings flags, every option given)."""
    from dtrain.control.settings import schema
    from dtrain.control.workloads import workload_class

    cls = workload_class(workload)
    keys = [k for k in schema().values() if k.section in (workload, "run")]
    # The workload's own options first, then the shared ones.
    keys.sort(key=lambda k: k.section != workload)
    annotations: dict[str, Any] = {}
    by_param: dict[str, str] = {}
    for k in keys:
        annotations[k.name] = _option(k)
        by_param[k.name] = k.key
    options = {**LAUNCH_ONLY, **extra}
    for name, (annotation, _default) in options.items():
        annotations[name] = annotation
    defaults = {name: default for name, (_a, default) in options.items()}
    # typer reads both the signature and the annotations.
    params = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=defaults.get(name), annotation=annotation)
        for name, annotation in annotations.items()
    ]

    def command(**given: Any) -> None:
        run(workload, {by_param[name]: value for name, value in given.items() if name in by_param}, given)

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = annotations
    command.__doc__ = (cls.__doc__ or "").strip().split("\n\n")[0]
    command.__name__ = workload
    return command


def _register(workload: str) -> None:
    def train(workload: str, flags: dict[str, Any], given: dict[str, Any]) -> None:
        console.state.exit_code = launch(
            workload,
            flags,
            accept_new_host_keys=given["accept_new_host_keys"],
            image=given["image"] or "",
            oversubscribe=given["oversubscribe"],
            time=given["time"] or "",
        )

    app.command(workload)(workload_command(workload, train, {}))


def launch(
    workload: str,
    flags: dict[str, Any],
    *,
    accept_new_host_keys: bool = False,
    image: str = "",
    oversubscribe: bool = False,
    time: str = "",
) -> int:
    """Run `workload` where the settings say; report where the run went; return the job's exit code."""
    from dtrain.control.launch import LaunchRequest
    from dtrain.control.launch import launch as control_launch
    from dtrain.control.launch_result import next_step
    from dtrain.control.slurm.spec import check_time

    request = LaunchRequest(
        workload=workload,
        flags=flags,
        config_path=console.state.config_path,
        image=image,
        accept_new_host_keys=accept_new_host_keys,
        oversubscribe=oversubscribe,
        time=check_time(time, "--time") if time else "",
        tty=sys.stdout.isatty(),
        debug=console.state.debug,
    )
    with console.operation() as (events, handle):
        result = control_launch(request, events=events, handle=handle)
    message = next_step(result)
    if message and result.ok:
        console.out.print(message, highlight=False)
    elif message:
        console.err.print(message, highlight=False)
    return result.exit_code


@app.command(
    "program",
    hidden=True,
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
)
def program(ctx: typer.Context) -> None:
    """Run a script, module, job table or command (see `dtrain train --help`)."""
    argv = ctx.meta.get(PROGRAM_ARGV, list(ctx.args))
    console.state.exit_code = run_program(argv)


def run_program(argv: list[str]) -> int:
    """`dtrain train` of a user's program: parse its line, resolve a job table, run it, report."""
    from dtrain.control.jobs_file import program_request
    from dtrain.control.launch import launch as control_launch
    from dtrain.control.launch_result import next_step

    if argv and argv[0] in ("-h", "--help"):
        console.out.print(app.info.help, highlight=False)
        return 0
    request, _launch = program_request(
        argv, console.state.config_path, tty=sys.stdout.isatty(), debug=console.state.debug
    )
    with console.operation() as (events, handle):
        result = control_launch(request, events=events, handle=handle)
    message = next_step(result, program=True)
    if message and result.ok:
        console.out.print(message, highlight=False)
    elif message:
        console.err.print(message, highlight=False)
    return result.exit_code


def register_all() -> None:
    """One command per workload. cli/main.py calls it only when `train` is on the command line: building
    the options reads every workload's dataclasses, which `dtrain --help` need not pay for."""
    from dtrain.control.workloads import WORKLOADS

    if any(c.name in WORKLOADS for c in app.registered_commands):
        return
    for name in WORKLOADS:
        _register(name)
