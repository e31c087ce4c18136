"""The method registry: one unit per confidence method, and what iterates over it.

A stand-in actor (no transformer) counts the passes it is asked for, so "the Collector
runs the union of what the chosen methods need" and "a cached shard is reused" are
visible as call counts.
"""

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import heads.collect as collect
from heads import passes, registry
from heads.collect import Collector
from heads.dualread import EMBEDDED_HEADS, Heads
from heads.evaluate import evaluate
from heads.fit import fit_methods
from heads.passes import Pass
from heads.registry import FitData, Method
from models.data import Item
from models.readout import Response
from tests.helpers import red_or_blue, seeded_response

DIM = 8
DOCS_REPORT = Path(__file__).resolve().parents[1] / "docs" / "eval-easyvqa-1000" / "report.json"


# ------------------------------------------------------------------ a stand-in actor
class StandIn:
    """Answers "red" for reddish images; readouts are seeded by (image, question)."""

    folder = "stand-in"

    def __init__(self, fingerprint: str = "fp") -> None:
        self.fingerprint = fingerprint
        self.calls = {"answer": 0, "score": 0, "sample": 0, "next_token_probs": 0}
        self.tokenizer = None

    def _response(self, img, question: str, text: str) -> Response:
        return seeded_response(img, question, text, DIM)

    @staticmethod
    def _text(img) -> str:
        return red_or_blue(img)

    def answer(self, images, questions, max_new_tokens=64, readout="capture"):
        self.calls["answer"] += 1
        return [self._response(i, q, self._text(i)) for i, q in zip(images, questions)]

    def score(self, images, questions, responses, cue=True):
        self.calls["score"] += 1
        return [self._response(i, q, r) for i, q, r in zip(images, questions, responses)]

    def sample(self, images, questions, k, temperature=1.0, max_new_tokens=64, seed=None):
        self.calls["sample"] += 1
        return [[self._response(i, q, "<answer>red</answer>") for _ in range(k)]
                for i, q in zip(images, questions)]

    def next_token_probs(self, images, questions):
        self.calls["next_token_probs"] += 1
        raise AssertionError("no test here asks for P(True)")


def make_items(folder: Path, n: int = 10) -> list[Item]:
    out = []
    for k in range(n):
        path = folder / f"{k}.png"
        Image.new("RGB", (8, 8), (200, 40, 40) if k % 3 else (20, 20, 200)).save(path)
        out.append(Item(id=f"i{k}", image_path=str(path), question=f"what color {'?' * k}",
                        answer="red", image_id=f"img{k}"))
    return out


def write_jsonl(items: list[Item], folder: Path) -> str:
    rows = [{"id": it.id, "image": Path(it.image_path).name, "question": it.question,
             "answer": it.answer, "image_id": it.image_id} for it in items]
    (folder / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return f"jsonl:{folder / 'd.jsonl'}"


# ------------------------------------------------------------------ a toy method
def question_length(col, items, meta):
    """The toy pass: one number per item, the length of its question."""
    return {"question_length": torch.tensor([float(len(it.question)) for it in items])}


class QuestionLength(Method):
    """Toy: confidence falls with question length, scaled by a fitted constant."""

    name = "question_length"
    cost = "1 toy pass"
    passes = ("question_length",)
    fit_passes_on = "all"

    def fit(self, heads, data):
        heads.temperatures[self.name] = float(data.x("question_length", "temperature").max())
        return {"scale": heads.temperatures[self.name]}

    def score(self, heads, f):
        return 1.0 - f["question_length"].double().numpy() / (2 * heads.temperature(self.name))


@pytest.fixture
def toy():
    """Register the toy pass and method (one line each), and remove them afterwards."""
    passes.register_pass(Pass("question_length", question_length))
    method = registry.register(QuestionLength())
    yield method
    registry.unregister(method.name)
    passes.unregister_pass("question_length")


# ------------------------------------------------------------------ the registry
def test_canonical_names_are_the_shipped_report_keys_in_table_order():
    report = json.loads(DOCS_REPORT.read_text())
    shipped = report["datasets"]["easyvqa:test"]["methods"]
    dropped = report.get("dropped", {})     # left out of the table, with a reason
    # question_only is evaluate's grounding baseline, read from the card, not a method
    assert shipped.pop("question_only")["cost_passes"].startswith("0")
    assert tuple(n for n in registry.names() if n not in dropped) == tuple(shipped)
    for name, row in shipped.items():
        assert registry.get(name).cost == row["cost_passes"], name


def test_unknown_method_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown method 'sc8'.*sc_8"):
        registry.select(("sc8",))


def test_passes_are_the_union_of_what_methods_need():
    chosen = registry.select(("psr", "sc_2", "sc_4", "blind_image_contrast", "dualread"))
    assert registry.passes_for(chosen) == ("samples", "black_image")
    assert registry.passes_for(registry.select(("dualread", "verbalized"))) == ()


def test_heads_score_keeps_its_readout_only_keys():
    h = Heads.new(DIM)
    g = torch.Generator().manual_seed(0)
    f = {"h_pre": torch.randn(3, DIM, generator=g), "h_close": torch.randn(3, DIM, generator=g),
         "phi": torch.randn(3, 4 * DIM, generator=g), "h_mid": torch.randn(3, DIM, generator=g),
         "msp": torch.rand(3, 1, generator=g), "mean_logprob": -torch.rand(3, 1, generator=g),
         "entropy": torch.rand(3, 1, generator=g), "mu": torch.rand(3, 1, generator=g)}
    assert set(h.score(f)) == {"psr", "p_state", "per", "dualread", "verbalized",
                               "max_sequence_probability", "saplma", "mean_token_logprob",
                               "predictive_entropy", "answer_consistency"}
    assert set(h.readers) == {"psr", "state", "visual", "saplma", "bicr", "consistency"}


def test_a_caller_writing_into_one_score_does_not_change_dualreads_fusion():
    """Within one call PSR's and PER's probabilities are kept for DualRead's fusion
    (`Scored`); the arrays handed out must be copies of what is kept."""
    h = Heads.new(DIM)
    for reader in h.readers.values():
        reader.eval()                                    # no dropout: repeatable scores
    g = torch.Generator().manual_seed(1)
    f = {"h_pre": torch.randn(3, DIM, generator=g), "h_close": torch.randn(3, DIM, generator=g),
         "phi": torch.randn(3, 4 * DIM, generator=g)}
    want = registry.get("dualread").score(h, registry.Scored(dict(f)))
    shared = registry.Scored(dict(f))
    for name in ("psr", "per"):
        registry.get(name).score(h, shared)[:] = 0.0          # a careless caller
    assert np.array_equal(registry.get("dualread").score(h, shared), want)


def test_served_methods_are_the_answer_schema_fields():
    """`/answer`'s confidence fields come from the registry: the two must agree."""
    from clients.schemas import SERVED_CONFIDENCES, Confidence

    served = {m.name for m in registry.registered() if m.served}
    assert served == set(Confidence.model_fields) == {"dualread", "psr", "per", "verbalized"}
    assert list(SERVED_CONFIDENCES) == ["dualread", "psr", "per", "verbalized"]  # JSON order
    registry.check_served()                        # the import-time check agrees


class ServedToy(Method):
    name = "served_toy"
    served = True

    def score(self, heads, f):
        return np.zeros(1)


def test_a_served_method_missing_from_the_schema_list_is_refused():
    with pytest.raises(ValueError, match="'served_toy' is marked served.*SERVED_CONFIDENCES"):
        registry.register(ServedToy())
    assert "served_toy" not in registry.names()


def test_a_served_method_that_is_listed_registers(monkeypatch):
    import clients.schemas

    monkeypatch.setitem(clients.schemas.SERVED_CONFIDENCES, "served_toy", "a toy")
    try:
        registry.register(ServedToy())
        registry.check_served()
    finally:
        registry.unregister("served_toy")


def test_a_schema_field_without_a_served_method_is_caught(monkeypatch):
    import clients.schemas

    monkeypatch.setitem(clients.schemas.SERVED_CONFIDENCES, "orphan", "no method serves it")
    with pytest.raises(ValueError, match=r"fields only \['orphan'\]"):
        registry.check_served()
    monkeypatch.delitem(clients.schemas.SERVED_CONFIDENCES, "orphan")
    monkeypatch.setattr(registry.get("psr"), "served", False)   # a method dropped from serving
    with pytest.raises(ValueError, match=r"fields only \['psr'\]"):
        registry.check_served()


def test_toy_method_is_fitted_saved_and_found_in_the_evaluation_table(toy, tmp_path):
    from heads.evaluate import METHODS

    assert "question_length" in METHODS                   # the default table follows it
    actor = StandIn()
    items = make_items(tmp_path)
    spec = write_jsonl(items, tmp_path)
    # fitting: the toy sees its pass's features on the temperature split
    col = Collector(actor, None, batch=4)
    feats, _ = col.run(items, passes=("question_length",))
    splits = {s: torch.arange(10) for s in ("reader", "reader_train", "reader_val",
                                             "temperature", "defer")}
    splits["temperature"] = torch.tensor([0, 1, 2])
    heads = Heads.new(DIM)
    heads.actor_fingerprint = actor.fingerprint
    log = fit_methods(heads, FitData(feats, feats["z"], splits), [toy])
    longest = max(len(items[i].question) for i in (0, 1, 2))      # "what color ??"
    assert log == {"question_length": {"scale": float(longest)}}
    heads.save(tmp_path / "heads", {"command": "test"})
    card = json.loads((tmp_path / "heads" / "heads_card.json").read_text())
    assert card["temperatures"]["question_length"] == longest
    assert "question_length" in card["methods"]
    back = Heads.load(tmp_path / "heads", actor.fingerprint)
    # evaluation (one chunk): only the toy's pass runs (dualread and verbalized need none)
    actor = StandIn()
    report = evaluate(actor, back, [spec], tmp_path / "eval",
                      methods=("verbalized", "question_length", "dualread"), bootstrap=0)
    assert actor.calls == {"answer": 1, "score": 0, "sample": 0, "next_token_probs": 0}
    rows = report["datasets"][spec]["methods"]
    assert list(rows) == ["verbalized", "question_length", "dualread"]
    assert rows["question_length"]["cost_passes"] == "1 toy pass"
    # hand-computed: c_i = 1 - len(q_i) / (2 * longest); wrong answers are k % 3 == 0
    c = np.array([1 - len(it.question) / (2 * longest) for it in items])
    z = np.array([k % 3 != 0 for k in range(10)], int)
    assert rows["question_length"]["brier"] == pytest.approx(np.mean((c - z) ** 2))
    table = (tmp_path / "eval" / "report.md").read_text()
    # its row of the main table, with the cost it declared
    row = [ln for ln in table.splitlines() if ln.startswith("| question_length |")
           and "| 1 toy pass |" in ln]
    assert len(row) == 1


def test_toy_method_is_gone_after_unregistering(toy):
    registry.unregister(toy.name)
    assert toy.name not in registry.names()
    registry.register(toy)     # the fixture removes it again


# ------------------------------------------------------------------ the artefact
def test_legacy_card_loads_under_canonical_keys(tmp_path):
    # The card the first release shipped (tests/data), beside weights of the same shapes.
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    shutil.copy(Path(__file__).parent / "data" / "legacy_heads_card.json",
                legacy / "heads_card.json")
    shutil.copy(EMBEDDED_HEADS / "heads.safetensors", legacy / "heads.safetensors")
    card = json.loads((legacy / "heads_card.json").read_text())
    assert "T_pre" in card["temperatures"] and "sc8" in card["platt"]    # the old format
    h = Heads.load(legacy)
    assert h.temperature("psr") == card["temperatures"]["T_pre"]
    assert h.temperature("blind_image_contrast") == card["temperatures"]["T_bicr"]
    assert h.platt_map("sc_8") == tuple(card["platt"]["sc8"])
    assert h.platt_map("semantic_uncertainty") == tuple(card["platt"]["semantic"])
    # a hand-computed score through the legacy Platt map of predictive entropy
    a, b = card["platt"]["predictive_entropy"]
    f = {"entropy": torch.tensor([[0.05]])}
    got = registry.get("predictive_entropy").score(h, f)[0]
    assert got == pytest.approx(1 / (1 + math.exp(-(a * -0.05 + b))), rel=1e-6)
    # saved again, the card speaks the canonical names only
    h.save(tmp_path, dict(h.card))
    saved = json.loads((tmp_path / "heads_card.json").read_text())
    assert "sc_8" in saved["platt"] and "sc8" not in saved["platt"]
    assert "psr" in saved["temperatures"] and "T_pre" not in saved["temperatures"]


# ------------------------------------------------------------------ the cache keys
@pytest.fixture
def cached(tmp_path):
    items = make_items(tmp_path)
    cache = tmp_path / "cache"
    Collector(StandIn(), cache, batch=4).run(items, passes=("black_image",))
    return items, cache


def test_unchanged_code_reuses_every_shard(cached):
    items, cache = cached
    actor = StandIn()
    Collector(actor, cache, batch=4).run(items, passes=("black_image",))
    assert actor.calls["answer"] == 0 and actor.calls["score"] == 0


def test_a_new_feature_schema_recomputes_the_natural_pass(cached, monkeypatch):
    items, cache = cached
    monkeypatch.setattr(collect, "FEATURE_SCHEMA", collect.FEATURE_SCHEMA + 1)
    actor = StandIn()
    Collector(actor, cache, batch=4).run(items)
    assert actor.calls["answer"] == 3


def test_changed_pass_code_recomputes_that_pass_only(cached, monkeypatch):
    items, cache = cached
    old = passes.PASSES["black_image"]

    def run_black_image_v2(col, chunk, meta):
        return {"h_close_black": torch.zeros(len(chunk), DIM)}

    monkeypatch.setitem(passes.PASSES, "black_image", replace(old, run=run_black_image_v2))
    actor = StandIn()
    feats, _ = Collector(actor, cache, batch=4).run(items, passes=("black_image",))
    assert actor.calls["answer"] == 0                     # the natural pass is unchanged
    assert torch.equal(feats["h_close_black"], torch.zeros(10, DIM))   # not the stale shard
    monkeypatch.setitem(passes.PASSES, "black_image", replace(old, version=old.version + 1))
    actor = StandIn()
    Collector(actor, cache, batch=4).run(items, passes=("black_image",))
    assert actor.calls == {"answer": 0, "score": 3, "sample": 0, "next_token_probs": 0}


def test_kappa_and_a_collector_with_other_features_get_their_own_shards(cached):
    items, cache = cached
    actor = StandIn()
    Collector(actor, cache, batch=4, kappa=0.2).run(items)
    assert actor.calls["answer"] == 3

    class WithImages(Collector):
        def _base(self, chunk):
            tensors, meta = super()._base(chunk)
            tensors["n_image_tokens"] = torch.full((len(chunk),), 3.0)
            return tensors, meta

    actor = StandIn()
    feats, _ = WithImages(actor, cache, batch=4).run(items)
    assert actor.calls["answer"] == 3 and "n_image_tokens" in feats
