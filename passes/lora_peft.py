"""PEFT's LoRA adapter folder (``adapter_model.safetensors`` + ``adapter_config.json``): its
names, and reading and writing it, for the lora pass's ``adapter`` and the adapters' export.

PEFT saves a module's adapter as ``base_model.model.<module>.lora_A.weight`` ([r, in]) and
``….lora_B.weight`` ([out, r]), the adapter's name ("default") left out, and its
``LoraConfig`` as JSON beside them (``peft_type`` "LORA", ``r``, ``lora_alpha``, ...).
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save as save_safetensors

from graphforge.errors import PassError
from graphforge.program import LoraAdapter
from graphforge.tempfiles import write_atomically

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
#: what PEFT's PeftModel puts before a module's name in the keys it saves
KEY_PREFIX = "base_model.model."
_PARTS = ("lora_A", "lora_B")


def peft_key(module: str, part: str) -> str:
    """PEFT's saved name of ``module``'s ``part`` ("lora_A" or "lora_B")."""
    return f"{KEY_PREFIX}{module}.{part}.weight"


@dataclass(frozen=True)
class PeftAdapters:
    """A PEFT LoRA folder's settings and weights: ``weights`` maps a module (as PEFT names
    it) to its A [r, in] and B [out, r]."""

    folder: Path
    r: int
    alpha: float
    rslora: bool
    dropout: float
    weights: Mapping[str, tuple[np.ndarray, np.ndarray]]


def read_peft(folder: str | os.PathLike) -> PeftAdapters:
    """The LoRA adapters of PEFT's folder ``folder``; an error naming the folder and what is
    wrong with it where it is no LoRA folder graphforge can start from."""
    folder = Path(folder)
    config = _read_config(folder)
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1 or not isinstance(alpha, int | float) or alpha <= 0:
        raise PassError(f"{folder / CONFIG}: r ({r!r}) and lora_alpha ({alpha!r}) must be positive numbers")
    weights = _read_weights(folder)
    for module, (a, _) in weights.items():
        if a.shape[0] != r:
            raise PassError(f"{folder / WEIGHTS}: {module}'s lora_A has rank {a.shape[0]}, the config's r is {r}")
    return PeftAdapters(
        folder, r, float(alpha), bool(config.get("use_rslora", False)), float(config.get("lora_dropout") or 0), weights
    )


def _read_config(folder: Path) -> dict:
    path = folder / CONFIG
    if not path.is_file():
        raise PassError(f"{folder}: no {CONFIG} (a PEFT adapter folder, as save_pretrained writes it)")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PassError(f"{path}: not readable as JSON ({exc})") from None
    if not isinstance(config, dict) or str(config.get("peft_type", "")).upper() != "LORA":
        raise PassError(f"{path}: peft_type is {config.get('peft_type')!r}, not LORA")
    unsupported = [
        key
        for key in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform")
        if config.get(key)
    ]
    if unsupported or config.get("bias", "none") != "none":
        what = ", ".join(unsupported + (["bias"] if config.get("bias", "none") != "none" else []))
        raise PassError(f"{path}: {what} set; graphforge starts from plain LoRA adapters of one rank and alpha")
    return config


def _read_weights(folder: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """module -> (A, B), as float32 or float16 arrays."""
    path = folder / WEIGHTS
    if not path.is_file():
        raise PassError(f"{folder}: no {WEIGHTS}")
    found: dict[str, dict[str, np.ndarray]] = {}
    try:
        with safe_open(str(path), framework="numpy") as tensors:
            for key in tensors.keys():  # noqa: SIM118 (safe_open is no mapping)
                module, part = _split_key(path, key)
                found.setdefault(module, {})[part] = tensors.get_tensor(key)
    except (SafetensorError, OSError, TypeError) as exc:
        raise PassError(f"{path}: not readable as safetensors of float32 or float16 ({exc})") from None
    if not found:
        raise PassError(f"{path}: holds no adapter")
    for module, parts in found.items():
        missing = [p for p in _PARTS if p not in parts]
        if missing:
            raise PassError(f"{path}: {module} has no {missing[0]}")
        a, b = parts["lora_A"], parts["lora_B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise PassError(
                f"{path}: {module}'s lora_A {list(a.shape)} and lora_B {list(b.shape)} are no [r, in], [out, r]"
            )
    return {module: (parts["lora_A"], parts["lora_B"]) for module, parts in found.items()}


def _split_key(path: Path, key: str) -> tuple[str, str]:
    for part in _PARTS:
        suffix = f".{part}.weight"
        if key.startswith(KEY_PREFIX) and key.endswith(suffix) and len(key) > len(KEY_PREFIX) + len(suffix):
            return key[len(KEY_PREFIX) : -len(suffix)], part
    raise PassError(f"{path}: {key!r} is no LoRA weight ({KEY_PREFIX}<module>.lora_A.weight or .lora_B.weight)")


# --------------------------------------------------------------------------- writing


def peft_config(
    adapters: Sequence[LoraAdapter], *, base_model: str | None = None, task_type: str | None = None
) -> dict:
    """PEFT's ``adapter_config.json`` for ``adapters``: the most common rank and alpha as
    ``r`` and ``lora_alpha``, other modules' in ``rank_pattern`` / ``alpha_pattern`` (as
    PEFT writes a model of several ranks); ``fan_in_fan_out`` where every base weight is
    stored [in, out] under its torch name (GPT-2's Conv1D: a folded export's weight is a
    Linear's, transposed)."""
    r = Counter(a.r for a in adapters).most_common(1)[0][0]
    alpha = Counter(a.alpha for a in adapters).most_common(1)[0][0]
    rslora = {a.rslora for a in adapters}
    if len(rslora) > 1:
        raise PassError("the adapters mix rsLoRA's scale and LoRA's; PEFT's config has one use_rslora")
    conv1d = all(a.fan_in_fan_out and a.weight == f"{a.module}.weight" for a in adapters)
    dropout = Counter(a.dropout for a in adapters).most_common(1)[0][0]
    return {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model,
        "r": r,
        "lora_alpha": _number(alpha),
        "lora_dropout": dropout,
        "target_modules": sorted(a.module for a in adapters),
        "use_rslora": rslora.pop(),
        "fan_in_fan_out": conv1d,
        "bias": "none",
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "rank_pattern": {a.module: a.r for a in adapters if a.r != r},
        "alpha_pattern": {a.module: _number(a.alpha) for a in adapters if a.alpha != alpha},
    }


def write_peft(folder: str | os.PathLike, config: dict, weights: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> Path:
    """Write PEFT's folder: ``weights`` (module -> A, B) under PEFT's keys, and ``config``;
    each file whole or not at all."""
    folder = Path(folder)
    tensors = {
        peft_key(m, part): np.ascontiguousarray(v)
        for m, ab in weights.items()
        for part, v in zip(_PARTS, ab, strict=True)
    }
    data = save_safetensors(tensors, metadata={"format": "pt"})
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PassError(f"{folder}: cannot make the folder ({exc.strerror})") from None
    write_atomically(folder / WEIGHTS, data)
    write_atomically(folder / CONFIG, text.encode())
    return folder


def _number(x: float) -> int | float:
    return int(x) if math.isfinite(x) and float(x).is_integer() else float(x)
