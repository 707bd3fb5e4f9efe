"""``python -m worker.daemon``: the filter daemon process (:func:`worker.daemon.main.main`)."""

from worker.daemon.main import main

main()
