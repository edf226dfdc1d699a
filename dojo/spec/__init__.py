"""The pytest side."""
