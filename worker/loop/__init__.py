"""The engine loop: micro-batches formed from many chunk tasks' images, one engine thread, and
what it does on device out-of-memory. It asks the governor (``worker.governor``) what to run."""
