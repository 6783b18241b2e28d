import sys

from checkpointing.cli.app import main

sys.exit(main())
