"""`firstlight bringup`: bring a model up on an emulated chip, then write its runbook and dossier.

Exit codes: 0 the goal holds, 1 it does not (budget spent or no remedy left), 2 bad input (nothing
written), 130 interrupted (the runbook and state so far are on disk; rerun to continue).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import typer


def bringup(
    model: str = typer.Option("smollm2-135m", help="Model name or checkpoint dir."),
    target: str = typer.Option("emulate:wormhole-n300", help="An emulated chip: emulate:CHIP (see docs/EMULATION.md)."),
    goal: str = typer.Option("verdict", help="'verdict' (verify's) or thresholds, e.g. 'ppl<=1.01,top1>=0.99,kl<=1e-3'."),
    budget: int = typer.Option(12, help="Verify runs for the correctness phase (>= 1)."),
    perf_budget: int = typer.Option(8, help="Verify runs for the performance phase (0: skip it)."),
    out: Path = typer.Option(Path("bringup"), help="Directory for RUNBOOK.md, overrides.yaml, state.json, dossier."),
    overrides: Path | None = typer.Option(None, help="Start from these overrides (YAML) instead of the chip's defaults."),
    playbook: str | None = typer.Option(
        None, help="Playbook JSON file (default $FIRSTLIGHT_HOME/bringup/playbook.json); 'show' prints it and exits."),
    remedies: list[Path] = typer.Option([], help="Extra remedy files (Python; they run their code: trusted files only)."),
    project: str = typer.Option("", help="Chips to project serving on in the dossier, e.g. h100,trn2 ('' : none)."),
    dossier: bool = typer.Option(True, "--dossier/--no-dossier", help="Write the dossier (index.html, dossier.json)."),
    bench: bool = typer.Option(True, "--bench/--no-bench", help="Dossier: measure our engine on this machine."),
    prompt_tokens: int = typer.Option(32, help="Tokens of the bundled text verify uses as the prompt."),
    threads: int = typer.Option(0, help="torch threads (0: torch's default)."),
    seed: int = typer.Option(0, help="Seed of stochastic rounding."),
    planner: str = typer.Option("playbook", help="Who orders the remedies: playbook (past success), or chat (an "
                                "OpenAI-compatible chat model through function calling; the playbook if it fails)."),
    planner_url: str | None = typer.Option(None, help="--planner chat: the server's base URL (http://HOST:PORT)."),
    planner_model: str | None = typer.Option(None, help="--planner chat: the model name the server serves."),
) -> None:
    """Bring a model up on an emulated chip: verify, localize, remedy, repeat; then buy the speed back."""
    from rich.console import Console

    from firstlight.bringup.goal import GoalError, parse_goal
    from firstlight.bringup.playbook import Playbook

    con = Console()
    book = Playbook(None if playbook in (None, "show") else playbook)
    if playbook == "show":
        _show(book, con)
        return
    try:
        the_goal = parse_goal(goal)
    except GoalError as e:
        _fail(str(e))
    if budget < 1:
        _fail(f"--budget {budget}: give at least 1 verify run")
    if perf_budget < 0:
        _fail(f"--perf-budget {perf_budget}: give 0 (skip) or more")
    chip = _chip(target)
    for f in remedies:
        from firstlight.bringup.remedies import load_file
        from firstlight.errors import FirstlightError

        try:
            load_file(f)
        except FirstlightError as e:
            _fail(str(e))
    from firstlight.bringup.chat_planner import planner_from_options
    from firstlight.errors import FirstlightError

    try:
        the_planner = planner_from_options(planner, planner_url, planner_model, book, out / "planner.jsonl")
    except FirstlightError as e:
        _fail(str(e))
    _check_writable(out)
    if dossier and project:
        from firstlight.bringup.dossier_project import check_chips

        try:
            check_chips([p for p in project.split(",") if p])
        except FirstlightError as e:
            _fail(str(e))
    _run(model, chip, the_goal, budget, perf_budget, out, overrides, book, project, dossier, prompt_tokens, threads,
         seed, con, planner=the_planner, bench=bench)


def _fail(message: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=2)


def _chip(target: str) -> str:
    from firstlight.errors import FirstlightError
    from firstlight.targets.registry import get_target

    if not target.startswith("emulate:"):
        _fail(f"target '{target}': the loop applies remedies as numerics overrides, which only emulated chips take; "
              "give --target emulate:CHIP (firstlight verify still checks any target)")
    try:
        t = get_target(target)
    except FirstlightError as e:
        _fail(str(e))
    return t.chip


def _check_writable(out: Path) -> None:
    """Fail before anything is written if `out` cannot hold the bring-up."""
    probe = out if out.exists() else next((p for p in out.parents if p.exists()), Path("."))
    if out.exists() and not out.is_dir():
        _fail(f"--out {out} exists and is not a directory")
    if not os.access(probe, os.W_OK):
        _fail(f"--out {out}: {probe} is not writable; give a writable directory")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as e:
        _fail(f"--out {out}: cannot write in {probe} ({e})")


def _run(model: str, chip: str, goal, budget: int, perf_budget: int, out: Path, overrides: Path | None, book,
         project: str, dossier: bool, prompt_tokens: int, threads: int, seed: int, con, planner=None, bench: bool = True) -> None:
    import torch

    from firstlight.bringup import runbook
    from firstlight.bringup.loop import BringupConfig, BringupLoop
    from firstlight.data import load_text
    from firstlight.models.hub import resolve
    from firstlight.models.loader import load_tokenizer
    from firstlight.targets.overrides import Overrides, load_overrides

    if threads:
        torch.set_num_threads(threads)
    path = resolve(model)
    tok = load_tokenizer(path)
    ids = tok(load_text("hamlet-sample"), verbose=False)["input_ids"]
    cfg = BringupConfig(model_path=path, chip=chip, goal=goal, budget=budget, perf_budget=perf_budget, out=out,
                        base_overrides=load_overrides(overrides) if overrides else Overrides(),
                        prompt_ids=ids[1000:1000 + prompt_tokens], ppl_ids=ids, seed=seed)

    printed: set[int] = set()

    def progress(state) -> None:
        runbook.write(out, state, model)
        it = state.iterations[-1] if state.iterations else None
        if it and it["run"] not in printed:
            printed.add(it["run"])
            rem = (it.get("remedy") or {}).get("description", "")
            after = it["after"]
            con.print(f"[{it['run']:>2}] {it['phase']:<11} {rem or '-':<48} -> {it.get('outcome') or ('met' if after['met'] else 'fails')}"
                      f" ({it.get('seconds', 0):.0f} s)  {'; '.join(after['unmet'][:1])[:90]}", highlight=False,
                      soft_wrap=True)

    loop = BringupLoop(cfg, book, planner=planner, on_iteration=progress)
    try:
        state = loop.run()
    except KeyboardInterrupt:
        loop.state.status = "interrupted"
        loop._save()
        con.print(f"interrupted: the runbook so far is {out / 'RUNBOOK.md'}; rerun the same command to continue")
        raise typer.Exit(code=130) from None
    runbook.write(out, state, model)
    con.print(f"[bold]{'MET' if state.final['met'] else 'NOT MET'}[/] goal {state.goal} after {state.final['verify_runs']} "
              f"verify runs; runbook: {out / 'RUNBOOK.md'}; overrides: {out / 'overrides.yaml'}", highlight=False)
    if dossier:
        from firstlight.bringup.dossier import write_dossier

        html = write_dossier(out, model=model, target=f"emulate:{chip}", overrides_file=out / "overrides.yaml",
                             verify_result=loop.final_result, project=[p for p in project.split(",") if p],
                             bench=bench)
        con.print(f"dossier: {html}", highlight=False)
    raise typer.Exit(code=0 if state.final["met"] else 1)


def _show(book, con) -> None:
    from rich.table import Table

    rows = book.summary()
    if not rows and not book.configs:
        con.print(f"playbook {book.path}: empty")
        return
    table = Table(title=f"playbook {book.path}")
    for col in ("signature", "remedy", "kept / tries", "in a passing config", "chips", "families"):
        table.add_column(col)
    for r in sorted(rows, key=lambda r: (r["signature"], -r["kept"])):
        table.add_row(r["signature"], r["remedy"], f"{r['kept']} / {r['tries']}", str(r["essential"]),
                      ", ".join(r["chips"]), ", ".join(r["families"]))
    con.print(table)
    configs = Table(title="passing configurations (the next bring-up on the chip starts from the newest)")
    for col in ("chip", "family", "model", "remedies kept", "predicted ms / request", "time"):
        configs.add_column(col)
    for c in book.configs:
        cost = c.get("cost_ms")
        configs.add_row(c.get("chip", "?"), c.get("family", "?"), Path(str(c.get("model", "?"))).name,
                        "; ".join(k.get("description", "?") for k in c["kept"]),
                        "-" if cost is None else f"{cost:.1f}", c.get("time", ""))
    if book.configs:
        con.print(configs)
