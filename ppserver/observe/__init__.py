"""What the server tells about itself: stage timings, rolling rates and ETA, its status (typed,
turned into the wire dict in status.py), progress log lines and the Prometheus endpoint. Runs in
the server process; never blocks its loop."""
