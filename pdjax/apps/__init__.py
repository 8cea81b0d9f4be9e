"""Applications built on the pdjax library: the training loop and its datasets, the
in-process benchmark (``pdjax bench``), plots, and the command line. A library user imports
:mod:`pdjax.pipeline`, :mod:`pdjax.partition` and :mod:`pdjax.profile`; nothing in the
library imports from here. (The cluster benchmarks and the emulated network they run on are
the repository's ``benchmarks/harness/``, not part of the installed package.)"""
