"""The embedded stack ``ocrq up`` and ``ocrq down`` run on one host: local Redis servers (one,
or an HA set with Sentinels), one worker per GPU, Flower and the API. Only the command line (and
the benchmarks and tests that start the same stack) use it; workers are started as processes
(``python -m ocrq_cli worker``), never imported from here."""
