"""Glue between HTTP and the core: load the actor and heads, run batches, shape results."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from PIL import Image

from heads.dualread import Heads
from models.loading import load_actor
from models.masking import MaskSpec


@dataclass
class AnswerJob:
    image: Image.Image
    question: str


class Service:
    def __init__(self, actor_dir: str | None, heads_dir: str | None, device: str = "cpu",
                 dtype: str = "float32") -> None:
        self.actor = load_actor(actor_dir, device=device, dtype=dtype)
        self.heads = Heads.load(heads_dir, self.actor.fingerprint)
        self.heads_id = self.heads.card.get("heads_id") or \
            f"{self.heads.actor_fingerprint}-{self.heads.card.get('git_commit', '')[:8]}"
        self.threshold = self.heads.policy.tau if self.heads.policy else 1.5

    def cards(self) -> dict[str, Any]:
        import json
        from pathlib import Path

        card = Path(self.actor.folder) / "actor_card.json"
        actor_card = json.loads(card.read_text()) if card.exists() else {}
        actor_card.pop("log", None)
        return {"actor": {"fingerprint": self.actor.fingerprint, "folder_name":
                          Path(self.actor.folder).name, "family": self.actor.family.name,
                          "card": actor_card},
                "heads": {"id": self.heads_id, "card": self.heads.card}}

    def answer_batch(self, jobs: list[AnswerJob], max_new_tokens: int) -> list[dict]:
        res = self.actor.answer([j.image for j in jobs], [j.question for j in jobs],
                                max_new_tokens, readout="capture")
        tm = dict(self.actor.last_timings)
        out = []
        for r in res:
            t = time.perf_counter()
            conf = self.heads.confidence(r.readout)
            heads_s = time.perf_counter() - t
            out.append({"answer": r.answer, "canonical": r.canonical, "response": r.text,
                        "confidence": conf, "defer": self.heads.defer(conf["dualread"]),
                        "timings": {"generate": tm["generate"], "readout": tm["readout"],
                                    "heads": heads_s}})
        return out

    def score_one(self, image: Image.Image, question: str, response: str,
                  mask: MaskSpec | None) -> dict:
        r = self.actor.score([image], [question], [response], mask=mask)[0]
        ro = r.readout
        return {"confidence": self.heads.confidence(ro), "mu_c": ro.verbalized_mu,
                "answer": r.answer, "masked_tokens": len(ro.positions.get("masked", []))}
