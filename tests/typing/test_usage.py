"""The typed usage file (``tests/typing/usage.py``, checked by ``mypy --strict``) also runs."""
from tests.typing import usage


def test_typed_usage_runs() -> None:
    usage.main()
