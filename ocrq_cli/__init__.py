"""The ``ocrq`` command line: the one layer above both sides.

It imports ``ocrq`` (the shared contract), ``producer`` (submit, status, results) and ``worker``
(``ocrq worker``, ``ocrq model``); neither side nor ``ocrq`` imports it. ``python -m ocrq_cli``
is the same command as the ``ocrq`` console script.
"""
