"""The one-page summary of `dualread probe all`."""

from __future__ import annotations

from clients.probes.numbers import fmt


def summary(report: dict) -> str:
    meta = report.get("meta", {})
    ccg, tgs, emvr, rel = (report.get(k, {}) for k in ("ccg", "tgs", "emvr", "reliance"))
    ifaces = [k for k, v in ccg.items() if isinstance(v, dict) and "natural" in v] or \
        [k for k, v in tgs.items() if isinstance(v, dict) and "self" in v]
    dep = meta.get("deployment", {})
    lines = ["# Probe summary", "",
             f"Data `{meta.get('data')}`, {fmt(meta.get('items'))} items; deployment "
             + ", ".join(f"{k} `{v}`" for k, v in dep.items()) + ".", "",
             "Grounding of each confidence interface (↑ better for CCG-AUC and TGS, "
             "↓ better for EMVR):", "",
             "| interface | CCG-AUC | CCG-AUC strict | TGS-self | TGS-pair own | TGS-pair gold "
             "| TGS-pair held-out (own) | EMVR mask | EMVR blur | EMVR control |",
             "|---" * 10 + "|"]
    for k in ifaces:
        c, t, e = ccg.get(k, {}), tgs.get(k, {}), emvr.get(k, {})
        lines.append(f"| {k} | {fmt(c.get('natural'))} | {fmt(c.get('strict'))} | "
                     f"{fmt(t.get('self'))} | {fmt(t.get('pair'))} | {fmt(t.get('gold_pair'))} "
                     f"| {fmt(t.get('heldout_pair_own'))} | {fmt(e.get('mask'))} | "
                     f"{fmt(e.get('blur'))} | {fmt(e.get('control'))} |")
    first = ccg.get(ifaces[0], {}) if ifaces else {}
    lines += ["", f"CCG: \\|P\\| {fmt(first.get('n_eligible'))}, \\|E\\| "
              f"{fmt(first.get('n_decisive'))}, \\|E_strict\\| {fmt(first.get('n_strict'))}, "
              f"{fmt(first.get('source_images'))} source images"
              + (" (underpowered)" if first.get("underpowered") else "") + ". "
              f"TGS-pair on {fmt(tgs.get('n_pair_vision'))}/{fmt(tgs.get('n_pair_reasoning'))}/"
              f"{fmt(tgs.get('n_pair_answer'))} items (vision/reasoning/answer); hesitation: "
              f"{tgs.get('hesitation') if isinstance(tgs.get('hesitation'), str) else 'see TGS'}."
              f" EMVR on {fmt(emvr.get('n_trajectories'))} trajectories "
              f"({fmt(emvr.get('n_control'))} with a control box).", "",
              "Actor's reliance on the image: "
              + ", ".join(f"{m.upper()} {fmt(rel.get(m))}" for m in
                          ("vrs", "bd", "is", "vbr", "vhr", "nvcr", "hvrr")) + "."]
    return "\n".join(lines)
