"""The reference solutions, one module per kata; ``python -m solutions.kNN_topic`` runs its program.

Typed with a Python that is not the project's environment, it says how to get in, as ``dojo``
does, instead of a traceback at ``import torch``. A process the reference starts on its
own (k01-k03's spawned ranks) starts the maintainers' instruments too, when a run names them
(``dojo.harness.impl``: nothing unless ``DOJO_INSTRUMENTS`` is set).
"""

from dojo.commands import require

require("torch")

from dojo.harness import impl  # noqa: E402  (after the check: it may import torch)

impl.start()
