"""`firstlight dossier`: the per-model dossier without the bring-up loop.

Exit codes: 0 written (whatever verify found: the verdict is in the dossier), 2 bad input (an unknown
target, chip or model, a missing overrides file, an unwritable out dir): nothing written.
"""

from __future__ import annotations

from pathlib import Path

import typer


def dossier(
    model: str = typer.Option("smollm2-135m", help="Model name or checkpoint dir."),
    target: str = typer.Option(..., help="Verify target, e.g. emulate:wormhole-n300 (see `firstlight verify --help`)."),
    overrides: Path | None = typer.Option(None, help="Numerics overrides YAML for an emulate:CHIP target."),
    project: str = typer.Option("", help="Chips to project serving on with the simulator, e.g. h100,trn2 ('': none)."),
    out: Path = typer.Option(Path("dossier"), help="Directory for index.html, dossier.json and the plots."),
    bench: bool = typer.Option(True, "--bench/--no-bench", help="Measure our engine on this machine (firstlight bench)."),
    slo: str = typer.Option("ttft=1,tpot=0.05", help="SLO of the projections: p90 TTFT and p90 TPOT, seconds."),
    new_tokens: int = typer.Option(16, help="Greedy tokens of the reference continuation verify checks."),
    ppl_tokens: int = typer.Option(256, help="Tokens of the bundled text for perplexity (0: skip)."),
    bench_requests: int = typer.Option(8, help="Requests of the engine run (64 prompt / 32 output tokens each)."),
    bench_time_limit: float = typer.Option(300.0, help="Seconds the engine run may take, server start included."),
    threads: int = typer.Option(0, help="torch threads for verify and the engine (0: torch's default / one per CPU)."),
) -> None:
    """Write a model's dossier: verify on every path, quality, configuration, a measured engine run, sim projections."""
    from rich.console import Console

    from firstlight.bringup.dossier import EngineRunSpec, ProjectionSpec, write_dossier
    from firstlight.bringup.dossier_project import DossierError, parse_slo
    from firstlight.errors import FirstlightError

    err = Console(stderr=True)
    try:
        ttft, tpot = parse_slo(slo)
        if bench_requests < 1:
            raise DossierError(f"--bench-requests {bench_requests}: give at least 1")
        html = write_dossier(out, model=model, target=target, overrides_file=overrides, verify_result=None,
                             project=[p.strip() for p in project.split(",") if p.strip()], bench=bench,
                             engine=EngineRunSpec(num_requests=bench_requests, time_limit_s=bench_time_limit,
                                                  threads=threads),
                             projection=ProjectionSpec(slo_ttft_s=ttft, slo_tpot_s=tpot),
                             verify_new_tokens=new_tokens, verify_ppl_tokens=ppl_tokens, threads=threads,
                             log=lambda s: err.print(s, highlight=False))
    except FirstlightError as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=2 if isinstance(e, DossierError) else e.exit_code) from None
    Console().print(f"dossier: {html}", highlight=False)
