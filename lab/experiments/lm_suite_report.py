"""The domain suite's report: lm_suite's shard records merged, each domain's figure chosen by leave-one-kind-out
(faast_lab.experiments.loko), written as one record (<stem>.json) and its Markdown (<stem>.md).

    python -m faast_lab.experiments.lm_suite_report SHARD_DIR --out lab/experiments/results/lm_suite_cpu

The merged record is what docs/results_sections.toml names (kind "lm_suite", scripts/results_formats.py): its
`loko` holds the per-domain choices, per-kind and suite medians and worst, and the shares of one LoRA epoch's
reduction; `runs` names the run and machine of every shard (a sharded run may span machines: its times compare
within a shard only).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from faast_lab.experiments import loko
from faast_lab.experiments._common import measured_by, table

LORA = "LoRA"  # the one-epoch LoRA row's name before " (" (lm_domains_peers.run_backprop)


def load_shards(paths: Sequence[Path]) -> list[dict]:
    """The shard records of `paths` (folders: their *.json), in domain order of the files; all must share one suite
    manifest and one protocol (a ValueError names the first that does not)."""
    files = [f for p in paths for f in (sorted(Path(p).glob("*.json")) if Path(p).is_dir() else [Path(p)])]
    shards = [json.loads(f.read_text(encoding="utf-8")) for f in files]
    if not shards:
        raise ValueError(f"paths: expected shard records (lm_suite's <domain>.json), found none in {list(paths)}")
    first = shards[0]
    for f, s in zip(files, shards, strict=True):
        for key in ("suite", "protocol"):
            if s.get(key) != first.get(key):
                raise ValueError(f"{f}: its {key} differs from {files[0].name}'s: the shards are not one suite run")
    return shards


def tables(shards: Sequence[dict]) -> tuple[dict, dict, dict, dict]:
    """({domain: {setting: reduction}}, {domain: kind}, {domain: one LoRA epoch's reduction}, {domain: {setting:
    reductions along the curve}}) of the shards."""
    reductions, kinds, lora, curve = {}, {}, {}, {}
    for s in shards:
        name = s["domain"]
        reductions[name] = {k: r["reduction"] for k, r in s["settings"].items()}
        curve[name] = {k: r["curve"]["reduction"] for k, r in s["settings"].items()}
        kinds[name] = s["kind"]
        peer = next((r for r in s.get("peers", []) if r["method"].split(" (")[0] == LORA), None)
        if peer is not None:
            lora[name] = peer["reduction"]
    return reductions, kinds, lora, curve


def merge(shards: Sequence[dict]) -> dict:
    """The merged record: provenance of the last shard, every shard's run, the suite, the protocol, the settings'
    reductions per domain and the leave-one-kind-out report."""
    reductions, kinds, lora, _ = tables(shards)
    settings = list(shards[0]["protocol"]["settings"])
    report = loko.loko(reductions, kinds, lora, settings=settings)
    return {"provenance": shards[-1]["provenance"], "suite": shards[0]["suite"], "protocol": shards[0]["protocol"],
            "runs": {s["domain"]: measured_by(s["provenance"]) for s in shards},
            "suite_domains": {s["domain"]: s["suite_domain"] for s in shards},
            "reductions": reductions, "lora": lora, "loko": report.to_dict()}  # fmt: skip


def pct(x: float | None) -> str:
    """A reduction as the perplexity change it is: 0.123 -> '−12.3%'."""
    return "–" if x is None else f"{-100 * x:+.1f}%".replace("-", "−")


def share(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def report(merged: dict) -> list[str]:
    """The Markdown of a merged record: per-domain figures under leave-one-kind-out, per kind, over the suite."""
    r = merged["loko"]
    runs = {json.dumps(v, sort_keys=True) for v in merged["runs"].values()}
    lines = [f"{len(r['choices'])} domains of {len(r['kinds'])} kinds (suite {merged['suite']['manifest_sha256'][:12]}"
             f"; {len(runs)} run{'s' if len(runs) != 1 else ''}). Each domain's figure is under the setting whose "
             "median reduction is best over the domains of the other kinds (faast_lab.experiments.loko).", "",
             *table(["domain", "kind", "setting (chosen on the other kinds)", "change", "best on itself",
                     "1 LoRA epoch", "share of LoRA's"],
                    [[c["domain"], c["kind"], c["setting"], pct(c["reduction"]), c["own_best"], pct(c["lora"]),
                      share(c["share"])] for c in r["choices"]]), "",
             *table(["kind", "domains", "median change", "worst change", "median share of LoRA's"],
                    [[k, len(v["domains"]), pct(v["median"]), pct(v["worst"]), share(v["share_median"])]
                     for k, v in r["kinds"].items()]), ""]  # fmt: skip
    lines.append(f"Suite: median {pct(r['median'])}, worst {pct(r['worst'])} ({r['worst_domain']}); median share of"
                 f" one LoRA epoch's reduction {share(r['share_median'])}, worst kind's "
                 f"{share(r['worst_kind_share'])}.")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> dict:
    from faast import provenance
    from faast.persist import write_text_atomic

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shards", type=Path, nargs="+", help="shard records or folders of them (lm_suite --out)")
    p.add_argument("--out", type=Path, required=True, help="the merged record's stem (<stem>.json, <stem>.md)")
    args = p.parse_args(argv)
    merged = merge(load_shards(args.shards))
    lines = report(merged)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out.with_suffix(".json"), json.dumps(merged, indent=1, ensure_ascii=False) + "\n")
    body = ["# The domain suite under leave-one-kind-out", "", provenance.markdown(merged["provenance"]), "", *lines]
    write_text_atomic(args.out.with_suffix(".md"), "\n".join(body) + "\n")
    print("\n".join(lines))
    return merged


if __name__ == "__main__":
    main()
