"""What the server tells about itself: stage timings, rolling rates and ETA, status fields,
progress log lines and the Prometheus endpoint. Runs in the server process; never blocks its loop."""
