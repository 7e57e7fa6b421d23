"""The multi-domain benchmark's text: five local domains of different kinds, readable offline on a Debian-like machine.

Each domain is a sorted list of files split by file: every 4th file is held out (scored), the rest are learned, so
no held-out text was seen while learning. Where the every-4th files hold under 40K characters (tkinter), the last
learn files move to the held-out side, whole, until they do. Exact duplicate files are dropped first (many copyright
files are the same GPL text; a held-out copy of a learned file would measure copying, not learning). None of these
was used to train or choose the shipped readout (that used /usr/share/doc/**/*.md, package METADATA and
/usr/include/*.h, validated on the stdlib package `email`).

    asyncio     Python source of the stdlib package asyncio (the demo's domain)
    tkinter     Python source of the stdlib package tkinter
    perl        Perl modules (code and POD) under /usr/share/perl/<version>
    man         roff sources of the English section 1 manual pages (/usr/share/man/man1/*.gz)
    copyright   Debian copyright files (/usr/share/doc/*/copyright): licence texts and file-by-file notices

VALIDATION names the domains on which FAAST's settings are chosen and which take no part in the benchmark: `email`
and `multiprocessing` (stdlib packages) and `licenses` (/usr/share/common-licenses).

EXTRA names two domains that are neither: chosen after FAAST's settings and the benchmark were fixed, to test that the
defaults carry to text nobody tuned on.

    changelog   Debian changelogs (/usr/share/doc/*/changelog.Debian.gz): release notes in short prose entries;
                chosen after the settings, to test that the defaults carry to text nobody tuned on
    info        GNU info manuals (/usr/share/info/*.gz, the `dir` index skipped): long technical prose;
                chosen after the settings, to test that the defaults carry to text nobody tuned on
"""

from __future__ import annotations

import gzip
import hashlib
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

DOMAINS = ("asyncio", "tkinter", "perl", "man", "copyright")


def _stdlib(package: str) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"]) / package
    return sorted(p for p in root.rglob("*.py") if "test" not in p.relative_to(root).parts[0].lower())


def _perl() -> list[Path]:
    roots = sorted(Path("/usr/share/perl").glob("5.*"))
    return sorted(p for p in roots[-1].rglob("*.pm")) if roots else []


def _man() -> list[Path]:
    return sorted(Path("/usr/share/man/man1").glob("*.gz"))


def _copyright() -> list[Path]:
    return sorted(Path("/usr/share/doc").glob("*/copyright"))


def _changelog() -> list[Path]:
    return sorted(Path("/usr/share/doc").glob("*/changelog.Debian.gz"))


def _info() -> list[Path]:
    # `dir` (plain or gzipped) is the index of the installed manuals, not a manual.
    return sorted(p for p in Path("/usr/share/info").glob("*.gz") if p.name.split(".")[0] != "dir")


FILES: dict[str, Callable[[], list[Path]]] = {
    "asyncio": lambda: _stdlib("asyncio"),
    "tkinter": lambda: _stdlib("tkinter"),
    "perl": _perl,
    "man": _man,
    "copyright": _copyright,
    "email": lambda: _stdlib("email"),
    "multiprocessing": lambda: _stdlib("multiprocessing"),
    "licenses": lambda: sorted(p for p in Path("/usr/share/common-licenses").iterdir() if p.is_file()),
    "changelog": _changelog,
    "info": _info,
}
VALIDATION = ("email", "multiprocessing", "licenses")
# Neither benchmark nor validation: chosen after the settings, to test that the defaults carry to text nobody tuned on.
EXTRA = ("changelog", "info")


def read(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


def unique_texts(paths: Iterable[Path]) -> Iterator[str]:
    """Each readable, non-empty file's text (`read`), in order, exact duplicates skipped."""
    seen = set()
    for path in paths:
        try:
            text = read(path)
        except (OSError, EOFError):
            continue
        digest = hashlib.sha256(text.encode()).hexdigest()
        if text.strip() and digest not in seen:
            seen.add(digest)
            yield text


def domain_texts(
    name: str, min_files: int = 8, min_held_out_chars: int = 40_000, min_learn_chars: int = 200_000
) -> tuple[list[str], list[str]]:
    """(learn texts, held-out texts) of a domain: unique non-empty files, every 4th held out (then, if they hold
    fewer than min_held_out_chars characters, the last learn files too, as long as min_learn_chars remain)."""
    if name not in FILES:
        raise ValueError(f"name: expected one of {(*DOMAINS, *EXTRA, *VALIDATION)}, got {name!r}")
    texts = list(unique_texts(FILES[name]()))
    if len(texts) < min_files:
        raise SystemExit(f"domain {name!r}: found {len(texts)} usable files on this machine, need >= {min_files}")
    held_out = texts[3::4]
    learn = [t for i, t in enumerate(texts) if i % 4 != 3]
    # A domain of few, unevenly sized files can leave too little held-out text to score (tkinter: one 170 KB module
    # and thirteen small ones; its every-4th files hold ~7K tokens): the learn list's last files move over, whole,
    # until the held-out files reach min_held_out_chars (~10K tokens of code) or the learned text would drop below
    # min_learn_chars.
    while sum(map(len, held_out)) < min_held_out_chars and sum(map(len, learn[:-1])) >= min_learn_chars:
        held_out.append(learn.pop())
    return learn, held_out
