"""``python -m benchmarks``: print the benchmark table (see benchmarks/table.py)."""
import sys

from .table import main

sys.exit(main())
