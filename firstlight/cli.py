"""The `firstlight` command: one sub-command per stage. No business logic lives here.

Each stage keeps its sub-commands in its own `cli.py` (a typer app), imported here; those modules
import heavy libraries (torch, transformers) inside the commands, so `firstlight --help` is quick.
"""

from __future__ import annotations

import sys
import traceback

import typer
from rich.console import Console

from firstlight.bench.cli import app as bench_app
from firstlight.bringup.cli import bringup
from firstlight.bringup.dossier_cli import dossier
from firstlight.core.trace_cli import app as trace_app
from firstlight.engine.cli import serve
from firstlight.errors import FirstlightError
from firstlight.eval.cli import app as eval_app
from firstlight.models.cli import app as models_app
from firstlight.models.cli import generate
from firstlight.sim.cli import app as sim_app
from firstlight.train.cli import app as train_app
from firstlight.verify.cli import verify

app = typer.Typer(
    name="firstlight",
    help="Bring large language models up on new hardware: run, verify, serve, benchmark, simulate.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
_DEBUG = {"on": False}


@app.callback()
def _global(debug: bool = typer.Option(False, "--debug", help="Show the full traceback of an error.")) -> None:
    """Bring large language models up on new hardware: run, verify, serve, benchmark, simulate."""
    _DEBUG["on"] = debug


app.add_typer(models_app, name="models")
app.command()(generate)
app.command()(verify)
app.command()(bringup)
app.command()(dossier)
app.command()(serve)
app.add_typer(bench_app, name="bench")
app.add_typer(sim_app, name="sim")
app.add_typer(trace_app, name="trace")
app.add_typer(eval_app, name="eval")
app.add_typer(train_app, name="train")


def main() -> None:
    """Entry point: runs the app and turns errors into one line and an exit code (1), with the
    traceback only under `firstlight --debug ...`."""
    debug = "--debug" in sys.argv[1:2] or _DEBUG["on"]
    try:
        app()  # typer handles usage errors itself (message, exit 2)
    except FirstlightError as e:
        if debug or _DEBUG["on"]:
            traceback.print_exc()
        Console(stderr=True).print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:
        if debug or _DEBUG["on"]:
            traceback.print_exc()
        Console(stderr=True).print(f"[bold red]error:[/] unexpected {type(e).__name__}: {e} (a bug: rerun with "
                                   "`firstlight --debug ...` for the traceback and report it)", highlight=False,
                                   soft_wrap=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
