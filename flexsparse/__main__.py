"""``python -m flexsparse``: the benchmark runner (``flexsparse.bench.cli``)."""
from .bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
