"""`dualread probe tgs` — docs/method.md §3, for every confidence interface the service returns
(verbalized μ(C), and DualRead, PSR and PER, which no seed paper measures this way).

Per item: the actor's own trajectory τ (its natural answer), then one `/probe/score_batch`
call with τ unmasked, τ with the think block masked at 25/50/75% (3 seeds each) and 100%
(answer visible), and the three rule-built bad variants (vision, reasoning, answer; see
`text.py`), plus pre/post cuts around any hesitation marker.

- TGS-self = mean[c(τ) − c(τ masked 100%)] over items whose think block has tokens to mask.
- TGS-pair_axis = mean[c(good) − c(bad_axis)] over items answered correctly (so the good
  trajectory is good) that have a variant on that axis; TGS-pair = mean of the axes.
- P(JSD ≤ 0.1), two versions, each labelled in the report:
  * `p_jsd_le_0.1_{axis}` (Bernoulli): JSD (log 2) between Bernoulli(c) of the good and
    the bad trajectory, for every interface (the service's scalar confidences). For μ(C)
    it garbles the 11-way digit distribution, so by data processing it is ≤ the digit JSD.
  * `p_jsd11_le_0.1_{axis}` (the paper's, TGS A.1): the 11-way P(C) after each of the
    actor's own component and up to K_ALTERNATIVES rule-built alternatives on that axis
    (seeded picks, duplicates dropped), JSD (natural log) over every pair of them, pooled
    over items. Verbalized μ(C) only: the other interfaces have no digit distribution.
    The paper samples its alternatives from another VLM (T = .8); ours come from the
    same substitution rules as the bad variants, so there are fewer on some axes (a
    yes/no answer has one alternative).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from clients.probes import external, text
from clients.probes.runner import Config, Context, Memo, fmt, interfaces, pixels, run_params
from clients.probes.stats import NAN_CI, cluster_bootstrap, mean, pairwise_jsd, share_close
from models.data import Item
from models.synonyms import table_for
from models.trajectory import describe_images

NAME = "tgs"
AXES = ("vision", "reasoning", "answer")
MAX_HESITATIONS = 14          # keeps one item inside one 64-trajectory batch
K_ALTERNATIVES = 5            # alternatives per axis for the paper's JSD (TGS A.1.3: k = 5)
CLOSE = 0.02                  # |c_pre − c_post| ≤ .02 counts as "no change" (TGS §3.4)
EXTERNAL = 1                  # version of the gold template and held-out families (run tag)


def params(cfg: Config) -> dict:
    return run_params(NAME, cfg, seed=cfg.seed, ratios=list(cfg.mask_ratios),
                      seeds=list(cfg.mask_seeds), alternatives=K_ALTERNATIVES,
                      external=EXTERNAL)


def alternatives(response: str, question: str, key: str, axis: str) -> list[str]:
    """Up to K_ALTERNATIVES distinct trajectories that replace one component (seeded picks
    of the same rules as the bad variants), none equal to the response itself."""
    make = {"vision": lambda k: text.vision_variant(response, question, k),
            "reasoning": lambda k: text.reasoning_variant(response),
            "answer": lambda k: text.answer_variant(response, k)}[axis]
    out: list[str] = []
    for j in range(4 * K_ALTERNATIVES):        # a few extra draws: picks may repeat
        v = make(f"{key}:alt{j}")
        if v is not None and v != response and v not in out:
            out.append(v)
        if len(out) == K_ALTERNATIVES:
            break
    return out


def plan(response: str, question: str, key: str, cfg: Config
         ) -> tuple[list[str], list[str], list[dict | None], dict]:
    """(labels, trajectories, masks, variants) to score for one item's trajectory."""
    labels, trajs, masks = ["good"], [response], [None]
    for ratio in cfg.mask_ratios:
        if ratio <= 0:
            continue
        for seed in (cfg.mask_seeds if ratio < 1 else (0,)):   # 100% is one fixed set
            labels.append(f"mask:{ratio:g}:{seed}")
            trajs.append(response)
            masks.append({"target": "think", "ratio": ratio, "seed": seed})
    variants = {"vision": text.vision_variant(response, question, key),
                "reasoning": text.reasoning_variant(response),
                "answer": text.answer_variant(response, key)}
    for axis, v in variants.items():
        if v is not None:
            labels.append(axis)
            trajs.append(v)
            masks.append(None)
    for axis in AXES:
        for j, v in enumerate(alternatives(response, question, key, axis)):
            labels.append(f"alt:{axis}:{j}")
            trajs.append(v)
            masks.append(None)
    for j, (pre, post) in enumerate(text.hesitations(response)[:MAX_HESITATIONS]):
        labels += [f"hes:{j}:pre", f"hes:{j}:post"]
        trajs += [pre, post]
        masks += [None, None]
    return labels, trajs, masks, variants


def _descriptions(ctx: Context) -> dict[str, str]:
    """The data's own description of each image (gold annotations), once per run."""
    if getattr(ctx, "_tgs_descriptions", None) is None:
        ctx._tgs_descriptions = describe_images(ctx.pool)
    return ctx._tgs_descriptions


def plan_external(own: str | None, own_variants: dict, item: Item, key: str,
                  facts: dict[str, str]) -> tuple[list[tuple[str, str]], str]:
    """(label, trajectory) pairs for the gold-conditioned trajectory, its bad variants
    and the held-out families (`external.plan`), and the gold trajectory itself."""
    obs = external.observation_of(item.image_id, facts, item.answer, item.question)
    gold = external.gold_trajectory(item.answer, obs)
    gold_bad = external.gold_variants(item.answer, obs, item.question, key)
    return external.plan(own, own_variants, gold, gold_bad, key, table_for(item.domain)), gold


# pragma: no mutate start (reached only through a live service: docs/testing.md)
async def run_item(ctx: Context, item: Item, memo: Memo) -> dict:
    real = await memo.real()
    ifaces = list(real["confidence"])
    key = f"{ctx.cfg.seed}:{item.id}"
    own = real["response"] if real["response"].strip() else None
    # the service refuses empty text: without its own trajectory an item keeps the gold one
    labels, trajs, masks, variants = plan(own, item.question, key, ctx.cfg) if own else \
        ([], [], [], {})
    ext, gold = plan_external(own, variants, item, key, _descriptions(ctx))
    labels += [lab for lab, _ in ext]
    trajs += [t for _, t in ext]
    masks += [None] * len(ext)
    scores = await ctx.client.score_batch(pixels(item)(), item.question, trajs, masks)
    full = f"mask:{max(ctx.cfg.mask_ratios):g}:0"
    by = dict(zip(labels, scores))
    return {"image_id": item.image_id, "z": real["z"], "interfaces": ifaces,
            "real_c": real["confidence"], "tau": real.get("defer_threshold"),
            "masked_tokens": by[full].masked_tokens if full in by else 0,
            "scores": {k: s.confidence.model_dump() for k, s in by.items()},
            "digits": {k: s.digits for k, s in by.items()
                       if (k == "good" or k.startswith("alt:")) and s.digits is not None},
            "variants": variants, "gold": gold,
            "hesitations": sum(k.endswith(":pre") for k in labels)}


# pragma: no mutate end
def _ci(rows: list[dict], d: np.ndarray, cfg: Config) -> tuple[float, float]:
    if not len(rows):
        return NAN_CI
    return cluster_bootstrap([r["image_id"] for r in rows], lambda idx: float(d[idx].mean()),
                             cfg.bootstrap, 42)


def summarise(records: list[dict], cfg: Config) -> dict:
    out: dict = {"n_items": len(records)}
    selfset = [r for r in records if r["masked_tokens"] > 0]
    out["n_self"] = len(selfset)
    out["accuracy"] = mean([r["z"] for r in records])
    pair_rows = {a: [r for r in records if r["z"] and a in r["scores"]] for a in AXES}
    out.update({f"n_pair_{a}": len(pair_rows[a]) for a in AXES})
    events = [(r["scores"][f"hes:{j}:pre"], r["scores"][f"hes:{j}:post"])
              for r in records for j in range(r["hesitations"])]
    out["hesitation"] = ({"events": len(events),
                          "trajectories": sum(r["hesitations"] > 0 for r in records)}
                         if events else "none")
    full = f"mask:{max(cfg.mask_ratios):g}:0"
    for k in interfaces(records, lambda r: dict.fromkeys(r.get("interfaces", ()))
                        or r["scores"].get("good")):
        good = np.array([r["scores"]["good"][k] for r in selfset])
        masked = np.array([r["scores"][full][k] for r in selfset]) if selfset else good
        d_self = good - masked
        curve = {}
        for ratio in cfg.mask_ratios:
            if ratio <= 0:
                curve[f"{ratio:g}"] = mean(good)
                continue
            seeds = cfg.mask_seeds if ratio < 1 else (0,)
            curve[f"{ratio:g}"] = mean([np.mean([r["scores"][f"mask:{ratio:g}:{s}"][k]
                                                 for s in seeds]) for r in selfset])
        v: dict = {"self": mean(d_self), "self_ci": _ci(selfset, d_self, cfg),
                   "curve": curve}
        axis_means = []
        for a in AXES:
            rows = pair_rows[a]
            g = np.array([r["scores"]["good"][k] for r in rows])
            b = np.array([r["scores"][a][k] for r in rows])
            d = g - b
            v[f"pair_{a}"] = mean(d)
            v[f"pair_{a}_ci"] = _ci(rows, d, cfg)
            v[f"p_jsd_le_0.1_{a}"] = share_close(g, b) if rows else float("nan")
            if rows:
                axis_means.append(mean(d))
        v["pair"] = float(np.mean(axis_means)) if axis_means else float("nan")
        if k == "verbalized":
            for a in AXES:
                d = _digit_jsd(records, a)
                v[f"p_jsd11_le_0.1_{a}"] = float(np.mean(np.array(d) <= 0.1)) if d \
                    else float("nan")
                v[f"n_jsd11_pairs_{a}"] = len(d)
        v.update(_external(records, k, cfg))
        if events:
            pre = np.array([e[0][k] for e in events])
            post = np.array([e[1][k] for e in events])
            v["hesitation"] = {"mean_drop": mean(pre - post),
                               "p_unchanged": float(np.mean(np.abs(pre - post) <= CLOSE))}
        out[k] = v
    out.update(_external_counts(records))
    out["deferral"] = _deferral(records)
    return out


def _pair(rows: list[dict], k: str, good: str, bad: str, cfg: Config
          ) -> tuple[float, tuple[float, float], int]:
    """mean[c(good) − c(bad)] over the rows that have both labels, its CI and n."""
    rows = [r for r in rows if good in r["scores"] and bad in r["scores"]]
    d = np.array([r["scores"][good][k] - r["scores"][bad][k] for r in rows])
    return mean(d), _ci(rows, d, cfg), len(rows)


def _axes_mean(v: dict, prefix: str) -> float:
    vals = [v[f"{prefix}_{a}"] for a in AXES if np.isfinite(v.get(f"{prefix}_{a}", np.nan))]
    return float(np.mean(vals)) if vals else float("nan")


def _external(records: list[dict], k: str, cfg: Config) -> dict:
    """TGS-pair with the gold-conditioned good trajectory (every item), and per held-out
    family with each good source (own: items answered correctly; gold: every item); the
    in-distribution pairs are the rule-built variants of the actor's own (`pair`) and of
    the gold trajectory (`gold_pair`)."""
    rows = {"own": [r for r in records if r["z"]], "gold": records}
    v: dict = {}
    for a in AXES:
        v[f"gold_pair_{a}"], v[f"gold_pair_{a}_ci"], _ = _pair(records, k, "gold",
                                                                f"gold:{a}", cfg)
    v["gold_pair"] = _axes_mean(v, "gold_pair")
    own_rows = [r for r in rows["own"] if "gold" in r["scores"] and "good" in r["scores"]]
    v["own_minus_gold"] = mean([r["scores"]["good"][k] - r["scores"]["gold"][k]
                                for r in own_rows])
    held: dict = {}
    for fam in external.FAMILIES:
        for src in external.SOURCES:
            base = "good" if src == "own" else "gold"
            f = {}
            for a in AXES:
                f[f"pair_{a}"], f[f"pair_{a}_ci"], f[f"n_{a}"] = _pair(
                    rows[src], k, f"{fam}:{src}:good", f"{fam}:{src}:{a}", cfg)
            f["pair"] = _axes_mean(f, "pair")
            # what the rewording alone costs a good trajectory (0 = reads content, not form)
            f["wording_cost"], _, f["n_good"] = _pair(rows[src], k, base,
                                                      f"{fam}:{src}:good", cfg)
            held.setdefault(fam, {})[src] = f
    v["heldout"] = held
    for src in external.SOURCES:
        for a in AXES:
            vals = [held[fam][src][f"pair_{a}"] for fam in external.FAMILIES
                    if np.isfinite(held[fam][src][f"pair_{a}"])]
            v[f"heldout_pair_{src}_{a}"] = float(np.mean(vals)) if vals else float("nan")
        v[f"heldout_pair_{src}"] = _axes_mean(v, f"heldout_pair_{src}")
    return v


def _external_counts(records: list[dict]) -> dict:
    out = {"n_gold": sum("gold" in r["scores"] for r in records)}
    for a in AXES:
        out[f"n_gold_{a}"] = sum(f"gold:{a}" in r["scores"] for r in records)
    return out


def _deferral(records: list[dict], k: str = "dualread") -> dict | str:
    """How the service's own threshold τ treats wrong answers: the actor's own wrong
    answers (its /answer confidence), and rule-built wrong answers (the answer axis of its
    own correct trajectories, of the gold trajectory, and of each held-out family).
    `ge_tau` = share still released (confidence ≥ τ)."""
    taus = [r["tau"] for r in records if r.get("tau") is not None]
    if not taus or not any(k in (r.get("real_c") or {}) for r in records):
        return "no threshold (answer-only service or records without one)"
    tau = float(taus[0])

    def share(cs: list[float]) -> dict:
        a = np.array(cs, float)
        return {"n": int(a.size), "ge_tau": float((a >= tau).mean()) if a.size else float("nan"),
                "mean": mean(a)}

    def scored(label: str, rows: list[dict]) -> list[float]:
        return [r["scores"][label][k] for r in rows if label in r["scores"]]

    right = [r for r in records if r["z"]]
    out = {"interface": k, "tau": tau,
           "own_wrong": share([r["real_c"][k] for r in records
                               if not r["z"] and k in (r.get("real_c") or {})]),
           "own_right": share([r["real_c"][k] for r in right if k in (r.get("real_c") or {})]),
           "flip_own": share(scored("answer", right)),
           "flip_gold": share(scored("gold:answer", records))}
    for fam in external.FAMILIES:
        out[f"flip_{fam}_own"] = share(scored(f"{fam}:own:answer", right))
        out[f"flip_{fam}_gold"] = share(scored(f"{fam}:gold:answer", records))
    return out


def _digit_jsd(records: list[dict], axis: str) -> list[float]:
    """Pairwise JSD of P(C) over {own component} ∪ its alternatives on `axis`, pooled
    over items that have at least one alternative (all items, right or wrong: the paper
    does not condition on correctness)."""
    out: list[float] = []
    for r in records:
        dig = r.get("digits") or {}
        alts = [dig[k] for k in sorted(dig) if k.startswith(f"alt:{axis}:")]
        if "good" in dig and alts:
            out += pairwise_jsd([np.array(dig["good"])] + [np.array(x) for x in alts])
    return out


def _ifaces(s: dict) -> list[str]:
    return [k for k, v in s.items() if isinstance(v, dict) and "self" in v]


# pragma: no mutate start (report layout and plots: the numbers come from summarise)
def markdown(s: dict) -> str:
    lines = ["## Trajectory grounding (docs/method.md §3): does confidence read the "
             "trajectory?", "",
             f"{s['n_items']} items (actor accuracy {fmt(s['accuracy'])}); TGS-self on "
             f"{s['n_self']} with a think block to mask; TGS-pair on correctly answered items "
             f"with a rule-built variant (vision {s['n_pair_vision']}, reasoning "
             f"{s['n_pair_reasoning']}, answer {s['n_pair_answer']}). Positive = grounded, "
             "0 = trajectory-blind, negative = anti-grounded. 95% CIs: image-cluster bootstrap. "
             "P(JSD≤.1), Bernoulli: JSD (log 2) between Bernoulli(c) of good and bad.",
             "", "| interface | TGS-self | 95% CI | TGS-pair | vision | reasoning | answer | "
             "P(JSD≤.1) Bernoulli vision | reasoning | answer |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for k in _ifaces(s):
        v = s[k]
        lines.append(f"| {k} | {fmt(v['self'])} | {fmt(v['self_ci'])} | {fmt(v['pair'])} | "
                     + " | ".join(f"{fmt(v[f'pair_{a}'])} {fmt(v[f'pair_{a}_ci'])}"
                                  for a in AXES) + " | "
                     + " | ".join(fmt(v[f"p_jsd_le_0.1_{a}"]) for a in AXES) + " |")
    v = s.get("verbalized", {})
    if any(f"p_jsd11_le_0.1_{a}" in v for a in AXES):
        lines += ["", "P(JSD≤.1) as the TGS paper defines it (verbalized μ(C) only): the "
                  "11-way P(C) after the actor's own component and up to "
                  f"{K_ALTERNATIVES} rule-built alternatives per axis, JSD (natural log) over "
                  "every pair, pooled over items; higher = more trajectory-independent. "
                  + "; ".join(f"{a} {fmt(v.get(f'p_jsd11_le_0.1_{a}'))} "
                              f"({fmt(v.get(f'n_jsd11_pairs_{a}'))} pairs)" for a in AXES)
                  + "."]
    lines += _external_markdown(s)
    ratios = list(s[_ifaces(s)[0]]["curve"]) if _ifaces(s) else []
    lines += ["", "Masking curve (mean confidence as the think block is masked; the answer "
              "stays visible):", "", "| interface | " + " | ".join(ratios) + " |",
              "|---|" + "---|" * len(ratios)]
    for k in _ifaces(s):
        lines.append(f"| {k} | " + " | ".join(fmt(x) for x in s[k]["curve"].values()) + " |")
    h = s["hesitation"]
    if h == "none":
        lines += ["", "Hesitation: none — the actor never wrote a hesitation marker "
                  "(TGS A.3 lexicon), so there is nothing to analyse."]
    else:
        lines += ["", f"Hesitation: {h['events']} events in {h['trajectories']} trajectories; "
                  + "; ".join(f"{k}: mean drop {fmt(s[k]['hesitation']['mean_drop'])}, "
                              f"P(|Δ|≤.02) {fmt(s[k]['hesitation']['p_unchanged'])}"
                              for k in _ifaces(s))]
    return "\n".join(lines)


def _external_markdown(s: dict) -> list[str]:
    names = [k for k in _ifaces(s) if "gold_pair" in s[k]]
    if not names or not s.get("n_gold"):
        return []
    lines = ["", "TGS-pair by good trajectory and wording (docs/probes.md, \"External good "
             "trajectory and held-out families\"). *own*: the actor's trajectory, items it "
             "answered correctly; *gold*: a template that states the gold answer, scored by "
             f"the same actor, every item ({s['n_gold']}; vision "
             f"{s.get('n_gold_vision')}, reasoning {s.get('n_gold_reasoning')}, answer "
             f"{s.get('n_gold_answer')}). *In-distribution*: the rule-built bad variants (the "
             "answer axis is the perturbation the consistency reader was fitted on); "
             "*held-out*: the same pairs rewritten by families the reader never saw ("
             + ", ".join(external.FAMILIES) + "), mean over families.", "",
             "| interface | good | in-dist. TGS-pair | vision | reasoning | answer | held-out "
             "TGS-pair | vision | reasoning | answer |", "|---" * 10 + "|"]
    for k in names:
        v = s[k]
        ind = {"own": [v["pair"]] + [v[f"pair_{a}"] for a in AXES],
               "gold": [v["gold_pair"]] + [v[f"gold_pair_{a}"] for a in AXES]}
        for src in external.SOURCES:
            held = [v[f"heldout_pair_{src}"]] + [v[f"heldout_pair_{src}_{a}"] for a in AXES]
            lines.append(f"| {k} | {src} | " + " | ".join(fmt(x) for x in ind[src] + held)
                         + " |")
    lines += ["", "Per held-out family: TGS-pair (mean of the axes) and the wording cost "
              "c(good) − c(good reworded), 0 when confidence reads content, not form. "
              "Own − gold: mean c(own) − c(gold) on correctly answered items.", "",
              "| interface | family | own TGS-pair | own answer axis | own wording cost | "
              "gold TGS-pair | gold answer axis | gold wording cost |", "|---" * 8 + "|"]
    for k in names:
        for fam in external.FAMILIES:
            h = s[k]["heldout"][fam]
            lines.append(f"| {k} | {fam} | " + " | ".join(
                f"{fmt(h[src]['pair'])} | {fmt(h[src]['pair_answer'])} "
                f"{fmt(h[src]['pair_answer_ci'])} | {fmt(h[src]['wording_cost'])}"
                for src in external.SOURCES) + " |")
    lines.append("")
    lines.append("Own − gold: " + "; ".join(f"{k} {fmt(s[k]['own_minus_gold'])}" for k in names)
                 + ".")
    d = s.get("deferral")
    if isinstance(d, dict):
        lines += ["", f"Wrong answers against the service's threshold τ = {fmt(d['tau'])} "
                  f"({d['interface']}; share with confidence ≥ τ, i.e. released): the actor's "
                  f"own wrong answers {fmt(d['own_wrong']['ge_tau'])} of "
                  f"{d['own_wrong']['n']} (own right answers {fmt(d['own_right']['ge_tau'])});"
                  f" answer-flipped own trajectories {fmt(d['flip_own']['ge_tau'])} of "
                  f"{d['flip_own']['n']}; answer-flipped gold {fmt(d['flip_gold']['ge_tau'])}"
                  f" of {d['flip_gold']['n']}; held-out answer flips "
                  + ", ".join(f"{fam} own {fmt(d[f'flip_{fam}_own']['ge_tau'])} / gold "
                              f"{fmt(d[f'flip_{fam}_gold']['ge_tau'])}"
                              for fam in external.FAMILIES) + "."]
    return lines


def figures(records: list[dict], section: dict, out: Path) -> list[str]:
    import matplotlib.pyplot as plt

    names = _ifaces(section)
    if not names:
        return []
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.4))
    for k in names:
        xs = [float(x) for x in section[k]["curve"]]
        a1.plot(xs, list(section[k]["curve"].values()), marker="o", label=k)
    a1.set(xlabel="share of think tokens masked", ylabel="mean confidence",
           title="TGS masking curve")
    a1.legend(fontsize=7)
    width = 0.8 / len(names)
    for j, k in enumerate(names):
        vals = [section[k][f"pair_{a}"] for a in AXES] + [section[k]["self"]]
        vals = [np.nan if v is None else v for v in vals]
        a2.bar(np.arange(4) + j * width, vals, width, label=k)
    a2.axhline(0, color="k", lw=0.8)
    a2.set_xticks(np.arange(4) + 0.4 - width / 2, ["vision", "reasoning", "answer", "self"])
    a2.set(ylabel="TGS", title="TGS-pair by axis and TGS-self")
    fig.tight_layout()
    path = out / "tgs.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [str(path)]
# pragma: no mutate end
