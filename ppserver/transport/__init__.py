"""How bytes move between processes beyond plain ZeroMQ messages: reading another process's
memory (cma) and the CURVE key checks of the sockets that accept peers."""
