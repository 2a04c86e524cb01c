"""How the suite runs: the files scripts/test.sh gives one worker as one unit are exactly the
files holding Ray tests (a Ray file elsewhere could start a second local cluster beside the
first, which joins it)."""

from pathlib import Path

from conftest import RAY_FILES

TESTS = Path(__file__).resolve().parent


def test_the_ray_unit_is_the_files_with_ray_tests():
    found = {f"tests/{p.name}" for p in TESTS.glob("test_*.py")
             if "pytest.mark.ray" in p.read_text() and p.name != Path(__file__).name}
    assert found == RAY_FILES
