"""Choose the spectral filter of the LM memory layers on a validation domain, by held-out perplexity.

    python -m faast_lab.benchmarks.hf_filter_sweep --package email        # validation domain (the demo scores asyncio)

The model learns `--learn-tokens` of one stdlib package's Python source and is scored on its held-out files (the
demo's split) for every alpha, with the output memory layer on and off and the middle layers on and off. Learning
happens once: the filter only changes the solve. The shipped FaastConfig takes its alpha from this sweep on a package
that is not the demo's, so the demo's number is not tuned on its own test text.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from faast_lab.benchmarks import _harness as H

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> dict:
    from faast.hf.default import DEFAULT_READOUT, SMOLLM2_NAME, load_default_model
    from faast.hf.demo import domain_files, tokens_of
    from faast.hf.evaluate import perplexity, token_windows

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", default="email")
    parser.add_argument("--readout", default=str(DEFAULT_READOUT))
    parser.add_argument("--learn-tokens", type=int, default=16384)
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--alphas", default="1.0,0.8,0.7,0.6,0.5,0.4,auto")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    H.set_threads()
    record = H.start()
    model, tokenizer = load_default_model(readout=args.readout)
    learn_files, eval_files = domain_files(args.package)
    learn = tokens_of(learn_files, tokenizer, args.learn_tokens)
    windows = [w for ids in tokens_of(eval_files, tokenizer, args.eval_tokens) for w in token_windows(ids, 512)]
    base = perplexity(model, windows).ppl
    model.learn(learn, max_length=512, batch_size=4)
    middle = list(model.memory_layers.values())
    rows, records = [], []
    # The filter being chosen is the middle layers' (the residual output layer has its own, output_alpha); each row
    # also scores the middle layers alone and the output layer alone, by disabling the other part.
    parts = (("both", None), ("middle", "output"), ("output", "middle"))
    for text in args.alphas.split(","):
        alpha = text if text == "auto" else float(text)
        for layer in middle:
            layer.memory.alpha = alpha
        result = {"alpha": alpha}
        for name, disabled in parts:
            with model.disable_faast(disabled) if disabled else contextlib.nullcontext():
                result[name] = perplexity(model, windows).ppl
        records.append(result)
        rows.append(
            [str(alpha)]
            + [f"{result[k]:.3f} ({100 * (1 - result[k] / base):+.1f}%)" for k in ("both", "middle", "output")]
        )
        print(rows[-1], flush=True)
    readout = H.provenance.relative(str(Path(args.readout).resolve()), H.REPO)  # results carry no machine paths
    payload = {"package": args.package, "readout": readout, "base_ppl": base,
               "learn_tokens": sum(len(x) for x in learn), "eval_tokens": sum(len(w) - 1 for w in windows),
               "records": records}  # fmt: skip
    stem = args.out or f"hf_filter_sweep_{args.package}"
    title = f"Spectral filter sweep on '{args.package}' (validation domain), {SMOLLM2_NAME} + readout"
    md = [
        f"Learned {payload['learn_tokens']:,} tokens of the package's source; held-out perplexity over "
        f"{payload['eval_tokens']:,} tokens of its other files; base {base:.3f}; relative reduction in brackets.",
        "",
        H.markdown_table(["alpha", "middle + output layers", "middle layers only", "output layer only"], rows),
        "",
    ]
    H.write(RESULTS / stem, record, payload, title, md)
    print("\n".join(md))
    return payload


if __name__ == "__main__":
    main()
