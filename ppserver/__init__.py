"""ppserver: a long-running data postprocessing service on ZeroMQ."""
