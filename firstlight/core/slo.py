"""The one `--slo` syntax of `bench` and `sim`: `ttft=500ms,tpot=50,e2e=2s` (or `ttft:500ms`).

Values are milliseconds unless suffixed with `ms` or `s`; keys are ttft, tpot (alias itl) and e2e.
Returns milliseconds; a caller that works in seconds divides by 1000.
"""

from __future__ import annotations

from firstlight.errors import FirstlightError

SLO_KEYS = ("ttft", "tpot", "e2e")
SLO_HELP = "ttft=500ms,tpot=50,e2e=5s: milliseconds unless suffixed with ms or s (':' works as '=' too)"


def parse_slo_ms(text: str, allowed: tuple[str, ...] = SLO_KEYS) -> dict[str, float]:
    """`ttft=200,tpot=50ms,e2e=2s` -> {"ttft": 200.0, "tpot": 50.0, "e2e": 2000.0} (milliseconds)."""
    vals: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            raise FirstlightError(_help(text, allowed, "an empty item"))
        sep = "=" if "=" in part else ":"
        key, found, raw = part.partition(sep)
        key, raw = key.strip().lower(), raw.strip().lower()
        key = "tpot" if key == "itl" else key
        if not found or key not in allowed:
            raise FirstlightError(_help(text, allowed, f"unknown or missing key in {part!r}"))
        scale = 1.0
        if raw.endswith("ms"):
            raw = raw[:-2]
        elif raw.endswith("s"):
            raw, scale = raw[:-1], 1000.0
        try:
            v = float(raw) * scale
        except ValueError:
            raise FirstlightError(_help(text, allowed, f"{raw!r} is not a number")) from None
        if not v > 0:
            raise FirstlightError(_help(text, allowed, f"{key} must be > 0"))
        vals[key] = v
    return vals


def _help(text: str, allowed: tuple[str, ...], why: str) -> str:
    return (f"--slo {text!r} does not parse ({why}): expected comma-separated key=value with keys "
            f"{', '.join(allowed)} and values in ms (or with an s/ms suffix), e.g. --slo ttft=200,tpot=50,e2e=5s.")
