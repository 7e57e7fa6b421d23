"""The domain suite's report: lm_suite's shard records merged, each domain's figure chosen by leave-one-kind-out
(faast_lab.experiments.loko), written as one record (<stem>.json) and its Markdown (<stem>.md).

    python -m faast_lab.experiments.lm_suite_report SHARD_DIR [SHARD_DIR ...] \
        --out lab/experiments/results/lm_suite_cpu

Several folders may hold shards of one domain: a run of the default with its peers, and a run of more settings
without peers (the same suite, tokens and windows; a setting's name means one setting everywhere). A domain's shards
are joined into one: their settings side by side, each peer from the one that ran it (one LoRA epoch in one run,
the tuned peers in another). A peer run again in a newer shard (by its provenance date) supersedes the older run's
rows, and FAAST's time beside them, listed in `superseded_peers`; two runs of a peer at one date are refused. A
setting in two shards (the default run again beside its ablations or the tuned peers) must have read the same
perplexities in both, which shows the runs compare.

A setting's name means the newest run's setting of that name: where a shard's setting differs from the one the
newest shard (by its provenance date) ran under that name (the default changed since), that shard's copy is
superseded: left out of every table, and listed in `superseded`. A domain left with no setting is listed in
`left_out` (run it again). FAAST's time beside the peers stays that of the peers' run, superseded or not: a time
ratio always comes from one run.

A mechanism removed from faast leaves its fields (faast.hf.output.REMOVED_FIELDS) in the policies of the shards run
before: those fields are not part of what a setting means (`today`). Where the mechanism never changed a solve of a
shard (two of its settings that differ only in its fields read the same perplexities), every setting of the shard
reads as today's. Where it acted (`acted_mechanisms`), only the settings that had it off (its fields at REMOVED_OFF)
were solved as today's would be: they stay, under the name that means their setting today (the removed ramp's "off"
setting is today's default, `current_name`), and the others are left out, listed in `superseded` with the reason. A
shard a removed mechanism left with no setting gives its domain its peers and FAAST's time beside them where no other
run of the domain has the same peers; else it is only listed (the peers would clash). Where the shard's peers were
timed against a setting a removed mechanism acted in, FAAST's time is that of the setting that became the default
where the shard holds it, else the timed setting's: the settings of a shard's group share one learning pass, and only
their solves differ, by a fraction of a second.

The name `default` means what faast ships: where a shard ran faast's shipped setting (by the fields it recorded,
`today`), under any name, that setting reads as `default` there, and a setting named `default` with other fields (an
earlier default) is superseded, wherever no newer run of that name is. A default changed in a field the solve alone
reads (lm_suite's SOLVE_TIME_FIELDS) then needs no run again: the candidate's runs beside the earlier default are its
runs. `--default FIELDS` gives the name back to an earlier default (its fields over the shipped ones), so a report
made while it shipped regenerates as it read.

`--settings` names the settings leave-one-kind-out chooses among (`only`): where the default changed, the runs of an
earlier default's ablations stay on disk, and are set aside, named, until they are run again around today's.

A setting that reads an exact cache (lab/experiments/lm_suite_cache.py) takes its pairs from a pass of its own:
where a domain chose one, FAAST's time beside the peers is scaled by that setting's learn + solve with the pass over
without it, both from its own run (`cache_facts`), and the report lists those domains' caches.

The merged record is what docs/results_sections.toml names (kind "lm_suite", scripts/results_formats.py): its
`loko` holds the per-domain choices, per-kind and suite medians and worst, and the shares of one LoRA epoch's
reduction; `domains` each domain's peers, times and lowest curve point; `goals` the issue's goals read off them;
`runs` names the run and machine of every shard (a sharded run may span machines: its times compare within a shard
only).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

from faast.hf.output import REMOVED_FIELDS
from faast_lab.experiments import loko
from faast_lab.experiments._common import ROOT, measured_by, table

DEFAULT = "default"  # lm_suite's name for the shipped settings (its --settings default)
LORA = "LoRA"  # the one-epoch LoRA row's name before " (" (lm_domains_peers.run_backprop)
LORA_TIME = "LoRA at FAAST's time"  # lm_domains_peers.run_lora_time
KNN_TUNED = "kNN-LM tuned"  # lm_domains_peers.run_knn_tuned
LORA_BEST = "LoRA-best"  # lm_domains_peers.run_lora_best
# What a domain's facts keep of a peer row: tuning_s and tuned (the choice) for the peers tuned on the held-out tail,
# faast_s FAAST's time in the peer's own run (_timed_peers).
PEER_FIELDS = ("method", "reduction", "learn_s", "tuning_s", "tuned", "faast_s")
# Shards of one domain must agree on these protocol fields to be joined; settings and peers may differ.
JOIN_FREE = ("settings", "peers")
# Two runs of one text and setting agree to this relative to their perplexity (the same model, windows and batches;
# the float sums' order differs between processes, and the kernels between machines: 8.3e-6 on perl-vendor's zero-shot
# between 2 AMD EPYC cores with AVX2 and 2 Intel Xeon cores with AVX-512). Another text, window or default moves it by
# 1e-3 or more.
ZERO_SHOT_REL = 1e-4
# The suite's goals (lab/README.md, "The report").
GOAL_SHARE, GOAL_WORST_KIND_SHARE, GOAL_TIME_RATIO = 0.8, 0.5, 0.5
# A superseded entry's "by" where no newer run but a removed mechanism's acting left a shard's settings out.
REMOVED_ACTED = "a mechanism since removed acted in this run"
# The value of a removed field (REMOVED_FIELDS) under which its mechanism was off: the held-out ends in folds with the
# one fit's step always taken, the token bias's ramp full from the first position. A removed mechanism names at least
# one such field; its other fields (the number of folds) did nothing while it was off.
REMOVED_OFF = {"fold_step_ratio": math.inf, "token_bias_full": 1}
# OutputPolicy fields added after the suite's first runs, at the value under which a run made before them solved: a
# shard that did not record one ran without its mechanism (the document folds).
ADDED_FIELDS = {"document_folds": 0, "document_folds_gate": False}


def peer_name(method: str) -> str:
    """A peer row's name before " (": 'LoRA (peft, r=8, 1 epoch)' -> 'LoRA'."""
    return method.split(" (")[0]


def _where(path: Path) -> str:
    """A shard's path as the record keeps it: from the repository's root when inside it, else its name alone (a
    scratch folder of this machine means nothing elsewhere)."""
    path = path.resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


def _peer_names(shard: dict) -> set[str]:
    return {peer_name(r["method"]) for r in shard.get("peers", [])}


def _timed_peers(shard: dict) -> list[dict]:
    """A shard's peer rows, each with FAAST's learn + solve time of its own run (`faast_s`: the setting that ran
    first), so that a peer's time is only ever compared with FAAST's in the same run."""
    return [{**r, "faast_s": shard.get("faast_s")} for r in shard.get("peers", [])]


def _join(domain: str, parts: Sequence[tuple[Path, dict]]) -> dict:
    """One domain's shards as one: the first's record, every part's settings, each peer from the part that ran it."""
    first_file, first = parts[0]
    joined = {**first, "settings": dict(first["settings"]), "peers": _timed_peers(first),
              "files": [_where(first_file)], "runs": [measured_by(first["provenance"])],
              "timed_setting": first.get("timed_setting"), "timed_superseded": first.get("timed_superseded", False),
              "faast_s": first.get("faast_s")}  # fmt: skip
    # Each peer's run (date, file): a peer run again in a newer shard supersedes the older run's rows.
    peer_from = dict.fromkeys(_peer_names(first), (first["provenance"]["date"], _where(first_file)))
    for f, s in parts[1:]:
        zero, have = s["zero_shot"]["ppl"], first["zero_shot"]["ppl"]
        if abs(zero - have) > ZERO_SHOT_REL * have:
            raise ValueError(f"{f}: {domain}'s zero-shot perplexity {zero} differs from {first_file.name}'s {have}: "
                             "not the same text, model or windows")  # fmt: skip
        # A setting measured again (the default beside its ablations) must read as it did: the two runs then compare.
        for name in set(s["settings"]) & set(joined["settings"]):
            again, have = s["settings"][name]["curve"]["ppl"], joined["settings"][name]["curve"]["ppl"]
            if len(again) != len(have) or any(
                abs(a - b) > ZERO_SHOT_REL * b for a, b in zip(again, have, strict=False)
            ):
                raise ValueError(f"{f}: {domain}'s setting {name!r} measured {again} along the curve where "
                                 f"{first_file.name} measured {have}: the runs do not compare (another commit or "
                                 "machine); run the settings again together")  # fmt: skip
        joined["settings"].update({k: v for k, v in s["settings"].items() if k not in joined["settings"]})
        joined["protocol"] = {**joined["protocol"],
                              "settings": {**joined["protocol"]["settings"], **s["protocol"]["settings"]}}  # fmt: skip
        if s.get("peers"):
            date, where = s["provenance"]["date"], _where(f)
            clash = _peer_names(s) & set(peer_from)
            if any(peer_from[n][0] == date for n in clash):
                raise ValueError(f"{f}: {domain}'s peers {sorted(clash)} also ran in another shard of "
                                 f"{[Path(x).name for x in joined['files']]} at the same time: no newer run says "
                                 "which to keep")  # fmt: skip
            newer = {n for n in clash if peer_from[n][0] < date}
            for old in sorted({peer_from[n][1] for n in newer}):
                gone = sorted(n for n in newer if peer_from[n][1] == old)
                joined["superseded_peers"] = [*joined.get("superseded_peers", []),
                                              {"file": old, "peers": gone, "by": where}]  # fmt: skip
            older = sorted(clash - newer)
            if older:
                by = sorted({peer_from[n][1] for n in older})
                joined["superseded_peers"] = [*joined.get("superseded_peers", []),
                                              {"file": where, "peers": older, "by": ", ".join(by)}]  # fmt: skip
            joined["peers"] = [r for r in joined["peers"] if peer_name(r["method"]) not in newer]
            rows = [r for r in _timed_peers(s) if peer_name(r["method"]) not in older]
            names = {peer_name(r["method"]) for r in rows}
            # FAAST's time over LoRA's is one run's: the shard with one LoRA epoch gives it, else the first with peers.
            if rows and (not joined["peers"] or LORA in names - _peer_names(joined)):
                joined["timed_setting"], joined["faast_s"] = s["timed_setting"], s["faast_s"]
                joined["timed_superseded"] = s.get("timed_superseded", False)
            joined["peers"] += rows
            peer_from.update(dict.fromkeys(names, (date, where)))
        joined["files"].append(_where(f))
        joined["runs"].append(measured_by(s["provenance"]))
        joined["superseded"] = joined.get("superseded", []) + s.get("superseded", [])
    return joined


def _without(setting: object, fields: object) -> object:
    """A setting's fields with `fields` left out of its policy."""
    if not isinstance(setting, dict) or not isinstance(setting.get("policy"), dict):
        return setting
    return {**setting, "policy": {k: v for k, v in setting["policy"].items() if k not in fields}}


def today(setting: object) -> object:
    """A setting's fields as they mean today: its policy without the fields of removed mechanisms (REMOVED_FIELDS),
    and with each field added since (ADDED_FIELDS) at the value that reproduces a run made before it, where the run
    did not record it."""
    setting = _without(setting, REMOVED_FIELDS)
    if not isinstance(setting, dict) or not isinstance(setting.get("policy"), dict):
        return setting
    return {**setting, "policy": {**ADDED_FIELDS, **setting["policy"]}}


def removed_mechanisms() -> dict[str, list[str]]:
    """{a removed mechanism's description (REMOVED_FIELDS' values): its fields}."""
    out: dict[str, list[str]] = {}
    for field, mechanism in REMOVED_FIELDS.items():
        out.setdefault(mechanism, []).append(field)
    return out


def acted_mechanisms(shard: dict) -> list[str]:
    """The removed mechanisms that changed a solve in `shard`: two of its settings that differ only in that
    mechanism's fields read different perplexities along the curve."""
    acted = []
    for mechanism, fields in removed_mechanisms().items():
        read: dict[str, list] = {}
        for name, setting in shard["protocol"]["settings"].items():
            if name in shard["settings"]:
                curve = shard["settings"][name]["curve"]["ppl"]
                if read.setdefault(json.dumps(_without(setting, fields), sort_keys=True), curve) != curve:
                    acted.append(mechanism)
                    break
    return acted


def solved_as_today(setting: object, acted: Sequence[str]) -> bool:
    """Whether `setting` had each of the `acted` mechanisms off (their fields at REMOVED_OFF, or absent)."""
    policy = setting.get("policy") if isinstance(setting, dict) else None
    policy = policy if isinstance(policy, dict) else {}
    fields = removed_mechanisms()
    return all(policy.get(f, REMOVED_OFF[f]) == REMOVED_OFF[f] for m in acted for f in fields[m] if f in REMOVED_OFF)


def current_name(setting: object, current: dict[str, tuple[object, Path, str]]) -> str | None:
    """The name that means `setting` today: of the names whose newest run (`_current_settings`) reads as it (`today`),
    the one run last, the default first at one date; None when no name means it now."""
    meaning = today(setting)
    names = [(date, n == DEFAULT, n) for n, (s, _, date) in current.items() if today(s) == meaning]
    return max(names)[2] if names else None


def shipped_setting(path: str = "float32", fields: dict | None = None) -> dict:
    """faast's shipped setting as lm_suite records a setting of no fields on `path` (its protocol's "path"); with
    `fields` (lm_suite's setting fields, over the shipped ones), that setting as lm_suite records it: an earlier
    default, such as {"policy": {"document_positions_per_dim": 6}}."""
    from faast_lab.experiments import lm_suite

    return lm_suite.setting_to_dict(lm_suite.setting_from_dict(DEFAULT, fields or {}, path))


def _current_settings(files: Sequence[Path], shards: Sequence[dict]) -> dict[str, tuple[object, Path, str]]:
    """{setting name: (its fields as the newest shard that ran it recorded them, that shard's file, its date)}: shards
    are ordered by their provenance dates (ISO 8601, one time zone: they order as strings)."""
    current: dict[str, tuple[object, Path, str]] = {}
    for f, s in zip(files, shards, strict=True):
        date = str(s["provenance"].get("date", ""))
        for name, setting in s["protocol"]["settings"].items():
            have = current.get(name)
            if have is None or date > have[2]:
                current[name] = (setting, f, date)
            elif date == have[2] and setting != have[0]:
                raise ValueError(f"{f}: its setting {name!r} differs from the one of that name in {have[1]}, run "
                                 "at the same time: no newer run says which one the name means")  # fmt: skip
    return current


def load_shards(paths: Sequence[Path], shipped: object = None, default: dict | None = None) -> list[dict]:
    """The shard records of `paths` (folders: their *.json), a domain's shards joined (module docstring), in the
    order the domains first appear; a domain whose every setting was superseded has none (`merge` leaves it out).
    The shards must share one suite manifest and one protocol but for settings and peers (a ValueError names the
    first file that does not). `shipped`: the fields `default` means where a shard ran them (default: faast's shipped
    setting on the shards' path, `shipped_setting`, or with `default`'s fields over it: an earlier default's report
    regenerated as it read then)."""
    files = [f for p in paths for f in (sorted(Path(p).glob("*.json")) if Path(p).is_dir() else [Path(p)])]
    shards = [json.loads(f.read_text(encoding="utf-8")) for f in files]
    if not shards:
        raise ValueError(f"paths: expected shard records (lm_suite's <domain>.json), found none in {list(paths)}")
    first = shards[0]

    def fixed(s: dict) -> dict:
        return {k: v for k, v in s.get("protocol", {}).items() if k not in JOIN_FREE}

    for f, s in zip(files, shards, strict=True):
        if s.get("suite") != first.get("suite") or fixed(s) != fixed(first):
            key = "suite" if s.get("suite") != first.get("suite") else "protocol"
            raise ValueError(f"{f}: its {key} differs from {files[0].name}'s: the shards are not one suite run")
    current = _current_settings(files, shards)
    path = str(first["protocol"].get("path", "float32"))
    meaning = today(shipped_setting(path, default) if shipped is None else shipped)
    ran = [(str(s["provenance"].get("date", "")), f) for f, s in zip(files, shards, strict=True)
           if any(today(x) == meaning for x in s["protocol"]["settings"].values())]  # fmt: skip
    newest = max(ran) if ran else None
    # faast's shipped setting ran, and no run of the default's name is newer: `default` means it
    shipped_ran = newest is not None and (DEFAULT not in current or current[DEFAULT][2] <= newest[0])
    if shipped_ran:
        current[DEFAULT] = (meaning, newest[1], newest[0])
    by_domain: dict[str, list[tuple[Path, dict]]] = {}
    spent_whole: set[Path] = set()
    for f, s in zip(files, shards, strict=True):
        timed = next(iter(s["settings"])) if s.get("peers") else None
        acted = acted_mechanisms(s)
        defined = s["protocol"]["settings"]
        # Where a removed mechanism acted, only the settings that had it off read as today's, each under today's name.
        spent = [n for n, x in defined.items() if acted and not solved_as_today(x, acted)]
        names = {n: DEFAULT if shipped_ran and today(x) == meaning else (current_name(x, current) or n) if acted else n
                 for n, x in defined.items() if n not in spent}  # fmt: skip
        gone = [n for n, x in defined.items() if n not in spent and today(x) != today(current[names[n]][0])]
        if len({names[n] for n in names if n not in gone}) < len(names) - len(gone):
            raise ValueError(f"{f}: two of its settings, {sorted(names)}, mean one setting today")
        by = {n: _where(current[names[n]][1]) for n in gone}
        kept = {n: names[n] for n in defined if n not in spent and n not in gone}
        # FAAST's time beside the peers stays the timed setting's, superseded by a newer run or not (one run gives a
        # ratio); where a removed mechanism acted in that setting, it is the default's of the same learning pass.
        faast_s = s["settings"][timed]["learn_s"] if timed else None
        timed_name = kept.get(timed, timed)
        same = next((n for n, new in kept.items() if new == DEFAULT), None)
        if timed in spent and same is not None:
            timed_name, faast_s = DEFAULT, s["settings"][same]["learn_s"]
        protocol = {**s["protocol"], "settings": {new: today(defined[n]) for n, new in kept.items()}}
        # where the timed setting itself was superseded, FAAST's time beside the peers is an earlier setting's: said
        timed_gone = timed is not None and timed_name not in kept.values()
        s = {**s, "timed_setting": timed_name, "timed_superseded": timed_gone, "faast_s": faast_s,
             "protocol": protocol, "settings": {new: s["settings"][n] for n, new in kept.items()}}  # fmt: skip
        if spent or gone:
            s["superseded"] = [{"file": _where(f), "setting": n, "by": by.get(n, REMOVED_ACTED)} for n in defined
                               if n in spent or n in gone]  # fmt: skip
        by_domain.setdefault(s["domain"], []).append((f, s))
        if acted and not kept:
            spent_whole.add(f)
    joined = []
    for d, parts in by_domain.items():
        # A shard left with no setting still gives its peers and FAAST's time beside them (module docstring), unless a
        # removed mechanism acted in it and another run of the domain has the same peers (they would clash): then, or
        # with no peers to give, it is only listed, beside the domain's other shards where there are any.
        ran = {f: _peer_names(s) for f, s in parts}
        alone = {f for f in ran if ran[f] and not any(ran[f] & ran[g] for g in ran if g != f)}
        kept_parts = [(f, s) for f, s in parts if f not in spent_whole or f in alone] or parts[:1]
        listed = [x for f, s in parts if not any(s is k for _, k in kept_parts) for x in s.get("superseded", [])]
        kept_parts[0] = (
            kept_parts[0][0],
            {**kept_parts[0][1], "superseded": kept_parts[0][1].get("superseded", []) + listed},
        )
        joined.append(_join(d, kept_parts))
    return joined


def only(shards: Sequence[dict], names: Sequence[str]) -> list[dict]:
    """The joined shards with only the settings `names` (each measured on some domain, else a ValueError naming it),
    the others listed in each shard's `set_aside` (the report names them): leave-one-kind-out then chooses among
    `names` alone, such as today's default and its ablations where older runs measured settings of an earlier
    default. Peers and FAAST's time beside them stay."""
    measured = {n for s in shards for n in s["settings"]}
    missing = [n for n in names if n not in measured]
    if missing:
        raise ValueError(f"settings: expected settings the shards measured {sorted(measured)}, got {missing}")
    kept = []
    for s in shards:
        keep = [n for n in s["settings"] if n in names]
        aside = [n for n in s["settings"] if n not in names]
        protocol = {**s["protocol"], "settings": {n: s["protocol"]["settings"][n] for n in keep}}
        kept.append({**s, "settings": {n: s["settings"][n] for n in keep}, "protocol": protocol,
                     "set_aside": s.get("set_aside", []) + aside})  # fmt: skip
    return kept


def tables(shards: Sequence[dict]) -> tuple[dict, dict, dict, dict]:
    """({domain: {setting: reduction}}, {domain: kind}, {domain: one LoRA epoch's reduction}, {domain: {setting:
    reductions along the curve}}) of the shards."""
    reductions, kinds, lora, curve = {}, {}, {}, {}
    for s in shards:
        name = s["domain"]
        reductions[name] = {k: r["reduction"] for k, r in s["settings"].items()}
        curve[name] = {k: r["curve"]["reduction"] for k, r in s["settings"].items()}
        kinds[name] = s["kind"]
        peer = next((r for r in s.get("peers", []) if peer_name(r["method"]) == LORA), None)
        if peer is not None:
            lora[name] = peer["reduction"]
    return reductions, kinds, lora, curve


def domain_facts(shard: dict, chosen: str) -> dict:
    """A domain's figures beside its reduction: the chosen setting's lowest curve point, every peer's reduction and
    time, and FAAST's learn + solve time (the setting LoRA at FAAST's time was given, measured in the peers' run)
    over one LoRA epoch's."""
    peers = {peer_name(r["method"]): {k: r[k] for k in PEER_FIELDS if k in r} for r in shard["peers"]}
    timed, faast_s = shard.get("timed_setting"), shard.get("faast_s")
    lora_s = (peers.get(LORA) or {}).get("learn_s")
    row = shard["settings"][chosen]
    points = row["curve"]
    cache = cache_facts(row)
    if cache is not None and faast_s:  # its pass of its own counts: FAAST's time beside the peers, scaled
        faast_s *= cache["time_factor"]
    return {"kind": shard["kind"], "zero_shot": shard["zero_shot"]["ppl"], "learned_tokens": shard["learned_tokens"],
            "scored_tokens": shard["scored_tokens"], "curve_tokens": points["tokens"],
            "curve": points["reduction"], "lowest_point": min(points["reduction"]), "peers": peers,
            "timed_setting": timed, "timed_superseded": bool(shard.get("timed_superseded")), "faast_s": faast_s,
            "lora_s": lora_s,
            "time_ratio": faast_s / lora_s if faast_s and lora_s else None, "files": shard["files"],
            "runs": shard["runs"], "cache": cache}  # fmt: skip


def cache_facts(row: dict) -> dict | None:
    """A cached setting's cache (lm_suite_cache; None for any other setting): its λ, T and k (a tuned cache's at the
    last point, λ 0 where it chose none), the pairs and bytes it held at the last point, and its time factor: its
    learn + solve with the pairs' own pass (and a tuned cache's tuning) over without them, both in its own run.
    FAAST's time beside the peers is scaled by it where the domain chose a cached setting."""
    cache = row.get("cache")
    if cache is None:
        return None
    without = row["learn_s"] - cache["build_s"] - cache.get("tune_s", 0.0)
    return {"lam": cache["lam"], "temperature": cache["temperature"], "k": cache["k"],
            "tuned": bool(cache.get("tune")), "pairs": row["cache_curve"]["pairs"][-1],
            "memory_bytes": row["memory_bytes"],
            "build_s": cache["build_s"], "time_factor": row["learn_s"] / without}  # fmt: skip


def _at_least(x: float | None, goal: float) -> bool | None:
    return None if x is None else x >= goal


def goals(report: loko.Report, domains: dict) -> dict:
    """The issue's goals read off the report: the median and worst kind's share of one LoRA epoch's reduction, learn
    + solve over LoRA's epoch time (every domain's, so the worst), and no curve point of a chosen setting worse than
    zero-shot by more than loko.FLOOR; each figure and each goal's `met` None where nothing measured it."""
    ratios = [d["time_ratio"] for d in domains.values() if d["time_ratio"] is not None]
    low = min(domains.items(), key=lambda kv: kv[1]["lowest_point"])
    return {"share_median": report.share_median, "share_goal": GOAL_SHARE,
            "worst_kind_share": report.worst_kind_share, "worst_kind_share_goal": GOAL_WORST_KIND_SHARE,
            "time_ratio_median": statistics.median(ratios) if ratios else None,
            "time_ratio_worst": max(ratios) if ratios else None, "time_ratio_goal": GOAL_TIME_RATIO,
            "lowest_point": low[1]["lowest_point"], "lowest_point_domain": low[0], "floor": -loko.FLOOR,
            "met": {"share": _at_least(report.share_median, GOAL_SHARE),
                    "worst_kind_share": _at_least(report.worst_kind_share, GOAL_WORST_KIND_SHARE),
                    "time": _at_least(-max(ratios), -GOAL_TIME_RATIO) if ratios else None,
                    "floor": low[1]["lowest_point"] >= -loko.FLOOR}}  # fmt: skip


def _peer_figures(peer: dict | None) -> dict | None:
    """A tuned peer's reduction, choice and time: its tuning plus its final training (or datastore) over FAAST's learn
    + solve in the same run."""
    if peer is None:
        return None
    spent = peer["learn_s"] + peer.get("tuning_s", 0.0)
    return {
        "reduction": peer["reduction"],
        "tuned": peer.get("tuned"),
        "learn_s": peer["learn_s"],
        "tuning_s": peer.get("tuning_s"),
        "time_ratio": spent / peer["faast_s"] if peer.get("faast_s") else None,
    }


def tuned_peers(report: loko.Report, domains: dict) -> dict:
    """The peers tuned on FAAST's held-out tail (the kNN-LM's λ and T, LoRA-best's lr and epochs) beside FAAST's
    figure (the setting chosen on the other kinds), on the domains where either ran: per domain each one's reduction,
    choice and time over FAAST's, and FAAST's share of LoRA-best's reduction (None where LoRA-best does not reduce
    perplexity); per peer, the medians over the domains it ran on, FAAST's over the same domains. Empty where none
    ran."""
    rows = {}
    for c in report.choices:
        peers = domains[c.domain]["peers"]
        knn, best = _peer_figures(peers.get(KNN_TUNED)), _peer_figures(peers.get(LORA_BEST))
        if knn is None and best is None:
            continue
        share_of_best = c.reduction / best["reduction"] if best and best["reduction"] > 0 else None
        rows[c.domain] = {"kind": c.kind, "faast": c.reduction, KNN_TUNED: knn, LORA_BEST: best,
                          "share_of_lora_best": share_of_best}  # fmt: skip
    medians = {}
    for name in (KNN_TUNED, LORA_BEST):
        ran = [r for r in rows.values() if r[name] is not None]
        if not ran:
            continue
        shares = [r["share_of_lora_best"] for r in ran if r["share_of_lora_best"] is not None]
        medians[name] = {"domains": len(ran), "kinds": len({r["kind"] for r in ran}),
                         "reduction": statistics.median(r[name]["reduction"] for r in ran),
                         "faast": statistics.median(r["faast"] for r in ran),
                         "faast_better": sum(r["faast"] > r[name]["reduction"] for r in ran),
                         "share": statistics.median(shares) if name == LORA_BEST and shares else None}  # fmt: skip
    return {"domains": rows, "medians": medians}


def merge(shards: Sequence[dict]) -> dict:
    """The merged record: provenance of the last shard, every shard's run, the suite, the protocol (every setting
    measured), the settings' reductions per domain, the leave-one-kind-out report, each domain's facts, the goals,
    the settings superseded by a newer run of their name and the domains left out for it (module docstring)."""
    left_out = [s["domain"] for s in shards if not s["settings"]]
    superseded = [x for s in shards for x in s.get("superseded", [])]
    superseded_peers = [x for s in shards for x in s.get("superseded_peers", [])]
    shards = [s for s in shards if s["settings"]]
    reductions, kinds, lora, _ = tables(shards)
    defined = {n: d for s in shards for n, d in s["protocol"]["settings"].items()}
    # The shipped default first: leave-one-kind-out gives it a tie (loko's tie-break), whichever shard came first.
    settings = sorted(dict.fromkeys(n for s in shards for n in s["settings"]), key=lambda n: n != DEFAULT)
    report = loko.loko(reductions, kinds, lora, settings=settings)
    chosen = {c.domain: c.setting for c in report.choices}
    domains = {s["domain"]: domain_facts(s, chosen[s["domain"]]) for s in shards}
    peers = sorted({p for s in shards for p in s["protocol"].get("peers", [])})
    protocol = {**shards[0]["protocol"], "settings": {n: defined[n] for n in settings}, "peers": peers}
    return {"provenance": shards[-1]["provenance"], "suite": shards[0]["suite"], "protocol": protocol,
            "runs": {s["domain"]: s["runs"] for s in shards},
            "suite_domains": {s["domain"]: s["suite_domain"] for s in shards},
            "reductions": reductions, "lora": lora, "loko": report.to_dict(), "domains": domains,
            "goals": goals(report, domains), "tuned_peers": tuned_peers(report, domains),
            "superseded": superseded, "superseded_peers": superseded_peers, "left_out": left_out,
            "set_aside": sorted({n for s in shards for n in s.get("set_aside", [])})}  # fmt: skip


def load_heuristics(*paths: Path) -> dict:
    """Heuristics specs (lab/experiments/suite_heuristics.json, suite_capacity.json), each {"settings": {name:
    fields}, "mechanisms": [{"name", "on", "off", "constants"}]}, each mechanism's on and off settings named (`on` may
    be the default, which a spec's settings need not hold), as one: {"mechanisms": every spec's, in order}. A
    mechanism's name must be new, its `within` (if any) another mechanism's name, and a setting's name must mean one
    setting across the specs."""
    mechanisms: list[dict] = []
    settings: dict[str, object] = {}
    for path in paths:
        spec = json.loads(Path(path).read_text(encoding="utf-8"))
        for m in spec.get("mechanisms", []):
            if not {"name", "on", "off", "constants"} <= set(m):
                raise ValueError(f"{path}: mechanism {m!r}: expected the keys name, on, off and constants")
            if any(m["name"] == x["name"] for x in mechanisms):
                raise ValueError(f"{path}: mechanism {m['name']!r} is already in an earlier spec")
            mechanisms.append(m)
        for name, fields in spec.get("settings", {}).items():
            if settings.setdefault(name, fields) != fields:
                raise ValueError(f"{path}: setting {name!r} differs from the one of that name in an earlier spec")
    names = {m["name"] for m in mechanisms}
    for m in mechanisms:
        if "within" in m and m["within"] not in names - {m["name"]}:
            raise ValueError(f"mechanism {m['name']!r}: 'within' names {m['within']!r}, expected another mechanism "
                             f"of the specs {sorted(names - {m['name']})}")  # fmt: skip
    return {"settings": settings, "mechanisms": mechanisms}


def _names(x: str | Sequence[str]) -> list[str]:
    return [x] if isinstance(x, str) else list(x)


def heuristics(shards: Sequence[dict], spec: dict) -> dict:
    """Each mechanism of `spec` judged by issue 74's rule (loko.heuristic_pays) at every curve point, on the domains
    that measured all of its settings: it pays when it gains enough at one point at least (the ramps matter only
    early), or when without it some domain falls below the floor at a point, and with it every domain is within the
    floor at every point. A mechanism `within` another (a part of it, such as a ramp of a bias) goes when that one
    goes. The count of tuned constants before and after removing those that do not pay. A mechanism measured on
    fewer than two kinds has no verdict (None). A mechanism marked "removed" (suite_removed.json) is judged on the
    shards that ran it, and its constants are counted as removed already (`constants_removed`). A mechanism with a
    "floor_guard" (a synthetic stream outside the suite where, without it, new text reads above the floor: a test)
    stays whatever it gains on the suite, the rule's floor clause applied to that stream."""
    from dataclasses import asdict

    judged = []
    for m in spec["mechanisms"]:
        on, off = _names(m["on"]), _names(m["off"])
        have = [s for s in shards if all(x in s["settings"] for x in on + off)]
        kinds = {s["domain"]: s["kind"] for s in have}
        entry = {"name": m["name"], "on": on, "off": off, "constants": m["constants"], "domains": sorted(kinds),
                 "kinds": sorted(set(kinds.values())), "points": [], "pays": None,
                 "removed": bool(m.get("removed", False)), "candidate": DEFAULT not in on}  # fmt: skip
        if len(entry["kinds"]) < 2:
            entry["reason"] = f"measured on {len(entry['kinds'])} kind(s): leave-one-kind-out needs two"
            judged.append(entry)
            continue
        tokens = sorted(set.intersection(*(set(s["settings"][x]["curve"]["tokens"]) for s in have for x in on + off)))
        for t in tokens:
            table = {s["domain"]: {x: dict(zip(s["settings"][x]["curve"]["tokens"], s["settings"][x]["curve"][
                "reduction"], strict=True))[t] for x in on + off} for s in have}  # fmt: skip
            without = loko.loko({d: {x: row[x] for x in off} for d, row in table.items()}, kinds, settings=off)
            ons = loko.loko({d: {x: row[x] for x in on} for d, row in table.items()}, kinds, settings=on)
            with_it = {c.domain: c.reduction for c in ons.choices}
            # a domain past the floor without it that it keeps within the floor: it guards the floor there
            kept = [c.domain for c in without.choices if c.reduction < -loko.FLOOR <= with_it[c.domain]]
            entry["points"].append({"tokens": t, **asdict(loko.heuristic_pays(table, kinds, on, off)),
                                    "lowest_without": min(c.reduction for c in without.choices),
                                    "floor_kept": kept})  # fmt: skip
        floor_ok = all(p["floor_ok"] for p in entry["points"])
        # Without it a domain falls past the floor where with it that domain is within: it keeps the floor, a goal.
        guards = any(p["floor_kept"] for p in entry["points"])
        gains = any(p["median_gain"] >= loko.MEDIAN_GAIN or p["worst_gain"] >= loko.WORST_GAIN
                    for p in entry["points"])  # fmt: skip
        guard = m.get("floor_guard")
        entry["pays"] = floor_ok and (gains or guards or bool(guard))
        keeps = "keeps the floor: without it a domain is below it"
        entry["reason"] = ("breaks the floor" if not floor_ok else "pays" if gains else keeps if guards
                           else f"keeps the floor outside the suite ({guard})" if guard
                           else "gains too little")  # fmt: skip
        judged.append(entry)
    # A part of a mechanism (the token bias's ramp) goes when the mechanism goes, whatever its own verdict.
    verdicts = {m["name"]: m for m in judged}
    for m, entry in zip(spec["mechanisms"], judged, strict=True):
        parent = verdicts.get(m.get("within", ""))
        if parent is not None and parent["pays"] is False:
            entry["pays"], entry["reason"] = False, f"goes with {parent['name']}"
    # A candidate (its "on" setting is not the default) is not in the default: its constants are not the default's.
    constants = list(dict.fromkeys(c for m in judged if not m["candidate"] for c in m["constants"]))
    gone = [c for c in constants if all(m["removed"] for m in judged if c in m["constants"])]
    removed = [c for c in constants if c not in gone
               and all(m["pays"] is False for m in judged if c in m["constants"])]  # fmt: skip
    return {
        "mechanisms": judged,
        "candidates_that_pay": [m["name"] for m in judged if m["candidate"] and m["pays"]],
        "constants_judged": constants,
        "constants_to_remove": removed,
        "constants_removed": gone,
    }


def pct(x: float | None) -> str:
    """A reduction as the perplexity change it is: 0.123 -> '−12.3%'."""
    return "–" if x is None else f"{-100 * x:+.1f}%".replace("-", "−")


def share(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}×"


def run_count(merged: dict) -> int:
    """How many runs measured the shards: their `measured_by` but its date (a run writes each shard at its own)."""
    return len({json.dumps({**r, "date": None}, sort_keys=True) for runs in merged["runs"].values() for r in runs})


def report(merged: dict) -> list[str]:
    """The Markdown of a merged record: per-domain figures under leave-one-kind-out with their peers, times and lowest
    curve points, per kind, over the suite, and the goals."""
    r, facts, g = merged["loko"], merged["domains"], merged["goals"]
    runs = run_count(merged)

    def peer(domain: str, name: str) -> str:
        row = facts[domain]["peers"].get(name)
        return pct(row["reduction"]) if row else "–"

    lines = [f"{len(r['choices'])} domains of {len(r['kinds'])} kinds (suite {merged['suite']['manifest_sha256'][:12]}"
             f"; {runs} run{'s' if runs != 1 else ''}). Each domain's figure is under the setting whose "
             "median reduction is best over the domains of the other kinds (faast_lab.experiments.loko).", "",
             *table(["domain", "kind", "setting (chosen on the other kinds)", "change", "lowest curve point",
                     "best on itself", "1 LoRA epoch", "share of LoRA's", "LoRA at FAAST's time",
                     "FAAST's time / LoRA's"],
                    [[c["domain"], c["kind"], c["setting"], pct(c["reduction"]),
                      pct(facts[c["domain"]]["lowest_point"]), c["own_best"], pct(c["lora"]), share(c["share"]),
                      peer(c["domain"], LORA_TIME), ratio(facts[c["domain"]]["time_ratio"])]
                     for c in r["choices"]]), "",
             *table(["kind", "domains", "median change", "worst change", "median share of LoRA's"],
                    [[k, len(v["domains"]), pct(v["median"]), pct(v["worst"]), share(v["share_median"])]
                     for k, v in r["kinds"].items()]), ""]  # fmt: skip
    lines.append(f"Suite: median {pct(r['median'])}, worst {pct(r['worst'])} ({r['worst_domain']}); median share of"
                 f" one LoRA epoch's reduction {share(r['share_median'])}, worst kind's "
                 f"{share(r['worst_kind_share'])}.")  # fmt: skip
    lines.append(goals_line(g))
    lines += cache_lines(merged)
    lines += tuned_peer_lines(merged)
    lines += superseded_lines(merged)
    lines += setting_lines(merged)
    if merged.get("heuristics"):
        lines += ["", *heuristic_lines(merged["heuristics"])]
    return lines


def superseded_lines(merged: dict) -> list[str]:
    """The settings a newer run of their name superseded, and those a removed mechanism acted in, by shard, and the
    domains left out for it (none: no line)."""
    by: dict[str, list[str]] = {}
    acted: dict[str, list[str]] = {}
    for x in merged.get("superseded", []):
        where = "/".join(Path(x["file"]).parts[-2:])
        (acted if x["by"] == REMOVED_ACTED else by).setdefault(where, []).append(x["setting"])
    lines = []
    if by:
        shards = "; ".join(f"{f}: {', '.join(names)}" for f, names in by.items())
        lines.append(f"Superseded by a newer run of their name, left out of every table: {shards}.")
    if acted:
        shards = "; ".join(f"{f}: {', '.join(names)}" for f, names in acted.items())
        lines.append(f"Solved with a mechanism since removed, which changed their solves, left out: {shards}.")
    # Grouped by folder and peers: a peer run again is usually run again on many domains at once.
    peers: dict[tuple[str, str], list[str]] = {}
    for x in merged.get("superseded_peers", []):
        where = Path(x["file"])
        folder = f"{where.parent.name}/" if len(where.parts) > 1 else ""
        peers.setdefault((folder, ", ".join(x["peers"])), []).append(where.stem)
    if peers:
        shards = "; ".join(f"{f}{{{', '.join(ds)}}}.json: {names}" for (f, names), ds in peers.items())
        lines.append(f"Peers run again by a newer run, the older rows left out (with FAAST's time beside them): "
                     f"{shards}.")  # fmt: skip
    if merged.get("left_out"):
        lines.append(f"Left out, no setting left to choose from (run again): {', '.join(merged['left_out'])}.")
    if merged.get("set_aside"):
        lines.append(f"Set aside (not among the settings chosen from): {', '.join(merged['set_aside'])}.")
    timed = sorted(d for d, f in merged["domains"].items() if f.get("timed_superseded"))
    if timed:
        lines.append(f"FAAST's time beside the peers is that of the setting that ran beside them, since superseded, "
                     f"on {len(timed)} domain{'s' if len(timed) != 1 else ''} ({', '.join(timed)}): a time ratio "
                     "comes from one run only.")  # fmt: skip
    return ["", *lines] if lines else []


def setting_lines(merged: dict) -> list[str]:
    """Where more than one setting ran: every setting's change on every domain ('–' where it did not run), and each
    setting's median over the domains that ran them all; the leave-one-kind-out table chooses among these."""
    names = list(merged["protocol"]["settings"])
    if len(names) < 2:
        return []
    rows = merged["reductions"]
    every = [d for d, row in rows.items() if all(n in row for n in names)]
    medians = [pct(statistics.median(rows[d][n] for d in every)) if every else "–" for n in names]
    return ["", f"Every setting's change ({len(every)} domain{'s' if len(every) != 1 else ''} ran all of them):", "",
            *table(["domain", "kind", *names],
                   [[d, merged["domains"][d]["kind"], *(pct(rows[d].get(n)) for n in names)] for d in rows]
                   + [["median of those", "", *medians]])]  # fmt: skip


def cache_lines(merged: dict) -> list[str]:
    """The domains whose chosen setting reads an exact cache (domain_facts' "cache"): its λ and T, the pairs and MiB
    it held at the last point, and its time factor (the pairs' own pass counted); none chose one: no lines."""

    def chose(c: dict) -> str:
        fixed = "off" if c["lam"] == 0 else f"λ {c['lam']:g}, T {c['temperature']:g}"
        return f"tuned: {fixed}" if c.get("tuned") else fixed

    rows = [[d, f["kind"], chose(c), f"{c['pairs']:,}",
             f"{c['memory_bytes'] / 2**20:.1f}", ratio(c["time_factor"])]
            for d, f in merged["domains"].items() if (c := f.get("cache")) is not None]  # fmt: skip
    if not rows:
        return []
    return ["", "Where the chosen setting reads the exact cache (its time factor, learn + solve with the pairs' own "
            "pass, and a tuned cache's tuning, over without them in its run, scales FAAST's time beside the peers; "
            "a tuned cache's choice is its last point's):", "",
            *table(["domain", "kind", "cache", "pairs", "memory (MiB)", "time factor"], rows)]  # fmt: skip


def tuned_peer_lines(merged: dict) -> list[str]:
    """The tuned peers (merged["tuned_peers"]): a row per domain they ran on, and a line of medians per peer (none
    ran: no line). A time is the peer's tuning plus final run over FAAST's learn + solve in the same run."""
    t = merged.get("tuned_peers") or {}
    if not t.get("domains"):
        return []

    def chose(row: dict | None, keys: tuple[tuple[str, str], ...]) -> str:
        tuned = (row or {}).get("tuned") or {}
        return ", ".join(f"{label} {tuned[k]:g}" for k, label in keys if k in tuned) or "–"

    def figure(row: dict | None, key: str, fmt: Callable[[float | None], str]) -> str:
        return fmt(row[key]) if row else "–"

    knn_keys, lora_keys = (("lam", "λ"), ("temperature", "T")), (("lr", "lr"), ("epochs", "epochs"))
    rows = [[d, r["kind"], pct(r["faast"]), figure(r[KNN_TUNED], "reduction", pct), chose(r[KNN_TUNED], knn_keys),
             figure(r[KNN_TUNED], "time_ratio", ratio), figure(r[LORA_BEST], "reduction", pct),
             chose(r[LORA_BEST], lora_keys), share(r["share_of_lora_best"]), figure(r[LORA_BEST], "time_ratio", ratio)]
            for d, r in t["domains"].items()]  # fmt: skip
    lines = ["", "The peers tuned on FAAST's held-out tail of the learned text (each run beside the default, whose "
             "perplexities it read again):", "",
             *table(["domain", "kind", "FAAST (chosen on the other kinds)", "kNN-LM tuned", "its λ, T",
                     "its time / FAAST's", "LoRA-best", "its lr, epochs", "FAAST's share of LoRA-best's",
                     "its time / FAAST's"], rows), ""]  # fmt: skip
    for name, m in t["medians"].items():
        of = f"; FAAST's median share of its reduction {share(m['share'])}" if m["share"] is not None else ""
        lines.append(
            f"{name} on {m['domains']} domains of {m['kinds']} kinds: median {pct(m['reduction'])} against "
            f"FAAST's {pct(m['faast'])} on the same domains; FAAST better on {m['faast_better']}{of}."
        )
    return lines


def heuristic_lines(judged: dict) -> list[str]:
    """The heuristics' verdicts: per mechanism its gains at each curve point and why it stays or goes."""

    def points(m: dict) -> str:
        return "; ".join(f"{p['tokens']:,}: median {100 * p['median_gain']:+.2f}, worst {100 * p['worst_gain']:+.2f}"
                         for p in m["points"]) or "–"  # fmt: skip

    verdict = {True: "stays", False: "goes", None: "not judged"}
    candidate = {True: "a candidate", False: "a candidate", None: "a candidate, not judged"}
    rows = [[m["name"] + (" (removed)" if m.get("removed") else ""), f"{len(m['domains'])} ({len(m['kinds'])} kinds)",
             points(m), f"{(candidate if m.get('candidate') else verdict)[m['pays']]}: {m['reason']}",
             ", ".join(m["constants"])]
            for m in judged["mechanisms"]]  # fmt: skip
    paying = judged.get("candidates_that_pay", [])
    removed, gone = judged["constants_to_remove"], judged.get("constants_removed", [])
    return [*table(["mechanism", "domains", "gain with it, points (median, worst) by learned tokens", "verdict",
                    "its constants"], rows), "",
            f"Tuned constants judged: {len(judged['constants_judged'])}; removed: {len(gone)}"
            + (f" ({', '.join(gone)})" if gone else "") + f"; to remove: {len(removed)}"
            + (f" ({', '.join(removed)})." if removed else ".")
            + (f" Candidates outside the default that pay: {', '.join(paying)}." if paying else "")]  # fmt: skip


def goals_line(g: dict) -> str:
    """The goals, each with the figure that meets or misses it."""
    met = {True: "met", False: "missed", None: "not measured"}
    return (
        f"Goals: median share ≥ {share(g['share_goal'])}: {share(g['share_median'])} ({met[g['met']['share']]}); "
        f"worst kind's ≥ {share(g['worst_kind_share_goal'])}: {share(g['worst_kind_share'])} "
        f"({met[g['met']['worst_kind_share']]}); learn + solve ≤ {ratio(g['time_ratio_goal'])} LoRA's epoch: "
        f"{ratio(g['time_ratio_worst'])} at worst, {ratio(g['time_ratio_median'])} median "
        f"({met[g['met']['time']]}); no curve point worse than zero-shot by over {100 * -g['floor']:g}%: lowest "
        f"{pct(g['lowest_point'])} ({g['lowest_point_domain']}; {met[g['met']['floor']]})."
    )


def main(argv: list[str] | None = None) -> dict:
    from faast import provenance
    from faast.persist import write_text_atomic

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "shards",
        type=Path,
        nargs="+",
        help="shard records or folders of them (lm_suite --out); a domain's shards are joined",
    )
    p.add_argument(
        "--heuristics",
        type=Path,
        nargs="+",
        default=None,
        help="specs of mechanisms to judge (lab/experiments/suite_heuristics.json, suite_capacity.json)",
    )
    p.add_argument(
        "--settings",
        nargs="+",
        default=None,
        help="the settings leave-one-kind-out chooses among (default: every one the shards measured); the rest are "
        "set aside, and named",
    )
    p.add_argument(
        "--default",
        type=json.loads,
        default=None,
        metavar="FIELDS",
        help="a JSON object of lm_suite setting fields over the shipped ones: the setting `default` means (default: "
        "what faast ships), so that an earlier default's report reads as it did, e.g. "
        '\'{"policy": {"document_positions_per_dim": 6}}\'',
    )
    p.add_argument("--out", type=Path, required=True, help="the merged record's stem (<stem>.json, <stem>.md)")
    args = p.parse_args(argv)
    if args.default is not None and not isinstance(args.default, dict):
        p.error(f"--default: expected a JSON object of setting fields, got {args.default!r}")
    shards = load_shards(args.shards, default=args.default)
    if args.settings is not None:
        shards = only(shards, args.settings)
    merged = merge(shards)
    if args.heuristics is not None:
        merged["heuristics"] = heuristics(shards, load_heuristics(*args.heuristics))
    lines = report(merged)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out.with_suffix(".json"), json.dumps(merged, indent=1, ensure_ascii=False) + "\n")
    body = ["# The domain suite under leave-one-kind-out", "", provenance.markdown(merged["provenance"]), "", *lines]
    write_text_atomic(args.out.with_suffix(".md"), "\n".join(body) + "\n")
    print("\n".join(lines))
    return merged


if __name__ == "__main__":
    main()
