"""`dualread probe reliance` — docs/method.md §5. Each item is answered on its real image, a blank
image (224×224 RGB 128) and a shuffled one (a different image of the same data, seeded).

VRS = Acc_real − Acc_shuffle, BD = Acc_real − Acc_blank, IS = P[a_real ≠ a_shuffle],
VBR = P[z_real ∧ ¬z_shuf], VHR = P[¬z_real ∧ z_shuf]; NVC = the real rationale uses
visual-observation language not copied from the question; NVCR = P[NVC],
HVRR = P[NVC ∧ a_real = a_shuffle], and P[a_real = a_shuffle | NVC]. 95% CIs from an
image-cluster bootstrap (1000); VRS and BD also get a paired sign-flip permutation test
against 0. Mean confidence per condition shows whether each interface notices.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from clients.probes import text
from clients.probes.images import blank, png
from clients.probes.runner import Config, Context, Memo, fmt, interfaces, pixels, run_params, short
from clients.probes.stats import cluster_bootstrap, mean, reliance, sign_flip_p
from models.data import Item

NAME = "reliance"
BLANK_PNG = png(blank())
CONDITIONS = ("real", "blank", "shuffle")
METRICS = ("vrs", "bd", "is", "vbr", "vhr", "nvcr", "hvrr")


def params(cfg: Config) -> dict:
    return run_params(NAME, cfg, seed=cfg.seed)


# pragma: no mutate start (reached only through a live service: docs/testing.md)
async def run_item(ctx: Context, item: Item, memo: Memo) -> dict:
    shuf = ctx.shuffle_image(item)
    if shuf is None:
        return {"skipped": "one image only", "image_id": item.image_id}
    shuf_id, shown = shuf
    real, bl, sh = await asyncio.gather(
        memo.real(), memo.answer("blank", lambda: BLANK_PNG),
        memo.answer(f"shuffle:{shuf_id}", pixels(shown)))
    return {"image_id": item.image_id, "shuffle_image": shuf_id,
            "nvc": text.novel_visual_claim(text.rationale(real["response"]), item.question),
            "real": short(real), "blank": short(bl), "shuffle": short(sh)}


# pragma: no mutate end
def _arrays(rows: list[dict]) -> tuple[np.ndarray, ...]:
    zr = np.array([r["real"]["z"] for r in rows], bool)
    zb = np.array([r["blank"]["z"] for r in rows], bool)
    zs = np.array([r["shuffle"]["z"] for r in rows], bool)
    same = np.array([r["real"]["a"] == r["shuffle"]["a"] for r in rows], bool)
    nvc = np.array([r["nvc"] for r in rows], bool)
    return zr, zb, zs, same, nvc


def summarise(records: list[dict], cfg: Config) -> dict:
    rows = [r for r in records if "real" in r]
    zr, zb, zs, same, nvc = _arrays(rows)
    out: dict = {"n_items": len(records), "n": len(rows), "bootstrap": cfg.bootstrap,
                 **reliance(zr, zb, zs, same, nvc)}
    images = [r["image_id"] for r in rows]
    for m in METRICS + ("p_invariant_given_nvc",):
        out[f"{m}_ci"] = cluster_bootstrap(
            images, lambda i, m=m: reliance(zr[i], zb[i], zs[i], same[i], nvc[i])[m],
            cfg.bootstrap, 42)
    out["vrs_p"] = sign_flip_p(zr.astype(float) - zs)
    out["bd_p"] = sign_flip_p(zr.astype(float) - zb)
    conf: dict = {}
    for k in interfaces(rows, lambda r: r["real"]["c"]):
        conf[k] = {c: mean([r[c]["c"][k] for r in rows]) for c in CONDITIONS}
    out["confidence"] = conf
    return out


# pragma: no mutate start (report layout and plots: the numbers come from summarise)
def markdown(s: dict) -> str:
    lines = ["## Visual reliance (docs/method.md §5): real vs blank vs shuffled image", "",
             f"{s['n']} items. 95% CIs: image-cluster bootstrap ({s['bootstrap']}); p: paired "
             "sign-flip "
             "permutation test against 0 (10,000).", "",
             "| metric | value | 95% CI |", "|---|---|---|"]
    names = {"vrs": "VRS = Acc_real − Acc_shuffle", "bd": "BD = Acc_real − Acc_blank",
             "is": "IS = P[a_real ≠ a_shuffle]", "vbr": "VBR = P[z_real ∧ ¬z_shuffle]",
             "vhr": "VHR = P[¬z_real ∧ z_shuffle]", "nvcr": "NVCR = P[NVC]",
             "hvrr": "HVRR = P[NVC ∧ a_real = a_shuffle]",
             "p_invariant_given_nvc": "P[a_real = a_shuffle \\| NVC]"}
    for m, label in names.items():
        extra = f" (p = {s[m + '_p']:.4f})" if f"{m}_p" in s and s[m + "_p"] is not None else ""
        lines.append(f"| {label} | {fmt(s[m])}{extra} | {fmt(s[m + '_ci'])} |")
    lines += ["", f"Accuracy: real {fmt(s['acc_real'])}, blank {fmt(s['acc_blank'])}, "
              f"shuffled {fmt(s['acc_shuffle'])}.", "",
              "| interface | mean conf. real | blank | shuffled |", "|---|---|---|---|"]
    for k, v in s["confidence"].items():
        lines.append(f"| {k} | {fmt(v['real'])} | {fmt(v['blank'])} | {fmt(v['shuffle'])} |")
    return "\n".join(lines)


def figures(records: list[dict], section: dict, out: Path) -> list[str]:
    import matplotlib.pyplot as plt

    if not section.get("n"):
        return []
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.2))
    accs = [section["acc_real"], section["acc_blank"], section["acc_shuffle"]]
    a1.bar(CONDITIONS, [np.nan if a is None else a for a in accs], color="tab:gray")
    a1.set(ylim=(0, 1), title="actor accuracy", ylabel="accuracy")
    conf = section["confidence"]
    width = 0.8 / max(1, len(conf))
    for j, (k, v) in enumerate(conf.items()):
        a2.bar(np.arange(3) + j * width, [v[c] for c in CONDITIONS], width, label=k)
    a2.set_xticks(np.arange(3) + 0.4 - width / 2, CONDITIONS)
    a2.set(ylim=(0, 1), title="mean confidence", ylabel="confidence")
    a2.legend(fontsize=7)
    fig.tight_layout()
    path = out / "reliance.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [str(path)]
# pragma: no mutate end
