"""The suite's tiers (pyproject.toml's markers): `make test` runs every test marked neither `matrix` nor
`e2e`; `make test-e2e` the `e2e` ones (each capability's whole flow as a user runs it); `make
test-matrix` the `matrix` ones (further parameter values of a code path a kept test already runs); CI
all three. The batches below know only "core" and "matrix": no `e2e` test reads one.

A module that runs its parametrized cases as one batch (one set of gloo processes for all) marks its
matrix cases with `cases(...)` and builds its batch from `wanted(...)` cases only, so a tier that
leaves the matrix out does not pay for training its plans. Each module's MATRIX dict says, for each
case it marks, which kept case covers its code path.
"""

from __future__ import annotations

import pytest

# The tiers this pytest session runs ("core", "matrix"), set by conftest.py once collection is done;
# None until then (a batch built outside a pytest session: every case).
SELECTED: set[str] | None = None


def cases(names, matrix: dict, ids=None) -> list:
    """`names` as parametrize values, the ones in `matrix` marked `matrix` (same ids as unmarked)."""
    names = list(names)
    ids = list(ids) if ids is not None else [str(n) for n in names]
    return [pytest.param(*(n if isinstance(n, tuple) else (n,)), id=i,
                         marks=[pytest.mark.matrix] if n in matrix else []) for n, i in zip(names, ids)]


def wanted(name, matrix: dict) -> bool:
    """Whether a batch should run this case: its tier is one this session runs."""
    return SELECTED is None or ("matrix" if name in matrix else "core") in SELECTED
