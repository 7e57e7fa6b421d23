"""Leave-one-kind-out choice of settings, and the issue-74 rule for keeping a heuristic, on a table of reductions.

The figure reported for a domain comes from a setting chosen without any domain of its kind: for a domain of kind K,
each candidate setting is scored by its median reduction over the domains of the other kinds, and the best one's
reduction on the domain is reported. Reductions are 1 − perplexity / zero-shot perplexity (0.10: 10% lower).

Tie-break: a higher median wins; medians within TIE of each other are split by the higher worst reduction over the
same domains (again beyond TIE), then by the order the settings are given in (put the shipped default first: a tie
keeps it). TIE is what one solve reads as in two runs: settings whose solves are the same at a point (the untuned
step's ramp is off past 4K positions) must tie there, whichever run measured them.

`heuristic_pays` is the rule a constant or mechanism must pass to stay (lab/README.md, "What stays in the default"):
with it on, under leave-one-kind-out among the settings that have it on, the suite's median reduction is at least
MEDIAN_GAIN higher than with it off (among the settings that have it off), or its worst domain's at least WORST_GAIN
higher, and no domain ends worse than zero-shot by more than FLOOR (at the final point and, given, at every curve
point). Pure Python: no torch, so scripts and tests read records with it cheaply.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

# Reductions, as fractions: 0.005 is half a percentage point.
MEDIAN_GAIN = 0.005
WORST_GAIN = 0.01
FLOOR = 0.003  # a perplexity above zero-shot × 1.003 hurts
# Reductions within TIE are one result: the same solve read in two runs of the suite (float sums in another order, on
# another CPU) differed by up to 6.4e-7 on 25 domains; 1e-5 is a thousandth of a percentage point.
TIE = 1e-5

#: {domain: {setting: reduction}}
Table = Mapping[str, Mapping[str, float]]


@dataclass(frozen=True)
class Choice:
    """One domain's figure: the setting chosen on the other kinds, its reduction here, and its share of LoRA's."""

    domain: str
    kind: str
    setting: str
    reduction: float
    score: float  # the setting's median reduction over the other kinds' domains
    own_best: str  # the setting best on this domain itself (never used to choose; for the report)
    lora: float | None = None
    share: float | None = None  # reduction / LoRA's, where LoRA reduces perplexity


@dataclass
class Report:
    """The leave-one-kind-out figures: per domain (`choices`), per kind and over the suite."""

    choices: list[Choice]
    kinds: dict[str, dict] = field(default_factory=dict)
    median: float = 0.0
    worst: float = 0.0
    worst_domain: str = ""
    share_median: float | None = None
    worst_kind_share: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _settings_order(table: Table, settings: Sequence[str] | None) -> list[str]:
    if settings is not None:
        return list(settings)
    return list(dict.fromkeys(s for row in table.values() for s in row))


def _check(table: Table, kinds: Mapping[str, str]) -> None:
    missing = [d for d in table if d not in kinds]
    if missing:
        raise ValueError(f"kinds: expected a kind for every domain of the table, missing {missing}")
    if len({kinds[d] for d in table}) < 2:
        found = sorted({kinds[d] for d in table})
        raise ValueError(f"table: leave-one-kind-out needs domains of at least two kinds, got {found}")


def _beats(key: tuple[float, float, int], best: tuple[float, float, int]) -> bool:
    """Whether (median, worst, −order) `key` beats `best`: the median beyond TIE, then the worst beyond TIE, then the
    earlier setting."""
    for mine, theirs in zip(key[:2], best[:2], strict=True):
        if abs(mine - theirs) > TIE:
            return mine > theirs
    return key[2] > best[2]


def choose_setting(table: Table, kinds: Mapping[str, str], domain: str,
                   settings: Sequence[str] | None = None) -> tuple[str, float]:  # fmt: skip
    """(setting, its median reduction over the other kinds' domains) for `domain`: the best of the settings measured
    on the domain and on every domain of another kind (tie-break in the module docstring). No domain of the domain's
    kind, the domain itself included, is read."""
    _check(table, kinds)
    if domain not in table:
        raise ValueError(f"domain: expected one of the table's domains {sorted(table)}, got {domain!r}")
    others = [d for d in table if kinds[d] != kinds[domain]]
    best: tuple[float, float, int] | None = None
    chosen = ""
    for i, s in enumerate(_settings_order(table, settings)):
        if s not in table[domain] or any(s not in table[d] for d in others):
            continue
        values = [table[d][s] for d in others]
        key = (statistics.median(values), min(values), -i)
        if best is None or _beats(key, best):
            best, chosen = key, s
    if best is None:
        raise ValueError(f"table: no setting is measured on {domain!r} and on every domain of the other kinds")
    return chosen, best[0]


def best_on_itself(row: Mapping[str, float], order: Sequence[str]) -> str:
    """The setting of `order` with the highest reduction in `row` (one domain's), the earliest of those within TIE of
    it: the same solve read in two runs is one result, so a tie names the setting given first (the default)."""
    measured = [s for s in order if s in row]
    top = max(row[s] for s in measured)
    return next(s for s in measured if row[s] >= top - TIE)


def loko(table: Table, kinds: Mapping[str, str], lora: Mapping[str, float] | None = None,
         settings: Sequence[str] | None = None) -> Report:  # fmt: skip
    """Leave-one-kind-out over `table`: each domain's reduction under the setting chosen on the other kinds; per kind
    and over the suite the median and the worst (lowest) reduction; with `lora` ({domain: one LoRA epoch's
    reduction}), each domain's share of it (where LoRA reduces perplexity), the median share per kind and over the
    suite, and the worst kind's median share."""
    lora = lora or {}
    choices = []
    for domain in table:
        setting, score = choose_setting(table, kinds, domain, settings)
        own = best_on_itself(table[domain], _settings_order(table, settings))
        peer = lora.get(domain)
        reduction = table[domain][setting]
        share = reduction / peer if peer is not None and peer > 0 else None
        choices.append(Choice(domain, kinds[domain], setting, reduction, score, own, peer, share))
    report = Report(choices)
    for kind in dict.fromkeys(c.kind for c in choices):
        mine = [c for c in choices if c.kind == kind]
        shares = [c.share for c in mine if c.share is not None]
        report.kinds[kind] = {"domains": [c.domain for c in mine],
                              "median": statistics.median(c.reduction for c in mine),
                              "worst": min(c.reduction for c in mine),
                              "share_median": statistics.median(shares) if shares else None}  # fmt: skip
    report.median = statistics.median(c.reduction for c in choices)
    worst = min(choices, key=lambda c: c.reduction)
    report.worst, report.worst_domain = worst.reduction, worst.domain
    shares = [c.share for c in choices if c.share is not None]
    report.share_median = statistics.median(shares) if shares else None
    kind_shares = [k["share_median"] for k in report.kinds.values() if k["share_median"] is not None]
    report.worst_kind_share = min(kind_shares) if kind_shares else None
    return report


@dataclass(frozen=True)
class Verdict:
    """Whether a mechanism pays under leave-one-kind-out, and the numbers that decided it."""

    pays: bool
    median_gain: float  # suite median with it on − with it off
    worst_gain: float  # worst domain's reduction with it on − with it off
    floor_ok: bool  # it makes no domain (no curve point) worse than zero-shot by more than FLOOR
    worst_point: tuple[str, float]  # (domain, reduction) of the lowest point with it on
    reason: str


def heuristic_pays(
    table: Table,
    kinds: Mapping[str, str],
    on: Sequence[str],
    off: Sequence[str],
    curve: Mapping[str, Mapping[str, Sequence[float]]] | None = None,
) -> Verdict:
    """The issue's rule for keeping a mechanism: leave-one-kind-out among the settings `on` (mechanism on) and among
    `off` (the same without it); it pays when the suite's median rises by at least MEDIAN_GAIN or its worst domain by
    at least WORST_GAIN, and it makes no domain more than 0.3% worse than zero-shot: no domain's chosen setting with it
    reduces perplexity by less than −FLOOR where the chosen one without it stays within that floor, at the final point
    nor at any point of `curve` ({domain: {setting: reductions at the curve points}}) when given. A domain past the
    floor without it as well is not the mechanism's doing (the issue's "without making any domain worse than
    zero-shot + 0.3%"): the default's own failure there is reported as the suite's floor goal."""
    if not on or not off or set(on) & set(off):
        raise ValueError(f"on, off: expected two disjoint non-empty lists of settings, got {list(on)} and {list(off)}")
    with_it = loko({d: {s: r for s, r in row.items() if s in on} for d, row in table.items()}, kinds, settings=on)
    without = loko({d: {s: r for s, r in row.items() if s in off} for d, row in table.items()}, kinds, settings=off)
    off_choice = {c.domain: c for c in without.choices}
    points, made = [(c.domain, c.reduction) for c in with_it.choices], []
    for c in with_it.choices:
        alt = off_choice[c.domain]
        ours = [c.reduction, *((curve or {}).get(c.domain) or {}).get(c.setting, ())]
        theirs = [alt.reduction, *((curve or {}).get(c.domain) or {}).get(alt.setting, ())]
        points += [(c.domain, r) for r in ours[1:]]
        # past the floor with it, and within it (or not measured) without it at the same point: it made the domain so
        made += [(c.domain, r) for i, r in enumerate(ours) if r < -FLOOR and (i >= len(theirs) or theirs[i] >= -FLOOR)]
    lowest = min(points, key=lambda p: p[1])
    floor_ok = not made
    median_gain, worst_gain = with_it.median - without.median, with_it.worst - without.worst
    gains = median_gain >= MEDIAN_GAIN or worst_gain >= WORST_GAIN
    words = (f"median {100 * median_gain:+.2f} points, worst {100 * worst_gain:+.2f} points; lowest point "
             f"{100 * lowest[1]:+.2f}% ({lowest[0]})")  # fmt: skip
    if not floor_ok:
        reason = f"breaks the floor (a domain more than {100 * FLOOR:g}% worse than zero-shot): {words}"
    elif not gains:
        reason = f"gains too little (needs median +{100 * MEDIAN_GAIN:g} or worst +{100 * WORST_GAIN:g}): {words}"
    else:
        reason = f"pays: {words}"
    return Verdict(floor_ok and gains, median_gain, worst_gain, floor_ok, lowest, reason)
