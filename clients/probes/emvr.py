"""`dualread probe emvr` — docs/method.md §4. Each item with a question-critical box (the `box` of a
JSONL item; for easy-VQA the shape's box) is answered at five severities of a centred
mask on the box, of a Gaussian blur inside it, and of the same mask on a matched
non-critical box (control). The mask is filled with the image's own background estimate
(`images.background_rgb`), not docs/method.md §4's literal gray: on easy-VQA a gray rectangle is an
answer ("gray", "rectangle"), so it would add evidence where it should remove some.
For each confidence interface:

- EMVR = share of adjacent severity pairs where confidence *rises* as evidence goes;
- TVR = share of trajectories with at least one such rise;
- with the effect-size curves (accuracy and mean confidence per severity), because a flat
  curve can have a high EMVR from noise alone (EMVR paper §5.3).
Uncertainty: paired bootstrap over whole trajectories, 1000 resamples, seed 42.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from clients.probes.images import blur_region, control_box, mask_region, png
from clients.probes.runner import Config, Context, Memo, fmt, interfaces, run_params, short
from clients.probes.stats import NAN_CI, bootstrap, emvr, mean, tvr
from models.data import Item, shape_box

NAME = "emvr"
VARIANTS = ("mask", "blur", "control")
# EMVR stays the paper's strict R_{k+1} > R_k (docs/probes.md, "EMVR and numerical
# noise"); rises up to NOISE_TOL are also reported apart, as a labelled diagnostic.
NOISE_TOL = 1e-6


def params(cfg: Config) -> dict:
    return run_params(NAME, cfg, severities=list(cfg.severities), fill=cfg.mask_fill)


def critical_box(item: Item) -> tuple[int, int, int, int] | None:
    if item.box:
        return tuple(int(v) for v in item.box)
    if item.domain == "easyvqa":
        return shape_box(item.image_path)
    return None


async def run_item(ctx: Context, item: Item, memo: Memo) -> dict:
    box = critical_box(item)
    if box is None:
        return {"skipped": "no box", "image_id": item.image_id}
    img = item.image()
    ctrl = control_box(box, img.size, ctx.other_boxes(item))
    fill = ctx.cfg.mask_fill
    ops = {"mask": lambda lam: mask_region(img, box, lam, fill),
           "blur": lambda lam: blur_region(img, box, lam)}
    if ctrl is not None:
        ops["control"] = lambda lam: mask_region(img, ctrl, lam, fill)

    async def one(variant: str, lam: float) -> dict:
        if lam <= 0:                                   # λ = 0 is the untouched image
            return short(await memo.real())
        data = png(ops[variant](lam))
        return short(await memo.answer(f"{variant}:{lam:g}", lambda: data))

    keys = [(v, lam) for v in ops for lam in ctx.cfg.severities]
    runs = await asyncio.gather(*(one(v, lam) for v, lam in keys))
    out: dict = {"image_id": item.image_id, "box": list(box),
                 "control_box": list(ctrl) if ctrl else None}
    for v in ops:
        out[v] = [r for (vv, _), r in zip(keys, runs) if vv == v]
    return out


def _matrix(rows: list[dict], variant: str, iface: str) -> np.ndarray:
    return np.array([[run["c"][iface] for run in r[variant]] for r in rows], float)


def _acc(rows: list[dict], variant: str) -> np.ndarray:
    return np.array([[run["z"] for run in r[variant]] for r in rows], float)


def summarise(records: list[dict], cfg: Config) -> dict:
    rows = [r for r in records if "mask" in r]
    ctrl = [r for r in rows if r.get("control")]
    sev = [f"{s:g}" for s in cfg.severities]
    out: dict = {"n_items": len(records), "n_trajectories": len(rows), "n_control": len(ctrl),
                 "severities": sev, "bootstrap": cfg.bootstrap, "mask_fill": cfg.mask_fill,
                 "noise_tol": NOISE_TOL}
    actor: dict = {}
    for v in VARIANTS:
        sub = ctrl if v == "control" else rows
        actor[f"accuracy_{v}"] = dict(zip(sev, _acc(sub, v).mean(0).tolist())) if sub else {}
    # accuracy drop clean → full, critical minus matched control, paired per trajectory
    if ctrl:
        drop_crit = _acc(ctrl, "mask")[:, 0] - _acc(ctrl, "mask")[:, -1]
        drop_ctrl = _acc(ctrl, "control")[:, 0] - _acc(ctrl, "control")[:, -1]
        d = drop_crit - drop_ctrl
        actor["drop_critical"] = mean(drop_crit)
        actor["drop_control"] = mean(drop_ctrl)
        actor["drop_difference"] = mean(d)
        actor["drop_difference_ci"] = bootstrap(len(d), lambda i: float(d[i].mean()),
                                                cfg.bootstrap, 42)
    out["actor"] = actor
    for k in interfaces(rows, lambda r: r["mask"][0]["c"]):
        v: dict = {}
        for var in VARIANTS:
            sub = ctrl if var == "control" else rows
            if not sub:
                v[var], v[f"tvr_{var}"], v[f"{var}_ci"] = float("nan"), float("nan"), NAN_CI
                v[f"confidence_{var}"] = {}
                continue
            m = _matrix(sub, var, k)
            v[var] = emvr(m)
            v[f"{var}_above_noise"] = emvr(m, NOISE_TOL)
            v[f"tvr_{var}"] = tvr(m)
            v[f"{var}_ci"] = bootstrap(len(m), lambda i, m=m: emvr(m[i]), cfg.bootstrap, 42)
            v[f"confidence_{var}"] = dict(zip(sev, m.mean(0).tolist()))
        out[k] = v
    ifaces = [k for k in out if isinstance(out[k], dict) and "mask" in out[k]]
    if "verbalized" in ifaces and rows:   # paired: same trajectories, two interfaces
        for k in ifaces:
            if k == "verbalized":
                continue
            for var in ("mask", "blur"):
                a, b = _matrix(rows, var, k), _matrix(rows, var, "verbalized")
                out[k][f"{var}_minus_verbalized"] = emvr(a) - emvr(b)
                out[k][f"{var}_minus_verbalized_ci"] = bootstrap(
                    len(a), lambda i, a=a, b=b: emvr(a[i]) - emvr(b[i]), cfg.bootstrap, 42)
    return out


def _ifaces(s: dict) -> list[str]:
    return [k for k, v in s.items() if isinstance(v, dict) and "tvr_mask" in v]


def markdown(s: dict) -> str:
    lines = ["## Evidence order (docs/method.md §4): does confidence fall as the critical "
             "region goes?",
             "", f"{s['n_trajectories']} trajectories (5 severities each), {s['n_control']} "
             "with a matched non-critical control box; mask fill: "
             f"{s.get('mask_fill', 'gray')} (the image's own background estimate unless it "
             "says gray). EMVR = share of adjacent severity pairs where confidence rises "
             "(0 = monotone); TVR = share of trajectories with any rise. "
             f"95% CIs: paired bootstrap over trajectories ({s['bootstrap']}, seed 42).", "",
             "| interface | EMVR mask | 95% CI | TVR mask | EMVR blur | 95% CI | EMVR control | "
             "95% CI |", "|---|---|---|---|---|---|---|---|"]
    for k in _ifaces(s):
        v = s[k]
        lines.append(f"| {k} | {fmt(v['mask'])} | {fmt(v['mask_ci'])} | {fmt(v['tvr_mask'])} | "
                     f"{fmt(v['blur'])} | {fmt(v['blur_ci'])} | {fmt(v['control'])} | "
                     f"{fmt(v['control_ci'])} |")
    if all(f"{var}_above_noise" in s[k] for k in _ifaces(s) for var in VARIANTS):
        lines += ["", f"EMVR counting only rises larger than {s.get('noise_tol', NOISE_TOL):g} "
                  "(a diagnostic, not EMVR: a control box over plain background leaves the "
                  "image unchanged, and its \"rises\" are arithmetic noise between batches): "
                  + "; ".join(f"{k} mask {fmt(s[k]['mask_above_noise'])}, blur "
                              f"{fmt(s[k]['blur_above_noise'])}, control "
                              f"{fmt(s[k]['control_above_noise'])}" for k in _ifaces(s)) + "."]
    diffs = [(k, s[k]) for k in _ifaces(s) if "mask_minus_verbalized" in s[k]]
    if diffs:
        lines += ["", "Paired EMVR difference to verbalized μ(C) (negative = more ordered "
                  "than μ(C)): " + "; ".join(
                      f"{k} mask {fmt(v['mask_minus_verbalized'])} "
                      f"{fmt(v['mask_minus_verbalized_ci'])}, blur "
                      f"{fmt(v['blur_minus_verbalized'])} {fmt(v['blur_minus_verbalized_ci'])}"
                      for k, v in diffs) + "."]
    sev = s["severities"]
    lines += ["", "Effect size per severity λ (" + ", ".join(sev) + "):", "",
              "| curve | " + " | ".join(sev) + " |", "|---|" + "---|" * len(sev)]
    a = s["actor"]
    for var in VARIANTS:
        if a.get(f"accuracy_{var}"):
            lines.append(f"| accuracy, {var} | "
                         + " | ".join(fmt(x) for x in a[f"accuracy_{var}"].values()) + " |")
    for k in _ifaces(s):
        for var in VARIANTS:
            if s[k].get(f"confidence_{var}"):
                lines.append(f"| {k}, {var} | " + " | ".join(
                    fmt(x) for x in s[k][f"confidence_{var}"].values()) + " |")
    if "drop_difference" in a:
        lines += ["", f"Accuracy drop clean → full mask: critical {fmt(a['drop_critical'])}, "
                  f"matched control {fmt(a['drop_control'])}; paired difference "
                  f"{fmt(a['drop_difference'])} {fmt(a['drop_difference_ci'])}."]
    return "\n".join(lines)


def figures(records: list[dict], section: dict, out: Path) -> list[str]:
    import matplotlib.pyplot as plt

    names = _ifaces(section)
    if not names:
        return []
    sev = [float(x) for x in section["severities"]]
    fig, axes = plt.subplots(1, len(names) + 1, figsize=(3.2 * (len(names) + 1), 3.2))
    styles = {"mask": "-o", "blur": "--s", "control": ":^"}
    for var in VARIANTS:
        acc = section["actor"].get(f"accuracy_{var}")
        if acc:
            axes[0].plot(sev, list(acc.values()), styles[var], label=var)
    axes[0].set(title="actor accuracy", xlabel="severity λ", ylim=(0, 1.02))
    axes[0].legend(fontsize=7)
    for ax, k in zip(axes[1:], names):
        for var in VARIANTS:
            c = section[k].get(f"confidence_{var}")
            if c:
                ax.plot(sev, list(c.values()), styles[var], label=var)
        ax.set(title=f"{k}: EMVR mask {fmt(section[k]['mask'])}", xlabel="severity λ",
               ylim=(0, 1.02))
    axes[1].set_ylabel("mean confidence")
    fig.tight_layout()
    path = out / "emvr_curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [str(path)]
