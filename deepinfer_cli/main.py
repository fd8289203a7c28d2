"""The `deepinfer` command: the root only wires the sub-commands, each in its own module.

Nothing heavy is imported here (no torch, no cupy), so `deepinfer --help` is instant; each
command imports the engine inside its function.
"""

from __future__ import annotations

import sys

import typer

from deepinfer.cli import bench, chat, convert, serve, validate
from deepinfer.cli import eval as eval_cli
from deepinfer.cli.errors import DEBUG

# The help lists the commands in this order: what a user runs first, then serving, then the GPU check.
COMMAND_ORDER = ("convert", "bench", "eval", "chat", "serve", "validate-kernels")


class _OrderedGroup(typer.core.TyperGroup):
    def list_commands(self, ctx) -> list[str]:
        names = super().list_commands(ctx)
        return sorted(names, key=lambda name: COMMAND_ORDER.index(name) if name in COMMAND_ORDER else len(names))


app = typer.Typer(
    cls=_OrderedGroup,
    name="deepinfer",
    help="deepinfer: an LLM inference engine core and toolkit for one GPU.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help: wraps to any width and never cuts an option name
)


def _print_version(value: bool) -> None:
    if value:
        from deepinfer import __version__

        print(f"deepinfer {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors."),
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    DEBUG["enabled"] = debug


app.command("convert")(convert.convert)
app.add_typer(bench.app, name="bench")
app.command("chat")(chat.chat)
app.command("serve")(serve.serve)
app.command("eval")(eval_cli.eval_command)
app.command("validate-kernels")(validate.validate_kernels)


def main() -> None:
    try:
        app()
    except SystemExit:
        raise
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except Exception as err:  # a clear line for the user; the traceback with --debug
        if DEBUG["enabled"] or "--debug" in sys.argv:
            raise
        message = str(err) or type(err).__name__
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
