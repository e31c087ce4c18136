"""TGS's summary on hand-built records (mutation gaps of clients/probes/tgs.py): every
field of `summarise` — the counts, TGS-self and its curve, the pairs and their intervals,
the hesitation section, the gold and held-out pairs (`_external`), their counts and the
wrong answers against τ (`_deferral`) — against expectations computed here with numpy
from the records; and the two pieces of `run_item` that need no service (`plan_external`,
`_descriptions`)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from clients.probes import external
from clients.probes import tgs as tgs_probe
from clients.probes.runner import Config, Context
from clients.probes.stats import cluster_bootstrap, share_close
from models.data import Item
from models.synonyms import table_for

IFACES = ("dualread", "psr", "per", "verbalized")
AXES = ("vision", "reasoning", "answer")
FAMS = ("synonym", "phrase", "paraphrase")
SRCS = ("own", "gold")
TAU = 0.6
CFG = Config(data="t", bootstrap=40, mask_ratios=(0.0, 0.5, 1.0), mask_seeds=(0, 1))
# no record has these: a held-out family that never applied to a source or an axis
NEVER = {"phrase:own:vision", "phrase:gold:vision",
         *(f"paraphrase:own:{x}" for x in ("good", *AXES))}
EXTERNAL = ("gold", *(f"gold:{a}" for a in AXES),
            *(f"{f}:{s}:{x}" for f in FAMS for s in SRCS for x in ("good", *AXES)))


def _labels(missing: tuple[str, ...]) -> list[str]:
    own = ["good", "mask:0.5:0", "mask:0.5:1", "mask:1:0", *AXES]
    return [lab for lab in own + list(EXTERNAL) if lab not in NEVER and lab not in missing]


def _records() -> list[dict]:
    """Seven items on four images; each label and interface its own confidence."""
    rng = np.random.default_rng(5)

    def rec(image: str, z: bool, masked: int, missing: tuple[str, ...] = (), hes: int = 0,
            tau: float | None = TAU, real: bool = True) -> dict:
        labels = _labels(missing) + [f"hes:{j}:{s}" for j in range(hes) for s in ("pre", "post")]
        scores = {lab: {k: round(float(rng.uniform(0.05, 0.95)), 3) for k in IFACES}
                  for lab in labels}
        real_c = {k: round(float(rng.uniform(0.3, 0.95)), 3) for k in IFACES} if real else None
        return {"image_id": image, "z": z, "interfaces": list(IFACES), "masked_tokens": masked,
                "scores": scores, "variants": {}, "hesitations": hes, "tau": tau,
                "real_c": real_c}

    recs = [rec("A", True, 7, hes=2),
            rec("A", False, 3, missing=("vision", "gold:vision")),
            rec("B", True, 0, missing=("reasoning",), hes=1),
            rec("C", False, 5, missing=EXTERNAL, tau=None, real=False),   # stored before
            rec("C", True, 4),
            rec("D", True, 1, missing=("answer", "synonym:own:answer")),
            rec("D", False, 0)]
    del recs[0]["interfaces"]                  # read from the good trajectory's scores
    recs[2]["scores"]["hes:0:pre"]["dualread"] = 0.02       # |Δ| exactly .02: unchanged
    recs[2]["scores"]["hes:0:post"]["dualread"] = 0.0
    recs[0]["scores"]["hes:1:post"]["psr"] = recs[0]["scores"]["hes:1:pre"]["psr"]  # no change
    recs[6]["real_c"]["dualread"] = TAU                     # wrong, at τ: released
    recs[4]["scores"]["answer"]["dualread"] = TAU           # a flip at τ: released
    del recs[5]["real_c"]["dualread"]
    return recs


# ---------------------------------------------------------------- the expectation
def _ci(rows: list[dict], d: np.ndarray) -> tuple[float, float]:
    if not rows:
        return (math.nan, math.nan)
    return cluster_bootstrap([r["image_id"] for r in rows], lambda idx: float(d[idx].mean()),
                             CFG.bootstrap, 42)


def _avg(x) -> float:
    x = np.asarray(x, float)
    return float(x.mean()) if x.size else math.nan


def _finite_mean(xs: list[float]) -> float:
    xs = [x for x in xs if np.isfinite(x)]
    return float(np.mean(xs)) if xs else math.nan


def _pair(rows: list[dict], k: str, good: str, bad: str) -> tuple[float, tuple, int]:
    rows = [r for r in rows if good in r["scores"] and bad in r["scores"]]
    d = np.array([r["scores"][good][k] - r["scores"][bad][k] for r in rows])
    return _avg(d), _ci(rows, d), len(rows)


def _want_external(recs: list[dict], k: str) -> dict:
    right = [r for r in recs if r["z"]]
    v: dict = {}
    for a in AXES:
        v[f"gold_pair_{a}"], v[f"gold_pair_{a}_ci"], _ = _pair(recs, k, "gold", f"gold:{a}")
    v["gold_pair"] = _finite_mean([v[f"gold_pair_{a}"] for a in AXES])
    v["own_minus_gold"] = _avg([r["scores"]["good"][k] - r["scores"]["gold"][k]
                                for r in right if "gold" in r["scores"]])
    held: dict = {}
    for fam in FAMS:
        held[fam] = {}
        for src, rows, base in (("own", right, "good"), ("gold", recs, "gold")):
            f: dict = {}
            for a in AXES:
                f[f"pair_{a}"], f[f"pair_{a}_ci"], f[f"n_{a}"] = _pair(
                    rows, k, f"{fam}:{src}:good", f"{fam}:{src}:{a}")
            f["pair"] = _finite_mean([f[f"pair_{a}"] for a in AXES])
            f["wording_cost"], _, f["n_good"] = _pair(rows, k, base, f"{fam}:{src}:good")
            held[fam][src] = f
    v["heldout"] = held
    for src in SRCS:
        for a in AXES:
            v[f"heldout_pair_{src}_{a}"] = _finite_mean([held[f][src][f"pair_{a}"]
                                                         for f in FAMS])
        v[f"heldout_pair_{src}"] = _finite_mean([v[f"heldout_pair_{src}_{a}"] for a in AXES])
    return v


def _share(cs: list[float]) -> dict:
    a = np.array(cs, float)
    return {"n": len(cs), "ge_tau": float(np.mean(a >= TAU)) if len(cs) else math.nan,
            "mean": _avg(a)}


def _want_deferral(recs: list[dict]) -> dict:
    k = "dualread"
    right = [r for r in recs if r["z"]]

    def scored(label: str, rows: list[dict]) -> list[float]:
        return [r["scores"][label][k] for r in rows if label in r["scores"]]

    out = {"interface": k, "tau": TAU,
           "own_wrong": _share([r["real_c"][k] for r in recs
                                if not r["z"] and r["real_c"] and k in r["real_c"]]),
           "own_right": _share([r["real_c"][k] for r in right
                                if r["real_c"] and k in r["real_c"]]),
           "flip_own": _share(scored("answer", right)),
           "flip_gold": _share(scored("gold:answer", recs))}
    for fam in FAMS:
        out[f"flip_{fam}_own"] = _share(scored(f"{fam}:own:answer", right))
        out[f"flip_{fam}_gold"] = _share(scored(f"{fam}:gold:answer", recs))
    return out


def _want_summary(recs: list[dict]) -> dict:
    sel = [r for r in recs if r["masked_tokens"] > 0]
    rows = {a: [r for r in recs if r["z"] and a in r["scores"]] for a in AXES}
    events = [(r["scores"][f"hes:{j}:pre"], r["scores"][f"hes:{j}:post"])
              for r in recs for j in range(r["hesitations"])]
    out: dict = {"n_items": len(recs), "n_self": len(sel),
                 "accuracy": float(np.mean([r["z"] for r in recs])),
                 **{f"n_pair_{a}": len(rows[a]) for a in AXES},
                 "hesitation": {"events": len(events),
                                "trajectories": sum(r["hesitations"] > 0 for r in recs)}}
    for k in IFACES:
        good = np.array([r["scores"]["good"][k] for r in sel])
        d_self = good - np.array([r["scores"]["mask:1:0"][k] for r in sel])
        v: dict = {"self": float(d_self.mean()), "self_ci": _ci(sel, d_self),
                   "curve": {"0": float(good.mean()),
                             "0.5": float(np.mean([(r["scores"]["mask:0.5:0"][k]
                                                    + r["scores"]["mask:0.5:1"][k]) / 2
                                                   for r in sel])),
                             "1": float(np.mean([r["scores"]["mask:1:0"][k] for r in sel]))}}
        for a in AXES:
            g = np.array([r["scores"]["good"][k] for r in rows[a]])
            b = np.array([r["scores"][a][k] for r in rows[a]])
            v[f"pair_{a}"] = float((g - b).mean())
            v[f"pair_{a}_ci"] = _ci(rows[a], g - b)
            v[f"p_jsd_le_0.1_{a}"] = share_close(g, b)
        v["pair"] = float(np.mean([v[f"pair_{a}"] for a in AXES]))
        if k == "verbalized":                    # no digit distributions in these records
            for a in AXES:
                v[f"p_jsd11_le_0.1_{a}"] = math.nan
                v[f"n_jsd11_pairs_{a}"] = 0
        v.update(_want_external(recs, k))
        drop = np.array([e[0][k] - e[1][k] for e in events])
        v["hesitation"] = {"mean_drop": float(drop.mean()),
                           "p_unchanged": float(np.mean(np.abs(drop) <= 0.02))}
        out[k] = v
    out["n_gold"] = sum("gold" in r["scores"] for r in recs)
    out.update({f"n_gold_{a}": sum(f"gold:{a}" in r["scores"] for r in recs) for a in AXES})
    out["deferral"] = _want_deferral(recs)
    return out


def _same(got, want, where: str = "") -> None:
    """Equal keys all the way down; numbers equal to 1e-12 (NaN equals NaN)."""
    if isinstance(want, dict):
        assert isinstance(got, dict), where
        assert set(got) == set(want), (where, set(got) ^ set(want))
        for key in want:
            _same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want), where
        for j, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{j}]")
    elif isinstance(want, float):
        assert isinstance(got, float), (where, got)
        assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=1e-12), \
            (where, got, want)
    else:
        assert type(got) is type(want) and got == want, (where, got, want)


@pytest.fixture
def recs() -> list[dict]:
    return _records()


@pytest.fixture
def summary(recs) -> dict:
    return tgs_probe.summarise(recs, CFG)


@pytest.fixture
def want(recs) -> dict:
    return _want_summary(recs)


# ---------------------------------------------------------------- summarise
def test_the_records_exercise_every_branch(recs, want):
    """The expectation is only as sharp as the records: wrong and right items, items with
    nothing to mask, missing axes, a family that never applied, an empty share and ties at
    τ and at the .02 hesitation bound."""
    assert 0 < want["n_self"] < want["n_items"] and 0 < want["accuracy"] < 1
    assert len({want[f"n_pair_{a}"] for a in AXES}) > 1
    assert math.isnan(want["dualread"]["heldout"]["paraphrase"]["own"]["pair"])
    assert want["deferral"]["flip_paraphrase_own"]["n"] == 0
    assert 0 < want["deferral"]["own_wrong"]["ge_tau"] < 1
    assert 0 < want["dualread"]["hesitation"]["p_unchanged"] < 1
    assert 0 < want["psr"]["hesitation"]["p_unchanged"] < 1
    assert {want[k]["p_jsd_le_0.1_vision"] for k in IFACES} - {0.0, 1.0}


def test_counts_accuracy_and_hesitation_events(summary, want):
    for key in ("n_items", "n_self", "accuracy", *(f"n_pair_{a}" for a in AXES),
                "hesitation", "n_gold", *(f"n_gold_{a}" for a in AXES)):
        _same(summary[key], want[key], key)
    assert summary["hesitation"] == {"events": 3, "trajectories": 2}
    assert summary["n_items"] == 7 and summary["n_self"] == 5
    assert summary["accuracy"] == pytest.approx(4 / 7)
    assert (summary["n_gold"], summary["n_gold_vision"], summary["n_gold_answer"]) == (6, 5, 6)


@pytest.mark.parametrize("k", IFACES)
def test_self_curve_pairs_and_their_intervals(summary, want, k):
    for key in ("self", "self_ci", "curve", "pair",
                *(f"{p}_{a}{s}" for p in ("pair",) for a in AXES for s in ("", "_ci")),
                *(f"p_jsd_le_0.1_{a}" for a in AXES)):
        _same(summary[k][key], want[k][key], f"{k}.{key}")


@pytest.mark.parametrize("k", IFACES)
def test_hesitation_drop_and_unchanged_share(summary, want, k):
    _same(summary[k]["hesitation"], want[k]["hesitation"], k)


@pytest.mark.parametrize("k", IFACES)
def test_gold_and_held_out_pairs(recs, summary, want, k):
    got = tgs_probe._external(recs, k, CFG)
    _same(got, _want_external(recs, k), k)
    for key in got:
        _same(summary[k][key], want[k][key], f"{k}.{key}")


def test_every_field_of_the_summary(summary, want):
    """No key missing, none extra, none renamed: the whole summary at once."""
    _same(summary, want)


def test_without_hesitations_the_section_says_none(recs):
    quiet = [{**r, "hesitations": 0} for r in recs]
    s = tgs_probe.summarise(quiet, CFG)
    assert s["hesitation"] == "none"
    assert all("hesitation" not in s[k] for k in IFACES)


def test_external_counts(recs):
    got = tgs_probe._external_counts(recs)
    assert got == {"n_gold": 6, "n_gold_vision": 5, "n_gold_reasoning": 6, "n_gold_answer": 6}
    assert tgs_probe._external_counts([]) == dict.fromkeys(got, 0)


# ---------------------------------------------------------------- wrong answers against τ
def test_deferral_shares_against_tau(recs):
    got = tgs_probe._deferral(recs)
    _same(got, _want_deferral(recs))
    # by hand: own wrong answers are items 1 and 6 (item 3 has no /answer confidence);
    # item 6 sits at τ, which the service releases
    assert got["own_wrong"]["n"] == 2
    assert got["own_wrong"]["ge_tau"] == 0.5             # item 1 is below τ
    assert got["own_right"]["n"] == 3 and got["flip_own"]["n"] == 3
    assert got["flip_gold"]["n"] == 6 and got["flip_synonym_own"]["n"] == 3
    assert got["flip_paraphrase_own"]["n"] == 0 and math.isnan(got["flip_paraphrase_own"]["mean"])


def test_deferral_of_another_interface(recs):
    got = tgs_probe._deferral(recs, "psr")
    assert got["interface"] == "psr"
    assert got["own_right"]["n"] == 4                    # item 5 has a psr confidence
    assert got["flip_own"]["mean"] == pytest.approx(np.mean(
        [r["scores"]["answer"]["psr"] for r in recs if r["z"] and "answer" in r["scores"]]))


def test_deferral_takes_the_first_records_threshold(recs):
    """Records stored before τ was recorded carry none and are skipped."""
    later = [{**recs[3]}, {**recs[1], "tau": 0.2}, {**recs[0], "tau": 0.9}]
    got = tgs_probe._deferral(later)
    assert got["tau"] == 0.2
    assert got["own_wrong"]["ge_tau"] == 1.0 and got["own_right"]["ge_tau"] == 1.0


@pytest.mark.parametrize("case", ["no tau", "no dualread", "no records"])
def test_deferral_without_a_threshold_says_why(recs, case):
    rows = {"no tau": [{**r, "tau": None} for r in recs],
            "no dualread": [{**r, "real_c": {"psr": 0.5}} for r in recs],
            "no records": []}[case]
    got = tgs_probe._deferral(rows)
    assert isinstance(got, str) and got.startswith("no threshold (answer-only service")


# ---------------------------------------------------------------- report and plan helpers
def test_ifaces_are_the_sections_with_a_self_score():
    s = {"n_items": 3, "dualread": {"self": 0.1}, "deferral": {"tau": 0.5},
         "hesitation": "none", "psr": {"self": math.nan, "pair": 0.0}, "x": {"pair": 1.0}}
    assert tgs_probe._ifaces(s) == ["dualread", "psr"]


def _item(k: str, image: str, question: str, answer: str, domain: str = "easyvqa") -> Item:
    return Item(id=k, image_path="", question=question, answer=answer, image_id=image,
                domain=domain)


def test_descriptions_are_read_once_per_run():
    pool = [_item("1", "A", "what color is the shape?", "green"),
            _item("2", "A", "what shape is in the image?", "triangle")]
    ctx = Context(None, pool, CFG)
    first = tgs_probe._descriptions(ctx)
    assert first == {"A": "a green triangle"}
    ctx.pool = [_item("3", "B", "what color is the shape?", "red")]
    assert tgs_probe._descriptions(ctx) is first         # cached: not described again


OWN = ("<think>I see a red circle. The question asks for the colour, so the answer is "
       "red.</think><answer>red</answer><confidence>9</confidence>")
OWN_BAD = {"vision": OWN.replace("red circle", "blue circle"), "reasoning": None,
           "answer": OWN.replace("<answer>red", "<answer>blue")}


def test_plan_external_states_the_gold_with_the_datas_description():
    q = "what color is the shape?"
    item = _item("1", "A", q, "red")
    pairs, gold = tgs_probe.plan_external(OWN, OWN_BAD, item, "0:1", {"A": "a red circle"})
    assert gold == ("<think>The image shows a red circle. That supports red, so the answer "
                    "is red.</think><answer>red</answer>")
    bad = external.gold_variants("red", "a red circle", q, "0:1")
    assert pairs == external.plan(OWN, OWN_BAD, gold, bad, "0:1", table_for("easyvqa"))
    labels = [lab for lab, _ in pairs]
    assert labels[0] == "gold" and "synonym:own:good" in labels and "synonym:gold:good" in labels
    # another key draws other swaps where the rules have a choice
    other, _ = tgs_probe.plan_external(OWN, OWN_BAD, item, "9:9", {"A": "a red circle"})
    assert other != pairs


def test_plan_external_without_a_description_or_an_own_trajectory():
    q = "is there a red shape?"
    item = _item("2", "Z", q, "no", domain="other")         # no synonym table either
    pairs, gold = tgs_probe.plan_external(None, {}, item, "0:2", {"A": "a red circle"})
    assert gold == ("<think>The image shows what the question asks about. That supports no, "
                    "so the answer is no.</think><answer>no</answer>")
    labels = [lab for lab, _ in pairs]
    assert "gold:vision" not in labels and "gold:answer" in labels
    assert not any(":own:" in lab or lab.startswith("synonym:") for lab in labels)
    assert pairs == external.plan(None, {}, gold, external.gold_variants("no", None, q, "0:2"),
                                  "0:2", {})
    # an open question without a description: the gold answer is the observation
    _, gold = tgs_probe.plan_external(None, {}, _item("3", "Z", "what shape?", "circle"), "k",
                                      {})
    assert gold.startswith("<think>The image shows circle. That supports circle")


def test_plan_draws_the_alternatives_with_the_items_key():
    """Each item gets its own seeded picks: another key, other alternatives."""
    q = "what color is the shape?"

    def alts(key: str, axis: str) -> list[str]:
        labels, trajs, _, _ = tgs_probe.plan(OWN, q, key, CFG)
        return [t for lab, t in zip(labels, trajs) if lab.startswith(f"alt:{axis}:")]

    # a colour has seven others: which five, and in which order, is the key's draw
    assert alts("0:a", "vision") != alts("1:b", "vision")
    assert alts("0:a", "answer") != alts("1:b", "answer")
    assert alts("0:a", "vision") == alts("0:a", "vision")


def test_nothing_to_score_gives_nan_without_numpy_warnings():
    """An item with no scores (every call failed) leaves NaN where there is nothing to
    average — by the guards, not by numpy's mean of an empty slice, which warns."""
    import warnings

    empty = {"image_id": "a", "z": True, "interfaces": list(IFACES), "masked_tokens": 0,
             "scores": {}, "variants": {}, "hesitations": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = tgs_probe.summarise([empty], CFG)
    assert all(math.isnan(s[k]["pair"]) for k in IFACES)
    assert all(math.isnan(s["verbalized"][f"p_jsd11_le_0.1_{a}"]) for a in AXES)


def test_thresholds_with_no_wrong_answer_give_nan_without_numpy_warnings():
    """Every answer right: the wrong answers' released share has nothing to average and is
    NaN by the guard, not by numpy's mean of an empty array (which warns)."""
    import warnings

    right = {"image_id": "a", "z": True, "interfaces": list(IFACES), "masked_tokens": 0,
             "scores": {}, "variants": {}, "hesitations": 0, "tau": TAU,
             "real_c": {k: 0.9 for k in IFACES}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d = tgs_probe._deferral([right])
    assert d["own_wrong"]["n"] == 0 and math.isnan(d["own_wrong"]["ge_tau"])
    assert d["own_right"] == {"n": 1, "ge_tau": 1.0, "mean": 0.9}


def test_digit_jsd_skips_an_item_without_its_own_digit_distribution():
    """Alternatives without the good trajectory's distribution: nothing to compare them
    with, so the item adds no pair (and does not fail)."""
    alt = np.full(11, 1 / 11).tolist()
    only_alts = {"digits": {"alt:answer:0": alt, "alt:answer:1": alt}}
    both = {"digits": {"good": alt, "alt:answer:0": alt}}
    assert tgs_probe._digit_jsd([only_alts], "answer") == []
    assert tgs_probe._digit_jsd([only_alts, both], "answer") == [0.0]


def test_alternatives_draw_at_most_four_picks_per_alternative(monkeypatch):
    """The picks are keyed `{key}:alt0` … `{key}:alt19` (4·K_ALTERNATIVES): an axis whose
    rule gives fewer than K distinct alternatives stops there, so a stored run's
    alternatives are the same picks when re-run."""
    keys: list[str] = []

    def few(response: str, question: str, key: str) -> str:
        keys.append(key)
        j = int(key.rsplit("alt", 1)[1])
        return f"v{j % 4}" if j < 20 else f"late{j}"   # four distinct, then a fifth

    monkeypatch.setattr(tgs_probe.text, "vision_variant", few)
    got = tgs_probe.alternatives("own", "q?", "k", "vision")
    assert got == ["v0", "v1", "v2", "v3"]
    assert keys == [f"k:alt{j}" for j in range(4 * tgs_probe.K_ALTERNATIVES)]


def test_paper_jsd_share_counts_a_pair_at_exactly_one_tenth(recs, monkeypatch):
    """The paper's P(JSD ≤ 0.1) is inclusive: a pair at exactly 0.1 counts as close."""
    monkeypatch.setattr(tgs_probe, "_digit_jsd", lambda records, axis: [0.1, 0.05, 0.2])
    v = tgs_probe.summarise(recs, CFG)["verbalized"]
    for a in AXES:
        assert v[f"p_jsd11_le_0.1_{a}"] == pytest.approx(2 / 3)
        assert v[f"n_jsd11_pairs_{a}"] == 3
