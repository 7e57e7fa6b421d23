"""`python -m faast.hardware`: faast/hardware/report.py."""

from .report import main

main()
