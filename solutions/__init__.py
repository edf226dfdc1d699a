"""The reference solutions, one module per kata; ``python -m solutions.kNN_topic`` runs its program.

Typed with a Python that is not the project's environment, it says how to get in, as ``dojo``
does, instead of a traceback at ``import torch``.
"""

from dojo.commands import require

require("torch")
