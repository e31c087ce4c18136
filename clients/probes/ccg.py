"""`dualread probe ccg` — docs/method.md §2. Donors are assigned (seeded) before anything is scored;
each eligible item is answered on its own image and on the donor's, and every confidence
interface the service returns is read from those two answers. The CCG-AUC maths is the
one in `clients.ccg` (not a second copy).

Beyond docs/method.md §2's table: CCG-AUC per answer type and on open (not yes/no) questions on
their own, where the actor can give the same wrong answer on both images and strict CCG
can differ from natural; and paired contrasts between interfaces (same decisive pairs,
the same source-image resamples for both, so the CI is of the difference itself)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from clients.ccg import Pair
from clients.ccg import summarise as ccg_summary
from clients.grounding import classify_pair
from clients.maths import phi, resample_clusters
from clients.probes.runner import Config, Context, Memo, fmt, interfaces, pixels, run_params, short
from models.canon import canon
from models.data import Item

NAME = "ccg"


def params(cfg: Config) -> dict:
    return run_params(NAME, cfg, seed=cfg.seed)


async def run_item(ctx: Context, item: Item, memo: Memo) -> dict:
    donor = ctx.donor(item)
    if donor is None:
        return {"eligible": False, "image_id": item.image_id}
    real = await memo.real()
    hn = await memo.answer(f"donor:{donor.id}", pixels(donor), reference=donor)
    return {"eligible": True, "image_id": item.image_id, "donor": donor.id,
            "donor_image": donor.image_id, "answer_type": kind(item),
            "real": short(real), "hn": short(hn)}


def kind(item: Item) -> str:
    """The item's answer type as its data labels it; yes/no or open when unlabelled."""
    if item.answer_type:
        return item.answer_type
    return "yes/no" if canon(item.answer) in ("yes", "no") else "open"


def is_open(r: dict) -> bool:
    """Not a yes/no question (records stored before the type was kept count as unknown)."""
    return r.get("answer_type", "unknown") not in ("yes/no", "unknown")


def strict_pair(r: dict) -> bool:
    """Decisive with the same non-empty canonical answer on both images (E_strict)."""
    return bool(classify_pair(r["real"]["z"], r["hn"]["z"], r["real"]["a"], r["hn"]["a"]).strict)


def pairs(records: list[dict], iface: str) -> list[Pair]:
    return [Pair(str(k), r["image_id"], bool(r["real"]["z"]), bool(r["hn"]["z"]),
                 float(r["real"]["c"][iface]), float(r["hn"]["c"][iface]), strict_pair(r))
            for k, r in enumerate(records)]


def summarise(records: list[dict], cfg: Config) -> dict:
    elig = [r for r in records if r["eligible"]]
    decisive = [r for r in elig if r["real"]["z"] and not r["hn"]["z"]]
    out: dict = {"n_items": len(records)}
    for iface in interfaces(elig, lambda r: r["real"]["c"]):
        s = ccg_summary(pairs(elig, iface), bootstrap=cfg.bootstrap)
        out[iface] = {"natural": s["ccg_auc"], "natural_ci": s["ccg_auc_ci"],
                      "strict": s["ccg_auc_strict"], "strict_ci": s["ccg_auc_strict_ci"],
                      "n_eligible": s["P"], "n_decisive": s["E"], "n_strict": s["E_strict"],
                      "source_images": s["E_images"],
                      "donor_images": len({r["donor_image"] for r in decisive}),
                      "underpowered": s["underpowered"]}
    ifaces = _ifaces(out)
    groups = {"open": [r for r in elig if is_open(r)]}
    for t in sorted({r.get("answer_type", "unknown") for r in elig}):
        groups[t] = [r for r in elig if r.get("answer_type", "unknown") == t]
    out["by_answer_type"] = {
        t: {"n_eligible": len(rows),
            "n_decisive": sum(r["real"]["z"] and not r["hn"]["z"] for r in rows),
            "n_strict": sum(strict_pair(r) for r in rows),
            **{k: _ccg_cell(rows, k, cfg) for k in ifaces}}
        for t, rows in groups.items()}
    out["contrasts"] = {f"{a} − {b}": {m: contrast(elig, a, b, m == "strict", cfg.bootstrap)
                                        for m in ("natural", "strict")}
                        for i, a in enumerate(ifaces) for b in ifaces[i + 1:]}
    acc_real = float(np.mean([r["real"]["z"] for r in elig])) if elig else float("nan")
    acc_hn = float(np.mean([r["hn"]["z"] for r in elig])) if elig else float("nan")
    out["actor"] = {"acc_real": acc_real, "acc_donor": acc_hn, "vrs": acc_real - acc_hn,
                    "vbr": len(decisive) / len(elig) if elig else float("nan")}
    return out


def _ccg_cell(rows: list[dict], iface: str, cfg: Config) -> dict:
    s = ccg_summary(pairs(rows, iface), bootstrap=cfg.bootstrap) if rows else {}
    return {"natural": s.get("ccg_auc", float("nan")),
            "natural_ci": s.get("ccg_auc_ci", (float("nan"),) * 2),
            "strict": s.get("ccg_auc_strict", float("nan")),
            "underpowered": s.get("underpowered", True)}


def contrast(records: list[dict], a: str, b: str, strict: bool, bootstrap: int) -> dict:
    """CCG-AUC(a) − CCG-AUC(b) on the same decisive pairs, with a paired source-image
    cluster bootstrap CI (one resample of images serves both interfaces)."""
    e = [r for r in records if r["real"]["z"] and not r["hn"]["z"]
         and (strict_pair(r) or not strict)]
    if not e:
        return {"difference": float("nan"), "ci": (float("nan"), float("nan")), "n": 0}
    d = np.array([phi(r["real"]["c"][a] - r["hn"]["c"][a]) - phi(r["real"]["c"][b]
                                                                  - r["hn"]["c"][b])
                  for r in e], float)
    ci = resample_clusters([r["image_id"] for r in e], lambda idx: float(d[idx].mean()),
                           bootstrap, 42)
    return {"difference": float(d.mean()), "ci": ci, "n": len(e)}


def _ifaces(section: dict) -> list[str]:
    return [k for k, v in section.items() if isinstance(v, dict) and "natural" in v]


def markdown(s: dict) -> str:
    lines = ["## CCG-AUC (docs/method.md §2): does confidence drop on a real hard-negative "
             "image?", "",
             f"{s['n_items']} items; CCG-AUC = mean φ(c_real − c_donor) over the decisive set "
             "E (right on the real image, wrong on the donor); 0.5 = blind to the swap. "
             "95% CIs: source-image cluster bootstrap.", "",
             "| interface | CCG-AUC | 95% CI | strict | 95% CI | \\|P\\| | \\|E\\| | "
             "\\|E_strict\\| | source imgs | donor imgs | underpowered |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k in _ifaces(s):
        v = s[k]
        lines.append(f"| {k} | {fmt(v['natural'])} | {fmt(v['natural_ci'])} | "
                     f"{fmt(v['strict'])} | {fmt(v['strict_ci'])} | {fmt(v['n_eligible'])} | "
                     f"{fmt(v['n_decisive'])} | {fmt(v['n_strict'])} | "
                     f"{fmt(v['source_images'])} | {fmt(v['donor_images'])} | "
                     f"{fmt(v['underpowered'])} |")
    by = s.get("by_answer_type", {})
    names = _ifaces(s)
    if by and names:
        lines += ["", "By answer type (\"open\" = every question that is not yes/no; strict "
                  "CCG can differ from natural only there):", "",
                  "| answer type | \\|P\\| | \\|E\\| | \\|E_strict\\| | "
                  + " | ".join(f"{k} (strict)" for k in names) + " |",
                  "|---|---|---|---|" + "---|" * len(names)]
        for t, v in by.items():
            lines.append(f"| {t} | {fmt(v['n_eligible'])} | {fmt(v['n_decisive'])} | "
                         f"{fmt(v['n_strict'])} | " + " | ".join(
                             f"{fmt(v[k]['natural'])} {fmt(v[k]['natural_ci'])} "
                             f"({fmt(v[k]['strict'])})" for k in names) + " |")
    con = s.get("contrasts", {})
    if con:
        lines += ["", f"Paired contrasts between interfaces ({len(con)} pairs, each on the "
                  "same decisive pairs; 95% CI from one source-image cluster bootstrap for "
                  "both; not adjusted for multiplicity):", "",
                  "| contrast | natural | 95% CI | strict | 95% CI | \\|E\\| |",
                  "|---|---|---|---|---|---|"]
        for name, v in con.items():
            lines.append(f"| {name} | {fmt(v['natural']['difference'])} | "
                         f"{fmt(v['natural']['ci'])} | {fmt(v['strict']['difference'])} | "
                         f"{fmt(v['strict']['ci'])} | {fmt(v['natural']['n'])} |")
    a = s.get("actor", {})
    lines += ["", f"Actor on P: accuracy {fmt(a.get('acc_real'))} on the real image, "
                  f"{fmt(a.get('acc_donor'))} on the donor; VRS {fmt(a.get('vrs'))}, "
                  f"VBR = \\|E\\|/\\|P\\| {fmt(a.get('vbr'))}."]
    return "\n".join(lines)


def figures(records: list[dict], section: dict, out: Path) -> list[str]:
    import matplotlib.pyplot as plt

    elig = [r for r in records if r["eligible"]]
    names = _ifaces(section)
    if not elig or not names:
        return []
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.3), squeeze=False)
    dec = np.array([r["real"]["z"] and not r["hn"]["z"] for r in elig])
    for ax, k in zip(axes[0], names):
        cr = np.array([r["real"]["c"][k] for r in elig])
        ch = np.array([r["hn"]["c"][k] for r in elig])
        ax.scatter(ch[~dec], cr[~dec], s=6, c="0.7", label="not decisive")
        ax.scatter(ch[dec], cr[dec], s=8, c="tab:blue", label="decisive (E)")
        ax.plot([0, 1], [0, 1], "k--", lw=0.8)
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="c_donor", ylabel="c_real",
               title=f"{k}: CCG-AUC {fmt(section[k]['natural'])}")
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path = out / "ccg_scatter.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [str(path)]
