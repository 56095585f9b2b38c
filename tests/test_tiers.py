"""The suite's tiers as the Makefile selects them: every test runs in exactly one of `make test`,
`make test-e2e` and `make test-matrix`, whatever tier markers it carries, so CI (.ci/run, all three)
runs each test once and `make test-all` is their sum."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIER_MARKERS = ("e2e", "matrix")
TIERS = ("test", "test-e2e", "test-matrix")  # the make targets CI runs, in its order
# ... and then the loss-parity modules again under other CPU kernel sets (a subset of `make test`'s tests)
CI_TARGETS = (*TIERS, "test-kernels")


def marker_expressions() -> dict[str, str]:
    """make target -> its pytest `-m` expression, read from the Makefile."""
    found = re.findall(r'^(test[\w-]*): .*\n\t.* -m (?:"([^"]+)"|(\w+))', (ROOT / "Makefile").read_text(), re.M)
    return {target: quoted or bare for target, quoted, bare in found}


def selects(expression: str, markers: set[str]) -> bool:
    """pytest's -m semantics for an expression of marker names, and, or, not and parentheses."""
    assert re.fullmatch(r"[\w\s()]+", expression), expression
    names = {word for word in re.findall(r"\w+", expression) if word not in ("and", "or", "not")}
    return eval(expression, {}, {name: name in markers for name in names})  # booleans only (checked above)


def test_ci_runs_every_tier_and_pyproject_declares_their_markers():
    ci = (ROOT / ".ci" / "run").read_text()
    assert [line for line in ci.splitlines() if line.startswith("make ")] == [f"make {t}" for t in CI_TARGETS]
    declared = (ROOT / "pyproject.toml").read_text()
    for marker in TIER_MARKERS:
        assert re.search(rf'^\s*"{marker}: ', declared, re.M), marker


# Every set of tier markers a test can carry, and the one tier that runs it (a matrix case of an e2e
# test, such as test_newcomer's full fine-tune, is matrix).
@pytest.mark.parametrize("markers,tier", [(set(), "test"), ({"e2e"}, "test-e2e"), ({"matrix"}, "test-matrix"),
                                          ({"e2e", "matrix"}, "test-matrix")])
def test_each_set_of_tier_markers_runs_in_exactly_one_tier(markers, tier):
    expressions = marker_expressions()
    assert [t for t in TIERS if selects(expressions[t], markers)] == [tier]


def test_the_kernel_runs_repeat_only_tests_that_make_test_runs():
    """`make test-kernels` runs a subset of `make test` (its modules, its marker expression) under other
    CPU kernel sets, each with an Inductor cache of its own, and every module it names exists."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^test-kernels: .*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert re.search(r'-m "([^"]+)"', recipe).group(1) == marker_expressions()["test"]
    assert "for cap in avx2:AVX2 default:COMPATIBLE;" in recipe and "|| exit 1" in recipe
    assert "ATEN_CPU_CAPABILITY=$${cap%%:*} MKL_CBWR=$${cap##*:}" in recipe
    # torch.compile's CPU kernels cached under one instruction set gave NaN under another: a cache per set
    assert "TORCHINDUCTOR_CACHE_DIR=$${TMPDIR:-/tmp}/paratune-inductor-$${cap%%:*}" in recipe
    modules = re.search(r"^KERNEL_MODULES = ((?:.*\\\n)*.*)$", makefile, re.M).group(1).replace("\\", " ").split()
    assert modules and all((ROOT / m).is_file() for m in modules)
