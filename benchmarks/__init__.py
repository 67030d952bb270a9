"""Side-by-side measurements of lightning_opt against its baselines and peers: one result schema
(:mod:`benchmarks._results`), one docs generator (``python -m benchmarks.make_docs``). Run a benchmark as
``python -m benchmarks.<name>`` from the repository root."""
