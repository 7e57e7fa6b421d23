"""The broad domain suite (issue 74): 25 text domains of 9 kinds, read offline on a Debian-like machine, fixed by a
committed manifest (lab/experiments/suite_manifest.json) of each domain's files and their hashes.

    python -m faast_lab.experiments.suite            # list the suite: domains, kinds, learned / held-out size
    python -m faast_lab.experiments.suite --check    # do this machine's files still match the manifest?
    python -m faast_lab.experiments.suite --write    # choose the files anew (once; refuses to overwrite)

A domain is a kind label and a sorted list of files under one root, split by file: every 4th file is held out
(scored), the rest are learned, so no held-out text was seen while learning. Exact duplicates are dropped (many
copyright files are the same GPL text; a held-out copy of a learned file would measure copying, not learning). The
files were chosen once (`--write`): the sorted matches of the domain's patterns, in order, until the learned side
holds MIN_LEARN_TOKENS and the held-out side MIN_HELD_TOKENS of SmolLM2's tokens, measured with its tokenizer. The
manifest keeps those files (paths relative to the root) and two hashes: sha256 of the sorted relative paths, and
sha256 of the paths with their contents' hashes. Results record them; `check_suite` reads the files again and names
the domain (and the missing files) whose files changed, so a run never measures other text under the same name.

Kinds group text that shares its language and form: Python source (stdlib packages and third-party packages of the
environment's site-packages alike), Perl modules, roff man pages (sections 1, 3, 5, 7, 8), GNU info manuals, legal
text (/usr/share/common-licenses and Debian copyright files: the same licences), Debian changelogs, Markdown under
/usr/share/doc, bash-completion scripts and glibc locale sources. Settings for a domain are chosen without any domain
of its kind (faast_lab.experiments.loko): a kind split more finely would let near-identical text choose them.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import sysconfig
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from faast_lab.experiments.domains import read

MANIFEST = Path(__file__).resolve().parent / "suite_manifest.json"
# The benchmark learns 32,768 tokens and scores 8,192: the margins cover texts under two tokens (token_lists skips
# them) and the first token of each 1,024-token scoring window, which is never scored.
MIN_LEARN_TOKENS = 32_768 + 4_096
MIN_HELD_TOKENS = 8_192 + 1_024
# Every 4th file is held out, as lab/experiments/domains.py splits.
HELD_OUT_EVERY = 4


def default_bases() -> dict[str, Path]:
    """The roots the domains' paths start from on this machine: the stdlib, the running environment's site-packages,
    /usr/share."""
    paths = sysconfig.get_paths()
    return {"stdlib": Path(paths["stdlib"]), "site": Path(paths["purelib"]), "share": Path("/usr/share")}


@dataclass(frozen=True)
class Source:
    """Where a domain's files come from: `root` names a base ("{stdlib}/asyncio"); `patterns` are globs relative to
    it, `skip` fnmatch patterns of relative paths left out."""

    name: str
    kind: str
    root: str
    patterns: tuple[str, ...]
    skip: tuple[str, ...] = ()
    description: str = ""


# tkinter (in domains.py's benchmark) is not here: its every-4th files hold 28K characters, under MIN_HELD_TOKENS.
_PY_TESTS = ("*test*/*",)  # test packages are not the library's own code (as domains.py's stdlib rule)
SOURCES: tuple[Source, ...] = (
    Source("asyncio", "python", "{stdlib}/asyncio", ("**/*.py",), _PY_TESTS, "stdlib package asyncio"),
    Source("xml", "python", "{stdlib}/xml", ("**/*.py",), _PY_TESTS, "stdlib package xml"),
    Source("email", "python", "{stdlib}/email", ("**/*.py",), _PY_TESTS, "stdlib package email"),
    Source("multiprocessing", "python", "{stdlib}/multiprocessing", ("**/*.py",), _PY_TESTS, "stdlib multiprocessing"),
    Source("idlelib", "python", "{stdlib}/idlelib", ("**/*.py",), _PY_TESTS, "stdlib package idlelib (IDLE)"),
    Source("numpy", "python", "{site}/numpy", ("**/*.py",), _PY_TESTS, "numpy in the environment's site-packages"),
    Source("pip", "python", "{site}/pip/_internal", ("**/*.py",), _PY_TESTS, "pip's own code (its _vendor left out)"),
    Source("perl-core", "perl", "{share}/perl/5.36", ("**/*.pm",), (), "Perl's core modules (code and POD)"),
    Source("perl-vendor", "perl", "{share}/perl5", ("**/*.pm",), (), "Debian's Perl modules (Dpkg, Debconf, ...)"),
    Source("man1", "man", "{share}/man/man1", ("*.gz",), (), "roff manual pages, section 1 (commands)"),
    # Section 3 proper (C library functions): the 3pm/3perl pages are the Perl modules' own POD, the perl kind's text.
    Source("man3", "man", "{share}/man/man3", ("*.3.gz",), (), "section 3 (C library functions)"),
    Source("man5", "man", "{share}/man/man5", ("*.gz",), (), "section 5 (file formats)"),
    # Lowercase names: the capitalised pages are PostgreSQL's SQL commands, generated from one template.
    Source("man7", "man", "{share}/man/man7", ("[a-z]*.7.gz",), (), "section 7 (overviews)"),
    Source("man8", "man", "{share}/man/man8", ("*.gz",), (), "section 8 (administration)"),
    Source("info-a-f", "info", "{share}/info", ("[a-f]*.gz",), (), "GNU info manuals a-f"),
    Source("info-g-z", "info", "{share}/info", ("[g-z]*.gz",), (), "GNU info manuals g-z"),
    Source("licenses", "legal", "{share}/common-licenses", ("*",), (), "/usr/share/common-licenses"),
    Source("copyright", "legal", "{share}/doc", ("*/copyright",), (), "Debian copyright files"),
    Source("changelog-a-l", "changelog", "{share}/doc", ("[a-l]*/changelog.Debian.gz",), (), "packages a-l"),
    Source("changelog-m-z", "changelog", "{share}/doc", ("[m-z]*/changelog.Debian.gz",), (), "packages m-z"),
    Source("markdown-a-l", "markdown", "{share}/doc", ("[a-l]*/**/*.md", "[a-l]*/**/*.md.gz"), (), "packages a-l"),
    Source("markdown-m-z", "markdown", "{share}/doc", ("[m-z]*/**/*.md", "[m-z]*/**/*.md.gz"), (), "packages m-z"),
    Source("bash-completion", "bash", "{share}/bash-completion/completions", ("*",), (), "bash-completion scripts"),
    Source("locales", "locale", "{share}/i18n/locales", ("*_*",), ("translit_*",), "glibc locale definitions"),
    Source("translit", "locale", "{share}/i18n/locales", ("translit_*",), (), "glibc transliteration tables"),
)


class SuiteChanged(RuntimeError):
    """This machine's files of a suite domain are not the ones its manifest records."""


def resolve(root: str, bases: Mapping[str, Path] | None = None) -> Path:
    """A root such as "{stdlib}/asyncio" on this machine (bases: default_bases())."""
    bases = default_bases() if bases is None else bases
    try:
        return Path(root.format(**{k: str(v) for k, v in bases.items()}))
    except KeyError as err:
        raise ValueError(f"root: {root!r} names a base not in {sorted(bases)}") from err


def candidates(source: Source, bases: Mapping[str, Path] | None = None) -> list[str]:
    """The source's files, as sorted paths relative to its root: files matching a pattern and no skip pattern."""
    root = resolve(source.root, bases)
    found = {p.relative_to(root).as_posix() for pattern in source.patterns for p in root.glob(pattern) if p.is_file()}
    return sorted(r for r in found if not any(fnmatch.fnmatch(r, s) for s in source.skip))


def split(items: Sequence) -> tuple[list, list]:
    """(learned, held out) of a domain's files or texts in order: every HELD_OUT_EVERY-th held out."""
    held = list(items[HELD_OUT_EVERY - 1 :: HELD_OUT_EVERY])
    learn = [x for i, x in enumerate(items) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    return learn, held


def hashes(root: Path, files: Sequence[str]) -> dict[str, str]:
    """{"paths_sha256": of the sorted relative paths, "contents_sha256": of each path with its bytes' sha256}."""
    ordered = sorted(files)
    contents = hashlib.sha256()
    for rel in ordered:
        contents.update(f"{rel}\0{hashlib.sha256((root / rel).read_bytes()).hexdigest()}\n".encode())
    return {"paths_sha256": hashlib.sha256("\n".join(ordered).encode()).hexdigest(),
            "contents_sha256": contents.hexdigest()}  # fmt: skip


def choose(
    source: Source,
    count_tokens: Callable[[str], int],
    bases: Mapping[str, Path] | None = None,
    min_learn_tokens: int = MIN_LEARN_TOKENS,
    min_held_tokens: int = MIN_HELD_TOKENS,
) -> dict:
    """The manifest entry of `source`: its sorted readable, non-empty, unique files in order until the learned side
    holds min_learn_tokens and the held-out side min_held_tokens (count_tokens(text) -> tokens), with their
    character and token counts and `hashes`. SystemExit when all its files hold less (the domain is not here)."""
    root = resolve(source.root, bases)
    files, seen = [], set()
    chars, tokens = [0, 0], [0, 0]  # (learned, held out)
    for rel in candidates(source, bases):
        try:
            text = read(root / rel)
        except (OSError, EOFError):
            continue
        digest = hashlib.sha256(text.encode()).hexdigest()
        if not text.strip() or digest in seen:
            continue
        seen.add(digest)
        side = 1 if len(files) % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else 0
        files.append(rel)
        chars[side] += len(text)
        tokens[side] += count_tokens(text)
        if tokens[0] >= min_learn_tokens and tokens[1] >= min_held_tokens:
            break
    else:
        raise SystemExit(
            f"domain {source.name!r}: {root} holds {tokens[0]:,} learn and {tokens[1]:,} held-out tokens"
            f" in {len(files)} usable files, need {min_learn_tokens:,} and {min_held_tokens:,}"
        )
    return {"name": source.name, "kind": source.kind, "root": source.root, "description": source.description,
            "files": files, "learn_chars": chars[0], "held_out_chars": chars[1], "learn_tokens": tokens[0],
            "held_out_tokens": tokens[1], **hashes(root, files)}  # fmt: skip


def load_manifest(path: Path = MANIFEST) -> dict:
    """The committed manifest: {"tokenizer", "domains": [entry of `choose`, ...], ...}."""
    if not path.is_file():
        raise FileNotFoundError(f"manifest: expected the suite's manifest at {path}")
    return json.loads(path.read_text(encoding="utf-8"))


def manifest_sha256(manifest: Mapping) -> str:
    """One hash of the whole suite (its domains' names, kinds, roots and hashes), for a result to record."""
    keys = ("name", "kind", "root", "paths_sha256", "contents_sha256")
    rows = [[d[k] for k in keys] for d in manifest["domains"]]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def entry(name: str, manifest: Mapping | None = None) -> dict:
    """The manifest entry of domain `name`."""
    manifest = load_manifest() if manifest is None else manifest
    found = next((d for d in manifest["domains"] if d["name"] == name), None)
    if found is None:
        raise ValueError(f"name: expected a suite domain, one of {[d['name'] for d in manifest['domains']]}, "
                         f"got {name!r}")  # fmt: skip
    return found


def check_domain(domain: Mapping, bases: Mapping[str, Path] | None = None) -> None:
    """SuiteChanged naming the domain (and any files gone) when its files on this machine differ from the manifest."""
    root = resolve(domain["root"], bases)
    missing = [rel for rel in domain["files"] if not (root / rel).is_file()]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise SuiteChanged(f"suite domain {domain['name']!r}: {len(missing)} of its files are not under {root}: "
                           f"{shown}")  # fmt: skip
    now = hashes(root, domain["files"])
    if now["paths_sha256"] != domain["paths_sha256"] or now["contents_sha256"] != domain["contents_sha256"]:
        raise SuiteChanged(f"suite domain {domain['name']!r}: the contents of its files under {root} changed since "
                           f"the manifest was written (contents sha256 {now['contents_sha256'][:12]}, manifest "
                           f"{domain['contents_sha256'][:12]}): its results would measure other text")  # fmt: skip


def check_suite(manifest: Mapping | None = None, bases: Mapping[str, Path] | None = None,
                names: Sequence[str] | None = None) -> None:  # fmt: skip
    """check_domain for every domain of the manifest (names: only these); the first that changed raises."""
    manifest = load_manifest() if manifest is None else manifest
    for name in [d["name"] for d in manifest["domains"]] if names is None else names:
        check_domain(entry(name, manifest), bases)


def domain_texts(
    name: str, manifest: Mapping | None = None, bases: Mapping[str, Path] | None = None
) -> tuple[list[str], list[str], dict]:
    """(learned texts, held-out texts, the domain's record: name, kind, root and hashes) of a suite domain, after
    check_domain: the texts are the manifest's files, split every HELD_OUT_EVERY-th."""
    domain = entry(name, manifest)
    check_domain(domain, bases)
    root = resolve(domain["root"], bases)
    learn, held = split([read(root / rel) for rel in domain["files"]])
    record = {k: domain[k] for k in ("name", "kind", "root", "paths_sha256", "contents_sha256")}
    return learn, held, record


def write_manifest(path: Path, domains: list[dict], tokenizer_name: str) -> None:
    """The manifest, written atomically."""
    import platform
    from importlib import metadata

    from faast.persist import write_text_atomic

    # The stdlib's and site-packages' domains are these versions' files: another environment fails check_suite.
    versions = {"python": platform.python_version(), **{p: metadata.version(p) for p in ("numpy", "pip")}}
    payload = {"about": "lab/experiments/suite.py: the fixed domain suite; do not edit by hand",
               "versions": versions, "tokenizer": tokenizer_name, "min_learn_tokens": MIN_LEARN_TOKENS,
               "min_held_tokens": MIN_HELD_TOKENS, "held_out_every": HELD_OUT_EVERY, "domains": domains}  # fmt: skip
    write_text_atomic(path, json.dumps(payload, indent=1) + "\n")


def listing(manifest: Mapping) -> list[str]:
    """The suite as a Markdown table: domain, kind, files, learned and held-out characters and tokens."""
    lines = ["| domain | kind | files | learn chars | held-out chars | learn tokens | held-out tokens |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for d in manifest["domains"]:
        lines.append(f"| {d['name']} | {d['kind']} | {len(d['files'])} | {d['learn_chars']:,} | "
                     f"{d['held_out_chars']:,} | {d['learn_tokens']:,} | {d['held_out_tokens']:,} |")  # fmt: skip
    kinds = sorted({d["kind"] for d in manifest["domains"]})
    return [*lines, "", f"{len(manifest['domains'])} domains of {len(kinds)} kinds: {', '.join(kinds)}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 naming the first domain whose files changed")
    p.add_argument("--write", action="store_true", help="choose the files and write the manifest (SmolLM2's tokens)")
    p.add_argument("--manifest", type=Path, default=MANIFEST)
    p.add_argument("--force", action="store_true", help="with --write: overwrite an existing manifest")
    args = p.parse_args(argv)
    if args.write:
        if args.manifest.exists() and not args.force:
            raise SystemExit(f"--write: {args.manifest} exists; the suite is fixed once chosen (--force replaces it)")
        from transformers import AutoTokenizer

        from faast.hf.default import SMOLLM2_GGUF, SMOLLM2_NAME, smollm2_folder

        tokenizer = AutoTokenizer.from_pretrained(str(smollm2_folder()), gguf_file=SMOLLM2_GGUF)

        def count(text: str) -> int:
            n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            return n if n >= 2 else 0  # token_lists skips a text under two tokens

        domains = [choose(s, count) for s in SOURCES]
        write_manifest(args.manifest, domains, SMOLLM2_NAME)
    manifest = load_manifest(args.manifest)
    if args.check:
        try:
            check_suite(manifest)
        except SuiteChanged as err:
            print(err)
            return 1
        print(f"the suite's {len(manifest['domains'])} domains match {args.manifest.name}")
        return 0
    print("\n".join(listing(manifest)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
