"""The parts of ``benchmarks/tta.py`` (the script is the entry point; see its docstring):
the measured studies, the paper's figures, the simulated plans, Table 1 row by row and
the simulated page."""
