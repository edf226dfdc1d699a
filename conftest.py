# Loads the dojo's pytest plugin (options --solutions and --expect-todo, the `kata` and
# `world` fixtures, "not implemented yet" reports). First, a pytest from outside the project's
# environment (no torch, no pytest-timeout) stops with one line saying how to get in.
from dojo.commands import require

require("torch", "pytest_timeout")

pytest_plugins = ["dojo.spec.plugin"]
