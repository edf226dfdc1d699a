# Loads the dojo's pytest plugin (options --solutions and --expect-todo, the `kata` and
# `world` fixtures, "not implemented yet" reports). Nothing else belongs here.
pytest_plugins = ["dojo.plugin"]
