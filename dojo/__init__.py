"""The dojo: tooling a learner never edits (rank harness, pytest plugin, curriculum, data)."""
