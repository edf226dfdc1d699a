"""The reference solutions, one module per kata; ``python -m solutions.kNN_topic`` runs its program.

Typed with a Python that is not the project's environment, it says how to get in, as ``dojo``
does, instead of a traceback at ``import torch``. Under the maintainers' gate it notes which of
its functions each test reaches (``dojo.reach``: nothing unless ``DOJO_REACH_DIR`` is set).
"""

from dojo.commands import require

require("torch")

from dojo import reach  # noqa: E402  (after the check: it imports torch when asked)

reach.install()
