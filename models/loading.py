"""Load an actor from a local folder (never a hub)."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import torch

from models.actor import Actor
from models.compat import load_processor
from models.families import family_of

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EMBEDDED_ACTOR = Path(__file__).parent / "embedded" / "actor"


# Files besides the weights that every state depends on: how text becomes ids (tokenizer,
# chat template), how images become patches (processor), how decoding stops.
BEHAVIOUR_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                   "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
                   "chat_template.json", "processor_config.json", "preprocessor_config.json",
                   "video_preprocessor_config.json")


def system_prompt_of(folder: str | Path) -> str | None:
    card = Path(folder) / "actor_card.json"
    return json.loads(card.read_text()).get("system_prompt") if card.exists() else None


# 2: the fingerprint covers tokenizer, chat template, processor config and system prompt.
FINGERPRINT_SCHEME = 2
# fingerprint -> the scheme-1 fingerprint (config + weights only) of the same folder, for
# heads whose card predates scheme 2 (`Heads.load` accepts them with a warning)
LEGACY_FINGERPRINTS: dict[str, str] = {}


def _weights_hash(h, folder: Path) -> None:
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            h.update(fh.read(n))
            h.update(fh.read(1 << 20))
            fh.seek(max(0, f.stat().st_size - (1 << 20)))
            h.update(fh.read())


def legacy_fingerprint(folder: str | Path) -> str:
    """Scheme 1: config.json and the weights only."""
    folder = Path(folder)
    h = hashlib.sha256()
    h.update((folder / "config.json").read_bytes())
    _weights_hash(h, folder)
    return h.hexdigest()[:16]


def fingerprint(folder: str | Path) -> str:
    """A cheap identity of an actor: weights, tokenizer, chat template, processor config
    and system prompt (every state the heads read depends on all of them).

    Hashing every byte of a multi-GB checkpoint on each start would cost seconds; the
    header (names, shapes, offsets) plus the first and last MiB of each shard change
    whenever the weights do in practice. The small files are hashed whole, by name.
    """
    folder = Path(folder)
    h = hashlib.sha256()
    for name in BEHAVIOUR_FILES:
        f = folder / name
        if f.exists():
            h.update(f"<{name}>".encode())
            h.update(f.read_bytes())
    h.update(f"<system>{system_prompt_of(folder)!r}".encode())
    _weights_hash(h, folder)
    fp = h.hexdigest()[:16]
    LEGACY_FINGERPRINTS[fp] = legacy_fingerprint(folder)
    return fp


def load_actor(folder: str | Path | None = None, device: str = "cpu",
               dtype: str = "float32", attn_implementation: str | None = None) -> Actor:
    """`AutoModelForImageTextToText` + processor from a local folder, eval mode, frozen."""
    from transformers import AutoModelForImageTextToText

    folder = Path(folder) if folder else EMBEDDED_ACTOR
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"no actor at {folder} (expected config.json and weights)")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("--device cuda requested but CUDA is not available")
    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    family = family_of(model_type)
    kwargs = {"local_files_only": True, "dtype": DTYPES[dtype]}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForImageTextToText.from_pretrained(folder, **kwargs).to(device).eval()
    model.requires_grad_(False)
    processor = load_processor(str(folder), model_type)
    system = system_prompt_of(folder)
    return Actor(model, processor, family, str(folder), fingerprint(folder), system)
