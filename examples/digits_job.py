"""The demo's digits job, data-parallel over two workers tagged ``dp``.

Submit it to a coordinator (``docker compose up`` runs it as the ``job`` service)::

    somatize submit examples/digits_job.py --coordinator ws://COORDINATOR:8765

``somatize submit`` runs this file and sends its ``graph``, ``x``, ``y`` and ``strategy``.
"""

import somatize
from somatize.cli.demo import digits_graph, load_digits

data = load_digits()

graph = digits_graph(epochs=3)
x = data.x_train
y = data.y_train
strategy = somatize.DataParallel(workers=2, tag="dp")
