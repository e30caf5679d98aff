"""`python -m ppserver.worker CONFIG --connect ADDR`: one worker process (the server and
`ppserver worker` start it so)."""

import sys

from ppserver.worker.main import main

sys.exit(main())
