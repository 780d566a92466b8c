"""Load one of our models from an HF checkpoint directory.

A checkpoint dir holds config.json, model.safetensors (or shards listed in
model.safetensors.index.json), tokenizer.json (+ tokenizer_config.json) and optionally
generation_config.json. Every way this can go wrong ends in a ModelLoadError that names the file.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from firstlight.errors import ModelLoadError
from firstlight.models.config import MTP_FIELDS, ModelConfig
from firstlight.models.hf_names import (
    EXPERT_FILE_INDEX,
    IGNORED,
    STACKED_EXPERTS,
    build_state_dict,
    text_model_name,
)
from firstlight.models.layers import CausalLM

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype '{dtype}' is not supported; use one of: float32, bfloat16, float16")
    return DTYPES[dtype]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(f"{path} not found: a checkpoint dir needs it (is this an HF checkpoint dir?)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON ({e}); re-download or re-pull the model") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} holds a JSON {type(data).__name__}, expected a JSON object; "
                             "re-download or re-pull the model")
    return data


def load_config(path: str | Path) -> ModelConfig:
    """ModelConfig from <dir>/config.json, with eos ids merged from generation_config.json."""
    ckpt = _checkpoint_dir(path)
    cfg = _read_json(ckpt / "config.json")
    gen_path = ckpt / "generation_config.json"
    if gen_path.is_file():
        gen = _read_json(gen_path)
        if gen.get("eos_token_id") is not None:
            cfg = {**cfg, "eos_token_id": gen["eos_token_id"]}
    return ModelConfig.from_hf(cfg, source=str(ckpt / "config.json"))


def _checkpoint_dir(path: str | Path) -> Path:
    ckpt = Path(path)
    if not ckpt.exists():
        raise ModelLoadError(f"model path {ckpt} does not exist; give a checkpoint dir or a name from `firstlight models list`")
    if not ckpt.is_dir():
        raise ModelLoadError(f"model path {ckpt} is a file, expected an HF checkpoint dir (GGUF files: `firstlight models convert`)")
    return ckpt


def _weight_files(ckpt: Path) -> list[Path]:
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ModelLoadError(f"{index} has no 'weight_map' of tensor name -> file name; re-download the checkpoint")
        files = [_inside(ckpt, f, index) for f in sorted(set(weight_map.values()))]
    elif (ckpt / "model.safetensors").is_file():
        files = [ckpt / "model.safetensors"]
    else:
        raise ModelLoadError(f"{ckpt} has no model.safetensors nor model.safetensors.index.json")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{ckpt}: shard(s) listed in the index are missing: {', '.join(missing)}")
    return files


def _inside(ckpt: Path, name: str, index: Path) -> Path:
    """A shard named by the index, refused when it resolves outside the checkpoint dir (`../x`, `/etc/x`,
    a symlink out): an index must not make the loader open files it was not given."""
    root = ckpt.resolve()
    path = (ckpt / name).resolve()
    if not path.is_relative_to(root):
        raise ModelLoadError(f"{index}: weight_map names {name!r}, which is outside the checkpoint dir {ckpt}; "
                             "shards must be files inside it")
    return path


class _Tensors:
    """Lazy name → tensor view over all safetensors files of a checkpoint, by the text model's names
    (`text_model_name`: a multimodal wrapper's vision tower left out)."""

    def __init__(self, files: list[Path], model_type: str) -> None:
        self.where: dict[str, Any] = {}  # name → (handle, file, the name in the file)
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt")
                names = list(handle.keys())
            except (SafetensorError, OSError, ValueError) as e:
                raise ModelLoadError(f"{f} is not a readable safetensors file ({e}); it may be truncated or corrupt: re-pull/re-download it") from e
            for n in names:
                name = text_model_name(n, model_type)
                if name is not None:
                    self.where[name] = (handle, f, n)

    def names(self) -> set[str]:
        return set(self.where)

    def shape(self, name: str) -> list[int]:
        handle, _, stored = self.where[name]
        return list(handle.get_slice(stored).get_shape())

    def get(self, name: str) -> torch.Tensor:
        handle, f, stored = self.where[name]
        try:
            return handle.get_tensor(stored)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ModelLoadError(f"{f}: tensor {stored} cannot be read ({e}); the file may be truncated: re-pull it") from e


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    module_name, class_name = cfg.family.split(":")
    return getattr(importlib.import_module(f"firstlight.models.{module_name}"), class_name)


def build_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32, device: str = "cpu") -> CausalLM:
    """An uninitialized model (weights on `device`, undefined values) for a config."""
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model


def load_model(
    path: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu", with_tokenizer: bool = True
) -> tuple[CausalLM, Any]:
    """(model, tokenizer) from an HF checkpoint dir; the tokenizer is None if with_tokenizer=False."""
    ckpt = _checkpoint_dir(path)
    cfg = load_config(ckpt)
    torch_dtype = parse_dtype(dtype)
    tensors = _Tensors(_weight_files(ckpt), cfg.model_type)
    cfg = _with_mtp_layers(cfg, tensors.names())
    model = build_model(cfg, torch_dtype, device)
    expected = dict(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)

    def get_hf(name: str) -> torch.Tensor:
        if name not in tensors.where:
            raise ModelLoadError(f"{ckpt}: tensor {name} is missing from the checkpoint (config: {cfg.model_type}, {cfg.num_layers} layers)")
        return tensors.get(name)

    _check_expert_count(ckpt, cfg, tensors)
    num_experts = cfg.moe.num_experts if cfg.moe is not None else 0
    state, used = build_state_dict(list(expected), get_hf, cfg.model_type, num_experts, tensors.where.__contains__)
    for name, tensor in state.items():
        want = tuple(expected[name].shape)
        if tuple(tensor.shape) != want:
            raise ModelLoadError(
                f"{ckpt}: tensor {name} has shape {list(tensor.shape)} in the checkpoint but the config implies {list(want)}"
            )
    if cfg.tie_word_embeddings:
        used.add("lm_head.weight")
    extra = sorted(n for n in tensors.names() - used if not IGNORED.match(n) and not _shared_mtp_copy(n, cfg))
    if extra:
        raise ModelLoadError(f"{ckpt}: checkpoint has tensors the {cfg.model_type} config does not use: {', '.join(extra[:5])}")
    with torch.no_grad():
        for name, tensor in state.items():
            expected[name].copy_(tensor)
    model.eval().requires_grad_(False)
    tokenizer = load_tokenizer(ckpt) if with_tokenizer else None
    return model, tokenizer


def _with_mtp_layers(cfg: ModelConfig, names: set[str]) -> ModelConfig:
    """The MTP layer count the files back. Hub Qwen3-Next / Qwen3.5 configs may omit it
    (`num_nextn_predict_layers`, `mtp_num_hidden_layers`) while the files carry the layers: count them, so
    the MTP weights load (and are checked like every other tensor) instead of being rejected. Files with
    no MTP tensor at all (conversions often drop DeepSeek-V3's) load without MTP whatever the config
    says; `--speculative mtp` then names the field. Some MTP tensors but not all: a missing-tensor error."""
    if cfg.model_type not in MTP_FIELDS:
        return cfg
    if cfg.model_type == "deepseek_v3":  # its files keep MTP depth k as model.layers.{num_layers + k}
        found = {int(m.group(1)) - cfg.num_layers for n in names
                 if (m := LAYER_FILE.match(n)) and int(m.group(1)) >= cfg.num_layers}
    else:
        found = {int(n.split(".")[2]) for n in names if n.startswith("mtp.layers.")}
    if not found:
        return dataclasses.replace(cfg, num_mtp_layers=0)
    return cfg if cfg.num_mtp_layers else dataclasses.replace(cfg, num_mtp_layers=max(found) + 1)


LAYER_FILE = re.compile(r"^model\.layers\.(\d+)\.")
SHARED_MTP_COPY = re.compile(r"^model\.layers\.(\d+)\.(?:embed_tokens|shared_head\.head)\.weight$")


def _shared_mtp_copy(name: str, cfg: ModelConfig) -> bool:
    """DeepSeek-V3's files keep copies of the embedding and LM head in each MTP layer
    (`model.layers.{num_hidden_layers + k}.embed_tokens` / `.shared_head.head`); the MTP layers share
    the main model's (V3 report sec. 2.2), so the copies are not read."""
    m = SHARED_MTP_COPY.match(name) if cfg.model_type == "deepseek_v3" else None
    return m is not None and cfg.num_layers <= int(m.group(1)) < cfg.num_layers + cfg.num_mtp_layers


def _check_expert_count(ckpt: Path, cfg: ModelConfig, tensors: _Tensors) -> None:
    """Experts in the files must number exactly what the config says, in every MoE layer: per-expert
    tensors counted, stacked ones by their first dim."""
    found: dict[int, int] = {}
    for n in tensors.names():
        m = EXPERT_FILE_INDEX.match(n)
        if m:
            layer, expert = int(m.group(1)), int(m.group(2))
            found[layer] = max(found.get(layer, 0), expert + 1)
        elif m := STACKED_EXPERTS.match(n):
            found[int(m.group(1))] = tensors.shape(n)[0]
    if not found:
        return
    if cfg.moe is None:
        raise ModelLoadError(f"{ckpt}: checkpoint has expert tensors but {cfg.model_type} has no experts")
    for layer, count in sorted(found.items()):
        if count != cfg.moe.num_experts:
            raise ModelLoadError(
                f"{ckpt}/config.json: field '{cfg.moe.experts_field}' is {cfg.moe.num_experts} but the checkpoint "
                f"has {count} experts in layer {layer}; fix the config or use the matching checkpoint"
            )


def load_tokenizer(path: str | Path) -> Any:
    """The checkpoint's fast tokenizer (transformers), read offline from tokenizer.json."""
    ckpt = _checkpoint_dir(path)
    if not (ckpt / "tokenizer.json").is_file():
        raise ModelLoadError(f"{ckpt} has no tokenizer.json; firstlight needs a fast tokenizer file")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(ckpt), local_files_only=True)
    except Exception as e:  # transformers raises many kinds; all mean the same to the user
        raise ModelLoadError(f"{ckpt}/tokenizer.json cannot be loaded ({type(e).__name__}: {e})") from e
