"""A job's state in Redis while it runs: the job index of per-image markers and exact counts
(``index``), its submissions fed to the queue in windows (``feed``), its failed registry
(``failed``), what it cost (``cost``), its progress between records (``progress``) and its
webhook outbox (``events``). Above the broker's scripts and the store."""
