"""Registers the ``corpus`` marker (the per-field diagnosis checks of tests/diagnosis/test_corpus.py)."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "corpus: per-field checks of nanreplay's diagnosis against a corpus case's EXPECTED (select with -m corpus)",
    )
