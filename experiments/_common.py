"""What the LM experiment scripts share: the model with its memory layers, and the JSON + Markdown result files."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
# Run from a checkout without installing: faast lives in python/, faast_kernels at the root.
for _path in (ROOT, ROOT / "python"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="'smollm2' (embedded) or a transformers id/path")
    parser.add_argument(
        "--readout", default=None, help="a trained adapter folder (default: the shipped one for smollm2)"
    )
    parser.add_argument("--results-dir", default=str(RESULTS))
    parser.add_argument("--out", default=None, help="result file stem (default: <experiment>_<model>)")


def load_model(args: argparse.Namespace):  # noqa: ANN201 - (FaastModel, tokenizer, description)
    """The base model with FAAST's memory layers: the readout given, the shipped one for smollm2, else untrained."""
    from faast.hf import FaastConfig, apply_faast, from_pretrained
    from faast.hf.default import DEFAULT_READOUT, load_base_model

    base, tokenizer, description = load_base_model(args.model)
    readout = args.readout or (DEFAULT_READOUT if args.model == "smollm2" else None)
    model = from_pretrained(base, readout) if readout else apply_faast(base, FaastConfig())
    return model, tokenizer, description


def write_results(args: argparse.Namespace, experiment: str, payload: dict, markdown: Sequence[str]) -> Path:
    """results/<stem>.json and .md, each written atomically; returns the folder."""
    from faast._persist import write_text_atomic

    stem = args.out or f"{experiment}_{args.model.replace('/', '_')}"
    folder = Path(args.results_dir)
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomic(folder / f"{stem}.json", json.dumps(payload, indent=2, ensure_ascii=False) + "\n")
    write_text_atomic(folder / f"{stem}.md", "\n".join(markdown) + "\n")
    print("\n".join(markdown), flush=True)
    return folder


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def read_split_jsonl(path: Path, fields: Sequence[str]) -> tuple[list[dict], list[dict]]:
    """(train rows, test rows) of a JSONL file whose rows carry `fields` (non-empty) and split = train|test."""
    train, test = [], []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        missing = [k for k in fields if row.get(k) in (None, "")]
        if missing or row.get("split") not in ("train", "test"):
            raise ValueError(
                f"{path}:{n}: expected non-empty {missing or list(fields)} and split 'train' or 'test', "
                f"got split {row.get('split')!r}"
            )
        (train if row["split"] == "train" else test).append(row)
    return train, test
