"""lab/benchmarks/data/make_debian_sections.py, the builder of faast's Debian-sections data set: it takes the 16
sections from the package, so that the data and the package cannot disagree."""

import runpy
from pathlib import Path

from faast.classify.data import DEBIAN_SECTIONS

BUILDER = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "make_debian_sections.py"


def test_the_builder_uses_the_package_section_table():
    builder = runpy.run_path(str(BUILDER), run_name="make_debian_sections")  # defines, does not run main()
    assert builder["SECTIONS"] is DEBIAN_SECTIONS
