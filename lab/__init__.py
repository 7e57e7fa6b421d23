"""faast-lab: the experiments (faast_lab.experiments) and benchmarks (faast_lab.benchmarks) of faast.

Not part of the library: the lab measures faast through its public API only (tests/test_structure.py checks it) and
is installed editable from the checkout (lab/pyproject.toml). Each script runs as a module, e.g.
`python -m faast_lab.experiments.lm_domains --help`; docs/testing.md ("The lab") says what is where.
"""
