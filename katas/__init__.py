"""The learner's katas, one module each; ``python -m katas.kNN_topic`` runs a kata's program.

Typed with a Python that is not the project's environment, it says how to get in, as ``dojo``
does, instead of a traceback at ``import torch``.
"""

from dojo.commands import require

require("torch")
