"""Build the Debian-sections text-classification dataset shipped as ``faast/data/debian_sections.tsv.gz``.

Each record is one Debian binary package: its one-line synopsis (the text) and its archive section (the label),
restricted to 16 topical sections. The input is a Debian ``Packages`` index (plain, .gz, .xz or .lz4), as found
under ``/var/lib/apt/lists/`` on any Debian machine. Run once; the outputs are committed::

    python lab/benchmarks/data/make_debian_sections.py [PACKAGES] [--out python/faast/data/debian_sections.tsv.gz]

Everything is deterministic: the same index gives byte-identical outputs (gzip mtime is 0, rows are sorted, and
every selection is ordered by sha1 of a name, never by the order of the index or by a random generator).
"""

from __future__ import annotations

import argparse
import bz2
import glob
import gzip
import hashlib
import io
import lzma
import os
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_OUT = REPO_ROOT / "python" / "faast" / "data" / "debian_sections.tsv.gz"
DEFAULT_GLOB = "/var/lib/apt/lists/*_main_binary-amd64_Packages*"

# Section id -> title: the one definition is the package's, which reads the file this script writes (so this
# script needs faast installed, with its own dependencies, torch included).
from faast.classify.data import DEBIAN_SECTIONS as SECTIONS  # noqa: E402

CAP_PER_CLASS = 400
HEADER = ("split", "label", "package", "text")
_WS = re.compile(r"\s+")


@dataclass(frozen=True)
class Record:
    package: str
    source: str
    section: str
    synopsis: str


def read_index(path: Path) -> bytes:
    """Return the decompressed bytes of a Packages index, choosing the codec from the file name."""
    name = path.name
    if name.endswith(".gz"):
        return gzip.decompress(path.read_bytes())
    if name.endswith(".xz"):
        return lzma.decompress(path.read_bytes())
    if name.endswith(".bz2"):
        return bz2.decompress(path.read_bytes())
    if name.endswith(".lz4"):
        try:
            import lz4.frame
        except ImportError as exc:
            raise SystemExit(f"{path} is lz4-compressed: pip install lz4") from exc
        with lz4.frame.open(path, "rb") as f:
            return f.read()
    return path.read_bytes()


def iter_stanzas(text: str) -> Iterator[dict[str, str]]:
    """Yield each deb822 stanza as {field: value}; continuation lines are appended after a newline."""
    fields: dict[str, str] = {}
    last = None
    for line in io.StringIO(text):
        line = line.rstrip("\n")
        if not line.strip():
            if fields:
                yield fields
            fields, last = {}, None
        elif line[0] in " \t":
            if last is not None:
                fields[last] += "\n" + line.strip()
        else:
            key, _, value = line.partition(":")
            last = key.strip()
            fields[last] = value.strip()
    if fields:
        yield fields


def normalise(text: str) -> str:
    return _WS.sub(" ", text).strip().lower()


def sha1(name: str) -> str:
    return hashlib.sha1(name.encode("utf-8")).hexdigest()


def parse_records(text: str) -> tuple[list[Record], Counter]:
    """Keep binary packages of the 16 sections that are not transitional or dummy packages."""
    dropped: Counter = Counter()
    seen: set[str] = set()
    records = []
    for st in iter_stanzas(text):
        package = st.get("Package")
        section = st.get("Section", "")
        if "/" in section:
            # "contrib/games" and the like belong to other archive areas, not to main.
            area, _, section = section.partition("/")
            if area != "main":
                continue
        if not package or section not in SECTIONS:
            continue
        # Only the first line of Description is the synopsis; a full index may carry the long text after it.
        synopsis = _WS.sub(" ", st.get("Description", "").split("\n", 1)[0]).strip()
        if not synopsis:
            dropped["no synopsis"] += 1
            continue
        low = synopsis.lower()
        if "transitional" in low or "dummy package" in low:
            dropped["transitional or dummy"] += 1
            continue
        if package in seen:
            # An index lists a package once per version only in unusual mirrors; the first stanza wins.
            dropped["repeated package stanza"] += 1
            continue
        seen.add(package)
        source = st.get("Source", package).split("(", 1)[0].strip() or package
        records.append(Record(package, source, section, synopsis))
    return records, dropped


def deduplicate(records: list[Record], dropped: Counter) -> list[Record]:
    """One binary per source package, then one record per normalised synopsis.

    Sibling binaries of one source (foo, foo-data, foo-gtk) share words and often whole synopses; keeping one
    per source stops a support example from having a near-copy in the query set.
    """
    by_source: dict[str, list[Record]] = defaultdict(list)
    for rec in records:
        by_source[rec.source].append(rec)
    chosen = []
    for source in sorted(by_source):
        group = by_source[source]
        best = min(group, key=lambda r: (r.package != source, len(r.package), r.package))
        chosen.append(best)
        dropped["other binary of the same source"] += len(group) - 1
    kept, synopses = [], set()
    for rec in sorted(chosen, key=lambda r: (sha1(r.source), r.source)):
        key = normalise(rec.synopsis)
        if key in synopses:
            dropped["duplicate synopsis"] += 1
            continue
        synopses.add(key)
        kept.append(rec)
    return kept


def split_classes(records: list[Record], dropped: Counter) -> list[tuple[str, Record]]:
    """Cap each class at CAP_PER_CLASS and halve it into train/test, both in sha1(source) order."""
    by_label: dict[str, list[Record]] = defaultdict(list)
    for rec in records:
        by_label[rec.section].append(rec)
    rows = []
    for label in sorted(by_label):
        ordered = sorted(by_label[label], key=lambda r: (sha1(r.source), r.source))
        dropped["over the per-class cap"] += max(0, len(ordered) - CAP_PER_CLASS)
        ordered = ordered[:CAP_PER_CLASS]
        n_train = (len(ordered) + 1) // 2
        rows += [("train", rec) for rec in ordered[:n_train]]
        rows += [("test", rec) for rec in ordered[n_train:]]
    return rows


def write_tsv(rows: list[tuple[str, Record]], out: Path) -> bytes:
    lines = ["\t".join(HEADER)]
    for split, rec in sorted(rows, key=lambda sr: (sr[0], sr[1].section, sr[1].package)):
        fields = (split, rec.section, rec.package, rec.synopsis)
        if any(ch in f for f in fields for ch in "\t\r\n"):
            raise ValueError(f"field of {rec.package} contains a tab or newline")
        lines.append("\t".join(fields))
    payload = ("\n".join(lines) + "\n").encode("utf-8")
    # mtime=0 and no file name in the header keep the archive byte-identical across runs.
    data = gzip.compress(payload, compresslevel=9, mtime=0)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, out)
    return data


def release_info(index: Path, raw: bytes) -> dict[str, str]:
    """Date and listed checksum from the InRelease file that sits next to the index, if there is one."""
    info = {"sha256": hashlib.sha256(raw).hexdigest()}
    prefix, sep, _ = index.name.partition("_main_")
    if not sep:
        return info
    inrelease = index.with_name(prefix + "_InRelease")
    if not inrelease.is_file():
        return info
    text = inrelease.read_text(encoding="utf-8", errors="replace")
    date = re.search(r"^Date:\s*(.+)$", text, re.M)
    if date:
        info["date"] = date.group(1).strip()
    for field in ("Codename", "Suite", "Version"):
        found = re.search(rf"^{field}:\s*(.+)$", text, re.M)
        if found:
            info[field.lower()] = found.group(1).strip()
    listed = re.search(r"^ ([0-9a-f]{64})\s+\d+\s+main/binary-amd64/Packages$", text, re.M)
    if listed:
        info["listed"] = "yes" if listed.group(1) == info["sha256"] else "no"
    return info


def counts_table(rows: list[tuple[str, Record]]) -> tuple[str, dict[str, dict[str, int]]]:
    counts: dict[str, dict[str, int]] = {s: {"train": 0, "test": 0} for s in SECTIONS}
    for split, rec in rows:
        counts[rec.section][split] += 1
    lines = ["| label | title | train | test | total |", "|---|---|---:|---:|---:|"]
    for s in sorted(SECTIONS):
        c = counts[s]
        lines.append(f"| `{s}` | {SECTIONS[s]} | {c['train']} | {c['test']} | {c['train'] + c['test']} |")
    tr = sum(c["train"] for c in counts.values())
    te = sum(c["test"] for c in counts.values())
    lines.append(f"| **all** | | **{tr}** | **{te}** | **{tr + te}** |")
    return "\n".join(lines), counts


def write_card(
    path: Path, index: Path, info: dict[str, str], table: str, n_in: int, dropped: Counter, tsv: bytes
) -> None:
    date = info.get("date", "unknown (no InRelease file next to the index)")
    release = info.get("codename", "bookworm")
    if "suite" in info or "version" in info:
        # The suite alias moves (stable -> oldstable), so record what it was when the index was fetched.
        release += f" ({', '.join(info[k] for k in ('suite', 'version') if k in info)} at that date)"
    listed = {
        "yes": "it matches the `main/binary-amd64/Packages` entry of that InRelease file",
        "no": "it does NOT match the `main/binary-amd64/Packages` entry of that InRelease file",
    }.get(info.get("listed", ""), "no InRelease entry was available to check it against")
    drops = "\n".join(f"| {why} | {n} |" for why, n in sorted(dropped.items()))
    card = f"""# Debian sections: a small offline text-classification dataset

`debian_sections.tsv.gz` pairs the one-line synopsis of a Debian package (the text) with the archive section the
package is filed under (the label), for 16 topical sections. It is small, real, labelled, needs no download and
is used by faast's demo and by the few-shot benchmark of closed-form classifiers over frozen sentence embeddings.

## Provenance

- Source: Debian {release} `main`, amd64 binary `Packages` index
  (`{index.name}`).
- Release `Date:` from the matching InRelease file: {date}.
- sha256 of the uncompressed index: `{info["sha256"]}`;
  {listed}.
- {n_in} binary packages of the 16 sections remained after the transitional/dummy filter, before deduplication.
- sha256 of the generated `debian_sections.tsv.gz`: `{hashlib.sha256(tsv).hexdigest()}`.

Package synopses are package metadata: every Debian mirror redistributes them in its `Packages` indices, and
packages.debian.org publishes them. Only the package name, section and synopsis are kept here; no package contents.

## Format

Gzip-compressed UTF-8 TSV with header `split\\tlabel\\tpackage\\ttext`; rows sorted by split, label, package.
`label` is the section id (`hamradio`), `text` the synopsis with whitespace collapsed (no tabs or newlines).
`faast.classify.load_debian_sections(split)` loads one split; label ids follow the sorted section ids.

## Rules

1. Keep binary packages whose `Section` is one of the 16 below, dropping transitional and dummy packages
   (synopsis contains "transitional" or "dummy package", case-insensitive).
2. Keep one binary package per source package (`Source`, version stripped; the package itself when absent):
   the binary whose name equals the source name, else the shortest name, ties broken alphabetically.
   Sibling binaries share synopses and vocabulary, so this keeps near-copies out of opposite splits.
3. Visit the survivors in sha1(source name) order and drop any whose normalised synopsis (lower-case,
   whitespace collapsed) was already kept, across all classes.
4. Per class, order by sha1(source name), keep the first {CAP_PER_CLASS}, and give the first half to `train` and
   the rest to `test` (an odd count gives the extra record to `train`).

Hence no package, source package or normalised synopsis appears in both splits.

| dropped | records |
|---|---:|
{drops}

## Counts

{table}

## Regenerate

```
pip install lz4
python lab/benchmarks/data/make_debian_sections.py /var/lib/apt/lists/{index.name}
```

Run from the repository root on a Debian bookworm machine (the index lives under `/var/lib/apt/lists/` after
`apt-get update`). With no argument the script takes the single index matching
`{DEFAULT_GLOB}`. The same index gives byte-identical outputs.
"""
    path.write_text(card, encoding="utf-8")


def find_default_index() -> Path:
    matches = sorted(p for p in glob.glob(DEFAULT_GLOB) if not p.endswith((".diff_Index", ".tmp")))
    if not matches:
        raise SystemExit(f"no Packages index matches {DEFAULT_GLOB}; pass its path")
    if len(matches) > 1:
        raise SystemExit("several Packages indices match; pass one of:\n  " + "\n  ".join(matches))
    return Path(matches[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("packages", nargs="?", type=Path, help=f"Packages index (default: {DEFAULT_GLOB})")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output .tsv.gz (data card written beside)")
    args = parser.parse_args(argv)
    index = args.packages or find_default_index()
    raw = read_index(index)
    records, dropped = parse_records(raw.decode("utf-8"))
    n_in = len(records)
    rows = split_classes(deduplicate(records, dropped), dropped)
    missing = sorted(set(SECTIONS) - {rec.section for _, rec in rows})
    if missing:
        raise SystemExit(f"sections with no records: {missing}")
    tsv = write_tsv(rows, args.out)
    table, counts = counts_table(rows)
    card = args.out.with_name(args.out.name.removesuffix(".tsv.gz") + ".md")
    write_card(card, index, release_info(index, raw), table, n_in, dropped, tsv)
    print(table)
    print(f"wrote {args.out} ({len(tsv)} bytes) and {card}", file=sys.stderr)
    small = [s for s, c in counts.items() if min(c["train"], c["test"]) < 40]
    if small:
        print(f"warning: fewer than 40 records in a split for {small}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
