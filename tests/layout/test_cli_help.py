"""Every option and argument of every `firstlight` command says what it is for, and booleans read as flags."""

from __future__ import annotations

import typer.main
from typer.core import TyperArgument, TyperOption

from firstlight.cli import app


def _commands(cmd, path: str = "firstlight"):  # typer vendors click: walk by duck type
    yield path, cmd
    if hasattr(cmd, "commands"):
        for name, sub in cmd.commands.items():
            yield from _commands(sub, f"{path} {name}")


def _params():
    root = typer.main.get_command(app)
    for path, cmd in _commands(root):
        for p in cmd.params:
            if p.name == "help":
                continue
            yield path, cmd, p


def test_the_walk_sees_the_commands() -> None:
    paths = {path for path, _ in _commands(typer.main.get_command(app))}
    assert {"firstlight serve", "firstlight bench run", "firstlight sim sweep", "firstlight eval ppl",
            "firstlight bringup", "firstlight trace export", "firstlight sim calibrate", "firstlight verify"} <= paths
    verify = {o for path, _, p in _params() if path == "firstlight verify" for o in p.opts}
    assert {"--overrides", "--decode-steps", "--batch-path", "--reference-cache"} <= verify
    assert sum(1 for _ in _params()) > 200


def test_every_option_has_help() -> None:
    missing = [f"{path} {p.opts[0]}" for path, _, p in _params()
               if isinstance(p, TyperOption) and not (p.help or "").strip()]
    assert not missing, "options without help text:\n" + "\n".join(missing)


def test_every_argument_is_documented() -> None:
    missing = [f"{path} {p.name}" for path, _, p in _params()
               if isinstance(p, TyperArgument) and not (getattr(p, "help", "") or "").strip()]
    assert not missing, "arguments without help text:\n" + "\n".join(missing)


def test_booleans_are_flags_named_positively() -> None:
    bad = []
    for path, _, p in _params():
        if isinstance(p, TyperOption) and p.is_flag:
            names = p.opts + p.secondary_opts
            if any(n.startswith("--no-no-") for n in names) or (p.name or "").startswith("no_"):
                bad.append(f"{path} {'/'.join(names)}")
    assert not bad, "use --thing/--no-thing, not a negative name:\n" + "\n".join(bad)


def test_slo_units_and_arrival_names_are_the_same_in_bench_and_sim() -> None:
    from firstlight.bench.load import ARRIVALS
    from firstlight.bench.metrics import SLO
    from firstlight.sim.cli import ARRIVAL_NAMES
    from firstlight.sim.sweep import parse_slo

    for text in ("ttft=500,tpot=50", "ttft:500ms,tpot:0.05s", "tpot=50ms,ttft=0.5s"):
        b = SLO.parse(text)
        assert (b.ttft_ms, b.tpot_ms) == (500.0, 50.0)
        assert parse_slo(text) == (0.5, 0.05)
    assert set(ARRIVALS) <= set(ARRIVAL_NAMES)


def test_serve_reads_the_api_key_from_the_environment() -> None:
    root = typer.main.get_command(app)
    opt = next(p for p in root.commands["serve"].params if p.name == "api_key")
    assert opt.envvar == "FIRSTLIGHT_API_KEY"
