"""The parts of ``benchmarks/gpu_check.py`` (the script is the entry point; see its
docstring for what the check measures): sizes and the GPT, placement, runners, the
throughput and roofline phases, progress logging and the report."""
