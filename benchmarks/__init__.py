"""Speed measurements that are too slow or too machine-dependent for the test suite.

Typed with a Python that is not the project's environment (``python -m benchmarks.NAME``), any
benchmark says how to get in, as ``dojo`` does, instead of a traceback at ``import torch``.
"""

from dojo.commands import require

require("torch")
