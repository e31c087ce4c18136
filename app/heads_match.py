"""Heads that do not match the actor: refuse to start, or serve answers without
confidence (`heads_mismatch`, "refuse" or "answer-only").

Heads read hidden states of the actor they were fitted on; on another actor their numbers
mean nothing, so they are never used. The only choice is whether the service starts.
"""

from __future__ import annotations

import json
from pathlib import Path

from heads.dualread import EMBEDDED_HEADS, FingerprintMismatch, Heads
from models.loading import EMBEDDED_ACTOR, fingerprint

MODES = ("refuse", "answer-only")


def heads_fingerprint(heads_dir: str | Path | None) -> str:
    """The actor fingerprint a heads folder was fitted for (its card's)."""
    folder = Path(heads_dir) if heads_dir else EMBEDDED_HEADS
    return str(json.loads((folder / "heads_card.json").read_text())["actor_fingerprint"])


def mismatch_message(actor_dir: str | Path | None, heads_dir: str | Path | None,
                     actor_fp: str, heads_fp: str) -> str:
    """One paragraph: what does not match, and the ways out."""
    actor = str(actor_dir) if actor_dir else "the embedded actor"
    heads = str(heads_dir) if heads_dir else "the embedded heads"
    fit = "dualread fit-heads" + (f" --actor {actor_dir}" if actor_dir else "") + \
        " --out HEADS_DIR"
    return (f"The heads ({heads}) were fitted for actor {heads_fp}, but the actor ({actor}) "
            f"has fingerprint {actor_fp}: their confidences would mean nothing for it. "
            "Either pass --heads (DUALREAD_HEADS) a heads folder fitted for this actor, fit "
            f"one with `{fit}` and pass --heads HEADS_DIR, or serve answers without "
            "confidence with --heads-mismatch answer-only (DUALREAD_HEADS_MISMATCH="
            "answer-only): every /answer then has confidence null and defer true (defer "
            "reason no_heads).")


def mismatch(actor_dir: str | Path | None, heads_dir: str | Path | None) -> str | None:
    """`mismatch_message` when the heads were fitted for another actor, else None.

    Cheap (the fingerprint reads the small files and a few MiB of the weights; no model is
    built): `dualread serve` calls it before it starts. Any other problem (no actor, no
    heads, an unreadable card) is left to the loader, which reports it as before."""
    try:
        actor_fp = fingerprint(Path(actor_dir) if actor_dir else EMBEDDED_ACTOR)
        Heads.load(heads_dir, actor_fp, prepare=False)   # the one rule, legacy cards too
    except FingerprintMismatch:
        return mismatch_message(actor_dir, heads_dir, actor_fp, heads_fingerprint(heads_dir))
    except Exception:
        return None
    return None
