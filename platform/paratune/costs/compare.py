"""Which cluster to train on: the arithmetic of time, GPU-hours and cost to train N tokens per cluster.

Pure functions, no torch, no cost model run here (paratune.commands.compare runs it per cluster):
- `parse_clusters`: `--compare h100-80gb:8,a100-80gb:16` -> Cluster (device x GPU count, as nodes x
  the device table's gpus per node); a count above one node must be whole nodes;
- `load_prices`: the user's prices file, `{currency: USD, <device>: <price per GPU-hour>}`;
- `prediction_band`: the cost model's relative error on a plan's tokens/s/GPU (paratune.costs.bands' per
  plan kind, from the published corpus; the roofline's prior without one);
- `Outcome` (a cluster's best plan and runner-up, or why none fits) -> `rank`: rows with the time
  to train, GPU-hours, cost, cost per billion tokens, the time-versus-cost Pareto front and the ties
  the band cannot separate, fastest first;
- `with_measured`: a sweep's measured winner in place of its cluster's prediction, the same
  device's other clusters scaled by measured / predicted;
- `smallest_fitting`: the smallest GPU count (of a list) at which a check passes, few checks.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

MAX_NODES = 64  # how far `smallest_fitting` looks for a cluster that fits (whole nodes of a device)


# --------------------------------------------------------------------------- clusters
@dataclass(frozen=True)
class Cluster:
    """`gpus` GPUs of one device-table entry; `gpus_per_node`: the table's node size, or the count
    itself where it is less (part of one node)."""

    device: str
    gpus: int
    gpus_per_node: int

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    @property
    def label(self) -> str:
        return f"{self.device}:{self.gpus}"

    @property
    def layout(self) -> str:
        return f"{self.nodes} x {self.gpus_per_node}"


def closest_name(name: str, names: Iterable[str]) -> str | None:
    """The known name nearest to `name`: one it starts (h100 -> h100-80gb), else difflib's closest."""
    names = sorted(names)
    starting = [n for n in names if n.startswith(name.lower())]
    if starting:
        return starting[0]
    close = difflib.get_close_matches(name.lower(), names, n=1, cutoff=0.4)
    return close[0] if close else None


def cluster_for(device: str, gpus: int, node_size: int) -> Cluster:
    """Cluster of `gpus` GPUs of a device whose nodes hold `node_size`; a ValueError (what is
    allowed) where the count is not whole nodes."""
    if gpus > node_size and gpus % node_size:
        below, above = gpus // node_size * node_size, -(-gpus // node_size) * node_size
        raise ValueError(f"--compare: {device}:{gpus}: {gpus} GPUs are not whole nodes of {device} "
                         f"({node_size} GPUs per node in the device table); allowed: up to {node_size} (one node) "
                         f"or a multiple of {node_size}, e.g. {below} or {above} (--devices FILE changes gpus_per_node)")
    return Cluster(device, gpus, min(gpus, node_size))


def parse_clusters(text: str, node_sizes: dict[str, int]) -> list[Cluster]:
    """`DEVICE:GPUS,DEVICE:GPUS,...` against the device table (`node_sizes`: name -> gpus per node).
    Every error names the item, what is wrong and what is allowed (an unknown device: the closest)."""
    items = [t.strip() for t in (text or "").split(",") if t.strip()]
    if not items:
        raise ValueError(f"--compare: got {text!r}; allowed: DEVICE:GPUS[,DEVICE:GPUS...], e.g. "
                         "h100-80gb:8,a100-80gb:16")
    clusters: list[Cluster] = []
    for item in items:
        device, sep, count = item.rpartition(":")
        if not sep or not device:
            raise ValueError(f"--compare: got {item!r}; allowed: DEVICE:GPUS, e.g. h100-80gb:8 (devices: "
                             f"{', '.join(sorted(node_sizes))})")
        if device not in node_sizes:
            near = closest_name(device, node_sizes)
            raise ValueError(f"--compare: device {device!r} (in {item!r}) is not in the device table"
                             + (f"; closest: {near}" if near else "")
                             + f"; allowed: {', '.join(sorted(node_sizes))} (or add it with --devices FILE)")
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"--compare: {item!r}: GPU count {count!r}; allowed: a whole number >= 1")
        cluster = cluster_for(device, int(count), node_sizes[device])
        if cluster not in clusters:
            clusters.append(cluster)
    return clusters


# --------------------------------------------------------------------------- prices
@dataclass(frozen=True)
class Prices:
    """Price per GPU-hour by device, in one currency, as the user wrote them (no network)."""

    currency: str
    per_gpu_hour: dict[str, float]
    source: str = ""


def load_prices(path: str | Path, devices: Iterable[str]) -> Prices:
    """A YAML (or JSON) mapping: `currency: USD` and `<device>: <price per GPU-hour>` for devices of
    the table. A wrong field is a ValueError naming the file, the field, its value and what is allowed."""
    import yaml

    path, devices = Path(path), sorted(devices)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as err:
        raise ValueError(f"--prices: cannot read {path} ({err.strerror or err})") from None
    except yaml.YAMLError as err:
        raise ValueError(f"--prices: {path} is not YAML ({str(err).splitlines()[0]})") from None
    example = "allowed: a mapping such as {currency: USD, h100-80gb: 2.49, a100-80gb: 1.29} (price per GPU-hour)"
    if not isinstance(data, dict):
        raise ValueError(f"--prices: {path}: got {data!r}; {example}")
    currency = data.get("currency")
    if not isinstance(currency, str) or not currency.strip() or len(currency.strip()) > 12:
        raise ValueError(f"--prices: {path}: currency: got {currency!r}; allowed: a short name such as USD, EUR "
                         "or credits (required: every price is in it)")
    prices: dict[str, float] = {}
    for name, value in data.items():
        if name == "currency":
            continue
        if str(name) not in devices:
            near = closest_name(str(name), devices)
            raise ValueError(f"--prices: {path}: {name!r} is not a device of the table"
                             + (f" (closest: {near})" if near else "") + f"; allowed: currency, {', '.join(devices)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"--prices: {path}: {name}: got {value!r}; allowed: a price per GPU-hour > 0, "
                             f"in {currency.strip()}")
        prices[str(name)] = float(value)
    return Prices(currency.strip(), prices, str(path))


def missing_prices(clusters: Sequence[Cluster], prices: Prices) -> str | None:
    """Why the prices cannot cost every cluster (a device without a price), or None."""
    missing = sorted({c.device for c in clusters} - set(prices.per_gpu_hour))
    if not missing:
        return None
    return (f"--prices: {prices.source}: no price for {', '.join(missing)} (a device of --compare); allowed: add "
            f"`{missing[0]}: <price per GPU-hour in {prices.currency}>`")


# --------------------------------------------------------------------------- the band
def prediction_band(estimate: Any = None) -> float:
    """The relative error band of a predicted tokens/s/GPU: the estimate's own (`Estimate.band`,
    set by paratune.costs.estimate.estimate from paratune.costs.bands.prediction_band: on a GPU the published
    corpus's 80th percentile of |error| for plans of its kind, bench/results/published.md; on the
    CPU entry the CPU benchmarks'); without an estimate or its band, the roofline's stated prior
    (paratune.costs.predict.RooflinePredictor.PRIOR_BAND: 25%)."""
    band = getattr(getattr(estimate, "band", None), "tokens", None)
    if band is not None and band == band:  # not NaN
        return float(band)
    from paratune.costs.predict import RooflinePredictor

    return RooflinePredictor.PRIOR_BAND


def tie(a: float, b: float, band_a: float, band_b: float) -> bool:
    """Two rates the bands cannot separate: their intervals a(1 ± band_a), b(1 ± band_b) overlap
    (the sweep verdict's rule: within band(a) + band(b) of each other)."""
    high, low = (a, b) if a >= b else (b, a)
    band_high, band_low = (band_a, band_b) if a >= b else (band_b, band_a)
    return high * (1 - band_high) <= low * (1 + band_low)


# --------------------------------------------------------------------------- arithmetic
def tokens_label(tokens: float) -> str:
    """1e11 -> '100B', 2.5e12 -> '2.5T', as people say a training's size."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if tokens >= scale:
            return f"{tokens / scale:.3g}{unit}"
    return f"{tokens:,.0f}"


def hours_to_train(tokens: float, tokens_per_s_per_gpu: float, gpus: int) -> float:
    return tokens / (tokens_per_s_per_gpu * gpus) / 3600.0


def gpu_hours(tokens: float, tokens_per_s_per_gpu: float) -> float:
    """GPU-hours to train `tokens`: the same at any GPU count for the same tokens/s/GPU."""
    return tokens / tokens_per_s_per_gpu / 3600.0


def pareto_front(times: Sequence[float | None], costs: Sequence[float | None]) -> list[bool]:
    """Which points no other beats: at most the time and at most the cost, and less in one.
    A point without both numbers is never on it."""
    known = [t is not None and c is not None for t, c in zip(times, costs)]
    front = []
    for i, (t, c) in enumerate(zip(times, costs)):
        if not known[i]:
            front.append(False)
            continue
        front.append(not any(known[j] and times[j] <= t and costs[j] <= c and (times[j] < t or costs[j] < c)
                             for j in range(len(times)) if j != i))
    return front


@dataclass
class Outcome:
    """What the cost model says of one cluster: its best plan that fits and the runner-up of
    another strategy, or why nothing fits. `source`: predicted, measured (a sweep's winner) or
    scaled (predicted x the device's measured / predicted)."""

    cluster: Cluster
    tokens_per_s_per_gpu: float | None = None
    band: float = 0.0
    best: str | None = None
    best_strategy: str | None = None
    peak_gib: float | None = None
    runner_up: str | None = None
    runner_up_tokens_per_s_per_gpu: float | None = None
    plans: int = 0  # valid plans of the space at this count
    fitting: int = 0
    reason: str | None = None  # why no plan fits (or the count cannot keep the global batch)
    smallest_fit: int | None = None  # the smallest count of this device that would fit, if searched and found
    source: str = "predicted"

    @property
    def fits(self) -> bool:
        return self.tokens_per_s_per_gpu is not None

    @property
    def runner_up_ties(self) -> bool:
        return (self.runner_up_tokens_per_s_per_gpu is not None
                and tie(self.tokens_per_s_per_gpu, self.runner_up_tokens_per_s_per_gpu, self.band, self.band))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Outcome":
        return cls(**{**data, "cluster": Cluster(**data["cluster"])})


@dataclass
class Row:
    """A cluster's line of the comparison: its outcome and what training `tokens` on it takes."""

    outcome: Outcome
    hours: float | None = None
    hours_low: float | None = None  # the band's: tokens/s/GPU x (1 + band)
    hours_high: float | None = None  # tokens/s/GPU x (1 - band)
    gpu_hours: float | None = None
    price: float | None = None  # per GPU-hour
    cost: float | None = None
    cost_per_billion: float | None = None
    pareto: bool = False
    tie_with_fastest: bool = False
    fastest: bool = False
    notes: list[str] = field(default_factory=list)


def rank(outcomes: Sequence[Outcome], tokens: float, prices: Prices | None = None) -> list[Row]:
    """Rows fastest first (then those that fit nowhere): time to train, GPU-hours, cost (with
    prices), the Pareto front of time against cost (GPU-hours without prices: as if every GPU-hour
    cost the same) and the clusters tied with the fastest by the band."""
    if not (isinstance(tokens, (int, float)) and math.isfinite(tokens) and tokens > 0):
        raise ValueError(f"--tokens: got {tokens!r}; allowed: a number of tokens > 0, e.g. 1e11")
    rows = []
    for o in outcomes:
        row = Row(o)
        if o.fits:
            gpus = o.cluster.gpus
            row.hours = hours_to_train(tokens, o.tokens_per_s_per_gpu, gpus)
            row.hours_low = hours_to_train(tokens, o.tokens_per_s_per_gpu * (1 + o.band), gpus)
            row.hours_high = hours_to_train(tokens, o.tokens_per_s_per_gpu * max(1 - o.band, 1e-9), gpus)
            row.gpu_hours = gpu_hours(tokens, o.tokens_per_s_per_gpu)
            if prices is not None and o.cluster.device in prices.per_gpu_hour:
                row.price = prices.per_gpu_hour[o.cluster.device]
                row.cost = row.gpu_hours * row.price
                row.cost_per_billion = row.cost / (tokens / 1e9)
        rows.append(row)
    rows.sort(key=lambda r: (r.hours is None, r.hours if r.hours is not None else 0.0))
    spend = [r.cost for r in rows] if prices is not None else [r.gpu_hours for r in rows]
    for r, on_front in zip(rows, pareto_front([r.hours for r in rows], spend)):
        r.pareto = on_front
    if rows and rows[0].hours is not None:
        best = rows[0]
        best.fastest = True
        for r in rows[1:]:  # the time intervals overlap: the rates' do
            r.tie_with_fastest = r.hours is not None and tie(
                best.outcome.tokens_per_s_per_gpu * best.outcome.cluster.gpus,
                r.outcome.tokens_per_s_per_gpu * r.outcome.cluster.gpus, best.outcome.band, r.outcome.band)
    return rows


def with_measured(outcomes: Sequence[Outcome], device: str, gpus: int, measured: float, label: str | None = None
                  ) -> tuple[list[Outcome], float | None]:
    """A sweep measured `measured` tokens/s/GPU (its winner, plan `label`) on `device` x `gpus`:
    that cluster's prediction is replaced by it (band 0: a measurement, its noise aside), and the
    same device's other clusters (and every runner-up of the device) are scaled by measured / that
    cluster's predicted best; other devices stay predicted. Returns the outcomes and the ratio
    (None: the sweep's cluster is not among them, or fits nowhere there: nothing changes)."""
    here = next((o for o in outcomes if o.cluster.device == device and o.cluster.gpus == gpus and o.fits), None)
    if here is None or not measured or measured <= 0:
        return list(outcomes), None
    ratio = measured / here.tokens_per_s_per_gpu
    out = []
    for o in outcomes:
        if o.cluster.device != device or not o.fits:
            out.append(o)
            continue
        runner_up = o.runner_up_tokens_per_s_per_gpu * ratio if o.runner_up_tokens_per_s_per_gpu else None
        if o is here:
            out.append(replace(o, tokens_per_s_per_gpu=measured, band=0.0, source="measured", best=label or o.best,
                               runner_up_tokens_per_s_per_gpu=runner_up))
        else:
            out.append(replace(o, tokens_per_s_per_gpu=o.tokens_per_s_per_gpu * ratio, source="scaled",
                               runner_up_tokens_per_s_per_gpu=runner_up))
    return out, ratio


# --------------------------------------------------------------------------- compare.json
def to_document(outcomes: Sequence[Outcome], tokens: float, prices: Prices | None, **facts: Any) -> dict[str, Any]:
    """What `plan --compare` writes to <out>/compare.json (the sweep report reads it back)."""
    return {"tokens": tokens, "outcomes": [o.to_dict() for o in outcomes],
            "prices": asdict(prices) if prices is not None else None, **facts}


def from_document(data: dict[str, Any]) -> tuple[list[Outcome], float, Prices | None]:
    """compare.json read back: the outcomes, the tokens to train and the prices (or None)."""
    prices = data.get("prices")
    return ([Outcome.from_dict(o) for o in data["outcomes"]], float(data["tokens"]),
            Prices(**prices) if isinstance(prices, dict) else None)


# --------------------------------------------------------------------------- the smallest that fits
def whole_node_counts(start: int, node_size: int, max_nodes: int = MAX_NODES) -> list[int]:
    """The counts above `start` a device comes in: doublings of a part of a node up to one node,
    then whole nodes up to `max_nodes`."""
    counts = set()
    c = start * 2
    while c < node_size:
        counts.add(c)
        c *= 2
    counts.update(k * node_size for k in range(1, max_nodes + 1))
    return sorted(c for c in counts if c > start)


def smallest_fitting(counts: Sequence[int], fits: Callable[[int], bool]) -> int | None:
    """The smallest of `counts` (ascending) for which `fits` holds, asking few: galloping (1st, 2nd,
    4th, 8th, ...) to the first that fits, then every count between it and the last that did not,
    smallest first. Exact where fitting is monotone in the count; where it is not (a count that
    cannot split the global batch), the smallest found by this walk."""
    if not counts:
        return None
    last_fail, i, step = -1, 0, 1
    while not fits(counts[i]):
        last_fail = i
        if i == len(counts) - 1:
            return None
        i, step = min(i + step, len(counts) - 1), step * 2
    return next((counts[j] for j in range(last_fail + 1, i) if fits(counts[j])), counts[i])
