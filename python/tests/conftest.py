"""conftest.py - fixtures of the exl package's tests: the shared test material (EXL_SHARED, else ../shared beside
the repository) and one model loaded per session."""
import os

import pytest

import exl

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SHARED = os.environ.get("EXL_SHARED") or os.path.join(os.path.dirname(ROOT), "shared")


@pytest.fixture(scope="session")
def shared():
    if not os.path.isdir(os.path.join(SHARED, "models")):
        pytest.fail(f"the shared fixtures are not at {SHARED}: set EXL_SHARED")
    return SHARED


@pytest.fixture(scope="session")
def model(shared):
    m = exl.Model(os.path.join(shared, "models", "tinystories-656k"), device="cpu", threads=1)
    yield m
    m.close()
