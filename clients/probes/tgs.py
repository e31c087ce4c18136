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

from clients.probes import text
from clients.probes.runner import Config, Context, Memo, fmt, interfaces, pixels, run_params
from clients.probes.stats import NAN_CI, cluster_bootstrap, mean, pairwise_jsd, share_close
from models.data import Item

NAME = "tgs"
AXES = ("vision", "reasoning", "answer")
MAX_HESITATIONS = 14          # keeps one item inside one 64-trajectory batch
K_ALTERNATIVES = 5            # alternatives per axis for the paper's JSD (TGS A.1.3: k = 5)
CLOSE = 0.02                  # |c_pre − c_post| ≤ .02 counts as "no change" (TGS §3.4)


def params(cfg: Config) -> dict:
    return run_params(NAME, cfg, seed=cfg.seed, ratios=list(cfg.mask_ratios),
                      seeds=list(cfg.mask_seeds), alternatives=K_ALTERNATIVES)


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


# pragma: no mutate start (reached only through a live service: docs/testing.md)
async def run_item(ctx: Context, item: Item, memo: Memo) -> dict:
    real = await memo.real()
    ifaces = list(real["confidence"])
    if not real["response"].strip():   # nothing to score (the service refuses empty text)
        return {"image_id": item.image_id, "z": real["z"], "interfaces": ifaces,
                "masked_tokens": 0, "scores": {}, "variants": {}, "hesitations": 0}
    labels, trajs, masks, variants = plan(real["response"], item.question,
                                          f"{ctx.cfg.seed}:{item.id}", ctx.cfg)
    scores = await ctx.client.score_batch(pixels(item)(), item.question, trajs, masks)
    full = f"mask:{max(ctx.cfg.mask_ratios):g}:0"
    by = dict(zip(labels, scores))
    return {"image_id": item.image_id, "z": real["z"], "interfaces": ifaces,
            "masked_tokens": by[full].masked_tokens if full in by else 0,
            "scores": {k: s.confidence.model_dump() for k, s in by.items()},
            "digits": {k: s.digits for k, s in by.items()
                       if (k == "good" or k.startswith("alt:")) and s.digits is not None},
            "variants": variants,
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
        if events:
            pre = np.array([e[0][k] for e in events])
            post = np.array([e[1][k] for e in events])
            v["hesitation"] = {"mean_drop": mean(pre - post),
                               "p_unchanged": float(np.mean(np.abs(pre - post) <= CLOSE))}
        out[k] = v
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
