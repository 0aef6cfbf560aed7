"""Stream a checkpoint's tensors out of safetensors files, one at a time.

Why lazily: the model runner copies each tensor into its own (possibly sharded, possibly
fused) parameter as it arrives, so peak host memory stays at roughly one tensor, not a second
copy of the whole checkpoint. Only safetensors are read: pickled `.bin` checkpoints can run
arbitrary code on load and cannot be memory-mapped.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

if TYPE_CHECKING:  # the gateway imports this package (for `resolve_model_path`): no torch
    import torch

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
_PICKLE_WEIGHT_PATTERNS = ("pytorch_model*.bin", "*.pt", "*.pth", "consolidated*.pth")


def find_safetensors_files(folder: Path) -> list[Path]:
    """The safetensors files that make up the checkpoint in `folder`, in a stable order.

    With an index, only the files it names count: some repos also ship a `consolidated`
    copy of the same weights next to the shards, and reading both would load them twice.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"Model folder {folder} does not exist or is not a directory.")

    index_path = folder / SAFETENSORS_INDEX_FILE
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(
                f"{index_path} names shard(s) that are not in {folder}: {missing}. "
                "The download is incomplete: fetch the missing shards or re-download the model."
            )
        return files

    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files

    pickled = sorted({p.name for pat in _PICKLE_WEIGHT_PATTERNS for p in folder.glob(pat)})
    if pickled:
        raise ValueError(
            f"{folder} holds only PyTorch pickle weights ({', '.join(pickled)}); Tandem loads "
            "safetensors only. Convert them, e.g. `AutoModelForCausalLM.from_pretrained(folder)"
            ".save_pretrained(out)` with transformers, and point Tandem at `out`."
        )
    raise FileNotFoundError(f"No *.safetensors weight files found in {folder}.")


def iter_safetensors_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` for every tensor of the checkpoint in `folder`, on CPU.

    Works for a single `model.safetensors`, an indexed sharded checkpoint, and several
    `*.safetensors` without an index. Tensors keep their stored dtype; a name that appears in
    two files is an error (it would otherwise silently depend on file order).
    """
    seen_names: set[str] = set()
    for path in find_safetensors_files(Path(folder)):
        logger.debug("Reading weights from %s", path)
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if name in seen_names:
                    raise ValueError(f"Tensor {name!r} appears in more than one file ({path}).")
                seen_names.add(name)
                yield name, f.get_tensor(name)
