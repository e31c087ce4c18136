"""`dualread probe ccg` — docs/method.md §2. Donors are assigned (seeded) before anything is scored;
each eligible item is answered on its own image and on the donor's, and every confidence
interface the service returns is read from those two answers. The CCG-AUC maths is the
one in `clients.ccg` (not a second copy)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from clients.ccg import Pair
from clients.ccg import summarise as ccg_summary
from clients.grounding import classify_pair
from clients.probes.runner import Config, Context, Memo, fmt, interfaces, pixels, run_params, short
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
            "donor_image": donor.image_id, "real": short(real), "hn": short(hn)}


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
    acc_real = float(np.mean([r["real"]["z"] for r in elig])) if elig else float("nan")
    acc_hn = float(np.mean([r["hn"]["z"] for r in elig])) if elig else float("nan")
    out["actor"] = {"acc_real": acc_real, "acc_donor": acc_hn, "vrs": acc_real - acc_hn,
                    "vbr": len(decisive) / len(elig) if elig else float("nan")}
    return out


def _ifaces(section: dict) -> list[str]:
    return [k for k, v in section.items() if isinstance(v, dict) and "natural" in v]


def markdown(s: dict) -> str:
    lines = ["## CCG-AUC (SPEC §2): does confidence drop on a real hard-negative image?", "",
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
