"""The server process: its I/O loop (sockets; performs the scheduler's instructions), the
control requests it answers, the reader thread (the only caller of the dataset) and the
watch over the processes a local server belongs to."""
