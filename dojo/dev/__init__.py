"""Maintainers only."""
