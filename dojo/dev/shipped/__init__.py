"""The stubs made from ``solutions/``, one module per kata: the stubs as they ship.

The gate (``python -m dojo dev check``) writes them here before it lints them and runs every
spec against them (``DOJO_IMPL=dojo.dev.shipped``), whatever a learner holds in ``katas/``.
They are git-ignored and remade each time: to change a stub, change its reference's markers
(``dojo/curriculum/stubs.py`` says how).
"""
