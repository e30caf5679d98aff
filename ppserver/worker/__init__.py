"""The worker process: registers with a server, maps the seqs it is sent, sends the results
(straight to their clients where it can). It never opens the dataset. Also the pool of worker
processes a server or a `ppserver worker` host starts and supervises."""
