"""Cache the final-norm hidden states of a domain's learned and held-out tokens, for studying the output layer fast.

    python -m faast_lab.experiments.lm_output_states --domains email asyncio --cache /tmp/faast_states

The default configuration (the residual output layer alone, docs/design.md §6.3) reads nothing but the final norm's
output h̃ and the head, and the backbone is frozen, so every variant of that layer (its regulariser, step rule,
curvature) is a function of h̃ for the learned tokens and for the held-out tokens. This script runs the backbone once
per domain, exactly as lab/experiments/lm_domains.py does (learned: `--learn-tokens` tokens in `--learn-window`-token
windows overlapping by one; held-out: `--score-tokens` tokens in `--window`-token windows), and saves per domain
`<cache>/<domain>.pt` with float32 h̃ and next-token ids of both sides. lab/experiments/lm_output_variants.py reads
them.

Domains: the benchmark's five (lab/experiments/domains.py) and validation domains that take no part in it, on which the
layer's settings are chosen: `email` and `multiprocessing` (stdlib packages) and `licenses`
(/usr/share/common-licenses).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from faast_lab.experiments.domains import DOMAINS, VALIDATION, domain_texts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--domains", nargs="+", choices=(*DOMAINS, *VALIDATION), default=[*VALIDATION, *DOMAINS])
    p.add_argument("--cache", type=Path, required=True)
    p.add_argument("--learn-tokens", type=int, default=32768)
    p.add_argument("--score-tokens", type=int, default=8192)
    p.add_argument("--learn-window", type=int, default=256)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    return p.parse_args(argv)


def states(base, windows: list[list[int]], batch_size: int):  # noqa: ANN001, ANN201 - (h [n, d], y [n])
    """Final-norm states of every position that predicts a next token, and that token, window by window."""
    import torch

    from faast.hf.tokens import pad_rows

    hs, ys = [], []
    backbone = base.get_decoder() if hasattr(base, "get_decoder") else base.model
    for start in range(0, len(windows), batch_size):
        ids, mask = pad_rows(windows[start : start + batch_size])
        with torch.no_grad():
            h = backbone(input_ids=ids, attention_mask=mask.long(), use_cache=False).last_hidden_state
        keep = mask[:, 1:] & mask[:, :-1]
        hs.append(h[:, :-1][keep].float())
        ys.append(ids[:, 1:][keep])
    return torch.cat(hs), torch.cat(ys)


def main(argv: list[str] | None = None) -> None:
    import torch

    from faast.hf.default import load_base_model
    from faast.hf.evaluate import token_windows
    from faast.hf.tokens import overlapping_windows, token_lists

    args = parse_args(argv)
    args.cache.mkdir(parents=True, exist_ok=True)
    base, tokenizer, description = load_base_model("smollm2")
    for name in args.domains:
        path = args.cache / f"{name}.pt"
        if path.is_file():
            continue
        started = time.perf_counter()
        learn_texts, score_texts = domain_texts(name)
        learn = token_lists(learn_texts, tokenizer, args.learn_tokens)
        learn_windows = [w for ids in learn for w in overlapping_windows(ids, args.learn_window)]
        score_windows = [w for ids in token_lists(score_texts, tokenizer, args.score_tokens)
                         for w in token_windows(ids, args.window)]  # fmt: skip
        h_learn, y_learn = states(base, learn_windows, args.batch_size)
        h_score, y_score = states(base, score_windows, max(1, args.batch_size // 4))
        torch.save({"model": description, "settings": {k: str(v) for k, v in vars(args).items()},
                    "learn": (h_learn, y_learn), "score": (h_score, y_score)}, path)  # fmt: skip
        print(f"{name}: learned {len(y_learn):,} positions, held-out {len(y_score):,} "
              f"({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
