"""The experiments of faast: each module is a script, run as `python -m faast_lab.experiments.<name>` (its docstring
gives its command lines). Shared code: `_common` (model loading, result files), `domains` (the benchmark's texts),
`lm_baselines` (the peers FAAST is compared with). Data in lab/experiments/data, results in lab/experiments/results."""
