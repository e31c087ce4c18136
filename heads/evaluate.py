"""`dualread evaluate`: every confidence method on the same frozen actor outputs.

One row per method (SPEC §7), columns n, accuracy, AUROC, ECE-15, ECE-10, Brier, AURC,
HCE@0.9 with image-cluster bootstrap CIs, the cost of each method in forward passes
beyond the natural generation, and measured seconds per item.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from heads import registry
from heads.collect import Collector
from heads.dualread import Heads
from heads.metrics import METRICS, cluster_bootstrap, risk_coverage
from models.data import load, sample

SHOWN = ("auroc", "ece", "ece10", "brier", "aurc", "hce90")


def __getattr__(name: str):
    # METHODS follows the registry, so a method registered later is in the default table
    if name == "METHODS":
        return registry.names()
    raise AttributeError(name)


def score_all(heads: Heads, feats: dict, methods: tuple[str, ...] | None = None
              ) -> dict[str, np.ndarray]:
    """Confidence of each chosen method (all registered by default), in the order given."""
    return {m.name: m.score(heads, feats) for m in registry.select(methods)}


def evaluate(actor, heads: Heads, specs: list[str], out: str | Path,
             methods: tuple[str, ...] | None = None, limit: int | None = None,
             bootstrap: int = 1000, cache_dir: str | Path | None = None,
             max_new_tokens: int = 64, command: str = "") -> dict:
    """One table per data spec: every chosen method (all registered by default)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    chosen = registry.select(methods)
    missing = [m.name for m in chosen if not heads.has(m)]
    if missing:
        raise ValueError(f"these heads were fitted without {', '.join(missing)}; refit them "
                         "with `dualread fit-heads` or leave those methods out")
    passes = registry.passes_for(chosen)
    report: dict = {"actor": actor.folder, "actor_fingerprint": actor.fingerprint,
                    "heads": heads.card.get("command", ""), "command": command,
                    "bootstrap": bootstrap, "datasets": {}}
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
        rows = {}
        n = len(items)
        base_s = col.seconds["generate+readout"] / max(1, n)
        for m in chosen:
            c = scores[m.name]
            row = {"n": n}
            for name in SHOWN:
                row[name] = METRICS[name](c, z)
                if bootstrap:
                    row[name + "_ci"] = cluster_bootstrap(c, z, clusters, METRICS[name],
                                                          n=bootstrap)
            extra_s = sum(col.seconds[p] for p in m.passes) / n
            extra_s *= m.pass_share    # SC@K reads the first K of one shared sample pass
            row["cost_passes"] = m.cost
            row["seconds_per_item_extra"] = round(extra_s + scoring_s, 5)
            rows[m.name] = row
        report["datasets"][spec] = {
            "n": n, "accuracy": float(z.mean()), "images": len(set(clusters)),
            "seconds_per_item_generate_readout": round(base_s, 5),
            "wall_seconds": round(wall, 1), "methods": rows}
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


def _fmt(row: dict, k: str) -> str:
    v = row[k]
    if k + "_ci" in row and not np.isnan(row[k + "_ci"][0]):
        lo, hi = row[k + "_ci"]
        return f"{v:.3f} [{lo:.3f}, {hi:.3f}]"
    return f"{v:.3f}"


def markdown(report: dict) -> str:
    lines = [f"# Evaluation of `{Path(report['actor']).name}`", ""]
    if report.get("command"):
        lines += [f"Command: `{report['command']}`", ""]
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
        lines.append("")
    if "macro_average" in report:
        lines += ["## Macro average over the datasets the heads were not fitted on", "",
                  "| method | " + " | ".join(SHOWN) + " |", "|---" * (len(SHOWN) + 1) + "|"]
        for m, row in report["macro_average"].items():
            lines.append(f"| {m} | " + " | ".join(f"{row[k]:.3f}" for k in SHOWN) + " |")
    return "\n".join(lines) + "\n"


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
