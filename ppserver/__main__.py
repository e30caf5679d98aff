import sys

from ppserver.cli import main

sys.exit(main())
