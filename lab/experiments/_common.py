"""What the LM experiment scripts share: the model with its memory layers, local data files read through the
datasets library, and the JSON + Markdown result files with their provenance (faast.provenance)."""

from __future__ import annotations

import argparse
import glob
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

#: The checkout the lab is installed from (editable, lab/pyproject.toml): provenance reads its git state, and paths
#: in the recorded settings are written relative to it.
ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = Path(__file__).resolve().parent
RESULTS = EXPERIMENTS / "results"
DATA = EXPERIMENTS / "data"

#: load_model(name) -> (base model, tokenizer, description), as faast.hf.default.load_base_model: the scripts' main
#: takes one (`load_model=`), so a test hands them a tiny model rather than rebinding the library's loader.
ModelLoader = Callable[[str], tuple[Any, Any, str]]


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="'smollm2' (embedded) or a transformers id/path")
    parser.add_argument(
        "--readout", default=None, help="a trained adapter folder (default: none, faast's default configuration)"
    )
    parser.add_argument("--results-dir", default=str(RESULTS))
    parser.add_argument("--out", default=None, help="result file stem (default: <experiment>_<model>)")


def add_stream_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's stream and its learners' windows, as lab/experiments/lm_domains.py sets them: learned and scored
    tokens, the scoring window, FAAST's learning windows and batch, LoRA's training windows and batch."""
    parser.add_argument("--learn-tokens", type=int, default=32768)
    parser.add_argument("--score-tokens", type=int, default=8192)
    parser.add_argument("--window", type=int, default=1024, help="scoring window (tokens)")
    parser.add_argument("--learn-window", type=int, default=256)
    parser.add_argument("--learn-batch-size", type=int, default=8)
    parser.add_argument("--train-window", type=int, default=256)
    parser.add_argument("--train-batch-size", type=int, default=4)


def load_model(args: argparse.Namespace):  # noqa: ANN201 - (FaastModel, tokenizer, description)
    """The base model with FAAST's memory layers: the readout given (`--readout`, e.g. faast/data/smollm2-readout for
    the shipped middle layers), else faast's default configuration (FaastConfig(): the residual output layer), as the
    demo and lab/experiments/lm_domains.py run it."""
    from faast.hf import FaastConfig, apply_faast, from_pretrained
    from faast.hf.default import load_base_model

    base, tokenizer, description = load_base_model(args.model)
    model = from_pretrained(base, args.readout) if args.readout else apply_faast(base, FaastConfig())
    return model, tokenizer, description


def start_record() -> dict:
    """faast.provenance's record of this run (call it first: it holds the load average at the start)."""
    from faast import provenance

    return provenance.start(ROOT)


def run_default_domains(
    args: argparse.Namespace, run_domain: Callable[..., dict], title: str, report: Callable[[list[dict]], list[str]]
) -> dict:
    """The per-domain experiments' main: the default model (SmolLM2) loaded once, run_domain(name, base, tokenizer,
    args) for each of args.domains, and {model, settings, rows} written with report(rows) through the results writer
    at args.results_dir / args.out. Returns that payload."""
    from faast import provenance
    from faast.hf.default import load_base_model

    record = start_record()
    base, tokenizer, description = load_base_model("smollm2")
    rows = [run_domain(name, base, tokenizer, args) for name in args.domains]
    settings = {k: str(v).replace(str(ROOT) + "/", "") for k, v in vars(args).items()}
    payload = {"model": description, "settings": settings, "rows": rows}
    provenance.write(Path(args.results_dir) / args.out, record, payload, title, report(rows))
    return payload


def write_results(
    args: argparse.Namespace, experiment: str, record: dict, payload: dict, title: str, markdown: Sequence[str]
) -> Path:
    """results/<stem>.json ({"provenance": record, **payload}) and .md (title, provenance block, markdown), each
    written atomically; prints the Markdown and returns the folder."""
    from faast import provenance

    stem = args.out or f"{experiment}_{args.model.replace('/', '_')}"
    folder = Path(args.results_dir)
    _, md_path = provenance.write(folder / stem, record, payload, title, markdown)
    print(md_path.read_text(encoding="utf-8"), flush=True)
    return folder


def measured_by(record: dict) -> dict:
    """Which run and machine measured a part of a result (a domain, a stream): a resumed run may go on on another CPU,
    and its times then compare only within that part."""
    return {k: record.get(k) for k in ("date", "git_sha", "git_dirty", "cpu_model", "cpu_native_bf16")}


def several_runs(parts: Iterable[dict]) -> bool:
    """Whether the parts of a result (domains, streams) were measured by more than one run (their `measured_by`)."""
    return len({json.dumps(p.get("measured_by"), sort_keys=True) for p in parts}) > 1


def measured_by_words(by: dict | None) -> str:
    """'the run of DATE at SHA7 on CPU (native bfloat16 | no native bfloat16 | bfloat16 unknown)'."""
    by = by or {}
    bf16 = {True: "native bfloat16", False: "no native bfloat16"}.get(by.get("cpu_native_bf16"), "bfloat16 unknown")
    return f"the run of {by.get('date')} at {str(by.get('git_sha'))[:7]} on {by.get('cpu_model')} ({bf16})"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def load_local(builder: str, files: Sequence[str | Path], **options: object) -> Iterable[dict]:
    """The rows of local files through `datasets.load_dataset(builder, data_files=files)` ('json' or 'text'),
    streamed in file order (no cache written); needs the datasets library (the experiments extra)."""
    try:
        from datasets import load_dataset
    except ImportError as err:
        raise ImportError("local data files are read by the datasets library: pip install faast[experiments]") from err
    # datasets globs each data file again: escaped, a name with [ ] * ? stays the one file it is.
    data_files = [glob.escape(str(f)) for f in files]
    return load_dataset(builder, data_files=data_files, split="train", streaming=True, **options)


def read_split_jsonl(path: str | Path, fields: Sequence[str]) -> tuple[list[dict], list[dict]]:
    """(train rows, test rows) of a JSON Lines file whose rows carry `fields` (non-empty) and split = train|test,
    read through the datasets library's json builder. An error names the file and the row (its line number when the
    file has no blank lines)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file: expected a JSON Lines file, {path} does not exist")
    train, test = [], []
    try:
        rows = list(load_local("json", [path]))
    except (ValueError, OSError) as err:  # the json builder's parse errors (pyarrow's and pandas') are ValueErrors
        raise ValueError(f"{path}: expected JSON Lines (one object per line): {err}") from err
    for n, row in enumerate(rows, 1):
        missing = [k for k in fields if row.get(k) in (None, "")]
        if missing or row.get("split") not in ("train", "test"):
            raise ValueError(
                f"{path}:{n}: expected non-empty {missing or list(fields)} and split 'train' or 'test', "
                f"got split {row.get('split')!r}"
            )
        (train if row["split"] == "train" else test).append(row)
    return train, test
