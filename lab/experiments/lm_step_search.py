"""The residual output layer's step search on real held-out logits: passes over the [n, V] logits, the step and the
held-out NLL, the shipped search against the one before it, on cached states (lab/experiments/lm_output_states.py).

    python -m faast_lab.experiments.lm_output_states --cache /tmp/faast_states
    python -m faast_lab.experiments.lm_step_search --cache /tmp/faast_states --domains email multiprocessing licenses

For each cached domain and amount of learned text, the layer (faast/hf/output.py, keys h̃ alone: the cache holds the
final-norm states only) learns the cached states through its own `learn`; at each curve point the held-out logits its
solve tunes the step on (the tail's rows, scored by the W fitted without them: the layer's public tail_statistics,
newton and tail_logits) are handed to both searches in turn. `previous` is the search before the sampled start and
the Gauss-Newton fallback (a Newton step that left the bracket was replaced by arithmetic bisection, and every pass
read all rows), kept here to measure against. Every pass of either search appends one point to its trace, so the
passes are counted from the traces (the shipped search's sample pass is replayed untimed for its trace). A pass over
a quarter of the rows counts a quarter in `row passes`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from faast import provenance
from faast_lab.experiments._common import RESULTS, ROOT


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, required=True)
    p.add_argument("--domains", nargs="+", default=["email", "multiprocessing", "licenses"])
    p.add_argument("--curve", default="8192,32768")
    p.add_argument("--results-dir", type=Path, default=RESULTS)
    p.add_argument("--out", default="lm_step_search_cpu")
    return p.parse_args(argv)


def previous_search(tuning, logits, weight: float, log_base, start: float, policy=None):  # noqa: ANN001, ANN201
    """The search as it was before the sample start and the Gauss-Newton fallback, under `policy` (an OutputPolicy;
    None: the shipped one): (η, trace, rows)."""
    import math

    from faast.hf import OutputPolicy

    policy = OutputPolicy() if policy is None else policy
    tol = policy.step_tol
    eta, low, high, trace = min(max(float(start), 0.0), policy.max_step), 0.0, policy.max_step, []
    rows = None
    for _ in range(policy.step_iterations):
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
        if abs(new - eta) <= tol * max(eta, 1e-2) or high - low <= tol * max(high, 1e-2):
            break
        eta = new
    if rows.eta != eta:
        rows = tuning.step_rows(logits, eta)
        trace.append((eta, float(-tuning.log_mixture(log_base, rows.log_memory, weight).mean())))
    if weight < 1.0 and eta > 0.0 and not tuning.significant(log_base, rows.log_memory, weight, policy):
        eta = 0.0
    return eta, trace, rows


def main(argv: list[str] | None = None) -> dict:
    import torch

    from faast.hf.default import load_base_model
    from faast.hf.output import tuning
    from faast_lab.experiments import lm_output_variants as variants

    args = parse_args(argv)
    record = provenance.start(ROOT)
    base, tokenizer, description = load_base_model("smollm2")
    head = base.get_output_embeddings()
    rows_out: list[dict] = []

    def shipped_passes(layer, logits, weight, log_base, start, trace) -> tuple[int, float]:  # noqa: ANN001
        """(passes, rows read / n) of the shipped search whose full rows' trace is `trace`: one pass per point, and
        first, with enough rows, the sample's search, replayed here for its trace."""
        n, policy = int(logits[0].shape[0]), layer.policy
        passes, rows = len(trace), float(len(trace))
        if n >= policy.search_sample_min_rows:
            pick = slice(None, None, policy.search_sample_stride)
            sample = tuple(part[pick] for part in logits)
            _, sample_trace, _ = tuning.tune_step_rows(sample, weight, log_base[pick], start, True, policy)
            passes += len(sample_trace)
            rows += len(sample_trace) * sample[0].shape[0] / n
        return passes, rows

    def compare(layer, context: dict) -> None:  # noqa: ANN001
        """Both searches on the held-out logits the layer's solve tunes its step on now (keys h̃ alone, from 0)."""
        if not layer.held_out_positions():
            return
        keys, ys, _, s_tail, t_tail, n_tail, _, _ = layer.step_choice().tail_statistics()
        memory, curvature = layer.memory, layer.damped_curvature()
        dt = memory.gram.dtype
        w = layer.newton(memory.gram - s_tail.to(dt), memory.cross - t_tail.to(dt), memory.count - n_tail.to(dt),
                         curvature, layer.hidden_size)  # fmt: skip
        logits = layer.step_choice().tail_logits(keys, ys, w)
        log_base, weight, start, n = tuning.base_log_targets(logits), float(layer.weight), 0.0, int(keys.shape[0])
        searches = (("previous", lambda *a: previous_search(tuning, *a, policy=layer.policy)),
                    ("shipped", lambda *a: tuning.tune_step_rows(*a, policy=layer.policy)))  # fmt: skip
        for name, search in searches:
            started = time.perf_counter()
            eta, trace, rows = search(logits, weight, log_base, start)
            seconds = time.perf_counter() - started
            if name == "shipped":
                passes, row_passes = shipped_passes(layer, logits, weight, log_base, start, trace)
            else:
                passes, row_passes = len(trace), float(len(trace))
            log_memory = tuning.step_rows(logits, eta).log_memory if eta > 0 else log_base
            nll = float(-tuning.log_mixture(log_base, log_memory, weight).mean())
            rows_out.append({**context, "search": name, "held_out_rows": n, "start": start, "step": eta,
                             "held_out_nll": nll, "passes": passes, "row_passes": row_passes, "seconds": seconds,
                             "full_rows_trace": [point for point, _ in trace]})  # fmt: skip
            print(f"{context['domain']:>15} {context['tokens']:>6} {name:>8}: η {eta:.4f}  NLL {nll:.6f}  "
                  f"{passes} passes, {row_passes:.2f} row passes, {seconds:.1f} s", flush=True)  # fmt: skip

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
            with torch.no_grad():  # the head's products, outside any autograd the loaded model may have on
                compare(layer, {"domain": name, "tokens": amount})
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
