"""Golden model fixture generator, split out of tools/make_fixtures.py (the entry point)."""
