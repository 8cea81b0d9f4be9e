"""Applications built on the pdjax library: the training loop and its datasets, the
benchmarks (in-process, and 2 workers on an emulated cluster), the emulated network, plots,
and the command line. A library user imports :mod:`pdjax.pipeline`, :mod:`pdjax.partition`
and :mod:`pdjax.profile`; nothing in the library imports from here."""
