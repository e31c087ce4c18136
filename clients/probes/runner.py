"""Resumable probe runs: per-item results in JSONL, a progress bar, reports from results.

Every probe's results go to `OUT/<probe>.jsonl`, one line per finished item, tagged with a
hash of the probe's parameters (data, seed, severities, the deployment's actor and heads).
A re-run with the same parameters skips what is there; a kill loses only the items in
flight (a half-written last line is cut off on the next start). Reports are computed from
the stored results in data order, so a resumed run writes the same report as one that was
never interrupted. Wall time and retries go to `run.json`, never into `report.json`.
Several endpoints of one deployment (`--url A --url B`) split the items, each taking the
next one when it has a free slot; their results go to the same files.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from clients.http import AsyncDualReadClient
from clients.probes.images import png
from clients.probes.numbers import clean, fmt  # noqa: F401  (the probes import them here)
from models.canon import canon, is_correct
from models.data import HardNegativeIndex, Item

FORMAT = 1          # bump when a record's layout changes: old lines stop matching
DEADLINE_S = 24 * 3600.0   # how long a run keeps retrying 429s (backpressure) by default


class TooManyFailures(RuntimeError):
    """A run stopped because at least 10 items (or a tenth of them) failed: the service or
    the data is wrong, and going on would only fail the rest. What was stored stays."""

    def __init__(self, failures: list[str]) -> None:
        super().__init__(f"{len(failures)} items failed; the run stopped")
        self.failures = list(failures)


@dataclass
class Config:
    data: str
    seed: int = 0
    bootstrap: int = 1000
    max_new_tokens: int | None = None
    severities: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    mask_ratios: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    mask_seeds: tuple[int, ...] = (0, 1, 2)
    mask_fill: str = "background"      # EMVR's mask: the image's own background estimate
    deployment: dict = field(default_factory=dict)


class Probe(Protocol):
    NAME: str

    def params(self, cfg: Config) -> dict: ...
    async def run_item(self, ctx: Context, item: Item, memo: Memo) -> dict: ...
    def summarise(self, records: list[dict], cfg: Config) -> dict: ...
    def markdown(self, section: dict) -> str: ...
    def figures(self, records: list[dict], section: dict, out: Path) -> list[str]: ...


def run_params(name: str, cfg: Config, **own: Any) -> dict:
    """What identifies a probe's run (its stored lines carry a hash of it): the fields
    every probe shares, with the probe's own (seed, severities, mask ratios) in between."""
    return {"probe": name, "format": FORMAT, "data": cfg.data, **own,
            "max_new_tokens": cfg.max_new_tokens, "deployment": cfg.deployment}


# ---------------------------------------------------------------- storage
def tag_of(params: dict) -> str:
    blob = json.dumps(params, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class Store:
    """Append-only JSONL of finished items for one probe and one parameter set."""

    def __init__(self, path: Path, params: dict) -> None:
        self.path = Path(path)
        self.tag = tag_of(params)
        self.done: dict[str, dict] = {}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            self._load()
        self.fh = open(self.path, "a", encoding="utf-8")

    def _load(self) -> None:
        raw = self.path.read_bytes()
        keep = raw[:raw.rfind(b"\n") + 1]      # a kill mid-write leaves a partial line
        if len(keep) != len(raw):
            with open(self.path, "r+b") as fh:
                fh.truncate(len(keep))
        for line in keep.decode("utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("tag") == self.tag:
                self.done[row["id"]] = row["record"]

    def add(self, item_id: str, record: dict) -> None:
        self.fh.write(json.dumps({"id": item_id, "tag": self.tag, "record": record}) + "\n")
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.done[item_id] = record

    def close(self) -> None:
        self.fh.close()


# ---------------------------------------------------------------- the shared context
def _seeded(seed: int, key: str) -> np.random.Generator:
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return np.random.default_rng([seed, h])


class Context:
    """What every probe needs: the client, the whole loaded data (donor and shuffle
    pools), the config, and deterministic donor/shuffle assignments."""

    def __init__(self, client: AsyncDualReadClient, pool: list[Item], cfg: Config) -> None:
        self.client, self.pool, self.cfg = client, pool, cfg
        self._index: HardNegativeIndex | None = None
        self.donors: dict[str, Item | None] = {}
        self.images: dict[str, Item] = {}           # one item per image: its pixels
        self.boxes: dict[str, set[tuple[int, int, int, int]]] = {}
        for it in pool:
            self.images.setdefault(it.image_id, it)
            if it.box:
                self.boxes.setdefault(it.image_id, set()).add(tuple(it.box))
        self._image_ids = sorted(self.images)

    def assign_donors(self, items: Sequence[Item]) -> None:
        """docs/method.md §2: donors are fixed (seeded) before anything is scored."""
        self._index = self._index or HardNegativeIndex(self.pool, self.cfg.seed)
        for it in items:
            self.donors[it.id] = self._index.assign(it)

    def donor(self, item: Item) -> Item | None:
        if item.id not in self.donors:
            self.assign_donors([item])
        return self.donors[item.id]

    def shuffle_image(self, item: Item) -> tuple[str, Item] | None:
        """(image id, an item showing it) for a different image of the same data, seeded
        per item."""
        others = [i for i in self._image_ids if i != item.image_id]
        if not others:
            return None
        pick = others[int(_seeded(self.cfg.seed, "shuffle:" + item.id).integers(len(others)))]
        return pick, self.images[pick]

    def other_boxes(self, item: Item) -> list[tuple[int, int, int, int]]:
        """Annotated boxes on the same image other than this item's own."""
        return sorted(b for b in self.boxes.get(item.image_id, ()) if b != tuple(item.box or ()))


class Memo:
    """One item's answers by condition, shared by the probes that run on it, so the real
    image is answered once even when four probes want it at the same moment."""

    def __init__(self, ctx: Context, item: Item) -> None:
        self.ctx, self.item = ctx, item
        self.runs: dict[str, asyncio.Future] = {}

    async def answer(self, key: str, image: Callable[[], bytes | str | Path],
                     reference: Item | None = None) -> dict:
        if key not in self.runs:
            self.runs[key] = asyncio.ensure_future(self._call(image))
        run = dict(await self.runs[key])
        ref = reference or self.item
        run["z"] = is_correct(run["answer"], ref.answer, ref.options or None)
        run["canonical"] = canon(run["answer"], ref.options or None)
        return run

    async def _call(self, image: Callable[[], bytes | str | Path]) -> dict:
        r = await self.ctx.client.answer(image(), self.item.question, self.ctx.cfg.max_new_tokens)
        if r.confidence is None:
            raise RuntimeError("the deployment answers without confidence heads (answer-only "
                               "mode): the probes read its confidences")
        return {"answer": r.answer, "response": r.response,
                "confidence": r.confidence.model_dump(),
                "defer_threshold": getattr(r, "defer_threshold", None)}

    async def real(self) -> dict:
        return await self.answer("real", pixels(self.item))


def pixels(item: Item) -> Callable[[], bytes | Path]:
    """What to send for an item's image: the file itself (its own bytes, DICOM included),
    unless the item's pixels are computed (a corrupted copy, `models.shift`)."""
    if type(item).image is Item.image:
        return lambda: Path(item.image_path)
    return lambda: png(item.image())


def short(run: dict) -> dict:
    """What a record keeps of one run: correctness, canonical answer, confidences."""
    return {"z": run["z"], "a": run["canonical"], "c": run["confidence"]}


# ---------------------------------------------------------------- reports
def interfaces(records: list[dict], find: Callable[[dict], dict | None]) -> list[str]:
    """Confidence interfaces the service returned, in its order."""
    for r in records:
        c = find(r)
        if c:
            return list(c)
    return []


def _progress(total: int, done: int, label: str):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class Rate(ProgressColumn):
        def render(self, task) -> Text:
            speed = task.finished_speed or task.speed
            return Text(f"{speed:.2f} items/s" if speed else "– items/s")

    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   Rate(), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
    task = bar.add_task(label, total=total, completed=done)
    return bar, task


async def _run(probes: Sequence[Probe], items: list[Item], ctx: Context | Sequence[Context],
               out: Path, concurrency: int, progress: bool) -> tuple[dict[str, Store], dict]:
    """Items go, in data order, to whichever endpoint (one context each) has a free slot:
    `concurrency` items in flight per endpoint, results in one store per probe."""
    ctxs = [ctx] if isinstance(ctx, Context) else list(ctx)
    ctx = ctxs[0]
    stores = {p.NAME: Store(out / f"{p.NAME}.jsonl", p.params(ctx.cfg)) for p in probes}
    todo = [it for it in items if any(it.id not in stores[p.NAME].done for p in probes)]
    failures: list[str] = []
    bar, task = _progress(len(items), len(items) - len(todo),
                          "+".join(p.NAME for p in probes)) if progress else (None, None)
    queue = deque(todo)            # items in flight (what a kill can lose) = the workers
    by_url = {str(c.client.http.base_url).rstrip("/"): 0 for c in ctxs}

    async def work(ctx: Context, item: Item) -> None:
        memo = Memo(ctx, item)
        need = [p for p in probes if item.id not in stores[p.NAME].done]
        try:
            recs = await asyncio.gather(*(p.run_item(ctx, item, memo) for p in need))
        except Exception as e:   # recorded, not stored: a re-run tries the item again
            failures.append(f"{item.id}: {type(e).__name__}: {e}")
            if len(failures) >= max(10, len(todo) // 10):
                queue.clear()
                raise TooManyFailures(failures) from e
            return
        for p, rec in zip(need, recs):
            stores[p.NAME].add(item.id, rec)
        by_url[str(ctx.client.http.base_url).rstrip("/")] += 1
        if bar is not None:
            bar.advance(task)

    async def worker(ctx: Context) -> None:
        while queue:
            await work(ctx, queue.popleft())

    t0 = time.perf_counter()
    try:
        if bar is not None:
            bar.start()
        await asyncio.gather(*(worker(c) for c in ctxs for _ in range(concurrency)))
    finally:
        if bar is not None:
            bar.stop()
        for s in stores.values():
            s.close()
    run = {"wall_s": round(time.perf_counter() - t0, 2), "items": len(items),
           "items_run": len(todo) - len(failures), "items_resumed": len(items) - len(todo),
           "failures": failures, "retried_requests": sum(c.client.retried for c in ctxs),
           "throttled_requests": sum(c.client.limit.throttled for c in ctxs),
           "timed_out_requests": sum(c.client.timed_out for c in ctxs),
           "smallest_window": min(c.client.limit.smallest for c in ctxs),
           "batch_scoring": ctx.client.batch_scoring, "concurrency": concurrency,
           "items_by_url": by_url}
    return stores, run


def write_reports(probes: Sequence[Probe], items: list[Item], stores: dict[str, Store],
                  cfg: Config, out: Path) -> dict:
    """report.json, report.md and figures from the stored results (data order). Without
    matplotlib (the `probes` extra alone) the figures are left out and report.md says so."""
    try:
        import matplotlib
    except ImportError:
        matplotlib = None
    else:
        matplotlib.use("Agg")
    report: dict[str, Any] = {"meta": {"data": cfg.data, "items": len(items),
                                       "deployment": cfg.deployment, "seed": cfg.seed}}
    md, figs = [], []
    for p in probes:
        recs = [stores[p.NAME].done[it.id] for it in items if it.id in stores[p.NAME].done]
        section = clean(p.summarise(recs, cfg))
        report[p.NAME] = section
        md.append(p.markdown(section))
        if matplotlib is not None:
            figs += p.figures(recs, section, out)
    if len(probes) > 1:
        from clients.probes.summary import summary

        page = summary(report)
        (out / "summary.md").write_text(page)
        md.insert(0, page)
    (out / "report.json").write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    body = "\n\n".join(md) + "\n\n" + "\n".join(f"![{Path(f).stem}]({Path(f).name})"
                                                for f in figs) + "\n"
    if matplotlib is None:
        body += "\n(No figures: they need matplotlib, e.g. pip install \"dualread[server]\".)\n"
    (out / "report.md").write_text(body)
    return report


async def deployment(client: AsyncDualReadClient, url: str) -> dict:
    """Which actor and heads answer at `url` (results from another deployment never mix)."""
    try:
        m = await client.models()
        return {"actor": m["actor"]["fingerprint"], "heads": m["heads"]["id"]}
    except Exception:   # a deployment without /v1/models: key results by its address
        return {"url": url}


def same_deployment(found: Sequence[dict], urls: Sequence[str]) -> dict:
    """The one deployment behind every endpoint of a sharded run; endpoints that serve
    different actors or heads would mix results, so they are refused."""
    if len(found) == 1:
        return found[0]
    if any("url" in d for d in found):     # one cannot be identified: key by all addresses
        return {"url": sorted(urls)}
    if any(d != found[0] for d in found):
        raise ValueError("the endpoints serve different actors or heads: " + "; ".join(
            f"{u}: {d['actor']}/{d['heads']}" for u, d in zip(urls, found)))
    return found[0]


def run(names: Sequence[str], url: str | Sequence[str], data: str, out: Path,
        limit: int | None = None, concurrency: int = 16, api_key: str | None = None,
        seed: int = 0, bootstrap: int = 1000, max_new_tokens: int | None = None,
        progress: bool = True, items: list[Item] | None = None,
        deadline_s: float | None = DEADLINE_S, command: str = "") -> dict:
    """Run probes `names` against the service at `url`, or split the items across several
    endpoints of one deployment; returns report.json's content. `command`: the command
    line that ran it, recorded in `run.json`.

    A 429 is backpressure: each endpoint's client narrows its window of requests in flight
    (AIMD, `clients.http.AdaptiveLimit`) and retries, honouring `Retry-After`, until
    `deadline_s` seconds after the start (None: a fixed number of retries, as for any
    other caller)."""
    from clients.probes import PROBES
    from models.data import load, sample

    unknown = [n for n in names if n not in PROBES]
    if unknown:
        raise ValueError(f"unknown probe {unknown}; choose from {', '.join(PROBES)} or all")
    probes = [PROBES[n] for n in names]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pool = items if items is not None else load(data)
    chosen = sample(pool, limit, seed)
    cfg = Config(data=data, seed=seed, bootstrap=bootstrap, max_new_tokens=max_new_tokens)

    urls = [url] if isinstance(url, str) else list(url)

    async def go() -> tuple[dict[str, Store], dict]:
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        clients = [AsyncDualReadClient(u, api_key, concurrency=concurrency, deadline=deadline)
                   for u in urls]
        try:
            found = [await deployment(c, u) for c, u in zip(clients, urls)]
            cfg.deployment = same_deployment(found, urls)
            ctx = Context(clients[0], pool, cfg)
            if "ccg" in names:
                ctx.assign_donors(chosen)
            # the other endpoints' contexts share the data, donors and config
            ctxs = [ctx] + [copy.copy(ctx) for _ in clients[1:]]
            for c, client in zip(ctxs, clients):
                c.client = client
            return await _run(probes, chosen, ctxs, out, concurrency, progress)
        finally:
            for c in clients:
                await c.aclose()

    stores, info = asyncio.run(go())
    report = write_reports(probes, chosen, stores, cfg, out)
    info.update({"command": command, "probes": list(names),
                 "url": url if isinstance(url, str) else urls,
                 "data": data, "limit": limit,
                 "config": clean(asdict(cfg))})
    (out / "run.json").write_text(json.dumps(info, indent=1) + "\n")
    if info["failures"]:
        report["failures"] = info["failures"]
    return report


