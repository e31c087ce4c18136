"""The model side of serving: load the actor and its heads, check inputs against the
tokenizer, run batches and shape typed results. The numbers come from `models` + `heads`."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from app.defer_codes import NO_HEADS_REASON, answer_only_codes, defer_codes
from app.errors import (
    DeadlineExceeded,
    ModelFailure,
    NoHeads,
    QuestionInvalid,
    TrajectoryInvalid,
)
from app.heads_match import heads_fingerprint, mismatch_message
from app.serving import (
    AnswerItem,
    AnswerResult,
    Confidences,
    NoveltyResult,
    ScoreItem,
    ScoreResult,
    StageTimes,
)
from app.text import CONTROL, mixed_script_letter, plain_question
from heads.dualread import Assessment, FingerprintMismatch, Heads
from heads.recert import SHIPPED, DeferRule, Served, input_key
from models.actor import Actor, Answers, ReadoutMode
from models.loading import load_actor
from models.quality import response_problem, uses_answer_tag
from models.readout import Response

log = logging.getLogger("dualread.service")
AnswerJob = AnswerItem   # the earlier name


def _confidences(c: dict[str, float]) -> Confidences:
    return Confidences.from_scores(c)


class Service:
    def __init__(self, actor_dir: str | None, heads_dir: str | None, device: str = "cpu",
                 dtype: str = "float32", heads_mismatch: str = "refuse") -> None:
        actor = load_actor(actor_dir, device=device, dtype=dtype)
        # Heads fitted on another actor read meaningless states: never used. "answer-only"
        # serves answers without them (app.heads_match); otherwise loading fails.
        self.heads_problem: str | None = None
        try:
            heads: Heads | None = Heads.load(heads_dir, actor.fingerprint)
        except FingerprintMismatch:
            self.heads_problem = mismatch_message(actor_dir, heads_dir, actor.fingerprint,
                                                  heads_fingerprint(heads_dir))
            if heads_mismatch != "answer-only":
                raise FingerprintMismatch(self.heads_problem) from None
            log.warning(json.dumps({"event": "answer_only", "detail": self.heads_problem}))
            heads = None
        self._attach(actor, heads)

    @classmethod
    def of(cls, actor: Actor, heads: Heads) -> Service:
        """A service over an actor and heads already loaded (the in-process benchmark runs
        exactly what `/answer` runs)."""
        if heads.actor_fingerprint != actor.fingerprint:
            raise ValueError("these heads were fitted on another actor")
        svc = cls.__new__(cls)
        svc._attach(actor, heads)
        return svc

    def _attach(self, actor: Actor, heads: Heads | None) -> None:
        self.actor, self.heads = actor, heads
        # the artefact as shipped; `heads` is what serves (a re-certified rule applied)
        self.base_heads = heads
        self.fingerprint = self.actor.fingerprint
        self.heads_id = None if heads is None else heads.heads_id
        self.needs_tag = uses_answer_tag(self._actor_card().get("response_format"))

    def use_rule(self, rule: DeferRule) -> None:
        """Serve `rule` from the next batch on (one reference swap: a batch reads one
        heads object from start to end)."""
        self.heads = rule.apply(self.base_heads)

    @property
    def rule_version(self) -> str:
        return getattr(self.heads, "rule_version", SHIPPED)

    @property
    def threshold(self) -> float | None:
        """τ of the heads' defer policy (above any probability when there is none); None
        without heads (answer-only)."""
        return None if self.heads is None else self.heads.defer_threshold

    def _actor_card(self) -> dict[str, Any]:
        card = Path(self.actor.folder) / "actor_card.json"
        return json.loads(card.read_text()) if card.exists() else {}

    def info(self) -> dict[str, str]:
        """Labels of the dualread_model_info metric."""
        return {"actor": self.fingerprint, "heads": self.heads_id or "none",
                "family": self.actor.family.name, "device": str(self.actor.device)}

    def cards(self) -> dict[str, Any]:
        actor_card = self._actor_card()
        actor_card.pop("log", None)
        return {"actor": {"fingerprint": self.actor.fingerprint, "folder_name":
                          Path(self.actor.folder).name, "family": self.actor.family.name,
                          "card": actor_card},
                "heads": {"id": self.heads_id, "card": None if self.heads is None else
                          self.heads.card, "mismatch": self.heads_problem}}

    # ------------------------------------------------------------------ input checks
    def check_question(self, question: str, max_chars: int, max_tokens: int) -> str:
        bad = CONTROL.search(question)
        if bad:
            # NUL, ESC or a bidi override reach the model unseen by whoever reads the log
            raise QuestionInvalid(f"question contains a control character "
                                  f"(U+{ord(bad.group()):04X}); remove it")
        if len(question) > max_chars:
            # as sent, before normalising: it walks every character (a 32 MB body of them
            # would hold the event loop for a minute), and the OpenAPI document can state
            # a length as sent (maxLength), not one after invisible characters are dropped
            raise QuestionInvalid(f"question is longer than {max_chars} characters")
        q = plain_question(question)
        if not q:
            raise QuestionInvalid("question is empty")
        if not any(c.isalnum() for c in q):
            # "?" alone was answered "yes" at confidence 0.9996
            raise QuestionInvalid("question has no letter or digit")
        odd = mixed_script_letter(q)
        if odd is not None:
            raise QuestionInvalid(f"question has a letter of another script posing as a "
                                  f"Latin one (U+{ord(odd):04X}); retype it")
        self._check_tokens(q, max_tokens, QuestionInvalid, "question ")
        return q

    def check_response(self, response: str, max_tokens: int) -> str:
        """The text that will be scored (masks index into it), or TrajectoryInvalid."""
        bad = CONTROL.search(response)
        if bad:   # as for questions; the response's answer is returned to the caller
            raise TrajectoryInvalid(f"contains a control character "
                                    f"(U+{ord(bad.group()):04X}); remove it")
        # the budget counts the trajectory's own tokens, not the cue appended to it
        self._check_tokens(self.actor.score_text(response, cue=False), max_tokens,
                           TrajectoryInvalid)
        return self.actor.score_text(response)

    def _check_tokens(self, text: str, max_tokens: int, error: type[Exception],
                      subject: str = "") -> None:
        """No reserved (template) token, at most `max_tokens` tokens; `subject` starts the
        message ("question " for questions; a trajectory's error names its field itself)."""
        reserved = self.actor.reserved_tokens_in(text)
        if reserved:
            raise error(f"{subject}contains reserved token(s) {', '.join(reserved)}")
        n = self.actor.count_tokens(text)
        if n > max_tokens:
            count = f"{subject}is {n}" if subject else str(n)
            raise error(f"{count} tokens, over the limit of {max_tokens}")

    # ------------------------------------------------------------------ batch handlers
    def answer_batch(self, items: list[AnswerItem], deadlines: list[float]
                     ) -> list[AnswerResult | Exception]:
        # without heads nothing reads the states: none are captured
        return self.answer_responses(items, deadlines,
                                     "capture" if self.heads is not None else "none")[1]

    def answer_responses(self, items: list[AnswerItem], deadlines: list[float],
                         readout: ReadoutMode = "capture"
                         ) -> tuple[Answers, list[AnswerResult | Exception]]:
        """`answer_batch`, with the actor's responses too (`readout`: how the states are
        read; the service captures them, the benchmark also times replay)."""
        heads = self.heads       # the rule this batch is decided by, start to end
        res = self.actor.answer([i.image for i in items], [i.question for i in items],
                                [i.max_new_tokens for i in items], readout=readout,
                                deadlines=deadlines)
        now = time.monotonic()
        live = [k for k, d in enumerate(deadlines) if now <= d]
        scored = self._assess_batch({k: res[k].readout for k in live}, heads,
                                    {k: items[k].image for k in live})
        out: list[AnswerResult | Exception] = []
        for k, (r, deadline) in enumerate(zip(res, deadlines)):
            if now > deadline:     # decoding was cut at the deadline; its caller has gone
                out.append(DeadlineExceeded("deadline passed while generating"))
                continue
            out.append(self._guard(lambda r=r, c=scored.get(k), it=items[k]:
                                   self._answer(r, res.timings, c, heads, it.image,
                                                it.question)))
        return res, out

    def _assess_batch(self, readouts: dict[int, Any], heads: Heads | None = None,
                      images: dict[int, Any] | None = None
                      ) -> dict[int, tuple[Assessment, float]]:
        """Served confidences and novelty of a whole batch in one call of the readers (each
        readout's decoded image in `images`: the detector's pixel part reads it), with each
        item's share of the seconds; {} when the call fails (each item then scores alone, so
        a bad readout or image fails only its own item)."""
        if not readouts or self.heads is None:
            return {}
        t = time.perf_counter()
        try:
            h, rs = heads or self.heads, list(readouts.values())
            confs = h.assess(rs) if images is None else h.assess(rs, [images[k] for k in readouts])
        except Exception as e:
            # once per batch: the per-item fallback hides the failure from the caller
            log.warning(json.dumps({"event": "batch_scoring_failed", "items": len(readouts),
                                    "error": type(e).__name__, "detail": str(e)[:200]}),
                        exc_info=e)
            return {}
        each = (time.perf_counter() - t) / len(readouts)
        return {k: (c, each) for k, c in zip(readouts, confs)}

    def _answer(self, r: Response, timings, scored: tuple[Assessment, float] | None = None,
                heads: Heads | None = None, image: Any = None, question: str | None = None
                ) -> AnswerResult:
        if (heads or self.heads) is None:
            return self._answer_only(r, timings)
        t = time.perf_counter()
        heads = heads or self.heads
        a, batch_s = scored if scored is not None else \
            (heads.assess([r.readout], None if image is None else [image])[0], 0.0)
        conf = _confidences(a.confidence)
        nov = a.novelty                              # None: these heads have no detector
        heads_s = time.perf_counter() - t + batch_s
        problem = response_problem(r.parsed, r.token_ids, r.finished, self.needs_tag)
        # the heads hold the whole rule: τ, the novelty p-value against α, the parse check
        nov_p = nov.p_value if nov else None
        defer, reason = heads.decide(conf.dualread, nov_p, problem)
        read = {"novelty": nov} if nov is not None else {}
        served = None if a.logits is None else Served(
            getattr(heads, "rule_version", SHIPPED), a.logits,
            {k: v.score for k, v in read.items()}, {k: v.p_value for k, v in read.items()},
            problem is not None,
            "" if question is None else input_key(image, question))
        return AnswerResult(
            answer=r.answer, canonical=r.canonical, response=r.text, confidence=conf,
            defer=defer, defer_reason=reason,
            defer_codes=tuple(defer_codes(heads, conf.dualread, nov_p, problem)),
            timings=StageTimes(timings.generate, timings.readout, heads_s),
            novelty=None if nov is None else NoveltyResult(nov.score, nov.p_value, nov.novel),
            served=served,
            calibrated=heads.calibrated(nov_p), threshold=heads.defer_threshold)

    def _answer_only(self, r: Response, timings) -> AnswerResult:
        """No heads: the answer, deferred, with why the response is unusable if it is."""
        problem = response_problem(r.parsed, r.token_ids, r.finished, self.needs_tag)
        return AnswerResult(
            answer=r.answer, canonical=r.canonical, response=r.text, confidence=None,
            defer=True, defer_reason="; ".join(x for x in (NO_HEADS_REASON, problem) if x),
            defer_codes=tuple(answer_only_codes(problem)),
            timings=StageTimes(timings.generate, timings.readout, 0.0), calibrated=False)

    def score_batch(self, items: list[ScoreItem], deadlines: list[float]
                    ) -> list[ScoreResult | Exception]:
        if self.heads is None:          # the routes refuse first (NoHeads); this holds anyway
            return [NoHeads() for _ in items]
        res = self.actor.score([i.image for i in items], [i.question for i in items],
                               [i.response for i in items], mask=[i.mask for i in items])
        return [self._guard(lambda r=r: self._score(r)) for r in res]

    def _score(self, r: Response) -> ScoreResult:
        ro = r.readout
        return ScoreResult(confidence=_confidences(self.heads.confidence(ro)),
                           mu_c=ro.verbalized_mu, answer=r.answer,
                           masked_tokens=len(ro.positions.get("masked", [])),
                           digits=None if ro.digit_probs is None
                           else [round(float(p), 6) for p in ro.digit_probs])

    @staticmethod
    def _guard(fn) -> Any:
        """One item's failure is that item's error, not the batch's."""
        try:
            return fn()
        except Exception as e:
            log.error("item failed: %s", type(e).__name__, exc_info=e)
            return ModelFailure("the model failed on this item")

    def __repr__(self) -> str:
        return f"Service(actor={self.actor.fingerprint}, heads={self.heads_id})"

