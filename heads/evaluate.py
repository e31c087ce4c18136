"""`dualread evaluate`: every confidence method on the same frozen actor outputs.

One row per method (docs/method.md §7), columns n, accuracy, AUROC, ECE-15, ECE-10, Brier, AURC,
HCE@0.9 with image-cluster bootstrap CIs, the cost of each method in forward passes
beyond the natural generation, and measured seconds per item.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from heads import grounding, registry
from heads.collect import Collector
from heads.dualread import DEFER_METHOD, Heads
from heads.fit import question_only
from heads.metrics import METRICS, cluster_bootstrap, risk_coverage
from heads.suites import suite_markdown, suite_row
from models.data import load, sample
from models.parse import parse_response
from models.quality import response_problem, uses_answer_tag

SHOWN = ("auroc", "ece", "ece10", "brier", "aurc", "hce90")
# the question-only baseline: accuracy of the question's normalised form when fitting
QUESTION_ONLY = "question_only"


def __getattr__(name: str):
    # METHODS follows the registry, so a method registered later is in the default table
    if name == "METHODS":
        return registry.names()
    raise AttributeError(name)


def score_all(heads: Heads, feats: dict, methods: tuple[str, ...] | None = None
              ) -> dict[str, np.ndarray]:
    """Confidence of each chosen method (all registered by default), in the order given."""
    return {m.name: m.score(heads, feats) for m in registry.select(methods)}


# pragma: no mutate start (reached only through the tiny actors: docs/testing.md)
def evaluate(actor, heads: Heads, specs: list[str], out: str | Path,
             methods: tuple[str, ...] | None = None, limit: int | None = None,
             bootstrap: int = 1000, cache_dir: str | Path | None = None,
             max_new_tokens: int = 64, command: str = "", grounding_on: bool = True) -> dict:
    """One table per data spec: every chosen method (all registered by default), with
    grounding (CCG-AUC, AUROC per answer type, paired differences to DualRead, the defer
    rule on these data) computed on the same readouts."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # the question-only baseline comes with the full table, or when named
    with_question_only = methods is None or QUESTION_ONLY in methods
    if methods is not None:
        methods = tuple(m for m in methods if m != QUESTION_ONLY)
    chosen = registry.select(methods)
    if methods is None:
        # the full table: what these heads hold (an older artefact, or a fit where a
        # method had nothing to learn from, lacks some readers)
        chosen = [m for m in chosen if heads.has(m)]
    dropped = _unreadable_follow_up(actor, chosen) if methods is None else {}
    chosen = [m for m in chosen if m.name not in dropped]
    missing = [m.name for m in chosen if not heads.has(m)]
    if missing:
        raise ValueError(f"these heads were fitted without {', '.join(missing)}; refit them "
                         "with `dualread fit-heads` or leave those methods out")
    passes = registry.passes_for(chosen)
    # the heads by id (what `/health` and every answer report), their fit command beside it
    report: dict = {"actor": _display(actor.folder), "actor_fingerprint": actor.fingerprint,
                    "heads_id": heads.heads_id, "heads": heads.card.get("command", ""),
                    "command": command,
                    "bootstrap": bootstrap, "datasets": {}, "dropped": dropped}
    for spec in specs:
        items = sample(load(spec), limit)
        # features with the κ the heads were fitted with
        col = Collector(actor, cache_dir, max_new_tokens, kappa=heads.kappa)
        t0 = time.perf_counter()
        feats, meta = col.run(items, passes=passes, label=f"evaluate {spec}")
        wall = time.perf_counter() - t0
        t1 = time.perf_counter()
        scores = {m.name: m.score(heads, feats) for m in chosen}
        scoring_s = (time.perf_counter() - t1) / max(1, len(items))
        z = feats["z"].numpy().astype(int)
        clusters = meta["image_ids"]
        if with_question_only and "question_prior" in heads.card:
            scores[QUESTION_ONLY] = question_only(heads.card["question_prior"],
                                                  [it.question for it in items])
        # CCG donors are assigned before any confidence is scored (docs/method.md §2)
        plan = grounding.plan_donors(items, seed=0) if grounding_on else None
        rows = {}
        n = len(items)
        base_s = col.seconds["generate+readout"] / max(1, n)
        for name_m, c in scores.items():
            m = registry.get(name_m) if name_m != QUESTION_ONLY else None
            row = {"n": n}
            for name in SHOWN:
                row[name] = METRICS[name](c, z)
                if bootstrap:
                    row[name + "_ci"] = cluster_bootstrap(c, z, clusters, METRICS[name],
                                                          n=bootstrap)
            row["auroc_by_type"] = grounding.auroc_by_type(
                c, z, [grounding.answer_type(it.answer) for it in items])
            if m is None:
                row["cost_passes"] = "0 (a table from the fitting data)"
                row["seconds_per_item_extra"] = 0.0
            else:
                extra_s = sum(col.seconds[p] for p in m.passes) / n
                extra_s *= m.pass_share  # SC@K reads the first K of one shared sample pass
                row["cost_passes"] = m.cost
                row["seconds_per_item_extra"] = round(extra_s + scoring_s, 5)
            rows[name_m] = row
        entry = {"n": n, "accuracy": float(z.mean()), "images": len(set(clusters)),
                 "seconds_per_item_generate_readout": round(base_s, 5),
                 "wall_seconds": round(wall, 1), "methods": rows}
        if plan is not None:
            entry.update(_grounding(heads, col, items, plan, feats, meta, scores, chosen,
                                    passes, rows, bootstrap))
        if DEFER_METHOD in scores and heads.policy is not None:
            # the artefact's whole rule, as the service applies it: τ on DualRead, the
            # novelty p-value when it has a detector, and the responses that do not parse
            novelty_p = None
            if heads.novelty is not None:
                nf = heads.with_images(feats, [it.image() for it in items]) \
                    if getattr(heads.novelty, "reads_pixels", False) else feats
                novelty_p = [r.p_value for r in heads.novelty.read(nf, heads.novelty_alpha)]
            problems = response_problems(actor, meta.get("responses"), max_new_tokens)
            entry.update(defer_accounting(heads, z, scores[DEFER_METHOD], novelty_p, problems))
        report["datasets"][spec] = entry
        _plots(out, spec, scores, z)
    # macro average over the data specs the heads were not fitted on
    others = [s for s in specs if s != heads.card.get("data")]
    if len(others) > 1:
        report["macro_average"] = {
            m: {k: float(np.mean([report["datasets"][s]["methods"][m][k] for s in others]))
                for k in SHOWN} for m in scores}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(markdown(report))
    return report


# pragma: no mutate end
def defer_accounting(heads: Heads, z: np.ndarray, confidence: np.ndarray,
                     novelty_p: list | None, problems: list | None) -> dict:
    """The "defer" and "suite" entries of one data spec: the artefact's whole rule on these
    items, one reason per part it has (a cache written without the responses has no
    "problem" part)."""
    why = heads.defer_reasons(confidence, novelty_p, problems)
    if heads.novelty is None:
        del why["novelty"]
    if problems is None:
        del why["problem"]
    deferred = np.zeros(len(z), bool)
    for flags in why.values():
        deferred |= np.asarray(flags, bool)
    return {"defer": grounding.defer_on(z, why, heads.policy.tau, heads.policy.target_risk),
            "suite": suite_row(z, confidence, deferred, why["tau"])}


def response_problems(actor, responses: list[str] | None, max_new_tokens: int
                      ) -> list[str | None] | None:
    """Why each generated response is unusable (`models.quality.response_problem`, as the
    service computes it), or None without the responses. The collector keeps the text, not
    the ids: they are re-encoded, and a response that stopped on its own (an EOS) has fewer
    than `max_new_tokens` tokens before the EOS, a truncated one exactly that many (exact
    when the text re-encodes to as many tokens as were generated)."""
    if responses is None or getattr(actor, "tokenizer", None) is None:
        return None
    card = Path(actor.folder) / "actor_card.json"
    fmt = json.loads(card.read_text()).get("response_format") if card.exists() else None
    needs_tag = uses_answer_tag(fmt)
    out: list[str | None] = []
    for text in responses:
        ids = actor.tokenizer.encode(text, add_special_tokens=False)
        finished = len(ids) < max_new_tokens
        out.append(response_problem(parse_response(text, finished), ids, finished, needs_tag))
    return out


# pragma: no mutate start (reached only through the tiny actors: docs/testing.md)
def _grounding(heads: Heads, col: Collector, items: list, plan, feats: dict, meta: dict,
               scores: dict[str, np.ndarray], chosen: list, passes: tuple[str, ...],
               rows: dict, bootstrap: int) -> dict:
    """CCG-AUC of every method on donor runs, and DualRead's paired differences."""
    z = feats["z"].numpy().astype(int)
    extra = grounding.extra_items(items, plan)
    z_x, can_x, sc_x = np.zeros(0, int), [], {}
    if extra:
        fx, mx = col.run(extra, passes=passes, label="donor runs (CCG)")
        z_x, can_x = fx["z"].numpy().astype(int), mx["canonical"]
        sc_x = {m.name: m.score(heads, fx) for m in chosen}
        if QUESTION_ONLY in scores:
            sc_x[QUESTION_ONLY] = question_only(heads.card["question_prior"],
                                                [it.question for it in extra])
    runs = grounding.donor_runs(plan, z, meta["canonical"], scores, z_x, can_x, sc_x)
    pairs = {}
    for name, c in scores.items():
        pairs[name] = grounding.pairs_for(plan, items, z, meta["canonical"], c, runs, name)
        rows[name].update(grounding.ccg_summary(pairs[name], runs.image_ids, bootstrap))
    out = {"ccg_pairs": {"eligible": len(plan.source), "extra_runs": len(extra),
                         "vrs": float(np.mean(z[plan.source]) - np.mean(runs.z))
                         if plan.source else float("nan")}}
    if DEFER_METHOD in scores:
        out["paired_vs_dualread"] = grounding.paired_vs(
            DEFER_METHOD, scores, z, meta["image_ids"], pairs, bootstrap)
    return out


# pragma: no mutate end
def _unreadable_follow_up(actor, chosen) -> dict[str, str]:
    """Methods left out of the full table, with the reason: P(True) when the actor's
    tokenizer cannot read its template (`heads.passes.ptrue_unreadable`)."""
    from heads.passes import ptrue_unreadable

    tok = getattr(actor, "tokenizer", None)
    why = ptrue_unreadable(tok) if tok is not None else None
    return {m.name: why for m in chosen if "follow_up" in m.passes and why}


def _fmt(row: dict, k: str) -> str:
    v = row[k]
    if k + "_ci" in row and not np.isnan(row[k + "_ci"][0]):
        lo, hi = row[k + "_ci"]
        return f"{v:.3f} [{lo:.3f}, {hi:.3f}]"
    return f"{v:.3f}"


# pragma: no mutate start (report layout, not its accounting: docs/testing.md)
def markdown(report: dict) -> str:
    lines = [f"# Evaluation of `{Path(report['actor']).name}`", ""]
    if report.get("command"):
        lines += [f"Command: `{report['command']}`", ""]
    if report.get("heads_id"):
        lines += [f"Actor `{report.get('actor_fingerprint', '')}`, heads "
                  f"`{report['heads_id']}` (fitted with `{report.get('heads', '')}`).", ""]
    rows = {spec: d["suite"] for spec, d in report["datasets"].items() if "suite" in d}
    if rows:
        lines += suite_markdown(rows)
    for spec, d in report["datasets"].items():
        lines += [f"## {spec}: n = {d['n']} ({d['images']} images), accuracy "
                  f"{d['accuracy']:.3f}", "",
                  f"Natural generation + readout: {d['seconds_per_item_generate_readout']:.4f} "
                  "s/item. Brackets: 95% CI, image-cluster bootstrap.", "",
                  "| method | AUROC ↑ | ECE-15 ↓ | ECE-10 ↓ | Brier ↓ | AURC ↓ | HCE@0.9 ↓ | "
                  "extra passes | extra s/item |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for m, row in d["methods"].items():
            cells = " | ".join(_fmt(row, k) for k in SHOWN)
            lines.append(f"| {m} | {cells} | {row['cost_passes']} | "
                         f"{row['seconds_per_item_extra']:.4f} |")
        for m, why in report.get("dropped", {}).items():
            lines.append(f"| {m} | dropped: {why} |" + " |" * (len(SHOWN) + 1))
        lines.append("")
        lines += _grounding_md(d)
    if "macro_average" in report:
        lines += ["## Macro average over the datasets the heads were not fitted on", "",
                  "| method | " + " | ".join(SHOWN) + " |", "|---" * (len(SHOWN) + 1) + "|"]
        for m, row in report["macro_average"].items():
            lines.append(f"| {m} | " + " | ".join(f"{row[k]:.3f}" for k in SHOWN) + " |")
    return "\n".join(lines) + "\n"


def _grounding_md(d: dict) -> list[str]:
    lines: list[str] = []
    if "defer" in d:
        f = d["defer"]
        lines += [f"Defer rule of the heads on these data (τ = {f['tau']:.4f}): coverage "
                  f"{f['coverage']:.3f}, risk among kept answers {f['risk']:.4f} "
                  f"({'≤' if f['risk_within_target'] else '>'} r = {f['target_risk']})."
                  + (f" Novelty flags {f['novelty_flag_rate']:.3f} of items (coverage with "
                     f"τ alone {f['coverage_tau_only']:.3f})." if "novelty_flag_rate" in f
                     else "")
                  + (" Share deferred by each reason (an item may have several): "
                     + ", ".join(f"{k} {v:.3f}" for k, v in f["deferred_share"].items())
                     + "." if f.get("deferred_share") else ""), ""]
    rows = d["methods"]
    types = sorted({t for r in rows.values() for t in r.get("auroc_by_type", {})})
    if "ccg_pairs" in d:
        g = d["ccg_pairs"]
        lines += [f"Grounding: {g['eligible']} items with a donor (hard negative; "
                  f"{g['extra_runs']} extra runs), VRS {g['vrs']:.3f}. CCG-AUC over the "
                  "decisive set (right on the real image, wrong on the donor); brackets: 95% "
                  "CI, source-image bootstrap; * underpowered (< 30 source or donor images).",
                  ""]
    head = ["method"]
    if "ccg_pairs" in d:
        head += ["CCG natural", "n decisive", "CCG strict", "n decisive strict"]
    head += [f"AUROC {t} (n)" for t in types]
    lines += ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for m, r in rows.items():
        cells = [f"`{m}`"]    # one plain "| m |" row per method: the main table's
        if "ccg_pairs" in d:
            for tag in ("natural", "strict"):
                star = "*" if r[f"ccg_{tag}_underpowered"] else ""
                cells += [_fmt(r, f"ccg_{tag}") + star, str(r[f"ccg_{tag}_n_decisive"])]
        for t in types:
            a = r["auroc_by_type"].get(t)
            cells.append(f"{a['auroc']:.3f} ({a['n']})" if a else "")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if "paired_vs_dualread" in d:
        lines += ["DualRead minus each method (paired image-cluster bootstrap, 95% CI):", "",
                  "| method | Δ AUROC | Δ CCG-AUC natural |", "|---|---|---|"]
        for m, r in d["paired_vs_dualread"].items():
            cells = []
            for k in ("auroc", "ccg_natural"):
                v = r.get(k)
                if v is None:
                    cells.append("")
                elif "ci" in v:
                    cells.append(f"{v['diff']:+.3f} [{v['ci'][0]:+.3f}, {v['ci'][1]:+.3f}]")
                else:
                    cells.append(f"{v['diff']:+.3f}")
            lines.append(f"| `{m}` | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _plots(out: Path, spec: str, scores: dict[str, np.ndarray], z: np.ndarray) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tag = spec.replace(":", "_").replace("/", "_")
    n = len(scores)
    cols = 5
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 3 * rows), squeeze=False)
    edges = np.linspace(0, 1, 16)
    for ax, (m, c) in zip(axes.flat, scores.items()):
        idx = np.minimum((c * 15).astype(int), 14)
        accs = [z[idx == b].mean() if (idx == b).any() else np.nan for b in range(15)]
        ax.bar(edges[:-1], accs, width=1 / 15, align="edge", edgecolor="k", alpha=0.7)
        ax.plot([0, 1], [0, 1], "r--", lw=1)
        ax.set_title(m, fontsize=9)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(f"Reliability diagrams (15 bins) — {spec}")
    fig.tight_layout()
    fig.savefig(out / f"reliability_{tag}.png", dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for m, c in scores.items():
        cov, risk = risk_coverage(c, z)
        ax.plot(cov, risk, label=m, lw=2 if m == "dualread" else 1)
    ax.set_xlabel("coverage")
    ax.set_ylabel("selective risk")
    ax.legend(fontsize=6, ncol=2)
    ax.set_title(f"Risk–coverage — {spec}")
    fig.tight_layout()
    fig.savefig(out / f"risk_coverage_{tag}.png", dpi=90)
    plt.close(fig)

    fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 2.4 * rows), squeeze=False)
    for ax, (m, c) in zip(axes.flat, scores.items()):
        ax.hist([c[z == 1], c[z == 0]], bins=20, range=(0, 1), label=["correct", "wrong"],
                stacked=True)
        ax.set_title(m, fontsize=9)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"confidence_hist_{tag}.png", dpi=90)
    plt.close(fig)


# pragma: no mutate end
def _display(folder: str) -> str:
    """The actor folder as a report shows it: relative to the working directory when it is
    inside it (reports are committed; absolute paths are one machine's)."""
    p = Path(folder).resolve()
    try:
        return str(p.relative_to(Path.cwd().resolve()))
    except ValueError:
        return p.name
