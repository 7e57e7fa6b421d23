"""The benchmarks of faast: each module is a script, run as `python -m faast_lab.benchmarks.<name>` (its docstring
gives its command lines); `_harness` holds their timing, memory and result-file helpers, `gpu_check` runs the GPU
ones in one command (scripts/gpu_check.sh). Results in lab/benchmarks/results."""
