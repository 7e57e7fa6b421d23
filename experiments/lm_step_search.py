"""The residual output layer's step search on real held-out logits: passes over the [n, V] logits, the step and the
held-out NLL, the shipped search against the one before it, on cached states (experiments/lm_output_states.py).

    python experiments/lm_output_states.py --cache /tmp/faast_states
    python experiments/lm_step_search.py --cache /tmp/faast_states --domains email multiprocessing licenses

For each cached domain and amount of learned text, the layer (faast/hf/output.py, keys h̃ alone: the cache holds the
final-norm states only) learns the cached states through its own `learn`; at its solve, the held-out logits it tunes
the step on are handed to both searches in turn, and the layer goes on with the shipped one. `previous` is the search
before the sampled start and the Gauss-Newton fallback (a Newton step that left the bracket was replaced by
arithmetic bisection, and every pass read all rows), kept here to measure against. A pass over a quarter of the rows
counts a quarter in `row passes`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS, ROOT  # noqa: E402

from faast import provenance  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, required=True)
    p.add_argument("--domains", nargs="+", default=["email", "multiprocessing", "licenses"])
    p.add_argument("--curve", default="8192,32768")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--out", default="lm_step_search_cpu")
    return p.parse_args(argv)


def previous_search(tuning, logits, weight: float, log_base, start: float):  # noqa: ANN001, ANN201
    """The search as it was before the sample start and the Gauss-Newton fallback: (η, trace, rows)."""
    import math

    eta, low, high, trace = min(max(float(start), 0.0), tuning.MAX_STEP), 0.0, tuning.MAX_STEP, []
    rows = None
    for _ in range(tuning.STEP_ITERATIONS):
        rows = tuning.step_rows(logits, eta)
        log_mix = tuning.log_mixture(log_base, rows.log_memory, weight)
        share = (rows.log_memory - log_mix).exp() * weight
        grad = float(-(share * rows.gap).mean())
        curv = float((share * rows.spread + (share * share - share) * rows.gap * rows.gap).mean())
        trace.append((eta, float(-log_mix.mean())))
        if eta == 0.0 and grad >= 0:
            break
        if grad > 0:
            high = eta
        else:
            low = eta
        new = eta - grad / curv if curv > 0 else math.inf
        if new <= low == 0.0 and not any(point == 0.0 for point, _ in trace):
            new = 0.0
        elif not low < new < high:
            new = 0.5 * (low + high)
        if abs(new - eta) <= tuning.STEP_TOL * max(eta, 1e-2) or high - low <= tuning.STEP_TOL * max(high, 1e-2):
            break
        eta = new
    if rows.eta != eta:
        rows = tuning.step_rows(logits, eta)
        trace.append((eta, float(-tuning.log_mixture(log_base, rows.log_memory, weight).mean())))
    if weight < 1.0 and eta > 0.0 and not tuning.significant(log_base, rows.log_memory, weight):
        eta = 0.0
    return eta, trace, rows


def main(argv: list[str] | None = None) -> dict:
    import lm_output_variants as variants
    import torch

    from faast.hf import output_tuning as tuning
    from faast.hf.default import load_base_model

    args = parse_args(argv)
    record = provenance.start(ROOT)
    base, tokenizer, description = load_base_model("smollm2")
    head = base.get_output_embeddings()
    shipped, count = tuning.tune_step_rows, {"rows": 0, "passes": 0}
    step_rows = tuning.step_rows
    rows_out: list[dict] = []
    context: dict = {}

    def counted(logits, eta):  # noqa: ANN001, ANN202
        count["rows"] += int(logits[0].shape[0])
        count["passes"] += 1
        return step_rows(logits, eta)

    def both(logits, weight=1.0, log_base=None, start=0.0):  # noqa: ANN001, ANN202
        if log_base is None:
            log_base = tuning.base_log_targets(logits)
        n = int(logits[0].shape[0])
        result = None
        for name, search in (("previous", lambda *a: previous_search(tuning, *a)), ("shipped", shipped)):
            count.update(rows=0, passes=0)
            started = time.perf_counter()
            eta, trace, rows = search(logits, weight, log_base, start)
            seconds = time.perf_counter() - started
            passes, row_passes = count["passes"], count["rows"] / n
            log_memory = step_rows(logits, eta).log_memory if eta > 0 else log_base
            nll = float(-tuning.log_mixture(log_base, log_memory, weight).mean())
            rows_out.append({**context, "search": name, "held_out_rows": n, "start": start, "step": eta,
                             "held_out_nll": nll, "passes": passes, "row_passes": row_passes, "seconds": seconds,
                             "full_rows_trace": [point for point, _ in trace]})  # fmt: skip
            print(f"{context['domain']:>15} {context['tokens']:>6} {name:>8}: η {eta:.4f}  NLL {nll:.6f}  "
                  f"{passes} passes, {row_passes:.2f} row passes, {seconds:.1f} s", flush=True)  # fmt: skip
            result = (eta, trace, rows) if name == "shipped" else result
        return result

    tuning.step_rows, tuning.tune_step_rows = counted, both
    try:
        for name in args.domains:
            data = torch.load(args.cache / f"{name}.pt")
            keys, targets = data["learn"]
            budget = int(data["settings"].get("learn_tokens", 32768))
            starts = variants.doc_starts(name, tokenizer, len(targets), budget)
            layer = variants.layer_for(head, keys.shape[1], head.weight.shape[0])
            done = 0
            for point in [int(x) for x in args.curve.split(",")]:
                amount = min(point, len(targets))
                variants.feed(layer, keys[done:amount], targets[done:amount], starts, done)
                done = amount
                context.update(domain=name, tokens=amount)
                layer.solution(torch.device("cpu"), torch.float32)
    finally:
        tuning.step_rows, tuning.tune_step_rows = step_rows, shipped
    lines = ["Each search runs on the same held-out logits of the layer's solve (probability space, λ 0.5, keys h̃"
             " alone); `row passes` counts a pass over a quarter of the rows as a quarter. NLL: mean held-out NLL at"
             " the step found (nats).", "",
             "| domain | tokens | rows | search | step | NLL | passes | row passes | seconds | full-rows points |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows_out:
        lines.append(f"| {r['domain']} | {r['tokens']:,} | {r['held_out_rows']:,} | {r['search']} | {r['step']:.4f} "
                     f"| {r['held_out_nll']:.6f} | {r['passes']} | {r['row_passes']:.2f} | {r['seconds']:.1f} | "
                     f"{', '.join(f'{p:.3g}' for p in r['full_rows_trace'])} |")  # fmt: skip
    settings = {k: str(v).replace(str(ROOT) + "/", "") for k, v in vars(args).items()}
    payload = {"model": description, "settings": settings, "rows": rows_out}
    provenance.write(args.results_dir / args.out, record, payload, "The step search on cached held-out logits", lines)
    return payload


if __name__ == "__main__":
    main()
